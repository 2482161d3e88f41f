"""The Spark sink's replay markers last MARK_TTL_S each from when they were written: those
of a sink that keeps writing do not pile up in Redis. No Spark needed: `sink.publish` is
what a task runs."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pyspark")

from gateway.broker import Broker
from gateway.engine import keys
from gateway.engine.queues import QueueConfig
from gateway.model import Message
from gateway.spark import sink


async def test_old_markers_expire_while_the_sink_keeps_writing(
    broker: Broker, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sink, "MARK_TTL_S", 2)
    await broker.declare_queue(QueueConfig(name="out"))
    opts = sink.SinkOptions(redis_url, "out", True, "queue:out", None)

    def msgs(tag: str) -> list[Message]:
        return [Message(destination="out", to_queue=True, payload=tag.encode(), id=tag)]

    await sink.publish(opts, "q/1", "q/1:0", msgs("a"))
    await asyncio.sleep(1.5)
    await sink.publish(opts, "q/2", "q/2:0", msgs("b"))  # a later micro-batch, in time
    assert (await sink.publish(opts, "q/1", "q/1:0", msgs("a"))).skipped  # still known
    await asyncio.sleep(1.5)  # batch 1's marker is now 3 s old, past the 2 s TTL
    await sink.publish(opts, "q/3", "q/3:0", msgs("c"))
    marks = await broker.redis.zrange(keys.sink_marks("queue:out"), 0, -1)
    assert marks == [b"q/2:0", b"q/3:0"]
