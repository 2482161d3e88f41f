"""Interop scenarios: each drives one client (or a publisher/consumer pair) through the
gateway and raises `Fail` with what differed. Names and order here are the matrix columns.
"""

from __future__ import annotations

import base64
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import driver
from envs import Prepared
from gateway_proc import Gateway
from registry import CLIENTS, Client

TIMEOUT = 10.0
PAYLOAD = 'héllo → {"t": 21.5}'.encode()
_ids = itertools.count()


class Fail(Exception):
    """The scenario ran and the gateway or client did not do what the mapping promises."""


class Unsupported(Exception):
    """The client (or the gateway) cannot express this scenario."""


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def ensure(cond: bool, detail: str) -> None:
    if not cond:
        raise Fail(detail)


class Ctx:
    """What a scenario needs: the gateway, prepared environments, unique names."""

    def __init__(self, gw: Gateway, prepared: dict[str, Prepared], run_id: str) -> None:
        self.gw = gw
        self.prepared = prepared
        self.run_id = run_id

    def name(self, c: Client, what: str) -> str:
        """A topic / queue / client-id stem no other cell uses."""
        return f"it-{self.run_id}-{next(_ids)}-{c.name}-{what}"

    def start(
        self, c: Client, action: str, ready: bool = True, tls: bool = False, **kw: Any
    ) -> driver.Running:
        """Run a driver action; with `tls`, on the TLS port, verifying the run's certificate
        (`ca`; `server_name` for clients that check DNS names only)."""
        env = self.prepared[c.env]
        if env.unavailable:
            raise Unsupported(f"environment {c.env} unavailable from its registry: {env.error}")
        if env.error:
            raise Fail(f"environment {c.env} not prepared: {env.error}")
        port = self.gw.ports[f"{c.protocol}_{'tls_' if tls else ''}port"]
        if tls:
            kw.update(ca=str(self.gw.cert), server_name="localhost")
        args = {
            "action": action,
            "host": "127.0.0.1",
            "port": port,
            "timeout": TIMEOUT,
            "version": c.version,
            "client_id": self.name(c, action),
            **c.options,
            **kw,
        }
        running = driver.start(env.command, env.env, c.driver, args)
        if ready:
            running.wait_ready()
        return running

    def run(self, c: Client, action: str, tls: bool = False, **kw: Any) -> dict[str, Any]:
        out = self.start(c, action, ready=False, tls=tls, **kw).result()
        if action != "connect" and not out.get("ok"):
            raise Fail(f"{c.name} {action} failed: {out}")
        return out

    def queue(self, c: Client, what: str, subscriptions: list[str], **extra: Any) -> str:
        name = self.name(c, what)
        self.gw.create_queue(name, subscriptions, **extra)
        return name

    def depth(self, queue: str) -> int:
        """Messages left in `queue`, polled briefly: acks are batched per event-loop turn."""
        for _ in range(20):
            depth = self.gw.admin("GET", f"queues/{queue}")["messages"]
            if depth == 0:
                return 0
            time.sleep(0.1)
        return depth


def payloads(messages: list[dict[str, Any]], key: str = "payload") -> list[bytes]:
    return [unb64(m[key]) for m in messages]


# ---- both protocols -------------------------------------------------------------------


def auth_good(ctx: Ctx, c: Client) -> str:
    out = ctx.run(c, "connect", username="alice", password="s3cret")
    ensure(out.get("ok") is True, f"alice/s3cret refused: {out}")
    return "alice/s3cret accepted"


def auth_bad(ctx: Ctx, c: Client) -> str:
    out = ctx.run(c, "connect", username="alice", password="wrong")
    ensure(out.get("ok") is False, f"alice/wrong accepted: {out}")
    return f"alice/wrong refused ({out.get('rc', out.get('error'))})"


