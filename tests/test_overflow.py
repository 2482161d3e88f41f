"""Overflow policies: reject (default), ring (drop oldest), producer flow control."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import redis

from gateway.broker import Broker
from gateway.engine import keys, library, spool
from gateway.engine.flows import Flow
from gateway.engine.ordered_calls import NotSent
from gateway.engine.partitions import partition_of
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message, Outcome, encode
from tests.test_engine import wait_for
from tests.test_last_value import browse_all


def msg(payload: str, priority: int = 4, **props: str) -> Message:
    return Message(
        destination="q",
        to_queue=True,
        payload=payload.encode(),
        priority=priority,
        user_properties=list(props.items()),
    )


async def acking_consumer(broker: Broker, queue: str, window: int) -> tuple[Flow, list[bytes]]:
    """A consumer that acks each message as it comes: its flow and the payloads, in
    arrival order."""
    got: list[bytes] = []
    flows = []

    def consume(d: Delivery) -> None:
        got.append(d.message.payload)
        flows[0].ack(d.entry_id)

    flows.append(await broker.bind(queue, consume, window=window))
    return flows[0], got


async def test_reject_is_the_default(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="q", max_messages=2))
    outcomes = [await broker.publish(msg(f"{i}")) for i in range(3)]
    assert outcomes == [Outcome.OK, Outcome.OK, Outcome.QUEUE_FULL]


async def test_ring_drops_the_oldest_undelivered(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="q", max_messages=3, overflow="ring"))
    for i in range(3):
        await broker.publish(msg(f"{i}"))
    got: list[Delivery] = []
    await broker.bind("q", got.append, window=1)  # holds "0": delivered, never dropped
    await wait_for(lambda: len(got) == 1)
    for i in range(3, 6):
        assert await broker.publish(msg(f"{i}")) is Outcome.OK
    info = await broker.queues.info("q")
    assert info.messages == 3 and info.counters["dropped"] == 3
    seen: list[Delivery] = []
    await broker.bind("q", seen.append, browse=True)
    await wait_for(lambda: len(seen) == 3)
    assert [d.message.payload for d in seen] == [b"0", b"4", b"5"]


async def test_ring_takes_a_message_when_only_delivered_ones_are_left(broker: Broker) -> None:
    """A ring never refuses a publisher: with every message of the queue delivered and not
    settled yet (a prefetch as large as the limit), the next one was refused (queue full).
    It is taken over the limit, which then bounds the waiting ones (RabbitMQ's drop-head
    counts only ready messages). (Found by a review.)"""
    await broker.declare_queue(QueueConfig(name="q", max_messages=3, overflow="ring"))
    for i in range(3):
        await broker.publish(msg(f"{i}"))
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=3)
    await wait_for(lambda: len(got) == 3)
    assert [await broker.publish(msg(f"{i}")) for i in (3, 4)] == [Outcome.OK, Outcome.OK]
    info = await broker.queues.info("q")
    assert info.messages == 4 and info.counters["dropped"] == 1  # "3" made room for "4"
    for d in got:
        flow.ack(d.entry_id)
    await wait_for(lambda: len(got) == 4)
    assert [d.message.payload for d in got] == [b"0", b"1", b"2", b"4"]


async def test_a_message_larger_than_a_queues_byte_quota_is_refused_at_once(
    broker: Broker,
) -> None:
    """It can never fit, even in the empty queue: under flow_control it was held for good,
    and held back every later message of the node to the queue. (Found by a review.)"""
    await broker.declare_queue(QueueConfig(name="q", max_spool_bytes=2000, overflow="flow_control"))
    big = broker.publish_nowait(msg("x" * 5000))
    assert await asyncio.wait_for(big, 2) is Outcome.QUOTA_EXCEEDED
    assert await asyncio.wait_for(broker.publish(msg("small")), 2) is Outcome.OK
    info = await broker.queues.info("q")
    assert info.messages == 1 and not info.blocked


@pytest.mark.parametrize(
    "kind",
    [{"message_groups": "default"}, {"selector": "rank IS NOT NULL"}],
    ids=["grouped", "selective"],
)
async def test_ring_drops_the_oldest_waiting_where_entries_wait_held(
    broker: Broker, kind: dict[str, str]
) -> None:
    """Message-group and selective queues keep their waiting entries in the holding
    consumer: the ring drops the oldest of those as it does on a plain queue."""
    selector = kind.pop("selector", None)
    await broker.declare_queue(QueueConfig(name="q", max_messages=3, overflow="ring", **kind))
    for i in range(3):
        await broker.publish(msg(f"{i}", rank=f"{i}"))
    got: list[Delivery] = []
    await broker.bind("q", got.append, window=1, selector=selector)  # holds one
    await wait_for(lambda: len(got) == 1)
    for i in range(3, 6):
        assert await broker.publish(msg(f"{i}", rank=f"{i}")) is Outcome.OK
    info = await broker.queues.info("q")
    assert info.messages == 3 and info.counters["dropped"] == 3
    seen: list[Delivery] = []
    await broker.bind("q", seen.append, browse=True)
    await wait_for(lambda: len(seen) == 3)
    assert [d.message.payload for d in seen] == [b"0", b"4", b"5"]  # "0": delivered, kept


async def test_one_big_message_drops_more_entries_than_lua_can_unpack(broker: Broker) -> None:
    """A ring queue with a byte quota takes one message that displaces ~9,000 small ones:
    the drop deletes them in several calls (Lua's unpack stops near 8,000 values)."""
    small = [msg(f"{i:05d}") for i in range(9_000)]
    for i, m in enumerate(small):
        m.id = f"s{i:05d}"  # every stored entry the same size
    blob = len(encode(small[0]))
    quota = 9_000 * blob
    await broker.declare_queue(QueueConfig(name="q", max_spool_bytes=quota, overflow="ring"))
    outcomes = await asyncio.gather(*(broker.publish_nowait(m) for m in small))
    assert set(outcomes) == {Outcome.OK}
    big = msg("b" * (quota - 10 * blob))
    big.id = "big"
    kept = (quota - len(encode(big))) // blob
    assert await broker.publish(big) is Outcome.OK
    info = await broker.queues.info("q")
    assert 9_000 - kept > 8_000
    assert (info.counters["dropped"], info.messages) == (9_000 - kept, kept + 1)
    assert info.spooled_bytes == kept * blob + len(encode(big))
    assert await broker.redis.xlen(keys.queue_stream("q")) == kept + 1


async def test_flow_control_withholds_acks_until_the_queue_drains(broker: Broker) -> None:
    await broker.declare_queue(
        QueueConfig(name="q", max_messages=5, overflow="flow_control", resume_percent=40)
    )
    futures = [broker.publish_nowait(msg(f"{i}")) for i in range(8)]
    await asyncio.sleep(0.3)
    assert [f.done() for f in futures] == [True] * 5 + [False] * 3, "3 publishers wait"
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=10)
    await wait_for(lambda: len(got) == 5)
    for d in got[:3]:
        flow.ack(d.entry_id)  # depth 2: not below 40% of 5, still blocked
    await asyncio.sleep(0.3)
    assert not any(f.done() for f in futures[5:])
    flow.ack(got[3].entry_id)  # depth 1: publishing resumes
    await wait_for(lambda: all(f.done() for f in futures), timeout=5)
    assert {f.result() for f in futures} == {Outcome.OK}
    await wait_for(lambda: len(got) == 8)
    assert [d.message.payload for d in got] == [b"%d" % i for i in range(8)], "in order"


