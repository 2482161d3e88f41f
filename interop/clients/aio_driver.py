"""aiomqtt 2.x and asyncio-mqtt 0.16 driver (the same asyncio API shape, two packages)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import AsyncIterator
from typing import Any

from common import args, b64, emit, ready, unb64
from paho_props import props_json, publish_props, session_props

A = args()
if A["lib"] == "aiomqtt":
    import aiomqtt as lib
else:
    import asyncio_mqtt as lib  # type: ignore[no-redef]

VERSIONS = {5: lib.ProtocolVersion.V5, 4: lib.ProtocolVersion.V311, 3: lib.ProtocolVersion.V31}


def client(a: dict[str, Any], will: dict[str, Any] | None = None) -> Any:
    """A client for `a`; the two packages differ only in the client id keyword here."""
    kwargs: dict[str, Any] = {
        "username": a.get("username"),
        "password": a.get("password"),
        "protocol": VERSIONS[a["version"]],
        ("identifier" if a["lib"] == "aiomqtt" else "client_id"): a["client_id"],
    }
    if a["version"] == 5:
        kwargs["clean_start"] = a.get("clean", True)
        if not a.get("clean", True):
            kwargs["properties"] = session_props()
    else:
        kwargs["clean_session"] = a.get("clean", True)
    if a.get("ca"):
        kwargs["tls_context"] = ssl.create_default_context(cafile=a["ca"])
    if will:
        kwargs["will"] = lib.Will(
            will["topic"], unb64(will["payload"]), will["qos"], will["retain"]
        )
    return lib.Client(a["host"], a["port"], **kwargs)


async def messages(c: Any, stack: contextlib.AsyncExitStack) -> AsyncIterator[Any]:
    """The message stream, opened before CONNECT: asyncio-mqtt drops what a resumed session
    delivers before `unfiltered_messages()` is entered (aiomqtt 2 queues from the start)."""
    if A["lib"] == "aiomqtt":
        return c.messages
    return await stack.enter_async_context(c.unfiltered_messages())


def to_json(m: Any) -> dict[str, Any]:
    return {
        "topic": str(m.topic),
        "payload": b64(bytes(m.payload)),
        "qos": m.qos,
        "retain": bool(m.retain),
        "props": props_json(getattr(m, "properties", None)),
    }


async def subscribe(c: Any, stream: AsyncIterator[Any], a: dict[str, Any]) -> list[Any]:
    got: list[dict[str, Any]] = []
    for topic, qos in a["topics"]:
        await c.subscribe(topic, qos)
    ready()
    if a["count"] == 0:
        return got
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(a["timeout"]):
            async for m in stream:
                got.append(to_json(m))
                if len(got) >= a["count"]:
                    break
    await asyncio.sleep(0.2)  # let the last acks go out before DISCONNECT
    return got


async def main(a: dict[str, Any]) -> None:
    if a["action"] == "will":
        c = client(a, a["will"])
        await c.__aenter__()
        emit({"ok": True})
        os._exit(0)  # drop the socket without DISCONNECT: the will must fire
    async with contextlib.AsyncExitStack() as stack:
        c = client(a)
        stream = await messages(c, stack)
        try:
            async with asyncio.timeout(a["timeout"]):
                await stack.enter_async_context(c)
        except Exception as exc:  # refused CONNECT: MqttCodeError / MqttError
            emit({"ok": False, "rc": f"{type(exc).__name__}: {exc}"})
            return
        await act(c, stream, a)


async def act(c: Any, stream: AsyncIterator[Any], a: dict[str, Any]) -> None:
    if a["action"] == "connect":
        emit({"ok": True})
    elif a["action"] == "publish":
        for m in a["messages"]:
            await c.publish(
                m["topic"],
                unb64(m["payload"]),
                m["qos"],
                m.get("retain", False),
                properties=publish_props(m.get("props", {})),
            )
        emit({"ok": True})
    elif a["action"] == "subscribe":
        emit({"ok": True, "messages": await subscribe(c, stream, a)})


if __name__ == "__main__":
    asyncio.run(main(A))
