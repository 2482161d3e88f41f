"""Hostile and malformed MQTT input over real sockets, against a real gateway and Redis.

The table-driven cases check the whole standard: the bad connection gets exactly the bytes
the spec asks for (MQTT 5: DISCONNECT with the reason code; 3.1.1: nothing; a bad CONNECT:
its CONNACK) and then EOF; a QoS 1 message the same connection had acknowledged before is
still delivered; a fresh client can still connect, publish at QoS 1 and receive it; and
nothing reached the event loop's or the session's generic error handlers (no ERROR log).
Packets are built by hand, independent of the codec's encoder (only the fuzz test uses the
codec's strategies and encoder, to make packets that decode)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.broker import Broker
from gateway.config import Settings, User
from gateway.model import MAX_USER_PROPERTIES
from protocols.mqtt import session as session_module
from protocols.mqtt.codec import Disconnect, MqttDecoder, Packet, Pingresp, encode
from protocols.mqtt.connection import MqttConnection
from protocols.mqtt.listener import Listener, start
from tests.conftest import logged_errors
from tests.test_mqtt_codec import frame, packet_strategies, vbi
from tests.test_mqtt_websocket import RawClient

WAIT = 5.0
ACKED = b"acked before the bad packet"


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("!H", len(raw)) + raw


def props(*items: bytes) -> bytes:
    body = b"".join(items)
    return vbi(len(body)) + body


def u32(pid: int, value: int) -> bytes:
    return bytes((pid,)) + struct.pack("!I", value)


def u16(pid: int, value: int) -> bytes:
    return bytes((pid,)) + struct.pack("!H", value)


def user(key: str | bytes, value: str | bytes) -> bytes:
    return b"\x26" + s(key) + s(value)


def connect(
    level: int,
    client_id: str | bytes = "",
    flags: int = 0x02,
    keep_alive: int = 0,
    cprops: bytes = b"\x00",
    rest: bytes = b"",
    name: bytes | None = None,
) -> bytes:
    """CONNECT; `rest` follows the client id (will, user name, password)."""
    name = name if name is not None else (b"MQIsdp" if level == 3 else b"MQTT")
    head = s(name) + bytes((level, flags)) + struct.pack("!H", keep_alive)
    return frame(0x10, head + (cprops if level == 5 else b"") + s(client_id) + rest)


def publish(
    level: int,
    topic: str | bytes,
    payload: bytes,
    qos: int = 0,
    pid: int = 1,
    pprops: bytes = b"\x00",
    flags: int = 0,
) -> bytes:
    body = s(topic) + (struct.pack("!H", pid) if qos else b"") + (pprops if level == 5 else b"")
    return frame(0x30 | qos << 1 | flags, body + payload)


def subscribe(
    level: int, pid: int, *filters: tuple[str | bytes, int], sprops: bytes = b"\x00"
) -> bytes:
    body = struct.pack("!H", pid) + (sprops if level == 5 else b"")
    return frame(0x82, body + b"".join(s(f) + bytes((o,)) for f, o in filters))


def connack(level: int, rc: int) -> bytes:
    return bytes((0x20, 3, 0, rc, 0)) if level == 5 else bytes((0x20, 2, 0, rc))


def disconnect(level: int, rc: int) -> bytes:
    """What a server answers a broken connection with: v5 DISCONNECT, v3/v4 nothing."""
    return bytes((0xE0, 1, rc)) if level == 5 else b""


async def stopped(task: asyncio.Task) -> None:
    """Cancel a trickling sender; the server closing on it is what the test expected."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, ConnectionError):
        await task


