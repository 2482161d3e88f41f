"""The PySpark data source, sink and jobs against a real redis-server and a local Spark.

One local[2] session serves the module; Spark actions run in a thread so the test's
Broker keeps its heartbeat while a job blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis

pyspark = pytest.importorskip("pyspark")

from proton import Message as AmqpMessage  # noqa: E402
from proton import Timeout  # noqa: E402
from proton.utils import BlockingConnection  # noqa: E402
from pyspark.sql import Row, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.conversion import ArrowTableToRowsConversion  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    DataType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from gateway.broker import Broker  # noqa: E402
from gateway.config import Settings  # noqa: E402
from gateway.engine import keys  # noqa: E402
from gateway.engine.partitions import partition_of  # noqa: E402
from gateway.engine.queues import QueueConfig, stream_queues  # noqa: E402
from gateway.model import Delivery, Message, Outcome, decode, encode  # noqa: E402
from gateway.spark import DEFAULT_REDIS_URL, jobs, sink  # noqa: E402
from gateway.spark.cli import pipeline_redis_url  # noqa: E402
from gateway.spark.session import activate, build_session  # noqa: E402
from gateway.spark.sink import RowMapper, SinkCommit, SinkOptions  # noqa: E402
from gateway.spark.source import DataLossError, Options, StreamReader  # noqa: E402
from protocols.amqp.listener import start as start_amqp  # noqa: E402
from tests.test_engine import wait_for  # noqa: E402

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = build_session("gateway-tests", "local[2]", shuffle_partitions=2, ui=False)
    yield session
    session.stop()


def in_thread(spark: SparkSession, action: Callable[[], object]) -> Callable[[], object]:
    """`action` for asyncio.to_thread: Spark needs the session active in that thread."""

    def run() -> object:
        activate(spark)
        return action()

    return run


async def make_partitioned_queue(broker: Broker, name: str, count: int) -> list[str]:
    """A partitioned queue; returns its child queues in partition order."""
    await broker.declare_queue(QueueConfig(name=name, partition_count=count))
    return [child for _, child in stream_queues(name, count)]


async def publish_to(broker: Broker, queue: str, payloads: list[bytes], **fields) -> None:
    for payload in payloads:
        msg = Message(destination=queue, payload=payload, to_queue=True, **fields)
        assert await broker.publish(msg) is Outcome.OK


def read(spark: SparkSession, redis_url: str, queue: str, **options: str):
    return (
        (spark.read.format("gateway").option("redis_url", redis_url).option("queue", queue))
        .options(**options)
        .load()
    )


async def test_batch_read_of_partitioned_queue_returns_every_message_once(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    await make_partitioned_queue(broker, "p", 4)
    sent: dict[bytes, int] = {}
    for n in range(200):
        key = f"k{n % 16}"
        payload = f"m{n}".encode()
        sent[payload] = partition_of(key, 4)
        msg = Message(
            destination="p",
            payload=payload,
            to_queue=True,
            partition_key=key,
            content_type="text/plain",
            user_properties=[("n", n), ("even", n % 2 == 0)],
        )
        assert await broker.publish(msg) is Outcome.OK
    assert set(sent.values()) == {0, 1, 2, 3}
    df = read(spark, redis_url, "p")
    assert df.rdd.getNumPartitions() == 4
    rows = await asyncio.to_thread(df.collect)
    assert len(rows) == 200
    assert {r.payload: r.partition for r in rows} == sent
    assert len({(r.partition, r.entry_id) for r in rows}) == 200
    row = next(r for r in rows if r.payload == b"m9")
    assert (row.queue, row.topic, row.partition_key) == ("p", "p", "k9")
    assert row.properties["n"] == "9" and row.properties["even"] == "false"
    assert (row.content_type, row.priority, row.persistent) == ("text/plain", 4, True)
    assert set(row.properties) == {"n", "even"}  # the headers have their columns
    assert row.ingest_ts.year >= 2024


async def test_a_job_that_gave_the_sources_schema_before_its_header_columns_still_reads(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    await broker.declare_queue(QueueConfig(name="pinned"))
    await publish_to(broker, "pinned", [b"a", b"b"])
    before = (
        "queue string, partition int, entry_id string, ingest_ts timestamp, topic string, "
        "partition_key string, properties map<string,string>, payload binary"
    )

    def collect(schema: str) -> list:
        activate(spark)
        reader = spark.read.format("gateway").schema(schema).option("redis_url", redis_url)
        return reader.option("queue", "pinned").load().collect()

    rows = await asyncio.to_thread(collect, before)
    assert [(r.queue, r.payload) for r in rows] == [("pinned", b"a"), ("pinned", b"b")]
    rows = await asyncio.to_thread(collect, "payload binary, priority int")
    assert [tuple(r) for r in rows] == [(b"a", 4), (b"b", 4)]
    with pytest.raises(Exception, match="has no column colour"):
        await asyncio.to_thread(collect, "payload binary, colour string")


async def test_a_queue_copied_through_source_and_sink_keeps_its_messages_headers(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    """The README has a source's DataFrame written to the sink as it is. Headers travelled
    as strings in `properties`, which the sink republished as user properties: the copy
    lost its priority, TTL, correlation-id and reply-to, and gained properties named
    after them. Property values stay strings: the source's map has one value type."""
    for name in ("orig", "copy"):
        await broker.declare_queue(QueueConfig(name=name))
    amqp = await start_amqp(broker, Settings(amqp_port=0, host="127.0.0.1"))
    url = f"amqp://127.0.0.1:{amqp.port}"
    sent = AmqpMessage(
        body=b"\x00\x01binary",
        priority=7,
        durable=True,
        ttl=3600,
        content_type="application/octet-stream",
        correlation_id="corr-1",
        subject="orders.new",
        reply_to="replies",
        group_id="g1",
        properties={"n": 5, "flag": True},
    )

    def send() -> None:
        conn = BlockingConnection(url, timeout=10)
        try:
            conn.create_sender("orig").send(sent)
        finally:
            conn.close()

    def copy() -> None:
        activate(spark)
        writer = read(spark, redis_url, "orig").write.format("gateway").mode("append")
        writer.option("redis_url", redis_url).option("queue", "copy").save()

    def receive(queue: str) -> AmqpMessage:
        conn = BlockingConnection(url, timeout=10)
        try:
            receiver = conn.create_receiver(queue, credit=1)
            msg = receiver.receive(timeout=10)
            receiver.accept()
            return msg
        finally:
            conn.close()

    def view(m: AmqpMessage) -> tuple:
        expires = m.expiry_time or (time.time() + m.ttl if m.ttl else 0)
        return (
            bytes(m.body), m.priority, m.durable, m.content_type, m.correlation_id,
            m.subject, m.reply_to, m.group_id, 3500 < expires - time.time() <= 3600,
        )  # fmt: skip

    try:
        await asyncio.to_thread(send)
        await asyncio.to_thread(copy)
        original = await asyncio.to_thread(receive, "orig")
        copied = await asyncio.to_thread(receive, "copy")
    finally:
        await amqp.close()
    assert view(copied) == view(original)
    assert view(original)[-1], "the original's expiry is an hour away"
    assert dict(copied.properties) == {"n": "5", "flag": "true"}


