"""The queues an adapter keeps for its clients' subscriptions (an AMQP durable subscription,
an MQTT session's or shared group's queue) are no address: another user sent into them by
name past the topic ACL (by AMQP link, the anonymous relay, the admin API, or as a queue's
dead message queue), and their own user read them by name past the ACL's subscribe
denials. A user sees only the queues it may browse. Real Redis, the AMQP listener driven
by python-qpid-proton, the MQTT listener with a raw client, the admin HTTP server. (Found
by a review.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from proton import Message
from proton.reactor import DurableSubscription
from proton.utils import BlockingConnection, LinkDetached, SendException

from gateway.broker import Broker
from gateway.config import AclRule, Settings, User
from gateway.engine.queues import subscription_queue
from protocols.amqp.listener import Listener, start
from protocols.mqtt.codec import Suback, Subscribe, SubscriptionOptions
from protocols.mqtt.listener import queue_name
from protocols.mqtt.listener import start as start_mqtt
from protocols.mqtt.state import shared_queue_name
from tests.conftest import admin_port_of
from tests.test_admin_auth import Client, basic, q, refused
from tests.test_amqp_clients import TIMEOUT, durable_queues, url
from tests.test_mqtt_protocol import Raw

USERS = [User(name, f"{name[0]}-pw") for name in ("alice", "bob", "mallory")]
USERS.append(User("root", "r-pw", admin=True))
# only alice's door controller may open doors; bob and mallory may not read secrets
ACL = [
    AclRule(user="bob", deny_publish=["control/#"], deny_subscribe=["secret/#"]),
    AclRule(user="mallory", deny_subscribe=["secret/#"]),
]
SETTINGS = Settings(
    amqp_port=0, mqtt_port=0, host="127.0.0.1", users=USERS, acl=ACL, allow_anonymous=False
)


@pytest.fixture
async def amqp(broker: Broker) -> AsyncIterator[Listener]:
    listener = await start(broker, SETTINGS)
    assert listener is not None
    yield listener
    await listener.close()


@pytest.fixture
async def admin_port(broker: Broker) -> AsyncIterator[int]:
    async with admin_port_of(broker, USERS, ACL) as port:
        yield port


def connect(amqp: Listener, user: str, **kw) -> BlockingConnection:
    return BlockingConnection(
        url(amqp, user, f"{user[0]}-pw"), timeout=TIMEOUT, allowed_mechs="PLAIN", **kw
    )


def door_subscription(amqp: Listener) -> list[bytes]:
    """alice's door controller attaches its durable subscription to control/door: what
    waits in it (none the first time), then it detaches."""
    conn = connect(amqp, "alice", container_id="door-controller")
    got = []
    try:
        sub = conn.create_receiver(
            "topic://control/door", name="doors", credit=10, options=DurableSubscription()
        )
        while True:
            try:
                got.append(bytes(sub.receive(timeout=0.5).body))
            except Exception:
                break
            sub.accept()
        sub.link.detach()
    finally:
        conn.close()
    return got


def bob_sends(amqp: Listener, address: str | None, to: str | None = None) -> str:
    """bob sends one message to `address` (None: the anonymous relay, to `to`)."""
    conn = connect(amqp, "bob")
    try:
        try:
            sender = conn.create_sender(address)
        except LinkDetached as exc:
            return f"refused: {exc}"
        try:
            sender.send(Message(address=to, body=b"OPEN THE DOOR"))
        except SendException as exc:
            return f"rejected: {exc.state}"
        return "accepted"
    finally:
        conn.close()


async def mqtt_session(broker: Broker, user: str, client_id: str, pattern: str) -> str:
    """A persistent MQTT session of `user` subscribed to `pattern`, offline: its queue."""
    mqtt = await start_mqtt(broker, SETTINGS)
    assert mqtt is not None
    try:
        password = f"{user[0]}-pw".encode()
        raw, ack = await Raw.connected(mqtt.port, 4, client_id=client_id, username=user,
                                       password=password, clean_start=False)  # fmt: skip
        assert ack.reason_code == 0, ack
        await raw.send(Subscribe(1, [(pattern, SubscriptionOptions(qos=1))]))
        assert isinstance(await raw.recv(), Suback)
        raw.close()
    finally:
        await mqtt.close()
    return shared_queue_name("g", "control/#") if pattern.startswith("$share/") else (
        queue_name(client_id)
    )  # fmt: skip


@pytest.mark.parametrize("way", ["link", "relay"])
async def test_no_user_sends_into_a_durable_subscription_by_its_name(
    broker: Broker, amqp: Listener, way: str
) -> None:
    """bob, whom the ACL denies control/#, put a control/door message into alice's
    durable subscription by sending to its queue."""
    await asyncio.to_thread(door_subscription, amqp)
    [dts] = await durable_queues(broker, 1)
    address, to = (f"queue://{dts}", "topic://control/door") if way == "link" else (
        None, f"queue://{dts}")  # fmt: skip
    outcome = await asyncio.to_thread(bob_sends, amqp, address, to)
    # the link refused, or the message rejected (37: proton's REJECTED)
    assert "unauthorized-access" in outcome or outcome == "rejected: 37", outcome
    assert await asyncio.to_thread(door_subscription, amqp) == []


async def test_no_user_sends_into_a_durable_subscription_through_the_admin_api(
    broker: Broker, amqp: Listener, admin_port: int
) -> None:
    await asyncio.to_thread(door_subscription, amqp)
    [dts] = await durable_queues(broker, 1)
    bob = Client(admin_port, basic("bob", "b-pw"))
    sent = await bob.call("POST", q(dts, "messages"), {"payload": "OPEN THE DOOR"})
    assert sent.status == 403, sent
    assert await asyncio.to_thread(door_subscription, amqp) == []


@pytest.mark.parametrize("pattern", ["news/#", "$share/g/control/#"])
async def test_no_user_sends_into_an_mqtt_sessions_or_groups_queue(
    broker: Broker, amqp: Listener, pattern: str
) -> None:
    queue = await mqtt_session(broker, "alice", "alice-phone", pattern)
    outcome = await asyncio.to_thread(bob_sends, amqp, f"queue://{queue}")
    assert "unauthorized-access" in outcome, outcome
    assert (await broker.queues.info(queue)).messages == 0


async def test_a_users_queue_does_not_dead_letter_into_a_subscription_queue(
    broker: Broker, amqp: Listener, admin_port: int
) -> None:
    """bob's queue named alice's durable subscription as its dead message queue: what he
    rejected on his own queue went to her door controller."""
    await asyncio.to_thread(door_subscription, amqp)
    [dts] = await durable_queues(broker, 1)
    bob = Client(admin_port, basic("bob", "b-pw"))
    made = await bob.call("POST", "/api/v1/queues", {"name": "bobq", "dead_message_queue": dts})
    assert made.status == 400, made
    assert (await bob.call("POST", "/api/v1/queues", {"name": "bobq"})).status == 201
    patched = await bob.call("PATCH", q("bobq"), {"dead_message_queue": dts})
    assert patched.status == 400, patched
    assert (await broker.queues.config("bobq")).dead_message_queue == "#DEAD_MSG_QUEUE"


async def test_a_user_does_not_read_its_own_subscription_queue_past_the_acl(
    broker: Broker, amqp: Listener, admin_port: int
) -> None:
    """bob's broader filter `#` is allowed, the secret topics held back as his session
    delivers; by his session queue's name he read them all."""
    session = await mqtt_session(broker, "bob", "bob-1", "#")

    def alice_publishes_then_bob_reads() -> str:
        conn = connect(amqp, "alice")
        conn.create_sender("topic://secret/plan").send(Message(body=b"secret"))
        conn.close()
        conn = connect(amqp, "bob")
        try:
            conn.create_receiver(f"queue://{session}", credit=10)
            return "attached"
        except LinkDetached as exc:
            return str(exc)
        finally:
            conn.close()

    outcome = await asyncio.to_thread(alice_publishes_then_bob_reads)
    assert "unauthorized-access" in outcome, outcome
    bob = Client(admin_port, basic("bob", "b-pw"))
    got = await bob.call("POST", q(session, "get"), {"count": 10, "timeout_ms": 200})
    assert got.status == 403, got
    assert (await broker.queues.info(session)).messages == 1  # still his session's


