"""MQTT adapter protocol edges over raw sockets (the codec as the client): malformed and
unexpected packets, keep alive, exactly-once, refusals, backpressure, restarts."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import AsyncIterator

import pytest

from gateway.broker import ANONYMOUS, Broker, QueueConfig
from gateway.config import Settings, User
from gateway.engine import library
from gateway.model import Message
from protocols.mqtt.codec import (
    Connack,
    Connect,
    Disconnect,
    MqttDecoder,
    Packet,
    Pingreq,
    Pingresp,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
    encode,
)
from protocols.mqtt.listener import Listener, start

WAIT = 5.0


def settings(**kw: object) -> Settings:
    return Settings(mqtt_port=0, host="127.0.0.1", users=[User("alice", "s3cret")], **kw)


@pytest.fixture
async def mqtt(broker: Broker) -> AsyncIterator[Listener]:
    listener = await start(broker, settings())
    assert listener is not None
    yield listener
    await listener.close()


class Raw:
    """A bare MQTT client: the codec over an asyncio stream."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, level: int
    ) -> None:
        self.reader, self.writer, self.level = reader, writer, level
        self.decoder = MqttDecoder(protocol_level=level)
        self.pending: list[Packet] = []

    @classmethod
    async def open(cls, port: int, level: int = 4, rcvbuf: int | None = None) -> Raw:
        sock = None
        if rcvbuf is not None:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer, level)

    @classmethod
    async def connected(cls, port: int, level: int = 4, **kw: object) -> tuple[Raw, Connack]:
        raw = await cls.open(port, level)
        kw.setdefault("client_id", "")
        await raw.send(Connect(protocol_level=level, **kw))  # type: ignore[arg-type]
        ack = await raw.recv()
        assert isinstance(ack, Connack)
        return raw, ack

    async def send(self, packet: Packet) -> None:
        self.writer.write(encode(packet, self.level))
        await self.writer.drain()

    async def send_bytes(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self, timeout: float = WAIT) -> Packet:
        async with asyncio.timeout(timeout):
            while not self.pending:
                data = await self.reader.read(65536)
                if not data:
                    raise ConnectionError("closed by the server")
                self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    async def closed(self, timeout: float = WAIT) -> list[Packet]:
        """Wait for the server to close; returns the packets it sent before that."""
        got = list(self.pending)
        async with asyncio.timeout(timeout):
            while True:
                try:
                    data = await self.reader.read(65536)
                except ConnectionResetError:
                    return got
                if not data:
                    return got
                got.extend(self.decoder.feed(data))

    async def ping(self) -> None:
        """Round trip: everything the server sent before the PINGRESP is in `pending`."""
        await self.send(Pingreq())
        while not any(isinstance(p, Pingresp) for p in self.pending):
            data = await asyncio.wait_for(self.reader.read(65536), WAIT)
            assert data, "closed by the server"
            self.pending.extend(self.decoder.feed(data))
        self.pending = [p for p in self.pending if not isinstance(p, Pingresp)]

    def close(self) -> None:
        self.writer.close()


async def test_malformed_packet_closes_only_that_connection(mqtt: Listener) -> None:
    v4, _ = await Raw.connected(mqtt.port, 4)
    v5, _ = await Raw.connected(mqtt.port, 5)
    await v4.send_bytes(b"\x30\xff\xff\xff\xff\x7f")  # remaining length of five bytes
    await v5.send_bytes(b"\x36\x03\x00\x01a")  # PUBLISH with QoS 3
    assert await v4.closed() == []
    assert [p.reason_code for p in await v5.closed()] == [0x81]
    other, ack = await Raw.connected(mqtt.port, 4)
    assert ack.reason_code == 0
    await other.ping()
    other.close()


