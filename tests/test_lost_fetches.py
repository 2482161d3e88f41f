# ruff: noqa: F811  (the fixtures imported from test_redis_outages)
"""A fetch that ran in Redis but whose answer was lost with the connection: its flow keeps
its id (an exclusive queue's lease, a partitioned queue's partitions) and gets what the
fetch took first, in the queue's order, once; what it settled meanwhile is not handed
out again."""

from __future__ import annotations

import asyncio

import pytest
import redis

from gateway.broker import Broker
from gateway.engine import keys
from gateway.engine.flows import Flow
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message, Outcome
from tests.redis_proxy import CuttingProxy
from tests.test_engine import to_queue, wait_for
from tests.test_redis_outages import node, proxy  # noqa: F401


@pytest.mark.parametrize("kind", ["plain", "exclusive", "partitioned", "priority", "grouped"])
async def test_what_a_fetch_whose_answer_was_lost_took_goes_to_its_flow_first(
    broker: Broker, node: Broker, proxy: CuttingProxy, kind: str
) -> None:
    """A fetch that ran in Redis, its answer lost with the connection: the flow keeps its
    id (so an exclusive queue's lease and a partitioned one's partitions) and gets what the
    fetch took before anything newer, once (not what it settled before). Unbound and bound
    again, its unsettled messages would go to the other consumer while it still held them."""
    config = {
        "plain": QueueConfig(name="lost"),
        "exclusive": QueueConfig(name="lost", access_type="exclusive"),
        "partitioned": QueueConfig(name="lost", partition_count=1, partition_rebalance_delay_ms=0),
        "priority": QueueConfig(name="lost", priorities=True),
        "grouped": QueueConfig(name="lost", message_groups="default"),
    }[kind]
    await broker.queues.create(config)
    for i in range(6):
        msg = to_queue("lost", b"%d" % i, partition_key="k", user_properties=[("g", "one")])
        assert await broker.publish(msg) is Outcome.OK
    got: list[Delivery] = []
    flow = await node.bind("lost", got.append, window=100, credit=2)
    await wait_for(lambda: len(got) == 2)
    first_id = flow.id
    other: list[Delivery] = []
    competing = kind in ("plain", "priority")  # another consumer would take the rest
    if not competing:  # a standby, holds no partition, or waits for the group
        await broker.bind("lost", other.append, window=100)
        await asyncio.sleep(0.3)
    proxy.cut_on = [b"gw_fetch"]
    flow.ack(got[0].entry_id)  # in the same round: recovered after it, not handed out again
    flow.set_credit(3)
    await wait_for(lambda: proxy.cuts == 1)
    await wait_for(lambda: len(got) == 5)
    for i in range(6, 8):
        msg = to_queue("lost", b"%d" % i, partition_key="k", user_properties=[("g", "one")])
        assert await broker.publish(msg) is Outcome.OK
    flow.set_credit(3)
    await wait_for(lambda: len(got) == 8)
    await asyncio.sleep(0.2)
    assert [d.message.payload for d in got] == [b"%d" % i for i in range(8)]
    assert flow.id == first_id, "the flow was bound again"
    assert other == [], "the other consumer got messages the first one holds"


async def _busy_pair(node: Broker, selector: str | None = None) -> tuple[Flow, list, Flow]:
    """F holding e0 of 2 messages on "q" (e1 waiting), and G with 300 waiting on "big"
    and no window yet: opened, G's batch makes a full round ahead of F's next fetch."""
    await node.queues.create(QueueConfig(name="q"))
    await node.queues.create(QueueConfig(name="big"))
    for i in range(300):
        assert await node.publish(to_queue("big", b"b%d" % i)) is Outcome.OK
    for i in range(2):
        msg = to_queue("q", b"%d" % i, user_properties=[("n", i)])
        assert await node.publish(msg) is Outcome.OK
    got_f: list[Delivery] = []
    f = await node.bind("q", got_f.append, window=10, credit=1, selector=selector)
    await wait_for(lambda: len(got_f) == 1)
    g = await node.bind("big", lambda d: g.ack(d.entry_id), window=0)
    await asyncio.sleep(0.1)
    return f, got_f, g


