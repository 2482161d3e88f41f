"""Pipeline jobs over gateway queues, and the `gateway pipeline ...` command.

archive     a queue to Parquet, partitioned by queue and date (incremental with a checkpoint)
aggregate   count and average of a numeric value per partition key and time window, with a
            watermark, published back into a gateway topic through the sink
dmq-report  dead messages by origin queue and reason (batch read of the DMQ)
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable

import redis
from pyspark.errors import StreamingQueryException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from gateway.engine import keys
from gateway.engine.library import redacted
from gateway.engine.queues import DEAD_MESSAGE_QUEUE
from gateway.spark.cli import add_pipeline_parser, pipeline_redis_url
from gateway.spark.session import activate, build_session

ORIGIN_PROPERTY = "x-origin-queue"
REASON_PROPERTY = "x-dmq-reason"


def read_queue(spark: SparkSession, redis_url: str, queue: str, **options: str) -> DataFrame:
    """Batch read of every stream of `queue`."""
    activate(spark)
    reader = spark.read.format("gateway").option("redis_url", redis_url).option("queue", queue)
    return reader.options(**options).load()


def stream_queue(spark: SparkSession, redis_url: str, queue: str, **options: str) -> DataFrame:
    """Streaming read of every stream of `queue`."""
    activate(spark)
    reader = spark.readStream.format("gateway").option("redis_url", redis_url)
    return reader.option("queue", queue).options(**options).load()


def with_date(df: DataFrame) -> DataFrame:
    return df.withColumn("date", F.to_date("ingest_ts"))


def archive(
    spark: SparkSession,
    redis_url: str,
    queue: str,
    path: str,
    checkpoint: str | None = None,
) -> None:
    """Write the queue's messages to Parquet under `path` (partitions queue=/date=).

    With a checkpoint the archive is incremental (Trigger.AvailableNow, committed offsets
    under reader name ``archive:<path>``, so the engine keeps entries until archived);
    without one it is a one-shot snapshot of what is spooled now.
    """
    if checkpoint is None:
        df = with_date(read_queue(spark, redis_url, queue))
        df.write.mode("append").partitionBy("queue", "date").parquet(path)
        return
    df = with_date(stream_queue(spark, redis_url, queue, readerName=f"archive:{path}"))
    query = (
        df.writeStream.format("parquet")
        .option("path", path)
        .option("checkpointLocation", checkpoint)
        .partitionBy("queue", "date")
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()


def value_column(value: str) -> Column:
    """`payload` (the payload as a number) or `property:NAME` (a user property)."""
    if value == "payload":  # try_cast: a malformed value counts, but stays out of the average
        return F.col("payload").cast("string").try_cast("double")
    kind, _, name = value.partition(":")
    if kind != "property" or not name:
        raise ValueError("value must be 'payload' or 'property:NAME'")
    return F.col("properties").getItem(name).try_cast("double")


def aggregates(df: DataFrame, window: str, watermark: str, value: str) -> DataFrame:
    """Per key and window: count and average, as sink rows (JSON payload, stable id)."""
    grouped = (
        df.withWatermark("ingest_ts", watermark)
        .withColumn("value", value_column(value))
        .groupBy(F.window("ingest_ts", window), F.col("partition_key"))
        .agg(F.count(F.lit(1)).alias("count"), F.avg("value").alias("avg"))
    )
    body = F.to_json(
        F.struct(
            F.col("partition_key").alias("key"),
            F.date_format("window.start", "yyyy-MM-dd'T'HH:mm:ss.SSSXXX").alias("window_start"),
            F.date_format("window.end", "yyyy-MM-dd'T'HH:mm:ss.SSSXXX").alias("window_end"),
            "count",
            "avg",
        )
    )
    return grouped.select(
        body.cast("binary").alias("payload"),
        F.col("partition_key"),
        F.lit("application/json").alias("content_type"),
        # the same window always publishes the same message id, also when replayed: its
        # start as an instant (text would depend on the session's time zone, and repeat in
        # a daylight saving change), and a null key told apart from an empty one
        F.concat_ws(
            "|",
            F.coalesce(F.concat(F.lit("k:"), "partition_key"), F.lit("-")),
            F.unix_micros("window.start").cast("string"),
        ).alias("id"),
    )


def aggregate(
    spark: SparkSession,
    redis_url: str,
    queue: str,
    topic: str,
    checkpoint: str,
    *,
    window: str = "1 minute",
    watermark: str = "10 seconds",
    value: str = "payload",
    reader_name: str | None = None,
    once: bool = False,
    processing_time: str = "1 second",
) -> StreamingQuery:
    """Start the windowed aggregate; `once` processes what is spooled now and stops.

    Its committed offsets go under `reader_name` (default ``aggregate:<topic>``).
    """
    name = reader_name or f"aggregate:{topic}"
    rows = aggregates(
        stream_queue(spark, redis_url, queue, readerName=name), window, watermark, value
    )
    writer = (
        rows.writeStream.format("gateway")
        .option("redis_url", redis_url)
        .option("topic", topic)
        .option("sinkName", f"aggregate:{queue}:{topic}")
        .option("checkpointLocation", checkpoint)
        .outputMode("append")
    )
    trigger = {"availableNow": True} if once else {"processingTime": processing_time}
    return writer.trigger(**trigger).start()


def dmq_report(spark: SparkSession, redis_url: str, queue: str = DEAD_MESSAGE_QUEUE) -> DataFrame:
    """Dead messages counted by origin queue and reason, most frequent first."""
    props = F.col("properties")
    return (
        read_queue(spark, redis_url, queue)
        .select(
            F.coalesce(props.getItem(ORIGIN_PROPERTY), F.lit("unknown")).alias("origin_queue"),
            F.coalesce(props.getItem(REASON_PROPERTY), F.lit("unknown")).alias("reason"),
            F.col("ingest_ts"),
        )
        .groupBy("origin_queue", "reason")
        .agg(
            F.count(F.lit(1)).alias("messages"),
            F.min("ingest_ts").alias("first"),
            F.max("ingest_ts").alias("last"),
        )
        .orderBy(F.desc("messages"), "origin_queue", "reason")
    )


class StageProgress:
    """Prints one line per completed Spark stage while a batch job runs (status tracker)."""

    def __init__(
        self, spark: SparkSession, out: Callable[[str], None] = print, interval: float = 0.5
    ) -> None:
        self._tracker = spark.sparkContext.statusTracker()
        self._out = out
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stage-progress", daemon=True)
        self._active: dict[int, tuple[str, int]] = {}

    def __enter__(self) -> StageProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()
        for stage_id in list(self._active):
            self._finish(stage_id)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._poll()

    def _poll(self) -> None:
        current = set(self._tracker.getActiveStageIds())
        for stage_id in current:
            info = self._tracker.getStageInfo(stage_id)
            if info is not None:
                self._active[stage_id] = (info.name, info.numTasks)
        for stage_id in set(self._active) - current:
            self._finish(stage_id)

    def _finish(self, stage_id: int) -> None:
        name, tasks = self._active.pop(stage_id)
        self._out(f"stage {stage_id} done: {tasks} tasks ({name.split(' at ')[0]})")


def run_pipeline(args: argparse.Namespace) -> int:
    args.redis_url = pipeline_redis_url(args.redis_url)
    command = args.pipeline_command
    if not _exists(args.redis_url, args.queue):  # checked before Spark starts
        print(f"gateway pipeline {command}: no queue {args.queue!r}", file=sys.stderr)
        # the default dead message queue until the operator declares it: nothing to report
        return 0 if command == "dmq-report" and args.queue == DEAD_MESSAGE_QUEUE else 1
    spark = build_session(
        f"gateway-{args.pipeline_command}", args.master, shuffle_partitions=args.shuffle_partitions
    )
    spark.sparkContext.setLogLevel("WARN")
    try:
        if args.pipeline_command == "archive":
            with StageProgress(spark):
                archive(spark, args.redis_url, args.queue, args.path, args.checkpoint)
            print(f"archived {args.queue} to {args.path}")
        elif args.pipeline_command == "aggregate":
            return _run_aggregate(spark, args)
        else:
            with StageProgress(spark, out=lambda line: print(line, file=sys.stderr)):
                rows = dmq_report(spark, args.redis_url, args.queue).collect()
            _print_report(rows, args.json)
    finally:
        spark.stop()
    return 0


def _exists(redis_url: str, queue: str) -> bool:
    """Whether the queue exists (the source's error for one that does not is a traceback
    from inside Spark)."""
    try:
        with redis.Redis.from_url(redis_url) as client:
            return bool(client.exists(keys.queue_config(queue)))
    except redis.ConnectionError as exc:
        raise SystemExit(
            f"gateway pipeline: no Redis at {redacted(redis_url)} ({exc}): give --redis-url or "
            "GATEWAY_REDIS_URL, or run it where the node runs"
        ) from None


def _run_aggregate(spark: SparkSession, args: argparse.Namespace) -> int:
    query = aggregate(
        spark,
        args.redis_url,
        args.queue,
        args.topic,
        args.checkpoint,
        window=args.window,
        watermark=args.watermark,
        value=args.value,
        once=args.once,
    )
    seen = -1
    try:
        done = False
        while not done:  # a line per micro-batch; ends with the query (or Ctrl-C)
            done = query.awaitTermination(2)
            for progress in query.recentProgress:
                if progress["batchId"] > seen:
                    seen = progress["batchId"]
                    print(f"batch {seen}: {progress['numInputRows']} rows")
    except KeyboardInterrupt:
        query.stop()
    except StreamingQueryException as exc:
        print(f"gateway pipeline aggregate: {exc.getCondition()}: {exc}", file=sys.stderr)
        return 1
    return 0


def _print_report(rows: list, as_json: bool) -> None:
    if as_json:
        for r in rows:
            print(json.dumps({**r.asDict(), "first": str(r.first), "last": str(r.last)}))
        return
    print(f"{'origin queue':<30} {'reason':<24} {'messages':>9}")
    for r in rows:
        print(f"{r.origin_queue:<30} {r.reason:<24} {r.messages:>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway")
    add_pipeline_parser(parser.add_subparsers(dest="command", required=True))
    return run_pipeline(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
