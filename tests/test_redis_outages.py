"""Redis out of touch: commands it ran whose replies were lost with the connection (what
the node does again, or undoes, takes nothing from other consumers and leaves nothing
bound), a restart longer than the nodes' liveness TTL (no live node is presumed dead), and
a pub/sub event read late (what it announces still holds when the caller is told)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from proton import Message as AmqpMessage
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.broker import Broker
from gateway.config import Settings
from gateway.engine import keys, library, roll_call
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message, Outcome
from protocols.amqp.listener import start as start_amqp
from protocols.mqtt.codec import (
    Connack,
    Connect,
    Properties,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
)
from protocols.mqtt.listener import start
from tests.amqp_raw import DETACH, Peer
from tests.conftest import RedisServer, admin_of, running_node
from tests.redis_proxy import CuttingProxy
from tests.test_engine import retained_matching, second_node, to_queue, wait_for  # noqa: F401
from tests.test_mqtt_protocol import Raw, settings


@pytest.fixture
async def proxy(redis_server) -> AsyncIterator[CuttingProxy]:
    """A proxy in front of the test's Redis; `node` talks to Redis through it."""
    proxy = CuttingProxy(redis_server.port)
    await proxy.start()
    yield proxy
    await proxy.close()


@contextlib.asynccontextmanager
async def proxied_node(proxy: CuttingProxy) -> AsyncIterator[Broker]:
    """A node that talks to Redis through `proxy`."""
    async with running_node(proxy.url) as node:
        yield node


@pytest.fixture
async def node(proxy: CuttingProxy) -> AsyncIterator[Broker]:
    async with proxied_node(proxy) as node:
        yield node


async def test_a_requeue_sent_again_after_a_lost_reply_takes_nothing_from_another_consumer(
    proxy: CuttingProxy,
    node: Broker,
    redis_url: str,
    second_node: Broker,  # noqa: F811
) -> None:
    await node.queues.create(QueueConfig(name="q"))
    assert await node.publish(to_queue("q", b"X")) is Outcome.OK
    got_a: list[Delivery] = []
    a = await node.bind("q", got_a.append, window=10, credit=1)
    await wait_for(lambda: len(got_a) == 1)
    got_b: list[Delivery] = []
    await second_node.bind("q", got_b.append, window=10)  # holds what it gets
    # A gives X back; the connection breaks after Redis ran the requeue, before its
    # reply reached node 1, which sends the requeue again on a new connection
    proxy.cut_on = [b"gw_settle", b"requeue"]
    a.requeue(got_a[0].entry_id)
    await wait_for(lambda: proxy.cuts == 1)
    await wait_for(lambda: len(got_b) >= 1, timeout=5)  # B took X and holds it
    await asyncio.sleep(2.0)  # the node sends the requeue again meanwhile
    r = redis.Redis.from_url(redis_url)
    pending = r.xpending_range(keys.queue_stream("q"), "g", "-", "+", 10)
    assert [d.message.payload for d in got_b] == [b"X"], (
        f"X was delivered again while B held it unsettled: {len(got_b)} deliveries to B, "
        f"counts {[d.delivery_count for d in got_b]}; pending {pending}"
    )


async def test_a_bind_whose_reply_was_lost_leaves_no_consumer_holding_an_exclusive_queue(
    proxy: CuttingProxy, node: Broker
) -> None:
    await node.queues.create(QueueConfig(name="ex", access_type="exclusive"))
    assert await node.publish(to_queue("ex", b"X")) is Outcome.OK
    # the consumer's bind runs in Redis, its reply is lost with the connection: the
    # consumer is told the bind failed (its AMQP attach is refused) and attaches again
    proxy.cut_on = [b"gw_bind", b"ex"]
    got: list[Delivery] = []
    with pytest.raises(RedisConnectionError):
        await node.bind("ex", got.append, window=10)
    assert proxy.cuts == 1
    flow = await node.bind("ex", got.append, window=10)
    try:
        await wait_for(lambda: len(got) == 1, timeout=4)
    except AssertionError:
        info = await node.queues.info("ex")
        raise AssertionError(
            f"the stored message is never delivered: the consumer is a standby "
            f"(active={flow.active}) behind a flow nobody owns; bound flows {info.flows}"
        ) from None


