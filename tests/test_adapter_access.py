"""Queue ownership, permissions and exclusive queues through the protocol adapters, with real
clients (python-qpid-proton, paho-mqtt): every bind and queue change is made as the client's
authenticated user and connection, never as the operator."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from proton import Described, Message, symbol, ubyte, uint, ulong
from proton.reactor import Copy, DurableSubscription, LinkOption
from proton.utils import BlockingConnection, LinkDetached

from gateway.broker import ANONYMOUS, Broker, QueueConfig, QueueError
from gateway.config import Settings, User
from gateway.model import Message as GatewayMessage
from protocols.listening import Listener
from protocols.mqtt.listener import queue_name
from tests.amqp_raw import (
    ATTACH,
    DETACH,
    END,
    RECEIVER,
    SENDER,
    SOURCE,
    TARGET,
    TRANSFER,
    Peer,
    flow,
    frame,
    performative,
)
from tests.test_mqtt_paho import V5, V311, Client

TIMEOUT = 5.0
UNAUTHORIZED = "amqp:unauthorized-access"
LOCKED = "amqp:resource-locked"


@pytest.fixture
def listener_settings() -> Settings:
    users = [User("alice", "a-secret"), User("bob", "b-secret")]
    return Settings(amqp_port=0, mqtt_port=0, host="127.0.0.1", users=users)


def connect(listener: Listener, user: str | None = None, **kw: Any) -> BlockingConnection:
    """A client connection as `user` (password `<initial>-secret`), else anonymous."""
    auth = f"{user}:{user[0]}-secret@" if user else ""
    return BlockingConnection(f"amqp://{auth}127.0.0.1:{listener.port}", timeout=TIMEOUT, **kw)


def refusal(attach: Callable[[], object]) -> str:
    """The error condition of a refused attach ('attached' if it was not refused)."""
    try:
        attach()
    except LinkDetached as exc:
        return str(exc)
    return "attached"


def on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a broker call on the gateway's loop from a client thread."""
    return asyncio.run_coroutine_threadsafe(coro, loop).result(TIMEOUT)


class LifetimePolicy(LinkOption):
    """dynamic-node-properties {lifetime-policy: <policy>} on a dynamic source, by its
    symbolic descriptor or its numeric one."""

    def __init__(self, descriptor: symbol | ulong) -> None:
        self.descriptor = descriptor

    def apply(self, link) -> None:
        policy = Described(self.descriptor, [])
        link.source.properties.put_dict({symbol("lifetime-policy"): policy})


async def test_dynamic_source_is_exclusive_to_its_connection(
    broker: Broker, amqp: Listener
) -> None:
    def scenario() -> tuple[str, str, bytes]:
        owner, other = connect(amqp, "alice"), connect(amqp, "alice")
        try:
            replies = owner.create_receiver(None, dynamic=True, credit=10)
            address = replies.link.remote_source.address
            locked = refusal(lambda: other.create_receiver(address))
            other.create_sender(address).send(Message(body=b"reply"))  # a reply-to address
            msg = replies.receive(TIMEOUT)
            replies.accept()
            return address, locked, bytes(msg.body)
        finally:
            owner.close()
            other.close()

    address, locked, body = await asyncio.to_thread(scenario)
    assert LOCKED in locked and body == b"reply"
    await asyncio.sleep(0.2)
    assert not await broker.queues.exists(address)


async def test_dynamic_node_lifetime_policies(broker: Broker, amqp: Listener) -> None:
    loop = asyncio.get_running_loop()

    def exists(name: str) -> bool:
        return on_loop(loop, broker.queues.exists(name))

    def scenario() -> tuple[dict[str, bool], dict[str, bool], str]:
        conn = connect(amqp)
        try:
            names: dict[str, str] = {}
            for policy, descriptor in (
                ("delete-on-close", symbol("amqp:delete-on-close:list")),
                ("delete-on-no-links", ulong(0x2C)),
                ("delete-on-no-messages", symbol("amqp:delete-on-no-messages:list")),
            ):
                option = LifetimePolicy(descriptor)
                rcv = conn.create_receiver(None, dynamic=True, options=option)
                names[policy] = rcv.link.remote_source.address
                assert exists(names[policy])
                rcv.close()
            time.sleep(0.3)  # the links' broker state is released after their detach
            after_link = {policy: exists(name) for policy, name in names.items()}
        finally:
            conn.close()
        time.sleep(0.3)
        after_connection = {policy: exists(name) for policy, name in names.items()}
        return after_link, after_connection, names["delete-on-no-messages"]

    after_link, after_connection, kept = await asyncio.to_thread(scenario)
    assert after_link == {
        "delete-on-close": False,
        "delete-on-no-links": False,  # its last link went
        "delete-on-no-messages": True,  # emptiness is not watched: kept ...
    }
    assert after_connection == dict.fromkeys(after_link, False)  # ... until the connection ends
    assert kept.startswith("#tmp/")


