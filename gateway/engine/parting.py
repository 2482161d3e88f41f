"""Parting messages: what a client's connection leaves to be published should it end
without a word (an MQTT will), kept in Redis so that it goes even when its node dies.

The node holding the connection decides while it runs (it publishes the message or drops
it, and times a delay itself). A node that dies leaves its records to the reaper
(`gw_reap`), which makes each due after its delay; any node then takes due ones
(`gw_parting_take`), publishes them and drops them. A record taken stays due again after a
lease until it is dropped, so a node dying between the two loses none (it may go twice).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
import redis.asyncio as aioredis

from gateway.engine import keys
from gateway.model import Message, decode, encode

TAKE_LEASE_MS = 30_000  # a taken record is due again after this, unless dropped
TAKE_LIMIT = 100  # records taken in one call


def pack(msg: Message, expiry_ms: int | None) -> bytes:
    """`msg` with its expiry as an interval: it counts from when the message goes."""
    return msgpack.packb([expiry_ms, encode(msg)], use_bin_type=True)


def unpack(blob: bytes) -> Message:
    """The message as it goes now: a new id, its expiry counted from now. ValueError: not
    a record this version can read."""
    try:
        expiry_ms, raw = msgpack.unpackb(blob, raw=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise ValueError(f"undecodable parting message: {exc}") from exc
    msg = decode(raw)
    msg.id = ""
    msg.expiration = None if expiry_ms is None else int(time.time() * 1000) + expiry_ms
    return msg


@dataclass
class Due:
    """A record taken to be published; `drop` it once that is done."""

    key: str
    claim: int
    message: bytes


class PartingStore:
    def __init__(self, redis: aioredis.Redis, node_id: str) -> None:
        self._redis = redis
        self._node_id = node_id

    async def hold(
        self, client_id: str, claim: int, ends_session: bool, message: bytes | None, delay_s: int
    ) -> bytes | None:
        """Keep the parting message of the connection of `claim` (None: it has none) in
        place of an earlier connection's. Returns that one's message when it is to go now:
        its node died, and it had no delay or this connection ends the session."""
        return await self._redis.fcall(
            "gw_parting_hold",
            1,
            keys.client_parting(client_id),
            self._node_id,
            claim,
            "1" if ends_session else "",
            delay_s * 1000,
            message or b"",
        )

    async def due(self, client_id: str, claim: int, at_ms: int) -> None:
        """The connection ended; its message waits on this node until `at_ms`, and goes
        then should this node die first."""
        await self._redis.fcall("gw_parting_due", 1, keys.client_parting(client_id), claim, at_ms)

    async def drop(self, client_id: str, claim: int) -> None:
        """The message of the connection of `claim` went, or is not to go."""
        await self._drop(keys.client_parting(client_id), claim)

    async def take(self) -> list[Due]:
        """Due messages of connections whose node died."""
        rows = await self._redis.fcall("gw_parting_take", 0, TAKE_LEASE_MS, TAKE_LIMIT)
        return [Due(key.decode(), int(claim), message) for key, claim, message in rows]

    async def done(self, due: Due) -> None:
        await self._drop(due.key, due.claim)

    async def _drop(self, key: str, claim: int) -> None:
        await self._redis.fcall("gw_parting_drop", 1, key, claim)
