"""Link logic shared by both directions, addresses, and inbound links (client -> gateway).

Addresses: a bare name, ``queue://name`` or ``/queues/<name>`` (RabbitMQ 4) is a queue;
``topic://a/b`` is a topic (publish to it, or subscribe with a temporary queue); a bare name
is a topic when the terminus carries the Qpid JMS capability ``topic``.

Every proton object is touched only while ``host.closed`` and ``self.closed`` are false: a
publish outcome or a delivery from Redis can arrive after the link or the connection is gone.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote

from cproton import (
    PN_ACCEPTED,
    pn_delivery_aborted,
    pn_delivery_partial,
    pn_delivery_pending,
    pn_delivery_readable,
    pn_delivery_remote_state,
    pn_delivery_settle,
    pn_delivery_settled,
    pn_delivery_update,
    pn_link_advance,
    pn_link_credit,
    pn_link_flow,
)
from cproton_ffi import ffi, lib
from proton import Condition, Delivery, Disposition, Link, Terminus

from gateway.acl import TopicAccess
from gateway.broker import Broker, DeletionWatch, InDoubt, Outcome, QueueError
from gateway.engine.queues import subscription_queue
from gateway.model import TOPIC_ADDRESS, Publisher
from gateway.topics import TopicError, validate_topic
from protocols.amqp import mapping, sections
from protocols.amqp.nodes import DynamicNodes, Lifetime, LinkId, lifetime
from protocols.amqp.terminus import capabilities

if TYPE_CHECKING:  # outbound.py imports this module
    from protocols.amqp.outbound import Outbound

log = logging.getLogger(__name__)

_TOPIC = frozenset({"topic"})
TEMPORARY_TOPIC = "temporary-topic"  # a terminus capability (Qpid JMS)

CREDIT = 500  # credit granted to publishing clients
MAX_MESSAGE_SIZE = 16 * 1024 * 1024  # advertised on inbound links
# Bytes of unfinished (multi-frame) deliveries a connection's links may have proton hold
# at once: two of the largest messages. The session window does not bound them (and
# cannot: a delivery is read once complete), so the link whose delivery would pass this
# is ended with amqp:resource-limit-exceeded
PARTIAL_BYTES_MAX = 2 * MAX_MESSAGE_SIZE
RECEIVE_BUFFER_MAX = 64 * 1024  # larger deliveries are read through a buffer of their own

INTERNAL_ERROR = "amqp:internal-error"
NOT_FOUND = "amqp:not-found"
NOT_IMPLEMENTED = "amqp:not-implemented"
RESOURCE_DELETED = "amqp:resource-deleted"
RESOURCE_LIMIT = "amqp:resource-limit-exceeded"
MESSAGE_SIZE_EXCEEDED = "amqp:link:message-size-exceeded"
TRANSFER_LIMIT = "amqp:link:transfer-limit-exceeded"
# A transfer or disposition in a transaction (transactional-state, §4.5.5): no coordinator
# declares any, so each names an unknown one (§4.5.6)
TRANSACTIONAL_STATE = 0x34
UNKNOWN_TRANSACTION = "amqp:transaction:unknown-id"
NO_TRANSACTIONS = "transactions are not supported: no transaction has this id"
UNAUTHORIZED = "amqp:unauthorized-access"
INVALID_FIELD = "amqp:invalid-field"
REFUSALS = {
    Outcome.NOT_FOUND: NOT_FOUND,
    Outcome.TOO_LARGE: RESOURCE_LIMIT,
    Outcome.QUOTA_EXCEEDED: RESOURCE_LIMIT,
    Outcome.QUEUE_FULL: RESOURCE_LIMIT,
    Outcome.OUT_OF_MEMORY: RESOURCE_LIMIT,
    Outcome.INGRESS_DISABLED: "amqp:precondition-failed",
}


@dataclass(frozen=True, slots=True)
class Address:
    name: str
    is_queue: bool


def parse_address(
    address: str | None, capabilities: frozenset[str] = frozenset()
) -> Address | None:
    """The queue or topic an AMQP address names; None for a null or empty address."""
    if not address:
        return None
    if address.startswith("queue://"):
        return _checked(address[8:], True)
    if address.startswith("topic://"):
        return _checked(address[8:], False)
    if address.startswith("/queues/"):
        return _checked(unquote(address[8:]), True)
    topic = bool(capabilities & {"topic", TEMPORARY_TOPIC})
    return Address(address, not topic)


def _checked(name: str, is_queue: bool) -> Address | None:
    return Address(name, is_queue) if name else None


def _topic_refusal(address: Address) -> str | None:
    """Why no topic may be named so (over 65,535 UTF-8 bytes, U+0000: the router takes no
    such name), else None; a queue's name is the queue store's to judge."""
    if address.is_queue:
        return None
    try:
        validate_topic(address.name)
    except TopicError as exc:
        return str(exc)
    return None


class Host(Protocol):
    """What a link needs from its connection."""

    broker: Broker
    publisher: Publisher
    closed: bool
    user: str  # for queue permissions: the SASL user, or ANONYMOUS
    topics: TopicAccess  # the topic ACL's denials for that user
    connection_id: str  # for exclusive queues
    nodes: DynamicNodes
    writable: bool  # False while the socket's buffer is past its high-water mark
    partial_bytes: int  # in the links' unfinished deliveries (PARTIAL_BYTES_MAX)

    def wake(self) -> None: ...

    def watch_writes(self, endpoint: Outbound) -> None:
        """Call `endpoint.written()` after each write of proton's output, while it says
        it waits for more."""


class Endpoint:
    """State shared by both link directions."""

    def __init__(self, host: Host, link: Link) -> None:
        self.host = host
        self.link = link
        self.closed = False
        # done once its attach is served (and what a detach meanwhile left it bound released)
        self.attach_over: asyncio.Future[None] | None = None
        self.temporary: str | None = None  # queue created for this link
        self.lifetime = Lifetime.LINK  # of `temporary`: deleted with the link, or later
        self.dynamic = False  # `temporary` is a dynamic node (not a topic subscription's)
        self.counted: str | None = None  # delete-on-no-links node this link counts toward

    @property
    def live(self) -> bool:
        return not (self.closed or self.host.closed)

    def on_delivery(self, dlv: Any) -> None:
        """DELIVERY event on the C delivery `dlv` of this link (while the link is live)."""

    def detached(self) -> None:
        """The client detached the link, in the turn its detach is read."""

    def on_flow(self) -> None:
        """LINK_FLOW event: the client's flow frame changed this link's credit."""

    def set_writable(self, writable: bool) -> None:
        """The connection's socket backed up (False) or drained (True)."""

    def discard(self, dlv: Any) -> None:
        """DELIVERY event after we closed the link, before the client detached: settled, or
        proton would keep it (and the bytes of all the client sends on) until then."""
        pn_delivery_settle(dlv)

    def refuse(self, name: str, description: str) -> None:
        """Answer the attach with a null terminus (the client's target, or source) and a
        detach carrying the error, as the spec asks of a refused link."""
        if self.live:
            self.closed = True
            self.link.condition = Condition(name, description)
            self.open_unattached()
            self.link.close()
            self.host.wake()

    def open_unattached(self) -> None:
        """Answer the attach with a null terminus (the client's target, or source), as for
        a link refused, or detached by its client before it was answered (§2.6.3: each
        attach is answered by one, §2.6.6: then the detach by a detach)."""
        link = self.link
        (link.target if link.is_receiver else link.source).type = Terminus.UNSPECIFIED
        link.open()

    def fail(self, name: str, description: str | None = None) -> None:
        """End the attached link with an error (a detach with closed=true carrying it)."""
        if self.live:
            self.closed = True
            self.link.condition = Condition(name, description)
            self.link.close()
            self.host.wake()

    def suspend(self) -> None:
        """The client detached the link without closing it (it may resume it, §2.6.3): its
        delete-on-close node waits for that, or for the end of its session or connection
        (§3.5.10: the node goes once the link ceases to exist)."""
        if self.temporary is not None and self.dynamic and self.lifetime is Lifetime.LINK:
            self.host.nodes.suspend(self.temporary, self.link_id, self.link.session)
            self.temporary = None
        if self.counted is not None:
            self.host.nodes.suspend_link(self.counted, self.link_id, self.link.session)
            self.counted = None

    def resume(self, address: str) -> None:
        """An attach to `address`: if it resumes the suspended link that made the node at
        that address, the node is this link's again; a delete-on-no-links node counts it."""
        if self.host.nodes.resume(address, self.link_id):
            self.temporary, self.lifetime, self.dynamic = address, Lifetime.LINK, True
        self.count_toward(address)

    def count_toward(self, node: str) -> None:
        if self.host.nodes.link(node, self.link_id):
            self.counted = node

    @property
    def link_id(self) -> LinkId:
        """The link's name and role (§2.6.1: a sender and a receiver may share a name)."""
        return self.link.name, self.link.is_sender  # our sender: the client receives

    async def close(self, ended: bool = False) -> None:
        """Release what the link holds in the broker (the proton link is closed by the caller).
        `ended`: the client closed the link rather than detached it (durable state goes)."""
        self.closed = True
        if self.temporary is not None:
            name, self.temporary = self.temporary, None
            if self.lifetime is Lifetime.LINK:  # else with its last link or the connection
                await self.host.nodes.delete(name)
        if self.counted is not None:
            name, self.counted = self.counted, None
            await self.host.nodes.unlink(name)


