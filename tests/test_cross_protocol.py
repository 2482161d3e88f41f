"""MQTT 5 <-> AMQP 1.0 through one gateway: the mapping table holds in both directions."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from proton import Message as AmqpMessage
from proton import byte, symbol
from proton.reactor import Selector
from proton.utils import BlockingConnection

from gateway.broker import Broker, QueueConfig
from gateway.config import Settings
from gateway.model import Message, Publisher
from protocols.amqp.listener import start as start_amqp
from protocols.mqtt.codec import MqttDecoder, Publish
from protocols.mqtt.listener import queue_name
from protocols.mqtt.listener import start as start_mqtt
from protocols.mqtt.mapping import encode_delivery
from tests.test_mqtt_paho import V5, Client

TIMEOUT = 10.0


@pytest.fixture
async def ports(broker: Broker) -> AsyncIterator[tuple[int, int]]:
    settings = Settings(mqtt_port=0, amqp_port=0, host="127.0.0.1")
    mqtt = await start_mqtt(broker, settings)
    amqp = await start_amqp(broker, settings)
    yield mqtt.port, amqp.port
    await mqtt.close()
    await amqp.close()


def mqtt5_client(port: int, client_id: str) -> paho.Client:
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id, protocol=paho.MQTTv5)
    client.connect("127.0.0.1", port)
    client.loop_start()
    return client


def receive_one(amqp_port: int, queue: str, selector: str | None = None) -> AmqpMessage:
    """One message of `queue`, accepted, through a stock proton receiver."""
    conn = BlockingConnection(f"amqp://127.0.0.1:{amqp_port}")
    try:
        options = Selector(selector) if selector is not None else None
        receiver = conn.create_receiver(queue, options=options)
        msg = receiver.receive(timeout=TIMEOUT)
        receiver.accept()
        return msg
    finally:
        conn.close()


async def test_mqtt5_publish_reaches_amqp_receiver_mapped(
    broker: Broker, ports: tuple[int, int]
) -> None:
    mqtt_port, amqp_port = ports
    await broker.declare_queue(QueueConfig(name="devices"), [("devices/>", "smf")])

    def publish() -> None:
        client = mqtt5_client(mqtt_port, "pub-1")
        props = Properties(PacketTypes.PUBLISH)
        props.UserProperty = [
            ("site", "north"),
            ("JMSXGroupId", "dev-7"),
            ("JMSPriority", "07"),
            ("site", "n2"),
        ]
        props.CorrelationData = b"corr-42"
        props.ResponseTopic = "replies/pub-1"
        props.ContentType = "application/json"
        info = client.publish("devices/dev-7/temp", b'{"t": 21.5}', qos=1, properties=props)
        info.wait_for_publish(TIMEOUT)
        client.loop_stop()
        client.disconnect()

    await asyncio.to_thread(publish)

    # the selector reads the first of a repeated key, as the message shows it
    msg = await asyncio.to_thread(receive_one, amqp_port, "devices", "site = 'north'")
    assert bytes(msg.body) == b'{"t": 21.5}'
    assert msg.group_id == "dev-7"
    assert bytes(msg.correlation_id) == b"corr-42"
    assert msg.reply_to == "topic://replies/pub-1"  # an address: a bare name is a queue
    assert msg.content_type == "application/json"
    assert msg.durable is True
    props = dict(msg.properties or {})
    assert props.get("site") == "north"  # AMQP maps have unique keys: the first (RabbitMQ's)
    assert "JMSXGroupId" not in props, "the group travels as group-id, not a property"
    assert (msg.priority, "JMSPriority" in props) == (7, False)


async def test_an_mqtt5_content_type_past_ascii_is_left_out_for_amqp(
    broker: Broker, ports: tuple[int, int]
) -> None:
    """AMQP's content-type is a symbol, ASCII only (§3.2.4, §1.6.20); MQTT 5's is any UTF-8
    string. It was sent as a symbol holding UTF-8 bytes, which strict decoders refuse."""
    mqtt_port, amqp_port = ports
    await broker.declare_queue(QueueConfig(name="typed"), [("typed/#", "mqtt")])

    def publish() -> None:
        client = mqtt5_client(mqtt_port, "pub-ct")
        props = Properties(PacketTypes.PUBLISH)
        props.ContentType = "text/plain; charset=\u00fc"
        client.publish("typed/a", b"x", qos=1, properties=props).wait_for_publish(TIMEOUT)
        client.loop_stop()
        client.disconnect()

    await asyncio.to_thread(publish)

    msg = await asyncio.to_thread(receive_one, amqp_port, "typed")
    absent = AmqpMessage().content_type  # how proton shows no content-type
    assert (bytes(msg.body), msg.content_type) == (b"x", absent)


async def amqp_to_mqtt5(ports: tuple[int, int], message: AmqpMessage) -> paho.MQTTMessage:
    """Send `message` over AMQP to topic://replies/pub-1; what an MQTT 5 subscriber of
    replies/# receives."""
    mqtt_port, amqp_port = ports
    got: list[paho.MQTTMessage] = []
    arrived = threading.Event()
    subscribed = threading.Event()

    def on_message(client, userdata, message) -> None:
        got.append(message)
        arrived.set()

    def subscribe() -> paho.Client:
        client = paho.Client(CallbackAPIVersion.VERSION2, "sub-1", protocol=paho.MQTTv5)
        client.on_message = on_message
        client.on_subscribe = lambda *a: subscribed.set()
        client.connect("127.0.0.1", mqtt_port)
        client.loop_start()
        client.subscribe("replies/#", qos=1)
        assert subscribed.wait(TIMEOUT)
        return client

    client = await asyncio.to_thread(subscribe)
    try:

        def send() -> None:
            conn = BlockingConnection(f"amqp://127.0.0.1:{amqp_port}")
            try:
                conn.create_sender("topic://replies/pub-1").send(message)
            finally:
                conn.close()

        await asyncio.to_thread(send)
        assert await asyncio.to_thread(arrived.wait, TIMEOUT)
    finally:
        client.loop_stop()
        client.disconnect()
    return got[0]


