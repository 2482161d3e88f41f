"""Input validation of every admin API endpoint, over real sockets against a real Redis.

Each bad input must get a 4xx whose message names the field, leave the queues as they
were (nothing half-created or half-changed) and never a 500; what is accepted must stay
readable and deliverable. JSON carries what no protocol can (lone surrogates such as
"\\ud800", NaN, numbers beyond 64 bits), so these are the inputs tried first.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admin.api import MESSAGE_FIELDS
from gateway.admin.http import MAX_BODY
from gateway.broker import Broker
from gateway.engine import keys
from gateway.engine.queues import MAX_CONFIG_INT
from tests.conftest import CLIENT_TIMEOUT, Ports
from tests.test_admin_api import Admin, Reply, q

QUEUES = "/api/v1/queues"
MESSAGES = "/api/v1/messages"


async def raw_http(
    port: int, head: str | bytes, body: bytes = b"", length: int | None = None
) -> Reply:
    """One request as written (target, headers and body not touched by a client library);
    `head` is the request line and headers without the blank line; `length` the declared
    Content-Length (default: the body's)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        declared = len(body) if length is None else length
        start = head.encode() if isinstance(head, str) else head
        writer.write(
            start
            + f"\r\nHost: x\r\nConnection: close\r\nContent-Length: {declared}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    _headers, _, raw = rest.partition(b"\r\n\r\n")
    return Reply(int(status_line.split()[1]), {}, raw)


def refused(reply: Reply, *needles: str, status: int = 400) -> None:
    assert reply.status == status, (reply.status, reply.raw)
    for needle in needles:
        assert needle in reply.error, (needle, reply.error)


async def queue_list(admin: Admin) -> list[str]:
    reply = await admin.get(QUEUES)
    assert reply.status == 200, reply
    return [row["name"] for row in reply.body]


async def shown(admin: Admin, name: str) -> dict[str, Any]:
    reply = await admin.get(q(name))
    assert reply.status == 200, reply
    return reply.body


# -- creating a queue -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"name": "\ud800"}, "name"),
        ({"name": ["q"]}, "name"),
        ({"name": "ok", "owner": "\udfff"}, "owner"),
        ({"name": "ok", "owner": 7}, "owner"),
        ({"name": "ok", "lvq_key": "k\ud800"}, "lvq_key"),
        ({"name": "ok", "lvq_key": "a\x00b"}, "lvq_key"),
        ({"name": "ok", "sort_key": "a\x00b"}, "sort_key"),
        ({"name": "ok", "default_group": "\ud800"}, "default_group"),
        ({"name": "ok", "default_group": None}, "default_group"),
        ({"name": "ok", "lvq_key": None}, "lvq_key"),  # was stored as the key "None"
        ({"name": "ok", "sort_key": None}, "sort_key"),
        ({"name": "ok", "subscription_selector": None}, "subscription_selector"),
        ({"name": "ok", "subscription_selector": "a = '\ud800'"}, "subscription_selector"),
        ({"name": "ok", "dead_message_queue": "\ud800"}, "dead_message_queue"),
        ({"name": "ok", "dead_message_queue": ""}, "dead_message_queue"),
        ({"name": "ok", "dead_message_queue": "bad*dmq"}, "dead_message_queue"),
        ({"name": "ok", "resume_percent": 50.5}, "resume_percent"),
        ({"name": "ok", "resume_percent": True}, "resume_percent"),
        ({"name": "ok", "resume_percent": "50"}, "resume_percent"),
        ({"name": "ok", "resume_percent": None}, "resume_percent"),
        ({"name": "ok", "resume_percent": 0}, "resume_percent"),
        ({"name": "ok", "max_messages": True}, "max_messages"),
        ({"name": "ok", "max_messages": 1.0}, "max_messages"),
        ({"name": "ok", "max_messages": MAX_CONFIG_INT + 1}, "max_messages"),
        ({"name": "ok", "max_ttl_ms": 10**17}, "max_ttl_ms"),
        ({"name": "ok", "max_redelivery": 2**64}, "max_redelivery"),
        ({"name": "ok", "partition_rebalance_delay_ms": -1}, "partition_rebalance_delay_ms"),
        ({"name": "ok", "partition_count": 1025}, "partition_count"),
        ({"name": "ok", "durable": 1}, "durable"),
        ({"name": "ok", "priorities": None}, "priorities"),
        ({"name": "ok", "priorities": True, "lvq_key": "sym"}, "last value queue"),
        ({"name": "ok", "priorities": True, "max_spool_bytes": 0}, "last value queue"),
        ({"name": "ok", "permission": ["consume"]}, "permission"),
        ({"name": "ok", "vpn": "\ud800"}, "vpn"),
        ({"name": "ok", "created_ms": 5}, "created_ms"),
        ({"name": "ok", "subscriptions": [{"pattern": "a", "sintax": "mqtt"}]}, "sintax"),
        ({"name": "ok", "subscriptions": [{"pattern": "a", "syntax": 1}]}, "syntax"),
        ({"name": "ok", "subscriptions": [{"pattern": "a", "syntax": ["mqtt"]}]}, "syntax"),
        ({"name": "ok", "subscriptions": [{"pattern": "a\ud800"}]}, "subscriptions[0].pattern"),
        ({"name": "ok", "subscriptions": ["ok/>", 5]}, "subscription"),
        ({"name": "ok", "subscriptions": None}, "subscriptions"),
    ],
)
async def test_create_refuses_bad_values(admin: Admin, body: dict, needle: str) -> None:
    refused(await admin.post(QUEUES, body), needle)
    assert await queue_list(admin) == []  # nothing half-created
    assert (await admin.get(q("ok"))).status == 404