class Inbound(Endpoint):
    """A link the client sends on: complete deliveries become broker publishes.

    A link whose target is a queue ends with amqp:resource-deleted once the queue is deleted
    (on any node): from then on its deliveries are refused with that error, not spooled,
    and the detach waits for the outcomes of those already spooling, so that each
    delivery the client sent is settled with what became of it."""

    def __init__(self, host: Host, link: Link) -> None:
        super().__init__(host, link)
        self.address: Address | None = None  # None: anonymous relay (per-message `to`)
        self.attached = False
        self.inflight = 0
        self.watch: DeletionWatch | None = None  # of the target's queue
        # the error the link ends with once the publishes in flight are answered (its queue
        # was deleted, or a delivery was over the size limit)
        self.ending: tuple[str, str] | None = None
        self._buffer: Any = ffi.NULL  # see _receive_buffer
        self._buffer_size = 0
        # rcv-settle-mode second (§2.6.12): outcomes go unsettled, and each delivery is
        # settled once the client settles it; the C deliveries answered until then
        self.second = False
        self._answered: set[Any] = set()
        # the unfinished delivery the link receives (at most one: a link's transfers are
        # of one delivery until it is complete), and its bytes in host.partial_bytes
        self._partial: Any = None
        self._partial_bytes = 0

    async def attach(self) -> None:
        link, broker = self.link, self.host.broker
        remote = link.remote_target
        if remote.type == Terminus.COORDINATOR:  # no coordinator: refused, not a relay (§4.2)
            self.refuse(NOT_IMPLEMENTED, "transactions are not supported")
            return
        reply_address: str | None = None
        if remote.dynamic and TEMPORARY_TOPIC in capabilities(remote):
            # a topic, which every sender reaches by its address (with topic://), and
            # this connection's receivers alone read (DynamicNodes.topics)
            self.address = Address(self.host.nodes.create_topic(), False)
            reply_address = TOPIC_ADDRESS + self.address.name
        elif remote.dynamic:
            self.lifetime, self.dynamic = lifetime(remote), True
            self.temporary = await self.host.nodes.create(self.lifetime)
            self.count_toward(self.temporary)
            self.address = Address(self.temporary, True)
            reply_address = self.temporary
        else:
            self.address = parse_address(remote.address, capabilities(remote))
            if remote.address and self.address is None:
                self.refuse(NOT_FOUND, f"invalid address {remote.address!r}")
                return
            if self.address is not None and self.address.is_queue:
                self.resume(self.address.name)
        queue = self.address.name if self.address and self.address.is_queue else None
        if self.address and queue is None and not self.host.topics.may_publish(self.address.name):
            self.refuse(UNAUTHORIZED, f"may not publish to topic {self.address.name!r}")
            return
        if queue is not None and subscription_queue(queue):
            self.refuse(UNAUTHORIZED, f"{queue!r} is filled by its subscriptions alone")
            return
        if queue is not None:
            try:
                self.watch = await broker.watch_deletion(queue, partial(self._deleted, queue))
            except QueueError:
                self.refuse(NOT_FOUND, f"queue {queue!r} does not exist")
                return
        if not self.live:
            return
        link.source.copy(link.remote_source)
        link.target.copy(remote)
        if reply_address is not None:
            link.target.address = reply_address
        link.max_message_size = MAX_MESSAGE_SIZE
        link.snd_settle_mode = link.remote_snd_settle_mode  # the client's, echoed (§2.7.3)
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        self.second = link.remote_rcv_settle_mode == Link.RCV_SECOND
        link.open()
        self.attached = True
        self._top_up()
        self.host.wake()

    def on_delivery(self, dlv: Any) -> None:
        """DELIVERY event on the C delivery `dlv` (read with cffi calls: proton's Delivery
        wrapper cost more than the rest of a publish): act once the delivery is complete (it
        may span many frames)."""
        if self._answered and dlv in self._answered:  # mode second: settled after the client
            if pn_delivery_settled(dlv):
                self._answered.discard(dlv)
                pn_delivery_settle(dlv)
                self._top_up()
            return
        if pn_delivery_aborted(dlv):
            self._drop_partial()
            pn_delivery_settle(dlv)
            self._top_up()
            return
        if not pn_delivery_readable(dlv):
            return
        size = pn_delivery_pending(dlv)
        if pn_delivery_partial(dlv):
            if self.ending:
                self._skip(dlv, size)
                return
            host = self.host
            host.partial_bytes += size - self._partial_bytes
            self._partial, self._partial_bytes = dlv, size
            if size > MAX_MESSAGE_SIZE:  # a link error, as the spec asks (§2.7.3)
                self._end(MESSAGE_SIZE_EXCEEDED, f"over {MAX_MESSAGE_SIZE} bytes")
            elif host.partial_bytes > PARTIAL_BYTES_MAX:
                why = f"the connection's unfinished deliveries passed {PARTIAL_BYTES_MAX} bytes"
                self._end(RESOURCE_LIMIT, why)
            if self.ending and self.live:
                self._skip(dlv, size)
            return
        if self._partial is not None:  # the last frame of a multi-frame delivery
            self._drop_partial()
        impl = self.link._impl
        buffer = self._buffer if size <= self._buffer_size else self._receive_buffer(size)
        got = lib.pn_link_recv(impl, buffer, size) if size else 0
        data = ffi.unpack(buffer, got) if got > 0 else b""
        pn_link_advance(impl)
        if not self.attached:  # sent before we granted credit
            self._settle(dlv, Disposition.REJECTED, "amqp:illegal-state", "link not attached")
        elif self.ending:  # the link ends once the publishes in flight are answered
            self._settle(dlv, Disposition.REJECTED, *self.ending)
        elif size > MAX_MESSAGE_SIZE:  # its last frame crossed the limit: as above
            why = f"over {MAX_MESSAGE_SIZE} bytes"
            self._settle(dlv, Disposition.REJECTED, MESSAGE_SIZE_EXCEEDED, why)
            self._end(MESSAGE_SIZE_EXCEEDED, why)
            return
        elif self._publish(dlv, data):
            return  # credit: the delivery used one, its publish holds one (see _top_up)
        self._top_up()

    def refuse(self, name: str, description: str) -> None:
        live = self.live
        super().refuse(name, description)
        self._drop_unfinished(live)

    def fail(self, name: str, description: str | None = None) -> None:
        live = self.live
        super().fail(name, description)
        self._drop_unfinished(live)

    def _drop_unfinished(self, live: bool) -> None:
        """The link was ended: its unfinished delivery, if any, is refused with its error,
        and proton drops its bytes and those the client sends on (rather than keep them
        until the client detaches)."""
        dlv = self._partial
        self._drop_partial()
        if live and dlv is not None:
            self.discard(dlv)

    def detached(self) -> None:
        self._drop_partial()  # freed with the link

    def _drop_partial(self) -> None:
        """The unfinished delivery leaves the connection's count (aborted, or dropped)."""
        if self._partial_bytes:
            self.host.partial_bytes -= self._partial_bytes
        self._partial, self._partial_bytes = None, 0

    def discard(self, dlv: Any) -> None:
        """Refused with the error the link was closed with: not stored (see Endpoint)."""
        if dlv in self._answered:  # its outcome stands
            self._answered.discard(dlv)
            pn_delivery_settle(dlv)
            return
        condition = self.link.condition
        if condition is None:
            condition = Condition("amqp:illegal-state", "the link is closed")
        self._settle(dlv, Disposition.REJECTED, condition.name, condition.description or "")

    def _skip(self, dlv: Any, size: int) -> None:
        """Read and drop the `size` bytes the unfinished `dlv` holds: the link ends once
        its publishes in flight are answered (which may wait on Redis), and the rest of a
        delivery it refuses is not kept meanwhile. `dlv` stays the unfinished one, so it is
        refused with the link's error when the link ends before it does."""
        impl = self.link._impl
        chunk = min(size, RECEIVE_BUFFER_MAX)
        buffer = self._buffer if chunk <= self._buffer_size else self._receive_buffer(chunk)
        while size > 0:
            got = lib.pn_link_recv(impl, buffer, min(size, self._buffer_size))
            if got <= 0:
                break
            size -= got
        self._drop_partial()
        self._partial = dlv

    def _receive_buffer(self, size: int) -> Any:
        """A buffer for a delivery of `size` bytes. The link keeps one (up to
        RECEIVE_BUFFER_MAX) rather than allocating one per message: a fresh zeroed cdata cost
        ~0.13 µs of each publish."""
        if size > RECEIVE_BUFFER_MAX:
            return ffi.new("char[]", size)
        self._buffer_size = max(1024, 1 << (size - 1).bit_length())
        self._buffer = ffi.new("char[]", self._buffer_size)
        return self._buffer

    def _publish(self, dlv: Any, data: bytes) -> bool:
        """Decode and publish; False when the delivery was refused (settled) instead."""
        if pn_link_credit(self.link._impl) < 0:  # proton counts it, but does not refuse it
            self.fail(TRANSFER_LIMIT, "a transfer sent without link credit")
            self.discard(dlv)
            return False
        if pn_delivery_remote_state(dlv) == TRANSACTIONAL_STATE:  # not stored outside it
            self._settle(dlv, Disposition.REJECTED, UNKNOWN_TRANSACTION, NO_TRANSACTIONS)
            return False
        try:
            ingress = mapping.decode(data, self.host.publisher)
        except mapping.BodyError as exc:
            self._settle(dlv, Disposition.REJECTED, exc.condition, str(exc))
            return False
        address = self.address
        if address is None:  # the anonymous relay
            topic = _TOPIC if ingress.jms_dest in sections.JMS_TOPICS else frozenset()
            address = parse_address(ingress.to, topic)
            if address is None:
                self._settle(dlv, Disposition.REJECTED, NOT_FOUND, "message has no usable 'to'")
                return False
            refusal = _topic_refusal(address)
            if refusal:
                self._settle(dlv, Disposition.REJECTED, INVALID_FIELD, refusal)
                return False
            if not address.is_queue and not self.host.topics.may_publish(address.name):
                why = f"may not publish to topic {address.name!r}"
                self._settle(dlv, Disposition.REJECTED, UNAUTHORIZED, why)
                return False
            if address.is_queue and subscription_queue(address.name):
                why = f"{address.name!r} is filled by its subscriptions alone"
                self._settle(dlv, Disposition.REJECTED, UNAUTHORIZED, why)
                return False
        msg = ingress.message
        msg.destination, msg.to_queue = address.name, address.is_queue
        if ingress.to is None:
            sections.address_bare(msg)
        self.inflight += 1
        if pn_delivery_settled(dlv):  # pre-settled by the client: at most once, no outcome
            pn_delivery_settle(dlv)
            dlv = None
        self.host.broker.publish_nowait(msg, partial(self._published, dlv))
        return True

    def _published(self, dlv: Any, result: Outcome | BaseException) -> None:
        """The spool answered: settle the client's delivery (if it waits) and refill credit."""
        self.inflight -= 1
        outcome: Outcome | None = None
        if isinstance(result, BaseException):
            log.warning("AMQP publish failed: %s", result)
            if dlv is not None and result.__class__ is InDoubt and self.live:
                # not released (§3.4.4: not acted upon), which a client sends again: the
                # link ends with the delivery unsettled, in doubt, as it is
                self.fail(INTERNAL_ERROR, "the message store's answer was lost: it may be stored")
                return
        else:
            outcome = result
            if dlv is None and not outcome.accepted:
                log.info("pre-settled AMQP publish refused: %s", outcome.name)
        if self.closed or self.host.closed:
            return
        if dlv is not None:
            if outcome is None:  # not stored: released, so the client may send it again
                self._settle(dlv, Disposition.RELEASED)
            elif outcome.accepted:
                pn_delivery_update(dlv, PN_ACCEPTED)
                self._settled(dlv)
            else:
                self._settle(dlv, Disposition.REJECTED, REFUSALS[outcome], outcome.name)
        if self.ending and not self.inflight:
            self.fail(*self.ending)
        self._top_up()
        self.host.wake()

    def _deleted(self, queue: str) -> None:
        """The target's queue was deleted (they may have been stored before it went)."""
        self.watch = None
        self._end(RESOURCE_DELETED, f"queue {queue!r} was deleted")

    def _end(self, condition: str, description: str) -> None:
        """No more credit, and the link ends with this error once the publishes in flight
        have their outcomes: each delivery the client sent is settled with what became of
        it (one stored and left in doubt would be sent again)."""
        if self.live and self.ending is None:
            self.ending = (condition, description)
            if not self.inflight:
                self.fail(condition, description)

    def _settle(self, dlv: Any, state: int, condition: str = "", text: str = "") -> None:
        """Settle the C delivery `dlv` with `state` (a refusal's condition goes through
        proton's wrapper: rare, and it owns the condition's encoding)."""
        if condition:
            wrapper = Delivery.wrap(dlv)
            wrapper.local.condition = Condition(condition, text)
            wrapper.update(state)
        else:
            pn_delivery_update(dlv, state)
        self._settled(dlv)

    def _settled(self, dlv: Any) -> None:
        """Settle `dlv`, whose outcome is set: at once, or in rcv-settle-mode second once
        the client has settled it (on_delivery), which may already be the case, unless the
        link was ended (what a client sends on past that is refused and forgotten)."""
        if self.second and not self.closed and not pn_delivery_settled(dlv):
            self._answered.add(dlv)
        else:
            pn_delivery_settle(dlv)

    def _top_up(self) -> None:
        """Keep the client's credit near CREDIT minus the publishes still in flight, and,
        in rcv-settle-mode second, those answered that the client has not settled yet (each
        holds its bytes until then: a client that never settles would grow them for good)."""
        if self.closed or self.host.closed or self.ending:
            return
        impl = self.link._impl  # runs once a message: no wrapper
        credit = pn_link_credit(impl)
        missing = max(0, CREDIT - self.inflight - len(self._answered)) - credit
        if missing > 0 and (missing >= CREDIT // 4 or credit == 0):
            pn_link_flow(impl, missing)

    async def close(self, ended: bool = False) -> None:
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None
        await super().close(ended)