async def test_a_user_sees_only_the_queues_it_may_browse(
    broker: Broker, amqp: Listener, admin_port: int
) -> None:
    """The admin API listed and showed bob every queue: alice's private ones too, named
    after her container id and subscription, with their topic subscriptions; its other
    routes answered 403 for them (404 for no queue), the metrics named them."""
    await asyncio.to_thread(door_subscription, amqp)
    [dts] = await durable_queues(broker, 1)
    bob = Client(admin_port, basic("bob", "b-pw"))
    assert (await bob.call("POST", "/api/v1/queues", {"name": "open"})).status == 201
    names = [row["name"] for row in (await bob.call("GET", "/api/v1/queues")).body]
    assert "open" in names and dts not in names, names
    for method, body in (("GET", None), ("PATCH", {"max_messages": 9}), ("DELETE", None)):
        reply = await bob.call(method, q(dts), body)  # as if it were not there
        assert reply.status == 404, (method, reply)
    metrics = (await bob.call("GET", "/metrics")).body.decode()
    assert 'queue="open"' in metrics and dts not in metrics
    root = Client(admin_port, basic("root", "r-pw"))
    assert dts in [row["name"] for row in (await root.call("GET", "/api/v1/queues")).body]


async def test_another_user_adds_no_topic_the_queues_owner_is_denied(admin_port: int) -> None:
    """A queue subscription added through the admin API is refused if it could match a
    topic the caller may not read: alice, whom the ACL lets read secrets, added `secret/>`
    to mallory's queue (permission modify-topic), and mallory read them from it. The
    owner's ACL binds it too, as the owner reads what it holds. (Found by a review.)"""
    mallory = Client(admin_port, basic("mallory", "m-pw"))
    alice = Client(admin_port, basic("alice", "a-pw"))
    body = {"name": "mq", "permission": "modify-topic"}
    assert (await mallory.call("POST", "/api/v1/queues", body)).status == 201
    refused(await mallory.call("POST", q("mq", "subscriptions"), {"pattern": "secret/>"}))
    refused(await alice.call("POST", q("mq", "subscriptions"), {"pattern": "secret/>"}))
    redeclared = {**body, "subscriptions": ["secret/>"]}  # the declaration route as well
    refused(await alice.call("POST", "/api/v1/queues", redeclared))
    added = await alice.call("POST", q("mq", "subscriptions"), {"pattern": "news/>"})
    assert added.status == 200 and added.body == {"changed": 1}
    shown = (await mallory.call("GET", q("mq"))).body["subscriptions"]
    assert shown == [{"pattern": "news/>", "syntax": "smf"}]


