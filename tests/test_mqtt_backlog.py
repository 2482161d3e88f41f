"""What waits for an MQTT client that acks nothing stays bounded: retained messages each
SUBSCRIBE sends again, and QoS 0 messages held behind a waiting retained one of their
topic (both grew without bound: +76 MiB for 60 SUBSCRIBEs of 500 retained messages), and
queued messages while its socket is backed up. Real Redis, a raw client on a real socket;
the session's queues are read directly."""

from __future__ import annotations

import asyncio
import struct

from gateway.admin.metrics import render_metrics
from gateway.broker import Broker
from gateway.config import Settings
from gateway.engine.flows import FETCH_BATCH
from gateway.model import Message as GwMessage
from protocols.mqtt.codec import Puback, Publish, Suback, Subscribe, SubscriptionOptions, encode
from protocols.mqtt.listener import start as start_mqtt
from protocols.mqtt.session import MAX_WAITING, MAX_WINDOW, Session
from tests.redis_proxy import CuttingProxy
from tests.test_amqp_slow_reader import socket_buffers
from tests.test_engine import wait_for
from tests.test_mqtt_protocol import Raw
from tests.test_redis_outages import node, proxy  # noqa: F401

RETAINED = 500
SUBSCRIBES = 60


def utf8(s: str) -> bytes:
    return struct.pack(">H", len(s)) + s.encode()


def packet(kind: int, body: bytes) -> bytes:
    n, rl = len(body), b""
    while True:
        b, n = n % 128, n // 128
        rl += bytes([b | (0x80 if n else 0)])
        if not n:
            break
    return bytes([kind]) + rl + body


async def drain(reader: asyncio.StreamReader, suback_ids: set[int], want: int) -> None:
    """Read packets (never acking a PUBLISH) until `want` SUBACKs arrived."""
    while len(suback_ids) < want:
        head = await reader.readexactly(1)
        size, mult = 0, 1
        while True:
            b = (await reader.readexactly(1))[0]
            size += (b & 0x7F) * mult
            mult *= 128
            if not b & 0x80:
                break
        body = await reader.readexactly(size)
        if head[0] & 0xF0 == 0x90:
            suback_ids.add(struct.unpack(">H", body[:2])[0])


async def hog_with_retained(
    broker: Broker, mqtt, client_id: str, retained: int, payload: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Session]:
    """`retained` retained messages on r/0, r/1, ...; then a v3.1.1 client `client_id`
    connected (clean session) on a raw socket, with its node-side session."""
    outcomes = await asyncio.gather(
        *(
            broker.publish_nowait(GwMessage(destination=f"r/{i}", payload=payload, retain=True))
            for i in range(retained)
        )
    )
    assert all(o.accepted for o in outcomes)
    reader, writer = await asyncio.open_connection("127.0.0.1", mqtt.port)
    writer.write(
        packet(0x10, utf8("MQTT") + bytes([4, 0x02]) + struct.pack(">H", 60) + utf8(client_id))
    )
    assert (await asyncio.wait_for(reader.readexactly(4), 5))[0] == 0x20
    return reader, writer, mqtt.registry.sessions[client_id]


async def test_resubscribing_client_retained_backlog_is_bounded(broker: Broker, mqtt) -> None:
    reader, writer, session = await hog_with_retained(broker, mqtt, "hog", RETAINED, b"r" * 2048)
    try:
        got: set[int] = set()
        for pid in range(1, SUBSCRIBES + 1):
            writer.write(packet(0x82, struct.pack(">H", pid) + utf8("r/#") + b"\x01"))
        async with asyncio.timeout(15):
            await drain(reader, got, SUBSCRIBES)
        await asyncio.sleep(0.2)
        waiting = len(session._retained_waiting)
        assert waiting <= MAX_WAITING, (
            f"{waiting} retained messages held in memory for one client that acks nothing"
        )
    finally:
        writer.close()


async def test_the_mqtt_counters_are_exported_from_the_start(broker: Broker, mqtt) -> None:
    """A counter missing until its first event hides that event from a rate (Prometheus:
    avoid missing metrics). (Found by a review.)"""
    metrics = await render_metrics(broker)
    for name in ("qos0_dropped", "retained_dropped", "publish_denied", "wills"):
        assert f'gateway_mqtt_{name}{{node="{broker.node_id}"}} 0' in metrics, name


async def test_qos0_held_behind_waiting_retained_is_bounded(broker: Broker, mqtt) -> None:
    """A QoS 0 message whose topic has an older retained message waiting for the client's
    receive maximum is held in `_held_out` (session.py `_send_or_hold`). A client that never
    acks keeps that retained message waiting for ever, so every QoS 0 message on the topic
    is kept in the node's memory, never sent and never dropped (QoS 0 may be dropped:
    Mosquitto drops beyond max_queued_messages). Reached by a client that lowers its
    subscription's QoS from 1 to 0 while retained QoS 1 messages wait for its window."""
    # more retained messages than the v3.1.1 window of 256
    reader, writer, session = await hog_with_retained(broker, mqtt, "hog0", 300, b"v")
    writer.write(packet(0x82, struct.pack(">H", 1) + utf8("r/#") + b"\x01"))
    async with asyncio.timeout(5):
        await drain(reader, set(), 1)
    await wait_for(lambda: len(session._retained_waiting) == 300 - 256, 5)
    topic = session._retained_waiting[-1][0].destination
    # the client lowers the subscription to QoS 0: its messages now go direct
    writer.write(packet(0x82, struct.pack(">H", 2) + utf8("r/#") + b"\x00"))
    async with asyncio.timeout(5):
        await drain(reader, set(), 1)
    try:
        body = b"z" * 1024
        for _ in range(20):
            await asyncio.gather(
                *(
                    broker.publish_nowait(
                        GwMessage(destination=topic, payload=body, persistent=False)
                    )
                    for _ in range(1000)
                )
            )
        await asyncio.sleep(0.3)
        held = len(session._held_out)
        assert held <= MAX_WAITING, f"{held} QoS 0 messages held in memory, never sent or dropped"
        # what was dropped is counted where an operator sees it (it was counted in a dict
        # nothing read)
        metrics = await render_metrics(broker)
        assert f'gateway_mqtt_qos0_dropped{{node="{broker.node_id}"}} {20_000 - held}' in metrics
    finally:
        writer.close()


