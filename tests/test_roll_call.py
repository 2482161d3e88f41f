# ruff: noqa: F811  (the fixtures imported from test_redis_outages)
"""Subscriptions that must hold on every node once the caller is answered, when an event
channel reconnects (as after a Redis restart), a node does not answer, or an announcement
or a withdrawal of direct (QoS 0) subscribers fails half way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis

from gateway.broker import Broker
from gateway.config import Settings
from gateway.engine import keys, library, roll_call
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message, Outcome
from protocols.mqtt import listener as mqtt_listener
from protocols.mqtt import session as mqtt_session
from protocols.mqtt.codec import Connect, Properties, Pubcomp, Publish, Pubrec, Pubrel
from protocols.mqtt.listener import Listener
from protocols.mqtt.listener import start as start_mqtt
from tests.redis_proxy import CuttingProxy
from tests.test_engine import wait_for
from tests.test_mqtt_protocol import Raw
from tests.test_redis_outages import node, proxied_node, proxy  # noqa: F401


@pytest.fixture
async def node2(proxy: CuttingProxy) -> AsyncIterator[Broker]:
    async with proxied_node(proxy) as node:
        yield node


async def _cut_event_channel(proxy: CuttingProxy, n: Broker) -> None:
    await n.queues.create(QueueConfig(name="cutq"))
    proxy.cut_on = [b"SUBSCRIBE", b"cutq"]  # n's event connection, as it watches the queue
    await n.bind("cutq", lambda d: None)
    await wait_for(lambda: proxy.cuts == 1)
    await asyncio.sleep(0.05)  # Redis saw it close; n reconnects 0.5 s after the loss


async def test_a_node_asking_while_its_event_channel_reconnects_waits_for_answers(
    node: Broker,
    node2: Broker,
    proxy: CuttingProxy,
) -> None:
    """A's own event connection is down (reconnecting): it waits to hear answers before
    asking, so a node that reads the change late still routes by it at once after."""
    await node.declare_queue(QueueConfig(name="routed"))
    await _cut_event_channel(proxy, node)
    proxy.delay = 1.0
    proxy.delay_reply_on = b"\r\nsub "  # B reads the 'sub' event (and the ask after it) late
    started = asyncio.get_running_loop().time()
    await node.subscribe_queue("routed", ["routed/#"], "mqtt")
    took = asyncio.get_running_loop().time() - started
    assert proxy.delay_reply_on is None, "B read the change late"
    await node2.publish(Message(destination="routed/1", payload=b"right after"))
    assert (await node.queues.info("routed")).messages == 1, (
        f"published on B right after the subscribe returned ({took * 1000:.0f} ms, B holds "
        f"the question 1000 ms): not routed"
    )


async def test_a_node_whose_event_channel_reconnects_routes_by_routes_read_after(
    broker: Broker,
    node: Broker,
    proxy: CuttingProxy,
) -> None:
    """B (node) is alive and publishing while its event connection reconnects: it may
    have missed the change, so its topic messages wait until it read the routes again."""
    await broker.declare_queue(QueueConfig(name="routed"))
    await _cut_event_channel(proxy, node)
    await broker.subscribe_queue("routed", ["routed/#"], "mqtt")
    await node.publish(Message(destination="routed/1", payload=b"right after"))
    assert (await broker.queues.info("routed")).messages == 1, "published right after: not routed"


async def test_a_first_qos0_subscriber_while_the_event_channel_reconnects_holds(
    node: Broker,
    node2: Broker,
    proxy: CuttingProxy,
) -> None:
    """The same for a node's first QoS 0 subscriber."""
    got: list[Message] = []
    await _cut_event_channel(proxy, node)
    proxy.delay = 1.0
    proxy.delay_reply_on = f"ask {node.node_id} ".encode()
    await node.subscribe_direct("late/#", "mqtt", got.append)
    await node2.publish(Message(destination="late/1", payload=b"right after"))
    relayed = node2.direct.relayed
    await asyncio.sleep(1.5)
    assert [m.payload for m in got] == [b"right after"], f"B relayed {relayed} at publish"


