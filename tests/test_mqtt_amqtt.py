"""amqtt (MQTT 3.1.1 only) against the adapter, from its own venv: its pinned dependencies
would clash with the project's, so it runs as a subprocess driven by the script DRIVER."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from protocols.mqtt.listener import Listener

AMQTT = "amqtt==0.12.1"
DRIVER = '''\
"""QoS 1 pub/sub through amqtt; argv: PORT COUNT; prints one JSON line of what arrived."""

import asyncio
import json
import sys

from amqtt.client import MQTTClient
from amqtt.mqtt.constants import QOS_1


async def main(port: int, count: int) -> None:
    uri = f"mqtt://127.0.0.1:{port}/"
    sub = MQTTClient(client_id="amqtt-sub")
    pub = MQTTClient(client_id="amqtt-pub")
    await sub.connect(uri, cleansession=True)
    await pub.connect(uri, cleansession=True)
    granted = await sub.subscribe([("am/#", QOS_1)])
    for i in range(count):
        await pub.publish(f"am/{i % 3}", f"m{i}".encode(), qos=QOS_1)
    got = []
    for _ in range(count):
        msg = await sub.deliver_message(timeout_duration=30)
        got.append([msg.topic, bytes(msg.data).decode(), msg.qos])
    await pub.disconnect()
    await sub.disconnect()
    print(json.dumps({"granted": granted, "got": got}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
'''


@pytest.fixture(scope="session")
def amqtt_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with amqtt installed; the test is skipped if pip cannot get it."""
    venv = tmp_path_factory.mktemp("amqtt") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    try:
        pip = subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "--no-compile",
                "--disable-pip-version-check",
                AMQTT,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip install {AMQTT} timed out")
    if pip.returncode != 0:
        pytest.skip(f"pip cannot install {AMQTT}: {pip.stderr.strip()[-500:]}")
    (venv / "driver.py").write_text(DRIVER)
    return python


async def test_amqtt_qos1_pub_sub(mqtt: Listener, amqtt_python: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        str(amqtt_python), str(amqtt_python.parent.parent / "driver.py"), str(mqtt.port), "20",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert result["granted"] == [1]
    assert result["got"] == [[f"am/{i % 3}", f"m{i}", 1] for i in range(20)]