async def test_a_client_that_reads_nothing_stops_taking_queued_messages(
    broker: Broker, mqtt
) -> None:
    """A v5 client's receive maximum (up to MAX_WINDOW) let its subscription take that many
    messages, of any size, for its socket while the client read none of them: past 8 MiB
    (WRITE_BUFFER_CAP) the node cut it off, and a slow reader of a backlog of big messages
    was cut off again at each reconnect. Its flows now wait while its socket is backed up,
    and the messages go out once it reads again."""
    reader, writer = await asyncio.open_connection("127.0.0.1", mqtt.port)
    receive_maximum = b"\x03\x21" + struct.pack(">H", 65535)  # properties: length, 0x21
    writer.write(
        packet(0x10, utf8("MQTT") + bytes([5, 0x02]) + struct.pack(">H", 60)
               + receive_maximum + utf8("slow"))
    )  # fmt: skip
    head = await asyncio.wait_for(reader.readexactly(2), 5)
    assert head[0] == 0x20
    await reader.readexactly(head[1])
    session = mqtt.registry.sessions["slow"]
    writer.write(packet(0x82, struct.pack(">H", 1) + b"\x00" + utf8("big/#") + b"\x01"))
    async with asyncio.timeout(5):
        await drain(reader, set(), 1)
    body = b"z" * 65536
    messages = MAX_WINDOW + 100  # 70 MiB: far more than the sockets' buffers take
    outcomes = await asyncio.gather(
        *(
            broker.publish_nowait(GwMessage(destination="big/x", payload=body))
            for _ in range(messages)
        )
    )
    assert all(o.accepted for o in outcomes)
    try:
        await asyncio.sleep(2.0)
        assert not session.closing, "cut off"
        held = sum(len(flow.unacked) for flow in session._flows.values())
        # what the sockets took, and a fetch or two: not the client's whole window
        bound = socket_buffers() // len(body) + 2 * FETCH_BATCH
        assert bound < MAX_WINDOW  # else this machine's buffers would hide the difference
        assert 0 < held <= bound, (held, bound)
        got = 0
        async with asyncio.timeout(10):
            while got < MAX_WINDOW:  # reading again (acking none): its window's worth come
                first = (await reader.readexactly(1))[0]
                size, mult = 0, 1
                while (b := (await reader.readexactly(1))[0]) & 0x80:
                    size, mult = size + (b & 0x7F) * mult, mult * 128
                await reader.readexactly(size + (b & 0x7F) * mult)
                got += first & 0xF0 == 0x30
    finally:
        writer.close()


async def test_a_subscription_bound_while_the_socket_drained_gets_its_messages(
    proxy: CuttingProxy,  # noqa: F811
    node: Broker,  # noqa: F811
) -> None:
    """Two SUBSCRIBEs in one write, as clients send them on connect: the first one's
    retained messages back the socket up, the second one's QoS 1 filter binds the session's
    queue. The client read everything while the bind's answer came late (Redis a few hops
    away, or busy), and the flow kept the shut window it was bound with: a QoS 1 message
    then never came. (Found by a review of the change.)"""
    mqtt = await start_mqtt(node, Settings(mqtt_port=0, host="127.0.0.1"))
    try:
        # one retained message of 6.4 MiB, a batch of its own (the SUBSCRIBE ends without
        # waiting for it to drain): the node's socket backs up
        retained = 1
        outcomes = await asyncio.gather(
            *(
                node.publish_nowait(
                    GwMessage(destination=f"r/{i}", payload=b"r" * 6_400_000, retain=True)
                )
                for i in range(retained)
            )
        )
        assert all(o.accepted for o in outcomes)
        sub, _ = await Raw.connected(mqtt.port, 4, client_id="sub", keep_alive=60)
        (conn,) = [c for c in mqtt.registry.connections if c.session.client_id == "sub"]
        proxy.delay_on, proxy.delay = b"gw_bind", 0.5  # the next bind's answer comes late
        sub.writer.write(
            encode(Subscribe(1, [("r/#", SubscriptionOptions(qos=0))]), 4)
            + encode(Subscribe(2, [("q/#", SubscriptionOptions(qos=1))]), 4)
        )
        await wait_for(lambda: proxy.delay_on is None)  # the bind went, its answer waits
        assert not conn.writable
        got_retained = subacks = 0
        async with asyncio.timeout(5):  # reading all it was sent, while the bind waits
            while got_retained < retained or subacks < 2:
                packet_in = await sub.recv()
                got_retained += isinstance(packet_in, Publish)
                subacks += isinstance(packet_in, Suback)
        await wait_for(lambda: conn.writable and conn.session.state.queue in conn.session._flows)

        pub, _ = await Raw.connected(mqtt.port, 4, client_id="pub")
        await pub.send(Publish("q/x", b"hello", qos=1, packet_id=1))
        assert isinstance(await pub.recv(), Puback)
        got = await sub.recv(3.0)
        assert isinstance(got, Publish) and got.payload == b"hello"
        sub.writer.close()
        pub.writer.close()
    finally:
        await mqtt.close()
