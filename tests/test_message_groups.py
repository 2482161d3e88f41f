"""Message groups on non-partitioned queues (Qpid Broker-J default and shared-groups modes)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.broker import Broker
from gateway.engine.flows import Flow
from gateway.engine.queues import DEAD_MESSAGE_QUEUE, QueueConfig, QueueError
from gateway.model import Delivery, Message
from tests.conftest import running_node
from tests.test_engine import wait_for


def grouped(group: str | None, payload: str) -> Message:
    return Message(destination="g", to_queue=True, payload=payload.encode(), partition_key=group)


async def consumer(broker: Broker, window: int = 10) -> tuple[Flow, list[Delivery]]:
    got: list[Delivery] = []
    flow = await broker.bind("g", got.append, window=window)
    return flow, got


def groups_of(got: list[Delivery]) -> set[str | None]:
    return {d.message.partition_key for d in got}


async def test_default_mode_keeps_a_group_on_one_consumer(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="g", message_groups="default"))
    a, got_a = await consumer(broker, window=4)
    for i in range(30):
        await broker.publish(grouped(f"g{i % 6}", f"{i}"))
    # a takes the first four messages, so four groups; b, bound only then, gets the other
    # two (bound together, which one first touches each group depends on timing)
    await wait_for(lambda: len(got_a) == 4)
    _b, got_b = await consumer(broker, window=40)
    await wait_for(lambda: len(got_b) == 10)
    await asyncio.sleep(0.2)
    assert groups_of(got_a) == {"g0", "g1", "g2", "g3"}
    assert not groups_of(got_a) & groups_of(got_b), "no group reaches two consumers"
    owner = {g: "a" for g in groups_of(got_a)} | {g: "b" for g in groups_of(got_b)}
    # acking does not release a group in default mode: a's groups wait for a
    while len(got_a) + len(got_b) < 30:
        for d in list(got_a):
            a.ack(d.entry_id)
        await asyncio.sleep(0.05)
    for name, got in (("a", got_a), ("b", got_b)):
        for d in got:
            assert owner.setdefault(d.message.partition_key, name) == name
        for group in groups_of(got):
            seq = [int(d.message.payload) for d in got if d.message.partition_key == group]
            assert seq == sorted(seq), "a group's messages arrive in order"


async def test_default_mode_consumers_bound_before_the_messages_never_share_a_group(
    broker: Broker,
) -> None:
    """Both consumers compete from the first message on (which one first touches a group
    is up to timing): still no group reaches both, and each group arrives in order."""
    await broker.declare_queue(QueueConfig(name="g", message_groups="default"))
    a, got_a = await consumer(broker, window=4)
    b, got_b = await consumer(broker, window=4)
    for i in range(30):
        await broker.publish(grouped(f"g{i % 6}", f"{i}"))
    acked = {a: 0, b: 0}
    deadline = asyncio.get_running_loop().time() + 10
    while len(got_a) + len(got_b) < 30:  # each acks what it got: its window refills
        assert asyncio.get_running_loop().time() < deadline, "not every message arrived"
        for flow, got in ((a, got_a), (b, got_b)):
            for d in got[acked[flow] :]:
                flow.ack(d.entry_id)
            acked[flow] = len(got)
        await asyncio.sleep(0.05)
    assert not groups_of(got_a) & groups_of(got_b), "no group reaches two consumers"
    for got in (got_a, got_b):
        for group in groups_of(got):
            seq = [int(d.message.payload) for d in got if d.message.partition_key == group]
            assert seq == sorted(seq), "a group's messages arrive in order"


async def test_a_closed_consumer_hands_its_groups_on(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="g", message_groups="default"))
    a, got_a = await consumer(broker, window=10)
    for i in range(4):
        await broker.publish(grouped("G", f"{i}"))
    await wait_for(lambda: len(got_a) == 4)
    a.ack(got_a[0].entry_id)
    _b, got_b = await consumer(broker, window=10)
    await asyncio.sleep(0.2)
    assert got_b == [], "G stays with a while a lives"
    await a.close()
    await wait_for(lambda: len(got_b) == 3)
    assert [d.message.payload for d in got_b] == [b"1", b"2", b"3"]
    assert all(d.redelivered and d.delivery_count == 2 for d in got_b)


async def test_a_consumer_that_held_none_of_its_group_hands_it_on_at_once(
    broker: Broker,
) -> None:
    """An AMQP receiver of one credit per receive(): it took and accepted G0, then closed.
    G was freed, but nothing woke the consumer waiting for it (no message went back):
    that one had G1 and G2 only at its node's idle poll (10 heartbeats: 10 s by default)."""
    await broker.declare_queue(QueueConfig(name="g", message_groups="default"))
    got_a: list[Delivery] = []
    a = await broker.bind("g", got_a.append, window=10, credit=1)
    for i in range(3):
        await broker.publish(grouped("G", f"G{i}"))
    await wait_for(lambda: len(got_a) == 1)
    a.ack(got_a[0].entry_id)
    _b, got_b = await consumer(broker)
    await asyncio.sleep(0.2)
    assert got_b == [], "G stays with a while a lives"
    await a.close()
    await wait_for(lambda: len(got_b) == 2, 1.0)  # the idle poll: 2 s at this heartbeat
    assert [d.message.payload for d in got_b] == [b"G1", b"G2"]


