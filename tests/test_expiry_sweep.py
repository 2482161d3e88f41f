"""The heartbeat's expiry sweep looks only at the queues due: when their earliest waiting
message expires, or when messages come back to wait. Real Redis (its command counters)."""

from __future__ import annotations

import asyncio
import time

from gateway.broker import Broker, QueueConfig
from gateway.engine import keys
from gateway.engine.flows import Delivery
from gateway.model import Message, Outcome
from tests.test_engine import wait_for


def expiring(queue: str, payload: bytes, in_ms: int) -> Message:
    return Message(
        destination=queue,
        to_queue=True,
        payload=payload,
        expiration=int(time.time() * 1000) + in_ms,
    )


async def expired(broker: Broker, queue: str, count: int) -> None:
    deadline = time.monotonic() + 5
    while (await broker.queues.info(queue)).messages and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    info = await broker.queues.info(queue)
    assert info.messages == 0 and info.counters.get("expired") == count, info.counters


async def queue_reads(broker: Broker) -> int:
    """XLEN calls so far: the sweep's first step on each queue it looks at."""
    return (await broker.redis.info("commandstats")).get("cmdstat_xlen", {}).get("calls", 0)


async def test_a_sweep_reads_only_the_queues_due(broker: Broker) -> None:
    """1,000 device queues each holding a message that expires in an hour: a sweep reads
    none of them (every one, every beat, before: 25 µs of Redis a queue, 400 ms a beat at
    16,000 queues). A queue whose message expires is still swept when it does."""
    devices = [f"device{i}" for i in range(1000)]
    for name in [*devices, "soon"]:
        await broker.declare_queue(QueueConfig(name=name))
    futures = [broker.publish_nowait(expiring(name, b"later", 3_600_000)) for name in devices]
    assert {await f for f in futures} == {Outcome.OK}
    assert await broker.publish(expiring("soon", b"short", 300)) is Outcome.OK
    before = await queue_reads(broker)
    await broker.redis.fcall("gw_reap", 0)
    await asyncio.sleep(0.5)  # heartbeats' sweeps too (every 0.2 s)
    assert await queue_reads(broker) - before < 20
    await expired(broker, "soon", 1)
    assert (await broker.queues.info("device7")).messages == 1


async def test_a_message_given_back_after_its_expiry_leaves_a_queue_nobody_reads(
    broker: Broker,
) -> None:
    """A delivered message is not waiting, so the sweep stops looking at its queue; given
    back after it expired by a consumer that leaves, it is looked at again and goes."""
    await broker.declare_queue(QueueConfig(name="q", max_ttl_ms=300))
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=1)
    assert await broker.publish(Message(destination="q", to_queue=True, payload=b"m")) is (
        Outcome.OK
    )
    await wait_for(lambda: len(got) == 1)
    await asyncio.sleep(0.8)  # expired while delivered; sweeps passed the queue by
    assert (await broker.queues.info("q")).messages == 1
    flow.release(got[0].entry_id)
    await flow.close()
    await expired(broker, "q", 1)


async def test_queues_the_release_before_listed_are_swept(broker: Broker) -> None:
    """The release before kept the queues to sweep in a plain set: the sweep takes them
    over, so a message stored then still expires though nobody reads its queue."""
    await broker.declare_queue(QueueConfig(name="q"))
    assert await broker.publish(expiring("q", b"short", 300)) is Outcome.OK
    redis = broker.redis
    await redis.zrem(keys.TEMPLATES["expiring_queues"], "q")
    await redis.sadd(keys.TEMPLATES["earlier_expiring_queues"], "q")
    await expired(broker, "q", 1)
    assert not await redis.exists(keys.TEMPLATES["earlier_expiring_queues"])


async def test_messages_back_to_wait_expire_after_a_stream_reader_is_forgotten(
    broker: Broker,
) -> None:
    """While a Spark reader reads a queue, the sweep reads its lists without the earliest
    expiry being kept: once the reader is gone, the sweep reads them all again, so 100
    given back that expire in 6 s go then, not with the 99 that expire in an hour."""
    redis, cursor = broker.redis, keys.queue_expiry_cursor("orders")
    await broker.declare_queue(QueueConfig(name="orders"))
    got: list[Delivery] = []
    flow = await broker.bind("orders", got.append, window=300)
    futures = [broker.publish_nowait(expiring("orders", b"early", 6000)) for _ in range(100)]
    futures += [broker.publish_nowait(expiring("orders", b"late", 3_600_000)) for _ in range(99)]
    assert {await f for f in futures} == {Outcome.OK}
    await wait_for(lambda: len(got) == 199)
    early = time.monotonic() + 6
    await flow.close()  # all 199 wait again
    due = keys.TEMPLATES["expiring_queues"]
    for _ in range(100):  # the sweep read them all: the queue is due when the early expire
        score = await redis.zscore(due, "orders")
        if score and score > time.time() * 1000 + 2000 and not await redis.exists(cursor):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the sweep did not read the queue whole")
    for _ in range(20):  # until a reader's sweep left a list read in part
        await redis.fcall("gw_reader_at", 0, "orders", "spark1", "0-0", 1)
        assert await broker.publish(expiring("orders", b"short", 50)) is Outcome.OK  # due
        await asyncio.sleep(0.3)  # the readers' sweeps (every beat)
        pipe = redis.pipeline(transaction=True)
        pipe.fcall("gw_reap", 0)
        pipe.fcall("gw_forget_reader", 0, "orders", "spark1")
        pipe.hgetall(cursor)
        *_, state = await pipe.execute()
        if {k.decode() for k in state} - {"again", "soonest"}:
            break
    else:
        raise AssertionError("no sweep left a list read in part")
    await asyncio.sleep(early - time.monotonic() + 1.5)
    info = await broker.queues.info("orders")
    assert info.messages == 99 and info.counters["expired"] >= 101, info.counters
