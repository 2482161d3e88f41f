"""Consumer flows: windows, batched fetches and settlements, exclusive access.

A flow is one consumer of one queue: a consumer in the queue's consumer group, named by a
flow id that starts with the node id (so a dead node's flows can be found and released).
The node's `Dispatcher` runs one pump task: each round sends the settlements (ack / requeue
/ reject) gathered since the last round and fetches, for flows that have window space and
may have work, asking for up to ROUND_MESSAGES messages in all, then hands the fetched
messages to the flows' callbacks. Settlements go before fetches so a requeued message is
seen by the next fetch. Rounds go out on one connection (OrderedCalls), so Redis runs them
in the order sent; up to MAX_ROUNDS_IN_FLIGHT rounds are in flight, and a flow with a fetch
in flight waits for its answer before it fetches again. A round is handed over once all its
replies are in: rounds of a few big fetches let each flow's batch go out soon after its own
answer, and the flow fetch again, instead of every flow waiting for the slowest of one round
holding them all (MQTT QoS 1, 8 pairs: p50 ~19 -> ~14 ms; fan-out to 10 queues: +15 %
msg/s), while flows with small windows (shared groups) still fetch many to a round.
A fetch whose answer is lost with the connection may have run: its flow fetches nothing
more until a later round, after the settlements sent before, asks Redis what the flow
holds that the node does not know (gw_recover) and hands that out first. The flow keeps
its id, so its unsettled messages, lease and partitions stay with it.

Exclusive queues: the earliest-bound flow on a live node holds the lease (with a fencing
token checked by every fetch); the others are standbys, promoted in bind order when the
lease moves (unbind, or the holder's node stops heartbeating).

Partitioned queues: flows bind to the parent; each partition (a hidden exclusive child
queue) is dispatched by the one flow Redis assigned it to (see partitions.py), so a flow
fetches from each partition it owns and its entry ids carry the partition ("2/1700-0").
A bind asks for a rebalance after the queue's rebalance delay, which coalesces bursts.

Sorted queues (`QueueConfig.sort_key`): a fetch takes the waiting messages lowest in the
queue's key order (see functions.lua). A browser pages through that order, its cursor a
place in it; it sees the messages waiting, not those delivered and not yet settled, and
one that arrives later with a key before its cursor as it arrives (gw_browse's late ones).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import struct
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.engine.keys import partition_queue, priority_queue, queue_flows
from gateway.engine.ordered_calls import OrderedCalls, broke, refused_for_now
from gateway.engine.partitions import PartitionMap, split_window
from gateway.engine.queues import PER_FLOW_DEFAULT
from gateway.engine.selection import matches
from gateway.model import DEAD_LETTER_REASON, ORIGIN_QUEUE, Delivery, Message, decode
from gateway.selectors import Selector, SelectorError, compile_selector

log = logging.getLogger(__name__)

FETCH_BATCH = 256
DEFAULT_WINDOW = 256
SELECT_SCAN = 1024  # a selector consumer considers this many of the oldest waiting messages
ROUND_MESSAGES = FETCH_BATCH  # a round's fetches stop once they ask for this many in all
# A flow competing with others of its queue fetches this many at first, twice as many after
# each fetch that came back full: a burst is dealt out in turns (one fetch of a whole burst
# gave it to one consumer), a backlog goes in big batches.
SHARE_START = 8
MAX_ROUNDS_IN_FLIGHT = 8
REBIND_RETRY = 0.5  # seconds between binds again while Redis is unreachable or egress off
# A behind consumer that neither fetched nor settled nor gave credit for this long is
# stalled (its window is full and stays full), not draining: publishers do not wait for it.
STALLED_AFTER = 0.05  # seconds
# A fetch Redis refuses (not a lost connection) is tried again after this long: a refusal
# that repeats (a damaged key) would otherwise spin the dispatcher, thousands of rounds a
# second.
FETCH_RETRY = 1.0  # seconds
# Held entries (delivery time to come) a browser keeps to see once due; at the limit its
# cursor stops at the next one until some are due.
MAX_HELD_BROWSED = 10_000
HELD_RECHECK = 0.01  # seconds: the least wait for a due one (Redis's clock may lag the node's)
# A grouped queue's consumer that found only others' groups in reach looks again after
# this long, doubled each time it still does, up to STARVED_RECHECK_MAX: one of its own
# comes in reach as the others take theirs or they expire, which wakes nobody.
STARVED_RECHECK = 0.05  # seconds
STARVED_RECHECK_MAX = 2.0

# gw_fetch adds this to a delivery count when the entry was acquired before without the
# delivery counting (see ACQUIRED in functions.lua)
ACQUIRED = 1 << 40

QUEUE_DELETED = "queue deleted"  # on_closed's reason when the flow's queue went

DeliverCallback = Callable[[Delivery], None]
ClosedCallback = Callable[[str], None]


class BindError(Exception):
    """A refused bind; `code`: not_found, egress_disabled, invalid_selector, unsupported."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


BIND_REFUSALS = {
    "noqueue": ("not_found", "queue does not exist"),
    "egress": ("egress_disabled", "queue has egress disabled"),
    "partitioned": (
        "unsupported",
        "browsing and selectors are not available on a partitioned queue",
    ),
    "grouped": ("unsupported", "selectors are not available on a message-group queue"),
    "prioritised": ("unsupported", "browsing and selectors are not available on a priority queue"),
}