async def test_refused_creates_leave_the_queue_list_working(admin: Admin) -> None:
    """A refused create must not have stored a config that every later read fails on."""
    await admin.create("kept")
    for body in ({"name": "ok", "resume_percent": 50.5}, {"name": "ok", "owner": "\ud800"}):
        assert (await admin.post(QUEUES, body)).status == 400
    assert await queue_list(admin) == ["kept"]
    assert (await admin.create("ok")).status == 201
    assert await queue_list(admin) == ["kept", "ok"]


async def test_the_largest_integers_accepted_are_honoured(admin: Admin) -> None:
    """A longer max_ttl_ms once made every message vanish: the expiry it gave went past
    what the Redis functions' double-precision numbers print as an integer."""
    created = await admin.create("long", max_ttl_ms=MAX_CONFIG_INT, max_messages=MAX_CONFIG_INT)
    assert created.status == 201, created
    assert created.body["max_ttl_ms"] == MAX_CONFIG_INT
    assert (await admin.publish("long", "kept")).status == 200
    got = await admin.take("long")
    assert [m["payload"] for m in got] == ["kept"]


# -- changing a queue -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"resume_percent": 50.5}, "resume_percent"),
        ({"resume_percent": "5"}, "resume_percent"),
        ({"resume_percent": False}, "resume_percent"),
        ({"owner": "\ud800"}, "owner"),
        ({"owner": 5}, "owner"),
        ({"max_messages": 2**70}, "max_messages"),
        ({"max_message_size": None}, "max_message_size"),
        ({"max_spool_bytes": 1.5}, "max_spool_bytes"),
        ({"partition_count": True}, "partition_count"),
        ({"partition_count": 1.0}, "partition_count"),
        ({"overflow": None}, "overflow"),
        ({"ingress_enabled": 0}, "ingress_enabled"),
        ({"name": "other"}, "name"),
        ({"ingress_enabled": False, "max_messages": -1}, "max_messages"),
    ],
)
async def test_patch_refuses_bad_values(admin: Admin, changes: dict, needle: str) -> None:
    await admin.create("q1")
    await admin.publish("q1", "keep")
    before = await shown(admin, "q1")
    refused(await admin.request("PATCH", q("q1"), changes), needle)
    assert await shown(admin, "q1") == before  # nothing applied, and still readable


async def test_patch_with_a_repartition_is_all_or_nothing(admin: Admin) -> None:
    """The repartition ran before the other changes were stored: a bad value among them
    left the queue repartitioned and its config unreadable."""
    await admin.create("pq", egress_enabled=False)
    before = await shown(admin, "pq")
    for bad in ({"resume_percent": 50.5}, {"max_messages": MAX_CONFIG_INT + 1}):
        reply = await admin.request("PATCH", q("pq"), {"partition_count": 2, **bad})
        refused(reply, *bad)
        assert await shown(admin, "pq") == before
    ok = await admin.request("PATCH", q("pq"), {"partition_count": 2, "resume_percent": 50})
    assert ok.status == 200, ok
    assert (ok.body["partition_count"], ok.body["resume_percent"]) == (2, 50)


