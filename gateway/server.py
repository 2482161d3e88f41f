"""Start-up and shut-down of one gateway node.

Protocol adapters are found through the ``gateway.protocols`` entry-point group (each entry
is ``async def start(broker, settings) -> listener`` with ``name``, ``port`` and
``async close()``), so this package never imports ``protocols/``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from importlib.metadata import entry_points
from typing import Any, Protocol

from redis.exceptions import RedisError

from gateway.acl import literal_denials
from gateway.admin.api import AdminApi
from gateway.admin.http import HttpServer
from gateway.broker import Broker
from gateway.config import ConfigError, Settings, queue_subscriptions
from gateway.engine import library
from gateway.engine.queues import RUNTIME_SETTINGS, QueueConfig, QueueError
from gateway.engine.spool_usage import SpoolLimits, SpoolMonitor

log = logging.getLogger("gateway")

PROTOCOL_GROUP = "gateway.protocols"
# Telling Redis the node goes, once clients' sessions are saved (the listeners' close,
# bounded by their own waits): a stalled Redis must not keep the process from exiting;
# other nodes take over once the node's liveness key expires.
STOP_REDIS_GRACE_S = 5.0
STOP_REDIS_HURRIED_S = 0.5  # the same once asked again: a healthy Redis is still told


class Listener(Protocol):
    name: str
    port: int  # the plain listener; `extra_ports` (optional) names others, e.g. mqtt_tls_port

    async def close(self) -> None: ...


def warn_literal_denials(settings: Settings) -> None:
    """A deny pattern MQTT cannot read is a topic name: said, should a filter be meant. A
    user name with ':' logs in over MQTT and AMQP, not to the admin API (HTTP Basic splits
    at the first colon, RFC 7617 §2): said, not refused, as such users may exist."""
    for user, pattern in literal_denials(settings.acl):
        log.warning(
            "acl: %r of user %r is no MQTT filter: it denies that topic name only", pattern, user
        )
    for name in (user.name for user in settings.users if ":" in user.name):
        log.warning("users: %r has ':', which the admin API's HTTP Basic login cannot carry", name)


async def provision(broker: Broker, settings: Settings) -> None:
    """Create the queues of the config file (idempotent). One that exists with other
    properties is a ConfigError (the node does not start); its run-time settings (PATCH's
    to change) stay as stored, and a warning names those the file would change."""
    for spec in settings.queues:
        config = QueueConfig.from_json(spec)
        try:
            created = await broker.declare_queue(config, queue_subscriptions(spec))
        except QueueError as exc:
            raise ConfigError(f"queue {config.name!r} of the config file: {exc}") from None
        if not created:
            stored = (await broker.queues.info(config.name)).config
            kept = [
                f"{name}={getattr(stored, name)!r} (the file: {spec[name]!r})"
                for name in sorted((RUNTIME_SETTINGS | {"partition_count"}) & spec.keys())
                if getattr(stored, name) != getattr(config, name)
            ]
            if kept:
                log.warning(
                    "queue %s keeps its stored %s: change run-time settings with PATCH",
                    config.name,
                    ", ".join(kept),
                )
        log.info("provisioned queue %s", config.name)


async def run_node(
    settings: Settings,
    redis_url: str,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[Broker], Awaitable[None]] | None = None,
    supervise: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run until `stop` is set (or SIGINT / SIGTERM), then shut down in order.

    `on_ready(broker)` runs once everything listens (embedding programs and tests use it);
    `supervise()` runs from then until the shutdown starts (the embedded Redis's restarts).
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        client = await library.connect(redis_url)
    except (RedisError, ValueError) as exc:  # refused, wrong password, a URL redis-py
        # cannot read...: one line, not a traceback
        raise library.RedisUnsuitable(
            f"cannot use Redis at {library.redacted(redis_url)}: {exc}"
        ) from None
    broker = Broker(client, heartbeat=settings.heartbeat_s, node_ttl=settings.node_ttl_s)
    listeners: list[Listener] = []
    supervisor: asyncio.Task | None = None
    api = AdminApi(broker, settings.users, settings.acl)
    admin = HttpServer(api)
    spool = SpoolMonitor(client, broker.node_id, broker.events, SpoolLimits.from_settings(settings))
    try:
        await broker.start()
        await spool.start()
        await provision(broker, settings)
        warn_literal_denials(settings)
        admin_port = await admin.start(settings.host, settings.admin_port)
        for ep in sorted(entry_points(group=PROTOCOL_GROUP), key=lambda e: e.name):
            listener = await ep.load()(broker, settings)
            if listener is not None:
                listeners.append(listener)
        ready: dict[str, Any] = {
            "event": "ready",
            "node": broker.node_id,
            "admin_port": admin_port,
            "redis_url": library.redacted(redis_url),
            **{f"{lst.name}_port": lst.port for lst in listeners},
            **{k: v for lst in listeners for k, v in getattr(lst, "extra_ports", {}).items()},
        }
        print(json.dumps(ready), flush=True)
        log.info("gateway node %s ready", broker.node_id)
        if supervise is not None:
            supervisor = loop.create_task(supervise())
        if on_ready is not None:
            await on_ready(broker)
        await stop.wait()
        log.info("shutting down")
        api.stopping = True  # the health probe says so while the listeners close
    finally:
        hurry = asyncio.Event()  # a second signal: wait for Redis no more
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, hurry.set)
        if supervisor is not None:
            supervisor.cancel()
        # each stops accepting first, then saves its clients' sessions
        closing = asyncio.gather(*(listener.close() for listener in listeners))
        if not await within(closing, hurry):
            log.warning("stopping before clients' sessions are saved (asked again)")
            closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        await admin.close()
        try:
            await leave_redis(spool, broker, hurry)
        finally:
            await client.aclose()


async def within(work: asyncio.Future, hurry: asyncio.Event, timeout: float | None = None) -> bool:
    """Wait for `work` until `hurry` is set or `timeout` passed; whether it is done."""
    hurried = asyncio.ensure_future(hurry.wait())
    await asyncio.wait((work, hurried), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    hurried.cancel()
    return work.done()


async def leave_redis(spool: SpoolMonitor, broker: Broker, hurry: asyncio.Event) -> None:
    """Tell Redis the node goes, for up to STOP_REDIS_GRACE_S or until `hurry` is set
    (STOP_REDIS_HURRIED_S if it already is); failing that, stop everything here without
    telling it."""

    async def told() -> None:
        await spool.stop()
        await broker.stop()

    telling = asyncio.ensure_future(told())
    if hurry.is_set():
        await asyncio.wait((telling,), timeout=STOP_REDIS_HURRIED_S)
    else:
        await within(telling, hurry, STOP_REDIS_GRACE_S)
    if not telling.done():
        telling.cancel()
        log.warning(
            "stopping without telling Redis (%s): other nodes take over once this node's"
            " liveness key expires",
            "asked again" if hurry.is_set() else f"no answer in {STOP_REDIS_GRACE_S:g} s",
        )
    outcome = (await asyncio.gather(telling, return_exceptions=True))[0]
    if outcome is None:
        return
    if isinstance(outcome, RedisError):
        log.warning(
            "cannot tell Redis this node stops (%s): others take over once its liveness"
            " key expires",
            outcome,
        )
    elif not isinstance(outcome, asyncio.CancelledError):
        raise outcome
    await spool.stop(tell_redis=False)
    await broker.stop(tell_redis=False)


async def signals_ignored_after(node: Awaitable[None]) -> None:
    """Once the node is down, SIGINT and SIGTERM are ignored until the process exits: one
    arriving after the event loop closed (its handlers gone), an operator's second Ctrl-C
    or kill, ended the process by the signal rather than 0 and cut the embedded Redis's
    stop short."""
    try:
        await node
    finally:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)  # or closing the loop would restore the default
            signal.signal(sig, signal.SIG_IGN)


# Young-generation collections every 700 allocations cost the MQTT path ~17% of its CPU per
# message (bench/results/profiles); message objects are short-lived and rarely cyclic.
GC_THRESHOLDS = (50_000, 20, 20)


def run(
    settings: Settings, redis_url: str, supervise: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Run a node on uvloop when available, with the garbage collector tuned for it."""
    gc.set_threshold(*GC_THRESHOLDS)
    node = signals_ignored_after(run_node(settings, redis_url, supervise=supervise))
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep asyncio usable
        asyncio.run(node)
        return
    if sys.version_info >= (3, 12):
        asyncio.run(node, loop_factory=uvloop.new_event_loop)
    else:
        uvloop.run(node)
