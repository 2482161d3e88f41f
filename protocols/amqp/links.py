"""Link logic: addresses, inbound links (client -> gateway), outbound links (gateway -> client).

Addresses: a bare name, ``queue://name`` or ``/queues/<name>`` (RabbitMQ 4) is a queue;
``topic://a/b`` is a topic (publish to it, or subscribe with a temporary queue); a bare name
is a topic when the terminus carries the Qpid JMS capability ``topic``.

Every proton object is touched only while ``host.closed`` and ``self.closed`` are false: a
publish outcome or a delivery from Redis can arrive after the link or the connection is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass
from functools import partial
from typing import Protocol
from urllib.parse import unquote

from proton import Condition, Data, Delivery, Disposition, Link, Terminus

from gateway.broker import BindError, Broker, Flow, Outcome, QueueError
from gateway.model import Delivery as GatewayDelivery
from gateway.model import Publisher
from protocols.amqp import mapping

log = logging.getLogger(__name__)

CREDIT = 500  # credit granted to publishing clients
WINDOW = 500  # most unsettled deliveries per outbound link
MAX_MESSAGE_SIZE = 16 * 1024 * 1024  # advertised on inbound links
DRAIN_QUIET = 0.02  # seconds without a delivery after which a drain is answered

NOT_FOUND = "amqp:not-found"
RESOURCE_LIMIT = "amqp:resource-limit-exceeded"
REFUSALS = {
    Outcome.NOT_FOUND: NOT_FOUND,
    Outcome.TOO_LARGE: RESOURCE_LIMIT,
    Outcome.QUOTA_EXCEEDED: RESOURCE_LIMIT,
    Outcome.QUEUE_FULL: RESOURCE_LIMIT,
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
    topic = bool(capabilities & {"topic", "temporary-topic"})
    return Address(address, not topic)


def _checked(name: str, is_queue: bool) -> Address | None:
    return Address(name, is_queue) if name else None


def capabilities(terminus: Terminus) -> frozenset[str]:
    """The symbols of a terminus' capabilities (a single symbol or an array)."""
    data: Data = terminus.capabilities
    data.rewind()
    if not data.next():
        return frozenset()
    obj = data.get_object()
    values = obj.elements if hasattr(obj, "elements") else [obj]
    return frozenset(str(v) for v in values)


class Host(Protocol):
    """What a link needs from its connection."""

    broker: Broker
    publisher: Publisher
    closed: bool

    def wake(self) -> None: ...


class Endpoint:
    """State shared by both link directions."""

    def __init__(self, host: Host, link: Link) -> None:
        self.host = host
        self.link = link
        self.closed = False
        self.temporary: str | None = None  # queue created for this link, deleted with it

    @property
    def live(self) -> bool:
        return not (self.closed or self.host.closed)

    def refuse(self, name: str, description: str) -> None:
        """Answer the attach with a null terminus and a detach carrying the error."""
        if self.live:
            self.closed = True
            self.link.condition = Condition(name, description)
            self.link.open()
            self.link.close()
            self.host.wake()

    async def close(self) -> None:
        """Release what the link holds in the broker (the proton link is closed by the caller)."""
        self.closed = True
        if self.temporary is not None:
            name, self.temporary = self.temporary, None
            with contextlib.suppress(QueueError):
                await self.host.broker.delete_queue(name)


