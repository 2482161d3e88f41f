"""Outbound links (gateway -> client): a broker flow whose credit is the link credit.

The source decides what the flow is: a queue (optionally browsed with distribution-mode
``copy``, optionally filtered by a JMS selector), a topic (a temporary queue subscribed to
it, or, for a durable source with a link name, the durable subscription queue of that
container id + link name: kept when the link detaches, deleted when the client closes it),
or a dynamic source (a temporary queue with a generated name, see nodes.py).

Every bind and queue change is made as the connection's user and connection id, so queue
ownership and permissions (a durable subscription is its user's alone) and exclusive queues
hold: refusals are ``amqp:unauthorized-access`` and ``amqp:resource-locked``.

Drain is exact: the flow reports when a fetch finds nothing more (`on_empty`), and only
then is the unused credit handed back.
"""

from __future__ import annotations

import contextlib
import itertools
import logging

from proton import Condition, Delivery, Disposition, Link, Terminus

from gateway.broker import BindError, Flow, QueueConfig, QueueError
from gateway.model import Delivery as GatewayDelivery
from protocols.amqp import mapping, nodes, sections, terminus
from protocols.amqp.links import NOT_FOUND, Endpoint, Host, parse_address

log = logging.getLogger(__name__)

WINDOW = 500  # most unsettled deliveries per outbound link

UNAUTHORIZED = "amqp:unauthorized-access"
BIND_REFUSALS = {
    "not_found": NOT_FOUND,
    "invalid_selector": "amqp:invalid-field",
    "unsupported": "amqp:not-implemented",
    "unauthorized": UNAUTHORIZED,
    "resource_locked": "amqp:resource-locked",
}