async def test_a_subscriber_after_a_failed_withdrawal_gets_relayed_messages(
    broker: Broker,
    node: Broker,
    proxy: CuttingProxy,
    redis_url: str,
) -> None:
    """A withdrawal that failed half way (its SREM ran) is announced again by the next
    subscriber, not taken for still announced."""
    token = await node.subscribe_direct("wd/#", "mqtt", lambda m: None)
    # the withdrawal's SREM and unwatch run; its 'direct <node>' PUBLISH's reply is lost
    proxy.cut_on = [b"PUBLISH", f"direct {node.node_id}".encode()]
    node.unsubscribe_direct(token)
    await wait_for(lambda: proxy.cuts == 1)
    await asyncio.sleep(0.3)
    got: list[Message] = []
    await node.subscribe_direct("wd/#", "mqtt", got.append)  # a new QoS 0 subscriber: SUBACK
    await asyncio.sleep(0.3)
    await broker.publish(Message(destination="wd/1", payload=b"after suback"))
    await asyncio.sleep(1.0)
    members = redis.Redis.from_url(redis_url).smembers(keys.direct_nodes)
    assert [m.payload for m in got] == [b"after suback"], (
        f"announced={node.direct._announced} direct_nodes={members} "
        f"other relays={broker.direct._others} relayed={broker.direct.relayed}"
    )


async def test_a_node_whose_announcement_failed_half_way_withdraws_after_its_last_subscriber(
    broker: Broker,
    node: Broker,
    proxy: CuttingProxy,
    redis_url: str,
) -> None:
    """An announcement that failed half way (its SADD ran) is withdrawn after the last
    subscriber: other nodes do not relay every topic message to it for ever."""
    # SADD and watch ran; the ask's PUBLISH ran too, its reply lost: the subscriber is told
    # "not announced", keeps its token
    proxy.cut_on = [b"PUBLISH", f"ask {node.node_id}".encode()]
    token = await node.subscribe_direct("wd/#", "mqtt", lambda m: None)
    assert proxy.cuts == 1
    node.unsubscribe_direct(token)  # the node's last direct subscriber
    await asyncio.sleep(1.0)
    members = redis.Redis.from_url(redis_url).smembers(keys.direct_nodes)
    for i in range(100):  # every topic message of the other node is relayed for nobody
        await broker.publish(Message(destination=f"any/{i}", payload=b"x"))
    await asyncio.sleep(0.2)
    assert members == set() and broker.direct.relayed == 0, (
        f"no direct subscriber left, yet direct_nodes={members}, the node still listens "
        f"({bool(node.events._channels)}), the other node relayed {broker.direct.relayed}"
    )