class Peer:
    """A raw client socket: bytes in, bytes out, with a tiny parser for what comes back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.buf = b""

    @classmethod
    async def open(cls, port: int) -> Peer:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def trickle(self, data: bytes, pause: float) -> None:
        """Send `data` a byte at a time, each its own segment, `pause` seconds apart."""
        for i in range(len(data)):
            await self.send(data[i : i + 1])
            await asyncio.sleep(pause)

    async def packet(self) -> bytes:
        """The next whole packet the server sent."""
        async with asyncio.timeout(WAIT):
            while True:
                size = _packet_size(self.buf)
                if size is not None:
                    out, self.buf = self.buf[:size], self.buf[size:]
                    return out
                data = await self.reader.read(65536)
                if not data:
                    raise ConnectionError(f"closed by the server; unparsed {self.buf!r}")
                self.buf += data

    async def until_eof(self, timeout: float = WAIT) -> bytes:
        """Everything the server sends from now until it closes the connection."""
        async with asyncio.timeout(timeout):
            while True:
                try:
                    data = await self.reader.read(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    out, self.buf = self.buf, b""
                    return out
                self.buf += data

    def close(self) -> None:
        self.writer.transport.abort()


def _packet_size(buf: bytes) -> int | None:
    n, shift, i = 0, 0, 1
    while i < len(buf):
        b = buf[i]
        n |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return i + n if len(buf) >= i + n else None
        shift += 7
    return None


async def connected(port: int, level: int, client_id: str, **kw: object) -> Peer:
    peer = await Peer.open(port)
    await peer.send(connect(level, client_id, **kw))  # type: ignore[arg-type]
    ack = await peer.packet()
    assert ack[0] == 0x20 and ack[3] == 0, ack
    return peer


@pytest.fixture
async def gw(broker: Broker, caplog: pytest.LogCaptureFixture) -> AsyncIterator[Listener]:
    """The MQTT listener (plain and WebSocket); fails the test on any ERROR log."""
    caplog.set_level(logging.WARNING)
    listener = await start(broker, Settings(host="127.0.0.1", mqtt_port=0, mqtt_ws_port=0))
    assert listener is not None
    yield listener
    await listener.close()
    assert not logged_errors(caplog)


async def watcher(port: int, topic: str) -> Peer:
    """A v4 client subscribed to `topic` at QoS 1."""
    peer = await connected(port, 4, f"watch-{topic}")
    await peer.send(subscribe(4, 1, (topic, 1)))
    assert await peer.packet() == b"\x90\x03\x00\x01\x01"
    return peer


async def published(peer: Peer, level: int, topic: str, payload: bytes, pid: int = 1) -> None:
    """A QoS 1 PUBLISH from `peer`, acknowledged."""
    await peer.send(publish(level, topic, payload, qos=1, pid=pid))
    assert await peer.packet() == b"\x40\x02" + struct.pack("!H", pid)


async def delivered(peer: Peer, topic: str, payload: bytes) -> None:
    """`peer` receives `topic` / `payload` at QoS 1 (and acks it)."""
    got = await peer.packet()
    expected = s(topic)
    assert got[0] == 0x32 and got[2 : 2 + len(expected)] == expected, got
    assert got.endswith(payload), got
    await peer.send(b"\x40\x02" + got[2 + len(expected) : 4 + len(expected)])


async def assert_serving(port: int) -> None:
    """A fresh client connects, publishes at QoS 1 and receives its own message."""
    for level in (4, 5):
        peer = await connected(port, level, f"fresh{level}")
        await peer.send(subscribe(level, 1, ("alive", 1)))
        suback = await peer.packet()
        assert suback[0] == 0x90 and suback[-1] == 1, suback
        await peer.send(publish(level, "alive", b"still here", qos=1, pid=2))
        got = {(await peer.packet())[0] for _ in range(2)}
        assert got == {0x40, 0x32}
        peer.close()


async def hostile(port: int, level: int, bad: bytes, expected: bytes) -> None:
    """Connect at `level`, get a QoS 1 message acknowledged, send `bad`: the connection
    answers `expected` and closes, the acknowledged message is delivered, the gateway serves."""
    watch = await watcher(port, "h/acked")
    victim = await connected(port, level, "victim")
    await published(victim, level, "h/acked", ACKED)
    await victim.send(bad)
    assert await victim.until_eof() == expected
    await delivered(watch, "h/acked", ACKED)
    victim.close()
    watch.close()
    await assert_serving(port)


def pub5(topic: str | bytes = "t", pprops: bytes = b"\x00", **kw: object) -> bytes:
    return publish(5, topic, b"p", pprops=pprops, **kw)  # type: ignore[arg-type]


# (id, level, bytes sent after a successful CONNECT, reason code of the v5 DISCONNECT)
AFTER_CONNECT: list[tuple[str, int, bytes, int]] = [
    ("remaining-length-5-bytes", 5, b"\x30\xff\xff\xff\xff\x7f", 0x81),
    ("remaining-length-short-for-topic", 5, b"\x30\x03\x00\x05a", 0x81),
    ("pingreq-with-body", 5, b"\xc0\x01\x00", 0x81),
    ("pingreq-flags", 5, b"\xc1\x00", 0x81),
    ("reserved-packet-type-0", 5, b"\x00\x00", 0x81),
    ("puback-trailing-byte-v4", 4, b"\x40\x03\x00\x01\x00", 0),
    ("puback-packet-id-0", 5, b"\x40\x02\x00\x00", 0x82),
    ("puback-bad-reason-code", 5, b"\x40\x03\x00\x01\x05", 0x82),
    ("pubrel-flags-0", 5, b"\x60\x02\x00\x01", 0x81),
    ("publish-qos3", 5, pub5(qos=3), 0x81),
    ("publish-dup-on-qos0", 5, pub5(flags=8), 0x81),
    ("publish-packet-id-0", 5, pub5(qos=1, pid=0), 0x82),
    ("publish-topic-bad-utf8", 5, pub5(b"a\xff"), 0x81),
    ("publish-topic-nul", 5, pub5(b"a\x00b"), 0x81),
    ("publish-topic-surrogate", 5, pub5(b"a\xed\xa0\x80"), 0x81),
    ("publish-topic-overlong-utf8", 5, pub5(b"\xc0\xaf"), 0x81),
    ("publish-topic-plus", 5, pub5("a/+"), 0x90),
    ("publish-topic-hash", 5, pub5("a/#"), 0x90),
    ("publish-empty-topic-no-alias", 5, pub5(""), 0x82),
    ("publish-topic-alias-0", 5, pub5(pprops=props(u16(0x23, 0))), 0x94),
    ("publish-topic-alias-over-max", 5, pub5(pprops=props(u16(0x23, 65))), 0x94),
    ("publish-topic-alias-unknown", 5, pub5("", props(u16(0x23, 5))), 0x82),
    ("publish-subscription-id", 5, pub5(pprops=props(b"\x0b\x01")), 0x82),
    ("publish-response-topic-wildcard", 5, pub5(pprops=props(b"\x08" + s("r/#"))), 0x82),
    ("publish-duplicate-expiry", 5, pub5(pprops=props(u32(2, 9), u32(2, 9))), 0x82),
    (
        "publish-duplicate-content-type",
        5,
        pub5(pprops=props(b"\x03" + s("a"), b"\x03" + s("b"))),
        0x82,
    ),
    ("publish-property-not-allowed", 5, pub5(pprops=props(u32(0x11, 9))), 0x81),
    ("publish-unknown-property", 5, pub5(pprops=props(b"\x7f\x00")), 0x81),
    ("publish-property-id-0", 5, pub5(pprops=props(b"\x00")), 0x81),
    ("publish-user-property-bad-utf8", 5, pub5(pprops=props(user(b"k\xfe", "v"))), 0x81),
    ("publish-user-property-nul", 5, pub5(pprops=props(user("k", b"v\x00"))), 0x81),
    ("publish-user-property-surrogate", 5, pub5(pprops=props(user(b"\xed\xbf\xbf", "v"))), 0x81),
    ("publish-payload-format-2", 5, pub5(pprops=props(b"\x01\x02")), 0x82),
    ("publish-properties-overrun", 5, pub5(pprops=b"\x10" + u32(2, 9)), 0x81),
    ("publish-property-truncated", 5, pub5(pprops=b"\x03\x02\x00\x00"), 0x81),
    ("publish-packet-id-missing", 5, frame(0x32, s("t")), 0x81),
    ("publish-properties-missing", 5, frame(0x30, s("t")), 0x81),
    ("publish-property-length-5-bytes", 5, frame(0x30, s("t") + b"\x80\x80\x80\x80\x01"), 0x81),
    ("publish-over-maximum-size", 5, b"\x30" + vbi(3 * 1024 * 1024) + b"\x00\x01t", 0x95),
    ("subscribe-flags-0", 5, b"\x80" + subscribe(5, 1, ("a", 0))[1:], 0x81),
    ("subscribe-no-filters", 5, frame(0x82, b"\x00\x01\x00"), 0x82),
    ("subscribe-packet-id-0", 5, subscribe(5, 0, ("a", 0)), 0x82),
    ("subscribe-qos3", 5, subscribe(5, 1, ("a", 3)), 0x81),
    ("subscribe-reserved-bits", 5, subscribe(5, 1, ("a", 0x40)), 0x81),
    ("subscribe-retain-handling-3", 5, subscribe(5, 1, ("a", 0x30)), 0x82),
    ("subscribe-no-local-shared", 5, subscribe(5, 1, ("$share/g/a", 4)), 0x82),
    ("subscribe-options-missing", 5, frame(0x82, b"\x00\x01\x00" + s("a")), 0x81),
    ("subscribe-filter-bad-utf8", 5, subscribe(5, 1, (b"\xff", 0)), 0x81),
    ("subscribe-filter-nul", 5, subscribe(5, 1, (b"a\x00", 0)), 0x81),
    ("subscribe-subscription-id-0", 5, subscribe(5, 1, ("a", 0), sprops=props(b"\x0b\x00")), 0x82),
    (
        "subscribe-subscription-id-twice",
        5,
        subscribe(5, 1, ("a", 0), sprops=props(b"\x0b\x01\x0b\x02")),
        0x82,
    ),
    (
        "subscribe-subscription-id-5-bytes",
        5,
        subscribe(5, 1, ("a", 0), sprops=props(b"\x0b\xff\xff\xff\xff\x01")),
        0x81,
    ),
    ("subscribe-packet-id-missing", 5, b"\x82\x01\x00", 0x81),
    (
        "subscribe-property-not-allowed",
        5,
        subscribe(5, 1, ("a", 0), sprops=props(u16(0x23, 1))),
        0x81,
    ),
    ("unsubscribe-flags-0", 5, frame(0xA0, b"\x00\x01\x00" + s("a")), 0x81),
    ("unsubscribe-no-filters", 5, frame(0xA2, b"\x00\x01\x00"), 0x82),
    (
        "unsubscribe-subscription-id",
        5,
        frame(0xA2, b"\x00\x01" + props(b"\x0b\x01") + s("a")),
        0x81,
    ),
    ("second-connect", 5, connect(5, "again"), 0x82),
    ("second-connect-bad-version", 5, connect(5, "again", name=b"MQTX"), 0x82),
    ("connack-from-client", 5, b"\x20\x03\x00\x00\x00", 0x82),
    ("suback-from-client", 5, b"\x90\x04\x00\x01\x00\x00", 0x82),
    ("unsuback-from-client", 5, b"\xb0\x04\x00\x01\x00\x00", 0x82),
    ("pingresp-from-client", 5, b"\xd0\x00", 0x82),
    ("auth-without-method", 5, b"\xf0\x00", 0x82),
    ("disconnect-flags", 5, b"\xe1\x00", 0x81),
    ("disconnect-bad-reason-code", 5, b"\xe0\x01\x05", 0x82),
    ("disconnect-property-not-allowed", 5, b"\xe0\x05\x00" + props(u16(0x23, 1)), 0x81),
    ("disconnect-session-expiry-after-0", 5, b"\xe0\x07\x00" + props(u32(0x11, 10)), 0x82),
]
# The same kinds of faults at 3.1.1 and 3.1: the connection is closed, nothing is sent.
for _level in (3, 4):
    AFTER_CONNECT += [
        (f"remaining-length-5-bytes-v{_level}", _level, b"\x30\xff\xff\xff\xff\x7f", 0),
        (f"publish-qos3-v{_level}", _level, publish(_level, "t", b"p", qos=3), 0),
        (f"publish-topic-surrogate-v{_level}", _level, publish(_level, b"\xed\xa0\x80", b""), 0),
        (f"publish-topic-wildcard-v{_level}", _level, publish(_level, "a/+", b""), 0),
        (f"publish-empty-topic-v{_level}", _level, publish(_level, "", b"p"), 0),
        (f"publish-packet-id-0-v{_level}", _level, publish(_level, "t", b"p", qos=1, pid=0), 0),
        (f"subscribe-no-filters-v{_level}", _level, frame(0x82, b"\x00\x01"), 0),
        (f"subscribe-reserved-bits-v{_level}", _level, subscribe(_level, 1, ("a", 4)), 0),
        (f"second-connect-v{_level}", _level, connect(_level, "again"), 0),
        (f"suback-from-client-v{_level}", _level, b"\x90\x03\x00\x01\x00", 0),
        (f"auth-v{_level}", _level, b"\xf0\x00", 0),
        (f"publish-over-maximum-size-v{_level}", _level, b"\x30" + vbi(3 * 1024 * 1024), 0),
    ]


@pytest.mark.parametrize(
    ("level", "bad", "rc"), [c[1:] for c in AFTER_CONNECT], ids=[c[0] for c in AFTER_CONNECT]
)
async def test_bad_packet_after_connect(gw: Listener, level: int, bad: bytes, rc: int) -> None:
    """A connected client's bad packet: DISCONNECT with `rc` (v5) or a bare close."""
    await hostile(gw.port, level, bad, disconnect(level, rc))


