"""The C MQTT load generator (bench/loadgen/mqtt.c) against the gateway's MQTT listener.

The benchmarks trust its counts and latencies, so they are checked here against a real
listener on the test's event loop; the generator runs as a child process.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bench import mqttgen
from gateway.broker import Broker
from gateway.config import Settings, User
from protocols.mqtt.listener import Listener, start

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mqttgen.build(tmp_path_factory.mktemp("mqttgen"))


@pytest.fixture
async def mqtt(broker: Broker) -> AsyncIterator[Listener]:
    settings = Settings(mqtt_port=0, host="127.0.0.1", users=[User("alice", "s3cret")])
    listener = await start(broker, settings)
    assert listener is not None
    yield listener
    await listener.close()


async def generate(binary: Path, mode: str, **options: Any) -> tuple[int, str, str]:
    """Run the generator without blocking the loop that serves the listener."""
    proc = await asyncio.create_subprocess_exec(
        *mqttgen.argv(binary, mode, {"timeout": 20, **options}),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_pubsub_qos1_counts_every_message(binary: Path, mqtt: Listener) -> None:
    code, out, err = await generate(
        binary, "pubsub", port=mqtt.port, pairs=2, messages=2000, qos=1, inflight=50,
        user="alice", password="s3cret",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["sent"] == report["acked"] == 2000
    assert report["received"] == report["sent"] == report["expected"]
    assert report["lost"] == report["duplicates"] == 0
    assert not report["timed_out"]
    latency = report["latency_ms"]
    assert 0 < latency["p50"] <= latency["p99"] <= latency["p999"] <= latency["max"]
    assert report["msgs_per_s"] > 0 and report["client_cpu_us_per_msg"] > 0


async def test_fan_out_v5_qos0_delivers_to_every_subscriber(binary: Path, mqtt: Listener) -> None:
    code, out, err = await generate(
        binary, "pubsub", port=mqtt.port, version=5, qos=0, messages=500, publishers=1,
        subscribers=3, publish_topic="fan/x", subscribe_topic="fan/#",
        user="alice", password="s3cret",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["sent"] == 500
    assert report["expected"] == report["received"] == 1500
    assert report["lost"] == 0


async def test_refused_connect_is_an_error(binary: Path, mqtt: Listener) -> None:
    code, out, err = await generate(
        binary, "pubsub", port=mqtt.port, messages=10, user="alice", password="wrong"
    )
    assert code == 1 and out == ""
    assert "CONNACK refused" in err
