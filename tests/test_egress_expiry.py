"""Effective expiry on egress: a queue's max_ttl_ms shortens a message's life when it is
spooled, and consumers are told that shorter life (AMQP header.ttl and
absolute-expiry-time, MQTT 5 Message Expiry Interval), not the publisher's. Real Redis,
real sockets, proton and paho clients.
"""

from __future__ import annotations

import asyncio
import time

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from proton import Message
from proton.utils import BlockingConnection

from gateway.broker import Broker, QueueConfig
from gateway.model import Message as GatewayMessage
from gateway.model import Outcome
from protocols.amqp.listener import Listener as AmqpListener
from protocols.mqtt.listener import Listener as MqttListener
from protocols.mqtt.state import shared_queue_name
from tests.test_amqp_clients import Browse
from tests.test_mqtt_paho import V5, Client

TIMEOUT = 5.0
CAP_MS = 3000


async def test_amqp_consumer_sees_the_capped_ttl(broker: Broker, amqp: AmqpListener) -> None:
    await broker.declare_queue(QueueConfig(name="capped", max_ttl_ms=CAP_MS))

    def client() -> list[tuple[bytes, float, float, float]]:
        conn = BlockingConnection(f"amqp://127.0.0.1:{amqp.port}", timeout=TIMEOUT)
        try:
            snd = conn.create_sender("capped")
            snd.send(Message(body=b"long", ttl=60))  # the cap is shorter
            snd.send(Message(body=b"none"))  # no TTL of its own: the cap applies
            snd.send(Message(body=b"short", ttl=1))  # its own TTL is shorter than the cap
            rcv = conn.create_receiver("capped", credit=10)
            got = []
            for _ in range(3):
                msg = rcv.receive(TIMEOUT)
                rcv.accept()
                got.append((bytes(msg.body), msg.ttl, msg.expiry_time, time.time()))
            return got
        finally:
            conn.close()

    sent = time.time()
    got = {body: (ttl, expiry, at) for body, ttl, expiry, at in await asyncio.to_thread(client)}
    for body in (b"long", b"none"):
        ttl, expiry, _ = got[body]
        assert 0 < ttl <= CAP_MS / 1000, f"{body!r}: header.ttl is the time the cap leaves"
        assert expiry <= sent + CAP_MS / 1000 + 0.5, "absolute-expiry-time is the capped one"
    ttl, _, _ = got[b"short"]
    assert 0 < ttl <= 1, "a publisher TTL under the cap is kept"


async def test_mqtt5_consumer_sees_the_capped_expiry_interval(
    broker: Broker, mqtt: MqttListener
) -> None:
    await broker.queues.create(
        QueueConfig(name=shared_queue_name("g", "exp/#"), max_ttl_ms=CAP_MS), reserved_ok=True
    )

    def scenario() -> dict[bytes, int | None]:
        sub = Client(mqtt.port, V5, "exp-sub")
        pub = Client(mqtt.port, V5, "exp-pub")
        try:
            sub.subscribe("$share/g/exp/#", 1)
            props = Properties(PacketTypes.PUBLISH)
            props.MessageExpiryInterval = 3600
            pub.publish("exp/a", b"long", 1, props)
            pub.publish("exp/a", b"none", 1)
            return {
                m.payload: getattr(m.properties, "MessageExpiryInterval", None)
                for m in sub.receive(2)
            }
        finally:
            pub.close()
            sub.close()

    got = await asyncio.to_thread(scenario)
    for payload in (b"long", b"none"):
        left = got[payload]
        assert left is not None and 1 <= left <= CAP_MS // 1000, (payload, left)


async def test_amqp_browser_sees_the_capped_ttl(broker: Broker, amqp: AmqpListener) -> None:
    await broker.declare_queue(QueueConfig(name="shelf", max_ttl_ms=CAP_MS))

    def client() -> float:
        conn = BlockingConnection(f"amqp://127.0.0.1:{amqp.port}", timeout=TIMEOUT)
        try:
            conn.create_sender("shelf").send(Message(body=b"long", ttl=60))
            browser = conn.create_receiver("shelf", name="b", credit=10, options=Browse())
            msg = browser.receive(TIMEOUT)
            browser.accept()
            return msg.ttl
        finally:
            conn.close()

    assert 0 < await asyncio.to_thread(client) <= CAP_MS / 1000


