"""Dead message queues, max redelivery and TTL, against a real redis-server."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gateway.broker import Broker
from gateway.engine import keys
from gateway.engine.partitions import partition_of
from gateway.engine.queues import DEAD_MESSAGE_QUEUE, QueueConfig
from gateway.model import (
    DEAD_LETTER_REASON,
    LATEST_MS,
    ORIGIN_QUEUE,
    Delivery,
    Message,
    Outcome,
    encode,
)
from protocols.amqp.sections import keep_bare
from tests.test_engine import wait_for


def msg(payload: bytes, **kw) -> Message:
    return Message(destination="q", to_queue=True, payload=payload, **kw)


async def conserved(broker: Broker, published: int) -> None:
    """Every message is in exactly one place: queued, acked, dead-lettered or discarded."""
    q = await broker.queues.info("q")
    dmq = await broker.queues.info(DEAD_MESSAGE_QUEUE)
    gone = q.counters.get("acked", 0) + q.counters.get("discarded", 0)
    assert q.messages + dmq.messages + dmq.counters.get("acked", 0) + gone == published


async def test_max_redelivery_moves_eligible_messages_to_the_dmq(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(QueueConfig(name="q", max_redelivery=2))
    await broker.publish(msg(b"poison", dmq_eligible=True))
    await broker.publish(msg(b"plain"))  # not eligible: discarded
    got: list[Delivery] = []
    flow = None

    def nack(d: Delivery) -> None:
        got.append(d)
        flow.requeue(d.entry_id)

    flow = await broker.bind("q", nack)
    await wait_for(lambda: len(got) == 6)
    await asyncio.sleep(0.2)
    assert len(got) == 6, "each delivered 1 + max_redelivery times, then no more"
    assert sorted(d.delivery_count for d in got) == [1, 1, 2, 2, 3, 3]
    info = await broker.queues.info("q")
    assert info.messages == 0
    assert info.counters["max_redelivered"] == 2
    assert info.counters["dead_lettered"] == 1 and info.counters["discarded"] == 1
    dead: list[Delivery] = []
    await broker.bind(DEAD_MESSAGE_QUEUE, dead.append)
    await wait_for(lambda: len(dead) == 1)
    m = dead[0].message
    assert m.payload == b"poison"
    assert m.annotations[ORIGIN_QUEUE] == "q"
    assert m.annotations[DEAD_LETTER_REASON] == "max_redelivered"
    await conserved(broker, 2)


@pytest.mark.parametrize("failed", ["requeue", "avoid_failed"])
async def test_a_message_whose_last_delivery_failed_leaves_for_the_dmq_at_once(
    broker: Broker, failed: str
) -> None:
    """Its last delivery max_redelivery allows failed and its only consumer went: it goes
    to the dead message queue as it comes back, as RabbitMQ's delivery-limit does (it
    stayed, counted toward the queue's limits, until a fetch reached it: the next publish
    to a queue of max_messages 1 was refused as if the queue were full)."""
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(QueueConfig(name="q", max_redelivery=1, max_messages=1))
    assert await broker.publish(msg(b"poison", dmq_eligible=True)) is Outcome.OK
    for count in (1, 2):  # its delivery and its one redelivery, both failed
        got: list[Delivery] = []
        flow = await broker.bind("q", got.append, window=1)
        await wait_for(lambda got=got: len(got) == 1)
        assert got[0].delivery_count == count
        if failed == "requeue":
            flow.requeue(got[0].entry_id)
        else:  # AMQP modified, delivery-failed and undeliverable-here
            flow.avoid(got[0].entry_id, failed=True)
        await flow.close()
    info = await broker.queues.info("q")
    assert info.messages == 0 and info.counters["max_redelivered"] == 1
    assert (await broker.queues.info(DEAD_MESSAGE_QUEUE)).messages == 1
    assert await broker.publish(msg(b"next")) is Outcome.OK
    await conserved(broker, 2)


async def test_expired_messages_are_never_delivered(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(
        QueueConfig(name="q", respect_ttl=True, max_ttl_ms=200, dmq_eligible_default=True)
    )
    now = int(time.time() * 1000)
    await broker.publish(msg(b"already expired", expiration=now - 1))
    await broker.publish(msg(b"queue ttl"))  # expires 200 ms after spooling
    await broker.publish(msg(b"not eligible", expiration=now - 1, dmq_eligible=False))
    await asyncio.sleep(0.3)
    await broker.publish(msg(b"fresh"))
    got: list[Delivery] = []
    await broker.bind("q", got.append)
    await wait_for(lambda: len(got) == 1)
    await asyncio.sleep(0.2)
    assert [d.message.payload for d in got] == [b"fresh"]
    info = await broker.queues.info("q")
    assert info.counters["expired"] == 3
    assert info.counters["dead_lettered"] == 2 and info.counters["discarded"] == 1
    dead: list[Delivery] = []
    await broker.bind(DEAD_MESSAGE_QUEUE, dead.append)
    await wait_for(lambda: len(dead) == 2)
    assert {d.message.annotations[DEAD_LETTER_REASON] for d in dead} == {"expired"}
    await conserved(broker, 4)


async def test_messages_nobody_consumes_expire_and_free_their_room(broker: Broker) -> None:
    """No consumer: expired messages still leave the queue (to the DMQ with respect_ttl),
    so they stop counting toward its limits; a delivered one stays with its consumer."""
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(
        QueueConfig(
            name="q", respect_ttl=True, max_ttl_ms=300, max_messages=3, dmq_eligible_default=True
        )
    )
    held: list[Delivery] = []
    flow = await broker.bind("q", held.append, window=1)
    for i in range(3):
        assert await broker.publish(msg(b"m%d" % i)) is Outcome.OK
    await wait_for(lambda: len(held) == 1)
    assert await broker.publish(msg(b"one too many")) is Outcome.QUEUE_FULL

    async def expired() -> bool:
        return (await broker.queues.info("q")).messages == 1

    deadline = time.monotonic() + 5
    while not await expired() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    info = await broker.queues.info("q")
    assert info.messages == 1 and info.counters["expired"] == 2  # the delivered one stays
    assert (await broker.queues.info(DEAD_MESSAGE_QUEUE)).messages == 2
    assert await broker.publish(msg(b"room again")) is Outcome.OK
    flow.ack(held[0].entry_id)
    await conserved(broker, 4)


async def test_expiry_without_respect_ttl_discards(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(QueueConfig(name="q", dmq_eligible_default=True))
    await broker.publish(msg(b"old", expiration=int(time.time() * 1000) - 1))
    got: list[Delivery] = []
    await broker.bind("q", got.append)
    await asyncio.sleep(0.3)
    info = await broker.queues.info("q")
    assert got == [] and info.counters["discarded"] == 1 and info.messages == 0


async def test_rejected_messages_go_to_the_dmq(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="custom.dmq"))
    await broker.declare_queue(QueueConfig(name="q", dead_message_queue="custom.dmq"))
    await broker.publish(msg(b"bad", dmq_eligible=True))
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append)
    await wait_for(lambda: len(got) == 1)
    flow.reject(got[0].entry_id)
    dead: list[Delivery] = []
    await broker.bind("custom.dmq", dead.append)
    await wait_for(lambda: len(dead) == 1)
    assert dead[0].message.annotations[DEAD_LETTER_REASON] == "rejected"
    assert (await broker.queues.info("q")).counters["rejected"] == 1


async def test_a_dmqs_own_max_ttl_applies_to_what_it_receives(broker: Broker) -> None:
    """A dead-lettered message is spooled on the dead message queue under its max_ttl_ms,
    counted from when it arrives there (not from the original's expiry, which passed)."""
    await broker.declare_queue(QueueConfig(name="short.dmq", max_ttl_ms=1000))
    await broker.declare_queue(
        QueueConfig(name="q", dead_message_queue="short.dmq", respect_ttl=True, max_ttl_ms=100)
    )
    await broker.publish(msg(b"expires twice", dmq_eligible=True))
    deadline = time.monotonic() + 5
    while (await broker.queues.info("short.dmq")).counters.get("spooled", 0) < 1:
        assert time.monotonic() < deadline, "never dead-lettered"
        await asyncio.sleep(0.02)
    assert (await broker.queues.info("short.dmq")).messages == 1  # kept though it expired
    while (dmq := await broker.queues.info("short.dmq")).messages:
        assert time.monotonic() < deadline, "the dead message queue's ttl never applied"
        await asyncio.sleep(0.05)
    assert dmq.counters["expired"] == 1 and dmq.counters["discarded"] == 1


@pytest.mark.parametrize("dmq_ttl", [0, 60_000])
async def test_a_message_expired_to_the_dmq_does_not_carry_its_passed_expiry(
    broker: Broker, dmq_ttl: int
) -> None:
    """A dead-lettered message's own expiry stays behind (RabbitMQ removes it): passed, its
    consumers (MQTT's send path, Qpid JMS's local expiry) would drop it. Only the dead
    message queue's max_ttl_ms, counted from its arrival there, applies."""
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE, max_ttl_ms=dmq_ttl))
    await broker.declare_queue(QueueConfig(name="q", respect_ttl=True))
    expires = int(time.time() * 1000) + 100
    await broker.publish(msg(b"expired", dmq_eligible=True, expiration=expires))
    dead: list[Delivery] = []
    flow = await broker.bind(DEAD_MESSAGE_QUEUE, dead.append)
    await wait_for(lambda: len(dead) == 1, timeout=5)
    await flow.close()
    got = dead[0].message
    assert got.payload == b"expired" and got.annotations["x-dmq-reason"] == "expired"
    if dmq_ttl:
        assert got.expiration is not None and got.expiration > expires + dmq_ttl // 2
    else:
        assert got.expiration is None