class DynamicTarget(LinkOption):
    """A sender's dynamic target, delete-on-no-links."""

    def apply(self, link) -> None:
        link.target.dynamic = True
        policy = Described(ulong(0x2C), [])
        link.target.properties.put_dict({symbol("lifetime-policy"): policy})


async def test_a_delete_on_no_links_node_goes_with_the_last_link_to_or_from_it(
    broker: Broker, amqp: Listener
) -> None:
    """§3.5.10: the node lives while links to or from it exist. A dynamic target's node
    (made by a sender link: no consumer ever) stayed until the connection ended; a dynamic
    source's went with its receiver while a sender link of the connection still sent to it.
    (Found by a review.)"""
    loop = asyncio.get_running_loop()

    def exists(name: str) -> bool:
        return on_loop(loop, broker.queues.exists(name))

    def scenario() -> list[bool]:
        conn = connect(amqp)
        try:
            snd = conn.create_sender(None, options=DynamicTarget())
            target = snd.link.remote_target.address
            seen = [exists(target)]
            snd.close()
            time.sleep(0.3)
            seen.append(exists(target))
            rcv = conn.create_receiver(None, dynamic=True, options=LifetimePolicy(ulong(0x2C)))
            source = rcv.link.remote_source.address
            replies = conn.create_sender(source)
            rcv.close()
            time.sleep(0.3)
            seen.append(exists(source))  # a link to it is left
            replies.close()
            time.sleep(0.3)
            seen.append(exists(source))
            return seen
        finally:
            conn.close()

    assert await asyncio.to_thread(scenario) == [True, False, True, False]


async def dynamic_receiver(peer: Peer, name: str, policy: int | None = None) -> str:
    """Attach link `name` (handle 0) with a dynamic source, delete-on-close by default (else
    the lifetime policy of descriptor `policy`); the address of its node."""
    fields: list[object] = [None, None, None, None, True]  # dynamic
    if policy is not None:
        fields.append({symbol("lifetime-policy"): Described(ulong(policy), [])})
    source = Described(ulong(SOURCE), fields)
    target = Described(ulong(TARGET), [None])
    modes = ubyte(0), ubyte(0)
    peer.send(frame(performative(ATTACH, name, uint(0), RECEIVER, *modes, source, target)))
    return str((await peer.expect(ATTACH)).fields[5].value[0])


async def detach(peer: Peer, closed: bool) -> None:
    peer.send(frame(performative(DETACH, uint(0), closed)))
    await peer.expect(DETACH)
    await asyncio.sleep(0.3)  # the link's broker state is released after its detach


async def gone(broker: Broker, name: str) -> bool:
    for _ in range(100):
        if not await broker.queues.exists(name):
            return True
        await asyncio.sleep(0.02)
    return False


@pytest.mark.parametrize("policy", [None, 0x2C], ids=["delete-on-close", "delete-on-no-links"])
async def test_a_delete_on_close_node_outlives_a_detach_without_close(
    broker: Broker, amqp: Listener, policy: int | None
) -> None:
    """Found by a review: a detach with closed=false deleted a delete-on-close node, and
    the messages it held, though the link may be resumed (§3.5.10: the node goes when the
    link ceases to exist). The link's resumption takes it on, and its close deletes it."""
    peer = await Peer.opened(amqp.port)
    node = await dynamic_receiver(peer, "replies", policy)
    await detach(peer, closed=False)
    assert await broker.queues.exists(node), "deleted by a detach without close"
    await broker.publish(GatewayMessage(node, b"reply", to_queue=True))
    peer.attach("replies", 0, RECEIVER, node)  # resumed
    assert (await peer.expect(ATTACH)).fields[5] is not None, "refused"
    peer.send(flow(0, 1))
    message = Message()
    message.decode((await peer.expect(TRANSFER)).payload)
    assert message.body == b"reply"
    await detach(peer, closed=True)
    assert await gone(broker, node), "kept after the resumed link was closed"
    peer.close()


