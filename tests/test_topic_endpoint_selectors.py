"""Spool-time selectors of topic endpoints (Solace semantics): a queue's
`subscription_selector` decides which messages its topic subscriptions attract, so what it
does not select is never stored; messages sent to the queue by name are not filtered.
AMQP durable topic subscriptions with a JMS selector use it. Real Redis, real sockets,
proton and paho clients.
"""

from __future__ import annotations

import asyncio

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from proton import Described, Timeout, symbol
from proton import Message as AmqpMessage
from proton.reactor import DurableSubscription, Selector
from proton.utils import BlockingConnection, LinkDetached

from gateway.broker import Broker, QueueConfig, QueueError
from gateway.model import Message as GatewayMessage
from gateway.model import Outcome
from tests.conftest import Ports
from tests.test_admin_api import q
from tests.test_amqp_clients import durable_queues, echoed_filter
from tests.test_mqtt_paho import V5, Client

TIMEOUT = 5.0
SELECTOR = symbol("apache.org:selector-filter:string")


def drain(rcv, quiet: float = 0.3) -> list[bytes]:
    """Bodies of what arrives until nothing more does for `quiet` seconds (accepted)."""
    out = []
    while True:
        try:
            msg = rcv.receive(quiet if out else TIMEOUT)
        except Timeout:
            return out
        rcv.accept()
        out.append(bytes(msg.body))


def publish_colours(port: int, colours: list[str]) -> None:
    """MQTT 5 publishes to paint/wall, each with a `color` user property."""
    pub = Client(port, V5, "painter")
    try:
        for i, colour in enumerate(colours):
            props = Properties(PacketTypes.PUBLISH)
            props.UserProperty = [("color", colour)]
            assert pub.publish("paint/wall", f"{colour}{i}".encode(), 1, props).is_published()
    finally:
        pub.close()


def attach(conn: BlockingConnection, selector: str):
    return conn.create_receiver(
        "topic://paint/>",
        name="painting",
        credit=10,
        options=[DurableSubscription(), Selector(selector)],
    )


def subscribe_and_leave(ports: Ports, container_id: str, selector: str) -> str:
    """Attach the durable subscription with `selector` and detach (it stays), on a
    connection of its own; the refusal's text if it was refused."""
    conn = ports.connect(container_id)
    try:
        attach(conn, selector).link.detach()
        return ""
    except LinkDetached as exc:
        return str(exc)
    finally:
        conn.close()


async def test_durable_subscription_stores_only_what_its_selector_selects(
    broker: Broker, ports: Ports
) -> None:
    def subscribe_then_detach() -> dict:
        conn = ports.connect(container_id="te-client")
        try:
            sub = attach(conn, "color = 'red'")
            echoed = echoed_filter(sub)
            sub.link.detach()  # the subscription stays
            return echoed
        finally:
            conn.close()

    def resume_then_unsubscribe() -> list[bytes]:
        conn = ports.connect(container_id="te-client")
        try:
            sub = attach(conn, "color = 'red'")
            got = drain(sub)
            sub.close()
            return got
        finally:
            conn.close()

    echoed = await asyncio.to_thread(subscribe_then_detach)
    assert echoed == {symbol("selector"): Described(SELECTOR, "color = 'red'")}
    [queue] = await durable_queues(broker, 1)
    assert (await broker.queues.config(queue)).subscription_selector == "color = 'red'"
    await asyncio.to_thread(publish_colours, ports.mqtt, ["red", "blue", "red", "blue"])
    info = await broker.queues.info(queue)
    assert info.messages == 2, "blue never reached the subscription queue"
    assert info.counters["spooled"] == 2
    assert await asyncio.to_thread(resume_then_unsubscribe) == [b"red0", b"red2"]
    assert await durable_queues(broker, 0) == []


async def test_a_temporary_subscription_stores_only_what_its_selector_selects(
    broker: Broker, ports: Ports
) -> None:
    """A non-durable topic subscriber's queue filters at spool time too: what it does not
    select never piles up in it while the link lives."""

    def subscribe() -> tuple[BlockingConnection, object, dict]:
        conn = ports.connect(container_id="te-temp")
        sub = conn.create_receiver("topic://paint/>", credit=10, options=Selector("color = 'red'"))
        return conn, sub, echoed_filter(sub)

    conn, sub, echoed = await asyncio.to_thread(subscribe)
    try:
        assert echoed == {symbol("selector"): Described(SELECTOR, "color = 'red'")}
        await asyncio.to_thread(publish_colours, ports.mqtt, ["blue"] * 20 + ["red"])
        assert await asyncio.to_thread(drain, sub) == [b"red20"]
        [queue] = [n for n in await broker.queues.names() if n.startswith("#tsub/")]
        assert (await broker.queues.info(queue)).counters["spooled"] == 1
    finally:
        await asyncio.to_thread(conn.close)


async def test_reattach_with_another_selector_replaces_the_subscription(
    broker: Broker, ports: Ports
) -> None:
    def scenario() -> tuple[dict, list[bytes]]:
        assert subscribe_and_leave(ports, "te-client-2", "color = 'red'") == ""
        publish_colours(ports.mqtt, ["red"])  # kept for the red subscription
        conn = ports.connect(container_id="te-client-2")
        try:
            sub = attach(conn, "color = 'blue'")  # JMS: a new subscription, red is gone
            publish_colours(ports.mqtt, ["red", "blue"])
            got = drain(sub)
            return echoed_filter(sub), got
        finally:
            conn.close()

    echoed, got = await asyncio.to_thread(scenario)
    assert echoed == {symbol("selector"): Described(SELECTOR, "color = 'blue'")}
    assert got == [b"blue1"]
    [queue] = await durable_queues(broker, 1)
    assert (await broker.queues.config(queue)).subscription_selector == "color = 'blue'"


