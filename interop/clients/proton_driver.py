"""Qpid Proton (Python, blocking API) driver: send, receive, connect, dynamic request."""

from __future__ import annotations

from typing import Any

from common import args, b64, emit, ready, unb64
from proton import Message, SSLDomain
from proton.reactor import AtMostOnce
from proton.utils import BlockingConnection

PROPS = ("correlation_id", "reply_to", "content_type", "group_id", "subject")


def connect(a: dict[str, Any]) -> BlockingConnection:
    kwargs: dict[str, Any] = {"timeout": a["timeout"]}
    scheme = "amqp"
    if a.get("ca"):  # proton matches DNS names only, hence server_name for 127.0.0.1
        scheme = "amqps"
        domain = SSLDomain(SSLDomain.MODE_CLIENT)
        domain.set_trusted_ca_db(a["ca"])
        domain.set_peer_authentication(SSLDomain.VERIFY_PEER_NAME)
        kwargs.update(ssl_domain=domain, virtual_host=a["server_name"])
    url = f"{scheme}://{a['host']}:{a['port']}"
    if a.get("username"):
        kwargs.update(
            user=a["username"],
            password=a["password"],
            allowed_mechs="PLAIN",
            allow_insecure_mechs=True,
        )
    return BlockingConnection(url, **kwargs)


def to_message(m: dict[str, Any]) -> Message:
    msg = Message(body=unb64(m["body"]), durable=m.get("durable", True))
    for key, value in m.get("properties", {}).items():
        setattr(msg, key, unb64(value["binary"]) if isinstance(value, dict) else value)
    if m.get("application_properties"):
        msg.properties = dict(m["application_properties"])
    return msg


def to_json(msg: Message) -> dict[str, Any]:
    body = msg.body
    kind = "data" if isinstance(body, bytes | memoryview) else type(body).__name__
    raw = bytes(body) if kind == "data" else str(body).encode()
    # proton reports an absent content-type as symbol('None')
    props: dict[str, Any] = {
        k: str(getattr(msg, k)) for k in PROPS if getattr(msg, k) not in (None, "None")
    }
    if isinstance(msg.correlation_id, bytes | memoryview):
        props["correlation_id"] = {"binary": b64(bytes(msg.correlation_id))}
    app = {str(k): v for k, v in (msg.properties or {}).items()}
    return {
        "body": b64(raw),
        "body_kind": kind,
        "properties": props,
        "application_properties": app,
        "durable": bool(msg.durable),
    }


def main() -> None:
    a = args()
    try:
        conn = connect(a)
    except Exception as exc:  # auth failures arrive as several proton exception types
        emit({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    try:
        run(a, conn)
    finally:
        conn.close()


def run(a: dict[str, Any], conn: BlockingConnection) -> None:
    action = a["action"]
    options = AtMostOnce() if a.get("settle") == "presettled" else None
    if action == "connect":
        emit({"ok": True})
    elif action == "send":
        sender = conn.create_sender(a["address"], options=options)
        for m in a["messages"]:
            sender.send(to_message(m), timeout=a["timeout"])
        emit({"ok": True})
    elif action == "receive":
        receiver = conn.create_receiver(a["address"], credit=a["count"], options=options)
        ready()
        out = []
        for _ in range(a["count"]):
            try:
                msg = receiver.receive(timeout=a["timeout"])
            except Exception:
                break
            out.append(to_json(msg))
            if options is None:
                receiver.accept()
        emit({"ok": True, "messages": out})
    elif action == "request":
        receiver = conn.create_receiver(None, dynamic=True)
        reply_to = receiver.remote_source.address
        sender = conn.create_sender(a["address"])
        msg = to_message(a["message"])
        msg.reply_to = reply_to
        sender.send(msg, timeout=a["timeout"])
        reply = receiver.receive(timeout=a["timeout"])
        receiver.accept()
        emit({"ok": True, "reply_to": reply_to, "reply": to_json(reply)})
    else:
        emit({"ok": False, "error": f"unknown action {action}"})


if __name__ == "__main__":
    main()
