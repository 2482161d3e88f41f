"""Ownership and permissions, RabbitMQ exclusive and auto-delete queues."""

from __future__ import annotations

import pytest

from gateway.broker import BindError, Broker
from gateway.engine.queues import QueueConfig, QueueError
from tests.test_engine import wait_for


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


async def test_invalid_permission_is_refused(broker: Broker) -> None:
    with pytest.raises(QueueError):
        await broker.declare_queue(QueueConfig(name="q", permission="everything"))
