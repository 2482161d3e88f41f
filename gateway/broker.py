"""The one API protocol adapters call. Adapters import this module and `gateway.model` only.

Publishing
    ``outcome = await broker.publish(msg)`` routes `msg` (to the queues whose topic
    subscriptions match ``msg.destination``, or to the queue it names when
    ``msg.to_queue``), spools it in Redis and returns an `Outcome`. Ack the publisher only
    when ``outcome.accepted``; otherwise map the outcome to the protocol's NACK (AMQP
    ``rejected`` with ``amqp:resource-limit-exceeded`` / ``amqp:not-found``, MQTT 5 reason
    0x97 / 0x95 ...). ``broker.publish_nowait(msg)`` returns the future instead, so an
    adapter can keep reading while the batch commits; ``broker.publish_nowait(msg, done)``
    creates no future and calls ``done(outcome)`` (or ``done(exception)``) when the batch
    has committed (the cheapest form, for hot paths). Publishes of one event-loop turn share
    one Redis round trip (group commit). A Redis failure raises: do not ack.
    ``watch = await broker.watch_deletion(queue, on_deleted)`` (QueueError 'not_found' if
    there is no such queue) calls ``on_deleted()`` once the queue is deleted, on any node:
    for a publisher that names a queue, such as an AMQP sender link whose target it is;
    ``watch.cancel()`` when it goes.

Consuming
    ``flow = await broker.bind(queue, on_deliver, window=N, credit=None, on_closed=cb)``
    binds a consumer flow; raises `BindError` ('not_found', 'egress_disabled',
    'invalid_selector' with the error position in its message, 'unsupported',
    'unauthorized', 'resource_locked'). Pass the client's ``user=`` (and ``connection=``
    id) so ownership, permissions and RabbitMQ-exclusive queues are enforced; calls
    without them are the operator's (a client that did not authenticate is `ANONYMOUS`).
    ``delete_queue`` / ``subscribe_queue`` take ``user=`` too (QueueError 'unauthorized').
    ``selector="color = 'red' AND weight > 10"`` (JMS / SQL-92): the flow gets only matching
    messages; the others stay for other consumers. ``browse=True`` reads the queue oldest to
    newest without taking anything (AMQP distribution-mode copy; settling only frees the
    window), ``replay_ms`` limits a browser to messages of the last N ms plus new ones. On a
    non-destructive queue every consumer browses. Not on partitioned queues. ``get=True``:
    the flow takes a few messages and goes (RabbitMQ's basic.get), no consumer to an
    auto-delete queue, which goes only when its last consumer does.
    ``flow.on_empty = callback`` is called whenever a fetch finds nothing more for the flow
    (an AMQP drain can complete then).
    ``on_deliver(delivery)`` is called on the event loop for each message, at most `window`
    unsettled at a time (and at most `credit` more, when credit is used, as AMQP does).
    Settle with ``flow.ack(entry_id)``, ``flow.requeue(entry_id)`` (redelivered later with
    its delivery count raised), ``flow.release(entry_id)`` (redelivered, the delivery not
    counted) or ``flow.reject(entry_id)``; settlements are batched per
    turn. ``await flow.close()`` unbinds; whatever is unsettled is redelivered to another
    flow with ``delivery.redelivered`` set. Exclusive queues deliver to one flow at a time;
    the others are standbys in bind order. ``on_closed(reason)`` is called if the queue goes
    away underneath the flow (reason QUEUE_DELETED when it was deleted).

Client sessions (state that must survive restarts and moves between nodes)
    ``broker.clients`` (`ClientStore`): ``save(client_id, state_bytes, expiry_s, claim)``,
    ``load(client_id, claim)``, ``expire``, ``persist``, ``delete``;
    ``mark_received(client_id, packet_id)`` (False for a duplicate: exactly-once receipt)
    and ``release_received``.
    ``claim, before = await broker.claim_client(client_id, on_takeover)`` announces the
    connection that holds a client id: an older one, on any node, gets ``on_takeover()``;
    ``await broker.handed_over(client_id, before, timeout)`` waits for the teardown of one
    on another node (which saves what the session needs next) before the state is loaded;
    ``await broker.release_client(client_id, claim)`` when the connection ends.
    ``broker.parting`` (`PartingStore`) keeps a connection's parting message (an MQTT will)
    in Redis: ``hold`` at connect, ``due`` / ``drop`` as its node decides; those of a node
    that died are published by the others once due.
    Retained messages: publishing a topic message with ``retain=True`` stores it (an empty
    payload clears it) before the future resolves; ``async for batch in
    broker.retained.matching(filter, "mqtt")`` reads those matching a new subscription.

Direct topic subscribers (not spooled, e.g. MQTT QoS 0)
    ``token = broker.subscribe_direct(pattern, syntax, callback)`` / ``unsubscribe_direct``:
    ``callback(message)`` runs for every topic message published on any node whose topic
    matches (other nodes' messages are relayed over Redis pub/sub: at most once).

Provisioning
    ``await broker.declare_queue(config, subscriptions)`` creates a queue (idempotent; a
    re-declaration with other properties raises `QueueError` 'precondition_failed'; a
    ``subscription_selector`` keeps the topic messages it does not select out of the queue);
    ``broker.queues`` (`QueueStore`) shows, lists and changes queues;
    ``await broker.create_temporary_queue(...)`` makes an anonymous queue that dies with this
    node (delete it when the owning session ends); ``await broker.subscribe_queue(queue,
    patterns)`` / ``unsubscribe_queue`` change a queue's topic subscriptions;
    ``update_queue(queue, changes)`` its run-time settings (owner only). These and
    ``declare_queue`` take ``user=`` (a user's new queue is its own).

Errors
    A call that needs Redis raises `StoreError` when Redis fails or refuses it (it is
    unreachable, refuses writes for now, ...).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any, overload

import redis.asyncio as aioredis
from redis.exceptions import RedisError as StoreError

from gateway.config import ANONYMOUS
from gateway.engine import keys
from gateway.engine.clients import ClientStore, RetainedStore
from gateway.engine.deletions import DeletionWatch, DeletionWatches, OnDeleted
from gateway.engine.direct import DirectCallback, DirectRelay
from gateway.engine.events import EventListener
from gateway.engine.flows import (
    DEFAULT_WINDOW,
    QUEUE_DELETED,
    BindError,
    ClosedCallback,
    DeliverCallback,
    Dispatcher,
    Flow,
)
from gateway.engine.leases import NodeLiveness, new_node_id
from gateway.engine.parting import Due, PartingStore, unpack
from gateway.engine.permissions import BROWSE, CONSUME, DELETE, MODIFY_TOPIC, allowed
from gateway.engine.queues import (
    ADAPTER_QUEUE_MESSAGE_SIZE,
    DEAD_MESSAGE_QUEUE,
    TEMPORARY_PREFIX,
    TEMPORARY_SUBSCRIPTION_PREFIX,
    QueueConfig,
    QueueError,
    QueueInfo,
    QueueStore,
    temporary_queue_name,
    validate_queue_name,
)
from gateway.engine.roll_call import RollCall
from gateway.engine.spool import Done, InDoubt, Spooler
from gateway.model import MAX_PRIORITY, Message, Outcome, bound_times, encode, new_message_id
from gateway.router import Router
from gateway.routing_hold import RoutingHold

__all__ = [
    "ANONYMOUS",
    "QUEUE_DELETED",
    "BindError",
    "Broker",
    "DeletionWatch",
    "Flow",
    "InDoubt",
    "Outcome",
    "QueueConfig",
    "QueueError",
    "QueueInfo",
    "StoreError",
]

HANDOVER_CHECK_S = 0.5  # how often a handover's wait looks whether the old node still lives
REFRESH_RETRY_S = 1.0  # a routing table or direct-subscriber list Redis did not answer

log = logging.getLogger(__name__)


def _result_of(fut: asyncio.Future[Outcome]) -> Outcome | BaseException:
    """A resolved future's outcome, or what it raised."""
    if fut.cancelled():
        return asyncio.CancelledError()
    return fut.exception() or fut.result()