async def test_garbage_before_connect_is_closed(mqtt: Listener) -> None:
    raw = await Raw.open(mqtt.port)
    await raw.send_bytes(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await raw.closed() == []


async def test_unsupported_protocol_version(mqtt: Listener) -> None:
    raw = await Raw.open(mqtt.port, 4)
    await raw.send_bytes(b"\x10\x0d\x00\x04MQTT\x06\x02\x00\x3c\x00\x01x")
    assert await raw.closed() == [Connack(False, 1)]


@pytest.mark.parametrize("level", [4, 5])
async def test_second_connect_is_a_protocol_error(mqtt: Listener, level: int) -> None:
    raw, _ = await Raw.connected(mqtt.port, level)
    await raw.send(Connect(protocol_level=level, client_id="again"))
    got = await raw.closed()
    assert got == ([Disconnect(0x82)] if level == 5 else [])


async def test_v3_connack_return_codes(broker: Broker) -> None:
    listener = await start(broker, settings(allow_anonymous=False))
    assert listener is not None
    try:
        for kw, code in (({"username": "alice", "password": b"bad"}, 4), ({}, 5)):
            raw = await Raw.open(listener.port, 4)
            await raw.send(Connect(protocol_level=4, client_id="c", **kw))
            assert await raw.closed() == [Connack(False, code)]
    finally:
        await listener.close()


async def test_credentials_without_configured_users_connect_as_anonymous(
    broker: Broker,
) -> None:
    """No users configured, anonymous clients allowed (the default): a client that sends a
    user name (and password) anyway connects, as Mosquitto lets it, as anonymous."""
    listener = await start(broker, Settings(mqtt_port=0, host="127.0.0.1"))
    assert listener is not None
    try:
        for n, kw in enumerate(({"username": "dev"}, {"username": "dev", "password": b"x"})):
            raw = await Raw.open(listener.port, 4)
            await raw.send(Connect(protocol_level=4, client_id=f"named-{n}", **kw))
            assert await raw.recv() == Connack(False, 0)
            assert listener.registry.sessions[f"named-{n}"].access_user == ANONYMOUS
            raw.close()
    finally:
        await listener.close()


@pytest.mark.parametrize("level", [4, 5])
async def test_keep_alive_enforced(mqtt: Listener, level: int) -> None:
    raw, _ = await Raw.connected(mqtt.port, level, keep_alive=1)
    start_time = asyncio.get_running_loop().time()
    got = await raw.closed(timeout=4)
    elapsed = asyncio.get_running_loop().time() - start_time
    assert 1.4 <= elapsed < 3
    assert got == ([Disconnect(0x8D)] if level == 5 else [])


async def test_qos2_inbound_exactly_once(mqtt: Listener) -> None:
    sub, _ = await Raw.connected(mqtt.port, 5, client_id="q2-sub")
    await sub.send(Subscribe(1, [("q2/#", SubscriptionOptions(qos=2))]))
    assert await sub.recv() == Suback(1, [2])
    pub, _ = await Raw.connected(mqtt.port, 5, client_id="q2-pub")
    await pub.send(Publish("q2/a", b"once", qos=2, packet_id=7))
    await pub.send(Publish("q2/a", b"once", qos=2, packet_id=7, dup=True))
    assert await pub.recv() == Pubrec(7)
    assert await pub.recv() == Pubrec(7)
    await pub.send(Pubrel(7))
    assert await pub.recv() == Pubcomp(7)
    await pub.send(Pubrel(7))
    assert await pub.recv() == Pubcomp(7, 0x92)
    got = await sub.recv()
    assert isinstance(got, Publish) and got.payload == b"once" and got.qos == 2
    await sub.send(Pubrec(got.packet_id))  # type: ignore[arg-type]
    assert await sub.recv() == Pubrel(got.packet_id)  # type: ignore[arg-type]
    await sub.send(Pubcomp(got.packet_id))  # type: ignore[arg-type]
    await sub.ping()
    assert sub.pending == []
    sub.close()
    pub.close()


async def test_refusals_v5_reason_codes_v4_withheld(mqtt: Listener, broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="tiny", max_messages=1))
    await broker.subscribe_queue("tiny", ["full/#"], "mqtt")
    v5, _ = await Raw.connected(mqtt.port, 5, client_id="r5")
    await v5.send(Publish("full/a", b"1", qos=1, packet_id=1))
    await v5.send(Publish("full/a", b"2", qos=1, packet_id=2))
    await v5.send(Publish("full/a", b"3", qos=2, packet_id=3))
    assert [await v5.recv() for _ in range(3)] == [Puback(1), Puback(2, 0x97), Pubrec(3, 0x97)]
    v4, _ = await Raw.connected(mqtt.port, 4, client_id="r4")
    await v4.send(Publish("full/a", b"4", qos=1, packet_id=1))
    await v4.ping()
    assert v4.pending == []  # no PUBACK for a refused message in 3.1.1
    await broker.queues.update("tiny", {"ingress_enabled": False})
    await v5.send(Publish("full/a", b"5", qos=1, packet_id=4))
    assert await v5.recv() == Puback(4)  # a shut queue discards it, as Solace's does
    await broker.queues.create(QueueConfig(name="small", max_message_size=10))
    await broker.subscribe_queue("small", ["big"], "mqtt")
    await v5.send(Publish("big", b"x" * 11, qos=1, packet_id=5))
    assert await v5.recv() == Puback(5, 0x97)  # PUBACK cannot carry 0x95
    v5.close()
    v4.close()


