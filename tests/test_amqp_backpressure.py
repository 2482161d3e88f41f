"""An AMQP consumer that stops reading its socket: the node buffered all its credit
allowed (with pre-settled deliveries, the whole queue). It is dropped once 8 MiB wait for
it, as an MQTT client is (WRITE_BUFFER_CAP). Real Redis, a raw client on a real socket."""

from __future__ import annotations

import asyncio
import socket

from proton import uint

from gateway.broker import Broker, QueueConfig
from gateway.model import Message as GwMessage
from tests.amqp_raw import (
    AMQP_HEADER,
    ATTACH,
    BEGIN,
    OPEN,
    RECEIVER,
    Peer,
    flow,
    frame,
    performative,
)

QUEUE = "slow-q"
CAP = 8 * 1024 * 1024  # what the MQTT side allows a client that does not read


async def fill(broker: Broker, count: int, size: int) -> None:
    body = b"x" * size
    futures = [
        broker.publish_nowait(GwMessage(destination=QUEUE, payload=body, to_queue=True))
        for _ in range(count)
    ]
    outcomes = await asyncio.gather(*futures)
    assert all(o.accepted for o in outcomes)


async def stalled_receiver(port: int, snd_mode: int, credit: int) -> Peer:
    """A raw AMQP receiver with `credit` that then never reads its socket again."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    peer = Peer(reader, writer)
    peer.send(AMQP_HEADER + frame(performative(OPEN, "stall", None, uint(65536))))
    assert await peer.read_header() == AMQP_HEADER
    await peer.expect(OPEN)
    peer.send(frame(performative(BEGIN, None, uint(0), uint(2**31 - 1), uint(1000))))
    await peer.expect(BEGIN)
    peer.attach("r0", 0, RECEIVER, QUEUE, snd_mode=snd_mode)
    await peer.expect(ATTACH)
    peer.send(flow(0, credit, window=2**31 - 1))
    await writer.drain()
    return peer  # from here on nothing is read


def server_side(amqp) -> object:
    conns = list(amqp.registry.connections)
    assert len(conns) == 1
    return conns[0]


async def peak_buffer(conn, seconds: float) -> int:
    peak = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        sock = conn.socket
        if sock is None or sock.is_closing() or conn.closed:
            break
        peak = max(peak, sock.get_write_buffer_size())
        await asyncio.sleep(0.05)
    return peak


async def test_presettled_consumer_not_reading_is_bounded(broker: Broker, amqp) -> None:
    """A receiver with settle mode `settled` and a large credit that stops reading: the
    node must not buffer the whole queue for it (the MQTT side's 8 MiB cap, Mosquitto's
    max_queued_bytes, RabbitMQ's writer flow control)."""
    await broker.declare_queue(QueueConfig(name=QUEUE))
    await fill(broker, 3000, 8 * 1024)  # ~24 MiB
    peer = await stalled_receiver(amqp.port, snd_mode=1, credit=1_000_000)
    try:
        conn = server_side(amqp)
        peak = await peak_buffer(conn, 8.0)
        depth = (await broker.queues.info(QUEUE)).messages
        print(f"peak asyncio write buffer {peak} bytes; queue depth left {depth}")
        assert peak <= CAP + 256 * 1024, (
            f"{peak / 2**20:.1f} MiB queued in the node for a client that reads nothing"
        )
    finally:
        peer.close()


async def test_unsettled_consumer_not_reading_is_bounded(broker: Broker, amqp) -> None:
    """The same with unsettled deliveries and a credit under the queue's per-flow window
    (10,000 by default): everything credited is pushed into the node's socket buffer."""
    await broker.declare_queue(QueueConfig(name=QUEUE))
    await fill(broker, 3000, 8 * 1024)
    peer = await stalled_receiver(amqp.port, snd_mode=0, credit=3000)
    try:
        conn = server_side(amqp)
        peak = await peak_buffer(conn, 8.0)
        print(f"peak asyncio write buffer {peak} bytes")
        assert peak <= CAP + 256 * 1024, (
            f"{peak / 2**20:.1f} MiB queued in the node for a client that reads nothing"
        )
    finally:
        peer.close()
