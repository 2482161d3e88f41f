"""MQTT over WebSocket: paho-mqtt and MQTT.js as clients, plus a hand-written client for
the framing cases they never produce (fragments, pings, refused upgrades, bad frames).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import queue
import shutil
import socket
import struct
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from gateway.broker import Broker, QueueConfig
from gateway.config import Settings
from gateway.model import Message
from protocols.mqtt import websocket
from protocols.mqtt.codec import (
    Connect,
    Publish,
    Subscribe,
    SubscriptionOptions,
    encode,
    encode_publish,
)
from protocols.mqtt.listener import Listener, start
from protocols.mqtt.session import Session
from protocols.mqtt.websocket import BINARY, CLOSE, CONTINUATION, PING, PONG, TEXT, accept_key
from tests.test_engine import wait_for
from tests.test_mqtt_protocol import Raw

TIMEOUT = 10.0
CONNECT = bytes.fromhex("100c00044d5154540402003c0000")  # MQTT 3.1.1 CONNECT, empty id
CONNACK = bytes.fromhex("20020000")
PINGREQ, PINGRESP = b"\xc0\x00", b"\xd0\x00"
KEY = base64.b64encode(b"0123456789abcdef").decode()
MQTT_JS = """
const mqtt = require("mqtt");
const c = mqtt.connect(process.env.MQTT_URL, {reconnectPeriod: 0, connectTimeout: 10000});
c.on("error", (e) => { console.error(String(e)); process.exit(2); });
c.on("connect", () => c.subscribe("ws/js", {qos: 1}, () =>
  c.publish("ws/js", "from js", {qos: 1})));
c.on("message", (t, p) => { console.log(JSON.stringify({topic: t, payload: String(p)}));
  c.end(); });
