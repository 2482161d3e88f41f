"""Consumer flows: windows, batched fetches and settlements, exclusive access.

A flow is one consumer of one queue: a consumer in the queue's consumer group, named by a
flow id that starts with the node id (so a dead node's flows can be found and released).
The node's `Dispatcher` runs one pump task: each round sends, in one pipelined round trip,
the settlements (ack / requeue / reject) gathered since the last round and a fetch for every
flow that has window space and may have work, then hands the fetched messages to the flows'
callbacks. Settlements go before fetches so a requeued message is seen by the next fetch.

Exclusive queues: the earliest-bound flow on a live node holds the lease (with a fencing
token checked by every fetch); the others are standbys, promoted in bind order when the
lease moves (unbind, or the holder's node stops heartbeating).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from gateway.model import Delivery, decode

log = logging.getLogger(__name__)

FETCH_BATCH = 256
DEFAULT_WINDOW = 256

DeliverCallback = Callable[[Delivery], None]
ClosedCallback = Callable[[str], None]


class BindError(Exception):
    """A refused bind; `code` is 'not_found' or 'egress_disabled'."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Flow:
    """One consumer's binding to a queue. Adapters settle through it and size its window."""

    __slots__ = (
        "_dispatcher",
        "active",
        "closed",
        "credit",
        "exclusive",
        "fence",
        "id",
        "on_closed",
        "on_deliver",
        "queue",
        "unacked",
        "window",
    )

    def __init__(
        self,
        dispatcher: Dispatcher,
        flow_id: str,
        queue: str,
        exclusive: bool,
        window: int,
        credit: int | None,
        on_deliver: DeliverCallback,
        on_closed: ClosedCallback | None,
    ) -> None:
        self._dispatcher = dispatcher
        self.id = flow_id
        self.queue = queue
        self.exclusive = exclusive
        self.window = window
        self.credit = credit
        self.on_deliver = on_deliver
        self.on_closed = on_closed
        self.unacked: dict[str, int] = {}
        self.active = not exclusive
        self.fence = ""
        self.closed = False

    @property
    def space(self) -> int:
        """How many more messages this flow may take now."""
        free = self.window - len(self.unacked)
        return free if self.credit is None else min(free, self.credit)

    def ack(self, entry_id: str) -> None:
        """The consumer processed the message: delete it from the queue."""
        self._settle("ack", entry_id)

    def requeue(self, entry_id: str) -> None:
        """Give the message back (nack / released / modified): redelivered, count kept."""
        self._settle("requeue", entry_id)

    def reject(self, entry_id: str) -> None:
        """The consumer refuses the message for good: it is discarded and counted."""
        self._settle("reject", entry_id)

    def _settle(self, mode: str, entry_id: str) -> None:
        size = self.unacked.pop(entry_id, None)
        if size is None or self.closed:
            return
        self._dispatcher.settle(mode, self, entry_id, size)

    def set_window(self, window: int) -> None:
        """Maximum delivered-but-unsettled messages (MQTT receive maximum, prefetch)."""
        self.window = max(0, window)
        self._dispatcher.wake(self)

    def set_credit(self, credit: int | None) -> None:
        """AMQP link credit: decremented per delivery; None means window only."""
        self.credit = credit
        self._dispatcher.wake(self)

    async def close(self) -> None:
        """Unbind: settlements made so far go first, unsettled messages are redelivered."""
        if not self.closed:
            self.closed = True
            await self._dispatcher.unbind(self)


