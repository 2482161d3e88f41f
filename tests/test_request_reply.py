"""Request / reply across MQTT 5 and AMQP 1.0 (MQTT 5 §4.10, AMQP 1.0 §3.2.4): a reply
sent where the request said reaches the requester, whichever protocol each side speaks;
and property values an MQTT subscriber reads as their usual text."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from proton import Message as AmqpMessage
from proton import Timeout
from proton.utils import BlockingConnection

from gateway.broker import Broker, QueueConfig
from tests.conftest import Ports
from tests.test_mqtt_paho import V5, Client

TIMEOUT = 5.0


async def test_an_amqp_requesters_topic_reply_to_is_an_mqtt_responders_response_topic(
    broker: Broker, ports: Ports
) -> None:
    def scenario() -> tuple[str | None, bytes | None]:
        responder = Client(ports.mqtt, V5, "responder-1")
        conn = BlockingConnection(ports.url, timeout=TIMEOUT)
        try:
            responder.subscribe("requests/#", 1)
            replies = conn.create_receiver("topic://replies/r1")
            conn.create_sender("topic://requests/a").send(
                AmqpMessage(body=b"ping", reply_to="topic://replies/r1", durable=True)
            )
            [request] = responder.receive(1)
            topic = getattr(request.properties, "ResponseTopic", None)
            if topic:
                responder.publish(topic, b"pong", 1)
            try:
                reply = replies.receive(timeout=2)
            except Timeout:
                return topic, None
            return topic, bytes(reply.body)
        finally:
            responder.close()
            conn.close()

    assert await asyncio.to_thread(scenario) == ("replies/r1", b"pong")


@pytest.mark.parametrize("reply_to", ["queue://answers", "answers", "/queues/answers"])
async def test_a_queue_reply_to_is_no_response_topic(
    broker: Broker, ports: Ports, reply_to: str
) -> None:
    """MQTT cannot publish to a queue: a responder told its name would reply to a topic.
    A bare name is a queue (what Qpid JMS sends for a Queue or TemporaryQueue)."""

    def scenario() -> object:
        responder = Client(ports.mqtt, V5, "responder-q")
        conn = BlockingConnection(ports.url, timeout=TIMEOUT)
        try:
            responder.subscribe("requests/#", 1)
            conn.create_sender("topic://requests/q").send(
                AmqpMessage(body=b"ping", reply_to=reply_to, durable=True)
            )
            [request] = responder.receive(1)
            return getattr(request.properties, "ResponseTopic", None)
        finally:
            responder.close()
            conn.close()

    assert await asyncio.to_thread(scenario) is None


async def test_an_mqtt_requesters_response_topic_is_an_amqp_responders_reply_to(
    broker: Broker, ports: Ports
) -> None:
    """The responder sends through the anonymous relay to the request's reply-to, as JMS
    and proton's request / reply examples do: a bare name there would be a queue."""
    await broker.declare_queue(QueueConfig(name="requests"), [("requests/#", "mqtt")])

    def scenario() -> tuple[str | None, list[bytes]]:
        requester = Client(ports.mqtt, V5, "requester-1")
        conn = BlockingConnection(ports.url, timeout=TIMEOUT)
        try:
            requester.subscribe("replies/m1", 1)
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic = "replies/m1"
            props.CorrelationData = b"c-1"
            requester.publish("requests/b", b"ping", 1, props)
            receiver = conn.create_receiver("requests")
            request = receiver.receive(timeout=TIMEOUT)
            receiver.accept()
            reply = AmqpMessage(
                body=b"pong", address=request.reply_to, correlation_id=request.correlation_id
            )
            conn.create_sender(None).send(reply)
            got = requester.receive(1)
            return request.reply_to, [m.payload for m in got]
        finally:
            requester.close()
            conn.close()

    assert await asyncio.to_thread(scenario) == ("topic://replies/m1", [b"pong"])


async def test_booleans_reach_mqtt_subscribers_as_true_and_false(
    broker: Broker, ports: Ports
) -> None:
    """As JMS, JSON, the Spark source and the gateway's own x-opt-dmq-eligible spell them,
    not as Python's "True"."""

    def scenario() -> list[list[tuple[str, str]]]:
        sub = Client(ports.mqtt, V5, "bool-sub")
        conn = BlockingConnection(ports.url, timeout=TIMEOUT)
        try:
            sub.subscribe("flags/#", 1)
            conn.create_sender("topic://flags/a").send(
                AmqpMessage(body=b"x", durable=True, properties={"ok": True, "bad": False})
            )
            return [list(m.properties.UserProperty) for m in sub.receive(1)]
        finally:
            sub.close()
            conn.close()

    assert await asyncio.to_thread(scenario) == [[("ok", "true"), ("bad", "false")]]


async def test_a_uuid_correlation_id_survives_an_mqtt_responder(
    broker: Broker, ports: Ports
) -> None:
    """It reaches MQTT as the correlation data "urn:uuid:..." (as RabbitMQ sends it), which
    the responder echoes unaltered (MQTT 5 §4.10.2): the AMQP requester gets its uuid back."""
    corr = uuid.UUID("1b4e28ba-2fa1-11d2-883f-0016d3cca427")

    def scenario() -> tuple[bytes, object]:
        responder = Client(ports.mqtt, V5, "responder-2")
        conn = BlockingConnection(ports.url, timeout=TIMEOUT)
        try:
            responder.subscribe("requests/#", 1)
            replies = conn.create_receiver("topic://replies/r2")
            conn.create_sender("topic://requests/c").send(
                AmqpMessage(body=b"ping", correlation_id=corr, durable=True)
            )
            [request] = responder.receive(1)
            data = request.properties.CorrelationData
            props = Properties(PacketTypes.PUBLISH)
            props.CorrelationData = data
            responder.publish("replies/r2", b"pong", 1, props)
            return data, replies.receive(timeout=TIMEOUT).correlation_id
        finally:
            responder.close()
            conn.close()

    assert await asyncio.to_thread(scenario) == (f"urn:uuid:{corr}".encode(), corr)
