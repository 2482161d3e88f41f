"""The admin HTTP API and the `gateway queue` CLI, over real sockets against a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import socket
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from gateway.admin import http as admin_http
from gateway.broker import Broker
from gateway.engine.queues import DEAD_MESSAGE_QUEUE, INFO_BATCH, QueueConfig
from gateway.model import Message, Outcome

# urllib honours *_proxy variables; this client and the CLI must talk to loopback directly
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
CLI = Path(sys.executable).parent / "gateway"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    raw: bytes

    @property
    def body(self) -> Any:
        return json.loads(self.raw) if self.raw else None

    @property
    def error(self) -> str:
        body = self.body
        assert isinstance(body, dict), body
        assert isinstance(body.get("error"), str) and body["error"], body
        assert body.get("status") == self.status
        return body["error"]


class Admin:
    """Blocking urllib calls, each in a thread so the server on this loop keeps running."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"

    def _call(self, method: str, path: str, data: bytes | None, ctype: str | None) -> Reply:
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if ctype:
            req.add_header("Content-Type", ctype)
        try:
            with _opener.open(req, timeout=10) as resp:
                return Reply(resp.status, dict(resp.headers.items()), resp.read())
        except urllib.error.HTTPError as exc:
            return Reply(exc.code, dict(exc.headers.items()), exc.read())

    async def request(
        self, method: str, path: str, body: Any = None, *, raw: bytes | None = None
    ) -> Reply:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        ctype = "application/json" if data is not None else None
        return await asyncio.to_thread(self._call, method, path, data, ctype)

    async def get(self, path: str) -> Reply:
        return await self.request("GET", path)

    async def post(self, path: str, body: Any = None, **kw: Any) -> Reply:
        return await self.request("POST", path, body, **kw)

    async def create(self, name: str, **props: Any) -> Reply:
        return await self.post("/api/v1/queues", {"name": name, **props})

    async def publish(self, queue: str, payload: str, **fields: Any) -> Reply:
        return await self.post(q(queue, "messages"), {"payload": payload, **fields})

    async def take(self, queue: str, count: int = 1, ackmode: str = "ack", timeout_ms=2000):
        reply = await self.post(
            q(queue, "get"), {"count": count, "ackmode": ackmode, "timeout_ms": timeout_ms}
        )
        assert reply.status == 200, reply
        return reply.body

    async def depth(self, queue: str) -> int:
        reply = await self.get(q(queue))
        assert reply.status == 200, reply
        return reply.body["messages"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def q(name: str, *rest: str) -> str:
    """Path of a queue resource, the name encoded as one segment (a/b -> a%2Fb)."""
    return "/".join(["/api/v1/queues", quote(name, safe=""), *rest])


# -- queues ---------------------------------------------------------------------------------


async def test_create_is_idempotent_and_checks_equivalence(admin: Admin) -> None:
    first = await admin.create("q1", access_type="exclusive", max_messages=5)
    assert first.status == 201
    assert first.headers["Content-Type"] == "application/json"
    assert first.body["name"] == "q1"
    assert first.body["access_type"] == "exclusive"
    assert first.body["max_messages"] == 5
    assert first.body["messages"] == 0

    again = await admin.create("q1", access_type="exclusive")
    assert again.status == 200
    assert again.body["name"] == "q1"

    other = await admin.create("q1", access_type="non-exclusive")
    assert other.status == 409
    assert "access_type" in other.error

    durable = await admin.create("q1", access_type="exclusive", durable=False)
    assert durable.status == 409
    assert "durable" in durable.error

    shown = await admin.get(q("q1"))
    assert shown.body["access_type"] == "exclusive"
    assert shown.body["durable"] is True


@pytest.mark.parametrize(
    "other",
    [
        {"lvq_key": "k"},
        {"non_destructive": True},
        {"max_ttl_ms": 1000},
        {"respect_ttl": True},
        {"max_redelivery": 3},
        {"dead_message_queue": "other"},
        {"dmq_eligible_default": True},
        {"message_groups": "shared", "default_group": "g"},
    ],
    ids=lambda other: ",".join(other),
)
async def test_a_redeclaration_with_other_message_semantics_is_409(
    admin: Admin, other: dict
) -> None:
    """RabbitMQ compares a re-declaration's arguments (x-message-ttl, x-dead-letter-
    exchange, x-delivery-limit...): the declarer would not have the queue it asked for.
    Run-time settings (limits, overflow) are not compared: an operator may change them."""
    base = {"message_groups": "shared"} if "default_group" in other else {}
    assert (await admin.create("eq", **base)).status == 201
    reply = await admin.create("eq", **other)
    assert reply.status == 409 and next(iter(reversed(other))) in reply.error, reply
    assert (await admin.create("eq", **base, max_messages=7, overflow="ring")).status == 200


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"name": "bad*name"}, "forbidden"),
        ({"name": "has space"}, "forbidden"),
        ({"name": ""}, "non-empty"),
        ({"name": "#mine"}, "reserved"),
        ({"name": "amq.x"}, "reserved"),
        ({"name": "x" * 256}, "longer"),
        ({}, "name"),
        ({"name": "ok", "colour": "red"}, "unknown queue properties: colour"),
        ({"name": "ok", "access_type": "shared"}, "access_type"),
        ({"name": "ok", "durable": "yes"}, "durable"),
        ({"name": "ok", "max_messages": -1}, "max_messages"),
        ({"name": "ok", "max_messages": "10"}, "max_messages"),
        ({"name": "ok", "subscriptions": "a/b"}, "subscriptions"),
        ({"name": "ok", "subscriptions": [{"pattern": "a/#/b", "syntax": "mqtt"}]}, "a/#/b"),
        ({"name": "ok", "subscriptions": [{"pattern": "a", "syntax": "amqp"}]}, "syntax"),
        ({"name": "ok", "partition_count": 2, "access_type": "exclusive"}, "partitioned"),
    ],
)
async def test_create_refuses_bad_specs(admin: Admin, body: dict, needle: str) -> None:
    reply = await admin.post("/api/v1/queues", body)
    assert reply.status == 400
    assert needle in reply.error
    assert (await admin.get("/api/v1/queues")).body == []  # nothing half-created


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'"q1"', "JSON object"),
        (b"null", "JSON object"),
    ],
)
async def test_bad_bodies_get_400_json(admin: Admin, raw: bytes, needle: str) -> None:
    for path in ("/api/v1/queues", "/api/v1/messages"):
        reply = await admin.post(path, raw=raw)
        assert reply.status == 400
        assert reply.headers["Content-Type"] == "application/json"
        assert needle in reply.error


