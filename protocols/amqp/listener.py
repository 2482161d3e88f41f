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
from protocols.listening import Listener, Plan
from protocols.tls import tls_context

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


async def start(broker: Broker, settings: Settings) -> Listener | None:
    """Plugin entry point: listen on amqp_port, and on amqp_tls_port with a certificate."""
    registry = Registry(broker, settings)

    def factory() -> AmqpConnection:
        return AmqpConnection(registry)

    plan: Plan = {"amqp_port": (factory, settings.amqp_port, None)}
    context = tls_context(settings)
    if context is not None:
        plan["amqp_tls_port"] = (factory, settings.amqp_tls_port, context)
    return await Listener.open("amqp", registry, settings.host, plan)