async def test_amqp_send_reaches_mqtt5_subscriber_mapped(
    broker: Broker, ports: tuple[int, int]
) -> None:
    m = await amqp_to_mqtt5(
        ports,
        AmqpMessage(
            body=b"pong",
            group_id="dev-7",
            correlation_id=b"corr-42",
            reply_to="topic://devices/dev-7/cmd",
            content_type="text/plain",
            properties={"attempt": "2"},
            durable=True,
        ),
    )
    assert m.topic == "replies/pub-1" and m.payload == b"pong" and m.qos == 1
    props = m.properties
    assert props.CorrelationData == b"corr-42"
    assert props.ResponseTopic == "devices/dev-7/cmd"
    assert props.ContentType == "text/plain"
    assert ("attempt", "2") in props.UserProperty
    assert ("JMSXGroupId", "dev-7") in props.UserProperty


@pytest.mark.parametrize(
    ("reply_to", "kind", "response_topic"),
    [
        ("replies/j1", 1, "replies/j1"),  # a Topic, as Qpid JMS names it
        ("replies/j1", 0, None),  # a Queue: no response topic
        ("topic://replies/j2", 1, "replies/j2"),  # an address that says it already
    ],
    ids=["topic", "queue", "prefixed"],
)
async def test_a_jms_topic_reply_to_is_the_mqtt_response_topic(
    broker: Broker, ports: tuple[int, int], reply_to: str, kind: int, response_topic: str | None
) -> None:
    """Qpid JMS sends a Topic JMSReplyTo as its bare name with x-opt-jms-reply-to 1: it was
    taken for a queue, and an MQTT responder was told no response topic."""
    message = AmqpMessage(body=b"ping", reply_to=reply_to, durable=True)
    message.annotations = {symbol("x-opt-jms-reply-to"): byte(kind)}
    m = await amqp_to_mqtt5(ports, message)
    assert getattr(m.properties, "ResponseTopic", None) == response_topic


async def test_amqp_text_with_nul_reaches_mqtt5_subscriber(
    broker: Broker, ports: tuple[int, int]
) -> None:
    """MQTT strings cannot hold U+0000, AMQP's can: it arrives as U+FFFD, not never."""
    m = await amqp_to_mqtt5(
        ports,
        AmqpMessage(
            body=b"x",
            properties={"k\x00": "v\x00", "b": b"\x00"},
            durable=True,  # queued: undeliverable, it would have held a window slot for good
        ),
    )
    assert m.payload == b"x"
    assert ("k\ufffd", "v\ufffd") in m.properties.UserProperty
    assert ("b", "\ufffd") in m.properties.UserProperty