async def test_a_stopping_node_refuses_the_publishes_it_holds_and_stores_none_later(
    redis_url: str,
) -> None:
    """A publish producer flow control holds when its node stops is refused (not sent),
    and the stopped node does not store it once the queue has room: its publisher's
    connection ended unanswered, so the client sends it again (it was stored twice)."""
    client = await library.connect(redis_url)
    node = Broker(client, heartbeat=0.2, node_ttl=1.0)
    await node.start()
    await node.declare_queue(QueueConfig(name="q", max_messages=1, overflow="flow_control"))
    assert await node.publish(msg("0")) is Outcome.OK
    held = node.publish_nowait(msg("1"))
    await asyncio.sleep(0.2)
    assert not held.done()
    await asyncio.wait_for(node.stop(), 5)
    try:
        assert held.done() and isinstance(held.exception(), NotSent)
        await client.hset(keys.queue_config("q"), "max_messages", 100)  # room again
        await asyncio.sleep(0.3)  # the held publish was retried every 50 ms
        assert await client.xlen(keys.queue_stream("q")) == 1
    finally:
        await client.aclose()


def keyed(payload: str, priority: int, key: str) -> Message:
    message = msg(payload, priority)
    message.partition_key = key
    return message


@pytest.mark.parametrize("kind", ["priority", "partitioned"])
async def test_flow_control_blocks_a_whole_priority_or_partitioned_queue(
    broker: Broker, kind: str
) -> None:
    """Blocked, the whole queue holds its publishers until it drains below resume_percent,
    as a plain one does: its priority levels or partitions are not blocked one by one (a
    publisher of another level was taken up to the limit each time a consumer settled
    one, and the one held waited for good)."""
    shape = {"priorities": True} if kind == "priority" else {"partition_count": 2}
    await broker.declare_queue(
        QueueConfig(name="q", max_messages=5, overflow="flow_control", resume_percent=40, **shape)
    )
    first = [broker.publish_nowait(keyed(f"a{i}", 4, "a")) for i in range(6)]
    await asyncio.sleep(0.3)
    assert [f.done() for f in first] == [True] * 5 + [False], "the 6th is held: blocked"
    assert partition_of("a", 2) != partition_of("d", 2)
    later = broker.publish_nowait(keyed("d", 9, "d"))  # another level (or partition)
    await asyncio.sleep(0.3)
    assert not later.done(), "held too: the queue is blocked"
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=10)
    await wait_for(lambda: len(got) == 5)
    flow.ack(got[0].entry_id)  # depth 4: not below 40% of 5, still blocked
    await asyncio.sleep(0.3)
    assert not first[5].done() and not later.done()
    for d in got[1:4]:
        flow.ack(d.entry_id)  # depth 1: publishing resumes
    await wait_for(lambda: first[5].done() and later.done(), timeout=5)
    assert first[5].result() is Outcome.OK and later.result() is Outcome.OK
    await flow.close()