def will(level: int, topic: str | bytes, wprops: bytes = b"\x00") -> bytes:
    return (wprops if level == 5 else b"") + s(topic) + s(b"bye")


# (id, bytes of a first packet, what the server answers before it closes)
BAD_CONNECT: list[tuple[str, bytes, bytes]] = [
    ("unknown-protocol-name", connect(4, "c", name=b"MQTX"), connack(4, 1)),
    ("unknown-protocol-level", connect(6, "c", name=b"MQTT"), connack(4, 1)),
    ("mqtt-name-with-level-3", connect(3, "c", name=b"MQTT"), connack(4, 1)),
    ("mqisdp-name-with-level-4", connect(4, "c", name=b"MQIsdp"), connack(4, 1)),
    ("fixed-header-flags", b"\x11" + connect(4, "c")[1:], b""),
    ("truncated", connect(4, "c")[:-1], b""),  # remaining length kept: waits, then times out
    ("remaining-length-short", b"\x10\x04" + connect(4, "c")[2:6], b""),
    ("trailing-byte-v4", frame(0x10, connect(4, "c")[2:] + b"\x00"), b""),
    ("trailing-byte-v5", frame(0x10, connect(5, "c")[2:] + b"\x00"), connack(5, 0x81)),
    ("reserved-flag-v4", connect(4, "c", flags=0x03), b""),
    ("reserved-flag-v5", connect(5, "c", flags=0x03), connack(5, 0x81)),
    ("will-qos-without-will-v4", connect(4, "c", flags=0x0A), b""),
    ("will-qos-without-will-v5", connect(5, "c", flags=0x0A), connack(5, 0x81)),
    ("will-retain-without-will-v5", connect(5, "c", flags=0x22), connack(5, 0x81)),
    ("will-qos3-v4", connect(4, "c", flags=0x1E, rest=will(4, "w")), b""),
    ("will-qos3-v5", connect(5, "c", flags=0x1E, rest=will(5, "w")), connack(5, 0x81)),
    ("will-topic-wildcard-v4", connect(4, "c", flags=0x06, rest=will(4, "w/#")), b""),
    ("will-topic-wildcard-v5", connect(5, "c", flags=0x06, rest=will(5, "w/#")), connack(5, 0x90)),
    ("will-topic-empty-v5", connect(5, "c", flags=0x06, rest=will(5, "")), connack(5, 0x90)),
    (
        "will-response-topic-wildcard-v5",
        connect(5, "c", flags=0x06, rest=will(5, "w", props(b"\x08" + s("r/+")))),
        connack(5, 0x82),
    ),
    ("will-topic-nul-v5", connect(5, "c", flags=0x06, rest=will(5, b"w\x00")), connack(5, 0x81)),
    (
        "will-property-not-allowed",
        connect(5, "c", flags=0x06, rest=will(5, "w", props(u32(0x11, 1)))),
        connack(5, 0x81),
    ),
    (
        "will-duplicate-delay",
        connect(5, "c", flags=0x06, rest=will(5, "w", props(u32(0x18, 1), u32(0x18, 1)))),
        connack(5, 0x82),
    ),
    ("password-without-user-v4", connect(4, "c", flags=0x42, rest=s(b"pw")), b""),
    ("user-flag-without-user-v4", connect(4, "c", flags=0x82), b""),
    ("user-name-bad-utf8-v4", connect(4, "c", flags=0x82, rest=s(b"\xff")), b""),
    (
        "user-name-surrogate-v5",
        connect(5, "c", flags=0x82, rest=s(b"\xed\xa0\x80")),
        connack(5, 0x81),
    ),
    ("client-id-empty-persistent-v4", connect(4, "", flags=0x00), connack(4, 2)),
    ("client-id-empty-v3", connect(3, ""), connack(3, 2)),
    ("client-id-bad-utf8-v4", connect(4, b"\xc3"), b""),
    ("client-id-nul-v5", connect(5, b"a\x00"), connack(5, 0x81)),
    ("client-id-surrogate-v5", connect(5, b"\xed\xb0\x80"), connack(5, 0x81)),
    ("receive-maximum-0", connect(5, "c", cprops=props(u16(0x21, 0))), connack(5, 0x82)),
    ("maximum-packet-size-0", connect(5, "c", cprops=props(u32(0x27, 0))), connack(5, 0x82)),
    (
        "duplicate-session-expiry",
        connect(5, "c", cprops=props(u32(0x11, 1), u32(0x11, 1))),
        connack(5, 0x82),
    ),
    ("request-problem-information-2", connect(5, "c", cprops=props(b"\x17\x02")), connack(5, 0x82)),
    ("property-not-allowed", connect(5, "c", cprops=props(u16(0x23, 1))), connack(5, 0x81)),
    ("user-property-nul", connect(5, "c", cprops=props(user("k\x00", "v"))), connack(5, 0x81)),
    (
        "authentication-data-without-method",
        connect(5, "c", cprops=props(b"\x16" + s(b"x"))),
        connack(5, 0x82),
    ),
    (
        "authentication-method",
        connect(5, "c", cprops=props(b"\x15" + s("SCRAM"))),
        connack(5, 0x8C),
    ),
    ("client-id-missing-v4", frame(0x10, connect(4, "")[2:-2]), b""),
    ("client-id-missing-v5", frame(0x10, connect(5, "")[2:-2]), connack(5, 0x81)),
    ("keep-alive-missing", frame(0x10, s("MQTT") + b"\x04\x02\x00"), b""),
    ("publish-first", publish(4, "t", b"p"), b""),
    ("pingreq-first", b"\xc0\x00", b""),
    ("subscribe-first", subscribe(4, 1, ("a", 0)), b""),
    ("auth-first", b"\xf0\x00", b""),
    ("connack-first", b"\x20\x02\x00\x00", b""),
    ("huge-first", b"\x10" + vbi(3 * 1024 * 1024), b""),
]


