"""TLS listeners against real clients: paho-mqtt, the mosquitto CLI and proton (amqps).

The certificate is self-signed for 127.0.0.1 (made once per session with the openssl CLI)
and every client verifies it, host name included.
"""

from __future__ import annotations

import asyncio
import queue
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from proton import Message, SSLDomain
from proton.utils import BlockingConnection

from gateway.broker import Broker, QueueConfig
from gateway.config import Settings
from protocols.amqp import listener as amqp_listener
from protocols.mqtt import listener as mqtt_listener

TIMEOUT = 10.0


def make_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate and key for 127.0.0.1 / localhost, via the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    cert, key = directory / "cert.pem", directory / "key.pem"
    argv = [
        "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
    ]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.fixture(scope="session")
def cert_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls_settings(cert_pair: tuple[Path, Path]) -> Settings:
    cert, key = cert_pair
    return Settings(
        host="127.0.0.1",
        mqtt_port=0,
        amqp_port=0,
        mqtt_tls_port=0,
        amqp_tls_port=0,
        mqtt_ws_port=-1,
        tls_cert=str(cert),
        tls_key=str(key),
    )


@pytest.fixture
async def mqtt_tls(broker: Broker, tls_settings: Settings) -> AsyncIterator[int]:
    listener = await mqtt_listener.start(broker, tls_settings)
    assert listener is not None
    yield listener.extra_ports["mqtt_tls_port"]
    await listener.close()


@pytest.fixture
async def amqp_tls(broker: Broker, tls_settings: Settings) -> AsyncIterator[int]:
    listener = await amqp_listener.start(broker, tls_settings)
    assert listener is not None
    yield listener.extra_ports["amqp_tls_port"]
    await listener.close()


def paho_roundtrip(port: int, ca: Path, topic: str) -> bytes:
    """Subscribe and publish at QoS 1 over TLS with one paho client; the payload received."""
    received: queue.Queue[bytes] = queue.Queue()
    subscribed: queue.Queue[int] = queue.Queue()
    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311)
    client.tls_set(ca_certs=str(ca))
    client.on_message = lambda c, u, msg: received.put(msg.payload)
    client.on_subscribe = lambda c, u, mid, codes, props: subscribed.put(mid)
    client.connect("127.0.0.1", port, keepalive=30)
    client.loop_start()
    try:
        client.subscribe(topic, qos=1)
        subscribed.get(timeout=TIMEOUT)
        client.publish(topic, b"over tls", qos=1).wait_for_publish(TIMEOUT)
        return received.get(timeout=TIMEOUT)
    finally:
        client.disconnect()
        client.loop_stop()


async def test_no_tls_listener_without_certificate(broker: Broker) -> None:
    settings = Settings(mqtt_port=0, amqp_port=0, host="127.0.0.1")
    mqtt = await mqtt_listener.start(broker, settings)
    amqp = await amqp_listener.start(broker, settings)
    try:
        assert mqtt.extra_ports == {} and amqp.extra_ports == {}
    finally:
        await mqtt.close()
        await amqp.close()


async def test_paho_qos1_over_tls(mqtt_tls: int, cert_pair: tuple[Path, Path]) -> None:
    payload = await asyncio.to_thread(paho_roundtrip, mqtt_tls, cert_pair[0], "tls/paho")
    assert payload == b"over tls"


async def test_mosquitto_cli_over_tls(mqtt_tls: int, cert_pair: tuple[Path, Path]) -> None:
    if shutil.which("mosquitto_sub") is None or shutil.which("mosquitto_pub") is None:
        pytest.skip("mosquitto clients are not installed")
    common = ["-h", "127.0.0.1", "-p", str(mqtt_tls), "--cafile", str(cert_pair[0])]
    sub = await asyncio.create_subprocess_exec(
        "mosquitto_sub", *common, "-t", "tls/cli", "-q", "1", "-C", "1", "-W", "10",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        for _ in range(50):  # bounded: publish until the subscription is in place
            pub = await asyncio.create_subprocess_exec(
                "mosquitto_pub", *common, "-t", "tls/cli", "-q", "1", "-m", "hello",
                stderr=subprocess.PIPE,
            )  # fmt: skip
            _, err = await asyncio.wait_for(pub.communicate(), TIMEOUT)
            assert pub.returncode == 0, err
            try:
                out, err = await asyncio.wait_for(sub.communicate(), 0.2)
                break
            except TimeoutError:
                continue
        else:
            pytest.fail("mosquitto_sub received nothing")
    finally:
        if sub.returncode is None:
            sub.kill()
            await sub.wait()
    assert sub.returncode == 0, err
    assert out.strip() == b"hello"


async def test_proton_amqps(broker: Broker, amqp_tls: int, cert_pair: tuple[Path, Path]) -> None:
    await broker.queues.create(QueueConfig(name="secure"))

    def client() -> bytes:
        domain = SSLDomain(SSLDomain.MODE_CLIENT)
        domain.set_trusted_ca_db(str(cert_pair[0]))
        domain.set_peer_authentication(SSLDomain.VERIFY_PEER_NAME)  # checks DNS names only
        conn = BlockingConnection(
            f"amqps://localhost:{amqp_tls}", timeout=TIMEOUT, ssl_domain=domain
        )
        try:
            conn.create_sender("secure").send(Message(body=b"sealed"))
            receiver = conn.create_receiver("secure")
            msg = receiver.receive(timeout=TIMEOUT)
            receiver.accept()
            return bytes(msg.body)
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == b"sealed"


async def test_plain_bytes_to_tls_port_close_only_that_connection(
    mqtt_tls: int, cert_pair: tuple[Path, Path]
) -> None:
    def garbage() -> bytes:
        with socket.create_connection(("127.0.0.1", mqtt_tls), timeout=TIMEOUT) as sock:
            sock.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00" * 4)
            chunks = []
            while chunk := sock.recv(4096):  # ends at EOF, or TimeoutError fails the test
                chunks.append(chunk)
            return b"".join(chunks)

    await asyncio.to_thread(garbage)
    payload = await asyncio.to_thread(paho_roundtrip, mqtt_tls, cert_pair[0], "tls/after")
    assert payload == b"over tls"