@pytest.mark.parametrize("rest", ["ack", "release", "requeue"])
async def test_a_group_let_go_goes_on_when_its_consumer_without_credit_settles(
    broker: Broker, rest: str
) -> None:
    """README: a consumer that cannot take one of its group's messages (undeliverable-here)
    frees the group once it holds none of it. One out of credit settled the rest of it, and
    the group stayed its own: only its next fetch, which it never made, freed it."""
    await broker.declare_queue(QueueConfig(name="g", message_groups="default"))
    got_a: list[Delivery] = []
    a = await broker.bind("g", got_a.append, window=10, credit=2)
    await broker.publish(grouped("G", "m0"))
    await broker.publish(grouped("G", "m1"))
    await wait_for(lambda: len(got_a) == 2)
    _b, got_b = await consumer(broker, window=5)
    a.avoid(got_a[0].entry_id, False)
    getattr(a, rest)(got_a[1].entry_id)
    expected = [b"m0"] if rest == "ack" else [b"m0", b"m1"]
    await wait_for(lambda: len(got_b) == len(expected), 1.0)
    assert [d.message.payload for d in got_b] == expected


async def test_an_empty_group_id_is_no_group_in_a_grouped_dead_message_queue(
    broker: Broker,
) -> None:
    """An empty group id is no group on a grouped queue; dead-lettered into a grouped dead
    message queue, the messages were all one group "" there, taken by one consumer."""
    await broker.declare_queue(QueueConfig(name="dlq", message_groups="default"))
    await broker.declare_queue(
        QueueConfig(
            name="g", message_groups="default", dead_message_queue="dlq", dmq_eligible_default=True
        )
    )
    source, got = await consumer(broker)
    for i in range(4):
        await broker.publish(grouped("", f"{i}"))
    await wait_for(lambda: len(got) == 4)
    for d in got:
        source.reject(d.entry_id)
    await source.close()
    for _ in range(100):
        if (await broker.queues.info("dlq")).messages == 4:
            break
        await asyncio.sleep(0.02)
    got_c: list[Delivery] = []
    got_d: list[Delivery] = []
    await broker.bind("dlq", got_c.append, window=1)
    await broker.bind("dlq", got_d.append, window=10)
    await wait_for(lambda: len(got_c) + len(got_d) == 4)
    assert sorted((len(got_c), len(got_d))) == [1, 3], "no group: each takes what it has room for"


