"""Queue deletions told to what uses a queue without a flow: an AMQP sender link whose target
is the queue, which ends with amqp:resource-deleted when the queue goes (as RabbitMQ and
ActiveMQ Artemis end it), rather than stay attached to a name that stores nothing.

A consumer learns of the deletion through its flow (Dispatcher.queue_deleted); a watch
here through the deletion's event ('qdel', which the Redis function that deletes a queue
publishes, whichever node asked for it, or an auto-delete or a dead node's reaping did),
or, when the event channel was lost, through `recheck` once it is back. The event comes on
a connection of its own, so by then the queue may have been made again under its name:
its `created_ms` tells the queue a watch began on from that one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from gateway.engine.queues import QueueError, QueueStore

log = logging.getLogger(__name__)

OnDeleted = Callable[[], None]


class DeletionWatch:
    """One watcher of one queue; `cancel` it when it no longer cares."""

    __slots__ = ("_watches", "created_ms", "on_deleted", "queue", "reread")

    def __init__(self, watches: DeletionWatches, queue: str, on_deleted: OnDeleted) -> None:
        self._watches = watches
        self.queue = queue
        self.on_deleted = on_deleted
        self.created_ms: int | None = None  # None while its first read is under way
        self.reread = False  # an event came during that read: its answer may be stale

    def cancel(self) -> None:
        self._watches.forget(self)


class DeletionWatches:
    """The deletion watches of one node, by queue."""

    def __init__(self, queues: QueueStore) -> None:
        self._queues = queues
        self._by_queue: dict[str, dict[DeletionWatch, None]] = {}

    async def watch(self, queue: str, on_deleted: OnDeleted) -> DeletionWatch:
        """Call `on_deleted()` once `queue` is deleted; QueueError 'not_found' if there is no
        such queue (a partition or priority level is none). Registered before the queue is
        read, so a deletion after that read is never missed."""
        watch = DeletionWatch(self, queue, on_deleted)
        self._by_queue.setdefault(queue, {})[watch] = None
        try:
            created = (await self._queues.config(queue)).created_ms
            while watch.reread:  # a deletion's event came meanwhile: read what it left
                watch.reread = False
                created = (await self._queues.config(queue)).created_ms
        except BaseException:
            watch.cancel()
            raise
        watch.created_ms = created
        return watch

    def forget(self, watch: DeletionWatch) -> None:
        watches = self._by_queue.get(watch.queue)
        if watches is None:
            return
        watches.pop(watch, None)
        if not watches:
            del self._by_queue[watch.queue]

    async def queue_deleted(self, queue: str) -> None:
        """A deletion of `queue` was announced: tell the watches of the queue that went,
        unless it is there still, the same queue (the event of an earlier one's deletion,
        heard late). Should Redis not answer, as the event says."""
        try:
            await self._check(queue)
        except RedisError as exc:
            log.warning("checking deleted queue %s failed: %s", queue, exc)
            self._tell(queue, None)

    async def recheck(self) -> None:
        """The event channel is back: a deletion meanwhile may have gone unheard. Raises
        StoreError when Redis does not answer (the caller tries again)."""
        for queue in list(self._by_queue):
            await self._check(queue)

    async def _check(self, queue: str) -> None:
        watches = self._by_queue.get(queue)
        if not watches:
            return
        for watch in watches:
            if watch.created_ms is None:
                watch.reread = True
        try:
            created: int | None = (await self._queues.config(queue)).created_ms
        except QueueError:  # not_found
            created = None
        self._tell(queue, created)

    def _tell(self, queue: str, created: int | None) -> None:
        """End the watches of `queue` not begun on the one made at `created` (None: none)."""
        for watch in list(self._by_queue.get(queue, ())):
            if watch.created_ms is not None and watch.created_ms != created:
                watch.cancel()
                try:
                    watch.on_deleted()
                except Exception:
                    log.exception("telling of the deletion of queue %s failed", queue)
