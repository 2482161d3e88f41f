"""SUBSCRIBE while messages flow: routes that change under way, the retained messages'
gate, QoS 0 subscriptions announced to other nodes. Delays are added to real calls to
widen the windows these races happen in."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from gateway.broker import Broker
from gateway.config import Settings
from gateway.engine.direct import DirectRelay
from gateway.model import Message
from protocols.mqtt.codec import (
    Properties,
    Puback,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    encode,
)
from protocols.mqtt.listener import Listener
from protocols.mqtt.listener import start as start_mqtt
from tests import test_engine, test_mqtt_handover
from tests.redis_proxy import CuttingProxy
from tests.test_mqtt_protocol import Raw
from tests.test_redis_outages import node, proxy  # noqa: F401

second_node = test_engine.second_node  # fixtures: a second node and its MQTT listener
mqtt2 = test_mqtt_handover.mqtt2


async def publishes(raw: Raw, timeout: float) -> list[Publish]:
    """What comes until nothing has for `timeout` seconds (QoS 1 ones acknowledged)."""
    got = []
    try:
        while True:
            p = await raw.recv(timeout=timeout)
            if isinstance(p, Publish):
                got.append(p)
                if p.qos:
                    await raw.send(Puback(p.packet_id))
    except TimeoutError:
        return got


async def test_a_new_qos0_filter_under_a_qos1_wildcard_loses_nothing(
    mqtt: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a new QoS 0 filter's node announcement is under way, a message it matches
    that a QoS 1 filter takes from the queue is sent once, at QoS 1 (a direct copy noted
    as sent though no direct route sent it made the queued one be settled unsent)."""
    sub, _ = await Raw.connected(mqtt.port, 4, client_id="br-sub")
    pub, _ = await Raw.connected(mqtt.port, 4, client_id="br-pub")
    await sub.send(Subscribe(1, [("br/#", SubscriptionOptions(qos=1))]))
    assert isinstance(await sub.recv(), Suback)
    announce = DirectRelay._announce

    async def slow(self: DirectRelay, present: bool) -> None:
        await asyncio.sleep(0.5)
        await announce(self, present)

    monkeypatch.setattr(DirectRelay, "_announce", slow)
    await sub.send(Subscribe(2, [("br/x", SubscriptionOptions(qos=0))]))
    await asyncio.sleep(0.2)
    await pub.send(Publish("br/x", b"during", qos=1, packet_id=1))
    assert isinstance(await pub.recv(), Puback)
    got = await publishes(sub, 2)
    assert [(p.payload, p.qos) for p in got] == [(b"during", 1)]
    sub.close()
    pub.close()