async def test_missing_dmq_discards_and_counts(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="q", max_redelivery=1))
    await broker.publish(msg(b"x", dmq_eligible=True))
    flow = None
    got: list[Delivery] = []

    def nack(d: Delivery) -> None:
        got.append(d)
        flow.requeue(d.entry_id)

    flow = await broker.bind("q", nack)
    await wait_for(lambda: len(got) == 2)
    await asyncio.sleep(0.2)
    info = await broker.queues.info("q")
    assert info.counters["discarded"] == 1 and info.messages == 0


@pytest.mark.parametrize("size", [0, 31, 255, 256, 70_000])
@pytest.mark.parametrize("eligible", [True, False, None])
async def test_eligibility_is_read_from_any_message_size(
    broker: Broker, size: int, eligible: bool | None
) -> None:
    """The Lua side reads the publisher's flag past payloads of every msgpack size class."""
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(QueueConfig(name="q", dmq_eligible_default=True))
    long_id = "i" * size  # also pushes the id past the short string forms
    await broker.publish(
        Message(
            destination="q", to_queue=True, payload=b"p" * size, id=long_id, dmq_eligible=eligible
        )
    )
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append)
    await wait_for(lambda: len(got) == 1)
    flow.reject(got[0].entry_id)
    expected = 1 if eligible in (True, None) else 0  # None: the queue's default (True)
    for _ in range(50):
        if (await broker.queues.info(DEAD_MESSAGE_QUEUE)).messages == expected:
            break
        await asyncio.sleep(0.02)
    assert (await broker.queues.info(DEAD_MESSAGE_QUEUE)).messages == expected


