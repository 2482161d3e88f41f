"""The MQTT listener plugin (`gateway.protocols` entry point) and the node's session table.

`Registry` owns what outlives a connection on this node: the `SessionState` per client id
(with session takeover), delayed wills and session expiry timers. A persistent session's
QoS 1/2 subscriptions are also in Redis, as the topic subscriptions of its durable queue
`#mqtt/<hex client id>`, so a reconnect after a gateway restart recovers them from there.
That queue is exclusive: if the same client id is connected to two nodes at once, one of
them consumes and the other stands by (session takeover itself is per node).
Follow-ups that need shared state in Redis: QoS 0 subscriptions, QoS 2 packet ids and
subscription options of a persistent session survive only while this node runs, and the
expiry of a session whose node stopped is not enforced (its queue stays until the client
reconnects with a clean start).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Coroutine
from typing import Any

from gateway.broker import Broker, Outcome, QueueConfig, QueueError
from gateway.config import Settings
from gateway.model import Message, Publisher
from gateway.topics import MQTT
from protocols.mqtt import mapping
from protocols.mqtt.codec import SubscriptionOptions
from protocols.mqtt.connection import MqttConnection
from protocols.mqtt.session import NEVER_EXPIRES, Session, SessionState

log = logging.getLogger(__name__)

QUEUE_PREFIX = "#mqtt/"
CLOSE_TIMEOUT = 5.0


def queue_name(client_id: str) -> str:
    """Deterministic durable queue name for a client id (hashed when hex would not fit)."""
    raw = client_id.encode()
    tail = raw.hex() if len(raw) <= 120 else "h" + hashlib.sha256(raw).hexdigest()
    return QUEUE_PREFIX + tail


class Registry:
    """Sessions, wills and expiry timers of this node's MQTT clients."""

    def __init__(self, broker: Broker, settings: Settings) -> None:
        self.broker = broker
        self.settings = settings
        self.states: dict[str, SessionState] = {}
        self.connections: set[MqttConnection] = set()
        self.counters: dict[str, int] = {}
        self._locks: dict[str, list[Any]] = {}  # client id -> [lock, users]
        self._wills: dict[str, tuple[asyncio.TimerHandle, Message]] = {}
        self._expiry: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task] = set()

    def count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("MQTT session task failed", exc_info=task.exception())

    # -- attach / detach -------------------------------------------------------------------

    async def attach(
        self, session: Session, client_id: str, clean_start: bool, expiry: int
    ) -> tuple[SessionState, bool]:
        """Give `session` the client's state; True if an existing session was resumed."""
        entry = self._locks.setdefault(client_id, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                return await self._attach(session, client_id, clean_start, expiry)
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[client_id]

    async def _attach(
        self, session: Session, client_id: str, clean_start: bool, expiry: int
    ) -> tuple[SessionState, bool]:
        state = self.states.get(client_id)
        if state is not None and state.session is not None:
            await state.session.take_over()
            state = self.states.get(client_id)
        pending = self._wills.pop(client_id, None)
        if pending is not None:  # a new connection to the session cancels a delayed will
            pending[0].cancel()
            if clean_start:  # ... unless the old session ends now
                self._publish_will(pending[1])
        timer = self._expiry.pop(client_id, None)
        if timer is not None:
            timer.cancel()
        if clean_start:
            if state is not None:
                await self._end(state)
            elif await self.broker.queues.exists(queue_name(client_id)):
                await self._delete_queue(queue_name(client_id))
            state = None
        elif state is None:
            state = await self._recover(client_id)
        present = state is not None
        if state is None:
            state = SessionState(client_id)
        state.expiry = expiry
        state.persistent = expiry > 0
        state.session = session
        self.states[client_id] = state
        return state, present

    async def _recover(self, client_id: str) -> SessionState | None:
        """A persistent session from its durable queue (after a gateway restart).

        The queue keeps the filters but not their QoS: they come back as QoS 1."""
        name = queue_name(client_id)
        try:
            info = await self.broker.queues.info(name)
        except QueueError:
            return None
        state = SessionState(client_id, queue=name)
        for pattern, syntax in info.subscriptions:
            if syntax == MQTT:
                state.set_subscription(pattern, SubscriptionOptions(qos=1))
        return state

    async def detach(self, session: Session) -> None:
        """The connection of `session` is gone: will, then end or keep the session."""
        state = session.state
        assert state is not None
        state.session = None
        if session.will is not None:
            self._schedule_will(session, state)
        if state.expiry == 0:
            await self._end(state)
        elif state.expiry != NEVER_EXPIRES:
            self._expiry[state.client_id] = asyncio.get_running_loop().call_later(
                state.expiry, self._expire, state
            )

    def _expire(self, state: SessionState) -> None:
        self._expiry.pop(state.client_id, None)
        if self.states.get(state.client_id) is state and state.session is None:
            self.spawn(self._end(state))

    async def _end(self, state: SessionState) -> None:
        if self.states.get(state.client_id) is state:
            del self.states[state.client_id]
        if state.queue is not None:
            await self._delete_queue(state.queue)
            state.queue = None

    async def _delete_queue(self, name: str) -> None:
        with contextlib.suppress(QueueError):  # already gone
            await self.broker.delete_queue(name)

    async def create_queue(self, state: SessionState) -> str:
        """The per-client queue: durable for a persistent session, else temporary."""
        if not state.persistent:
            return await self.broker.create_temporary_queue(owner=state.client_id)
        name = queue_name(state.client_id)
        # exclusive: should the client id also be connected to another node, one consumes
        config = QueueConfig(
            name=name, durable=True, owner=state.client_id, access_type="exclusive"
        )
        await self.broker.queues.create(config, reserved_ok=True)
        return name

    # -- wills -----------------------------------------------------------------------------

    def _schedule_will(self, session: Session, state: SessionState) -> None:
        will = session.will
        assert will is not None
        publisher = Publisher("mqtt", state.client_id, session.user)
        msg = mapping.to_message(will, publisher, session.level)
        delay = 0
        if session.level == 5 and will.properties is not None:
            delay = min(will.properties.will_delay_interval or 0, state.expiry)
        if delay <= 0:
            self._publish_will(msg)
            return
        handle = asyncio.get_running_loop().call_later(delay, self._fire_will, state.client_id)
        self._wills[state.client_id] = (handle, msg)

    def _fire_will(self, client_id: str) -> None:
        pending = self._wills.pop(client_id, None)
        if pending is not None:
            self._publish_will(pending[1])

    def _publish_will(self, msg: Message) -> None:
        self.count("wills")
        fut = self.broker.publish_nowait(msg)
        fut.add_done_callback(_log_will_outcome)

    # -- shutdown --------------------------------------------------------------------------

    async def close(self) -> None:
        """Disconnect every client, release their flows, publish pending wills now."""
        for conn in list(self.connections):
            if conn.session is not None:
                conn.session.shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_TIMEOUT
        while (self.connections or self._tasks) and loop.time() < deadline:
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=deadline - loop.time())
            else:
                await asyncio.sleep(0.01)
        for timer in self._expiry.values():
            timer.cancel()
        self._expiry.clear()
        for client_id in list(self._wills):
            self._wills[client_id][0].cancel()
            self._fire_will(client_id)


def _log_will_outcome(fut: asyncio.Future[Outcome]) -> None:
    if fut.cancelled():
        return
    if fut.exception() is not None:
        log.warning("will message not published: %s", fut.exception())
    elif not fut.result().accepted:
        log.warning("will message refused: %s", fut.result().name)


class Listener:
    """A bound MQTT server socket; `port` is the actual port (settings may ask for 0)."""

    name = "mqtt"

    def __init__(self, server: asyncio.Server, registry: Registry) -> None:
        self._server = server
        self.registry = registry
        self.port: int = server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self._server.close()
        await self.registry.close()
        await self._server.wait_closed()


async def start(broker: Broker, settings: Settings) -> Listener | None:
    """Plugin entry point: listen on settings.host:settings.mqtt_port."""
    registry = Registry(broker, settings)
    server = await asyncio.get_running_loop().create_server(
        lambda: MqttConnection(registry), settings.host, settings.mqtt_port
    )
    log.info("MQTT listening on %s:%d", settings.host, server.sockets[0].getsockname()[1])
    return Listener(server, registry)
