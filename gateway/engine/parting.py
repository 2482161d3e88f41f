"""Parting messages: what a client's connection leaves to be published should it end
without a word (an MQTT will), kept in Redis so that it goes even when its node dies.

Each connection's record is its own (by claim). The node holding the connection times
its delay and publishes it, once it took the record (`own`): a new connection to the
session may have settled it first (`hold`: sent, or dropped within the delay), or the node,
presumed dead a while, had its records made due for other nodes. A node that dies leaves
its records to the reaper (`gw_reap`), which makes each due after its delay; any node then
takes due ones (`take`), publishes them and drops them. A record taken is due again after a
lease until it is dropped, so a node dying between the two loses none (it may go twice).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import msgpack
import redis.asyncio as aioredis

from gateway.engine import keys
from gateway.model import Message, decode, encode

TAKE_LEASE_MS = 30_000  # a taken record is due again after this, unless dropped
TAKE_LIMIT = 100  # records taken in one call


def pack(msg: Message) -> bytes:
    """`msg`, just made, with its expiry and delivery time as intervals: they count from
    when the message goes."""
    now = _now_ms()
    expiry = None if msg.expiration is None else msg.expiration - now
    delay = None if msg.not_before is None else msg.not_before - now
    timeless = replace(msg, expiration=None, not_before=None)
    return msgpack.packb([expiry, delay, encode(timeless)], use_bin_type=True)


def unpack(blob: bytes) -> Message:
    """The message as it goes now: a new id, its expiry and delivery time counted from now.
    ValueError: not a record this version can read."""
    try:
        expiry, delay, raw = msgpack.unpackb(blob, raw=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise ValueError(f"undecodable parting message: {exc}") from exc
    msg = decode(raw)
    now = _now_ms()
    msg.id = ""
    msg.expiration = None if expiry is None else now + expiry
    msg.not_before = None if delay is None else now + delay
    return msg


def _now_ms() -> int:
    return int(time.time() * 1000)


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
    ) -> list[Due]:
        """Keep the parting message of the connection of `claim` (None: it has none), and
        settle those of earlier connections to the session (§3.1.3.2.2): returns those to
        send now (their delay ended, their node died with them open, or this connection
        ends the session), taken as `take` takes due ones; those within their delay are
        dropped."""
        rows = await self._redis.fcall(
            "gw_parting_hold",
            1,
            keys.client_parting(client_id),
            self._node_id,
            claim,
            "1" if ends_session else "",
            delay_s * 1000,
            message or b"",
            TAKE_LEASE_MS,
        )
        return _due(rows)

    async def due(self, client_id: str, claim: int, at_ms: int) -> None:
        """The connection ended; its message waits on this node until `at_ms`, and goes
        then should this node die first."""
        await self._redis.fcall("gw_parting_due", 1, keys.client_parting(client_id), claim, at_ms)

    async def own(self, client_id: str, claim: int) -> Due | None:
        """This node is to publish the message of its connection of `claim`: taken as
        `take` takes due ones if it is its to publish, None if it was settled elsewhere (a
        new connection, or other nodes while this one was presumed dead)."""
        key = keys.client_parting(client_id)
        row = await self._redis.fcall("gw_parting_own", 1, key, claim, TAKE_LEASE_MS)
        return _due([row])[0] if row else None

    async def drop(self, client_id: str, claim: int) -> None:
        """The message of the connection of `claim` went, or is not to go."""
        await self._drop(keys.client_parting(client_id), claim)

    async def take(self) -> list[Due]:
        """Due messages of connections whose node died."""
        return _due(await self._redis.fcall("gw_parting_take", 0, TAKE_LEASE_MS, TAKE_LIMIT))

    async def done(self, due: Due) -> None:
        await self._drop(due.key, due.claim)

    async def _drop(self, key: str, claim: int) -> None:
        await self._redis.fcall("gw_parting_drop", 1, key, claim)


def _due(rows: list[list[bytes]]) -> list[Due]:
    return [Due(key.decode(), int(claim), message) for key, claim, message in rows]
