"""Priority queues: highest priority first, FIFO within a priority."""

from __future__ import annotations

import asyncio

import pytest

from gateway.broker import BindError, Broker
from gateway.engine import keys
from gateway.engine.keys import partition_queue, priority_queue
from gateway.engine.queues import DEAD_MESSAGE_QUEUE, QueueConfig, QueueError, stream_queues
from gateway.model import Delivery, Message, Outcome
from tests.test_engine import wait_for


def msg(payload: str, priority: int, **kw) -> Message:
    return Message(
        destination="pq", to_queue=True, payload=payload.encode(), priority=priority, **kw
    )


async def test_highest_priority_first_fifo_within(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="pq", priorities=True))
    for payload, priority in [("a4", 4), ("b9", 9), ("c0", 0), ("d9", 9), ("e4", 4)]:
        await broker.publish(msg(payload, priority))
    assert (await broker.queues.info("pq")).messages == 5
    got: list[Delivery] = []
    flow = await broker.bind("pq", got.append, window=10)
    await wait_for(lambda: len(got) == 5)
    assert [d.message.payload for d in got] == [b"b9", b"d9", b"a4", b"e4", b"c0"]
    flow.requeue(got[2].entry_id)
    await wait_for(lambda: len(got) == 6)  # a requeued message returns to its level
    assert got[5].message.payload == b"a4" and got[5].redelivered
    for d in got[:2] + got[3:]:
        flow.ack(d.entry_id)
    await asyncio.sleep(0.1)
    assert (await broker.queues.info("pq")).messages == 0


async def test_a_small_window_still_takes_the_highest_first(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="pq", priorities=True))
    for i in range(3):
        await broker.publish(msg(f"low{i}", 1))
    got: list[Delivery] = []
    flow = await broker.bind("pq", got.append, window=1)
    await wait_for(lambda: len(got) == 1)
    await broker.publish(msg("urgent", 8))
    flow.ack(got[0].entry_id)
    await wait_for(lambda: len(got) == 2)
    assert got[1].message.payload == b"urgent"


