"""Direct topic subscribers (not spooled, e.g. MQTT QoS 0) across nodes.

Subscribers are matched in a trie on their own node. A topic message published on a node
reaches that node's subscribers at once, and is relayed over Redis pub/sub (in order, in
batches of what gathered while the one before was sent) only while another node has
direct subscribers: nodes announce themselves in a Redis set and tell the others through
the event channel, and a node's first subscriber is told its subscription holds
(`subscribe` returns) only once every other node that got the announcement answered that
it relays from then on. At most once, like QoS 0.
A message with a later delivery time is held on its node until then, as a spooled one is
(at most MAX_HELD at a time: beyond that it is dropped, as QoS 0 may be).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.engine import keys
from gateway.engine.events import EventListener
from gateway.engine.roll_call import RollCall
from gateway.model import Message, decode, encode
from gateway.topics import SubscriptionTrie

log = logging.getLogger(__name__)

DirectCallback = Callable[[Message], None]
MAX_HELD = 10_000  # direct messages waiting for their delivery time
# a PUBLISH's messages and bytes: what gathers while Redis is slow goes in parts, each well
# below a subscriber's pub/sub output buffer limit (32 MB hard by default)
MAX_RELAY_BATCH = 1000
MAX_RELAY_BYTES = 4 << 20
WITHDRAW_RETRY_S = 1.0  # a withdrawal Redis did not take is tried again after this long


class DirectRelay:
    def __init__(
        self, redis: aioredis.Redis, node_id: str, events: EventListener, roll_call: RollCall
    ) -> None:
        self._redis = redis
        self._node = node_id
        self._events = events
        self._roll_call = roll_call
        self._trie: SubscriptionTrie[int] = SubscriptionTrie()
        self._callbacks: dict[int, DirectCallback] = {}
        self._tokens = itertools.count(1)
        self._others = False  # another node has direct subscribers
        self._told = 0  # 'direct' events heard: a read of the set older than one is stale
        self._announced = False  # other nodes know this one has direct subscribers
        self._listed = False  # an announcement began: a withdrawal has something to undo
        self._closed = False
        self._announcing: asyncio.Task | None = None  # the latest (with)drawal of that
        self._announce_lock = asyncio.Lock()  # one at a time, in order
        self._outbox: list[bytes] = []
        self._relayer: asyncio.Task | None = None  # sends _outbox, batch after batch
        self._tasks: set[asyncio.Task] = set()
        self._held: set[asyncio.TimerHandle] = set()
        self.relayed = 0

    async def subscribe(self, pattern: str, syntax: str, callback: DirectCallback) -> int:
        """Returns once other nodes were told that this one has direct subscribers: they
        relay what is published there from then on. Redis unreachable: local messages
        only, until a later subscriber's announcement gets through."""
        token = next(self._tokens)
        self._trie.add(pattern, token, syntax)
        self._callbacks[token] = callback
        try:
            while self._callbacks:  # a withdrawal under way goes first, then ours
                pending, ours = self._announcing, False
                if pending is None or pending.done():
                    if self._announced:
                        break
                    pending = self._announcing = self._spawn(self._announce(True))
                    ours = True
                try:
                    await asyncio.shield(pending)
                except RedisError as exc:
                    if ours:
                        log.warning("direct subscribers not announced to other nodes: %s", exc)
                        break
        except BaseException:  # cancelled: the caller never gets the token
            self.unsubscribe(token)
            raise
        return token

    def unsubscribe(self, token: int) -> None:
        if self._callbacks.pop(token, None) is None:
            return
        for pattern, syntax, value in list(self._trie.entries()):
            if value == token:
                self._trie.remove(pattern, value, syntax)
        if not self._callbacks and not self._closed:
            self._announcing = self._spawn(self._withdraw())

    def publish(self, msg: Message) -> None:
        """A topic message published on this node: local subscribers, then other nodes'."""
        if msg.not_before is not None and msg.not_before > time.time() * 1000:
            self._hold(msg)
            return
        if self._callbacks:
            self._deliver(msg)
        if self._others:
            self._outbox.append(encode(msg))
            if self._relayer is None:
                self._relayer = self._spawn(self._relay())

    def told(self, node: str) -> bool:
        """`node` announced or withdrew itself (or was reaped). Relay from now on, before
        the set is read again: the announcing node's subscribers wait for this node to
        have been told. False if it was this node itself (reaped while it lives: it
        lists itself again)."""
        if node == self._node:
            if self._announced:
                self._spawn(self._relist_logged())
            return False
        self._told += 1
        self._others = True
        return True

    async def resync(self) -> None:
        """The event channel is back: an announcement may have been missed, and this
        node's own entry lost (reaped while it was presumed dead, a Redis failover)."""
        await self._relist()
        await self._announce(False)  # one that failed half way (a no-op otherwise)
        await self._announce(True)  # one that failed (a no-op otherwise)
        await self.refresh()

    async def _withdraw(self) -> None:
        """Until Redis takes it (or a subscriber comes back): left, the other nodes would
        relay every topic message here."""
        while True:
            try:
                await self._announce(False)
                return
            except RedisError as exc:
                log.warning("withdrawing direct subscribers failed; tried again: %s", exc)
                for _ in range(10):  # a subscriber back meanwhile need not wait for it
                    await asyncio.sleep(WITHDRAW_RETRY_S / 10)
                    if self._callbacks:
                        return

    async def _relist(self) -> None:
        async with self._announce_lock:
            if self._announced and await self._redis.fcall("gw_direct_node", 0, self._node, 1):
                await self._redis.publish(keys.events, f"direct {self._node}")

    async def _relist_logged(self) -> None:
        try:
            await self._relist()
        except RedisError as exc:  # the next resync of the event channel lists it again
            log.warning("cannot list this node's direct subscribers again: %s", exc)

    async def refresh(self) -> None:
        """Learn whether another node has direct subscribers (on start and on 'direct')."""
        told = self._told
        nodes = {n.decode() for n in await self._redis.smembers(keys.direct_nodes)}
        # an event heard meanwhile may be of a node this read missed: its own read follows
        self._others = bool(nodes - {self._node}) or (told != self._told and self._others)

    def _hold(self, msg: Message) -> None:
        if len(self._held) >= MAX_HELD:
            log.warning("direct message for %r dropped: %d already held", msg.destination, MAX_HELD)
            return
        assert msg.not_before is not None
        delay = msg.not_before / 1000 - time.time()
        loop = asyncio.get_running_loop()
        handle = loop.call_later(delay, lambda: self._release(handle, msg))
        self._held.add(handle)

    def _release(self, handle: asyncio.TimerHandle, msg: Message) -> None:
        self._held.discard(handle)
        self.publish(dataclasses.replace(msg, not_before=None))  # due: to other nodes too

    async def close(self, tell_redis: bool = True) -> None:
        """`tell_redis` False: the withdrawal is left to the node's reaping."""
        self._closed = True
        for handle in self._held:
            handle.cancel()
        self._held.clear()
        for task in list(self._tasks):  # relays, withdrawals tried again: this one is last
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        withdraw = bool(self._callbacks or self._listed) and tell_redis
        self._callbacks.clear()
        if withdraw:
            try:
                await self._announce(False)
            except RedisError as exc:  # reaping the node removes it
                log.warning("cannot withdraw this node's direct subscribers: %s", exc)

    async def _announce(self, present: bool) -> None:
        """Tell other nodes whether this one has direct subscribers, unless it already
        did or a later change undid the need (a subscriber came back before a withdrawal
        ran: the node must keep listening)."""
        async with self._announce_lock:
            if present != bool(self._callbacks):
                return
            if present and not self._announced:
                self._listed = True
                await self._events.watch_channel(keys.direct_channel, self._received)
                await self._redis.fcall("gw_direct_node", 0, self._node, 1)
                # the event for nodes that do not answer questions (an older version)
                await self._redis.publish(keys.events, f"direct {self._node}")
                await self._roll_call.ask("direct")
                self._announced = True
            elif not present and self._listed:
                self._announced = False  # half done, the next subscriber announces again
                await self._redis.fcall("gw_direct_node", 0, self._node, 0)
                await self._events.unwatch_channel(keys.direct_channel)
                await self._redis.publish(keys.events, f"direct {self._node}")
                self._listed = False

    async def _relay(self) -> None:
        """One batch at a time, each what gathered while the one before was sent: two
        PUBLISHes in flight on two pooled connections could reach Redis in either order,
        and a topic's messages must not overtake each other (MQTT-4.6.0-6)."""
        try:
            await asyncio.sleep(0)  # this turn's messages go together
            while self._outbox:  # bounded: a subscriber's pub/sub buffer has a hard limit
                batch = self._next_batch()
                self.relayed += len(batch)
                data = self._node.encode() + b"\n" + msgpack.packb(batch, use_bin_type=True)
                try:
                    await self._redis.publish(keys.direct_channel, data)
                except RedisError as exc:  # at most once, as QoS 0 is
                    log.warning("%d direct messages not relayed: %s", len(batch), exc)
        finally:
            self._relayer = None

    def _next_batch(self) -> list[bytes]:
        """The oldest messages of the outbox, up to MAX_RELAY_BATCH of them and
        MAX_RELAY_BYTES in all (one at least)."""
        outbox, size, count = self._outbox, 0, 0
        for blob in outbox[:MAX_RELAY_BATCH]:
            if count and size + len(blob) > MAX_RELAY_BYTES:
                break
            size += len(blob)
            count += 1
        batch = outbox[:count]
        del outbox[:count]
        return batch

    def _received(self, data: bytes) -> None:
        origin, _, body = data.partition(b"\n")
        if origin.decode() == self._node:
            return  # delivered locally when it was published
        for blob in msgpack.unpackb(body, raw=False):
            self._deliver(decode(blob))

    def _deliver(self, msg: Message) -> None:
        for token in self._trie.match(msg.destination):
            callback = self._callbacks.get(token)
            if callback is None:
                continue
            try:
                callback(msg)
            except Exception:
                log.exception("direct subscriber failed")

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
