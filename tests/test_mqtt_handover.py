"""An MQTT session handed over between connections, on one node or two: the new connection
loads the session once the old one saved it (waiting for a slow teardown), an old one
never saves over its successor, an expiry-0 session ends with its connection, and a
delayed will is not sent once the session is resumed elsewhere (§3.1.3.2.2)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
import redis

from gateway.broker import Broker, QueueConfig
from gateway.config import Settings
from gateway.engine import keys
from protocols.mqtt.codec import (
    Connack,
    Connect,
    Disconnect,
    Properties,
    Puback,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Will,
)
from protocols.mqtt.listener import Listener
from protocols.mqtt.listener import start as start_mqtt
from protocols.mqtt.state import SessionState
from tests import test_engine
from tests.test_mqtt_protocol import Raw

KEEP = Properties(session_expiry_interval=300)
second_node = test_engine.second_node  # a second node on the same Redis


@pytest.fixture
async def mqtt2(second_node: Broker, listener_settings: Settings) -> AsyncIterator[Listener]:
    """An MQTT listener on a second node sharing the first one's Redis."""
    listener = await start_mqtt(second_node, listener_settings)
    assert listener is not None
    yield listener
    await listener.close()


async def a_publish_held(broker: Broker, client: Raw) -> None:
    """`client` has a QoS 1 publish held by producer flow control: its teardown waits for it
    (up to 10 s)."""
    await broker.declare_queue(QueueConfig(name="fc", max_messages=1, overflow="flow_control"))
    await broker.subscribe_queue("fc", ["fc/#"], "mqtt")
    await asyncio.sleep(0.3)
    await client.send(Publish("fc/1", b"x", qos=1, packet_id=100))
    assert await client.recv() == Puback(100)
    await client.send(Publish("fc/2", b"y", qos=1, packet_id=101))  # held: the queue is full
    await asyncio.sleep(0.3)


async def taken_over(port: int, client_id: str) -> tuple[Raw, Connack]:
    """Connect (resuming) without the test client's connect timeout: a hand-off may wait."""
    new = await Raw.open(port, 5)
    await new.send(Connect(protocol_level=5, client_id=client_id, clean_start=False,
                           properties=KEEP))  # fmt: skip
    ack = await new.recv(timeout=15)
    assert isinstance(ack, Connack)
    return new, ack


@pytest.mark.parametrize("other_node", [True, False])
async def test_a_takeover_waits_for_a_slow_teardown(
    broker: Broker, mqtt: Listener, mqtt2: Listener, other_node: bool
) -> None:
    """The old connection's teardown waits for its held publish: the new connection waits
    for it too, then resends the messages in flight with their packet ids."""
    first, _ = await Raw.connected(mqtt.port, 5, client_id="mover", properties=KEEP)
    await first.send(Subscribe(1, [("mv/#", SubscriptionOptions(qos=1))]))
    assert await first.recv() == Suback(1, [1])
    pub, _ = await Raw.connected(mqtt.port, 4, client_id="mover-pub")
    for i in range(5):
        await pub.send(Publish(f"mv/{i}", b"m%d" % i, qos=1, packet_id=i + 1))
        assert (await pub.recv()).packet_id == i + 1  # type: ignore[union-attr]
    for _ in range(2):  # acknowledged: those in flight do not have the first ids
        done = await first.recv()
        await first.send(Puback(done.packet_id))  # type: ignore[union-attr]
    sent = [await first.recv() for _ in range(3)]
    await a_publish_held(broker, first)
    second, ack = await taken_over((mqtt2 if other_node else mqtt).port, "mover")
    assert ack.session_present
    again = [await second.recv(timeout=15) for _ in range(3)]
    assert sorted((p.payload, p.packet_id, p.dup) for p in again) == sorted(  # type: ignore[union-attr]
        (p.payload, p.packet_id, True)
        for p in sent  # type: ignore[union-attr]
    )
    second.close()
    pub.close()