async def test_bad_selector_keeps_the_existing_subscription(broker: Broker, ports: Ports) -> None:
    assert await asyncio.to_thread(subscribe_and_leave, ports, "te-3", "color = 'red'") == ""
    refused = await asyncio.to_thread(subscribe_and_leave, ports, "te-3", "color = = 'x'")
    assert "amqp:invalid-field" in refused and "position" in refused
    [queue] = await durable_queues(broker, 1)
    assert (await broker.queues.config(queue)).subscription_selector == "color = 'red'"


async def test_topic_messages_are_filtered_queue_messages_are_not(broker: Broker) -> None:
    await broker.declare_queue(
        QueueConfig(name="reds", subscription_selector="color = 'red'"), [("paint/#", "mqtt")]
    )
    await broker.declare_queue(QueueConfig(name="all"), [("paint/#", "mqtt")])

    def message(colour: str, **kw: object) -> GatewayMessage:
        return GatewayMessage(
            kw.pop("destination", "paint/x"),
            colour.encode(),
            user_properties=[("color", colour)],
            **kw,  # type: ignore[arg-type]
        )

    assert await broker.publish(message("red")) == Outcome.OK
    assert await broker.publish(message("blue")) == Outcome.OK  # "all" takes it
    assert await broker.publish(message("blue", destination="reds", to_queue=True)) == Outcome.OK
    assert (await broker.queues.info("reds")).messages == 2
    assert (await broker.queues.info("all")).messages == 2
    await broker.delete_queue("all")
    outcome = await broker.publish(message("green"))
    assert outcome == Outcome.NO_SUBSCRIBERS, "a topic no selector takes reaches no queue"


async def test_declare_validates_and_compares_the_selector(broker: Broker) -> None:
    with pytest.raises(QueueError) as bad:
        await broker.declare_queue(QueueConfig(name="te", subscription_selector="a = = 1"))
    assert bad.value.code == "invalid" and "at position 4" in str(bad.value)
    too_long = "a = '" + "x" * 1100 + "'"
    with pytest.raises(QueueError) as long:
        await broker.declare_queue(QueueConfig(name="te", subscription_selector=too_long))
    assert long.value.code == "invalid" and "1023 bytes" in str(long.value)
    assert not await broker.queues.exists("te")
    assert await broker.declare_queue(QueueConfig(name="te", subscription_selector="a = 1"))
    assert not await broker.declare_queue(QueueConfig(name="te", subscription_selector="a = 1"))
    with pytest.raises(QueueError) as other:
        await broker.declare_queue(QueueConfig(name="te", subscription_selector="a = 2"))
    assert other.value.code == "precondition_failed" and "subscription_selector" in str(other.value)


async def test_admin_api_declares_a_selector(broker: Broker, ports: Ports) -> None:
    created = await ports.admin.create(
        "hot", subscription_selector="temp > 30", subscriptions=[{"pattern": "sensors/>"}]
    )
    assert created.status == 201, created
    assert created.body["subscription_selector"] == "temp > 30"
    refused = await ports.admin.create("cold", subscription_selector="temp >")
    assert refused.status == 400 and "position" in refused.error
    for temp in (10, 40):
        reply = await ports.admin.post(
            "/api/v1/messages",
            {"topic": "sensors/a", "payload": str(temp), "user_properties": {"temp": temp}},
        )
        assert reply.status in (200, 201, 202), reply
    shown = await ports.admin.get(q("hot"))
    assert shown.body["messages"] == 1


def _drained(receiver, quiet: float = 0.5) -> list[tuple[bytes, int]]:
    """(body, AMQP delivery-count) of what arrives until `quiet` passes without any."""
    out = []
    while True:
        try:
            msg = receiver.receive(quiet)
        except Timeout:
            return out
        receiver.accept()
        out.append((bytes(msg.body), msg.delivery_count))


async def test_a_subscription_selector_on_the_delivery_count_holds_for_redeliveries(
    broker: Broker, ports: Ports
) -> None:
    """A durable subscriber selecting JMSXDeliveryCount = 1 (a guard against poison
    messages) got a message again with JMSXDeliveryCount 2: the subscription's selector was
    applied once, when the message was spooled, as a first delivery. The link applies it
    at each delivery too, and what it refuses leaves the subscription, which holds only
    what its selector selects (a review found my first version kept it for good, and a
    thousand of them at the head of the queue hid new messages from the selector)."""

    def attach(conn: BlockingConnection):
        options = [DurableSubscription(), Selector("JMSXDeliveryCount = 1")]
        return conn.create_receiver("topic://t/x", name="s1", credit=10, options=options)

    def client() -> tuple[int, list[tuple[bytes, int]]]:
        first_conn = ports.connect(container_id="dcsub")
        receiver = attach(first_conn)
        first_conn.create_sender("topic://t/x").send(AmqpMessage(body=b"m"))
        first = receiver.receive(5).delivery_count
        receiver.link.detach()  # unsettled: back on the subscription, counted
        first_conn.close()
        again = ports.connect(container_id="dcsub")
        try:
            return first, _drained(attach(again), 1.0)
        finally:
            again.close()

    assert await asyncio.to_thread(client) == (0, [])
    (name,) = await durable_queues(broker, 1)
    assert (await broker.queues.info(name)).messages == 0