@pytest.mark.parametrize("level", [4, 5])
async def test_subscribe_filter_checks_and_unsubscribe(mqtt: Listener, level: int) -> None:
    raw, _ = await Raw.connected(mqtt.port, level, client_id="filters")
    await raw.send(
        Subscribe(
            1,
            [
                ("a/#/b", SubscriptionOptions()),
                ("$share/g+/t", SubscriptionOptions()),
                ("ok/+", SubscriptionOptions(qos=1)),
            ],
        )
    )
    expected = [0x8F, 0x8F, 1] if level == 5 else [0x80, 0x80, 1]
    assert await raw.recv() == Suback(1, expected)
    await raw.send(Unsubscribe(2, ["ok/+", "never"]))
    assert await raw.recv() == Unsuback(2, [0, 0x11] if level == 5 else [])
    await raw.send(Publish("ok/x", b"late", qos=1, packet_id=9))
    assert await raw.recv() == Puback(9)
    await raw.ping()
    assert raw.pending == []
    raw.close()


async def test_topic_alias(mqtt: Listener) -> None:
    raw, _ = await Raw.connected(mqtt.port, 5, client_id="alias")
    await raw.send(Subscribe(1, [("al/#", SubscriptionOptions(qos=1))]))
    await raw.recv()
    await raw.send(Publish("al/x", b"1", qos=1, packet_id=1, properties=Properties(topic_alias=3)))
    await raw.send(Publish("", b"2", qos=1, packet_id=2, properties=Properties(topic_alias=3)))
    got = [await raw.recv() for _ in range(4)]
    publishes = [p for p in got if isinstance(p, Publish)]
    assert [(p.topic, p.payload) for p in publishes] == [("al/x", b"1"), ("al/x", b"2")]
    await raw.send(Publish("", b"3", qos=0, properties=Properties(topic_alias=9)))
    assert await raw.closed() == [Disconnect(0x82)]


async def test_outbound_topic_aliases(mqtt: Listener) -> None:
    raw, _ = await Raw.connected(
        mqtt.port, 5, client_id="aliased", properties=Properties(topic_alias_maximum=2)
    )
    await raw.send(Subscribe(1, [("oa/#", SubscriptionOptions(qos=0))]))
    await raw.recv()
    pub, _ = await Raw.connected(mqtt.port, 5, client_id="aliaser")
    for topic in ("oa/a", "oa/a", "oa/b", "oa/c", "oa/b"):
        await pub.send(Publish(topic, topic.encode()))
    got = [await raw.recv() for _ in range(5)]
    seen = [(p.topic, p.properties.topic_alias if p.properties else None, p.payload) for p in got]
    assert seen == [
        ("oa/a", 1, b"oa/a"),
        ("", 1, b"oa/a"),  # the alias stands for the topic
        ("oa/b", 2, b"oa/b"),
        ("oa/c", None, b"oa/c"),  # past the client's topic alias maximum
        ("", 2, b"oa/b"),
    ]
    pub.close()
    raw.close()