async def test_list_and_show(admin: Admin) -> None:
    assert (await admin.get("/api/v1/queues")).body == []
    assert (await admin.create("b", subscriptions=["t/>"])).status == 201
    assert (await admin.create("a", access_type="exclusive", durable=False)).status == 201
    assert (await admin.publish("b", "hello")).status == 200

    listed = await admin.get("/api/v1/queues")
    assert listed.status == 200
    assert [row["name"] for row in listed.body] == ["a", "b"]
    a, b = listed.body
    assert a["access_type"] == "exclusive" and a["durable"] is False and a["messages"] == 0
    assert b["access_type"] == "non-exclusive" and b["messages"] == 1
    assert b["spooled_bytes"] > len("hello")
    assert a["flows"] == 0

    shown = await admin.get(q("b"))
    assert shown.status == 200
    assert shown.body["name"] == "b"
    assert shown.body["subscriptions"] == [{"pattern": "t/>", "syntax": "smf"}]
    assert shown.body["messages"] == 1
    assert shown.body["ingress_enabled"] is True

    missing = await admin.get(q("nope"))
    assert missing.status == 404
    assert "nope" in missing.error


async def test_unknown_routes(admin: Admin) -> None:
    assert (await admin.get("/api/v2/queues")).status == 404
    assert (await admin.get("/nothing")).status == 404
    put = await admin.request("PUT", "/api/v1/queues", {"name": "x"})
    assert put.status == 405
    assert put.error
    health = await admin.get("/api/v1/health")
    assert health.status == 200 and health.body["status"] == "ok"


async def test_patch_ingress_disabled_refuses_publishes(admin: Admin) -> None:
    await admin.create("q1")
    patched = await admin.request("PATCH", q("q1"), {"ingress_enabled": False})
    assert patched.status == 200
    assert patched.body["ingress_enabled"] is False
    assert (await admin.get(q("q1"))).body["ingress_enabled"] is False

    refused = await admin.publish("q1", "x")
    assert refused.status == 503
    assert "ingress_disabled" in refused.error
    assert await admin.depth("q1") == 0

    assert (await admin.request("PATCH", q("q1"), {"ingress_enabled": True})).status == 200
    ok = await admin.publish("q1", "x")
    assert ok.status == 200 and ok.body["outcome"] == "ok"
    assert await admin.depth("q1") == 1


async def test_patch_errors(admin: Admin) -> None:
    await admin.create("q1")
    fixed = await admin.request("PATCH", q("q1"), {"access_type": "exclusive"})
    assert fixed.status == 400
    assert "access_type" in fixed.error
    negative = await admin.request("PATCH", q("q1"), {"max_messages": -5})
    assert negative.status == 400
    missing = await admin.request("PATCH", q("nope"), {"ingress_enabled": False})
    assert missing.status == 404
    assert (await admin.get(q("q1"))).body["max_messages"] == 0


async def test_patch_limits_and_egress_take_effect(admin: Admin) -> None:
    await admin.create("q1", access_type="exclusive")
    shrunk = await admin.request("PATCH", q("q1"), {"max_message_size": 4})
    assert shrunk.status == 200 and shrunk.body["max_message_size"] == 4
    assert (await admin.publish("q1", "12345")).status == 413
    assert (await admin.publish("q1", "1234")).status == 200

    assert (await admin.request("PATCH", q("q1"), {"egress_enabled": False})).status == 200
    blocked = await admin.post(q("q1", "get"), {"timeout_ms": 100})
    assert blocked.status == 409
    assert "egress" in blocked.error
    assert await admin.depth("q1") == 1

    assert (await admin.request("PATCH", q("q1"), {"egress_enabled": True})).status == 200
    got = await admin.take("q1")  # an exclusive queue: the get's flow takes the lease
    assert [m["payload"] for m in got] == ["1234"]
    assert await admin.depth("q1") == 0
    not_object = await admin.request("PATCH", q("q1"), raw=b"[]")
    assert not_object.status == 400


async def test_patch_with_a_non_boolean_switch_is_refused(admin: Admin) -> None:
    await admin.create("q1")
    patched = await admin.request("PATCH", q("q1"), {"ingress_enabled": "true"})
    assert patched.status == 400
    assert (await admin.get(q("q1"))).body["ingress_enabled"] is True


async def test_delete(admin: Admin) -> None:
    await admin.create("q1", subscriptions=["d/>"])
    await admin.publish("q1", "x")
    deleted = await admin.request("DELETE", q("q1"))
    assert deleted.status == 204
    assert deleted.raw == b""
    assert (await admin.get(q("q1"))).status == 404
    again = await admin.request("DELETE", q("q1"))
    assert again.status == 404
    assert "q1" in again.error
    assert (await admin.get("/api/v1/queues")).body == []
    # its subscription went with it
    routed = await admin.post("/api/v1/messages", {"topic": "d/1", "payload": "x"})
    assert routed.body["outcome"] == "no_subscribers"


async def test_names_with_slashes_and_unicode(admin: Admin) -> None:
    for name in ("a/b", "svc/orders/in", "café/ü", "100%", "a#b", "#DEAD_MSG_QUEUE"):
        created = await admin.create(name)
        assert created.status == 201, created
        assert created.body["name"] == name
        shown = await admin.get(q(name))
        assert shown.status == 200 and shown.body["name"] == name
        assert (await admin.publish(name, "p")).status == 200
        got = await admin.take(name)
        assert [m["payload"] for m in got] == ["p"]
        assert got[0]["destination"] == name
    # a/b is not the resource a, nor the queue list
    assert (await admin.get("/api/v1/queues/a")).status == 404
    assert (await admin.request("DELETE", q("a/b"))).status == 204
    assert (await admin.get(q("a/b"))).status == 404
    assert (await admin.get(q("svc/orders/in"))).status == 200


# -- subscriptions and topic publishing -------------------------------------------------------