@pytest.mark.parametrize(
    ("shape", "batch"),
    [({}, spool.MAX_BATCH_MESSAGES), ({"partition_count": 1}, 4), ({"priorities": True}, 4)],
    ids=["plain", "partitioned", "priority"],
)
async def test_flow_control_keeps_order_with_batches_in_flight(
    broker: Broker, monkeypatch: pytest.MonkeyPatch, shape: dict, batch: int
) -> None:
    """Publishes keep coming while the queue blocks and resumes, in batches that overlap
    in flight: the consumer still sees them in the order they were published. A
    partition's or priority level's mark holds its messages: cleared by a later batch of
    one offer of held messages, it let a message overtake earlier ones still held (found
    by a review of the batched offer)."""
    monkeypatch.setattr(spool, "MAX_BATCH_MESSAGES", batch)
    config = QueueConfig(
        name="q", max_messages=40, overflow="flow_control", resume_percent=90, **shape
    )
    await broker.declare_queue(config)
    flow, got = await acking_consumer(broker, "q", 8)
    count = 2000
    futures = []
    for i in range(count):
        keyed = Message("q", b"%d" % i, partition_key="k", to_queue=True)
        futures.append(broker.publish_nowait(keyed))
        if i % 50 == 49:
            await asyncio.sleep(0)
    assert set(await asyncio.gather(*futures)) == {Outcome.OK}
    assert broker.spooler.flow_controlled > 0, "the queue blocked at least once"
    await wait_for(lambda: len(got) == count, timeout=20)
    assert got == [b"%d" % i for i in range(count)]
    await flow.close()


def spool_call_sizes(client: redis.Redis) -> list[int]:
    """The argument count of each gw_spool call in Redis's slow log (Redis shows 32 of
    them, the last saying how many more)."""
    sizes = []
    for entry in client.execute_command("SLOWLOG", "GET", 10_000):
        args = entry[3]
        if len(args) < 2 or args[1] != b"gw_spool":
            continue
        more = args[-1].startswith(b"... (") and args[-1].endswith(b" more arguments)")
        sizes.append(31 + int(args[-1].split()[1][1:]) if more else len(args))
    return sizes