async def test_a_qos_2_delivery_names_its_topic_in_full(mqtt: Listener) -> None:
    """mqtt.js hands a QoS 2 message on at PUBREL, from the packet it stored before it read
    the alias: a topic the alias stood for reached its application as "". A QoS 2 PUBLISH
    names the topic (and sets the alias again); QoS 1 ones still leave it out. (Found by a
    review.)"""
    raw, _ = await Raw.connected(
        mqtt.port, 5, client_id="aliased2", properties=Properties(topic_alias_maximum=2)
    )
    await raw.send(Subscribe(1, [("q2a/#", SubscriptionOptions(qos=2))]))
    await raw.recv()
    pub, _ = await Raw.connected(mqtt.port, 5, client_id="aliaser2")
    for qos in (2, 2, 1, 2):
        await pub.send(Publish("q2a/t", b"%d" % qos, qos=qos, packet_id=1))
        await pub.recv()  # PUBREC / PUBACK
        if qos == 2:
            await pub.send(Pubrel(1))
            await pub.recv()
    seen = []
    while len(seen) < 4:
        p = await raw.recv()
        if isinstance(p, Pubrel):
            await raw.send(Pubcomp(p.packet_id))
            continue
        seen.append((p.qos, p.topic, p.properties.topic_alias))
        await raw.send(Pubrec(p.packet_id) if p.qos == 2 else Puback(p.packet_id))
    assert seen == [(2, "q2a/t", 1), (2, "q2a/t", 1), (1, "", 1), (2, "q2a/t", 1)]
    pub.close()
    raw.close()


async def test_a_qos_2_delivery_that_fits_only_with_its_alias_is_sent_with_it(
    mqtt: Listener,
) -> None:
    """A QoS 2 delivery names its topic in full (for mqtt.js, above): one that fitted the
    client's maximum packet size only with the topic left out was dropped as over it."""
    topic = "long/" + "t" * 200
    props = Properties(topic_alias_maximum=2, maximum_packet_size=400)
    raw, _ = await Raw.connected(mqtt.port, 5, client_id="fits2", properties=props)
    await raw.send(Subscribe(1, [("long/#", SubscriptionOptions(qos=2))]))
    await raw.recv()
    pub, _ = await Raw.connected(mqtt.port, 5, client_id="fits2-pub")
    for pid, payload in ((1, b"small"), (2, b"x" * 250)):  # 250 B: fits with no topic
        await pub.send(Publish(topic, payload, qos=2, packet_id=pid))
        assert await pub.recv() == Pubrec(pid)
    seen = []
    while len(seen) < 2:
        p = await raw.recv()
        if isinstance(p, Pubrel):
            await raw.send(Pubcomp(p.packet_id))
            continue
        seen.append((p.topic, len(p.payload), p.properties.topic_alias))
        await raw.send(Pubrec(p.packet_id))
    assert seen == [(topic, 5, 1), ("", 250, 1)]
    pub.close()
    raw.close()


async def test_slow_reader_is_disconnected(mqtt: Listener) -> None:
    slow = await Raw.open(mqtt.port, 4, rcvbuf=4096)
    await slow.send(Connect(protocol_level=4, client_id="slow"))
    await slow.send(Subscribe(1, [("slow/#", SubscriptionOptions())]))
    await asyncio.sleep(0.2)  # CONNACK + SUBACK arrive; from now on nobody reads
    pub, _ = await Raw.connected(mqtt.port, 4, client_id="flood")
    chunk = b"x" * 100_000
    for _ in range(200):  # 20 MB against an 8 MiB cap
        await pub.send(Publish("slow/t", chunk))
        if "slow" not in mqtt.registry.sessions:
            break
    await pub.ping()
    async with asyncio.timeout(WAIT):
        while "slow" in mqtt.registry.sessions:
            await asyncio.sleep(0.05)
    pub.close()
    slow.close()