async def test_expired_messages_leave_a_queue_a_stream_reader_reads(broker: Broker) -> None:
    """Messages nobody consumes expire on the heartbeat's sweep (README), on a queue a Spark
    stream reader reads too (gw_reader_at, as gateway/spark/source.py registers it): they
    stop counting toward its limits, where they had kept it full."""
    await broker.declare_queue(QueueConfig(name="q", max_ttl_ms=200, max_messages=2))
    await broker.redis.fcall("gw_reader_at", 0, "q", "spark-1", "0-0", 1)
    for i in range(2):
        assert (
            await broker.publish(GatewayMessage(destination="q", to_queue=True, payload=b"%d" % i))
            is Outcome.OK
        )
    deadline = time.monotonic() + 3
    while (await broker.queues.info("q")).messages and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    info = await broker.queues.info("q")
    assert info.messages == 0 and info.counters.get("expired") == 2, info.counters
    assert (
        await broker.publish(GatewayMessage(destination="q", to_queue=True, payload=b"room again"))
        is Outcome.OK
    )


def plain(queue: str, payload: bytes, expiration: int | None = None) -> GatewayMessage:
    return GatewayMessage(destination=queue, to_queue=True, payload=payload, expiration=expiration)


async def test_an_expired_message_behind_unexpiring_ones_leaves_a_queue_nobody_reads(
    broker: Broker,
) -> None:
    """The sweep goes on through a queue's waiting messages page by page: one expired
    behind 150 that never expire goes to the dead message queue (the sweep read the oldest
    100 only, for ever)."""
    await broker.declare_queue(QueueConfig(name="dmq"))
    await broker.declare_queue(
        QueueConfig(name="q", respect_ttl=True, dead_message_queue="dmq", dmq_eligible_default=True)
    )
    for i in range(150):
        assert await broker.publish(plain("q", b"keep%d" % i)) is Outcome.OK
    expires = int(time.time() * 1000) + 200
    assert await broker.publish(plain("q", b"short", expires)) is Outcome.OK
    deadline = time.monotonic() + 5
    while (await broker.queues.info("dmq")).messages == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert (await broker.queues.info("q")).messages == 150
    assert (await broker.queues.info("dmq")).messages == 1


async def test_a_non_destructive_queues_expired_messages_leave_it(broker: Broker) -> None:
    """A non-destructive queue's messages are never taken, so they leave only by expiry:
    2,000 expired go within a few sweeps (a sweep took 100 of them: the queue grew)."""
    await broker.declare_queue(QueueConfig(name="nd", non_destructive=True, max_ttl_ms=100))
    futures = [broker.publish_nowait(plain("nd", b"%d" % i)) for i in range(2000)]
    assert {await f for f in futures} == {Outcome.OK}
    deadline = time.monotonic() + 3
    while (await broker.queues.info("nd")).messages and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    info = await broker.queues.info("nd")
    assert info.messages == 0 and info.counters.get("expired") == 2000, info.counters


async def test_an_expired_message_behind_unexpiring_ones_a_browser_admitted_goes(
    broker: Broker,
) -> None:
    """A sorted queue's browser moves its waiting messages into its index (held for their
    sort order): the sweep pages through those too, so one expired behind 150 that never
    expire goes (the sweep read the oldest 100 of them only)."""
    await broker.declare_queue(QueueConfig(name="dmq"))
    await broker.declare_queue(
        QueueConfig(
            name="sq",
            sort_key="k",
            non_destructive=True,
            respect_ttl=True,
            dead_message_queue="dmq",
            dmq_eligible_default=True,
        ),
        [("sorted/>", "smf")],
    )
    for i in range(150):
        message = plain("sq", b"keep%d" % i)
        message.user_properties = [("k", f"{i:04}")]
        assert await broker.publish(message) is Outcome.OK
    short = plain("sq", b"short", int(time.time() * 1000) + 300)
    short.user_properties = [("k", "9999")]
    assert await broker.publish(short) is Outcome.OK
    seen: list = []
    await broker.bind("sq", seen.append, window=1000)  # browses: admits them all
    deadline = time.monotonic() + 5
    while (await broker.queues.info("dmq")).messages == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert (await broker.queues.info("sq")).messages == 150
    assert (await broker.queues.info("dmq")).messages == 1