async def test_held_messages_are_offered_again_in_batches_of_the_usual_size(
    broker: Broker, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every held message went again in one call, past the batch limits: 10,000 held
    MQTT publishes of 1 KiB made a 10 MB call every 50 ms, and Redis answered nothing
    else while it ran (~55 ms; found by a review). They go in batches of the usual size,
    and a queue met only in a later batch takes its messages, in order, while another
    queue stays full."""
    monkeypatch.setattr(spool, "MAX_BATCH_MESSAGES", 8)
    for name, limit in (("full", 1), ("q", 3)):
        config = QueueConfig(
            name=name, max_messages=limit, overflow="flow_control", resume_percent=100
        )
        await broker.declare_queue(config)
    full = [Message(destination="full", to_queue=True, payload=b"%d" % i) for i in range(21)]
    assert await broker.publish(full[0]) is Outcome.OK
    for i in range(3):
        assert await broker.publish(msg(f"{i}")) is Outcome.OK
    held = [broker.publish_nowait(m) for m in full[1:]]
    held += [broker.publish_nowait(msg(f"{i}")) for i in range(3, 8)]
    await wait_for(lambda: broker.spooler.flow_controlled >= 25)
    slowlog = redis.Redis.from_url(redis_url)
    slowlog.config_set("slowlog-log-slower-than", 0)
    slowlog.config_set("slowlog-max-len", 10_000)
    slowlog.slowlog_reset()
    try:
        _, got = await acking_consumer(broker, "q", 10)
        await wait_for(lambda: len(got) == 8)
        assert got == [b"%d" % i for i in range(8)]
        assert [f.done() for f in held] == [False] * 20 + [True] * 5
        sizes = spool_call_sizes(slowlog)
    finally:
        slowlog.config_set("slowlog-log-slower-than", 10_000)
    # its header: FCALL, the name, numkeys, node, nq, 2 names; then 2 per message
    assert sizes and max(sizes) <= 5 + 2 + 2 * 8, sizes


async def test_a_held_message_goes_once_its_queue_drains_while_another_stays_full(
    broker: Broker,
) -> None:
    """A topic message held by the full queue it met first, a message to the other held
    too: that one was held while the first queue stayed full, its queue drained, as the
    batch that offered the topic message never looked at its queue's mark (found by a
    review of the batched offer)."""
    for name in ("qa", "qb"):
        config = QueueConfig(name=name, max_messages=1, overflow="flow_control")
        await broker.queues.create(config, [("t/x", "smf")])
    await broker.router.reload()
    full, drained = broker.router.match("t/x")  # the order the spool checks them in
    for name in (full, drained):
        assert await broker.publish(Message(name, b"first", to_queue=True)) is Outcome.OK
    # 70 KB to 2 queues fills a batch (MAX_BATCH_BYTES) alone: the offer's first batch
    topic = broker.publish_nowait(Message("t/x", os.urandom(70_000)))
    later = broker.publish_nowait(Message(drained, b"later", to_queue=True))
    await asyncio.sleep(0.2)
    assert not topic.done() and not later.done()
    got: list[Delivery] = []
    flow = await broker.bind(drained, got.append, window=10)
    await wait_for(lambda: len(got) == 1)
    flow.ack(got[0].entry_id)
    await wait_for(later.done, timeout=3)
    assert later.result() is Outcome.OK and not topic.done()
    await flow.close()


async def test_a_held_mark_holds_back_the_nodes_newer_messages_until_its_retry(
    broker: Broker, redis_url: str
) -> None:
    await broker.declare_queue(QueueConfig(name="q", max_messages=10, overflow="flow_control"))
    marks = redis.Redis.from_url(redis_url)
    held_key = keys.queue_flow_held("q")
    now = int(marks.time()[0])
    marks.hset(held_key, broker.node_id, now - 3600)  # left by a stop before its retry
    assert await broker.publish(msg("lapsed")) is Outcome.OK
    assert not marks.hexists(held_key, broker.node_id), "a lapsed mark is dropped"
    marks.hset(held_key, broker.node_id, now)  # as if a message of this node was held
    before = broker.spooler.flow_controlled
    assert await broker.publish(msg("after")) is Outcome.OK  # held once, then retried
    assert broker.spooler.flow_controlled == before + 1
    assert not marks.hexists(held_key, broker.node_id), "the retry cleared the mark"
    await broker.queues.delete("q")
    assert not marks.exists(held_key)


async def test_ring_drops_returned_messages_oldest_first(broker: Broker) -> None:
    """Messages a consumer took and gave back wait at the head of the queue: the ring drops
    them first (RabbitMQ's drop-head), and never refuses the publisher while they wait."""
    await broker.declare_queue(QueueConfig(name="q", max_messages=3, overflow="ring"))
    for i in range(3):
        assert await broker.publish(msg(f"{i}")) is Outcome.OK
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=1)
    await wait_for(lambda: len(got) == 1)
    await flow.close()  # "0" back, waiting
    assert await broker.publish(msg("3")) is Outcome.OK
    assert await browse_all(broker, "q") == [b"1", b"2", b"3"]
    flow = await broker.bind("q", got.append, window=10)
    await wait_for(lambda: len(got) == 4)
    await flow.close()  # all three back: only returned messages wait
    assert await broker.publish(msg("4")) is Outcome.OK
    assert await browse_all(broker, "q") == [b"2", b"3", b"4"]
    assert (await broker.queues.info("q")).messages == 3


