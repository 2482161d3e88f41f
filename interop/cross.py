"""Cross-protocol cells: one MQTT publisher x one AMQP consumer (and back), checking the
payload bytes and every mapped property of the mapping table (ARCHITECTURE.md)."""

from __future__ import annotations

from typing import Any

from registry import Client
from scenarios import PAYLOAD, Ctx, amqp_msg, b64, ensure, mqtt_msg, unb64

USER_PROPS = [["site", "north"], ["JMSXGroupId", "dev-7"], ["unit", "C"]]
MQTT_PROPS = {
    "user_properties": USER_PROPS,
    "correlation_data": b64(b"corr-42"),
    "response_topic": "replies/x",
    "content_type": "application/json",
}
APP_PROPS = {"site": "south", "unit": "F"}
AMQP_PROPS = {
    "correlation_id": "corr-7",
    "reply_to": "topic://replies/y",  # a topic: MQTT cannot reply to a queue
    "content_type": "text/plain",
    "group_id": "dev-9",
}


def mqtt_to_amqp(ctx: Ctx, pub: Client, sub: Client) -> str:
    topic = ctx.name(pub, "x")
    queue = ctx.queue(pub, "xq", [topic])
    props = MQTT_PROPS if pub.version == 5 else {}
    ctx.run(pub, "publish", messages=[mqtt_msg(topic, PAYLOAD, 1, props)])
    got = ctx.run(sub, "receive", address=queue, count=1)["messages"]
    ensure(len(got) == 1, f"{sub.name} received nothing")
    m = got[0]
    ensure(unb64(m["body"]) == PAYLOAD, f"payload {unb64(m['body'])!r} != {PAYLOAD!r}")
    if sub.name == "qpid-proton-c":
        return "payload exact (receive.c prints the body only: properties not visible)"
    ensure(m.get("body_kind") == "data", f"body section {m.get('body_kind')}, not data")
    want: dict[str, Any] = {}
    want_app: dict[str, str] = {}
    if pub.version == 5:
        want = {
            "correlation_id": {"binary": b64(b"corr-42")},
            "reply_to": "topic://replies/x",  # an address: a bare name is a queue
            "content_type": "application/json",
            "group_id": "dev-7",
        }
        want_app = {"site": "north", "unit": "C"}
    have = {k: v for k, v in m["properties"].items() if k in want or k in AMQP_PROPS}
    ensure(have == want, f"properties {have} != {want}")
    ensure(
        m["application_properties"] == want_app,
        f"application-properties {m['application_properties']} != {want_app}",
    )
    return "payload + properties exact" if want else "payload exact (MQTT 3.x: payload only)"


def amqp_to_mqtt(ctx: Ctx, pub: Client, sub: Client) -> str:
    topic = ctx.name(pub, "y")
    listener = ctx.start(sub, "subscribe", topics=[[topic, 1]], count=1)
    message = {**amqp_msg(PAYLOAD, **AMQP_PROPS), "application_properties": APP_PROPS}
    ctx.run(pub, "send", address="topic://" + topic, messages=[message])
    got = listener.result()["messages"]
    ensure(len(got) == 1, f"{sub.name} received nothing")
    m = got[0]
    ensure(unb64(m["payload"]) == PAYLOAD, f"payload {unb64(m['payload'])!r} != {PAYLOAD!r}")
    want: dict[str, Any] = {}
    if sub.version == 5:
        want = {
            "user_properties": [["site", "south"], ["unit", "F"]],
            "group": ["dev-9"],
            "correlation_data": b64(b"corr-7"),
            "response_topic": "replies/y",
            "content_type": "text/plain",
        }
    have = {k: v for k, v in m.get("props", {}).items() if k in MQTT_PROPS}
    if want:  # JMSXGroupId's place among the user properties is not specified
        users = have.get("user_properties", [])
        have["user_properties"] = [p for p in users if p[0] != "JMSXGroupId"]
        have["group"] = [p[1] for p in users if p[0] == "JMSXGroupId"]
    ensure(have == want, f"MQTT properties {have} != {want}")
    return "payload + properties exact" if want else "payload exact (MQTT 3.x: payload only)"