async def test_subscriptions_add_and_remove(admin: Admin) -> None:
    await admin.create("q1")
    subs = q("q1", "subscriptions")
    publish = {"topic": "shop/eu/created", "payload": "order"}

    before = await admin.post("/api/v1/messages", publish)
    assert before.status == 200 and before.body["outcome"] == "no_subscribers"

    added = await admin.post(subs, {"pattern": "shop/*/created"})
    assert added.status == 200 and added.body == {"changed": 1}
    assert (await admin.post(subs, {"pattern": "shop/*/created"})).body == {"changed": 0}
    mqtt = await admin.post(subs, {"pattern": "alerts/#", "syntax": "mqtt"})
    assert mqtt.body == {"changed": 1}
    assert (await admin.get(q("q1"))).body["subscriptions"] == [
        {"pattern": "alerts/#", "syntax": "mqtt"},
        {"pattern": "shop/*/created", "syntax": "smf"},
    ]

    routed = await admin.post("/api/v1/messages", publish)
    assert routed.status == 200 and routed.body["outcome"] == "ok" and routed.body["id"]
    alerts = await admin.post("/api/v1/messages", {"topic": "alerts", "payload": "a"})
    assert alerts.body["outcome"] == "ok"  # mqtt '#' matches the parent level
    other = await admin.post("/api/v1/messages", {"topic": "shop/eu/paid", "payload": "x"})
    assert other.body["outcome"] == "no_subscribers"
    assert await admin.depth("q1") == 2

    removed = await admin.request("DELETE", subs + "?pattern=" + quote("shop/*/created"))
    assert removed.status == 200 and removed.body == {"changed": 1}
    gone = await admin.post("/api/v1/messages", publish)
    assert gone.body["outcome"] == "no_subscribers"
    # wrong syntax: nothing removed
    wrong = await admin.request("DELETE", subs + "?pattern=alerts/%23&syntax=smf")
    assert wrong.body == {"changed": 0}
    right = await admin.request("DELETE", subs + "?pattern=alerts/%23&syntax=mqtt")
    assert right.body == {"changed": 1}
    # a '+' in a URL's query is itself (an MQTT wildcard), not a space as in a form: the
    # removal of a/+ removed "a/ ", i.e. nothing (found by a review)
    assert (await admin.post(subs, {"pattern": "a/+", "syntax": "mqtt"})).body == {"changed": 1}
    plus = await admin.request("DELETE", subs + "?pattern=a/+&syntax=mqtt")
    assert plus.body == {"changed": 1}
    assert (await admin.post("/api/v1/messages", {"topic": "alerts"})).body["outcome"] == (
        "no_subscribers"
    )
    got = await admin.take("q1", count=5, timeout_ms=300)
    assert [(m["destination"], m["payload"]) for m in got] == [
        ("shop/eu/created", "order"),
        ("alerts", "a"),
    ]


async def test_subscription_errors(admin: Admin) -> None:
    await admin.create("q1")
    subs = q("q1", "subscriptions")
    assert (await admin.request("DELETE", subs)).status == 400
    assert (await admin.get(subs)).status == 405
    bad = await admin.post(subs, {"pattern": "a/+b", "syntax": "mqtt"})
    assert bad.status == 400 and "a/+b" in bad.error
    assert (await admin.post(subs, {"syntax": "smf"})).status == 400
    unknown = await admin.post(q("nope", "subscriptions"), {"pattern": "a"})
    assert unknown.status == 404
    assert (await admin.get(q("q1"))).body["subscriptions"] == []


async def test_topic_publish_validation(admin: Admin) -> None:
    both = await admin.post("/api/v1/messages", {"topic": "a", "queue": "b"})
    assert both.status == 400 and "exactly one" in both.error
    neither = await admin.post("/api/v1/messages", {"payload": "x"})
    assert neither.status == 400
    empty_topic = await admin.post("/api/v1/messages", {"topic": ""})
    assert empty_topic.status == 400 and "invalid topic" in empty_topic.error
    await admin.create("q1")
    bad_b64 = await admin.publish("q1", "", payload_base64="***")
    assert bad_b64.status == 400
    bad_priority = await admin.publish("q1", "x", priority=10)
    assert bad_priority.status == 400
    bad_props = await admin.publish("q1", "x", user_properties=[["a", 1]])
    assert bad_props.status == 400
    nested = await admin.publish("q1", "x", user_properties={"a": {"b": 1}})
    assert nested.status == 400 and "'a'" in nested.error
    not_text = await admin.publish("q1", "x", content_type=["text/plain"])
    assert not_text.status == 400 and "content_type" in not_text.error
    for fields in ({"reply_to": "\ud800"}, {"user_properties": {"k": "\udfff"}}):
        surrogate = await admin.publish("q1", "x", **fields)
        assert surrogate.status == 400 and "surrogate" in surrogate.error
    surrogate_payload = await admin.publish("q1", "\ud800")
    assert surrogate_payload.status == 400 and "payload" in surrogate_payload.error
    assert await admin.depth("q1") == 0


# -- publishing to a queue and getting messages ------------------------------------------------


async def test_publish_and_get_fields(admin: Admin) -> None:
    await admin.create("q1")
    sent = await admin.publish(
        "q1",
        "",
        payload_base64="AP8=",
        partition_key="dev-1",
        priority=9,
        user_properties={"k": "v", "n": 2},
        content_type="application/x-raw",
        correlation_id="corr-1",
        reply_to="replies",
    )
    assert sent.status == 200
    assert sent.body["outcome"] == "ok"
    text = await admin.publish("q1", "héllo")
    got = await admin.take("q1", count=2)
    assert len(got) == 2
    first, second = got
    assert first["id"] == sent.body["id"] and second["id"] == text.body["id"]
    assert first["payload_base64"] == "AP8=" and first["payload"] is None  # not UTF-8
    assert first["partition_key"] == "dev-1" and first["priority"] == 9
    assert first["user_properties"] == {"k": "v", "n": 2}
    headers = ("content_type", "correlation_id", "reply_to", "expiration", "annotations")
    assert [first[h] for h in headers] == ["application/x-raw", "corr-1", "replies", None, {}]
    assert second["payload"] == "héllo" and second["priority"] == 4
    assert first["delivery_count"] == 1 and first["redelivered"] is False
    assert await admin.depth("q1") == 0


