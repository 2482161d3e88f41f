"""State that protocol sessions keep in Redis so it survives restarts and node changes.

Generic on purpose (the core knows no protocol): an opaque state blob per client id with an
optional expiry (e.g. an MQTT session and its expiry interval), the set of inbound message
ids received but not yet released (exactly-once receipt, e.g. MQTT QoS 2), and retained
messages per topic. Which node holds a client's connection is announced over the event
channel, so a reconnect elsewhere takes the session over.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError

from gateway.engine import keys
from gateway.model import Message, SpoolMark, decode, encode
from gateway.topics import literal_prefix, pattern_matcher

# retained messages decoded (and sent) between turns of the event loop: this many, or
# those that reach this size (250 of 2 MiB were half a GiB at once in a client's buffer)
RETAINED_BATCH = 250
RETAINED_BATCH_BYTES = 1024 * 1024
_GLOB_SPECIAL = re.compile(r"[\\*?\[\]]")  # what a Redis MATCH pattern would read as a wildcard


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

    async def hold(
        self, client_id: str, lease_s: int, node: str, claim: int, expiry_s: int
    ) -> None:
        """The connection of `claim` on `node` holds the session: its state is kept
        `lease_s` (renewed while connected), and `expiry_s` from when the node dies
        (gw_reap), unless a newer connection claimed it by then."""
        await self._expire(client_id, lease_s, (node, claim, expiry_s))

    async def persist(self, client_id: str) -> None:
        """Stop the expiry clock (the client is connected again)."""
        await self._expire(client_id, -1)

    async def _expire(
        self, client_id: str, seconds: int, held: tuple[str, int, int] | None = None
    ) -> None:
        """One function call for both keys (it runs while Redis is full, see functions.lua);
        the claims of a client whose session is held live on with it."""
        state, received = keys.client_state(client_id), keys.client_received(client_id)
        claims = keys.client_claims(client_id)
        node = () if held is None else (held[0], keys.client_hex(client_id), held[1], held[2])
        await self._redis.fcall("gw_client_expire", 3, state, received, claims, seconds, *node)

    async def delete(self, client_id: str) -> None:
        await self._redis.delete(keys.client_state(client_id), keys.client_received(client_id))

    async def start_afresh(self, client_id: str, claim: int) -> None:
        """The connection of `claim` starts a new session: `delete`, and the marks of older
        connections' QoS 2 publishes still on their way count no more (gw_spool_marked)."""
        await self._redis.fcall(
            "gw_client_fresh",
            3,
            keys.client_state(client_id),
            keys.client_received(client_id),
            keys.client_claims(client_id),
            claim,
        )

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

    @staticmethod
    def receipt_mark(client_id: str, message_id: int | str, claim: int) -> SpoolMark:
        """The spool mark of an exactly-once publish (Message.exactly_once) of the client's
        connection of `claim`: the id is recorded received as the message is stored."""
        received, claims = keys.client_received(client_id), keys.client_claims(client_id)
        return received, str(message_id), claims, claim, keys.client_state(client_id)

    async def mark_received(self, client_id: str, message_id: int | str, claim: int) -> bool:
        """Record an inbound message id of the connection of `claim`; False if it was
        already recorded (a duplicate), or its session ended or was started afresh since."""
        return bool(
            await self._redis.fcall(
                "gw_client_mark",
                3,
                keys.client_received(client_id),
                keys.client_claims(client_id),
                keys.client_state(client_id),
                message_id,
                claim,
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

    async def put(self, msg: Message, queued: bool = False) -> bool:
        """Retain `msg`, or clear its topic for an empty payload. A message its queues hold
        (`queued`), or a clear, is retained even when Redis is over its maxmemory: its
        publish was taken. One that no queue took is new data and is refused then: False."""
        function = "gw_retain" if queued or not msg.payload else "gw_retain_new"
        topic = msg.destination
        due = "" if msg.not_before is None else msg.not_before
        blob = encode(msg) if msg.payload else b""
        names = (keys.retained, keys.retained_held_topics, keys.retained_held(topic))
        try:
            await self._redis.fcall(function, 3, *names, topic, _now_ms(), blob, due)
        except OutOfMemoryError:
            return False
        return True

    async def matching(self, pattern: str, syntax: str = "mqtt") -> AsyncIterator[list[Message]]:
        """Retained messages whose topic matches `pattern`, in topic order, in batches
        (RETAINED_BATCH): decoding and sending 100,000 of them in one go held the node's
        event loop near a second. A filter without wildcards names one topic: one call,
        not a scan of every retained message (devices that each subscribe to their own
        topics, with a retained message per device). A filter with a literal start
        ("site/7/+/temp") has Redis send only the topics with that start, not every
        retained message. A topic with held messages is read again at one instant
        (gw_retained): one may have fallen due since its value was read."""
        prefix, exact = literal_prefix(pattern, syntax)
        if exact:
            values = {pattern: await self._value(pattern)}
        else:
            matches = pattern_matcher(pattern, syntax)
            glob = _GLOB_SPECIAL.sub(r"\\\g<0>", prefix) + "*"
            # the topics with held messages first: one of them read by the value scan may
            # have had one fall due meanwhile, so they are read again, each at one instant
            held = [
                name
                async for topic in self._redis.sscan_iter(
                    keys.retained_held_topics, glob, count=1000
                )
                if matches(name := topic.decode())
            ]
            values = {}
            async for topic, blob in self._redis.hscan_iter(keys.retained, glob, count=1000):
                if matches(name := topic.decode()):
                    values[name] = blob
            for name in held:
                values[name] = await self._value(name)
        now_ms = time.time() * 1000
        found: list[Message] = []
        size = 0
        for topic in sorted(values):
            blob = values.pop(topic)
            if not blob:
                continue
            msg = decode(blob)
            if msg.expiration is not None and msg.expiration <= now_ms:
                # neither sent nor kept: it took a place among a subscriber's first ones
                await self._redis.fcall("gw_retained_expired", 1, keys.retained, topic, blob)
            # one stored held before held messages waited apart: not shown before it is due
            elif msg.not_before is None or msg.not_before <= now_ms:
                found.append(msg)
                size += len(blob)
                if len(found) == RETAINED_BATCH or size >= RETAINED_BATCH_BYTES:
                    yield found
                    found, size = [], 0
                    await asyncio.sleep(0)  # the loop's other work goes between batches
        if found:
            yield found

    async def _value(self, topic: str) -> bytes | None:
        names = (keys.retained, keys.retained_held_topics, keys.retained_held(topic))
        return await self._redis.fcall("gw_retained", 3, *names, topic, _now_ms())


def _now_ms() -> int:
    return int(time.time() * 1000)
