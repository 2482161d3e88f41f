"""The publish path: group commit of spools into one Redis function call per batch.

Publishes from every connection that arrive in the same event-loop turn (or while the
batches in flight fill the pipeline) go to Redis together, in one `gw_spool` call that
checks quotas, fans each message out to its queues and returns an outcome per message.
The caller acks its publisher only when its future resolves, so nothing is acked before it
is stored. Up to MAX_IN_FLIGHT batches are in flight on one connection (OrderedCalls):
Redis runs them in the order sent, which keeps each publisher's messages in order, and the
node no longer waits a round trip between batches (1 MQTT QoS 1 pair: +30 % msg/s).
While Redis is over its maxmemory it refuses gw_spool whole, before it runs (and nothing
else, see functions.lua): each message of such a batch is OUT_OF_MEMORY, NACKed like a
quota refusal.
While a local consumer of a queue the next batch goes to is behind (`Pacing.behind_on`), one
batch at a time: publishers are acked at about the pace the consumers take messages, so the
queue does not fill for as long as they publish faster (4 KiB MQTT QoS 1, 1 pair: p50 229 ->
9 ms at the same msg/s). Publishers to other queues keep the pipeline.
That alone keeps a backlog from growing, not from staying: when the node is the busy side,
publishers and consumers share its CPU and a backlog built once stays for the rest of the
run (AMQP durable queue, 1 pair: p50 ~1.5 s in a short run, 143 ms in a long one). So a
paced batch also waits, up to MAX_HOLD, for the behind consumers of its queues to catch up
while they are still taking messages (Pacing.catch_up; a stalled consumer holds no one):
the backlog drains (same workload: p50 14 ms at the same msg/s and CPU per message).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError

from gateway.engine.library import IN_PLACE_BYTES
from gateway.engine.ordered_calls import NotSent, OrderedCalls, broke
from gateway.engine.partitions import key_hash
from gateway.model import Outcome, SpoolMark

log = logging.getLogger(__name__)

MAX_BATCH_MESSAGES = 512
# Redis runs a batch's function call whole, with the fetches and settles sent after it
# waiting: a batch of 512 messages of 4 KiB (2 MB) kept consumers waiting ~13 ms, and a
# backlog built (8 MQTT QoS 1 pairs: p50 100-250 ms); at 128 KiB a batch, 20-50 ms.
MAX_BATCH_BYTES = 128 * 1024
# A batch with this many bytes of long messages writes them from their own buffers
# (library.pack_in_place) instead of copying them into one new one; below it, hiredis packs
# faster.
IN_PLACE_BATCH_BYTES = 64 * 1024
MAX_IN_FLIGHT = 4  # batches sent and not yet answered (2 measured as good; 8 no better)
# How long a paced batch waits for the behind consumers of its queues to catch up (see
# the module docstring).
MAX_HOLD = 0.005  # seconds
FLOW_CONTROL_RETRY = 0.05  # seconds between offers of flow-controlled messages
_OUTCOMES = tuple(Outcome)  # by code: indexing costs a tenth of Outcome(code)


STOPPED = NotSent("the node stopped before storing it")


class InDoubt(RedisConnectionError):
    """The connection to Redis broke after the message's batch was sent: it may be stored
    (a publisher must not be told it was not)."""


# One message waiting for the next batch: the arguments of `Spooler.submit`, then its future
# (None when it has a callback), its callback (None when it has a future) and its mark. A
# plain tuple: a dataclass instance per message costs measurably more on the publish path.
_Pending = tuple[
    Collection[str],
    "Mapping[str, str] | None",
    int,
    "str | None",
    "int | None",
    str,
    int,
    "int | None",
    bytes,
    "asyncio.Future | None",
    "Done | None",
    "SpoolMark | None",
]
Done = Callable[["Outcome | BaseException"], None]
_BLOB, _FUTURE, _DONE, _MARK = 8, 9, 10, 11


class Pacing(Protocol):
    """Tells the spooler whether the local consumers of some queues are behind."""

    def behind_on(self, queues: Iterable[str]) -> bool: ...

    async def catch_up(self, queues: Callable[[], Iterable[str]], limit: float) -> None: ...


class Spooler:
    """Batches spool requests; `on_spooled(queues)` tells local flows there is work."""

    def __init__(
        self,
        redis: aioredis.Redis,
        node_id: str,
        on_spooled: Callable[[set[str]], None] | None = None,
        pacing: Pacing | None = None,
    ) -> None:
        self._calls = OrderedCalls(redis)
        self._node = node_id
        self._on_spooled = on_spooled
        self._pacing = pacing
        self._pending: list[_Pending] = []
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.messages = 0  # stored (outcome OK)
        self.refused: dict[str, int] = {}  # outcome name (or redis_error) -> count
        self._held: list[_Pending] = []  # refused by producer flow control, retried
        self._retry_due = False  # the held messages are to be offered again
        self._retrying = 0  # held messages offered again still first in _pending
        self._retry: asyncio.TimerHandle | None = None  # when they are
        self._closed = False
        # the client's loop, kept: asyncio.get_running_loop() costs a getpid() system call
        self._loop: asyncio.AbstractEventLoop | None = None
        self.flow_controlled = 0
        self.redis_full = False  # the last batch was refused: Redis is over its maxmemory
        self._marked = 0  # marked messages pending or held: batches look for them

    def submit(
        self,
        queues: Collection[str],
        routed_by: Mapping[str, str] | None,
        size: int,
        key: str | None,
        expires: int | None,
        props: str,
        priority: int,
        not_before: int | None,
        blob: bytes,
        done: Done | None = None,
        mark: SpoolMark | None = None,
    ) -> asyncio.Future[Outcome] | None:
        """Queue one message for the next batch; the future carries its Outcome, or, when
        `done` is given, no future is made and `done(outcome)` (or `done(exception)` when
        Redis failed) is called once the batch is answered.
        `key` (the partition key) picks the partition, or the message group; `expires`
        (epoch ms) is when it may no longer be delivered; `props` carries the properties
        last value and sorted queues key on (Router.spool_properties); `priority` (0-9)
        picks the level of a priority queue; `not_before` (epoch ms) holds it invisible
        until then; `mark` (SpoolMark) is recorded in the same step as the message is stored,
        and a message whose mark is recorded already is not stored again (an MQTT QoS 2
        publish resent after its answer was lost), until a later connection starts a new
        session."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[Outcome] | None = None if done is not None else loop.create_future()
        pending: _Pending = (
            queues, routed_by, size, key, expires, props, priority, not_before, blob, fut, done,
            mark,
        )  # fmt: skip
        if self._closed:
            _resolve(pending, STOPPED)
            return fut
        self._pending.append(pending)
        if mark is not None:
            self._marked += 1
        if self._task is None:
            self._task = loop.create_task(self._run())
        return fut

    async def _run(self) -> None:
        try:
            await asyncio.sleep(0)  # let the rest of this turn's publishes join the batch
            while self._pending or (self._retry_due and self._held):
                if self._retry_due and self._held and not self._retrying:
                    # with nothing in flight, every refusal is in: the held list is whole
                    await self._calls.wait_below(1)
                    await self._offer_held()
                if self._retrying:  # the held ones go first, in batches of the usual size
                    await self._calls.wait_below(MAX_IN_FLIGHT)
                    if not self._retrying:
                        continue  # closed meanwhile
                    batch, long_bytes = self._take_batch(self._retrying)
                    self._retrying -= len(batch)
                    call = self._call(batch)
                else:
                    pacing = self._pacing
                    paced = pacing is not None and pacing.behind_on(self._next_queues())
                    # meanwhile the batch grows
                    await self._calls.wait_below(1 if paced else MAX_IN_FLIGHT)
                    if pacing is not None and paced:
                        await pacing.catch_up(self._next_queues, MAX_HOLD)
                    if not self._pending:
                        continue
                    batch, long_bytes = self._take_batch()
                    call = self._call(batch)
                await self._calls.send(
                    lambda reply, batch=batch: self._answered(batch, reply),
                    "FCALL",
                    *call,
                    in_place=long_bytes >= IN_PLACE_BATCH_BYTES,
                )
        finally:
            self._task = None
            if self._pending or (self._retry_due and self._held):  # raced with the finally
                self._task = asyncio.get_running_loop().create_task(self._run())

    async def _offer_held(self) -> None:
        """Put the held messages first, to go in the next batches, once the node's marks on
        their queues are cleared (in the same order of calls): each is judged afresh, and
        one held again marks its queue again, holding the later ones behind it."""
        queues = sorted({q for p in self._held for q in p[0]})
        self._retrying = len(self._held)
        self._pending[:0], self._held = self._held, []
        self._retry_due = False
        await self._calls.send(_cleared, "FCALL", "gw_flow_held_clear", 0, self._node, *queues)

    async def close(self) -> None:
        """Drop the spool connection; batches still unanswered are refused, never acked,
        and so are the messages producer flow control holds or not yet sent: a stopped
        node stores nothing more (their publishers' connections are gone, unanswered, so
        they send them again)."""
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        unsent, self._pending, self._held = self._pending + self._held, [], []
        self._retrying = 0
        for p in unsent:
            _resolve(p, STOPPED)
        await self._calls.close()

    def _next_queues(self) -> Iterator[str]:
        """The queues of the messages the next batch takes, walked only as far as asked:
        pacing asks only while some consumer is behind, and stops at its first queue."""
        stored = 0
        for count, p in enumerate(self._pending, 1):
            yield from p[0]
            stored += len(p[_BLOB]) * len(p[0])
            if count >= MAX_BATCH_MESSAGES or stored >= MAX_BATCH_BYTES:  # as _batch_length
                return

    def _take_batch(self, most: int = MAX_BATCH_MESSAGES) -> tuple[list[_Pending], int]:
        """The next batch, of `most` messages at most, and the bytes of its long messages
        (see `_batch_length`)."""
        pending = self._pending
        count, long_bytes = self._batch_length(most)
        if count == len(pending):
            self._pending = []
            return pending, long_bytes
        self._pending = pending[count:]
        return pending[:count], long_bytes

    def _batch_length(self, most: int) -> tuple[int, int]:
        """How many pending messages the next batch takes, up to the batch limits or
        `most`, and the bytes of its long messages (IN_PLACE_BYTES or more). A message
        counts against MAX_BATCH_BYTES once per queue it goes to: Redis stores it in each
        (fan-out to 10 queues at 4 KiB: p99 365-490 -> 110-140 ms against counting it once)."""
        long_bytes = stored = 0
        most = min(most, MAX_BATCH_MESSAGES)
        for i, p in enumerate(self._pending):
            size = len(p[_BLOB])
            if size >= IN_PLACE_BYTES:
                long_bytes += size
            stored += size * len(p[0])
            if i + 1 >= most or stored >= MAX_BATCH_BYTES:
                return i + 1, long_bytes
        return len(self._pending), long_bytes

    def _call(self, batch: list[_Pending]) -> list[object]:
        """The function for the batch and its arguments: gw_spool_marked when a message
        of it has a mark (its set a key, its place and member an argument before the rest)."""
        args = self._arguments(batch)
        if not self._marked:
            return ["gw_spool", *args]
        marks = [(place, p[_MARK]) for place, p in enumerate(batch, 1) if p[_MARK] is not None]
        if not marks:
            return ["gw_spool", *args]
        self._marked -= len(marks)
        keys = [key for _, (ids, _, claims, _, state) in marks for key in (ids, claims, state)]
        places = " ".join(f"{place} {member} {claim}" for place, (_, member, _, claim, _) in marks)
        return ["gw_spool_marked", len(keys), *keys, places, *args[1:]]

    def _arguments(self, batch: list[_Pending]) -> list[object]:
        """gw_spool's arguments for the batch (numkeys first)."""
        named: dict[str, int] = {}  # the queues messages name
        # the queues topic subscriptions routed messages to, by the routes (one load of
        # them, alive in the batch) that did
        routed: dict[int, dict[str, int]] = {}
        names: list[str] = []
        body: list[object] = []
        append, extend = body.append, body.extend
        for queues, routed_by, size, key, expires, props, priority, not_before, blob, *_ in batch:
            direct = routed_by is None
            if direct:
                index = named
            else:
                index = routed.get(id(routed_by))
                if index is None:
                    index = routed[id(routed_by)] = {}
            idx = []
            for q in queues:
                i = index.get(q)
                if i is None:
                    made = None if direct else routed_by.get(q)
                    names.append(f"{q} {made}" if made else q)
                    i = index[q] = len(names)
                idx.append(i)
            if key is None and not expires and not props and not not_before:
                append(short_head(idx, direct, size, key_hash(None)[1], priority))
                append(blob)
                continue
            append(len(idx))
            extend(idx)
            extend(
                (
                    1 if direct else 0,
                    size,
                    *key_hash(key),
                    key or "",
                    expires or 0,
                    props,
                    priority,
                    not_before or 0,
                    blob,
                )
            )
        return [0, self._node, len(names), *names, *body]

    def _answered(self, batch: list[_Pending], reply: list[int] | BaseException) -> None:
        """gw_spool's outcome codes for the batch, or why Redis did not answer them."""
        if reply.__class__ is OutOfMemoryError:  # refused whole, before it ran: nothing stored
            self._full(True)
            self._settle(batch, [Outcome.OUT_OF_MEMORY] * len(batch))
            return
        if isinstance(reply, BaseException):  # Redis unreachable or refused: never ack
            self.refused["redis_error"] = self.refused.get("redis_error", 0) + len(batch)
            if broke(reply) and not isinstance(reply, NotSent):
                reply = InDoubt(f"{reply} (the message may be stored)")
            for p in batch:
                _resolve(p, reply)
            if self._on_spooled is not None:  # it may have run, its answer lost: what it
                self._on_spooled({q for p in batch for q in p[0]})  # stored is delivered
            return
        self.batches += 1
        if self.redis_full:
            self._full(False)
        self._settle(batch, reply)

    def refused_for_memory(self) -> None:
        """A publish refused for memory outside a batch (a retained message no queue took)."""
        self._full(True)
        self.refused["out_of_memory"] = self.refused.get("out_of_memory", 0) + 1

    def _full(self, full: bool) -> None:
        """Say once when Redis goes over its maxmemory (publishes are refused from then on)
        and once when a batch is stored again."""
        if full and not self.redis_full:
            log.warning(
                "Redis is over its maxmemory: publishes are refused until consumers free space"
            )
        elif not full:
            log.info("Redis has room again: publishes are stored")
        self.redis_full = full

    def _settle(self, batch: list[_Pending], codes: list[int]) -> None:
        """Tell each message's publisher its outcome; hold the flow-controlled ones."""
        stored: set[str] = set()
        held: list[_Pending] = []
        for p, code in zip(batch, codes, strict=False):
            outcome = _OUTCOMES[code]
            if outcome is Outcome.FLOW_CONTROLLED:
                held.append(p)  # the publisher's ack waits until the queue drains
                if p[_MARK] is not None:
                    self._marked += 1
                continue
            if outcome is Outcome.OK:
                stored.update(p[0])
                self.messages += 1
            elif outcome is not Outcome.NO_SUBSCRIBERS:
                name = outcome.name.lower()
                self.refused[name] = self.refused.get(name, 0) + 1
            _resolve(p, outcome)
        if stored and self._on_spooled is not None:
            self._on_spooled(stored)
        if held:
            self.flow_controlled += len(held)
            if not self._held and not self._retry_due and not self._closed:
                self._retry = asyncio.get_running_loop().call_later(
                    FLOW_CONTROL_RETRY, self._retry_held
                )
            self._held.extend(held)

    def _retry_held(self) -> None:
        """Offer the held messages again, ahead of newer ones (order per publisher; Redis
        holds back this node's newer messages to their queues until then)."""
        self._retry = None
        self._retry_due = True
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())


