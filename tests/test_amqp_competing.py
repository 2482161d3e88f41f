"""Competing AMQP consumers of a non-exclusive queue, frame by frame: a burst is dealt out
in turns, and what a link was fetched as its client cut its credit goes to the others.
Real Redis (behind a proxy that can slow a fetch's answer), real sockets."""

from __future__ import annotations

import asyncio

from proton import Described, symbol, uint, ulong
from proton import Message as AmqpMessage

from gateway.broker import Broker, QueueConfig
from gateway.config import Settings
from gateway.model import Message
from protocols.amqp.listener import Listener
from protocols.amqp.listener import start as start_amqp
from tests.amqp_raw import (
    ATTACH,
    RECEIVER,
    SOURCE,
    TARGET,
    TRANSFER,
    Peer,
    flow,
    frame,
    performative,
)
from tests.redis_proxy import CuttingProxy
from tests.test_redis_outages import node, proxy  # noqa: F401


async def receiver(port: int, queue: str, name: str, credit: int) -> Peer:
    peer = await Peer.opened(port)
    peer.attach(name, 0, RECEIVER, queue)
    await peer.expect(ATTACH)
    if credit:
        peer.send(flow(0, credit))
    return peer


async def transfers(peer: Peer, seconds: float) -> int:
    return sum(1 for f in await peer.frames_for(seconds) if f.code == TRANSFER)


async def test_a_burst_is_dealt_out_to_idle_consumers_in_turns(
    broker: Broker, amqp: Listener
) -> None:
    """Solace serves a non-exclusive queue's consumers round-robin; one fetch took a whole
    burst of up to 256 / consumers messages for the first consumer woken (100 to 0)."""
    await broker.queues.create(QueueConfig(name="burst"))
    a = await receiver(amqp.port, "burst", "a", 100)
    b = await receiver(amqp.port, "burst", "b", 100)
    publisher = await Peer.opened(amqp.port)
    await publisher.sender(0, "burst")
    bodies = [bytes(AmqpMessage(body=b"%d" % i).encode()) for i in range(100)]
    assert len(await publisher.send_all(0, bodies)) == 100
    counts = await asyncio.gather(transfers(a, 0.8), transfers(b, 0.8))
    assert sum(counts) == 100 and min(counts) >= 25, counts
    for peer in (a, b, publisher):
        peer.close()


async def test_what_was_fetched_as_the_credit_went_to_zero_goes_to_other_consumers(
    node: Broker,  # noqa: F811
    proxy: CuttingProxy,  # noqa: F811
) -> None:
    """A link given no credit may be sent nothing (§2.6.7): the messages its fetch brought
    once the client had cut its credit waited in proxy, held from every other consumer,
    until that link went."""
    listener = await start_amqp(node, Settings(amqp_port=0, host="127.0.0.1"))
    try:
        await node.queues.create(QueueConfig(name="stop"))
        for i in range(5):
            await node.publish(Message("stop", b"%d" % i, to_queue=True))
        a = await receiver(listener.port, "stop", "a", 0)
        proxy.delay_on, proxy.delay = b"gw_fetch", 0.5
        a.send(flow(0, 5))
        await asyncio.sleep(0.2)  # its fetch is under way
        a.send(flow(0, 0))
        await asyncio.sleep(0.6)
        b = await receiver(listener.port, "stop", "b", 10)
        assert await transfers(b, 1.5) == 5
        assert await transfers(a, 0.1) == 0
        a.close()
        b.close()
    finally:
        await listener.close()


async def test_a_browser_whose_credit_was_cut_during_a_fetch_still_sees_every_message(
    node: Broker,  # noqa: F811
    proxy: CuttingProxy,  # noqa: F811
) -> None:
    """A browser's cursor passes what its fetch brought: given back as a consumer's is, a
    message fetched as the client cut the credit was never shown to that browser."""
    listener = await start_amqp(node, Settings(amqp_port=0, host="127.0.0.1"))
    try:
        await node.queues.create(QueueConfig(name="shelf"))
        for i in range(5):
            await node.publish(Message("shelf", b"%d" % i, to_queue=True))
        peer = await Peer.opened(listener.port)
        source = Described(ulong(SOURCE), ["shelf", *[None] * 5, symbol("copy")])
        target = Described(ulong(TARGET), [None])
        peer.send(frame(performative(ATTACH, "b", uint(0), RECEIVER, None, None, source, target)))
        await peer.expect(ATTACH)
        proxy.delay_on, proxy.delay = b"gw_browse", 0.5
        peer.send(flow(0, 5))
        await asyncio.sleep(0.2)  # its fetch is under way
        peer.send(flow(0, 0))
        await asyncio.sleep(0.6)
        peer.send(flow(0, 5))
        assert await transfers(peer, 1.5) == 5
        assert (await node.queues.info("shelf")).messages == 5
        peer.close()
    finally:
        await listener.close()