async def test_priority_queue_dead_letters_keep_their_origin(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(QueueConfig(name="pq", priorities=True, max_redelivery=1))
    await broker.publish(msg("x", 7, dmq_eligible=True))
    got: list[Delivery] = []
    flow = None

    def nack(d: Delivery) -> None:
        got.append(d)
        flow.requeue(d.entry_id)

    flow = await broker.bind("pq", nack)
    await wait_for(lambda: len(got) == 2)
    dead: list[Delivery] = []
    await broker.bind(DEAD_MESSAGE_QUEUE, dead.append)
    await wait_for(lambda: len(dead) == 1)
    assert dead[0].message.annotations["x-origin-queue"] == "pq"


async def test_priority_queue_limits(broker: Broker) -> None:
    with pytest.raises(QueueError):
        await broker.declare_queue(QueueConfig(name="x", priorities=True, partition_count=2))
    with pytest.raises(QueueError, match="non-destructive"):
        await broker.declare_queue(QueueConfig(name="x", priorities=True, non_destructive=True))
    await broker.declare_queue(QueueConfig(name="pq", priorities=True))
    with pytest.raises(BindError) as err:
        await broker.bind("pq", lambda d: None, selector="a = 1")
    assert err.value.code == "unsupported"


async def test_levels_and_partitions_are_no_queues_a_client_names(broker: Broker) -> None:
    """A priority level or a partition is part of its queue: deleting, changing, binding,
    browsing or sending to one by its name is refused as for a queue that does not exist,
    and the queue works on."""
    await broker.declare_queue(QueueConfig(name="pq", priorities=True))
    await broker.declare_queue(QueueConfig(name="parted", partition_count=2))
    for child in (priority_queue("pq", 3), partition_queue("parted", 0)):
        for change in (
            broker.delete_queue(child),
            broker.update_queue(child, {"max_messages": 1}),
            broker.queues.info(child),
            broker.queues.change_subscriptions(child, "add", [("a/b", "mqtt")]),
        ):
            with pytest.raises(QueueError) as err:
                await change
            assert err.value.code == "not_found"
        for browse in (False, True):
            with pytest.raises(BindError) as bind_err:
                await broker.bind(child, lambda d: None, browse=browse)
            assert bind_err.value.code == "not_found"
        sent = Message(destination=child, to_queue=True, payload=b"x")
        assert await broker.publish(sent) is Outcome.NOT_FOUND
    await broker.publish(msg("p3", 3))
    got: list[Delivery] = []
    await broker.bind("pq", got.append)
    await wait_for(lambda: len(got) == 1)
    assert got[0].message.payload == b"p3"
    assert (await broker.queues.info("pq")).messages == 1


@pytest.mark.parametrize(
    "limits",
    [{"max_messages": 3}, {"max_spool_bytes": 300}],
    ids=["max_messages", "max_spool_bytes"],
)
async def test_limits_bound_the_whole_queue_not_each_level_or_partition(
    broker: Broker, limits: dict[str, int]
) -> None:
    """A priority queue's or a partitioned queue's limits count what all its levels or
    partitions hold, as a queue's do on RabbitMQ, Solace and Qpid."""
    await broker.declare_queue(QueueConfig(name="pq", priorities=True, **limits))
    await broker.declare_queue(QueueConfig(name="parted", partition_count=4, **limits))
    for name in ("pq", "parted"):
        outcomes = [
            await broker.publish(
                Message(
                    destination=name,
                    to_queue=True,
                    payload=b"x" * 60,
                    priority=i % 10,
                    partition_key=f"k{i}",
                )
            )
            for i in range(12)
        ]
        stored = outcomes.count(Outcome.OK)
        assert stored == 3 and (await broker.queues.info(name)).messages == 3, outcomes
        assert set(outcomes[stored:]) <= {Outcome.QUEUE_FULL, Outcome.QUOTA_EXCEEDED}


async def test_a_priority_queue_is_never_a_last_value_queue(broker: Broker) -> None:
    """Each level is a stream of its own, so one key's values would live on in several:
    the combination is refused when declared and when a change would make it."""
    for extra in ({"lvq_key": "sym"}, {"max_spool_bytes": 0}):
        with pytest.raises(QueueError, match="last value queue"):
            await broker.declare_queue(QueueConfig(name="p", priorities=True, **extra))
    await broker.declare_queue(QueueConfig(name="p", priorities=True))
    with pytest.raises(QueueError, match="last value queue"):
        await broker.update_queue("p", {"max_spool_bytes": 0})
    assert (await broker.queues.config("p")).max_spool_bytes != 0


async def test_forget_reader_of_a_priority_queue_drops_its_level_registrations(
    broker: Broker,
) -> None:
    """A Spark reader of a priority queue registers on its levels' streams: forgetting it
    (DELETE /api/v1/queues/{name}/readers/{reader}) drops every registration, or the
    levels keep acked entries for it for ever."""
    await broker.declare_queue(QueueConfig(name="prio", priorities=True))
    # what gateway.spark.source.StreamReader._register does for a priority queue
    levels = [q for _, q in stream_queues("prio", 0, True)]
    for queue in levels:
        await broker.redis.fcall("gw_reader_at", 0, queue, "retired", "0-0", 1)

    msg = Message(destination="prio", payload=b"p", to_queue=True, priority=4)
    assert await broker.publish(msg) is Outcome.OK
    got: list[Delivery] = []
    flow = await broker.bind("prio", got.append)
    await wait_for(lambda: len(got) == 1)
    flow.ack(got[0].entry_id)
    await flow.close()

    forgotten = await broker.queues.forget_reader("prio", "retired")
    still = [q for q in levels if await broker.redis.hexists(keys.queue_readers(q), "retired")]
    level4 = keys.queue_stream(keys.priority_queue("prio", 4))
    await asyncio.sleep(0.1)
    assert forgotten == len(levels) and not still, (
        f"forget_reader dropped {forgotten} registrations; still registered on {len(still)} "
        f"levels, which keep acked entries ({await broker.redis.xlen(level4)} in level 4)"
    )