class Outbound(Endpoint):
    """A link the client receives on."""

    def __init__(self, host: Host, link: Link) -> None:
        super().__init__(host, link)
        self.flow: Flow | None = None
        self.presettled = False
        self.durable: str | None = None  # durable subscription queue, deleted on link close
        self.unsettled: dict[str, str] = {}  # delivery tag -> stream entry id
        self._tags = itertools.count(1)

    async def attach(self) -> None:
        link, broker = self.link, self.host.broker
        remote = link.remote_source
        try:
            source = await self._source(remote)
        except QueueError as exc:
            if exc.code != "unauthorized":
                raise
            self.refuse(UNAUTHORIZED, str(exc))  # another user's durable subscription
            self.durable = None
            return
        if source is None or not self.live:
            return
        queue, browse, topic = source
        selector = terminus.selector(remote)
        try:
            flow = await broker.bind(
                queue,
                self._on_deliver,
                window=WINDOW,
                credit=0,
                on_closed=self._on_flow_closed,
                selector=selector.text if selector else None,
                browse=browse,
                user=self.host.user,
                connection=self.host.connection_id,
            )
        except BindError as exc:
            self.refuse(BIND_REFUSALS.get(exc.code, "amqp:precondition-failed"), str(exc))
            if exc.code == "invalid_selector" and self.durable is not None:
                await self.close(ended=True)  # JMS: no subscription with a bad selector
            self.durable = None  # not this link's: closing it must not delete the queue
            return
        self.flow = flow
        flow.on_empty = self._on_empty
        if not self.live:
            return  # the caller's close() unbinds it
        self._answer(remote, selector, topic, flow.browse)
        self.presettled = link.remote_snd_settle_mode == Link.SND_SETTLED
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.open()
        self.on_flow()
        self.host.wake()

    async def _source(self, remote: Terminus) -> tuple[str, bool, str | None] | None:
        """(queue, browse, topic subscribed) for the client's source; None when refused."""
        if remote.dynamic:
            self.lifetime = nodes.lifetime(remote)
            self.temporary = await self.host.nodes.create(self.lifetime)
            return self.temporary, False, None
        if not remote.address:
            return await self._existing_subscription()
        address = parse_address(remote.address, terminus.capabilities(remote))
        if address is None:
            self.refuse(NOT_FOUND, f"invalid source address {remote.address!r}")
            return None
        if address.is_queue:
            return address.name, remote.distribution_mode == Terminus.DIST_MODE_COPY, None
        if terminus.is_durable(remote) and self.link.name:
            self.durable = await self._subscription(address.name)
            return self.durable, False, address.name
        self.temporary = await self.host.nodes.create(
            nodes.Lifetime.LINK, subscriptions=[(address.name, "smf")]
        )
        return self.temporary, False, address.name

    async def _existing_subscription(self) -> tuple[str, bool, str | None] | None:
        """A null source address names the durable subscription of this container id + link
        name (Qpid JMS looks a subscription up this way to unsubscribe: attach, then close)."""
        name = terminus.durable_queue_name(self.host.publisher.client_id, self.link.name)
        try:
            info = await self.host.broker.queues.info(name)
        except QueueError:
            self.refuse(NOT_FOUND, f"no durable subscription named {self.link.name!r}")
            return None
        self.durable = name
        return name, False, info.subscriptions[0][0] if info.subscriptions else None

    def _answer(
        self,
        remote: Terminus,
        selector: terminus.SelectorFilter | None,
        topic: str | None,
        browse: bool,
    ) -> None:
        """Our source: the client's, with what the gateway actually applies."""
        source = self.link.source
        source.copy(remote)
        source.type = Terminus.SOURCE  # proton reads a source without address as none
        source.filter.clear()
        if selector is not None:
            selector.echo(source)
        if remote.dynamic:
            source.address = self.temporary
        elif not remote.address and topic is not None:
            source.address = f"topic://{topic}"
        if self.durable is not None:
            source.durability = Terminus.DELIVERIES
            source.expiry_policy = Terminus.EXPIRE_NEVER
        if browse:  # asked for, or a non-destructive queue: every consumer browses
            source.distribution_mode = Terminus.DIST_MODE_COPY
        self.link.target.copy(self.link.remote_target)

    async def _subscription(self, topic: str) -> str:
        """The durable subscription queue of this container id + link name, created on the
        first attach and resumed later; a new topic starts it afresh, as JMS requires."""
        broker, user = self.host.broker, self.host.user
        name = terminus.durable_queue_name(self.host.publisher.client_id, self.link.name)
        wanted = [(topic, "smf")]
        try:
            info = await broker.queues.info(name)
        except QueueError:  # not_found: a new subscription
            info = None
        if info is not None:
            if info.subscriptions == wanted:
                return name  # the bind checks whose it is
            await broker.delete_queue(name, user=user)  # another user's: 'unauthorized'
        config = QueueConfig(name=name, durable=True, owner=user, permission="none")
        await broker.queues.create(config, reserved_ok=True)
        try:
            await broker.subscribe_queue(name, [topic], user=user)
        except QueueError:  # an invalid topic pattern: leave nothing behind
            await broker.delete_queue(name, user=user)
            raise
        return name

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
        try:
            body = sections.encode(delivery)
        except sections.Unsupported:
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
        if self.presettled:
            dlv.settle()
            flow.ack(delivery.entry_id)
        else:
            self.unsettled[tag] = delivery.entry_id
        self.host.wake()

    def on_flow(self) -> None:
        """FLOW event: the link credit is the flow's credit. A drain is answered when the
        flow finds nothing more, or at once when it cannot fetch at all (window full,
        exclusive standby)."""
        if not self.live or self.flow is None:
            return
        flow, link = self.flow, self.link
        flow.set_credit(max(0, link.credit))
        if link.drain_mode and link.credit > 0 and (flow.space <= 0 or not flow.active):
            self._drained(flow)

    def _on_empty(self) -> None:
        if self.live and self.flow is not None and self.link.drain_mode and self.link.credit > 0:
            self._drained(self.flow)

    def _drained(self, flow: Flow) -> None:
        """Hand the unused credit back (delivery-count advances, credit 0)."""
        self.link.drained()
        flow.set_credit(0)
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

    async def close(self, ended: bool = False) -> None:
        self.closed = True
        if self.flow is not None:
            flow, self.flow = self.flow, None
            await flow.close()
        if ended and self.durable is not None:
            name, self.durable = self.durable, None
            with contextlib.suppress(QueueError):  # gone, or not this user's to delete
                await self.host.broker.delete_queue(name, user=self.host.user)
        await super().close(ended)