def queue_ack(ctx: Ctx, c: Client) -> str:
    bodies = [f"q{i}".encode() for i in range(3)]
    if c.protocol == "amqp":
        queue = ctx.queue(c, "q", [])
        if "cross_publish" in c.cannot:  # the client cannot send these payloads
            for body in bodies:
                ctx.gw.admin("POST", "messages", {"queue": queue, "payload": body.decode()})
            how = "filled through the admin API, consumed with accept"
        else:
            send_amqp(ctx, c, queue, bodies)
            how = "sent to the queue and consumed with accept"
        got = ctx.run(c, "receive", address=queue, count=3)["messages"]
        ensure(payloads(got, "body") == bodies, f"received {payloads(got, 'body')}")
    else:
        topic = ctx.name(c, "t")
        queue = ctx.queue(c, "q", [topic])
        ctx.run(c, "publish", messages=[mqtt_msg(topic, b, 1) for b in bodies])
        got = ctx.gw.admin(
            "POST", f"queues/{queue}/get", {"count": 3, "ackmode": "ack", "timeout_ms": 3000}
        )
        ensure(got_payloads(got) == bodies, f"queue held {got}")
        how = "QoS 1 publish spooled to the queue, consumed with ack via the admin API"
    left = ctx.depth(queue)
    ensure(left == 0, f"{left} messages left in the queue after the acks")
    return how


def got_payloads(got: Any) -> list[bytes]:
    """Payloads from an admin API get, whatever the list is called."""
    items = got["messages"] if isinstance(got, dict) else got
    out = []
    for m in items:
        if "payload_base64" in m:
            out.append(unb64(m["payload_base64"]))
        else:
            out.append(m["payload"].encode())
    return out


def partitioned(ctx: Ctx, c: Client, consumer: Client) -> str:
    keys = [f"g{k}" for k in range(4)]
    order = [(key, seq) for seq in range(3) for key in keys]
    if c.protocol == "amqp":
        queue = ctx.queue(c, "p", [], partition_count=4)
        messages = [amqp_msg(f"{k}:{s}".encode(), group_id=k) for k, s in order]
        ctx.run(c, "send", address=queue, messages=messages)
    else:
        topic = ctx.name(c, "t")
        queue = ctx.queue(c, "p", [f"{topic}/>"], partition_count=4)
        messages = [
            mqtt_msg(
                f"{topic}/{k}", f"{k}:{s}".encode(), 1, {"user_properties": [["JMSXGroupId", k]]}
            )
            for k, s in order
        ]
        ctx.run(c, "publish", messages=messages)
    got = ctx.run(consumer, "receive", address=queue, count=len(order))["messages"]
    ensure(len(got) == len(order), f"received {len(got)} of {len(order)}")
    per_key: dict[str, list[str]] = {}
    for m in got:
        key, seq = unb64(m["body"]).decode().split(":")
        ensure(m["properties"].get("group_id") == key, f"group-id {m['properties']} for {key}")
        per_key.setdefault(key, []).append(seq)
    ensure(all(v == ["0", "1", "2"] for v in per_key.values()), f"per-key order {per_key}")
    state = ctx.gw.admin("GET", f"queues/{queue}")
    return f"4 keys x 3 in order via {consumer.name}; partitions {len(state['partitions'])}"


# ---- MQTT -----------------------------------------------------------------------------


def mqtt_msg(
    topic: str, payload: bytes, qos: int, props: dict[str, Any] | None = None, retain: bool = False
) -> dict[str, Any]:
    return {
        "topic": topic,
        "payload": b64(payload),
        "qos": qos,
        "retain": retain,
        "props": props or {},
    }


def pubsub_qos(qos: int) -> Callable[[Ctx, Client], str]:
    def scenario(ctx: Ctx, c: Client) -> str:
        topic = ctx.name(c, "t")
        bodies = [f"m{i}".encode() for i in range(3)]
        sub = ctx.start(c, "subscribe", topics=[[topic, qos]], count=3)
        ctx.run(c, "publish", messages=[mqtt_msg(topic, b, qos) for b in bodies])
        got = sub.result()["messages"]
        ensure(payloads(got) == bodies, f"received {payloads(got)}")
        ensure(all(m["qos"] == qos for m in got), f"QoS {[m['qos'] for m in got]}")
        return f"3 messages at QoS {qos}"

    return scenario