class Dispatcher:
    """All flows of one node; see the module docstring for the pump's round."""

    def __init__(self, redis: aioredis.Redis, node_id: str) -> None:
        self._redis = redis
        self.node_id = node_id
        self._ids = itertools.count(1)
        self.flows: dict[str, list[Flow]] = {}
        self._want: dict[Flow, None] = {}
        self._settles: dict[str, list[tuple[str, str, str, int]]] = {}
        self._unbinds: list[tuple[Flow, asyncio.Future]] = []
        self._lease_checks: set[str] = set()
        self._task: asyncio.Task | None = None
        self.on_last_flow: Callable[[str], None] | None = None
        self.delivered = 0
        self.rounds = 0

    # -- binding ---------------------------------------------------------------------------

    async def bind(
        self,
        queue: str,
        on_deliver: DeliverCallback,
        *,
        window: int = DEFAULT_WINDOW,
        credit: int | None = None,
        on_closed: ClosedCallback | None = None,
    ) -> Flow:
        flow_id = f"{self.node_id}.{next(self._ids)}"
        _status, access = await self._register(queue, flow_id)
        flow = Flow(
            self, flow_id, queue, access == "exclusive", window, credit, on_deliver, on_closed
        )
        local = self.flows.setdefault(queue, [])
        local.append(flow)
        if flow.exclusive:
            await self.check_lease(queue)
        else:
            self.wake(flow)
        return flow

    async def _register(self, queue: str, flow_id: str) -> tuple[str, str]:
        reply = await self._redis.fcall("gw_bind", 0, queue, flow_id, self.node_id)
        status = reply[0].decode()
        if status == "noqueue":
            raise BindError("not_found", f"queue {queue!r} does not exist")
        if status == "egress":
            raise BindError("egress_disabled", f"queue {queue!r} has egress disabled")
        return status, reply[2].decode()

    async def unbind(self, flow: Flow) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._unbinds.append((flow, fut))
        self._forget(flow)
        self._kick()
        await fut

    def _forget(self, flow: Flow) -> None:
        self._want.pop(flow, None)
        local = self.flows.get(flow.queue)
        if local and flow in local:
            local.remove(flow)
            if not local:
                del self.flows[flow.queue]
                if self.on_last_flow is not None:
                    self.on_last_flow(flow.queue)

    def close_queue_flows(self, queue: str, reason: str) -> None:
        """The queue went away (deleted): end its local flows and tell their owners."""
        for flow in list(self.flows.get(queue, ())):
            flow.closed = True
            self._forget(flow)
            if flow.on_closed is not None:
                flow.on_closed(reason)

    # -- wake-ups --------------------------------------------------------------------------

    def wake(self, flow: Flow) -> None:
        """The flow may have work (new messages, more space)."""
        if not flow.closed and flow.active and flow.space > 0:
            self._want[flow] = None
            self._kick()

    def wake_queue(self, queue: str) -> None:
        for flow in self.flows.get(queue, ()):
            self.wake(flow)

    def wake_all(self) -> None:
        for queue in list(self.flows):
            self.wake_queue(queue)

    def settle(self, mode: str, flow: Flow, entry_id: str, size: int) -> None:
        self._settles.setdefault(mode, []).append((flow.queue, flow.id, entry_id, size))
        self.wake(flow)

    async def check_lease(self, queue: str) -> None:
        """Ask Redis who holds an exclusive queue; promote or demote local flows."""
        fence, holder = await self._redis.fcall("gw_lease", 0, queue)
        holder = holder.decode()
        for flow in self.flows.get(queue, ()):
            if not flow.exclusive:
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

    # -- the pump --------------------------------------------------------------------------

    def _kick(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        try:
            await asyncio.sleep(0)  # gather this turn's settlements and wake-ups
            while self._settles or self._unbinds or self._want or self._lease_checks:
                try:
                    await self._round()
                except Exception:
                    log.exception("dispatch round failed; retrying")
                    await asyncio.sleep(0.5)
        finally:
            self._task = None

    async def _round(self) -> None:
        self.rounds += 1
        settles, self._settles = self._settles, {}
        unbinds, self._unbinds = self._unbinds, []
        lease_checks, self._lease_checks = self._lease_checks, set()
        pipe = self._redis.pipeline(transaction=False)
        for mode, items in settles.items():
            args: list[object] = [mode]
            for (queue, flow_id), group in _group(items).items():
                args += [queue, flow_id, len(group)]
                for entry_id, size in group:
                    args += [entry_id, size]
            pipe.fcall("gw_settle", 0, *args)
        for flow, _ in unbinds:
            pipe.fcall("gw_unbind", 0, flow.queue, flow.id)
        fetching: list[tuple[Flow, int]] = []
        for flow in list(self._want):
            del self._want[flow]
            n = min(flow.space, FETCH_BATCH)
            if n <= 0 or flow.closed or not flow.active:
                continue
            fetching.append((flow, n))
            pipe.fcall("gw_fetch", 0, flow.queue, flow.id, n, flow.fence)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:
            # nothing was applied for sure: put the work back and let the caller retry
            for mode, items in settles.items():
                self._settles.setdefault(mode, []).extend(items)
            self._unbinds.extend(unbinds)
            self._lease_checks |= lease_checks
            for flow, _ in fetching:
                self._want[flow] = None
            raise exc
        pos = len(settles)
        for (_, fut), reply in zip(unbinds, replies[pos : pos + len(unbinds)], strict=False):
            if not fut.done():
                if isinstance(reply, Exception):
                    fut.set_exception(reply)
                else:
                    fut.set_result(None)
        pos += len(unbinds)
        for (flow, requested), reply in zip(fetching, replies[pos:], strict=False):
            if isinstance(reply, Exception):
                log.warning("fetch for flow %s failed: %s", flow.id, reply)
                self._want[flow] = None
                continue
            self._deliver(flow, requested, reply)
        for queue in lease_checks:
            await self.check_lease(queue)

    def _deliver(self, flow: Flow, requested: int, reply: list) -> None:
        status = reply[0]
        if status != b"ok":
            self._fetch_refused(flow, status.decode())
            return
        if flow.closed:
            return  # closed while fetching: its pending unbind returns these entries
        got = (len(reply) - 1) // 3
        queue = flow.queue
        for i in range(1, len(reply), 3):
            entry_id = reply[i].decode()
            blob = reply[i + 2]
            flow.unacked[entry_id] = len(blob)
            if flow.credit is not None:
                flow.credit -= 1
            delivery = Delivery(queue, entry_id, decode(blob), int(reply[i + 1]), len(blob))
            self.delivered += 1
            try:
                flow.on_deliver(delivery)
            except Exception:
                log.exception("delivery callback of flow %s failed", flow.id)
            if flow.closed:
                return
        if got >= requested and flow.space > 0:  # a full batch: there may be more
            self._want[flow] = None

    def _fetch_refused(self, flow: Flow, status: str) -> None:
        if status == "notowner":
            flow.active = False
            self.request_lease_check(flow.queue)
        elif status == "noflow":
            # our node was presumed dead and the flow released: its messages went back to the
            # queue. Bind again under a new id, so late settlements of the old id are ignored.
            log.warning("flow %s was released by another node; rebinding", flow.id)
            flow.unacked.clear()
            flow.id = f"{self.node_id}.{next(self._ids)}"
            asyncio.get_running_loop().create_task(self._rebind(flow))
        elif status == "noqueue":
            self.close_queue_flows(flow.queue, "queue deleted")
        # 'egress': paused until the queue's config changes (a 'qcfg' event wakes it)

    async def _rebind(self, flow: Flow) -> None:
        try:
            await self._register(flow.queue, flow.id)
        except BindError as exc:
            self.close_queue_flows(flow.queue, str(exc))
            return
        if flow.exclusive:
            await self.check_lease(flow.queue)
        else:
            self.wake(flow)


def _group(items: list[tuple[str, str, str, int]]) -> dict[tuple[str, str], list[tuple[str, int]]]:
    groups: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for queue, flow_id, entry_id, size in items:
        groups.setdefault((queue, flow_id), []).append((entry_id, size))
    return groups
