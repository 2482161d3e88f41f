"""Stopping `gateway serve` ends in bounded time with exit code 0 whatever Redis does, and
a second signal neither hangs nor kills it. Real processes, a real redis-server (stalled
with SIGSTOP, as a disk or fork stall would, or killed)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import redis

from gateway.broker import Broker, QueueConfig
from gateway.config import Settings
from gateway.engine import keys
from gateway.server import STOP_REDIS_GRACE_S, run_node
from protocols.mqtt.codec import Properties, Puback, Publish, Will
from protocols.mqtt.listener import Registry as MqttRegistry
from tests.conftest import RedisServer, free_port, running_node
from tests.processes import GATEWAY, Proc, node_env, serve_argv
from tests.test_engine import wait_for
from tests.test_mqtt_protocol import Raw


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server this test may stall or kill."""
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    if server.proc is not None:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop(kill=True)


async def node_on(url: str) -> Proc:
    argv = [*GATEWAY, "serve", "--redis-url", url]
    node = await Proc.start(
        [*argv, "--admin-port", "0", "--mqtt-port", "0", "--amqp-port", "0"], node_env()
    )
    await node.wait_event("ready")
    return node


async def exit_code(node: Proc, within: float) -> int | None:
    try:
        return await asyncio.wait_for(node.proc.wait(), within)
    except TimeoutError:
        return None


async def test_a_stop_while_redis_stalls_ends_after_the_grace(own_redis: RedisServer) -> None:
    """It hung for good on its first call to Redis after the listeners closed."""
    node = await node_on(own_redis.url)
    try:
        assert own_redis.proc is not None
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        began = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        assert await exit_code(node, STOP_REDIS_GRACE_S + 10) == 0, node.stderr_tail()
        assert time.monotonic() - began >= STOP_REDIS_GRACE_S - 0.5
        assert "stopping without telling Redis (no answer in" in node.stderr_tail()
    finally:
        node.kill()


def persistent_subscriber(port: int, client_id: str) -> mqtt.Client:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id, clean_session=False)
    subscribed = threading.Event()
    client.on_subscribe = lambda *_: subscribed.set()
    client.connect("127.0.0.1", port)
    client.loop_start()
    client.subscribe("t/#", qos=1)
    assert subscribed.wait(5)
    return client


async def test_a_second_signal_ends_a_stop_redis_holds_up_at_once(
    own_redis: RedisServer,
) -> None:
    """Clients connected: saving their sessions waits for Redis too (10 s, before telling
    it the node goes)."""
    node = await node_on(own_redis.url)
    port = next(line["mqtt_port"] for line in node.lines if line.get("event") == "ready")
    clients = [persistent_subscriber(port, f"device{i}") for i in range(3)]
    try:
        assert own_redis.proc is not None
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        node.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(1)
        assert node.proc.returncode is None  # waiting for Redis
        node.proc.send_signal(signal.SIGINT)  # Ctrl-C again
        assert await exit_code(node, 2) == 0, node.stderr_tail()
        log = node.stderr_tail()
        assert "stopping before clients' sessions are saved (asked again)" in log
        assert "stopping without telling Redis (asked again)" in log
    finally:
        for client in clients:
            client.loop_stop()
        node.kill()


