"""Ownership and permissions, RabbitMQ exclusive and auto-delete queues."""

from __future__ import annotations

import asyncio

import pytest

from gateway.broker import BindError, Broker
from gateway.engine import keys, library
from gateway.engine.queues import QueueConfig, QueueError
from gateway.model import Delivery, Message
from tests.test_engine import to_queue, wait_for


async def test_permission_levels_for_other_users(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="q", owner="alice", permission="read-only"))
    await broker.bind("q", lambda d: None, browse=True, user="bob")  # read-only: browse
    with pytest.raises(BindError) as err:
        await broker.bind("q", lambda d: None, user="bob")
    assert err.value.code == "unauthorized"
    await broker.bind("q", lambda d: None, user="alice")  # the owner may do anything
    with pytest.raises(QueueError) as qerr:
        await broker.subscribe_queue("q", ["a/>"], user="bob")
    assert qerr.value.code == "unauthorized" and qerr.value.http_status == 403
    with pytest.raises(QueueError):
        await broker.delete_queue("q", user="bob")
    await broker.queues.update("q", {"permission": "modify-topic"})
    await broker.bind("q", lambda d: None, user="bob")
    assert await broker.subscribe_queue("q", ["a/>"], user="bob") == 1
    with pytest.raises(QueueError):
        await broker.delete_queue("q", user="bob")
    await broker.delete_queue("q", user="alice")


async def test_none_permission_refuses_even_browsing(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="q", owner="alice", permission="none"))
    with pytest.raises(BindError) as err:
        await broker.bind("q", lambda d: None, browse=True, user="bob")
    assert err.value.code == "unauthorized"


async def test_rabbitmq_exclusive_queue_belongs_to_its_connection(broker: Broker) -> None:
    config = QueueConfig(name="mine", durable=False, owner_connection="conn-1")
    await broker.declare_queue(config)
    await broker.bind("mine", lambda d: None, connection="conn-1", user="alice")
    with pytest.raises(BindError) as err:
        await broker.bind("mine", lambda d: None, connection="conn-2", user="alice")
    assert err.value.code == "resource_locked"


async def test_auto_delete_queue_goes_with_its_last_consumer(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="tmp", auto_delete=True), [("t/#", "mqtt")])
    a = await broker.bind("tmp", lambda d: None)
    b = await broker.bind("tmp", lambda d: None)
    await a.close()
    assert await broker.queues.exists("tmp")
    await b.close()
    assert not await broker.queues.exists("tmp")
    await wait_for(lambda: broker.router.match("t/x") == frozenset())


async def test_a_get_does_not_delete_an_auto_delete_queue(broker: Broker) -> None:
    """RabbitMQ: an auto-delete queue goes when its last consumer is cancelled, and a
    basic.get (the admin API's get binds a get flow) is no consumer."""
    await broker.declare_queue(QueueConfig(name="tmp", auto_delete=True))
    for i in range(3):
        await broker.publish(Message(destination="tmp", to_queue=True, payload=b"%d" % i))
    got: list[Delivery] = []
    getter = await broker.bind("tmp", got.append, window=1, get=True)
    await wait_for(lambda: len(got) == 1)
    getter.ack(got[0].entry_id)
    await getter.close()
    assert (await broker.queues.info("tmp")).messages == 2
    consumer = await broker.bind("tmp", lambda d: None, window=1)
    getter = await broker.bind("tmp", lambda d: None, window=1, get=True)
    await consumer.close()  # its last consumer, though a get is bound: the queue goes
    assert not await broker.queues.exists("tmp")
    await getter.close()