def retained(ctx: Ctx, c: Client) -> str:
    topic = ctx.name(c, "t")
    ctx.run(c, "publish", messages=[mqtt_msg(topic, b"kept", 1, retain=True)])
    got = ctx.run(c, "subscribe", topics=[[topic, 1]], count=1)["messages"]
    ensure(payloads(got) == [b"kept"], f"new subscriber got {got}")
    ensure(got[0]["retain"] is True, "retained message delivered without the RETAIN flag")
    ctx.run(c, "publish", messages=[mqtt_msg(topic, b"", 1, retain=True)])
    again = ctx.run(c, "subscribe", topics=[[topic, 1]], count=1, timeout=2.0)["messages"]
    ensure(again == [], f"empty retained publish did not clear it: {again}")
    return "delivered with RETAIN to a new subscriber; cleared by an empty payload"


def will(ctx: Ctx, c: Client) -> str:
    topic = ctx.name(c, "will")
    sub = ctx.start(c, "subscribe", topics=[[topic, 1]], count=1)
    ctx.run(c, "will", will={"topic": topic, "payload": b64(b"gone"), "qos": 1, "retain": False})
    got = sub.result()["messages"]
    ensure(payloads(got) == [b"gone"], f"will not delivered: {got}")
    return "will published after the socket dropped without DISCONNECT"


def session_resume(ctx: Ctx, c: Client) -> str:
    topic = ctx.name(c, "t")
    client_id = ctx.name(c, "persistent")
    ctx.run(c, "subscribe", topics=[[topic, 1]], count=0, clean=False, client_id=client_id)
    ctx.run(c, "publish", messages=[mqtt_msg(topic, f"s{i}".encode(), 1) for i in range(2)])
    got = ctx.run(c, "subscribe", topics=[], count=2, clean=False, client_id=client_id)
    ensure(payloads(got["messages"]) == [b"s0", b"s1"], f"resumed session got {got}")
    return "2 QoS 1 messages queued while offline, received on resume"


def request_reply_mqtt(ctx: Ctx, c: Client) -> str:
    req, rsp = ctx.name(c, "req"), ctx.name(c, "rsp")
    requester = ctx.start(c, "subscribe", topics=[[rsp, 1]], count=1)
    responder = ctx.start(c, "subscribe", topics=[[req, 1]], count=1)
    props = {"response_topic": rsp, "correlation_data": b64(b"corr-1")}
    ctx.run(c, "publish", messages=[mqtt_msg(req, b"ping", 1, props)])
    got = responder.result()["messages"]
    ensure(len(got) == 1, f"responder got {got}")
    p = got[0]["props"]
    ensure(p.get("response_topic") == rsp, f"response topic lost: {p}")
    ensure(p.get("correlation_data") == b64(b"corr-1"), f"correlation data lost: {p}")
    reply = {"correlation_data": p["correlation_data"]}
    ctx.run(c, "publish", messages=[mqtt_msg(p["response_topic"], b"pong", 1, reply)])
    back = requester.result()["messages"]
    ensure(payloads(back) == [b"pong"], f"requester got {back}")
    ensure(back[0]["props"].get("correlation_data") == b64(b"corr-1"), f"reply {back}")
    return "response topic + correlation data round trip"


# ---- AMQP -----------------------------------------------------------------------------


def amqp_msg(body: bytes, **properties: Any) -> dict[str, Any]:
    return {"body": b64(body), "properties": properties}


def send_amqp(ctx: Ctx, c: Client, address: str, bodies: list[bytes], **kw: Any) -> None:
    ctx.run(c, "send", address=address, messages=[amqp_msg(b) for b in bodies], **kw)


def pubsub_settle(settle: str) -> Callable[[Ctx, Client], str]:
    def scenario(ctx: Ctx, c: Client) -> str:
        address = "topic://" + ctx.name(c, "t")
        bodies = [f"m{i}".encode() for i in range(3)]
        sub = ctx.start(c, "receive", address=address, count=3, settle=settle)
        send_amqp(ctx, c, address, bodies, settle=settle)
        got = sub.result()["messages"]
        if c.name == "qpid-proton-c":  # send.c sends the map {"sequence": n}, n from 1, and
            # receive.c prints what it got with pn_inspect: the same map must come back
            bodies = [b'{"sequence"=%d}' % (i + 1) for i in range(3)]
        ensure(payloads(got, "body") == bodies, f"received {payloads(got, 'body')}")
        return f"3 messages {settle} on a topic:// address"

    return scenario


