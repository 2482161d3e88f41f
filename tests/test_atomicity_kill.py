"""Crash atomicity of expiry, dead-letter moves and ring drops, checked at the Redis level.

Real `gateway serve --redis-url` processes take MQTT 5 publishes (paho) and feed an AMQP
consumer (python-qpid-proton) while the engine expires messages into the dead message
queue, moves them there after max_redelivery, or drops the oldest of a full ring queue.
A gateway (alone, beside a surviving second gateway, or with redis-server itself) is
SIGKILLed at a random moment of that work, several times; after each kill the streams and
counters in Redis are checked against what the clients know (tests/crash_ledger.py): no
message both moved and still queued, none vanished unaccounted, counters equal to the
streams' contents. A final clean drain shows nothing is stuck.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.broker import Broker
from gateway.engine import keys
from gateway.engine.queues import QueueConfig
from gateway.model import Message, Outcome
from tests.conftest import RedisServer
from tests.crash_clients import Consumer, Ledger, Policy, Publisher, payload
from tests.crash_ledger import account
from tests.processes import Proc, node_env, serve_argv

KILLS = 3
TOPIC = "atom/in"
BUSY_TIMEOUT = 15.0


@dataclass
class Scenario:
    """A queue configuration, a consumer's behaviour and the counter that shows the work."""

    queue: dict[str, Any]
    policy: Policy
    pause: float  # seconds the consumer spends per message
    rate: float  # messages a second from each publisher
    busy_counter: str  # grows while the engine does the work under test
    reasons: set[str]  # dead-letter reasons it may produce

    @property
    def name(self) -> str:
        return self.queue["name"]

    @property
    def dmq(self) -> str:
        return self.queue["dead_message_queue"]


def accept_all(_seq: int) -> str:
    return "accept"


def mostly_release(seq: int) -> str:
    """Most messages keep coming back until max_redelivery moves them; some are settled."""
    if seq % 5 == 0:
        return "accept"
    return "reject" if seq % 7 == 0 else "release"


EXPIRY = Scenario(
    {
        "name": "expiring",
        "max_ttl_ms": 60,
        "respect_ttl": True,
        "dmq_eligible_default": True,
        "dead_message_queue": "expiring.dmq",
    },
    accept_all,
    0.002,
    1500,
    "expired",
    {"expired"},
)
REDELIVERY = Scenario(
    {
        "name": "poison",
        "max_redelivery": 2,
        "dmq_eligible_default": True,
        "dead_message_queue": "poison.dmq",
    },
    mostly_release,
    0.0,
    300,
    "max_redelivered",
    {"max_redelivered", "rejected"},
)
RING = Scenario(
    {
        "name": "ring",
        "max_messages": 150,
        "overflow": "ring",
        "dead_message_queue": "ring.dmq",
    },
    accept_all,
    0.003,
    1500,
    "dropped",
    set(),
)


def admin_call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else None
    finally:
        conn.close()


async def start_gateway(redis_url: str, data_dir: Path) -> tuple[Proc, dict[str, Any]]:
    proc = await Proc.start(serve_argv(data_dir, "--redis-url", redis_url), node_env())
    try:
        ready = await proc.wait_event("ready", timeout=30)
    except BaseException:
        proc.kill()
        raise
    return proc, ready


async def declare(admin_port: int, scenario: Scenario) -> None:
    """Idempotent: every round declares the same queues again."""
    for body in ({"name": scenario.dmq}, {**scenario.queue, "subscriptions": [TOPIC]}):
        status, reply = await asyncio.to_thread(
            admin_call, admin_port, "POST", "/api/v1/queues", body
        )
        assert status in (200, 201), reply


def counter(r: redis.Redis, queue: str, name: str) -> int:
    return int(r.hget(keys.queue_stats(queue), name) or 0)


async def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@dataclass
class Node:
    """One gateway process and the clients connected to it."""

    gw: Proc
    node_id: str
    pubs: list[Publisher]
    consumer: Consumer

    async def stop_clients(self, *, ask: bool = False) -> None:
        """Wait for the clients to see their connections break (or `ask` them to stop)."""
        for t in [*self.pubs, self.consumer]:
            if ask:
                t.stop.set()
        for t in [*self.pubs, self.consumer]:
            await asyncio.to_thread(t.join, 15)
            assert not t.is_alive(), f"{t.name} did not stop"
        for p in self.pubs:
            assert p.error is None, p.error


