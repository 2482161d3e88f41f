"""Cross-node notifications over Redis pub/sub.

Two kinds of channel: the shared event channel (subscription changes, queue deletions and
config changes, exclusive lease moves) and one wake-up channel per queue that this node
has flows on (published by the spool function when it stores messages). Pub/sub is
at-most-once, so after a reconnect every local flow is woken and the routes reloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.engine import keys

log = logging.getLogger(__name__)

EventHandler = Callable[[str, str], None]  # (kind, argument)
WakeHandler = Callable[[str], None]  # queue name


class EventListener:
    """One pub/sub connection per node; handlers run on the event loop."""

    def __init__(
        self,
        redis: aioredis.Redis,
        node_id: str,
        on_event: EventHandler,
        on_wake: WakeHandler,
        on_reconnect: Callable[[], None],
    ) -> None:
        self._redis = redis
        self._node = node_id.encode()
        self._on_event = on_event
        self._on_wake = on_wake
        self._on_reconnect = on_reconnect
        self._wake_channels: dict[bytes, str] = {}
        self._channels: dict[bytes, Callable[[bytes], None]] = {}
        self._pubsub: aioredis.client.PubSub | None = None
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self.listening = asyncio.Event()  # subscribed now (cleared while reconnecting)
        self.losses = 0  # times the channel was lost
        self.on_lost: Callable[[], None] | None = None  # events may be missed from now on

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await self._ready.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._pubsub is not None:
            await self._pubsub.aclose()

    async def watch_channel(self, channel: str, handler: Callable[[bytes], None]) -> None:
        """Any other channel (e.g. direct topic messages from other nodes)."""
        self._channels[channel.encode()] = handler
        await self._on_connection(True, channel)

    async def unwatch_channel(self, channel: str) -> None:
        self._channels.pop(channel.encode(), None)
        await self._on_connection(False, channel)

    async def watch_queue(self, queue: str) -> None:
        channel = keys.queue_wake(queue)
        self._wake_channels[channel.encode()] = queue
        await self._on_connection(True, channel)

    async def unwatch_queue(self, queue: str) -> None:
        channel = keys.queue_wake(queue)
        self._wake_channels.pop(channel.encode(), None)
        await self._on_connection(False, channel)

    async def _on_connection(self, subscribe: bool, channel: str) -> None:
        """(Un)subscribe on the connection now. One that fails is broken: the reconnect
        subscribes to every channel watched by then, so the failure is not the caller's."""
        pubsub = self._pubsub
        if pubsub is None:
            return
        try:
            await (pubsub.subscribe(channel) if subscribe else pubsub.unsubscribe(channel))
        except (RedisError, OSError, RuntimeError) as exc:
            log.debug("event connection broken while (un)subscribing %s: %s", channel, exc)

    async def _run(self) -> None:
        first = True
        while True:
            try:
                self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                await self._pubsub.subscribe(keys.events, *self._wake_channels, *self._channels)
                self._ready.set()
                self.listening.set()
                if not first:
                    self._on_reconnect()
                first = False
                while True:
                    msg = await self._pubsub.get_message(timeout=5.0)
                    if msg is not None:
                        self._dispatch(msg["channel"], msg["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("event channel lost (%s); reconnecting", exc)
                self.listening.clear()
                self.losses += 1
                if self.on_lost is not None:
                    self.on_lost()
                # watch_* meanwhile only note the channel: the next subscribe takes them all
                pubsub, self._pubsub = self._pubsub, None
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                await asyncio.sleep(0.5)

    def _dispatch(self, channel: bytes, data: bytes) -> None:
        handler = self._channels.get(channel)
        if handler is not None:
            try:
                handler(data)
            except Exception:
                log.exception("handling a message on %r failed", channel)
            return
        queue = self._wake_channels.get(channel)
        if queue is not None:
            if data != self._node:  # our own spools already woke our flows
                self._on_wake(queue)
            return
        kind, _, arg = data.decode().partition(" ")
        try:
            self._on_event(kind, arg)
        except Exception:
            log.exception("handling event %r failed", data)