async def test_partitioned_dmq_places_by_key(broker: Broker) -> None:
    from gateway.engine.partitions import partition_of

    await broker.declare_queue(QueueConfig(name="pdmq", partition_count=4))
    await broker.declare_queue(QueueConfig(name="q", dead_message_queue="pdmq"))
    for key in ("a", "b", "c", None):
        await broker.publish(msg(b"x", dmq_eligible=True, partition_key=key))
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append)
    await wait_for(lambda: len(got) == 4)
    for d in got:
        flow.reject(d.entry_id)
    expected = [0, 0, 0, 0]
    for key in ("a", "b", "c"):
        expected[partition_of(key, 4)] += 1
    expected[0] += 1  # no key: partition 0
    for _ in range(50):
        info = await broker.queues.info("pdmq")
        if info.messages == 4:
            break
        await asyncio.sleep(0.02)
    assert [p["messages"] for p in info.partitions] == expected


@pytest.mark.parametrize("overflow", ["reject", "ring"])
async def test_a_full_dmq_discards_or_drops_its_oldest(broker: Broker, overflow: str) -> None:
    """Solace: a dead message that does not fit its DMQ is discarded and counted ("to DMQ
    failed"); a ring DMQ makes room by dropping its oldest instead."""
    await broker.declare_queue(
        QueueConfig(name=DEAD_MESSAGE_QUEUE, max_messages=2, overflow=overflow)
    )
    await broker.declare_queue(QueueConfig(name="q", dmq_eligible_default=True))
    for i in range(4):
        await broker.publish(msg(b"m%d" % i))
    seen: list[Delivery] = []
    flow = None

    def reject(d: Delivery) -> None:
        seen.append(d)
        flow.reject(d.entry_id)

    flow = await broker.bind("q", reject)
    await wait_for(lambda: len(seen) == 4)
    await flow.close()
    await wait_for_messages(broker, "q", 0)
    dead: list[Delivery] = []
    await broker.bind(DEAD_MESSAGE_QUEUE, dead.append)
    await wait_for(lambda: len(dead) == 2)
    payloads = [d.message.payload for d in dead]
    info = await broker.queues.info("q")
    dmq = await broker.queues.info(DEAD_MESSAGE_QUEUE)
    if overflow == "reject":
        assert payloads == [b"m0", b"m1"]
        assert info.counters["dead_lettered"] == 2
        assert info.counters["discarded"] == 2 and info.counters["dmq_failed"] == 2
    else:
        assert payloads == [b"m2", b"m3"]
        assert info.counters["dead_lettered"] == 4 and "dmq_failed" not in info.counters
        assert dmq.counters["dropped"] == 2