class Run:
    """Gateways, clients and ledger of one scenario across its kill rounds."""

    def __init__(self, scenario: Scenario, redis_url: str, data_dir: Path) -> None:
        self.scenario = scenario
        self.redis_url = redis_url
        self.data_dir = data_dir
        self.ledger = Ledger()
        self.started = 0

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    async def start(self, publishers: int) -> Node:
        self.started += 1
        gw, ready = await start_gateway(self.redis_url, self.data_dir)
        try:
            await declare(ready["admin_port"], self.scenario)
            consumer = await asyncio.to_thread(
                Consumer,
                ready["amqp_port"],
                self.scenario.name,
                self.ledger,
                self.scenario.policy,
                pause=self.scenario.pause,
            )
            pubs = [
                await asyncio.to_thread(
                    Publisher,
                    ready["mqtt_port"],
                    TOPIC,
                    self.ledger,
                    f"pub-{self.started}-{i}",
                    self.scenario.rate,
                )
                for i in range(publishers)
            ]
        except BaseException:
            gw.kill()
            raise
        consumer.start()
        for p in pubs:
            p.start()
        return Node(gw, ready["node"], pubs, consumer)

    async def crash_round(self, kill: Callable[[Proc], None], publishers: int = 2) -> str:
        """Load a new gateway until the work under test runs, then `kill` at a random
        moment. Returns the killed node's id."""
        r = self.redis()
        busy = self.scenario.busy_counter
        before = counter(r, self.scenario.name, busy)
        node = await self.start(publishers)
        try:
            await wait_until(
                lambda: counter(r, self.scenario.name, busy) > before + 20,
                BUSY_TIMEOUT,
                f"{busy} to grow on {self.scenario.name}",
            )
            await asyncio.sleep(random.uniform(0.0, 0.5))
            kill(node.gw)
        finally:
            node.gw.kill()
            await node.gw.proc.wait()
            await node.stop_clients()
            r.close()
        return node.node_id

    async def drain(self, node: Node | None = None) -> None:
        """Publishing stops; the consumer of `node` (or of a new gateway) empties the queue;
        then a clean stop."""
        node = node or await self.start(publishers=0)
        r = self.redis()
        try:
            for p in node.pubs:
                p.stop.set()
            for p in node.pubs:
                await asyncio.to_thread(p.join, 10)
            for _ in range(2):  # again after a pause: publishes the gateway had read when
                await wait_until(  # the publisher closed its socket land late
                    lambda: counter(r, self.scenario.name, "msgs") == 0,
                    20,
                    f"{self.scenario.name} to drain",
                )
                await asyncio.sleep(0.5)
        finally:
            await node.stop_clients(ask=True)
            assert await node.gw.stop() == 0, node.gw.stderr_tail()
            r.close()

    def check_drained(self) -> None:
        """After a clean drain: nothing left, nothing discarded, no message delivered more
        often than max_redelivery allows (a move that failed to happen would show here)."""
        r = self.redis()
        try:
            stats = {k: counter(r, self.scenario.name, k) for k in ("msgs", "discarded")}
            moved = counter(r, self.scenario.name, "dead_lettered")
        finally:
            r.close()
        assert stats == {"msgs": 0, "discarded": 0}, stats
        assert (moved > 0) == bool(self.scenario.reasons), "moved to the dead message queue"
        limit = self.scenario.queue.get("max_redelivery", 0)
        if limit:
            most = max(self.ledger.delivered.values())
            assert most <= limit + 1, f"a message was delivered {most} times"

    def check(self, *, refusals_final: bool = True) -> None:
        r = self.redis()
        try:
            errors = account(
                r,
                self.scenario.name,
                self.scenario.dmq,
                self.ledger,
                self.scenario.reasons,
                refusals_final=refusals_final,
            )
        finally:
            r.close()
        assert not errors, "\n".join(errors)
        assert self.ledger.confirmed, "the gateway confirmed some publishes"


def sigkill(gw: Proc) -> None:
    gw.kill()


