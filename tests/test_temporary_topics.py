"""JMS temporary topics: a sender's dynamic target with the temporary-topic capability (how
Qpid JMS makes one) is a topic every sender reaches by its address, and only the
connection that made it reads (python-qpid-proton, paho-mqtt v5)."""

from __future__ import annotations

import asyncio

from proton import Message as AmqpMessage
from proton import Terminus, Timeout, symbol
from proton.reactor import LinkOption
from proton.utils import BlockingConnection, LinkDetached

from gateway.broker import Broker
from tests.conftest import Ports
from tests.test_mqtt_paho import V5, Client

TIMEOUT = 5.0


class Capability(LinkOption):
    """A capability on the terminus naming the node; with `dynamic`, a sender's dynamic
    target."""

    def __init__(self, name: str, dynamic: bool = False) -> None:
        self.name, self.dynamic = name, dynamic

    def apply(self, link) -> None:
        terminus = link.target if link.is_sender else link.source
        if self.dynamic:
            terminus.dynamic = True
        terminus.capabilities.put_object(symbol(self.name))


def temporary_topic(conn: BlockingConnection) -> str:
    """session.createTemporaryTopic() as Qpid JMS does it: the address the gateway gives."""
    creator = conn.create_sender(
        None, name="temp-topic", options=Capability("temporary-topic", dynamic=True)
    )
    return creator.link.remote_target.address


def subscribe(conn: BlockingConnection, address: str, name: str):
    return conn.create_receiver(
        address, name=name, credit=10, options=Capability("temporary-topic")
    )


async def test_any_responder_reaches_a_temporary_topics_subscriber(ports: Ports) -> None:
    """A responder that is not Qpid JMS sends to the reply-to as given, by a link or the
    anonymous relay, and an MQTT one publishes to the response topic: the address was
    also a queue no one read, where the replies were stored and deleted with it."""

    def scenario() -> list[object]:
        requester = BlockingConnection(ports.url, timeout=TIMEOUT, container_id="jms-req")
        responder = BlockingConnection(ports.url, timeout=TIMEOUT, container_id="responder")
        mqtt = Client(ports.mqtt, V5, "mqtt-responder")
        try:
            address = temporary_topic(requester)
            assert address.startswith("topic://$tmp/"), address
            replies = subscribe(requester, address, "replies")
            responder.create_sender(address, name="to-it").send(AmqpMessage(body="by link"))
            relay = responder.create_sender(None, name="relay")
            relay.send(AmqpMessage(address=address, body="by relay"))
            assert mqtt.publish(address.removeprefix("topic://"), b"by mqtt", 1).is_published()
            got: list[object] = []
            for _ in range(3):
                message = replies.receive(timeout=TIMEOUT)
                got.append(message.body if isinstance(message.body, str) else bytes(message.body))
                replies.accept()
            return got
        finally:
            requester.close()
            responder.close()
            mqtt.close()

    got = await asyncio.to_thread(scenario)
    assert sorted(map(str, got)) == ["b'by mqtt'", "by link", "by relay"]


async def test_only_its_connection_reads_a_temporary_topic(ports: Ports) -> None:
    """JMS 2.0 §6.2.6: only the connection that made a temporary destination consumes
    from it. Another learns its address from a reply-to; it read every reply."""

    def scenario() -> tuple[str, object]:
        owner, other = ports.connect("owner"), ports.connect("other")
        try:
            address = temporary_topic(owner)
            mine = subscribe(owner, address, "replies")
            try:
                spy = subscribe(other, address, "spy")
            except LinkDetached as exc:
                refused = str(exc)
            else:
                refused = "attached"
            owner.create_sender(address, name="p").send(AmqpMessage(body="for the owner"))
            assert mine.receive(timeout=TIMEOUT).body == "for the owner"
            if refused != "attached":
                return refused, None
            try:
                return refused, spy.receive(timeout=1).body
            except Timeout:
                return refused, None
        finally:
            owner.close()
            other.close()

    refused, read = await asyncio.to_thread(scenario)
    assert read is None and "resource-locked" in refused, (refused, read)


class Durable(LinkOption):
    """A JMS durable subscriber's source: kept while the link is away."""

    def apply(self, link) -> None:
        link.source.capabilities.put_object(symbol("temporary-topic"))
        link.source.durability = Terminus.DELIVERIES
        link.source.expiry_policy = Terminus.EXPIRE_NEVER


async def test_a_temporary_topic_has_no_durable_subscriptions(ports: Ports) -> None:
    """JMS: none on a temporary topic. Its queue outlived the topic, storing on."""

    def scenario() -> str:
        owner = ports.connect("durable-owner")
        try:
            address = temporary_topic(owner)
            try:
                owner.create_receiver(address, name="sub-1", options=Durable())
            except LinkDetached as exc:
                return str(exc)
            return "attached"
        finally:
            owner.close()

    assert "amqp:not-allowed" in await asyncio.to_thread(scenario)


async def test_no_mqtt_client_subscribes_to_temporary_topics(broker: Broker, ports: Ports) -> None:
    """A first-level wildcard matches no "$" topic; a filter naming the level is refused."""

    def scenario() -> list[int]:
        client = Client(ports.mqtt, V5, "peeker")
        try:
            return [client.subscribe(f, 1)[0].value for f in ("$tmp/#", "$tmp/+/+", "#")]
        finally:
            client.close()

    assert await asyncio.to_thread(scenario) == [0x87, 0x87, 1]
