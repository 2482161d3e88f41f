"""The MQTT listener plugin (`gateway.protocols` entry point) and the node's session table.

`Registry` attaches connections to sessions. A session's state lives in Redis
(`broker.clients`, saved on every change; see state.py), so it survives a gateway restart
and follows the client to another node: `broker.claim_client` makes the connection that held
the client id, on any node, disconnect (MQTT 5: 0x8E) and save the state on its way out; the
new connection loads it once that one ended (`broker.handed_over`), and from then on the
old one's saves are refused. The expiry
clock runs in Redis (`expire` at disconnect); a session found gone at its next connect has
its durable queue `#mqtt/<hex client id>` deleted, as does a local timer when the session
expires while this node runs. While connected, a session with a finite expiry holds a lease
(its expiry + LEASE_S, renewed every LEASE_S / 2), so the session of a node that died still
expires; the node that reaps a dead one cuts that to the expiry from then. Its queue has
the session as its one member, for as long as the session lasts (renewed with the lease):
a sweep at start and every SWEEP_S deletes the queue of a session
that expired while no node watched it (its node stopped first, or Redis refused the
deletion). A connection's will is also kept in Redis (`broker.parting`) while its node
holds it: this node publishes it, times its delay and drops it, but should the node die the
others publish it once its delay from then ends, unless a connection to the session came
first (one that starts afresh ends the session, and the will goes then).

A shared subscription group's queue lives while the group has members: a member joins in
Redis before it declares and binds the queue, and leaves when it unsubscribes or its
session ends (clean start, expiry, or the end of a non-persistent session). The last
member's leave deletes the queue and its messages (MQTT 5 lets the server discard them),
unless a flow is still bound (a member of a session moving between nodes): then the group
is checked again after SHARED_RECHECK_S, backing off, until it goes or has members again.
A persistent session's membership outlasts its connection by its session expiry; every
group is swept at start and every SWEEP_S, so one whose members lapsed on a node that died
goes too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from typing import Any

from gateway.broker import ANONYMOUS, Broker, QueueConfig, QueueError, StoreError
from gateway.config import Settings
from gateway.engine.parting import Due, pack
from gateway.engine.queues import (
    ADAPTER_QUEUE_MESSAGE_SIZE,
    MQTT_SESSION_PREFIX,
    MQTT_SHARED_PREFIX,
)
from gateway.model import Publisher
from gateway.topics import MQTT
from protocols.listening import BackgroundTasks, Listener, Plan
from protocols.mqtt import mapping
from protocols.mqtt.connection import MqttConnection
from protocols.mqtt.session import CONNECT_TIMEOUT, NEVER_EXPIRES, Session
from protocols.mqtt.state import (
    SessionState,
    shared_filter,
    shared_queue_name,
)
from protocols.mqtt.websocket import WebSocketConnection
from protocols.tls import tls_context

log = logging.getLogger(__name__)

CLOSE_TIMEOUT = 5.0
# the longest a connection taken over takes to end (its publishes in flight land first)
HANDOVER_TIMEOUT = CONNECT_TIMEOUT + CLOSE_TIMEOUT
LEASE_S = 60  # how long a connected session outlives its node, beyond its expiry
# how long a session's queue outlives the session: a connect that found the session stored
# renews the queue's membership before the sweep may take the queue
QUEUE_GRACE_S = 10
SHARED_JOIN_GRACE_MS = 10_000  # a joining member's claim on its group, until it is bound
SHARED_RECHECK_S = 5.0  # a group left with only flows bound is checked again after this
SHARED_RECHECK_MAX_S = 60.0  # ... and again, backing off up to this, until it goes or is joined
SWEEP_S = 300.0  # groups and session queues are checked at start and this often


def shared_queues(state: SessionState) -> list[str]:
    """The queues of the shared subscription groups a session is a member of."""
    groups = (shared_filter(p) for p in state.subscriptions)
    return [shared_queue_name(*g) for g in groups if g is not None]


def session_lasts(state: SessionState, connected: bool) -> float:
    """Seconds from now a session would outlive its connection (its node's, while
    connected: the lease); 0 for a non-persistent one, math.inf for one that never expires."""
    if not state.persistent:
        return 0
    if state.expiry == NEVER_EXPIRES:
        return math.inf
    return state.expiry + (LEASE_S if connected else 0)


def membership_until(state: SessionState, connected: bool) -> float:
    """Epoch ms a session's group memberships last: while connected its bound flows keep
    the groups (a non-persistent session needs only the time to bind); a persistent
    session's membership lasts as long as the session would (math.inf: for ever)."""
    return time.time() * 1000 + max(session_lasts(state, connected) * 1000, SHARED_JOIN_GRACE_MS)


