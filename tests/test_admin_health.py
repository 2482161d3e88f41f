"""The admin API's health probe tells a load balancer when the node cannot serve: Redis
does not answer, or the node's heartbeat lapsed so other nodes take its flows over. Real
Redis behind a proxy that holds its answers back, a real HTTP server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.admin import api
from gateway.broker import Broker
from gateway.config import Settings
from gateway.server import run_node
from protocols.mqtt.listener import Listener as MqttListener
from tests.conftest import admin_of, free_port
from tests.redis_proxy import CuttingProxy
from tests.test_admin_api import Admin, Reply
from tests.test_redis_outages import node, proxy  # noqa: F401


@pytest.fixture
async def health(node: Broker) -> AsyncIterator[Admin]:  # noqa: F811
    async with admin_of(node) as served:
        yield served


async def test_health_is_503_while_redis_does_not_answer(
    health: Admin,
    proxy: CuttingProxy,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(api, "HEALTH_TIMEOUT_S", 0.3)
    assert (await health.get("/api/v1/health")).status == 200
    proxy.delay_on, proxy.delay = b"PING", 2.0
    reply = await health.get("/api/v1/health")
    assert reply.status == 503, reply.raw  # was an unanswered probe, then a 500
    assert reply.body["status"] == "unavailable"
    assert reply.body["reason"] == "Redis does not answer within 0.3 s"  # was "...answer: "
    await asyncio.sleep(2.0)
    assert (await health.get("/api/v1/health")).status == 200


async def test_health_is_503_once_the_nodes_heartbeat_lapsed(
    health: Admin,
    proxy: CuttingProxy,  # noqa: F811
) -> None:
    """The node's TTL is 1 s: a beat held back 2.5 s lets other nodes presume it dead, while
    the probe's own PING is answered at once."""
    assert (await health.get("/api/v1/health")).status == 200
    proxy.delay_on, proxy.delay = b"gw_reap", 2.5

    reply = await _probe_until(health, 503)
    assert "heartbeat" in reply.body["reason"]
    await _probe_until(health, 200)  # the held beat's answer came


async def _probe_until(health: Admin, status: int, timeout: float = 5.0) -> Reply:
    deadline = asyncio.get_running_loop().time() + timeout
    while (reply := await health.get("/api/v1/health")).status != status:
        assert asyncio.get_running_loop().time() < deadline, reply.raw
        await asyncio.sleep(0.05)
    return reply


async def test_health_is_503_while_the_node_stops(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node shutting down closes its listeners (its MQTT sessions save, its wills go)
    before its admin API: the probe answered 200 meanwhile, and a load balancer kept
    sending it clients."""
    closing = asyncio.Event()
    close = MqttListener.close

    async def slow_close(self: MqttListener) -> None:  # sessions that take a while to save
        closing.set()
        await asyncio.sleep(1.0)
        await close(self)

    monkeypatch.setattr(MqttListener, "close", slow_close)
    port = free_port()
    settings = Settings(host="127.0.0.1", mqtt_port=0, amqp_port=0, admin_port=port)
    stop, ready = asyncio.Event(), asyncio.Event()

    async def on_ready(_: Broker) -> None:
        ready.set()

    running = asyncio.create_task(run_node(settings, redis_url, stop=stop, on_ready=on_ready))
    await asyncio.wait_for(ready.wait(), 10)
    probe = Admin(port)
    assert (await probe.get("/api/v1/health")).status == 200
    stop.set()
    await asyncio.wait_for(closing.wait(), 5)
    reply = await probe.get("/api/v1/health")
    assert reply.status == 503 and "stopping" in reply.body["reason"]
    await asyncio.wait_for(running, 10)