@pytest.mark.parametrize(
    ("bad", "expected"), [c[1:] for c in BAD_CONNECT], ids=[c[0] for c in BAD_CONNECT]
)
async def test_bad_first_packet(
    gw: Listener, monkeypatch: pytest.MonkeyPatch, bad: bytes, expected: bytes
) -> None:
    """A bad first packet: the CONNACK the spec asks for (if any), then EOF; a client
    already connected keeps publishing and receiving."""
    monkeypatch.setattr(session_module, "CONNECT_TIMEOUT", 1.0)
    watch = await watcher(gw.port, "h/first")
    peer = await Peer.open(gw.port)
    await peer.send(bad)
    assert await peer.until_eof() == expected
    peer.close()
    await watch.send(publish(4, "h/first", ACKED, qos=1, pid=9))
    assert await watch.packet() == b"\x40\x02\x00\x09"
    await delivered(watch, "h/first", ACKED)
    watch.close()
    await assert_serving(gw.port)


def split(data: bytes) -> list[bytes]:
    """Packets of a byte stream the server sent."""
    out = []
    while data:
        size = _packet_size(data)
        assert size is not None, data
        out.append(data[:size])
        data = data[size:]
    return out


async def test_bad_packet_behind_valid_ones_in_one_segment(gw: Listener) -> None:
    """CONNECT, SUBSCRIBE and a QoS 1 PUBLISH arrive with a malformed packet in one write:
    the valid ones are handled (the message is stored) before the DISCONNECT."""
    watch = await watcher(gw.port, "h/segment")
    peer = await Peer.open(gw.port)
    await peer.send(
        connect(5, "segment")
        + subscribe(5, 1, ("h/own", 1))
        + publish(5, "h/segment", ACKED, qos=1, pid=2)
        + pub5(qos=3)
    )
    got = split(await peer.until_eof())
    assert [p[0] for p in got[:2]] == [0x20, 0x90] and got[0][3] == 0
    assert got[1] == b"\x90\x04\x00\x01\x00\x01"
    assert got[-1] == disconnect(5, 0x81)
    assert got[2:-1] in ([], [b"\x40\x02\x00\x02"])  # the PUBACK may have been overtaken
    await delivered(watch, "h/segment", ACKED)
    watch.close()
    await assert_serving(gw.port)


async def test_a_shared_subscribe_cut_short_by_a_takeover(gw: Listener) -> None:
    """A SUBSCRIBE to a shared group still binding when another connection takes the client
    id over: no error (the fixture checks the log), and the gateway serves on."""
    session = props(u32(0x11, 60))  # persistent: the takeover keeps its group membership
    for delay in (0.0, 0.001, 0.002, 0.005, 0.01):
        first = await Peer.open(gw.port)
        await first.send(
            connect(5, "taken", cprops=session) + subscribe(5, 1, ("$share/cut/h/taken", 1))
        )
        await asyncio.sleep(delay)
        second = await Peer.open(gw.port)
        await second.send(connect(5, "taken", cprops=session))
        await first.until_eof()
        assert (await second.packet())[0] == 0x20
        second.close()
    await assert_serving(gw.port)


async def test_racing_connects_with_one_client_id_leave_the_later(gw: Listener) -> None:
    """CONNECTs with one client id sent back to back: the one that arrived first is taken
    over (DISCONNECT 0x8E), whichever of their session look-ups Redis answers first."""
    session = props(u32(0x11, 60))
    for round_ in range(30):
        first = await Peer.open(gw.port)
        await first.send(connect(5, "racing", cprops=session))
        second = await Peer.open(gw.port)
        await second.send(connect(5, "racing", cprops=session))
        got = split(await first.until_eof())
        assert got[0][0] == 0x20 and got[-1] == disconnect(5, 0x8E), (round_, got)
        assert (await second.packet())[0] == 0x20
        second.close()
    await assert_serving(gw.port)


