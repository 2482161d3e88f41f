"""Users of MQTT clients: a client id belongs to the user that first connected with it, on
every node of one Redis (README: others get 0x87); the topic ACL's rules for a user apply
to it, "anonymous" included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.broker import Broker
from gateway.config import AclRule, Settings, User
from protocols.mqtt.codec import Disconnect
from protocols.mqtt.listener import Listener, start
from tests.test_engine import second_node  # noqa: F401
from tests.test_mqtt_handover import mqtt2  # noqa: F401
from tests.test_mqtt_paho import V5, V311, Client
from tests.test_mqtt_protocol import Raw


@pytest.fixture
def listener_settings() -> Settings:
    users = [User("alice", "a-secret"), User("bob", "b-secret")]
    return Settings(mqtt_port=0, amqp_port=0, host="127.0.0.1", users=users)


@pytest.mark.parametrize("level", [4, 5])
async def test_other_user_cannot_take_over_a_live_clean_session_on_another_node(
    mqtt: Listener,
    mqtt2: Listener,  # noqa: F811
    level: int,
) -> None:
    """A client id belongs to the user connected with it, on every node: a clean session
    stores nothing the other node's check could read."""
    alice, ack = await Raw.connected(
        mqtt.port, level, client_id="sensor-1", username="alice", password=b"a-secret"
    )
    assert ack.reason_code == 0
    # same node: refused, alice stays
    bob, ack = await Raw.connected(
        mqtt.port, level, client_id="sensor-1", username="bob", password=b"b-secret"
    )
    assert ack.reason_code != 0
    await bob.closed()
    # the other node
    _, ack2 = await Raw.connected(
        mqtt2.port, level, client_id="sensor-1", username="bob", password=b"b-secret"
    )
    kicked = None
    try:
        kicked = await alice.recv(timeout=1.5)
    except (TimeoutError, ConnectionError) as exc:
        kicked = exc if isinstance(exc, ConnectionError) else None
    assert kicked is None, f"alice's connection was taken over by bob: {kicked!r}"
    assert ack2.reason_code != 0, "bob connected with alice's live client id on another node"
    await alice.send(Disconnect())


@pytest.fixture
async def acl_gateway(broker: Broker) -> AsyncIterator[Listener]:
    settings = Settings(
        mqtt_port=0,
        host="127.0.0.1",
        users=[User("alice", "s3cret")],
        acl=[AclRule(user="anonymous", deny_publish=["control/#"], deny_subscribe=["secret/#"])],
    )
    mqtt = await start(broker, settings)
    assert mqtt is not None
    yield mqtt
    await mqtt.close()


@pytest.mark.parametrize("version", [V311, V5], ids=["v311", "v5"])
async def test_acl_rule_for_anonymous_applies_to_anonymous_clients(
    acl_gateway: Listener, version: int
) -> None:
    """Clients that do not authenticate are the user "anonymous", to the ACL too (Mosquitto:
    ACL entries before any `user` line apply to anonymous clients)."""
    mqtt = acl_gateway

    def scenario() -> None:
        watcher = Client(mqtt.port, version, "watcher", username="alice", password="s3cret")
        anon = Client(mqtt.port, version, "anon-acl")
        try:
            assert watcher.accepted and anon.accepted
            watcher.subscribe("control/#", 1)
            codes = anon.subscribe("secret/x", 1)
            code = int(getattr(codes[0], "value", codes[0]))
            anon.publish("control/door", b"open", 1)
            leaked = not watcher.nothing_more(1.0)
            assert code in (0x80, 0x87), f"anonymous subscribe to secret/x granted: {code:#x}"
            assert not leaked, "anonymous publish to control/door was delivered"
        finally:
            anon.close()
            watcher.close()

    await asyncio.to_thread(scenario)