async def test_a_bind_whose_reply_was_lost_leaves_no_partition_to_nobody(
    proxy: CuttingProxy, node: Broker
) -> None:
    await node.queues.create(
        QueueConfig(name="pq", partition_count=4, partition_rebalance_delay_ms=0)
    )
    for i in range(40):
        msg = to_queue("pq", b"%d" % i, partition_key=f"k{i}")
        assert await node.publish(msg) is Outcome.OK
    proxy.cut_on = [b"gw_bind", b"pq"]
    got: list[Delivery] = []
    with pytest.raises(RedisConnectionError):  # the consumer is told its bind failed
        await node.bind("pq", got.append, window=100)
    assert proxy.cuts == 1
    await node.bind("pq", got.append, window=100)  # it binds again
    try:
        await wait_for(lambda: len(got) == 40, timeout=4)
    except AssertionError:
        raise AssertionError(
            f"{40 - len(got)} of 40 stored messages never delivered: their partitions "
            "went to a flow nobody owns"
        ) from None


async def test_a_redis_restart_deletes_no_live_nodes_temporary_queue(
    redis_server,
    broker: Broker,
    second_node: Broker,  # noqa: F811
) -> None:
    temps = {}
    for name, node in (("one", broker), ("two", second_node)):
        q = await node.create_temporary_queue(owner="u")
        assert await node.publish(to_queue(q, b"stored for " + name.encode())) is Outcome.OK
        temps[name] = q
    # Redis restarts; it was down a little longer than the node TTL (1 s here, 5 s by
    # default: a restart replaying a large AOF, a failover)
    redis_server.stop()
    await asyncio.sleep(1.6)
    await asyncio.to_thread(redis_server.start)
    # both nodes beat again
    before = (broker.liveness.reaped, second_node.liveness.reaped)
    await asyncio.sleep(1.5)
    missing = []
    for name, q in temps.items():
        if not await broker.queues.exists(q):
            missing.append(name)
    assert not missing, (
        f"temporary queues of live node(s) {missing} were deleted with their stored "
        f"message; reaped before/after: {before} -> "
        f"{(broker.liveness.reaped, second_node.liveness.reaped)}"
    )


async def test_unbinding_a_flow_never_bound_keeps_an_auto_delete_queue(broker: Broker) -> None:
    """A bind whose reply was lost is undone by an unbind, whether it ran or not: one that
    did not run leaves an auto-delete queue nobody consumed from, with its messages, as it
    was (RabbitMQ deletes one when its last consumer goes, not before it has any)."""
    await broker.queues.create(QueueConfig(name="ad", auto_delete=True))
    assert await broker.publish(to_queue("ad", b"kept")) is Outcome.OK
    assert await broker.redis.fcall("gw_unbind", 0, "ad", f"{broker.node_id}.999") == 0
    assert await broker.queues.exists("ad")
    assert (await broker.queues.info("ad")).messages == 1


@pytest.mark.parametrize("kind", ["partitioned", "exclusive"])
async def test_a_flow_bound_while_an_older_answer_comes_is_not_taken_for_lost(
    proxy: CuttingProxy, node: Broker, kind: str
) -> None:
    """A read of a queue's flows (the partition map, the exclusive lease) whose answer comes
    after a flow bound meanwhile does not know that flow: it is no sign the flow was
    released. Taking it so rebound the flow under a new id and left the first id bound with
    nobody owning it, holding partitions (or the lease) and their messages."""
    options = {"partitioned": {"partition_count": 2}, "exclusive": {"access_type": "exclusive"}}
    await node.queues.create(QueueConfig(name=kind, **options[kind]))
    proxy.delay_on, proxy.delay = (
        b"gw_partitions" if kind == "partitioned" else b"gw_lease",
        0.5,
    )
    read = asyncio.ensure_future(
        node.dispatcher.refresh_partitions(kind)
        if kind == "partitioned"
        else node.dispatcher.check_lease(kind)
    )
    await asyncio.sleep(0.1)  # the read ran in Redis; its answer is on its way
    got: list[Delivery] = []
    flow = await node.bind(kind, got.append, window=100)
    first_id = flow.id
    await read
    for i in range(10):
        assert await node.publish(to_queue(kind, b"%d" % i, partition_key=f"k{i}")) is Outcome.OK
    await wait_for(lambda: len(got) == 10, timeout=5)
    assert flow.id == first_id
    assert (await node.queues.info(kind)).flows == [first_id]