@pytest.mark.parametrize("scenario", [EXPIRY, REDELIVERY, RING], ids=lambda s: s.name)
async def test_sigkilled_gateway_leaves_every_message_in_one_place(
    scenario: Scenario, redis_url: str, tmp_path: Path
) -> None:
    run = Run(scenario, redis_url, tmp_path)
    for _ in range(KILLS):
        await run.crash_round(sigkill)
        run.check()
    await run.drain()
    run.check()
    run.check_drained()


@pytest.mark.parametrize("scenario", [EXPIRY, REDELIVERY, RING], ids=lambda s: s.name)
async def test_a_surviving_gateway_takes_over_with_every_message_in_one_place(
    scenario: Scenario, redis_url: str, tmp_path: Path
) -> None:
    """Two gateways share Redis. One is SIGKILLed mid-work while the other keeps publishing,
    consuming and moving; the survivor's reaper then returns the dead node's unsettled
    messages to the queue. Checked live, in one transaction, before and after the reap."""
    run = Run(scenario, redis_url, tmp_path)
    survivor = await run.start(publishers=1)
    r = run.redis()
    try:
        for _ in range(KILLS):
            dead = await run.crash_round(sigkill, publishers=1)
            run.check()
            await wait_until(
                lambda dead=dead: not r.sismember(keys.nodes, dead), 10, "the dead node's reap"
            )
            run.check()
    except BaseException:
        survivor.gw.kill()
        raise
    finally:
        r.close()
    await run.drain(survivor)
    run.check()
    run.check_drained()


@pytest.mark.parametrize("scenario", [EXPIRY, REDELIVERY, RING], ids=lambda s: s.name)
async def test_sigkilled_redis_restarts_from_its_aof_with_whole_moves(
    scenario: Scenario, tmp_path: Path
) -> None:
    """redis-server dies mid-batch (appendfsync always): every move is whole after replay."""
    server = RedisServer(tmp_path / "redis")
    (tmp_path / "redis").mkdir()
    server.start()

    def always() -> None:
        client = redis.Redis(port=server.port)
        client.config_set("appendfsync", "always")
        client.close()

    always()
    run = Run(scenario, server.url, tmp_path / "gw")

    def kill_redis(_gw: Proc) -> None:
        server.stop(kill=True)

    try:
        for _ in range(KILLS):
            await run.crash_round(kill_redis)
            server.start()  # replays the AOF
            always()
            run.check(refusals_final=False)  # a reply lost with Redis: stored yet refused
        await run.drain()
        run.check(refusals_final=False)
        run.check_drained()
    finally:
        server.stop()


async def test_the_check_sees_a_half_move_and_a_vanished_message(
    broker: Broker, redis_url: str
) -> None:
    """The invariant check itself: a copy left behind and a silent delete are both caught."""
    await broker.declare_queue(QueueConfig(name="q.dmq"))
    await broker.declare_queue(QueueConfig(name="q", dead_message_queue="q.dmq"))
    ledger = Ledger()
    for seq in range(3):
        msg = Message(destination="q", to_queue=True, payload=payload(seq))
        assert await broker.publish(msg) is Outcome.OK
        ledger.sent.add(seq)
        ledger.confirmed.add(seq)
    r = redis.Redis.from_url(redis_url)
    try:
        assert account(r, "q", "q.dmq", ledger, {"expired"}) == []
        (_, first), (second_id, _) = r.xrange(keys.queue_stream("q"), count=2)
        # a move whose delete from the origin was lost: counters say moved, the entry stays
        r.xadd(keys.queue_stream("q.dmq"), {**first, "o": "q", "r": "expired"})
        r.hincrby(keys.queue_stats("q.dmq"), "msgs", 1)
        r.hincrby(keys.queue_stats("q.dmq"), "bytes", len(first[b"m"]))
        r.hincrby(keys.queue_stats("q.dmq"), "spooled", 1)
        r.hincrby(keys.queue_stats("q"), "dead_lettered", 1)
        errors = account(r, "q", "q.dmq", ledger, {"expired"})
        assert any("both in q and in q.dmq" in e for e in errors), errors
        # a message deleted without a trace: moved nowhere, counted nowhere
        r.xdel(keys.queue_stream("q"), second_id)
        errors = account(r, "q", "q.dmq", ledger, {"expired"})
        assert any("vanished" in e for e in errors), errors
        assert any("stats msgs" in e for e in errors), errors
    finally:
        r.close()
