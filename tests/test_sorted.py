"""Sorted queues (Qpid Broker-J): delivery in ascending order of a user property's value,
messages without it first, arrival order among equal keys; real Redis, real clients."""

from __future__ import annotations

import asyncio
import time

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from proton.utils import BlockingConnection

from gateway.broker import Broker
from gateway.config import Settings
from gateway.engine import flows, keys
from gateway.engine.queues import DEAD_MESSAGE_QUEUE, QueueConfig, QueueError
from gateway.model import DEAD_LETTER_REASON, Delivery, Message
from protocols.amqp.listener import start as start_amqp
from protocols.mqtt.listener import start as start_mqtt
from tests.test_admin_api import Admin
from tests.test_engine import wait_for
from tests.test_mqtt_paho import V5, Client

SUBSCRIPTION = [("sorted/>", "smf")]


def keyed(payload: str, key: str | None, queue: str = "sq", **kw) -> Message:
    props = [] if key is None else [("k", key)]
    return Message(
        destination=queue, to_queue=True, payload=payload.encode(), user_properties=props, **kw
    )


async def sorted_queue(broker: Broker, name: str = "sq", **kw) -> None:
    # a subscription makes this node reload its routes at once (so the spool passes "k")
    await broker.declare_queue(QueueConfig(name=name, sort_key="k", **kw), SUBSCRIPTION)


def payloads(got: list[Delivery]) -> list[bytes]:
    return [d.message.payload for d in got]


async def index_size(broker: Broker, name: str = "sq") -> int:
    return await broker.redis.zcard(keys.queue_sorted(name))


async def test_delivered_by_key_missing_first_ties_in_arrival_order(broker: Broker) -> None:
    await sorted_queue(broker)
    for payload, key in [("c1", "c"), ("a1", "a"), ("n1", None), ("b1", "b"), ("a2", "a")]:
        await broker.publish(keyed(payload, key))
    await broker.publish(keyed("e1", ""))  # an empty value is a key: after the missing ones
    await broker.publish(keyed("n2", None))
    await broker.publish(keyed("a3", "a"))
    assert await index_size(broker) == 8
    got: list[Delivery] = []
    flow = await broker.bind("sq", got.append, window=20)
    await wait_for(lambda: len(got) == 8)
    assert payloads(got) == [b"n1", b"n2", b"e1", b"a1", b"a2", b"a3", b"b1", b"c1"]
    assert await index_size(broker) == 0
    for d in got:
        flow.ack(d.entry_id)
    await wait_for(lambda: not flow.unacked)
    await asyncio.sleep(0.1)
    assert (await broker.queues.info("sq")).messages == 0


async def test_string_comparison_not_numeric(broker: Broker) -> None:
    await sorted_queue(broker)
    for value in (9, 10, 100, 2):  # AMQP-style numbers compare as their text (Broker-J)
        await broker.publish(
            Message(
                destination="sq",
                to_queue=True,
                payload=str(value).encode(),
                user_properties=[("k", value)],
            )
        )
    got: list[Delivery] = []
    await broker.bind("sq", got.append)
    await wait_for(lambda: len(got) == 4)
    assert payloads(got) == [b"10", b"100", b"2", b"9"]


async def test_booleans_sort_as_their_text_in_both_protocols(broker: Broker) -> None:
    """An AMQP boolean keys as "true" / "false" (Broker-J's toString, and the text MQTT 5
    publishers and subscribers see): it keyed as "True" / "False", which sort before all
    lower-case text, so an AMQP true overtook an MQTT "false". (Found by a review.)"""
    await sorted_queue(broker)
    for payload, value in [("amqp-true", True), ("amqp-false", False), ("mqtt-true", "true"),
                           ("mqtt-false", "false")]:  # fmt: skip
        msg = keyed(payload, None)
        msg.user_properties = [("k", value)]
        await broker.publish(msg)
    got: list[Delivery] = []
    await broker.bind("sq", got.append)
    await wait_for(lambda: len(got) == 4)
    assert payloads(got) == [b"amqp-false", b"mqtt-false", b"amqp-true", b"mqtt-true"]


