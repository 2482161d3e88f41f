"""Hold until valid: a message with a delivery time stays invisible until then."""

from __future__ import annotations

import asyncio
import time

from gateway.broker import Broker
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message
from tests.test_engine import wait_for


def now_ms() -> int:
    return int(time.time() * 1000)


async def test_held_messages_are_invisible_until_due(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="q"))
    await broker.publish(
        Message(destination="q", to_queue=True, payload=b"later", not_before=now_ms() + 700)
    )
    await broker.publish(Message(destination="q", to_queue=True, payload=b"now"))
    got: list[Delivery] = []
    await broker.bind("q", got.append)
    await wait_for(lambda: len(got) == 1)
    await asyncio.sleep(0.3)
    assert [d.message.payload for d in got] == [b"now"]
    await wait_for(lambda: len(got) == 2, timeout=5)
    assert got[1].message.payload == b"later"
    assert got[1].delivery_count == 1 and not got[1].redelivered, "holding is no delivery"
    assert (await broker.queues.info("q")).messages == 2


async def test_held_messages_on_a_priority_queue(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="pq", priorities=True))
    await broker.publish(
        Message(
            destination="pq", to_queue=True, payload=b"held", priority=9, not_before=now_ms() + 500
        )
    )
    await broker.publish(Message(destination="pq", to_queue=True, payload=b"low", priority=1))
    got: list[Delivery] = []
    await broker.bind("pq", got.append)
    await wait_for(lambda: len(got) == 2, timeout=5)
    assert [d.message.payload for d in got] == [b"low", b"held"]