async def _held_by_one_consumer(node: Broker, f: Flow, got_f: list[Delivery]) -> None:
    """Another consumer H of "q" holds nothing F holds unsettled."""
    got_h: list[Delivery] = []
    await node.bind("q", got_h.append, window=10)
    await asyncio.sleep(1.0)
    held_by_f = {d.message.payload for d in got_f if d.entry_id in f.unacked}
    held_by_h = {d.message.payload for d in got_h}
    assert not (held_by_f & held_by_h), (
        f"both consumers hold {held_by_f & held_by_h} unsettled: F got "
        f"{[d.message.payload for d in got_f]}, H got {[d.message.payload for d in got_h]}"
    )


async def _handed_out_once(f: Flow, got_f: list[Delivery], redis_url: str) -> None:
    pending = redis.Redis.from_url(redis_url).xpending_range(
        keys.queue_stream("q"), "g", "-", "+", 10
    )
    assert [(d.message.payload, d.delivery_count) for d in got_f] == [(b"0", 1), (b"1", 1)], (
        f"F got {[(d.message.payload, d.delivery_count) for d in got_f]}; "
        f"flow.unacked={list(f.unacked)}; pending in Redis {pending}"
    )


@pytest.mark.parametrize("settle", ["ack", "release"])
async def test_a_settlement_sent_after_a_lost_fetch_is_not_handed_out_again(
    proxy: CuttingProxy, node: Broker, redis_url: str, settle: str
) -> None:
    """Two rounds in flight: X (G's batch of 256, a full round) and A (F's fetch, sent
    right after). F's consumer settles e0 meanwhile; once X is answered, round B carries
    that. The connection breaks after A ran in Redis and before B reached it. The
    recovery of A must not run before the settlement is sent again: it would hand e0 out
    again (it is no longer in flow.unacked), and a release would then give it to another
    consumer while F holds it."""
    f, got_f, g = await _busy_pair(node)
    proxy.delay_on = b"gw_fetch\r\n$1\r\n0\r\n$3\r\nbig\r\n"  # X's answer comes late
    proxy.delay, proxy.pre, proxy.after = 0.2, 0.3, 0.3
    proxy.cut_on = [b"gw_fetch", f.id.encode() + b"\r\n"]  # A runs, nothing after it
    g.set_window(256)  # round X: G's 256 (a full round) ...
    f.set_credit(1)  # ... round A: F's fetch, sent right after
    await asyncio.sleep(0.05)
    getattr(f, settle)(got_f[0].entry_id)  # while X and A are in flight
    await wait_for(lambda: proxy.cuts == 1)
    await asyncio.sleep(2.5)
    if settle == "release":
        await _held_by_one_consumer(node, f, got_f)
        return
    f.set_credit(5)
    await asyncio.sleep(1.0)
    await _handed_out_once(f, got_f, redis_url)


@pytest.mark.parametrize("selector", [None, "n > 0"])
async def test_a_lost_fetch_of_a_sorted_queue_is_handed_out_in_key_order(
    redis_url: str, proxy: CuttingProxy, node: Broker, selector: str | None
) -> None:
    """A sorted queue's lost fetch took its entries lowest key first: so they go out."""
    await node.declare_queue(QueueConfig(name="sq", sort_key="k"), [("sorted/>", "smf")])
    for n, (payload, key) in enumerate([("c", "c"), ("a", "a"), ("b", "b")]):
        msg = Message(
            destination="sq",
            to_queue=True,
            payload=payload.encode(),
            user_properties=[("k", key), ("n", n + 1)],
        )
        assert await node.publish(msg) is Outcome.OK
    got: list[Delivery] = []
    flow = await node.bind("sq", got.append, window=10, credit=0, selector=selector)
    await asyncio.sleep(0.2)
    proxy.cut_on = [b"gw_take" if selector else b"gw_fetch"]
    flow.set_credit(3)
    await wait_for(lambda: proxy.cuts == 1)
    await wait_for(lambda: len(got) == 3)
    await asyncio.sleep(1.0)
    assert [d.message.payload for d in got] == [b"a", b"b", b"c"], [
        (d.message.payload, d.entry_id, d.delivery_count) for d in got
    ]