async def _restart_redis(redis_server, down: float) -> None:
    redis_server.stop()
    await asyncio.sleep(down)
    await asyncio.to_thread(redis_server.start)


async def test_a_node_starting_right_after_a_redis_outage_reaps_no_live_node(
    redis_server,
    redis_url: str,
    broker: Broker,
    second_node: Broker,  # noqa: F811
) -> None:
    """A node starting just after Redis was out of touch for longer than the TTL (a gateway
    restarted by its supervisor, a scale-out) reaps no live node whose key expired during
    the outage."""
    temps = {}
    for name, node in (("one", broker), ("two", second_node)):
        q = await node.create_temporary_queue(owner="u")
        assert await node.publish(to_queue(q, b"stored for " + name.encode())) is Outcome.OK
        temps[name] = q
    for node in (broker, second_node):  # both come back a little after the third starts
        node.liveness._task.cancel()
    await _restart_redis(redis_server, 1.6)
    client = await library.connect(redis_url)
    third = Broker(client, heartbeat=0.2, node_ttl=1.0)
    await third.start()
    try:
        for node in (broker, second_node):  # they beat again an interval later
            node.liveness._task = asyncio.get_running_loop().create_task(node.liveness._run())
        await asyncio.sleep(1.0)
        missing = [name for name, q in temps.items() if not await third.queues.exists(q)]
        assert not missing, (
            f"temporary queues of live node(s) {missing} were deleted with their stored "
            f"messages by a node that started after the outage (reaped {third.liveness.reaped})"
        )
    finally:
        await third.stop()
        await client.aclose()


async def test_redis_stalled_longer_than_the_ttl_reaps_no_live_node(
    redis_url: str,
    broker: Broker,
    second_node: Broker,  # noqa: F811
) -> None:
    """Redis itself stalls (a slow script, fork or disk) for longer than the TTL: every key
    expires meanwhile, yet no live node is reaped once it runs again."""
    temps = {}
    for name, node in (("one", broker), ("two", second_node)):
        q = await node.create_temporary_queue(owner="u")
        assert await node.publish(to_queue(q, b"stored for " + name.encode())) is Outcome.OK
        temps[name] = q
    await asyncio.sleep(0.3)
    stall = aioredis.Redis.from_url(redis_url)
    script = (
        "local t = redis.call('TIME'); local s = t[1] * 1000 + math.floor(t[2] / 1000) "
        "while true do t = redis.call('TIME') "
        "if t[1] * 1000 + math.floor(t[2] / 1000) - s > 1500 then return 1 end end"
    )
    try:
        await stall.eval(script, 0)  # Redis busy for 1.5 s (the TTL is 1 s)
        await asyncio.sleep(1.0)
        missing = [name for name, q in temps.items() if not await broker.queues.exists(q)]
        reaped = (broker.liveness.reaped, second_node.liveness.reaped)
        assert not missing, (
            f"temporary queues of live node(s) {missing} were deleted with their stored "
            f"messages after Redis stalled for longer than the TTL (reaped {reaped})"
        )
    finally:
        await stall.aclose()


async def test_a_node_dead_long_before_a_restart_is_not_presumed_alive(redis_url: str) -> None:
    """The only gateway node crashed with an MQTT client connected; the gateway is back a
    few TTLs later (Redis never went away). While no node can be judged dead (see
    node_alive in functions.lua), the reconnecting client does not wait HANDOVER_TIMEOUT
    (15 s) for a teardown from the crashed node that never comes."""
    # the crashed node, as it was (same calls the node makes)
    old_client = await library.connect(redis_url)
    old = Broker(old_client, heartbeat=0.2, node_ttl=1.0)
    await old.start()
    await old.claim_client("c1", lambda: None)
    old.liveness._task.cancel()  # crash: no more beats, no clean shutdown
    await asyncio.sleep(0.05)
    dead_id = old.node_id
    # down 2 TTLs: its liveness key expired; Redis kept running
    await asyncio.sleep(2.0)
    r = aioredis.Redis.from_url(redis_url)
    assert not await r.exists(keys.node_alive(dead_id))
    await r.aclose()
    client = await library.connect(redis_url)
    node = Broker(client, heartbeat=0.2, node_ttl=1.0)
    await node.start()
    listener = await start(node, settings())
    try:
        t0 = time.monotonic()
        raw = await Raw.open(listener.port)
        await raw.send(Connect(protocol_level=4, client_id="c1", clean_start=False))
        try:
            ack = await raw.recv(timeout=4.0)
        except TimeoutError:
            ack = None
        waited = time.monotonic() - t0
        raw.close()
        assert isinstance(ack, Connack), (
            f"CONNACK not within 4 s ({waited:.1f} s): the new node waits for a handover "
            f"from node {dead_id}, dead for 2 TTLs"
        )
    finally:
        await listener.close()
        await node.stop()
        await client.aclose()
        await old_client.aclose()


