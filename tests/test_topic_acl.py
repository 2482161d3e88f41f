"""The topic ACL binds a user's AMQP clients and admin API calls as it binds its MQTT clients:
a user denied a topic cannot publish to it or read it another way. Real Redis, a real
AMQP listener driven by python-qpid-proton, the real admin HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from proton import Message, Timeout
from proton.reactor import DurableSubscription
from proton.utils import BlockingConnection, LinkDetached, SendException

from gateway.acl import topic_access
from gateway.broker import Broker
from gateway.config import AclRule, Settings, User
from gateway.engine.queues import QueueConfig
from protocols.amqp.listener import Listener, start
from tests.conftest import admin_port_of
from tests.test_admin_auth import Client, basic, q
from tests.test_amqp_clients import TIMEOUT, durable_queues, queued, url

USERS = [User("alice", "s3cret"), User("bob", "s3cret")]
ACL = [AclRule(user="bob", deny_publish=["control/#"], deny_subscribe=["secret/#"])]


@pytest.fixture
async def amqp(broker: Broker) -> AsyncIterator[Listener]:
    settings = Settings(amqp_port=0, host="127.0.0.1", users=USERS, acl=ACL)
    listener = await start(broker, settings)
    assert listener is not None
    yield listener
    await listener.close()


def connect(amqp: Listener, user: str) -> BlockingConnection:
    return BlockingConnection(url(amqp, user, "s3cret"), timeout=TIMEOUT, allowed_mechs="PLAIN")


async def test_a_sender_to_a_denied_topic_is_refused(broker: Broker, amqp: Listener) -> None:
    await broker.declare_queue(QueueConfig(name="doors"), [("control/#", "mqtt")])

    def scenario() -> str:
        alice = connect(amqp, "alice")
        alice.create_sender("topic://control/door").send(Message(body=b"from alice"))
        alice.close()
        bob = connect(amqp, "bob")
        try:
            bob.create_sender("topic://control/door").send(Message(body=b"from bob"))
        except LinkDetached as exc:
            return str(exc)
        finally:
            bob.close()
        return "attached"

    refusal = await asyncio.to_thread(scenario)
    assert "unauthorized-access" in refusal, refusal
    assert await queued(broker, "doors", 1) == 1  # alice's only


async def test_the_anonymous_relay_rejects_a_message_to_a_denied_topic(
    broker: Broker, amqp: Listener
) -> None:
    await broker.declare_queue(QueueConfig(name="doors"), [("control/#", "mqtt")])

    def scenario() -> str:
        bob = connect(amqp, "bob")
        try:
            relay = bob.create_sender(None)
            relay.send(Message(address="topic://status/door", body=b"allowed"))
            try:
                relay.send(Message(address="topic://control/door", body=b"denied"))
            except SendException as exc:
                return str(exc.state)
            return "accepted"
        finally:
            bob.close()

    assert await asyncio.to_thread(scenario) != "accepted"
    assert await queued(broker, "doors", 0) == 0


async def test_a_denied_topic_cannot_be_subscribed_nor_read_through_a_broader_filter(
    broker: Broker, amqp: Listener
) -> None:
    def scenario() -> tuple[str, list[str]]:
        bob = connect(amqp, "bob")
        try:
            try:
                bob.create_receiver("topic://secret/plans")
                refused = "attached"
            except LinkDetached as exc:
                refused = str(exc)
            everything = bob.create_receiver("topic://>", credit=10)
            alice = connect(amqp, "alice")
            for topic in ("secret/plans", "public/news", "secret/more", "public/weather"):
                alice.create_sender(f"topic://{topic}").send(Message(body=topic.encode()))
            alice.close()
            got = []
            for _ in range(2):
                msg = everything.receive(timeout=TIMEOUT)
                got.append(bytes(msg.body).decode())
                everything.accept()
            return refused, got
        finally:
            bob.close()

    refused, got = await asyncio.to_thread(scenario)
    assert "unauthorized-access" in refused, refused
    assert got == ["public/news", "public/weather"]  # the secret ones consumed unseen


@pytest.fixture
async def admin_port(broker: Broker) -> AsyncIterator[int]:
    async with admin_port_of(broker, USERS, ACL) as port:
        yield port


async def test_the_admin_api_holds_a_user_to_the_topic_acl(broker: Broker, admin_port: int) -> None:
    bob = Client(admin_port, basic("bob", "s3cret")).call
    publish = await bob("POST", "/api/v1/messages", {"topic": "control/door", "payload": "x"})
    assert publish.status == 403, publish
    create = await bob("POST", "/api/v1/queues", {"name": "mine", "subscriptions": ["secret/>"]})
    assert create.status == 403, create
    for broader in (">", "secre*/>", "*/plans"):  # a queue's reader gets past any filter
        made = await bob("POST", "/api/v1/queues", {"name": "b", "subscriptions": [broader]})
        assert made.status == 403, (broader, made)
    for temporary in ("$tmp/>", "$t*/>"):  # AMQP connections' temporary topics
        made = await bob("POST", "/api/v1/queues", {"name": "t", "subscriptions": [temporary]})
        assert made.status == 403, (temporary, made)
    assert (await bob("POST", "/api/v1/queues", {"name": "mine"})).status == 201
    subscribe = await bob("POST", q("mine", "subscriptions"), {"pattern": "secret/#"})
    assert subscribe.status == 403, subscribe
    allowed = await bob("POST", q("mine", "subscriptions"), {"pattern": "public/>"})
    assert allowed.status == 200, allowed
    sent = await bob("POST", "/api/v1/messages", {"topic": "public/x", "payload": "x"})
    assert sent.status == 200, sent
    assert (await broker.queues.info("mine")).messages == 1


@pytest.mark.parametrize(
    ("pattern", "syntax", "allowed"),
    [
        ("public/news", "smf", True),
        ("pub*/news", "smf", True),
        ("public/+/x", "mqtt", True),
        ("secretive/x", "smf", True),
        ("$app/hidden", "mqtt", True),  # "+" matches no "$" topic (MQTT §4.7.2)
        ("public/+", "mqtt", False),  # public/hidden
        ("secret", "mqtt", False),  # MQTT's "secret/#" covers "secret" itself
        ("secre*", "smf", False),  # ... which this matches
        (">", "smf", False),
        ("#", "mqtt", False),
        ("secre*/>", "smf", False),
        ("a+b", "smf", False),  # a denied name that is no MQTT pattern: taken literally
        ("a*", "smf", False),
    ],
)
def test_which_queue_subscriptions_could_reach_a_denied_topic(
    pattern: str, syntax: str, allowed: bool
) -> None:
    denied = ["secret/#", "+/hidden", "a+b"]
    access = topic_access([AclRule(user="bob", deny_subscribe=denied)], "bob")
    assert access.may_route(pattern, syntax) is allowed


async def test_a_topic_receivers_queue_is_no_address_for_its_own_user(
    broker: Broker, amqp: Listener, admin_port: int
) -> None:
    """Bob, denied secret/#, attached topic://> (a broader filter delivers him no secret),
    then a second receiver on its queue by name (his own, in his admin API list), which
    nothing filtered: he read alice's secret (found by a review). Such a queue is no
    address, and the admin API's get refuses it too."""
    bob_admin = Client(admin_port, basic("bob", "s3cret"))

    def attach() -> BlockingConnection:
        bob = connect(amqp, "bob")
        bob.create_receiver("topic://>", credit=0)
        return bob

    bob = await asyncio.to_thread(attach)
    try:
        [name] = [row["name"] for row in (await bob_admin.call("GET", "/api/v1/queues")).body]
        with pytest.raises(LinkDetached, match="amqp:unauthorized-access"):
            await asyncio.to_thread(bob.create_receiver, f"queue://{name}")
        got = await bob_admin.call("POST", q(name, "get"), {"count": 5})
        assert got.status == 403, got
    finally:
        await asyncio.to_thread(bob.close)