class Flow:
    """One consumer's binding to a queue. Adapters settle through it and size its window."""

    __slots__ = (
        "_dispatcher",
        "active",
        "arrivals",
        "browse",
        "closed",
        "created",
        "credit",
        "cursor",
        "exclusive",
        "fence",
        "held",
        "held_timer",
        "id",
        "idle",
        "limit",
        "listed",
        "lost_at",
        "on_closed",
        "on_deliver",
        "on_empty",
        "partitioned",
        "parts",
        "prioritised",
        "queue",
        "recheck",
        "registered",
        "replay_since",
        "selector",
        "share",
        "starved",
        "turns",
        "unacked",
        "unmatched",
        "wakes",
        "window",
    )

    def __init__(
        self,
        dispatcher: Dispatcher,
        flow_id: str,
        queue: str,
        window: int,
        credit: int | None,
        on_deliver: DeliverCallback,
        on_closed: ClosedCallback | None,
    ) -> None:
        self._dispatcher = dispatcher
        self.id = flow_id
        self.queue = queue
        self.exclusive = False
        self.partitioned = False
        self.prioritised = False  # a priority queue: entry ids carry the level ("9/1700-0")
        self.parts: dict[int, str] = {}  # partition index -> fence, while this flow owns it
        self.idle: set[int] = set()  # owned partitions found empty since the last wake-up
        self.wakes = 0  # wake-ups so far: a fetch sent before the last one finds no idleness
        # when its bind was last answered (Dispatcher._registrations); inf while it binds again
        self.registered: float = 0
        self.lost_at = -REBIND_RETRY  # monotonic: when it was last taken for lost
        self.turns = 0  # fetches of its partitions so far: which partition goes first
        self.share = SHARE_START  # competing with other flows of its queue: its next fetch
        self.window = window
        self.limit = PER_FLOW_DEFAULT  # the queue's max_delivered_unacked_msgs_per_flow
        self.credit = credit
        self.on_deliver = on_deliver
        self.on_closed = on_closed
        self.on_empty: Callable[[], None] | None = None  # a fetch found nothing more
        self.unacked: dict[str, tuple[str, str, int]] = {}  # entry id -> (queue, id, size)
        self.active = True  # exclusive standbys and partitioned flows without partitions: no
        self.fence = ""
        self.closed = False
        self.selector: Selector | None = None
        self.browse = False  # reads without taking (AMQP distribution-mode copy)
        # among the queue's flows in Redis: every consumer is, a non-destructive queue's
        # too (they browse); a browser of another queue is no consumer and registered nowhere
        self.listed = False
        self.created: bytes = b""  # the created_ms of the queue it bound to (gw_bind)
        self.cursor: str | bytes = "0-0"  # browsing: the last entry (sorted: index member) seen
        self.arrivals: str | bytes = ""  # browsing a sorted queue: the last entry seen arrive
        self.replay_since = 0  # browsing: epoch ms of the replay period's start (0: all)
        self.held: dict[str, int] = {}  # browsing: entries seen held -> delivery time (ms)
        self.held_timer: asyncio.TimerHandle | None = None  # wakes it when the first is due
        self.starved = 0  # fetches in a row that found only others' groups (STARVED_RECHECK)
        self.recheck: asyncio.TimerHandle | None = None  # its look again, when starved
        # a selector flow's last peek: the entries its selector did not match, by id -> their
        # delivery count then (a later peek sends them without their message, see _select)
        self.unmatched: dict[bytes, int] = {}

    @property
    def space(self) -> int:
        """How many more messages this flow may take now."""
        free = min(self.window, self.limit) - len(self.unacked)
        return free if self.credit is None else min(free, self.credit)

    @property
    def full(self) -> bool:
        """Holding the queue's max_delivered_unacked_msgs_per_flow: no more until it
        settles some, whatever its own window and credit."""
        return len(self.unacked) >= self.limit

    def ack(self, entry_id: str) -> None:
        """The consumer processed the message: delete it from the queue."""
        self._settle("ack", entry_id)

    def requeue(self, entry_id: str) -> None:
        """Give the message back (nack, AMQP modified as failed): redelivered, and this
        delivery counts toward the queue's max_redelivery."""
        self._settle("requeue", entry_id)

    def release(self, entry_id: str) -> None:
        """Give the message back undelivered (AMQP released): the delivery does not count."""
        self._settle("release", entry_id)

    def unsend(self, entry_id: str) -> None:
        """Give back a message that never reached the consumer (the link closed while it
        waited to be written): as it was before this flow took it, a first delivery
        still if it was one."""
        self._settle("unsent", entry_id)

    def avoid(self, entry_id: str, failed: bool) -> None:
        """Give the message back, never to this flow again (AMQP modified with
        undeliverable-here): other consumers get it. `failed`: the delivery counts toward
        the queue's max_redelivery, as for requeue."""
        self._settle("avoid_failed" if failed else "avoid", entry_id)

    def reject(self, entry_id: str) -> None:
        """The consumer refuses the message for good: it is discarded and counted."""
        self._settle("reject", entry_id)

    def _settle(self, mode: str, entry_id: str) -> None:
        held = self.unacked.pop(entry_id, None)
        if held is None or self.closed:
            return
        if self.browse:  # a browser took nothing: settling only frees its window
            self._dispatcher.wake(self)
            return
        self._dispatcher.settle(mode, self, *held)

    def owns_partition(self, queue: str) -> bool:
        return any(partition_queue(self.queue, i) == queue for i in self.parts)

    def set_window(self, window: int) -> None:
        """Maximum delivered-but-unsettled messages (MQTT receive maximum, prefetch)."""
        self.window = max(0, window)
        self._dispatcher.wake(self)

    def set_credit(self, credit: int | None) -> None:
        """AMQP link credit: decremented per delivery; None means window only."""
        self.credit = credit
        if credit:  # given credit: a behind consumer doing so is still taking messages
            self._dispatcher.consumer_active(self)
        self._dispatcher.wake(self)

    async def close(self) -> None:
        """Unbind: settlements made so far go first, unsettled messages are redelivered."""
        if not self.closed:
            self.closed = True
            await self._dispatcher.unbind(self)


class _Fetch:
    """One fetch of one round: a flow reading `count` entries of `queue` (a partition)."""

    __slots__ = ("count", "flow", "flow_id", "partition", "queue", "wakes")

    def __init__(self, flow: Flow, queue: str, partition: int | None, count: int) -> None:
        self.flow = flow
        self.flow_id = flow.id  # as the fetch is sent (a flow taken for lost gets a new one)
        self.queue = queue
        self.partition = partition
        self.count = count
        self.wakes = flow.wakes  # as the fetch is sent


_Unbind = tuple[str, str, "asyncio.Future[None] | None"]  # queue, flow id, told when done
_Settle = tuple[str, str, str, int]  # queue, flow id, entry id, size