async def test_a_reader_that_keeps_up_is_not_cut_off_behind_one_large_message(
    mqtt: Listener, broker: Broker
) -> None:
    """A subscriber reading steadily (about 13 MB/s) got a 15 MB message, then a small one:
    the small one found the large one still in the write buffer, over the 8 MiB cap, and
    the client was cut off as not reading, losing both. The cap counts what was queued
    after the client stopped keeping up. (Found by a review.)"""
    sub = await Raw.open(mqtt.port, 4, rcvbuf=65536)
    await sub.send(Connect(protocol_level=4, client_id="bigsub"))
    await sub.send(Subscribe(1, [("big/#", SubscriptionOptions())]))
    assert isinstance(await sub.recv(), Connack) and isinstance(await sub.recv(), Suback)
    body = random.randbytes(15_000_000)
    await broker.publish(Message(destination="big/a", payload=body))  # QoS 0: no queue
    got: list[Packet] = []

    async def read_slowly() -> None:
        while len(got) < 2:
            data = await sub.reader.read(65536)
            if not data:
                return
            got.extend(sub.decoder.feed(data))
            await asyncio.sleep(0.005)

    reading = asyncio.create_task(read_slowly())
    await asyncio.sleep(0.15)
    await broker.publish(Message(destination="big/b", payload=b"small"))
    await asyncio.wait_for(reading, 30)
    assert [(p.topic, p.payload == body) for p in got] == [("big/a", True), ("big/b", False)]
    assert got[1].payload == b"small"
    sub.close()


async def test_persistent_session_survives_gateway_restart(redis_url: str) -> None:
    async def node() -> tuple[Broker, Listener]:
        broker = Broker(await library.connect(redis_url), heartbeat=0.2, node_ttl=1.0)
        await broker.start()
        listener = await start(broker, settings())
        assert listener is not None
        return broker, listener

    async def stop(broker: Broker, listener: Listener) -> None:
        await listener.close()
        await broker.stop()
        await broker.redis.aclose()

    broker, listener = await node()
    raw, _ = await Raw.connected(listener.port, 4, client_id="survivor", clean_start=False)
    await raw.send(Subscribe(1, [("keep/#", SubscriptionOptions(qos=1))]))
    await raw.recv()
    await raw.send(Disconnect())
    await raw.closed()
    await stop(broker, listener)

    broker, listener = await node()
    try:
        pub, _ = await Raw.connected(listener.port, 4, client_id="p")
        await pub.send(Publish("keep/1", b"while away", qos=1, packet_id=1))
        assert await pub.recv() == Puback(1)
        raw, ack = await Raw.connected(listener.port, 4, client_id="survivor", clean_start=False)
        assert ack.session_present
        got = await raw.recv()
        assert isinstance(got, Publish) and (got.topic, got.payload) == ("keep/1", b"while away")
        # not acked: redelivered with DUP after a reconnect
        raw.close()
        await asyncio.sleep(0.2)
        raw, _ = await Raw.connected(listener.port, 4, client_id="survivor", clean_start=False)
        again = await raw.recv()
        assert isinstance(again, Publish) and again.dup and again.payload == b"while away"
        await raw.send(Puback(again.packet_id))  # type: ignore[arg-type]
        await raw.send(Disconnect())
        await raw.closed()
        pub.close()
    finally:
        await stop(broker, listener)


async def test_will_delay_cancelled_by_reconnect(mqtt: Listener) -> None:
    watcher, _ = await Raw.connected(mqtt.port, 5, client_id="watch")
    await watcher.send(Subscribe(1, [("w/#", SubscriptionOptions(qos=1))]))
    await watcher.recv()
    will = Will("w/late", b"bye", 1, properties=Properties(will_delay_interval=1))
    for payload, reconnect in ((b"bye", False), (b"kept", True)):
        will.payload = payload
        raw, _ = await Raw.connected(
            mqtt.port,
            5,
            client_id="delayed",
            will=will,
            properties=Properties(session_expiry_interval=30),
        )
        raw.writer.transport.abort()
        if reconnect:
            raw, ack = await Raw.connected(mqtt.port, 5, client_id="delayed", clean_start=False)
            assert ack.session_present
        await asyncio.sleep(1.5)
        await watcher.ping()
        delivered = [p.payload for p in watcher.pending if isinstance(p, Publish)]
        assert delivered == ([] if reconnect else [b"bye"])
        watcher.pending.clear()
        raw.close()
    watcher.close()


