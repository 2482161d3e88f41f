"""amqtt 0.12.1 client driver (MQTT 3.1.1 only)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from amqtt.client import MQTTClient
from common import args, b64, emit, ready, unb64


def uri(a: dict[str, Any]) -> str:
    creds = f"{a['username']}:{a['password']}@" if a.get("username") else ""
    scheme = "mqtts" if a.get("ca") else "mqtt"
    return f"{scheme}://{creds}{a['host']}:{a['port']}"


async def main(a: dict[str, Any]) -> None:
    config: dict[str, Any] = {"auto_reconnect": False, "keep_alive": 30}
    if a["action"] == "will":
        w = a["will"]
        config["will"] = {
            "topic": w["topic"],
            "message": unb64(w["payload"]).decode(),
            "qos": w["qos"],
            "retain": w["retain"],
        }
    client = MQTTClient(client_id=a["client_id"], config=config)
    try:
        async with asyncio.timeout(a["timeout"]):
            await client.connect(uri(a), cleansession=a.get("clean", True), cafile=a.get("ca"))
    except Exception as exc:  # ConnectError carries the CONNACK return code
        emit({"ok": False, "rc": f"{type(exc).__name__}: {exc}"})
        return
    if a["action"] == "will":
        emit({"ok": True})
        os._exit(0)  # drop the socket without DISCONNECT: the will must fire
    if a["action"] == "connect":
        emit({"ok": True})
    elif a["action"] == "publish":
        for m in a["messages"]:
            await client.publish(m["topic"], unb64(m["payload"]), m["qos"], m.get("retain", False))
        emit({"ok": True})
    elif a["action"] == "subscribe":
        if a["topics"]:
            await client.subscribe([(t, q) for t, q in a["topics"]])
        ready()
        got = []
        while len(got) < a["count"]:
            try:
                m = await client.deliver_message(timeout_duration=a["timeout"])
            except TimeoutError:
                break
            if m is None:
                break
            got.append(
                {
                    "topic": m.topic,
                    "payload": b64(bytes(m.data)),
                    "qos": m.qos,
                    "retain": bool(m.publish_packet.retain_flag),
                    "props": {},
                }
            )
        await asyncio.sleep(0.2)  # let the last acks go out before DISCONNECT
        emit({"ok": True, "messages": got})
    await client.disconnect()


if __name__ == "__main__":
    asyncio.run(main(args()))
