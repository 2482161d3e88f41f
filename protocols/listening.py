"""The server sockets of one protocol (plain, TLS, WebSocket) sharing one registry of its
connections and sessions: what a protocol plugin's `start` returns to the gateway."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from gateway.broker import StoreError

log = logging.getLogger(__name__)

# A TLS client has as long for its handshake as a plain one for the protocol's opening (a
# socket that never starts one was held for asyncio's 60 s), and a TLS connection the
# gateway closes waits as long as a plain one's unsent bytes for the client's close_notify
# (asyncio's 30 s kept a dead MQTT client's connection, delaying its will and takeover).
TLS_TIMEOUTS = {"ssl_handshake_timeout": 10.0, "ssl_shutdown_timeout": 1.0}

# ready-line key -> (protocol factory, port, TLS context or None)
Plan = dict[str, tuple[Callable[[], asyncio.BaseProtocol], int, ssl.SSLContext | None]]


class Registry(Protocol):
    async def close(self) -> None: ...


class Listener:
    """`port` is the plain port; `extra_ports` holds the others under their ready-line
    keys (e.g. `mqtt_tls_port`), the actual ports when settings asked for 0."""

    def __init__(self, name: str, servers: dict[str, asyncio.Server], registry: Registry) -> None:
        self.name = name
        self._servers = servers
        self.registry = registry
        ports = {key: server.sockets[0].getsockname()[1] for key, server in servers.items()}
        self.port: int = ports.pop(f"{name}_port")
        self.extra_ports: dict[str, int] = ports

    @classmethod
    async def open(cls, name: str, registry: Registry, host: str, plan: Plan) -> Listener:
        """Listen on every socket of `plan` (the plain one is keyed `<name>_port`)."""
        loop = asyncio.get_running_loop()
        servers = {}
        for key, (factory, port, context) in plan.items():
            tls = {} if context is None else TLS_TIMEOUTS
            servers[key] = server = await loop.create_server(
                factory, host, port, ssl=context, **tls
            )
            log.info("%s listening on %s:%d", key, host, server.sockets[0].getsockname()[1])
        return cls(name, servers, registry)

    async def close(self) -> None:
        """Stop accepting, end every connection, then wait for the sockets to close."""
        for server in self._servers.values():
            server.close()
        await self.registry.close()
        for server in self._servers.values():
            await server.wait_closed()


class BackgroundTasks:
    """Tasks a protocol's connections start and do not await (saves, releases): kept
    referenced, failures logged, waited for at shutdown."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if isinstance(exc, StoreError):  # Redis away or refusing: no bug of ours
            log.warning("%s task not done: Redis did not take it: %s", self._label, exc)
        else:
            log.error("%s task failed", self._label, exc_info=exc)

    async def wait(self, busy: Callable[[], bool], timeout: float) -> None:
        """Until no task runs and `busy()` is false, or the timeout. Cancelled (a stop cut
        short), it cancels the tasks and waits for them to end: none runs on after."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while (busy() or self._tasks) and loop.time() < deadline:
                if self._tasks:
                    await asyncio.wait(set(self._tasks), timeout=deadline - loop.time())
                else:
                    await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