async def test_a_limit_stored_before_the_bound_still_lets_the_queue_change(
    admin: Admin, broker: Broker
) -> None:
    """A queue stored with a limit past MAX_CONFIG_INT (legal before it was bounded) reads
    as the bound, so an unrelated change is not refused for the old value."""
    await admin.create("old")
    await broker.redis.hset(keys.queue_config("old"), "max_spool_bytes", str(10**16))
    assert (await shown(admin, "old"))["max_spool_bytes"] == MAX_CONFIG_INT
    reply = await admin.request("PATCH", q("old"), {"ingress_enabled": False})
    assert reply.status == 200, reply
    assert (reply.body["ingress_enabled"], reply.body["max_spool_bytes"]) == (
        False,
        MAX_CONFIG_INT,
    )


# -- topic subscriptions ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"pattern": "a", "sintax": "mqtt"}, "sintax"),
        ({"pattern": "a", "syntax": True}, "syntax"),
        ({"pattern": "a", "syntax": ""}, "syntax"),
        ({"pattern": "a\ud800"}, "pattern"),
        ({"pattern": ["a"]}, "pattern"),
        ({"pattern": ""}, "empty"),
        ({"pattern": "a\x00b"}, "U+0000"),
    ],
)
async def test_subscribe_refuses_bad_values(admin: Admin, body: dict, needle: str) -> None:
    await admin.create("q1", subscriptions=["kept/>"])
    refused(await admin.post(q("q1", "subscriptions"), body), needle)
    assert (await shown(admin, "q1"))["subscriptions"] == [{"pattern": "kept/>", "syntax": "smf"}]


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("pattern=kept%2F%3E&syntax=", "syntax"),  # blank: not the default smf
        ("pattern=kept%2F%3E&pattern=other", "pattern"),  # which one?
        ("pattern=kept%2F%FF", "UTF-8"),  # once removed kept/\ufffd, i.e. nothing
        ("pattern=kept%2F%ED%A0%80", "UTF-8"),  # an encoded surrogate
        ("pattern=", "pattern"),
    ],
)
async def test_unsubscribe_refuses_bad_queries(admin: Admin, query: str, needle: str) -> None:
    await admin.create("q1", subscriptions=["kept/>"])
    reply = await raw_http(admin.port, f"DELETE /api/v1/queues/q1/subscriptions?{query} HTTP/1.1")
    refused(reply, needle)
    assert (await shown(admin, "q1"))["subscriptions"] == [{"pattern": "kept/>", "syntax": "smf"}]


# -- names in the path ------------------------------------------------------------------------


@pytest.mark.parametrize("escaped", ["%FF", "%ED%A0%80", "%C3"])
async def test_path_segments_must_be_utf8(admin: Admin, escaped: str) -> None:
    """Decoded with replacement characters, a bad name named the queue "\\ufffd"."""
    await admin.create("\ufffd")
    await admin.publish("\ufffd", "keep")
    for head in (
        f"DELETE /api/v1/queues/{escaped} HTTP/1.1",
        f"GET /api/v1/queues/{escaped} HTTP/1.1",
        f"POST /api/v1/queues/{escaped}/get HTTP/1.1",
        f"DELETE /api/v1/queues/%EF%BF%BD/readers/{escaped} HTTP/1.1",
    ):
        refused(await raw_http(admin.port, head), "UTF-8")
    assert await queue_list(admin) == ["\ufffd"]
    assert await admin.depth("\ufffd") == 1


async def test_reader_names_are_taken_as_given(admin: Admin) -> None:
    await admin.create("q1")
    for reader in ("x", "a/b", "\ufffd", "%"):
        missing = await admin.request("DELETE", q("q1", "readers", quote(reader, safe="")))
        refused(missing, repr(reader), status=404)
    refused(await admin.request("DELETE", q("nope", "readers", "x")), "nope", status=404)


