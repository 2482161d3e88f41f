"""Last value queues: Solace's (max_spool_bytes = 0) and Qpid's (by a key property)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from gateway.broker import Broker
from gateway.engine import keys
from gateway.engine.queues import QueueConfig, QueueError
from gateway.model import Delivery, Message, Outcome
from gateway.router import Router
from tests.test_engine import second_node, wait_for  # noqa: F401


def msg(payload: str, **props) -> Message:
    return Message(
        destination="prices/x", payload=payload.encode(), user_properties=list(props.items())
    )


async def browse_all(broker: Broker, queue: str) -> list[bytes]:
    seen: list[Delivery] = []
    flow = await broker.bind(queue, seen.append, browse=True)
    await asyncio.sleep(0.2)
    await flow.close()
    return [d.message.payload for d in seen]


async def test_solace_lvq_keeps_only_the_last_message(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="last", max_spool_bytes=0), [("prices/>", "smf")])
    for i in range(5):
        assert (await broker.publish(msg(f"v{i}"))).accepted
    assert await browse_all(broker, "last") == [b"v4"]
    info = await broker.queues.info("last")
    assert info.messages == 1 and info.counters["replaced"] == 4
    got: list[Delivery] = []
    flow = await broker.bind("last", got.append, window=1)
    await wait_for(lambda: len(got) == 1)
    await broker.publish(msg("v5"))  # the delivered one stays with its consumer
    await broker.publish(msg("v6"))
    flow.ack(got[0].entry_id)
    await wait_for(lambda: len(got) == 2)
    assert [d.message.payload for d in got] == [b"v4", b"v6"]


async def test_qpid_lvq_keeps_the_last_message_per_key(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="ticks", lvq_key="symbol"), [("prices/>", "smf")])
    await broker.publish(msg("a1", symbol="AAA"))
    await broker.publish(msg("b1", symbol="BBB"))
    await broker.publish(msg("a2", symbol="AAA"))
    await broker.publish(msg("plain"))  # no key: kept as it is
    await broker.publish(msg("b2", symbol="BBB"))
    assert await browse_all(broker, "ticks") == [b"a2", b"plain", b"b2"]
    assert (await broker.queues.info("ticks")).messages == 3


async def test_a_key_settled_for_good_leaves_the_queues_key_index(broker: Broker) -> None:
    """The key index kept a field for every key value ever seen, its values long consumed
    (found by a review: 300 keys, 300 fields, the queue empty); one key per session or
    request grew it for as long as the queue lived. An acked or rejected value's key goes;
    a key whose newer value waits stays."""
    await broker.declare_queue(QueueConfig(name="ticks", lvq_key="symbol"), [("prices/>", "smf")])
    for i in range(30):
        await broker.publish(msg(f"v{i}", symbol=f"S{i}"))
    got: list[Delivery] = []
    flow = await broker.bind("ticks", got.append, window=50)
    await wait_for(lambda: len(got) == 30)
    await broker.publish(msg("newer", symbol="S0"))  # a newer value of a delivered key
    for d in got[:29]:
        flow.ack(d.entry_id)
    flow.reject(got[29].entry_id)
    index = keys.queue_last_values("ticks")
    await wait_for(lambda: len(got) == 31)
    deadline = time.monotonic() + 5
    while await broker.redis.hkeys(index) != [b"S0"]:
        assert time.monotonic() < deadline, await broker.redis.hkeys(index)
        await asyncio.sleep(0.05)
    flow.ack(got[30].entry_id)
    deadline = time.monotonic() + 5
    while await broker.redis.exists(index):
        assert time.monotonic() < deadline, await broker.redis.hkeys(index)
        await asyncio.sleep(0.05)
    await flow.close()


@pytest.mark.parametrize("how", ["release", "consumer_closes"])
async def test_a_value_given_back_after_a_newer_one_was_consumed_is_dropped(
    broker: Broker, how: str
) -> None:
    """Once a newer value of its key was acked (its key left the index), an older one a
    consumer gave back was delivered again (found by a review of the index cleanup): a
    key the index no longer names had a newer value settled."""
    await broker.declare_queue(QueueConfig(name="ticks", lvq_key="symbol"), [("prices/>", "smf")])
    first: list[Delivery] = []
    second: list[Delivery] = []
    holder = await broker.bind("ticks", first.append, window=1)
    await broker.publish(msg("v1", symbol="S"))
    await wait_for(lambda: len(first) == 1)
    await broker.publish(msg("v2", symbol="S"))  # v1 is delivered: v2 waits
    taker = await broker.bind("ticks", second.append, window=10)
    await wait_for(lambda: len(second) == 1)
    taker.ack(second[0].entry_id)
    await asyncio.sleep(0.3)
    if how == "release":
        holder.release(first[0].entry_id)
    else:
        await holder.close()
    await asyncio.sleep(0.5)
    assert [d.message.payload for d in first + second] == [b"v1", b"v2"]
    assert (await broker.queues.info("ticks")).messages == 0
    await taker.close()
    if how == "release":
        await holder.close()


async def test_a_ring_lvqs_dropped_values_leave_its_key_index(broker: Broker) -> None:
    await broker.declare_queue(
        QueueConfig(name="ticks", lvq_key="symbol", max_messages=5, overflow="ring"),
        [("prices/>", "smf")],
    )
    for i in range(50):
        assert (await broker.publish(msg(f"v{i}", symbol=f"S{i}"))).accepted
    assert (await broker.queues.info("ticks")).messages == 5
    assert await broker.redis.hlen(keys.queue_last_values("ticks")) == 5


async def test_a_key_is_its_string_value_whatever_its_type(broker: Broker) -> None:
    """MQTT 5 user properties are all strings: an MQTT publisher's "7" shares the key of an
    AMQP publisher's integer 7 (Qpid, keying on Java objects, keeps two; README)."""
    await broker.declare_queue(QueueConfig(name="ticks", lvq_key="symbol"), [("prices/>", "smf")])
    await broker.publish(msg("int", symbol=7))
    await broker.publish(msg("bytes", symbol=b"7"))
    await broker.publish(msg("str", symbol="7"))
    assert await browse_all(broker, "ticks") == [b"str"]


