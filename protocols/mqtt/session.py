"""MQTT semantics of one client connection, between the codec and the broker.

A `Session` receives decoded packets in order and answers through a `Link` (the asyncio
connection). Packets are handled one at a time: PUBLISH and the acks are handled on the spot,
while CONNECT, SUBSCRIBE, UNSUBSCRIBE, QoS 2 PUBLISH and PUBREL await Redis, and later
packets wait in a backlog (input paused) so that e.g. a PUBLISH after a SUBSCRIBE is routed
to the new subscription and a QoS 2 id is recorded before the next packet reuses it.

What outlives the connection is `SessionState` (state.py), saved in Redis by the node's
`Registry` (listener.py) whenever it changes. QoS 1/2 subscriptions feed one queue per
client (durable for persistent sessions, temporary otherwise), so a message that matches
several of them is delivered once at the highest granted QoS; QoS 0 subscriptions are
direct (not spooled). A shared subscription `$share/<group>/<filter>` binds one more flow,
on the group's durable non-exclusive queue, so the group's members split its messages.
Retained messages go out after the SUBACK, as retain handling asks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from gateway.acl import NO_DENIALS, topic_access
from gateway.broker import (
    ANONYMOUS,
    QUEUE_DELETED,
    BindError,
    Flow,
    Outcome,
    QueueError,
    StoreError,
)
from gateway.config import Settings
from gateway.model import Delivery, Message, Publisher, new_message_id
from gateway.topics import (
    MQTT,
    TopicError,
    parse_pattern,
    pattern_matches,
    reaches_temporary_topics,
)
from protocols.mqtt import mapping
from protocols.mqtt.codec import (
    Connack,
    Connect,
    Disconnect,
    MqttProtocolError,
    Packet,
    Pingreq,
    Pingresp,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    ReasonCode,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
    encode,
    encode_puback,
)
from protocols.mqtt.state import SessionState, shared_filter, shared_queue_name

if TYPE_CHECKING:
    from protocols.mqtt.listener import Registry

log = logging.getLogger(__name__)

NEVER_EXPIRES = 0xFFFFFFFF
MAX_PACKET_SIZE = 2 * 1024 * 1024  # announced to v5 clients, enforced by the decoder
SERVER_RECEIVE_MAXIMUM = 256  # inbound QoS 1/2 publishes a v5 client may have unacked
TOPIC_ALIAS_MAXIMUM = 64
MAX_KEEP_ALIVE = 3600  # v5 clients asking for more are told this (server keep alive)
CONNECT_TIMEOUT = 10.0
# Outbound unacked QoS 1/2 messages for v3/v4 clients (they announce no receive maximum):
# enough to keep a subscriber busy while acks and the next reads cross Redis.
DEFAULT_WINDOW = 256
MAX_WINDOW = 1024  # cap on a v5 client's receive maximum, to bound memory per client
# resend_ids key of a message in flight when the connection ended that was stored in the
# session's queue for the next one (by message id: its entry id is new)
RESENT_BY_ID = "id:"
MAX_RESEND_IDS = 4096  # packet ids kept from earlier connections, at most
MAX_PENDING_PUBLISHES = 1024  # publishes awaiting the spool before input is paused
# Window of a flow on a shared group's queue: the engine fills a flow's window from what is
# spooled, so a small one spreads a burst over the group's members instead of one taking all.
SHARED_WINDOW = 8
MAX_CACHED_ROUTES = 4096  # topics whose delivery options a session keeps (see _deliver)
MAX_SENT_DIRECT = 4096  # ids of messages sent direct while a filter changed QoS (_on_direct)
# What waits for a client's receive maximum beyond its queue's window: retained messages a
# SUBSCRIBE sends (each SUBSCRIBE sends them again) and QoS 0 messages held behind one of
# their topic. Beyond this many they are dropped, as Mosquitto's max_queued_messages (1000)
# drops: a client that acks nothing grew them without bound.
MAX_WAITING = 1000
SAVE_RETRY_S = 1.0  # a failed save of PUBREL ids is tried again after this
# Topic filters one session may hold: each costs about 1.5 KB here and its share of the state
# saved in Redis, and one 2 MiB SUBSCRIBE can carry 150 000 of them.
MAX_SUBSCRIPTIONS = 10_000
_connection_ids = itertools.count(1)

# Refused spool outcomes -> MQTT 5 PUBACK/PUBREC reason codes. PUBACK cannot carry 0x95
# (packet too large is not in its table, MQTT 5 §3.4.2.1), so TOO_LARGE is a quota refusal.
_REFUSAL_CODES = {
    Outcome.QUOTA_EXCEEDED: ReasonCode.QUOTA_EXCEEDED,
    Outcome.QUEUE_FULL: ReasonCode.QUOTA_EXCEEDED,
    Outcome.TOO_LARGE: ReasonCode.QUOTA_EXCEEDED,
    Outcome.OUT_OF_MEMORY: ReasonCode.QUOTA_EXCEEDED,
    Outcome.INGRESS_DISABLED: ReasonCode.UNSPECIFIED_ERROR,
    Outcome.NOT_FOUND: ReasonCode.UNSPECIFIED_ERROR,
}
# Failure reason codes a CONNACK may carry (MQTT 5 §3.2.2.2).
_CONNACK_CODES = frozenset({
    0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90, 0x95,
    0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F
})  # fmt: skip
# Reason codes a server may put in DISCONNECT; others become protocol errors.
_DISCONNECT_CODES = frozenset({
    0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x90, 0x93, 0x94, 0x95, 0x97,
    0x98, 0x99, 0x9A, 0x9B
})  # fmt: skip


class Link(Protocol):
    """What a session needs from its connection."""

    protocol_level: int | None  # fixed by the decoder from the CONNECT header
    input_paused: bool
    writable: bool  # False while the socket's buffer is past its high-water mark

    def send(self, data: bytes) -> None: ...
    def close(self) -> None: ...
    def pause_input(self, reason: str) -> None: ...
    def resume_input(self, reason: str) -> None: ...
    def output_moved(self) -> bool: ...


def _valid_filter(pattern: str) -> bool:
    """A topic filter MQTT allows, shared ones (`$share/group/filter`) included."""
    shared = shared_filter(pattern)
    if shared is not None and (not shared[0] or any(c in shared[0] for c in "+#")):
        return False
    try:
        parse_pattern(pattern if shared is None else shared[1], MQTT)
    except TopicError:
        return False
    return True


def _bad_response_topic(response_topic: str | None) -> bool:
    """A Response Topic is a topic name: MQTT 5 §3.3.2.3.5 forbids wildcards in it (a reply
    published to it would be refused), and a topic name has a character at least."""
    return response_topic is not None and not mapping.is_topic_name(response_topic)


# CONNACK properties left out, in this order, for a client whose maximum packet size is
# smaller than the CONNACK: first those that say what their absence says, then limits
_CONNACK_OPTIONAL = (
    "retain_available",
    "wildcard_subscription_available",
    "subscription_identifier_available",
    "shared_subscription_available",
    "topic_alias_maximum",
    "maximum_packet_size",
    "receive_maximum",
)

_DECIDED = object()  # an `_Ack` answered on arrival, with its own reason code


class _Ack:
    """One inbound QoS 1/2 PUBLISH awaiting its PUBACK / PUBREC. The spooler calls it with
    the outcome (or the exception that kept the message from Redis): a plain call, no future
    or loop handle per message."""

    __slots__ = ("outcome", "pid", "qos", "rc", "session")

    def __init__(self, session: Session, qos: int, pid: int, rc: int, outcome: object) -> None:
        self.session = session
        self.qos = qos
        self.pid = pid
        self.rc = rc
        self.outcome: object = outcome  # None while spooling

    def __call__(self, outcome: Outcome | BaseException) -> None:
        self.outcome = outcome
        session = self.session
        if self.qos == 1:
            session._spooled()
        session._ack_resolved()

    def from_future(self, fut: asyncio.Future[Outcome]) -> None:
        if fut.cancelled():
            self.outcome = asyncio.CancelledError()
        else:
            self.outcome = fut.exception() or fut.result()
        self.session._ack_resolved()


class Session:
    """One connection's MQTT state machine; see the module docstring."""

    def __init__(self, registry: Registry, link: Link) -> None:
        self.registry = registry
        self.broker = registry.broker
        self.settings: Settings = registry.settings
        self.link = link
        self.loop = asyncio.get_running_loop()
        self.level = 4
        self.client_id = ""
        self.user: str | None = None
        self.connection_id = f"{self.broker.node_id}/mqtt/{next(_connection_ids)}"
        self.will: Will | None = None
        self.state: SessionState | None = None
        self.connected = False
        self.closing = False
        self.taken_over = False  # another connection holds the client id now
        # taken over from another node: whether that connection started afresh (it ends
        # the session) or resumed it (a delayed will is then not sent)
        self.successor_ends: bool | None = None
        self.claim: int | None = None  # from broker.claim_client, while attached
        self.detached: asyncio.Future[None] = self.loop.create_future()
        self._connect_seen = False
        self._backlog: deque[Packet | MqttProtocolError] = deque()
        self._busy: asyncio.Task | None = None
        self._acks: deque[_Ack] = deque()  # inbound QoS 1/2 publishes, in arrival order
        self._unresolved = 0  # of them, those still waiting for the spool
        self._resolved: asyncio.Future[None] | None = None  # set when that reaches 0
        self._qos1_in = 0
        self._storing: dict[int, asyncio.Future[Outcome]] = {}  # QoS 2 ids being stored
        self._spooling = 0
        self._publisher: Publisher | None = None  # shared by this session's messages
        # packet id -> (queue, entry id, qos); queue None: not from a queue (retained)
        self._inflight: dict[int, tuple[str | None, str | None, int]] = {}
        # retained QoS 1/2 messages for new subscriptions: in flight, and waiting for room
        # in the client's receive maximum (message, qos, subscription ids)
        self._retained_out = 0
        self._retained_waiting: deque[tuple[Message, int, list[int]]] = deque()
        self._drained: asyncio.Future[None] | None = None  # retained ones wait for the socket
        # packet id -> a message in flight that no queue of the session keeps for a resend,
        # and its subscription ids: a retained one, or a shared group's QoS 2 one (only this
        # client may get it, §4.8.2)
        self._kept: dict[int, tuple[Message, list[int]]] = {}
        # QoS 2 deliveries PUBRECed, settled in their queue once the session state holding
        # their PUBREL ids is stored (a crash between the two lost the message)
        self._settle_when_saved: list[tuple[str | None, str | None]] = []
        self._saving: set[tuple[str | None, str | None]] = set()  # theirs, in a save under way
        # packet id -> message id of one in flight whose route the session state notes
        # (resend_retained, resend_shared): forgotten once acknowledged
        self._routed: dict[int, str] = {}
        # queued QoS 1/2 deliveries waiting for room in the client's receive maximum, which
        # holds across the session's flows (its queue, its shared groups): each flow's own
        # window alone would let them exceed it together
        self._held_out: deque[tuple[Any, ...]] = deque()
        # while a SUBSCRIBE is handled: routed deliveries (_send_or_hold's arguments) on
        # topics of the filters it sends retained messages for wait here, for those to go
        # first (MQTT-4.6.0-6)
        self._gate: list[tuple[Any, ...]] | None = None
        self._gate_filters: list[str] = []
        self._next_pid = 1
        self._reserved: set[int] = set()  # packet ids kept for resends (state.resend_ids)
        # shared groups' QoS 1 messages this session sent and has no PUBACK for (on this
        # connection or, from state.shared_in_flight, an earlier one): one that comes back
        # from its group is a re-delivery (DUP)
        self._sent_before: dict[tuple[str, str], None] = {}
        self._aliases: dict[int, str] = {}
        self._flows: dict[str, Flow] = {}  # queue -> this session's flow on it
        self._shared: dict[str, str] = {}  # shared queue -> its `$share/...` filter
        self._window = DEFAULT_WINDOW
        self._direct: dict[str, int] = {}
        # (topic, direct, own message) -> `_route` result, for `_routes_of` at its version
        self._routes: dict[tuple[str, bool, bool], tuple[int, bool, list[int]] | None] = {}
        self._routes_of: SessionState | None = None
        self._routes_version = 0
        self._last_direct = ""
        # QoS 0 messages of a resumed session's filters that came before its CONNACK went
        self._early_direct: collections.deque[Message] = collections.deque(maxlen=MAX_WAITING)
        # while a filter moves between the direct and the queued route (it has both), the
        # ids of messages sent direct, so their queued copies are not sent again
        self._both_routes = 0
        # new QoS 1/2 filters whose queue route is being added (see _subscribe)
        self._queuing: set[str] = set()
        self._sent_direct: dict[str, None] = {}
        self.topics = NO_DENIALS  # the topic ACL's denials for its user, once it logged in
        self._max_out: int | None = None
        self._out_alias_max = 0  # topic aliases the client accepts from us
        self._out_aliases: dict[str, int] = {}
        self._keep_alive = 0.0
        self._last_rx = self.loop.time()
        self._timer: asyncio.TimerHandle | None = self.loop.call_later(
            CONNECT_TIMEOUT, self._connect_timeout
        )

    # -- input -----------------------------------------------------------------------------

    def receive(self, packets: list[Packet], error: MqttProtocolError | None = None) -> None:
        """Decoded packets (and the decoder's error, if any) in arrival order."""
        if self.closing:
            return
        self._last_rx = self.loop.time()
        self._backlog.extend(packets)
        if error is not None:
            self._backlog.append(error)
        self._drain()

    def _drain(self) -> None:
        while self._busy is None and self._backlog and not self.closing:
            item = self._backlog.popleft()
            try:
                coro = self._dispatch(item)
            except Exception:
                log.exception("MQTT client %r: handling %s failed", self.client_id, item)
                self.fail(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)
                return
            if coro is not None:
                self._busy = self.loop.create_task(coro)
                self._busy.add_done_callback(self._busy_done)
                self.link.pause_input("busy")

    def _busy_done(self, task: asyncio.Task) -> None:
        self._busy = None
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, StoreError):  # Redis down or refusing writes: not a bug
            log.warning("MQTT client %r: request failed, Redis: %s", self.client_id, exc)
            self.fail(ReasonCode.UNSPECIFIED_ERROR)
        elif exc is not None:
            log.error("MQTT client %r: request failed", self.client_id, exc_info=exc)
            self.fail(ReasonCode.UNSPECIFIED_ERROR)
        self.link.resume_input("busy")
        self._drain()

    def _dispatch(self, item: Packet | MqttProtocolError) -> Coroutine[Any, Any, None] | None:
        handler = _HANDLERS.get(item.__class__)  # one lookup: two packets a QoS 1 message
        if handler is not None and self._connect_seen:
            return handler(self, item)
        if isinstance(item, MqttProtocolError):
            self._protocol_error(item)
            return None
        if not self._connect_seen:
            self._connect_seen = True
            assert isinstance(item, Connect)  # the decoder lets nothing else come first
            return self._on_connect(item)
        # a second CONNECT, AUTH, or a packet only servers send
        log.info("MQTT client %r sent unexpected %s", self.client_id, type(item).__name__)
        self.fail(ReasonCode.PROTOCOL_ERROR)
        return None

    def _on_pingreq(self, _: Pingreq) -> None:
        self._send(Pingresp())

    def _protocol_error(self, exc: MqttProtocolError) -> None:
        log.info("MQTT client %r: %s", self.client_id, exc)
        if self._connect_seen:
            self.fail(exc.reason_code)
            return
        # the CONNECT itself was bad: answer with a CONNACK where the spec asks for one
        self._connect_seen = True
        level = self.link.protocol_level
        rc = exc.reason_code
        if level is None and rc == ReasonCode.UNSUPPORTED_PROTOCOL_VERSION:
            self.level = 4  # the v3/v4 CONNACK every client version can read
            self._refuse_connect(rc)
        elif level == 5 or (level is not None and rc == ReasonCode.CLIENT_IDENTIFIER_NOT_VALID):
            self.level = level
            self._refuse_connect(rc if rc in _CONNACK_CODES else ReasonCode.MALFORMED_PACKET)
        else:
            self.close()

    # -- CONNECT ---------------------------------------------------------------------------

    async def _on_connect(self, p: Connect) -> None:
        if self._timer is not None:  # it came: taking a session over may wait a while
            self._timer.cancel()
            self._timer = None
        self.level = p.protocol_level
        props = p.properties or Properties()
        if props.authentication_method is not None:
            self._refuse_connect(ReasonCode.BAD_AUTHENTICATION_METHOD)
            return
        will_props = p.will.properties if p.will is not None else None
        if will_props is not None and _bad_response_topic(will_props.response_topic):
            self._refuse_connect(ReasonCode.PROTOCOL_ERROR)
            return
        refusal = self._authenticate(p)
        if refusal is not None:
            self._refuse_connect(refusal)
            return
        self.client_id = p.client_id or f"auto-{os.urandom(12).hex()}"
        self.will = p.will
        if self.level == 5:
            expiry = props.session_expiry_interval or 0
            self._window = min(props.receive_maximum or 65535, MAX_WINDOW)
            self._max_out = props.maximum_packet_size
            self._out_alias_max = props.topic_alias_maximum or 0
            keep_alive = min(p.keep_alive, MAX_KEEP_ALIVE)
        else:
            expiry = 0 if p.clean_start else NEVER_EXPIRES
            keep_alive = p.keep_alive
        if self.will is not None and not self.topics.may_publish(self.will.topic):
            self.will = None
        try:
            attached = await self.registry.attach(self, p.clean_start, expiry)
        except StoreError as exc:  # e.g. Redis refuses writes for now: the client tries later
            log.warning("MQTT client %r: its session is unavailable: %s", self.client_id, exc)
            if not self.closing:
                self._refuse_connect(ReasonCode.SERVER_UNAVAILABLE)
            return
        if attached is None:
            log.info("MQTT client %r: its session belongs to another user", self.client_id)
            if not self.closing:
                self._refuse_connect(ReasonCode.NOT_AUTHORIZED)
            return
        self.state, present = attached
        if self.closing:  # the client went away while we waited
            return
        # a resumed session's QoS 0 filters are live on every node before the CONNACK says
        # it is present (as a SUBACK waits for its route): a reply published on another
        # node the moment the client is back was lost
        await self._resume_direct()
        if self.closing:
            return
        ack_props = None
        if self.level == 5:
            ack_props = Properties(
                assigned_client_identifier=None if p.client_id else self.client_id,
                server_keep_alive=keep_alive,
                receive_maximum=SERVER_RECEIVE_MAXIMUM,
                maximum_packet_size=MAX_PACKET_SIZE,
                topic_alias_maximum=TOPIC_ALIAS_MAXIMUM,
                retain_available=1,
                wildcard_subscription_available=1,
                subscription_identifier_available=1,
                shared_subscription_available=1,
            )
        data = encode(Connack(present, 0, ack_props), self.level)
        for optional in _CONNACK_OPTIONAL:  # within the client's maximum (MQTT-3.1.2-24)
            if ack_props is None or self._max_out is None or len(data) <= self._max_out:
                break
            setattr(ack_props, optional, None)
            data = encode(Connack(present, 0, ack_props), self.level)
        self.link.send(data)
        self.connected = True
        self._start_keep_alive(keep_alive)
        while self._early_direct:
            self._deliver(self._early_direct.popleft(), None, None, False)
        await self._resume()

    def _authenticate(self, p: Connect) -> int | None:
        """None if the client may connect, else the v5 CONNACK reason code."""
        if p.username is None and p.password is None:
            if not self.settings.allow_anonymous:
                return ReasonCode.NOT_AUTHORIZED
        else:
            try:
                password = (p.password or b"").decode()
            except UnicodeDecodeError:
                return ReasonCode.BAD_USER_NAME_OR_PASSWORD
            accepted, self.user = self.settings.login(p.username or "", password)
            if not accepted:
                return ReasonCode.BAD_USER_NAME_OR_PASSWORD
        self.topics = topic_access(self.settings.acl, self.access_user)
        return None

    @property
    def access_user(self) -> str:
        """Who the client is to queue permissions: its user name, or ANONYMOUS (not the
        operator, so anonymous clients get only what queues grant everyone)."""
        return self.user or ANONYMOUS

    def _refuse_connect(self, rc: int) -> None:
        self._send(Connack(False, rc))
        self.close()

    async def _resume_direct(self) -> None:
        """A resumed session's QoS 0 filters, before its CONNACK (see _on_connect)."""
        state = self.state
        assert state is not None
        for pattern, options in list(state.subscriptions.items()):
            if options.qos == 0 and shared_filter(pattern) is None and not self.closing:
                await self._subscribe_direct(pattern)

    async def _resume(self) -> None:
        """Re-establish a (possibly resumed) session's other deliveries after CONNACK."""
        state = self.state
        assert state is not None
        self._reserved = set(state.resend_ids.values())
        self._sent_before = dict.fromkeys((queue, entry) for queue, entry in state.shared_in_flight)
        for pattern in list(state.subscriptions):
            shared = shared_filter(pattern)
            if shared is not None and self._check_filter(pattern) is not None:
                # the ACL came to deny it a topic of the group's since it joined: its share
                # of those would be lost to the group (see _check_filter). Dropped, as a
                # refused SUBSCRIBE is: its offline session would join the group again
                log.warning("MQTT client %r: %s dropped, as the topic ACL now denies it",
                            self.client_id, pattern)  # fmt: skip
                state.drop_subscription(pattern)
                await self.registry.leave_shared(shared_queue_name(*shared), self.client_id)
                self.registry.save_soon(self)
            elif shared is not None:
                try:
                    await self._bind_shared(pattern, *shared)
                except (QueueError, BindError) as exc:
                    log.warning("MQTT client %r: %s not resumed: %s", self.client_id, pattern, exc)
        for pid in state.pubrel_out:
            self._send(Pubrel(pid))
        if state.queue is not None:
            await self.broker.queues.lift_earlier_size_limit(state.queue)
            await self._bind(state.queue)

    async def _subscribe_direct(self, pattern: str) -> None:
        """A QoS 0 subscription: delivered straight from any node once this returns."""
        token = await self.broker.subscribe_direct(pattern, MQTT, self._on_direct)
        if self.closing:  # the connection ended meanwhile: its clean-up may be done
            self.broker.unsubscribe_direct(token)
        else:
            self._direct[pattern] = token

    async def _bind(self, queue: str) -> bool:
        """Bind a flow on `queue` (the client's own, or a shared group's); False if gone."""
        try:
            flow = await self.broker.bind(
                queue,
                self._on_delivery,
                window=self._flow_window(queue),
                on_closed=lambda reason: self._flow_closed(queue, reason),
                # a group's queue is the adapter's: SUBSCRIBE checked the member's ACL
                user=None if queue in self._shared else self.access_user,
                connection=self.connection_id,
            )
        except BindError as exc:
            log.warning("MQTT client %r: cannot bind %s: %s", self.client_id, queue, exc)
            if self.state is not None and self.state.queue == queue:
                self.state.queue = None
            return False
        if self.closing:  # lost while binding: the cleanup ran before the flow existed
            await flow.close()
            return False
        self._flows[queue] = flow
        window = self._flow_window(queue)  # the socket may have drained during the bind,
        if flow.window != window:  # or acks freed room: _resize_windows did not see it
            flow.set_window(window)
        return True

    def _flow_window(self, queue: str) -> int:
        """The client's receive maximum less what else it counts: PUBREL-pending QoS 2
        deliveries and retained messages in flight or waiting to go first; none while the
        socket is backed up."""
        if not self.link.writable:
            return 0  # see writable_changed
        pending = len(self.state.pubrel_out) if self.state is not None else 0
        retained = self._retained_out + len(self._retained_waiting)
        window = max(0, self._window - pending - retained)
        return min(window, SHARED_WINDOW) if queue in self._shared else window

    def _flow_closed(self, queue: str, reason: str) -> None:
        log.info("MQTT client %r: flow on %s closed (%s)", self.client_id, queue, reason)
        self._flows.pop(queue, None)
        self._drop_held(queue)
        if self.state is not None and self.state.queue == queue:
            self.state.queue = None
            if reason == QUEUE_DELETED:
                self._end_session()
        elif reason == QUEUE_DELETED and queue in self._shared and not self.closing:
            self.registry.spawn(self._rejoin(self._shared[queue]))

    async def _rejoin(self, pattern: str) -> None:
        """A group's queue was deleted (by an operator, to drop its backlog): the member's
        subscription holds, so the group starts again, empty."""
        shared = shared_filter(pattern)
        if self.closing or self.state is None or pattern not in self.state.subscriptions:
            return
        assert shared is not None
        try:
            await self._bind_shared(pattern, *shared)
        except (QueueError, BindError) as exc:
            log.warning("MQTT client %r: %s not rejoined: %s", self.client_id, pattern, exc)

    def _end_session(self) -> None:
        """The session's queue was deleted (by an operator) and its subscriptions with it:
        the session ends with this connection, so the client is not told on its next
        CONNECT that a session with subscriptions is present (MQTT-3.2.2-2, 5.0
        §3.2.2.1.2). A v5 client hears why (0x98)."""
        log.warning(
            "MQTT client %r: its session's queue was deleted; session ended", self.client_id
        )
        state = self.state
        assert state is not None
        state.expiry, state.persistent = 0, False
        self.fail(ReasonCode.ADMINISTRATIVE_ACTION)

    # -- keep alive ------------------------------------------------------------------------

    def _connect_timeout(self) -> None:
        self._timer = None
        if not self.connected and not self.closing:
            log.info("MQTT connection sent no CONNECT in %.0f s", CONNECT_TIMEOUT)
            self.close()

    def _start_keep_alive(self, seconds: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if seconds:
            self._keep_alive = seconds * 1.5
            self._timer = self.loop.call_later(self._keep_alive, self._check_keep_alive)

    def _check_keep_alive(self) -> None:
        if self.link.input_paused and self.link.output_moved():  # we are not reading
            self._last_rx = self.loop.time()
        idle = self.loop.time() - self._last_rx
        if idle >= self._keep_alive:
            self._timer = None
            log.info("MQTT client %r: keep alive timed out", self.client_id)
            self.fail(ReasonCode.KEEP_ALIVE_TIMEOUT)
        else:
            self._timer = self.loop.call_later(self._keep_alive - idle, self._check_keep_alive)

    # -- inbound PUBLISH -------------------------------------------------------------------

    def _on_publish(self, p: Publish) -> None:
        state = self.state
        assert state is not None
        if self.level == 5 and not self._check_v5_publish(p):
            return
        pid = p.packet_id or 0  # set whenever qos > 0 (the decoder checks)
        if p.qos == 2 and pid in state.qos2_in:  # resent before PUBREL: do not spool again
            storing = self._storing.get(pid)
            if storing is not None:  # the first is not stored yet: answered as it is
                self._unresolved += 1
                ack = _Ack(self, 2, pid, ReasonCode.SUCCESS, None)
                self._acks.append(ack)
                storing.add_done_callback(ack.from_future)
                return
            self._acks.append(_Ack(self, 2, pid, ReasonCode.SUCCESS, _DECIDED))
            self._flush_acks()
            return
        if (
            p.qos
            and self.level == 5
            and self._qos1_in + len(state.qos2_in) >= (SERVER_RECEIVE_MAXIMUM)
        ):
            self.fail(ReasonCode.RECEIVE_MAXIMUM_EXCEEDED)
            return
        if self.topics.deny_publish and not self.topics.may_publish(p.topic):
            log.info("MQTT client %r may not publish to %r", self.client_id, p.topic)
            self.registry.count("publish_denied")
            if p.qos:  # v3/v4: acked and dropped (as mosquitto does), v5: refused
                rc = ReasonCode.NOT_AUTHORIZED if self.level == 5 else ReasonCode.SUCCESS
                self._acks.append(_Ack(self, p.qos, pid, rc, _DECIDED))
                self._flush_acks()
            return
        publisher = self._publisher
        if publisher is None:  # client id and user are fixed once connected
            publisher = self._publisher = Publisher("mqtt", self.client_id, self.user)
        msg = mapping.to_message(p, publisher, self.level)
        self._spooling += 1
        if self._spooling >= MAX_PENDING_PUBLISHES:
            self.link.pause_input("spool")
        if p.qos == 1:  # the spooler calls the ack back: no future, no loop handle
            self._qos1_in += 1
            self._unresolved += 1
            ack = _Ack(self, 1, pid, ReasonCode.SUCCESS, None)
            self._acks.append(ack)
            self.broker.publish_nowait(msg, ack)
            return
        if p.qos == 0:
            self.broker.publish_nowait(msg, self._spooled)
            return
        state.qos2_in.add(pid)
        assert self.claim is not None  # connected
        msg.exactly_once = self.broker.clients.receipt_mark(self.client_id, pid, self.claim)
        self._unresolved += 1
        ack = _Ack(self, 2, pid, ReasonCode.SUCCESS, None)
        self._acks.append(ack)
        spooled = self.broker.publish_nowait(msg)
        fut = asyncio.ensure_future(self._mark_received(spooled, pid, self.claim))
        fut.add_done_callback(ack.from_future)
        self._storing[pid] = fut
        fut.add_done_callback(lambda _: self._storing.pop(pid, None))

    async def _mark_received(
        self, spooled: asyncio.Future[Outcome], pid: int, claim: int
    ) -> Outcome:
        """QoS 2: the id is recorded in Redis before the PUBREC, so a resend after a
        reconnect (on any node, after a restart) is not stored again: by the spool, in the
        same step as the message (`exactly_once`: an answer lost on the way, or Redis
        restarted, stored a resend twice), here for a message no queue took."""
        try:
            outcome = await spooled
        finally:
            self._spooled()
        if outcome is Outcome.NO_SUBSCRIBERS:
            await self.broker.clients.mark_received(self.client_id, pid, claim)
        return outcome

    def _check_v5_publish(self, p: Publish) -> bool:
        """Topic aliases and what a v5 client may not send; False if the client was failed."""
        props = p.properties
        if props is None:
            return True
        if props.subscription_identifiers or _bad_response_topic(props.response_topic):
            self.fail(ReasonCode.PROTOCOL_ERROR)
            return False
        alias = props.topic_alias
        if alias is not None:
            if not 0 < alias <= TOPIC_ALIAS_MAXIMUM:
                self.fail(ReasonCode.TOPIC_ALIAS_INVALID)
                return False
            if p.topic:
                self._aliases[alias] = p.topic
            elif alias in self._aliases:
                p.topic = self._aliases[alias]
            else:
                self.fail(ReasonCode.PROTOCOL_ERROR)
                return False
        return True

    def _spooled(self, _: object = None) -> None:
        self._spooling -= 1
        if self._spooling == MAX_PENDING_PUBLISHES // 2:
            self.link.resume_input("spool")

    def _ack_resolved(self) -> None:
        """One QoS 1/2 entry of `_acks` got its outcome."""
        self._unresolved -= 1
        if self._unresolved == 0 and self._resolved is not None:
            self._resolved.set_result(None)
            self._resolved = None
        self._flush_acks()

    def _flush_acks(self) -> None:
        """Send PUBACK/PUBREC for the resolved head of the queue: acks keep publish order.

        An entry `_DECIDED` on arrival answers with its `rc`."""
        state = self.state
        acks = self._acks
        while acks:
            ack = acks[0]
            outcome = ack.outcome
            if outcome is None:
                return
            acks.popleft()
            qos, pid = ack.qos, ack.pid
            if outcome is Outcome.OK:  # the common case first
                if qos == 1:
                    self._qos1_in -= 1
                if not self.closing and state is not None:
                    self._send_pub_ack(qos, pid, ReasonCode.SUCCESS)
                continue
            if qos == 1 and outcome is not _DECIDED:
                self._qos1_in -= 1
            if self.closing or state is None:
                continue
            if outcome is _DECIDED:
                self._send_pub_ack(qos, pid, ack.rc)
                continue
            if not isinstance(outcome, Outcome):
                # not stored: no ack, and the connection goes so the client resends
                log.error("MQTT client %r: spooling failed: %r", self.client_id, outcome)
                state.qos2_in.discard(pid)
                self.fail(ReasonCode.UNSPECIFIED_ERROR)
                continue
            if outcome.accepted:
                self._send_pub_ack(qos, pid, ReasonCode.SUCCESS)
                continue
            state.qos2_in.discard(pid)
            self.registry.count(f"refused_{outcome.name.lower()}")
            if self.level == 5:
                self._send_pub_ack(qos, pid, _REFUSAL_CODES.get(outcome, 0x80))
            else:
                log.warning(
                    "MQTT client %r: publish refused (%s); PUBACK withheld",
                    self.client_id,
                    outcome.name,
                )

    def _send_pub_ack(self, qos: int, pid: int, rc: int) -> None:
        if qos == 1 and rc == ReasonCode.SUCCESS:
            self.link.send(encode_puback(pid))
        else:
            self._send(Puback(pid, rc) if qos == 1 else Pubrec(pid, rc))

    async def _on_pubrel(self, p: Pubrel) -> None:
        """Forget the id in Redis before the PUBCOMP lets the client reuse it."""
        state = self.state
        assert state is not None
        if p.packet_id in state.qos2_in:
            await self.broker.clients.release_received(self.client_id, p.packet_id)
            state.qos2_in.discard(p.packet_id)
            self._send(Pubcomp(p.packet_id))
        else:
            rc = ReasonCode.PACKET_IDENTIFIER_NOT_FOUND if self.level == 5 else 0
            self._send(Pubcomp(p.packet_id, rc))

    # -- outbound deliveries ---------------------------------------------------------------

    def _on_direct(self, msg: Message) -> None:
        # one callback per matching QoS 0 filter: deliver each message once
        if self.closing or msg.id == self._last_direct:
            return
        self._last_direct = msg.id
        if not self.connected:  # a resumed session's filter, live before its CONNACK went
            if len(self._early_direct) == MAX_WAITING:  # the deque drops its oldest
                self.registry.count("qos0_dropped")
            self._early_direct.append(msg)
            return
        self._deliver(msg, None, None, False)

    def _on_delivery(self, delivery: Delivery) -> None:
        queue, entry_id = delivery.queue, delivery.entry_id
        if delivery.redelivered and self._inflight and self._in_flight(queue, entry_id):
            return  # its flow took it again (its node was presumed dead a while): the client
            # has it under its packet id, and its answer settles it (MQTT-4.3.3, -4.4.0-1)
        redelivered = delivery.redelivered
        if redelivered and queue in self._shared:  # its group's queue counts every member's
            # deliveries: DUP only for one this session had in flight (MQTT-3.3.1-1)
            redelivered = (queue, entry_id) in self._sent_before
        self._deliver(delivery.message, queue, entry_id, redelivered)

    def _note_sent(self, queue: str, entry_id: str) -> None:
        sent = self._sent_before
        sent[(queue, entry_id)] = None
        if len(sent) > MAX_RESEND_IDS:  # the oldest goes: one given back long ago
            del sent[next(iter(sent))]

    def _in_flight(self, queue: str, entry_id: str) -> bool:
        """Looked up only on a flow that was lost once (a scan of the window: other
        redeliveries, a resumed session's, cannot be in flight on this connection)."""
        flow = self._flows.get(queue)
        if flow is None or flow.lost_at < 0:  # never lost
            return False
        return any(q == queue and e == entry_id for q, e, _ in self._inflight.values())

    def _deliver(self, msg: Message, queue: str | None, entry_id: str | None, dup: bool) -> None:
        """Send one message; `entry_id` None: a direct (QoS 0, not spooled) message."""
        state = self.state
        if state is None or self.closing:
            self._give_back(queue, entry_id)  # fetched as the connection ended: never sent
            return
        shared = self._shared.get(queue) if queue is not None else None
        if shared is None and state.resend_shared and queue == state.queue:
            shared = state.resend_shared.get(msg.id)  # a group's, kept for this client
        if state.resend_retained and queue == state.queue and msg.id in state.resend_retained:
            qos, sub_ids = state.resend_retained[msg.id]  # as it went on SUBSCRIBE
            denied = not self.topics.may_receive(msg.destination)
            route = None if denied else (qos, True, sub_ids)
        elif shared is not None:  # a shared group's queue: that one subscription
            route = self._route(state, [shared] if shared in state.subscriptions else [], msg)
        elif entry_id is not None and self._sent_direct and msg.id in self._sent_direct:
            self._settle(queue, entry_id)  # went out direct while a filter changed QoS
            return
        else:
            pub = msg.publisher
            own = pub is not None and pub.client_id == self.client_id and pub.protocol == "mqtt"
            key = (msg.destination, entry_id is None, own)
            if self._routes_of is not state or self._routes_version != state.version:
                self._routes.clear()
                self._routes_of, self._routes_version = state, state.version
            try:
                route = self._routes[key]
            except KeyError:
                filters = self._own_filters(state, msg.destination, entry_id is None, own)
                route = self._route(state, filters, msg)
                if len(self._routes) >= MAX_CACHED_ROUTES:
                    self._routes.clear()
                self._routes[key] = route
        if state.resend_qos and entry_id is not None and queue == state.queue:
            route = self._resent_route(state, msg, entry_id, route)
        if route is None:
            self._settle(queue, entry_id)
            return
        max_qos, retain_as_published, sub_ids = route
        qos = min(mapping.message_qos(msg), max_qos)
        retain = msg.retain and retain_as_published
        if entry_id is None and self._both_routes:  # its queued copy is not sent again
            self._sent_direct[msg.id] = None
            if len(self._sent_direct) > MAX_SENT_DIRECT:
                del self._sent_direct[next(iter(self._sent_direct))]
        gate = self._gate
        if gate is not None and self._gated(msg.destination):
            full = queue is None and len(gate) >= MAX_WAITING
            if full and not self._dropped_at_gate(gate, msg.destination):
                self.registry.count("qos0_dropped")  # none older to drop: this one goes
                return
            gate.append((msg, queue, entry_id, qos, dup, retain, sub_ids))
            return
        self._send_or_hold(msg, queue, entry_id, qos, dup, retain, sub_ids)

    def _resent_route(self, state: SessionState, msg: Message, entry_id: str, route: Any) -> Any:
        """A message in flight when the last connection ended goes again at the QoS it went
        at, with its packet id (MQTT-4.4.0-1), though its filter was unsubscribed or
        subscribed at a lower QoS since (MQTT-3.10.4-3: a delivery begun is completed)."""
        qos = state.resend_qos.get(entry_id)  # kept until its packet id is (_packet_id)
        if qos is None or entry_id not in state.resend_ids:
            return route
        if not self.topics.may_receive(msg.destination):  # the topic ACL denies it now
            return None
        return (qos, *route[1:]) if route is not None else (qos, False, [])

    def _dropped_at_gate(self, gate: list[tuple[Any, ...]], topic: str) -> bool:
        """Drop a direct (QoS 0) message at the gate, if one is there: while the retained
        messages wait for a client that reads slowly, or not at all, the live ones must
        not grow in the node's memory (a flow's are bounded by its window). The oldest
        one that a newer one of its topic follows goes (the one arriving on `topic`
        counts), so that the client's last word on that topic is still its newest value;
        else the oldest."""
        later = {topic}
        at = None
        for i in range(len(gate) - 1, -1, -1):
            waiting = gate[i]
            if waiting[1] is None and waiting[0].destination in later:
                at = i
            later.add(waiting[0].destination)
        if at is None:
            at = next((i for i, waiting in enumerate(gate) if waiting[1] is None), None)
            if at is None:
                return False
        del gate[at]
        self.registry.count("qos0_dropped")
        return True

    def _gated(self, topic: str) -> bool:
        """Whether a delivery on `topic` waits at the gate: one of the filters the SUBSCRIBE
        being handled sends retained messages for matches it."""
        return any(pattern_matches(f, topic, MQTT) for f in self._gate_filters)

    def _send_or_hold(self, *routed: Any) -> None:
        """`routed`: _transmit's arguments. A queued QoS 1/2 message waits while the
        client's receive maximum is full (MQTT-3.3.4-9, across all the session's flows),
        or while others wait before it. A QoS 0 one waits too while an older retained
        message of its topic waits for room: the client's last word on the topic must be
        the newer one."""
        queue, qos = routed[1], routed[3]
        if qos and queue is not None and (self._held_out or not self._room()):
            self._held_out.append(routed)
            return
        if not qos and (self._held_out or self._retained_waiting) and self._behind(routed[0]):
            if len(self._held_out) >= MAX_WAITING:  # QoS 0 may be dropped: the oldest one,
                # so that the client's last word on a topic is still its newest value
                oldest = next((r for r in self._held_out if not r[3]), None)
                if oldest is None:
                    self.registry.count("qos0_dropped")
                    return
                self._held_out.remove(oldest)
                self.registry.count("qos0_dropped")
            self._held_out.append(routed)
            return
        self._transmit(*routed)

    def _behind(self, msg: Message) -> bool:
        """An older message of `msg`'s topic waits: a retained one, or one held out."""
        topic = msg.destination
        return self._retained_waits(topic) or any(
            held[0].destination == topic for held in self._held_out
        )

    def _retained_waits(self, topic: str) -> bool:
        return any(msg.destination == topic for msg, _, _ in self._retained_waiting)

    def _route(
        self, state: SessionState, filters: list[str], msg: Message
    ) -> tuple[int, bool, list[int]] | None:
        """How the matching `filters` deliver `msg`'s topic: the highest QoS granted,
        whether one keeps the retain flag, the subscription ids; None: not at all."""
        options = [state.subscriptions[f] for f in filters]
        if not options or not self.topics.may_receive(msg.destination):
            return None
        if not mapping.is_topic_name(msg.destination):  # from AMQP: no MQTT topic name
            log.info("MQTT client %r: a message on %r, not a topic name, is not sent",
                     self.client_id, msg.destination)  # fmt: skip
            return None
        return (
            max(o.qos for o in options),
            any(o.retain_as_published for o in options),
            sorted({state.subscription_ids[f] for f in filters if f in state.subscription_ids}),
        )

    def _own_filters(self, state: SessionState, topic: str, direct: bool, own: bool) -> list[str]:
        """The client's non-shared filters that take a message on `topic` (from its queue,
        or direct); `own`: the client published it (no-local filters skip it). A queued
        message goes out once for every filter that matches it, QoS 0 ones too: their
        subscription ids go with it, and one resubscribed at QoS 0 since it was queued
        still gets it. The queue holds a copy when any QoS 1/2 filter matches, a no-local
        one too: that copy, not a direct one, goes to the client's other filters."""
        matched = list(state.trie.match(topic))
        if direct:
            if self._queuing:  # not routed to the queue yet: the other filters deliver it
                matched = [f for f in matched if f not in self._queuing]
            if any(state.subscriptions[f].qos > 0 for f in matched):
                return []  # the queue delivers it
        if own:
            matched = [f for f in matched if not state.subscriptions[f].no_local]
        return matched

    def _room(self) -> bool:
        """The client's receive maximum has room for one more QoS 1/2 PUBLISH."""
        pending = len(self.state.pubrel_out) if self.state is not None else 0
        return len(self._inflight) + pending < self._window

    def _drop_held(self, queue: str) -> None:
        """Deliveries waiting for room (or at the gate) from a flow that ended: its queue
        has them back."""
        if self._held_out:
            self._held_out = deque(held for held in self._held_out if held[1] != queue)
        if self._gate:
            self._gate = [waiting for waiting in self._gate if waiting[1] != queue]

    async def _close_flow(self, queue: str, flow: Flow) -> None:
        """Close the flow; its deliveries waiting for room (or at the gate) are released
        first, so its queue has them back with the delivery uncounted (the unbind would
        count it: max_redelivery, DUP): no client saw them. The close follows at once, so
        the flow does not fetch them again meanwhile."""
        for _, held_queue, entry_id, *_ in [*self._held_out, *(self._gate or ())]:
            if held_queue == queue:
                self._give_back(queue, entry_id)
        self._drop_held(queue)
        self._flows.pop(queue, None)
        await flow.close()

    def _send_held_out(self) -> None:
        """In order: a QoS 1/2 delivery once there is room, a QoS 0 one once no retained
        message of its topic waits before it."""
        held = self._held_out
        while held and not self.closing:
            msg, qos = held[0][0], held[0][3]
            blocked = not self._room() if qos else self._retained_waits(msg.destination)
            if blocked:
                return
            self._transmit(*held.popleft())

    def _transmit(
        self,
        msg: Message,
        queue: str | None,
        entry_id: str | None,
        qos: int,
        dup: bool,
        retain: bool,
        sub_ids: list[int],
    ) -> None:
        expiry = None
        if msg.expiration is not None:
            expiry = mapping.remaining_expiry(msg, mapping.now_ms())
            if expiry == 0:  # expired while it waited: its queue expires it (DMQ, counters)
                self._give_back(queue, entry_id)
                return
        resent = False
        if not qos:
            pid = None
        elif self._reserved:
            pid, resent = self._packet_id(msg, entry_id)
        else:
            pid = self._allocate_pid()
        if qos and pid is None:  # cannot happen while the window is below 65535
            flow = self._flows.get(queue) if queue is not None else None
            if flow is not None and entry_id is not None:
                flow.release(entry_id)
            return
        alias = self._alias_for(msg.destination) if self._out_alias_max else None
        named = alias is not None and qos == 2 and alias[1]
        if named:  # its topic in full, the alias set again: mqtt.js hands a QoS 2 message
            alias = (alias[0], False)  # on at PUBREL with the topic of the stored packet,
            # left out ("") where the alias stood for it
        dup = (dup or resent) and qos > 0
        try:
            data = mapping.encode_delivery(
                msg, qos, pid, dup, retain, sub_ids, expiry, self.level, alias
            )
            if named and self._max_out is not None and len(data) > self._max_out:
                alias = (alias[0], True)  # fits only with the topic left out: sent so
                data = mapping.encode_delivery(
                    msg, qos, pid, dup, retain, sub_ids, expiry, self.level, alias
                )
        except ValueError as exc:  # a string over 65,535 bytes (from AMQP): dropped, as a
            # packet over the client's maximum is (MQTT-3.1.2-25), not left to hold its place
            log.info("MQTT client %r: a message MQTT cannot carry is not sent: %s",
                     self.client_id, exc)  # fmt: skip
            self._settle(queue, entry_id)
            return
        if self._max_out is not None and len(data) > self._max_out:
            log.info("MQTT client %r: message over its maximum packet size dropped", self.client_id)
            self._settle(queue, entry_id)
            return
        if alias is not None and not alias[1]:  # the client learns it with this packet
            self._out_aliases[msg.destination] = alias[0]
        if pid is not None:
            self._inflight[pid] = (queue, entry_id, qos)
            if queue is None or (qos == 2 and queue in self._shared):
                self._kept[pid] = (msg, sub_ids)  # stored should this connection end
            elif qos == 1 and queue in self._shared and entry_id is not None:
                self._note_sent(queue, entry_id)
            state = self.state
            if (
                state is not None
                and queue == state.queue
                and (msg.id in state.resend_retained or msg.id in state.resend_shared)
            ):
                self._routed[pid] = msg.id  # its noted route stays until it is acknowledged
        else:
            self._settle(queue, entry_id)
        self.link.send(data)

    def _alias_for(self, topic: str) -> tuple[int, bool] | None:
        """Outbound topic aliases: the first topics (up to the client's topic alias maximum)
        get one; later PUBLISHes on them leave the topic out. True: the client knows it;
        False: a new one, kept once a packet that tells the client is sent."""
        alias = self._out_aliases.get(topic)
        if alias is not None:
            return alias, True
        if len(self._out_aliases) < self._out_alias_max:
            return len(self._out_aliases) + 1, False
        return None

    def _give_back(self, queue: str | None, entry_id: str | None) -> None:
        """A queued delivery no client saw goes back to its queue, the delivery uncounted
        (max_redelivery, DUP)."""
        flow = self._flows.get(queue) if queue is not None else None
        if flow is not None and entry_id is not None:
            flow.release(entry_id)

    def _settle(self, queue: str | None, entry_id: str | None) -> None:
        if queue is None or entry_id is None:
            return
        flow = self._flows.get(queue)
        if flow is not None:
            flow.ack(entry_id)

    def _packet_id(self, msg: Message, entry_id: str | None) -> tuple[int | None, bool]:
        """(packet id, resent): the id a message in flight when the last connection ended
        had (MQTT-4.4.0-1), by its entry (or, for a retained one stored for the resend, its
        message id), else a free one. Ids kept for messages settled meanwhile stay unused
        for the rest of the connection: at most MAX_RESEND_IDS of them."""
        state = self.state
        if self._reserved and state is not None:
            resend = state.resend_ids
            pid = resend.pop(entry_id, None) if entry_id is not None else None
            if pid is not None and state.resend_qos:
                state.resend_qos.pop(entry_id, None)
            if pid is None and msg.id:
                pid = resend.pop(RESENT_BY_ID + msg.id, None)
            if pid is not None:
                self._reserved.discard(pid)
                if pid not in self._inflight:
                    return pid, True
        return self._allocate_pid(), False

    def _allocate_pid(self) -> int | None:
        pubrel = self.state.pubrel_out if self.state is not None else ()
        for _ in range(65535):
            pid = self._next_pid
            self._next_pid = pid % 65535 + 1
            if pid not in self._inflight and pid not in pubrel and pid not in self._reserved:
                return pid
        return None

    def _on_puback(self, p: Puback) -> None:
        item = self._inflight.pop(p.packet_id, None)
        if item is not None:
            if item[2] != 1:  # the QoS 2 flow answered as QoS 1
                self._wrong_ack(item[2])
                return
            self._settle(item[0], item[1])
            if self._sent_before:
                self._sent_before.pop((item[0], item[1]), None)
            if item[0] is None or self._retained_waiting:
                self._kept.pop(p.packet_id, None)
                self._acked(item[0])
            if self._routed:
                self._forget_route(p.packet_id)
            if self._held_out:
                self._send_held_out()

    def _forget_route(self, pid: int) -> None:
        """A message resent by the route noted for it (a retained or a group's one stored
        for this session) was acknowledged: the note goes. Until then it stays, should this
        connection end too."""
        message_id = self._routed.pop(pid, None)
        state = self.state
        if message_id is not None and state is not None:
            state.resend_retained.pop(message_id, None)
            state.resend_shared.pop(message_id, None)

    def _on_pubrec(self, p: Pubrec) -> None:
        """QoS 2 out: the message is settled in the queue at PUBREC (the client owns it
        now), so a reconnect resends PUBREL, never the message: no duplicate."""
        state = self.state
        assert state is not None
        item = self._inflight.pop(p.packet_id, None)
        self._kept.pop(p.packet_id, None)
        if self._routed:
            self._forget_route(p.packet_id)
        if item is not None:
            if item[2] != 2:  # the QoS 1 flow answered as QoS 2
                self._wrong_ack(item[2])
                return
            if p.reason_code < 0x80 and state.persistent:
                self._settle_when_saved.append((item[0], item[1]))
            else:
                self._settle(item[0], item[1])
            if p.reason_code < 0x80:
                state.pubrel_out[p.packet_id] = None
                self._pubrel_changed()
                self._send(Pubrel(p.packet_id))
            if item[0] is None or self._retained_waiting:
                self._acked(item[0])
            if self._held_out:  # a failed PUBREC ended the exchange: room for one more
                self._send_held_out()
        elif p.packet_id in state.pubrel_out:
            self._send(Pubrel(p.packet_id))
        elif self.level == 5:
            self._send(Pubrel(p.packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))

    def saving(self) -> list[tuple[str | None, str | None]]:
        """The PUBRECed deliveries whose PUBREL ids the save now starting stores."""
        settles, self._settle_when_saved = self._settle_when_saved, []
        self._saving.update(settles)
        return settles

    def unsaved(self, settles: list[tuple[str | None, str | None]]) -> None:
        """The save `saving` went with failed: they wait for the next, tried soon (their
        place in the client's receive maximum is taken until then)."""
        self._saving.difference_update(settles)
        self._settle_when_saved[:0] = settles
        if settles and not self.closing:
            self.loop.call_later(SAVE_RETRY_S, self._save_again)

    def _save_again(self) -> None:
        if not self.closing:  # else the teardown saved (a later save would outlive the
            self.registry.save_soon(self)  # session: an expiry 0 one stored again)

    def saved(self, settles: Iterable[tuple[str | None, str | None]]) -> None:
        """The save `saving` went with is in: the client owns those messages now."""
        for settle in settles:
            self._saving.discard(settle)
            self._settle(*settle)

    def _wrong_ack(self, qos: int) -> None:
        """A PUBACK for a QoS 2 delivery or a PUBREC for a QoS 1 one: a protocol error (as
        Mosquitto has it). The delivery stays unsettled, so it is delivered again."""
        log.info("MQTT client %r acknowledged a QoS %d delivery wrongly", self.client_id, qos)
        self.fail(ReasonCode.PROTOCOL_ERROR)

    def _on_pubcomp(self, p: Pubcomp) -> None:
        state = self.state
        assert state is not None
        if p.packet_id in state.pubrel_out:
            del state.pubrel_out[p.packet_id]
            self._pubrel_changed()
            if self._retained_waiting:  # the room it held in the receive maximum is theirs
                self._send_retained_waiting()  # (then the held-out ones)
            else:
                self._send_held_out()

    def _pubrel_changed(self) -> None:
        """PUBREL-pending messages count against the client's receive maximum, and a
        persistent session resends its PUBRELs after a restart."""
        self._resize_windows()
        self.registry.save_soon(self)

    def writable_changed(self) -> None:
        """The socket backed up, or drained: the flows' windows shut, or open again."""
        self._resize_windows()
        if self.link.writable:
            self._wake_drained()

    def _wake_drained(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _resize_windows(self) -> None:
        if self.closing:  # they stay shut (see _closing)
            return
        for queue, flow in self._flows.items():
            flow.set_window(self._flow_window(queue))

    def _acked(self, queue: str | None) -> None:
        """A PUBLISH left the client's count: a retained one frees the flows' room, and
        retained messages waiting for room may go."""
        if queue is None and self._retained_out:
            self._retained_out -= 1
            if not self._retained_waiting:
                self._resize_windows()
        self._send_retained_waiting()

    # -- SUBSCRIBE / UNSUBSCRIBE -----------------------------------------------------------

    async def _on_subscribe(self, p: Subscribe) -> None:
        """A new subscription is live before its retained messages are read, so what it
        gets meanwhile waits (the gate) until they went: a retained message never comes
        after a newer live one of its topic."""
        self._gate = []
        try:
            await self._subscribe_all(p)
        finally:
            waiting, self._gate, self._gate_filters = self._gate, None, []
            for delivery in waiting:
                if self.closing:  # never sent: back to their queues uncounted
                    self._give_back(delivery[1], delivery[2])
                else:
                    self._send_or_hold(*delivery)

    async def _subscribe_all(self, p: Subscribe) -> None:
        state = self.state
        assert state is not None
        sub_id = None
        if p.properties is not None and p.properties.subscription_identifiers:
            sub_id = p.properties.subscription_identifiers[0]
        codes: list[int] = []
        retained: list[tuple[str, SubscriptionOptions]] = []
        over_quota = 0
        for pattern, options in p.subscriptions:
            previous = state.subscriptions.get(pattern)
            rc = self._check_filter(pattern)
            if rc is None and previous is None and len(state.subscriptions) >= MAX_SUBSCRIPTIONS:
                rc = ReasonCode.QUOTA_EXCEEDED
                over_quota += 1
            handling = options.retain_handling
            sends_retained = shared_filter(pattern) is None and (
                handling == 0 or (handling == 1 and previous is None)
            )
            previous_id = state.subscription_ids.get(pattern)
            if rc is None:
                if sends_retained:  # live before its retained messages are read
                    self._gate_filters.append(pattern)
                # before the route is live: what it delivers meanwhile carries the id
                # (MQTT-3.3.4-3), also while other nodes are asked to route by it
                state.set_subscription_id(pattern, sub_id)
                try:
                    rc = await self._subscribe(pattern, options, previous)
                except (QueueError, BindError) as exc:  # e.g. a race with the queue's end
                    log.warning(
                        "MQTT client %r: subscribing to %r failed: %s", self.client_id, pattern, exc
                    )
                    rc = ReasonCode.UNSPECIFIED_ERROR
                if rc >= 0x80:
                    state.set_subscription_id(pattern, previous_id)
            if rc >= 0x80:
                if previous is not None:
                    state.set_subscription(pattern, previous)
                elif pattern in state.subscriptions:
                    state.drop_subscription(pattern)
            elif sends_retained:
                retained.append((pattern, options))
            codes.append(rc)
        if over_quota:
            log.warning(
                "MQTT client %r: %d filters refused, %d subscriptions is the maximum",
                self.client_id,
                over_quota,
                MAX_SUBSCRIPTIONS,
            )
        await self.registry.save(self)
        self._send(Suback(p.packet_id, codes))
        for pattern, options in retained:
            if self.closing and not state.persistent:  # none of them would go
                return
            await self._send_retained(pattern, options)

    async def _subscribe(
        self, pattern: str, options: SubscriptionOptions, previous: SubscriptionOptions | None
    ) -> int:
        """Route `pattern` to this session as `options` ask; returns the granted QoS.
        A filter changing between QoS 0 and 1/2 gets its new route before the old one goes,
        so nothing published meanwhile is lost (MQTT-3.8.4-3), nor sent twice."""
        state = self.state
        assert state is not None
        shared = shared_filter(pattern)
        if shared is not None:
            state.set_subscription(pattern, options)
            if previous is None:
                await self._bind_shared(pattern, *shared)
            return options.qos
        if options.qos == 0:
            state.set_subscription(pattern, options)
            if previous is None or previous.qos == 0 or state.queue is None:
                if pattern not in self._direct:
                    await self._subscribe_direct(pattern)
                return 0
            # from QoS 1/2: the direct route is live (its announcement to other nodes may
            # take a round trip) while the queued one still is
            with self._both_routes_held():
                if pattern not in self._direct:
                    await self._subscribe_direct(pattern)
                await self.broker.unsubscribe_queue(
                    state.queue, [pattern], MQTT, user=self.access_user
                )
            return 0
        if pattern not in self._direct:
            # a new filter: until its queue route holds on every node, a message it matches
            # may reach the client only through an overlapping QoS 0 filter's direct copy,
            # which goes out; a queued copy goes out too, at its QoS (MQTT 5 §3.3.4 allows
            # a copy per matching subscription). A QoS 1/2 filter subscribed again is
            # queued already.
            new = previous is None
            if new:
                self._queuing.add(pattern)
            state.set_subscription(pattern, options)  # a new version: the routes are redone
            try:
                queue = await self._ensure_queue()
                await self.broker.subscribe_queue(queue, [pattern], MQTT, user=self.access_user)
            finally:
                if new:
                    self._queuing.discard(pattern)
                    self._routes.clear()
            return options.qos
        queue = await self._ensure_queue()  # it stays QoS 0 until the queue takes the topic
        with self._both_routes_held():
            await self.broker.subscribe_queue(queue, [pattern], MQTT, user=self.access_user)
        state.set_subscription(pattern, options)
        self.broker.unsubscribe_direct(self._direct.pop(pattern))
        return options.qos

    @contextlib.contextmanager
    def _both_routes_held(self) -> Iterator[None]:
        """While a filter has its direct and its queued route (see _on_direct)."""
        self._both_routes += 1
        try:
            yield
        finally:
            self._both_routes -= 1

    async def _bind_shared(self, pattern: str, group: str, topic_filter: str) -> None:
        """Join the group: its durable non-exclusive queue, and one flow of ours on it."""
        assert self.state is not None
        queue = await self.registry.shared_queue(group, topic_filter, self.state)
        self._shared[queue] = pattern
        if not await self._bind(queue):
            del self._shared[queue]
            if self.closing:  # lost meanwhile: it stays a member until its detach
                return
            await self.registry.leave_shared(queue, self.client_id)  # not a member after all
            raise BindError("not_found", f"shared queue {queue!r} is gone")

    async def _send_retained(self, pattern: str, options: SubscriptionOptions) -> None:
        """The retained messages for a new subscription, flagged RETAIN=1. Once the
        connection ends, a persistent session's QoS 1/2 ones still wait for room, and
        are stored for its next connection with those that waited before."""
        state = self.state
        assert state is not None
        sub_id = state.subscription_ids.get(pattern)
        sent = False  # a batch waits for the socket to drain; the last one's ends the SUBSCRIBE
        async with contextlib.aclosing(self.broker.retained.matching(pattern, MQTT)) as batches:
            async for batch in batches:  # the event loop's other work goes between them
                if sent:
                    await self._until_writable()
                for msg in batch:
                    if self.closing and not state.persistent:
                        return
                    if self.topics.may_receive(msg.destination):
                        self._offer_retained(
                            msg, min(mapping.message_qos(msg), options.qos), sub_id
                        )
                self._send_retained_waiting()
                sent = True

    async def _until_writable(self) -> None:
        """Until the socket's buffer drained below its high-water mark, or the session
        closes: a slow reader's retained messages wait as stored, not encoded in its
        buffer, which would pass the cap that drops a client as one not reading. The
        reading it pauses is paused for the writing alone meanwhile: the keep alive then
        drops a client that takes none of its output (a pause while busy counts as ours)."""
        await asyncio.sleep(0)  # the batch just sent is written (the link writes once a turn)
        if self.link.writable or self.closing:
            return
        self.link.resume_input("busy")  # reading stays paused: the writing pauses it too
        try:
            while not self.link.writable and not self.closing:
                self._drained = self.loop.create_future()
                await self._drained
        finally:
            self.link.pause_input("busy")

    def _offer_retained(self, msg: Message, qos: int, sub_id: int | None) -> None:
        """A QoS 0 one goes now (not once the connection ended), a QoS 1/2 one once the
        client's receive maximum has room."""
        self._pass_over_older(msg)
        sub_ids = [] if sub_id is None else [sub_id]
        if not qos:
            if not self.closing:
                self._transmit(msg, None, None, 0, False, True, sub_ids)
        elif len(self._retained_waiting) < MAX_WAITING:
            self._retained_waiting.append((msg, qos, sub_ids))
        else:
            self.registry.count("retained_dropped")

    def _pass_over_older(self, retained: Message) -> None:
        """A retained message read while its QoS 0 live copy waits at the gate: that copy
        and the direct messages of its topic before it are older than what goes as
        retained now, and are not sent (QoS 0 may drop them), unless a filter that gets no
        retained messages now matches the topic too (an older subscription gets its own)."""
        gate, state = self._gate, self.state
        if not gate or state is None:
            return
        if not set(state.trie.match(retained.destination)) <= set(self._gate_filters):
            return
        at = next((i for i, d in enumerate(gate) if d[2] is None and d[0].id == retained.id), None)
        if at is not None:
            topic = retained.destination
            self._gate = [
                d
                for i, d in enumerate(gate)
                if i > at or d[2] is not None or d[0].destination != topic
            ]

    def _send_retained_waiting(self) -> None:
        """Retained QoS 1/2 messages go out while the client's receive maximum has room
        (MQTT-3.3.4-9); the rest wait for acknowledgements."""
        if not self._retained_waiting or self.state is None:
            return
        pending = len(self.state.pubrel_out)
        while self._retained_waiting and len(self._inflight) + pending < self._window:
            if self.closing:
                return
            msg, qos, sub_ids = self._retained_waiting.popleft()
            sent = len(self._inflight)
            self._transmit(msg, None, None, qos, False, True, sub_ids)
            self._retained_out += len(self._inflight) - sent
        self._resize_windows()
        if self._held_out:  # QoS 0 messages that waited behind those may go
            self._send_held_out()

    def _check_filter(self, pattern: str) -> int | None:
        """None if `pattern` may be subscribed, else the SUBACK failure code."""
        if not _valid_filter(pattern):
            return ReasonCode.TOPIC_FILTER_INVALID
        shared = shared_filter(pattern)
        topic_filter = pattern if shared is None else shared[1]
        if (
            not self.topics.may_subscribe(topic_filter)
            # a group's member takes its share of every topic the filter matches: one the
            # ACL denies it would be lost to the group, or wait on its queue for good
            or (shared is not None and not self.topics.may_route(topic_filter, MQTT))
            # the AMQP connections that made them alone read those
            or reaches_temporary_topics(topic_filter, MQTT)
        ):
            log.info("MQTT client %r may not subscribe to %r", self.client_id, pattern)
            return ReasonCode.NOT_AUTHORIZED
        return None

    async def _ensure_queue(self) -> str:
        """The client's queue, created (and bound) on the first QoS 1/2 subscription."""
        state = self.state
        assert state is not None
        if state.queue is None:
            state.queue = await self.registry.create_queue(state, self.access_user)
        if state.queue not in self._flows and not self.closing:
            await self._bind(state.queue)
        return state.queue

    async def _on_unsubscribe(self, p: Unsubscribe) -> None:
        state = self.state
        assert state is not None
        codes: list[int] = []
        from_queue: list[str] = []
        for pattern in p.topic_filters:
            options = state.subscriptions.get(pattern)
            if options is None:  # MQTT 5 §3.11.3: an invalid filter says so
                valid = _valid_filter(pattern)
                codes.append(
                    ReasonCode.NO_SUBSCRIPTION_EXISTED if valid else ReasonCode.TOPIC_FILTER_INVALID
                )
                continue
            codes.append(ReasonCode.SUCCESS)
            state.drop_subscription(pattern)
            if pattern in self._direct:
                self.broker.unsubscribe_direct(self._direct.pop(pattern))
            if shared_filter(pattern) is not None:
                await self._leave_shared(pattern)
            elif options.qos > 0:
                from_queue.append(pattern)
        if from_queue and state.queue is not None:
            await self.broker.unsubscribe_queue(
                state.queue, from_queue, MQTT, user=self.access_user
            )
        await self.registry.save(self)
        self._send(Unsuback(p.packet_id, codes))

    async def _leave_shared(self, pattern: str) -> None:
        """Unsubscribed: close our flow, then leave the group (the last member's leave
        deletes the group's queue)."""
        group = shared_filter(pattern)
        assert group is not None
        queue = shared_queue_name(*group)
        if self._shared.pop(queue, None) is not None:
            flow = self._flows.get(queue)
            if flow is not None:
                await self._close_flow(queue, flow)
            else:
                self._drop_held(queue)
        await self.registry.leave_shared(queue, self.client_id)

    # -- DISCONNECT and teardown -----------------------------------------------------------

    def _on_disconnect(self, p: Disconnect) -> None:
        state = self.state
        assert state is not None
        expiry = p.properties.session_expiry_interval if p.properties else None
        if expiry is not None:
            if state.expiry == 0 and expiry:  # MQTT 5 §3.14.2.2.2
                self.fail(ReasonCode.PROTOCOL_ERROR)
                return
            state.expiry = expiry
        if p.reason_code == ReasonCode.NORMAL_DISCONNECTION:  # MQTT-3.1.2-8: only it drops it
            self.will = None
        self.close()

    def fail(self, rc: int) -> None:
        """Close because of `rc`, telling a v5 client why (v3/v4 have no DISCONNECT)."""
        if self.closing:
            return
        if self.level == 5 and self.connected:
            self._send(Disconnect(rc if rc in _DISCONNECT_CODES else ReasonCode.PROTOCOL_ERROR))
        self.close()

    def close(self) -> None:
        if not self.closing:
            self._closing()
            self.link.close()

    def take_over(self) -> None:
        """Another connection (on any node) claims this client id: disconnect with 0x8E and
        leave the session's state in Redis to the new connection."""
        self.taken_over = True
        self.fail(ReasonCode.SESSION_TAKEN_OVER)

    def shutdown(self) -> None:
        self.fail(ReasonCode.SERVER_SHUTTING_DOWN)

    def connection_lost(self) -> None:
        """The transport is gone: release flows and subscriptions, then the registry decides
        about the will and the session's lifetime."""
        self._closing()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.registry.spawn(self._teardown())

    def _closing(self) -> None:
        """Nothing more goes to the client: the flows fetch no more (what they still hand
        over is given back, see `_deliver`)."""
        self.closing = True
        for flow in self._flows.values():
            flow.set_window(0)
        self._wake_drained()

    async def _teardown(self) -> None:
        try:
            if self._busy is not None:
                await asyncio.wait({self._busy})
            # QoS 2 ids are marked in Redis once spooled: let those land before the session
            # is handed on, so a resend on the next connection is known as a duplicate
            if self._unresolved:
                self._resolved = self.loop.create_future()
                await asyncio.wait({self._resolved}, timeout=CONNECT_TIMEOUT)
            for token in self._direct.values():
                self.broker.unsubscribe_direct(token)
            self._direct.clear()
            await self._keep_in_flight()
            if self._settle_when_saved or self._saving:  # their PUBREL ids stored, then
                # settled, before the flows close (which would give them back to the queue)
                with contextlib.suppress(StoreError):  # else they come back: no loss
                    if await self.registry.save(self):  # and a save still under way: this
                        self.saved(list(self._saving))  # one stored their ids too
            for queue, flow in list(self._flows.items()):
                await self._close_flow(queue, flow)
            if self.state is not None:
                await self.registry.detach(self)
        except StoreError as exc:  # what Redis did not take stays until a clean start ends it
            log.warning(
                "MQTT client %r: ending its connection in Redis failed: %s", self.client_id, exc
            )
        finally:
            if not self.detached.done():
                self.detached.set_result(None)

    async def _keep_in_flight(self) -> None:
        """Note the packet ids of the session queue's messages in flight, and store those
        in flight that no queue of the session keeps (`_kept`) in that queue: the next
        connection resends them with these ids. A shared group's QoS 2 message in flight
        is taken from the group: it goes to this client alone (MQTT-4.8.2-4), and to no
        one once the session ends (MQTT-4.8.2-5); its QoS 1 ones go to other members.
        Retained messages waiting for room are stored after them: messages pending
        transmission are session state (§4.1)."""
        state = self.state
        if state is None:
            return
        kept = [(pid, msg, sub_ids, self._inflight[pid])
                for pid, (msg, sub_ids) in self._kept.items() if pid in self._inflight]  # fmt: skip
        if not state.persistent:
            for *_, (queue, entry_id, _) in kept:
                self._settle(queue, entry_id)
            return
        if state.queue is not None:  # the last connection's not resent yet stay too
            resend = _latest(state.resend_ids)
            resend.update(
                (entry_id, pid)
                for pid, (queue, entry_id, _) in self._inflight.items()
                if queue == state.queue and entry_id is not None
            )
            state.resend_ids = resend
            qos_of = _latest(state.resend_qos)
            qos_of.update(
                (entry_id, qos)
                for queue, entry_id, qos in self._inflight.values()
                if queue == state.queue and entry_id is not None
            )
            state.resend_qos = qos_of
        state.shared_in_flight = [[queue, entry_id] for queue, entry_id in self._sent_before]
        # routes of messages not seen again
        state.resend_shared = _latest(state.resend_shared)
        state.resend_retained = _latest(state.resend_retained)
        try:
            await self._store_in_flight(state, kept)
        except Exception as exc:  # the teardown goes on: those go as before
            log.warning("MQTT client %r: messages in flight not kept: %s", self.client_id, exc)

    async def _store_in_flight(
        self, state: SessionState, kept: list[tuple[int, Message, list[int], tuple[Any, ...]]]
    ) -> None:
        """Store `kept` (packet id, message, subscription ids, in-flight entry), then the
        retained messages waiting for room, in the session's queue, in that order, and note
        how each goes again: with its packet id if it was sent, a group's by that group's
        filter, a retained one (a copy: one message may match several subscriptions) as
        it went on SUBSCRIBE."""
        stored: list[tuple[Message, int | None, str | None, str | None, list[Any]]] = []
        for pid, msg, sub_ids, (queue, entry_id, qos) in kept:
            if queue is None:
                stored.append((_retained_copy(msg), pid, None, None, [qos, sub_ids]))
            elif queue in self._shared:  # else its group was left and had it back
                stored.append((msg, pid, queue, entry_id, [self._shared[queue]]))
        stored.extend((_retained_copy(msg), None, None, None, [qos, sub_ids])
                      for msg, qos, sub_ids in self._retained_waiting)  # fmt: skip
        self._retained_waiting.clear()
        if not stored:
            return
        if state.queue is None:
            state.queue = await self.registry.create_queue(state, self.access_user)
        outcomes = await asyncio.gather(
            *(self.broker.store_in(state.queue, msg) for msg, *_ in stored),
            return_exceptions=True,
        )
        for (msg, pid, queue, entry_id, route), outcome in zip(stored, outcomes, strict=True):
            if isinstance(outcome, BaseException) or not outcome.accepted:
                log.info("MQTT client %r: message in flight not kept: %s", self.client_id,
                         getattr(outcome, "name", outcome))  # fmt: skip
                continue
            if pid is not None:
                state.resend_ids[RESENT_BY_ID + msg.id] = pid
            if queue is None:
                state.resend_retained[msg.id] = route
            else:
                state.resend_shared[msg.id] = route[0]
                self._settle(queue, entry_id)

    def _send(self, packet: Packet) -> None:
        self.link.send(encode(packet, self.level))


def _latest(noted: dict[str, Any]) -> dict[str, Any]:
    """The last MAX_RESEND_IDS of `noted`: what earlier connections left for messages that
    did not come again goes first."""
    return dict(list(noted.items())[-MAX_RESEND_IDS:]) if len(noted) > MAX_RESEND_IDS else noted


def _retained_copy(msg: Message) -> Message:
    """A retained message to store for a resend, under an id of its own."""
    return replace(msg, id=new_message_id(), retain=True)


# What a connected session does with each packet a client may send (by exact class: the
# decoder makes no subclasses); a handler returns a coroutine when the packet needs Redis.
_HANDLERS: dict[type, Callable[[Session, Any], Coroutine[Any, Any, None] | None]] = {
    Publish: Session._on_publish,
    Puback: Session._on_puback,
    Pubrec: Session._on_pubrec,
    Pubrel: Session._on_pubrel,
    Pubcomp: Session._on_pubcomp,
    Subscribe: Session._on_subscribe,
    Unsubscribe: Session._on_unsubscribe,
    Pingreq: Session._on_pingreq,
    Disconnect: Session._on_disconnect,
}
