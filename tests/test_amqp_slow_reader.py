"""An AMQP consumer that stops reading its socket takes no more messages once what it was
sent backs up in the node: with a big link credit it took all of them (up to the queue's
10,000 per flow), held in the node's memory and from every other consumer. Real Redis, raw
AMQP frames over real sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.broker import Broker, QueueConfig
from gateway.config import Settings
from gateway.engine.flows import FETCH_BATCH
from gateway.model import Message
from protocols.amqp.listener import Listener
from protocols.amqp.listener import start as start_amqp
from protocols.amqp.outbound import Outbound
from tests.amqp_raw import ATTACH, RECEIVER, TRANSFER, Peer, flow
from tests.redis_proxy import CuttingProxy
from tests.test_amqp_competing import transfers
from tests.test_engine import wait_for
from tests.test_redis_outages import node, proxy  # noqa: F401

MESSAGES = 2000
PAYLOAD = b"p" * 8192  # 16 MiB in all: far more than the sockets' buffers take


def socket_buffers() -> int:
    """Bytes the kernel takes before the node's socket backs up: the node's send buffer
    at its largest, the client's receive buffer as a socket that reads nothing keeps it."""
    try:
        wmem = Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()
        rmem = Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()
        return int(wmem[2]) + int(rmem[1])
    except (OSError, IndexError, ValueError):
        return 4 * 1024 * 1024 + 128 * 1024  # Linux's defaults


def held(amqp: Listener) -> int:
    """Messages the node's AMQP consumers hold delivered but unsettled."""
    return sum(
        len(endpoint.flow.unacked)
        for conn in amqp.registry.connections
        for endpoint in conn.endpoints.values()
        if isinstance(endpoint, Outbound) and endpoint.flow is not None
    )


async def test_a_consumer_that_reads_nothing_stops_taking_messages(
    broker: Broker, amqp: Listener
) -> None:
    await broker.queues.create(QueueConfig(name="big"))
    await asyncio.gather(
        *[broker.publish(Message("big", PAYLOAD, to_queue=True)) for _ in range(MESSAGES)]
    )
    stuck = await Peer.opened(amqp.port, window=100_000)
    stuck.attach("r", 0, RECEIVER, "big")
    await stuck.expect(ATTACH)
    stuck.send(flow(0, 100_000, window=100_000))  # then reads nothing
    await asyncio.sleep(2.0)
    taken = held(amqp)
    # what the sockets took, and a fetch or two past the point where the socket backed up:
    # not the whole queue
    bound = socket_buffers() // len(PAYLOAD) + 2 * FETCH_BATCH
    assert bound < MESSAGES  # else this machine's buffers would hide the difference
    assert 0 < taken <= bound, (taken, bound)

    reader = await Peer.opened(amqp.port, window=100_000)
    reader.attach("r", 0, RECEIVER, "big")
    await reader.expect(ATTACH)
    reader.send(flow(0, 100_000, window=100_000))
    assert await transfers(reader, 3.0) == MESSAGES - taken  # the rest, none kept back

    # reading again, it gets what it took (the node sends on once its socket drains)
    assert await transfers(stuck, 3.0) == taken
    reader.close()
    stuck.close()


async def test_a_link_bound_while_the_socket_drained_gets_its_messages(
    proxy: CuttingProxy,  # noqa: F811
    node: Broker,  # noqa: F811
) -> None:
    """A link attached while the socket was backed up kept the shut window it was bound
    with when the socket drained before the bind's answer came (Redis a few hops away, or
    busy): it never got a message. (Found by a review of the change.)"""
    amqp = await start_amqp(node, Settings(amqp_port=0, host="127.0.0.1"))
    try:
        await node.queues.create(QueueConfig(name="big"))
        await node.queues.create(QueueConfig(name="replies"))
        backlog = 1000  # 8 MiB: more than the sockets take, so the node's socket backs up
        await asyncio.gather(
            *[node.publish(Message("big", PAYLOAD, to_queue=True)) for _ in range(backlog)]
        )
        for i in range(3):
            await node.publish(Message("replies", b"reply %d" % i, to_queue=True))
        peer = await Peer.opened(amqp.port, window=100_000)
        peer.attach("backlog", 0, RECEIVER, "big")
        await peer.expect(ATTACH)
        peer.send(flow(0, backlog, window=100_000))  # then reads nothing for a while
        (conn,) = amqp.registry.connections
        await wait_for(lambda: not conn.writable)

        proxy.delay_on, proxy.delay = b"gw_bind", 0.5  # the next bind's answer comes late
        peer.attach("replies", 1, RECEIVER, "replies")
        peer.send(flow(1, 10, window=100_000))
        await wait_for(lambda: proxy.delay_on is None)  # the bind went, its answer waits
        frames = await peer.frames_for(3.0)  # reading again: the socket drains meanwhile
        handles = [f.fields[0] for f in frames if f.code == TRANSFER]
        assert (handles.count(0), handles.count(1)) == (backlog, 3)
        peer.close()
    finally:
        await amqp.close()
