"""TLS listeners against real clients: paho-mqtt, the mosquitto CLI, proton (amqps) and
MQTT.js (MQTT over secure WebSocket).

The certificate is self-signed for 127.0.0.1 (made once per session with the openssl CLI)
and every client verifies it, host name included.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from proton import Message, SSLDomain
from proton.utils import BlockingConnection

from gateway.broker import Broker, QueueConfig
from gateway.config import Settings
from protocols.amqp import listener as amqp_listener
from protocols.mqtt import listener as mqtt_listener
from tests.test_mqtt_websocket import mqtt_js  # noqa: F401

TIMEOUT = 10.0
Starter = Callable[[Broker, Settings], Awaitable[Any]]  # a protocol plugin's start


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
        mqtt_wss_port=0,
        tls_cert=str(cert),
        tls_key=str(key),
    )


@asynccontextmanager
async def listening(
    start: Starter, broker: Broker, settings: Settings, key: str
) -> AsyncIterator[int]:
    """The port of one of the listeners `start` opens (e.g. mqtt_tls_port)."""
    listener = await start(broker, settings)
    assert listener is not None
    try:
        yield listener.extra_ports[key]
    finally:
        await listener.close()


@pytest.fixture
async def mqtt_tls(broker: Broker, tls_settings: Settings) -> AsyncIterator[int]:
    async with listening(mqtt_listener.start, broker, tls_settings, "mqtt_tls_port") as port:
        yield port


@pytest.fixture
async def mqtt_wss(broker: Broker, tls_settings: Settings) -> AsyncIterator[int]:
    async with listening(mqtt_listener.start, broker, tls_settings, "mqtt_wss_port") as port:
        yield port


@pytest.fixture
async def amqp_tls(broker: Broker, tls_settings: Settings) -> AsyncIterator[int]:
    async with listening(amqp_listener.start, broker, tls_settings, "amqp_tls_port") as port:
        yield port


def paho_roundtrip(port: int, ca: Path, topic: str, websocket: bool = False) -> bytes:
    """Subscribe and publish at QoS 1 over TLS (WebSocket on `websocket`) with one paho
    client; the payload received."""
    received: queue.Queue[bytes] = queue.Queue()
    subscribed: queue.Queue[int] = queue.Queue()
    transport = "websockets" if websocket else "tcp"
    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311, transport=transport)
    if websocket:
        client.ws_set_options(path="/mqtt")
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
    settings = Settings(mqtt_port=0, amqp_port=0, host="127.0.0.1", mqtt_wss_port=0)
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


async def test_paho_over_secure_websocket(mqtt_wss: int, cert_pair: tuple[Path, Path]) -> None:
    payload = await asyncio.to_thread(paho_roundtrip, mqtt_wss, cert_pair[0], "wss/paho", True)
    assert payload == b"over tls"


# MQTT.js, the browser's MQTT client, with the test CA as the one it trusts
MQTT_JS_WSS = """
const fs = require("fs");
const mqtt = require("mqtt");
const c = mqtt.connect(process.env.MQTT_URL,
  {reconnectPeriod: 0, connectTimeout: 10000, ca: fs.readFileSync(process.env.CA)});
c.on("error", (e) => { console.error(String(e)); process.exit(2); });
c.on("connect", () => c.subscribe("wss/js", {qos: 1}, () =>
  c.publish("wss/js", "from js", {qos: 1})));
c.on("message", (t, p) => { console.log(JSON.stringify({topic: t, payload: String(p)}));
  c.end(); });
"""


async def test_mqtt_js_over_secure_websocket(
    mqtt_wss: int,
    cert_pair: tuple[Path, Path],
    mqtt_js: Path,  # noqa: F811
) -> None:
    env = {
        **os.environ,
        "NODE_PATH": str(mqtt_js),
        "MQTT_URL": f"wss://127.0.0.1:{mqtt_wss}/mqtt",
        "CA": str(cert_pair[0]),
    }
    proc = await asyncio.create_subprocess_exec(
        "node", "-e", MQTT_JS_WSS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err
    assert json.loads(out) == {"topic": "wss/js", "payload": "from js"}


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


def silent_for(port: int, limit: float) -> float:
    """Connect, send nothing; seconds until the gateway closed the socket (or `limit`)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as sock:
        try:
            while sock.recv(4096):
                pass
        except TimeoutError:
            pass
    return time.monotonic() - start