# -- publishing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"topic": 5}, "topic"),
        ({"topic": ["t/a"]}, "topic"),
        ({"queue": 5}, "queue"),
        ({"queue": None, "topic": None}, "queue or topic"),
        ({"topic": "t/\ud800"}, "topic"),
        ({"topic": "t/a", "payload": 5}, "payload"),
        ({"topic": "t/a", "payload": {"text": "x"}}, "payload"),
        ({"topic": "t/a", "payload_base64": None}, "payload_base64"),
        ({"topic": "t/a", "priority": True}, "priority"),
        ({"topic": "t/a", "priority": 4.0}, "priority"),
        ({"topic": "t/a", "persistent": "false"}, "persistent"),
        ({"topic": "t/a", "persistent": 0}, "persistent"),
        ({"topic": "t/a", "partition_key": 7}, "partition_key"),
        ({"topic": "t/a", "user_properties": {"n": -(2**63) - 1}}, "'n'"),
        ({"topic": "t/a", "user_properties": {"n": 2**64}}, "'n'"),
        ({"topic": "t/a", "user_properties": {"\ud800": 1}}, "user_properties"),
        ({"topic": "t/a", "paylod": "x"}, "paylod"),
    ],
)
async def test_publish_refuses_bad_values(admin: Admin, body: dict, needle: str) -> None:
    await admin.create("q1", subscriptions=["t/>"])
    refused(await admin.post(MESSAGES, body), needle)
    assert await admin.depth("q1") == 0


async def test_publish_keeps_properties_deliverable_over_amqp(ports: Ports) -> None:
    """The integer limits are AMQP's (a long, or a ulong past a long's range): what is
    accepted reaches an AMQP consumer as it was sent (2**64 once stopped the queue's AMQP
    deliveries)."""
    admin = ports.admin
    await admin.create("q1")
    props = {"max": 2**64 - 1, "long": 2**63 - 1, "min": -(2**63), "f": 1.5, "b": True, "s": "é"}
    assert (await admin.publish("q1", "x", user_properties=props)).status == 200

    def receive() -> dict[str, Any]:
        conn = ports.connect()
        try:
            receiver = conn.create_receiver("q1")
            message = receiver.receive(timeout=CLIENT_TIMEOUT)
            receiver.accept()
            return dict(message.properties)
        finally:
            conn.close()

    assert await asyncio.to_thread(receive) == props
    assert await admin.depth("q1") == 0


async def test_a_header_the_api_reads_given_twice_is_refused(admin: Admin) -> None:
    """Which value would count is a guess: refused, and nothing published."""
    await admin.create("q1")
    body = b'{"payload": "x"}'
    publish = "POST /api/v1/queues/q1/messages HTTP/1.1"
    twice = f"{publish}\r\nSolace-User-Property-colour: red\r\nSolace-User-Property-Colour: blue"
    refused(await raw_http(admin.port, twice, body), "solace-user-property-colour", "more than")
    assert await admin.depth("q1") == 0
    auth = "GET /api/v1/queues HTTP/1.1\r\nAuthorization: Basic eDp5\r\nAuthorization: Basic eDp6"
    refused(await raw_http(admin.port, auth), "authorization", "more than once")
    other = f"{publish}\r\nAccept: text/plain\r\nAccept: application/json"  # not read: fine
    assert (await raw_http(admin.port, other, body)).status == 200
    assert await admin.depth("q1") == 1


async def test_publish_null_payload_is_empty(admin: Admin) -> None:
    """It was published as the text "None"."""
    await admin.create("q1")
    assert (await admin.post(q("q1", "messages"), {"payload": None})).status == 200
    [got] = await admin.take("q1")
    assert got["payload"] == ""


async def test_publish_header_property_needs_a_name(admin: Admin) -> None:
    await admin.create("q1")
    body = b'{"payload": "x"}'
    head = "POST /api/v1/queues/q1/messages HTTP/1.1\r\nSolace-User-Property-: v"
    refused(await raw_http(admin.port, head, body), "Solace-User-Property-")
    assert await admin.depth("q1") == 0
    named = "POST /api/v1/queues/q1/messages HTTP/1.1\r\nSolace-User-Property-colour: red"
    assert (await raw_http(admin.port, named, body)).status == 200
    [got] = await admin.take("q1")
    assert got["user_properties"] == {"colour": "red"}


async def test_publish_header_properties_are_utf8(admin: Admin) -> None:
    await admin.create("q1")
    body = b'{"payload": "x"}'
    head = "POST /api/v1/queues/q1/messages HTTP/1.1\r\nSolace-User-Property-city: Zürich"
    assert (await raw_http(admin.port, head, body)).status == 200  # sent as UTF-8
    [got] = await admin.take("q1")
    assert got["user_properties"] == {"city": "Zürich"}
    bad = b"POST /api/v1/queues/q1/messages HTTP/1.1\r\nSolace-User-Property-city: \xff"
    refused(await raw_http(admin.port, bad, body), "solace-user-property-city", "UTF-8")
    assert await admin.depth("q1") == 0