async def test_v5_subscription_options(mqtt: Listener) -> None:
    raw, _ = await Raw.connected(mqtt.port, 5, client_id="opts")
    await raw.send(Subscribe(1, [("o/mine", SubscriptionOptions(qos=1, no_local=True))]))
    await raw.send(
        Subscribe(
            2, [("x/+", SubscriptionOptions(qos=0))], Properties(subscription_identifiers=[42])
        )
    )
    assert [await raw.recv() for _ in range(2)] == [Suback(1, [1]), Suback(2, [0])]
    await raw.send(Publish("o/mine", b"own", qos=1, packet_id=5))  # no_local: not back to us
    await raw.send(Publish("x/other", b"echo", qos=0))
    await raw.ping()
    got = [p for p in raw.pending if isinstance(p, Publish)]
    assert [(p.topic, p.payload) for p in got] == [("x/other", b"echo")]
    assert got[0].properties is not None
    assert got[0].properties.subscription_identifiers == [42]
    raw.close()


async def test_an_own_message_a_no_local_qos1_filter_skips_comes_once_by_another(
    mqtt: Listener,
) -> None:
    """`nl/#` (QoS 1, no local) and `nl/+` (QoS 0): only `nl/+` takes the client's own
    message (MQTT-3.8.3-3), once, at QoS 0, with that filter's subscription id only."""
    raw, _ = await Raw.connected(mqtt.port, 5, client_id="nl-once")
    await raw.send(
        Subscribe(1, [("nl/#", SubscriptionOptions(qos=1, no_local=True))], Properties())
    )
    await raw.send(
        Subscribe(
            2, [("nl/+", SubscriptionOptions(qos=0))], Properties(subscription_identifiers=[7])
        )
    )
    assert [await raw.recv() for _ in range(2)] == [Suback(1, [1]), Suback(2, [0])]
    await raw.send(Publish("nl/x", b"own", qos=1, packet_id=3))
    await asyncio.sleep(0.5)  # a second copy would be here by now
    await raw.ping()
    got = [p for p in raw.pending if isinstance(p, Publish)]
    assert [(p.payload, p.qos) for p in got] == [(b"own", 0)]
    assert got[0].properties is not None
    assert got[0].properties.subscription_identifiers == [7]
    raw.close()


async def test_delivery_follows_subscription_changes(mqtt: Listener) -> None:
    """What a delivery carries (QoS, subscription ids) is worked out once per topic and
    kept: a changed or added subscription must show in the very next delivery."""
    raw, _ = await Raw.connected(mqtt.port, 5, client_id="changes")

    async def delivered(payload: bytes) -> Publish:
        await raw.send(Publish("c/x", payload, qos=0))
        got = await raw.recv()
        assert isinstance(got, Publish) and got.payload == payload
        return got

    ids = Properties(subscription_identifiers=[7])
    await raw.send(Subscribe(1, [("c/#", SubscriptionOptions(qos=1))], ids))
    assert await raw.recv() == Suback(1, [1])
    first = await delivered(b"1")
    assert first.properties is not None and first.properties.subscription_identifiers == [7]
    ids = Properties(subscription_identifiers=[9])
    await raw.send(Subscribe(2, [("c/#", SubscriptionOptions(qos=1))], ids))
    assert await raw.recv() == Suback(2, [1])
    second = await delivered(b"2")
    assert second.properties is not None and second.properties.subscription_identifiers == [9]
    ids = Properties(subscription_identifiers=[3])
    await raw.send(Subscribe(3, [("c/+", SubscriptionOptions(qos=1))], ids))
    assert await raw.recv() == Suback(3, [1])
    third = await delivered(b"3")
    assert third.properties is not None and third.properties.subscription_identifiers == [3, 9]
    await raw.send(Unsubscribe(4, ["c/#", "c/+"]))
    assert isinstance(await raw.recv(), Unsuback)
    await raw.send(Publish("c/x", b"4", qos=0))
    await raw.ping()
    assert not [p for p in raw.pending if isinstance(p, Publish)]
    raw.close()


