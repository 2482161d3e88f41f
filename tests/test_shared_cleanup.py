"""MQTT shared subscription groups' queues go with their last member: when it unsubscribes
or its session ends (end of a non-persistent session, clean start over a persistent one),
not while another member, online or a persistent session offline, or a bound flow holds
the group. Real Redis, real sockets, paho-mqtt 2.x (MQTT 5).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gateway.broker import Broker, QueueConfig
from protocols.mqtt.listener import Listener
from protocols.mqtt.state import shared_queue_name
from tests.test_mqtt_paho import V5, Client

TIMEOUT = 5.0
GROUP = "$share/grp/jobs/#"
QUEUE = shared_queue_name("grp", "jobs/#")


async def exists_after(broker: Broker, expected: bool) -> bool:
    """Whether the group's queue exists, once it is `expected` (or at the deadline):
    unbinds and leaves reach Redis a little after the client has its UNSUBACK."""
    deadline = time.monotonic() + TIMEOUT
    while (found := await broker.queues.exists(QUEUE)) != expected:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    return found


async def connect(mqtt: Listener, client_id: str) -> Client:
    """A connected MQTT 5 client with a non-persistent session (paho blocks: in a thread)."""
    return await asyncio.to_thread(Client, mqtt.port, V5, client_id)


def unsubscribe(client: Client) -> None:
    """UNSUBSCRIBE from the group and wait for the UNSUBACK."""
    done = threading.Event()
    client.c.on_unsubscribe = lambda *_: done.set()
    client.c.unsubscribe(GROUP)
    assert done.wait(TIMEOUT), "no UNSUBACK"


def persistent() -> Properties:
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 60
    return props


async def test_queue_goes_when_both_members_unsubscribe(broker: Broker, mqtt: Listener) -> None:
    a, b, pub = [await connect(mqtt, c) for c in ("member-a", "member-b", "producer")]
    try:
        await asyncio.to_thread(a.subscribe, GROUP, 1)
        await asyncio.to_thread(b.subscribe, GROUP, 1)
        await asyncio.to_thread(pub.publish, "jobs/1", b"j1", 1)
        assert await broker.queues.exists(QUEUE)
        await asyncio.to_thread(unsubscribe, a)
        await asyncio.sleep(0.3)
        assert await exists_after(broker, True), "b still holds the group"
        await asyncio.to_thread(unsubscribe, b)
        assert not await exists_after(broker, False), "the last member took it with it"
        # a new member starts a new, empty group queue
        await asyncio.to_thread(a.subscribe, GROUP, 1)
        assert (await broker.queues.info(QUEUE)).messages == 0
    finally:
        for client in (a, b, pub):
            await asyncio.to_thread(client.close)


async def test_queue_stays_while_one_member_stays(broker: Broker, mqtt: Listener) -> None:
    a, b = [await connect(mqtt, c) for c in ("member-a", "member-b")]
    try:
        await asyncio.to_thread(a.subscribe, GROUP, 1)
        await asyncio.to_thread(b.subscribe, GROUP, 1)
        await asyncio.to_thread(a.close)  # its non-persistent session ends
        await asyncio.sleep(0.5)
        assert await broker.queues.exists(QUEUE)
        await asyncio.to_thread(b.close)  # the last member's session ends
        assert not await exists_after(broker, False)
    finally:
        await asyncio.to_thread(b.close)


async def test_offline_persistent_member_holds_the_group_until_clean_start(
    broker: Broker, mqtt: Listener
) -> None:
    def offline_member() -> None:
        a = Client(mqtt.port, V5, "member-p", clean=False, properties=persistent())
        a.subscribe(GROUP, 1)
        a.close()

    await asyncio.to_thread(offline_member)
    b, pub = [await connect(mqtt, c) for c in ("member-b", "producer")]
    try:
        await asyncio.to_thread(b.subscribe, GROUP, 1)
        await asyncio.to_thread(unsubscribe, b)
        await asyncio.to_thread(pub.publish, "jobs/2", b"j2", 1)
        await asyncio.sleep(0.3)
        assert await exists_after(broker, True), "the offline session is still a member"
        assert (await broker.queues.info(QUEUE)).messages == 1, "kept for it"
        # a clean start ends the stored session: its membership goes, and with it the queue
        a = await asyncio.to_thread(Client, mqtt.port, V5, "member-p", True)
        await asyncio.to_thread(a.close)
        assert not await exists_after(broker, False)
    finally:
        for client in (b, pub):
            await asyncio.to_thread(client.close)


async def test_a_member_joining_as_the_last_leaves_keeps_the_queue(broker: Broker) -> None:
    """Nodes join before declaring and binding, and the leave checks members and flows in
    one function, so a join racing a last leave never loses its queue."""
    queue = "#share/race"
    now = time.time() * 1000
    await broker.queues.join(queue, "a", math.inf)
    await broker.queues.create(QueueConfig(name=queue), reserved_ok=True)
    await broker.queues.join(queue, "b", now + 10_000)  # another node's member, not bound yet
    assert await broker.queues.leave(queue, "a") == 0
    assert await broker.queues.exists(queue)
    flow = await broker.bind(queue, lambda d: None)  # b's flow
    await broker.queues.join(queue, "b", now - 1)  # its membership lapsed: the flow holds it
    assert await broker.queues.leave(queue, "a") == 2
    assert await broker.queues.exists(queue)
    await flow.close()
    assert await broker.queues.leave(queue, "b") == 1
    assert not await broker.queues.exists(queue)
