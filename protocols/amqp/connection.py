"""One AMQP 1.0 client connection: an asyncio.Protocol driving proton's engine.

Bytes in: the Python SASL layer first (`sasl.SaslServer`), then `transport.push` in pieces
no larger than `capacity()`. Events come out of the collector and go to the session / link
handlers; bytes out with `pending` / `peek` / `pop`. `tick` is scheduled with call_later so
proton sends heartbeats and enforces the idle timeout. No reactor, no thread.

Work that waits for Redis (attach checks, publish outcomes, deliveries) comes back through
`wake()`, which processes the engine and writes output once per event-loop turn. When the
socket goes, every link's broker state is released and the proton objects are freed;
`closed` tells late callbacks not to touch them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, cast

from cproton import (
    PN_CONNECTION_REMOTE_CLOSE,
    PN_CONNECTION_REMOTE_OPEN,
    PN_DELIVERY,
    PN_LINK_FLOW,
    PN_LINK_REMOTE_CLOSE,
    PN_LINK_REMOTE_DETACH,
    PN_LINK_REMOTE_OPEN,
    PN_SESSION_REMOTE_CLOSE,
    PN_SESSION_REMOTE_OPEN,
    PN_TRANSPORT_ERROR,
    PN_TRANSPORT_TAIL_CLOSED,
    pn_collector_peek,
    pn_collector_pop,
    pn_delivery_link,
    pn_event_delivery,
    pn_event_link,
    pn_event_type,
    pn_transport_capacity,
    pn_transport_pending,
    pn_transport_pop,
    pn_transport_tick,
)
from cproton_ffi import ffi, lib
from proton import (
    Collector,
    Condition,
    Connection,
    Described,
    Endpoint,
    Event,
    Link,
    SymbolList,
    Transport,
    symbol,
    ulong,
)

from gateway.acl import NO_DENIALS, topic_access
from gateway.broker import ANONYMOUS, QueueError, StoreError
from gateway.model import Publisher
from protocols.amqp.links import RESOURCE_LIMIT, Inbound
from protocols.amqp.links import Endpoint as LinkEndpoint
from protocols.amqp.nodes import DynamicNodes
from protocols.amqp.outbound import Outbound
from protocols.amqp.sasl import SaslServer, State, encode_frame
from protocols.amqp.terminus import InvalidField

if TYPE_CHECKING:
    from protocols.amqp.listener import Registry

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 60.0  # seconds of silence from the client before proton closes the connection
CLOSE_GRACE = 1.0
HANDSHAKE_TIMEOUT = 10.0  # seconds a new socket has for the protocol headers, SASL and open
# Links a connection may hold at once (Solace's default max egress and ingress flows of a
# client are 1,000 each): each consuming link is a flow in Redis, each publishing one
# has 500 publishes in flight
MAX_LINKS = 1000
AMQP_FRAME, CLOSE, ERROR = 0, 0x18, 0x1D  # frame type, close and error descriptors
_connection_ids = itertools.count(1)
_HANDLED = frozenset(
    {
        PN_LINK_REMOTE_OPEN,
        PN_LINK_REMOTE_CLOSE,
        PN_LINK_REMOTE_DETACH,
        PN_SESSION_REMOTE_OPEN,
        PN_SESSION_REMOTE_CLOSE,
        PN_CONNECTION_REMOTE_OPEN,
        PN_CONNECTION_REMOTE_CLOSE,
        PN_TRANSPORT_ERROR,
        PN_TRANSPORT_TAIL_CLOSED,
    }
)  # events `_dispatch` acts on (through proton's Event wrapper: rare)


class AmqpConnection(asyncio.Protocol):
    """One client socket; implements `links.Host`."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.broker = registry.broker
        settings = registry.settings
        self.sasl = SaslServer(settings.allow_anonymous, settings.login)
        self.publisher = Publisher("amqp")
        self.connection_id = f"{self.broker.node_id}/amqp/{next(_connection_ids)}"
        self.nodes = DynamicNodes(self.broker, ANONYMOUS, self.connection_id)
        self.topics = NO_DENIALS  # the topic ACL's, once SASL said who the client is
        self.closed = False
        self.socket: asyncio.Transport | None = None
        self.conn = Connection()
        self.conn.container = f"gateway-{self.broker.node_id}"
        self.collector = Collector()
        self.conn.collect(self.collector)
        self.transport = Transport(Transport.SERVER)
        self.transport.idle_timeout = IDLE_TIMEOUT
        self.transport.bind(self.conn)
        self._timpl = self.transport._impl
        self._cimpl = self.collector._impl
        self.endpoints: dict[Any, LinkEndpoint] = {}  # by C link (cffi pointers hash by address)
        self._input = b""  # what proton had no room for yet
        self._loop = asyncio.get_running_loop()  # protocols are made by the running loop
        self._woken = False
        self._tick: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._shutdown: asyncio.TimerHandle | None = None  # the abort after CLOSE_GRACE
        self._handshake: asyncio.TimerHandle | None = None
        self._detaching: dict[str, asyncio.Future[None]] = {}  # link name -> its close
        self._write_watchers: set[Outbound] = set()  # see watch_writes
        self.writable = True  # see pause_writing
        self.partial_bytes = 0  # see links.PARTIAL_BYTES_MAX

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.socket = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if self.registry.closing:  # accepted, or its TLS handshake done, after close()
            transport.abort()
            return
        self.registry.connections.add(self)
        # proton's idle timeout runs only once it has input: until SASL is done, this does
        self._handshake = self._loop.call_later(HANDSHAKE_TIMEOUT, self._handshake_expired)

    def data_received(self, data: bytes) -> None:
        if self.closed or self._shutdown is not None:
            return  # closing: what the client still sends is drained unread
        if self.sasl.state is not State.DONE:
            self.sasl.feed(data)
            self._write(bytes(self.sasl.output))
            self.sasl.output.clear()
            if self.sasl.state is State.FAILED:
                self._close_socket()
                return
            if self.sasl.state is State.NEGOTIATING:
                return
            self.publisher.user = self.sasl.user
            self.nodes.user = self.user
            self.topics = topic_access(self.registry.settings.acl, self.user)
            data = self.sasl.rest
        self._input = self._input + data if self._input else data
        self._pump()

    def pause_writing(self) -> None:
        """The socket's buffer passed its high-water mark (the client reads slowly, or not
        at all): its links take no more messages until it drains. Else a link's whole
        credit of them (up to the queue's per-flow limit) would wait in this node's memory,
        kept from every other consumer."""
        self._set_writable(False)

    def resume_writing(self) -> None:
        self._set_writable(True)

    def _set_writable(self, writable: bool) -> None:
        self.writable = writable
        for endpoint in self.endpoints.values():
            endpoint.set_writable(writable)

    def eof_received(self) -> bool:
        if not self.closed and self.sasl.state is State.DONE:
            self.transport.close_tail()
            self._pump()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.registry.connections.discard(self)
        if self.closed:
            return
        self.closed = True
        for timer in (self._tick, self._shutdown, self._handshake):
            if timer is not None:
                timer.cancel()
        for endpoint in self.endpoints.values():
            self.spawn(endpoint.close())
        self.endpoints.clear()
        self.spawn(self.nodes.delete_all())  # the dynamic nodes its links left behind
        self.transport.unbind()
        self.conn.free()
        self.collector.release()

    # -- links.Host --------------------------------------------------------------------------

    @property
    def user(self) -> str:
        """Who the client is to queue permissions: its SASL user, or ANONYMOUS (not the
        operator, so anonymous clients get only what queues grant everyone)."""
        return self.publisher.user or ANONYMOUS

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self.registry.spawn(coro)

    def watch_writes(self, endpoint: Outbound) -> None:
        self._write_watchers.add(endpoint)

    def wake(self) -> None:
        """Process engine events and write output at the end of this loop turn."""
        if not self._woken and not self.closed:
            self._woken = True
            self._loop.call_soon(self._wake)

    def _wake(self) -> None:
        self._woken = False
        if not self.closed:
            self._pump()

    # -- the engine ------------------------------------------------------------------------

    def _pump(self) -> None:
        """Push buffered input, dispatch events, write output, schedule the next tick."""
        while True:
            while self._input:
                data = self._input
                taken = lib.pn_transport_push(self._timpl, data, len(data))  # up to capacity
                if taken < 0:  # input side closed: the rest is ignored
                    self._input = b""
                    break
                self._input = data[taken:] if taken < len(data) else b""
                self._events()
                if not taken:
                    break
            self._events()
            if self.closed or not self._flush() or not self._input:
                break
            if pn_transport_capacity(self._timpl) <= 0:
                break
        if not self.closed:
            self._schedule_tick()

    def _events(self) -> None:
        """Dispatch collected events with cffi calls. DELIVERY (one per message) and
        LINK_FLOW go straight to their link's endpoint, events nobody handles are dropped
        unread: proton's Event object wraps five engine objects per event."""
        impl, endpoints = self._cimpl, self.endpoints
        while not self.closed:
            event = pn_collector_peek(impl)
            if event == ffi.NULL:
                return
            kind = pn_event_type(event)
            try:
                if kind == PN_DELIVERY:
                    dlv = pn_event_delivery(event)
                    endpoint = endpoints.get(pn_delivery_link(dlv))
                    if endpoint is not None:
                        if not endpoint.closed:
                            endpoint.on_delivery(dlv)
                        else:  # sent on after we closed the link: proton would keep it
                            endpoint.discard(dlv)
                elif kind == PN_LINK_FLOW:
                    endpoint = endpoints.get(pn_event_link(event))
                    if endpoint is not None and not endpoint.closed:
                        endpoint.on_flow()
                elif kind in _HANDLED:
                    self._dispatch(Event.wrap(event))
            except UnicodeDecodeError:  # proton passes a frame's strings on unchecked
                self._undecodable("a string of a frame is not valid UTF-8")
            except Exception:
                log.exception("AMQP event %s failed", kind)
            pn_collector_pop(impl)

    def _flush(self) -> bool:
        """Write what proton produced; False once the output side is closed."""
        impl = self._timpl
        while True:
            pending = pn_transport_pending(impl)
            if pending < 0:
                self._close_socket()
                return False
            if pending == 0:
                if self._write_watchers:
                    self._write_watchers = {e for e in self._write_watchers if e.written()}
                return True
            buffer = ffi.new("char[]", pending)
            lib.pn_transport_peek(impl, buffer, pending)
            self._write(ffi.unpack(buffer, pending))
            pn_transport_pop(impl, pending)

    def _write(self, data: bytes) -> None:
        """Nothing once the socket is shut for writing (`_close_socket`)."""
        socket = self.socket
        if data and self._shutdown is None and socket is not None and not socket.is_closing():
            socket.write(data)

    def _close_socket(self) -> None:
        """Close the socket after what was written. Where it can, only the sending side is
        shut and the client's bytes are read on until it closes (or CLOSE_GRACE passes):
        closing with unread input makes the kernel reset the connection, and the reset can
        overtake the close frame that says why. The links' flows are released when the
        socket closes (connection_lost): for a client that does not close, CLOSE_GRACE
        later."""
        socket = self.socket
        if socket is None or socket.is_closing() or self._shutdown is not None:
            return
        if socket.can_write_eof():
            socket.write_eof()
        else:
            socket.close()
        self._shutdown = self._loop.call_later(CLOSE_GRACE, socket.abort)

    def _handshake_expired(self) -> None:
        self._handshake = None
        if self.closed:
            return
        # proton's idle timeout starts with the AMQP layer: a client silent after SASL (no
        # AMQP header, or no open) would otherwise hold its socket for ever
        if self.sasl.state is State.NEGOTIATING or self.conn.state & Endpoint.REMOTE_UNINIT:
            log.info("AMQP client did not finish the protocol header, SASL and open in time")
            self._close_socket()

    def _schedule_tick(self) -> None:
        loop = self._loop
        deadline = pn_transport_tick(self._timpl, int(loop.time() * 1000))  # ms
        if deadline == self._deadline and self._tick is not None:
            return
        if self._tick is not None:
            self._tick.cancel()
        self._deadline = deadline
        self._tick = loop.call_at(deadline / 1000, self._on_tick) if deadline else None

    def _on_tick(self) -> None:
        """Proton's deadline: the tick makes the heartbeat frame (or the idle-timeout close),
        and this pump writes it now, not at the next tick."""
        self._tick = None
        if not self.closed:
            pn_transport_tick(self._timpl, int(self._loop.time() * 1000))
            self._pump()

    def close(self, condition: Condition | None = None) -> None:
        """Server-side close (listener shutdown): a proper AMQP close, then the socket."""
        if self.closed:
            return
        if self.sasl.state is not State.DONE:
            self._close_socket()
            return
        self.conn.condition = condition
        self.conn.close()
        self._pump()

    # -- events ----------------------------------------------------------------------------

    def _dispatch(self, event: Event) -> None:
        kind = event.type
        if kind == Event.LINK_REMOTE_OPEN:
            self._attach(event.link)
        elif kind == Event.LINK_REMOTE_CLOSE:
            self._detach(event.link, ended=True)
        elif kind == Event.LINK_REMOTE_DETACH:
            self._detach(event.link, suspended=True)
        elif kind == Event.SESSION_REMOTE_OPEN:
            if self.conn.state & Endpoint.REMOTE_UNINIT:  # §2.4.1: the open comes first
                self._close_with("amqp:not-allowed", "a begin before the connection's open")
                return
            event.session.open()
        elif kind == Event.SESSION_REMOTE_CLOSE:
            session = event.session
            for endpoint in list(self.endpoints.values()):
                if endpoint.link.session == session:
                    self._detach(endpoint.link)
            self.spawn(self.nodes.end_session(session))
            session.close()
            session.free()  # else proton keeps each ended session while the connection lasts
        elif kind == Event.CONNECTION_REMOTE_OPEN:
            self.publisher.client_id = self.conn.remote_container or ""
            # DELAYED_DELIVERY: messages with x-opt-delivery-time are held (Qpid JMS's
            # setDeliveryDelay needs it offered); SHARED-SUBS: JMS 2.0 shared subscriptions
            # (Qpid JMS refuses to create one from a peer that does not offer it)
            self.conn.offered_capabilities = SymbolList(
                ["ANONYMOUS-RELAY", "DELAYED_DELIVERY", "SHARED-SUBS"]
            )
            self.conn.open()
        elif kind == Event.CONNECTION_REMOTE_CLOSE:
            for endpoint in list(self.endpoints.values()):
                self._detach(endpoint.link)
            self.conn.close()
        elif kind == Event.TRANSPORT_ERROR:
            cond = self.transport.condition
            log.info("AMQP connection error: %s", cond.description if cond else "?")
        elif kind == Event.TRANSPORT_TAIL_CLOSED:
            self._tail_closed()

    def _tail_closed(self) -> None:
        """Proton stops reading, without a word, at a frame it cannot decode (a body that is
        not a described list, an unknown performative or frame type): answer with a close
        carrying amqp:decode-error, not a connection left open and deaf. Its other reasons
        (the client's close or EOF, a protocol error) have a close of their own."""
        if self.transport.condition is None and not self.conn.state & Endpoint.REMOTE_CLOSED:
            self._undecodable("a frame could not be decoded")

    def _undecodable(self, why: str) -> None:
        """Close the connection with amqp:decode-error (once: later events may fail too)."""
        self._close_with("amqp:decode-error", why)

    def _close_with(self, condition: str, why: str) -> None:
        """Close the connection with this error, once. Before the client's open proton
        writes our open but never the close (it waits for the open that will not come):
        the close is written here, and the socket shut."""
        if not self.conn.state & Endpoint.LOCAL_CLOSED:
            log.info("AMQP connection error: %s", why)
            self.conn.condition = Condition(condition, why)
            self.conn.close()
            if self.conn.state & Endpoint.REMOTE_UNINIT:
                self._flush()  # our open
                self._write(_close_frame(self.conn.condition))
                self._close_socket()

    def _attach(self, link: Link) -> None:
        endpoint: LinkEndpoint = Inbound(self, link) if link.is_receiver else Outbound(self, link)
        self.endpoints[link._impl] = endpoint
        if len(self.endpoints) > MAX_LINKS:  # each a consumer in Redis, or 500 publishes
            endpoint.refuse(RESOURCE_LIMIT, f"a connection has at most {MAX_LINKS} links")
            return
        endpoint.attach_over = self._loop.create_future()
        # the link of this name before it, still closing, now: a detach of this one, read
        # before its attach runs, puts its own there
        earlier = self._detaching.get(link.name)
        self.spawn(self._run_attach(endpoint, earlier))

    async def _run_attach(
        self, endpoint: Inbound | Outbound, earlier: asyncio.Future[None] | None
    ) -> None:
        try:
            await self._serve_attach(endpoint, earlier)
        finally:
            over = endpoint.attach_over
            if over is not None and not over.done():
                over.set_result(None)

    async def _serve_attach(
        self, endpoint: Inbound | Outbound, earlier: asyncio.Future[None] | None
    ) -> None:
        if earlier is not None:  # the link of this name before it is still closing: so
            await asyncio.shield(earlier)  # that one of this name after it waits for both
        if endpoint.closed:  # detached before its attach ran (answered then): nothing to do
            return
        try:
            link = endpoint.link
            if link.name is None:
                raise InvalidField("an attach must name its link")
            # §2.8.2 / §2.8.3: sender-settle-mode 0-2, receiver-settle-mode 0-1 (echoed back
            # unchecked, they made an attach no client could read)
            if link.remote_snd_settle_mode > 2 or link.remote_rcv_settle_mode > 1:
                raise InvalidField("an attach's settle modes are out of range")
            await endpoint.attach()
        except (QueueError, InvalidField) as exc:  # e.g. an invalid topic pattern, a bad filter
            endpoint.refuse("amqp:invalid-field", str(exc))
        except UnicodeDecodeError:  # proton passes the attach's strings on unchecked
            endpoint.refuse("amqp:decode-error", "a string of the attach is not valid UTF-8")
        except StoreError as exc:  # e.g. Redis refuses writes for now: the client tries later
            log.warning("AMQP attach failed: %s", exc)
            endpoint.refuse("amqp:internal-error", str(exc))
        except Exception as exc:
            log.exception("AMQP attach failed")
            endpoint.refuse("amqp:internal-error", str(exc))
        if not endpoint.live:
            await endpoint.close()

    def _detach(self, link: Link, ended: bool = False, suspended: bool = False) -> None:
        """The client detached the link (`ended`: closed it, so its durable state goes too;
        `suspended`: detached only it, to resume it maybe); session and connection ends only
        detach. Answered in kind, then the link is freed at once: proton would hand a
        detached (not closed) link object to a re-attach of the same name, and churn would
        leak."""
        endpoint = self.endpoints.pop(link._impl, None)
        if endpoint is None:
            return  # released already: its session or connection ended first
        endpoint.closed = True  # from now on nothing may be sent on it
        endpoint.detached()
        if suspended:
            endpoint.suspend()
        name = link.name
        if link.state & Endpoint.LOCAL_UNINIT:  # its attach not answered yet (proton would
            endpoint.open_unattached()  # answer neither a detach of it nor the attach)
        if not link.state & Endpoint.LOCAL_CLOSED:
            if ended:
                link.close()
            else:
                link.detach()
        link.free()
        closed = self._loop.create_future()
        self._detaching[name] = closed
        self.spawn(self._close_endpoint(endpoint, ended, name, closed))

    async def _close_endpoint(
        self, endpoint: LinkEndpoint, ended: bool, name: str, closed: asyncio.Future[None]
    ) -> None:
        """Release what a detached link held; an attach of its name waits for this (a
        durable subscription's next link must not find the old one's flow still bound, nor
        that of an attach of the old one still being served when the client detached it)."""
        try:
            if endpoint.attach_over is not None:
                await endpoint.attach_over
            await endpoint.close(ended)
        finally:
            closed.set_result(None)
            if self._detaching.get(name) is closed:
                del self._detaching[name]


def _close_frame(condition: Condition) -> bytes:
    """A close performative (§2.7.9) carrying `condition`."""
    error = Described(ulong(ERROR), [symbol(condition.name), condition.description])
    return encode_frame(Described(ulong(CLOSE), [error]), AMQP_FRAME)
