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


async def test_a_task_dying_amid_a_chunk_stores_none_of_it_again_on_replay(
    broker: Broker, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streaming task's progress is noted after each chunk of its publishes: one that died
    in between (its executor lost) stored that chunk again on replay, 1,000 messages twice
    (found by a review). The spool records each row as it stores it."""
    await broker.declare_queue(QueueConfig(name="kept"))
    opts = sink.SinkOptions(redis_url, "kept", True, "queue:kept", None)

    def rows() -> list[Message]:
        return [
            Message(destination="kept", to_queue=True, payload=b"%d" % i, id=f"row{i}")
            for i in range(2500)
        ]

    noted, note = [], sink._note_progress

    async def dies_before_the_second_chunks_note(*args: object) -> None:
        noted.append(args)
        if len(noted) == 2:  # after the second chunk
            raise RuntimeError("the executor is gone")
        await note(*args)

    monkeypatch.setattr(sink, "_note_progress", dies_before_the_second_chunks_note)
    with pytest.raises(RuntimeError):
        await sink.publish(opts, "e7", "e7:0", rows())
    assert (await broker.queues.info("kept")).messages == 2000
    monkeypatch.setattr(sink, "_note_progress", note)
    await sink.publish(opts, "e7", "e7:0", rows())  # the micro-batch replayed
    assert (await broker.queues.info("kept")).messages == 2500
    assert await broker.redis.keys(keys.sink_stored("queue:kept", "*")) == []


async def test_the_rows_recorded_by_an_attempt_never_replayed_go_with_its_progress(
    broker: Broker, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch write's attempt that died amid a chunk is never replayed under its marker:
    the rows the spool recorded stored for it stayed in Redis for good once the sink was
    idle (found by a review). They go MARK_TTL_S after its last note, as its progress."""
    monkeypatch.setattr(sink, "MARK_TTL_S", 1)
    await broker.declare_queue(QueueConfig(name="kept"))
    opts = sink.SinkOptions(redis_url, "kept", True, "queue:kept", None)
    rows = [Message("kept", b"%d" % i, to_queue=True, id=f"row{i}") for i in range(1500)]
    note = sink._note_progress

    async def dies_before_the_second_chunks_note(*args: object) -> None:
        if args[-1] and max(args[-1]) >= sink.CHUNK:  # the spooled rows of the 2nd chunk
            raise RuntimeError("the executor is gone")
        await note(*args)

    monkeypatch.setattr(sink, "_note_progress", dies_before_the_second_chunks_note)
    with pytest.raises(RuntimeError):
        await sink.publish(opts, "b1", "b1/att1:0", rows)
    stored = keys.sink_stored("queue:kept", "b1/att1:0")
    assert await broker.redis.exists(stored)
    await asyncio.sleep(1.5)  # the sink is idle: a rerun is a new attempt, a new marker
    left = await broker.redis.keys(f"{keys.PREFIX}:sink:*")
    assert left == [], left