async def test_a_keyed_last_value_queue_is_not_also_a_one_message_queue(broker: Broker) -> None:
    """lvq_key and max_spool_bytes 0 are the two kinds: both at once (declared, or changed
    to) are refused (the queue kept one value of all keys: the others' were lost)."""
    with pytest.raises(QueueError, match="not both"):
        await broker.declare_queue(QueueConfig(name="lv", lvq_key="sym", max_spool_bytes=0))
    await broker.declare_queue(QueueConfig(name="lv", lvq_key="sym"))
    with pytest.raises(QueueError, match="not both"):
        await broker.update_queue("lv", {"max_spool_bytes": 0})
    assert (await broker.queues.config("lv")).max_spool_bytes != 0


async def test_a_partitioned_queue_is_never_a_last_value_queue(broker: Broker) -> None:
    """Each partition is a stream of its own, so a key's values (a Solace last value
    queue's one value) would live in several, one per partition: refused when declared,
    changed or repartitioned, as for a priority queue."""
    for extra in ({"lvq_key": "sym"}, {"max_spool_bytes": 0}):
        with pytest.raises(QueueError, match="last value queue"):
            await broker.declare_queue(QueueConfig(name="p", partition_count=2, **extra))
        await broker.declare_queue(QueueConfig(name="lv", **extra))
        await broker.update_queue("lv", {"egress_enabled": False})
        with pytest.raises(QueueError, match="last value queue"):
            await broker.update_queue("lv", {"partition_count": 2})
        with pytest.raises(QueueError, match="last value queue"):
            await broker.queues.repartition("lv", 2)
        assert (await broker.queues.config("lv")).partition_count == 0
        await broker.delete_queue("lv")
    await broker.declare_queue(QueueConfig(name="p", partition_count=2))
    with pytest.raises(QueueError, match="last value queue"):
        await broker.update_queue("p", {"max_spool_bytes": 0})
    # one change that ends a last value queue and partitions it is fine
    await broker.declare_queue(QueueConfig(name="lv", max_spool_bytes=0, egress_enabled=False))
    await broker.update_queue("lv", {"partition_count": 2, "max_spool_bytes": 1_000_000})
    config = await broker.queues.config("lv")
    assert (config.partition_count, config.max_spool_bytes) == (2, 1_000_000)


async def test_a_full_lvq_still_takes_a_new_value_of_a_key_it_holds(broker: Broker) -> None:
    """At max_messages, a new value replacing a waiting one does not grow the queue: it is
    stored; a value of a new key is refused."""
    await broker.declare_queue(
        QueueConfig(name="lv", lvq_key="sym", max_messages=2), [("prices/>", "smf")]
    )
    for payload, sym in (("IBM=1", "IBM"), ("MSFT=1", "MSFT"), ("IBM=2", "IBM"), ("IBM=3", "IBM")):
        assert await broker.publish(msg(payload, sym=sym)) is Outcome.OK
    assert await broker.publish(msg("SAP=1", sym="SAP")) is Outcome.QUEUE_FULL
    assert sorted(await browse_all(broker, "lv")) == [b"IBM=3", b"MSFT=1"]


