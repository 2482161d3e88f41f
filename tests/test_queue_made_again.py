"""A queue deleted and made again under its name before a node heard of the deletion (its
event comes on a connection of its own): a consumer of the deleted queue, which finds its
flow gone and binds again, must not bind to the new queue, whose access it was never
checked for; it ends as the deleted queue's consumer."""

from __future__ import annotations

import asyncio

import pytest

from gateway.broker import Broker, QueueConfig
from gateway.model import Delivery
from tests.redis_proxy import CuttingProxy
from tests.test_engine import second_node, to_queue  # noqa: F401
from tests.test_redis_outages import node, proxy  # noqa: F401


@pytest.mark.parametrize("non_destructive", [True, False])
async def test_a_consumer_of_a_deleted_queue_never_reads_the_one_made_again(
    proxy: CuttingProxy,  # noqa: F811
    node: Broker,  # noqa: F811
    second_node: Broker,  # noqa: F811
    non_destructive: bool,
) -> None:
    config = QueueConfig(name="again", non_destructive=non_destructive, permission="consume")
    await node.queues.create(config)
    got: list[Delivery] = []
    reasons: list[str] = []
    await node.bind("again", got.append, user="alice", on_closed=reasons.append)
    await asyncio.sleep(0.3)  # its first fetch or browse answered: idle
    proxy.delay_reply_on = b"qdel again"  # the node hears of the deletion 2 s late
    proxy.delay = 2.0
    await second_node.delete_queue("again")
    closed = QueueConfig(
        name="again", non_destructive=non_destructive, owner="bob", permission="none"
    )
    await second_node.queues.create(closed)
    await second_node.publish(to_queue("again", b"bob's first"))
    node.dispatcher.wake_all()  # as the heartbeat does every tenth beat
    await asyncio.sleep(3.0)  # the deletion's event has come by now
    await second_node.publish(to_queue("again", b"bob's second"))
    await asyncio.sleep(0.3)
    node.dispatcher.wake_all()
    await asyncio.sleep(0.5)
    assert reasons == ["queue deleted"]
    assert [d.message.payload for d in got] == []