async def test_a_dead_message_got_shows_where_from_and_why(admin: Admin) -> None:
    """An operator reading the dead message queue could not tell a rejected message from
    an expired or redelivered one: the annotations were not shown (RabbitMQ's management
    get shows x-death)."""
    await admin.create(DEAD_MESSAGE_QUEUE)
    await admin.create("orders", dmq_eligible_default=True)
    assert (await admin.publish("orders", "bad order")).status == 200
    assert len(await admin.take("orders", ackmode="reject")) == 1
    [dead] = await admin.take(DEAD_MESSAGE_QUEUE)
    assert dead["payload"] == "bad order"
    assert dead["annotations"] == {"x-origin-queue": "orders", "x-dmq-reason": "rejected"}


async def test_a_double_that_is_nan_or_infinite_is_got_as_strict_json(
    admin: Admin, broker: Broker
) -> None:
    """An AMQP publisher's NaN (a JMS setDoubleProperty) came out as `NaN`, which no strict
    JSON parser reads (RFC 8259): the whole answer was lost to a web UI, and the messages
    it took with it."""
    await admin.create("readings")
    props = [("reading", float("nan")), ("peak", float("inf")), ("low", -1.5)]
    msg = Message("readings", b"x", to_queue=True, user_properties=props)
    assert await broker.publish(msg) is Outcome.OK
    reply = await admin.post(q("readings", "get"), {"count": 1})

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    [got] = json.loads(reply.raw, parse_constant=refuse)
    assert got["user_properties"] == {"reading": "nan", "peak": "inf", "low": -1.5}


async def test_publish_to_unknown_queue_is_404(admin: Admin) -> None:
    reply = await admin.publish("nope", "x")
    assert reply.status == 404
    assert "not_found" in reply.error
    assert (await admin.get("/api/v1/queues")).body == []


async def test_publish_over_max_message_size_is_413(admin: Admin) -> None:
    await admin.create("small", max_message_size=10)
    assert (await admin.publish("small", "x" * 10)).status == 200
    big = await admin.publish("small", "x" * 11)
    assert big.status == 413
    assert "too_large" in big.error
    assert await admin.depth("small") == 1


async def test_full_queue_is_507_and_keeps_what_it_has(admin: Admin) -> None:
    await admin.create("capped", max_messages=3)
    ids = []
    for i in range(3):
        reply = await admin.publish("capped", f"m{i}")
        assert reply.status == 200, reply
        ids.append(reply.body["id"])
    for _ in range(2):
        full = await admin.publish("capped", "overflow")
        assert full.status == 507
        assert "queue_full" in full.error
    assert await admin.depth("capped") == 3

    got = await admin.take("capped", count=10, timeout_ms=300)
    assert [m["payload"] for m in got] == ["m0", "m1", "m2"]
    assert [m["id"] for m in got] == ids
    assert await admin.depth("capped") == 0
    assert (await admin.publish("capped", "after")).status == 200


async def test_publish_over_max_spool_bytes_is_507(admin: Admin) -> None:
    await admin.create("quota", max_spool_bytes=200)
    outcomes = [(await admin.publish("quota", "y" * 40)).status for _ in range(5)]
    assert outcomes[0] == 200
    assert 507 in outcomes
    first_refusal = outcomes.index(507)
    assert set(outcomes[first_refusal:]) == {507}
    shown = (await admin.get(q("quota"))).body
    assert shown["messages"] == first_refusal
    assert 0 < shown["spooled_bytes"] <= 200
    refused = await admin.publish("quota", "y" * 40)
    assert "quota_exceeded" in refused.error


async def test_get_requeue_ack_and_reject(admin: Admin) -> None:
    await admin.create("q1")
    for i in range(3):
        await admin.publish("q1", f"m{i}")

    first = await admin.take("q1", count=2, ackmode="requeue")
    assert [(m["payload"], m["delivery_count"], m["redelivered"]) for m in first] == [
        ("m0", 1, False),
        ("m1", 1, False),
    ]
    assert await admin.depth("q1") == 3

    second = await admin.take("q1", count=2, ackmode="ack")
    assert [(m["payload"], m["delivery_count"], m["redelivered"]) for m in second] == [
        ("m0", 2, True),
        ("m1", 2, True),
    ]
    assert [m["entry_id"] for m in second] == [m["entry_id"] for m in first]
    assert await admin.depth("q1") == 1

    third = await admin.take("q1", count=5, ackmode="reject", timeout_ms=300)
    assert [(m["payload"], m["delivery_count"]) for m in third] == [("m2", 1)]
    assert await admin.depth("q1") == 0
    counters = (await admin.get(q("q1"))).body["counters"]
    assert counters["acked"] == 2 and counters["rejected"] == 1 and counters["requeued"] == 2


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("DELETE", "/api/v1/queues/keep?if-empty=true"),  # RabbitMQ's conditional delete
        ("DELETE", "/api/v1/queues/keep/subscriptions?pattern=a%2F%23&sytnax=mqtt"),
        ("GET", "/api/v1/queues/keep?verbose=1"),
    ],
)
async def test_unknown_query_parameters_are_refused(admin: Admin, method: str, path: str) -> None:
    """A parameter no route reads would be ignored: the queue went with its message, or
    the subscription stayed while the answer said nothing changed."""
    body = {"subscriptions": [{"pattern": "a/#", "syntax": "mqtt"}]}
    assert (await admin.create("keep", **body)).status == 201
    assert (await admin.publish("keep", "m")).status == 200
    reply = await admin.request(method, path)
    assert reply.status == 400 and "query" in reply.error, reply
    assert await admin.depth("keep") == 1
    assert (await admin.get(q("keep"))).body["subscriptions"] != []


async def test_a_get_is_no_consumer_of_an_auto_delete_queue(admin: Admin) -> None:
    """RabbitMQ: an auto-delete queue goes when its last consumer is cancelled, and
    basic.get (the management API's get) is no consumer: taking one message of three
    leaves the queue and the other two."""
    assert (await admin.create("ad", auto_delete=True)).status == 201
    for i in range(3):
        assert (await admin.publish("ad", f"m{i}")).status == 200
    got = await admin.take("ad", count=1, ackmode="ack", timeout_ms=1000)
    assert [m["payload"] for m in got] == ["m0"]
    assert await admin.depth("ad") == 2