async def wait_for_messages(broker: Broker, queue: str, count: int) -> None:
    async def depth() -> int:
        return (await broker.queues.info(queue)).messages

    deadline = time.monotonic() + 5
    while await depth() != count:
        assert time.monotonic() < deadline, f"{queue} never reached {count} messages"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("window", [1, 100])
async def test_an_unreadable_entry_is_dead_lettered_not_stuck(
    broker: Broker, redis_url: str, window: int
) -> None:
    """A stream entry no node can decode (written by a broken or foreign writer) does not
    hold a window slot forever: it goes to the dead message queue, and the messages around
    it are delivered in order."""
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(QueueConfig(name="q", dmq_eligible_default=True))
    client = aioredis.Redis.from_url(redis_url)
    await broker.publish(msg(b"before"))
    for garbage in (b"not msgpack \xff", b"\x91\xc4", b"\x93\x63\xc4\x01x\xa1q"):
        await client.xadd(keys.queue_stream("q"), {"m": garbage})
    await broker.publish(msg(b"after"))
    got: list[Delivery] = []
    flow = None

    def ack(d: Delivery) -> None:
        got.append(d)
        flow.ack(d.entry_id)

    flow = await broker.bind("q", ack, window=window)
    await wait_for(lambda: len(got) == 2)
    assert [d.message.payload for d in got] == [b"before", b"after"]
    await broker.publish(msg(b"later"))
    await wait_for(lambda: len(got) == 3)
    await wait_for(lambda: not flow.unacked)
    for _ in range(100):  # the rejections reach Redis with the next dispatch round
        if await client.xlen(keys.queue_stream("q")) == 0:
            break
        await asyncio.sleep(0.02)
    assert await client.xlen(keys.queue_stream("q")) == 0, "nothing left behind"
    info = await broker.queues.info("q")
    assert info.counters.get("rejected") == 3 and info.counters.get("dead_lettered") == 3
    assert (await broker.queues.info(DEAD_MESSAGE_QUEUE)).messages == 3
    await client.aclose()


async def test_odd_expiries_in_entries_neither_stall_nor_lose_a_flow(
    broker: Broker, redis_url: str
) -> None:
    """An expiry another writer stored the way Lua prints large numbers (with an exponent)
    is read; one that no integer holds dead-letters its entry, and the flow goes on."""
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(QueueConfig(name="q", dmq_eligible_default=True))
    client = aioredis.Redis.from_url(redis_url)
    for payload, expiry in ((b"far", "1e+17"), (b"never", "inf")):
        await client.xadd(keys.queue_stream("q"), {"m": encode(msg(payload)), "x": expiry})
    await broker.publish(msg(b"after"))
    got: list[Delivery] = []
    await broker.bind("q", got.append)
    await wait_for(lambda: len(got) == 2)
    assert [(d.message.payload, d.message.expiration) for d in got] == [
        (b"far", 10**17),
        (b"after", None),
    ]
    await wait_for_messages(broker, DEAD_MESSAGE_QUEUE, 1)
    await client.aclose()