async def test_an_old_connection_never_saves_over_its_successor(
    broker: Broker, mqtt: Listener, mqtt2: Listener
) -> None:
    """A connection taken over while its teardown is slow: its successor loads the session
    once it saved, so what the successor changes stays (gw_client_save refuses an older
    connection's save once a newer one loaded: tests/test_engine.py)."""
    old, _ = await Raw.connected(mqtt.port, 5, client_id="slow", properties=KEEP)
    await old.send(Subscribe(1, [("s/a", SubscriptionOptions(qos=1))]))
    assert await old.recv() == Suback(1, [1])
    await a_publish_held(broker, old)
    loop = asyncio.get_running_loop()
    ended = loop.time() + 11  # the old connection's teardown is over by then
    new, ack = await taken_over(mqtt2.port, "slow")
    assert ack.session_present
    await new.send(Subscribe(1, [("s/b", SubscriptionOptions(qos=1))]))
    assert await new.recv() == Suback(1, [1])
    await new.send(Disconnect())
    await new.closed()
    await asyncio.sleep(max(0.5, ended - loop.time()))
    raw = await broker.redis.get(keys.client_state("slow"))
    assert raw is not None
    assert sorted(SessionState.loads("slow", raw).subscriptions) == ["s/a", "s/b"]


def delayed_will() -> Will:
    return Will("wt/w", b"gone", 0, False, Properties(will_delay_interval=2))


@pytest.mark.parametrize("dropped_first", [False, True], ids=["takeover", "reconnect"])
async def test_a_session_resumed_on_another_node_sends_no_delayed_will(
    mqtt: Listener, mqtt2: Listener, dropped_first: bool
) -> None:
    """A new connection to the session (on another node, the old one taken over or dropped)
    within the will delay: the will is not sent (MQTT 5 §3.1.3.2.2)."""
    watcher, _ = await Raw.connected(mqtt.port, 5, client_id="watcher")
    await watcher.send(Subscribe(1, [("wt/#", SubscriptionOptions(qos=0))]))
    assert await watcher.recv() == Suback(1, [0])
    old, _ = await Raw.connected(mqtt.port, 5, client_id="w", properties=KEEP,
                                 will=delayed_will())  # fmt: skip
    if dropped_first:
        old.close()
        await asyncio.sleep(0.3)
    new, ack = await Raw.connected(mqtt2.port, 5, client_id="w", clean_start=False,
                                   properties=KEEP)  # fmt: skip
    assert ack.session_present
    if not dropped_first:
        assert await old.closed() == [Disconnect(0x8E)]
    await asyncio.sleep(3)  # past the will delay
    await watcher.ping()
    assert [p for p in watcher.pending if isinstance(p, Publish)] == []
    new.close()
    watcher.close()


@pytest.mark.parametrize("how", ["disconnect", "takeover_same_node", "takeover_other_node"])
async def test_a_session_resumed_with_expiry_0_ends_with_its_connection(
    mqtt: Listener, mqtt2: Listener, how: str
) -> None:
    """A stored session resumed by a connection with session expiry 0 ends with that
    connection (§3.1.2.11.2), whether it disconnects or is taken over, so the next one
    finds no session (never one reported present whose queue is gone)."""
    first, _ = await Raw.connected(mqtt.port, 5, client_id="z", properties=KEEP)
    await first.send(Subscribe(1, [("z/#", SubscriptionOptions(qos=1))]))
    assert await first.recv() == Suback(1, [1])
    await first.send(Disconnect())
    await first.closed()
    brief, ack = await Raw.connected(mqtt.port, 5, client_id="z", clean_start=False)
    assert ack.session_present
    if how == "disconnect":
        await brief.send(Disconnect())
        await brief.closed()
        await asyncio.sleep(0.3)
    port = mqtt2.port if how == "takeover_other_node" else mqtt.port
    last, ack = await Raw.connected(port, 5, client_id="z", clean_start=False, properties=KEEP)
    assert not ack.session_present
    last.close()


@pytest.mark.parametrize("qos", [0, 1])
@pytest.mark.parametrize("level", [4, 5])
async def test_a_subscriber_gets_what_another_node_takes_after_its_suback(
    mqtt: Listener, mqtt2: Listener, level: int, qos: int
) -> None:
    """The SUBACK says the subscription holds (MQTT-3.8.4-1): every other node answered
    that it routes (QoS 1: to the session's queue) or relays (QoS 0, the node's first
    subscriber) by it before it goes, so a message another node takes right after it
    reaches the subscriber."""
    pub, _ = await Raw.connected(mqtt2.port, level, client_id="b-pub")
    sub, _ = await Raw.connected(mqtt.port, level, client_id="a-sub")
    await sub.send(Subscribe(1, [("xnode/#", SubscriptionOptions(qos=qos))]))
    assert isinstance(await sub.recv(), Suback)
    await pub.send(Publish("xnode/1", b"after suback", qos=1, packet_id=1))
    assert isinstance(await pub.recv(), Puback)
    got = await sub.recv()
    assert isinstance(got, Publish) and got.payload == b"after suback"
    pub.close()
    sub.close()