# -- getting ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"cout": 5}, "cout"),
        ({"count": 2**64}, "count"),
        ({"timeout_ms": 1.5}, "timeout_ms"),
        ({"browse": "true"}, "browse"),
        ({"browse": 1}, "browse"),
        ({"ackmode": ["ack"]}, "ackmode"),
        ({"ackmode": None}, "ackmode"),
        ({"selector": "a = 1"}, "selector"),
    ],
)
async def test_get_refuses_bad_values(admin: Admin, body: dict, needle: str) -> None:
    await admin.create("q1")
    await admin.publish("q1", "keep")
    refused(await admin.post(q("q1", "get"), body), needle)
    assert await admin.depth("q1") == 1


# -- the request as a whole -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"name": "ok", "max_messages": NaN}', "NaN"),
        (b'{"name": "ok", "max_messages": Infinity}', "Infinity"),
        (b'{"topic": "t/a", "user_properties": {"f": -Infinity}}', "-Infinity"),
        (b'{"queue": "q1", "user_properties": {"f": NaN}}', "NaN"),
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, "nested"),
    ],
)
async def test_bodies_must_be_strict_json(admin: Admin, raw: bytes, needle: str) -> None:
    await admin.create("q1", subscriptions=["t/>"])
    before = await shown(admin, "q1")
    for path in (QUEUES, MESSAGES, q("q1", "get"), q("q1", "subscriptions")):
        refused(await admin.post(path, raw=raw), needle)
    refused(await admin.request("PATCH", q("q1"), raw=raw), needle)
    assert await queue_list(admin) == ["q1"]
    assert await shown(admin, "q1") == before


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("POST", "/api/v1/spool", "GET"),
        ("PUT", MESSAGES, "POST"),
        ("GET", MESSAGES, "POST"),
        ("POST", "/metrics", "GET"),
        ("POST", "/api/v1/health", "GET"),
        ("PUT", QUEUES, "GET, POST"),
        ("POST", q("q1"), "GET, PATCH, DELETE"),
        ("GET", q("q1", "subscriptions"), "POST, DELETE"),
        ("PUT", q("q1", "subscriptions"), "POST, DELETE"),
        ("GET", q("q1", "messages"), "POST"),
        ("DELETE", q("q1", "get"), "POST"),
        ("GET", q("q1", "readers", "spark"), "DELETE"),
    ],
)
async def test_wrong_method_on_a_resource_is_405_with_allow(
    admin: Admin, method: str, path: str, allow: str
) -> None:
    reply = await admin.request(method, path, {})
    refused(reply, method, status=405)
    assert reply.headers.get("Allow") == allow, reply.headers


@pytest.mark.parametrize("path", [q("q1", "nothing"), "/api/v1", "/api/v1/queues/q1/readers"])
async def test_a_path_naming_no_resource_is_404(admin: Admin, path: str) -> None:
    for method in ("GET", "POST"):
        reply = await admin.request(method, path, {})
        refused(reply, "no such resource", status=404)
        assert "Allow" not in reply.headers


async def test_a_body_declared_over_the_limit_is_refused_before_it_is_read(admin: Admin) -> None:
    """Not after reading 16 MiB of it: the answer comes while the client is still sending."""
    head = "POST /api/v1/queues HTTP/1.1"
    reply = await raw_http(admin.port, head, b'{"name": "x', length=MAX_BODY + 1)
    refused(reply, "too large", status=413)
    assert await queue_list(admin) == []
    assert (await admin.get("/api/v1/health")).status == 200


# -- any value in any field -------------------------------------------------------------------

CONFIG_FIELDS = [
    "name", "access_type", "durable", "owner", "ingress_enabled", "egress_enabled",
    "max_message_size", "max_spool_bytes", "max_messages", "max_redelivery",
    "dead_message_queue", "max_ttl_ms", "respect_ttl", "dmq_eligible_default",
    "partition_count", "partition_rebalance_delay_ms", "partition_handoff_timeout_ms",
    "message_groups", "default_group", "non_destructive", "lvq_key", "priorities",
    "sort_key", "subscription_selector", "permission", "auto_delete", "overflow",
    "resume_percent", "vpn",
]  # fmt: skip
RUNTIME_FIELDS = [
    "permission", "overflow", "resume_percent", "ingress_enabled", "egress_enabled",
    "max_message_size", "max_spool_bytes", "max_messages", "owner", "partition_count",
]  # fmt: skip