@pytest.mark.parametrize("policy", [None, 0x2C], ids=["delete-on-close", "delete-on-no-links"])
async def test_a_sender_named_like_a_suspended_receiver_is_another_link(
    broker: Broker, amqp: Listener, policy: int | None
) -> None:
    """A link is its name and role (§2.6.1): a sender named like a suspended receiver took
    its place, and the sender's close deleted the node, and the reply in it, that the
    receiver could still resume. (Found by a review.)"""
    peer = await Peer.opened(amqp.port)
    node = await dynamic_receiver(peer, "x", policy)  # handle 0
    await detach(peer, closed=False)
    peer.attach("x", 1, SENDER, node)
    assert (await peer.expect(ATTACH)).fields[6] is not None
    await broker.publish(GatewayMessage(node, b"reply", to_queue=True))
    peer.send(frame(performative(DETACH, uint(1), True)))
    await peer.expect(DETACH)
    await asyncio.sleep(0.3)
    assert await broker.queues.exists(node), "deleted while a suspended link to it exists"
    peer.attach("x", 2, RECEIVER, node)  # resumed
    assert (await peer.expect(ATTACH)).fields[5] is not None
    peer.send(flow(2, 1))
    message = Message()
    message.decode((await peer.expect(TRANSFER)).payload)
    assert message.body == b"reply"
    peer.close()


@pytest.mark.parametrize("policy", [None, 0x2C], ids=["delete-on-close", "delete-on-no-links"])
@pytest.mark.parametrize("end", ["session", "connection"])
async def test_a_suspended_links_delete_on_close_node_goes_with_its_session(
    broker: Broker, amqp: Listener, end: str, policy: int | None
) -> None:
    """A link detached without close ceases to exist when its session or connection ends,
    and its delete-on-close (or delete-on-no-links) node with it."""
    peer = await Peer.opened(amqp.port)
    node = await dynamic_receiver(peer, "replies", policy)
    await detach(peer, closed=False)
    assert await broker.queues.exists(node)
    if end == "session":
        peer.send(frame(performative(END)))
        await peer.expect(END)
    else:
        peer.close()
    assert await gone(broker, node), f"kept after its {end} ended"
    peer.close()


async def test_a_topic_subscribers_queue_goes_with_a_detach_without_close(
    broker: Broker, amqp: Listener
) -> None:
    """No attach can resume a non-durable topic subscription's queue (it is named to no
    one): it goes with the link's detach, closed or not, not with its session."""

    async def temporary() -> list[str]:
        return [n for n in await broker.queues.names() if n.startswith("#tsub/")]

    peer = await Peer.opened(amqp.port)
    peer.attach("sub", 0, RECEIVER, "topic://news")
    await peer.expect(ATTACH)
    assert len(await temporary()) == 1
    await detach(peer, closed=False)
    assert await temporary() == []
    peer.close()


async def test_admin_exclusive_queue_refuses_other_connections(
    broker: Broker, amqp: Listener
) -> None:
    await broker.declare_queue(
        QueueConfig(name="rabbit", durable=False, owner_connection="declaring-connection")
    )

    def scenario() -> tuple[str, str]:
        conn = connect(amqp, "alice")
        try:
            consume = refusal(lambda: conn.create_receiver("rabbit"))
            browse = refusal(lambda: conn.create_receiver("rabbit", name="b", options=Copy()))
            return consume, browse
        finally:
            conn.close()

    consume, browse = await asyncio.to_thread(scenario)
    assert LOCKED in consume and LOCKED in browse