async def test_refused_connect_ignores_what_follows(broker: Broker) -> None:
    """A CONNECT refused for its credentials, with a PUBLISH in the same write: CONNACK
    (not authorized), EOF, and the PUBLISH is never routed."""
    settings = Settings(
        host="127.0.0.1", mqtt_port=0, allow_anonymous=False, users=[User("alice", "pw")]
    )
    listener = await start(broker, settings)
    assert listener is not None
    routed: list[bytes] = []
    await broker.subscribe_direct("h/#", "mqtt", lambda msg: routed.append(msg.payload))
    try:
        for level, refused in ((5, connack(5, 0x87)), (4, connack(4, 5))):
            peer = await Peer.open(listener.port)
            await peer.send(connect(level, "sneaky") + publish(level, "h/x", b"no", qos=1))
            assert await peer.until_eof() == refused
            peer.close()
        alice = await connected(listener.port, 4, "alice", flags=0xC2, rest=s("alice") + s("pw"))
        await published(alice, 4, "h/x", b"yes")
        alice.close()
        assert routed == [b"yes"]
    finally:
        await listener.close()


@pytest.mark.parametrize("level", [3, 4, 5])
async def test_byte_at_a_time(gw: Listener, level: int) -> None:
    """Valid packets split into single bytes, each its own TCP segment, still work: CONNECT,
    SUBSCRIBE, PUBLISH QoS 1 and 2 (with PUBREL), PINGREQ."""
    peer = await Peer.open(gw.port)
    await peer.trickle(connect(level, "trickle", keep_alive=30), 0.001)
    ack = await peer.packet()
    assert ack[0] == 0x20 and ack[3] == 0, ack
    await peer.trickle(subscribe(level, 1, ("h/trickle", 2)), 0.001)
    suback = await peer.packet()
    assert suback[:4] == b"\x90" + bytes((len(suback) - 2,)) + b"\x00\x01" and suback[-1] == 2
    offset = 2 + len(s("h/trickle"))  # of the packet id in a delivery
    await peer.trickle(publish(level, "h/trickle", b"one", qos=1, pid=7), 0.001)
    got = sorted([await peer.packet(), await peer.packet()])
    assert got[0][0] == 0x32 and got[0].endswith(b"one") and got[1] == b"\x40\x02\x00\x07"
    await peer.trickle(b"\x40\x02" + got[0][offset : offset + 2], 0.001)
    await peer.trickle(publish(level, "h/trickle", b"two", qos=2, pid=8), 0.001)
    got = sorted([await peer.packet(), await peer.packet()])
    assert got[0][0] == 0x34 and got[0].endswith(b"two") and got[1] == b"\x50\x02\x00\x08"
    pid = got[0][offset : offset + 2]
    await peer.trickle(b"\x50\x02" + pid + b"\x62\x02\x00\x08", 0.001)  # PUBREC, PUBREL
    got = sorted([await peer.packet(), await peer.packet()])
    assert got == [b"\x62\x02" + pid, b"\x70\x02\x00\x08"]
    await peer.trickle(b"\x70\x02" + pid + b"\xc0\x00", 0.001)  # PUBCOMP, PINGREQ
    assert await peer.packet() == b"\xd0\x00"
    peer.close()


@pytest.mark.parametrize("level", [4, 5])
async def test_slowloris_partial_packet_hits_keep_alive(gw: Listener, level: int) -> None:
    """A client that keeps a packet incomplete, one byte at a time, is not alive for
    keep alive purposes: it is dropped 1.5 keep alive periods after its last packet."""
    peer = await connected(gw.port, level, "slow", keep_alive=1)
    loop = asyncio.get_running_loop()
    began = loop.time()
    task = asyncio.create_task(peer.trickle(publish(level, "h/slow", b"x" * 100), 0.2))
    try:
        assert await peer.until_eof() == disconnect(level, 0x8D)
        assert 1.4 <= loop.time() - began < 3
    finally:
        await stopped(task)
    peer.close()
    await assert_serving(gw.port)


