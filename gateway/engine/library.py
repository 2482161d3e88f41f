"""Connects to Redis, checks its version and loads the gateway's function library."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from importlib import resources
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from gateway.engine import keys

log = logging.getLogger(__name__)

MIN_REDIS = (7, 0)
LIBRARY = "gw"  # the name in functions.lua's shebang line


async def replies(pipe: Any) -> list[Any]:
    """A pipeline's replies; the first error Redis answered is raised as Redis gave it:
    redis-py 6.4 replaces the text of the one it raises by an unformatted template, so
    a refusal for now (BUSY, MISCONF) could no longer be told from a fault."""
    found = await pipe.execute(raise_on_error=False)
    for reply in found:
        if isinstance(reply, Exception):
            raise reply
    return found


class RedisUnsuitable(RuntimeError):
    """This Redis cannot keep the gateway's messages safely; the message says why."""


class RedisTooOld(RedisUnsuitable):
    """Redis Functions and the stream commands we rely on need Redis 7.0 or newer."""


def library_source() -> str:
    """functions.lua with the generated key prelude inserted."""
    text = resources.files("gateway.engine").joinpath("functions.lua").read_text()
    return text.replace("-- {{PRELUDE}}", keys.lua_prelude(), 1)


def parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


class _HiredisPacking:
    """Encode commands with hiredis (C) instead of redis-py's pure-Python asyncio packer,
    which profiling showed as the largest single cost of a spool batch."""

    def pack_command(self, *args: Any) -> list[bytes]:
        first = args[0]
        if isinstance(first, str):
            first = first.encode()
        if b" " in first:  # redis-py sends e.g. "CLIENT SETINFO" as one argument
            args = (*first.split(), *args[1:])
        return [hiredis.pack_command(args)]


# A bytes argument this long is written from its own buffer rather than copied into the
# packed command (see pack_in_place).
IN_PLACE_BYTES = 1024


def pack_in_place(args: Sequence[Any]) -> list[bytes]:
    """One command in RESP as chunks for a vectored write, its long bytes arguments as
    chunks of their own. hiredis copies every argument three times into one new buffer;
    for a spool batch of 4 KiB messages that buffer is ~400 KB, freshly faulted in each
    time (8 MQTT pairs: 2.3 page faults and ~5 µs of node CPU a message)."""
    chunks = [b"*%d\r\n" % len(args)]
    start = 0
    for i, arg in enumerate(args):
        if arg.__class__ is bytes and len(arg) >= IN_PLACE_BYTES:
            if start < i:
                packed = hiredis.pack_command(tuple(args[start:i]))
                chunks.append(packed[packed.index(b"\n") + 1 :])  # without its "*<n>" line
            chunks += (b"$%d\r\n" % len(arg), arg, b"\r\n")
            start = i + 1
    if start < len(args):
        packed = hiredis.pack_command(tuple(args[start:]))
        chunks.append(packed[packed.index(b"\n") + 1 :])
    return chunks


class _TcpConnection(_HiredisPacking, aioredis.Connection):
    pass


class _UnixConnection(_HiredisPacking, aioredis.UnixDomainSocketConnection):
    pass


def client_for(url: str) -> aioredis.Redis:
    """A client whose connections pack commands with hiredis."""
    pool = aioredis.ConnectionPool.from_url(url, decode_responses=False)
    if issubclass(pool.connection_class, aioredis.UnixDomainSocketConnection):
        pool.connection_class = _UnixConnection
    elif pool.connection_class is aioredis.Connection:
        pool.connection_class = _TcpConnection
    return aioredis.Redis(connection_pool=pool)


async def loaded_library(client: aioredis.Redis) -> str | None:
    """The source of the gateway's function library as Redis has it; None if not loaded."""
    reply = await client.execute_command("FUNCTION", "LIST", "LIBRARYNAME", LIBRARY, "WITHCODE")
    for library in reply:
        fields = dict(zip(library[::2], library[1::2], strict=True))
        if fields.get(b"library_name") == LIBRARY.encode():
            return fields[b"library_code"].decode()
    return None


async def load(client: aioredis.Redis, *, replace: bool = True) -> None:
    """Load the library, or with `replace` this version of it, unless it is there already:
    Redis refuses FUNCTION LOAD while it is full, and a node must still start then, so its
    consumers can drain it."""
    loaded = await loaded_library(client)
    source = library_source()
    if loaded is None or (replace and loaded != source):
        await client.execute_command("FUNCTION", "LOAD", "REPLACE", source)


def missing(exc: BaseException) -> bool:
    """Redis has no such function: it came back without its data (a Redis with no AOF
    restarted, a new instance) or its functions were flushed."""
    return isinstance(exc, ResponseError) and "Function not found" in str(exc)


def redacted(url: str) -> str:
    """`url` without its password (in the user part, whatever characters it holds, or a
    `password=` parameter): fit for logs and the ready line."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if sep and at and ":" in credentials:
        rest = f"{credentials.partition(':')[0]}:***@{host}"
    return _PASSWORD_PARAM.sub(r"\1***", f"{scheme}{sep}{rest}")


_PASSWORD_PARAM = re.compile(r"([?&]password=)[^&]*")


async def connect(url: str, *, replace: bool = True) -> aioredis.Redis:
    """A client with the library loaded; raises RedisTooOld, or RedisUnsuitable for a Redis
    that evicts keys when full (it would delete stored messages), before touching any data.
    A Redis without an AOF is warned of (snapshots or replicas may be its operator's choice).

    A gateway node replaces the library with its own version; other clients (Spark
    executors, which may run an older package) pass replace=False and load it only if
    it is missing."""
    client = client_for(url)
    try:
        info = await client.info("server")
        version = str(info.get("redis_version", "0"))
        if parse_version(version)[:2] < MIN_REDIS:
            raise RedisTooOld(
                f"Redis {version} at {redacted(url)} is too old: the gateway needs Redis 7.0 "
                "or newer"
            )
        policy = str((await client.info("memory")).get("maxmemory_policy", "noeviction"))
        if policy != "noeviction":
            raise RedisUnsuitable(
                f"Redis at {redacted(url)} evicts keys when full (maxmemory-policy {policy}), "
                "which "
                "would delete stored messages: set maxmemory-policy noeviction"
            )
        if replace and not int((await client.info("persistence")).get("aof_enabled", 1)):
            log.warning(
                "Redis at %s keeps no AOF (appendonly no): the messages acked to publishers "
                "since its last snapshot are lost if it restarts; set appendonly yes",
                redacted(url),
            )
        await load(client, replace=replace)
    except BaseException:
        await client.aclose()
        raise
    return client