def request_reply_amqp(ctx: Ctx, c: Client) -> str:
    queue = ctx.queue(c, "svc", [])
    requester = ctx.start(
        c, "request", ready=False, address=queue, message=amqp_msg(b"ping", correlation_id="corr-1")
    )
    got = ctx.run(c, "receive", address=queue, count=1)["messages"]
    ensure(len(got) == 1, f"service got {got}")
    props = got[0]["properties"]
    ensure(bool(props.get("reply_to")), f"no reply-to on the request: {props}")
    reply = amqp_msg(b"pong", correlation_id=props.get("correlation_id"))
    ctx.run(c, "send", address=props["reply_to"], messages=[reply])
    out = requester.result()
    ensure(out.get("ok") is True, f"requester: {out}")
    ensure(unb64(out["reply"]["body"]) == b"pong", f"reply {out['reply']}")
    ensure(out["reply"]["properties"].get("correlation_id") == "corr-1", f"reply {out}")
    return f"dynamic reply-to {out['reply_to']}"


# ---- the matrix columns -----------------------------------------------------------------

QUEUE_READER = next(c for c in CLIENTS if c.name == "proton-python")  # reads MQTT-filled queues


def partitioned_cell(ctx: Ctx, c: Client) -> str:
    return partitioned(ctx, c, c if c.protocol == "amqp" else QUEUE_READER)


def request_reply(ctx: Ctx, c: Client) -> str:
    return request_reply_amqp(ctx, c) if c.protocol == "amqp" else request_reply_mqtt(ctx, c)


def tls(ctx: Ctx, c: Client) -> str:
    """Publish and consume over the TLS listener; the client verifies the certificate."""
    bodies = [f"tls{i}".encode() for i in range(2)]
    if c.protocol == "amqp":
        queue = ctx.queue(c, "tls", [])
        ctx.run(c, "send", tls=True, address=queue, messages=[amqp_msg(b) for b in bodies])
        got = ctx.run(c, "receive", tls=True, address=queue, count=2)["messages"]
        ensure(payloads(got, "body") == bodies, f"received {payloads(got, 'body')}")
        return "sent and received (accepted) over TLS, certificate verified"
    topic = ctx.name(c, "t")
    sub = ctx.start(c, "subscribe", tls=True, topics=[[topic, 1]], count=2)
    ctx.run(c, "publish", tls=True, messages=[mqtt_msg(topic, b, 1) for b in bodies])
    got = sub.result()["messages"]
    ensure(payloads(got) == bodies, f"received {payloads(got)}")
    return "QoS 1 publish and subscribe over TLS, certificate verified"


@dataclass(frozen=True)
class Scenario:
    """A matrix column: the protocols it applies to and the function that runs it."""

    protocols: frozenset[str]
    run: Callable[[Ctx, Client], str]


MQTT, AMQP = frozenset({"mqtt"}), frozenset({"amqp"})
BOTH = MQTT | AMQP
SCENARIOS = {
    "auth_good": Scenario(BOTH, auth_good),
    "auth_bad": Scenario(BOTH, auth_bad),
    "pubsub_qos0": Scenario(MQTT, pubsub_qos(0)),
    "pubsub_qos1": Scenario(MQTT, pubsub_qos(1)),
    "pubsub_qos2": Scenario(MQTT, pubsub_qos(2)),
    "pubsub_presettled": Scenario(AMQP, pubsub_settle("presettled")),
    "pubsub_unsettled": Scenario(AMQP, pubsub_settle("unsettled")),
    "queue_ack": Scenario(BOTH, queue_ack),
    "retained": Scenario(MQTT, retained),
    "will": Scenario(MQTT, will),
    "session_resume": Scenario(MQTT, session_resume),
    "partitioned": Scenario(BOTH, partitioned_cell),
    "request_reply": Scenario(BOTH, request_reply),
    "tls": Scenario(BOTH, tls),
}