class Inbound(Endpoint):
    """A link the client sends on: complete deliveries become broker publishes."""

    def __init__(self, host: Host, link: Link) -> None:
        super().__init__(host, link)
        self.address: Address | None = None  # None: anonymous relay (per-message `to`)
        self.attached = False
        self.inflight = 0

    async def attach(self) -> None:
        link, broker = self.link, self.host.broker
        remote = link.remote_target
        if remote.dynamic:
            self.temporary = await broker.create_temporary_queue(owner=self.host.publisher.user)
            self.address = Address(self.temporary, True)
        else:
            self.address = parse_address(remote.address, capabilities(remote))
            if remote.address and self.address is None:
                self.refuse(NOT_FOUND, f"invalid address {remote.address!r}")
                return
            queue = self.address.name if self.address and self.address.is_queue else None
            if queue is not None and not await broker.queues.exists(queue):
                self.refuse(NOT_FOUND, f"queue {queue!r} does not exist")
                return
        if not self.live:
            return
        link.source.copy(link.remote_source)
        link.target.copy(remote)
        if self.temporary is not None:
            link.target.address = self.temporary
        link.max_message_size = MAX_MESSAGE_SIZE
        link.open()
        self.attached = True
        self._top_up()
        self.host.wake()

    def on_delivery(self, dlv: Delivery) -> None:
        """DELIVERY event: act once the delivery is complete (it may span many frames)."""
        link = self.link
        if dlv.aborted:
            dlv.settle()
            self._top_up()
            return
        if not dlv.readable:
            return
        if dlv.partial:
            if dlv.pending > MAX_MESSAGE_SIZE:  # a link error, as the spec asks
                self.closed = True
                link.condition = Condition("amqp:link:message-size-exceeded")
                link.close()
            return
        data = link.recv(dlv.pending) or b""
        link.advance()
        if not self.attached:  # sent before we granted credit
            self._settle(dlv, Disposition.REJECTED, "amqp:illegal-state", "link not attached")
        elif len(data) > MAX_MESSAGE_SIZE:
            self._settle(dlv, Disposition.REJECTED, RESOURCE_LIMIT, "message too large")
        else:
            self._publish(dlv, data)
        self._top_up()

    def _publish(self, dlv: Delivery, data: bytes) -> None:
        try:
            ingress = mapping.decode(data, self.host.publisher)
        except mapping.BodyError as exc:
            self._settle(dlv, Disposition.REJECTED, "amqp:decode-error", str(exc))
            return
        topic = frozenset({"topic"}) if ingress.jms_dest in (1, 3) else frozenset()
        address = self.address or parse_address(ingress.to, topic)
        if address is None:
            self._settle(dlv, Disposition.REJECTED, NOT_FOUND, "message has no usable 'to'")
            return
        msg = ingress.message
        msg.destination, msg.to_queue = address.name, address.is_queue
        fut = self.host.broker.publish_nowait(msg)
        self.inflight += 1
        if dlv.settled:  # pre-settled by the client: at most once, no outcome to report
            dlv.settle()
            fut.add_done_callback(partial(self._published, None))
        else:
            fut.add_done_callback(partial(self._published, dlv))

    def _published(self, dlv: Delivery | None, fut: asyncio.Future[Outcome]) -> None:
        """The spool answered: settle the client's delivery (if it waits) and refill credit."""
        self.inflight -= 1
        failed = fut.cancelled() or fut.exception() is not None
        if failed:
            log.warning("AMQP publish failed: %s", fut.exception() if not fut.cancelled() else "")
        elif dlv is None and not fut.result().accepted:
            log.info("pre-settled AMQP publish refused: %s", fut.result().name)
        if not self.live:
            return
        if dlv is not None:
            if failed:  # not stored: released, so the client may send it again
                self._settle(dlv, Disposition.RELEASED)
            elif fut.result().accepted:
                self._settle(dlv, Disposition.ACCEPTED)
            else:
                outcome = fut.result()
                self._settle(dlv, Disposition.REJECTED, REFUSALS[outcome], outcome.name)
        self._top_up()
        self.host.wake()

    @staticmethod
    def _settle(dlv: Delivery, state: int, condition: str = "", text: str = "") -> None:
        if condition:
            dlv.local.condition = Condition(condition, text)
        dlv.update(state)
        dlv.settle()

    def _top_up(self) -> None:
        """Keep the client's credit near CREDIT minus the publishes still in flight."""
        if not self.live:
            return
        target = max(0, CREDIT - self.inflight)
        missing = target - self.link.credit
        if missing > 0 and (missing >= CREDIT // 4 or self.link.credit == 0):
            self.link.flow(missing)


class Outbound(Endpoint):
    """A link the client receives on: a broker flow whose credit is the link credit."""

    def __init__(self, host: Host, link: Link) -> None:
        super().__init__(host, link)
        self.flow: Flow | None = None
        self.presettled = False
        self.unsettled: dict[str, str] = {}  # delivery tag -> stream entry id
        self._tags = itertools.count(1)
        self._sent_since_check = False
        self._drain_timer: asyncio.TimerHandle | None = None

    async def attach(self) -> None:
        link, broker = self.link, self.host.broker
        remote = link.remote_source
        if remote.dynamic:
            self.temporary = await broker.create_temporary_queue(owner=self.host.publisher.user)
            queue = self.temporary
        else:
            address = parse_address(remote.address, capabilities(remote))
            if address is None:
                self.refuse(NOT_FOUND, f"invalid source address {remote.address!r}")
                return
            queue = address.name
            if address.is_queue and remote.distribution_mode == Terminus.DIST_MODE_COPY:
                self.refuse("amqp:not-implemented", "browsing (distribution-mode copy)")
                return
            if not address.is_queue:
                self.temporary = await broker.create_temporary_queue(
                    owner=self.host.publisher.user, subscriptions=[(address.name, "smf")]
                )
                queue = self.temporary
        if not self.live:
            return
        try:
            flow = await broker.bind(
                queue, self._on_deliver, window=WINDOW, credit=0, on_closed=self._on_flow_closed
            )
        except BindError as exc:
            code = NOT_FOUND if exc.code == "not_found" else "amqp:precondition-failed"
            self.refuse(code, str(exc))
            return
        self.flow = flow
        if not self.live:
            return  # the caller's close() unbinds it
        link.source.copy(remote)
        link.source.filter.clear()  # selectors are not applied: say so, as the spec asks
        link.target.copy(link.remote_target)
        if self.temporary is not None and remote.dynamic:
            link.source.address = self.temporary
        self.presettled = link.remote_snd_settle_mode == Link.SND_SETTLED
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.open()
        self.on_flow()
        self.host.wake()

    def _on_flow_closed(self, reason: str) -> None:
        if self.live:
            self.closed = True
            self.link.condition = Condition("amqp:resource-deleted", reason)
            self.link.close()
            self.host.wake()

    def _on_deliver(self, delivery: GatewayDelivery) -> None:
        if not self.live or self.flow is None:
            return  # unsettled in the flow: redelivered once the flow closes
        link, flow = self.link, self.flow
        body = mapping.from_delivery(delivery).encode()
        limit = link.remote_max_message_size
        if limit and len(body) > limit:
            log.warning(
                "message %s exceeds the client's max-message-size; rejected", delivery.entry_id
            )
            flow.reject(delivery.entry_id)
            return
        tag = str(next(self._tags))
        dlv = link.delivery(tag)
        link.send(body)
        link.advance()
        self._sent_since_check = True
        if self.presettled:
            dlv.settle()
            flow.ack(delivery.entry_id)
        else:
            self.unsettled[tag] = delivery.entry_id
        self.host.wake()

    def on_flow(self) -> None:
        """FLOW event: the link credit is the flow's credit; answer a drain when idle."""
        if not self.live or self.flow is None:
            return
        self.flow.set_credit(max(0, self.link.credit))
        if self.link.drain_mode and self.link.credit > 0 and self._drain_timer is None:
            self._sent_since_check = False
            self._drain_timer = asyncio.get_running_loop().call_later(DRAIN_QUIET, self._drain)

    def _drain(self) -> None:
        self._drain_timer = None
        if not self.live or self.flow is None or not self.link.drain_mode:
            return
        if self._sent_since_check and self.link.credit > 0:  # still delivering: wait more
            self._sent_since_check = False
            self._drain_timer = asyncio.get_running_loop().call_later(DRAIN_QUIET, self._drain)
            return
        self.link.drained()
        self.flow.set_credit(0)
        self.host.wake()

    def on_disposition(self, dlv: Delivery) -> None:
        """DELIVERY event on our sender: the client's outcome for one message."""
        if self.flow is None or not (dlv.settled or dlv.remote_state):
            return
        entry_id = self.unsettled.pop(dlv.tag, None)
        state = dlv.remote_state
        if entry_id is not None:
            if state == Disposition.REJECTED:
                self.flow.reject(entry_id)
            elif state in (Disposition.RELEASED, Disposition.MODIFIED):
                self.flow.requeue(entry_id)
            else:  # accepted, or settled with no outcome
                self.flow.ack(entry_id)
        dlv.settle()

    async def close(self) -> None:
        self.closed = True
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        if self.flow is not None:
            flow, self.flow = self.flow, None
            await flow.close()
        await super().close()
