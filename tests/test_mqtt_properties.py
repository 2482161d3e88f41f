"""MQTT 5 user properties the gateway applies: DMQ eligibility and delivery time (paho)."""

from __future__ import annotations

import asyncio
import time

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gateway.broker import Broker, QueueConfig
from gateway.engine.queues import DEAD_MESSAGE_QUEUE
from gateway.model import DEAD_LETTER_REASON, Delivery, Message, Outcome
from protocols.mqtt.listener import Listener
from tests.test_engine import wait_for
from tests.test_mqtt_paho import V5, Client


def publish_props(*user: tuple[str, str], expiry: int | None = None) -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    props.UserProperty = list(user)
    if expiry is not None:
        props.MessageExpiryInterval = expiry
    return props


def user_properties(msg) -> list[tuple[str, str]]:
    return list(getattr(msg.properties, "UserProperty", []) or [])


@pytest.mark.parametrize("qos", [0, 1], ids=["direct", "spooled"])
async def test_delivery_time_and_delay_hold_the_message(mqtt: Listener, qos: int) -> None:
    """Held until due for a QoS 1 subscriber (spooled) and a QoS 0 one (direct) alike."""

    def scenario() -> tuple[list[bytes], float, list[list[tuple[str, str]]]]:
        sub = Client(mqtt.port, V5, "held-sub")
        pub = Client(mqtt.port, V5, "held-pub")
        try:
            sub.subscribe("held/#", qos)
            due = int(time.time() * 1000) + 700
            pub.publish("held/a", b"at", 1, publish_props(("x-opt-delivery-time", str(due))))
            pub.publish("held/b", b"after", 1, publish_props(("x-opt-delivery-delay", "700")))
            sent = time.monotonic()
            assert sub.nothing_more(0.4)  # held: nothing before it is due
            got = sub.receive(2)
            return (
                [m.payload for m in got],
                time.monotonic() - sent,
                [user_properties(m) for m in got],
            )
        finally:
            sub.close()
            pub.close()

    payloads, waited, props = await asyncio.to_thread(scenario)
    assert sorted(payloads) == [b"after", b"at"]
    assert waited >= 0.5
    assert props == [[], []]  # consumed: not forwarded as user properties


async def test_invalid_values_are_forwarded_unchanged(mqtt: Listener) -> None:
    given = [
        ("x-opt-dmq-eligible", "maybe"),
        ("x-opt-delivery-delay", "soon"),
        ("x-opt-delivery-time", "-5"),
        ("JMSPriority", "\u00b2"),  # a digit to str.isdigit, not to int: refused nothing
        ("colour", "red"),
    ]

    def scenario() -> tuple[bytes, list[tuple[str, str]]]:
        sub = Client(mqtt.port, V5, "bad-sub")
        pub = Client(mqtt.port, V5, "bad-pub")
        try:
            sub.subscribe("bad/t", 1)
            assert pub.publish("bad/t", b"now", 1, publish_props(*given)).is_published()
            [msg] = sub.receive(1)  # not held, not refused
            return msg.payload, user_properties(msg)
        finally:
            sub.close()
            pub.close()

    assert await asyncio.to_thread(scenario) == (b"now", given)


@pytest.mark.parametrize("group", ["JMSXGroupId", "JMSXGroupID"])
async def test_group_and_priority_properties_are_forwarded_unaltered_in_place(
    mqtt: Listener, group: str
) -> None:
    """MQTT-3.3.2-17, -18: all user properties, unaltered, in their order, although the
    gateway reads the group and the priority from them."""
    given = [
        ("a", "1"),
        (group, "g"),
        ("JMSPriority", "07"),
        ("b", "2"),
        ("JMSPriority", "4"),
    ]

    def scenario() -> list[tuple[str, str]]:
        sub = Client(mqtt.port, V5, "gp-sub")
        pub = Client(mqtt.port, V5, "gp-pub")
        try:
            sub.subscribe("gp/t", 1)
            assert pub.publish("gp/t", b"x", 1, publish_props(*given)).is_published()
            [msg] = sub.receive(1)
            return user_properties(msg)
        finally:
            sub.close()
            pub.close()

    assert await asyncio.to_thread(scenario) == given


