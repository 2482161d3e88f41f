"""Parting messages in Redis (gateway/engine/parting.py): each connection's record is
settled once, by its node, by a new connection to the session, or by a node taking due
ones of a node that died."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.engine import library, parting
from gateway.engine.parting import PartingStore, pack, unpack
from gateway.model import Message


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """No node runs: none takes due records but the test's."""
    client = await library.connect(redis_url)
    yield client
    await client.aclose()


def record(payload: bytes) -> bytes:
    return pack(Message(destination="w/x", payload=payload))


async def test_a_record_a_node_is_publishing_is_not_sent_again_by_a_new_connection(
    client: aioredis.Redis,
) -> None:
    dead = PartingStore(client, "ndead0001")
    assert await dead.hold("cx", 1, False, record(b"bye"), 0) == []
    await client.fcall("gw_node_down", 0, "ndead0001")  # reaped: due now
    taken = await PartingStore(client, "nsurv0001").take()
    assert [unpack(t.message).payload for t in taken] == [b"bye"]
    newcomer = PartingStore(client, "nlive0001")
    assert await newcomer.hold("cx", 2, False, None, 0) == []


async def test_a_node_presumed_dead_does_not_publish_what_the_others_took_over(
    client: aioredis.Redis,
) -> None:
    stalled = PartingStore(client, "nstall001")
    await stalled.hold("cy", 1, False, record(b"bye"), 0)
    await client.fcall("gw_node_down", 0, "nstall001")  # presumed dead, reaped
    assert not await stalled.own("cy", 1)
    assert len(await PartingStore(client, "nsurv0001").take()) == 1


async def test_a_new_connection_cancels_a_will_within_its_delay_and_sends_one_past_it(
    client: aioredis.Redis,
) -> None:
    store = PartingStore(client, "nlive0001")
    now_ms = int(time.time() * 1000)
    await store.hold("w1", 1, False, record(b"waiting"), 60)
    await store.due("w1", 1, now_ms + 60_000)
    await store.hold("w2", 3, False, record(b"due"), 1)
    await store.due("w2", 3, now_ms - 1)
    assert await store.hold("w1", 2, False, None, 0) == []
    assert not await store.own("w1", 1)  # its timer fires late: settled
    sent = await store.hold("w2", 4, False, None, 0)
    assert [unpack(d.message).payload for d in sent] == [b"due"]


async def test_a_will_a_new_connection_is_to_send_stays_until_it_went(
    client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taken, not dropped: should its publish fail (Redis full, or away), a node takes it
    again once the lease ends."""
    monkeypatch.setattr(parting, "TAKE_LEASE_MS", 200)
    dead = PartingStore(client, "ndead0002")
    await dead.hold("cz", 1, False, record(b"bye"), 0)
    newcomer = PartingStore(client, "nlive0001")
    [due] = await newcomer.hold("cz", 2, True, None, 0)  # its node died: it goes now
    assert await newcomer.take() == []  # the newcomer is publishing it
    await asyncio.sleep(0.3)  # ... and failed: the lease ended
    [again] = await newcomer.take()
    assert (again.key, again.claim, again.message) == (due.key, due.claim, due.message)
    await newcomer.done(again)
    await asyncio.sleep(0.3)
    assert await newcomer.take() == []


async def test_a_will_keeps_its_expiry_and_delivery_delay_as_intervals(
    client: aioredis.Redis,
) -> None:
    made = int(time.time() * 1000)
    msg = Message(destination="w/x", payload=b"x", expiration=made + 5000, not_before=made + 800)
    blob = pack(msg)
    time.sleep(0.05)  # it goes later: the intervals count from then
    back = unpack(blob)
    assert back.expiration is not None and back.not_before is not None
    assert back.expiration - back.not_before == 4200
    assert back.not_before >= made + 800 + 50