# Larger than a declared queue's default max_message_size (10,000,000), under the 16 MiB
# an AMQP sending link is offered
AS_LARGE_AS_THE_LINK_ALLOWS = bytes(range(256)) * (12_000_000 // 256)


def send_large(amqp_port: int) -> None:
    """AS_LARGE_AS_THE_LINK_ALLOWS to topic://big/one; raises unless accepted."""
    conn = BlockingConnection(f"amqp://127.0.0.1:{amqp_port}")
    try:
        message = AmqpMessage(body=AS_LARGE_AS_THE_LINK_ALLOWS, durable=True)
        conn.create_sender("topic://big/one").send(message)
    finally:
        conn.close()


async def test_a_message_the_amqp_link_allows_reaches_an_mqtt_subscriber(
    broker: Broker, ports: tuple[int, int]
) -> None:
    """The subscriber's session queue had the default limit of a declared queue, so the
    publish was refused (all-or-none) though the link offered 16 MiB."""
    m = await amqp_to_mqtt5(ports, AmqpMessage(body=AS_LARGE_AS_THE_LINK_ALLOWS, durable=True))
    assert m.payload == AS_LARGE_AS_THE_LINK_ALLOWS


async def test_an_earlier_releases_session_queue_takes_what_the_amqp_link_allows(
    broker: Broker, ports: tuple[int, int]
) -> None:
    """A persistent session an earlier release made kept a declared queue's default size
    limit (10,000,000) after the upgrade: its resumption lifts it."""
    mqtt_port, amqp_port = ports
    name = queue_name("old-session")

    def session() -> None:
        expiry = Properties(PacketTypes.CONNECT)
        expiry.SessionExpiryInterval = 3600
        client = Client(mqtt_port, V5, "old-session", clean=False, properties=expiry)
        try:
            client.subscribe("big/#", 1)
        finally:
            client.close()

    await asyncio.to_thread(session)
    await broker.queues.update(name, {"max_message_size": 10_000_000})  # as stored before
    await asyncio.to_thread(session)  # resumed after the upgrade
    await asyncio.to_thread(send_large, amqp_port)
    assert (await broker.queues.info(name)).messages == 1


async def test_a_message_the_amqp_link_allows_reaches_an_amqp_topic_receiver(
    broker: Broker, ports: tuple[int, int]
) -> None:
    amqp_port = ports[1]
    receiving = await asyncio.to_thread(BlockingConnection, f"amqp://127.0.0.1:{amqp_port}")
    try:
        receiver = await asyncio.to_thread(receiving.create_receiver, "topic://big/one")
        await asyncio.to_thread(send_large, amqp_port)
        got = await asyncio.to_thread(receiver.receive, TIMEOUT)
        assert bytes(got.body) == AS_LARGE_AS_THE_LINK_ALLOWS
        await asyncio.to_thread(receiver.accept)
    finally:
        await asyncio.to_thread(receiving.close)


def as_v5_publish(msg: Message) -> Publish:
    """The QoS 0 PUBLISH an MQTT 5 subscriber gets for `msg`, decoded."""
    data = encode_delivery(
        msg,
        qos=0,
        packet_id=None,
        dup=False,
        retain=False,
        subscription_ids=[],
        expiry=None,
        level=5,
    )
    (publish,) = MqttDecoder(protocol_level=5).feed(data)
    assert isinstance(publish, Publish)
    return publish


def test_mqtt5_egress_replaces_nul_in_every_text_property() -> None:
    """The fields proton's client cuts at U+0000 may still hold one (the admin API)."""
    msg = Message("t", b"x", partition_key="g\x00", content_type="c\x00", reply_to="topic://r\x00")
    publish = as_v5_publish(msg)
    assert publish.properties is not None
    assert publish.properties.content_type == "c\ufffd"
    assert publish.properties.response_topic == "r\ufffd"
    assert publish.properties.user_properties == [("JMSXGroupId", "g\ufffd")]


@pytest.mark.parametrize(
    "reply_to, protocol, topic",
    [
        ("topic://a/b", "amqp", "a/b"),
        ("a/b", "amqp", None),  # a queue
        ("a/b", "mqtt", "a/b"),  # stored by an MQTT publisher before reply-tos were addresses
        ("topic://a/#", "mqtt", None),  # no topic name (MQTT-3.3.2-14)
    ],
)
def test_a_response_topic_is_the_topic_a_reply_to_names(
    reply_to: str, protocol: str, topic: str | None
) -> None:
    msg = Message("t", b"x", reply_to=reply_to, publisher=Publisher(protocol, "c"))
    props = as_v5_publish(msg).properties
    assert (props.response_topic if props is not None else None) == topic