async def test_an_overlapping_subscribe_keeps_an_older_subscriptions_live_messages(
    mqtt: Listener, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Live messages waiting while a new filter's retained messages are read go on to
    the subscriptions the client had before (only the new filter gets the retained one)."""
    raw, _ = await Raw.connected(mqtt.port, 5, client_id="gate-old")
    ids = Properties(subscription_identifiers=[1])
    await raw.send(Subscribe(1, [("pa/#", SubscriptionOptions(qos=0))], ids))
    assert isinstance(await raw.recv(), Suback)
    matching = broker.retained.matching

    async def traffic_meanwhile(pattern: str, syntax: str = "mqtt") -> AsyncIterator[list[Message]]:
        await broker.publish(Message(destination="pa/b", payload=b"live-1"))
        await broker.publish(Message(destination="pa/b", payload=b"state-2", retain=True))
        async for batch in matching(pattern, syntax):
            yield batch

    monkeypatch.setattr(broker.retained, "matching", traffic_meanwhile)
    ids = Properties(subscription_identifiers=[2])
    await raw.send(Subscribe(2, [("pa/b", SubscriptionOptions(qos=0))], ids))
    got = [
        (p.payload, (p.properties.subscription_identifiers if p.properties else None))
        for p in await publishes(raw, 1.5)
    ]
    raw.close()
    assert any(payload == b"live-1" and sub_ids and 1 in sub_ids for payload, sub_ids in got)


async def test_a_slow_subscribe_holds_no_other_subscriptions_messages(
    mqtt: Listener, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only messages on the topics of the filters a SUBSCRIBE reads retained messages for
    wait while it reads them (here for 3 s); the others go on."""
    raw, _ = await Raw.connected(mqtt.port, 4, client_id="gate-slow")
    await raw.send(Subscribe(1, [("busy/#", SubscriptionOptions(qos=1))]))
    assert isinstance(await raw.recv(), Suback)
    matching = broker.retained.matching

    async def slow(pattern: str, syntax: str = "mqtt") -> AsyncIterator[list[Message]]:
        await asyncio.sleep(3)
        async for batch in matching(pattern, syntax):
            yield batch

    monkeypatch.setattr(broker.retained, "matching", slow)
    await raw.send(Subscribe(2, [("unrelated/#", SubscriptionOptions(qos=0))]))
    assert isinstance(await raw.recv(), Suback)
    assert (await broker.publish(Message(destination="busy/1", payload=b"now"))).accepted
    got = await raw.recv(timeout=1.5)
    assert isinstance(got, Publish) and got.payload == b"now"
    raw.close()


async def test_unsubscribe_then_subscribe_at_once_still_gets_other_nodes_messages(
    mqtt: Listener, mqtt2: Listener
) -> None:
    """UNSUBSCRIBE and SUBSCRIBE of a node's only QoS 0 filter sent together: the node's
    withdrawal from the other nodes must not run after the new announcement (it stopped
    the node listening while the SUBACK said the subscription holds)."""
    sub, _ = await Raw.connected(mqtt.port, 4, client_id="flip-sub")
    pub, _ = await Raw.connected(mqtt2.port, 4, client_id="flip-pub")
    await sub.send(Subscribe(1, [("flip/#", SubscriptionOptions(qos=0))]))
    assert isinstance(await sub.recv(), Suback)
    await asyncio.sleep(0.3)
    sub.writer.write(encode(Unsubscribe(2, ["flip/#"]), 4))
    sub.writer.write(encode(Subscribe(3, [("flip/#", SubscriptionOptions(qos=0))]), 4))
    await sub.writer.drain()
    assert isinstance(await sub.recv(), Unsuback)
    assert isinstance(await sub.recv(), Suback)
    await asyncio.sleep(0.3)
    await pub.send(Publish("flip/1", b"after suback", qos=1, packet_id=1))
    assert isinstance(await pub.recv(), Puback)
    got = await sub.recv(timeout=2)
    assert isinstance(got, Publish) and got.payload == b"after suback"
    pub.close()
    sub.close()


@pytest.mark.parametrize("level", [4, 5])
async def test_a_new_qos1_filter_costs_an_overlapping_qos0_one_nothing(
    broker: Broker, second_node: Broker, mqtt: Listener, level: int
) -> None:
    """MQTT-3.8.4-3: a SUBSCRIBE leaves the other subscriptions be. With `a/#` at QoS 0,
    SUBSCRIBE `a/b` at QoS 1 took `a/b`'s direct copies away at once (the queue delivers
    them), while the queue's route was still being set up on every node: a few vanished."""
    sub, _ = await Raw.connected(mqtt.port, level, client_id="overlap")
    await sub.send(Subscribe(1, [("a/#", SubscriptionOptions(qos=0))]))
    assert await sub.recv() == Suback(1, [0])
    sent: list[int] = []
    subscribed = asyncio.Event()

    async def publish_steadily() -> None:
        while not subscribed.is_set() or len(sent) < 20:
            sent.append(len(sent))
            await broker.publish(Message(destination="a/b", payload=b"%d" % sent[-1]))
            await asyncio.sleep(0.001)

    task = asyncio.create_task(publish_steadily())
    await asyncio.sleep(0.05)
    await sub.send(Subscribe(2, [("a/b", SubscriptionOptions(qos=1))]))
    got: set[int] = set()
    with contextlib.suppress(TimeoutError):  # until nothing more comes for a second
        while packet := await sub.recv(1.0):
            if packet == Suback(2, [1]):
                subscribed.set()
            elif isinstance(packet, Publish):
                got.add(int(packet.payload))
                if packet.qos:
                    await sub.send(Puback(packet.packet_id))
    await task
    assert subscribed.is_set() and sent
    assert sorted(set(sent) - got) == []


async def test_subscribing_a_qos1_filter_again_keeps_its_messages_at_qos1(
    node: Broker,  # noqa: F811
    proxy: CuttingProxy,  # noqa: F811
) -> None:
    """Clients subscribe again on every reconnect. With an overlapping QoS 0 filter, the
    messages of the resubscription's window went out direct at QoS 0 and their queued
    QoS 1 copies were thrown away."""
    listener = await start_mqtt(node, Settings(mqtt_port=0, host="127.0.0.1"))
    try:
        sub, _ = await Raw.connected(listener.port, 5, client_id="resub")
        await sub.send(Subscribe(1, [("a/#", SubscriptionOptions(qos=0))]))
        assert await sub.recv() == Suback(1, [0])
        await sub.send(Subscribe(2, [("a/b", SubscriptionOptions(qos=1))]))
        assert await sub.recv() == Suback(2, [1])
        proxy.delay_on, proxy.delay = b"gw_subscription", 0.5  # a slow answer
        await sub.send(Subscribe(3, [("a/b", SubscriptionOptions(qos=1))]))
        await asyncio.sleep(0.1)
        for i in range(5):
            await node.publish(Message(destination="a/b", payload=b"%d" % i))
            await asyncio.sleep(0.02)
        got: list[Publish] = []
        with contextlib.suppress(TimeoutError):
            while packet := await sub.recv(1.5):
                if isinstance(packet, Publish):
                    got.append(packet)
                    if packet.qos:
                        await sub.send(Puback(packet.packet_id))
        assert sorted(p.payload for p in got if p.qos == 1) == [b"%d" % i for i in range(5)]
    finally:
        await listener.close()


async def test_unsubscribing_an_invalid_filter_says_so(mqtt: Listener) -> None:
    """MQTT 5 §3.11.3: 0x8F for a filter that is not valid, 0x11 for a valid one the client
    has no subscription to (an invalid one got 0x11 too)."""
    client, _ = await Raw.connected(mqtt.port, 5, client_id="unsub-invalid")
    await client.send(Unsubscribe(1, ["a/#/b", "never/subscribed", "$share//x", "x+/y"]))
    assert await client.recv() == Unsuback(1, [0x8F, 0x11, 0x8F, 0x8F])