async def test_a_node_that_does_not_answer_is_waited_for_once(
    broker: Broker, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live node that does not answer (stalled, or too old to answer questions) costs one
    wait, not one per subscription; once it answers again it is waited for again."""
    monkeypatch.setattr(roll_call, "ANSWER_TIMEOUT_S", 0.3)
    redis.Redis.from_url(redis_url).fcall("gw_node_up", 0, "nmute", 60_000)
    await broker.declare_queue(QueueConfig(name="mute"))
    started = time.monotonic()
    for i in range(4):
        await broker.subscribe_queue("mute", [f"mute/{i}"], "mqtt")
    assert 0.3 <= time.monotonic() - started < 0.6
    assert broker.roll_call._silent == {"nmute"}
    redis.Redis.from_url(redis_url).publish(keys.events, f"answer {broker.node_id} 99 nmute")
    await wait_for(lambda: not broker.roll_call._silent)
    started = time.monotonic()
    await broker.subscribe_queue("mute", ["mute/again"], "mqtt")
    assert time.monotonic() - started >= 0.3


async def test_an_unchanged_subscription_asks_nobody(
    broker: Broker, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Declaring a queue again with the subscriptions it has, or subscribing it to one it
    has (a session resumed), changes nothing other nodes must learn: no wait."""
    monkeypatch.setattr(roll_call, "ANSWER_TIMEOUT_S", 0.5)
    await broker.declare_queue(QueueConfig(name="same"), [("same/#", "mqtt")])
    redis.Redis.from_url(redis_url).fcall("gw_node_up", 0, "nmute", 60_000)
    started = time.monotonic()
    await broker.declare_queue(QueueConfig(name="same"), [("same/#", "mqtt")])
    await broker.subscribe_queue("same", ["same/#"], "mqtt")
    assert time.monotonic() - started < 0.4


async def test_topic_messages_held_while_the_event_channel_reconnects_keep_their_order(
    broker: Broker, node: Broker, proxy: CuttingProxy
) -> None:
    """Messages a node takes while its event channel reconnects wait for the routes read
    after it, and are then stored in the order they came."""
    await broker.declare_queue(QueueConfig(name="order"), [("order/#", "mqtt")])
    await _cut_event_channel(proxy, node)
    await wait_for(lambda: node.hold.active)
    futures = [
        node.publish_nowait(Message(destination="order/x", payload=b"%d" % i)) for i in range(20)
    ]
    assert set(await asyncio.gather(*futures)) == {Outcome.OK}
    got: list[Delivery] = []
    await broker.bind("order", got.append, window=100)
    await wait_for(lambda: len(got) == 20)
    assert [d.message.payload for d in got] == [b"%d" % i for i in range(20)]


async def test_one_bad_held_message_does_not_strand_the_others(
    broker: Broker, node: Broker, proxy: CuttingProxy
) -> None:
    """Messages held together are routed together, whatever one of them holds (here a
    binary, non-UTF-8 value of a keyed property, as an AMQP client may send: it keys as
    its escaped text)."""
    await broker.declare_queue(QueueConfig(name="lv", lvq_key="k"), [("lv/#", "mqtt")])
    await node.router.reload()
    await _cut_event_channel(proxy, node)
    await wait_for(lambda: node.hold.active)
    first = node.publish_nowait(Message(destination="lv/x", payload=b"1",
                                        user_properties=[("k", "a")]))  # fmt: skip
    bad = node.publish_nowait(Message(destination="lv/x", payload=b"bad",
                                      user_properties=[("k", b"\xff")]))  # fmt: skip
    last = node.publish_nowait(Message(destination="lv/x", payload=b"3",
                                       user_properties=[("k", "b")]))  # fmt: skip
    await wait_for(lambda: not node.hold.active, 5)
    done, _ = await asyncio.wait([first, bad, last], timeout=3)
    assert {first, last} <= done, (
        f"held with a bad message: first {first}, bad {bad}, last {last}; "
        f"still held {len(node.hold._held)}"
    )
    assert first.result() is Outcome.OK and last.result() is Outcome.OK
    assert bad.result() is Outcome.OK


async def test_a_node_stopped_while_cut_off_fails_its_held_messages(
    proxy: CuttingProxy, redis_url: str
) -> None:
    """A node stopped while Redis is out of reach stops whole (its direct subscribers'
    withdrawal fails) and fails what it held: its publishers are not acked."""
    client = await library.connect(proxy.url)
    n = Broker(client, heartbeat=0.2, node_ttl=1.0)
    await n.start()
    try:
        token = await n.subscribe_direct("d/#", "mqtt", lambda m: None)  # a QoS 0 subscriber
        assert proxy.server is not None
        proxy.server.close()
        for w in proxy._writers:
            w.transport.abort()
        await wait_for(lambda: n.hold.active)
        held = n.publish_nowait(Message(destination="t/1", payload=b"x"))
        n.unsubscribe_direct(token)  # its session ends
        error = None
        try:
            await asyncio.wait_for(n.stop(), 10)
        except Exception as exc:
            error = exc
        assert error is None and held.done(), f"stop raised {error!r}; the held publish: {held}"
    finally:
        await client.aclose()


async def test_a_node_whose_event_channel_reconnected_is_waited_for_again(
    broker: Broker, node: Broker, proxy: CuttingProxy
) -> None:
    """B (node) missed A's question while its event channel reconnected: A waited for it
    once. B is back and healthy; A's next subscription must still hold on B once A is
    answered, even if B reads that 'sub' event late."""
    await broker.declare_queue(QueueConfig(name="routed"))
    await _cut_event_channel(proxy, node)
    await broker.subscribe_queue("routed", ["first/#"], "mqtt")  # B misses the question
    await wait_for(lambda: node.events.listening.is_set() and not node.hold.active)
    await asyncio.sleep(0.2)
    silent = set(broker.roll_call._silent)
    proxy.delay = 1.0
    proxy.delay_reply_on = b"\r\nsub "  # B reads the next change (and its question) late
    started = asyncio.get_running_loop().time()
    await broker.subscribe_queue("routed", ["routed/#"], "mqtt")
    took = asyncio.get_running_loop().time() - started
    await node.publish(Message(destination="routed/1", payload=b"right after"))
    assert (await broker.queues.info("routed")).messages == 1, (
        f"published on B right after the subscribe returned ({took * 1000:.0f} ms): not "
        f"routed; A held B silent: {silent == {node.node_id}}"
    )


async def test_an_answer_lost_with_the_askers_own_event_channel_marks_nobody_silent(
    broker: Broker, node: Broker, proxy: CuttingProxy
) -> None:
    """A (node) asks; its event channel breaks and is back before the timeout; B's answer
    came in the gap. B answered: A must not stop waiting for B."""
    await node.declare_queue(QueueConfig(name="routed"))
    await node.queues.create(QueueConfig(name="cutq"))
    proxy.delay = 0.6
    proxy.delay_reply_on = f"answer {node.node_id} ".encode()  # B's answer, in the gap
    asking = asyncio.ensure_future(node.subscribe_queue("routed", ["one/#"], "mqtt"))
    await asyncio.sleep(0.05)
    proxy.cut_on = [b"SUBSCRIBE", b"cutq"]
    await node.bind("cutq", lambda d: None)
    await asyncio.wait_for(asking, 5)
    assert node.events.listening.is_set()
    assert broker.node_id not in node.roll_call._silent, (
        "B answered, its answer was lost with A's own event channel: B marked silent"
    )


async def test_a_withdrawal_that_failed_is_done_again(
    broker: Broker, node: Broker, proxy: CuttingProxy, redis_url: str
) -> None:
    """B's last QoS 0 subscriber goes; its withdrawal's SREM runs, the reply is lost with
    the connection (a Redis blip): B does it again, so A does not relay every topic
    message to it for ever."""
    token = await node.subscribe_direct("wd/#", "mqtt", lambda m: None)
    await wait_for(lambda: broker.direct._others)
    proxy.cut_on = [b"gw_direct_node", node.node_id.encode() + b"\r\n$1\r\n0\r\n"]
    node.unsubscribe_direct(token)
    await wait_for(lambda: proxy.cuts == 1)
    await asyncio.sleep(2.0)  # the event channel is fine; B has every chance to redo it
    members = redis.Redis.from_url(redis_url).smembers(keys.direct_nodes)
    for i in range(100):
        await broker.publish(Message(destination=f"any/{i}", payload=b"x"))
    await asyncio.sleep(0.2)
    assert broker.direct.relayed == 0, (
        f"no direct subscriber left anywhere (direct_nodes={members}); B still listens: "
        f"{bool(node.events._channels)}, listed={node.direct._listed}; A relayed "
        f"{broker.direct.relayed}"
    )


@pytest.fixture
async def mqttb(node: Broker) -> AsyncIterator[Listener]:
    listener = await start_mqtt(node, Settings(mqtt_port=0, amqp_port=0, host="127.0.0.1"))
    assert listener is not None
    yield listener
    await listener.close()


KEEP = Properties(session_expiry_interval=300)


async def test_a_qos2_message_held_on_a_cut_off_node_is_not_stored_twice(
    broker: Broker,
    mqtt: Listener,
    node: Broker,
    mqttb: Listener,
    proxy: CuttingProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message held on a node cut off from Redis is not stored once Redis is back after
    its publisher gave up and sent it on another node: the hold fails it as soon as a
    routes read fails, as a spool would."""
    monkeypatch.setattr(mqtt_session, "CONNECT_TIMEOUT", 1.0)
    monkeypatch.setattr(mqtt_listener, "HANDOVER_TIMEOUT", 1.0)
    await broker.declare_queue(QueueConfig(name="q2"), [("t/#", "mqtt")])
    await node.router.reload()
    c, _ = await Raw.connected(mqttb.port, 5, client_id="c2", properties=KEEP)
    # node B is cut off from Redis (its event channel too)
    assert proxy.server is not None
    proxy.server.close()
    for w in proxy._writers:
        w.transport.abort()
    await wait_for(lambda: node.hold.active)
    await c.send(Publish("t/1", b"once", qos=2, packet_id=7))
    await asyncio.sleep(0.3)
    c.writer.close()  # no PUBREC: the client goes to another node
    await asyncio.sleep(1.5)  # B's teardown gave up waiting for the held publish
    c2 = await Raw.open(mqtt.port, 5)
    await c2.send(Connect(protocol_level=5, client_id="c2", clean_start=False, properties=KEEP))
    await c2.recv(timeout=10)
    await c2.send(Publish("t/1", b"once", qos=2, packet_id=7, dup=True))
    assert await c2.recv() == Pubrec(7)
    await c2.send(Pubrel(7))
    assert await c2.recv() == Pubcomp(7)
    assert (await broker.queues.info("q2")).messages == 1
    # B reaches Redis again
    proxy.server = await asyncio.start_server(proxy._client, "127.0.0.1", proxy.port)
    await wait_for(lambda: not node.hold.active, 10)
    await asyncio.sleep(0.5)
    n = (await broker.queues.info("q2")).messages
    assert n == 1, f"the QoS 2 message the client had resent elsewhere was stored {n} times"


async def test_a_message_held_after_back_is_not_failed_by_an_older_read(
    broker: Broker, node: Broker, proxy: CuttingProxy
) -> None:
    """B's channel is back; while B re-reads its direct subscribers (before back()), M1 is
    held and the hold's routes read R starts. back() routes M1; the channel is lost again
    and M2 is held. R, started before M2 came, then fails: M2 must wait for a read started
    after it (which would succeed), not be failed by R."""
    await broker.declare_queue(QueueConfig(name="h"), [("h/#", "mqtt")])
    await node.router.reload()
    proxy.delay_on = keys.direct_nodes.encode()  # _routes_back's direct.resync is slow
    proxy.delay = 1.0
    await _cut_event_channel(proxy, node)
    await wait_for(lambda: node.hold.active)
    await wait_for(lambda: node.events.listening.is_set(), 3)  # back; back() not yet
    await asyncio.sleep(0.1)  # _routes_back's reload is done, direct.resync waits
    assert node.hold.active and proxy.delay_on is None
    proxy.after = 2.0  # R's reply is lost, its connection aborted 2 s later
    proxy.cut_on = [b"gw_routes"]
    m1 = node.publish_nowait(Message(destination="h/1", payload=b"1"))
    await asyncio.sleep(0.3)  # R is sent and cut
    assert proxy.cut_on is None
    proxy.after = 0.2
    await wait_for(lambda: not node.hold.active, 3)  # back()
    assert await asyncio.wait_for(m1, 2) is Outcome.OK
    assert node.hold._reading is not None, "R still in flight"
    await node.queues.create(QueueConfig(name="cutq2"))
    proxy.cut_on = [b"SUBSCRIBE", b"cutq2"]
    await node.bind("cutq2", lambda d: None)
    await wait_for(lambda: node.hold.active, 3)  # lost again
    assert node.hold._reading is not None, "R still in flight"
    m2 = node.publish_nowait(Message(destination="h/2", payload=b"2"))
    try:
        outcome = await asyncio.wait_for(m2, 5)
    except Exception as exc:
        outcome = exc
    assert outcome is Outcome.OK, f"M2 (held after R began, after back()) got {outcome!r}"


async def test_a_message_held_after_a_second_loss_waits_for_routes_read_after_it(
    broker: Broker, node: Broker, proxy: CuttingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's channel comes back (reconnect 1) and B's _routes_back (1) reads the routes, then
    its direct subscribers (slow). Meanwhile the channel is lost again (loss 2): A subscribes
    (B misses it), A's SUBACK goes, and M is published on B: held. Reconnect 2 happens;
    _routes_back (1) ends: it must not release M by the routes it read before loss 2 (M
    would miss the subscription A's client was told holds)."""
    monkeypatch.setattr(roll_call, "ANSWER_TIMEOUT_S", 0.2)
    await broker.declare_queue(QueueConfig(name="fresh"))
    await node.queues.create(QueueConfig(name="cutq2"))
    await node.router.reload()
    proxy.delay_on = keys.direct_nodes.encode()  # _routes_back (1)'s direct.resync is slow
    proxy.delay = 2.0
    await _cut_event_channel(proxy, node)
    await wait_for(lambda: node.events.listening.is_set(), 3)  # reconnect 1
    await asyncio.sleep(0.05)
    assert node.hold.active and proxy.delay_on is None, "_routes_back (1) not in resync"
    proxy.after = 0.05
    proxy.cut_on = [b"SUBSCRIBE", b"cutq2"]
    await node.bind("cutq2", lambda d: None)
    await wait_for(lambda: not node.events.listening.is_set(), 3)  # loss 2
    proxy.delay_reply_on = b"zfresh"  # B's first routes read with the new subscription: slow
    await broker.subscribe_queue("fresh", ["zfresh/#"], "mqtt")  # the client's SUBACK
    assert not node.events.listening.is_set(), "test timing: B's channel already back"
    m = node.publish_nowait(Message(destination="zfresh/1", payload=b"after suback"))
    assert not m.done()
    outcome = await asyncio.wait_for(m, 5)
    routed = (await broker.queues.info("fresh")).messages
    assert outcome is Outcome.OK and routed == 1, (
        f"M, published on B after A's SUBACK, held from loss 2: {outcome}, stored {routed}"
    )


async def test_a_node_back_before_a_direct_question_times_out_is_not_marked_silent(
    broker: Broker, node: Broker, proxy: CuttingProxy
) -> None:
    """B (node) misses A's 'direct' question while its channel reconnects; B comes back
    and says 'back' well before A's timeout. A must not then mark B silent: B is healthy,
    and A's next question must wait for it."""
    await broker.declare_queue(QueueConfig(name="routed"))
    await _cut_event_channel(proxy, node)
    backs: list[float] = []
    orig = broker.roll_call.back

    def spy(arg: str) -> None:
        backs.append(asyncio.get_running_loop().time())
        orig(arg)

    broker.roll_call.back = spy  # type: ignore[method-assign]
    started = asyncio.get_running_loop().time()
    await broker.subscribe_direct("d/#", "mqtt", lambda m: None)  # asks 'direct'; B misses it
    took = asyncio.get_running_loop().time() - started
    assert backs, "B never said back"
    silent = set(broker.roll_call._silent)
    # consequence: A's next subscription does not wait for B, which reads it late
    proxy.delay = 1.0
    proxy.delay_reply_on = b"\r\nsub "
    await broker.subscribe_queue("routed", ["routed/#"], "mqtt")
    await node.publish(Message(destination="routed/1", payload=b"right after"))
    n = (await broker.queues.info("routed")).messages
    assert node.node_id not in silent and n == 1, (
        f"B said back {backs[0] - started:.2f} s into A's 'direct' question (which took "
        f"{took:.2f} s); A then marked B silent: {silent}; routed right after the next "
        f"SUBACK: {n}"
    )


async def test_a_message_taken_after_the_node_stopped_while_holding_fails_at_once(
    broker: Broker, proxy: CuttingProxy
) -> None:
    """A publish that reaches a node after it stopped while holding (a late will) fails at
    once: nothing is left waiting for a routes read nobody makes."""
    async with proxied_node(proxy) as node:
        await _cut_event_channel(proxy, node)
        await wait_for(lambda: node.hold.active)
    late = node.publish_nowait(Message(destination="late/x", payload=b"x"))
    with pytest.raises(redis.RedisError):
        await asyncio.wait_for(late, 1)
