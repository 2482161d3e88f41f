"""Broker-wide and per-VPN spool quotas, and spool usage threshold events.

As on Solace PubSub+ (message-spool max-spool-usage, a Message VPN's max-msg-spool-usage),
the bytes every queue stores count against the broker-wide quota and against the quota of
the queue's VPN. The running totals, the quotas and the threshold alarms live in Redis and
change inside the function calls that store or remove messages (`account` in
functions.lua), so every node on one Redis enforces the same totals and each crossing of a
threshold (set at `set_percent` of a quota, cleared below `clear_percent`) happens once.
Each threshold event goes into a stream with one consumer group, so exactly one node logs
it; the counts of events live in Redis beside the alarms, for the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from gateway.engine import keys

if TYPE_CHECKING:
    from gateway.config import Settings
    from gateway.engine.events import EventListener

log = logging.getLogger("gateway.spool")

DEFAULT_VPN = "default"
_VPN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")
SCOPES = ("broker", "vpn", "queue")


def vpn_name_error(name: object) -> str | None:
    """Why `name` cannot be a Message VPN name (None: it can). Solace's rule, roughly: up
    to 32 letters, digits, '-', '_' or '.'."""
    if not isinstance(name, str) or not _VPN_NAME.fullmatch(name):
        return f"{name!r} is not a VPN name (1-32 letters, digits, '-', '_' or '.')"
    return None


# The settings of the limits, by the part of them they set (gw_spool_merge_limits's letters:
# the broker quota, the VPN quotas, the threshold percents, which go together)
SPOOL_SETTINGS = {
    "spool_quota_bytes": "b",
    "vpn_spool_quotas": "v",
    "spool_threshold_set_percent": "t",
    "spool_threshold_clear_percent": "t",
}
ALL_PARTS = "bvt"


@dataclass(frozen=True, slots=True)
class SpoolLimits:
    """The quotas (bytes, 0: unlimited) and threshold percents every node enforces."""

    broker_bytes: int = 0
    vpn_bytes: Mapping[str, int] = field(default_factory=dict)
    set_percent: int = 80
    clear_percent: int = 60
    # the parts (ALL_PARTS' letters) set by a file, the environment or a flag, if only to
    # their defaults: they replace the stored ones (a quota of 0 lifts one)
    given: str = field(default="", compare=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> SpoolLimits:
        given = settings.given
        return cls(
            broker_bytes=settings.spool_quota_bytes,
            vpn_bytes=dict(settings.vpn_spool_quotas),
            set_percent=settings.spool_threshold_set_percent,
            clear_percent=settings.spool_threshold_clear_percent,
            given="".join(sorted({part for n, part in SPOOL_SETTINGS.items() if n in given})),
        )

    def parts_set(self) -> str:
        """The parts this node sets: those given, and those other than the defaults (limits
        made in code have no settings)."""
        default = SpoolLimits()
        differ = {
            "b": self.broker_bytes != default.broker_bytes,
            "v": self.vpn_bytes != default.vpn_bytes,
            "t": (self.set_percent, self.clear_percent)
            != (default.set_percent, default.clear_percent),
        }
        return "".join(p for p in ALL_PARTS if p in self.given or differ[p])


async def apply_limits(redis: aioredis.Redis, limits: SpoolLimits, parts: str = ALL_PARTS) -> None:
    """Store the `parts` of the limits for every node on this Redis (the last node started
    sets them; the other parts stay as stored, or take `limits`' when none are), and raise
    or clear the alarms they decide, in one call: nodes starting together each keep what
    the other set. Totals missing (a Redis written by an earlier version, or lost) are first
    rebuilt from the queues' own counters."""
    await redis.fcall("gw_spool_rebuild", 0)
    pairs: list[Any] = []
    for vpn, quota in sorted(limits.vpn_bytes.items()):
        pairs += [vpn, quota]
    await redis.fcall(
        "gw_spool_merge_limits",
        0,
        parts or "-",  # an empty argument is the same to Lua, but clearer in MONITOR
        limits.broker_bytes,
        limits.set_percent,
        limits.clear_percent,
        *pairs,
    )


async def stored_limits(redis: aioredis.Redis) -> SpoolLimits | None:
    """The limits stored in Redis (None: none stored yet)."""
    raw = _decoded(await redis.hgetall(keys.spool_limits))
    if not raw:
        return None
    return SpoolLimits(
        broker_bytes=int(raw.get("broker", 0)),
        vpn_bytes={f[2:]: int(v) for f, v in raw.items() if f.startswith("v:")},
        set_percent=int(raw.get("set", 80)),
        clear_percent=int(raw.get("clear", 60)),
    )


@dataclass(slots=True)
class ScopeUsage:
    """Spool usage of the broker, one VPN or one queue."""

    scope: str  # "broker", "vpn" or "queue"
    name: str  # "" for the broker
    bytes: int
    quota: int  # 0: unlimited
    raised: bool  # the usage threshold alarm is set
    sets: int  # threshold events so far (all nodes)
    clears: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bytes": self.bytes,
            "quota": self.quota,
            "threshold_raised": self.raised,
            "threshold_events": {"set": self.sets, "clear": self.clears},
        }


@dataclass(slots=True)
class SpoolReport:
    """Usage of every scope: the broker, each VPN that stores messages or has a quota, and
    each queue with a threshold alarm or events."""

    set_percent: int
    clear_percent: int
    scopes: list[ScopeUsage]

    def to_json(self) -> dict[str, Any]:
        def of(kind: str) -> list[dict[str, Any]]:
            return [s.to_json() for s in self.scopes if s.scope == kind]

        broker = of("broker")[0]
        del broker["name"]
        return {
            "threshold_set_percent": self.set_percent,
            "threshold_clear_percent": self.clear_percent,
            "broker": broker,
            "vpns": of("vpn"),
            "queues": of("queue"),
        }


