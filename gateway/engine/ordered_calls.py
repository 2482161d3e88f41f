"""Commands written back to back on one Redis connection, answered in the order sent.

Redis runs one connection's commands in arrival order, so a command sees every write of the
commands sent before it on that connection. That lets a caller keep several commands in
flight without giving up order: the spooler sends its next batch while earlier ones are
still being answered, instead of waiting a round trip per batch.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import (
    BusyLoadingError,
    MasterDownError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.engine.library import pack_in_place

log = logging.getLogger(__name__)

Reply = Callable[[Any], None]  # gets the command's reply, or the exception that ended it


class NotSent(RedisConnectionError):
    """No connection to Redis could be made: nothing in flight had been written (the last
    connection's commands were told when it broke), so none of it ran."""


class OrderedCalls:
    """One dedicated connection from `redis`'s pool; replies are read by one task."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._pool = redis.connection_pool
        self._conn: aioredis.Connection | None = None
        self._connecting = asyncio.Lock()
        self._waiting: collections.deque[Reply] = collections.deque()
        self._reader: asyncio.Task | None = None
        self._answered = asyncio.Event()
        self._breaks = 0  # connections lost or not made: see send

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    async def send(self, on_reply: Reply, *args: Any, in_place: bool = False) -> None:
        """Write one command; `on_reply` is called with its reply (a ResponseError for a
        command Redis refused) or with the error that broke the connection, in which case
        every command still in flight is told the same and the next send reconnects.
        Whether a command told of a broken connection ran is unknown; one told NotSent did
        not run.
        `in_place` writes its long bytes arguments from their own buffers (pack_in_place)."""
        self._waiting.append(on_reply)
        conn, stale = self._conn, None
        if conn is not None and len(self._waiting) == 1 and _closed_by_redis(conn):
            # closed while nothing was in flight (Redis restarted): nothing was lost with it,
            # so this command goes on a new connection, not into the dead one (in doubt)
            self._conn, conn, stale = None, None, conn
        try:
            if conn is None:
                breaks = self._breaks
                try:
                    conn = await self._connect()
                except Exception as exc:
                    raise NotSent(f"{exc}") from exc
                if breaks != self._breaks:  # told NotSent while it waited for the connection
                    return
            packed = pack_in_place(args) if in_place else conn.pack_command(*args)
            # writes are synchronous up to the drain, so commands reach the socket in the
            # order their replies are expected
            await conn.send_packed_command(packed, check_health=False)
        except Exception as exc:
            await self._broken(conn, exc)
            return
        finally:
            if stale is not None:
                await stale.disconnect(nowait=True)
                await self._pool.release(stale)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read(conn))

    async def wait_below(self, limit: int) -> None:
        """Return once fewer than `limit` commands are in flight."""
        while len(self._waiting) >= limit:
            self._answered.clear()
            await self._answered.wait()

    async def close(self) -> None:
        """Give the connection back; commands still in flight are told it closed."""
        if self._reader is not None:
            self._reader.cancel()
        await self._broken(self._conn, ConnectionError("closed"))

    async def _connect(self) -> aioredis.Connection:
        async with self._connecting:
            if self._conn is None:
                self._conn = await self._pool.get_connection()
            return self._conn

    async def _read(self, conn: aioredis.Connection) -> None:
        try:
            while self._waiting and conn is self._conn:
                try:
                    reply: Any = await conn.read_response(disconnect_on_error=False)
                except ResponseError as exc:
                    reply = exc
                except BusyLoadingError as exc:  # a refusal redis-py files as a broken link
                    reply = exc
                except Exception as exc:
                    await self._broken(conn, exc)
                    return
                on_reply = self._waiting.popleft()
                self._answered.set()
                _tell(on_reply, reply)
        finally:
            self._reader = None
            if self._waiting and self._conn is not None:  # sent while this task was ending
                self._reader = asyncio.get_running_loop().create_task(self._read(self._conn))

    async def _broken(self, conn: aioredis.Connection | None, exc: BaseException) -> None:
        """Drop `conn` (if still the current one) and tell every command in flight."""
        if conn is not None and conn is not self._conn:
            return  # an older connection's news: its commands were told already
        self._conn = None
        self._breaks += 1
        waiting, self._waiting = self._waiting, collections.deque()
        self._answered.set()
        if conn is not None:
            await conn.disconnect(nowait=True)
            await self._pool.release(conn)
        for on_reply in waiting:
            _tell(on_reply, exc)


def _closed_by_redis(conn: aioredis.Connection) -> bool:
    """Whether Redis ended the connection: its stream reader saw the end, or an error
    (redis-py reads a connection only for a reply, so no one else notices while idle)."""
    reader = conn._reader
    return reader is None or reader.at_eof() or reader.exception() is not None


def broke(reply: Any) -> bool:
    """The reply is the error of a broken connection: whether the command ran is unknown.
    Not Redis's refusal while it loads its data (redis-py's BusyLoadingError is a
    ConnectionError): that command did not run."""
    return isinstance(reply, BaseException) and not isinstance(
        reply, (ResponseError, BusyLoadingError)
    )


# Errors Redis gives before it runs a command, for a state that passes: loading its data
# after a start, a replica (a failover under way), a script running long, or its AOF
# failing to write (a full disk: MISCONF). redis-py has classes for some of them.
_FOR_NOW = (BusyLoadingError, ReadOnlyError, MasterDownError, TryAgainError)
_FOR_NOW_CODES = ("MISCONF ", "BUSY ", "NOREPLICAS ")


def refused_for_now(reply: Any) -> bool:
    """Redis refused the command without running it, and may take it later."""
    return isinstance(reply, _FOR_NOW) or (
        isinstance(reply, ResponseError) and str(reply).startswith(_FOR_NOW_CODES)
    )


def _tell(on_reply: Reply, reply: Any) -> None:
    try:
        on_reply(reply)
    except Exception:  # the caller's bug must not stop the replies after it
        log.exception("reply callback failed")