async def test_get_timeout_waits_for_a_message(admin: Admin, broker: Broker) -> None:
    await admin.create("q1")
    loop = asyncio.get_running_loop()
    started = loop.time()
    empty = await admin.take("q1", count=1, timeout_ms=300)
    assert empty == []
    assert loop.time() - started >= 0.29

    async def later() -> None:
        await asyncio.sleep(0.2)
        assert (await admin.publish("q1", "late")).status == 200

    publisher = asyncio.create_task(later())
    started = loop.time()
    got = await admin.take("q1", count=1, timeout_ms=5000)
    await publisher
    assert [m["payload"] for m in got] == ["late"]
    assert loop.time() - started < 4  # returned when the message came, not at the timeout
    assert await admin.depth("q1") == 0


async def test_a_binary_user_property_is_got_as_base64(admin: Admin, broker: Broker) -> None:
    """AMQP application properties may be binary (§3.2.5): JSON has no bytes."""
    await admin.create("bin")
    props = [("raw", b"\x00\xff"), ("text", "t")]
    msg = Message(destination="bin", to_queue=True, payload=b"x", user_properties=props)
    assert await broker.publish(msg) is Outcome.OK
    [got] = await admin.take("bin")
    assert got["user_properties"] == {"raw": {"base64": "AP8="}, "text": "t"}


@pytest.mark.parametrize(
    "body",
    [
        {"count": 0},
        {"count": 1001},
        {"count": "1"},
        {"count": True},
        {"ackmode": "drop"},
        {"timeout_ms": -1},
        {"timeout_ms": 30_001},
    ],
)
async def test_get_validation(admin: Admin, body: dict) -> None:
    await admin.create("q1")
    await admin.publish("q1", "keep")
    reply = await admin.post(q("q1", "get"), body)
    assert reply.status == 400
    assert reply.error
    assert await admin.depth("q1") == 1


async def test_get_from_unknown_queue_is_404(admin: Admin) -> None:
    reply = await admin.post(q("nope", "get"), {"count": 1})
    assert reply.status == 404
    assert "nope" in reply.error


async def test_a_get_waiting_on_a_queue_deleted_meanwhile_is_404(admin: Admin) -> None:
    """It answered 200 [] once its timeout passed, as if the queue were there and empty."""
    await admin.create("q1")
    loop = asyncio.get_running_loop()
    started = loop.time()
    waiting = asyncio.create_task(admin.post(q("q1", "get"), {"timeout_ms": 20_000}))
    await asyncio.sleep(0.3)
    assert (await admin.request("DELETE", q("q1"))).status in (200, 204)
    reply = await waiting
    assert reply.status == 404, reply
    assert "q1" in reply.error
    assert loop.time() - started < 10  # at the delete, not at the timeout


# -- metrics ----------------------------------------------------------------------------------


async def test_metrics(admin: Admin, broker: Broker) -> None:
    await admin.create("q1")
    await admin.create("x/y")
    await admin.create("back\\slash")
    for i in range(3):
        await admin.publish("q1", f"m{i}")
    await admin.take("q1", count=1)

    reply = await admin.get("/metrics")
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/plain")
    lines = reply.raw.decode().splitlines()
    assert 'gateway_queue_messages{queue="q1"} 2' in lines
    assert 'gateway_queue_messages{queue="x/y"} 0' in lines
    assert 'gateway_queue_messages{queue="back\\\\slash"} 0' in lines  # label escaping
    assert 'gateway_queue_acked_total{queue="q1"} 1' in lines
    assert "# TYPE gateway_queue_messages gauge" in lines
    assert f'gateway_published{{node="{broker.node_id}"}} 3' in lines
    spooled = [ln for ln in lines if ln.startswith('gateway_queue_spooled_bytes{queue="q1"}')]
    assert len(spooled) == 1 and int(spooled[0].split()[-1]) > 0
    # every sample line is "name{labels} number"
    for line in lines:
        if line and not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


async def test_list_and_metrics_over_more_queues_than_one_read_takes(
    admin: Admin, broker: Broker
) -> None:
    """Queues are read INFO_BATCH a round trip: each one is listed, with its own figures
    (a partitioned and a priority queue's summed from their children), across batches."""
    names = [f"q{i:04}" for i in range(INFO_BATCH + 20)]
    for name in names:
        await broker.declare_queue(QueueConfig(name=name))
    await broker.declare_queue(QueueConfig(name="zparts", partition_count=2))
    await broker.declare_queue(QueueConfig(name="zprio", priorities=True))
    for name in ("q0003", names[-1], "zparts", "zprio", "zprio"):
        assert (await admin.publish(name, "m")).status == 200
    listed = {row["name"]: row["messages"] for row in (await admin.get("/api/v1/queues")).body}
    assert set(listed) == {*names, "zparts", "zprio"}
    assert {n for n, m in listed.items() if m} == {"q0003", names[-1], "zparts", "zprio"}
    assert listed["zprio"] == 2
    lines = (await admin.get("/metrics")).raw.decode().splitlines()
    depths = [ln for ln in lines if ln.startswith("gateway_queue_messages{")]
    assert len(depths) == len(listed)
    assert f'gateway_queue_messages{{queue="{names[-1]}"}} 1' in depths
    assert 'gateway_queue_messages{queue="zparts"} 1' in depths


def next_page(reply: Reply) -> str | None:
    """The path the Link header names as the next page of a list, if any."""
    link = reply.headers.get("Link")
    if link is None:
        return None
    match = re.fullmatch(r'<(/api/v1/queues\?[^>]*)>; rel="next"', link)
    assert match, link
    return match.group(1)


