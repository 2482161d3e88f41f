"""asyncio glue for one MQTT TCP connection: bytes -> decoder -> session, session -> socket.

Output is gathered per event-loop turn and written once (one send per turn, not one per
packet: on uvloop each write is a syscall). Flow control lives here because it is about
sockets: reading pauses while the session is busy or the spool is behind (several reasons
may hold it at once) and while the peer's receive side is full. While it is, the session's
flows take no more queued messages; a peer that stops reading is cut off once
WRITE_BUFFER_CAP bytes (of direct QoS 0 messages, say) are queued for it, so a slow
subscriber cannot make the gateway's memory grow without bound, and by keep alive once it
has taken none of its output for a keep alive period (its pings wait unread behind the
paused input).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import sys
import termios
from typing import TYPE_CHECKING, cast

from protocols.mqtt.codec import MqttDecoder, MqttProtocolError
from protocols.mqtt.session import MAX_PACKET_SIZE, Session

if TYPE_CHECKING:
    from protocols.mqtt.listener import Registry

log = logging.getLogger(__name__)

WRITE_BUFFER_HIGH = 256 * 1024  # pause reading above this much unsent output
# drop the client when this much more is queued than when it stopped keeping up (a large
# message queued at once is no sign of a client that does not read)
WRITE_BUFFER_CAP = 8 * 1024 * 1024
CLOSE_GRACE = 1.0  # seconds a closing transport may take to flush before it is aborted


def _kernel_queued(transport: asyncio.Transport) -> int:
    """Bytes in the socket's send queue not yet acknowledged by the peer (Linux's
    TIOCOUTQ; 0 where it cannot be asked)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return int.from_bytes(raw, sys.byteorder)


class MqttConnection(asyncio.Protocol):
    """One client's socket; implements the session's `Link`."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.transport: asyncio.Transport | None = None
        self.decoder = MqttDecoder(MAX_PACKET_SIZE)
        self.session: Session | None = None
        self._paused: set[str] = set()
        self._dead = False
        self._out: list[bytes] | None = None  # this turn's output, written by _flush
        self._written = 0  # bytes handed to the transport so far
        self._cap = WRITE_BUFFER_CAP  # unsent output beyond which the client is dropped
        self._acked_seen = 0  # output the client's TCP acknowledged, when last asked

    @property
    def protocol_level(self) -> int | None:
        return self.decoder.protocol_level

    @property
    def input_paused(self) -> bool:
        return bool(self._paused)

    def output_moved(self) -> bool:
        """Whether the client may have sent something we have not read: reading is paused
        on our side (busy, spool), or the client took some of its output since the last
        call (its TCP acknowledged more). A client that neither reads nor is read from
        cannot show that it is alive."""
        if self._paused - {"writing"}:
            return True
        transport = self.transport
        if transport is None:
            return False
        acked = self._written - transport.get_write_buffer_size() - _kernel_queued(transport)
        moved, self._acked_seen = acked > self._acked_seen, acked
        return moved

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it
        if self.registry.closing:  # accepted, TLS or WebSocket handshake done, after close()
            self._dead = True
            transport.abort()
            return
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        self.session = Session(self.registry, self)
        self.registry.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._dead or self.session is None:
            return
        try:
            packets = self.decoder.feed(data)
        except MqttProtocolError as exc:
            self._dead = True
            self.session.receive(exc.packets, exc)
            return
        if packets:
            self.session.receive(packets)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._dead = True
        self.registry.connections.discard(self)
        if self.session is not None:
            self.session.connection_lost()

    # -- Link ------------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if self._out is None:
            self._out = [data]
            asyncio.get_running_loop().call_soon(self._flush)
        else:
            self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, None
        transport = self.transport
        if not out or transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size() > self._cap:
            log.warning(
                "MQTT client %r is not reading; disconnecting it",
                self.session.client_id if self.session else "?",
            )
            transport.abort()
            return
        data = b"".join(out)
        self._written += len(data)
        transport.write(data)

    def close(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._flush()  # e.g. a refusing CONNACK or a DISCONNECT goes out first
        transport.close()
        if transport.get_write_buffer_size():
            asyncio.get_running_loop().call_later(CLOSE_GRACE, transport.abort)

    def pause_input(self, reason: str) -> None:
        if not self._paused and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self._paused.add(reason)

    def resume_input(self, reason: str) -> None:
        if reason not in self._paused:
            return
        self._paused.discard(reason)
        if not self._paused and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    @property
    def writable(self) -> bool:
        return "writing" not in self._paused

    def pause_writing(self) -> None:
        """The socket's buffer passed its high-water mark: nothing more is read, and the
        session's flows take no more messages until it drains (else each would fill its
        window, up to MAX_WINDOW messages of any size, in the node's memory)."""
        self.pause_input("writing")
        if self.transport is not None:
            self._cap = self.transport.get_write_buffer_size() + WRITE_BUFFER_CAP
        if self.session is not None:
            self.session.writable_changed()

    def resume_writing(self) -> None:
        self._cap = WRITE_BUFFER_CAP
        self.resume_input("writing")
        if self.session is not None:
            self.session.writable_changed()