async def test_times_past_what_entries_hold_are_bounded(broker: Broker) -> None:
    """A publisher's expiry or delivery time beyond the year 9999 (an AMQP timestamp may
    name any ms of 2**63) or before the epoch is stored as the nearest time entries hold:
    no expiry, the latest delivery time, long expired."""
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(QueueConfig(name="q", dmq_eligible_default=True, respect_ttl=True))
    held = msg(b"held", not_before=2**63 - 1)
    for m in (msg(b"forever", expiration=2**64), msg(b"expired", expiration=-(2**63)), held):
        assert await broker.publish(m) is Outcome.OK
    assert held.not_before == LATEST_MS
    got: list[Delivery] = []
    await broker.bind("q", got.append)
    await wait_for(lambda: len(got) == 1)
    assert (got[0].message.payload, got[0].message.expiration) == (b"forever", None)
    await wait_for_messages(broker, DEAD_MESSAGE_QUEUE, 1)  # the expired one
    await asyncio.sleep(0.2)
    assert len(got) == 1  # the held one waits (for 8,000 years)


@pytest.mark.parametrize("kind", ["priorities", "partitions"])
async def test_a_ring_dmq_with_levels_or_partitions_drops_from_all(
    broker: Broker, kind: str
) -> None:
    """A full ring dead message queue drops its oldest message from whichever level or
    partition holds it, rather than refusing a dead message for an empty one."""
    extra = {"priorities": True} if kind == "priorities" else {"partition_count": 2}
    await broker.declare_queue(
        QueueConfig(name=DEAD_MESSAGE_QUEUE, max_messages=2, overflow="ring", **extra)
    )
    await broker.declare_queue(QueueConfig(name="q"))
    keys_by_partition: dict[int, str] = {}
    i = 0
    while len(keys_by_partition) < 2:
        keys_by_partition.setdefault(partition_of(f"k{i}", 2), f"k{i}")
        i += 1
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=10)
    for payload, place in (("a", 0), ("b", 0), ("c", 1)):
        priority, key = (
            (4 + 5 * place, None) if kind == "priorities" else (4, keys_by_partition[place])
        )
        await broker.publish(
            msg(payload.encode(), priority=priority, dmq_eligible=True, partition_key=key)
        )
        await wait_for(lambda: len(got) == 1)
        flow.reject(got.pop().entry_id)
        deadline = time.monotonic() + 5
        while (await broker.queues.info("q")).counters.get("rejected", 0) < ord(payload) - 96:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
    await flow.close()
    origin = await broker.queues.info("q")
    dmq = await broker.queues.info(DEAD_MESSAGE_QUEUE)
    assert origin.counters.get("dmq_failed", 0) == 0 and origin.counters["dead_lettered"] == 3
    assert (dmq.messages, dmq.counters.get("dropped", 0)) == (2, 1)


async def test_a_grouped_dmq_keeps_dead_messages_groups(broker: Broker) -> None:
    """A dead message queue with message groups (Qpid Broker-J's DLQ of a grouped queue): a
    dead-lettered message keeps its group (JMSXGroupID / group-id), so one group never
    reaches two of the DMQ's consumers at once."""
    await broker.declare_queue(QueueConfig(name="dlq", message_groups="default"))
    await broker.declare_queue(QueueConfig(name="q", dead_message_queue="dlq"))
    for i in range(2):
        await broker.publish(
            Message(
                destination="q",
                to_queue=True,
                payload=b"%d" % i,
                partition_key="A",
                dmq_eligible=True,
            )
        )
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append)
    await wait_for(lambda: len(got) == 2, timeout=5)
    for d in got:
        flow.reject(d.entry_id)
    await flow.close()
    deadline = asyncio.get_running_loop().time() + 5
    while (await broker.queues.info("dlq")).messages < 2:
        assert asyncio.get_running_loop().time() < deadline, "never dead-lettered"
        await asyncio.sleep(0.05)
    a: list[Delivery] = []
    await broker.bind("dlq", a.append, window=1)
    await wait_for(lambda: len(a) == 1, timeout=5)
    assert a[0].message.partition_key == "A"
    b: list[Delivery] = []
    await broker.bind("dlq", b.append, window=1)
    await asyncio.sleep(0.5)
    assert b == [], "group A is a's while it holds one of its messages"


