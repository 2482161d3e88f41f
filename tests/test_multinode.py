"""Several gateway processes on one Redis: competing consumers and exclusive failover."""

from __future__ import annotations

import asyncio

import pytest

from gateway.broker import Broker
from gateway.engine.queues import QueueConfig
from gateway.model import Message
from tests.processes import NODE_DRIVER, Proc, node_env

pytestmark = pytest.mark.slow


async def start_consumer(redis_url: str, queue: str, **opts: object) -> Proc:
    argv = [*NODE_DRIVER, "--redis-url", redis_url, "--queue", queue]
    for key, value in opts.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    node = await Proc.start(argv, node_env(ttl=1.0))
    await node.wait_event("bound")
    return node


async def collect(nodes: dict[str, Proc], out: dict[str, list[dict]], until, timeout: float):
    """Read deliveries of every node into `out` until `until()` or the timeout."""

    async def reader(name: str) -> None:
        while True:
            line = await nodes[name].next_line(timeout)
            if line.get("event") == "delivered":
                out[name].append(line)

    tasks = [asyncio.ensure_future(reader(name)) for name in nodes]
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        while not until() and asyncio.get_running_loop().time() < deadline:
            if all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_competing_consumers_on_two_nodes(redis_url: str, broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="work"))
    a = await start_consumer(redis_url, "work")
    b = await start_consumer(redis_url, "work")
    try:
        n = 2000
        await asyncio.gather(
            *[
                broker.publish_nowait(Message(destination="work", to_queue=True, payload=b"%d" % i))
                for i in range(n)
            ]
        )
        got: dict[str, list[dict]] = {"a": [], "b": []}
        await collect({"a": a, "b": b}, got, lambda: len(got["a"]) + len(got["b"]) >= n, 30)
        await asyncio.sleep(0.3)  # anything delivered twice would show up now
        await collect({"a": a, "b": b}, got, lambda: False, 0.3)
        got_a, got_b = got["a"], got["b"]
        payloads = [d["payload"] for d in got_a + got_b]
        assert len(payloads) == n, "every message delivered"
        assert len(set(payloads)) == n, "no message delivered twice"
        assert got_a and got_b, "both nodes consumed"
        assert not any(d["redelivered"] for d in got_a + got_b)
    finally:
        await a.stop()
        await b.stop()
    assert (await broker.queues.info("work")).messages == 0


async def test_exclusive_queue_fails_over_to_other_node_in_order(
    redis_url: str, broker: Broker
) -> None:
    await broker.queues.create(QueueConfig(name="excl", access_type="exclusive"))
    n = 1000
    await asyncio.gather(
        *[
            broker.publish_nowait(Message(destination="excl", to_queue=True, payload=b"%04d" % i))
            for i in range(n)
        ]
    )
    # the active flow acks 300 messages, then hangs holding a full window
    active = await start_consumer(redis_url, "excl", window=10, ack_limit=300)
    assert active.lines[-1]["active"] is True
    standby = await start_consumer(redis_url, "excl", window=10)
    assert standby.lines[-1]["active"] is False
    got: dict[str, list[dict]] = {"a": [], "b": []}
    got_a, got_b = got["a"], got["b"]
    everything = {f"{i:04d}" for i in range(n)}
    try:
        await collect({"a": active}, got, lambda: len(got_a) >= 310, 30)
        assert len(got_a) == 310
        active.kill()  # SIGKILL: no clean shutdown, its flow must be reaped
        await active.proc.wait()
        seen = {d["payload"] for d in got_a}
        await collect(
            {"b": standby}, got, lambda: seen | {d["payload"] for d in got_b} >= everything, 30
        )
    finally:
        active.kill()
        await standby.stop()
    a_seq = [int(d["payload"]) for d in got_a]
    b_seq = [int(d["payload"]) for d in got_b]
    assert a_seq == list(range(len(a_seq))), "the active flow got the queue in order"
    info = await broker.queues.info("excl")
    assert b_seq, f"the standby took over ({info}); its log:\n{standby.stderr_tail()}"
    assert b_seq == list(range(b_seq[0], n)), "the standby continues in order, nothing lost"
    assert b_seq[0] <= a_seq[-1] + 1, "no gap between the two flows"
    for d in got_b:
        if int(d["payload"]) <= a_seq[-1]:
            assert d["redelivered"] and d["count"] >= 2, "unacked messages come back marked"
    assert (await broker.queues.info("excl")).messages == 0