async def test_ring_drops_a_message_held_until_its_delivery_time(broker: Broker) -> None:
    """A message held for a later delivery time waits too: a consumer's fetch parked it,
    and the ring drops it when it is the oldest."""
    await broker.declare_queue(QueueConfig(name="q", max_messages=2, overflow="ring"))
    later = msg("later")
    later.not_before = int(time.time() * 1000) + 60_000
    assert await broker.publish(later) is Outcome.OK
    assert await broker.publish(msg("1")) is Outcome.OK
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=10)  # parks "later" until it is due
    await wait_for(lambda: len(got) == 1)
    assert await broker.publish(msg("2")) is Outcome.OK  # "1" is delivered: "later" goes
    await wait_for(lambda: len(got) == 2)
    await flow.close()
    assert [d.message.payload for d in got] == [b"1", b"2"]
    assert await broker.redis.zcard(keys.queue_timed("q")) == 0
    assert (await broker.queues.info("q")).messages == 2


async def full_and_holding(broker: Broker) -> asyncio.Future[Outcome]:
    """Queue q under flow control, full with "0" and "1", holding the publish of "2"."""
    await broker.declare_queue(QueueConfig(name="q", max_messages=2, overflow="flow_control"))
    assert await broker.publish(msg("0")) is Outcome.OK
    assert await broker.publish(msg("1")) is Outcome.OK
    held = broker.publish_nowait(msg("2"))
    await asyncio.sleep(0.3)
    assert not held.done(), "held by flow control"
    return held


@pytest.mark.parametrize("overflow", ["ring", "reject"])
async def test_leaving_flow_control_answers_held_publishers_at_once(
    broker: Broker, overflow: str
) -> None:
    """A flow-controlled queue switched at run time to ring or reject: held and new
    publishes get the new policy's answer, not a wait until the queue drains."""
    held = await full_and_holding(broker)
    await broker.update_queue("q", {"overflow": overflow})
    later = broker.publish_nowait(msg("3"))
    answered = await asyncio.wait_for(asyncio.gather(held, later), 3)
    expected = Outcome.OK if overflow == "ring" else Outcome.QUEUE_FULL
    assert answered == [expected, expected]
    assert (await broker.queues.info("q")).messages == 2