async def test_permission_levels_below_the_owner(broker: Broker, amqp: Listener) -> None:
    await broker.declare_queue(QueueConfig(name="alices", owner="alice", permission="read-only"))
    loop = asyncio.get_running_loop()

    def scenario() -> dict[str, str]:
        alice, bob, anonymous = connect(amqp, "alice"), connect(amqp, "bob"), connect(amqp)
        try:
            alice.create_sender("alices").send(Message(body=b"kept"))
            browser = bob.create_receiver("alices", credit=1, options=Copy())
            msg = browser.receive(TIMEOUT)
            seen = bytes(msg.body)
            browser.accept()
            browser.close()
            found = {
                "bob browses": seen.decode(),
                "bob consumes": refusal(lambda: bob.create_receiver("alices", name="c")),
                "anonymous consumes": refusal(lambda: anonymous.create_receiver("alices")),
            }
            on_loop(loop, broker.queues.update("alices", {"permission": "none"}))
            found["bob browses, none"] = refusal(
                lambda: bob.create_receiver("alices", name="b2", options=Copy())
            )
            rcv = alice.create_receiver("alices", credit=1)
            msg = rcv.receive(TIMEOUT)
            found["alice consumes"] = bytes(msg.body).decode()
            rcv.accept()
            return found
        finally:
            for conn in (alice, bob, anonymous):
                conn.close()

    found = await asyncio.to_thread(scenario)
    assert found["bob browses"] == "kept" and found["alice consumes"] == "kept"
    for case in ("bob consumes", "anonymous consumes", "bob browses, none"):
        assert UNAUTHORIZED in found[case], case


async def test_durable_subscription_is_its_users_alone(broker: Broker, amqp: Listener) -> None:
    def subscribe(user: str, close: bool) -> None:
        conn = connect(amqp, user, container_id="shared-app")
        try:
            sub = conn.create_receiver("topic://d/>", name="sub", options=DurableSubscription())
            (sub.close if close else sub.link.detach)()
        finally:
            conn.close()

    def intrude(address: str | None) -> str:
        conn = connect(amqp, "bob", container_id="shared-app")
        try:  # proton closes the refused link: a JMS unsubscribe when the address is None
            durable = DurableSubscription() if address else None
            return refusal(lambda: conn.create_receiver(address, name="sub", options=durable))
        finally:
            conn.close()

    await asyncio.to_thread(subscribe, "alice", False)
    [name] = [q for q in await broker.queues.names() if q.startswith("#dts/")]
    config = await broker.queues.config(name)
    assert (config.owner, config.permission) == ("alice", "none")
    found = [
        await asyncio.to_thread(intrude, address)
        for address in (None, "topic://d/>", "topic://other")  # lookup, resume, re-subscribe
    ]
    assert all(UNAUTHORIZED in f for f in found), found
    await asyncio.sleep(0.2)
    assert await broker.queues.exists(name)  # bob's unsubscribe deleted nothing
    with pytest.raises(QueueError) as err:
        await broker.delete_queue(name, user="bob")
    assert err.value.code == "unauthorized"
    await asyncio.to_thread(subscribe, "alice", True)  # alice's own unsubscribe
    await asyncio.sleep(0.2)
    assert not await broker.queues.exists(name)


async def test_mqtt_session_queue_is_its_users_alone(
    broker: Broker, amqp: Listener, mqtt: Listener
) -> None:
    name = queue_name("alice-device")

    def alice_subscribes() -> None:
        client = Client(mqtt.port, V311, "alice-device", False, "alice", "a-secret")
        try:
            client.subscribe("m/#", 1)
        finally:
            client.close()

    def bob_tries() -> tuple[str, str, bool]:
        conn = connect(amqp, "bob")
        try:
            consume = refusal(lambda: conn.create_receiver(name))
            browse = refusal(lambda: conn.create_receiver(name, name="b", options=Copy()))
        finally:
            conn.close()
        client = Client(mqtt.port, V5, "alice-device", False, "bob", "b-secret")
        client.close()
        return consume, browse, client.accepted

    await asyncio.to_thread(alice_subscribes)
    config = await broker.queues.config(name)
    assert (config.owner, config.permission) == ("alice", "none")
    consume, browse, bob_connected = await asyncio.to_thread(bob_tries)
    assert UNAUTHORIZED in consume and UNAUTHORIZED in browse
    assert not bob_connected  # CONNACK 0x87: the client id's session is alice's
    assert await broker.queues.exists(name)