"""


@pytest.fixture
async def mqtt(broker: Broker) -> AsyncIterator[Listener]:
    listener = await start(broker, Settings(host="127.0.0.1", mqtt_port=0, mqtt_ws_port=0))
    assert listener is not None
    yield listener
    await listener.close()


def ws_url(listener: Listener) -> str:
    return f"ws://127.0.0.1:{listener.extra_ports['mqtt_ws_port']}/mqtt"


class RawClient:
    """A minimal WebSocket client over asyncio streams; every frame it sends is masked."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def upgrade(
        cls,
        listener: Listener,
        path: str = "/mqtt",
        protocol: str | None = "mqtt",
        rcvbuf: int | None = None,
    ) -> tuple[RawClient, bytes]:
        """Connect (with a receive buffer of `rcvbuf` bytes, if given) and send the upgrade
        request; the client and the response head."""
        port = listener.extra_ports["mqtt_ws_port"]
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: 127.0.0.1:{port}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {KEY}",
            "Sec-WebSocket-Version: 13",
        ]
        if protocol is not None:
            lines.append(f"Sec-WebSocket-Protocol: {protocol}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
        return cls(reader, writer), head

    def send(
        self, opcode: int, payload: bytes, fin: bool = True, masked: bool = True, rsv: int = 0
    ) -> None:
        mask = b"\x37\xfa\x21\x3d"
        n = len(payload)
        bit = 0x80 if masked else 0
        if n < 126:
            length = bytes([n | bit])
        elif n < 0x10000:
            length = struct.pack("!BH", 126 | bit, n)
        else:
            length = struct.pack("!BQ", 127 | bit, n)
        body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload)) if masked else payload
        first = (0x80 if fin else 0) | rsv << 4 | opcode
        self.writer.write(bytes([first]) + length + (mask if masked else b"") + body)

    async def receive(self) -> tuple[int, bytes]:
        """The next frame from the server (server frames are never masked)."""
        head = await asyncio.wait_for(self.reader.readexactly(2), TIMEOUT)
        assert not head[1] & 0x80
        n = head[1] & 0x7F
        if n == 126:
            n = struct.unpack("!H", await self.reader.readexactly(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", await self.reader.readexactly(8))[0]
        return head[0] & 0x0F, await self.reader.readexactly(n)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def paho_roundtrip(url_port: int) -> bytes:
    """paho over WebSocket: subscribe and publish at QoS 1; the payload received."""
    received: queue.Queue[bytes] = queue.Queue()
    subscribed: queue.Queue[int] = queue.Queue()
    client = paho.Client(CallbackAPIVersion.VERSION2, transport="websockets")
    client.ws_set_options(path="/mqtt")
    client.on_message = lambda c, u, msg: received.put(msg.payload)
    client.on_subscribe = lambda c, u, mid, codes, props: subscribed.put(mid)
    client.connect("127.0.0.1", url_port, keepalive=30)
    client.loop_start()
    try:
        client.subscribe("ws/paho", qos=1)
        subscribed.get(timeout=TIMEOUT)
        client.publish("ws/paho", b"over websocket", qos=1).wait_for_publish(TIMEOUT)
        return received.get(timeout=TIMEOUT)
    finally:
        client.disconnect()
        client.loop_stop()


async def test_paho_pub_sub_over_websocket(mqtt: Listener) -> None:
    port = mqtt.extra_ports["mqtt_ws_port"]
    assert await asyncio.to_thread(paho_roundtrip, port) == b"over websocket"


@pytest.fixture(scope="session")
def mqtt_js(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """node_modules with MQTT.js, installed with npm into a temporary prefix."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node / npm are not installed")
    prefix = tmp_path_factory.mktemp("mqttjs")
    try:
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix), "mqtt@5"],
            check=True,
            capture_output=True,
            timeout=180,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"npm could not install mqtt: {exc}")
    return prefix / "node_modules"


async def test_mqtt_js_over_websocket(mqtt: Listener, mqtt_js: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        "node", "-e", MQTT_JS,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "NODE_PATH": str(mqtt_js), "MQTT_URL": ws_url(mqtt)},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err
    assert json.loads(out) == {"topic": "ws/js", "payload": "from js"}


async def test_upgrade_answers_subprotocol_and_accept_key(mqtt: Listener) -> None:
    client, head = await RawClient.upgrade(mqtt, protocol="mqttv3.1")
    assert head.startswith(b"HTTP/1.1 101 ")
    assert f"Sec-WebSocket-Accept: {accept_key(KEY)}".encode() in head
    assert b"Sec-WebSocket-Protocol: mqttv3.1\r\n" in head
    await client.close()


@pytest.mark.parametrize(
    ("path", "protocol", "status"),
    [("/other", "mqtt", b"404"), ("/mqtt", None, b"400"), ("/mqtt", "amqp", b"400")],
)
async def test_refused_upgrades(
    mqtt: Listener, path: str, protocol: str | None, status: bytes
) -> None:
    client, head = await RawClient.upgrade(mqtt, path=path, protocol=protocol)
    assert head.split(b" ")[1] == status
    await client.close()


async def test_fragments_ping_and_close(mqtt: Listener) -> None:
    client, head = await RawClient.upgrade(mqtt)
    assert head.startswith(b"HTTP/1.1 101 ")
    client.send(BINARY, CONNECT[:3], fin=False)  # CONNECT in three fragments ...
    client.send(PING, b"hi")  # ... with a control frame in between
    client.send(CONTINUATION, CONNECT[3:9], fin=False)
    client.send(CONTINUATION, CONNECT[9:] + PINGREQ)  # and a second packet in the last one
    assert await client.receive() == (PONG, b"hi")
    received = b""
    while len(received) < len(CONNACK + PINGRESP):  # packets may come in one or two frames
        opcode, payload = await client.receive()
        assert opcode == BINARY
        received += payload
    assert received == CONNACK + PINGRESP
    client.send(CLOSE, struct.pack("!H", 1000))
    assert await client.receive() == (CLOSE, struct.pack("!H", 1000))
    assert await asyncio.wait_for(client.reader.read(), TIMEOUT) == b""
    await client.close()


@pytest.mark.parametrize(
    ("opcode", "masked", "code"),
    [(BINARY, False, 1002), (TEXT, True, 1003), (CONTINUATION, True, 1002)],
    ids=["unmasked", "text", "stray-continuation"],
)
async def test_bad_frames_close_the_connection(
    mqtt: Listener, opcode: int, masked: bool, code: int
) -> None:
    client, _ = await RawClient.upgrade(mqtt)
    client.send(opcode, CONNECT, masked=masked)
    assert await client.receive() == (CLOSE, struct.pack("!H", code))
    assert await asyncio.wait_for(client.reader.read(), TIMEOUT) == b""
    await client.close()


async def test_large_packet_uses_extended_length(mqtt: Listener) -> None:
    """A 305-byte PUBLISH needs the 16-bit length form in both directions."""
    client, _ = await RawClient.upgrade(mqtt)
    subscribe = bytes.fromhex("820800010003782f7900")  # id 1, "x/y" at QoS 0
    publish = b"\x30\xb1\x02\x00\x03x/y" + bytes(range(100)) * 3  # remaining length 305
    client.send(BINARY, CONNECT + subscribe)
    expected = CONNACK + bytes.fromhex("9003000100") + publish
    received = b""
    while len(received) < len(expected):
        if len(received) == len(CONNACK) + 5:
            client.send(BINARY, publish)
        _, payload = await client.receive()
        received += payload
    assert received == expected
    await client.close()


async def test_silent_socket_is_dropped(mqtt: Listener, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(websocket, "HANDSHAKE_TIMEOUT", 0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", mqtt.extra_ports["mqtt_ws_port"])
    assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""
    writer.close()
    await writer.wait_closed()


async def test_mqtt_is_chosen_when_offered_after_another(mqtt: Listener) -> None:
    """MQTT-6.0.0-4: the subprotocol the server selects is "mqtt"; some 3.1 client libraries
    offer the legacy name first."""
    client, head = await RawClient.upgrade(mqtt, protocol="mqttv3.1, mqtt")
    assert head.startswith(b"HTTP/1.1 101 ")
    assert b"Sec-WebSocket-Protocol: mqtt\r\n" in head
    await client.close()


async def test_a_frame_may_carry_packets_larger_than_one_together(
    broker: Broker, mqtt: Listener
) -> None:
    """MQTT §6: one data frame may hold several MQTT packets. Two PUBLISHes of 1.5 MiB each,
    each within the packet limit, in one frame of 3 MiB: both are stored."""
    await broker.declare_queue(QueueConfig(name="wsbig"), [("ws/big", "mqtt")])
    client, _ = await RawClient.upgrade(mqtt)
    client.send(BINARY, CONNECT)
    assert await client.receive() == (BINARY, CONNACK)
    publish = encode_publish("ws/big", b"p" * (3 * 512 * 1024))
    client.send(BINARY, publish + publish)
    await wait_for(lambda: broker.spooler.messages >= 2, timeout=TIMEOUT)
    assert (await broker.queues.info("wsbig")).messages == 2
    await client.close()


async def test_a_refused_frame_is_told_before_the_socket_closes(mqtt: Listener) -> None:
    """A client that breaks the protocol gets the close frame saying why (RFC 6455 §7.4.1)
    even while more of its bytes arrive: closing the socket with them unread would reset
    the connection, and the reset overtakes the close frame."""
    client, _ = await RawClient.upgrade(mqtt)
    client.send(BINARY, CONNECT)
    assert await client.receive() == (BINARY, CONNACK)
    client.writer.write(bytes([0x80 | TEXT, 0x80 | 127]) + struct.pack("!Q", 1 << 20) + b"mask")
    await client.writer.drain()  # refused at its header: the rest of it comes on
    for _ in range(4):
        await asyncio.sleep(0.1)
        client.writer.write(b"x" * 65536)
    try:
        got: object = await client.receive()
    except (ConnectionResetError, asyncio.IncompleteReadError) as exc:
        got = exc
    assert got == (CLOSE, struct.pack("!H", 1003))
    client.writer.transport.abort()


async def test_session_of_a_failed_websocket_sends_nothing_into_the_void(
    broker: Broker, mqtt: Listener
) -> None:
    """A client that broke the protocol ends its MQTT connection at once, while the socket
    waits to tell it why: its session sends nothing more into it (a QoS 1 message it took
    then came back counted, and the next connection got it with DUP=1)."""
    client, _ = await RawClient.upgrade(mqtt)
    connect = encode(Connect(protocol_level=4, clean_start=False, client_id="wsf"), 4)
    client.send(BINARY, connect)
    assert (await client.receive())[0] == BINARY  # CONNACK
    client.send(BINARY, encode(Subscribe(1, [("wf/#", SubscriptionOptions(qos=1))]), 4))
    assert (await client.receive())[0] == BINARY  # SUBACK
    client.send(TEXT, b"not allowed")  # the client breaks the protocol: 1003
    await client.writer.drain()
    assert await client.receive() == (CLOSE, b"\x03\xeb")
    await broker.publish(Message(destination="wf/1", payload=b"never sent"))
    sessions = mqtt.registry.sessions
    await asyncio.sleep(0.2)
    async with asyncio.timeout(5):
        while "wsf" in sessions:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    client.writer.transport.abort()
    raw, _ = await Raw.connected(mqtt.port, 4, client_id="wsf", clean_start=False)
    try:
        got = await raw.recv(timeout=3)
        assert isinstance(got, Publish) and got.payload == b"never sent"
        assert not got.dup, "never reached the client, yet DUP=1 (its delivery was counted)"
    finally:
        raw.close()


async def test_closing_session_does_not_fetch_and_release_in_a_loop(
    broker: Broker, mqtt: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session the server ends (here a second CONNECT) fetches nothing more while its
    socket waits for the client's answer to the close frame: what it gives back is not
    fetched again and again (one message went round 1,481 times in 0.6 s)."""
    given_back: list[str | None] = []
    original = Session._give_back

    def counting(self: Session, queue, entry_id) -> None:
        given_back.append(entry_id)
        original(self, queue, entry_id)

    monkeypatch.setattr(Session, "_give_back", counting)
    client, _ = await RawClient.upgrade(mqtt)
    client.send(BINARY, encode(Connect(protocol_level=4, clean_start=False, client_id="loop"), 4))
    assert (await client.receive())[0] == BINARY  # CONNACK
    client.send(BINARY, encode(Subscribe(1, [("lp/#", SubscriptionOptions(qos=1))]), 4))
    assert (await client.receive())[0] == BINARY  # SUBACK
    # a second CONNECT: the server fails the session; the socket waits (1 s) for the
    # client's answer to its close frame, which this client does not send
    client.send(BINARY, encode(Connect(protocol_level=4, clean_start=False, client_id="loop"), 4))
    await client.writer.drain()
    assert (await client.receive())[0] == CLOSE
    delivered = broker.dispatcher.delivered
    await broker.publish(Message(destination="lp/1", payload=b"x"))
    await asyncio.sleep(0.6)
    fetched = broker.dispatcher.delivered - delivered
    client.writer.transport.abort()
    # one message: fetched once (and given back once), not over and over
    assert fetched <= 2 and len(given_back) <= 2, (fetched, len(given_back))


async def test_a_socket_upgraded_after_the_listener_began_closing_is_not_served(
    broker: Broker,
) -> None:
    """Its MQTT connection would be made after close() ended every connection: it is
    dropped, not given a session by a registry that has shut down."""
    listener = await start(broker, Settings(host="127.0.0.1", mqtt_port=0, mqtt_ws_port=0))
    assert listener is not None
    port = listener.extra_ports["mqtt_ws_port"]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)  # accepted before
    closing = asyncio.create_task(listener.close())
    await asyncio.sleep(0.2)
    lines = [
        "GET /mqtt HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {KEY}",
        "Sec-WebSocket-Version: 13",
        "Sec-WebSocket-Protocol: mqtt",
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    client = RawClient(reader, writer)
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
        client.send(BINARY, CONNECT)
        await client.receive()
        raise AssertionError("served after the listener began closing")
    await asyncio.wait_for(closing, TIMEOUT)
    assert not listener.registry.connections
    writer.close()


async def upgrade_answer(listener: Listener, first: str, **headers: str | None) -> bytes:
    """The head of the answer to an upgrade request: `first` line, the usual headers with
    `headers` changed (None: left out)."""
    port = listener.extra_ports["mqtt_ws_port"]
    fields: dict[str, str | None] = {
        "Host": f"127.0.0.1:{port}",
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": KEY,
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Protocol": "mqtt",
    }
    fields.update({name.replace("_", "-"): value for name, value in headers.items()})
    lines = [first] + [f"{k}: {v}" for k, v in fields.items() if v is not None]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
    finally:
        writer.close()


@pytest.mark.parametrize(
    "first, headers",
    [
        ("GET /mqtt HTTP/1.1", {"Connection": None}),
        ("GET /mqtt HTTP/1.1", {"Connection": "keep-alive"}),
        ("GET /mqtt HTTP/1.1", {"Sec-WebSocket-Key": base64.b64encode(b"short").decode()}),
        ("GET /mqtt HTTP/1.1", {"Host": None}),
        ("GET /mqtt HTTP/1.0", {}),
    ],
    ids=["no-connection", "no-upgrade-token", "key-not-16-bytes", "no-host", "http-1.0"],
)
async def test_an_opening_handshake_rfc_6455_does_not_allow_is_refused(
    mqtt: Listener, first: str, headers: dict[str, str | None]
) -> None:
    """RFC 6455 §4.2.1: Host, a Connection header with the Upgrade token, a key of 16
    bytes, HTTP/1.1 or later; otherwise an HTTP error, no upgrade."""
    assert (await upgrade_answer(mqtt, first, **headers)).startswith(b"HTTP/1.1 400 ")


async def test_the_handshake_takes_what_rfc_6455_allows(mqtt: Listener) -> None:
    # another version: 426 naming the one it speaks (§4.2.2, §4.4)
    head = await upgrade_answer(mqtt, "GET /mqtt HTTP/1.1", Sec_WebSocket_Version="8")
    assert head.startswith(b"HTTP/1.1 426 ") and b"\r\nSec-WebSocket-Version: 13\r\n" in head
    # the subprotocols in two header lines are one list (§11.3.4)
    port = mqtt.extra_ports["mqtt_ws_port"]
    two_lines = "mqtt\r\nSec-WebSocket-Protocol: chat"
    head = await upgrade_answer(mqtt, "GET /mqtt HTTP/1.1", Sec_WebSocket_Protocol=two_lines)
    assert head.startswith(b"HTTP/1.1 101 ") and b"Sec-WebSocket-Protocol: mqtt\r\n" in head
    # an absolute request URI (§4.2.1, RFC 7230 §5.3.2), Connection with other tokens
    absolute = f"GET http://127.0.0.1:{port}/mqtt HTTP/1.1"
    head = await upgrade_answer(mqtt, absolute, Connection="keep-alive, Upgrade")
    assert head.startswith(b"HTTP/1.1 101 ")
    # an empty line before the request-line is ignored (RFC 7230 §3.5)
    head = await upgrade_answer(mqtt, "\r\nGET /mqtt HTTP/1.1")
    assert head.startswith(b"HTTP/1.1 101 ")


@pytest.mark.parametrize(
    "first",
    [b"\x16\x03\x01\x02\x00\x01", b"\x10\x0c\x00\x04MQTT\x04\x02"],
    ids=["tls-client-hello", "mqtt-connect"],
)
async def test_bytes_no_http_request_starts_with_are_refused_at_once(
    mqtt: Listener, first: bytes
) -> None:
    """A wss:// client, or a plain MQTT client, given the WebSocket port waited the whole
    handshake timeout (10 s) for an answer: bytes an HTTP GET cannot start with get a 400
    at once, as nginx answers. (Found by a review.)"""
    reader, writer = await asyncio.open_connection("127.0.0.1", mqtt.extra_ports["mqtt_ws_port"])
    writer.write(first)
    answer = await asyncio.wait_for(reader.read(), 2)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 400 "), answer