async def test_declaring_a_queue_the_user_may_not_see_shows_nothing_of_it(
    admin_port: int,
) -> None:
    """Bob, answered 404 for alice's private queue, declared it by name and got it whole
    (owner, subscriptions, flows) or a 409 naming its selector. (Found by a review.)"""
    alice = Client(admin_port, basic("alice", "a-pw"))
    bob = Client(admin_port, basic("bob", "b-pw"))
    body = {"name": "payroll", "permission": "none", "subscriptions": ["pay/>"]}
    body["subscription_selector"] = "amount > 1e5"
    assert (await alice.call("POST", "/api/v1/queues", body)).status == 201
    for declared in ({"name": "payroll"}, body):
        reply = await bob.call("POST", "/api/v1/queues", declared)
        assert reply.status == 409 and "pay/>" not in str(reply.body), reply
        assert "1e5" not in str(reply.body) and "alice" not in str(reply.body), reply
    assert (await alice.call("POST", "/api/v1/queues", body)).status == 200


async def test_a_clean_sessions_queue_is_its_sessions_alone(
    broker: Broker, admin_port: int
) -> None:
    """Bob, denied secret/#, subscribed # in a clean MQTT session (a broader filter delivers
    him no secret) and took the secret from its queue, his own, with an admin API get: the
    queue was no subscription queue by its name (found by a review)."""
    mqtt = await start_mqtt(broker, SETTINGS)
    assert mqtt is not None
    try:
        raw, ack = await Raw.connected(mqtt.port, 5, client_id="bob-clean", username="bob",
                                       password=b"b-pw", clean_start=True)  # fmt: skip
        assert ack.reason_code == 0, ack
        await raw.send(Subscribe(1, [("#", SubscriptionOptions(qos=1))]))
        assert isinstance(await raw.recv(), Suback)
        bob = Client(admin_port, basic("bob", "b-pw"))
        [name] = [row["name"] for row in (await bob.call("GET", "/api/v1/queues")).body]
        assert subscription_queue(name), name
        assert (await bob.call("POST", q(name, "get"), {"count": 5})).status == 403
        raw.close()
    finally:
        await mqtt.close()