async def test_lost_fetches_of_two_partitions_are_both_recovered_in_order(
    redis_url: str, proxy: CuttingProxy, node: Broker
) -> None:
    """Each partition's lost fetch is recovered, each partition in its order."""
    await node.queues.create(
        QueueConfig(name="pq", partition_count=2, partition_rebalance_delay_ms=0)
    )
    for i in range(8):
        msg = to_queue("pq", b"%d" % i, partition_key=f"k{i % 4}")
        assert await node.publish(msg) is Outcome.OK
    got: list[Delivery] = []
    flow = await node.bind("pq", got.append, window=100, credit=0)
    await wait_for(lambda: len(flow.parts) == 2)
    proxy.cut_on = [b"gw_fetch"]
    flow.set_credit(8)
    await wait_for(lambda: proxy.cuts == 1)
    await wait_for(lambda: len(got) == 8, timeout=5)
    await asyncio.sleep(0.5)
    by_key: dict[str, list[bytes]] = {}
    for d in got:
        by_key.setdefault(d.message.partition_key, []).append(d.message.payload)
    assert sorted(d.message.payload for d in got) == [b"%d" % i for i in range(8)]
    for k, ps in by_key.items():
        assert ps == sorted(ps, key=int), (k, ps)


async def test_a_recovery_refused_while_redis_loads_is_asked_again(
    redis_url: str, proxy: CuttingProxy, node: Broker
) -> None:
    """A recovery Redis refuses while it loads its data is asked again, not given up."""
    await node.queues.create(QueueConfig(name="lq"))
    for i in range(3):
        assert await node.publish(to_queue("lq", b"%d" % i)) is Outcome.OK
    got: list[Delivery] = []
    flow = await node.bind("lq", got.append, window=10, credit=0)
    first = flow.id
    await asyncio.sleep(0.1)
    proxy.cut_on = [b"gw_fetch"]
    proxy.loading_on = b"gw_recover"
    flow.set_credit(3)
    await wait_for(lambda: proxy.cuts == 1)
    await wait_for(lambda: len(got) == 3, timeout=6)
    assert proxy.refused == 1
    assert [d.message.payload for d in got] == [b"0", b"1", b"2"] and flow.id == first


async def test_a_settlement_refused_in_the_recoverys_round_is_not_handed_out_again(
    proxy: CuttingProxy, node: Broker, redis_url: str
) -> None:
    """F's fetch is lost; F acks e0 before the recovery goes: the round carries the ack,
    then gw_recover. Redis refuses the ack for now (-LOADING, it did not run) and then
    runs the recovery (its loading ended in between): e0 must not be handed out again."""
    await node.queues.create(QueueConfig(name="q"))
    for i in range(2):
        assert await node.publish(to_queue("q", b"%d" % i)) is Outcome.OK
    got_f: list[Delivery] = []
    f = await node.bind("q", got_f.append, window=10, credit=1)
    await wait_for(lambda: len(got_f) == 1)
    proxy.pre, proxy.after = 0.0, 0.2
    proxy.cut_on = [b"gw_fetch", f.id.encode() + b"\r\n"]
    proxy.loading_on = b"gw_settle"
    f.set_credit(1)
    await wait_for(lambda: proxy.ran == 1)
    f.ack(got_f[0].entry_id)  # before the recovery is sent: in its round, before it
    await wait_for(lambda: proxy.refused == 1)
    await asyncio.sleep(2.0)
    assert [d.message.payload for d in got_f] == [b"0", b"1"], [
        (d.message.payload, d.delivery_count) for d in got_f
    ]


def sel_msg(q: str, i: int) -> Message:
    return to_queue(q, b"%d" % i, user_properties=[("n", i)])


@pytest.mark.parametrize("settle", ["ack", "release"])
async def test_selector_lost_take_recovered_before_a_refused_ack_of_an_earlier_round(
    proxy: CuttingProxy, node: Broker, redis_url: str, settle: str
) -> None:
    """F (selector) settles e0 while round N (G's big fetch) is held; the settlement goes in
    round S, sent once N is finished, and is refused for now (-LOADING: it did not run).
    Round N+1 (sent right after N: F's selection) is finished after S was sent: its take
    runs on a pool connection whose answer is lost. The recovery waits until S is finished
    (and its settlement, sent again, ran): else it would find e0 still pending for F and
    hand it out again, and the settlement would then ack it (or, released, give it to
    another consumer while F holds it)."""
    f, got_f, g = await _busy_pair(node, selector="n >= 0")
    proxy.delay_on = b"gw_fetch\r\n$1\r\n0\r\n$3\r\nbig\r\n"  # round N's answers come late
    proxy.delay = 0.3
    proxy.cut_on = [b"gw_take"]  # the selection's take runs, its answer is lost
    proxy.loading_on = b"gw_settle"  # F's settlement: refused, not run
    g.set_window(256)  # round N: G's 256 (a full round) ...
    f.set_credit(1)  # ... round N+1: F's selection
    await asyncio.sleep(0.05)
    getattr(f, settle)(got_f[0].entry_id)  # while round N is held
    await wait_for(lambda: proxy.cuts == 1)
    await asyncio.sleep(2.5)
    assert proxy.refused == 1
    if settle == "release":
        await _held_by_one_consumer(node, f, got_f)
        return
    await _handed_out_once(f, got_f, redis_url)