async def test_a_starved_consumer_looks_again_when_the_others_take_a_few_and_stop(
    redis_url: str,
) -> None:
    """The busy consumer takes its prefetch more and works on it slowly: the other group's
    message comes in the starved consumer's reach without a wake (a countdown of a
    window's worth of takes left it to the idle poll, 10 s here)."""
    async with running_node(redis_url, heartbeat=1.0, node_ttl=5.0) as node:  # idle poll: 10 s
        await node.declare_queue(QueueConfig(name="g", message_groups="default"))
        a, got_a = await consumer(node, window=10)
        for i in range(80):
            node.publish_nowait(grouped("busy", f"{i}"))
        await node.publish(grouped("other", "o0"))
        await wait_for(lambda: len(got_a) == 10)
        _b, got_b = await consumer(node, window=10)
        await asyncio.sleep(0.3)  # b looked at 64 waiting: all busy's
        assert got_b == []
        for d in list(got_a):
            a.ack(d.entry_id)
        await wait_for(lambda: len(got_a) == 20)  # 60 busy and o0 wait: in b's reach
        await wait_for(lambda: got_b != [], timeout=3)
        assert [d.message.payload for d in got_b] == [b"o0"]


async def test_a_starved_consumer_looks_again_when_the_others_messages_expire(
    redis_url: str,
) -> None:
    """The busy group's waiting messages expire: no fetch takes them, and the other
    group's message, the only one left, reaches the starved consumer all the same."""
    async with running_node(redis_url, heartbeat=1.0, node_ttl=5.0) as node:  # idle poll: 10 s
        await node.declare_queue(QueueConfig(name="g", message_groups="default"))
        _a, got_a = await consumer(node, window=1)
        await node.publish(grouped("busy", "first"))
        await wait_for(lambda: len(got_a) == 1)  # a holds busy: works on it for long
        expires = int(time.time() * 1000) + 700
        for i in range(80):
            message = grouped("busy", f"{i}")
            message.expiration = expires
            node.publish_nowait(message)
        await node.publish(grouped("other", "o0"))
        _b, got_b = await consumer(node, window=10)
        await asyncio.sleep(0.3)
        assert got_b == []
        await wait_for(lambda: got_b != [], timeout=4)  # the sweep: each heartbeat (1 s)
        assert [d.message.payload for d in got_b] == [b"o0"]


async def test_a_starved_consumer_woken_often_keeps_one_look_again_going(
    broker: Broker,
) -> None:
    """Each publish to the busy group wakes the starved consumer, whose fetch finds only
    that group again: it keeps one look again going, not one more per such fetch (each
    went on for good, every 2 s at most: 100 publishes, 50 fetches a second)."""
    await broker.declare_queue(QueueConfig(name="g", message_groups="default"))
    _a, got_a = await consumer(broker, window=1)
    for i in range(64):
        broker.publish_nowait(grouped("busy", f"{i}"))
    await wait_for(lambda: len(got_a) == 1)  # a holds busy; 63 of it wait
    await consumer(broker, window=10)  # starved
    for i in range(100):
        await broker.publish(grouped("busy", f"more{i}"))  # each wakes it
        await asyncio.sleep(0.01)
    await asyncio.sleep(2.5)  # the looks again back off to 2 s
    before = (await broker.redis.info("commandstats"))["cmdstat_fcall"]["calls"]
    await asyncio.sleep(2.0)
    calls = (await broker.redis.info("commandstats"))["cmdstat_fcall"]["calls"] - before
    assert calls < 50, calls  # ~30: the heartbeats' (0.2 s) and one look again


async def test_idle_consumers_of_a_busy_groups_backlog_cost_little(broker: Broker) -> None:
    """Starved consumers look again now and then, not at each of the busy one's fetches
    (each woken one looked at its window again: 150 times the Redis reads of the busy
    consumer alone, with three idle ones)."""
    await broker.declare_queue(QueueConfig(name="g", message_groups="default"))

    async def reads_to_drain(group: str, idle: int) -> int:
        for i in range(300):
            broker.publish_nowait(grouped(group, f"{i}"))
        busy, got = await consumer(broker, window=1)
        await wait_for(lambda: len(got) == 1)  # it holds the group now
        idlers = [(await consumer(broker, window=5))[0] for _ in range(idle)]
        await asyncio.sleep(0.3)
        before = (await broker.redis.info("commandstats"))["cmdstat_xrange"]["calls"]
        done = 0
        while done < 300:
            for d in got[done:]:
                busy.ack(d.entry_id)
            done = len(got)
            await asyncio.sleep(0.005)
        after = (await broker.redis.info("commandstats"))["cmdstat_xrange"]["calls"]
        for flow in (busy, *idlers):
            await flow.close()
        return after - before

    alone = await reads_to_drain("g1", 0)
    crowded = await reads_to_drain("g2", 3)
    assert crowded < 6 * alone, (alone, crowded)