_HEAD_ONE_QUEUE = struct.Struct(">BIIBIIB")
_HEAD_END = struct.Struct(">BIIB")


def short_head(indexes: list[int], direct: bool, size: int, lo: int, priority: int) -> bytes:
    """gw_spool's short form of a message's fields, one binary argument before its blob
    (see functions.lua): hiredis packs each argument in ~80 ns, so five small numbers as
    one string save ~0.5 µs a message in the node (Redis: what the fewer argument strings
    save, the unpack in Lua costs)."""
    flag = 1 if direct else 0
    if len(indexes) == 1:
        return _HEAD_ONE_QUEUE.pack(0, 1, indexes[0], flag, size, lo, priority)
    return struct.pack(f">BI{len(indexes)}I", 0, len(indexes), *indexes) + _HEAD_END.pack(
        flag, size, lo, priority
    )


def _cleared(reply: object) -> None:
    """gw_flow_held_clear's answer. Refused, the marks stay: the held messages are held
    again, and offered again later."""
    if isinstance(reply, BaseException):
        log.info("clearing producer flow control marks failed: %s", reply)


def _resolve(p: _Pending, result: Outcome | BaseException) -> None:
    """Hand one message's outcome (or the batch's error) to its future or callback."""
    done = p[_DONE]
    if done is not None:
        try:
            done(result)
        except Exception:  # the publisher's problem: the rest of the batch is still told
            log.exception("spool callback failed")
        return
    fut = p[_FUTURE]
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)