@pytest.mark.parametrize("kind", ["exclusive", "partitioned"])
async def test_a_flow_being_bound_again_is_not_judged_by_an_older_answer(
    proxy: CuttingProxy, node: Broker, kind: str
) -> None:
    """A flow taken for lost binds again under a new id: a lease or partition-map answer
    asked before that bind ran does not know the new id, and is no sign it was released
    (it took the flow for lost once more: another unbind, another id, another rebind)."""
    options = {
        "partitioned": {"partition_count": 2},
        "exclusive": {"access_type": "exclusive"},
    }
    await node.queues.create(QueueConfig(name=kind, **options[kind]))
    got: list[Delivery] = []
    flow = await node.bind(kind, got.append, window=100)
    await asyncio.sleep(0.5)
    d = node.dispatcher
    # a lease / map read goes; Redis answers it at once, the answer is slow to come back
    proxy.delay_on = b"gw_lease" if kind == "exclusive" else b"gw_partitions"
    proxy.delay = 0.4
    read = asyncio.ensure_future(
        d.check_lease(kind) if kind == "exclusive" else d.refresh_partitions(kind)
    )
    await asyncio.sleep(0.1)
    # meanwhile the flow is lost (e.g. a fetch's answer lost with its connection) and
    # binds again; that bind runs in Redis now, its answer comes after the read's
    proxy.delay_on, proxy.delay = b"gw_bind", 0.8
    d._lost(flow, "lost a fetch's answer")
    second_id = flow.id
    await read
    await asyncio.sleep(1.5)
    info = await node.queues.info(kind)
    assert flow.id == second_id, (
        f"an answer asked before the rebind ran took the rebinding flow for lost again: "
        f"{second_id} -> {flow.id}; bound {info.flows}"
    )


async def test_a_node_reading_a_direct_announcement_late_still_relays_right_after_it(
    broker: Broker, node: Broker, proxy: CuttingProxy
) -> None:
    """A node's first direct (MQTT QoS 0) subscriber is told its subscription holds only
    once the other nodes answered that they relay to it: a node that reads the
    announcement late still relays a message it takes right after the SUBACK."""
    got: list[Message] = []
    proxy.delay = 0.5
    proxy.delay_reply_on = f"ask {broker.node_id} ".encode()
    await broker.subscribe_direct("late/#", "mqtt", got.append)
    assert proxy.delay_reply_on is None, "the announcement reached the node late"
    await node.publish(Message(destination="late/1", payload=b"right after"))
    await wait_for(lambda: len(got) == 1)
    assert got[0].payload == b"right after"


async def test_a_direct_announcement_missed_while_the_event_channel_was_down_is_learnt(
    broker: Broker, node: Broker, proxy: CuttingProxy
) -> None:
    """Pub/sub is at most once: a node whose event channel reconnects reads which nodes
    have direct subscribers again, or it would never relay to one announced meanwhile."""
    await broker.queues.create(QueueConfig(name="cutq"))
    proxy.cut_on = [b"SUBSCRIBE", b"cutq"]  # the node's event connection, as it watches
    await node.bind("cutq", lambda d: None)
    await wait_for(lambda: proxy.cuts == 1)
    got: list[Message] = []
    await broker.subscribe_direct("missed/#", "mqtt", got.append)  # while it is down
    await wait_for(lambda: node.direct._others)
    await node.publish(Message(destination="missed/1", payload=b"relayed"))
    await wait_for(lambda: len(got) == 1)