async def test_v5_disconnect_with_will(mqtt: Listener) -> None:
    watcher, _ = await Raw.connected(mqtt.port, 5, client_id="watch2")
    await watcher.send(Subscribe(1, [("w2/#", SubscriptionOptions())]))
    await watcher.recv()
    raw, _ = await Raw.connected(mqtt.port, 5, client_id="w", will=Will("w2/x", b"asked"))
    await raw.send(Disconnect(0x04))  # disconnect with will message
    assert await raw.closed() == []
    got = await watcher.recv()
    assert isinstance(got, Publish) and got.payload == b"asked"
    watcher.close()


async def test_random_garbage_never_breaks_the_server(mqtt: Listener) -> None:
    rng = random.Random(1883)
    for i in range(40):
        level = (3, 4, 5)[i % 3]
        connect = Connect(protocol_level=level, client_id=f"fuzz{i}")
        data = bytearray(encode(connect, level))
        data += encode(Subscribe(1, [("f/#", SubscriptionOptions(qos=1))]), level)
        data += encode(Publish("f/x", b"p", qos=1, packet_id=2), level)
        data += rng.randbytes(rng.randint(1, 64))
        raw = await Raw.open(mqtt.port, level)
        await raw.send_bytes(bytes(data))
        with contextlib.suppress(TimeoutError):  # closed, or waiting for more bytes
            await raw.closed(timeout=0.2)
        raw.writer.transport.abort()
    sub, _ = await Raw.connected(mqtt.port, 5, client_id="after")
    await sub.send(Subscribe(1, [("after", SubscriptionOptions(qos=1))]))
    assert await sub.recv() == Suback(1, [1])
    await sub.send(Publish("after", b"alive", qos=1, packet_id=1))
    got = {type(await sub.recv()) for _ in range(2)}
    assert got == {Puback, Publish}
    sub.close()


async def test_qos1_across_two_gateway_nodes(broker: Broker, redis_url: str) -> None:
    other = Broker(await library.connect(redis_url), heartbeat=0.2, node_ttl=1.0)
    await other.start()
    node_a = await start(broker, settings())
    node_b = await start(other, settings())
    assert node_a is not None and node_b is not None
    try:
        sub, _ = await Raw.connected(node_b.port, 4, client_id="on-b", clean_start=False)
        await sub.send(Subscribe(1, [("x/#", SubscriptionOptions(qos=1))]))
        assert await sub.recv() == Suback(1, [1])
        async with asyncio.timeout(WAIT):  # node A learns the subscription over pub/sub
            while not broker.router.match("x/1"):
                await asyncio.sleep(0.02)
        pub, _ = await Raw.connected(node_a.port, 4, client_id="on-a")
        await pub.send(Publish("x/1", b"hop", qos=1, packet_id=1))
        assert await pub.recv() == Puback(1)
        got = await sub.recv()
        assert isinstance(got, Publish) and got.payload == b"hop"
        pub.close()
        sub.close()
    finally:
        await node_a.close()
        await node_b.close()
        await other.stop()
        await other.redis.aclose()


async def test_a_qos2_resend_is_answered_as_its_first_copy_once_that_is_decided(
    mqtt: Listener, broker: Broker
) -> None:
    """A DUP that comes while the first copy waits (producer flow control) gets no
    PUBREC before it: MQTT 3.1.1 gets none for a refused publish, so the client sends it
    again, where an early PUBREC would have it believe a message stored that was not."""
    await broker.declare_queue(QueueConfig(name="fc", max_messages=1, overflow="flow_control"))
    await broker.subscribe_queue("fc", ["fc/#"], "mqtt")
    pub, _ = await Raw.connected(mqtt.port, 4, client_id="fc-pub")
    await pub.send(Publish("fc/t", b"first", qos=1, packet_id=1))
    assert await pub.recv() == Puback(1)
    await pub.send(Publish("fc/t", b"held", qos=2, packet_id=3))
    await asyncio.sleep(0.3)
    await pub.send(Publish("fc/t", b"held", qos=2, packet_id=3, dup=True))
    with pytest.raises(TimeoutError):
        await pub.recv(timeout=0.3)  # both wait
    await broker.update_queue("fc", {"overflow": "reject"})
    with pytest.raises(TimeoutError):
        await pub.recv(timeout=0.8)  # refused: no PUBREC for either
    assert (await broker.queues.info("fc")).messages == 1
    pub.close()
