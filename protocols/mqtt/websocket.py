"""MQTT over WebSocket (RFC 6455): the HTTP upgrade and the framing, nothing else.

`WebSocketConnection` is the asyncio protocol of the socket. After the upgrade it hands
the MQTT connection a `FramedTransport`, so the MQTT code is the same for every listener:
binary frame payloads (fragments too; MQTT is a byte stream, so they need no reassembly)
go to its `data_received` as they arrive, a frame of any size (it may carry several MQTT
packets, MQTT §6: the MQTT decoder caps each packet), and its writes go out as binary
frames. Pings are answered, a valid close frame is answered; anything else a client must
not send closes with 1002 (1003 for text, 1007 for a close reason that is not UTF-8).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import struct
from typing import cast

log = logging.getLogger(__name__)

PATH = "/mqtt"
SUBPROTOCOLS = ("mqtt", "mqttv3.1")  # in the server's order of choice (MQTT-6.0.0-4)
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
MAX_REQUEST = 8192  # bytes of HTTP upgrade request
MAX_CONTROL = 125  # bytes of a control frame's payload (RFC 6455 §5.5)
HANDSHAKE_TIMEOUT = 10.0  # seconds a new socket has to complete the upgrade request
CLOSE_WAIT = 1.0  # seconds to wait for the client's close frame before closing the socket
CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
PROTOCOL_ERROR, UNSUPPORTED_DATA, INVALID_DATA = 1002, 1003, 1007
# Close codes a peer may send (RFC 6455 §7.4; 1012-1014 registered with IANA since).
VALID_CLOSE_CODES = frozenset((1000, 1001, 1002, 1003, *range(1007, 1015), *range(3000, 5000)))


def frame(opcode: int, payload: bytes) -> bytes:
    """An unmasked, final server frame."""
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, n)
    elif n < 0x10000:
        head = struct.pack("!BBH", 0x80 | opcode, 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 127, n)
    return head + payload


def unmask(data: bytes, key: bytes, phase: int = 0) -> bytes:
    """`data` unmasked with `key`, starting `phase` bytes into the frame's payload."""
    n = len(data)
    key = key[phase % 4 :] + key[: phase % 4]
    pad = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "big") ^ int.from_bytes(pad, "big")).to_bytes(n, "big")


def close_frame_error(payload: bytes) -> int | None:
    """The close code to fail with for a bad close frame body (RFC 6455 §5.5.1, §7.4:
    empty, or a valid code and a UTF-8 reason), else None."""
    if not payload:
        return None
    if len(payload) < 2 or struct.unpack_from("!H", payload)[0] not in VALID_CLOSE_CODES:
        return PROTOCOL_ERROR
    try:
        payload[2:].decode()
    except UnicodeDecodeError:
        return INVALID_DATA
    return None


def _tokens(value: str) -> list[str]:
    return [token.strip() for token in value.split(",")]


def _http_11_or_later(version: str) -> bool:
    """RFC 6455 §4.2.1: an HTTP/1.1 or later GET."""
    major, _, minor = version.removeprefix("HTTP/").partition(".")
    if not version.startswith("HTTP/") or not (major.isdigit() and minor.isdigit()):
        return False
    return (int(major), int(minor)) >= (1, 1)


def _resource(target: str) -> str:
    """The path of a request target, origin-form or absolute-form (RFC 7230 §5.3)."""
    if "://" in target:
        target = "/" + target.split("://", 1)[1].partition("/")[2]
    return target.split("?", 1)[0]


def _nonce(key: str) -> bool:
    """A Sec-WebSocket-Key is 16 bytes, base64-encoded (§4.1)."""
    try:
        return len(base64.b64decode(key, validate=True)) == 16
    except ValueError:
        return False


def accept_key(key: str) -> str:
    return base64.b64encode(hashlib.sha1(key.encode() + GUID).digest()).decode()