LONE_SURROGATE = st.characters(categories=["Cs"])  # one: two may be a pair in JSON
JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 80, 100, 1024, MAX_CONFIG_INT, MAX_CONFIG_INT + 1, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.builds(str.__add__, st.text(max_size=3), LONE_SURROGATE),
    st.sampled_from(["exclusive", "ring", "shared", "consume", "a = 1", "default", "a\x00"]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
PROPERTY_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def stored_as(field: str, value: object) -> object:
    """What a queue shows for an accepted value (an empty owner is no owner; an empty
    permission is none given: the default, consume)."""
    if value == "" and field in ("owner", "permission"):
        return None if field == "owner" else "consume"
    return value


def call(admin: Admin, method: str, path: str, body: object = None) -> Reply:
    """A request from the property tests' thread (the server runs on the test's loop)."""
    data = None if body is None else json.dumps(body).encode()
    return admin._call(method, path, data, "application/json" if data else None)


def no_queues(admin: Admin) -> None:
    """Start each example afresh, whatever an earlier failing one left."""
    for row in call(admin, "GET", QUEUES).body:
        call(admin, "DELETE", q(row["name"]))


def check_accepted_queue(admin: Admin, name: str) -> None:
    """The queue reads back, and a message published to it can be got, or is refused as
    the queue's settings say (too large, ingress disabled, full; egress disabled)."""
    assert call(admin, "GET", q(name)).status == 200
    published = call(admin, "POST", q(name, "messages"), {"payload": "m"})
    assert published.status in (200, 413, 503, 507), published
    got = call(admin, "POST", q(name, "get"), {"count": 1})
    assert got.status in (200, 409), got
    assert call(admin, "GET", QUEUES).status == 200


async def test_create_with_any_value_in_any_field(admin: Admin) -> None:
    @PROPERTY_SETTINGS
    @given(field=st.sampled_from(CONFIG_FIELDS), value=JSON_VALUES)
    def create(field: str, value: object) -> None:
        no_queues(admin)
        body = {"name": "h", field: value}
        reply = call(admin, "POST", QUEUES, body)
        assert reply.status in (201, 400), (body, reply)
        if reply.status == 400:
            assert field in reply.error, (body, reply.error)
            assert call(admin, "GET", QUEUES).body == []
            return
        assert reply.body[field] == stored_as(field, value)
        check_accepted_queue(admin, body["name"])

    await asyncio.to_thread(create)


async def test_patch_with_any_value_in_any_runtime_field(admin: Admin) -> None:
    @PROPERTY_SETTINGS
    @given(field=st.sampled_from(RUNTIME_FIELDS), value=JSON_VALUES)
    def patch(field: str, value: object) -> None:
        no_queues(admin)
        assert call(admin, "POST", QUEUES, {"name": "p", "egress_enabled": False}).status == 201
        before = call(admin, "GET", q("p")).body
        reply = call(admin, "PATCH", q("p"), {field: value})
        assert reply.status in (200, 400), (field, value, reply)
        if reply.status == 400:
            assert field in reply.error, (field, value, reply.error)
            assert call(admin, "GET", q("p")).body == before
            return
        assert reply.body[field] == stored_as(field, value)
        check_accepted_queue(admin, "p")

    await asyncio.to_thread(patch)


async def test_publish_with_any_value_in_any_field(admin: Admin) -> None:
    await admin.create("m")

    @PROPERTY_SETTINGS
    @given(field=st.sampled_from(MESSAGE_FIELDS), value=JSON_VALUES)
    def publish(field: str, value: object) -> None:
        reply = call(admin, "POST", q("m", "messages"), {field: value})
        assert reply.status in (200, 400), (field, value, reply)
        if reply.status == 400:
            named = field.replace("_properties", " propert")  # user property 'k' ...
            assert field in reply.error or named in reply.error, (field, value, reply.error)
            assert call(admin, "GET", q("m")).body["messages"] == 0
            return
        [got] = call(admin, "POST", q("m", "get"), {"count": 1}).body
        if field == "user_properties":
            assert got["user_properties"] == value

    await asyncio.to_thread(publish)
