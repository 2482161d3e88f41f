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


async def test_the_progress_of_an_attempt_never_replayed_goes_while_the_sink_keeps_writing(
    broker: Broker, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch write's failed attempt is never replayed under its marker (a replay is a new
    attempt): what it noted it spooled goes MARK_TTL_S after, not with the sink's last write."""
    monkeypatch.setattr(sink, "MARK_TTL_S", 2)
    await broker.declare_queue(QueueConfig(name="pout"))
    opts = sink.SinkOptions(redis_url, "pout", True, "queue:pout", None)

    def msg(destination: str, tag: str) -> list[Message]:
        return [Message(destination=destination, to_queue=True, payload=tag.encode(), id=tag)]

    with pytest.raises(sink.SinkRefused):  # no such queue: refused, its progress noted
        await sink.publish(opts, "b1", "b1/att1:0", msg("nosuchq", "x"))
    progress = keys.sink_progress("queue:pout")
    assert await broker.redis.hexists(progress, "b1/att1:0")
    for batch in ("b2", "b3"):  # the sink keeps writing
        await asyncio.sleep(1.2)
        with pytest.raises(sink.SinkRefused):
            await sink.publish(opts, batch, f"{batch}/att:0", msg("nosuchq", batch))
    assert await broker.redis.hkeys(progress) == [b"b2/att:0", b"b3/att:0"]