@pytest.mark.parametrize("overflow", ["ring", "reject"])
async def test_leaving_flow_control_stores_what_it_held_first(
    broker: Broker, redis_url: str, overflow: str
) -> None:
    """Switched away from flow control while it held a publisher's message, the queue stored
    that publisher's next message at once and the held one after it, at the node's retry
    (found by a review: m0-m3 m6-m9 m4 m5). The held mark holds under any policy."""
    held = await full_and_holding(broker)
    await broker.update_queue("q", {"overflow": overflow, "max_messages": 100})
    later = broker.publish_nowait(msg("3"))
    assert await asyncio.wait_for(asyncio.gather(held, later), 3) == [Outcome.OK] * 2
    assert await browse_all(broker, "q") == [b"0", b"1", b"2", b"3"]
    stats = redis.Redis.from_url(redis_url).hgetall(keys.queue_stats("q"))
    assert b"flow_held" not in stats, "the retry cleared the marks"


async def test_a_ring_priority_queue_drops_from_its_lowest_level(broker: Broker) -> None:
    """A priority queue's limits bound the whole queue: full, it drops the oldest message of
    its lowest level that has one, whatever the new message's level."""
    await broker.declare_queue(
        QueueConfig(name="q", priorities=True, max_messages=3, overflow="ring")
    )
    for payload, priority in (("a4", 4), ("b7", 7), ("c4", 4)):
        assert await broker.publish(msg(payload, priority=priority)) is Outcome.OK
    assert await broker.publish(msg("d9", priority=9)) is Outcome.OK  # "a4" goes
    assert await broker.publish(msg("e1", priority=1)) is Outcome.OK  # "c4" goes
    info = await broker.queues.info("q")
    assert (info.messages, info.counters["dropped"]) == (3, 2)
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=10)
    await wait_for(lambda: len(got) == 3)
    await flow.close()
    assert [d.message.payload for d in got] == [b"d9", b"b7", b"e1"]


async def test_a_ring_partitioned_queue_drops_its_oldest_in_any_partition(
    broker: Broker,
) -> None:
    await broker.declare_queue(
        QueueConfig(name="q", partition_count=2, max_messages=2, overflow="ring")
    )
    keys_by_partition: dict[int, str] = {}
    i = 0
    while len(keys_by_partition) < 2:
        keys_by_partition.setdefault(partition_of(f"k{i}", 2), f"k{i}")
        i += 1
    for payload, partition in (("a", 0), ("b", 0), ("c", 1)):
        m = msg(payload)
        m.partition_key = keys_by_partition[partition]
        assert await broker.publish(m) is Outcome.OK
    info = await broker.queues.info("q")
    assert (info.messages, info.counters["dropped"]) == (2, 1)
    stored = [p["messages"] for p in info.partitions]
    assert stored == [1, 1], stored  # "a" went: the oldest, from the other partition


async def test_a_shut_queue_counts_a_held_topic_message_once(broker: Broker) -> None:
    """A topic message a shut queue discards (discarded_shut) and another queue holds back
    (producer flow control) was counted at each retry of the held message, and one another
    queue refused was counted though its publisher sends it again."""
    await broker.queues.create(QueueConfig(name="a-shut"), [("t/>", "smf")])
    await broker.queues.update("a-shut", {"ingress_enabled": False})
    fc = QueueConfig(name="fc", max_messages=1, overflow="flow_control", resume_percent=100)
    await broker.queues.create(fc, [("t/>", "smf")])
    await broker.router.reload()
    topic = Message(destination="t/1", payload=b"1")
    assert await broker.publish(topic) is Outcome.OK
    held = broker.publish_nowait(Message(destination="t/2", payload=b"2"))
    await asyncio.sleep(0.5)  # retried every 50 ms meanwhile
    assert not held.done()
    got: list[Delivery] = []
    flow = await broker.bind("fc", got.append)
    await wait_for(lambda: len(got) == 1)
    flow.ack(got[0].entry_id)
    assert await asyncio.wait_for(held, 5) is Outcome.OK
    assert (await broker.queues.info("a-shut")).counters["discarded_shut"] == 2
    await flow.close()
    await broker.queues.update("fc", {"overflow": "reject"})
    refused = await broker.publish(Message(destination="t/3", payload=b"3"))  # "fc" full
    assert refused is Outcome.QUEUE_FULL
    assert (await broker.queues.info("a-shut")).counters["discarded_shut"] == 2