def queue_name(client_id: str) -> str:
    """Deterministic durable queue name for a client id (hashed when hex would not fit)."""
    raw = client_id.encode()
    tail = raw.hex() if len(raw) <= 120 else "h" + hashlib.sha256(raw).hexdigest()
    return MQTT_SESSION_PREFIX + tail


class Registry:
    """Connected sessions, wills and expiry timers of this node's MQTT clients."""

    def __init__(self, broker: Broker, settings: Settings) -> None:
        self.broker = broker
        self.settings = settings
        self.sessions: dict[str, Session] = {}  # client id -> its attached session here
        for name in ("qos0_dropped", "retained_dropped", "publish_denied", "wills"):
            # exported from the start: a rate needs the counter before its first event
            broker.counters.setdefault(f"mqtt_{name}", 0)
        # user names (a session queue owned by one of them is theirs, never a legacy owner)
        self._user_names = {user.name for user in settings.users} | {ANONYMOUS}
        self.connections: set[MqttConnection] = set()
        self.closing = False  # connections made from now on are dropped
        self._locks: dict[str, list[Any]] = {}  # client id -> [lock, users]
        # client id -> its delayed will: the timer, and its connection's claim (Redis keeps
        # the will by that claim)
        self._wills: dict[str, tuple[asyncio.TimerHandle, int]] = {}
        self._wills_kept: set[Session] = set()  # sessions whose will Redis keeps
        self._expiry: dict[str, asyncio.TimerHandle] = {}
        self._rechecks: dict[str, asyncio.TimerHandle] = {}  # shared queue -> its recheck
        self._unsaved: set[Session] = set()
        self._tasks = BackgroundTasks("MQTT session")
        self.spawn = self._tasks.spawn
        self._renewer = asyncio.get_running_loop().create_task(self._renew_leases())
        broker.claim_watchers.append(self._claimed_elsewhere)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_often())

    def count(self, name: str) -> None:
        self.broker.count(f"mqtt_{name}")

    # -- attach / detach -------------------------------------------------------------------

    async def attach(
        self, session: Session, clean_start: bool, expiry: int
    ) -> tuple[SessionState, bool] | None:
        """Give `session` the client's state; True if an existing session was resumed. None
        if the session belongs to another user. Connects with one client id are taken in the
        order they arrived here (the later one takes over), whatever Redis answers first."""
        client_id = session.client_id
        entry = self._locks.setdefault(client_id, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                if not await self._may_use(client_id, session.access_user):
                    return None
                return await self._attach(session, clean_start, expiry)
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[client_id]

    async def _attach(
        self, session: Session, clean_start: bool, expiry: int
    ) -> tuple[SessionState, bool]:
        client_id = session.client_id
        old = self.sessions.get(client_id)
        session.claim, before = await self.broker.claim_client(
            client_id, session.take_over, clean_start, session.access_user
        )
        # the connection it takes over saves what the session needs next (the packet ids of
        # messages in flight...) as it ends: wait for that, here or on another node
        if old is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(old.detached), HANDOVER_TIMEOUT)
        if before is not None:
            await self.broker.handed_over(client_id, before, HANDOVER_TIMEOUT)
        self._new_connection(client_id, clean_start)
        state = None if clean_start else await self._load(client_id, session.claim)
        present = state is not None
        if state is None:
            await self._forget(client_id, clean_start, session.claim)
            state = SessionState(client_id)
        state.expiry = expiry
        state.persistent = expiry > 0
        state.user = session.access_user
        session.state = state
        self.sessions[client_id] = session
        if state.persistent:
            await self._hold(session, state)
            await self.save(session)
        await self._keep_will(session, state, clean_start)
        return state, present

    async def _keep_will(self, session: Session, state: SessionState, clean_start: bool) -> None:
        """Keep the connection's will in Redis, and settle earlier connections' there
        (those whose node died, or that wait their delay): they go now, or not at all."""
        assert session.claim is not None
        will = session.will
        record = None
        if will is not None:
            publisher = Publisher("mqtt", state.client_id, session.user)
            record = pack(mapping.to_message(will, publisher, session.level))
        delay = _will_delay(session, state) if will is not None else 0
        earlier = await self.broker.parting.hold(
            state.client_id, session.claim, clean_start, record, delay
        )
        if record is not None:
            self._wills_kept.add(session)
        for due in earlier:
            self._send_will(due)

    async def _load(self, client_id: str, claim: int) -> SessionState | None:
        """The stored state, as the connection of `claim` (older ones no longer save);
        None once its queue was deleted (by an operator): its subscriptions went too, and
        it leaves its shared subscription groups."""
        raw = await self.broker.clients.load(client_id, claim)
        if raw is None:
            return None
        state = SessionState.loads(client_id, raw)
        if state.queue is not None and not await self.broker.queues.exists(state.queue):
            log.warning("MQTT client %r: its session's queue was deleted; new session", client_id)
            await self._leave_groups(client_id, shared_queues(state))
            return None
        state.qos2_in = {int(pid) for pid in await self.broker.clients.received(client_id)}
        return state

    async def _forget(self, client_id: str, clean_start: bool, claim: int) -> None:
        """No session to resume: drop what an ended or expired one left in Redis (a clean
        start ends the stored session: it leaves its shared subscription groups)."""
        raw = await self.broker.clients.load(client_id, claim) if clean_start else None
        await self.broker.clients.start_afresh(client_id, claim)
        name = queue_name(client_id)
        if await self.broker.queues.exists(name):
            await self._delete_queue(name)
        if raw is not None:
            await self._leave_groups(client_id, shared_queues(SessionState.loads(client_id, raw)))

    async def save(self, session: Session) -> bool:
        """Store a persistent session's state (with its lease while it is connected), unless
        a connection that took it over has loaded it (False then); the QoS 2 deliveries
        whose PUBREL ids it holds are settled once it is in."""
        self._unsaved.discard(session)
        state, claim = session.state, session.claim
        settles = session.saving()
        stored = True
        try:
            if state is not None and state.persistent and claim is not None:
                blob = state.dumps()
                stored = await self.broker.clients.save(
                    session.client_id, blob, _lease(state), claim
                )
        except BaseException:
            session.unsaved(settles)  # the next save settles them
            raise
        if stored:
            session.saved(settles)
        else:  # a newer connection loaded the session without their PUBREL ids: left
            session.unsaved(settles)  # unsettled, they go to it again
        return stored

    async def _hold(self, session: Session, state: SessionState) -> None:
        """Stop the expiry clock of a connected session, and its queue's, up to its lease."""
        lease = _lease(state)
        if lease is None:
            await self.broker.clients.persist(state.client_id)
        else:
            assert session.claim is not None
            node = self.broker.node_id
            await self.broker.clients.hold(
                state.client_id, lease, node, session.claim, state.expiry
            )
        if state.queue is not None:
            await self._member(state, state.queue, connected=True)

    async def _member(self, state: SessionState, queue: str, connected: bool) -> None:
        """The session keeps its own queue for as long as it lasts."""
        lasts = session_lasts(state, connected) + QUEUE_GRACE_S
        await self.broker.queues.join(queue, state.client_id, time.time() * 1000 + lasts * 1000)

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_S / 2)
            for session in list(self.sessions.values()):
                state = session.state
                if state is not None and state.persistent and not session.taken_over:
                    try:
                        await self._hold(session, state)
                    except StoreError as exc:  # Redis away: the next round tries again
                        log.warning("MQTT session lease not renewed (%s)", exc)
                    except Exception:  # a fault of ours: told in full, and the loop goes on
                        log.exception("MQTT session lease not renewed")

    def save_soon(self, session: Session) -> None:
        """Save once this turn's changes are in (e.g. QoS 2 PUBREL ids)."""
        if session.state is not None and session.state.persistent and session not in self._unsaved:
            self._unsaved.add(session)
            self.spawn(self.save(session))

    async def detach(self, session: Session) -> None:
        """The connection of `session` is gone: will, then end or keep the session; then a
        connection waiting to take it over may load it."""
        client_id = session.client_id
        if self.sessions.get(client_id) is session:
            del self.sessions[client_id]
        try:
            await self._detach(session)
        finally:
            if session.claim is not None:
                await self.broker.release_client(client_id, session.claim)

    async def _detach(self, session: Session) -> None:
        state = session.state
        assert state is not None
        client_id = session.client_id
        if session in self._wills_kept:  # (a connection never accepted has none)
            self._wills_kept.discard(session)
            assert session.claim is not None
            if session.will is not None:
                self._schedule_will(session, state, session.claim)
            else:  # dropped by a DISCONNECT 0x00
                self.spawn(self.broker.parting.drop(client_id, session.claim))
        if session.taken_over:  # the state is the new connection's once it loads it
            if state.persistent:
                await self.save(session)  # what it needs next, unless it loaded already
            else:  # the session ends with this connection: nothing stored is resumed
                await self._end_queue(state)
                if session.claim is not None:
                    await self.broker.clients.forget(client_id, session.claim)
                await self._leave_groups(client_id, shared_queues(state))
            return
        if state.expiry == 0:
            await self._end_queue(state)
            await self.broker.clients.delete(client_id)
            await self._leave_groups(client_id, shared_queues(state))
            return
        await self.save(session)
        if state.queue is not None:
            await self._member(state, state.queue, connected=False)
        groups = shared_queues(state)
        for queue in groups:  # the offline session stays a member while it lasts
            await self.broker.queues.join(queue, client_id, membership_until(state, False))
        if state.expiry != NEVER_EXPIRES:
            await self.broker.clients.expire(client_id, state.expiry)
            self._expiry[client_id] = asyncio.get_running_loop().call_later(
                state.expiry + 1, self._expired, client_id, groups
            )

    def _expired(self, client_id: str, groups: list[str]) -> None:
        self._expiry.pop(client_id, None)
        if client_id not in self.sessions:
            self.spawn(self._drop_if_expired(client_id, groups))

    async def _drop_if_expired(self, client_id: str, groups: list[str]) -> None:
        """A connection elsewhere may hold the session with nothing stored (its expiry 0):
        its queue is in use then, not expired."""
        if (
            await self.broker.clients.load(client_id) is None
            and client_id not in self.sessions
            and not await self.broker.client_held(client_id)
        ):
            name = queue_name(client_id)
            if await self.broker.queues.exists(name):
                await self._delete_queue(name)
            await self._leave_groups(client_id, groups)

    # -- shared subscription groups --------------------------------------------------------

    async def shared_queue(self, group: str, topic_filter: str, state: SessionState) -> str:
        """Join a shared subscription group: its durable non-exclusive queue, declared
        (idempotently) after the membership is recorded."""
        name = shared_queue_name(group, topic_filter)
        await self.broker.queues.join(name, state.client_id, membership_until(state, True))
        # only the operator (this adapter) binds it, for members whose subscription the
        # topic ACL allowed: another user's AMQP link or admin get would read what the ACL
        # denies them
        config = QueueConfig(
            name=name,
            durable=True,
            access_type="non-exclusive",
            permission="none",
            max_message_size=ADAPTER_QUEUE_MESSAGE_SIZE,
        )
        await self.broker.queues.create(config, reserved_ok=True, as_it_is=True)
        await self.broker.subscribe_queue(name, [topic_filter], MQTT)
        return name

    async def leave_shared(self, queue: str, client_id: str) -> None:
        """`client_id` leaves a group (its flow on the queue already closed)."""
        await self._leave_groups(client_id, [queue])

    async def _leave_groups(self, client_id: str, queues: list[str]) -> None:
        for queue in queues:
            if await self.broker.queues.leave(queue, client_id) == 2:
                self._recheck_later(queue)

    def _recheck_later(self, queue: str, delay: float = SHARED_RECHECK_S) -> None:
        if queue not in self._rechecks:
            self._rechecks[queue] = asyncio.get_running_loop().call_later(
                delay, self._recheck, queue, delay
            )

    def _recheck(self, queue: str, delay: float) -> None:
        del self._rechecks[queue]
        self.spawn(self._check_group(queue, delay))

    async def _check_group(self, queue: str, delay: float) -> None:
        """Expire lapsed members; while only bound flows keep the group, ask again later
        (their node may die without leaving: nothing else would)."""
        if await self.broker.queues.leave(queue) == 2:
            self._recheck_later(queue, min(delay * 2, SHARED_RECHECK_MAX_S))

    async def _sweep_often(self) -> None:
        while True:
            try:
                await self.sweep()
            except StoreError as exc:  # Redis away: the next round tries again
                log.warning("MQTT group and session queue sweep failed (%s)", exc)
            except Exception:  # a fault of ours: told in full, and the loop goes on
                log.exception("MQTT group and session queue sweep failed")
            await asyncio.sleep(SWEEP_S)

    async def sweep(self) -> None:
        """Check every group and session queue once: a group whose members all lapsed
        (their node crashed before they left) goes, or is rechecked while flows hold it; a
        session queue goes once its session expired unwatched."""
        for name in await self.broker.queues.names():
            if name.startswith(MQTT_SHARED_PREFIX) and name not in self._rechecks:
                await self._check_group(name, SHARED_RECHECK_S / 2)
            elif name.startswith(MQTT_SESSION_PREFIX):
                await self.broker.queues.lapse(name)

    async def _end_queue(self, state: SessionState) -> None:
        """Delete an ending session's queue; a temporary one (of a session that was never
        persistent) later, should Redis refuse now."""
        if state.queue is None:
            return
        if state.persistent:  # persistent until its DISCONNECT set the expiry to 0
            await self._delete_queue(state.queue)
            return
        with contextlib.suppress(QueueError):  # already gone
            await self.broker.delete_temporary_queue(state.queue)

    async def _delete_queue(self, name: str) -> None:
        with contextlib.suppress(QueueError):  # already gone
            await self.broker.delete_queue(name)

    async def _may_use(self, client_id: str, user: str) -> bool:
        """Whether `user` may connect as `client_id`: not when the client id's live session,
        stored session or session queue belongs to another user (taking it over, or a clean
        start forgetting it, would take their session and messages)."""
        live = self.sessions.get(client_id)
        if live is not None and live.access_user != user:
            return False
        elsewhere = await self.broker.client_user(client_id)  # a clean session stores nothing
        if elsewhere is not None and elsewhere != user:
            return False
        raw = await self.broker.clients.load(client_id)
        stored = SessionState.loads(client_id, raw).user if raw is not None else None
        if stored is not None and stored != user:
            return False
        name = queue_name(client_id)
        try:
            config = await self.broker.queues.config(name)
        except QueueError:  # not_found: no session queue
            return True
        if not config.owner or config.owner == user:
            return True
        if config.owner == client_id and client_id not in self._user_names:
            # a queue from before owners were users (owner: the client id): adopt it
            with contextlib.suppress(QueueError):  # gone meanwhile: a new one is made
                await self.broker.queues.update(name, {"owner": user})
            return True
        return False

    async def create_queue(self, state: SessionState, user: str) -> str:
        """The per-client queue: durable for a persistent session, else temporary. It is
        `user`'s alone: other users may not even browse it (permission none)."""
        if not state.persistent:
            return await self.broker.create_temporary_queue(
                owner=user, permission="none", subscription=True
            )
        name = queue_name(state.client_id)
        await self._member(state, name, connected=True)
        # exclusive: during a takeover the old connection's flow drains before the new one
        config = QueueConfig(
            name=name,
            durable=True,
            owner=user,
            permission="none",
            access_type="exclusive",
            max_message_size=ADAPTER_QUEUE_MESSAGE_SIZE,
        )
        await self.broker.queues.create(config, reserved_ok=True)
        return name

    # -- wills -----------------------------------------------------------------------------

    def _schedule_will(self, session: Session, state: SessionState, claim: int) -> None:
        """Publish the will Redis keeps for the connection of `claim`, which ended: now or
        after its delay."""
        delay = _will_delay(session, state)
        if delay <= 0:
            self._publish_will(state.client_id, claim)
            return
        if session.successor_ends is not None:  # a connection on another node took it over
            if session.successor_ends:  # ... and ended the session
                self._publish_will(state.client_id, claim)
            else:
                self.spawn(self.broker.parting.drop(state.client_id, claim))
            return
        handle = asyncio.get_running_loop().call_later(delay, self._fire_will, state.client_id)
        self._wills[state.client_id] = (handle, claim)
        # should this node die first, it goes when due all the same
        due = int((time.time() + delay) * 1000)
        self.spawn(self.broker.parting.due(state.client_id, claim, due))

    def _new_connection(self, client_id: str, ends_session: bool) -> None:
        """A new connection to the session, here or on another node, cancels its expiry
        here, and its delayed will (§3.1.3.2.2) unless it starts afresh: the old session
        ends now, and its will goes."""
        timer = self._expiry.pop(client_id, None)
        if timer is not None:
            timer.cancel()
        pending = self._wills.pop(client_id, None)
        if pending is not None:
            handle, claim = pending
            handle.cancel()
            if ends_session:
                self._publish_will(client_id, claim)
            else:  # the new connection settles it too, unless that one fails first
                self.spawn(self.broker.parting.drop(client_id, claim))

    def _claimed_elsewhere(self, client_id: str, ends_session: bool) -> None:
        """A connection on another node took the client's session: its delayed will is not
        sent, unless that connection starts afresh, ending the session (§3.1.3.2.2); nor
        does it expire here (_new_connection)."""
        self._new_connection(client_id, ends_session)
        live = self.sessions.get(client_id)
        if live is not None:  # about to be taken over: its will waits on this
            live.successor_ends = ends_session

    def _fire_will(self, client_id: str) -> None:
        pending = self._wills.pop(client_id, None)
        if pending is not None:
            self._publish_will(client_id, pending[1])

    def _publish_will(self, client_id: str, claim: int) -> None:
        self.spawn(self._publish_own_will(client_id, claim))

    async def _publish_own_will(self, client_id: str, claim: int) -> None:
        """Take the will of the connection of `claim` from Redis and publish it, unless it
        was settled there first (a new connection to the session, or other nodes while
        this one was presumed dead)."""
        due = await self.broker.parting.own(client_id, claim)
        if due is not None:
            self._send_will(due)

    def _send_will(self, due: Due) -> None:
        self.count("wills")
        self.spawn(self.broker.publish_parting(due))

    # -- shutdown --------------------------------------------------------------------------

    async def close(self) -> None:
        """Disconnect every client, release their flows. Delayed wills go when due, from
        another node or this one's next start (unless their client comes back within the
        delay, as it may to another node at once); those without a delay go now."""
        self.closing = True
        self._renewer.cancel()
        self._sweeper.cancel()
        self.broker.claim_watchers.remove(self._claimed_elsewhere)
        for conn in list(self.connections):
            if conn.session is not None:
                conn.session.shutdown()
        try:
            await self._tasks.wait(lambda: bool(self.connections), CLOSE_TIMEOUT)
        finally:  # also when a second signal cut the wait short: no timer fires after
            for timer in (*self._expiry.values(), *self._rechecks.values()):
                timer.cancel()
            self._expiry.clear()
            self._rechecks.clear()
            for timer, _ in self._wills.values():
                timer.cancel()
            self._wills.clear()
        await self._tasks.wait(lambda: False, CLOSE_TIMEOUT)  # the wills' records settled