async def test_an_embedded_node_stopped_while_redis_stalls_leaves_nothing_running(
    own_redis: RedisServer,
) -> None:
    """run_node in a program's own event loop: cut short, its stop still ends the node's
    heartbeat and every task, so other nodes take over once its liveness key expires (its
    heartbeat went on once Redis answered, and it never expired)."""
    settings = Settings(
        host="127.0.0.1", mqtt_port=0, amqp_port=0, admin_port=0, heartbeat_s=0.2, node_ttl_s=1.0
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    nodes: list[str] = []

    async def on_ready(broker: Broker) -> None:
        nodes.append(broker.node_id)
        ready.set()

    before = asyncio.all_tasks()
    running = asyncio.create_task(run_node(settings, own_redis.url, stop, on_ready))
    await asyncio.wait_for(ready.wait(), 10)
    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    stop.set()
    await asyncio.wait_for(running, STOP_REDIS_GRACE_S + 5)
    os.kill(own_redis.proc.pid, signal.SIGCONT)
    await asyncio.sleep(2)  # twice the node's TTL
    left = asyncio.all_tasks() - before - {asyncio.current_task()}
    assert not left, [task.get_coro() for task in left]
    probe = redis.Redis(port=own_redis.port)
    try:
        assert not probe.exists(keys.node_alive(nodes[0]))
    finally:
        probe.close()


async def test_a_stop_with_redis_gone_ends_with_0_and_no_traceback(
    own_redis: RedisServer,
) -> None:
    """It ended by a ConnectionError's traceback, exit code 1."""
    node = await node_on(own_redis.url)
    try:
        own_redis.stop(kill=True)
        node.proc.send_signal(signal.SIGTERM)
        assert await exit_code(node, STOP_REDIS_GRACE_S + 10) == 0, node.stderr_tail()
        assert "Traceback" not in node.log.read_text(errors="replace")
    finally:
        node.kill()


async def test_a_sweep_with_redis_gone_logs_one_line_and_goes_on(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The MQTT group and session queue sweep (run at start) logged a ConnectionError's
    traceback when Redis went away: the stop above, run just after a start, showed it."""

    def failures() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "queue sweep failed" in r.getMessage()]

    async with running_node(own_redis.url) as broker:
        own_redis.stop(kill=True)
        registry = MqttRegistry(broker, Settings(mqtt_port=0, amqp_port=0, host="127.0.0.1"))
        try:
            await wait_for(failures)
            failed = failures()
            assert failed[0].levelname == "WARNING"
            assert failed[0].exc_info is None
            assert "Connection refused" in failed[0].getMessage()
            assert not registry._sweeper.done()  # the next round tries again
        finally:
            await registry.close()


@pytest.mark.parametrize("again", [signal.SIGTERM, signal.SIGINT], ids=["kill", "ctrl-c"])
async def test_signals_while_a_stop_ends_leave_exit_code_0(tmp_path: Path, again: int) -> None:
    """Signals until it is gone, through the embedded Redis's stop: it ended by the signal
    (143 or 130 to a service manager) once its event loop was closed."""
    gw = await Proc.start(serve_argv(tmp_path / "data", "--appendfsync", "always"))
    await gw.wait_event("ready")
    try:
        gw.proc.send_signal(signal.SIGTERM)
        while gw.proc.returncode is None:
            await asyncio.sleep(0.01)
            if gw.proc.returncode is None:
                gw.proc.send_signal(again)
        assert await gw.proc.wait() == 0, gw.stderr_tail()
        assert "Traceback" not in gw.log.read_text(errors="replace")
    finally:
        gw.kill()


@pytest.mark.parametrize("asked_again", [False, True], ids=["waited", "asked-again"])
async def test_a_stop_waiting_long_for_clients_still_tells_redis_and_leaves_nothing(
    redis_url: str, asked_again: bool
) -> None:
    """A publisher held by producer flow control makes the listeners' close wait its whole
    10 s, or until a second signal; Redis answers all along, so the node still tells it it
    goes (other nodes take over at once), and nothing of the node runs or listens once
    run_node returned (first versions counted the close against Redis's grace, skipped
    telling Redis when asked again, and left the close or the admin server running)."""
    port, admin_port = free_port(), free_port()
    settings = Settings(
        host="127.0.0.1", mqtt_port=port, amqp_port=0, admin_port=admin_port, heartbeat_s=0.2
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    nodes: list[Broker] = []

    async def on_ready(broker: Broker) -> None:
        nodes.append(broker)
        ready.set()

    before = asyncio.all_tasks()
    running = asyncio.create_task(run_node(settings, redis_url, stop, on_ready))
    await asyncio.wait_for(ready.wait(), 10)
    broker = nodes[0]
    await broker.declare_queue(QueueConfig(name="fc", max_messages=1, overflow="flow_control"))
    await broker.subscribe_queue("fc", ["fc/#"], "mqtt")
    client, _ = await Raw.connected(port, 4, client_id="pub")
    await client.send(Publish("fc/1", b"x", qos=1, packet_id=100))
    assert await client.recv() == Puback(100)
    await client.send(Publish("fc/2", b"y", qos=1, packet_id=101))  # held: the queue is full
    will = Will("wills/device", b"gone", properties=Properties(will_delay_interval=2))
    device, _ = await Raw.connected(
        port, 5, client_id="device", will=will, properties=Properties(session_expiry_interval=3)
    )
    await asyncio.sleep(0.3)
    stop.set()
    if asked_again:
        await asyncio.sleep(0.5)  # the MQTT close waits for the held publisher
        os.kill(os.getpid(), signal.SIGINT)  # run_node's handler takes it
    await asyncio.wait_for(running, 30)
    client.close()
    device.close()
    left = asyncio.all_tasks() - before - {asyncio.current_task()}
    assert not left, [task.get_coro() for task in left]
    armed = [  # the device's delayed will and session expiry: they fired after
        timer
        for registry in gc.get_objects()
        if isinstance(registry, MqttRegistry)
        for timer in (
            *registry._expiry.values(),
            *registry._rechecks.values(),
            *(timer for timer, _ in registry._wills.values()),
        )
        if not timer.cancelled()
    ]
    assert not armed, armed
    with pytest.raises(OSError):  # the admin server is closed
        socket.create_connection(("127.0.0.1", admin_port), timeout=1).close()
    probe = redis.Redis.from_url(redis_url)
    try:
        assert not probe.exists(keys.node_alive(broker.node_id))
    finally:
        probe.close()
