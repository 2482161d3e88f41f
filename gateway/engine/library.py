"""Connects to Redis, checks its version and loads the gateway's function library."""

from __future__ import annotations

from importlib import resources

import redis.asyncio as aioredis

from gateway.engine import keys

MIN_REDIS = (7, 0)


class RedisTooOld(RuntimeError):
    """Redis Functions and the stream commands we rely on need Redis 7.0 or newer."""


def library_source() -> str:
    """functions.lua with the generated key prelude inserted."""
    text = resources.files("gateway.engine").joinpath("functions.lua").read_text()
    return text.replace("-- {{PRELUDE}}", keys.lua_prelude(), 1)


def parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


async def connect(url: str) -> aioredis.Redis:
    """A client with the library loaded; raises RedisTooOld before touching any data."""
    client = aioredis.Redis.from_url(url, decode_responses=False)
    try:
        info = await client.info("server")
        version = str(info.get("redis_version", "0"))
        if parse_version(version)[:2] < MIN_REDIS:
            raise RedisTooOld(
                f"Redis {version} at {url} is too old: the gateway needs Redis 7.0 or newer"
            )
        await client.execute_command("FUNCTION", "LOAD", "REPLACE", library_source())
    except BaseException:
        await client.aclose()
        raise
    return client