async def test_requeued_message_returns_to_its_sorted_place(broker: Broker) -> None:
    await sorted_queue(broker)
    await broker.publish(keyed("b", "b"))
    await broker.publish(keyed("d", "d"))
    got: list[Delivery] = []
    flow = await broker.bind("sq", got.append, window=1)
    await wait_for(lambda: len(got) == 1)
    assert got[0].message.payload == b"b"
    await broker.publish(keyed("c", "c"))
    await broker.publish(keyed("a", "a"))
    flow.requeue(got[0].entry_id)
    for n in range(2, 6):
        await wait_for(lambda n=n: len(got) == n)
        flow.ack(got[-1].entry_id)
    assert payloads(got) == [b"b", b"a", b"b", b"c", b"d"]
    assert got[2].redelivered and got[2].delivery_count == 2


async def test_unbound_consumer_messages_go_back_in_order(broker: Broker) -> None:
    await sorted_queue(broker)
    for key in "cab":
        await broker.publish(keyed(key, key))
    first: list[Delivery] = []
    flow = await broker.bind("sq", first.append, window=10)
    await wait_for(lambda: len(first) == 3)
    await flow.close()  # unsettled: back into the index
    assert await index_size(broker) == 3
    second: list[Delivery] = []
    await broker.bind("sq", second.append, window=10)
    await wait_for(lambda: len(second) == 3)
    assert payloads(second) == [b"a", b"b", b"c"]
    assert all(d.redelivered for d in second)


async def test_competing_consumers_share_the_sorted_backlog(broker: Broker) -> None:
    await sorted_queue(broker)
    for i in reversed(range(20)):
        await broker.publish(keyed(f"{i:02}", f"{i:02}"))
    one: list[Delivery] = []
    two: list[Delivery] = []
    await broker.bind("sq", one.append, window=100)
    await broker.bind("sq", two.append, window=100)
    await wait_for(lambda: len(one) + len(two) == 20)
    assert sorted(payloads(one) + payloads(two)) == [f"{i:02}".encode() for i in range(20)]
    assert payloads(one) == sorted(payloads(one)) and payloads(two) == sorted(payloads(two))


async def test_a_held_message_takes_its_sorted_place_when_due(broker: Broker) -> None:
    await sorted_queue(broker)
    due = int(time.time() * 1000) + 500
    await broker.publish(keyed("a-held", "a", not_before=due))
    await broker.publish(keyed("c", "c"))
    got: list[Delivery] = []
    flow = await broker.bind("sq", got.append, window=1)
    await wait_for(lambda: len(got) == 1)
    assert got[0].message.payload == b"c"  # "a" is not due yet
    await broker.publish(keyed("b", "b"))
    deadline = time.monotonic() + 5
    while await index_size(broker) < 2:  # until "a" is due and back, ahead of "b"
        assert time.monotonic() < deadline, "the held message never came back"
        await asyncio.sleep(0.05)
    flow.ack(got[0].entry_id)
    await wait_for(lambda: len(got) == 2)
    flow.ack(got[1].entry_id)
    await wait_for(lambda: len(got) == 3)
    assert payloads(got) == [b"c", b"a-held", b"b"]
    assert got[1].delivery_count == 1, "holding is no delivery"