async def test_a_durable_subscription_looked_up_without_its_topic_is_held_to_the_acl(
    broker: Broker, amqp: Listener, admin_port: int
) -> None:
    """Bob removed the `>` of his durable subscription through the admin API and looked it
    up again with a null source (the Qpid JMS lookup): with no topic, nothing filtered what
    it held, and he read the secret it stored (found by a review). He may not change its
    subscriptions now, and a looked-up subscription is held to his ACL whatever it holds."""

    def subscribe_and_leave() -> None:
        bob = BlockingConnection(url(amqp, "bob", "s3cret"), timeout=TIMEOUT,
                                 allowed_mechs="PLAIN", container_id="bob-jms")  # fmt: skip
        bob.create_receiver("topic://>", name="sub1", options=DurableSubscription()).detach()
        bob.close()
        alice = connect(amqp, "alice")
        alice.create_sender("topic://secret/plans").send(Message(body=b"secret"))
        alice.create_sender("topic://news").send(Message(body=b"news"))
        alice.close()

    await asyncio.to_thread(subscribe_and_leave)
    [name] = await durable_queues(broker, 1)
    bob_admin = Client(admin_port, basic("bob", "s3cret"))
    removing = q(name, "subscriptions") + "?pattern=%3E&syntax=smf"
    assert (await bob_admin.call("DELETE", removing)).status == 403
    assert await broker.unsubscribe_queue(name, [">"]) == 1  # as the operator may

    def look_up() -> list[bytes]:
        bob = BlockingConnection(url(amqp, "bob", "s3cret"), timeout=TIMEOUT,
                                 allowed_mechs="PLAIN", container_id="bob-jms")  # fmt: skip
        try:
            receiver = bob.create_receiver(None, name="sub1", options=DurableSubscription())
            got = []
            with contextlib.suppress(Timeout):
                while True:
                    msg = receiver.receive(0.5)  # (its body is a view into it: kept alive)
                    got.append(bytes(msg.body))
                    receiver.accept()
            return got
        finally:
            bob.close()

    assert await asyncio.to_thread(look_up) == [b"news"]
