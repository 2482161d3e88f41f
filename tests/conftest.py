"""Shared fixtures: a real redis-server on a free loopback port, a started Broker, the MQTT
and AMQP listeners with default settings on free loopback ports, and all three front doors
(AMQP, MQTT, admin HTTP) at once."""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import uvloop
from proton.utils import BlockingConnection

from gateway.admin.api import AdminApi
from gateway.admin.http import HttpServer
from gateway.broker import Broker
from gateway.config import AclRule, Settings, User
from gateway.engine import library
from gateway.redis_server import repair_aof
from protocols.amqp.listener import Listener as AmqpListener
from protocols.amqp.listener import start as start_amqp
from protocols.mqtt.listener import Listener as MqttListener
from protocols.mqtt.listener import start as start_mqtt
from tests.test_admin_api import Admin


def logged_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """ERROR records of the whole test so far: `caplog.records`, read in a fixture's
    teardown, holds only the teardown's."""
    return [
        record.getMessage()
        for when in ("setup", "call", "teardown")
        for record in caplog.get_records(when)
        if record.levelno >= logging.ERROR
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child on loopback; restartable from its AOF for durability tests."""

    def __init__(self, workdir: Path, appendonly: bool = True) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start, or restart after a crash: a torn transaction at the end of the AOF is cut
        first, as the README tells operators of an external Redis to do."""
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        if self.appendonly:
            repair_aof(self.workdir)
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                str(self.workdir),
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--appendfsync",
                "everysec",
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.close()

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A clean database for each test."""
    client = redis.Redis(port=redis_server.port)
    client.flushall()
    client.close()
    return redis_server.url


@contextlib.asynccontextmanager
async def running_node(
    url: str, heartbeat: float = 0.2, node_ttl: float = 1.0
) -> AsyncIterator[Broker]:
    """A node started on the Redis at `url`, stopped (its client closed) on the way out."""
    client = await library.connect(url)
    node = Broker(client, heartbeat=heartbeat, node_ttl=node_ttl)
    await node.start()
    try:
        yield node
    finally:
        await node.stop()
        await client.aclose()


@pytest.fixture
async def broker(redis_url: str) -> AsyncIterator[Broker]:
    async with running_node(redis_url) as node:
        yield node


@pytest.fixture
def listener_settings() -> Settings:
    """The settings of the `mqtt` and `amqp` listeners: a test module may override it."""
    return Settings(mqtt_port=0, amqp_port=0, host="127.0.0.1")


@pytest.fixture
async def mqtt(broker: Broker, listener_settings: Settings) -> AsyncIterator[MqttListener]:
    listener = await start_mqtt(broker, listener_settings)
    assert listener is not None
    yield listener
    await listener.close()


@pytest.fixture
async def amqp(broker: Broker, listener_settings: Settings) -> AsyncIterator[AmqpListener]:
    listener = await start_amqp(broker, listener_settings)
    assert listener is not None
    yield listener
    await listener.close()


CLIENT_TIMEOUT = 5.0  # seconds a test's client waits for the gateway


@dataclass
class Ports:
    """Where the `ports` fixture's gateway listens."""

    amqp: int
    mqtt: int
    admin: Admin

    @property
    def url(self) -> str:
        return f"amqp://127.0.0.1:{self.amqp}"

    def connect(self, container_id: str | None = None) -> BlockingConnection:
        if container_id is None:
            return BlockingConnection(self.url, timeout=CLIENT_TIMEOUT)
        return BlockingConnection(self.url, timeout=CLIENT_TIMEOUT, container_id=container_id)


@contextlib.asynccontextmanager
async def admin_port_of(
    broker: Broker, users: Iterable[User] = (), acl: Iterable[AclRule] = ()
) -> AsyncIterator[int]:
    """`broker`'s admin API (with `users` and `acl`) on a free loopback port: its port."""
    server = HttpServer(AdminApi(broker, users, acl))
    try:
        yield await server.start("127.0.0.1", 0)
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def admin_of(broker: Broker) -> AsyncIterator[Admin]:
    """`broker`'s admin API on a free loopback port (no users: loopback is the operator)."""
    async with admin_port_of(broker) as port:
        yield Admin(port)


@pytest.fixture
async def admin(broker: Broker) -> AsyncIterator[Admin]:
    async with admin_of(broker) as served:
        yield served


@pytest.fixture
def ports(amqp: AmqpListener, mqtt: MqttListener, admin: Admin) -> Ports:
    """The AMQP and MQTT listeners and the admin API."""
    return Ports(amqp.port, mqtt.port, admin)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict:
    """Tests run on uvloop, as `gateway serve` does."""
    return {"uvloop": uvloop.new_event_loop}