@pytest.mark.parametrize("gap", [0, 0.01])
async def test_a_qos0_subscription_made_as_the_event_connections_drop_still_holds(
    redis_url: str,
    broker: Broker,
    second_node: Broker,
    mqtt: Listener,
    mqtt2: Listener,
    gap: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A QoS 0 SUBSCRIBE on one node just as every node's event connection is cut: it is
    answered (no error), and once the connections are back, what the other node takes
    reaches the subscriber (the announcement that failed with the connection is made
    again)."""
    pub, _ = await Raw.connected(mqtt2.port, 5, client_id="kpub")
    sub, _ = await Raw.connected(mqtt.port, 5, client_id="ksub")
    redis.Redis.from_url(redis_url).client_kill_filter(_type="pubsub")
    await asyncio.sleep(gap)
    await sub.send(Subscribe(1, [("k/#", SubscriptionOptions(qos=0))]))
    assert isinstance(await sub.recv(timeout=10), Suback)
    await test_engine.wait_for(lambda: second_node.direct._others and broker.direct._announced)
    for i in range(3):
        await pub.send(Publish("k/x", b"later %d" % i, qos=1, packet_id=i + 1))
        assert isinstance(await pub.recv(), Puback)
    got = [await sub.recv(timeout=5) for _ in range(3)]
    assert [p.payload for p in got] == [b"later %d" % i for i in range(3)]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    pub.close()
    sub.close()


async def test_a_session_resumed_elsewhere_with_expiry_0_keeps_its_queue_while_connected(
    mqtt: Listener, mqtt2: Listener
) -> None:
    """The session ends when that connection closes (§3.1.2.11.2), not when the first
    node's expiry timer for the earlier connection fires: nothing stored is renewed by an
    expiry-0 connection, and the timer found nothing and deleted the queue under it."""
    first, _ = await Raw.connected(
        mqtt.port, 5, client_id="xn", properties=Properties(session_expiry_interval=1)
    )
    await first.send(Subscribe(1, [("xn/#", SubscriptionOptions(qos=1))]))
    assert await first.recv() == Suback(1, [1])
    await first.send(Disconnect())
    await first.closed()
    second, ack = await Raw.connected(mqtt2.port, 5, client_id="xn", clean_start=False)
    assert ack.session_present
    await asyncio.sleep(2.5)  # past the first node's timer (expiry + 1 s)
    pub, _ = await Raw.connected(mqtt2.port, 5, client_id="xn-pub")
    await pub.send(Publish("xn/a", b"still here", qos=1, packet_id=1))
    assert await pub.recv() == Puback(1)
    got = await second.recv()
    assert isinstance(got, Publish) and got.payload == b"still here", got
    second.close()
    pub.close()


async def test_qos0_messages_relayed_to_another_node_keep_their_order(
    mqtt: Listener, mqtt2: Listener
) -> None:
    """MQTT-4.6.0-6: a subscriber on the other node gets one publisher's QoS 0 messages in
    the order sent, as one on the publisher's node does."""
    far, _ = await Raw.connected(mqtt2.port, 4, client_id="far")
    near, _ = await Raw.connected(mqtt.port, 4, client_id="near")
    for sub in (far, near):
        await sub.send(Subscribe(1, [("o/#", SubscriptionOptions(qos=0))]))
        assert await sub.recv() == Suback(1, [0])
    pub, _ = await Raw.connected(mqtt.port, 4, client_id="opub")
    n = 6000
    got: dict[str, list[int]] = {"far": [], "near": []}

    async def read(name: str, sub: Raw) -> None:
        while len(got[name]) < n:
            packet = await sub.recv(timeout=5)
            if isinstance(packet, Publish):
                got[name].append(int(packet.payload))

    readers = [asyncio.ensure_future(read("far", far)), asyncio.ensure_future(read("near", near))]
    for i in range(n):
        await pub.send(Publish("o/x", b"%d" % i))
        await asyncio.sleep(0)  # one a loop turn: as many relay batches as can be
    await asyncio.wait(readers, timeout=20)
    for task in readers:
        task.cancel()
    for client in (pub, far, near):
        client.close()
    assert got == {"far": list(range(n)), "near": list(range(n))}