async def test_a_silent_socket_on_a_tls_port_is_dropped_as_on_the_plain_port(
    amqp_tls: int, mqtt_tls: int
) -> None:
    """README: "a client has 10 s for the protocol header and SASL"; the plain MQTT port
    drops a socket that sends no CONNECT after 10 s. A TLS port gives a socket that never
    starts its handshake as long, not asyncio's 60 s (idle sockets would pile up)."""
    took = await asyncio.gather(
        asyncio.to_thread(silent_for, amqp_tls, 14.0), asyncio.to_thread(silent_for, mqtt_tls, 14.0)
    )
    assert max(took) < 13.0, f"silent TLS sockets (amqps, mqtts) open for {took} s"


def _client_ctx(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def _connect_ka1_with_will(client_id: bytes) -> bytes:
    """MQTT 3.1.1 CONNECT, keep alive 1 s, will 'will/t' = 'bye' at QoS 1."""
    body = b"\x00\x04MQTT\x04" + bytes([0x02 | 0x04 | 0x08]) + b"\x00\x01"
    for part in (client_id, b"will/t", b"bye"):
        body += len(part).to_bytes(2, "big") + part
    return b"\x10" + bytes([len(body)]) + body


def _open_tls(port: int, ca: Path, websocket: bool = False) -> ssl.SSLSocket:
    """A TLS connection; with `websocket`, upgraded to MQTT over WebSocket."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=8)
    tls = _client_ctx(ca).wrap_socket(raw, server_hostname="localhost")
    if websocket:
        tls.sendall(
            b"GET /mqtt HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n"
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += tls.recv(1)
        assert b" 101 " in head, head
    return tls


def _packet(data: bytes, websocket: bool) -> bytes:
    """An MQTT packet as sent: in a masked binary WebSocket frame with `websocket`."""
    if not websocket:
        return data
    mask = b"\x01\x02\x03\x04"
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
    return bytes([0x82, 0x80 | len(data)]) + mask + masked


def _connack(tls: ssl.SSLSocket, websocket: bool) -> bytes:
    """The 4 bytes of a CONNACK (b"" when none came in time), out of its frame."""
    try:
        return tls.recv(6)[2:] if websocket else tls.recv(4)
    except TimeoutError:
        return b""


def _stalled_tls_client(
    port: int, ca: Path, hold: float, connect: bytes, websocket: bool = False
) -> None:
    """`connect` over TLS, read the CONNACK, then go silent (a dead peer: nothing read, no
    TLS close_notify answered) for `hold` seconds."""
    tls = _open_tls(port, ca, websocket)
    tls.sendall(_packet(connect, websocket))
    assert _connack(tls, websocket) == b"\x20\x02\x00\x00"
    time.sleep(hold)
    tls.close()


async def test_keep_alive_expiry_of_a_dead_tls_client_sends_the_will_promptly(
    broker: Broker, mqtt_tls: int, cert_pair: tuple[Path, Path]
) -> None:
    """MQTT §3.1.2.10: after 1.5 x keep alive without a packet the server closes the
    connection as if the network failed, and the will goes (§3.1.2.5). On the plain port
    it goes ~1.5 s after the last packet; over TLS the close waits for the dead peer's
    close_notify (asyncio's 30 s TLS shutdown timeout) before the connection counts as lost."""
    await broker.declare_queue(QueueConfig(name="wills2"), [("will/t", "mqtt")])
    connect = _connect_ka1_with_will(b"ka")
    peer = asyncio.create_task(
        asyncio.to_thread(_stalled_tls_client, mqtt_tls, cert_pair[0], 6.0, connect)
    )
    try:
        start = time.monotonic()
        while time.monotonic() - start < 5.0:
            if (await broker.queues.info("wills2")).messages:
                break
            await asyncio.sleep(0.1)
        took = time.monotonic() - start
        assert (await broker.queues.info("wills2")).messages == 1, (
            f"no will {took:.1f} s after a keep alive of 1 s lapsed"
        )
    finally:
        await peer


def _connect_ka60(client_id: bytes) -> bytes:
    body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(client_id).to_bytes(2, "big") + client_id
    return b"\x10" + bytes([len(body)]) + body


@pytest.mark.parametrize("websocket", [False, True], ids=["tls", "wss"])
async def test_takeover_of_a_dead_tls_connection_is_prompt(
    broker: Broker, tls_settings: Settings, cert_pair: tuple[Path, Path], websocket: bool
) -> None:
    """MQTT §3.1.4-3: a CONNECT with a client id already connected makes the server
    disconnect the existing client. Clients reconnect (with the same id) precisely when
    the old connection is dead; over TLS the new CONNECT waited for the dead peer's
    close_notify answer (asyncio's TLS shutdown), so it was not answered in time; over
    secure WebSocket that wait came after the WebSocket close frame's."""
    listener = await mqtt_listener.start(broker, tls_settings)
    port = listener.extra_ports["mqtt_wss_port" if websocket else "mqtt_tls_port"]
    connect = _connect_ka60(b"tk")
    peer = asyncio.create_task(
        asyncio.to_thread(_stalled_tls_client, port, cert_pair[0], 5.0, connect, websocket)
    )
    await asyncio.sleep(0.5)

    def second() -> float:
        tls = _open_tls(port, cert_pair[0], websocket)
        start = time.monotonic()
        tls.sendall(_packet(connect, websocket))
        ack = _connack(tls, websocket)
        took = time.monotonic() - start
        tls.close()
        assert ack[:1] == b"\x20", f"no CONNACK after {took:.1f} s"
        return took

    try:
        took = await asyncio.to_thread(second)
        # the old connection's close waits 1 s for the client's answer, no more
        assert took < 1.7, f"the takeover CONNACK took {took:.1f} s"
    finally:
        await peer
        await listener.close()


def handshake_late(port: int, ca: Path, go: threading.Event, hello: bytes) -> bytes:
    """Connect now; once `go` is set, finish TLS, send `hello` and return the answer (b""
    when the connection was dropped)."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    try:
        go.wait(TIMEOUT)
        context = ssl.create_default_context(cafile=str(ca))
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(hello)
            return tls.recv(8)
    except OSError:
        return b""
    finally:
        raw.close()


@pytest.mark.parametrize(
    "protocol, hello",
    [("mqtt", bytes.fromhex("100c00044d5154540402003c0000")), ("amqp", b"AMQP\x03\x01\x00\x00")],
    ids=["mqtt", "amqp"],
)
async def test_a_tls_handshake_finished_after_the_listener_began_closing_is_not_served(
    broker: Broker,
    tls_settings: Settings,
    cert_pair: tuple[Path, Path],
    protocol: str,
    hello: bytes,
) -> None:
    """The connection would be made after close() ended every connection: it is dropped,
    not served by a registry that has shut down."""
    module = mqtt_listener if protocol == "mqtt" else amqp_listener
    listener = await module.start(broker, tls_settings)
    assert listener is not None
    port = listener.extra_ports[f"{protocol}_tls_port"]
    go = threading.Event()
    client = asyncio.create_task(asyncio.to_thread(handshake_late, port, cert_pair[0], go, hello))
    await asyncio.sleep(0.2)  # accepted, its handshake not begun
    closing = asyncio.create_task(listener.close())
    await asyncio.sleep(0.1)
    go.set()
    assert await client == b""
    await asyncio.wait_for(closing, TIMEOUT)
    assert not listener.registry.connections