async def test_a_browser_is_no_consumer_of_an_auto_delete_queue(broker: Broker) -> None:
    """A browser takes nothing: its going deletes nothing, nor does it keep the queue once
    the last consumer went."""
    await broker.declare_queue(QueueConfig(name="tmp", auto_delete=True))
    browser = await broker.bind("tmp", lambda d: None, browse=True)
    await browser.close()
    assert await broker.queues.exists("tmp")
    reasons: list[str] = []
    await broker.bind("tmp", lambda d: None, browse=True, on_closed=reasons.append)
    consumer = await broker.bind("tmp", lambda d: None)
    await consumer.close()
    assert not await broker.queues.exists("tmp")
    await wait_for(lambda: reasons == ["queue deleted"])


async def test_a_non_destructive_auto_delete_queue_goes_with_its_last_consumer_on_any_node(
    broker: Broker, redis_url: str
) -> None:
    """Its consumers browse (Qpid Broker-J non-destructive consumers) and are consumers all
    the same: the last of them to go, on whichever node, deletes it; so does its node's
    death. Exclusive access holds none of them back."""
    client = await library.connect(redis_url)
    other = Broker(client, heartbeat=0.2, node_ttl=1.0)
    await other.start()
    config = QueueConfig(
        name="tmp", access_type="exclusive", non_destructive=True, auto_delete=True
    )
    await broker.declare_queue(config, [("t/#", "mqtt")])
    await broker.publish(to_queue("tmp", b"m"))
    got: list[Delivery] = []
    here = await broker.bind("tmp", got.append)
    there = await other.bind("tmp", got.append)
    await wait_for(lambda: len(got) == 2)  # each browses it
    flows = (await broker.queues.info("tmp")).to_json()["flows"]
    assert flows == [{"id": here.id, "active": True}, {"id": there.id, "active": True}]
    await there.close()
    assert await broker.queues.exists("tmp")
    there = await other.bind("tmp", got.append)
    await here.close()
    assert await broker.queues.exists("tmp")  # its consumer on the other node stays
    other.liveness._task.cancel()  # the other node dies: no clean shutdown
    await other.events.stop()
    for _ in range(100):
        if not await broker.queues.exists("tmp"):
            break
        await asyncio.sleep(0.05)
    assert not await broker.queues.exists("tmp")
    await wait_for(lambda: broker.router.match("t/x") == frozenset())
    await client.aclose()


async def test_a_non_destructive_consumer_released_by_a_reap_binds_again(broker: Broker) -> None:
    """Released while its node lives (presumed dead), the consumer binds again and counts
    again: the other consumer's going leaves the auto-delete queue to it."""
    await broker.declare_queue(QueueConfig(name="tmp", non_destructive=True, auto_delete=True))
    got: list[Delivery] = []
    kept = await broker.bind("tmp", got.append)
    other = await broker.bind("tmp", lambda d: None)
    released = kept.id
    await broker.redis.fcall("gw_unbind", 0, "tmp", released)  # as a reap releases it
    await broker.publish(to_queue("tmp", b"m"))
    await wait_for(lambda: len(got) == 1 and kept.id != released)
    assert await broker.redis.zscore(keys.queue_flows("tmp"), kept.id) is not None
    await other.close()
    assert await broker.queues.exists("tmp")
    await kept.close()
    assert not await broker.queues.exists("tmp")


async def test_a_repartition_does_not_delete_an_auto_delete_queue(broker: Broker) -> None:
    """A repartition unbinds every flow for it to bind again: it cancels no consumer. The
    queue stays whole, with its settings (it was deleted midway, then half written)."""
    await broker.declare_queue(QueueConfig(name="tmp", auto_delete=True))
    consumer = await broker.bind("tmp", lambda d: None, window=1)
    await broker.queues.update("tmp", {"egress_enabled": False})
    await broker.queues.repartition("tmp", 2)
    info = await broker.queues.info("tmp")
    assert info.config.auto_delete and info.config.partition_count == 2
    assert not info.config.egress_enabled and "tmp" in await broker.queues.names()
    await consumer.close()


async def test_invalid_permission_is_refused(broker: Broker) -> None:
    with pytest.raises(QueueError):
        await broker.declare_queue(QueueConfig(name="q", permission="everything"))
