"""Node liveness and ownership across nodes.

Each node keeps a liveness key with a short TTL. Every node periodically reaps nodes whose
key expired: their flows' unacked messages return to their queues and their temporary
queues are deleted, all in one function call. Exclusive-queue leases are checked at the same
pace, so a standby on another node takes over within about one TTL of the holder dying.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.engine import keys, library
from gateway.engine.flows import Dispatcher

log = logging.getLogger(__name__)


def new_node_id() -> str:
    """Node ids never contain '.', which separates them from the flow number in flow ids."""
    return "n" + os.urandom(5).hex()


class NodeLiveness:
    """Heartbeat, reaper and lease checks for one node."""

    def __init__(
        self,
        redis: aioredis.Redis,
        dispatcher: Dispatcher,
        node_id: str,
        *,
        interval: float = 1.0,
        ttl: float = 5.0,
    ) -> None:
        self._redis = redis
        self._dispatcher = dispatcher
        self.node_id = node_id
        self.interval = interval
        self.ttl_ms = int(ttl * 1000)
        self._task: asyncio.Task | None = None
        self.reaped = 0
        self.last_beat = 0.0  # when the latest beat Redis took was sent (monotonic)

    def presumed_alive(self) -> bool:
        """Whether other nodes still count this node alive: its latest beat renewed its
        liveness key less than a TTL ago. Past that they take its flows over."""
        return time.monotonic() - self.last_beat < self.ttl_ms / 1000

    async def outlived(self, flows: Callable[[], Awaitable[list[str]]]) -> list[str]:
        """The flows `flows()` lists once those of crashed nodes are gone: a node killed
        holds its flows until its liveness key expires and a reaper releases them. Waits
        for that while no node of them renews its key, so a client reconnecting after a
        crash is not refused for its own dead link; a live node's flows are returned at
        its next beat, this node's at once."""
        last: dict[str, int] = {}  # node -> its liveness key's ms to live, as last read
        expired: dict[str, float] = {}  # node -> when its key was first seen gone
        while listed := await flows():
            nodes = sorted({flow.partition(".")[0] for flow in listed})
            if self.node_id in nodes:
                return listed
            pipe = self._redis.pipeline(transaction=False)
            for node in nodes:
                pipe.pttl(keys.node_alive(node))
            now = time.monotonic()
            for node, left in zip(nodes, await pipe.execute(), strict=True):
                if left == -2:  # expired: a reaper releases its flows at its next beat
                    if now - expired.setdefault(node, now) > 3 * self.interval:
                        return listed  # not reaped (Redis's grace after a restart)
                elif left < 0 or left > last.get(node, left):  # renewed: it beats
                    return listed
                else:
                    last[node] = left
            await asyncio.sleep(self.interval / 2)
        return []

    async def start(self) -> None:
        await self._redis.fcall("gw_node_up", 0, self.node_id, self.ttl_ms)
        await self.beat()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, tell_redis: bool = True) -> None:
        """Clean shutdown: other nodes need not wait for the TTL to take over (unless
        Redis is not told: they take over once the liveness key expires)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if tell_redis:
            await self._redis.fcall("gw_node_down", 0, self.node_id)

    async def beat(self) -> None:
        """Refresh our liveness, release dead nodes' flows, re-check standby leases."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.fcall("gw_node_up", 0, self.node_id, self.ttl_ms)  # it runs while Redis is full
        pipe.fcall("gw_reap", 0)
        sent = time.monotonic()
        replies = await library.replies(pipe)
        self.last_beat = sent
        released = replies[1]
        if released:
            self.reaped += int(released)
            log.info("released %s flows of dead nodes", released)
        for queue in self._dispatcher.exclusive_standby_queues():
            await self._dispatcher.check_lease(queue)
        for queue in self._dispatcher.partitioned_queues():  # handoff timeouts, dead owners
            self._dispatcher.request_rebalance(queue)

    async def _run(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(self.interval)
            ticks += 1
            try:
                await self.beat()
                if ticks % 10 == 0:  # pub/sub is at-most-once: poll idle flows now and then
                    self._dispatcher.wake_all()
            except asyncio.CancelledError:
                raise
            except RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
                if library.missing(exc):  # every call fails until it is loaded again
                    await self._load_library()
            except Exception:  # a fault of ours: told in full, and the heartbeat goes on
                log.exception("heartbeat failed")

    async def _load_library(self) -> None:
        """The node recovers by itself once Redis is back, even without its data."""
        try:
            await library.load(self._redis)
        except Exception as exc:
            log.warning("loading the function library again failed: %s", exc)
        else:
            log.warning("the function library was missing from Redis: loaded again")