def _decoded(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


async def read_usage(redis: aioredis.Redis) -> SpoolReport:
    """A consistent snapshot (one function call, which runs while Redis is full, unlike a
    MULTI) of the totals, quotas, alarms and event counts."""
    *report, queue_flat = await redis.fcall("gw_spool_report", 0)
    usage, limits, alarms, counts = (
        _decoded(dict(zip(flat[::2], flat[1::2], strict=True))) for flat in report
    )
    vpns = {DEFAULT_VPN}
    for f in [*usage, *limits]:
        if f.startswith("v:"):
            vpns.add(f[2:])
    for scope in [*alarms, *(c.partition(":")[2] for c in counts)]:
        kind, _, name = scope.partition(":")
        if kind == "vpn":
            vpns.add(name)
    # (name, bytes, quota) of the queue scopes, a partitioned or priority queue's whole
    queue_rows = sorted(
        (name.decode(), used, quota)
        for name, used, quota in zip(
            queue_flat[::3], queue_flat[1::3], queue_flat[2::3], strict=True
        )
    )

    def scope(kind: str, name: str, used: Any, quota: Any) -> ScopeUsage:
        key = "broker" if kind == "broker" else f"{kind}:{name}"
        return ScopeUsage(
            scope=kind,
            name=name,
            bytes=int(used or 0),
            quota=int(quota or 0),
            raised=key in alarms,
            sets=int(counts.get(f"set:{key}", 0)),
            clears=int(counts.get(f"clear:{key}", 0)),
        )

    scopes = [scope("broker", "", usage.get("broker"), limits.get("broker"))]
    scopes += [scope("vpn", v, usage.get(f"v:{v}"), limits.get(f"v:{v}")) for v in sorted(vpns)]
    scopes += [scope("queue", q, used, quota) for q, used, quota in queue_rows]
    return SpoolReport(
        set_percent=int(limits.get("set", 80)),
        clear_percent=int(limits.get("clear", 60)),
        scopes=scopes,
    )


class SpoolMonitor:
    """A node's part: stores its limits in Redis at start, and logs the threshold events it
    takes from the shared event stream (each event reaches exactly one node)."""

    BATCH = 100

    def __init__(
        self,
        redis: aioredis.Redis,
        node_id: str,
        events: EventListener,
        limits: SpoolLimits,
    ) -> None:
        self._redis = redis
        self._node = node_id
        self._events = events
        self.limits = limits
        self.logged = 0  # threshold events this node logged
        self._task: asyncio.Task | None = None
        self._again = False

    async def start(self) -> None:
        """Store the parts of the limits this node sets (given, or other than the
        defaults); the stored ones of the other parts stay (the last node started with a
        setting sets it). A difference is logged."""
        stored = await stored_limits(self._redis)
        parts = self.limits.parts_set()
        await apply_limits(self._redis, self.limits, parts)
        now = await stored_limits(self._redis)
        if now is not None and now != self.limits:
            log.warning(
                "spool limits of this node differ from those stored (%s): %s",
                stored,
                f"now {now}" if parts else "keeping the stored ones",
            )
            self.limits = now
        await self._events.watch_channel(keys.spool_notify, self._notified)
        await self._drain()  # events raised while no node was listening

    async def stop(self, tell_redis: bool = True) -> None:
        """Stop reading; a Redis gone or failing (or not told: `tell_redis` False) leaves
        the node's reader behind (harmless: nothing reads with it)."""
        if tell_redis:
            await self._events.unwatch_channel(keys.spool_notify)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if not tell_redis:
            return
        try:
            with contextlib.suppress(ResponseError):  # no group yet: nothing to forget
                await self._redis.xgroup_delconsumer(keys.spool_events, keys.GROUP, self._node)
        except RedisError as exc:
            log.warning("cannot forget this node's spool event reader (%s)", exc)

    def _notified(self, _data: bytes) -> None:
        if self._task is not None:
            self._again = True  # the running drain reads once more
            return
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            self._again = True
            while self._again:
                self._again = False
                await self._drain()
        except Exception as exc:  # Redis unreachable: the next notification retries
            log.warning("reading spool threshold events failed: %s", exc)
        finally:
            self._task = None

    async def _drain(self) -> None:
        while True:
            try:
                reply = await self._redis.xreadgroup(
                    keys.GROUP,
                    self._node,
                    {keys.spool_events: ">"},
                    count=self.BATCH,
                    noack=True,
                )
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    return  # no event was ever raised
                raise
            entries = reply[0][1] if reply else []
            for _id, fields in entries:
                self._log(_decoded(fields))
            if len(entries) < self.BATCH:
                return

    def _log(self, event: dict[str, str]) -> None:
        kind, scope = event["e"], event["s"]
        used, quota = int(event["b"]), int(event["q"])
        level = logging.WARNING if kind == "set" else logging.INFO
        share = f"{100 * used / quota:.1f}%" if quota else "no quota"
        words = "reached the set threshold" if kind == "set" else "fell below the clear threshold"
        self.logged += 1
        log.log(
            level,
            "spool usage of %s %s: %d of %d bytes (%s)",
            scope,
            words,
            used,
            quota,
            share,
            extra={
                "fields": {
                    "event": f"spool_threshold_{kind}",
                    "scope": scope.partition(":")[0],
                    "name": scope.partition(":")[2],
                    "bytes": used,
                    "quota": quota,
                    "node": self._node,
                }
            },
        )