async def test_the_queue_list_pages_by_name_and_links_the_next_page(
    admin: Admin, broker: Broker
) -> None:
    """?limit pages the list, in name order; each page but the last links the next, its
    `after` naming the page's last queue as one query value (a '+', '/', '=', '%' or '#'
    in it)."""
    names = sorted(["a+b", "c/d", "e#f", "h=i", "p%25", "z", *(f"q{i}" for i in range(3))])
    for name in names:
        await broker.declare_queue(QueueConfig(name=name))
    assert (await admin.publish("h=i", "m")).status == 200
    pages: list[list[dict]] = []
    path: str | None = "/api/v1/queues?limit=2"
    while path is not None:
        reply = await admin.get(path)
        assert reply.status == 200, reply
        pages.append(reply.body)
        path = next_page(reply)
    assert [len(page) for page in pages] == [2, 2, 2, 2, 1]
    assert [row["name"] for page in pages for row in page] == names
    assert next(row for page in pages for row in page if row["name"] == "h=i")["messages"] == 1
    whole = await admin.get("/api/v1/queues?limit=9")  # all on one page: no link
    assert [row["name"] for row in whole.body] == names and next_page(whole) is None
    after = await admin.get("/api/v1/queues?after=g")  # not a queue: those after it
    assert [row["name"] for row in after.body] == names[names.index("h=i") :]
    assert next_page(after) is None
    for bad in ("0", "-1", "x", "1.5", "\u00b2", "10001", "", "9" * 5000):
        reply = await admin.get(f"/api/v1/queues?limit={quote(bad)}")
        assert reply.status == 400 and "limit" in reply.error, (bad, reply)


async def test_a_queue_deleted_while_a_page_is_read_leaves_the_page_full_and_linked(
    admin: Admin, broker: Broker
) -> None:
    """Another client deletes a queue between the page's read of the names and of the
    queues: the operator's page held one queue less and no Link, so a program following
    the links took the list for ended. (The names are read as always, then one queue
    is deleted in Redis.)"""
    names = [f"q{i}" for i in range(6)]
    for name in names:
        await broker.declare_queue(QueueConfig(name=name))
    read_names = broker.queues.names

    async def names_then_a_deletion() -> list[str]:
        found = await read_names()
        broker.queues.names = read_names  # type: ignore[method-assign]
        await broker.delete_queue("q1")
        return found

    broker.queues.names = names_then_a_deletion  # type: ignore[method-assign]
    first = await admin.get("/api/v1/queues?limit=3")
    assert [row["name"] for row in first.body] == ["q0", "q2", "q3"]
    assert next_page(first) == "/api/v1/queues?limit=3&after=q3"


async def test_a_partitioned_queue_deleted_while_queues_are_listed_is_left_out(
    broker: Broker,
) -> None:
    """The batch read its config; its partitions, read after, are gone: the list goes on
    without it (it failed whole: a 500 for the queue list and /metrics)."""
    await broker.declare_queue(QueueConfig(name="a", partition_count=2))
    await broker.declare_queue(QueueConfig(name="z", partition_count=2))
    listing = broker.queues.infos(["a", "z"])
    assert (await anext(listing)).config.name == "a"
    await broker.delete_queue("z")
    assert [info async for info in listing] == []


# -- the HTTP layer ---------------------------------------------------------------------------


async def _raw_exchange(port: int, data: bytes, *, eof: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        if eof:
            writer.write_eof()
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)  # until the server closes
    finally:
        writer.close()


async def test_a_head_request_is_answered_as_a_get_without_the_body(admin: Admin) -> None:
    """h11 refused the body it was given for a HEAD: the connection's task died unread."""
    get = b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\n\r\n"
    last = get.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    answer = await _raw_exchange(admin.port, get.replace(b"GET", b"HEAD", 1) + last)
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Length: " in head
    assert rest.startswith(b"HTTP/1.1 200 ")  # the GET's answer right after the HEAD's head
    length = head.split(b"Content-Length: ")[1].split(b"\r\n")[0]
    assert rest.split(b"\r\n\r\n", 1)[1] and f"Content-Length: {int(length)}".encode() in rest


@pytest.mark.parametrize(
    "garbage",
    [
        b"THIS IS NOT HTTP\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)) + b"\r\n\r\n",
        b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\nContent-Length: many\r\n\r\n",
        b"GET /api/v1/health HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
        b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n",
    ],
    ids=["text", "tls-hello", "bad-content-length", "no-host", "bad-header"],
)
async def test_malformed_http_gets_400_and_server_keeps_serving(
    admin: Admin, garbage: bytes
) -> None:
    answer = await _raw_exchange(admin.port, garbage)
    assert answer.startswith(b"HTTP/1.1 400 ")
    _head, _, body = answer.partition(b"\r\n\r\n")
    assert json.loads(body)["status"] == 400
    health = await admin.get("/api/v1/health")
    assert health.status == 200 and health.body["status"] == "ok"


