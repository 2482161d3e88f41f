"""Session state in Redis (expiry, options) and shared subscriptions, on one broker."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time

from gateway.broker import Broker
from gateway.config import Settings
from gateway.engine import keys
from protocols.mqtt.codec import (
    Connack,
    Disconnect,
    Properties,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
)
from protocols.mqtt.listener import LEASE_S, Listener, queue_name, start
from protocols.mqtt.state import shared_queue_name
from tests.test_mqtt_paho import V5, V311, Client
from tests.test_mqtt_protocol import Raw


async def test_session_expiry_deletes_state_and_queue(mqtt: Listener, broker: Broker) -> None:
    raw, _ = await Raw.connected(
        mqtt.port, 5, client_id="brief", properties=Properties(session_expiry_interval=1)
    )
    await raw.send(Subscribe(1, [("exp/#", SubscriptionOptions(qos=1))]))
    assert await raw.recv() == Suback(1, [1])
    assert await broker.clients.load("brief") is not None
    # connected: kept for its expiry + the lease, should this node die without a word
    assert 1 < await broker.redis.ttl(keys.client_state("brief")) <= 1 + LEASE_S
    await raw.send(Disconnect())
    await raw.closed()
    await asyncio.sleep(1.3)
    assert await broker.clients.load("brief") is None  # expired in Redis
    raw, ack = await Raw.connected(mqtt.port, 5, client_id="brief", clean_start=False)
    assert isinstance(ack, Connack) and not ack.session_present
    assert not await broker.queues.exists(queue_name("brief"))
    raw.close()


async def test_subscription_options_restored_from_redis(broker: Broker) -> None:
    """A second listener on the same broker has no memory of the session: Redis has."""
    first = await start(broker, Settings(mqtt_port=0, host="127.0.0.1"))
    assert first is not None
    props = Properties(session_expiry_interval=60)
    raw, _ = await Raw.connected(first.port, 5, client_id="opts", properties=props)
    await raw.send(
        Subscribe(
            1,
            [("q0/+", SubscriptionOptions(qos=0, no_local=True))],
            Properties(subscription_identifiers=[7]),
        )
    )
    assert await raw.recv() == Suback(1, [0])
    await raw.send(Disconnect())
    await raw.closed()
    await first.close()
    second = await start(broker, Settings(mqtt_port=0, host="127.0.0.1"))
    assert second is not None
    try:
        raw, ack = await Raw.connected(
            second.port, 5, client_id="opts", clean_start=False, properties=props
        )
        assert ack.session_present
        await raw.send(Publish("q0/mine", b"own"))  # no-local kept
        pub, _ = await Raw.connected(second.port, 5, client_id="other")
        await pub.send(Publish("q0/x", b"direct"))
        got = await raw.recv()
        assert isinstance(got, Publish) and got.payload == b"direct" and got.qos == 0
        assert got.properties is not None and got.properties.subscription_identifiers == [7]
        await raw.ping()
        assert raw.pending == []
        raw.close()
        pub.close()
    finally:
        await second.close()


async def test_shared_subscription_splits_messages(mqtt: Listener, broker: Broker) -> None:
    n = 300

    def scenario() -> list[list[bytes]]:
        members = [Client(mqtt.port, v, f"member-{i}") for i, v in enumerate((V5, V5, V311))]
        watcher = Client(mqtt.port, V5, "watcher")
        pub = Client(mqtt.port, V5, "share-pub")
        try:
            for m in members:
                codes = m.subscribe("$share/g1/sh/#", 1)
                assert [int(getattr(c, "value", c)) for c in codes] == [1]
            watcher.subscribe("sh/#", 1)
            infos = [pub.c.publish(f"sh/{i % 5}", f"{i}".encode(), 1) for i in range(n)]
            for info in infos:
                info.wait_for_publish(5)
            assert len(watcher.receive(n)) == n  # a plain subscription gets everything
            got: list[list[bytes]] = [[] for _ in members]
            deadline = time.monotonic() + 10
            while sum(map(len, got)) < n and time.monotonic() < deadline:
                for i, m in enumerate(members):
                    with contextlib.suppress(queue.Empty):
                        got[i].append(m.messages.get(timeout=0.01).payload)
            assert all(m.nothing_more(0.2) for m in members)
            return got
        finally:
            for c in (*members, watcher, pub):
                c.close()

    got = await asyncio.to_thread(scenario)
    everything = sorted(int(p) for member in got for p in member)
    assert everything == list(range(n))  # each message exactly once across the group
    assert all(member for member in got)  # and split among the members
    name = shared_queue_name("g1", "sh/#")
    deadline = time.monotonic() + 5
    while await broker.queues.exists(name) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not await broker.queues.exists(name), "the group's queue went with its last member"


async def test_shared_member_loss_redelivers_to_the_group(mqtt: Listener) -> None:
    a, _ = await Raw.connected(mqtt.port, 5, client_id="share-a")
    b, _ = await Raw.connected(mqtt.port, 4, client_id="share-b")
    await a.send(Subscribe(1, [("$share/g2/job", SubscriptionOptions(qos=1))]))
    assert await a.recv() == Suback(1, [1])
    pub, _ = await Raw.connected(mqtt.port, 4, client_id="share-pub")
    await pub.send(Publish("job", b"work", qos=1, packet_id=1))
    got = await a.recv()  # only member: a gets it, and never acks
    assert isinstance(got, Publish) and got.payload == b"work"
    await b.send(Subscribe(1, [("$share/g2/job", SubscriptionOptions(qos=1))]))
    assert await b.recv() == Suback(1, [1])
    a.writer.transport.abort()
    again = await b.recv()
    assert isinstance(again, Publish) and again.payload == b"work" and again.dup
    await b.send(Unsubscribe(2, ["$share/g2/job"]))
    assert await b.recv() == Unsuback(2, [])
    await pub.send(Publish("job", b"later", qos=1, packet_id=2))
    await b.ping()
    assert [p for p in b.pending if isinstance(p, Publish)] == []  # b left the group
    b.close()
    pub.close()