class _Round:
    """One round's work, sent and waiting for (or holding) its replies in send order."""

    __slots__ = (
        "done",
        "fetches",
        "lease_checks",
        "rebalances",
        "recoveries",
        "refreshes",
        "replies",
        "selecting",
        "sent",
        "settles",
        "unbinds",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.settles: dict[str, list[_Settle]] = {}
        self.unbinds: list[_Unbind] = []
        self.lease_checks: set[str] = set()
        self.rebalances: list[str] = []
        self.recoveries: list[_Fetch] = []
        self.refreshes: set[str] = set()
        self.fetches: list[_Fetch] = []
        self.selecting: list[Flow] = []
        self.replies: list[object] = []
        self.sent = 0
        self.done: asyncio.Future[None] = loop.create_future()

    def reply(self, reply: object) -> None:
        self.replies.append(reply)
        if len(self.replies) == self.sent and not self.done.done():
            self.done.set_result(None)


class Dispatcher:
    """All flows of one node; see the module docstring for the pump's round."""

    def __init__(self, redis: aioredis.Redis, node_id: str) -> None:
        self._redis = redis
        self._calls = OrderedCalls(redis)
        self.node_id = node_id
        self._ids = itertools.count(1)
        # binds answered so far: a read of a queue's flows sent before a flow's bind was
        # answered may not have it (see Flow.registered)
        self._registrations = 0
        self._rebinding: set[Flow] = set()  # a _rebind task of theirs runs
        self._background: set[asyncio.Task] = set()  # see _spawn
        self.flows: dict[str, list[Flow]] = {}
        self._want: dict[Flow, None] = {}
        self._fetching: set[Flow] = set()  # a fetch (or selection) of theirs is in flight
        self._refused: set[Flow] = set()  # their last fetch was refused: wait FETCH_RETRY
        # fetches whose answers were lost, to recover; their flows fetch nothing meanwhile
        self._to_recover: list[_Fetch] = []
        self._recovering: dict[Flow, int] = {}  # flow -> its recoveries not yet answered
        # rounds sent, not yet finished (the pump's): a recovery waits for none
        self._rounds: collections.deque[_Round] = collections.deque()
        # their last fetch came back full (more is waiting) -> when they last fetched,
        # settled or gave credit (monotonic)
        self._behind: dict[Flow, float] = {}
        self._caught_up = asyncio.Event()  # a flow left _behind
        self._settles: dict[str, list[_Settle]] = {}
        self._later: dict[str, list[_Settle]] = {}  # settlements Redis refused for now
        self._later_unbinds: list[_Unbind] = []  # and unbinds
        self._later_timer: asyncio.TimerHandle | None = None
        self._refusing = False  # Redis refused the last round's calls for now
        self._unbinds: list[_Unbind] = []
        self._lease_checks: set[str] = set()
        self._rebalances: dict[str, float] = {}  # partitioned queue -> when (loop time)
        self._refreshes: set[str] = set()  # partitioned queues whose map to re-read
        self._task: asyncio.Task | None = None
        self.on_last_flow: Callable[[str], None] | None = None
        self.delivered = 0
        self.rounds = 0

    async def close(self) -> None:
        """Stop the pump and drop its connection (the node is stopping)."""
        if self._later_timer is not None:
            self._later_timer.cancel()
        if self._task is not None:
            self._task.cancel()
        await self._calls.close()

    # -- binding ---------------------------------------------------------------------------

    async def bind(
        self,
        queue: str,
        on_deliver: DeliverCallback,
        *,
        window: int = DEFAULT_WINDOW,
        credit: int | None = None,
        on_closed: ClosedCallback | None = None,
        selector: str | None = None,
        browse: bool = False,
        replay_ms: int = 0,
        get: bool = False,
    ) -> Flow:
        flow = Flow(
            self,
            self._flow_id(get),
            queue,
            window,
            credit,
            on_deliver,
            on_closed,
        )
        if selector:
            try:
                flow.selector = compile_selector(selector)
            except SelectorError as exc:
                raise BindError("invalid_selector", f"invalid selector: {exc}") from None
        flow.browse = browse
        if replay_ms > 0:
            flow.replay_since = int(time.time() * 1000) - replay_ms
        try:
            delay = await self._register(flow)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            if not refused_for_now(exc):  # (refused while Redis loads its data: it never ran)
                self._unbind_unknown(flow)  # the bind may have run, its reply lost
            raise
        except asyncio.CancelledError:  # its caller went: the bind may have run all the same
            self._unbind_unknown(flow)
            raise
        self.flows.setdefault(queue, []).append(flow)
        if flow.exclusive:
            try:
                await self.check_lease(queue)
            except BaseException:  # the caller is told the bind failed: the flow goes too
                flow.closed = True
                self._forget(flow)
                self._unbind_unknown(flow)
                raise
        elif flow.partitioned:
            self.request_rebalance(queue, delay)
        else:
            self.wake(flow)
        return flow

    def _unbind_unknown(self, flow: Flow) -> None:
        """Unbind the flow's id in Redis without waiting: the caller does not know whether
        it is bound there (a flow nobody owns would hold an exclusive queue's lease or
        partitions, and messages, until the node stops). Unbinding an id not bound changes
        nothing."""
        self._unbinds.append((flow.queue, flow.id, None))
        self._kick()

    def _flow_id(self, get: bool) -> str:
        """A new flow id, node.N; a get's flow is no consumer, and its id node.gN says so
        to an auto-delete queue (see functions.lua)."""
        return f"{self.node_id}.{'g' if get else ''}{next(self._ids)}"

    async def _register(self, flow: Flow) -> float:
        """gw_bind; sets the flow's kind. Returns the queue's rebalance delay (seconds)."""
        mode = "browse" if flow.browse else "select" if flow.selector else ""
        reply = await self._redis.fcall(
            "gw_bind", 0, flow.queue, flow.id, self.node_id, mode, flow.created
        )
        status = reply[0].decode()
        if status != "ok":
            code, why = BIND_REFUSALS.get(status, (status, "bind refused"))
            raise BindError(code, f"{why}: {flow.queue!r}")
        flow.browse = reply[5] == b"browse"  # every consumer of a non-destructive queue browses
        flow.listed = int(reply[1]) > 0
        flow.exclusive = reply[2] == b"exclusive" and not flow.browse
        flow.partitioned = int(reply[3]) > 0
        flow.prioritised = reply[6] == 1
        flow.created = reply[7]
        flow.limit = int(reply[8]) or PER_FLOW_DEFAULT
        flow.active = not (flow.exclusive or flow.partitioned)
        self._registrations += 1
        flow.registered = self._registrations
        return int(reply[4]) / 1000

    async def unbind(self, flow: Flow) -> None:
        if not flow.listed:  # a browser, registered nowhere in Redis
            self._forget(flow)
            return
        fut = asyncio.get_running_loop().create_future()
        self._unbinds.append((flow.queue, flow.id, fut))
        self._forget(flow)
        self._kick()
        await fut

    def behind_on(self, queues: Iterable[str]) -> bool:
        """Some local consumer of one of these queues is behind: its last fetch came back
        full, so its queue holds more than it could take (messages arrive faster than it
        consumes them)."""
        return self._lagging(queues, since=0.0)

    async def catch_up(self, queues: Callable[[], Iterable[str]], limit: float) -> None:
        """Wait, at most `limit` seconds, while a local consumer of `queues()` is behind
        and still taking messages (not stalled): a publisher's next batch then lets the
        backlog drain instead of growing it."""
        deadline = time.monotonic() + limit
        while self._lagging(queues(), since=time.monotonic() - STALLED_AFTER):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._caught_up.clear()
            try:
                async with asyncio.timeout(left):
                    await self._caught_up.wait()
            except TimeoutError:
                return

    def consumer_active(self, flow: Flow) -> None:
        """The flow's consumer settled or gave credit: if it is behind, it is draining."""
        if flow in self._behind:
            self._behind[flow] = time.monotonic()

    def _lagging(self, queues: Iterable[str], since: float) -> bool:
        """A local consumer of one of `queues` is behind and was last active after `since`
        (monotonic; 0: whenever)."""
        if not self._behind:
            return False
        lagging = {flow.queue for flow, at in self._behind.items() if at > since}
        return any(queue in lagging for queue in queues)

    def _forget(self, flow: Flow) -> None:
        self._want.pop(flow, None)
        for timer in (flow.held_timer, flow.recheck):
            if timer is not None:
                timer.cancel()
        if self._behind.pop(flow, None) is not None:
            self._caught_up.set()
        local = self.flows.get(flow.queue)
        if local and flow in local:
            local.remove(flow)
            if not local:
                del self.flows[flow.queue]
                if self.on_last_flow is not None:
                    self.on_last_flow(flow.queue)

    async def queue_deleted(self, queue: str, browsers: bool = True) -> None:
        """The queue's deletion was announced: end its local flows. The news comes on a
        connection of its own, so the queue may have been made again under its name and
        flows bound to it by then (an MQTT clean start): Redis has those registered, and
        they stay. A browser registered nowhere (see Flow.listed) ends (one of the deleted
        queue must not go on reading the new one, whose access it was never checked for),
        unless `browsers` is False: the deletion's own event ends those."""
        local = [
            flow
            for flow in self.flows.get(queue, ())
            if not flow.closed and (browsers or flow.listed)
        ]
        if not local:
            return
        try:
            registered = await self._redis.zmscore(queue_flows(queue), [f.id for f in local])
        except RedisError as exc:  # as the event says, then
            log.warning("checking the flows of deleted queue %s failed: %s", queue, exc)
            registered = [None] * len(local)
        for flow, score in zip(local, registered, strict=True):
            if (score is None or not flow.listed) and not flow.closed:
                self._end_flow(flow, QUEUE_DELETED)

    def _queue_gone(self, flow: Flow) -> None:
        """Redis ran a call of the flow when its queue was not there (deleted): the flow
        ends. The answer may come late, when the queue was made again under its name and
        other flows bound to it: of the consumers, queue_deleted ends only those Redis does
        not have; browsers registered nowhere are left to the deletion's event."""
        if not flow.closed:
            self._end_flow(flow, QUEUE_DELETED)
        self._spawn(self.queue_deleted(flow.queue, browsers=False))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` on its own, kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _end_flow(self, flow: Flow, reason: str) -> None:
        flow.closed = True
        self._forget(flow)
        if flow.on_closed is not None:
            flow.on_closed(reason)

    # -- wake-ups --------------------------------------------------------------------------

    def wake(self, flow: Flow) -> None:
        """The flow may have work (new messages, more space)."""
        flow.idle.clear()
        flow.wakes += 1
        if not flow.closed and flow.active and flow.space > 0 and flow not in self._refused:
            self._want[flow] = None
            self._kick()

    def wake_queue(self, queue: str) -> None:
        """New messages on the queue. Competing local flows take turns at being first to
        fetch them: the first fetch takes all it has room for, so a fixed order would hand
        every small batch to the same consumer."""
        local = self.flows.get(queue)
        if not local:
            return
        if len(local) > 1:
            local.append(local.pop(0))
            for flow in local:
                self._want.pop(flow, None)  # wanted again below, in the new order
        for flow in local:
            self.wake(flow)

    def wake_all(self) -> None:
        for queue in list(self.flows):
            self.wake_queue(queue)

    def settle(self, mode: str, flow: Flow, queue: str, entry_id: str, size: int) -> None:
        self._settles.setdefault(mode, []).append((queue, flow.id, entry_id, size))
        self.consumer_active(flow)
        if flow.partitioned and not flow.owns_partition(queue):
            self.request_rebalance(flow.queue)  # a handoff may be able to complete now
        self.wake(flow)
        self._kick()  # even when the flow has no credit left: the settlement must reach Redis

    # -- exclusive queues ------------------------------------------------------------------

    async def check_lease(self, queue: str) -> None:
        """Ask Redis who holds an exclusive queue; promote or demote local flows (not one
        bound after the question went: the answer may not know it)."""
        seen = self._registrations
        fence, holder, *bound = await self._redis.fcall("gw_lease", 0, queue)
        holder = holder.decode()
        bound_ids = {f.decode() for f in bound}
        for flow in list(self.flows.get(queue, ())):
            if not flow.exclusive or flow.registered > seen:
                continue
            if flow.id not in bound_ids and not flow.closed:
                self._lost(flow)  # a standby released while our node was presumed dead
                continue
            was = flow.active
            flow.active = flow.id == holder
            flow.fence = str(fence) if flow.active else ""
            if flow.active and not was:
                log.info("flow %s now active on exclusive queue %s", flow.id, queue)
                self.wake(flow)

    def request_lease_check(self, queue: str) -> None:
        if any(f.exclusive for f in self.flows.get(queue, ())):
            self._lease_checks.add(queue)
            self._kick()

    def exclusive_standby_queues(self) -> list[str]:
        return [q for q, fl in self.flows.items() if any(f.exclusive and not f.active for f in fl)]

    # -- partitioned queues ----------------------------------------------------------------

    def partitioned_queues(self) -> list[str]:
        return [q for q, fl in self.flows.items() if any(f.partitioned for f in fl)]

    def request_rebalance(self, queue: str, delay: float = 0.0) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        if due < self._rebalances.get(queue, float("inf")):
            self._rebalances[queue] = due
            if delay > 0:
                loop.call_later(delay, self._kick)
            else:
                self._kick()

    def request_partition_refresh(self, queue: str) -> None:
        if any(f.partitioned for f in self.flows.get(queue, ())):
            self._refreshes.add(queue)
            self._kick()

    async def refresh_partitions(self, queue: str) -> None:
        """Read a partitioned queue's map; give local flows the partitions they own now (not
        one bound after the read went: the map may not know it)."""
        seen = self._registrations
        pmap = PartitionMap.from_reply(await self._redis.fcall("gw_partitions", 0, queue))
        bound = set(pmap.flows)
        for flow in list(self.flows.get(queue, ())):
            if not flow.partitioned or flow.closed or flow.registered > seen:
                continue
            if flow.id not in bound:  # released while our node was presumed dead
                self._lost(flow)
                continue
            owned = pmap.owned_by(flow.id)
            gained = owned.keys() - flow.parts.keys()
            flow.parts = owned
            flow.active = bool(owned)
            if gained:
                self.wake(flow)

    def _due_rebalances(self) -> list[str]:
        now = asyncio.get_running_loop().time()
        return [q for q, due in self._rebalances.items() if due <= now]

    # -- the pump --------------------------------------------------------------------------

    def _kick(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pump())

    def _has_work(self) -> bool:
        """Anything to send: flows with a fetch in flight wait for its answer."""
        return bool(
            self._settles
            or self._unbinds
            or self._lease_checks
            or self._refreshes
            or self._due_rebalances()
            or any(flow not in self._fetching for flow in self._want)
            or (not self._rounds and self._recovery_due())
        )

    async def _pump(self) -> None:
        rounds = self._rounds
        try:
            await asyncio.sleep(0)  # gather this turn's settlements and wake-ups
            # a round failed (its connection broke): the rounds sent after it are finished
            # (what they lost put back) before any new one goes, so a recovery follows
            # every settlement sent before it
            failed = False
            logged = False  # the failure, once until a round goes through again
            while True:
                if (
                    not failed
                    and len(rounds) < MAX_ROUNDS_IN_FLIGHT
                    and not (rounds and self._recovery_due())  # it waits for those: so do we
                    and self._has_work()
                ):
                    rounds.append(await self._send_round())
                    continue
                if not rounds:
                    if not failed:
                        break
                    failed = False
                    await asyncio.sleep(0.5)
                    continue
                sent = rounds.popleft()
                await sent.done
                try:
                    await self._finish_round(sent)
                    logged = False
                except ConnectionError as exc:  # raised by _finish_round: work put back
                    if not logged:
                        log.warning("%s; retrying", exc)
                    failed = logged = True
                except Exception:
                    if not logged:
                        log.exception("dispatch round failed; retrying")
                    failed = logged = True
        finally:
            for sent in rounds:  # cancelled (node stopping): the flows may fetch again
                self._fetching.difference_update(f.flow for f in sent.fetches)
                self._fetching.difference_update(sent.selecting)
            rounds.clear()
            self._task = None

    def _fetches(self) -> tuple[list[_Fetch], list[Flow]]:
        """This round's fetches, and the flows with a selector (they peek, then take), for
        wanted flows without a fetch in flight, until they ask for ROUND_MESSAGES in all
        (the flows left stay wanted, for the next rounds)."""
        fetches: list[_Fetch] = []
        selecting: list[Flow] = []
        fetching = self._fetching
        taken: list[Flow] = []
        asked = 0
        sharing: dict[str, int] = {}  # queue -> its competing flows, counted once a round
        for flow in self._want:
            if asked >= ROUND_MESSAGES:
                break
            if flow in fetching:
                continue  # wanted again once its fetch is answered
            taken.append(flow)
            space = min(flow.space, FETCH_BATCH)
            if space <= 0 or flow.closed or not flow.active or flow in self._recovering:
                continue  # (a recovered flow is woken)
            if flow.selector is not None and not flow.browse:
                selecting.append(flow)
                fetching.add(flow)
                asked += space
                continue
            if not flow.partitioned:
                # competing flows of one queue take turns: a big window does not grab a
                # burst or the backlog in one fetch (each is wanted again after its batch);
                # browsers take nothing from the others: they neither compete nor share
                competing = sharing.get(flow.queue)
                if competing is None:  # each flow's count of them: O(flows^2) a round
                    competing = sharing[flow.queue] = sum(
                        1 for f in self.flows.get(flow.queue, ()) if f.active and not f.browse
                    )
                if competing > 1 and not flow.browse:
                    count = min(space, flow.share, max(1, FETCH_BATCH // competing))
                else:
                    count = space
                fetches.append(_Fetch(flow, flow.queue, None, count))
                fetching.add(flow)
                asked += count
                continue
            # a small window cannot serve every partition each round: start with those not
            # yet found empty, in turn (the flow's own: the rounds between its fetches may
            # come in any number), so each gets its share
            ready = [i for i in flow.parts if i not in flow.idle]
            if not ready:
                continue
            flow.turns += 1
            shift = flow.turns % len(ready)
            ready = ready[shift:] + ready[:shift]
            for index, count in zip(ready, split_window(space, len(ready)), strict=True):
                if count > 0:
                    fetches.append(_Fetch(flow, partition_queue(flow.queue, index), index, count))
                    fetching.add(flow)
                    asked += count
        for flow in taken:
            del self._want[flow]
        return fetches, selecting

    async def _send_round(self) -> _Round:
        """Take the work gathered so far and send its commands; replies come in order."""
        self.rounds += 1
        sent = _Round(asyncio.get_running_loop())
        sent.settles, self._settles = self._settles, {}
        sent.unbinds, self._unbinds = self._unbinds, []
        sent.lease_checks, self._lease_checks = self._lease_checks, set()
        sent.rebalances = self._due_rebalances()
        for queue in sent.rebalances:
            del self._rebalances[queue]
        sent.refreshes, self._refreshes = self._refreshes | set(sent.rebalances), set()
        # a recovery goes once every round sent before it is finished: then each settlement
        # sent before it ran, or was put back to go ahead of it in this round, or waits
        # (refused for now) and so does the recovery (_may_recover)
        sent.recoveries = [] if self._rounds else self._recoveries_now()
        sent.fetches, sent.selecting = self._fetches()
        commands: list[tuple[object, ...]] = []
        for mode, items in sent.settles.items():
            args: list[object] = [mode]
            for (queue, flow_id), (ids, sizes) in _group(items).items():
                args += [queue, flow_id, len(ids), sum(sizes), _pack_sizes(sizes), *ids]
            commands.append(("gw_settle", 0, *args))
        for queue, flow_id, _ in sent.unbinds:
            commands.append(("gw_unbind", 0, queue, flow_id))
        for queue in sent.rebalances:
            commands.append(("gw_rebalance", 0, queue))
        for f in sent.recoveries:  # after the settles: they must not come back
            commands.append(("gw_recover", 0, f.queue, f.flow_id, *_known(f)))
        for f in sent.fetches:
            flow = f.flow
            if flow.browse:
                due = _due_held(flow, f.count)
                page = f.count - len(due)
                commands.append(
                    (
                        "gw_browse",
                        0,
                        f.queue,
                        flow.id if flow.listed else "",
                        flow.cursor,
                        page,
                        flow.replay_since,
                        flow.arrivals,
                        flow.created,
                        *due,
                    )
                )
            else:
                commands.append(
                    ("gw_fetch", 0, f.queue, flow.id, f.count, flow_fence(flow, f.partition))
                )
        sent.sent = len(commands)
        if not commands:
            sent.done.set_result(None)
        for command in commands:
            await self._calls.send(sent.reply, "FCALL", *command)
        return sent

    async def _finish_round(self, sent: _Round) -> None:
        """Apply a round's replies in order: what a broken connection lost is done again."""
        replies = iter(sent.replies)
        lost = False
        refusal: BaseException | None = None  # Redis refused a call of the round for now
        unsettled: set[str] = set()  # flow ids whose settlements Redis refused for now
        for mode, items in sent.settles.items():
            reply = next(replies)
            if broke(reply):
                self._settles.setdefault(mode, []).extend(items)
                lost = True
            elif refused_for_now(reply):
                refusal = reply
                self._settle_later(mode, items)
                unsettled.update(item[1] for item in items)
            elif isinstance(reply, Exception):  # not retried: it would fail the same way
                log.error("settling %d entries (%s) failed: %s", len(items), mode, reply)
        for unbind in sent.unbinds:
            reply, fut = next(replies), unbind[2]
            if broke(reply):
                self._unbinds.append(unbind)
                lost = True
                continue
            if refused_for_now(reply):  # the flow's entries must still go back to the queue
                refusal = reply  # once Redis takes the unbind: ours to do; the caller goes on
                self._unbind_later(unbind)
                reply = None
            if fut is not None and not fut.done():
                if isinstance(reply, Exception):
                    fut.set_exception(reply)
                else:
                    fut.set_result(None)
        for queue in sent.rebalances:
            reply = next(replies)
            if broke(reply):
                self._rebalances[queue] = 0.0
                lost = True
            elif refused_for_now(reply):
                refusal = reply
                self.request_rebalance(queue, FETCH_RETRY)
            elif isinstance(reply, Exception):
                log.error("rebalancing the partitions of %s failed: %s", queue, reply)
        for f in sent.fetches:
            self._fetching.discard(f.flow)
        for f in sent.recoveries:
            reply = next(replies)
            if broke(reply) or f.flow_id in unsettled:  # (it reads only: asked again later)
                self._to_recover.append(f)
                lost = lost or broke(reply)
            elif refused_for_now(reply):
                refusal = reply
                asyncio.get_running_loop().call_later(FETCH_RETRY, self._recover_again, f)
            else:
                self._recovered(f, reply)
        for f in sent.fetches:
            reply = next(replies)
            if broke(reply):
                lost = True
                if not f.flow.browse:  # a browser took nothing: it just asks again
                    self._fetch_lost(f)
                    continue
            if isinstance(reply, Exception):
                if broke(reply):
                    self._want[f.flow] = None
                    continue
                if refused_for_now(reply):
                    refusal = reply
                else:
                    log.warning("fetch for flow %s failed: %s", f.flow.id, reply)
                self._refuse(f.flow)
                continue
            if f.flow.browse:
                self._deliver_browsed(f, reply)
            else:
                self._deliver(f, reply)
        done = sent.settles or sent.unbinds or sent.fetches
        if refusal is not None or (self._refusing and not lost and done):
            self._say_refusing(refusal)
        if lost:
            self._lease_checks |= sent.lease_checks
            self._refreshes |= sent.refreshes
            self._fetching.difference_update(sent.selecting)
            self._want.update(dict.fromkeys(sent.selecting))
            raise ConnectionError("the dispatch connection to Redis broke; work put back")
        for flow in sent.selecting:
            self._fetching.discard(flow)
            await self._select(flow)
        for queue in sent.lease_checks:
            await self.check_lease(queue)
        for queue in sent.refreshes:
            await self.refresh_partitions(queue)

    def _deliver(self, fetch: _Fetch, reply: list) -> None:
        flow = fetch.flow
        status = reply[0]
        if status != b"ok":
            self._fetch_refused(fetch, status.decode())
            return
        if flow.closed:
            return  # closed while fetching: its pending unbind returns these entries
        flow.starved = 0
        got = (len(reply) - 2) // 4 + int(reply[1])  # delivered + dead-lettered instead
        self._hand_out(fetch, reply)
        if flow.closed:
            return
        if got >= fetch.count:
            self._behind[flow] = time.monotonic()
        elif self._behind.pop(flow, None) is not None:
            self._caught_up.set()
        if fetch.partition is not None:
            # empty, unless woken since it was sent: what woke it may have come too late
            if got < fetch.count and fetch.wakes == flow.wakes:
                flow.idle.add(fetch.partition)
            if any(i not in flow.idle for i in flow.parts):
                if flow.space > 0:
                    self._want[flow] = None
            else:
                self._empty(flow)
        elif got >= fetch.count:  # a full batch: there may be more
            flow.share = min(2 * flow.share, FETCH_BATCH)
            if flow.space > 0:
                self._want[flow] = None
        else:
            flow.share = SHARE_START
            self._empty(flow)

    def _hand_out(self, fetch: _Fetch, reply: list) -> None:
        """Hand a fetch's ("ok", dead-lettered, entries...) reply to its flow."""
        flow = fetch.flow
        queue = fetch.queue
        prefix = "" if fetch.partition is None else f"{fetch.partition}/"
        unacked, prioritised = flow.unacked, flow.prioritised
        for i in range(2, len(reply), 4):
            raw_id = reply[i].decode()
            entry_id = prefix + raw_id if prefix else raw_id
            blob = reply[i + 2]
            size = len(blob)
            if prioritised:  # "level/id": the level's stream holds the entry
                level, _, raw_id = raw_id.partition("/")
                queue = priority_queue(flow.queue, int(level))
            unacked[entry_id] = (queue, raw_id, size)
            try:
                message = decode(blob)
                meta = reply[i + 3]
                if meta:  # an expiry, or a dead message queue's entry
                    _apply_meta(message, meta)
            except (ValueError, OverflowError) as exc:  # unreadable: it would stall the flow
                log.error("entry %s of queue %s rejected: %s", raw_id, queue, exc)
                flow.reject(entry_id)  # to the dead message queue, or discarded
                continue
            if flow.credit is not None:
                flow.credit -= 1
            self.delivered += 1
            try:
                count = int(reply[i + 1])
                flow.on_deliver(
                    Delivery(queue, entry_id, message, count % ACQUIRED, size, count >= ACQUIRED)
                )
            except Exception:
                log.exception("delivery callback of flow %s failed", flow.id)
            if flow.closed:
                return

    def _say_refusing(self, refusal: BaseException | None) -> None:
        """Log once when Redis starts refusing fetches, settlements and unbinds for now (see
        `refused_for_now`; one line a flow each second would flood the log) and once when
        it takes them again."""
        if refusal is not None and not self._refusing:
            log.warning(
                "Redis refuses fetches, settlements and unbinds for now; again every %.0f s: %s",
                FETCH_RETRY,
                refusal,
            )
        elif refusal is None:
            log.info("Redis takes fetches, settlements and unbinds again")
        self._refusing = refusal is not None

    def _settle_later(self, mode: str, items: list[_Settle]) -> None:
        """Settlements Redis refused without running them go again after FETCH_RETRY.
        Left undone they would hold their entries pending until the flow ends, and then
        the entries would be delivered again."""
        self._later.setdefault(mode, []).extend(items)
        self._again_soon()

    def _unbind_later(self, unbind: _Unbind) -> None:
        """The same for an unbind: left undone, the flow would hold its entries until the
        node stops. Its caller went on as if it were done (nothing else is left to do)."""
        self._later_unbinds.append((unbind[0], unbind[1], None))
        self._again_soon()

    def _again_soon(self) -> None:
        if self._later_timer is None:
            self._later_timer = asyncio.get_running_loop().call_later(FETCH_RETRY, self._again)

    def _again(self) -> None:
        self._later_timer = None
        for mode, items in self._later.items():
            self._settles.setdefault(mode, []).extend(items)
        self._unbinds += self._later_unbinds
        self._later, self._later_unbinds = {}, []
        self._kick()

    def _refuse(self, flow: Flow) -> None:
        """Redis refused the flow's fetch: it asks again after FETCH_RETRY."""
        self._refused.add(flow)

        def retry() -> None:
            self._refused.discard(flow)
            self.wake(flow)

        asyncio.get_running_loop().call_later(FETCH_RETRY, retry)

    def _empty(self, flow: Flow) -> None:
        """Nothing more for the flow right now (AMQP drain answers on this)."""
        if flow.on_empty is not None:
            try:
                flow.on_empty()
            except Exception:
                log.exception("on_empty callback of flow %s failed", flow.id)

    def _deliver_browsed(self, fetch: _Fetch, reply: list) -> None:
        """A browse reply: the held entries asked for again, (sorted) the late ones, then a
        page (see gw_browse)."""
        flow = fetch.flow
        status = reply[0]
        if status not in (b"ok", b"sorted"):
            self._fetch_refused(fetch, status.decode())
            return
        if flow.closed:
            return
        ordered = status == b"sorted"  # a sorted queue: entries named by index members
        if ordered:
            flow.arrivals = reply[1]
        again = 4 if ordered else 2
        late = again + 3 * int(reply[again - 1])
        page = late + 1 + 3 * int(reply[late]) if ordered else late
        entries = (len(reply) - page) // 3
        stopped = False
        lates = range(late + 1, page, 3) if ordered else range(0)
        for i in itertools.chain(range(again, late, 3), lates, range(page, len(reply), 3)):
            name, blob, meta = reply[i], reply[i + 1], reply[i + 2]
            entry_id = _member_id(name) if ordered and i >= late else name.decode()
            at_limit = not blob and meta and len(flow.held) >= MAX_HELD_BROWSED
            if i < late:
                flow.held.pop(entry_id, None)
            elif i < page:  # late: seen again from here (an arrival) once some are due
                if at_limit:
                    flow.arrivals = _just_before(entry_id)
                    stopped = True
                    break
            else:
                if at_limit:
                    stopped = True  # seen again from here once some held ones are due
                    break
                flow.cursor = name if ordered else entry_id
            if not blob:
                if meta:  # held until then
                    if len(flow.held) < MAX_HELD_BROWSED:
                        flow.held[entry_id] = int(meta)
                    else:
                        log.warning("browser of %s misses held entry %s", flow.queue, entry_id)
                continue  # else settled or expired: not on the queue
            try:
                message = decode(blob)
                if meta:
                    _apply_meta(message, meta)
            except (ValueError, OverflowError) as exc:  # a consumer's fetch dead-letters it
                log.warning("browser skips entry %s of queue %s: %s", entry_id, flow.queue, exc)
                continue
            if flow.selector is not None and not matches(flow.selector, message, 1):
                continue
            flow.unacked[entry_id] = (flow.queue, entry_id, len(blob))
            if flow.credit is not None:
                flow.credit -= 1
            self._hand_over(flow, Delivery(flow.queue, entry_id, message, 1, len(blob)))
            if flow.closed:
                return
        if flow.held:
            self._wake_when_due(flow)
        if stopped:
            return
        full = entries >= fetch.count - (late - again) // 3
        if full or (ordered and reply[2] == 1):  # there may be more
            if flow.space > 0:
                self._want[flow] = None
        else:
            self._empty(flow)

    def _wake_when_due(self, flow: Flow) -> None:
        """Wake a browser when the first entry it saw held is due."""
        if flow.held_timer is not None:
            flow.held_timer.cancel()
        delay = (min(flow.held.values()) - time.time() * 1000) / 1000
        flow.held_timer = asyncio.get_running_loop().call_later(
            max(delay, HELD_RECHECK), self._held_due, flow
        )

    def _held_due(self, flow: Flow) -> None:
        flow.held_timer = None
        self.wake(flow)

    async def _select(self, flow: Flow) -> None:
        """Peek at the waiting messages, take the ones the flow's selector matches. A call
        Redis refuses or does not answer is asked again later: the other flows of the round
        go on, and a take whose answer was lost gives back what it may have taken.
        Each message is judged once (again only when its delivery count moved): every
        arrival had each selector flow decode and judge all it had not taken, up to
        SELECT_SCAN of them, on the event loop."""
        space = min(flow.space, FETCH_BATCH)
        known = [b"%s %d" % item for item in flow.unmatched.items()]
        try:
            peeked = await self._redis.fcall("gw_peek", 0, flow.queue, flow.id, SELECT_SCAN, *known)
        except RedisError as exc:
            self._select_failed(flow, exc)
            return
        if peeked[0] != b"ok":
            self._fetch_refused(_Fetch(flow, flow.queue, None, space), peeked[0].decode())
            return
        wanted = []
        unmatched: dict[bytes, int] = {}
        judged = flow.unmatched
        for i in range(1, len(peeked), 3):
            if len(wanted) >= space:
                break
            entry, count, blob = peeked[i], peeked[i + 1], peeked[i + 2]
            if not blob and judged.get(entry) == count:  # sent without it: judged before
                unmatched[entry] = count
                continue
            try:
                message = decode(blob)
            except ValueError:  # unreadable: taken, and rejected as any consumer's fetch does
                wanted.append(entry)
                continue
            if matches(flow.selector, message, int(count) % ACQUIRED + 1):
                wanted.append(entry)
            else:
                unmatched[entry] = count
        flow.unmatched = unmatched
        if flow.closed:
            return
        if not wanted:
            self._empty(flow)
            return
        fetch = _Fetch(flow, flow.queue, None, len(wanted))
        try:
            reply = await self._redis.fcall("gw_take", 0, flow.queue, flow.id, *wanted)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            if refused_for_now(exc):  # Redis loading its data: the take did not run
                self._select_failed(flow, exc)
            else:
                self._fetch_lost(fetch)
            return
        except RedisError as exc:
            self._select_failed(flow, exc)
            return
        self._deliver(fetch, reply)

    def _select_failed(self, flow: Flow, exc: RedisError) -> None:
        if refused_for_now(exc):
            self._say_refusing(exc)
        else:
            log.warning("selecting for flow %s failed: %s", flow.id, exc)
        self._refuse(flow)

    def _hand_over(self, flow: Flow, delivery: Delivery) -> None:
        self.delivered += 1
        try:
            flow.on_deliver(delivery)
        except Exception:
            log.exception("delivery callback of flow %s failed", flow.id)

    def _fetch_refused(self, fetch: _Fetch, status: str) -> None:
        flow = fetch.flow
        if fetch.partition is not None and status in ("notowner", "noflow", "noqueue"):
            # the partition is being handed off (or was), or a repartition removed it (and
            # unbound every flow): stop dispatching it; the refresh binds the flow again
            flow.parts.pop(fetch.partition, None)
            flow.active = bool(flow.parts)
            self.request_partition_refresh(flow.queue)
            if all(i in flow.idle for i in flow.parts):  # its others were found empty first
                self._empty(flow)
        elif status == "notowner":
            flow.active = False
            self.request_lease_check(flow.queue)
            self._empty(flow)  # a standby has nothing for now
        elif status == "noflow":
            self._lost(flow)
        elif status == "noqueue":
            self._queue_gone(flow)
        elif status == "egress":  # paused until the queue's config changes (a 'qcfg' event
            self._empty(flow)  # wakes it): nothing for now, which a drain is told
        elif status == "starved":
            self._empty(flow)
            if flow.recheck is None:  # one at a time: a fetch others woke it for found the
                # same, and each would have kept a look again of its own going
                delay = min(STARVED_RECHECK * 2**flow.starved, STARVED_RECHECK_MAX)
                flow.starved = min(flow.starved + 1, 6)  # 0.05 s doubled past 2 s by then
                flow.recheck = asyncio.get_running_loop().call_later(delay, self._recheck, flow)
        elif status in BIND_REFUSALS and not flow.closed:  # as its bind would be refused now
            self._end_flow(flow, BIND_REFUSALS[status][1])

    def _recheck(self, flow: Flow) -> None:
        flow.recheck = None
        self.wake(flow)

    def _fetch_lost(self, fetch: _Fetch) -> None:
        """A fetch's answer was lost with the connection, so what it took (if it ran) is
        held by the flow in Redis and unknown here: the flow fetches nothing more until
        gw_recover told it, after the settlements sent before (a closed flow's unbind
        gives it back)."""
        flow = fetch.flow
        if not flow.closed and fetch.flow_id == flow.id:  # (else the old id's unbind gave
            self._recovering[flow] = self._recovering.get(flow, 0) + 1  # it back)
            self._to_recover.append(fetch)
            self._kick()

    def _recovery_due(self) -> bool:
        return bool(self._to_recover) and any(self._may_recover(f.flow) for f in self._to_recover)

    def _may_recover(self, flow: Flow) -> bool:
        """Not while settlements of the flow Redis refused wait: it would hand them out
        again (their entries are no longer in flow.unacked)."""
        return flow.closed or not any(
            item[1] == flow.id for items in self._later.values() for item in items
        )

    def _recoveries_now(self) -> list[_Fetch]:
        now, self._to_recover = self._to_recover, []
        due = []
        for f in now:
            if f.flow.closed:
                self._done_recovering(f.flow)
            elif self._may_recover(f.flow):
                due.append(f)
            else:
                self._to_recover.append(f)
        return due

    def _recover_again(self, fetch: _Fetch) -> None:
        if fetch.flow in self._recovering and fetch.flow_id == fetch.flow.id:
            self._to_recover.append(fetch)
            self._kick()

    def _recovered(self, fetch: _Fetch, reply: object) -> None:
        flow = fetch.flow
        if flow.id != fetch.flow_id or flow not in self._recovering:
            return  # taken for lost meanwhile: bound again under a new id
        if flow.closed:
            pass  # its unbind gives back what it holds
        elif isinstance(reply, Exception):  # not to be asked again: it would fail the same way
            log.error("recovering a lost fetch of flow %s failed: %s", flow.id, reply)
            self._lost(flow, "lost a fetch's answer")
        elif reply[0] != b"ok":
            self._fetch_refused(fetch, reply[0].decode())
        elif len(reply) > 2:
            log.info("flow %s got %d entries of a lost fetch", flow.id, (len(reply) - 2) // 4)
            self._hand_out(fetch, reply)
        self._done_recovering(flow)  # (not woken if taken for lost: it binds again first)

    def _done_recovering(self, flow: Flow) -> None:
        left = self._recovering.get(flow, 0) - 1
        if left > 0:
            self._recovering[flow] = left
        elif self._recovering.pop(flow, None) is not None:
            self.wake(flow)

    def _lost(self, flow: Flow, why: str = "was released by another node") -> None:
        """Our node was presumed dead and the flow released: its messages went back to the
        queue. Bind again under a new id, so late settlements of the old id are ignored.
        The old id is unbound: a no-op when it was released, and should it still be bound
        (a lost fetch's answer), nobody would own what it holds."""
        log.warning("flow %s %s; rebinding", flow.id, why)
        self._unbind_unknown(flow)
        if self._recovering.pop(flow, None) is not None:  # the unbind gives that back too
            self._to_recover = [f for f in self._to_recover if f.flow is not flow]
        flow.registered = float("inf")  # no answer asked before its new bind judges it
        flow.unacked.clear()
        flow.parts.clear()
        if flow.exclusive or flow.partitioned:  # no lease, no partition until bound again
            flow.active = False  # (a drain is answered meanwhile: nothing for it)
        flow.id = self._flow_id(flow.id.partition(".")[2].startswith("g"))
        # lost again at once (its node's own liveness key is gone until its next beat, so
        # every rebalance releases it): bind again after a pause, not thousands of times
        now = time.monotonic()
        pause = REBIND_RETRY if now - flow.lost_at < REBIND_RETRY else 0.0
        flow.lost_at = now
        if flow not in self._rebinding:  # a running one binds the id the flow has by then
            self._rebinding.add(flow)
            self._spawn(self._rebind(flow, pause))

    async def _rebind(self, flow: Flow, pause: float = 0.0) -> None:
        """Bind until the id bound is still the flow's once its lease check or wake-up is
        done: taken for lost again meanwhile (a lease check released it, its node's
        liveness key not back yet), it would keep an id bound nowhere, and an exclusive
        flow would never fetch again."""
        try:
            while (bound := await self._bind_again(flow, pause)) is not None:
                if flow.closed or flow.id == bound:
                    break
                pause = REBIND_RETRY
        finally:
            self._rebinding.discard(flow)

    async def _bind_again(self, flow: Flow, pause: float) -> str | None:
        """The id bound, or None when the flow ended or cannot be bound."""
        if pause:
            await asyncio.sleep(pause)
            if flow.closed:
                return None
        while True:
            bound_id = flow.id
            try:
                await self._register(flow)
                if flow.id == bound_id:
                    break
                # taken for lost again meanwhile: that id's unbind may have run before
                # this bind; unbind it again and bind the flow's id now
                self._unbinds.append((flow.queue, bound_id, None))
                self._kick()
                flow.registered = float("inf")
                continue
            except BindError as exc:
                if exc.code == "egress_disabled" and not flow.closed:
                    # a repartition unbinds every flow while egress is disabled, as it must
                    # be: the flow waits for egress as a bound one does, not ended
                    await asyncio.sleep(REBIND_RETRY)
                    if flow.closed:
                        return None
                    continue
                if exc.code == "not_found":
                    self._queue_gone(flow)
                elif not flow.closed:  # refused to it alone
                    self._end_flow(flow, str(exc))
                return None
            except RedisError as exc:
                if not isinstance(exc, (RedisConnectionError, RedisTimeoutError)) and not (
                    refused_for_now(exc)
                ):
                    # not to be tried again: the next lease check or partition refresh
                    # finds the id unbound and takes the flow for lost once more
                    log.error("flow %s cannot bind again: %s", flow.id, exc)
                    flow.registered = 0
                    return None
                if flow.closed:  # a bind of its id may have run, its reply lost
                    self._unbind_unknown(flow)
                    return None
                log.warning("flow %s cannot bind again yet: %s", flow.id, exc)
                await asyncio.sleep(REBIND_RETRY)  # the same id: binding it twice is once
        if flow.closed:  # closed meanwhile: its unbind may have run before this bind
            self._unbind_unknown(flow)
            return None
        if flow.exclusive:
            await self.check_lease(flow.queue)
        elif flow.partitioned:
            self.request_rebalance(flow.queue)
        else:
            self.wake(flow)
        return bound_id


def _known(fetch: _Fetch) -> list[str]:
    """The ids, as gw_fetch gives them for `fetch.queue`, of what its flow holds."""
    if fetch.partition is None:
        return list(fetch.flow.unacked)
    prefix = f"{fetch.partition}/"
    return [e[len(prefix) :] for e in fetch.flow.unacked if e.startswith(prefix)]


def _just_before(entry_id: str) -> str:
    """The stream id just before `entry_id`: a range starting after it takes that entry."""
    ms, seq = (int(part) for part in entry_id.split("-"))
    return f"{ms}-{seq - 1}" if seq else f"{ms - 1}-{2**64 - 1}"


def _member_id(member: bytes) -> str:
    """The entry id a sorted queue's index member names (sort_member in functions.lua:
    it ends with the id's two numbers, zero-padded to 20 digits and joined by '-')."""
    return f"{int(member[-41:-21])}-{int(member[-20:])}"


def _due_held(flow: Flow, limit: int) -> list[str]:
    """Up to `limit` ids of entries the browser saw held whose delivery time came."""
    if not flow.held:
        return []
    now = time.time() * 1000
    return [entry_id for entry_id, due in flow.held.items() if due <= now][:limit]


def _apply_meta(message: Message, meta: bytes) -> None:
    """What the entry's fields add to its message (see gw_fetch): the effective expiry when
    the queue's max_ttl_ms shortened it, and where a dead-lettered message came from. A
    dead-lettered message's own expiry stays behind, as RabbitMQ removes it: passed, it
    would make its consumers drop it; only the dead message queue's max_ttl_ms applies."""
    expiry, origin, reason = meta.decode().split("\n", 2)
    # Lua prints numbers of 1e17 and more with an exponent
    effective = (int(expiry) if expiry.isdigit() else int(float(expiry))) if expiry else None
    if origin:
        message.expiration = effective
        message.annotations[ORIGIN_QUEUE] = origin
        message.annotations[DEAD_LETTER_REASON] = reason
    elif effective is not None and (message.expiration is None or effective < message.expiration):
        message.expiration = effective


def flow_fence(flow: Flow, partition: int | None) -> str:
    """The fencing token a fetch must present (exclusive lease or partition ownership)."""
    return flow.fence if partition is None else flow.parts.get(partition, "")


def _group(
    items: list[_Settle],
) -> dict[tuple[str, str], tuple[list[str], list[int]]]:
    """Settlements by (queue, flow): their entry ids and, in the same order, their sizes."""
    groups: dict[tuple[str, str], tuple[list[str], list[int]]] = {}
    for queue, flow_id, entry_id, size in items:
        group = groups.get((queue, flow_id))
        if group is None:
            group = groups[queue, flow_id] = ([], [])
        group[0].append(entry_id)
        group[1].append(size)
    return groups


def _pack_sizes(sizes: list[int]) -> bytes:
    """gw_settle reads one entry's size only when it settles fewer than it was sent (some
    were settled before): one binary argument of little-endian uint32s costs less to pack
    and to hand to Lua than an argument per entry."""
    return struct.pack(f"<{len(sizes)}I", *sizes)
