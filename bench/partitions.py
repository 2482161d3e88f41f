"""Partition rebalance and handoff latency on a real redis-server (AOF on, everysec).

    python bench/partitions.py [--trials 20]

rebalance: a second flow binds to a 2-partition queue whose first flow holds nothing;
    measured from the bind to the first delivery of the moved partition on the new flow.
handoff: the first flow holds an unacked message of the moving partition; measured from
    its ack to the first delivery of that partition on the new flow.
Both with partition_rebalance_delay_ms = 0 (the delay adds directly to the rebalance figure).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from gateway.broker import Broker
from gateway.engine import library
from gateway.engine.partitions import partition_of
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message
from gateway.redis_server import EmbeddedRedis


def moving_key() -> str:
    """A key of partition 1: the partition that moves to the second flow."""
    return next(f"k{i}" for i in range(1000) if partition_of(f"k{i}", 2) == 1)


async def trial(broker: Broker, name: str, hold: bool) -> float:
    await broker.declare_queue(
        QueueConfig(name=name, partition_count=2, partition_rebalance_delay_ms=0)
    )
    key = moving_key()
    first: list[Delivery] = []
    a = await broker.bind(name, first.append, window=10 if hold else 0)
    await broker.publish(Message(destination=name, to_queue=True, partition_key=key))
    arrived = asyncio.Event()
    if hold:  # a holds the moving partition's message; b waits for the handoff
        while not first:
            await asyncio.sleep(0.001)
        b = await broker.bind(name, lambda d: arrived.set(), window=10)
        await broker.publish(Message(destination=name, to_queue=True, partition_key=key))
        await asyncio.sleep(0.2)
        assert not arrived.is_set()
        start = time.perf_counter()
        a.ack(first[0].entry_id)
    else:  # a (window 0) holds nothing: the partition moves at once
        start = time.perf_counter()
        b = await broker.bind(name, lambda d: arrived.set(), window=10)
    await asyncio.wait_for(arrived.wait(), 10)
    elapsed = time.perf_counter() - start
    await a.close()
    await b.close()
    await broker.delete_queue(name)
    return elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
        server = EmbeddedRedis(tmp)
        server.start()
        try:
            client = await library.connect(server.url)
            broker = Broker(client)
            await broker.start()
            for label, hold in (
                ("rebalance (bind -> first delivery)", False),
                ("handoff (old owner's ack -> first delivery)", True),
            ):
                times = [await trial(broker, f"b{i}", hold) for i in range(args.trials)]
                times.sort()
                print(
                    f"{label}: p50 {statistics.median(times) * 1000:.1f} ms, "
                    f"max {times[-1] * 1000:.1f} ms over {args.trials} trials"
                )
            await broker.stop()
            await client.aclose()
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