async def test_a_blocked_flow_control_lvq_takes_a_value_replacing_a_waiting_one(
    broker: Broker,
    second_node: Broker,  # noqa: F811
) -> None:
    """Under producer flow control too: once another node's value of a new key blocked the
    queue, a value replacing a waiting one, from a node holding nothing, is stored (it
    waited for the queue to drain, which with no consumer it never did, and the queue kept
    serving the superseded value)."""
    await broker.declare_queue(
        QueueConfig(name="lv", lvq_key="sym", max_messages=2, overflow="flow_control"),
        [("prices/>", "smf")],
    )
    await second_node.router.reload()
    assert await second_node.publish(msg("IBM=1", sym="IBM")) is Outcome.OK
    assert await second_node.publish(msg("MSFT=1", sym="MSFT")) is Outcome.OK
    new_key = second_node.publish_nowait(msg("SAP=1", sym="SAP"))
    await asyncio.sleep(0.2)
    assert not new_key.done(), "held: the queue is blocked"
    assert await asyncio.wait_for(broker.publish(msg("IBM=2", sym="IBM")), 2) is Outcome.OK
    assert sorted(await browse_all(broker, "lv")) == [b"IBM=2", b"MSFT=1"]
    assert not new_key.done()


async def test_a_held_older_value_does_not_supersede_a_newer_one_of_its_publisher(
    broker: Broker,
) -> None:
    """A node holding a value for a blocked queue holds the values after it too, replacing
    ones included: its older value, stored once the queue drains, would supersede them."""
    await broker.declare_queue(
        QueueConfig(name="lv", lvq_key="sym", max_spool_bytes=1000, overflow="flow_control"),
        [("prices/>", "smf")],
    )
    assert await broker.publish(msg("A" * 50, sym="IBM")) is Outcome.OK
    assert await broker.publish(msg("B" * 550, sym="MSFT")) is Outcome.OK
    older = broker.publish_nowait(msg("1" * 450, sym="IBM"))  # too large even in A's place
    await asyncio.sleep(0.2)
    assert not older.done(), "held: the queue is full"
    newer = broker.publish_nowait(msg("2" * 40, sym="IBM"))  # would fit in A's place
    got: list[Delivery] = []
    flow = None

    def ack(d: Delivery) -> None:
        got.append(d)
        flow.ack(d.entry_id)

    flow = await broker.bind("lv", ack)
    await asyncio.wait_for(asyncio.gather(older, newer), 3)
    await asyncio.sleep(0.3)
    await flow.close()
    values = [d.message.payload[:1] for d in got if ("sym", "IBM") in d.message.user_properties]
    assert values[-1] == b"2", values


async def test_a_replaced_value_leaves_no_undeliverable_here_mark(broker: Broker) -> None:
    """A value given back with undeliverable-here, then replaced, takes its mark with it
    (the marks of deleted values stayed for good, scanned by every fetch)."""
    await broker.declare_queue(QueueConfig(name="last", max_spool_bytes=0), [("prices/>", "smf")])
    got: list[Delivery] = []
    flow = await broker.bind("last", got.append, window=1)
    for i in range(5):
        assert (await broker.publish(msg(f"v{i}"))).accepted
        await wait_for(lambda i=i: len(got) == i + 1)
        flow.avoid(got[i].entry_id, False)  # AMQP modified, undeliverable-here
        await asyncio.sleep(0.05)
    assert (await broker.publish(msg("final"))).accepted  # replaces v4
    await asyncio.sleep(0.2)
    assert (await broker.queues.info("last")).messages == 1
    assert await broker.redis.hlen(keys.queue_avoid("last")) == 0
    await flow.close()


async def test_values_a_selector_consumer_passed_over_are_still_replaced(broker: Broker) -> None:
    """A selector consumer makes new messages wait in the holding consumer: they are still
    waiting values, replaced by the next one (not delivered ones, which stay)."""
    await broker.declare_queue(QueueConfig(name="last", max_spool_bytes=0), [("prices/>", "smf")])
    picky: list[Delivery] = []
    await broker.bind("last", picky.append, selector="colour = 'blue'")
    for i in range(5):
        assert (await broker.publish(msg(f"v{i}"))).accepted
        await asyncio.sleep(0.05)  # each looked at by the selector consumer in turn
    assert picky == []
    info = await broker.queues.info("last")
    assert info.messages == 1 and info.counters["replaced"] == 4
    assert await browse_all(broker, "last") == [b"v4"]