@pytest.mark.parametrize("kind", ["plain", "priorities", "partitioned"])
async def test_an_expired_message_is_never_delivered_by_a_queue_that_is_its_own_dmq(
    broker: Broker, kind: str
) -> None:
    """A queue named as its own dead message queue discards what it would dead-letter; a
    priority or partitioned one too (its levels and partitions dead-letter as it), not
    putting the message back into itself, where an expired one is delivered after all."""
    extra = {"priorities": {"priorities": True}, "partitioned": {"partition_count": 2}}
    await broker.declare_queue(
        QueueConfig(
            name="q",
            dead_message_queue="q",
            respect_ttl=True,
            dmq_eligible_default=True,
            **extra.get(kind, {}),
        )
    )
    now = int(time.time() * 1000)
    await broker.publish(
        Message(destination="q", to_queue=True, payload=b"expired", expiration=now - 1)
    )
    await broker.publish(Message(destination="q", to_queue=True, payload=b"fresh"))
    got: list[Delivery] = []
    await broker.bind("q", got.append)
    await wait_for(lambda: len(got) >= 1, timeout=5)
    await asyncio.sleep(0.5)
    assert [d.message.payload for d in got] == [b"fresh"], [
        (d.message.payload, d.message.annotations) for d in got
    ]


async def test_a_message_expiring_round_a_cycle_of_dmqs_is_dropped(broker: Broker) -> None:
    """Queues that are each other's dead message queues passed an expiring message round
    for ever (a dead-letter and a write every TTL; found by a review). As in RabbitMQ, one
    that comes back by expiry alone to a queue it expired from is dropped."""
    ring = ["a", "b", "c"]
    for name, dmq in zip(ring, ring[1:] + ring[:1], strict=True):
        config = QueueConfig(
            name=name, dead_message_queue=dmq, max_ttl_ms=100, respect_ttl=True,
            dmq_eligible_default=True,
        )  # fmt: skip
        await broker.declare_queue(config)
    await broker.publish(Message(destination="a", to_queue=True, payload=b"round"))

    async def counters() -> list[dict[str, int]]:
        return [(await broker.queues.info(name)).counters for name in ring]

    deadline = time.monotonic() + 5
    while not (await counters())[2].get("dmq_cycle"):
        assert time.monotonic() < deadline, await counters()
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    a, b, c = await counters()
    assert (a.get("dead_lettered"), b.get("dead_lettered"), c.get("dead_lettered")) == (1, 1, None)
    assert (c["discarded"], c["dmq_cycle"]) == (1, 1)
    assert [(await broker.queues.info(name)).messages for name in ring] == [0, 0, 0]


@pytest.mark.parametrize(
    "b_settings",
    [
        {"respect_ttl": False, "dmq_eligible_default": True},
        {"respect_ttl": True, "dmq_eligible_default": False},
    ],
    ids=["b-keeps-expired-from-its-dmq", "not-eligible-in-b"],
)
async def test_dmq_cycle_counts_only_a_message_the_cycle_stopped(
    broker: Broker, b_settings: dict
) -> None:
    """A message a queue discards anyway (it sends no expired or no such message to its
    DMQ) was counted dmq_cycle when its DMQ was a queue it had expired from, telling the
    operator of a loop that played no part (found by a review)."""
    config = QueueConfig(
        name="a", dead_message_queue="b", max_ttl_ms=100, respect_ttl=True,
        dmq_eligible_default=True,
    )  # fmt: skip
    await broker.declare_queue(config)
    await broker.declare_queue(
        QueueConfig(name="b", dead_message_queue="a", max_ttl_ms=100, **b_settings)
    )
    await broker.publish(Message(destination="a", to_queue=True, payload=b"once"))
    deadline = time.monotonic() + 5
    while not (b := (await broker.queues.info("b")).counters).get("discarded"):
        assert time.monotonic() < deadline, b
        await asyncio.sleep(0.05)
    assert (await broker.queues.info("a")).counters.get("dead_lettered") == 1
    assert (b["discarded"], b.get("dmq_cycle")) == (1, None)


