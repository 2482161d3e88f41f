"""Outbound links (gateway -> client): a broker flow whose credit is the link credit.

The source decides what the flow is: a queue (optionally browsed with distribution-mode
``copy``, optionally filtered by a JMS selector), a topic (a temporary queue subscribed to
it, or, for a durable source with a link name, the durable subscription queue of that
container id + link name: kept when the link detaches, deleted when the client closes it),
or a dynamic source (a temporary queue with a generated name, see nodes.py). A source with
capability ``shared`` names a subscription several links consume from (see
terminus.Subscription): durable, it outlives them; non-durable, it goes with the last.

A topic subscription's selector is its queue's subscription selector, applied when a
message is spooled (Solace topic endpoints), so messages it does not select never pile up,
while a durable subscriber is away or behind a temporary one's; attaching a durable one
with another selector (or topic) replaces the subscription, as JMS requires. A
``gateway:replay-period`` filter (milliseconds) limits a browser to the messages of that
last period plus new ones (see terminus.py).

Every bind and queue change is made as the connection's user and connection id, so queue
ownership and permissions (a durable subscription is its user's alone) and exclusive queues
hold: refusals are ``amqp:unauthorized-access`` and ``amqp:resource-locked``.

Drain is exact: the flow reports when a fetch finds nothing more (`on_empty`), and only
then is the unused credit handed back.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
from typing import Any

from cproton import (
    PN_ACCEPTED,
    PN_MODIFIED,
    PN_REJECTED,
    PN_RELEASED,
    pn_delivery_remote,
    pn_delivery_remote_state,
    pn_delivery_settle,
    pn_delivery_settled,
    pn_disposition_is_failed,
    pn_disposition_is_undeliverable,
    pn_link_advance,
    pn_link_credit,
    pn_link_get_drain,
    pn_link_queued,
    pn_link_remote_max_message_size,
)
from cproton_ffi import ffi, lib
from proton import Link, Terminus

from gateway.acl import TopicAccess
from gateway.broker import BindError, Flow, QueueConfig, QueueError
from gateway.engine.queues import ADAPTER_QUEUE_MESSAGE_SIZE, subscription_queue
from gateway.engine.selection import matches, redelivery_selector
from gateway.model import Delivery as GatewayDelivery
from gateway.model import Message
from gateway.selectors import Selector
from gateway.topics import SMF, reaches_temporary_topics
from protocols.amqp import mapping, nodes, sections, terminus
from protocols.amqp.links import (
    INVALID_FIELD,
    NO_TRANSACTIONS,
    NOT_FOUND,
    NOT_IMPLEMENTED,
    TRANSACTIONAL_STATE,
    UNAUTHORIZED,
    UNKNOWN_TRANSACTION,
    Endpoint,
    Host,
    parse_address,
)

log = logging.getLogger(__name__)

_Tag = tuple[Any, Any, Any]  # a pn_delivery_tag_t, the cffi memory it is in and points to

# The link credit is the window (§2.6.7), up to the queue's max_delivered_unacked_msgs_per_flow
# (a fixed 500 stalled a client that settles in bigger batches than that)
WINDOW = 2**32 - 1
# New delivery tags: never one an earlier attachment of a link used, on this node or another,
# which its client may still hold unsettled when it resumes the link (§2.6.12)
_TAG_PREFIX = os.urandom(4).hex().encode()
_TAGS = itertools.count(1)
_OUTCOMES = frozenset({PN_ACCEPTED, PN_REJECTED, PN_RELEASED, PN_MODIFIED})  # terminal states

NOT_ALLOWED = "amqp:not-allowed"
ATTACH_REFUSALS = {
    "unauthorized": UNAUTHORIZED,
    "invalid": INVALID_FIELD,
    "resource_locked": "amqp:resource-locked",
    "precondition_failed": "amqp:precondition-failed",
}
BIND_REFUSALS = {
    "not_found": NOT_FOUND,
    "invalid_selector": INVALID_FIELD,
    "unsupported": NOT_IMPLEMENTED,
    "unauthorized": UNAUTHORIZED,
    "resource_locked": "amqp:resource-locked",
}


class Outbound(Endpoint):
    """A link the client receives on."""

    def __init__(self, host: Host, link: Link) -> None:
        super().__init__(host, link)
        self.flow: Flow | None = None
        self.presettled = False
        # entry ids of pre-settled deliveries proton may not have written yet, in order:
        # acked once written (at most once), given back if the link closes before
        self._presettled: collections.deque[str] = collections.deque()
        self._given_back = False  # what proton held at the detach went back (see detached)
        self.max_message_size = 0  # the client's, from its attach (0: no limit)
        self.durable: str | None = None  # durable subscription queue, deleted on link close
        self.shared = False  # a shared subscription's: deleted once no other link consumes
        self.sole_consumer = False  # its queue is its own topic subscription's, named to no one
        # C delivery -> (stream entry id, its tag) (cffi pointers hash by address; proton
        # reuses a delivery's memory only once it is settled, and then it has left this dict)
        self.unsettled: dict[Any, tuple[str, _Tag]] = {}
        # Tags of settled deliveries, for new ones: a tag must be unique only among the
        # link's unsettled deliveries, and making one costs ~0.35 µs of a ~0.8 µs send.
        self._free_tags: list[_Tag] = []
        # a topic subscription's user's topic ACL, when it denies topics a broader filter
        # may match: their messages are consumed unseen
        self._acl: TopicAccess | None = None
        self._draining = False  # the client asked for a drain not answered yet
        self._drain_held = False  # answered once proton holds none of the link's deliveries
        self._sent = 0  # deliveries sent on the link (see _link_credit)
        # a topic subscription's selector naming JMSXDeliveryCount, checked at delivery too
        self._recheck: Selector | None = None
        # JMS no-local: the container id whose own messages this topic subscriber skips
        self._no_local: str | None = None

    async def attach(self) -> None:
        link, broker = self.link, self.host.broker
        remote = link.remote_source
        selector = terminus.selector(remote)  # these raise InvalidField: see _run_attach
        replay = terminus.replay_period(remote)
        no_local = terminus.no_local(remote)
        try:
            source = await self._source(remote, selector)
        except QueueError as exc:
            if exc.code not in ATTACH_REFUSALS:
                raise
            # another user's durable subscription, one in use by another link, one shared
            # where the link asks for an unshared one (or the other way round), or a
            # selector its queue cannot take: the subscription stays as it is
            self.refuse(ATTACH_REFUSALS[exc.code], str(exc))
            self.durable = None
            return
        if source is None or not self.live:
            if source is not None:
                await self._leave_unconsumed(source[0])
            return
        queue, browse, topic = source
        # a subscription's queue (a durable one looked up holds whatever it was subscribed
        # to, its topics since removed too)
        if (topic is not None or subscription_queue(queue)) and self.host.topics.deny_subscribe:
            self._acl = self.host.topics
        if topic is None:
            no_local = None  # a queue's consumer: every sender's messages are its own too
        elif no_local is not None:
            self._no_local = self.host.publisher.client_id
        # a topic subscription's queue applies the selector itself, at spool time; this link
        # again at each delivery if it names what a redelivery changes (see _on_deliver)
        spool_selected = topic is not None and bool(remote.address)
        if spool_selected and selector is not None:
            self._recheck = redelivery_selector(selector.text)
        try:
            flow = await broker.bind(
                queue,
                self._on_deliver,
                window=WINDOW if self.host.writable else 0,
                credit=0,
                on_closed=self._on_flow_closed,
                selector=selector.text if selector and not spool_selected else None,
                browse=browse,
                replay_ms=replay.ms if replay else 0,
                user=self.host.user,
                connection=self.host.connection_id,
            )
        except BindError as exc:
            self.refuse(BIND_REFUSALS.get(exc.code, "amqp:precondition-failed"), str(exc))
            if exc.code == "invalid_selector" and self.durable is not None:
                await self.close(ended=True)  # JMS: no subscription with a bad selector
            await self._leave_unconsumed(queue)
            self.durable = None  # not this link's: closing it must not delete the queue
            return
        self.flow = flow
        flow.on_empty = self._on_empty
        self.set_writable(self.host.writable)  # it may have changed during the bind
        if not self.live:
            return  # the caller's close() unbinds it
        applied = [
            f for f in (selector, replay if flow.browse else None, no_local) if f is not None
        ]
        self._answer(remote, applied, topic, flow.browse)
        self.presettled = link.remote_snd_settle_mode == Link.SND_SETTLED
        # the client's attach set it, once: read per delivery it cost a cffi call each
        self.max_message_size = pn_link_remote_max_message_size(link._impl)
        link.snd_settle_mode = link.remote_snd_settle_mode  # both as asked (§2.7.3): it
        link.rcv_settle_mode = link.remote_rcv_settle_mode  # settles after the outcome
        link.open()
        self.on_flow()
        self.host.wake()

    async def _source(
        self, remote: Terminus, selector: terminus.SelectorFilter | None
    ) -> tuple[str, bool, str | None] | None:
        """(queue, browse, topic subscribed) for the client's source; None when refused."""
        if remote.dynamic:
            self.lifetime, self.dynamic = nodes.lifetime(remote), True
            self.temporary = await self.host.nodes.create(self.lifetime)
            self.count_toward(self.temporary)
            return self.temporary, False, None
        if not remote.address:
            return await self._existing_subscription()
        address = parse_address(remote.address, terminus.capabilities(remote))
        if address is None:
            self.refuse(NOT_FOUND, f"invalid source address {remote.address!r}")
            return None
        if address.is_queue:
            if subscription_queue(address.name):  # its adapter holds readers to the ACL
                self.refuse(UNAUTHORIZED, f"{address.name!r} is read by its subscriber alone")
                return None
            self.resume(address.name)
            return address.name, remote.distribution_mode == Terminus.DIST_MODE_COPY, None
        caps, durable = terminus.capabilities(remote), terminus.is_durable(remote)
        if reaches_temporary_topics(address.name, SMF):
            if address.name not in self.host.nodes.topics:
                why = f"{address.name!r} is not a temporary topic of this connection"
                self.refuse(ATTACH_REFUSALS["resource_locked"], why)
                return None
            if durable:  # JMS: none on a temporary topic; it would outlive the topic
                self.refuse(NOT_ALLOWED, "a temporary topic has no durable subscriptions")
                return None
        if not self.host.topics.may_subscribe(address.name):
            self.refuse(UNAUTHORIZED, f"may not subscribe to topic {address.name!r}")
            return None
        sub = terminus.subscription(self.host.publisher.client_id, self.link.name, caps)
        if self.link.name and (durable or sub.shared):
            name = await self._subscription(sub, durable, address.name, selector)
            self.shared = sub.shared
            if durable:
                self.durable = name
            return name, False, address.name
        self.temporary = await self.host.nodes.create(
            nodes.Lifetime.LINK,
            subscriptions=[(address.name, "smf")],
            selector=selector.text if selector else "",
        )
        self.sole_consumer = True
        return self.temporary, False, address.name

    async def _leave_unconsumed(self, queue: str) -> None:
        """An attach that ended before its link consumed (the client went, or the bind was
        refused): a shared non-durable subscription goes with its last link, and one no
        link consumes would go with none (its auto-delete needs a consumer to leave)."""
        if not self.shared or self.durable is not None:
            return
        broker = self.host.broker
        with contextlib.suppress(QueueError):  # gone meanwhile
            if not (await broker.queues.info(queue)).flows:
                await broker.delete_queue(queue, user=self.host.user)

    async def _existing_subscription(self) -> tuple[str, bool, str | None] | None:
        """A null source address names the durable subscription of this container id + link
        name (Qpid JMS looks a subscription up this way to unsubscribe: attach, then close)."""
        name = terminus.looked_up(self.host.publisher.client_id, self.link.name).queue(True)
        try:
            info = await self.host.broker.queues.info(name)
        except QueueError:
            self.refuse(NOT_FOUND, f"no durable subscription named {self.link.name!r}")
            return None
        await self._check_unused(name)
        self.durable = name
        return name, False, info.subscriptions[0][0] if info.subscriptions else None

    def _answer(
        self,
        remote: Terminus,
        filters: list[terminus.Filter],
        topic: str | None,
        browse: bool,
    ) -> None:
        """Our source: the client's, with what the gateway actually applies."""
        source = self.link.source
        source.copy(remote)
        source.type = Terminus.SOURCE  # proton reads a source without address as none
        terminus.echo(source, filters)
        if remote.dynamic:
            source.address = self.temporary
        elif not remote.address and topic is not None:
            source.address = f"topic://{topic}"
        if self.durable is not None:
            source.durability = Terminus.DELIVERIES
            source.expiry_policy = Terminus.EXPIRE_NEVER
        if browse:  # asked for, or a non-destructive queue: every consumer browses
            source.distribution_mode = Terminus.DIST_MODE_COPY
        elif self.durable is not None or self.shared:  # its links take what they get
            source.distribution_mode = Terminus.DIST_MODE_MOVE
        self.link.target.copy(self.link.remote_target)

    async def _subscription(
        self,
        sub: terminus.Subscription,
        durable: bool,
        topic: str,
        selector: terminus.SelectorFilter | None,
    ) -> str:
        """The queue of a durable or shared subscription, created on the first attach and
        resumed (or joined) later; a new topic or selector starts it afresh, as JMS
        requires, unless a link consumes from it. The selector filters at spool time
        (QueueError 'invalid' if bad). A shared non-durable one goes with its last link."""
        broker, user = self.host.broker, self.host.user
        name = sub.queue(durable)
        wanted = [(topic, "smf")]
        config = QueueConfig(
            name=name,
            durable=durable,
            auto_delete=not durable,
            # unshared: two attaches racing past _check_unused still have one consumer
            access_type="non-exclusive" if sub.shared else "exclusive",
            owner=user,
            permission="none",
            subscription_selector=selector.text if selector else "",
            max_message_size=ADAPTER_QUEUE_MESSAGE_SIZE,
        )
        config.validate(reserved_ok=True)  # a bad selector leaves the old subscription be
        try:
            info = await broker.queues.info(name)
        except QueueError:  # not_found: a new subscription
            info = None
        if info is not None:
            if sub.shared != (info.config.access_type != "exclusive"):
                kind = "an unshared" if sub.shared else "a shared"
                raise QueueError(  # JMS 2.0: createSharedDurableConsumer, createDurableConsumer
                    "precondition_failed", f"{self.link.name!r} names {kind} durable subscription"
                )
            same = info.config.subscription_selector == config.subscription_selector
            same = same and info.subscriptions == wanted
            if not (sub.shared and same):  # a shared one is joined
                await self._check_unused(name)
            if same:
                await broker.queues.lift_earlier_size_limit(name, info.config.max_message_size)
                return name  # the bind checks whose it is
            await broker.delete_queue(name, user=user)  # another user's: 'unauthorized'
        await broker.queues.create(config, reserved_ok=True)
        try:
            await broker.subscribe_queue(name, [topic], user=user)
        except QueueError:  # an invalid topic pattern: leave nothing behind
            await broker.delete_queue(name, user=user)
            raise
        return name

    async def _check_unused(self, name: str) -> None:
        """A durable subscription has one link at a time (§2.6.1: a link name names one
        link; JMS: an unshared durable subscription has one active consumer, and is neither
        changed nor removed while it has one): QueueError 'resource_locked' while another
        link consumes from it. A link of a crashed node is none: its client, reconnecting
        (to this node, or to the node started again), waits until it is released."""
        broker = self.host.broker

        async def flows() -> list[str]:
            return (await broker.queues.info(name)).flows

        if await broker.liveness.outlived(flows):
            raise QueueError(
                "resource_locked", f"durable subscription {self.link.name!r} is in use"
            )

    def _on_flow_closed(self, reason: str) -> None:
        self.fail("amqp:resource-deleted", reason)

    def _on_deliver(self, delivery: GatewayDelivery) -> None:
        flow = self.flow
        if flow is None:
            return  # unsettled in the flow: redelivered once the flow closes
        if not self.live:  # the link is going: given back as it was, never sent, and no
            flow.set_credit(0)  # more fetched until the flow closes
            flow.unsend(delivery.entry_id)
            return
        if flow.credit is not None and flow.credit < 0 and not flow.browse:
            # fetched as the client cut its credit (to 0, or drained): not sent (§2.6.7),
            # nor held from other consumers until the link goes. (A browser's cursor has
            # passed it: proton holds it for the browser's next credit.)
            flow.credit += 1
            flow.unsend(delivery.entry_id)
            return
        acl, recheck, local = self._acl, self._recheck, self._no_local
        msg = delivery.message
        if (
            (acl is not None and not acl.may_receive(msg.destination))
            or (recheck is not None and not matches(recheck, msg, delivery.delivery_count))
            or (local is not None and _published_by(msg, local))
        ):
            # consumed unseen: as MQTT's subscriptions skip a denied topic, as the
            # subscription holds only what its selector selects (a redelivery, say), and as
            # a JMS no-local subscriber gets no message of its own connection
            flow.ack(delivery.entry_id)
            if flow.credit is not None:
                flow.set_credit(flow.credit + 1)  # the client's credit was not spent
            return
        try:
            body = self._encode(delivery)
        except Exception:  # left unsettled it would come back on every close: reject it
            log.exception("message %s cannot be encoded as AMQP; rejected", delivery.entry_id)
            flow.reject(delivery.entry_id)
            return
        limit = self.max_message_size
        if limit and len(body) > limit:  # never sent (§2.7.3). Kept for another consumer,
            # each fetch of this link would look past it again (and a selector's window
            # fill with them): a single consumer with a small limit slowed all of Redis
            log.warning(
                "message %s exceeds the client's max-message-size; rejected", delivery.entry_id
            )
            flow.reject(delivery.entry_id)
            if flow.credit is not None:
                flow.set_credit(flow.credit + 1)  # the client's credit was not spent
            return
        impl = self.link._impl  # cffi calls: proton's wrappers cost more than the send
        tag = self._free_tags.pop() if self._free_tags else self._new_tag()
        dlv = lib.pn_delivery(impl, tag[0])
        lib.pn_link_send(impl, body, len(body))
        pn_link_advance(impl)
        self._sent += 1
        if self.presettled:
            pn_delivery_settle(dlv)
            self._free_tags.append(tag)
            if not self._presettled:
                self.host.watch_writes(self)
            self._presettled.append(delivery.entry_id)
        else:
            self.unsettled[dlv] = (delivery.entry_id, tag)
        if self._draining and (flow.full or not flow.credit):  # no more for this drain
            self._drained(flow)
        self.host.wake()

    def written(self) -> bool:
        """The connection wrote proton's output: ack the pre-settled deliveries it took
        (proton writes a link's deliveries in order, the last `queued` wait), and answer a
        drain held for them. Whether some still wait."""
        flow, waiting = self.flow, self._presettled
        held = pn_link_queued(self.link._impl)
        while len(waiting) > held:
            entry_id = waiting.popleft()
            if flow is not None:
                flow.ack(entry_id)
        if self._drain_held and not held:
            self._drain_held = False
            if self.live:
                self.link.drained()
                self.host.wake()  # the answer is output this pass has no turn left for
        return bool(waiting) or self._drain_held

    def detached(self) -> None:
        """The link is detached: deliveries proton still holds (no credit, or the client's
        session window shut) were never attempts (§3.2.1): they go back as they were,
        first deliveries still if they were; pre-settled ones are not lost. Proton writes
        a link's deliveries in order, so they are the last ones handed to it. Told at once,
        in the detach's turn: proton's next output pass may write them to a link the
        client has left."""
        flow = self.flow
        if flow is None or self._given_back:
            return
        self._given_back = True
        self.written()  # pre-settled ones written are acked; the rest wait in proton
        waiting, self._presettled = self._presettled, collections.deque()
        for entry_id in waiting:
            flow.unsend(entry_id)
        unsent = min(pn_link_queued(self.link._impl), len(self.unsettled))
        if unsent:
            for dlv in list(self.unsettled)[-unsent:]:
                entry_id, _ = self.unsettled.pop(dlv)
                flow.unsend(entry_id)

    def _new_tag(self) -> _Tag:
        raw = ffi.new("char[]", b"%s%x" % (_TAG_PREFIX, next(_TAGS)))
        cell = ffi.new("pn_delivery_tag_t *", (len(raw) - 1, raw))
        return cell[0], cell, raw  # the struct, and the memory it lives in and points to

    @staticmethod
    def _encode(delivery: GatewayDelivery) -> bytes:
        """The AMQP message bytes of one delivery: the fast encoder, else proton's."""
        try:
            return sections.encode(delivery)
        except sections.Unsupported:  # proton encodes into a bytearray
            return bytes(mapping.from_delivery(delivery).encode())

    def set_writable(self, writable: bool) -> None:
        """No fetching while the socket is backed up (AmqpConnection.pause_writing): the
        flow's window shuts, its credit stays the client's."""
        window = WINDOW if writable else 0
        if self.flow is not None and self.flow.window != window:
            self.flow.set_window(window)

    def on_flow(self) -> None:
        """FLOW event: the link credit is the flow's credit. A drain is answered when the
        flow finds nothing more, or at once when it cannot fetch at all (the queue's
        per-flow limit full, exclusive standby); not for a socket backed up for a while."""
        if not self.live or self.flow is None:
            return
        flow, impl = self.flow, self.link._impl  # one FLOW event per client flow frame
        self._drain_held = False  # this flow's credit stands in for that drain's
        credit = _link_credit(impl, self._sent)
        flow.set_credit(max(0, credit))
        self._draining = credit > 0 and bool(pn_link_get_drain(impl))
        if self._draining and (flow.full or not flow.active):
            self._drained(flow)

    def _on_empty(self) -> None:
        if self.live and self.flow is not None and self._draining:
            self._drained(self.flow)

    def _drained(self, flow: Flow) -> None:
        """Hand the unused credit back (delivery-count advances, credit 0), once proton
        holds none of the link's deliveries: the client's session window may hold some
        back, and proton answers a drain only when it writes the last of them, if told
        after (it was told before, and the answer never came)."""
        self._draining = False
        flow.set_credit(0)
        if pn_link_queued(self.link._impl):
            self._drain_held = True
            self.host.watch_writes(self)
        else:
            self.link.drained()
        self.host.wake()

    def on_delivery(self, dlv: Any) -> None:
        """DELIVERY event on our sender (`dlv` is the C delivery): the client's outcome for
        one message."""
        state = pn_delivery_remote_state(dlv)
        if state == TRANSACTIONAL_STATE:  # an outcome for when a transaction ends: none will
            self.fail(UNKNOWN_TRANSACTION, NO_TRANSACTIONS)  # unsettled, so redelivered
            return
        if self.flow is None or not (state in _OUTCOMES or pn_delivery_settled(dlv)):
            return  # e.g. received (§3.4.1): not an outcome, the delivery stays unsettled
        held = self.unsettled.pop(dlv, None)
        if held is not None:
            entry_id, tag = held
            self._free_tags.append(tag)
            if state == PN_ACCEPTED:
                self.flow.ack(entry_id)
            elif state == PN_REJECTED:
                self.flow.reject(entry_id)
            elif state == PN_MODIFIED:  # delivery-failed: the attempt counts (§3.4.5)
                remote = pn_delivery_remote(dlv)
                failed = pn_disposition_is_failed(remote)
                if pn_disposition_is_undeliverable(remote):  # not to this link again
                    self._undeliverable_here(entry_id, failed)
                elif failed:
                    self.flow.requeue(entry_id)
                else:
                    self.flow.release(entry_id)
            elif state == PN_RELEASED:
                self.flow.release(entry_id)  # delivery-count not incremented (§3.4.4)
            else:  # settled with no outcome
                self.flow.ack(entry_id)
        pn_delivery_settle(dlv)

    def _undeliverable_here(self, entry_id: str, failed: bool) -> None:
        """Not to this link again (§3.4.5): another consumer gets it (this link's fetches
        look past it meanwhile). But no other one may take an exclusive queue's messages,
        or a partition's, while this link holds it, nor those of a non-durable unshared
        topic subscription's queue: kept back, it waited while its successors overtook it
        (or piled up). It is rejected then (to the DMQ, if eligible), as RabbitMQ answers
        undeliverable-here on every queue."""
        flow = self.flow
        assert flow is not None
        if flow.exclusive or flow.partitioned or self.sole_consumer:
            flow.reject(entry_id)
        else:
            flow.avoid(entry_id, failed)

    async def close(self, ended: bool = False) -> None:
        self.closed = True
        if self.flow is not None:
            self.detached()  # if the connection went without a detach
            flow, self.flow = self.flow, None
            await flow.close()
        if ended and self.durable is not None:
            name, self.durable = self.durable, None
            with contextlib.suppress(QueueError):  # gone, or not this user's to delete
                if not (self.shared and (await self.host.broker.queues.info(name)).flows):
                    await self.host.broker.delete_queue(name, user=self.host.user)
        await super().close(ended)


def _link_credit(impl: Any, sent: int) -> int:
    """The link's credit, after the link sent `sent` deliveries. Proton keeps it in a C int,
    which a client's credit of 2^31 or more (a uint on the wire; Azure's clients grant
    2^32 - 1) wraps to a negative number. A negative one is also a client's flow that
    crossed deliveries in flight (§2.6.7: its delivery-count is behind, so the link has no
    credit): the two cannot be told apart but before anything was sent, or past what
    deliveries in flight could make, where it is a wrap."""
    credit = pn_link_credit(impl)
    if credit < 0 and (not sent or credit < -(1 << 30)):
        credit += 1 << 32
    return credit


def _published_by(msg: Message, container_id: str) -> bool:
    """Whether an AMQP connection of this container id published `msg` (JMS no-local: a
    container id is one JMS connection's client id)."""
    pub = msg.publisher
    return pub is not None and pub.protocol == "amqp" and pub.client_id == container_id
