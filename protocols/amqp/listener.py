"""The AMQP 1.0 listener plugin (`gateway.protocols` entry point)."""

from __future__ import annotations

import logging

from proton import Condition

from gateway.broker import Broker
from gateway.config import Settings
from protocols.amqp.connection import AmqpConnection
from protocols.listening import BackgroundTasks, Listener, Plan
from protocols.tls import tls_context

log = logging.getLogger(__name__)

CLOSE_TIMEOUT = 5.0


class Registry:
    """This node's AMQP connections and the background tasks they started."""

    def __init__(self, broker: Broker, settings: Settings) -> None:
        self.broker = broker
        self.settings = settings
        self.connections: set[AmqpConnection] = set()
        self.closing = False  # connections made from now on are dropped
        self._tasks = BackgroundTasks("AMQP")
        self.spawn = self._tasks.spawn

    async def close(self) -> None:
        """Close every connection, then wait (bounded) for their links to be released."""
        self.closing = True
        shutdown = Condition("amqp:connection:forced", "gateway shutting down")
        for conn in list(self.connections):
            conn.close(shutdown)
        try:
            await self._tasks.wait(lambda: bool(self.connections), CLOSE_TIMEOUT)
        finally:  # also when a second signal cut the wait short
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