async def test_client_closing_mid_request_does_not_hurt(admin: Admin) -> None:
    partial_head = await _raw_exchange(
        admin.port, b"POST /api/v1/queues HTTP/1.1\r\nHost: x\r\n", eof=True
    )
    assert partial_head == b""  # closed before a request head: nothing to answer
    partial_body = await _raw_exchange(
        admin.port,
        b"POST /api/v1/queues HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
        eof=True,
    )
    assert partial_body.startswith(b"HTTP/1.1 400 ")  # body shorter than Content-Length
    _reader, writer = await asyncio.open_connection("127.0.0.1", admin.port)
    writer.write(b"POST /api/v1/queues HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    assert (await admin.get("/api/v1/health")).status == 200
    assert (await admin.get("/api/v1/queues")).body == []


async def test_keep_alive_serves_several_requests_on_one_connection(admin: Admin) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", admin.port)
    try:
        body = b'{"name": "ka"}'
        writer.write(
            b"POST /api/v1/queues HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s"
            % (len(body), body)
            + b"GET /api/v1/queues/ka HTTP/1.1\r\nHost: x\r\n\r\n"
            + b"GET /api/v1/queues/none HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", data) == [b"201", b"200", b"404"]


async def test_a_connection_idle_between_requests_is_closed(
    admin: Admin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each connection holds a task and a socket: one that never sent a request, and one
    idle after its last, held them until the client left."""
    monkeypatch.setattr(admin_http, "IDLE_S", 0.3)
    silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", admin.port)
    reader, writer = await asyncio.open_connection("127.0.0.1", admin.port)
    try:
        writer.write(b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        answered = await asyncio.wait_for(reader.read(), 3)  # answered, then closed
        assert answered.startswith(b"HTTP/1.1 200 ")
        assert await asyncio.wait_for(silent_reader.read(), 3) == b""
    finally:
        writer.close()
        silent_writer.close()


@pytest.mark.parametrize(
    "partial",
    [
        b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\n",
        b"POST /api/v1/queues HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n{",
    ],
    ids=["head", "body"],
)
async def test_a_request_not_completed_in_time_gets_408(
    admin: Admin, monkeypatch: pytest.MonkeyPatch, partial: bytes
) -> None:
    monkeypatch.setattr(admin_http, "REQUEST_S", 0.3)
    monkeypatch.setattr(admin_http, "IDLE_S", 10.0)
    answer = await _raw_exchange(admin.port, partial, eof=False)
    assert answer.startswith(b"HTTP/1.1 408 "), answer  # RFC 9110 §15.5.9
    assert (await admin.get("/api/v1/queues")).body == []


async def test_a_response_the_client_does_not_take_is_dropped(
    admin: Admin, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that asks for megabytes and reads none held its connection's task for good."""
    monkeypatch.setattr(admin_http, "SEND_S", 0.5)
    await broker.declare_queue(QueueConfig(name="big"))
    for _ in range(40):
        await broker.publish(Message(destination="big", payload=os.urandom(200_000), to_queue=True))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", admin.port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        body = b'{"count": 40, "browse": true}'
        writer.write(
            b"POST /api/v1/queues/big/get HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        await writer.drain()
        await asyncio.sleep(2.0)  # the server gives up on it meanwhile
        received = bytearray()
        with contextlib.suppress(ConnectionResetError):
            while chunk := await asyncio.wait_for(reader.read(1 << 20), 3):
                received += chunk
        head, _, rest = bytes(received).partition(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head)[1])
        assert len(rest) < length  # cut off, not delivered whole after the wait
    finally:
        writer.close()
    assert (await admin.get("/api/v1/queues/big")).body["messages"] == 40


# -- the CLI, for real, as a subprocess -------------------------------------------------------


async def run_cli(*args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    proc = await asyncio.create_subprocess_exec(
        str(CLI),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_cli_queue_commands(admin: Admin) -> None:
    assert CLI.exists(), CLI
    url = ["queue", "--admin-url", admin.base]

    rc, out, err = await run_cli(*url, "create", "q1", "--subscription", "a/>")
    assert (rc, err) == (0, "")
    created = json.loads(out)
    assert created["name"] == "q1"
    assert created["subscriptions"] == [{"pattern": "a/>", "syntax": "smf"}]
    # the subscription is live: a topic publish reaches the queue
    routed = await admin.post("/api/v1/messages", {"topic": "a/b/c", "payload": "x"})
    assert routed.body["outcome"] == "ok"

    rc, out, err = await run_cli(
        *url, "create", "x/y", "--access-type", "exclusive", "--max-messages", "7",
        "--non-durable",
    )  # fmt: skip
    assert (rc, err) == (0, "")
    assert json.loads(out)["max_messages"] == 7

    rc, out, err = await run_cli(*url, "list")
    assert (rc, err) == (0, "")
    rows = out.splitlines()
    assert rows[0].split() == ["NAME", "ACCESS", "MESSAGES", "BYTES", "FLOWS"]
    table = {r.split()[0]: r.split()[1:] for r in rows[1:]}
    assert set(table) == {"q1", "x/y"}
    assert table["q1"][:2] == ["non-exclusive", "1"]
    assert table["x/y"][:2] == ["exclusive", "0"]

    rc, out, err = await run_cli(*url, "show", "x/y")
    assert (rc, err) == (0, "")
    shown = json.loads(out)
    assert (shown["name"], shown["access_type"], shown["durable"]) == ("x/y", "exclusive", False)

    rc, out, err = await run_cli(*url, "delete", "q1")
    assert (rc, out, err) == (0, "", "")
    assert (await admin.get(q("q1"))).status == 404


async def test_cli_errors(admin: Admin) -> None:
    url = ["queue", "--admin-url", admin.base]

    rc, out, err = await run_cli(*url, "show", "nope")
    assert rc == 1 and out == ""
    assert err.endswith("\n") and len(err.splitlines()) == 1
    assert err.startswith("gateway: ") and "nope" in err and "does not exist" in err

    rc, out, err = await run_cli(*url, "create", "bad*name")
    assert rc == 1 and out == ""
    assert len(err.splitlines()) == 1 and "forbidden" in err

    await admin.create("q1", access_type="exclusive")
    rc, out, err = await run_cli(*url, "create", "q1", "--access-type", "non-exclusive")
    assert rc == 1 and len(err.splitlines()) == 1 and "access_type" in err

    rc, out, err = await run_cli(*url, "delete", "nope")
    assert rc == 1 and len(err.splitlines()) == 1 and "nope" in err

    closed = f"http://127.0.0.1:{free_port()}"
    rc, out, err = await run_cli("queue", "--admin-url", closed, "list")
    assert rc == 1 and out == ""
    assert len(err.splitlines()) == 1 and "cannot reach the admin API" in err

    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"AMQP\x00\x01\x00\x00")  # what the AMQP port answers
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(not_http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        rc, out, err = await run_cli("queue", "--admin-url", f"http://127.0.0.1:{port}", "list")
    finally:
        server.close()
    assert rc == 1 and out == ""
    assert len(err.splitlines()) == 1 and "no admin API answers" in err

    for malformed in ("localhost", "http://[::1"):  # a traceback before (found by a review)
        rc, out, err = await run_cli("queue", "--admin-url", malformed, "list")
        assert rc == 1 and out == ""
        assert len(err.splitlines()) == 1 and "is not an http(s) URL" in err, err


async def test_concurrent_patches_of_other_fields_both_stay(admin: Admin) -> None:
    """A PATCH writes the fields it changes, not the whole config it read: two PATCHes
    of other fields at once both take effect (a whole write lost one in half the rounds)."""
    assert (await admin.create("cp")).status == 201
    for i in range(1, 11):
        a, b = await asyncio.gather(
            admin.request("PATCH", q("cp"), {"max_messages": 100 + i}),
            admin.request("PATCH", q("cp"), {"max_message_size": 1000 + i}),
        )
        assert a.status == 200 and b.status == 200
        shown = (await admin.get(q("cp"))).body
        assert (shown["max_messages"], shown["max_message_size"]) == (100 + i, 1000 + i)
    assert (await admin.request("PATCH", q("cp"), {"max_messages": 110})).status == 200


async def test_flow_control_is_a_state_not_a_counter(admin: Admin, broker: Broker) -> None:
    """While a queue holds publishers back it shows `blocked`, and /metrics a 0/1 gauge:
    no event counter that vanishes when the queue drains."""
    await broker.declare_queue(
        QueueConfig(name="fc", max_messages=1, overflow="flow_control", resume_percent=50)
    )
    assert (await admin.publish("fc", "m0")).status == 200
    held = broker.publish_nowait(Message(destination="fc", payload=b"m1", to_queue=True))
    await asyncio.sleep(0.3)
    assert not held.done()
    info = (await admin.get("/api/v1/queues/fc")).body
    assert info["blocked"] is True and "blocked" not in info["counters"]
    text = (await admin.get("/metrics")).raw.decode()
    assert "# TYPE gateway_queue_blocked gauge" in text
    assert 'gateway_queue_blocked{queue="fc"} 1' in text.splitlines()
    assert "gateway_queue_blocked_total" not in text
    assert len(await admin.take("fc")) == 1  # drained: the held publish goes
    assert await asyncio.wait_for(held, 5) is Outcome.OK
    assert (await admin.get("/api/v1/queues/fc")).body["blocked"] is False


async def test_delete_with_an_unread_body_field_is_refused(admin: Admin) -> None:
    """Unknown fields are refused, in a DELETE's body too: {"if_empty": true} (RabbitMQ's
    guard) ignored deleted the queue with its messages."""
    assert (await admin.create("keepme")).status == 201
    assert (await admin.publish("keepme", "precious")).status == 200
    reply = await admin.request("DELETE", q("keepme"), {"if_empty": True})
    assert reply.status == 400, (reply.status, reply.raw)
    assert "if_empty" in reply.error
    assert await admin.depth("keepme") == 1


def _post_big(port: int, size: int) -> object:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        body = b'{"topic": "a/b", "payload": "' + b"x" * size + b'"}'
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/api/v1/messages", body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status
    except OSError as exc:
        return repr(exc)
    finally:
        conn.close()


async def test_an_over_large_body_gets_its_413(admin: Admin) -> None:
    """Answered as soon as the head is read, while the client still sends the body: a
    lingering close (RFC 9112 §9.6) lets a client that reads only once it sent all (Python's
    http.client, urllib, requests) read the 413 rather than a reset connection."""
    result = await asyncio.to_thread(_post_big, admin.port, 17 * 1024 * 1024)
    assert result == 413, result


async def test_expect_100_continue_is_answered(admin: Admin) -> None:
    """RFC 9110 §10.1.1: curl sends `Expect: 100-continue` for bodies over 1 MiB and,
    unanswered, waits a second before it sends the body."""
    assert (await admin.create("big")).status == 201
    body = b'{"payload": "' + b"x" * 2_000_000 + b'"}'
    reader, writer = await asyncio.open_connection("127.0.0.1", admin.port)
    try:
        writer.write(
            b"POST /api/v1/queues/big/messages HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        await writer.drain()
        try:
            first = await asyncio.wait_for(reader.readline(), 0.5)
        except TimeoutError:
            first = b"(nothing within 0.5 s)"
        assert first.startswith(b"HTTP/1.1 100"), first
    finally:
        writer.close()


async def test_a_get_without_timeout_takes_what_waits_in_a_partitioned_queue(
    admin: Admin,
) -> None:
    """Its flow fetches once the rebalance gives it partitions (after the queue's
    partition_rebalance_delay_ms): it waited one dispatch round, and answered []."""
    assert (await admin.create("orders", partition_count=4)).status == 201
    for i in range(3):
        assert (await admin.publish("orders", f"m{i}", partition_key=f"k{i}")).status == 200
    reply = await admin.post(q("orders", "get"), {"count": 10, "ackmode": "ack"})
    assert reply.status == 200, reply
    assert sorted(m["payload"] for m in reply.body) == ["m0", "m1", "m2"]
    empty = await admin.post(q("orders", "get"), {"count": 10})
    assert empty.status == 200 and empty.body == []


def _sample(text: str, series: str) -> int:
    rows = [line for line in text.splitlines() if line.startswith(series + " ")]
    assert len(rows) == 1, rows
    return int(rows[0].rsplit(" ", 1)[1])


async def test_queue_counters_never_go_back_when_it_is_repartitioned(admin: Admin) -> None:
    """Prometheus reads a counter that went back as a reset: the counters of the partitions
    a repartition deletes stay the queue's."""
    assert (await admin.create("pq", partition_count=4)).status == 201
    for i in range(8):
        assert (await admin.publish("pq", f"m{i}", partition_key=f"k{i}")).status == 200
    assert len(await admin.take("pq", count=8)) == 8
    series = ('gateway_queue_spooled_total{queue="pq"}', 'gateway_queue_acked_total{queue="pq"}')
    text = (await admin.get("/metrics")).raw.decode()
    assert [_sample(text, s) for s in series] == [8, 8]
    assert (await admin.request("PATCH", q("pq"), {"egress_enabled": False})).status == 200
    for count in (1, 0, 2):  # fewer partitions, none, some again
        reply = await admin.request("PATCH", q("pq"), {"partition_count": count})
        assert reply.status == 200, reply
        text = (await admin.get("/metrics")).raw.decode()
        assert [_sample(text, s) for s in series] == [8, 8], count


async def test_a_get_without_timeout_from_an_exclusive_queue_another_consumer_holds(
    admin: Admin, broker: Broker
) -> None:
    """Its flow is a standby and never fetches: it answers [] within a round or so."""
    await broker.declare_queue(QueueConfig(name="x", access_type="exclusive"))
    flow = await broker.bind("x", lambda d: None)
    try:
        assert (await admin.publish("x", "m")).status == 200
        started = asyncio.get_running_loop().time()
        reply = await admin.post(q("x", "get"), {"count": 1})
        took = asyncio.get_running_loop().time() - started
        assert reply.status == 200 and reply.body == []
        assert took < 0.5, took
    finally:
        await flow.close()
