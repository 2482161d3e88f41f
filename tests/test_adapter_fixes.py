"""Protocol adapter edge cases, with real clients and raw sockets against a real Redis:
hostile AMQP encodings, undeliverable messages, who may use a client id or another user's
temporary queue, nodes of a connection that drops mid-attach, shared groups whose members
lapsed."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time

import pytest
import redis
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from proton import Connection, Described, Disposition, Message, Transport, symbol
from proton.handlers import MessagingHandler
from proton.reactor import Container
from proton.utils import BlockingConnection

from gateway.admin.api import AdminApi
from gateway.admin.http import HttpServer
from gateway.broker import Broker, QueueConfig, QueueError
from gateway.config import Settings, User
from gateway.engine.queues import TEMPORARY_PREFIX
from gateway.model import Message as GatewayMessage
from protocols.listening import Listener
from protocols.mqtt.listener import queue_name
from protocols.mqtt.listener import start as start_mqtt
from protocols.mqtt.session import NEVER_EXPIRES
from protocols.mqtt.state import SessionState, shared_queue_name
from tests.test_admin_auth import Client as HttpClient
from tests.test_admin_auth import basic, q
from tests.test_mqtt_paho import V5, V311, Client

TIMEOUT = 5.0
USERS = [User("alice", "a-secret"), User("bob", "b-secret")]
# header {durable: true, priority: byte -5}, then a data section "a"
NEGATIVE_PRIORITY = bytes.fromhex("005370c004024151fb") + bytes.fromhex("005375a00161")


@pytest.fixture
def listener_settings() -> Settings:
    return Settings(amqp_port=0, mqtt_port=0, host="127.0.0.1", users=USERS)


def url(listener: Listener, user: str | None = None) -> str:
    auth = f"{user}:{user[0]}-secret@" if user else ""
    return f"amqp://{auth}127.0.0.1:{listener.port}"


async def eventually(check, expected: object) -> object:
    """The value of `check()` once it equals `expected`, or at the deadline."""
    deadline = time.monotonic() + TIMEOUT
    while (value := await check()) != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return value


class RawSender(MessagingHandler):
    """Sends raw transfer payloads (not proton Messages) to one address; records outcomes."""

    def __init__(self, address: str, target: str, payloads: list[bytes]) -> None:
        super().__init__()
        self.address, self.target, self.payloads = address, target, list(payloads)
        self.expected = len(payloads)
        self.outcomes: list[tuple[object, str | None]] = []

    def on_start(self, event) -> None:
        self.conn = event.container.connect(self.address)
        event.container.create_sender(self.conn, self.target)
        self.timer = event.container.schedule(TIMEOUT, self)  # outcomes missing: give up

    def on_timer_task(self, event) -> None:
        self.conn.close()

    def on_sendable(self, event) -> None:
        while self.payloads and event.sender.credit:
            event.sender.delivery(str(len(self.payloads)).encode())
            event.sender.send(self.payloads.pop(0))
            event.sender.advance()

    def on_settled(self, event) -> None:
        condition = event.delivery.remote.condition
        self.outcomes.append((event.delivery.remote_state, condition.name if condition else None))
        if len(self.outcomes) == self.expected:
            self.timer.cancel()
            event.connection.close()


def send_raw(listener: Listener, target: str, payloads: list[bytes]) -> list:
    sender = RawSender(url(listener), target, payloads)
    Container(sender).run()
    return sender.outcomes


def receive(listener: Listener, address: str, count: int) -> list[Message]:
    conn = BlockingConnection(url(listener), timeout=TIMEOUT)
    try:
        receiver = conn.create_receiver(address, credit=count)
        got = []
        for _ in range(count):
            got.append(receiver.receive(TIMEOUT))
            receiver.accept()
        return got
    finally:
        conn.close()


# -- AMQP encodings ----------------------------------------------------------------------------


async def test_a_negative_header_priority_is_read_as_proton_reads_it(
    broker: Broker, amqp: Listener
) -> None:
    await broker.declare_queue(QueueConfig(name="prio-q"))
    outcomes = await asyncio.to_thread(send_raw, amqp, "prio-q", [NEGATIVE_PRIORITY])
    assert outcomes == [(Disposition.ACCEPTED, None)], outcomes
    (msg,) = await asyncio.to_thread(receive, amqp, "prio-q", 1)
    assert msg.priority == 4 and bytes(msg.body) == b"a"


async def test_a_message_that_cannot_be_encoded_is_rejected_not_left_in_the_window(
    broker: Broker, amqp: Listener
) -> None:
    await broker.declare_queue(QueueConfig(name="enc-q"))
    bad = GatewayMessage("enc-q", b"bad", correlation_id=-5, to_queue=True)  # no AMQP form
    assert (await broker.publish(bad)).accepted
    assert (await broker.publish(GatewayMessage("enc-q", b"good", to_queue=True))).accepted
    (msg,) = await asyncio.to_thread(receive, amqp, "enc-q", 1)
    assert bytes(msg.body) == b"good"

    async def depth() -> int:
        return (await broker.queues.info("enc-q")).messages

    assert await eventually(depth, 0) == 0


async def test_deeply_nested_values_are_refused_as_a_decode_error(
    broker: Broker, amqp: Listener
) -> None:
    nested = b"\x45"
    for _ in range(1000):
        nested = b"\xd0" + (len(nested) + 4).to_bytes(4, "big") + b"\x00\x00\x00\x01" + nested
    good = bytes(Message(body=b"after").encode())
    await broker.declare_queue(QueueConfig(name="deep-q"))
    payloads = [b"\x00\x53\x77" + nested, good]
    outcomes = await asyncio.to_thread(send_raw, amqp, "deep-q", payloads)
    assert outcomes == [(Disposition.REJECTED, "amqp:decode-error"), (Disposition.ACCEPTED, None)]
    assert (await broker.queues.info("deep-q")).messages == 1


# -- AMQP temporary queues -------------------------------------------------------------------


async def test_another_user_may_send_to_a_reply_queue_but_not_delete_or_bind_it(
    broker: Broker, amqp: Listener
) -> None:
    server = HttpServer(AdminApi(broker, USERS))
    port = await server.start("127.0.0.1", 0)
    alice = await asyncio.to_thread(BlockingConnection, url(amqp, "alice"), timeout=TIMEOUT)
    try:
        replies = await asyncio.to_thread(alice.create_receiver, None, dynamic=True, credit=5)
        address = replies.link.remote_source.address
        with pytest.raises(QueueError):
            await broker.delete_queue(address, user="bob")
        with pytest.raises(QueueError):
            await broker.subscribe_queue(address, ["news/>"], user="bob")
        bob_http = HttpClient(port, basic("bob", "b-secret"))
        # refused as a queue bob may not see (its name untold)
        assert (await bob_http.call("DELETE", q(address))).status == 404

        def bob_replies() -> None:
            bob = BlockingConnection(url(amqp, "bob"), timeout=TIMEOUT)
            try:
                bob.create_sender(address).send(Message(body=b"reply"))
            finally:
                bob.close()

        await asyncio.to_thread(bob_replies)
        msg = await asyncio.to_thread(replies.receive, TIMEOUT)
        assert bytes(msg.body) == b"reply"
        assert await broker.queues.exists(address)
    finally:
        await asyncio.to_thread(alice.close)
        await server.close()


def attach_then_drop(port: int) -> None:
    """Open, begin and attach a receiver from a dynamic source (delete-on-no-messages) in
    one write (plain AMQP header, anonymous), then close the socket at once."""
    conn = Connection()
    transport = Transport()
    transport.bind(conn)
    conn.open()
    session = conn.session()
    session.open()
    receiver = session.receiver("drop")
    receiver.source.dynamic = True  # kept until the connection ends, whatever the link does
    policy = Described(symbol("amqp:delete-on-no-messages:list"), [])
    receiver.source.properties.put_dict({symbol("lifetime-policy"): policy})
    receiver.open()
    out = transport.peek(transport.pending())
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(out)


async def test_a_node_made_for_a_connection_that_dropped_during_attach_is_deleted(
    broker: Broker, amqp: Listener, redis_url: str
) -> None:
    async def temporaries() -> list[str]:
        return [n for n in await broker.queues.names() if n.startswith(TEMPORARY_PREFIX)]

    pauser = redis.Redis.from_url(redis_url)
    try:  # Redis holds writes back: the queue is made after the connection has gone
        pauser.execute_command("CLIENT", "PAUSE", "400", "WRITE")
        await asyncio.to_thread(attach_then_drop, amqp.port)
    finally:
        pauser.close()
    await asyncio.sleep(0.6)
    assert await eventually(temporaries, []) == []


# -- MQTT client ids -------------------------------------------------------------------------


def expiring(seconds: int) -> Properties:
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = seconds
    return props


async def test_a_session_queue_from_before_user_owners_is_adopted(
    broker: Broker, mqtt: Listener
) -> None:
    name = queue_name("dev-1")  # its owner was the client id then
    legacy = QueueConfig(
        name=name, durable=True, owner="dev-1", permission="none", access_type="exclusive"
    )
    await broker.queues.create(legacy, reserved_ok=True)
    stored = json.loads(SessionState("dev-1", True, NEVER_EXPIRES, queue=name).dumps())
    del stored["user"]  # a state saved before owners were recorded
    await broker.clients.save("dev-1", json.dumps(stored).encode(), None, claim=0)

    def alice_connects() -> bool:
        client = Client(mqtt.port, V311, "dev-1", False, "alice", "a-secret")
        client.close()
        return client.accepted

    assert await asyncio.to_thread(alice_connects)
    assert (await broker.queues.config(name)).owner == "alice"
    raw = await broker.clients.load("dev-1")
    assert raw is not None and SessionState.loads("dev-1", raw).user == "alice"


@pytest.mark.parametrize("version", [V5, V311], ids=["v5", "v311"])
async def test_another_user_cannot_take_over_a_live_session(mqtt: Listener, version: int) -> None:
    def scenario() -> tuple[bool, int, bool]:
        alice = Client(mqtt.port, version, "phone", True, "alice", "a-secret")
        try:
            bob = Client(mqtt.port, version, "phone", True, "bob", "b-secret")
            bob.close()
            return bob.accepted, bob.reason.value, alice.disconnected.wait(0.3)
        finally:
            alice.close()

    bob_accepted, reason, alice_dropped = await asyncio.to_thread(scenario)
    assert (bob_accepted, reason, alice_dropped) == (False, 0x87, False)


async def test_a_clean_start_cannot_forget_another_users_stored_session(
    broker: Broker, mqtt: Listener
) -> None:
    def scenario() -> tuple[bool, int]:
        alice = Client(mqtt.port, V5, "tablet", False, "alice", "a-secret", expiring(60))
        alice.subscribe("news/#", 0)  # QoS 0 only: the session has no queue
        alice.close()
        bob = Client(mqtt.port, V5, "tablet", True, "bob", "b-secret")
        bob.close()
        return bob.accepted, bob.reason.value

    assert await asyncio.to_thread(scenario) == (False, 0x87)
    raw = await broker.clients.load("tablet")
    assert raw is not None and SessionState.loads("tablet", raw).user == "alice"
    assert "news/#" in SessionState.loads("tablet", raw).subscriptions


# -- MQTT shared groups ----------------------------------------------------------------------


async def test_a_group_whose_members_lapsed_on_a_dead_node_is_swept_at_start(
    broker: Broker, listener_settings: Settings
) -> None:
    name = shared_queue_name("grp", "jobs/#")
    await broker.queues.join(name, "gone-member", time.time() * 1000 - 1000)
    config = QueueConfig(name=name, durable=True, access_type="non-exclusive")
    await broker.queues.create(config, reserved_ok=True)
    kept = shared_queue_name("grp", "kept/#")
    await broker.queues.join(kept, "live-member", math.inf)
    await broker.queues.create(QueueConfig(name=kept, durable=True), reserved_ok=True)
    listener = await start_mqtt(broker, listener_settings)
    assert listener is not None
    try:

        async def exists() -> bool:
            return await broker.queues.exists(name)

        assert await eventually(exists, False) is False
        assert await broker.queues.exists(kept)
    finally:
        await listener.close()