@pytest.mark.parametrize("name", ["JMSXGroupId", "JMSXGroupID"])
async def test_either_spelling_of_the_group_property_keys_a_partition(
    broker: Broker, mqtt: Listener, name: str
) -> None:
    """Solace's clients spell the partition key JMSXGroupID (the gateway's REST publish and
    selectors read that spelling): its messages were spread over the partitions."""
    await broker.declare_queue(
        QueueConfig(name="pq", partition_count=4, partition_rebalance_delay_ms=0),
        [("pq/in", "smf")],
    )

    def scenario() -> None:
        pub = Client(mqtt.port, V5, "key-pub")
        try:
            for i in range(20):
                props = publish_props((name, "dev-1"))
                assert pub.publish("pq/in", b"%d" % i, 1, props).is_published()
        finally:
            pub.close()

    await asyncio.to_thread(scenario)
    info = (await broker.queues.info("pq")).to_json()
    assert sorted(p["messages"] for p in info["partitions"]) == [0, 0, 0, 20]


async def test_dmq_eligible_message_is_dead_lettered_when_it_expires(
    broker: Broker, mqtt: Listener
) -> None:
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(QueueConfig(name="ttl", respect_ttl=True), [("ttl/t", "mqtt")])

    def publish() -> None:
        pub = Client(mqtt.port, V5, "ttl-pub")
        try:
            for body, eligible in ((b"eligible", "true"), (b"not", "false"), (b"default", None)):
                user = [("x-opt-dmq-eligible", eligible)] if eligible else []
                pub.publish("ttl/t", body, 1, publish_props(*user, expiry=1))
        finally:
            pub.close()

    await asyncio.to_thread(publish)
    await asyncio.sleep(1.1)  # the 1 s message expiry passes
    got: list[Delivery] = []
    await broker.bind("ttl", got.append)  # expired messages are found as the flow fetches
    dead: list[Delivery] = []
    await broker.bind(DEAD_MESSAGE_QUEUE, dead.append)
    await wait_for(lambda: len(dead) == 1)
    await asyncio.sleep(0.2)
    assert got == []
    assert [d.message.payload for d in dead] == [b"eligible"]
    assert dead[0].message.annotations[DEAD_LETTER_REASON] == "expired"
    assert ("x-opt-dmq-eligible", "true") not in dead[0].message.user_properties
    info = await broker.queues.info("ttl")
    assert info.counters["expired"] == 3
    assert info.counters["dead_lettered"] == 1 and info.counters["discarded"] == 2


async def test_an_expiry_past_what_mqtt_5_can_say_is_its_longest(
    mqtt: Listener, broker: Broker
) -> None:
    """An AMQP publisher may name an expiry in the year 5000: the PUBLISH could not be
    encoded (the delivery failed in its callback); it carries 0xFFFFFFFF seconds now."""

    def subscribed() -> Client:
        sub = Client(mqtt.port, V5, "far-sub")
        sub.subscribe("far/t", 1)
        return sub

    sub = await asyncio.to_thread(subscribed)
    try:
        far = Message(destination="far/t", payload=b"far", expiration=95_617_584_000_000)
        assert await broker.publish(far) is Outcome.OK
        [got] = await asyncio.to_thread(sub.receive, 1)
        assert (got.payload, got.properties.MessageExpiryInterval) == (b"far", 0xFFFF_FFFF)
    finally:
        await asyncio.to_thread(sub.close)


@pytest.mark.parametrize("qos", [0, 1, 2])
async def test_a_message_expiry_interval_of_0_is_no_expiry(mqtt: Listener, qos: int) -> None:
    """mqtt.js and `mosquitto_pub -D publish message-expiry-interval 0` send it: the message
    was acked and expired on arrival, given to no subscriber. Mosquitto reads it as none, as
    the gateway reads an AMQP ttl of 0. (Found by a review.)"""

    def scenario() -> list[tuple[bytes, object]]:
        sub = Client(mqtt.port, V5, "exp0-sub")
        pub = Client(mqtt.port, V5, "exp0-pub")
        try:
            sub.subscribe("exp0/#", qos)
            pub.publish("exp0/t", b"zero", qos, publish_props(expiry=0))
            return [(m.payload, getattr(m.properties, "MessageExpiryInterval", None))
                    for m in sub.receive(1)]  # fmt: skip
        finally:
            sub.close()
            pub.close()

    assert await asyncio.to_thread(scenario) == [(b"zero", None)]
