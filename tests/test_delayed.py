"""Hold until valid: a message with a delivery time stays invisible until then."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.broker import Broker
from gateway.engine import flows
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message, Outcome
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


async def test_a_browser_sees_a_held_message_once_due(broker: Broker) -> None:
    """Browsers and non-destructive consumers do not see a message before its delivery
    time either, and what came after it is not held up."""
    await broker.declare_queue(QueueConfig(name="q"))
    await broker.declare_queue(QueueConfig(name="nd", non_destructive=True))
    for queue in ("q", "nd"):
        await broker.publish(
            Message(destination=queue, to_queue=True, payload=b"later", not_before=now_ms() + 700)
        )
        await broker.publish(Message(destination=queue, to_queue=True, payload=b"now"))
    browsed: list[Delivery] = []
    await broker.bind("q", browsed.append, browse=True)
    consumed: list[Delivery] = []
    await broker.bind("nd", consumed.append)
    await wait_for(lambda: len(browsed) == 1 and len(consumed) == 1)
    await asyncio.sleep(0.3)
    for got in (browsed, consumed):
        assert [d.message.payload for d in got] == [b"now"]
    await wait_for(lambda: len(browsed) == 2 and len(consumed) == 2, timeout=5)
    for got in (browsed, consumed):
        assert [d.message.payload for d in got] == [b"now", b"later"]
    assert (await broker.queues.info("q")).messages == 2, "browsing took nothing"


async def test_a_browser_at_its_held_limit_waits_for_the_first_due(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flows, "MAX_HELD_BROWSED", 2)
    await broker.declare_queue(QueueConfig(name="q"))
    due = now_ms() + 600
    for i in range(3):
        await broker.publish(
            Message(destination="q", to_queue=True, payload=b"held%d" % i, not_before=due)
        )
    await broker.publish(Message(destination="q", to_queue=True, payload=b"plain"))
    seen: list[Delivery] = []
    await broker.bind("q", seen.append, browse=True)
    await asyncio.sleep(0.3)
    assert seen == [], "the cursor stopped at the third held one"
    await wait_for(lambda: len(seen) == 4, timeout=5)
    assert sorted(d.message.payload for d in seen) == [b"held0", b"held1", b"held2", b"plain"]
    assert now_ms() >= due


@pytest.mark.parametrize("bound", [False, True], ids=["no-consumer", "consumer-bound"])
async def test_an_expired_held_message_frees_its_room(broker: Broker, bound: bool) -> None:
    """A held message that expires before its delivery time is swept from the queue, so it
    no longer counts toward the limits, whether or not a consumer's fetch parked it."""
    await broker.declare_queue(QueueConfig(name="h", max_messages=1))
    got: list[Delivery] = []
    if bound:
        await broker.bind("h", got.append)
    held = Message(destination="h", to_queue=True, payload=b"x")
    held.not_before, held.expiration = now_ms() + 30_000, now_ms() + 200
    assert await broker.publish(held) is Outcome.OK
    for _ in range(50):  # the heartbeat sweeps every 0.2 s
        await asyncio.sleep(0.1)
        if (await broker.queues.info("h")).messages == 0:
            break
    assert (await broker.queues.info("h")).messages == 0
    fresh = Message(destination="h", to_queue=True, payload=b"y")
    assert await broker.publish(fresh) is Outcome.OK
    assert got == []
