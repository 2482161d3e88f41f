"""The limit on delivered-but-unacked messages per consumer (Solace's
max-delivered-unacked-msgs-per-flow): a queue setting, under which each consumer's own
window (AMQP link credit, MQTT receive maximum) applies. Real Redis, raw AMQP frames over
real sockets, the real admin API."""

from __future__ import annotations

import asyncio

import pytest

from gateway.broker import Broker, QueueConfig, QueueError
from gateway.model import Message
from protocols.amqp.listener import Listener
from tests.amqp_raw import ATTACH, FLOW, RECEIVER, TRANSFER, Peer, flow
from tests.test_admin_api import Admin
from tests.test_amqp_competing import transfers


async def fill(broker: Broker, queue: str, count: int) -> None:
    await asyncio.gather(
        *[broker.publish(Message(queue, b"%d" % i, to_queue=True)) for i in range(count)]
    )


async def test_an_amqp_link_may_hold_as_many_unsettled_as_its_credit(
    broker: Broker, amqp: Listener
) -> None:
    """Qpid JMS's default prefetch is 1000: a consumer settling every 700 messages got 500,
    then nothing, as each link was held to 500 unsettled deliveries whatever its credit."""
    await broker.queues.create(QueueConfig(name="batch"))
    await fill(broker, "batch", 700)
    peer = await Peer.opened(amqp.port, window=5000)
    peer.attach("r", 0, RECEIVER, "batch")
    await peer.expect(ATTACH)
    peer.send(flow(0, 1000, window=5000))
    assert await transfers(peer, 2.0) == 700
    peer.close()


async def test_the_queue_limits_what_each_consumer_holds_unacked(
    broker: Broker, amqp: Listener
) -> None:
    await broker.queues.create(QueueConfig(name="few", max_delivered_unacked_msgs_per_flow=3))
    await fill(broker, "few", 10)
    first, second = await Peer.opened(amqp.port), await Peer.opened(amqp.port)
    for peer in (first, second):
        peer.attach("r", 0, RECEIVER, "few")
        await peer.expect(ATTACH)
        peer.send(flow(0, 100))
    got = await asyncio.gather(transfers(first, 0.8), transfers(second, 0.8))
    assert got == [3, 3]  # credit 100 each, but 3 unacked at most: 4 wait in the queue
    assert (await broker.queues.info("few")).messages == 10
    first.close()
    second.close()


async def test_the_limit_is_validated_and_changed_at_run_time(broker: Broker, admin: Admin) -> None:
    with pytest.raises(QueueError, match="at least 1"):
        QueueConfig(name="zero", max_delivered_unacked_msgs_per_flow=0).validate()
    created = await admin.create("tunable")
    assert created.body["max_delivered_unacked_msgs_per_flow"] == 10_000
    patched = await admin.request(
        "PATCH", "/api/v1/queues/tunable", {"max_delivered_unacked_msgs_per_flow": 2}
    )
    assert patched.status == 200, patched.raw
    assert patched.body["max_delivered_unacked_msgs_per_flow"] == 2


async def test_a_drain_is_answered_once_the_per_flow_limit_is_full(
    broker: Broker, amqp: Listener
) -> None:
    """§2.6.7: a drain is answered as soon as the sender can send no more. Once the limit
    filled the flow nothing was fetched again, and nothing answered it: 7 credits hung."""
    await broker.queues.create(QueueConfig(name="pull", max_delivered_unacked_msgs_per_flow=3))
    await fill(broker, "pull", 10)
    peer = await Peer.opened(amqp.port)
    peer.attach("r", 0, RECEIVER, "pull")
    await peer.expect(ATTACH)
    peer.send(flow(0, 10, drain=True))
    frames = await peer.frames_for(1.5)
    peer.close()
    assert sum(1 for f in frames if f.code == TRANSFER) == 3
    assert any(f.code == FLOW and f.fields[6] == 0 for f in frames)  # link-credit 0
