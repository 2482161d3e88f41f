"""The server sockets of one protocol (plain, TLS, WebSocket) sharing one registry of its
connections and sessions: what a protocol plugin's `start` returns to the gateway."""

from __future__ import annotations

import asyncio
from typing import Protocol


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

    async def close(self) -> None:
        """Stop accepting, end every connection, then wait for the sockets to close."""
        for server in self._servers.values():
            server.close()
        await self.registry.close()
        for server in self._servers.values():
            await server.wait_closed()
