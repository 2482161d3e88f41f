"""paho-mqtt 2.x driver (MQTT 5, 3.1.1 and 3.1) with the blocking network loop."""

from __future__ import annotations

import os
import queue
import time
from typing import Any

import paho.mqtt.client as mqtt
from common import args, b64, emit, ready, unb64
from paho.mqtt.enums import CallbackAPIVersion
from paho_props import props_json, publish_props, session_props

VERSIONS = {5: mqtt.MQTTv5, 4: mqtt.MQTTv311, 3: mqtt.MQTTv31}
GOT: queue.Queue[dict[str, Any]] = queue.Queue()


def on_message(c: mqtt.Client, u: Any, msg: mqtt.MQTTMessage) -> None:
    GOT.put(
        {
            "topic": msg.topic,
            "payload": b64(msg.payload),
            "qos": msg.qos,
            "retain": bool(msg.retain),
            "props": props_json(getattr(msg, "properties", None)),
        }
    )


def connect(a: dict[str, Any], will: dict[str, Any] | None = None) -> tuple[mqtt.Client, int]:
    """Connect and wait for CONNACK; returns the client and the reason code value."""
    v5 = a["version"] == 5
    kwargs: dict[str, Any] = {"protocol": VERSIONS[a["version"]]}
    if not v5:
        kwargs["clean_session"] = a.get("clean", True)
    client = mqtt.Client(CallbackAPIVersion.VERSION2, a["client_id"], **kwargs)
    if a.get("ca"):
        client.tls_set(ca_certs=a["ca"])
    if a.get("username"):
        client.username_pw_set(a["username"], a.get("password"))
    if will:
        client.will_set(will["topic"], unb64(will["payload"]), will["qos"], will["retain"])
    acked: queue.Queue[int] = queue.Queue()
    client.on_connect = lambda c, u, f, rc, p: acked.put(rc.value)
    client.on_message = on_message  # before CONNECT: a resumed session delivers at once
    extra: dict[str, Any] = {}
    if v5:
        extra["clean_start"] = a.get("clean", True)
        if not a.get("clean", True):
            extra["properties"] = session_props()
    client.connect(a["host"], a["port"], keepalive=30, **extra)
    client.loop_start()
    rc = acked.get(timeout=a["timeout"])
    return client, rc


def main() -> None:
    a = args()
    action = a["action"]
    if action == "will":
        client, rc = connect(a, a["will"])
        emit({"ok": rc == 0, "rc": rc})
        os._exit(0)  # drop the socket without DISCONNECT: the will must fire
    client, rc = connect(a)
    if rc != 0:
        client.loop_stop()
        emit({"ok": False, "rc": rc})
        return
    if action == "connect":
        emit({"ok": True, "rc": rc})
    elif action == "publish":
        for m in a["messages"]:
            info = client.publish(
                m["topic"],
                unb64(m["payload"]),
                m["qos"],
                m.get("retain", False),
                properties=publish_props(m.get("props", {})),
            )
            info.wait_for_publish(a["timeout"])
            if not info.is_published():
                emit({"ok": False, "error": f"no PUBACK / PUBCOMP for {m['topic']}"})
                break
        else:
            emit({"ok": True})
    elif action == "subscribe":
        subacked: queue.Queue[None] = queue.Queue()
        client.on_subscribe = lambda *_: subacked.put(None)
        for topic, qos in a["topics"]:
            client.subscribe(topic, qos)
            subacked.get(timeout=a["timeout"])
        ready()
        messages = []
        deadline = time.monotonic() + a["timeout"]
        while len(messages) < a["count"] and time.monotonic() < deadline:
            try:
                messages.append(GOT.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                break
        time.sleep(0.2)  # let the last PUBACK / PUBCOMP go out before DISCONNECT
        emit({"ok": True, "messages": messages})
    client.disconnect()
    client.loop_stop()


if __name__ == "__main__":
    main()