async def test_a_stalled_node_holds_a_direct_announcement_only_a_while(
    broker: Broker, node: Broker, proxy: CuttingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that does not answer an announcement (stalled) delays the first direct
    subscriber's SUBACK by at most ANSWER_TIMEOUT_S."""
    monkeypatch.setattr(roll_call, "ANSWER_TIMEOUT_S", 0.3)
    proxy.delay = 3.0
    proxy.delay_reply_on = f"ask {broker.node_id} ".encode()
    started = time.monotonic()
    await broker.subscribe_direct("stalled/#", "mqtt", lambda m: None)
    assert 0.3 <= time.monotonic() - started < 2.0


async def test_a_node_reading_a_subscription_change_late_still_routes_right_after_it(
    broker: Broker, node: Broker, proxy: CuttingProxy
) -> None:
    """A subscription added to a queue holds on every node once the caller is answered (a
    SUBACK): a node that reads the change late still routes a message it takes right
    after to the queue."""
    await broker.declare_queue(QueueConfig(name="routed"))
    proxy.delay = 0.5
    proxy.delay_reply_on = b"\r\nsub "  # the node's 'sub' event, and what follows it
    await broker.subscribe_queue("routed", ["routed/#"], "mqtt")
    assert proxy.delay_reply_on is None, "the change reached the node late"
    assert (await node.publish(Message(destination="routed/1", payload=b"x"))).accepted
    assert (await broker.queues.info("routed")).messages == 1


@pytest.mark.parametrize("selector", [None, "n > 0"])
async def test_a_fetch_refused_while_redis_loads_its_data_is_not_taken_for_lost(
    broker: Broker, node: Broker, proxy: CuttingProxy, selector: str | None
) -> None:
    """Redis refuses commands while it loads its data after a start (redis-py files that
    under ConnectionError): such a fetch took nothing, so the flow keeps its id and what
    it holds, and fetches again (taken for lost, it would be bound again and its
    unsettled messages redelivered to another consumer)."""
    await broker.queues.create(QueueConfig(name="loading"))
    for i in range(4):
        msg = to_queue("loading", b"%d" % i, user_properties=[("n", i + 1)])
        assert await broker.publish(msg) is Outcome.OK
    got: list[Delivery] = []
    flow = await node.bind("loading", got.append, window=10, credit=2, selector=selector)
    await wait_for(lambda: len(got) == 2)
    first_id = flow.id
    proxy.loading_on = b"gw_take" if selector else b"gw_fetch"
    flow.set_credit(2)
    await wait_for(lambda: len(got) == 4)
    assert proxy.refused == 1
    assert flow.id == first_id, "the flow was bound again"
    assert (await broker.queues.info("loading")).flows == [first_id]
    assert len(flow.unacked) == 4


async def test_a_retained_message_whose_spool_answers_late_is_not_stored_over_a_later_one(
    proxy: CuttingProxy, node: Broker
) -> None:
    # the topic's one queue takes the first message only: the second, routed nowhere, is
    # answered at once, and must still be retained after the first
    await node.declare_queue(
        QueueConfig(name="sub", subscription_selector="n = 1"), [("t", "mqtt")]
    )
    proxy.delay_on = b"gw_spool"
    proxy.delay = 0.3
    first = Message(destination="t", payload=b"old", retain=True, user_properties=[("n", 1)])
    second = Message(destination="t", payload=b"new", retain=True, user_properties=[("n", 2)])
    outcomes = await asyncio.gather(node.publish_nowait(first), node.publish_nowait(second))
    assert outcomes == [Outcome.OK, Outcome.NO_SUBSCRIBERS]
    assert [m.payload for m in await retained_matching(node, "t")] == [b"new"]
    assert not node._retaining  # nothing left behind once stored


async def test_a_bind_cancelled_while_redis_runs_it_leaves_no_flow_bound(
    proxy: CuttingProxy, node: Broker, redis_url: str
) -> None:
    await node.queues.create(QueueConfig(name="q", access_type="exclusive"))
    proxy.delay_on = b"gw_bind"  # it runs in Redis; its answer comes late
    proxy.delay = 0.5
    binding = asyncio.create_task(node.bind("q", lambda d: None))
    await asyncio.sleep(0.2)
    binding.cancel()
    with pytest.raises(asyncio.CancelledError):
        await binding
    admin = aioredis.from_url(redis_url)
    try:
        # a flow nobody holds would keep the exclusive queue's lease until the node stops
        deadline = time.monotonic() + 5
        while await admin.zcard(keys.queue_flows("q")) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert keys.queue_wake("q").encode() not in node.events._wake_channels  # no watch
        consumer = await node.bind("q", lambda d: None)
        assert consumer.active
    finally:
        await admin.aclose()


@pytest.mark.parametrize("browse", [False, True], ids=["consumer", "browser"])
async def test_a_late_noqueue_answer_ends_its_own_flow_not_one_of_the_queue_made_again(
    proxy: CuttingProxy,
    node: Broker,
    second_node: Broker,  # noqa: F811
    browse: bool,
) -> None:
    await node.queues.create(QueueConfig(name="q"))
    old_ended: list[str] = []
    old = await node.bind("q", lambda d: None, credit=0, on_closed=old_ended.append)
    proxy.delay_reply_on = b"qdel q"  # the deletion's event reaches the node 0.3 s late
    proxy.delay = 0.3
    await second_node.delete_queue("q")
    proxy.delay = 1.5
    proxy.delay_on = b"gw_fetch"  # the old flow's fetch finds no queue; answer at 1.5 s
    old.set_credit(10)
    await asyncio.sleep(0.6)  # the event is in: the old flow ended
    assert old_ended == ["queue deleted"]
    await second_node.queues.create(QueueConfig(name="q"))  # made again under its name
    got: list[Delivery] = []
    ended: list[str] = []
    new = await node.bind("q", got.append, browse=browse, on_closed=ended.append)
    await asyncio.sleep(1.5)  # the late answer is in
    assert ended == [] and not new.closed
    assert await second_node.publish(to_queue("q", b"x")) is Outcome.OK
    await wait_for(lambda: len(got) == 1)


async def test_an_exclusive_flow_released_again_while_it_binds_again_still_fetches(
    broker: Broker, redis_url: str
) -> None:
    """A flow taken for lost binds again, then checks its queue's lease; while its node's
    liveness key is not back, that check releases the new id too. The rebind then running
    took no notice: the flow kept an id bound nowhere and never fetched again, while its
    publishers were acked (a node cut from Redis past its TTL, its clients still there)."""
    await broker.queues.create(QueueConfig(name="ex", access_type="exclusive"))
    got: list[bytes] = []

    def deliver(delivery: Delivery) -> None:
        got.append(delivery.message.payload)
        flow.ack(delivery.entry_id)

    flow = await broker.bind("ex", deliver)
    other = aioredis.from_url(redis_url)
    presumed_dead = asyncio.Event()

    async def keep_presumed_dead() -> None:  # as another node's reaper sees it
        while not presumed_dead.is_set():
            await other.delete(keys.node_alive(broker.node_id))
            await other.fcall("gw_reap", 0)
            await asyncio.sleep(0.005)

    task = asyncio.create_task(keep_presumed_dead())
    try:
        await broker.publish(to_queue("ex", b"during"))
        await asyncio.sleep(1.5)  # its fetch finds it released: it binds again, and again
    finally:
        presumed_dead.set()
        await task
        await other.aclose()
    await broker.publish(to_queue("ex", b"after"))
    await wait_for(lambda: got.count(b"after") == 1, timeout=5)
    assert b"during" in got


async def test_a_qos2_publish_resent_after_its_spool_answer_was_lost_is_delivered_once(
    proxy: CuttingProxy, node: Broker
) -> None:
    """The spool ran in Redis and its answer was lost with the connection (a network blip,
    a failover): no PUBREC, so the client resends on its resumed session (DUP). The packet
    id was recorded in a second call after the spool's answer, so the resend was stored
    again and the subscriber got the message twice (MQTT-4.3.3). The spool records it in
    the same step now; and what the lost call stored reaches its subscriber (no answer
    woke its flow). (Found by two reviews.)"""
    mqtt = await start(node, settings())
    assert mqtt is not None
    keep = Properties(session_expiry_interval=300)
    try:
        sub, _ = await Raw.connected(mqtt.port, 5, client_id="eo-sub", properties=keep)
        await sub.send(Subscribe(1, [("eo/#", SubscriptionOptions(qos=2))]))
        assert await sub.recv() == Suback(1, [2])
        pub, _ = await Raw.connected(mqtt.port, 5, client_id="eo-pub", properties=keep)
        proxy.cut_on = [b"gw_spool", b"exactly once"]
        await pub.send(Publish("eo/t", b"exactly once", qos=2, packet_id=7))
        assert not any(isinstance(p, Pubrec) for p in await pub.closed(timeout=5))
        assert proxy.ran == 1
        pub, ack = await Raw.connected(mqtt.port, 5, client_id="eo-pub", clean_start=False,
                                       properties=keep)  # fmt: skip
        assert ack.session_present
        await pub.send(Publish("eo/t", b"exactly once", qos=2, packet_id=7, dup=True))
        assert await pub.recv() == Pubrec(7)
        await pub.send(Pubrel(7))
        assert await pub.recv() == Pubcomp(7)
        got = []
        with contextlib.suppress(TimeoutError):
            while True:
                p = await sub.recv(timeout=1.5)
                if isinstance(p, Publish):
                    got.append(p.payload)
                    await sub.send(Pubrec(p.packet_id))
                elif isinstance(p, Pubrel):
                    await sub.send(Pubcomp(p.packet_id))
        assert got == [b"exactly once"]
        pub.close()
        sub.close()
    finally:
        await mqtt.close()


async def test_an_amqp_transfer_whose_store_answer_was_lost_is_not_released(
    proxy: CuttingProxy, node: Broker
) -> None:
    """The spool ran in Redis and its answer was lost with the connection: the transfer was
    answered released, "not acted upon" (§3.4.4), though stored, and a client sending it
    again stored it twice. The link ends with amqp:internal-error and the delivery in
    doubt. (Found by a review.)"""
    await node.queues.create(QueueConfig(name="doubt"))
    amqp = await start_amqp(node, Settings(amqp_port=0, host="127.0.0.1"))
    try:
        peer = await Peer.opened(amqp.port)
        await peer.sender(0, "doubt")
        proxy.cut_on = [b"gw_spool", b"maybe stored"]
        peer.transfer(0, 0, bytes(AmqpMessage(body=b"maybe stored").encode()))
        frames = await peer.frames_for(3.0)
        peer.close()
        assert [f.code for f in frames] == [DETACH], frames
        assert frames[0].error() == "amqp:internal-error"
        assert proxy.ran == 1
        assert (await node.queues.info("doubt")).messages == 1
    finally:
        await amqp.close()


async def test_a_node_loads_its_functions_again_when_redis_lost_them(
    broker: Broker, redis_url: str
) -> None:
    """A Redis that came back without its data (no AOF, a new instance, FUNCTION FLUSH) left
    the node failing every call (heartbeat, publishes, declarations) until it was
    restarted. Its heartbeat loads the library again. (Found by a review.)"""
    admin = aioredis.Redis.from_url(redis_url)
    try:
        await admin.execute_command("FUNCTION", "FLUSH")
        deadline = time.monotonic() + 5
        while await library.loaded_library(admin) is None:
            assert time.monotonic() < deadline, "the library was not loaded again"
            await asyncio.sleep(0.05)
        await broker.queues.create(QueueConfig(name="back"))
        assert await broker.publish(to_queue("back", b"x")) == Outcome.OK
    finally:
        await admin.aclose()


async def test_the_queue_list_with_redis_gone_is_a_503_told_on_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As the health probe says: Redis does not answer. It was a 500 "internal error"
    with a ConnectionError's traceback logged for each request."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        async with running_node(server.url) as broker, admin_of(broker) as admin:
            assert (await admin.create("q1")).status == 201
            server.stop(kill=True)
            for path in ("/api/v1/queues", "/api/v1/queues?limit=1", "/api/v1/queues/q1"):
                reply = await admin.get(path)
                assert reply.status == 503 and "Redis does not answer" in reply.error, reply
            assert not [r for r in caplog.records if r.exc_info is not None]
    finally:
        server.stop(kill=True)


async def test_an_admin_publish_whose_store_answer_was_lost_is_a_504(
    proxy: CuttingProxy, node: Broker
) -> None:
    """The spool ran in Redis and its answer was lost with the connection: the message
    may be stored, so the answer is neither "not stored" nor a plain "try again" (a 503
    invites a retry, which would store it twice)."""
    await node.queues.create(QueueConfig(name="doubt"))
    async with admin_of(node) as admin:
        proxy.cut_on = [b"gw_spool", b"maybe stored"]
        reply = await admin.publish("doubt", "maybe stored")
        assert reply.status == 504 and "may be stored" in reply.error, reply
    assert proxy.ran == 1
    assert (await node.queues.info("doubt")).messages == 1
