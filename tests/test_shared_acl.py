"""An MQTT shared subscription group's queue against the topic ACL and an operator: only
its members read it, a user the ACL denies a topic the group's filter matches does not
join it, and a group whose queue an operator deleted starts again. Real Redis, raw MQTT
clients on real sockets, python-qpid-proton, the real admin HTTP server. (Found by a
review.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from proton.utils import BlockingConnection, LinkDetached

from gateway.broker import Broker
from gateway.config import Settings
from protocols.amqp.listener import start as start_amqp
from protocols.mqtt.codec import (
    Puback,
    Publish,
    ReasonCode,
    Suback,
    Subscribe,
    SubscriptionOptions,
)
from protocols.mqtt.listener import Listener, start
from protocols.mqtt.state import shared_queue_name
from tests.test_admin_auth import Client, basic, q
from tests.test_mqtt_protocol import Raw
from tests.test_private_queues import SETTINGS, USERS, admin_port  # noqa: F401

SECRET_GROUP = shared_queue_name("g", "secret/#")


@pytest.fixture
async def mqtt(broker: Broker) -> AsyncIterator[Listener]:
    listener = await start(broker, SETTINGS)
    assert listener is not None
    yield listener
    await listener.close()


async def member(port: int, user: str, client_id: str, pattern: str, **kw: bool) -> Raw:
    """A v3.1.1 client of `user` (password `<initial>-pw`) subscribed to `pattern`."""
    raw, ack = await Raw.connected(
        port, 4, client_id=client_id, username=user, password=f"{user[0]}-pw".encode(), **kw
    )
    assert ack.reason_code == 0, ack
    await raw.send(Subscribe(1, [(pattern, SubscriptionOptions(qos=1))]))
    ack = await raw.recv()
    assert isinstance(ack, Suback) and ack.reason_codes == [1], ack
    return raw


async def secrets_reach(alice: Raw, port: int) -> list[str]:
    """20 QoS 1 messages on secret/1..20 from alice's publisher: the topics `alice` (a
    group member) gets of them."""
    pub, _ = await Raw.connected(port, 4, client_id="pub-1", username="alice", password=b"a-pw")
    for i in range(1, 21):
        await pub.send(Publish(f"secret/{i}", b"s", qos=1, packet_id=i))
        assert await pub.recv() == Puback(i)
    got: list[str] = []
    with contextlib.suppress(TimeoutError):
        while len(got) < 20:
            p = await alice.recv(timeout=2.0)
            if isinstance(p, Publish):
                got.append(p.topic)
                await alice.send(Puback(p.packet_id))
    pub.close()
    return got


async def a_secret_waits_for_offline_alice(mqtt: Listener, admin: int) -> None:
    """alice's persistent session is the secret group's only member, offline, and a message
    waits in the group's queue."""
    alice = await member(mqtt.port, "alice", "alice-1", "$share/g/secret/#", clean_start=False)
    alice.close()
    root = Client(admin, basic("root", "r-pw"))
    reply = await root.call("POST", "/api/v1/messages", {"topic": "secret/plan", "payload": "s"})
    assert reply.status == 200, reply


async def test_a_user_denied_the_topics_cannot_read_the_groups_queue_through_the_admin_api(
    mqtt: Listener,
    admin_port: int,  # noqa: F811
) -> None:
    """The group's queue let every user consume it: mallory, whom the ACL denies
    `secret/#` (her SUBSCRIBE to the group is refused), took alice's secret message."""
    await a_secret_waits_for_offline_alice(mqtt, admin_port)
    mallory = Client(admin_port, basic("mallory", "m-pw"))
    got = await mallory.call("POST", q(SECRET_GROUP, "get"), {"count": 1, "timeout_ms": 500})
    assert got.status == 404, (got.status, got.body)  # no queue mallory may see
    root = Client(admin_port, basic("root", "r-pw"))
    assert (await root.call("GET", q(SECRET_GROUP))).body["messages"] == 1  # still alice's


async def test_a_user_denied_the_topics_cannot_read_the_groups_queue_over_amqp(
    broker: Broker,
    mqtt: Listener,
    admin_port: int,  # noqa: F811
) -> None:
    await a_secret_waits_for_offline_alice(mqtt, admin_port)
    amqp = await start_amqp(broker, SETTINGS)
    assert amqp is not None

    def mallory_reads() -> str:
        url = f"amqp://mallory:m-pw@127.0.0.1:{amqp.port}"
        conn = BlockingConnection(url, timeout=5, allowed_mechs="PLAIN")
        try:
            receiver = conn.create_receiver(SECRET_GROUP, credit=1)
            return f"received {receiver.receive(timeout=3).body!r}"
        except LinkDetached as exc:
            return str(exc)
        finally:
            conn.close()

    try:
        outcome = await asyncio.to_thread(mallory_reads)
    finally:
        await amqp.close()
    assert "unauthorized-access" in outcome, outcome