async def test_sink_publishes_through_the_spool_and_replays_idempotently(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    await broker.declare_queue(QueueConfig(name="out"), [("events/>", "smf")])
    amqp = await start_amqp(broker, Settings(amqp_port=0, host="127.0.0.1"))
    df = spark.createDataFrame(
        [(f"v{i}", f"k{i % 3}", {"i": str(i)}) for i in range(50)],
        "payload string, partition_key string, properties map<string,string>",
    )

    def save(frame, **options: str) -> Callable[[], object]:
        writer = frame.write.format("gateway").mode("append").option("redis_url", redis_url)
        return in_thread(spark, writer.options(**options).save)

    def receive(count: int, timeout: float) -> list[AmqpMessage]:
        """A stock Qpid Proton receiver on the gateway's AMQP port."""
        conn = BlockingConnection(f"amqp://127.0.0.1:{amqp.port}", timeout=10)
        got: list[AmqpMessage] = []
        try:
            receiver = conn.create_receiver("out", credit=count)
            while len(got) < count:
                try:
                    got.append(receiver.receive(timeout=timeout))
                except Timeout:
                    break
                receiver.accept()
        finally:
            conn.close()
        return got

    try:
        await asyncio.to_thread(save(df.repartition(3), topic="events/new", batchId="b1"))
        got = await asyncio.to_thread(receive, 50, 10)
        assert sorted(bytes(m.body) for m in got) == sorted(f"v{i}".encode() for i in range(50))
        m7 = next(m for m in got if bytes(m.body) == b"v7")
        assert (m7.address, m7.group_id, dict(m7.properties)) == (
            "topic://events/new",
            "k1",
            {"i": "7"},
        )
        # three partition markers, then the batch marker from the driver's commit
        assert await broker.redis.zcard(keys.sink_marks("topic:events/new")) == 4

        # the same batch again, partitioned otherwise: nothing is published twice
        await asyncio.to_thread(save(df.repartition(5), topic="events/new", batchId="b1"))
        assert await asyncio.to_thread(receive, 1, 1.0) == []
    finally:
        await amqp.close()

    with pytest.raises(Exception, match=r"refused .*NOT_FOUND"):
        await asyncio.to_thread(save(df, queue="missing"))


async def test_streaming_aggregate_restarted_from_checkpoint_reads_only_new_entries(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    await broker.declare_queue(QueueConfig(name="metrics"))
    await broker.declare_queue(QueueConfig(name="aggs"), [("stats/>", "smf")])
    checkpoint = str(tmp_path / "checkpoint")

    async def run_once() -> int:
        query = jobs.aggregate(
            spark,
            redis_url,
            "metrics",
            "stats/metrics",
            checkpoint,
            window="1 second",
            watermark="0 seconds",
            once=True,
        )
        await asyncio.to_thread(query.awaitTermination, 60)
        assert query.exception() is None
        return sum(p["numInputRows"] for p in query.recentProgress)

    for key, value in [("a", 1), ("a", 2), ("a", 3), ("b", 10)]:
        await publish_to(broker, "metrics", [str(value).encode()], partition_key=key)
    assert await run_once() == 4
    await asyncio.sleep(1.2)  # the next entries fall in a later window: the watermark moves
    await publish_to(broker, "metrics", [b"100"], partition_key="a")
    assert await run_once() == 1

    entries = await broker.redis.xrange(keys.queue_stream("metrics"))
    committed = await broker.redis.hget(keys.queue_readers("metrics"), "aggregate:stats/metrics")
    assert committed == entries[-1][0]
    assert await broker.redis.sismember(keys.read_queues, "metrics")

    raw = await broker.redis.xrange(keys.queue_stream("aggs"))
    results = [json.loads(decode(fields[b"m"]).payload) for _, fields in raw]
    per_key: dict[str, tuple[int, float]] = {}
    for r in results:
        count, total = per_key.get(r["key"], (0, 0.0))
        per_key[r["key"]] = (count + r["count"], total + r["count"] * r["avg"])
    assert per_key == {"a": (3, 6.0), "b": (1, 10.0)}


async def stream_available_now(
    spark: SparkSession,
    redis_url: str,
    queue: str,
    checkpoint: Path,
    on_batch: Callable[[int], None] | None = None,
    **options: str,
) -> list[list[bytes]]:
    """Payloads of each micro-batch of one Trigger.AvailableNow run of a streaming read;
    `on_batch(batch id)` runs before a batch is collected. Raises the query's failure."""
    batches: list[list[bytes]] = []

    def each(frame, batch_id: int) -> None:
        if on_batch is not None:
            on_batch(batch_id)
        batches.append([r.payload for r in frame.collect()])

    def run() -> None:
        activate(spark)
        query = (
            jobs.stream_queue(spark, redis_url, queue, **options)
            .writeStream.foreachBatch(each)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(60)
        if query.exception() is not None:
            raise query.exception()

    await asyncio.to_thread(run)
    return batches


async def test_stream_caps_batches_and_commits_reader_offsets(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    children = await make_partitioned_queue(broker, "s", 2)
    for n in range(10):
        await publish_to(broker, "s", [f"m{n}".encode()], partition_key=f"k{n}")
    batches = await stream_available_now(
        spark, redis_url, "s", tmp_path, maxEntriesPerBatch="4", readerName="cap"
    )
    sizes = [len(b) for b in batches if b]
    assert max(sizes) <= 4 and len(sizes) >= 3
    assert sorted(p for b in batches for p in b) == sorted(f"m{n}".encode() for n in range(10))
    # Spark hands a batch's end to commit() when it plans the next one: the last lags
    for child in children:
        ids = [entry_id for entry_id, _ in await broker.redis.xrange(keys.queue_stream(child))]
        assert await broker.redis.hget(keys.queue_readers(child), "cap") in [b"0-0", *ids]
        assert await broker.redis.sismember(keys.read_queues, child)


async def test_a_max_entries_per_batch_that_is_not_a_number_names_the_option(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    """ "1k" failed with int()'s "invalid literal for int()", naming no option."""
    await broker.declare_queue(QueueConfig(name="capped"))
    for value in ("1k", "0"):
        with pytest.raises(
            Exception, match=f"option maxEntriesPerBatch must be a positive.*{value}"
        ):
            await stream_available_now(
                spark, redis_url, "capped", tmp_path / value, maxEntriesPerBatch=value
            )


async def test_registered_reader_sees_entries_consumers_acked(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    await broker.declare_queue(QueueConfig(name="acked"))
    first = await stream_available_now(spark, redis_url, "acked", tmp_path, readerName="r")
    assert not any(first)  # registers the reader: retention starts here
    assert await broker.redis.hget(keys.queue_readers("acked"), "r") == b"0-0"

    await publish_to(broker, "acked", [f"a{n}".encode() for n in range(5)])
    acked = asyncio.Event()
    count = 0

    def on_deliver(delivery: Delivery) -> None:
        nonlocal count
        flow.ack(delivery.entry_id)
        count += 1
        if count == 5:
            acked.set()

    flow = await broker.bind("acked", on_deliver)
    await asyncio.wait_for(acked.wait(), 10)
    for _ in range(100):  # acks are batched: wait until the engine has settled all five
        if await broker.redis.hget(keys.queue_stats("acked"), "acked") == b"5":
            break
        await asyncio.sleep(0.05)
    assert await broker.redis.hget(keys.queue_stats("acked"), "acked") == b"5"
    await flow.close()

    batches = await stream_available_now(spark, redis_url, "acked", tmp_path, readerName="r")
    assert [p for b in batches for p in b] == [f"a{n}".encode() for n in range(5)]


async def test_a_registered_reader_keeps_the_entries_of_partitions_added_after_it_began(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    """A queue scaled from 2 to 4 partitions between two runs of a named reader: what
    consumers acked in the new partitions before its next run reached nobody (no reader
    was placed there, and a range from 0-0 with no snapshot reported no loss)."""
    await make_partitioned_queue(broker, "grow", 2)
    for n in range(4):
        await publish_to(broker, "grow", [f"a{n}".encode()], partition_key=f"k{n}")
    first = await stream_available_now(spark, redis_url, "grow", tmp_path, readerName="arch")
    assert sorted(p for b in first for p in b) == sorted(f"a{n}".encode() for n in range(4))

    await broker.update_queue("grow", {"egress_enabled": False})
    await broker.update_queue("grow", {"partition_count": 4})
    await broker.update_queue("grow", {"egress_enabled": True})
    for _, child in stream_queues("grow", 4)[2:]:
        assert await broker.redis.hget(keys.queue_readers(child), "arch") == b"0-0"
    sent = [f"b{n}".encode() for n in range(16)]
    for n, payload in enumerate(sent):
        await publish_to(broker, "grow", [payload], partition_key=f"k{n}")
    got: list[Delivery] = []

    def on_deliver(delivery: Delivery) -> None:
        got.append(delivery)
        flow.ack(delivery.entry_id)

    flow = await broker.bind("grow", on_deliver)
    await wait_for(lambda: len(got) == 4 + 16, 15)  # a0..a3 waited too
    await flow.close()  # its acks go first
    children = [child for _, child in stream_queues("grow", 4)]
    acked = [await broker.redis.hget(keys.queue_stats(c), "acked") for c in children]
    assert sum(int(n or 0) for n in acked) == 16 + 4

    second = await stream_available_now(spark, redis_url, "grow", tmp_path, readerName="arch")
    assert sorted(p for b in second for p in b) == sorted(sent)


async def test_a_named_reader_of_a_last_value_queue_is_refused_with_why(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    """A last value queue replaces a waiting value whether a reader read it or not: a
    named streaming reader failed with DataLossError on every normal replacement."""
    await broker.declare_queue(QueueConfig(name="last", max_spool_bytes=0))
    await publish_to(broker, "last", [b"v1"])
    with pytest.raises(Exception, match=r"'last' is a last value queue.*readerName"):
        await stream_available_now(spark, redis_url, "last", tmp_path, readerName="arch")
    assert not await broker.redis.exists(keys.queue_readers("last"))


async def test_a_registered_reader_reads_and_commits_while_redis_is_full(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    await broker.declare_queue(QueueConfig(name="full"))
    await publish_to(broker, "full", [b"f0", b"f1", b"f2"])
    await broker.redis.config_set("maxmemory", 1)  # over it from now on: nothing new is stored
    try:
        batches = await stream_available_now(spark, redis_url, "full", tmp_path, readerName="r")
        place = await broker.redis.hget(keys.queue_readers("full"), "r")
    finally:
        await broker.redis.config_set("maxmemory", 0)
    assert [p for b in batches for p in b] == [b"f0", b"f1", b"f2"]
    assert place is not None and await broker.redis.sismember(keys.read_queues, "full")


async def test_fail_on_data_loss_detects_trimmed_and_deleted_ranges(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    await broker.declare_queue(QueueConfig(name="t"))
    await publish_to(broker, "t", [f"x{i}".encode() for i in range(10)])
    ids = [e[0].decode() for e in await broker.redis.xrange(keys.queue_stream("t"))]
    await broker.redis.xtrim(keys.queue_stream("t"), maxlen=5, approximate=False)

    behind = json.dumps({"t": ids[2]})
    with pytest.raises(Exception, match=r"data loss in queue 't'.*trimmed past"):
        await asyncio.to_thread(
            lambda: read(spark, redis_url, "t", startingOffsets=behind).collect()
        )
    lenient = read(spark, redis_url, "t", startingOffsets=behind, failOnDataLoss="false")
    assert len(await asyncio.to_thread(lenient.collect)) == 5
    ahead = read(spark, redis_url, "t", startingOffsets=json.dumps({"t": ids[6]}))
    assert [r.payload for r in await asyncio.to_thread(ahead.collect)] == [b"x7", b"x8", b"x9"]

    await broker.redis.xdel(keys.queue_stream("t"), ids[8])  # a hole after the start
    again = read(spark, redis_url, "t", startingOffsets=json.dumps({"t": ids[6]}))
    with pytest.raises(Exception, match=r"entries after .* were deleted"):
        await asyncio.to_thread(again.collect)


async def test_a_fail_on_data_loss_value_that_is_not_a_boolean_is_refused(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    """ "on" or "ture" was taken as false: the loss check went off without a word."""
    await broker.declare_queue(QueueConfig(name="onoff"))
    await publish_to(broker, "onoff", [b"x"])
    for value in ("on", "ture"):
        with pytest.raises(
            Exception, match=f"option failOnDataLoss must be true or false.*{value}"
        ):
            await asyncio.to_thread(
                lambda v=value: read(spark, redis_url, "onoff", failOnDataLoss=v).collect()
            )
    lenient = read(spark, redis_url, "onoff", failOnDataLoss=" No ")
    assert len(await asyncio.to_thread(lenient.collect)) == 1


async def holes_before_start(broker: Broker, queue: str) -> list[bytes]:
    """Ten messages x0..x9 in `queue`, x7 deleted (acked out of order) before any read."""
    await broker.declare_queue(QueueConfig(name=queue))
    await publish_to(broker, queue, [f"x{i}".encode() for i in range(10)])
    ids = [e[0] for e in await broker.redis.xrange(keys.queue_stream(queue))]
    await broker.redis.xdel(keys.queue_stream(queue), ids[7])
    return ids


def xdel_at(redis_url: str, queue: str, entry_id: bytes, batch: int) -> Callable[[int], None]:
    """An on_batch hook deleting `entry_id` while micro-batch `batch` runs."""

    def hook(batch_id: int) -> None:
        if batch_id == batch:
            client = redis.Redis.from_url(redis_url)
            client.xdel(keys.queue_stream(queue), entry_id)
            client.close()

    return hook


async def test_registered_reader_from_earliest_is_not_failed_by_holes_made_before_it(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    ids = await holes_before_start(broker, "h")
    options = {"maxEntriesPerBatch": "3", "readerName": "r"}

    def fail_second(batch_id: int) -> None:
        if batch_id == 1:
            raise RuntimeError("injected failure")

    with pytest.raises(Exception, match="injected failure"):  # x8 is not the reader's loss
        await stream_available_now(spark, redis_url, "h", tmp_path, fail_second, **options)
    # the restart replays batch 1 from the checkpoint, below the hole: no data loss either
    batches = await stream_available_now(spark, redis_url, "h", tmp_path, **options)
    assert batches == [[b"x3", b"x4", b"x5"], [b"x6", b"x8", b"x9"]]
    # the reader's committed place, as a new query (no checkpoint) resumes there
    await broker.redis.hset(keys.queue_readers("h"), "r", ids[2])
    again = await stream_available_now(spark, redis_url, "h", tmp_path / "new", **options)
    assert [p for b in again for p in b] == [b"x3", b"x4", b"x5", b"x6", b"x8", b"x9"]

    # deleted after registration, past the reader's place: lost
    await publish_to(broker, "h", [b"x10", b"x11", b"x12"])
    later = [e[0] for e in await broker.redis.xrange(keys.queue_stream("h"))][-3:]
    await broker.redis.xdel(keys.queue_stream("h"), later[1])
    with pytest.raises(Exception, match=r"data loss in queue 'h'.*were deleted"):
        await stream_available_now(spark, redis_url, "h", tmp_path, **options)
    # forgetting the reader forgets where it began
    assert await broker.redis.hexists(keys.queue_reader_baselines("h"), "r")
    assert await broker.redis.fcall("gw_forget_reader", 0, "h", "r") == 1
    assert not await broker.redis.exists(keys.queue_reader_baselines("h"))


async def test_unnamed_reader_from_earliest_is_only_failed_by_holes_made_after_it_started(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    ids = await holes_before_start(broker, "u")
    batches = await stream_available_now(
        spark, redis_url, "u", tmp_path / "a", maxEntriesPerBatch="3"
    )
    assert batches == [[b"x0", b"x1", b"x2"], [b"x3", b"x4", b"x5"], [b"x6", b"x8", b"x9"]]

    hook = xdel_at(redis_url, "u", ids[8], 0)  # x8 goes while the query runs: lost
    with pytest.raises(Exception, match=r"data loss in queue 'u'.*were deleted"):
        await stream_available_now(
            spark, redis_url, "u", tmp_path / "b", hook, maxEntriesPerBatch="3"
        )


async def test_unnamed_reader_is_failed_by_entries_that_went_between_planning_and_reading(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    """Loss was checked only when a batch was planned, and never for a range from the
    stream's start: an entry acked out of order, or three taken in order by a consumer (the
    engine trims them), while the first batch ran were skipped without a word. The task
    that reads a range now checks what went since its planning."""
    await broker.declare_queue(QueueConfig(name="first"))
    await publish_to(broker, "first", [f"x{i}".encode() for i in range(10)])
    ids = [e[0] for e in await broker.redis.xrange(keys.queue_stream("first"))]
    hook = xdel_at(redis_url, "first", ids[1], 0)
    with pytest.raises(Exception, match=r"data loss in queue 'first'.*deleted before it was read"):
        await stream_available_now(spark, redis_url, "first", tmp_path / "a", hook)

    await broker.declare_queue(QueueConfig(name="taken"))
    await publish_to(broker, "taken", [f"x{i}".encode() for i in range(10)])
    loop = asyncio.get_running_loop()

    async def consume_three() -> None:
        got: list[Delivery] = []
        flow = await broker.bind("taken", got.append, window=3)
        await wait_for(lambda: len(got) == 3)
        for delivery in got:
            flow.ack(delivery.entry_id)
        await flow.close()  # its acks go first
        assert await broker.redis.xlen(keys.queue_stream("taken")) == 7

    def take_three(batch_id: int) -> None:
        if batch_id == 0:
            asyncio.run_coroutine_threadsafe(consume_three(), loop).result(20)

    with pytest.raises(Exception, match=r"data loss in queue 'taken'.*went unread"):
        await stream_available_now(spark, redis_url, "taken", tmp_path / "b", take_three)


async def test_a_query_from_earliest_is_failed_by_holes_made_before_its_first_plan(
    broker: Broker, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Between the query's start (initialOffset) and its first batch's planning: a range
    from the stream's start was not checked at all. The driver's calls, in Spark's order:
    it asks initialOffset again before it plans the first batch (the second answer took
    the stream as it was then; a review of the change found it)."""
    await broker.declare_queue(QueueConfig(name="early"))
    await publish_to(broker, "early", [f"x{i}".encode() for i in range(5)])
    ids = [e[0] for e in await broker.redis.xrange(keys.queue_stream("early"))]
    reader = StreamReader(Options.parse({"redis_url": redis_url, "queue": "early"}))
    start = reader.initialOffset()
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    assert len(reader.partitions(reader.initialOffset(), end)) == 1  # nothing went yet
    await broker.redis.xdel(keys.queue_stream("early"), ids[1])
    with pytest.raises(DataLossError, match="deleted after the query began"):
        reader.partitions(reader.initialOffset(), end)
    await broker.redis.xtrim(
        keys.queue_stream("early"), minid=ids[3], approximate=False
    )  # in-order acks
    tolerant = StreamReader(
        Options.parse({"redis_url": redis_url, "queue": "early", "failOnDataLoss": "false"})
    )
    start = tolerant.initialOffset()
    end = tolerant.latestOffset(start, tolerant.getDefaultReadLimit())
    await broker.redis.xtrim(keys.queue_stream("early"), minid=ids[4], approximate=False)
    with caplog.at_level(logging.WARNING, logger="gateway.spark.source"):
        assert len(tolerant.partitions(tolerant.initialOffset(), end)) == 1  # warned; the
        # rest is read
    assert f"stream was trimmed past {ids[3].decode()}" in caplog.text


@pytest.mark.parametrize("capped", [True, False], ids=["capped", "to-the-newest"])
async def test_a_trim_of_just_what_a_query_read_is_no_loss(
    broker: Broker, redis_url: str, capped: bool
) -> None:
    """Consumers that settled just what the query read trim the stream up to the entry
    after its batch's end, that end included: no loss (the next batch failed with
    'trimmed past' the end, and again at every restart). A trim past that entry is."""
    await broker.declare_queue(QueueConfig(name="live"))
    await publish_to(broker, "live", [f"x{i}".encode() for i in range(10)])
    stream = keys.queue_stream("live")
    options = {"redis_url": redis_url, "queue": "live"}
    if capped:
        options["maxEntriesPerBatch"] = "5"
    for taken, lost in ((0, False), (1, True)):
        reader = StreamReader(Options.parse(options))
        start = reader.initialOffset()
        end = reader.latestOffset(start, reader.getDefaultReadLimit())
        assert len(reader.partitions(start, end)) == 1
        if not capped:  # more arrive after the batch was planned
            await publish_to(broker, "live", [b"later"] * 3)
        ids = [e[0].decode() for e in await broker.redis.xrange(stream)]
        after = ids[ids.index(end["live"]) + 1 + taken]  # the entry after the end, or one on
        await broker.redis.xtrim(stream, minid=after, approximate=False)
        following = reader.latestOffset(end, reader.getDefaultReadLimit())
        if lost:
            with pytest.raises(DataLossError, match="trimmed past"):
                reader.partitions(end, following)
        else:
            assert len(reader.partitions(end, following)) == 1
        await broker.delete_queue("live")
        await broker.declare_queue(QueueConfig(name="live"))
        await publish_to(broker, "live", [f"x{i}".encode() for i in range(10)])


async def test_a_partition_added_after_the_query_began_is_checked_for_loss(
    broker: Broker, redis_url: str
) -> None:
    """A stream the query first saw after it began (a partition added) was read from 0-0
    with no snapshot: entries deleted there before its task read them went unreported."""
    await make_partitioned_queue(broker, "more", 1)
    reader = StreamReader(Options.parse({"redis_url": redis_url, "queue": "more"}))
    start = reader.initialOffset()
    await broker.update_queue("more", {"egress_enabled": False})
    await broker.update_queue("more", {"partition_count": 2})
    added = stream_queues("more", 2)[1][1]
    key = next(f"k{n}" for n in range(100) if partition_of(f"k{n}", 2) == 1)
    await publish_to(broker, "more", [b"x0", b"x1"], partition_key=key)
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    assert added in end
    ids = [e[0] for e in await broker.redis.xrange(keys.queue_stream(added))]
    await broker.redis.xdel(keys.queue_stream(added), ids[0])
    with pytest.raises(DataLossError, match="deleted after the query began"):
        reader.partitions(start, end)


async def test_archive_and_dmq_report(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    dmq = "#DEAD_MSG_QUEUE"
    await broker.declare_queue(QueueConfig(name=dmq))
    dead = [("orders", "max-redelivery")] * 3 + [("orders", "ttl")] * 2
    for origin, reason in dead:
        props = [("x-origin-queue", origin), ("x-dmq-reason", reason)]
        await publish_to(broker, dmq, [b"d"], user_properties=props)
    annotated = {"x-origin-queue": "billing", "x-dmq-reason": "ttl"}
    await publish_to(broker, dmq, [b"d"], annotations=annotated)

    report = await asyncio.to_thread(lambda: jobs.dmq_report(spark, redis_url, dmq).collect())
    assert [(r.origin_queue, r.reason, r.messages) for r in report] == [
        ("orders", "max-redelivery", 3),
        ("orders", "ttl", 2),
        ("billing", "ttl", 1),
    ]

    path = str(tmp_path / "archive")
    await asyncio.to_thread(jobs.archive, spark, redis_url, dmq, path, str(tmp_path / "ck"))
    await publish_to(broker, dmq, [b"late"])
    await asyncio.to_thread(jobs.archive, spark, redis_url, dmq, path, str(tmp_path / "ck"))
    archived = await asyncio.to_thread(lambda: spark.read.parquet(path).collect())
    assert len(archived) == 7  # incremental: the second run added only the new entry
    assert {r.queue for r in archived} == {dmq}
    assert {str(r.date) for r in archived} == {str(archived[0].ingest_ts.date())}


async def test_batch_read_of_a_priority_queue_returns_its_messages(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    """A priority queue keeps its messages in hidden per-level streams (#R/<p>/<name>): the
    source reads them all, as it reads every partition of a partitioned one."""
    await broker.declare_queue(QueueConfig(name="prio", priorities=True))
    for n, prio in enumerate([1, 9, 4]):
        msg = Message(destination="prio", payload=f"p{n}".encode(), to_queue=True, priority=prio)
        assert await broker.publish(msg) is Outcome.OK
    assert (await broker.queues.info("prio")).messages == 3
    rows = await asyncio.to_thread(lambda: read(spark, redis_url, "prio").collect())
    assert sorted(r.payload for r in rows) == [b"p0", b"p1", b"p2"]


async def test_dmq_report_counts_real_dead_messages_by_origin_and_reason(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    """`gateway pipeline dmq-report` counts really dead-lettered messages by origin and
    reason, which the engine keeps as stream fields 'o' / 'r' beside the blob."""
    dmq = "#DEAD_MSG_QUEUE"
    await broker.declare_queue(QueueConfig(name=dmq))
    await broker.declare_queue(QueueConfig(name="orders", dmq_eligible_default=True))
    for n in range(2):
        msg = Message(destination="orders", payload=f"o{n}".encode(), to_queue=True)
        assert await broker.publish(msg) is Outcome.OK
    got: list[Delivery] = []
    flow = await broker.bind("orders", got.append)
    await wait_for(lambda: len(got) == 2)
    for d in got:
        flow.reject(d.entry_id)
    await flow.close()
    stream = keys.queue_stream(dmq)

    async def dead() -> int:
        return await broker.redis.xlen(stream)

    for _ in range(100):
        if await dead() == 2:
            break
        await asyncio.sleep(0.05)
    raw = await broker.redis.xrange(stream)
    assert len(raw) == 2 and raw[0][1][b"o"] == b"orders" and raw[0][1][b"r"] == b"rejected"

    report = await asyncio.to_thread(lambda: jobs.dmq_report(spark, redis_url, dmq).collect())
    assert [(r.origin_queue, r.reason, r.messages) for r in report] == [("orders", "rejected", 2)]


async def test_batch_sink_replay_after_a_failed_write_publishes_every_row(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    """A write refused half-way fails; replaying it with the same batchId once there is
    room publishes every row, however the replay is partitioned (per-partition markers of
    the failed write skipped other rows of a replay partitioned otherwise: lost)."""
    await broker.declare_queue(QueueConfig(name="sq", max_messages=7))
    rows = [(f"r{i}",) for i in range(10)]
    first = spark.sparkContext.parallelize(rows, 2).toDF("payload string")  # r0-r4 | r5-r9

    def save(frame) -> None:
        activate(spark)
        (
            frame.write.format("gateway")
            .mode("append")
            .option("redis_url", redis_url)
            .option("queue", "sq")
            .option("batchId", "nightly-1")
            .save()
        )

    with pytest.raises(Exception, match="refused"):
        await asyncio.to_thread(save, first)
    stored = {
        decode(f[b"m"]).payload for _, f in await broker.redis.xrange(keys.queue_stream("sq"))
    }
    assert len(stored) == 7  # r0-r4 and two of r5-r9

    await broker.queues.update("sq", {"max_messages": 0})  # room now: replay the write
    replay = spark.sparkContext.parallelize(rows, 1).toDF("payload string")
    await asyncio.to_thread(save, replay)
    stored |= {
        decode(f[b"m"]).payload for _, f in await broker.redis.xrange(keys.queue_stream("sq"))
    }
    assert stored == {f"r{i}".encode() for i in range(10)}


async def test_batch_read_and_dmq_report_of_an_empty_queue(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    """With nothing spooled the reader plans no range; PySpark still runs one task (an
    InputPartition of its own): no rows, no failure (`gateway pipeline dmq-report` on a
    broker with no dead messages)."""
    await broker.declare_queue(QueueConfig(name="#DEAD_MSG_QUEUE"))
    await broker.declare_queue(QueueConfig(name="empty"))
    assert await asyncio.to_thread(lambda: read(spark, redis_url, "empty").count()) == 0
    report = await asyncio.to_thread(
        lambda: jobs.dmq_report(spark, redis_url, "#DEAD_MSG_QUEUE").collect()
    )
    assert report == []


async def test_sink_duplicates_carry_a_message_id_consumers_can_recognise(
    spark: SparkSession, broker: Broker, redis_url: str, amqp
) -> None:
    """The sink's deterministic message ids go out as the AMQP message-id: the two copies
    of a row published twice (a retried task, a failed batch write replayed) can be told
    from two rows."""
    await broker.declare_queue(QueueConfig(name="ids"))
    df = spark.createDataFrame([("row-1", "hello")], "id string, payload string")

    def save(batch: str) -> None:
        activate(spark)
        (
            df.write.format("gateway")
            .mode("append")
            .option("redis_url", redis_url)
            .option("queue", "ids")
            .option("batchId", batch)
            .save()
        )

    await asyncio.to_thread(save, "try-1")
    await asyncio.to_thread(save, "try-2")  # the same row spooled again

    def receive() -> list:
        conn = BlockingConnection(f"amqp://127.0.0.1:{amqp.port}", timeout=10)
        try:
            receiver = conn.create_receiver("ids", credit=2)
            got = []
            for _ in range(2):
                got.append(receiver.receive(timeout=10))
                receiver.accept()
            return got
        finally:
            conn.close()

    first, second = await asyncio.to_thread(receive)
    assert (bytes(first.body), bytes(second.body)) == (b"hello", b"hello")
    assert first.id is not None and first.id == second.id


async def test_a_failed_batch_write_replayed_otherwise_gives_no_two_rows_one_message_id(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    """Rows without an `id` column get ids from their place in the write: a replay
    partitioned otherwise gave a row the message-id another row had in the failed write,
    so a consumer dropping duplicates by message-id dropped a different row. A replay's
    ids are its own (its copies are told apart by an `id` column only)."""
    await broker.declare_queue(QueueConfig(name="sq2", max_messages=7))
    rows = [(f"r{i}",) for i in range(10)]

    def save(frame) -> None:
        activate(spark)
        (
            frame.write.format("gateway")
            .mode("append")
            .option("redis_url", redis_url)
            .option("queue", "sq2")
            .option("batchId", "nightly-1")
            .save()
        )

    first = spark.sparkContext.parallelize(rows, 2).toDF("payload string")
    with pytest.raises(Exception, match="refused"):
        await asyncio.to_thread(save, first)
    await broker.queues.update("sq2", {"max_messages": 0})
    replay = spark.sparkContext.parallelize(rows, 3).toDF("payload string")
    await asyncio.to_thread(save, replay)

    ids: dict[bytes, set] = {}
    for _, f in await broker.redis.xrange(keys.queue_stream("sq2")):
        msg = decode(f[b"m"])
        ids.setdefault(msg.payload, set()).add(msg.message_id)
    rows_of: dict[object, set] = {}
    for payload, mids in ids.items():
        for mid in mids:
            rows_of.setdefault(mid, set()).add(payload)
    shared = sorted(sorted(r) for r in rows_of.values() if len(r) > 1)
    # a consumer deduplicating by message-id would drop one of two different rows
    assert not shared, f"different rows sharing a message-id: {shared}"
    assert set(ids) == {f"r{i}".encode() for i in range(10)}


async def stored(broker: Broker, queue: str) -> list[Message]:
    return [decode(f[b"m"]) for _, f in await broker.redis.xrange(keys.queue_stream(queue))]


async def test_an_unknown_source_or_sink_option_is_refused_by_name(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    """A misspelt readerName was ignored: the query ran unregistered (no retention)."""
    await broker.declare_queue(QueueConfig(name="q"))
    await publish_to(broker, "q", [b"a"])
    with pytest.raises(Exception, match="the gateway source has no option 'readernmae'"):
        await stream_available_now(spark, redis_url, "q", tmp_path, readerNmae="archive")
    assert not await broker.redis.exists(keys.queue_readers("q"))
    rows = read(spark, redis_url, "q", READERNAME="r", path="ignored")  # any case; Spark's
    assert len(await asyncio.to_thread(rows.collect)) == 1

    def save() -> None:
        df = spark.createDataFrame([("a",)], "payload string")
        writer = df.write.format("gateway").mode("append").option("redis_url", redis_url)
        writer.option("queue", "q").option("batchID", "b1").option("sinkNmae", "s").save()

    with pytest.raises(Exception, match="the gateway sink has no option 'sinknmae'"):
        await asyncio.to_thread(in_thread(spark, save))
    assert await broker.redis.xlen(keys.queue_stream("q")) == 1


async def test_a_source_or_sink_without_redis_url_names_the_option(
    spark: SparkSession, broker: Broker
) -> None:
    """Without redis_url both went to 127.0.0.1:6379: another Redis, or a connection
    error that named no option."""
    await broker.declare_queue(QueueConfig(name="q"))

    def load() -> object:
        return spark.read.format("gateway").option("queue", "q").load().collect()

    def save() -> None:
        df = spark.createDataFrame([("a",)], "payload string")
        df.write.format("gateway").mode("append").option("queue", "q").save()

    for action in (load, save):
        with pytest.raises(Exception, match=r"the gateway (source|sink) needs option 'redis_url'"):
            await asyncio.to_thread(in_thread(spark, action))


@pytest.mark.parametrize(
    "schema, row, refused",
    [
        ("payload int", (5,), "'payload' column must be binary or string, not int"),
        ("payload string, partition_key int", ("x", 7), "'partition_key' column must be a"),
        ("payload string, properties map<string,date>", ("x", {}), "'properties' column must"),
        ("payload string, priority string", ("x", "9"), "'priority' column must be an integer"),
        ("payload string, expiration long", ("x", 1), "'expiration' column must be a time"),
    ],
    ids=["int-payload", "int-key", "date-property", "text-priority", "long-expiration"],
)
async def test_a_column_of_a_type_a_message_cannot_carry_is_refused_before_writing(
    spark: SparkSession, broker: Broker, redis_url: str, schema: str, row: tuple, refused: str
) -> None:
    await broker.declare_queue(QueueConfig(name="nums"))
    df = spark.createDataFrame([row], schema)  # an int payload: bytes(5), five zero bytes
    write = df.write.format("gateway").mode("append").option("redis_url", redis_url)
    with pytest.raises(Exception, match=refused):
        await asyncio.to_thread(in_thread(spark, lambda: write.option("queue", "nums").save()))
    assert await stored(broker, "nums") == []


async def test_sink_columns_set_priority_expiry_persistence_subject_and_reply_to(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    await broker.declare_queue(QueueConfig(name="typed"))
    expires = datetime(2100, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    rows = [
        ("a", 7, expires, False, "orders", "replies/a"),
        ("b", 12, None, None, None, None),  # clamped as an AMQP priority is
        ("c", None, None, True, None, None),
    ]
    schema = (
        "payload string, priority int, expiration timestamp, persistent boolean, "
        "subject string, reply_to string"
    )
    write = spark.createDataFrame(rows, schema).coalesce(1).write.format("gateway")
    write = write.mode("append").option("redis_url", redis_url).option("queue", "typed")
    await asyncio.to_thread(in_thread(spark, write.save))
    got = {m.payload: m for m in await stored(broker, "typed")}
    fields = {
        p: (m.priority, m.expiration, m.persistent, m.subject, m.reply_to) for p, m in got.items()
    }
    assert fields == {
        b"a": (7, int(expires.timestamp() * 1000), False, "orders", "replies/a"),
        b"b": (9, None, True, None, None),
        b"c": (4, None, True, None, None),
    }


async def test_a_sources_dataframe_is_written_as_it_is_and_expired_rows_are_not_delivered(
    spark: SparkSession, broker: Broker, redis_url: str
) -> None:
    """The source's own columns (queue, entry_id, ingest_ts, ...) are not the sink's: they
    are left alone, so a queue can be copied without a select; its headers are the sink's,
    the message-id too (the copy had one the sink made: a consumer deduplicating by it, or
    a requester matching a reply's correlation-id, no longer knew the message)."""
    await broker.declare_queue(QueueConfig(name="from"))
    await broker.declare_queue(QueueConfig(name="copy"))
    await publish_to(broker, "from", [b"x", b"y"], partition_key="k", message_id="order-42")
    frame = read(spark, redis_url, "from").withColumn(
        "expiration",
        F.when(F.col("payload") == F.lit(b"y"), F.lit(datetime(2001, 1, 1, tzinfo=UTC))),
    )
    write = frame.write.format("gateway").mode("append").option("redis_url", redis_url)
    await asyncio.to_thread(in_thread(spark, write.option("queue", "copy").save))
    got: list[Delivery] = []
    flow = await broker.bind("copy", got.append)
    await wait_for(lambda: got)
    await asyncio.sleep(0.3)  # room for the expired one, were it delivered
    await flow.close()
    copied = [(d.message.payload, d.message.partition_key, d.message.message_id) for d in got]
    assert copied == [(b"x", "k", "order-42")]


async def test_a_topic_write_that_matched_no_subscription_is_counted_as_not_stored(
    broker: Broker, redis_url: str
) -> None:
    await broker.declare_queue(QueueConfig(name="heard"), [("said/yes", "smf")])
    opts = SinkOptions.parse({"redis_url": redis_url, "topic": "said/yes"})
    said = [Message(destination="said/yes", payload=b"1")]
    assert await sink.publish(opts, "b1", "b1:0", said) == SinkCommit("b1:0", 1, False, 0)
    opts = SinkOptions.parse({"redis_url": redis_url, "topic": "said/no"})
    unheard = [Message(destination="said/no", payload=str(i).encode()) for i in range(3)]
    assert await sink.publish(opts, "b1", "b1:0", unheard) == SinkCommit("b1:0", 3, False, 3)


async def test_a_micro_batch_replayed_after_a_refusal_spools_only_what_it_had_not(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    await broker.declare_queue(QueueConfig(name="src"))
    await broker.declare_queue(QueueConfig(name="dst", max_messages=3))
    await publish_to(broker, "src", [f"r{i}".encode() for i in range(5)])
    checkpoint = str(tmp_path / "ck")

    def run() -> BaseException | None:
        query = (
            jobs.stream_queue(spark, redis_url, "src")
            .select("payload")
            .writeStream.format("gateway")
            .option("redis_url", redis_url)
            .option("queue", "dst")
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start()
        )
        try:
            query.awaitTermination(60)
        except Exception as exc:  # the query's failure
            return exc
        return query.exception()

    failure = await asyncio.to_thread(in_thread(spark, run))
    assert failure is not None and "QUEUE_FULL" in str(failure)
    assert len(await stored(broker, "dst")) == 3
    await broker.queues.update("dst", {"max_messages": 0})  # room: the query restarts
    assert await asyncio.to_thread(in_thread(spark, run)) is None
    assert sorted(m.payload for m in await stored(broker, "dst")) == [
        f"r{i}".encode() for i in range(5)
    ]


async def test_aggregate_windows_an_hour_apart_in_a_daylight_saving_change_get_two_ids(
    spark: SparkSession, broker: Broker, redis_url: str, tmp_path: Path
) -> None:
    await broker.declare_queue(QueueConfig(name="m"))
    await broker.declare_queue(QueueConfig(name="aggs"), [("stats/>", "smf")])
    # 2025-11-02 01:30:10 EDT, 01:30:10 EST (the same local text), then one that moves
    # the watermark past both
    for stamp in (1762061410000, 1762065010000, 1762074000000):
        blob = encode(Message(destination="m", payload=b"1", to_queue=True, partition_key="k"))
        await broker.redis.xadd(keys.queue_stream("m"), {"m": blob}, id=f"{stamp}-0")
    zone = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        query = jobs.aggregate(
            spark, redis_url, "m", "stats/m", str(tmp_path / "ck"), watermark="0 seconds", once=True
        )
        await asyncio.to_thread(query.awaitTermination, 60)
        assert query.exception() is None
    finally:
        spark.conf.set("spark.sql.session.timeZone", zone)
    results = await stored(broker, "aggs")
    ids = {json.loads(m.payload)["window_start"]: m.message_id for m in results}
    assert len(ids) == 2 and len(set(ids.values())) == 2, ids


@pytest.fixture
def tokyo_worker() -> Iterator[None]:
    """This process as a Python worker on a host whose zone is Asia/Tokyo (UTC+9)."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Tokyo"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


@pytest.mark.parametrize("kind", [TimestampType(), TimestampNTZType()], ids=["ltz", "ntz"])
def test_an_expiration_is_the_instant_its_column_holds_whatever_the_workers_zone(
    tokyo_worker: None, kind: DataType
) -> None:
    """pyspark hands a writer a TimestampType value naive in the worker's zone (its Arrow
    converter), a TimestampNTZType one naive with no zone (taken as UTC)."""
    schema = StructType([StructField("payload", StringType()), StructField("expiration", kind)])
    expires = datetime(2100, 1, 2, 3, 4, 5, tzinfo=UTC)
    value = ArrowTableToRowsConversion._create_converter(kind)(
        expires if isinstance(kind, TimestampType) else expires.replace(tzinfo=None)
    )
    opts = SinkOptions.parse({"redis_url": "redis://127.0.0.1:1/0", "queue": "q"})
    msg = RowMapper(opts, schema).message(Row(payload="a", expiration=value), "b", 0)
    assert msg.expiration == int(expires.timestamp() * 1000)


def test_pipeline_jobs_find_the_redis_of_a_node_run_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gateway pipeline` went to redis://127.0.0.1:6379/0, which nothing answers after the
    README's `./run serve` (its Redis listens on a unix socket in .gateway-data; found by
    a review). Without --redis-url it takes GATEWAY_REDIS_URL, else that socket."""
    monkeypatch.delenv("GATEWAY_REDIS_URL", raising=False)
    monkeypatch.setenv("GATEWAY_DATA_DIR", str(tmp_path))
    assert pipeline_redis_url(None) == DEFAULT_REDIS_URL
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(tmp_path / "redis.sock"))
        assert pipeline_redis_url(None) == f"unix://{tmp_path.resolve()}/redis.sock?db=0"
    monkeypatch.setenv("GATEWAY_REDIS_URL", "redis://127.0.0.1:1/0")
    assert pipeline_redis_url(None) == "redis://127.0.0.1:1/0"
    assert pipeline_redis_url("redis://x:2/0") == "redis://x:2/0"


async def test_dmq_report_without_a_dead_message_queue_says_so(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new node has no #DEAD_MSG_QUEUE until the operator declares one: the README's
    `gateway pipeline dmq-report` ended in a traceback there (found by a review)."""
    argv = ["pipeline", "--redis-url", redis_url, "dmq-report"]
    assert await asyncio.to_thread(jobs.main, argv) == 0
    assert await asyncio.to_thread(jobs.main, [*argv, "other"]) == 1
    archive = ["pipeline", "--redis-url", redis_url, "archive", "gone", "/nowhere"]
    assert await asyncio.to_thread(jobs.main, archive) == 1  # one line, not a Spark traceback
    err = capsys.readouterr().err
    assert "no queue '#DEAD_MSG_QUEUE'" in err and "no queue 'other'" in err
    assert "gateway pipeline archive: no queue 'gone'" in err
    nowhere = "redis://gw:pw-s3cret@127.0.0.1:1/0"  # where no node runs: one line, no traceback
    with pytest.raises(SystemExit, match="no Redis at redis://gw:") as told:
        await asyncio.to_thread(jobs.main, ["pipeline", "--redis-url", nowhere, "dmq-report"])
    assert "pw-s3cret" not in str(told.value)


async def test_a_retired_reader_does_not_come_back_when_a_queue_is_unpartitioned(
    broker: Broker,
) -> None:
    """A reader of a plain queue, retired after the queue was partitioned (its places in the
    partitions forgotten), held again once the queue was unpartitioned: the queue's own
    place had stayed, and every acked message stayed in Redis for good (found by a review)."""
    await broker.declare_queue(QueueConfig(name="flip"))
    await broker.redis.fcall("gw_reader_at", 0, "flip", "old", "0-0", 1)
    await broker.update_queue("flip", {"egress_enabled": False})
    await broker.update_queue("flip", {"partition_count": 2})
    assert await broker.queues.forget_reader("flip", "old") == 2
    await broker.update_queue("flip", {"partition_count": 0, "egress_enabled": True})
    for n in range(5):
        assert await broker.publish(Message("flip", b"m%d" % n, to_queue=True)) is Outcome.OK
    got: list[Delivery] = []
    flow = await broker.bind("flip", lambda d: (got.append(d), flow.ack(d.entry_id)))
    await wait_for(lambda: len(got) == 5)
    await flow.close()
    await broker.redis.fcall("gw_reap", 0)
    assert await broker.redis.hget(keys.queue_readers("flip"), "old") is None
    assert await broker.redis.xlen(keys.queue_stream("flip")) == 0


def test_the_sink_takes_the_options_spark_hands_a_named_stream_query() -> None:
    """Spark hands a stream sink queryName when the query is named: refused as unknown
    since unknown options are, the query did not start (found by a review)."""
    options = {"redis_url": "redis://x/0", "topic": "t", "checkpointlocation": "/c"}
    assert SinkOptions.parse({**options, "queryname": "q"}).destination == "t"
