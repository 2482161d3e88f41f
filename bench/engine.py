"""Engine benchmark: spool -> dispatch -> ack through the broker API, against raw pipelined
XADD / XREADGROUP / XACK on the same redis-server (AOF on, appendfsync everysec) in the
same run. Prints throughput, CPU µs per message (this process + redis-server, from /proc)
and the engine's publish-to-delivery latency, each the median of --runs runs, and the
ratios engine / raw. Everything runs on a private unix socket; nothing else is touched.

    python bench/engine.py [--messages 100000] [--size 100] [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis
from peers import process_cpu

from gateway.broker import Broker
from gateway.engine import library
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message
from gateway.redis_server import EmbeddedRedis

RAW_BATCH = 100


class Meter:
    """Wall time and CPU of this process plus redis-server over one measured section."""

    def __init__(self, redis_pid: int) -> None:
        self.pids = [os.getpid(), redis_pid]

    def __enter__(self) -> Meter:
        self.cpu0 = [process_cpu(p) for p in self.pids]
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        cpu1 = [process_cpu(p) for p in self.pids]
        self.cpu = [b - a for a, b in zip(self.cpu0, cpu1, strict=True)]


async def run_raw(client: aioredis.Redis, redis_pid: int, n: int, size: int) -> dict:
    """Baseline: pipelined XADD batches; XREADGROUP + XACK batches, concurrently."""
    stream = f"bench:raw:{time.monotonic_ns()}"
    await client.xgroup_create(stream, "g", id="0", mkstream=True)
    payload = b"x" * size
    done = asyncio.Event()

    async def produce() -> None:
        for start in range(0, n, RAW_BATCH):
            pipe = client.pipeline(transaction=False)
            for _ in range(min(RAW_BATCH, n - start)):
                pipe.xadd(stream, {"m": payload})
            await pipe.execute()

    async def consume() -> None:
        got = 0
        while got < n:
            reply = await client.xreadgroup("g", "c", {stream: ">"}, count=RAW_BATCH)
            if not reply:
                await asyncio.sleep(0)
                continue
            ids = [entry_id for entry_id, _ in reply[0][1]]
            await client.xack(stream, "g", *ids)
            got += len(ids)
        done.set()

    with Meter(redis_pid) as m:
        await asyncio.gather(produce(), consume())
    await client.delete(stream)
    return {"wall": m.wall, "cpu_client": m.cpu[0], "cpu_redis": m.cpu[1]}


async def run_engine(broker: Broker, redis_pid: int, n: int, size: int, window: int) -> dict:
    """Publish n messages (at most 2 windows not yet delivered), one flow acking each."""
    name = f"bench-{time.monotonic_ns()}"
    await broker.queues.create(QueueConfig(name=name))
    latencies: list[float] = []
    finished = asyncio.Event()
    flow = None

    def on_deliver(d: Delivery) -> None:
        latencies.append(time.perf_counter() - float(d.message.payload[:20]))
        flow.ack(d.entry_id)
        in_flight.release()
        if len(latencies) >= n:
            finished.set()

    flow = await broker.bind(name, on_deliver, window=window)
    pad = b"x" * max(0, size - 20)
    in_flight = asyncio.Semaphore(2 * window)  # published but not yet delivered

    with Meter(redis_pid) as m:
        for _ in range(n):
            await in_flight.acquire()
            stamp = b"%20.6f" % time.perf_counter()
            broker.publish_nowait(Message(destination=name, to_queue=True, payload=stamp + pad))
        await finished.wait()
    await flow.close()
    await broker.delete_queue(name)
    latencies.sort()
    return {
        "wall": m.wall,
        "cpu_client": m.cpu[0],
        "cpu_redis": m.cpu[1],
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
    }


def summarise(runs: list[dict], n: int) -> dict:
    def med(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    out = {
        "msgs_per_s": med([n / r["wall"] for r in runs]),
        "cpu_us_per_msg": med([(r["cpu_client"] + r["cpu_redis"]) / n * 1e6 for r in runs]),
        "redis_cpu_us_per_msg": med([r["cpu_redis"] / n * 1e6 for r in runs]),
    }
    if "p50_ms" in runs[0]:
        out["p50_ms"] = med([r["p50_ms"] for r in runs])
        out["p99_ms"] = med([r["p99_ms"] for r in runs])
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
        redis_server = EmbeddedRedis(tmp, "everysec")
        redis_server.start()
        try:
            pid = redis_server.proc.pid  # type: ignore[union-attr]
            client = await library.connect(redis_server.url)
            broker = Broker(client)
            await broker.start()
            raw, engine = [], []
            for i in range(args.runs):  # interleaved so drift hits both alike
                raw.append(await run_raw(client, pid, args.messages, args.size))
                engine.append(await run_engine(broker, pid, args.messages, args.size, args.window))
                print(
                    f"run {i + 1}: raw {args.messages / raw[-1]['wall']:,.0f}/s, "
                    f"engine {args.messages / engine[-1]['wall']:,.0f}/s",
                    flush=True,
                )
            await broker.stop()
            await client.aclose()
        finally:
            redis_server.stop()
    result = {
        "messages": args.messages,
        "size": args.size,
        "window": args.window,
        "raw": summarise(raw, args.messages),
        "engine": summarise(engine, args.messages),
    }
    r, e = result["raw"], result["engine"]
    result["throughput_ratio"] = e["msgs_per_s"]["median"] / r["msgs_per_s"]["median"]
    result["cpu_ratio"] = e["cpu_us_per_msg"]["median"] / r["cpu_us_per_msg"]["median"]
    print(json.dumps(result, indent=1))
    print(
        f"engine reaches {result['throughput_ratio']:.0%} of raw Redis Streams throughput; "
        f"CPU per message {result['cpu_ratio']:.2f}x raw"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
