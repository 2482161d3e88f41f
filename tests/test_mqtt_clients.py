"""MQTT adapter against aiomqtt and Debian's mosquitto_pub / mosquitto_sub (subprocesses)."""

from __future__ import annotations

import asyncio
import shutil

import aiomqtt
import pytest

from gateway.broker import Broker
from gateway.config import Settings
from protocols.mqtt.listener import Listener, start

WAIT = 10.0
MOSQUITTO_VERSIONS = ["mqttv31", "mqttv311", "mqttv5"]


@pytest.mark.parametrize(
    "protocol", [aiomqtt.ProtocolVersion.V311, aiomqtt.ProtocolVersion.V5], ids=["v311", "v5"]
)
async def test_aiomqtt_pub_sub(mqtt: Listener, protocol: aiomqtt.ProtocolVersion) -> None:
    async with (
        aiomqtt.Client("127.0.0.1", mqtt.port, identifier="aio-sub", protocol=protocol) as sub,
        aiomqtt.Client("127.0.0.1", mqtt.port, identifier="aio-pub", protocol=protocol) as pub,
    ):
        await sub.subscribe("aio/#", qos=1)
        for i in range(10):
            await pub.publish(f"aio/{i % 3}", f"m{i}".encode(), qos=i % 3)
        got = []
        async with asyncio.timeout(WAIT):
            async for msg in sub.messages:
                got.append((str(msg.topic), msg.payload, msg.qos))
                if len(got) == 10:
                    break
        assert [p for _, p, _ in got] == [f"m{i}".encode() for i in range(10)]
        assert [q for _, _, q in got] == [min(i % 3, 1) for i in range(10)]
        assert got[4][0] == "aio/1"


needs_mosquitto = pytest.mark.skipif(
    shutil.which("mosquitto_sub") is None, reason="mosquitto clients not installed"
)


async def _run(*args: str) -> tuple[int, bytes]:
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), WAIT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out


@needs_mosquitto
@pytest.mark.parametrize("version", MOSQUITTO_VERSIONS)
@pytest.mark.parametrize("qos", ["0", "1", "2"])
async def test_mosquitto_pub_sub(mqtt: Listener, version: str, qos: str) -> None:
    port = str(mqtt.port)
    sub = await asyncio.create_subprocess_exec(
        "stdbuf",
        "-oL",
        "mosquitto_sub",
        "-h",
        "127.0.0.1",
        "-p",
        port,
        "-V",
        version,
        "-q",
        qos,
        "-i",
        f"msub-{version}",
        "-t",
        "mosq/+",
        "-C",
        "3",
        "-W",
        str(int(WAIT)),
        "-d",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert sub.stdout is not None
    try:
        async with asyncio.timeout(WAIT):
            while b"SUBACK" not in await sub.stdout.readline():
                pass
            for i in range(3):
                rc, out = await _run(
                    "mosquitto_pub",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    port,
                    "-V",
                    version,
                    "-q",
                    qos,
                    "-i",
                    f"mpub-{version}",
                    "-t",
                    f"mosq/{i}",
                    "-m",
                    f"hello {i}",
                )
                assert rc == 0, out
            rest = await sub.stdout.read()
            assert await sub.wait() == 0
    finally:
        if sub.returncode is None:
            sub.kill()
            await sub.wait()
    debug = ("Client ", "Subscribed")
    payloads = [line for line in rest.decode().splitlines() if not line.startswith(debug)]
    assert payloads == ["hello 0", "hello 1", "hello 2"]


@needs_mosquitto
async def test_mosquitto_bad_credentials(broker: Broker) -> None:
    listener = await start(broker, Settings(mqtt_port=0, allow_anonymous=False))
    assert listener is not None
    try:
        rc, out = await _run(
            "mosquitto_pub",
            "-h",
            "127.0.0.1",
            "-p",
            str(listener.port),
            "-V",
            "mqttv311",
            "-u",
            "nobody",
            "-P",
            "nothing",
            "-t",
            "x",
            "-m",
            "y",
        )
    finally:
        await listener.close()
    assert rc != 0
    assert b"not authorised" in out.lower() or b"bad user name" in out.lower(), out
