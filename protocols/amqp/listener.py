"""The AMQP 1.0 listener plugin (`gateway.protocols` entry point)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from proton import Condition

from gateway.broker import Broker
from gateway.config import Settings
from protocols.amqp.connection import AmqpConnection

log = logging.getLogger(__name__)

CLOSE_TIMEOUT = 5.0


class Registry:
    """This node's AMQP connections and the background tasks they started."""

    def __init__(self, broker: Broker, settings: Settings) -> None:
        self.broker = broker
        self.settings = settings
        self.connections: set[AmqpConnection] = set()
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("AMQP task failed", exc_info=task.exception())

    async def close(self) -> None:
        """Close every connection, then wait (bounded) for their links to be released."""
        shutdown = Condition("amqp:connection:forced", "gateway shutting down")
        for conn in list(self.connections):
            conn.close(shutdown)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_TIMEOUT
        while (self.connections or self._tasks) and loop.time() < deadline:
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=deadline - loop.time())
            else:
                await asyncio.sleep(0.01)
        for conn in list(self.connections):
            if conn.socket is not None:
                conn.socket.abort()


class Listener:
    """A bound AMQP server socket; `port` is the actual port (settings may ask for 0)."""

    name = "amqp"

    def __init__(self, server: asyncio.Server, registry: Registry) -> None:
        self._server = server
        self.registry = registry
        self.port: int = server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self._server.close()
        await self.registry.close()
        await self._server.wait_closed()


async def start(broker: Broker, settings: Settings) -> Listener | None:
    """Plugin entry point: listen on settings.host:settings.amqp_port."""
    registry = Registry(broker, settings)
    server = await asyncio.get_running_loop().create_server(
        lambda: AmqpConnection(registry), settings.host, settings.amqp_port
    )
    log.info("AMQP listening on %s:%d", settings.host, server.sockets[0].getsockname()[1])
    return Listener(server, registry)
