"""A queue deleted and made again under its name before a node heard of the deletion (its
event comes on a connection of its own): a consumer of the deleted queue, which finds its
flow gone and binds again, must not bind to the new queue, whose access it was never
checked for; it ends as the deleted queue's consumer."""

from __future__ import annotations

import asyncio

import pytest

from gateway.broker import Broker, QueueConfig
from gateway.model import Delivery, Message
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


async def test_a_queue_made_again_takes_nothing_its_former_subscriptions_attracted(
    broker: Broker,
    second_node: Broker,  # noqa: F811
) -> None:
    """What the AMQP adapter does when a durable subscription is attached with another
    topic (delete, create, subscribe), while another node publishes to the former topic:
    messages routed by the former queue's subscriptions (waiting in a node's spool batch,
    or routed before that node reloaded its routes) were stored in the new queue."""
    publishing = True

    async def publish_to_the_former_topic() -> None:
        n = 0
        while publishing:
            for _ in range(20):  # a backlog in the spooler
                n += 1
                second_node.publish_nowait(Message(destination="old/t", payload=b"%d" % n))
            await asyncio.sleep(0)

    task = asyncio.create_task(publish_to_the_former_topic())
    foreign = 0
    try:
        for _ in range(20):
            await broker.declare_queue(QueueConfig(name="ds"), [("old/t", "smf")])
            await asyncio.sleep(0.01)
            await broker.delete_queue("ds")
            await broker.queues.create(QueueConfig(name="ds"))  # in the same millisecond too
            await broker.subscribe_queue("ds", ["new/t"])
            await asyncio.sleep(0.02)  # what was on its way is stored by now
            foreign += (await broker.queues.info("ds")).messages
            await broker.delete_queue("ds")
    finally:
        publishing = False
        await task
    assert foreign == 0