async def test_dmq_takes_a_dead_message_it_would_take_from_a_publisher(broker: Broker) -> None:
    """A dead message queue's max_message_size limits the payload, as on the spool: not the
    stored entry (payload and every header), which discarded as "DMQ full" a dead message
    the DMQ takes from a publisher."""
    LIMIT = 1000
    await broker.declare_queue(QueueConfig(name="dmq", max_message_size=LIMIT))
    await broker.declare_queue(
        QueueConfig(name="q", dead_message_queue="dmq", max_message_size=LIMIT)
    )
    payload = b"x" * LIMIT
    # the DMQ takes this very message from a publisher
    assert (
        await broker.publish(
            Message(destination="dmq", to_queue=True, payload=payload, subject="s")
        )
        is Outcome.OK
    )
    assert (
        await broker.publish(
            Message(destination="q", to_queue=True, payload=payload, subject="s", dmq_eligible=True)
        )
        is Outcome.OK
    )
    await _reject_the_one(broker)
    info = await broker.queues.info("q")
    assert info.counters.get("rejected") == 1
    assert info.counters.get("dmq_failed", 0) == 0, info.counters
    assert (await broker.queues.info("dmq")).messages == 2


async def _reject_the_one(broker: Broker) -> None:
    """A consumer of queue q takes its one message and rejects it (to the DMQ)."""
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append)
    await wait_for(lambda: len(got) == 1, timeout=5)
    flow.reject(got[0].entry_id)
    await flow.close()


async def test_dmq_max_message_size_limits_an_amqp_published_payload(broker: Broker) -> None:
    """A message an AMQP publisher sent keeps its payload in its bare message (its payload
    field empty): the DMQ's max_message_size still limits it, as the spool does."""
    LIMIT = 100
    await broker.declare_queue(QueueConfig(name="dmq", max_message_size=LIMIT))
    await broker.declare_queue(QueueConfig(name="q", dead_message_queue="dmq"))
    payload = b"x" * 5000
    msg = Message(destination="q", to_queue=True, payload=payload, dmq_eligible=True)
    keep_bare(msg, b"\x00\x53\x75\xb0" + len(payload).to_bytes(4, "big") + payload)
    assert msg.payload_in_bare is not None
    # a publisher cannot send it to the DMQ
    direct = Message(destination="dmq", to_queue=True, payload=payload)
    keep_bare(direct, msg.amqp_bare)
    assert not (await broker.publish(direct)).accepted
    assert await broker.publish(msg) is Outcome.OK
    await _reject_the_one(broker)
    info = await broker.queues.info("q")
    dmq = await broker.queues.info("dmq")
    assert info.counters.get("rejected") == 1
    assert dmq.messages == 0, "the DMQ took a dead message over its max_message_size"
    assert info.counters.get("dmq_failed") == 1, info.counters


DMQ_LIMIT = 1000


def _amqp(dest: str, payload: bytes) -> Message:
    msg = Message(
        destination=dest, to_queue=True, payload=payload, dmq_eligible=True, subject="s" * 200
    )
    keep_bare(msg, b"\x00\x53\x75\xb0" + len(payload).to_bytes(4, "big") + payload)
    assert msg.payload_in_bare is not None
    return msg


def _empty(dest: str) -> Message:
    """An MQTT-style message with an empty payload and a large user property."""
    return Message(
        destination=dest,
        to_queue=True,
        payload=b"",
        dmq_eligible=True,
        user_properties=[("k", "v" * (2 * DMQ_LIMIT))],
    )


@pytest.mark.parametrize("make", [_amqp, _empty], ids=["amqp_payload_at_limit", "empty_payload"])
async def test_dmq_takes_a_dead_message_a_publisher_may_send_it(broker: Broker, make) -> None:
    """A DMQ's max_message_size limits a dead message's payload as the spool does: an AMQP
    one at the limit (its headers and bare-message framing on top), an empty one with
    large properties."""
    await broker.declare_queue(QueueConfig(name="dmq", max_message_size=DMQ_LIMIT))
    await broker.declare_queue(QueueConfig(name="q", dead_message_queue="dmq"))
    payload = b"x" * DMQ_LIMIT
    # a publisher may send this very message to the DMQ
    assert (
        await broker.publish(make("dmq", payload) if make is _amqp else make("dmq"))
    ) is Outcome.OK
    assert (await broker.publish(make("q", payload) if make is _amqp else make("q"))) is Outcome.OK
    await _reject_the_one(broker)
    info = await broker.queues.info("q")
    assert info.counters.get("rejected") == 1
    assert info.counters.get("dmq_failed", 0) == 0, (
        f"the DMQ refused a dead message it takes from a publisher: {info.counters}"
    )
    assert (await broker.queues.info("dmq")).messages == 2
