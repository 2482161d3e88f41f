"""SASL for the AMQP listener, written in Python (sans-IO).

Why not proton's SASL layer: without Cyrus SASL the proton *server* offers only ANONYMOUS and
EXTERNAL, and we need PLAIN against the gateway's users. So this class speaks the SASL
layer itself (protocol header, sasl-mechanisms, sasl-init, sasl-outcome) and then hands the
bytes that follow to a proton transport that has no SASL layer at all.

A client that skips SASL and sends the plain AMQP header goes straight to proton when
anonymous access is allowed; any other header (a TLS tunnel, another version, no AMQP at
all) gets the SASL header and a close (AMQP 1.0 §2.2).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from enum import Enum

from proton import UNDESCRIBED, Array, Data, Described, symbol, ubyte, ulong

SASL_HEADER = b"AMQP\x03\x01\x00\x00"
AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
TLS_PREFIX = b"AMQP\x02"  # protocol id 2: a TLS tunnel (amqps is TLS from the first byte)
SASL_FRAME = 1
MECHANISMS = 0x40
INIT = 0x41
CHALLENGE = 0x42
RESPONSE = 0x43
OUTCOME = 0x44
OK = 0
AUTH = 1
MAX_SASL_FRAME = 8192


class State(Enum):
    NEGOTIATING = 0
    DONE = 1  # hand `rest` to proton
    FAILED = 2  # write `output`, then close


class SaslServer:
    """Feed it the first bytes of a connection until `state` is DONE or FAILED."""

    def __init__(
        self, allow_anonymous: bool, login: Callable[[str, str], tuple[bool, str | None]]
    ) -> None:
        """`login(user, password)`: (accepted, as whom: None for anonymous), Settings.login."""
        self.allow_anonymous = allow_anonymous
        self.login = login
        self.state = State.NEGOTIATING
        self.user: str | None = None
        self.output = bytearray()
        self.rest = b""
        self._buf = bytearray()
        self._header_seen = False
        self._challenged = False  # a PLAIN init without its response: it must come next

    @property
    def mechanisms(self) -> list[str]:
        return ["PLAIN", "ANONYMOUS"] if self.allow_anonymous else ["PLAIN"]

    def feed(self, data: bytes) -> None:
        """Consume `data`; read `output` (bytes to send) and `state` afterwards."""
        if self.state is not State.NEGOTIATING:
            raise RuntimeError("SASL negotiation is over")
        self._buf += data
        if not self._header_seen:
            self._header()
        while self.state is State.NEGOTIATING and self._header_seen:
            frame = self._frame()
            if frame is None:
                return
            self._handle(frame)

    def _header(self) -> None:
        head = bytes(self._buf[:8])
        if SASL_HEADER.startswith(head) and len(head) < 8:
            return  # could still become the SASL header
        if head == SASL_HEADER:
            del self._buf[:8]
            self._header_seen = True
            self.output += SASL_HEADER + encode_frame(
                Described(ulong(MECHANISMS), [_symbols(self.mechanisms)])
            )
        elif AMQP_HEADER.startswith(head) and len(head) < 8:
            return
        elif head == AMQP_HEADER and self.allow_anonymous:
            self._finish()  # no SASL: proton takes it from the header on
        else:
            # a header it does not take (another protocol or version, TLS, SASL skipped
            # while required) or no AMQP at all (say, a TLS ClientHello): "speak SASL to
            # me", then close (AMQP 1.0 §2.2). Proton would answer with the plain AMQP
            # header, which may be refused too, or, at TLS, close without a word.
            self.output += SASL_HEADER
            self.state = State.FAILED

    def _frame(self) -> Described | None:
        body = b""
        while not body:  # empty (heartbeat) frames are skipped, however many come at once
            if len(self._buf) < 8:
                return None
            size, doff, kind = struct.unpack_from(">IBB", self._buf)
            if size < 8 or size > MAX_SASL_FRAME or doff < 2 or kind != SASL_FRAME:
                self._fail()
                return None
            if len(self._buf) < size:
                return None
            body = bytes(self._buf[doff * 4 : size])
            del self._buf[:size]
        data = Data()
        try:
            data.decode(body)
            data.rewind()
            data.next()
            obj = data.get_object()
        except Exception:
            obj = None
        if not isinstance(obj, Described) or not isinstance(obj.value, list):
            self._fail()
            return None
        # binaries decode as views into `data`'s buffer: copy them while it is alive
        return Described(obj.descriptor, [_owned(v) for v in obj.value])

    def _handle(self, frame: Described) -> None:
        if self._challenged:  # the PLAIN response the empty challenge asked for
            if frame.descriptor != RESPONSE or not frame.value:
                self._fail()
                return
            response = frame.value[0]
            self._plain_outcome(response if isinstance(response, bytes) else b"")
            return
        if frame.descriptor != INIT or not frame.value:
            self._fail()
            return
        mechanism = str(frame.value[0])
        response = frame.value[1] if len(frame.value) > 1 else None
        if mechanism == "PLAIN" and response is None:  # RFC 4616 §2: an empty challenge
            self._challenged = True
            self.output += encode_frame(Described(ulong(CHALLENGE), [b""]))
            return
        response = response if isinstance(response, bytes) else b""
        if mechanism == "ANONYMOUS" and self.allow_anonymous:
            self._succeed(None)
        elif mechanism == "PLAIN":
            self._plain_outcome(response)
        else:
            self._fail()

    def _plain_outcome(self, response: bytes) -> None:
        accepted, who = self._plain(response)
        if accepted:
            self._succeed(who)
        else:
            self._fail()

    def _plain(self, response: bytes) -> tuple[bool, str | None]:
        """Whether a PLAIN response (RFC 4616) logs in, and as whom (see login). Its fields are
        UTF-8 (a user name with bytes that are not was taken with replacement characters),
        and an authorization identity other than the user's own is refused: no user may
        act as another here."""
        parts = response.split(b"\x00")
        if len(parts) != 3:
            return False, None
        try:
            authzid, user, password = (part.decode() for part in parts)
        except UnicodeDecodeError:
            return False, None
        if authzid not in ("", user):
            return False, None
        return self.login(user, password)

    def _succeed(self, user: str | None) -> None:
        self.user = user
        self.output += encode_frame(Described(ulong(OUTCOME), [ubyte(OK)]))
        self._finish()

    def _finish(self) -> None:
        self.rest = bytes(self._buf)
        self._buf.clear()
        self.state = State.DONE

    def _fail(self) -> None:
        self.output += encode_frame(Described(ulong(OUTCOME), [ubyte(AUTH)]))
        self.state = State.FAILED


def _owned(value: object) -> object:
    return bytes(value) if isinstance(value, memoryview) else value


def _symbols(names: list[str]) -> Array:
    return Array(UNDESCRIBED, Data.SYMBOL, *(symbol(n) for n in names))


def encode_frame(body: Described, kind: int = SASL_FRAME) -> bytes:
    """One frame on channel 0: `kind` 1 a SASL frame, 0 an AMQP one."""
    data = Data()
    data.put_object(body)
    payload = bytes(data.encode())
    return struct.pack(">IBBH", 8 + len(payload), 2, kind, 0) + payload