def _will_delay(session: Session, state: SessionState) -> int:
    """Seconds a will waits once its connection ended: no longer than the session lasts."""
    will = session.will
    if session.level == 5 and will is not None and will.properties is not None:
        return min(will.properties.will_delay_interval or 0, state.expiry)
    return 0


def _lease(state: SessionState) -> int | None:
    """Seconds a connected session's state is kept should its node die; None: for ever."""
    return None if state.expiry == NEVER_EXPIRES else state.expiry + LEASE_S


async def start(broker: Broker, settings: Settings) -> Listener | None:
    """Plugin entry point: listen on mqtt_port, mqtt_tls_port (with a certificate),
    mqtt_ws_port and mqtt_wss_port (unless -1), all at settings.host."""
    registry = Registry(broker, settings)

    def factory() -> MqttConnection:
        return MqttConnection(registry)

    def websocket_factory() -> WebSocketConnection:
        return WebSocketConnection(MqttConnection(registry))

    plan: Plan = {"mqtt_port": (factory, settings.mqtt_port, None)}
    context = tls_context(settings)
    if context is not None:
        plan["mqtt_tls_port"] = (factory, settings.mqtt_tls_port, context)
    if settings.mqtt_ws_port != -1:
        plan["mqtt_ws_port"] = (websocket_factory, settings.mqtt_ws_port, None)
    if settings.mqtt_wss_port != -1 and context is not None:
        plan["mqtt_wss_port"] = (websocket_factory, settings.mqtt_wss_port, context)
    return await Listener.open("mqtt", registry, settings.host, plan)