async def test_a_group_freed_as_its_last_message_goes_to_the_dmq_wakes_its_next_consumer(
    broker: Broker,
) -> None:
    """Shared mode: the message a consumer gave back after its last allowed delivery goes
    to the dead message queue and frees its group: the consumer waiting for the group's
    next message gets it at once, not at the idle poll."""
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(QueueConfig(name="g", max_redelivery=1, message_groups="shared"))
    first = grouped("G", "m1")
    first.dmq_eligible = True
    await broker.publish(first)
    await broker.publish(grouped("G", "m2"))
    a, got_a = await consumer(broker, window=1)
    await wait_for(lambda: len(got_a) == 1)
    a.requeue(got_a[0].entry_id)  # its first delivery failed
    await wait_for(lambda: len(got_a) == 2)
    _b, got_b = await consumer(broker, window=5)
    await asyncio.sleep(0.3)
    assert got_b == [], "the group is a's while it holds m1"
    a.requeue(got_a[1].entry_id)  # its last allowed delivery failed: dead
    await a.close()
    await wait_for(lambda: len(got_b) == 1, timeout=0.8)  # the idle poll: 2 s here
    assert got_b[0].message.payload == b"m2"
    assert (await broker.queues.info(DEAD_MESSAGE_QUEUE)).messages == 1


async def test_messages_without_a_group_go_to_anyone_in_default_mode(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="g", message_groups="default"))
    _, got_a = await consumer(broker, window=3)
    _, got_b = await consumer(broker, window=3)
    for i in range(6):
        await broker.publish(grouped(None, f"{i}"))
    await wait_for(lambda: len(got_a) == 3 and len(got_b) == 3)


async def test_shared_mode_frees_a_group_once_settled(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="g", message_groups="shared"))
    a, got_a = await consumer(broker, window=1)
    for i in range(2):
        await broker.publish(grouped("G", f"{i}"))
    await broker.publish(grouped(None, "nogroup"))
    await wait_for(lambda: len(got_a) == 1)
    _b, got_b = await consumer(broker, window=5)
    await asyncio.sleep(0.3)
    # b may not take G while a holds G:0; the message without a group belongs to the
    # default group, which nobody holds yet
    assert all(d.message.partition_key != "G" for d in got_b)
    assert [d.message.payload for d in got_b] == [b"nogroup"]
    a.ack(got_a[0].entry_id)
    await wait_for(lambda: len(got_a) + len(got_b) == 3)
    g_msgs = [d for d in got_a + got_b if d.message.partition_key == "G"]
    assert [d.message.payload for d in g_msgs] == [b"0", b"1"]
    info = (await broker.queues.info("g")).to_json()
    assert info["message_groups"] == "shared" and info["default_group"] == "qpid.no-group"


async def test_distinct_groups_never_block_each_other(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="g", message_groups="shared"))
    _a, got_a = await consumer(broker, window=1)
    await broker.publish(grouped("slow", "s0"))
    await wait_for(lambda: len(got_a) == 1)  # a holds 'slow' and never acks
    for i in range(5):
        await broker.publish(grouped("slow", f"s{i + 1}"))
        await broker.publish(grouped(f"fast{i}", f"f{i}"))
    _b, got_b = await consumer(broker, window=20)
    await wait_for(lambda: len(got_b) == 5)
    assert sorted(d.message.payload for d in got_b) == [b"f%d" % i for i in range(5)]


async def test_group_settings_are_validated(broker: Broker) -> None:
    with pytest.raises(QueueError):
        await broker.declare_queue(QueueConfig(name="g", message_groups="sticky"))
    with pytest.raises(QueueError):
        await broker.declare_queue(
            QueueConfig(name="g", message_groups="default", partition_count=2)
        )
