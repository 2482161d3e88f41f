"""Messages an MQTT session fetched and holds back while the client's receive maximum is
full (MQTT-3.3.4-9), never sent: one that expires meanwhile is expired as its queue says
(counted, to the DMQ with respect_ttl when DMQ-eligible), not acknowledged as consumed; when
the session's flow ends they go back to the queue with the delivery uncounted."""

from __future__ import annotations

import asyncio
import time

from gateway.broker import Broker
from gateway.engine.queues import DEAD_MESSAGE_QUEUE, QueueConfig
from gateway.model import Message
from protocols.mqtt.codec import (
    Disconnect,
    Properties,
    Puback,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
)
from protocols.mqtt.listener import Listener
from protocols.mqtt.session import Session
from protocols.mqtt.state import shared_queue_name
from tests.test_mqtt_protocol import Raw


async def test_expired_message_held_for_the_receive_maximum_is_dead_lettered(
    broker: Broker, mqtt: Listener
) -> None:
    shared = shared_queue_name("g", "sh/#")
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.queues.create(
        QueueConfig(name=shared, respect_ttl=True, dmq_eligible_default=True), reserved_ok=True
    )
    raw, _ = await Raw.connected(
        mqtt.port, 5, client_id="held", properties=Properties(receive_maximum=1)
    )
    try:
        q1 = SubscriptionOptions(qos=1)
        await raw.send(Subscribe(1, [("own/#", q1), ("$share/g/sh/#", q1)]))
        assert isinstance(await raw.recv(), Suback)
        # fills the receive maximum: not acknowledged yet
        await broker.publish(Message(destination="own/1", payload=b"first"))
        first = await raw.recv()
        assert isinstance(first, Publish) and first.payload == b"first"
        # fetched by the shared group's flow, held back: no room in the receive maximum
        await broker.publish(
            Message(
                destination="sh/1",
                payload=b"short-lived",
                expiration=int(time.time() * 1000) + 600,
            )
        )
        await asyncio.sleep(1.2)  # it expired while held
        await raw.send(Puback(first.packet_id))
        await asyncio.sleep(0.5)
        assert not [p for p in raw.pending if isinstance(p, Publish)], "expired: not sent"
        info = await broker.queues.info(shared)
        dmq = await broker.queues.info(DEAD_MESSAGE_QUEUE)
        assert info.messages == 0
        assert (info.counters.get("expired", 0), info.counters.get("acked", 0)) == (1, 0), (
            f"an expired message counted as consumed: {info.counters}"
        )
        assert dmq.messages == 1, "a DMQ-eligible expired message goes to the DMQ (respect_ttl)"
    finally:
        raw.close()


async def _member_that_holds_back(port: int, client_id: str, own: str, broker: Broker) -> Raw:
    """A shared group member whose receive maximum (1) is full with a message of its own
    queue before it joins the group: what its group's flow fetches then waits, never sent."""
    raw, _ = await Raw.connected(
        port, 5, client_id=client_id, properties=Properties(receive_maximum=1)
    )
    q1 = SubscriptionOptions(qos=1)
    await raw.send(Subscribe(1, [(f"{own}/#", q1)]))
    assert isinstance(await raw.recv(), Suback)
    await broker.publish(Message(destination=f"{own}/1", payload=b"fills the window"))
    first = await raw.recv()
    assert isinstance(first, Publish) and first.payload == b"fills the window"
    await raw.send(Subscribe(2, [("$share/g/sh/#", q1)]))
    assert isinstance(await raw.recv(), Suback)
    return raw


async def test_messages_held_back_and_never_sent_do_not_count_toward_max_redelivery(
    broker: Broker, mqtt: Listener
) -> None:
    """Solace's max_redelivery counts redeliveries: a message a member's session fetched but
    never sent (its receive maximum was full) was not delivered, and comes back to the group
    uncounted when that member goes, as an AMQP released one does."""
    shared = shared_queue_name("g", "sh/#")
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.queues.create(
        QueueConfig(name=shared, max_redelivery=1, dmq_eligible_default=True), reserved_ok=True
    )
    # an offline persistent member keeps the group (and its queue) while members come and go
    anchor, _ = await Raw.connected(
        mqtt.port,
        5,
        client_id="anchor",
        clean_start=False,
        properties=Properties(session_expiry_interval=300),
    )
    await anchor.send(Subscribe(1, [("$share/g/sh/#", SubscriptionOptions(qos=1))]))
    assert isinstance(await anchor.recv(), Suback)
    await anchor.send(Disconnect())
    anchor.close()
    await asyncio.sleep(0.3)
    for n in range(2):  # two members in turn fetch it, hold it back, and go
        raw = await _member_that_holds_back(mqtt.port, f"m{n}", f"own{n}", broker)
        try:
            if n == 0:
                await broker.publish(Message(destination="sh/1", payload=b"never sent"))
            await asyncio.sleep(0.3)
            assert not raw.pending, "held back: receive maximum full"
        finally:
            raw.close()
        await asyncio.sleep(0.3)  # its connection ended: the group has the message back
    raw, _ = await Raw.connected(mqtt.port, 5, client_id="roomy")
    try:
        await raw.send(Subscribe(1, [("$share/g/sh/#", SubscriptionOptions(qos=1))]))
        assert isinstance(await raw.recv(), Suback)
        try:
            got = await raw.recv(timeout=2.0)
        except TimeoutError:
            got = None
        info = await broker.queues.info(shared)
        assert isinstance(got, Publish) and got.payload == b"never sent", (
            f"never sent to anyone, yet dead-lettered past max_redelivery: {info.counters}"
        )
    finally:
        raw.close()


async def test_delivery_fetched_during_teardown_is_released_uncounted(
    broker: Broker, mqtt: Listener, monkeypatch
) -> None:
    """A delivery that reaches the session after its connection ended, before its flow is
    closed, was never sent: it comes on the next connection without DUP (the teardown's
    Redis work is stretched here to 0.5 s)."""
    original = Session._keep_in_flight

    async def slow_keep_in_flight(self: Session) -> None:
        await asyncio.sleep(0.5)
        await original(self)

    monkeypatch.setattr(Session, "_keep_in_flight", slow_keep_in_flight)
    raw, _ = await Raw.connected(mqtt.port, 4, client_id="tear", clean_start=False)
    await raw.send(Subscribe(1, [("td/#", SubscriptionOptions(qos=1))]))
    assert isinstance(await raw.recv(), Suback)
    raw.writer.transport.abort()
    await asyncio.sleep(0.1)  # the teardown runs
    await broker.publish(Message(destination="td/1", payload=b"never sent"))
    sessions = mqtt.registry.sessions
    async with asyncio.timeout(5):
        while "tear" in sessions:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    raw, _ = await Raw.connected(mqtt.port, 4, client_id="tear", clean_start=False)
    try:
        got = await raw.recv(timeout=3)
        assert isinstance(got, Publish) and got.payload == b"never sent"
        assert not got.dup, "never sent to the client, yet DUP=1 (its delivery was counted)"
    finally:
        raw.close()
