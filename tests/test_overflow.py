"""Overflow policies: reject (default), ring (drop oldest), producer flow control."""

from __future__ import annotations

import asyncio

from gateway.broker import Broker
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message, Outcome
from tests.test_engine import wait_for


def msg(payload: str) -> Message:
    return Message(destination="q", to_queue=True, payload=payload.encode())


async def test_reject_is_the_default(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="q", max_messages=2))
    outcomes = [await broker.publish(msg(f"{i}")) for i in range(3)]
    assert outcomes == [Outcome.OK, Outcome.OK, Outcome.QUEUE_FULL]


async def test_ring_drops_the_oldest_undelivered(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="q", max_messages=3, overflow="ring"))
    for i in range(3):
        await broker.publish(msg(f"{i}"))
    got: list[Delivery] = []
    await broker.bind("q", got.append, window=1)  # holds "0": delivered, never dropped
    await wait_for(lambda: len(got) == 1)
    for i in range(3, 6):
        assert await broker.publish(msg(f"{i}")) is Outcome.OK
    info = await broker.queues.info("q")
    assert info.messages == 3 and info.counters["dropped"] == 3
    seen: list[Delivery] = []
    await broker.bind("q", seen.append, browse=True)
    await wait_for(lambda: len(seen) == 3)
    assert [d.message.payload for d in seen] == [b"0", b"4", b"5"]


async def test_flow_control_withholds_acks_until_the_queue_drains(broker: Broker) -> None:
    await broker.declare_queue(
        QueueConfig(name="q", max_messages=5, overflow="flow_control", resume_percent=40)
    )
    futures = [broker.publish_nowait(msg(f"{i}")) for i in range(8)]
    await asyncio.sleep(0.3)
    assert [f.done() for f in futures] == [True] * 5 + [False] * 3, "3 publishers wait"
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=10)
    await wait_for(lambda: len(got) == 5)
    for d in got[:3]:
        flow.ack(d.entry_id)  # depth 2: not below 40% of 5, still blocked
    await asyncio.sleep(0.3)
    assert not any(f.done() for f in futures[5:])
    flow.ack(got[3].entry_id)  # depth 1: publishing resumes
    await wait_for(lambda: all(f.done() for f in futures), timeout=5)
    assert {f.result() for f in futures} == {Outcome.OK}
    await wait_for(lambda: len(got) == 8)
    assert [d.message.payload for d in got] == [b"%d" % i for i in range(8)], "in order"