async def test_a_recovery_asked_again_after_loading_overtakes_a_refused_ack_in_flight(
    proxy: CuttingProxy, node: Broker, redis_url: str
) -> None:
    """F is a plain consumer (no selector). F's fetch is lost; its recovery is refused for
    now (-LOADING) and asked again FETCH_RETRY later (_recover_again). Meanwhile round S
    (F's ack of e0, refused for now: it did not run) was sent and the pump is still
    finishing an earlier round (another consumer's selection, slow to answer). When the
    timer fires, the recovery still waits for S: run after the refused ack, it would find
    e0 pending for F and hand it out again."""
    await node.queues.create(QueueConfig(name="q"))
    await node.queues.create(QueueConfig(name="big"))
    await node.queues.create(QueueConfig(name="sq"))
    for i in range(300):
        assert await node.publish(to_queue("big", b"b%d" % i)) is Outcome.OK
    for i in range(3):
        assert await node.publish(to_queue("q", b"%d" % i)) is Outcome.OK
    assert await node.publish(sel_msg("sq", 1)) is Outcome.OK
    got_f: list[Delivery] = []
    f = await node.bind("q", got_f.append, window=10, credit=1)
    await wait_for(lambda: len(got_f) == 1)
    g = await node.bind("big", lambda d: g.ack(d.entry_id), window=0)
    got_h: list[Delivery] = []
    h = await node.bind("sq", got_h.append, window=10, credit=0, selector="n > 0")
    await asyncio.sleep(0.1)
    proxy.cut_on = [b"gw_fetch", f.id.encode() + b"\r\n"]
    proxy.loading_on = b"gw_recover"
    f.set_credit(1)  # fetch of e1: runs, its answer lost
    await wait_for(lambda: proxy.refused == 1, timeout=5)  # the recovery: asked again in 1 s
    await asyncio.sleep(0.4)
    proxy.loading_on = b"gw_settle"
    proxy.delay_on = b"gw_fetch\r\n$1\r\n0\r\n$3\r\nbig\r\n"  # round A, late
    proxy.delay = 0.3
    g.set_window(256)  # round A: G's fetch of 256 (a full round) ...
    h.set_credit(1)  # ... round B: H's selection
    await wait_for(lambda: proxy.delay_on is None)
    proxy.delay_on, proxy.delay = b"gw_peek", 0.8  # B's selection answers late
    f.ack(got_f[0].entry_id)  # round S, sent once A is finished: refused for now
    await wait_for(lambda: proxy.refused == 2)
    await asyncio.sleep(3.0)
    assert len(got_h) == 1
    await _handed_out_once(f, got_f, redis_url)


async def test_selector_lost_take_recovered_before_a_release_lost_with_the_connection(
    proxy: CuttingProxy, node: Broker, redis_url: str
) -> None:
    """As the -LOADING case, with both connections lost (a Redis restart, a network cut):
    round S (G's acks, then F's release of e0) breaks after its first command ran, so the
    release did not run; the selection's take, on a pool connection, runs and its answer is
    lost. The recovery waits for S and the release sent again: else e0, still pending for
    F, would be handed to F again, and the release would give it to H too."""
    f, got_f, _ = await _busy_pair(node, selector="n >= 0")
    released = []

    def on_g(d: Delivery) -> None:
        g.ack(d.entry_id)
        if not released:  # F's consumer releases e0 just after G's first ack
            released.append(1)
            f.release(got_f[0].entry_id)

    g = await node.bind("big", on_g, window=0)  # G again, settling as it goes
    await asyncio.sleep(0.1)
    proxy.pre, proxy.after = 0.05, 0.3
    proxy.cuts_on = [
        [b"gw_settle\r\n$1\r\n0\r\n$3\r\nack"],  # S: the acks run, F's release does not
        [b"gw_take"],  # the selection's take runs, its answer is lost
    ]
    g.set_window(256)  # round N: G's 256 (a full round) ...
    f.set_credit(1)  # ... round N+1: F's selection
    await wait_for(lambda: proxy.cuts == 2)
    await asyncio.sleep(2.0)
    await _held_by_one_consumer(node, f, got_f)
    assert len(got_f) == 2, [(d.message.payload, d.delivery_count) for d in got_f]
