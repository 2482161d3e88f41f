"""gw_spool's two message forms (full and short) store the same entries and counters."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from gateway.engine import keys, library
from gateway.engine.queues import QueueConfig
from gateway.engine.spool import short_head

BLOB = b"\x96\x01\xc4\x03abc\xa1t\xa1i\x00\xc0"


@pytest.fixture
async def client(redis_url: str) -> aioredis.Redis:
    r = await library.connect(redis_url)
    yield r
    await r.aclose()


async def declare(r: aioredis.Redis, config: QueueConfig) -> None:
    assert await r.fcall("gw_queue_create", 0, config.name, *config.to_redis()) == [1]


def full(index: int, lo: int, blob: bytes) -> list[object]:
    return [1, index, 0, len(blob), 0, lo, "", 0, "", 4, 0, blob]


def short(
    index: int, lo: int, blob: bytes, priority: int = 4, direct: bool = False
) -> list[object]:
    return [short_head([index], False, len(blob), lo, priority), blob]


async def entries(r: aioredis.Redis, queue: str) -> list[dict]:
    return [fields for _, fields in await r.xrange(keys.queue_stream(queue))]


async def test_short_and_full_forms_store_the_same(client: aioredis.Redis) -> None:
    for name in ("full", "short"):
        await declare(client, QueueConfig(name=name))
    body = [
        *full(1, 7, BLOB),
        *short(2, 7, BLOB),
        *full(1, 8, BLOB + b"x"),
        *short(2, 8, BLOB + b"x"),
    ]
    codes = await client.fcall("gw_spool", 0, "n1", 2, "full", "short", *body)
    assert codes == [0, 0, 0, 0]
    assert await entries(client, "full") == await entries(client, "short")
    assert len(await entries(client, "short")) == 2
    stats = [
        await client.hmget(keys.queue_stats(q), "msgs", "bytes", "spooled")
        for q in ("full", "short")
    ]
    assert stats[0] == stats[1] == [b"2", str(2 * len(BLOB) + 1).encode(), b"2"]


async def test_short_form_picks_partition_and_priority(client: aioredis.Redis) -> None:
    await declare(client, QueueConfig(name="parts", partition_count=3))
    await declare(client, QueueConfig(name="prio", priorities=True))
    body = [*short(1, 5, BLOB), *short(2, 0, BLOB, priority=9)]
    assert await client.fcall("gw_spool", 0, "n1", 2, "parts", "prio", *body) == [0, 0]
    # a keyless message's partition: the low hash bits modulo the partition count (hi is 0)
    assert len(await entries(client, "#P/2/parts")) == 1
    assert len(await entries(client, "#R/9/prio")) == 1


async def test_short_form_refusals(client: aioredis.Redis) -> None:
    await declare(client, QueueConfig(name="small", max_message_size=2))
    body = [*short(1, 0, BLOB), short_head([2], True, 1, 0, 4), BLOB]
    codes = await client.fcall("gw_spool", 0, "n1", 2, "small", "nosuch", *body)
    assert codes == [4, 2]  # TOO_LARGE, NOT_FOUND (direct to a missing queue)
    assert await entries(client, "small") == []


async def test_short_form_fans_out_to_several_queues(client: aioredis.Redis) -> None:
    for name in ("a", "b", "c"):
        await declare(client, QueueConfig(name=name))
    body = [
        short_head([3, 1], False, len(BLOB), 0, 4),
        BLOB,
        *full(2, 0, BLOB),
        short_head([1, 2, 3], False, len(BLOB) + 1, 0, 4),
        BLOB + b"x",
    ]
    assert await client.fcall("gw_spool", 0, "n1", 3, "a", "b", "c", *body) == [0, 0, 0]
    assert await entries(client, "a") == [{b"m": BLOB}, {b"m": BLOB + b"x"}]
    assert await entries(client, "b") == [{b"m": BLOB}, {b"m": BLOB + b"x"}]
    assert await entries(client, "c") == [{b"m": BLOB}, {b"m": BLOB + b"x"}]


async def test_a_marked_message_is_stored_once_however_often_it_comes(
    client: aioredis.Redis,
) -> None:
    """gw_spool_marked records a marked message's member in its set in the step that
    stores it; a message whose member is there is answered OK and not stored again, while
    unmarked ones of the same call are stored as gw_spool stores them. A mark counts until
    a later connection starts a new session, and is recorded while the session lasts."""
    await declare(client, QueueConfig(name="q"))
    await client.hset("claims", mapping={"holder": "n1 6", "last": 6})  # a later one resumed
    body = [*short(1, 0, BLOB), *full(1, 0, BLOB + b"m"), *short(1, 0, BLOB + b"u")]
    call = ["gw_spool_marked", 3, "seen", "claims", "state", "2 7 5", "n1", 1, "q", *body]
    assert await client.fcall(*call) == [0, 0, 0]
    assert await client.smembers("seen") == {b"7"}
    assert await client.fcall(*call) == [0, 0, 0]  # resent: its marked message is known
    stored = [e[b"m"] for e in await entries(client, "q")]
    assert stored == [BLOB, BLOB + b"m", BLOB + b"u", BLOB, BLOB + b"u"]
    assert await client.hget(keys.queue_stats("q"), "msgs") == b"5"
    marked = ["gw_spool_marked", 3, "seen", "claims", "state"]
    missing = [short_head([1], True, 1, 0, 4), BLOB]
    assert await client.fcall(*marked, "1 8 5", "n1", 1, "nosuch", *missing) == [2]
    assert await client.smembers("seen") == {b"7"}  # NOT_FOUND: unrecorded, may come again
    # a new session (a clean start, or none stored), which clears what the last one left
    assert await client.fcall("gw_client_fresh", 3, "state", "seen", "claims", 7) is None
    assert await client.hget("claims", "fresh") == b"7"
    one = short(1, 0, BLOB)
    assert await client.fcall(*marked, "1 9 5", "n1", 1, "q", *one) == [0]  # an older one's
    assert await client.smembers("seen") == set()  # stored unmarked: 9 is the new session's
    await client.hdel("claims", "holder")  # the new session ended with its connection
    assert await client.fcall(*marked, "1 9 7", "n1", 1, "q", *one) == [0]
    assert not await client.exists("seen")  # not made again, for good, for a session gone
    assert len(await entries(client, "q")) == 7
