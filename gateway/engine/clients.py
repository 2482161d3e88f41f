"""State that protocol sessions keep in Redis so it survives restarts and node changes.

Generic on purpose (the core knows no protocol): an opaque state blob per client id with an
optional expiry (e.g. an MQTT session and its expiry interval), the set of inbound message
ids received but not yet released (exactly-once receipt, e.g. MQTT QoS 2), and retained
messages per topic. Which node holds a client's connection is announced over the event
channel, so a reconnect elsewhere takes the session over.
"""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Callable, Iterator

import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError

from gateway.engine import keys
from gateway.model import Message, decode, encode
from gateway.topics import literal_prefix, pattern_matcher

_GLOB_SPECIAL = re.compile(r"[\\*?\[\]]")  # what a Redis MATCH pattern would read as a wildcard
_HELD_HEAD = struct.Struct("<dI")  # gw_retain's held record: due epoch ms, message length


class ClientStore:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

    async def save(self, client_id: str, state: bytes, expiry_s: int | None, claim: int) -> bool:
        """Store a session's state as the connection of `claim`; it vanishes `expiry_s`
        seconds later unless saved again. False: a newer connection already loaded it."""
        return bool(
            await self._redis.fcall(
                "gw_client_save",
                2,
                keys.client_state(client_id),
                keys.client_claims(client_id),
                state,
                expiry_s or 0,
                claim,
            )
        )

    async def load(self, client_id: str, claim: int | None = None) -> bytes | None:
        """The stored state; with `claim`, as that connection's own: older connections can
        no longer save over it."""
        if claim is None:
            return await self._redis.get(keys.client_state(client_id))
        return await self._redis.fcall(
            "gw_client_load", 2, keys.client_state(client_id), keys.client_claims(client_id), claim
        )

    async def expire(self, client_id: str, expiry_s: int) -> None:
        """Start the expiry clock (e.g. when the client disconnects); 0 deletes now."""
        await self._expire(client_id, max(0, expiry_s))

    async def persist(self, client_id: str) -> None:
        """Stop the expiry clock (the client is connected again)."""
        await self._expire(client_id, -1)

    async def _expire(self, client_id: str, seconds: int) -> None:
        """One function call for both keys (it runs while Redis is full, see functions.lua);
        the claims of a client whose session is held live on with it."""
        state, received = keys.client_state(client_id), keys.client_received(client_id)
        claims = keys.client_claims(client_id)
        await self._redis.fcall("gw_client_expire", 3, state, received, claims, seconds)

    async def delete(self, client_id: str) -> None:
        await self._redis.delete(keys.client_state(client_id), keys.client_received(client_id))

    async def forget(self, client_id: str, claim: int) -> bool:
        """Delete what the session of the connection of `claim` left, as `delete`, unless a
        newer connection already loaded it: False then."""
        return bool(
            await self._redis.fcall(
                "gw_client_forget",
                3,
                keys.client_state(client_id),
                keys.client_received(client_id),
                keys.client_claims(client_id),
                claim,
            )
        )

    async def mark_received(self, client_id: str, message_id: int | str) -> bool:
        """Record an inbound message id; False if it was already recorded (a duplicate)."""
        return bool(
            await self._redis.fcall(
                "gw_client_mark", 1, keys.client_received(client_id), message_id
            )
        )

    async def release_received(self, client_id: str, message_id: int | str) -> None:
        await self._redis.srem(keys.client_received(client_id), message_id)

    async def received(self, client_id: str) -> set[str]:
        return {m.decode() for m in await self._redis.smembers(keys.client_received(client_id))}


class RetainedStore:
    """The last retained message per topic; an empty payload clears it. One held by a
    delivery delay becomes the topic's value when due (gw_retain), as its live copies
    reach subscribers then: until that, new subscribers get the value before it."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._keys = (keys.retained, keys.retained_pending)

    async def put(self, msg: Message, queued: bool = False) -> bool:
        """Retain `msg`, or clear its topic for an empty payload. A message its queues hold
        (`queued`), or a clear, is retained even when Redis is over its maxmemory: its
        publish was taken. One that no queue took is new data and is refused then: False."""
        function = "gw_retain" if queued or not msg.payload else "gw_retain_new"
        due = "" if msg.not_before is None else msg.not_before
        args = (msg.destination, int(time.time() * 1000), encode(msg) if msg.payload else b"", due)
        try:
            await self._redis.fcall(function, 2, *self._keys, *args)
        except OutOfMemoryError:
            return False
        return True

    async def matching(self, pattern: str, syntax: str = "mqtt") -> list[Message]:
        """Retained messages whose topic matches `pattern`, in topic order. A filter without
        wildcards names one topic: one call, not a scan of every retained message (devices
        that each subscribe to their own topics, with a retained message per device). A
        filter with a literal start ("site/7/+/temp") has Redis send only the topics with
        that start, not every retained message."""
        prefix, exact = literal_prefix(pattern, syntax)
        if exact:
            value, held = await self._redis.fcall_ro("gw_retained", 2, *self._keys, pattern)
            values = {} if value is None else {pattern: value}
            pending = {} if held is None else {pattern: held}
        else:
            matches = pattern_matcher(pattern, syntax)
            glob = _GLOB_SPECIAL.sub(r"\\\g<0>", prefix) + "*"
            # held ones first: one promoted between the two scans is then seen in both
            pending = await self._scan(keys.retained_pending, glob, matches)
            values = await self._scan(keys.retained, glob, matches)
        now_ms = time.time() * 1000
        for topic, packed in pending.items():
            due = [blob for at, blob in _held(packed) if at <= now_ms]
            if due:  # fell due since the topic's last store: newer than its value
                values[topic] = due[-1]
        return [decode(values[t]) for t in sorted(values) if values[t]]

    async def _scan(self, key: str, glob: str, matches: Callable[[str], bool]) -> dict[str, bytes]:
        found = {}
        async for topic, blob in self._redis.hscan_iter(key, glob, count=1000):
            if matches(name := topic.decode()):
                found[name] = blob
        return found


def _held(packed: bytes) -> Iterator[tuple[float, bytes]]:
    """(due epoch ms, message or b"" for a clear) of gw_retain's held records, in due order."""
    at = 0
    while at < len(packed):
        due, size = _HELD_HEAD.unpack_from(packed, at)
        at += _HELD_HEAD.size
        yield due, packed[at : at + size]
        at += size
