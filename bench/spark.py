"""Spark pipeline benchmark: batch-read and archive throughput, publish-to-aggregate latency.

Spools --messages messages of --size bytes into one queue of a private redis-server
(unix socket, AOF everysec), then on a local Spark session (--master, default local[*]):
  batch read   rows/s of a full read of the queue through the `gateway` data source
               (every payload materialised), best of --runs after one warm-up;
  archive      rows/s of the archive job (Parquet, partitioned by queue and date);
  aggregate    latency from an MQTT publish of the message that closes a window to the window's
               aggregate arriving in a gateway topic (windowed aggregate with a watermark,
               streaming, 100 ms trigger): median and max over --samples windows.

    python bench/spark.py [--messages 200000] [--size 100] [--runs 2] [--samples 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from gateway.broker import Broker
from gateway.config import Settings
from gateway.engine import library
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message
from gateway.redis_server import EmbeddedRedis
from gateway.spark import jobs
from gateway.spark.session import build_session
from protocols.mqtt.listener import start as start_mqtt

CHUNK = 2000


async def spool(broker: Broker, queue: str, n: int, size: int) -> float:
    """Publish `n` messages through the broker; returns messages per second."""
    payload = b"x" * size
    t0 = time.perf_counter()
    for start in range(0, n, CHUNK):
        futures = [
            broker.publish_nowait(
                Message(
                    destination=queue, payload=payload, to_queue=True, partition_key=f"k{i % 16}"
                )
            )
            for i in range(start, min(n, start + CHUNK))
        ]
        outcomes = await asyncio.gather(*futures)
        assert all(o.accepted for o in outcomes)
    return n / (time.perf_counter() - t0)


def timed(action) -> float:
    t0 = time.perf_counter()
    action()
    return time.perf_counter() - t0


def batch_read_rate(
    spark: SparkSession, url: str, queue: str, n: int, size: int, runs: int
) -> float:
    def read() -> None:  # a new DataFrame each time: re-collecting one reuses its shuffle
        df = jobs.read_queue(spark, url, queue)
        assert df.select(F.sum(F.length("payload"))).collect()[0][0] == n * size

    read()  # warm-up: Python workers, code paths
    return n / min(timed(read) for _ in range(runs))


def archive_rate(spark: SparkSession, url: str, queue: str, n: int, runs: int, tmp: Path) -> float:
    walls = [
        timed(lambda i=i: jobs.archive(spark, url, queue, str(tmp / f"archive-{i}")))
        for i in range(runs)
    ]
    assert spark.read.parquet(str(tmp / "archive-0")).count() == n
    return n / min(walls)


async def aggregate_latency(
    spark: SparkSession, broker: Broker, url: str, tmp: Path, samples: int
) -> list[float]:
    """Seconds from an MQTT publish into window i+1 to window i's aggregate reaching a topic."""
    await broker.declare_queue(QueueConfig(name="readings"), [("readings/>", "smf")])
    mqtt = await start_mqtt(broker, Settings(mqtt_port=0, host="127.0.0.1"))
    device = paho.Client(CallbackAPIVersion.VERSION2, "bench-device", protocol=paho.MQTTv311)
    device.connect("127.0.0.1", mqtt.port)
    device.loop_start()
    await broker.declare_queue(QueueConfig(name="results"), [("bench/agg", "smf")])
    arrived: dict[int, float] = {}  # window start (epoch s) -> arrival

    def on_deliver(d: Delivery) -> None:
        start = datetime.fromisoformat(json.loads(d.message.payload)["window_start"])
        arrived[int(start.timestamp())] = time.perf_counter()
        flow.ack(d.entry_id)

    flow = await broker.bind("results", on_deliver)
    query = jobs.aggregate(
        spark,
        url,
        "readings",
        "bench/agg",
        str(tmp / "agg-checkpoint"),
        window="1 second",
        watermark="0 seconds",
        processing_time="100 milliseconds",
    )
    try:
        for _ in range(300):  # the first micro-batch pays for planning: wait it out
            if query.lastProgress is not None:
                break
            await asyncio.sleep(0.1)
        published: list[tuple[int, float]] = []  # (window second, publish time)
        for _ in range(samples + 1):
            await asyncio.sleep(1.05 - time.time() % 1)  # early in the next window
            second, start = int(time.time()), time.perf_counter()
            info = device.publish("readings/d1", b"1", qos=1)
            await asyncio.to_thread(info.wait_for_publish, 10)
            published.append((second, start))
        for _ in range(300):
            if all(s in arrived for s, _ in published[:-1]):
                break
            await asyncio.sleep(0.1)
    finally:
        query.stop()
        await flow.close()
        device.loop_stop()
        device.disconnect()
        await mqtt.close()
    closing = [(published[i][0], published[i + 1][1]) for i in range(samples)]
    return [arrived[second] - t for second, t in closing if second in arrived]


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="gw-spark-bench-") as tmpdir:
        tmp = Path(tmpdir)
        server = EmbeddedRedis(tmp / "redis", "everysec")
        server.start()
        spark = build_session("gateway-bench", args.master, shuffle_partitions=2, ui=False)
        spark.sparkContext.setLogLevel("ERROR")
        client = await library.connect(server.url)
        broker = Broker(client)
        await broker.start()
        try:
            await broker.declare_queue(QueueConfig(name="bench"))
            spool_rate = await spool(broker, "bench", args.messages, args.size)
            read = await asyncio.to_thread(
                batch_read_rate, spark, server.url, "bench", args.messages, args.size, args.runs
            )
            arch = await asyncio.to_thread(
                archive_rate, spark, server.url, "bench", args.messages, args.runs, tmp
            )
            lat = await aggregate_latency(spark, broker, server.url, tmp, args.samples)
        finally:
            await broker.stop()
            await client.aclose()
            spark.stop()
            server.stop()
    print(f"\n{args.messages:,} messages x {args.size} B, master {spark_master(args)}")
    print(f"{'measure':<34} {'value':>14}")
    print(f"{'spool through the broker':<34} {spool_rate:>10,.0f} /s")
    print(f"{'batch read (gateway source)':<34} {read:>10,.0f} /s")
    print(f"{'archive job (Parquet)':<34} {arch:>10,.0f} /s")
    if lat:
        print(f"{'publish -> aggregate, median':<34} {statistics.median(lat) * 1000:>10,.0f} ms")
        print(f"{'publish -> aggregate, max':<34} {max(lat) * 1000:>10,.0f} ms")
    else:
        print(f"{'publish -> aggregate':<34} {'no result':>14}")


def spark_master(args: argparse.Namespace) -> str:
    return args.master or "local[*]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--master", help="Spark master (default local[*])")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