class FramedTransport:
    """What the MQTT connection writes to: its bytes leave as binary frames."""

    def __init__(self, socket: asyncio.Transport) -> None:
        self.socket = socket
        self.close_sent = False
        self.failed = False  # the client broke the protocol: what it sends is not read

    def write(self, data: bytes) -> None:
        if not self.close_sent:
            self.socket.write(frame(BINARY, data))

    def close(self) -> None:
        """Start the closing handshake: the socket closes at the client's answer (which
        spares the client a write to a closed socket) or after CLOSE_WAIT."""
        if not self.close_sent:
            self.close_sent = True
            self.socket.write(frame(CLOSE, struct.pack("!H", 1000)))
            asyncio.get_running_loop().call_later(CLOSE_WAIT, self._shut)

    def fail(self, code: int) -> None:
        """The client broke the protocol: say why, read no more of it, and close after
        CLOSE_WAIT. Closing at once, with its bytes unread, would reset the connection,
        and the reset overtakes the close frame: the client would never learn why."""
        self.failed = True
        if not self.close_sent:
            self.close_sent = True
            self.socket.write(frame(CLOSE, struct.pack("!H", code)))
            asyncio.get_running_loop().call_later(CLOSE_WAIT, self._shut)

    def _shut(self) -> None:
        """Close the socket; abort it when the client still has bytes of ours unread (a
        close waits for them, for ever from a client that stopped reading), or over TLS:
        a client that did not answer the close frame would not answer the TLS close either,
        and waiting for that delayed its will and takeover by another second."""
        socket = self.socket
        if socket.get_write_buffer_size() or socket.get_extra_info("sslcontext") is not None:
            socket.abort()
        else:
            socket.close()

    def abort(self) -> None:
        self.socket.abort()

    def is_closing(self) -> bool:
        return self.close_sent or self.socket.is_closing()

    def get_write_buffer_size(self) -> int:
        return self.socket.get_write_buffer_size()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self.socket.get_extra_info(name, default)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.socket.set_write_buffer_limits(high, low)

    def pause_reading(self) -> None:
        self.socket.pause_reading()

    def resume_reading(self) -> None:
        self.socket.resume_reading()