async def test_shared_subscriptions_serve_every_user(mqtt: Listener) -> None:
    """Shared subscription queues belong to no user: session queues being private must not
    keep users of one group apart."""

    def scenario() -> tuple[list[list[int]], list[bytes]]:
        alice = Client(mqtt.port, V5, "alice-s", username="alice", password="a-secret")
        bob = Client(mqtt.port, V5, "bob-s", username="bob", password="b-secret")
        anonymous = Client(mqtt.port, V5, "anon-s")
        try:
            granted = [
                [int(getattr(c, "value", c)) for c in client.subscribe("$share/g/s", 1)]
                for client in (alice, bob)
            ]
            for i in range(6):
                anonymous.publish("s", f"m{i}".encode(), 1)
            got: list[bytes] = []
            deadline = time.monotonic() + TIMEOUT
            while len(got) < 6 and time.monotonic() < deadline:
                for client in (alice, bob):
                    with contextlib.suppress(queue.Empty):
                        got.append(client.messages.get(timeout=0.02).payload)
            return granted, got
        finally:
            for client in (alice, bob, anonymous):
                client.close()

    granted, got = await asyncio.to_thread(scenario)
    assert granted == [[1], [1]]
    assert sorted(got) == [f"m{i}".encode() for i in range(6)]


async def test_anonymous_clients_are_a_user(broker: Broker, amqp: Listener) -> None:
    """Without SASL a client is ANONYMOUS, not the operator: it owns what it creates, and
    what another user owns is closed to it as to anyone."""
    loop = asyncio.get_running_loop()

    def scenario() -> QueueConfig:
        conn = connect(amqp)
        try:
            rcv = conn.create_receiver(None, dynamic=True)
            return on_loop(loop, broker.queues.config(rcv.link.remote_source.address))
        finally:
            conn.close()

    config = await asyncio.to_thread(scenario)
    assert (config.owner, config.owner_connection != "") == (ANONYMOUS, True)


@pytest.mark.parametrize("who", ["bob", None], ids=["another-user", "anonymous"])
async def test_the_default_dead_message_queue_shows_no_user_another_users_messages(
    broker: Broker, amqp: Listener, who: str | None
) -> None:
    """#DEAD_MSG_QUEUE gathers every queue's dead messages: declared by name only, it
    grants other users nothing (Solace: no-access for non-owners), though the operator
    may grant more."""
    await broker.declare_queue(QueueConfig(name="#DEAD_MSG_QUEUE"))
    await broker.declare_queue(
        QueueConfig(name="alices-private", permission="none", dmq_eligible_default=True),
        user="alice",
    )

    def alice_rejects_her_secret() -> None:
        conn = connect(amqp, "alice")
        try:
            conn.create_sender("alices-private").send(Message(body=b"alice's secret"))
            receiver = conn.create_receiver("alices-private", credit=1)
            receiver.receive(TIMEOUT)
            receiver.reject()
        finally:
            conn.close()

    await asyncio.to_thread(alice_rejects_her_secret)
    deadline = time.monotonic() + TIMEOUT
    while (await broker.queues.info("#DEAD_MSG_QUEUE")).messages < 1:
        assert time.monotonic() < deadline, "the rejected message was not dead-lettered"
        await asyncio.sleep(0.05)

    def attach(options: Any) -> str:
        conn = connect(amqp, who)
        try:
            return refusal(lambda: conn.create_receiver("#DEAD_MSG_QUEUE", options=options))
        finally:
            conn.close()

    assert UNAUTHORIZED in await asyncio.to_thread(attach, None)
    assert UNAUTHORIZED in await asyncio.to_thread(attach, Copy())  # nor browse
    assert (await broker.queues.config("#DEAD_MSG_QUEUE")).permission == "none"
    granted = QueueConfig(name="#DEAD_MSG_QUEUE", permission="read-only")
    assert granted.permission == "read-only"  # the operator may still grant more
