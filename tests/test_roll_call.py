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
from gateway.engine import keys, library, roll_call
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message, Outcome
from tests.redis_proxy import CuttingProxy
from tests.test_engine import wait_for
from tests.test_redis_outages import node, proxy  # noqa: F401


@pytest.fixture
async def node2(proxy: CuttingProxy) -> AsyncIterator[Broker]:
    client = await library.connect(proxy.url)
    n = Broker(client, heartbeat=0.2, node_ttl=1.0)
    await n.start()
    yield n
    await n.stop()
    await client.aclose()


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
    await wait_for(lambda: node._hold_routing)
    futures = [
        node.publish_nowait(Message(destination="order/x", payload=b"%d" % i)) for i in range(20)
    ]
    assert set(await asyncio.gather(*futures)) == {Outcome.OK}
    got: list[Delivery] = []
    await broker.bind("order", got.append, window=100)
    await wait_for(lambda: len(got) == 20)
    assert [d.message.payload for d in got] == [b"%d" % i for i in range(20)]