class WebSocketConnection(asyncio.Protocol):
    """One WebSocket client socket carrying an MQTT connection (`inner`)."""

    def __init__(self, inner: asyncio.Protocol) -> None:
        self.inner = inner
        self.socket: asyncio.Transport | None = None
        self.framed: FramedTransport | None = None  # set once upgraded
        self._buf = bytearray()
        self._in_message = False  # a fragmented binary message awaits continuations
        # the data frame whose payload is arriving: bytes still to come, mask key, offset
        self._remaining = 0
        self._key = b""
        self._phase = 0
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.socket = cast(asyncio.Transport, transport)
        self._timer = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT, self._too_slow)

    def _too_slow(self) -> None:
        """No upgrade in time: drop the socket (an idle one must not be held for ever)."""
        if self.framed is None and self.socket is not None:
            self.socket.close()

    def data_received(self, data: bytes) -> None:
        if self.framed is not None and self.framed.failed:
            return
        self._buf += data
        if self.framed is None:
            self._handshake()
        while (
            self.framed is not None
            and not self.framed.failed
            and not self.framed.socket.is_closing()
            and self._frame()
        ):
            pass

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.framed is not None and not self.framed.failed:
            self.inner.connection_lost(exc)

    def _fail(self, code: int) -> None:
        """The client broke the protocol: the MQTT connection ends now (its session sends
        nothing more into a socket that only waits to tell the client why)."""
        assert self.framed is not None
        if not self.framed.failed:
            self.framed.fail(code)
            self.inner.connection_lost(None)

    def pause_writing(self) -> None:
        if self.framed is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.framed is not None:
            self.inner.resume_writing()

    # -- upgrade ---------------------------------------------------------------------------

    def _handshake(self) -> None:
        while self._buf[:2] == b"\r\n":  # empty lines before the request-line are ignored
            del self._buf[:2]  # (RFC 7230 §3.5)
        start = bytes(self._buf[:4])
        if not b"GET ".startswith(start):  # a TLS ClientHello, an MQTT CONNECT: refused at
            self._refuse(400, "Bad Request")  # once, not after the handshake timeout
            return
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_REQUEST:
                self._refuse(431, "Request Header Fields Too Large")
            return
        head = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[: end + 4]
        parts = head[0].split(" ")
        headers: dict[str, str] = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip()
            # a header may come in several lines: one comma-separated list (RFC 7230 §3.2.2)
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        if len(parts) != 3 or parts[0] != "GET" or not _http_11_or_later(parts[2]):
            self._refuse(400, "Bad Request")
            return
        if _resource(parts[1]) != PATH:
            self._refuse(404, "Not Found")
            return
        if headers.get("sec-websocket-version") != "13":  # §4.4: say which one we speak
            self._refuse(426, "Upgrade Required", "Sec-WebSocket-Version: 13\r\n")
            return
        offered = _tokens(headers.get("sec-websocket-protocol", ""))
        chosen = next((p for p in SUBPROTOCOLS if p in offered), None)
        key = headers.get("sec-websocket-key")
        if (
            chosen is None
            or key is None
            or not _nonce(key)
            or "host" not in headers
            or "websocket" not in _tokens(headers.get("upgrade", "").lower())
            or "upgrade" not in _tokens(headers.get("connection", "").lower())
        ):
            self._refuse(400, "Bad Request")
            return
        assert self.socket is not None
        self.socket.write(
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Accept: {accept_key(key)}\r\n"
            f"Sec-WebSocket-Protocol: {chosen}\r\n\r\n".encode()
        )
        if self._timer is not None:
            self._timer.cancel()
        self.framed = FramedTransport(self.socket)
        self.inner.connection_made(cast(asyncio.Transport, self.framed))

    def _refuse(self, status: int, reason: str, extra: str = "") -> None:
        assert self.socket is not None
        body = f"{status} {reason}\n".encode()
        self.socket.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\n{extra}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        self.socket.close()

    # -- frames ----------------------------------------------------------------------------

    def _frame(self) -> bool:
        """Handle what the buffer holds of one frame: a data frame's payload as it arrives,
        a control frame once whole. False when it holds nothing more to handle."""
        assert self.framed is not None
        buf = self._buf
        if self._remaining:
            return self._payload()
        if len(buf) < 2:
            return False
        fin, opcode = buf[0] & 0x80, buf[0] & 0x0F
        masked, size = buf[1] & 0x80, buf[1] & 0x7F
        offset = 2
        if size == 126:
            if len(buf) < 4:
                return False
            size, offset = struct.unpack_from("!H", buf, 2)[0], 4
        elif size == 127:
            if len(buf) < 10:
                return False
            size, offset = struct.unpack_from("!Q", buf, 2)[0], 10
        if (
            not masked
            or buf[0] & 0x70
            or size >> 63  # a 64-bit length's most significant bit must be 0
            or (opcode >= CLOSE and (not fin or size > MAX_CONTROL))
        ):
            self._fail(PROTOCOL_ERROR)
            return False
        if opcode == TEXT:
            self._fail(UNSUPPORTED_DATA)
            return False
        if opcode < CLOSE:  # data: its payload goes on as it arrives
            if opcode != (CONTINUATION if self._in_message else BINARY):
                self._fail(PROTOCOL_ERROR)  # an unknown opcode, or out of place
                return False
            if len(buf) < offset + 4:
                return False
            self._in_message = not fin
            self._key, self._phase, self._remaining = bytes(buf[offset : offset + 4]), 0, size
            del buf[: offset + 4]
            return True
        if len(buf) < offset + 4 + size:
            return False
        key = bytes(buf[offset : offset + 4])
        payload = unmask(bytes(buf[offset + 4 : offset + 4 + size]), key)
        del buf[: offset + 4 + size]
        self._control(opcode, payload)
        return True

    def _payload(self) -> bool:
        """Hand the MQTT connection what has arrived of the current data frame's payload."""
        assert self.framed is not None
        buf = self._buf
        take = min(len(buf), self._remaining)
        if not take:
            return False
        data = unmask(bytes(buf[:take]), self._key, self._phase)
        del buf[:take]
        self._remaining -= take
        self._phase += take
        if not self.framed.close_sent:
            self.inner.data_received(data)
        return True

    def _control(self, opcode: int, payload: bytes) -> None:
        assert self.framed is not None
        if opcode == CLOSE:  # the client's answer, or its own close: we answer
            error = close_frame_error(payload)
            if error is not None:
                self._fail(error)
            else:
                self.framed.close()
                self.framed.socket.close()
        elif opcode == PING:
            self.framed.socket.write(frame(PONG, payload))
        elif opcode != PONG:  # an unknown control opcode
            self._fail(PROTOCOL_ERROR)