async def test_slowloris_before_connect_hits_connect_timeout(
    gw: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CONNECT trickled slower than the CONNECT timeout allows: closed at the timeout."""
    monkeypatch.setattr(session_module, "CONNECT_TIMEOUT", 1.0)
    peer = await Peer.open(gw.port)
    loop = asyncio.get_running_loop()
    began = loop.time()
    task = asyncio.create_task(peer.trickle(connect(4, "c" * 50), 0.1))
    try:
        assert await peer.until_eof() == b""
        assert 0.9 <= loop.time() - began < 2.5
    finally:
        await stopped(task)
    peer.close()
    await assert_serving(gw.port)


FLOOD = 7 * 1024 * 1024  # more than the kernel's buffers and the pause mark, under the cap
BULK = 64 * 1024


async def flood(port: int, topic: str) -> None:
    """FLOOD bytes of QoS 0 messages to `topic`; returns once the gateway took them all."""
    pub = await connected(port, 4, f"flood-{topic}")
    for _ in range(FLOOD // BULK):
        await pub.send(publish(4, topic, b"x" * BULK))
    await pub.send(publish(4, "h/flooded", b"", qos=1, pid=1))  # after the flood, in order
    assert await pub.packet() == b"\x40\x02\x00\x01"
    pub.close()


async def reading_little(port: int, client_id: str) -> Peer:
    """A v4 client with a tiny receive buffer, subscribed at QoS 0 to h/<client_id> (keep
    alive 1 s), and FLOOD bytes published to that topic: the gateway stopped reading it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    peer = Peer(reader, writer)
    await peer.send(connect(4, client_id, keep_alive=1))
    assert (await peer.packet())[0] == 0x20
    await peer.send(subscribe(4, 1, (f"h/{client_id}", 0)))
    assert (await peer.packet())[0] == 0x90
    await flood(port, f"h/{client_id}")
    return peer


def mqtt_connection(gw: Listener, client_id: str) -> MqttConnection | None:
    return next(
        (c for c in gw.registry.connections if c.session and c.session.client_id == client_id),
        None,
    )


async def test_a_client_that_stops_reading_hits_keep_alive(
    gw: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that takes none of its output while its pings wait unread behind the paused
    input cannot show it is alive: keep alive drops it (within two periods), well before
    its output reaches the write buffer's cap."""
    caplog.set_level(logging.INFO, logger=session_module.__name__)
    stuck = await reading_little(gw.port, "stuck")
    await dropped_by_keep_alive(gw, "stuck", lambda: stuck.writer.write(b"\xc0\x00"), caplog)
    await stuck.until_eof()
    stuck.close()
    await assert_serving(gw.port)


async def test_a_websocket_client_that_stops_reading_hits_keep_alive(
    gw: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    """The same over WebSocket: what its TCP acknowledged is asked of the socket under the
    WebSocket framing."""
    caplog.set_level(logging.INFO, logger=session_module.__name__)
    stuck = await WsPeer.open(gw, rcvbuf=4096)
    stuck.send(WS_BINARY, connect(4, "stuck-ws", keep_alive=1) + subscribe(4, 1, ("h/ws-stuck", 0)))
    assert (await stuck.packet())[0] == 0x20 and (await stuck.packet())[0] == 0x90
    await flood(gw.port, "h/ws-stuck")
    await dropped_by_keep_alive(gw, "stuck-ws", lambda: stuck.send(WS_BINARY, b"\xc0\x00"), caplog)
    await stuck.until_eof()
    stuck.abort()
    await assert_serving(gw.port)


async def dropped_by_keep_alive(
    gw: Listener, client_id: str, ping: Callable[[], None], caplog: pytest.LogCaptureFixture
) -> None:
    """The client's input is paused, it pings every 0.5 s (never read) and takes nothing:
    keep alive (1 s, so 1.5 s a period) drops it within two periods."""
    conn = mqtt_connection(gw, client_id)
    assert conn is not None and conn.input_paused  # the premise: its input is not read
    began = time.time()
    for _ in range(8):
        ping()
        await asyncio.sleep(0.5)
    assert mqtt_connection(gw, client_id) is None
    dropped = [r for r in caplog.records if "keep alive timed out" in r.getMessage()]
    assert len(dropped) == 1 and 1.4 <= dropped[0].created - began < 3.6, dropped


async def test_a_client_that_reads_slowly_stays(
    gw: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    """A subscriber that reads slowly, its pings unread behind the paused input, takes some
    of its output each keep alive period: it is alive, and stays connected."""
    caplog.set_level(logging.INFO, logger=session_module.__name__)
    slow = await reading_little(gw.port, "slow")
    conn = mqtt_connection(gw, "slow")
    assert conn is not None and conn.input_paused
    for i in range(40):  # 4 s at ~160 KiB/s
        if i % 5 == 0:
            await slow.send(b"\xc0\x00")
        slow.buf = b""
        await slow.reader.read(16384)
        await asyncio.sleep(0.1)
    assert mqtt_connection(gw, "slow") is conn
    assert "keep alive timed out" not in caplog.text
    slow.close()


class WsPeer(RawClient):
    """A raw WebSocket client carrying MQTT: MQTT packets read across binary frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.mqtt = b""  # binary payloads not yet taken as packets

    @classmethod
    async def open(cls, listener: Listener, rcvbuf: int | None = None) -> WsPeer:
        peer, head = await cls.upgrade(listener, rcvbuf=rcvbuf)
        assert head.startswith(b"HTTP/1.1 101 "), head
        return peer

    async def packet(self) -> bytes:
        async with asyncio.timeout(WAIT):
            while (size := _packet_size(self.mqtt)) is None:
                opcode, payload = await self.receive()
                assert opcode == WS_BINARY, (opcode, payload)
                self.mqtt += payload
        out, self.mqtt = self.mqtt[:size], self.mqtt[size:]
        return out

    async def until_eof(self) -> list[tuple[int, bytes]]:
        """The frames the server sends until it closes the socket. Its close frame is
        answered, as a client does: the server then closes without waiting CLOSE_WAIT."""
        frames = []
        async with asyncio.timeout(WAIT):
            while True:
                try:
                    opcode, payload = await self.receive()
                except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
                    assert not getattr(exc, "partial", b""), exc
                    return frames
                frames.append((opcode, payload))
                if opcode == WS_CLOSE:
                    self.send(WS_CLOSE, payload[:2])

    def abort(self) -> None:
        self.writer.transport.abort()


WS_CONTINUATION, WS_TEXT, WS_BINARY, WS_CLOSE, WS_PING = 0x0, 0x1, 0x2, 0x8, 0x9


def ws_close(code: int) -> tuple[int, bytes]:
    return (WS_CLOSE, struct.pack("!H", code))


# (id, frames as (opcode, payload, fin, rsv), the frames the server answers before EOF)
WS_CASES: list[tuple[str, list[tuple[int, bytes, bool, int]], list[tuple[int, bytes]]]] = [
    (
        "malformed-mqtt",
        [(WS_BINARY, pub5(qos=3), True, 0)],
        [(WS_BINARY, b"\xe0\x01\x81"), ws_close(1000)],
    ),
    (
        "mqtt-split-then-malformed",
        [(WS_BINARY, b"\x30", False, 0), (WS_CONTINUATION, b"\x80\x80\x80\x80\x01", True, 0)],
        [(WS_BINARY, b"\xe0\x01\x81"), ws_close(1000)],
    ),
    (
        "mqtt-too-large",
        [(WS_BINARY, b"\x30" + vbi(3 * 1024 * 1024), True, 0)],
        [(WS_BINARY, b"\xe0\x01\x95"), ws_close(1000)],
    ),
    ("text-frame", [(WS_TEXT, b"\xc0\x00", True, 0)], [ws_close(1003)]),
    ("rsv-bits", [(WS_BINARY, b"\xc0\x00", True, 4)], [ws_close(1002)]),
    ("fragmented-ping", [(WS_PING, b"hi", False, 0)], [ws_close(1002)]),
    ("long-ping", [(WS_PING, b"x" * 126, True, 0)], [ws_close(1002)]),
    (
        "binary-inside-fragmented-message",
        [(WS_BINARY, b"\xc0", False, 0), (WS_BINARY, b"\x00", True, 0)],
        [ws_close(1002)],
    ),
    ("stray-continuation", [(WS_CONTINUATION, b"\xc0\x00", True, 0)], [ws_close(1002)]),
    ("unknown-data-opcode", [(0x3, b"\xc0\x00", True, 0)], [ws_close(1002)]),
    ("unknown-control-opcode", [(0xB, b"", True, 0)], [ws_close(1002)]),
    ("close-one-byte-body", [(WS_CLOSE, b"\x03", True, 0)], [ws_close(1002)]),
    ("close-reserved-code", [(WS_CLOSE, struct.pack("!H", 1005), True, 0)], [ws_close(1002)]),
    ("close-code-below-1000", [(WS_CLOSE, struct.pack("!H", 999), True, 0)], [ws_close(1002)]),
    (
        "close-reason-bad-utf8",
        [(WS_CLOSE, struct.pack("!H", 1000) + b"\xff", True, 0)],
        [ws_close(1007)],
    ),
    ("close-normal", [(WS_CLOSE, struct.pack("!H", 1000), True, 0)], [ws_close(1000)]),
    (
        "close-private-code-reason",
        [(WS_CLOSE, struct.pack("!H", 4000) + "bye ü".encode(), True, 0)],
        [ws_close(1000)],
    ),
    ("close-empty", [(WS_CLOSE, b"", True, 0)], [ws_close(1000)]),
]


@pytest.mark.parametrize(
    ("frames", "expected"), [c[1:] for c in WS_CASES], ids=[c[0] for c in WS_CASES]
)
async def test_websocket_bad_frames(
    gw: Listener, frames: list[tuple[int, bytes, bool, int]], expected: list[tuple[int, bytes]]
) -> None:
    """After an acknowledged QoS 1 publish over WebSocket, bad frames close the connection
    with the WebSocket (or, inside binary frames, the MQTT) reason; the message survives."""
    watch = await watcher(gw.port, "h/ws")
    peer = await WsPeer.open(gw)
    peer.send(WS_BINARY, connect(5, "ws-victim") + publish(5, "h/ws", ACKED, qos=1, pid=3))
    ack = await peer.packet()
    assert ack[0] == 0x20 and ack[3] == 0, ack
    assert await peer.packet() == b"\x40\x02\x00\x03"
    for opcode, payload, fin, rsv in frames:
        peer.send(opcode, payload, fin=fin, rsv=rsv)
    assert await peer.until_eof() == expected
    peer.abort()
    await delivered(watch, "h/ws", ACKED)
    watch.close()
    await assert_serving(gw.port)


async def test_websocket_huge_frame_headers(gw: Listener) -> None:
    """A frame announcing 2**40 bytes is a byte stream like any other (MQTT §6): its
    packets count as they arrive, each within the packet limit. A length with the most
    significant bit set is refused with 1002 (RFC 6455 §5.2)."""
    peer = await WsPeer.open(gw)
    mask = b"\x00\x00\x00\x00"
    peer.writer.write(b"\x82\xff" + struct.pack("!Q", 1 << 40) + mask + connect(4, "ws-huge"))
    assert await peer.packet() == b"\x20\x02\x00\x00"
    peer.abort()
    peer = await WsPeer.open(gw)
    peer.writer.write(b"\x82\xff" + struct.pack("!Q", 1 << 63) + mask)
    assert await peer.until_eof() == [ws_close(1002)]
    peer.abort()
    await assert_serving(gw.port)


async def test_websocket_byte_at_a_time(gw: Listener) -> None:
    """MQTT packets cut into one-byte fragments of one message, and one-byte messages."""
    peer = await WsPeer.open(gw)
    data = connect(5, "ws-trickle") + subscribe(5, 1, ("h/wt", 1))
    for i in range(len(data)):
        opcode = WS_BINARY if i == 0 else WS_CONTINUATION
        peer.send(opcode, data[i : i + 1], fin=i == len(data) - 1)
        await asyncio.sleep(0.001)
    ack = await peer.packet()
    assert ack[0] == 0x20 and ack[3] == 0, ack
    assert await peer.packet() == b"\x90\x04\x00\x01\x00\x01"
    data = publish(5, "h/wt", b"bytes", qos=1, pid=4)
    for i in range(len(data)):
        peer.send(WS_BINARY, data[i : i + 1])
        await asyncio.sleep(0.001)
    got = sorted([await peer.packet(), await peer.packet()])
    assert got[0][0] == 0x32 and got[0].endswith(b"bytes") and got[1] == b"\x40\x02\x00\x04"
    peer.abort()


_fuzz_ids = itertools.count()
CLIENT_PACKETS = ("publish", "puback", "pubrec", "pubrel", "pubcomp", "subscribe", "unsubscribe")
ODD_PACKETS = ("connect", "connack", "suback", "unsuback", "pingresp", "disconnect", "auth")


@st.composite
def client_streams(draw: st.DrawFn) -> tuple[int, list[Packet]]:
    """A protocol level and packets a client might send: mostly ones a client may send, in
    any order and with any ids, sometimes one it must not (then the connection goes)."""
    level = draw(st.sampled_from((3, 4, 5)))
    strategies = packet_strategies(level)
    names = CLIENT_PACKETS + tuple(n for n in ODD_PACKETS if n in strategies)
    weights = st.sampled_from(CLIENT_PACKETS * 6 + names)
    packets = [draw(strategies[name]) for name in draw(st.lists(weights, max_size=6))]
    return level, packets


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(stream=client_streams())
async def test_fuzz_decodable_packets_never_break_the_session(
    gw: Listener, caplog: pytest.LogCaptureFixture, stream: tuple[int, list[Packet]]
) -> None:
    """Packets that decode but make no sense in their order (unknown ids, server-only
    packets, odd properties): the server answers only well-formed packets, closes with a
    DISCONNECT (v5) when it closes, logs no error, and keeps serving."""
    level, packets = stream
    caplog.clear()
    peer = await connected(gw.port, level, f"fuzz{next(_fuzz_ids)}")
    decoder = MqttDecoder(protocol_level=level)
    await peer.send(b"".join(encode(p, level) for p in packets) + b"\xc0\x00")
    received: list[Packet] = []
    closed = False
    try:
        while not any(isinstance(p, Pingresp) for p in received):
            received += decoder.feed(await peer.packet())
    except ConnectionError:
        closed = True
        received += decoder.feed(peer.buf)
    if closed and level == 5 and not any(isinstance(p, Disconnect) for p in packets):
        assert isinstance(received[-1], Disconnect) and received[-1].reason_code >= 0x80
    peer.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    await assert_serving(gw.port)


async def test_too_many_user_properties_close_the_connection(gw: Listener) -> None:
    """One 2 MiB publish of 340,000 empty user properties held the node for seconds, and
    every other client with it (found by a review): more than MAX_USER_PROPERTIES is a
    quota exceeded, the connection closed; as many are taken."""
    watch = await watcher(gw.port, "h/up")
    empty_pair = b"\x26" + s("") + s("")
    peer = await connected(gw.port, 5, "props")
    most = props(empty_pair * MAX_USER_PROPERTIES)
    await peer.send(publish(5, "h/up", b"most", qos=1, pprops=most))
    assert await peer.packet() == b"\x40\x02\x00\x01"
    assert (await watch.packet()).endswith(b"most")
    more = props(empty_pair * (MAX_USER_PROPERTIES + 1))
    await peer.send(publish(5, "h/up", b"more", qos=1, pid=2, pprops=more))
    assert await peer.until_eof() == disconnect(5, 0x97)
    peer.close()
    watch.close()
    await assert_serving(gw.port)


async def test_receive_maximum_exceeded(gw: Listener) -> None:
    """A v5 client with more unreleased QoS 2 publishes than the server's receive maximum
    (256) is disconnected with 0x93; the messages it had acknowledged are kept."""
    watch = await watcher(gw.port, "h/rm")
    peer = await connected(gw.port, 5, "greedy")
    await peer.send(b"".join(publish(5, "h/rm", b"%d" % i, qos=2, pid=i) for i in range(1, 257)))
    for i in range(1, 257):
        assert await peer.packet() == b"\x50\x02" + struct.pack("!H", i)
    await peer.send(publish(5, "h/rm", b"257", qos=2, pid=257))
    assert await peer.until_eof() == disconnect(5, 0x93)
    offset = 2 + len(s("h/rm"))
    payloads = set()
    for _ in range(256):
        packet = await watch.packet()
        payloads.add(packet[offset + 2 :])
        await watch.send(b"\x40\x02" + packet[offset : offset + 2])
    assert payloads == {b"%d" % i for i in range(1, 257)}
    marker = await connected(gw.port, 4, "marker")
    await published(marker, 4, "h/rm", b"marker")
    await delivered(watch, "h/rm", b"marker")  # and not the 257th before it
    marker.close()
    peer.close()
    watch.close()
    await assert_serving(gw.port)


@pytest.mark.parametrize("level", [4, 5])
async def test_unacked_delivery_survives_bad_packet(gw: Listener, level: int) -> None:
    """A persistent subscriber holding an unacknowledged QoS 1 delivery and a QoS 2 one
    (PUBREC sent) breaks the protocol: on reconnect it gets the QoS 1 message again (DUP)
    and the PUBREL of the QoS 2 one."""
    kw = {"flags": 0x00} if level == 4 else {"cprops": props(u32(0x11, 60))}
    sub = await connected(gw.port, level, "holder", **kw)  # type: ignore[arg-type]
    await sub.send(subscribe(level, 1, ("h/held", 2)))
    assert (await sub.packet())[-1] == 2
    pub = await connected(gw.port, 4, "sender")
    await published(pub, 4, "h/held", b"one")
    await pub.send(publish(4, "h/held", b"two", qos=2, pid=2))
    assert await pub.packet() == b"\x50\x02\x00\x02"
    await pub.send(b"\x62\x02\x00\x02")
    assert await pub.packet() == b"\x70\x02\x00\x02"
    offset = 2 + len(s("h/held"))
    first, second = await sub.packet(), await sub.packet()
    assert first[0] == 0x32 and first.endswith(b"one"), first
    assert second[0] == 0x34 and second.endswith(b"two"), second
    await sub.send(b"\x50\x02" + second[offset : offset + 2])  # PUBREC for "two"
    assert await sub.packet() == b"\x62\x02" + second[offset : offset + 2]
    await sub.send(publish(level, "h/+", b"bad"))  # a wildcard in a topic name
    assert await sub.until_eof() == disconnect(level, 0x90)
    sub.close()
    again = await Peer.open(gw.port)
    await again.send(connect(level, "holder", flags=0x00))
    ack = await again.packet()
    assert ack[0] == 0x20 and ack[2:4] == b"\x01\x00", ack  # session present
    got = [await again.packet() for _ in range(2)]
    assert b"\x62\x02" + second[offset : offset + 2] in got
    redelivered = next(p for p in got if p[0] & 0xF0 == 0x30)
    assert redelivered[0] == 0x3A and redelivered.endswith(b"one")  # QoS 1 with DUP
    again.close()
    pub.close()


@pytest.mark.parametrize("level", [4, 5])
@pytest.mark.parametrize(
    ("qos", "wrong"), [(1, 0x50), (2, 0x40)], ids=["pubrec-for-1", "puback-for-2"]
)
async def test_a_delivery_acked_at_the_wrong_qos(
    gw: Listener, level: int, qos: int, wrong: int
) -> None:
    """PUBREC for a QoS 1 delivery, PUBACK for a QoS 2 one: a protocol error, and the
    message is not settled by it: the next subscriber of the queue gets it."""
    kw = {"flags": 0x00} if level == 4 else {"cprops": props(u32(0x11, 60))}
    sub = await connected(gw.port, level, "wrong-ack", **kw)  # type: ignore[arg-type]
    await sub.send(subscribe(level, 1, ("h/wrong", qos)))
    assert (await sub.packet())[-1] == qos
    pub = await connected(gw.port, 4, "wrong-sender")
    await pub.send(publish(4, "h/wrong", b"m", qos=qos, pid=2))
    assert (await pub.packet())[0] == (0x40 if qos == 1 else 0x50)
    got = await sub.packet()
    assert got[0] & 0x06 == qos << 1 and got.endswith(b"m"), got
    offset = 2 + len(s("h/wrong"))
    await sub.send(bytes((wrong, 2)) + got[offset : offset + 2])
    assert await sub.until_eof() == disconnect(level, 0x82)
    sub.close()
    again = await Peer.open(gw.port)
    await again.send(connect(level, "wrong-ack", flags=0x00))
    assert (await again.packet())[2:4] == b"\x01\x00"  # session present
    redelivered = await again.packet()
    assert redelivered[0] & 0x0F == 0x08 | qos << 1 and redelivered.endswith(b"m")  # DUP
    again.close()
    pub.close()


@pytest.mark.parametrize(
    ("level", "bad", "rc"),
    [
        (4, publish(4, "t", b"p", qos=3), 0),
        (5, publish(5, "t", b"p", qos=3), 0x81),
        (5, b"\xe0\x01\x05", 0x82),  # a DISCONNECT with a reason code a client may not send
        (5, b"\xe0\x07\x00" + props(u32(0x11, 10)), 0x82),  # expiry after expiry 0
    ],
    ids=["v4-malformed", "v5-malformed", "v5-bad-disconnect", "v5-disconnect-expiry"],
)
async def test_will_published_after_protocol_error(
    gw: Listener, level: int, bad: bytes, rc: int
) -> None:
    """A connection closed for a protocol error publishes its will (MQTT 5 §3.1.2.5,
    3.1.1 §3.1.2.5): only a normal DISCONNECT discards it."""
    watch = await watcher(gw.port, "h/will")
    peer = await connected(gw.port, level, "willing", flags=0x0E, rest=will(level, "h/will"))
    await peer.send(bad)
    assert await peer.until_eof() == disconnect(level, rc)
    await delivered(watch, "h/will", b"bye")
    peer.close()
    watch.close()


@pytest.mark.parametrize("level", [4, 5])
async def test_subscriptions_per_session_are_capped(
    gw: Listener, monkeypatch: pytest.MonkeyPatch, level: int
) -> None:
    """One SUBSCRIBE can carry 150 000 filters and a client can send many: past the cap a
    new filter is refused (v5: 0x97 quota exceeded, v3.1.1: 0x80), while changing one it
    holds, or taking a new one after an UNSUBSCRIBE, still works."""
    monkeypatch.setattr(session_module, "MAX_SUBSCRIPTIONS", 3)
    refused = 0x97 if level == 5 else 0x80
    peer = await connected(gw.port, level, "collector")

    async def suback(pid: int, *filters: tuple[str, int]) -> bytes:
        await peer.send(subscribe(level, pid, *filters))
        got = await peer.packet()
        assert got[:4] == b"\x90" + bytes((len(got) - 2,)) + struct.pack("!H", pid), got
        return got[-len(filters) :]

    assert await suback(1, ("q/a", 0), ("q/b", 1), ("q/c", 1), ("q/d", 1)) == bytes(
        (0, 1, 1, refused)
    )
    assert await suback(2, ("q/e", 0), ("q/a", 1)) == bytes((refused, 1))
    await peer.send(frame(0xA2, b"\x00\x03" + (b"\x00" if level == 5 else b"") + s("q/b")))
    unsuback = b"\xb0\x04\x00\x03\x00\x00" if level == 5 else b"\xb0\x02\x00\x03"
    assert await peer.packet() == unsuback
    assert await suback(4, ("q/e", 1)) == b"\x01"
    await published(peer, level, "q/d", b"not subscribed")
    await published(peer, level, "q/e", b"subscribed", pid=2)
    await delivered(peer, "q/e", b"subscribed")
    peer.close()
    await assert_serving(gw.port)
