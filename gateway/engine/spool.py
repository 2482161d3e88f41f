"""The publish path: group commit of spools into one Redis function call per batch.

Publishes from every connection that arrive while the previous batch is in flight (or in
the same event-loop turn) go to Redis together, in one `gw_spool` call that checks quotas,
fans each message out to its queues and returns an outcome per message. The caller acks
its publisher only when its future resolves, so nothing is acked before it is stored.
One batch is in flight at a time, which keeps each publisher's messages in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.engine.partitions import key_hash
from gateway.model import Outcome

MAX_BATCH_MESSAGES = 512
MAX_BATCH_BYTES = 4 * 1024 * 1024
FLOW_CONTROL_RETRY = 0.05  # seconds between offers of flow-controlled messages
_OUTCOMES = tuple(Outcome)  # by code: indexing costs a tenth of Outcome(code)


@dataclass(slots=True)
class _Pending:
    """One message waiting for the next batch (see `Spooler.submit` for the fields)."""

    queues: Iterable[str]
    direct: bool
    size: int
    key: str | None
    expires: int | None
    props: str
    priority: int
    not_before: int | None
    blob: bytes
    future: asyncio.Future


class Spooler:
    """Batches spool requests; `on_spooled(queues)` tells local flows there is work."""

    def __init__(
        self,
        redis: aioredis.Redis,
        node_id: str,
        on_spooled: Callable[[set[str]], None] | None = None,
    ) -> None:
        self._redis = redis
        self._node = node_id
        self._on_spooled = on_spooled
        self._pending: list[_Pending] = []
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.messages = 0  # stored (outcome OK)
        self.refused: dict[str, int] = {}  # outcome name (or redis_error) -> count
        self._held: list[_Pending] = []  # refused by producer flow control, retried
        # the client's loop, kept: asyncio.get_running_loop() costs a getpid() system call
        self._loop: asyncio.AbstractEventLoop | None = None
        self.flow_controlled = 0

    def submit(
        self,
        queues: Iterable[str],
        direct: bool,
        size: int,
        key: str | None,
        expires: int | None,
        props: str,
        priority: int,
        not_before: int | None,
        blob: bytes,
    ) -> asyncio.Future[Outcome]:
        """Queue one message for the next batch; the future carries its Outcome.
        `key` (the partition key) picks the partition, or the message group; `expires`
        (epoch ms) is when it may no longer be delivered; `props` carries the properties
        last value and sorted queues key on (Router.spool_properties); `priority` (0-9)
        picks the level of a priority queue; `not_before` (epoch ms) holds it invisible
        until then."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[Outcome] = loop.create_future()
        self._pending.append(
            _Pending(queues, direct, size, key, expires, props, priority, not_before, blob, fut)
        )
        if self._task is None:
            self._task = loop.create_task(self._run())
        return fut

    async def _run(self) -> None:
        try:
            await asyncio.sleep(0)  # let the rest of this turn's publishes join the batch
            while self._pending:
                batch = self._take_batch()
                try:
                    await self._flush(batch)
                except Exception as exc:  # Redis unreachable: refuse, never ack
                    self.refused["redis_error"] = self.refused.get("redis_error", 0) + len(batch)
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(exc)
        finally:
            self._task = None
            if self._pending:  # raced with a submit during the finally
                self._task = asyncio.get_running_loop().create_task(self._run())

    def _take_batch(self) -> list[_Pending]:
        pending = self._pending
        total = 0
        for i, p in enumerate(pending):
            total += len(p.blob)
            if i + 1 >= MAX_BATCH_MESSAGES or total >= MAX_BATCH_BYTES:
                batch, self._pending = pending[: i + 1], pending[i + 1 :]
                return batch
        self._pending = []
        return pending

    async def _flush(self, batch: list[_Pending]) -> None:
        index: dict[str, int] = {}
        body: list[object] = []
        for p in batch:
            idx = []
            for q in p.queues:
                i = index.get(q)
                if i is None:
                    i = index[q] = len(index) + 1
                idx.append(i)
            body.append(len(idx))
            body += idx
            body += (
                1 if p.direct else 0,
                p.size,
                *key_hash(p.key),
                p.key or "",
                p.expires or 0,
                p.props,
                p.priority,
                p.not_before or 0,
                p.blob,
            )
        codes = await self._redis.fcall("gw_spool", 0, self._node, len(index), *index.keys(), *body)
        self.batches += 1
        stored: set[str] = set()
        held: list[_Pending] = []
        for p, code in zip(batch, codes, strict=False):
            outcome = _OUTCOMES[code]
            if outcome is Outcome.FLOW_CONTROLLED:
                held.append(p)  # the publisher's ack waits until the queue drains
                continue
            if outcome is Outcome.OK:
                stored.update(p.queues)
                self.messages += 1
            elif outcome is not Outcome.NO_SUBSCRIBERS:
                name = outcome.name.lower()
                self.refused[name] = self.refused.get(name, 0) + 1
            if not p.future.done():
                p.future.set_result(outcome)
        if stored and self._on_spooled is not None:
            self._on_spooled(stored)
        if held:
            self.flow_controlled += len(held)
            if not self._held:
                asyncio.get_running_loop().call_later(FLOW_CONTROL_RETRY, self._retry_held)
            self._held.extend(held)

    def _retry_held(self) -> None:
        """Offer flow-controlled messages again, ahead of newer ones (order per publisher)."""
        self._pending[:0], self._held = self._held, []
        if self._task is None and self._pending:
            self._task = asyncio.get_running_loop().create_task(self._run())