async def test_a_value_held_for_its_delivery_time_is_replaced_by_a_newer_one(
    broker: Broker,
) -> None:
    """A value held until a delivery time (a consumer's fetch parked it) has not been
    delivered: a newer value of its key replaces it, so the stale one never comes after."""
    await broker.declare_queue(QueueConfig(name="lv", lvq_key="sym"))
    got: list[Delivery] = []
    flow = await broker.bind("lv", got.append)
    old = Message(destination="lv", to_queue=True, payload=b"old", user_properties=[("sym", "A")])
    old.not_before = int(time.time() * 1000) + 800
    assert await broker.publish(old) is Outcome.OK
    await asyncio.sleep(0.2)  # the consumer's fetch parks it until due
    new = Message(destination="lv", to_queue=True, payload=b"new", user_properties=[("sym", "A")])
    assert await broker.publish(new) is Outcome.OK
    await wait_for(lambda: len(got) == 1)
    await asyncio.sleep(1.0)  # past the old one's delivery time, and the sweep after it
    await flow.close()
    assert [d.message.payload for d in got] == [b"new"]
    assert (await broker.queues.info("lv")).counters["replaced"] == 1


@pytest.mark.parametrize("given_back", ["release", "requeue", "consumer-gone"])
async def test_a_value_given_back_after_a_newer_one_came_is_dropped(
    broker: Broker, given_back: str
) -> None:
    """Qpid discards a released entry that is no longer its key's latest: the queue never
    hands out a value older than one it already has. A key without a newer value, and an
    entry without a key, come back as usual."""
    await broker.declare_queue(QueueConfig(name="ticks", lvq_key="symbol"), [("prices/>", "smf")])
    for payload, props in (("a1", {"symbol": "A"}), ("b1", {"symbol": "B"}), ("n", {})):
        assert (await broker.publish(named(payload, **props))).accepted
    got: list[Delivery] = []
    flow = await broker.bind("ticks", got.append, window=3)
    await wait_for(lambda: len(got) == 3)
    assert (await broker.publish(named("a2", symbol="A"))).accepted  # a1 is with the consumer
    if given_back == "consumer-gone":
        await flow.close()
    else:
        for d in got:
            getattr(flow, given_back)(d.entry_id)
        await asyncio.sleep(0.3)
        await flow.close()
    assert sorted(await browse_all(broker, "ticks")) == [b"a2", b"b1", b"n"]
    info = await broker.queues.info("ticks")
    assert (info.messages, info.counters["replaced"]) == (3, 1)
    await broker.declare_queue(QueueConfig(name="same", lvq_key="symbol"), [("prices/>", "smf")])
    for payload, props in (("a2", {"symbol": "A"}), ("b1", {"symbol": "B"}), ("n", {})):
        assert (await broker.publish(named(payload, **props))).accepted
    assert info.spooled_bytes == (await broker.queues.info("same")).spooled_bytes


def named(payload: str, **props: str) -> Message:
    """A message with an id of its own: the same bytes as another of that payload (a
    generated id grows a digit as the process's count of them does)."""
    message = msg(payload, **props)
    message.id = f"id-{payload}"
    return message


async def test_key_values_holding_a_nul_are_keys_of_their_own(broker: Broker) -> None:
    """AMQP strings and the admin API's JSON may hold U+0000: "A\\0B" and "A\\0C" are two
    keys, and another queue's key value is never read as this queue's key."""
    await broker.declare_queue(QueueConfig(name="ranked", sort_key="rank"), [("prices/>", "smf")])
    await broker.declare_queue(QueueConfig(name="ticks", lvq_key="symbol"), [("prices/>", "smf")])
    for payload, props in (
        ("b", {"symbol": "A\0B"}),
        ("c", {"symbol": "A\0C"}),
        ("keep", {"symbol": "AAA"}),
        ("other", {"rank": "1\0symbol\0AAA"}),  # no symbol of its own: no slot
    ):
        assert (await broker.publish(msg(payload, **props))).accepted
    assert sorted(await browse_all(broker, "ticks")) == [b"b", b"c", b"keep", b"other"]
    got: list[Delivery] = []
    flow = await broker.bind("ranked", got.append)
    await wait_for(lambda: len(got) == 4)
    await flow.close()
    ranks = [dict(d.message.user_properties).get("rank") for d in got]
    assert ranks == [None, None, None, "1\0symbol\0AAA"]  # keyless first, in arrival order