async def test_expired_and_redelivered_too_often_go_to_the_dmq(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await sorted_queue(broker, max_redelivery=1, respect_ttl=True)
    soon = int(time.time() * 1000) + 100
    await broker.publish(keyed("old", "a", expiration=soon, dmq_eligible=True))
    await broker.publish(keyed("nacked", "b", dmq_eligible=True))
    await broker.publish(keyed("fine", "c"))
    await asyncio.sleep(0.2)
    got: list[Delivery] = []
    flow = None

    def deliver(d: Delivery) -> None:
        got.append(d)
        if d.message.payload == b"nacked":
            flow.requeue(d.entry_id)
        else:
            flow.ack(d.entry_id)

    flow = await broker.bind("sq", deliver)
    await wait_for(lambda: len(got) == 3)
    assert payloads(got) == [b"nacked", b"fine", b"nacked"]  # "old" expired unseen
    dead: list[Delivery] = []
    await broker.bind(DEAD_MESSAGE_QUEUE, dead.append)
    await wait_for(lambda: len(dead) == 2)
    assert sorted(payloads(dead)) == [b"nacked", b"old"]
    reasons = {d.message.payload: d.message.annotations[DEAD_LETTER_REASON] for d in dead}
    assert reasons == {b"old": "expired", b"nacked": "max_redelivered"}
    await asyncio.sleep(0.1)
    assert (await broker.queues.info("sq")).messages == 0
    assert await index_size(broker) == 0


async def test_a_sorted_dead_message_queue_sorts_dead_letters(broker: Broker) -> None:
    await sorted_queue(broker, name="dmq")
    await sorted_queue(broker, dead_message_queue="dmq")
    for key in "cab":
        await broker.publish(keyed(key, key, dmq_eligible=True))
    got: list[Delivery] = []
    flow = await broker.bind("sq", got.append, window=10)
    await wait_for(lambda: len(got) == 3)
    for d in reversed(got):  # rejected c, b, a: the dead message queue still sorts them
        flow.reject(d.entry_id)
    await wait_for(lambda: not flow.unacked)
    await asyncio.sleep(0.1)
    dead: list[Delivery] = []
    await broker.bind("dmq", dead.append)
    await wait_for(lambda: len(dead) == 3)
    assert payloads(dead) == [b"a", b"b", b"c"]


async def test_browsing_sees_sorted_order_and_takes_nothing(broker: Broker) -> None:
    await sorted_queue(broker)
    for key in "dbca":
        await broker.publish(keyed(key, key))
    seen: list[Delivery] = []
    browser = await broker.bind("sq", seen.append, browse=True, window=2)
    await wait_for(lambda: len(seen) == 2)
    for d in seen:
        browser.ack(d.entry_id)  # frees the browser's window: the next page
    await wait_for(lambda: len(seen) == 4)
    assert payloads(seen) == [b"a", b"b", b"c", b"d"]
    assert (await broker.queues.info("sq")).messages == 4
    got: list[Delivery] = []
    await broker.bind("sq", got.append)
    await wait_for(lambda: len(got) == 4)
    assert payloads(got) == [b"a", b"b", b"c", b"d"]


@pytest.mark.parametrize("kind", ["browser", "non-destructive"])
async def test_a_message_sorting_before_a_browsers_place_still_reaches_it(
    broker: Broker, kind: str
) -> None:
    """A message that arrives with a key before what a browser (or a non-destructive
    queue's consumer, which browses) has read is on the queue: it reaches the browser, as
    Qpid's sorted queue moves its browsers back. It never did, while one bound later saw
    it."""
    non_destructive = kind == "non-destructive"
    await sorted_queue(broker, non_destructive=non_destructive)
    await broker.publish(keyed("m", "m"))
    got: list[Delivery] = []
    await broker.bind("sq", got.append, browse=not non_destructive)
    await wait_for(lambda: len(got) == 1)
    for key in "azb":
        await broker.publish(keyed(key, key))
    await wait_for(lambda: len(got) == 4)
    await asyncio.sleep(0.2)
    assert sorted(payloads(got)) == [b"a", b"b", b"m", b"z"] and len(got) == 4
    late: list[Delivery] = []
    await broker.bind("sq", late.append, browse=not non_destructive)
    await wait_for(lambda: len(late) == 4)
    assert payloads(late) == [b"a", b"b", b"m", b"z"]


async def test_late_arrivals_past_a_page_all_reach_a_browser(broker: Broker) -> None:
    """More late messages than a browse page looks at arrive at once: the browser goes on
    until it has looked at them all, with no new message to wake it."""
    await sorted_queue(broker)
    await broker.publish(keyed("z", "z"))
    got: list[Delivery] = []
    await broker.bind("sq", got.append, browse=True, window=1000)
    await wait_for(lambda: len(got) == 1)
    futures = [broker.publish_nowait(keyed(f"a{i:04}", f"a{i:04}")) for i in range(700)]
    await asyncio.gather(*futures)
    await wait_for(lambda: len(got) == 701, timeout=5)
    assert sorted(payloads(got)[1:]) == [b"a%04d" % i for i in range(700)]


@pytest.mark.parametrize("kind", ["browser", "non-destructive"])
async def test_a_sorted_browser_sees_each_message_once(broker: Broker, kind: str) -> None:
    """More messages arrive than a browse page looks at while the browser waits for room,
    later ones sorting before earlier ones: each reaches it once (a page showed ones the
    arrivals had not reached yet, which came again as late ones)."""
    non_destructive = kind == "non-destructive"
    await sorted_queue(broker, non_destructive=non_destructive)
    await broker.publish(keyed("a", "a"))
    got: list[Delivery] = []
    flow = await broker.bind("sq", got.append, browse=not non_destructive, window=1)
    await wait_for(lambda: len(got) == 1)
    for key in [f"z{i}" for i in range(5)] + [f"m{i}" for i in range(5)]:
        await broker.publish(keyed(key, key))
    acked = 0
    deadline = time.monotonic() + 5
    while len(got) < 11 and time.monotonic() < deadline:  # settles one at a time
        while acked < len(got):
            flow.ack(got[acked].entry_id)
            acked += 1
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    expected = [b"a"] + [b"z%d" % i for i in range(5)] + [b"m%d" % i for i in range(5)]
    assert sorted(payloads(got)) == sorted(expected)


async def test_late_held_arrivals_reach_a_sorted_browser_at_its_held_limit(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held messages arriving with keys before a browser's place while it is at its held
    limit: it stops at the first it cannot keep and sees them once due (they were missed)."""
    monkeypatch.setattr(flows, "MAX_HELD_BROWSED", 2)
    await sorted_queue(broker)
    await broker.publish(keyed("m", "m"))
    got: list[Delivery] = []
    await broker.bind("sq", got.append, browse=True)
    await wait_for(lambda: len(got) == 1)
    due = int(time.time() * 1000) + 600
    for key in "abc":
        await broker.publish(keyed(f"held-{key}", key, not_before=due))
    await wait_for(lambda: len(got) == 4, timeout=5)
    await asyncio.sleep(0.2)
    assert sorted(payloads(got)) == [b"held-a", b"held-b", b"held-c", b"m"]


async def test_a_sorted_browser_at_its_held_limit_misses_none(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At its limit of held messages a sorted queue's browser stops at the next held one
    until some are due, as another queue's does (it went past it: never seen)."""
    monkeypatch.setattr(flows, "MAX_HELD_BROWSED", 2)
    await sorted_queue(broker)
    due = int(time.time() * 1000) + 600
    for key in "abc":
        await broker.publish(keyed(f"held-{key}", key, not_before=due))
    await broker.publish(keyed("plain-d", "d"))
    seen: list[Delivery] = []
    await broker.bind("sq", seen.append, browse=True)
    await wait_for(lambda: len(seen) == 4, timeout=5)
    assert sorted(payloads(seen)) == [b"held-a", b"held-b", b"held-c", b"plain-d"]


async def test_selector_consumer_takes_matches_in_sorted_order(broker: Broker) -> None:
    await sorted_queue(broker)
    for key, colour in [("d", "red"), ("c", "blue"), ("b", "red"), ("a", "blue")]:
        await broker.publish(
            Message(
                destination="sq",
                to_queue=True,
                payload=key.encode(),
                user_properties=[("k", key), ("colour", colour)],
            )
        )
    red: list[Delivery] = []
    await broker.bind("sq", red.append, selector="colour = 'red'")
    await wait_for(lambda: len(red) == 2)
    assert payloads(red) == [b"b", b"d"]
    rest: list[Delivery] = []
    await broker.bind("sq", rest.append)
    await wait_for(lambda: len(rest) == 2)
    assert payloads(rest) == [b"a", b"c"]
    assert await index_size(broker) == 0


async def test_delete_removes_the_index(broker: Broker) -> None:
    await sorted_queue(broker)
    await broker.publish(keyed("a", "a"))
    assert await index_size(broker) == 1
    await broker.queues.delete("sq")
    assert not await broker.redis.exists(keys.queue_sorted("sq"))


@pytest.mark.parametrize(
    "extra",
    [
        {"partition_count": 2},
        {"priorities": True},
        {"lvq_key": "sym"},
        {"max_spool_bytes": 0},
        {"message_groups": "default"},
        {"overflow": "ring"},
    ],
)
async def test_features_that_cannot_combine_are_refused(broker: Broker, extra: dict) -> None:
    with pytest.raises(QueueError) as err:
        await broker.declare_queue(QueueConfig(name="sq", sort_key="k", **extra))
    assert err.value.code == "invalid" and "sort_key" in str(err.value)
    assert not await broker.queues.exists("sq")


async def test_sort_key_is_fixed(broker: Broker) -> None:
    await sorted_queue(broker)
    with pytest.raises(QueueError) as err:
        await broker.declare_queue(QueueConfig(name="sq", sort_key="other"))
    assert err.value.code == "precondition_failed"
    await broker.queues.update("sq", {"egress_enabled": False})
    with pytest.raises(QueueError) as err:
        await broker.queues.repartition("sq", 2)
    assert err.value.code == "invalid"
    assert (await broker.queues.config("sq")).sort_key == "k"


async def test_admin_api_declares_a_sorted_queue(admin: Admin) -> None:
    bad = await admin.create("bad", sort_key="k", priorities=True)
    assert bad.status == 400 and "sort_key" in bad.error
    created = await admin.create("sq", sort_key="k", subscriptions=["sorted/>"])
    assert created.status == 201, created.body
    assert (await admin.get("/api/v1/queues/sq")).body["sort_key"] == "k"
    for key in "cab":
        reply = await admin.publish("sq", key, user_properties={"k": key})
        assert reply.status == 200, reply.body
    taken = await admin.take("sq", count=3)
    assert [m["payload"] for m in taken] == ["a", "b", "c"]


async def test_mqtt5_user_property_orders_amqp_delivery(broker: Broker) -> None:
    await sorted_queue(broker)
    settings = Settings(mqtt_port=0, amqp_port=0, host="127.0.0.1")
    mqtt = await start_mqtt(broker, settings)
    amqp = await start_amqp(broker, settings)
    assert mqtt is not None and amqp is not None
    try:

        def publish() -> None:
            pub = Client(mqtt.port, V5, "sorted-pub")
            try:
                for key in ["m", "z", "b", "m", "a"]:
                    props = Properties(PacketTypes.PUBLISH)
                    props.UserProperty = ("k", key)
                    pub.publish("sorted/x", key.encode(), 1, properties=props)
                pub.publish("sorted/x", b"none", 1)  # no key: first
            finally:
                pub.close()

        def consume() -> list[tuple[bytes, object]]:
            conn = BlockingConnection(f"amqp://127.0.0.1:{amqp.port}", timeout=5)
            try:
                rcv = conn.create_receiver("sq", credit=10)
                out = []
                for _ in range(6):
                    msg = rcv.receive(5)
                    out.append((bytes(msg.body), (msg.properties or {}).get("k")))
                    rcv.accept()
                return out
            finally:
                conn.close()

        await asyncio.to_thread(publish)
        assert (await broker.queues.info("sq")).messages == 6
        got = await asyncio.to_thread(consume)
    finally:
        await mqtt.close()
        await amqp.close()
    assert got == [
        (b"none", None),
        (b"a", "a"),
        (b"b", "b"),
        (b"m", "m"),
        (b"m", "m"),
        (b"z", "z"),
    ]
