"""A consumer that says it cannot take a message (AMQP modified with undeliverable-here,
§3.4.5) does not get it again; the queue's other consumers do. Every way a queue hands
out returned messages honours it: plain, message groups, sorted, selector consumers. Where
no other consumer may take it (exclusive and partitioned queues), it is rejected."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from proton import Message as AmqpMessage
from proton import Timeout
from proton.utils import BlockingConnection

from gateway.broker import Broker
from gateway.engine import keys
from gateway.engine.queues import DEAD_MESSAGE_QUEUE, QueueConfig
from gateway.model import Delivery, Message
from protocols.amqp.listener import Listener
from tests.test_engine import wait_for

CASES = {
    "plain": (QueueConfig(name="q"), None),
    "groups": (QueueConfig(name="q", message_groups="default"), None),
    "sorted": (QueueConfig(name="q", sort_key="k"), None),
    "selector": (QueueConfig(name="q"), "k IS NOT NULL"),
}


def msg(payload: bytes) -> Message:
    return Message(destination="q", to_queue=True, payload=payload, user_properties=[("k", "a")])


@pytest.mark.parametrize("failed", [False, True], ids=["released", "failed"])
@pytest.mark.parametrize("case", list(CASES))
async def test_an_avoided_message_goes_to_another_consumer(
    broker: Broker, case: str, failed: bool
) -> None:
    config, selector = CASES[case]
    await broker.declare_queue(config)
    await broker.publish(msg(b"m1"))
    first: list[Delivery] = []
    a = await broker.bind("q", first.append, window=5, selector=selector)
    await wait_for(lambda: len(first) == 1)
    a.avoid(first[0].entry_id, failed)
    await broker.publish(msg(b"m2"))
    await wait_for(lambda: len(first) == 2)
    await asyncio.sleep(0.3)
    assert [d.message.payload for d in first] == [b"m1", b"m2"], "m1 not to `a` again"
    other: list[Delivery] = []
    b = await broker.bind("q", other.append, window=5, selector=selector)
    await wait_for(lambda: len(other) == 1)
    assert other[0].message.payload == b"m1"
    assert other[0].delivery_count == (2 if failed else 1), "counted only when it failed"
    a.ack(first[1].entry_id)
    b.ack(other[0].entry_id)
    for _ in range(100):
        if (await broker.queues.info("q")).messages == 0:
            break
        await asyncio.sleep(0.02)
    assert (await broker.queues.info("q")).messages == 0
    assert not await broker.redis.exists(keys.queue_avoid("q")), "settled: none to avoid"


async def drained(broker: Broker, q: str) -> None:
    for _ in range(200):
        if (await broker.queues.info(q)).messages == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("queue not drained")


async def test_an_avoided_message_that_expires_leaves_the_avoid_list(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="q"))
    expiration = int(time.time() * 1000) + 400
    await broker.publish(
        Message(destination="q", to_queue=True, payload=b"m", expiration=expiration)
    )
    got: list[Delivery] = []
    a = await broker.bind("q", got.append, window=5)
    await wait_for(lambda: len(got) == 1)
    a.avoid(got[0].entry_id, False)
    await asyncio.sleep(0.6)  # expired
    other: list[Delivery] = []
    await broker.bind("q", other.append, window=5)  # its fetch drops the expired entry
    await drained(broker, "q")
    await asyncio.sleep(0.2)
    assert other == []
    left = await broker.redis.hgetall(keys.queue_avoid("q"))
    assert not left, f"entries no longer on the queue still avoided: {left}"


async def test_an_avoided_message_dead_lettered_leaves_the_avoid_list(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="q", max_redelivery=1))
    await broker.publish(Message(destination="q", to_queue=True, payload=b"m"))
    got: list[Delivery] = []
    a = await broker.bind("q", got.append, window=5)
    await wait_for(lambda: len(got) == 1)
    a.avoid(got[0].entry_id, True)  # delivery-failed: counts, past max_redelivery
    other: list[Delivery] = []
    b = await broker.bind("q", other.append, window=5)
    await wait_for(lambda: len(other) == 1)
    b.requeue(other[0].entry_id)  # counts again: past max_redelivery, dead-lettered
    await drained(broker, "q")
    await asyncio.sleep(0.2)
    print("deliveries to b:", [(d.message.payload, d.delivery_count) for d in other])
    left = await broker.redis.hgetall(keys.queue_avoid("q"))
    assert not left, f"entries no longer on the queue still avoided: {left}"


async def test_avoid_on_a_priority_queue(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="pq", priorities=True))
    await broker.publish(Message(destination="pq", to_queue=True, payload=b"m1", priority=7))
    first: list[Delivery] = []
    a = await broker.bind("pq", first.append, window=5)
    await wait_for(lambda: len(first) == 1)
    a.avoid(first[0].entry_id, False)  # settled on the level's child queue
    await broker.publish(Message(destination="pq", to_queue=True, payload=b"m2", priority=7))
    await wait_for(lambda: len(first) == 2)
    await asyncio.sleep(0.3)
    assert [d.message.payload for d in first] == [b"m1", b"m2"]
    other: list[Delivery] = []
    b = await broker.bind("pq", other.append, window=5)
    await wait_for(lambda: len(other) == 1)
    a.ack(first[1].entry_id)
    b.ack(other[0].entry_id)
    await drained(broker, "pq")
    for p in range(10):
        assert not await broker.redis.exists(keys.queue_avoid(keys.priority_queue("pq", p)))


async def test_a_released_message_behind_many_avoided_ones_reaches_the_consumer(
    broker: Broker,
) -> None:
    """A fetch looks past every returned entry its flow avoids, however many."""
    n = 1002
    await broker.declare_queue(QueueConfig(name="q"))
    for i in range(n):
        await broker.publish(Message(destination="q", to_queue=True, payload=b"m%d" % i))
    got: list[Delivery] = []
    a = await broker.bind("q", got.append, window=2 * n)
    await wait_for(lambda: len(got) == n, timeout=20)
    a.set_window(1)  # fetches of one entry from here
    for d in got[:-1]:
        a.avoid(d.entry_id, False)  # 1001 the consumer cannot take
    last = got[-1]
    a.release(last.entry_id)  # any consumer, this one too, may take it
    await wait_for(lambda: len(got) == n + 1, timeout=5)
    assert got[-1].message.payload == last.message.payload


def grouped(payload: str) -> Message:
    return Message(destination="g", to_queue=True, payload=payload.encode(), partition_key="A")


@pytest.mark.parametrize("mode", ["default", "shared"])
async def test_an_avoided_message_of_a_group_goes_to_another_consumer_in_order(
    broker: Broker, mode: str
) -> None:
    """A consumer that cannot take a message of its group (undeliverable-here) lets the
    group go: another consumer takes that message, and the rest of the group after it;
    the first never gets a later one ahead of it (a group keeps its order)."""
    await broker.declare_queue(QueueConfig(name="g", message_groups=mode))
    got_a: list[Delivery] = []
    a = await broker.bind("g", got_a.append, window=1)
    await broker.publish(grouped("m0"))
    await wait_for(lambda: len(got_a) == 1)
    got_b: list[Delivery] = []
    b = await broker.bind("g", got_b.append, window=5)
    await broker.publish(grouped("m1"))
    await asyncio.sleep(0.1)
    a.avoid(got_a[0].entry_id, False)
    await wait_for(lambda: len(got_b) == 2)
    await asyncio.sleep(0.2)
    assert [d.message.payload for d in got_a] == [b"m0"]
    assert [d.message.payload for d in got_b] == [b"m0", b"m1"]
    for d in got_b:
        b.ack(d.entry_id)
    await a.close()
    await b.close()


@pytest.mark.parametrize("mode", ["default", "shared"])
async def test_a_group_goes_on_only_once_its_consumer_holds_none_of_it(
    broker: Broker, mode: str
) -> None:
    """A consumer holding two messages of its group cannot take the first: the group stays
    its own (nothing of it goes to another meanwhile) until it settles the second, then
    another consumer takes the group from the first message on, in order, and at once."""
    await broker.declare_queue(QueueConfig(name="g", message_groups=mode))
    got_a: list[Delivery] = []
    a = await broker.bind("g", got_a.append, window=2)
    await broker.publish(grouped("m0"))
    await broker.publish(grouped("m1"))
    await wait_for(lambda: len(got_a) == 2)
    got_b: list[Delivery] = []
    b = await broker.bind("g", got_b.append, window=5)
    a.avoid(got_a[0].entry_id, False)
    if mode == "default":
        await broker.publish(grouped("m2"))
    await asyncio.sleep(0.3)
    assert got_b == [] and len(got_a) == 2  # the group is still A's, and A gets no more
    if mode == "default":
        a.release(got_a[1].entry_id)  # A gives m1 back: it holds none of the group
    else:
        a.ack(got_a[1].entry_id)  # A is done with m1: the group is free (and B woken)
    expected = [b"m0", b"m1", b"m2"] if mode == "default" else [b"m0"]
    await wait_for(lambda: len(got_b) == len(expected), timeout=1)
    assert [d.message.payload for d in got_b] == expected
    for d in got_b:
        b.ack(d.entry_id)
    await a.close()
    await b.close()


async def test_a_group_stays_while_its_consumer_holds_one_behind_many(broker: Broker) -> None:
    """Whether a consumer still holds a message of a group is read through all it holds,
    not the first thousand."""
    await broker.declare_queue(QueueConfig(name="g", message_groups="default"))
    got_a: list[Delivery] = []
    a = await broker.bind("g", got_a.append, window=1100)
    others = [Message(destination="g", to_queue=True, payload=b"x", partition_key="X")] * 1050
    await asyncio.gather(*(broker.publish_nowait(m) for m in others))
    await broker.publish(grouped("a1"))
    await broker.publish(grouped("a2"))
    await wait_for(lambda: len(got_a) == 1052, timeout=20)
    got_b: list[Delivery] = []
    b = await broker.bind("g", got_b.append, window=5)
    assert [d.message.payload for d in got_a[-2:]] == [b"a1", b"a2"]
    a.avoid(got_a[-1].entry_id, False)  # A cannot take a2, and still holds a1 of its group
    await asyncio.sleep(0.5)
    assert got_b == []  # the group is still A's: a2 waits
    a.ack(got_a[-2].entry_id)  # now A holds none of it: B takes the group
    await wait_for(lambda: [d.message.payload for d in got_b] == [b"a2"], timeout=5)
    await a.close()
    await b.close()


@pytest.mark.parametrize(
    "config",
    [
        QueueConfig(name="one", access_type="exclusive", dmq_eligible_default=True),
        QueueConfig(
            name="one", partition_count=2, partition_rebalance_delay_ms=0, dmq_eligible_default=True
        ),
    ],
    ids=["exclusive", "partitioned"],
)
async def test_undeliverable_here_where_no_other_consumer_may_take_it_is_rejected(
    broker: Broker, amqp: Listener, config: QueueConfig
) -> None:
    """Only the link that holds an exclusive queue, or a message's partition, may take it:
    an avoided message waited there while its successors overtook it, for as long as that
    link stayed (a partition's order per key broken). It is rejected, as RabbitMQ answers
    undeliverable-here, and dead-lettered here. Real proton clients."""
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(config)

    def client() -> list[bytes]:
        conn = BlockingConnection(f"amqp://127.0.0.1:{amqp.port}", timeout=5)
        try:
            receivers = [conn.create_receiver("one", credit=5, name=n) for n in "ab"]
            time.sleep(0.5)  # the active one chosen, or the partitions shared
            sender = conn.create_sender("one")
            for i in range(1, 5):
                sender.send(AmqpMessage(body=b"m%d" % i, group_id="K"))
            got: list[bytes] = []
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and len(got) < 4:
                for receiver in receivers:
                    with contextlib.suppress(Timeout):
                        received = receiver.receive(0.1)
                        body = bytes(received.body)
                        got.append(body)
                        if body == b"m1":
                            receiver.fetcher.unsettled[0].local.undeliverable = True
                            receiver.release()  # modified, undeliverable-here
                        else:
                            receiver.accept()
            return got
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == [b"m1", b"m2", b"m3", b"m4"]  # m1 once
    dead: list[Delivery] = []
    flow = await broker.bind(DEAD_MESSAGE_QUEUE, dead.append)
    await wait_for(lambda: len(dead) == 1)
    assert (dead[0].message.payload, dead[0].message.annotations["x-dmq-reason"]) == (
        b"m1",
        "rejected",
    )
    await flow.close()