async def test_a_full_ring_lvq_drops_only_what_a_bigger_new_value_still_needs(
    broker: Broker,
) -> None:
    """B, C and A fill the queue; A's new value is bigger. With A's old value replaced,
    dropping the oldest (B) makes room: C, another key's latest value, stays."""
    await broker.declare_queue(QueueConfig(name="probe"), [("prices/>", "smf")])
    assert (await broker.publish(msg("x" * 999, symbol="B"))).accepted
    size = (await broker.queues.info("probe")).spooled_bytes  # one value's stored size
    await broker.delete_queue("probe")
    await broker.declare_queue(
        QueueConfig(name="ticks", lvq_key="symbol", overflow="ring", max_spool_bytes=3 * size),
        [("prices/>", "smf")],
    )
    for key in ("B", "C", "A"):
        assert (await broker.publish(msg("x" * 999, symbol=key))).accepted
    assert (await broker.publish(msg("y" * 1499, symbol="A"))).accepted
    seen: list[Delivery] = []
    browser = await broker.bind("ticks", seen.append, browse=True)
    await wait_for(lambda: len(seen) == 2)
    await asyncio.sleep(0.1)
    await browser.close()
    assert [dict(d.message.user_properties)["symbol"] for d in seen] == ["C", "A"]
    info = await broker.queues.info("ticks")
    assert (info.messages, info.counters["replaced"], info.counters["dropped"]) == (2, 1, 1)


async def test_a_ring_lvqs_replaced_value_is_counted_replaced_when_it_is_the_oldest(
    broker: Broker,
) -> None:
    """A (oldest), B and C fill it; A's new value is bigger and needs B's room too: A's old
    value is replaced, B dropped, and the counters say so."""
    await broker.declare_queue(QueueConfig(name="probe"), [("prices/>", "smf")])
    assert (await broker.publish(msg("x" * 999, symbol="B"))).accepted
    size = (await broker.queues.info("probe")).spooled_bytes
    await broker.delete_queue("probe")
    await broker.declare_queue(
        QueueConfig(name="ticks", lvq_key="symbol", overflow="ring", max_spool_bytes=3 * size),
        [("prices/>", "smf")],
    )
    for key in ("A", "B", "C"):
        assert (await broker.publish(msg("x" * 999, symbol=key))).accepted
    assert (await broker.publish(msg("y" * 1499, symbol="A"))).accepted
    assert sorted(await browse_all(broker, "ticks")) == [b"x" * 999, b"y" * 1499]
    info = await broker.queues.info("ticks")
    counted = (info.messages, info.counters.get("replaced"), info.counters.get("dropped"))
    assert counted == (2, 1, 1)


def older_spool_properties(router: Router) -> Callable[[Message], str]:
    """The keyed properties as a node or Spark executor of the release before sizes sends
    them ("name\\0value\\0..."): they still use the library the newest node loaded."""

    def spool_properties(m: Message) -> str:
        found: dict[str, str] = {}
        for name, value in m.user_properties:
            if name in router.keyed_properties and name not in found and value is not None:
                found[name] = str(value)
        return "".join(f"{k}\0{v}\0" for k, v in found.items())

    return spool_properties


async def test_an_older_callers_keyed_properties_still_key_and_sort(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    await broker.declare_queue(QueueConfig(name="ticks", lvq_key="symbol"), [("prices/>", "smf")])
    await broker.declare_queue(QueueConfig(name="ranked", sort_key="rank"), [("prices/>", "smf")])
    monkeypatch.setattr(broker.router, "spool_properties", older_spool_properties(broker.router))
    for payload, props in (("a1", {"symbol": "A"}), ("a2", {"symbol": "A"})):
        assert (await broker.publish(msg(payload, **props))).accepted
    for payload, rank in (("r3", "3"), ("r1", "1"), ("r2", "2")):
        assert (await broker.publish(msg(payload, rank=rank))).accepted
    assert sorted(await browse_all(broker, "ticks")) == [b"a2", b"r1", b"r2", b"r3"]
    got: list[Delivery] = []
    flow = await broker.bind("ranked", got.append)
    await wait_for(lambda: len(got) == 5)
    await flow.close()
    assert [d.message.payload for d in got] == [b"a1", b"a2", b"r1", b"r2", b"r3"]