async def test_a_user_denied_a_topic_of_the_filter_does_not_join_the_group(
    mqtt: Listener,
) -> None:
    """A broader filter is allowed, its denied topics held back, for a session's own
    subscription; a group member's: what the group's queue handed mallory's flow was
    acknowledged unsent, not given to alice (the publisher was PUBACKed, the message
    reached no one). A member takes its share of every topic of the group's filter, so
    mallory may not join it."""
    alice = await member(mqtt.port, "alice", "alice-1", "$share/g/#")
    mallory, _ = await Raw.connected(mqtt.port, 5, client_id="mal-1", username="mallory",
                                     password=b"m-pw")  # fmt: skip
    await mallory.send(Subscribe(1, [("$share/g/#", SubscriptionOptions(qos=1))]))
    assert await mallory.recv() == Suback(1, [ReasonCode.NOT_AUTHORIZED])
    await mallory.send(Subscribe(2, [("$share/g/public/#", SubscriptionOptions(qos=1))]))
    assert await mallory.recv() == Suback(2, [1])  # a filter clear of the denied topics
    got = await secrets_reach(alice, mqtt.port)
    assert sorted(got) == sorted(f"secret/{i}" for i in range(1, 21))


async def test_a_group_whose_queue_an_operator_deleted_starts_again(
    mqtt: Listener,
    admin_port: int,  # noqa: F811
) -> None:
    """The session's own queue deleted ends the session (the client is told); a group's
    queue deleted (to drop its backlog: there is no purge) left its members subscribed,
    connected, and given nothing for good."""
    sub = await member(mqtt.port, "alice", "m1", "$share/g/t/#")
    root = Client(admin_port, basic("root", "r-pw"))
    name = shared_queue_name("g", "t/#")
    assert (await root.call("DELETE", q(name))).status == 204
    deadline = asyncio.get_running_loop().time() + 5
    while True:  # the member joins it again: made, subscribed, its flow bound
        shown = await root.call("GET", q(name))
        if shown.status == 200 and shown.body["subscriptions"] and shown.body["flows"]:
            break
        assert asyncio.get_running_loop().time() < deadline, "the group's queue is gone"
        await asyncio.sleep(0.05)
    reply = await root.call("POST", "/api/v1/messages", {"topic": "t/1", "payload": "after"})
    assert reply.status == 200, reply
    got = await sub.recv(timeout=3.0)
    assert isinstance(got, Publish) and got.payload == b"after", got


async def test_a_member_the_acl_came_to_deny_a_topic_leaves_the_group(broker: Broker) -> None:
    """mallory's persistent session joined `$share/g/#` while the ACL allowed it; then it
    denied her `secret/#` and the gateway restarted. Her resumed session took its share of
    the secret messages and dropped them unsent: lost to the group, though alice may have
    them. A resumed member the ACL now refuses leaves the group, and drops the filter (its
    offline session joined the group again, which outlived its last member, filling up).
    (Found by reviews.)"""
    allowed = Settings(mqtt_port=0, host="127.0.0.1", users=USERS)
    before = await start(broker, allowed)
    assert before is not None
    try:
        (await member(before.port, "mallory", "mal-1", "$share/g/#", clean_start=False)).close()
        await asyncio.sleep(0.3)
    finally:
        await before.close()
    mqtt = await start(broker, SETTINGS)  # restarted, with the ACL that denies her
    assert mqtt is not None
    try:
        alice = await member(mqtt.port, "alice", "alice-1", "$share/g/#")
        mallory, ack = await Raw.connected(mqtt.port, 4, client_id="mal-1", username="mallory",
                                           password=b"m-pw", clean_start=False)  # fmt: skip
        assert ack.session_present
        got = await secrets_reach(alice, mqtt.port)
        assert len(got) == 20, f"alice got {len(got)} of 20"
        mallory.close()  # her offline session joined the group again, for good
        await asyncio.sleep(0.3)
        alice.close()  # the last member leaves: the group goes
        deadline = asyncio.get_running_loop().time() + 5
        while await broker.queues.exists(shared_queue_name("g", "#")):
            assert asyncio.get_running_loop().time() < deadline, "outlived its last member"
            await asyncio.sleep(0.05)
    finally:
        await mqtt.close()
