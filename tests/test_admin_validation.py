"""Input validation of every admin API endpoint, over real sockets against a real Redis.

Each bad input must get a 4xx whose message names the field, leave the queues as they
were (nothing half-created or half-changed) and never a 500; what is accepted must stay
readable and deliverable. JSON carries what no protocol can (lone surrogates such as
"\\ud800", NaN, numbers beyond 64 bits), so these are the inputs tried first.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

import pytest

from gateway.admin.http import MAX_BODY
from tests.test_admin_api import Admin, Reply, q

QUEUES = "/api/v1/queues"
MESSAGES = "/api/v1/messages"


async def raw_http(port: int, head: str, body: bytes = b"", length: int | None = None) -> Reply:
    """One request as written (target, headers and body not touched by a client library);
    `head` is the request line and headers without the blank line; `length` the declared
    Content-Length (default: the body's)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        declared = len(body) if length is None else length
        writer.write(
            f"{head}\r\nHost: x\r\nConnection: close\r\nContent-Length: {declared}\r\n\r\n".encode()
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
        ({"name": "ok", "owner": "\udfff"}, "owner"),
        ({"name": "ok", "lvq_key": "k\ud800"}, "lvq_key"),
        ({"name": "ok", "default_group": "\ud800"}, "default_group"),
        ({"name": "ok", "subscription_selector": "a = '\ud800'"}, "subscription_selector"),
        ({"name": "ok", "dead_message_queue": "\ud800"}, "dead_message_queue"),
        ({"name": "ok", "vpn": "\ud800"}, "vpn"),
        ({"name": "ok", "subscriptions": [{"pattern": "a\ud800"}]}, "subscriptions[0].pattern"),
    ],
)
async def test_create_refuses_bad_values(admin: Admin, body: dict, needle: str) -> None:
    refused(await admin.post(QUEUES, body), needle)
    assert await queue_list(admin) == []  # nothing half-created
    assert (await admin.get(q("ok"))).status == 404


# -- changing a queue -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"owner": "\ud800"}, "owner"),
    ],
)
async def test_patch_refuses_bad_values(admin: Admin, changes: dict, needle: str) -> None:
    await admin.create("q1")
    await admin.publish("q1", "keep")
    before = await shown(admin, "q1")
    refused(await admin.request("PATCH", q("q1"), changes), needle)
    assert await shown(admin, "q1") == before  # nothing applied, and still readable


# -- topic subscriptions ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"pattern": "a\ud800"}, "pattern"),
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
        ({"topic": "t/\ud800"}, "topic"),
        ({"topic": "t/a", "user_properties": {"\ud800": 1}}, "user_properties"),
    ],
)
async def test_publish_refuses_bad_values(admin: Admin, body: dict, needle: str) -> None:
    await admin.create("q1", subscriptions=["t/>"])
    refused(await admin.post(MESSAGES, body), needle)
    assert await admin.depth("q1") == 0


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


async def test_a_body_declared_over_the_limit_is_refused_before_it_is_read(admin: Admin) -> None:
    """Not after reading 16 MiB of it: the answer comes while the client is still sending."""
    head = "POST /api/v1/queues HTTP/1.1"
    reply = await raw_http(admin.port, head, b'{"name": "x', length=MAX_BODY + 1)
    refused(reply, "too large", status=413)
    assert await queue_list(admin) == []
    assert (await admin.get("/api/v1/health")).status == 200
