"""A consumer that says it cannot take a message (AMQP modified with undeliverable-here,
§3.4.5) does not get it again; the queue's other consumers do. Every way a queue hands
out returned messages honours it: plain, message groups, sorted, selector consumers."""

from __future__ import annotations

import asyncio

import pytest

from gateway.broker import Broker
from gateway.engine import keys
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message
from tests.test_engine import wait_for

CASES = {
    "plain": (QueueConfig(name="q"), None),
    "groups": (QueueConfig(name="q", message_groups="default"), None),
    "sorted": (QueueConfig(name="q", sort_key="k"), None),
    "selector": (QueueConfig(name="q"), "k IS NOT NULL"),
}


def msg(payload: bytes) -> Message:
    return Message(destination="q", to_queue=True, payload=payload, user_properties=[("k", "a")])


@pytest.mark.parametrize("failed", [False, True], ids=["released", "failed"])
@pytest.mark.parametrize("case", list(CASES))
async def test_an_avoided_message_goes_to_another_consumer(
    broker: Broker, case: str, failed: bool
) -> None:
    config, selector = CASES[case]
    await broker.declare_queue(config)
    await broker.publish(msg(b"m1"))
    first: list[Delivery] = []
    a = await broker.bind("q", first.append, window=5, selector=selector)
    await wait_for(lambda: len(first) == 1)
    a.avoid(first[0].entry_id, failed)
    await broker.publish(msg(b"m2"))
    await wait_for(lambda: len(first) == 2)
    await asyncio.sleep(0.3)
    assert [d.message.payload for d in first] == [b"m1", b"m2"], "m1 not to `a` again"
    other: list[Delivery] = []
    b = await broker.bind("q", other.append, window=5, selector=selector)
    await wait_for(lambda: len(other) == 1)
    assert other[0].message.payload == b"m1"
    assert other[0].delivery_count == (2 if failed else 1), "counted only when it failed"
    a.ack(first[1].entry_id)
    b.ack(other[0].entry_id)
    for _ in range(100):
        if (await broker.queues.info("q")).messages == 0:
            break
        await asyncio.sleep(0.02)
    assert (await broker.queues.info("q")).messages == 0
    assert not await broker.redis.exists(keys.queue_avoid("q")), "settled: none to avoid"
