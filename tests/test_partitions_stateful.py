"""Stateful property test of partitioned queues against a real Redis.

Random publish / bind / unbind / ack / crash sequences on two gateway nodes. Checked after
every delivery: no two flows hold unacked messages of one key, and each key's messages reach
a holder in publish order. Checked at the end: nothing is lost, and once quiet every
partition has exactly one owner among the live flows.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
import redis
import uvloop
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from gateway.broker import Broker
from gateway.engine import keys, library
from gateway.engine.flows import Flow
from gateway.engine.partitions import PartitionMap
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message

pytestmark = pytest.mark.slow

KEYS = ["a", "b", "c", "d", "e"]
QUEUE = "pq"


class PartitionMachine(RuleBasedStateMachine):
    url = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = uvloop.new_event_loop()
        redis.Redis.from_url(self.url).flushall()
        self.nodes: list[Broker | None] = [None, None]
        self.flows: list[tuple[int, Flow]] = []  # (node slot, flow)
        self.published: dict[str, int] = defaultdict(int)  # key -> last seq
        self.acked: dict[str, int] = defaultdict(int)  # key -> highest seq acked in order
        self.held: dict[Flow, list[tuple[str, int, str]]] = {}  # unacked, delivery order
        self.violations: list[str] = []
        self.dead: list[Broker] = []  # crashed nodes: closed at the end
        self.run(self._start())

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def _node(self) -> Broker:
        client = await library.connect(self.url)
        node = Broker(client, heartbeat=0.1, node_ttl=0.5)
        await node.start()
        return node

    async def _start(self) -> None:
        self.nodes = [await self._node(), await self._node()]
        await self.nodes[0].declare_queue(
            QueueConfig(
                name=QUEUE,
                partition_count=3,
                partition_rebalance_delay_ms=0,
                partition_handoff_timeout_ms=600_000,  # handoffs end by settling
            )
        )

    async def _settle(self, seconds: float = 0.05) -> None:
        await asyncio.sleep(seconds)

    def _holder_of(self, key: str) -> Flow | None:
        for flow, items in self.held.items():
            if any(k == key for k, _, _ in items):
                return flow
        return None

    def _on_deliver(self, flow: Flow, d: Delivery) -> None:
        key = d.message.partition_key
        seq = int(d.message.payload)
        holder = self._holder_of(key)
        if holder is not None and holder is not flow:
            self.violations.append(f"{key}:{seq} to {flow.id} while {holder.id} holds the key")
        mine = [s for k, s, _ in self.held[flow] if k == key]
        expected = (mine[-1] if mine else self.acked[key]) + 1
        if seq != expected:
            self.violations.append(f"{key}:{seq} to {flow.id}, expected {key}:{expected}")
        self.held[flow].append((key, seq, d.entry_id))

    @initialize(window=st.integers(1, 3))
    def start_busy(self, window: int) -> None:
        """Start with a backlog and one consumer, so every later bind moves partitions."""
        for key in KEYS:
            self.publish(key, 3, 0)
        self.bind(0, window)

    @rule(key=st.sampled_from(KEYS), count=st.integers(1, 4), slot=st.integers(0, 1))
    def publish(self, key: str, count: int, slot: int) -> None:
        async def go() -> None:
            for _ in range(count):
                self.published[key] += 1
                msg = Message(
                    destination=QUEUE,
                    to_queue=True,
                    partition_key=key,
                    payload=b"%d" % self.published[key],
                )
                assert (await self.nodes[slot].publish(msg)).accepted
            await self._settle()

        self.run(go())

    @rule(slot=st.integers(0, 1), window=st.integers(1, 4))
    def bind(self, slot: int, window: int) -> None:
        if len(self.flows) >= 5:
            return

        self.run(self._bind(slot, window))

    async def _bind(self, slot: int, window: int) -> None:
        box: list[Flow] = []
        flow = await self.nodes[slot].bind(
            QUEUE, lambda d: self._on_deliver(box[0], d), window=window
        )
        box.append(flow)
        self.held[flow] = []
        self.flows.append((slot, flow))
        await self._settle()

    @rule(data=st.data())
    def unbind(self, data: st.DataObject) -> None:
        if not self.flows:
            return
        slot, flow = data.draw(st.sampled_from(self.flows))

        async def go() -> None:
            self.flows.remove((slot, flow))
            del self.held[flow]  # its unacked messages go back to the queue
            await flow.close()
            await self._settle()

        self.run(go())

    @rule(data=st.data(), n=st.integers(1, 4))
    def ack(self, data: st.DataObject, n: int) -> None:
        if not self.flows:
            return
        _, flow = data.draw(st.sampled_from(self.flows))

        async def go() -> None:
            for key, seq, entry_id in self.held[flow][:n]:
                flow.ack(entry_id)
                self.acked[key] = max(self.acked[key], seq)
            del self.held[flow][:n]
            await self._settle()

        self.run(go())

    @rule(slot=st.integers(0, 1))
    def crash(self, slot: int) -> None:
        """The node dies without a word; a new node takes its slot."""

        async def go() -> None:
            node = self.nodes[slot]
            node.liveness._task.cancel()
            await node.events.stop()
            for s, flow in [f for f in self.flows if f[0] == slot]:
                flow.closed = True  # a dead process delivers nothing more
                self.flows.remove((s, flow))
                del self.held[flow]
            await node.redis.delete(keys.node_alive(node.node_id))  # its TTL ran out
            self.dead.append(node)
            self.nodes[slot] = await self._node()
            await self._settle(0.4)

        self.run(go())

    @invariant()
    def no_violation(self) -> None:
        assert self.violations == []

    def teardown(self) -> None:
        async def drain() -> None:
            # quiescence: the live consumers (at least one) ack everything
            if not self.flows:
                await self._bind(0, 4)
            await self._settle(0.3)
            for _ in range(200):
                for _, flow in self.flows:
                    for key, seq, entry_id in self.held[flow]:
                        flow.ack(entry_id)
                        self.acked[key] = max(self.acked[key], seq)
                    self.held[flow].clear()
                if self.flows and all(self.acked[k] == self.published[k] for k in KEYS):
                    break
                await asyncio.sleep(0.05)
            assert dict(self.acked) == dict(self.published), "nothing lost"
            pmap = PartitionMap.from_reply(
                await self.nodes[0].redis.fcall("gw_partitions", 0, QUEUE)
            )
            live = {f.id for _, f in self.flows}
            assert all(owner in live for owner in pmap.owners), pmap
            for node in self.nodes:
                await node.stop()
                await node.redis.aclose()
            for node in self.dead:
                await node.redis.aclose()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.run(drain())
            assert self.violations == []
        finally:
            self.loop.close()


def test_partitioned_queue_state_machine(redis_server) -> None:
    PartitionMachine.url = redis_server.url
    run_state_machine_as_test(
        PartitionMachine,
        settings=settings(
            max_examples=15,
            stateful_step_count=15,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