class Broker:
    """Router + queue engine of one gateway node."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        node_id: str | None = None,
        heartbeat: float = 1.0,
        node_ttl: float = 5.0,
    ) -> None:
        self.redis = redis
        self.node_id = node_id or new_node_id()
        self.queues = QueueStore(redis)
        self.deletions = DeletionWatches(self.queues)
        self.clients = ClientStore(redis)
        self.retained = RetainedStore(redis)
        self.parting = PartingStore(redis, self.node_id)
        # topic -> [its retained stores under way, the number of the latest stored]
        self._retaining: dict[str, list[int]] = {}
        self._retain_seq = itertools.count(1)  # retained publishes, in publish order
        self._connected: dict[str, tuple[int, Callable[[], None]]] = {}
        # client id -> the end ("node claim") of a connection on another node that a
        # connection here waits for (handed_over)
        self._handovers: dict[str, asyncio.Future[str]] = {}
        # called with (client id, whether it starts afresh) when another node claims one
        self.claim_watchers: list[Callable[[str, bool], None]] = []
        self.router = Router(redis)
        self.dispatcher = Dispatcher(redis, self.node_id)
        self.spooler = Spooler(redis, self.node_id, self._spooled, pacing=self.dispatcher)
        self.liveness = NodeLiveness(
            redis, self.dispatcher, self.node_id, interval=heartbeat, ttl=node_ttl
        )
        self.events = EventListener(
            redis, self.node_id, self._on_event, self.dispatcher.wake_queue, self._resync
        )
        self.dispatcher.on_last_flow = self._last_flow_gone
        self.hold = RoutingHold(self.router.reload, self._route)
        self.events.on_lost = self._events_lost
        self.roll_call = RollCall(redis, self.node_id, self.events)
        self.direct = DirectRelay(redis, self.node_id, self.events, self.roll_call)
        self._tasks: set[asyncio.Task] = set()
        self._undeleted: set[str] = set()  # temporary queues whose deletion Redis refused
        self.published = 0
        self.counters: dict[str, int] = {}  # the protocol adapters' events, by name
        self._heartbeat = heartbeat
        self._partings: asyncio.Task | None = None

    async def start(self) -> None:
        await self.events.start()
        await self.router.reload()
        await self.direct.refresh()
        await self.liveness.start()
        self._partings = asyncio.get_running_loop().create_task(self._publish_partings())

    async def stop(self, tell_redis: bool = True) -> None:
        """`tell_redis` False (Redis does not answer: a stop cut short): everything here
        stops without telling Redis; other nodes take over once the liveness key expires.
        Again after a stop cut short, it stops what that one left running."""
        if self._partings is not None:
            self._partings.cancel()
            await asyncio.gather(self._partings, return_exceptions=True)
        for task in list(self._tasks):  # retries until Redis answers, answers, resyncs
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # never stored: their publishers are not acked
        await self.hold.close(StoreError("the node stopped before it could route the message"))
        await self.direct.close(tell_redis)
        await self.spooler.close()
        await self.dispatcher.close()
        try:
            await self.liveness.stop(tell_redis)
        except StoreError as exc:  # other nodes take over once its liveness key expires
            log.warning("cannot tell Redis this node stops (%s): others take over later", exc)
        await self.events.stop()

    # -- publishing ------------------------------------------------------------------------

    @overload
    def publish_nowait(self, msg: Message) -> asyncio.Future[Outcome]: ...
    @overload
    def publish_nowait(self, msg: Message, done: Done) -> None: ...

    def publish_nowait(
        self, msg: Message, done: Done | None = None
    ) -> asyncio.Future[Outcome] | None:
        """Route and spool `msg`; the future resolves once it is stored (or refused).

        With `done`, no future is made (None is returned): `done(outcome)`, or
        `done(exception)` when Redis failed (InDoubt: it may be stored), is called once it is
        stored or refused, perhaps before this returns. The publish path of a busy node
        saves a future per message."""
        if not msg.id:
            msg.id = new_message_id()
        if msg.expiration is not None or msg.not_before is not None:
            bound_times(msg)
        self.published += 1
        if not msg.to_queue:
            self.direct.publish(msg)
        if self.hold.active:
            return self.hold.hold(msg, done)
        return self._route(msg, done)

    def _route(self, msg: Message, done: Done | None) -> asyncio.Future[Outcome] | None:
        if msg.to_queue:
            queues: Collection[str] = (msg.destination,)
        else:
            queues = self.router.match(msg.destination)
            if queues and self.router.selectors:  # some queue filters what it attracts
                queues = self.router.select(queues, msg)
            if not queues:
                if done is not None and not msg.retain:
                    done(Outcome.NO_SUBSCRIBERS)
                    return None
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(Outcome.NO_SUBSCRIBERS)
                return self._retain_after(msg, fut, done) if msg.retain else fut
        retain = msg.retain and not msg.to_queue
        routed_by = None if msg.to_queue else self.router.created
        fut = self._spool(queues, routed_by, msg, None if retain else done)
        return self._retain_after(msg, fut, done) if retain else fut

    def _spool(
        self,
        queues: Collection[str],
        routed_by: Mapping[str, str] | None,
        msg: Message,
        done: Done | None,
    ) -> asyncio.Future[Outcome] | None:
        """Hand `msg` to the spooler for `queues`. `routed_by`: None when the message names
        its queue, else the created_ms of the queues as the routes that matched its topic
        knew them (Router.created, one object per load): stored only in those queues, not
        in one made again under a name since."""
        return self.spooler.submit(
            queues,
            routed_by,
            len(msg.payload),
            msg.partition_key,
            msg.expiration,
            self.router.spool_properties(msg),
            min(max(msg.priority, 0), MAX_PRIORITY),
            msg.not_before,
            encode(msg),
            done,
            msg.exactly_once,
        )

    def _retain_after(
        self, msg: Message, spooled: asyncio.Future[Outcome], done: Done | None
    ) -> asyncio.Future[Outcome] | None:
        """Store a retained message once its spool succeeded (before the publisher's ack),
        unless a retained message of its topic published after it was stored first (its
        spool answered sooner: it went to fewer queues): the older one must not overwrite
        it. Stores are not made to wait for each other: a busy topic keeps its rate."""
        topic = msg.destination
        seq = next(self._retain_seq)
        entry = self._retaining.setdefault(topic, [0, 0])  # [stores under way, latest stored]
        entry[0] += 1

        async def both() -> Outcome:
            try:
                outcome = await spooled
                if outcome.accepted and entry[1] < seq:
                    entry[1] = seq
                    if not await self.retained.put(msg, outcome is Outcome.OK):
                        self.spooler.refused_for_memory()
                        return Outcome.OUT_OF_MEMORY
                return outcome
            finally:
                entry[0] -= 1
                if not entry[0] and self._retaining.get(topic) is entry:
                    del self._retaining[topic]

        fut = asyncio.ensure_future(both())
        if done is None:
            return fut
        fut.add_done_callback(lambda f: done(_result_of(f)))
        return None

    async def publish(self, msg: Message) -> Outcome:
        return await self.publish_nowait(msg)

    async def watch_deletion(self, queue: str, on_deleted: OnDeleted) -> DeletionWatch:
        """`on_deleted()` once `queue` is deleted (see the module docstring)."""
        return await self.deletions.watch(queue, on_deleted)

    def store_in(self, queue: str, msg: Message) -> asyncio.Future[Outcome]:
        """Spool `msg` into `queue` alone, its destination kept: a message one consumer
        must get again from there (an MQTT message in flight, retained or a shared
        group's QoS 2 one, when its session's connection ended). Messages stored one
        after another keep that order; the future holds the outcome."""
        if not msg.id:
            msg.id = new_message_id()
        stored = self._spool((queue,), None, msg, None)
        assert stored is not None  # a future: no `done` was given
        return stored

    def _spooled(self, queues: set[str]) -> None:
        for queue in queues:
            self.dispatcher.wake_queue(queue)

    # -- direct subscribers ----------------------------------------------------------------

    async def subscribe_direct(self, pattern: str, syntax: str, callback: DirectCallback) -> int:
        """Once it returns, messages published on any node reach `callback`."""
        return await self.direct.subscribe(pattern, syntax, callback)

    def unsubscribe_direct(self, token: int) -> None:
        self.direct.unsubscribe(token)

    # -- client sessions -------------------------------------------------------------------

    async def claim_client(
        self,
        client_id: str,
        on_takeover: Callable[[], None],
        ends_session: bool = False,
        user: str = "",
    ) -> tuple[int, str | None]:
        """Announce that this connection now holds `client_id`: an older connection with the
        same id, on this node or another, gets `on_takeover()` called and should close;
        `claim_watchers` on other nodes learn of it (`ends_session`: it starts afresh).
        Claims are ordered by a Redis counter, so a late event never ends a newer claim.
        Returns the claim's number (for `release_client` and the state's load and saves)
        and, when a connection on another live node held the client, that one's holder
        ("node claim") for `handed_over`. `user`: the one the connection acts as
        (`client_user` on other nodes)."""
        claims, hex_id = keys.client_claims(client_id), keys.client_hex(client_id)
        reply = await self.redis.fcall("gw_claim", 1, claims, self.node_id, hex_id, user)
        claim, before = int(reply[0]), reply[1].decode() if reply[1] else None
        if before is not None:  # waiting before the announcement: no release is missed
            self._handovers[client_id] = asyncio.get_running_loop().create_future()
        previous = self._connected.get(client_id)
        self._connected[client_id] = (claim, on_takeover)
        if previous is not None:
            previous[1]()
        ends = " 1" if ends_session else ""
        await self.redis.publish(keys.events, f"client {self.node_id} {claim} {hex_id}{ends}")
        return claim, before

    async def handed_over(self, client_id: str, before: str, timeout: float) -> bool:
        """Wait until the connection `before` held on another node has ended (its teardown
        saved what the session needs next), at most `timeout` seconds: False if it did not,
        or once its node is presumed dead (it never will: a crashed node saves nothing)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        node = before.split(" ", 1)[0]
        try:
            while True:
                fut = self._handovers.get(client_id)
                if fut is None:
                    return False
                wait = min(deadline - loop.time(), HANDOVER_CHECK_S)
                try:
                    ended = await asyncio.wait_for(asyncio.shield(fut), wait)
                except TimeoutError:
                    if loop.time() >= deadline or not await self._node_alive(node):
                        return False
                    continue
                if ended == before:
                    return True
                self._handovers[client_id] = loop.create_future()  # an older one's end
        finally:
            self._handovers.pop(client_id, None)

    async def _node_alive(self, node: str) -> bool:
        """Not presumed dead, as the engine judges it (a liveness grace after a Redis
        restart counts every node alive); in doubt, when Redis does not answer, alive."""
        try:
            return bool(await self.redis.fcall_ro("gw_node_alive", 0, node))
        except StoreError:
            return True

    async def client_user(self, client_id: str) -> str | None:
        """The user a connection on another live node that holds `client_id` acts as (None:
        no such connection; this node's own are its adapter's to know)."""
        holder = await self._holder(client_id)
        return None if holder is None or holder[0] == self.node_id else holder[1]

    async def client_held(self, client_id: str) -> bool:
        """Whether a connection, on this node or another live one, holds `client_id`."""
        holder = await self._holder(client_id)
        if holder is None:
            return False
        return holder[0] != self.node_id or client_id in self._connected

    async def _holder(self, client_id: str) -> tuple[str, str] | None:
        """The node of the connection that holds `client_id`, and its user; None when none
        does, or its node (another) is presumed dead."""
        holder, user = await self.redis.hmget(keys.client_claims(client_id), "holder", "user")
        if holder is None:
            return None
        node = holder.decode().split(" ", 1)[0]
        if node != self.node_id and not await self._node_alive(node):
            return None
        return node, (user or b"").decode()

    async def release_client(self, client_id: str, claim: int) -> None:
        """The connection of `claim` ended: no longer the holder, and one waiting on
        another node to load the session (`handed_over`) may go on."""
        current = self._connected.get(client_id)
        if current is not None and current[0] == claim:
            del self._connected[client_id]
        holder, hex_id = f"{self.node_id} {claim}", keys.client_hex(client_id)
        await self.redis.fcall("gw_unclaim", 1, keys.client_claims(client_id), holder, hex_id)
        await self.redis.publish(keys.events, f"released {holder} {hex_id}")

    def _released(self, arg: str) -> None:
        node, claim, hex_id = arg.split(" ")
        fut = self._handovers.get(bytes.fromhex(hex_id).decode())
        if fut is not None and not fut.done():
            fut.set_result(f"{node} {claim}")

    def _taken_over(self, arg: str) -> None:
        node, claim, hex_id, *ends = arg.split(" ")
        client_id = bytes.fromhex(hex_id).decode()
        if node != self.node_id:
            for watcher in self.claim_watchers:
                watcher(client_id, bool(ends))
        current = self._connected.get(client_id)
        if node != self.node_id and current is not None and current[0] < int(claim):
            del self._connected[client_id]
            current[1]()

    # -- consuming -------------------------------------------------------------------------

    async def bind(
        self,
        queue: str,
        on_deliver: DeliverCallback,
        *,
        window: int = DEFAULT_WINDOW,
        credit: int | None = None,
        on_closed: ClosedCallback | None = None,
        selector: str | None = None,
        browse: bool = False,
        replay_ms: int = 0,
        user: str | None = None,
        connection: str | None = None,
        get: bool = False,
    ) -> Flow:
        if user is not None or connection is not None:
            await self._check_access(queue, user, connection, BROWSE if browse else CONSUME)
        if queue not in self.dispatcher.flows:
            await self.events.watch_queue(queue)  # before the first fetch: no missed wake-up
        try:
            return await self.dispatcher.bind(
                queue,
                on_deliver,
                window=window,
                credit=credit,
                on_closed=on_closed,
                selector=selector,
                browse=browse,
                replay_ms=replay_ms,
                get=get,
            )
        except BindError:
            if queue not in self.dispatcher.flows:
                await self.events.unwatch_queue(queue)
            raise
        except BaseException:  # cancelled, or Redis out of reach: no flow, no watch either
            if queue not in self.dispatcher.flows:
                self._last_flow_gone(queue)
            raise

    def _last_flow_gone(self, queue: str) -> None:
        self._spawn(self.events.unwatch_queue(queue))

    # -- provisioning ----------------------------------------------------------------------

    async def _require(self, queue: str, user: str | None, needed: str) -> None:
        """Raise QueueError 'unauthorized' unless `user` has the level (None: operator)."""
        if user is None:
            return
        config = await self.queues.config(queue)
        if not allowed(config.owner, config.permission, user, needed):
            raise QueueError("unauthorized", f"user {user!r} may not {needed} queue {queue!r}")

    async def _check_access(
        self, queue: str, user: str | None, connection: str | None, needed: str
    ) -> None:
        """Ownership, permission and RabbitMQ-exclusive checks for a client's request."""
        try:
            config = await self.queues.config(queue)
        except QueueError as exc:
            raise BindError("not_found", str(exc)) from None
        if config.owner_connection and connection != config.owner_connection:
            raise BindError(
                "resource_locked", f"queue {queue!r} is exclusive to another connection"
            )
        if not allowed(config.owner, config.permission, user, needed):
            raise BindError("unauthorized", f"user {user!r} may not {needed} queue {queue!r}")

    async def declare_queue(
        self,
        config: QueueConfig,
        subscriptions: Iterable[tuple[str, str]] = (),
        user: str | None = None,
    ) -> bool:
        """Create a queue (idempotent). A non-durable queue belongs to this node and is
        deleted when the node goes away, as transient queues are on a broker restart.
        A user's new queue is owned by that user (Solace); re-declaring someone else's queue
        with subscriptions needs modify-topic."""
        if not config.durable and config.owner_node is None:
            config.owner_node = self.node_id
        subscriptions = list(subscriptions)
        if user is not None:
            if config.name == DEAD_MESSAGE_QUEUE:  # a system endpoint (Solace)
                raise QueueError(
                    "unauthorized",
                    f"only the operator declares {DEAD_MESSAGE_QUEUE}, where every queue's "
                    "dead messages go by default",
                )
            config.owner = user
        created, added = await self.queues.declare(config, subscriptions, user=user)
        if subscriptions or config.lvq_key or config.sort_key or config.subscription_selector:
            # routes carry a keyed queue's key, and selectors
            await self._route_everywhere(ask=created or added > 0)
        return created

    async def create_temporary_queue(
        self,
        owner: str | None = None,
        subscriptions: Iterable[tuple[str, str]] = (),
        *,
        connection: str = "",
        permission: str = "none",
        auto_delete: bool = False,
        selector: str = "",
        subscription: bool = False,
    ) -> str:
        """`connection`: only that connection may consume it (RabbitMQ exclusive);
        `permission`: what users other than `owner` may do; `selector`: what of its
        subscriptions' messages it stores (QueueError 'invalid' if bad); `subscription`:
        an adapter's queue for a client's topic subscription, which no client names
        (subscription_queue), so that its reader is held to the topic ACL."""
        prefix = TEMPORARY_SUBSCRIPTION_PREFIX if subscription else TEMPORARY_PREFIX
        name = temporary_queue_name(self.node_id, prefix)
        config = QueueConfig(
            name=name,
            durable=False,
            owner=owner,
            owner_node=self.node_id,
            owner_connection=connection,
            permission=permission,
            auto_delete=auto_delete,
            subscription_selector=selector,
            max_message_size=ADAPTER_QUEUE_MESSAGE_SIZE,
        )
        await self.queues.create(config, list(subscriptions), reserved_ok=True)
        if subscriptions:
            await self._route_everywhere()
        return name

    async def subscribe_queue(
        self, queue: str, patterns: Iterable[str], syntax: str = "smf", user: str | None = None
    ) -> int:
        await self._require(queue, user, MODIFY_TOPIC)
        changed = await self.queues.change_subscriptions(
            queue, "add", [(p, syntax) for p in patterns]
        )
        await self._route_everywhere(ask=changed > 0)
        return changed

    async def _route_everywhere(self, ask: bool = True) -> None:
        """Reload the routes here, then (`ask`: something changed) wait until the other
        nodes route by them too: a message another node takes once the caller was
        answered (a SUBACK, an attach, an UNSUBACK) reaches the new subscription, and not
        a removed one (MQTT-3.10.4-2; their 'sub' event alone may be read after it)."""
        await self.router.reload()
        if not ask:
            return
        try:
            await self.roll_call.ask("routes", str(self.router.version))
        except StoreError as exc:  # they reload on the 'sub' event, or on reconnecting
            log.warning("other nodes may route by older subscriptions a while: %s", exc)

    async def unsubscribe_queue(
        self, queue: str, patterns: Iterable[str], syntax: str = "smf", user: str | None = None
    ) -> int:
        await self._require(queue, user, MODIFY_TOPIC)
        changed = await self.queues.change_subscriptions(
            queue, "remove", [(p, syntax) for p in patterns]
        )
        await self._route_everywhere(ask=changed > 0)  # nothing routed by it once answered
        return changed

    async def update_queue(
        self, queue: str, changes: dict[str, Any], user: str | None = None
    ) -> int:
        """Change run-time settings (`partition_count` too: returns the messages the
        repartition deleted). As on Solace only the owner may, and may not give the queue
        away; the operator may change anything."""
        changes = dict(changes)
        if user is not None:
            owner = (await self.queues.config(queue)).owner
            if user != owner or "owner" in changes:
                raise QueueError("unauthorized", f"user {user!r} may not change queue {queue!r}")
            if "dead_message_queue" in changes:  # as when it declares one (QueueConfig)
                try:
                    validate_queue_name(changes["dead_message_queue"])
                except QueueError as exc:
                    raise QueueError("invalid", f"dead_message_queue: {exc}") from None
        await self.queues.changed(queue, changes, repartition=True)  # all or nothing
        deleted = 0
        if "partition_count" in changes:
            deleted = await self.queues.repartition(
                queue, changes.pop("partition_count"), changes.get("max_spool_bytes")
            )
        if changes:
            await self.queues.update(queue, changes)
        return deleted

    async def delete_queue(self, queue: str, user: str | None = None) -> None:
        await self._require(queue, user, DELETE)
        await self.queues.delete(queue)
        await self.router.reload()

    async def delete_temporary_queue(self, queue: str, user: str | None = None) -> None:
        """Delete a queue made by create_temporary_queue. Should Redis fail, it is deleted
        later, every REFRESH_RETRY_S until Redis answers: left, it would gather its
        subscriptions' messages until this node stops, and its name is never used again."""
        try:
            await self.delete_queue(queue, user)
        except StoreError as exc:
            if not self._undeleted:
                log.warning("deleting temporary queues is tried again until Redis answers: %s", exc)
                self._spawn(self._delete_undeleted())
            self._undeleted.add(queue)

    async def _delete_undeleted(self) -> None:
        while self._undeleted:
            await asyncio.sleep(REFRESH_RETRY_S)
            for queue in list(self._undeleted):
                try:
                    await self.queues.delete(queue)
                except QueueError:  # gone meanwhile (auto-delete, a dead node's reaping)
                    pass
                except StoreError:
                    break  # still refused: all wait for the next round
                self._undeleted.discard(queue)
        await self._until_answered("reloading the routes", self.router.reload)
        log.info("temporary queues Redis had refused to delete are deleted")

    # -- events ----------------------------------------------------------------------------

    def _events_lost(self) -> None:
        """Events may be missed from now on (routing waits), and a Redis restarted from an
        older copy of its data (a backup, an AOF that lost its last second) may hold other
        routes under the versions loaded: the next load reads every route."""
        self.router.forget()
        self.hold.lost()

    def _on_event(self, kind: str, arg: str) -> None:
        if kind == "sub":
            version = int(arg)
            self._spawn(self._until_answered("reloading the routes", self.router.reload, version))
        elif kind == "qdel":
            self._spawn(self.dispatcher.queue_deleted(arg))
            self._spawn(self.deletions.queue_deleted(arg))
        elif kind == "qcfg":
            self.dispatcher.wake_queue(arg)
        elif kind == "lease":
            self.dispatcher.request_lease_check(arg)
        elif kind == "parts":
            self.dispatcher.request_partition_refresh(arg)
        elif kind == "client":
            self._taken_over(arg)
        elif kind == "released":
            self._released(arg)
        elif kind == "direct":
            if self.direct.told(arg):
                self._learn_direct_nodes()
        elif kind == "ask":
            question = self.roll_call.parse(arg)
            if question is not None:
                self._spawn(self._answer(*question))
        elif kind == "answer":
            self.roll_call.answered(arg)
        elif kind == "back":
            self.roll_call.back(arg)

    async def _answer(self, node: str, tag: str, what: str, arg: str) -> None:
        """Act on another node's question, then answer it. Unanswered (Redis failed): the
        asking node waits no longer than its timeout, and this one learns it later."""
        try:
            if what == "direct":
                if self.direct.told(node):
                    self._learn_direct_nodes()
            elif what == "routes":
                await self.router.reload(int(arg))
            else:
                log.warning("unknown question %r from node %s", what, node)
                return
            await self.roll_call.answer(tag)
        except StoreError as exc:  # the 'sub' event's reload goes on until Redis answers
            log.warning("cannot answer node %s's question %r: %s", node, what, exc)

    async def _routes_back(self) -> None:
        """The event channel is back: read the routes and the direct subscribers' nodes
        again (what it told may have been missed), route what waited, and tell the nodes
        whose questions this node may have missed."""
        losses = self.events.losses
        await self._until_answered("reloading the routes", self.router.reload)
        await self._until_answered("telling of direct subscribers", self.direct.resync)
        if self.events.losses != losses:  # lost again meanwhile: the next resync does this
            return
        self.hold.back()
        try:
            await self.roll_call.tell_back(self.router.version)
        except StoreError as exc:
            log.warning("cannot tell the other nodes this one is back: %s", exc)

    def _learn_direct_nodes(self) -> None:
        self._spawn(self._until_answered("learning of direct subscribers", self.direct.refresh))

    def _resync(self) -> None:
        self._spawn(self._routes_back())
        self._spawn(self._until_answered("checking watched queues", self.deletions.recheck))
        self.dispatcher.wake_all()
        for queue in self.dispatcher.exclusive_standby_queues():
            self.dispatcher.request_lease_check(queue)
        for queue in self.dispatcher.partitioned_queues():
            self.dispatcher.request_partition_refresh(queue)

    async def _until_answered(
        self, what: str, call: Callable[..., Awaitable[None]], *args: object
    ) -> None:
        """`call(*args)` again every REFRESH_RETRY_S until Redis answers it: a routing
        table or direct-subscriber list left stale would misroute the messages after it."""
        failed = False
        while True:
            try:
                await call(*args)
            except StoreError as exc:
                if not failed:
                    log.warning("%s failed; tried again until Redis answers: %s", what, exc)
                failed = True
                await asyncio.sleep(REFRESH_RETRY_S)
            else:
                if failed:
                    log.info("%s done", what)
                return

    # -- parting messages ------------------------------------------------------------------

    async def _publish_partings(self) -> None:
        """Publish the parting messages (MQTT wills) of connections whose node died, as
        they fall due, at the heartbeat's pace."""
        while True:
            await asyncio.sleep(self._heartbeat)
            try:
                for due in await self.parting.take():
                    await self.publish_parting(due)
            except StoreError as exc:  # taken again after the lease
                log.warning("parting messages of dead nodes not published: %s", exc)
            except Exception:  # a bug of ours: the next round goes on
                log.exception("parting messages of dead nodes not published")

    async def publish_parting(self, due: Due) -> None:
        """Publish a parting message taken from Redis, then drop it there; one Redis did
        not take stays, taken again once its lease ends."""
        try:
            msg = unpack(due.message)
        except ValueError as exc:  # not one this node can read: no retry reads it either
            log.error("parting message %s unreadable, dropped: %s", due.key, exc)
        else:
            outcome = await self.publish_nowait(msg)
            if outcome is Outcome.OUT_OF_MEMORY:  # taken again after the lease
                return
            if not outcome.accepted:
                log.warning("parting message %s refused: %s", due.key, outcome.name)
        await self.parting.done(due)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stats(self) -> dict[str, int]:
        """Node-local counters for the metrics endpoint."""
        return {
            "published": self.published,
            "spool_batches": self.spooler.batches,
            "spooled": self.spooler.messages,
            "delivered": self.dispatcher.delivered,
            "dispatch_rounds": self.dispatcher.rounds,
            "flows": sum(len(f) for f in self.dispatcher.flows.values()),
            "reaped_flows": self.liveness.reaped,
            **{f"refused_{k}": v for k, v in self.spooler.refused.items()},
            **self.counters,
        }

    def count(self, name: str) -> None:
        """An adapter's event (a dropped QoS 0 message, say), shown in the metrics."""
        self.counters[name] = self.counters.get(name, 0) + 1
