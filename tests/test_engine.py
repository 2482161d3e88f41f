"""Queue engine through the broker API, against a real redis-server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.broker import Broker
from gateway.engine import direct, keys, library, queues
from gateway.engine.flows import BindError, Flow
from gateway.engine.queues import QueueConfig, QueueError
from gateway.model import Delivery, Message, Outcome
from gateway.topics import pattern_matches


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def retained_matching(broker: Broker, pattern: str, syntax: str = "mqtt") -> list[Message]:
    """Every batch the store reads for `pattern`, in one list."""
    return [msg async for batch in broker.retained.matching(pattern, syntax) for msg in batch]


def to_queue(name: str, payload: bytes, **kw) -> Message:
    return Message(destination=name, payload=payload, to_queue=True, **kw)


@pytest.fixture
async def second_node(redis_url: str) -> AsyncIterator[Broker]:
    client = await library.connect(redis_url)
    node = Broker(client, heartbeat=0.2, node_ttl=1.0)
    await node.start()
    yield node
    await node.stop()
    await client.aclose()


async def test_topic_fanout_reaches_every_matching_queue(broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="all"), [("shop/>", "smf")])
    await broker.queues.create(QueueConfig(name="created"), [("shop/*/created", "smf")])
    await broker.queues.create(QueueConfig(name="mqtt"), [("shop/+/created", "mqtt")])
    await broker.router.reload()
    assert await broker.publish(Message(destination="shop/eu/created", payload=b"a")) is Outcome.OK
    assert await broker.publish(Message(destination="shop/eu/paid", payload=b"b")) is Outcome.OK
    assert await broker.publish(Message(destination="other", payload=b"c")) is (
        Outcome.NO_SUBSCRIBERS
    )
    depth = {q: (await broker.queues.info(q)).messages for q in ("all", "created", "mqtt")}
    assert depth == {"all": 2, "created": 1, "mqtt": 1}


async def test_message_fields_survive_the_round_trip(broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    sent = to_queue(
        "q",
        b"\x00\xffdata",
        partition_key="dev-7",
        priority=9,
        correlation_id=b"\x01",
        reply_to="replies",
        content_type="application/octet-stream",
        user_properties=[("b", 1), ("a", "x"), ("b", 2.5)],
        expiration=1_900_000_000_000,
    )
    assert await broker.publish(sent) is Outcome.OK
    got: list[Delivery] = []
    await broker.bind("q", got.append)
    await wait_for(lambda: got)
    m = got[0].message
    assert (m.payload, m.partition_key, m.priority, m.correlation_id) == (
        b"\x00\xffdata",
        "dev-7",
        9,
        b"\x01",
    )
    assert m.user_properties == [("b", 1), ("a", "x"), ("b", 2.5)]
    assert (m.reply_to, m.content_type, m.expiration, m.id) == (
        "replies",
        "application/octet-stream",
        1_900_000_000_000,
        sent.id,
    )
    assert got[0].delivery_count == 1 and not got[0].redelivered


async def test_route_reloads_asked_for_meanwhile_share_one_load(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each subscription change reloads every route. Asked for while one runs, each waited
    for a load of its own: a client attaching and closing topic links in a loop queued
    thousands, and another client's SUBACK waited seconds (found by a review). A load
    begun after a caller asked serves it."""
    router = broker.router
    loads = 0
    load = router._load

    async def counted() -> None:
        nonlocal loads
        loads += 1
        await load()

    monkeypatch.setattr(router, "_load", counted)
    await broker.queues.create(QueueConfig(name="a"), [("x/1", "smf")])
    first = asyncio.create_task(router.reload())
    await asyncio.sleep(0)  # loading: what the others ask for comes after it began
    await broker.queues.create(QueueConfig(name="b"), [("x/1", "smf")])
    await asyncio.gather(first, *(router.reload() for _ in range(50)))
    # 2, and the 'sub' events of the two changes may each load once more: not 51
    assert loads <= 4 and router.match("x/1") == {"a", "b"}


async def test_refusals_are_outcomes_and_lose_nothing(broker: Broker) -> None:
    await broker.queues.create(
        QueueConfig(name="small", max_message_size=10, max_messages=2), [("t/>", "smf")]
    )
    await broker.queues.create(QueueConfig(name="other"), [("t/>", "smf")])
    await broker.router.reload()
    assert await broker.publish(to_queue("nope", b"x")) is Outcome.NOT_FOUND
    assert await broker.publish(to_queue("small", b"x" * 11)) is Outcome.TOO_LARGE
    assert await broker.publish(Message(destination="t/1", payload=b"1")) is Outcome.OK
    assert await broker.publish(Message(destination="t/2", payload=b"2")) is Outcome.OK
    # the third is refused by "small" and therefore stored nowhere (all or nothing)
    assert await broker.publish(Message(destination="t/3", payload=b"3")) is Outcome.QUEUE_FULL
    assert (await broker.queues.info("small")).messages == 2
    assert (await broker.queues.info("other")).messages == 2
    await broker.queues.update("small", {"ingress_enabled": False})
    assert await broker.publish(to_queue("small", b"x")) is Outcome.INGRESS_DISABLED
    # a topic's other queues take it; the shut one discards it and says so in a counter
    assert await broker.publish(Message(destination="t/4", payload=b"4")) is Outcome.OK
    assert (await broker.queues.info("other")).messages == 3
    assert (await broker.queues.info("small")).counters["discarded_shut"] == 1
    got: list[Delivery] = []
    flow = await broker.bind("small", got.append)
    await wait_for(lambda: len(got) == 2)
    assert [d.message.payload for d in got] == [b"1", b"2"]
    for d in got:
        flow.ack(d.entry_id)
    await flow.close()
    assert (await broker.queues.info("small")).messages == 0


async def test_byte_quota(broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="q", max_spool_bytes=400))
    outcomes = [await broker.publish(to_queue("q", b"x" * 100)) for _ in range(5)]
    assert outcomes[:2] == [Outcome.OK, Outcome.OK]
    assert outcomes[-1] is Outcome.QUOTA_EXCEEDED
    info = await broker.queues.info("q")
    assert 0 < info.spooled_bytes <= 400
    assert info.messages == outcomes.count(Outcome.OK)


async def test_group_commit_batches_one_turn(broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    before = broker.spooler.batches
    outcomes = await asyncio.gather(
        *[broker.publish_nowait(to_queue("q", b"%d" % i)) for i in range(300)]
    )
    assert set(outcomes) == {Outcome.OK}
    assert broker.spooler.batches - before == 1
    got: list[Delivery] = []
    await broker.bind("q", got.append, window=1000)
    await wait_for(lambda: len(got) == 300)
    assert [d.message.payload for d in got] == [b"%d" % i for i in range(300)]


async def test_window_limits_unacked(broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    for i in range(10):
        await broker.publish(to_queue("q", b"%d" % i))
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=3)
    await wait_for(lambda: len(got) == 3)
    await asyncio.sleep(0.1)
    assert len(got) == 3
    flow.ack(got[0].entry_id)
    await wait_for(lambda: len(got) == 4)
    flow.set_credit(0)
    flow.ack(got[1].entry_id)
    await asyncio.sleep(0.1)
    assert len(got) == 4
    flow.set_credit(2)
    await wait_for(lambda: len(got) == 5)


async def test_requeue_redelivers_with_count(broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    await broker.publish(to_queue("q", b"m"))
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append)
    await wait_for(lambda: got)
    flow.requeue(got[0].entry_id)
    await wait_for(lambda: len(got) == 2)
    assert got[1].entry_id == got[0].entry_id
    assert (got[1].delivery_count, got[1].redelivered) == (2, True)
    flow.reject(got[1].entry_id)
    await flow.close()
    info = await broker.queues.info("q")
    assert info.messages == 0 and info.counters["rejected"] == 1


async def test_closed_flow_redelivers_to_another(broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    for i in range(5):
        await broker.publish(to_queue("q", b"%d" % i))
    first: list[Delivery] = []
    a = await broker.bind("q", first.append, window=5)
    await wait_for(lambda: len(first) == 5)
    a.ack(first[0].entry_id)
    await a.close()
    second: list[Delivery] = []
    await broker.bind("q", second.append)
    await wait_for(lambda: len(second) == 4)
    assert [d.message.payload for d in second] == [b"1", b"2", b"3", b"4"]
    assert all(d.redelivered and d.delivery_count == 2 for d in second)


async def test_non_exclusive_round_robin_across_nodes(broker: Broker, second_node: Broker) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    seen: dict[str, list[bytes]] = {"a": [], "b": []}
    flows = {}

    def consumer(name: str, node: Broker):
        def on(d: Delivery) -> None:
            seen[name].append(d.message.payload)
            flows[name].ack(d.entry_id)

        return on

    flows["a"] = await broker.bind("q", consumer("a", broker), window=10)
    flows["b"] = await second_node.bind("q", consumer("b", second_node), window=10)
    n = 2000
    await asyncio.gather(*[broker.publish_nowait(to_queue("q", b"%d" % i)) for i in range(n)])
    await wait_for(lambda: len(seen["a"]) + len(seen["b"]) == n, 15)
    await asyncio.sleep(0.2)
    everything = seen["a"] + seen["b"]
    assert len(everything) == len(set(everything)) == n
    assert seen["a"] and seen["b"]


async def test_exclusive_standby_takes_over_in_order(broker: Broker, second_node: Broker) -> None:
    await broker.queues.create(QueueConfig(name="x", access_type="exclusive"))
    for i in range(20):
        await broker.publish(to_queue("x", b"%02d" % i))
    got_a: list[Delivery] = []
    got_b: list[Delivery] = []
    a = await broker.bind("x", got_a.append, window=5)
    b = None

    def on_b(d: Delivery) -> None:
        got_b.append(d)
        b.ack(d.entry_id)

    b = await second_node.bind("x", on_b, window=5)
    await wait_for(lambda: len(got_a) == 5)
    await asyncio.sleep(0.2)
    assert got_b == []  # standby
    for d in got_a[:3]:
        a.ack(d.entry_id)
    await wait_for(lambda: len(got_a) == 8)
    for d in got_a[3:6]:
        a.ack(d.entry_id)
    await a.close()  # 2 unacked go back and must come first on the standby
    await wait_for(lambda: len(got_b) >= 14, 10)
    payloads = [d.message.payload for d in got_b]
    assert payloads[:14] == [b"%02d" % i for i in range(6, 20)]
    assert [d.redelivered for d in got_b[:2]] == [True, True]


async def test_dead_node_flows_are_released(redis_url: str, broker: Broker) -> None:
    """A node that stops heartbeating loses its flows; their messages go to live flows."""
    client = await library.connect(redis_url)
    doomed = Broker(client, heartbeat=0.2, node_ttl=1.0)
    await doomed.start()
    await broker.queues.create(QueueConfig(name="x", access_type="exclusive"))
    for i in range(5):
        await broker.publish(to_queue("x", b"%d" % i))
    held: list[Delivery] = []
    await doomed.bind("x", held.append, window=3)
    await wait_for(lambda: len(held) == 3)
    tmp = await doomed.create_temporary_queue()
    survivor: list[Delivery] = []
    await broker.bind("x", survivor.append, window=10)
    # simulate a crash: stop the heartbeat task without the clean shutdown
    doomed.liveness._task.cancel()
    await doomed.events.stop()
    await wait_for(lambda: len(survivor) == 5, 10)
    assert [d.message.payload for d in survivor] == [b"0", b"1", b"2", b"3", b"4"]
    assert [d.redelivered for d in survivor] == [True] * 3 + [False] * 2
    for _ in range(100):
        if not await broker.queues.exists(tmp):
            break
        await asyncio.sleep(0.05)
    assert not await broker.queues.exists(tmp)
    await client.aclose()


async def test_egress_disabled_and_queue_deletion(broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="q", egress_enabled=False))
    with pytest.raises(BindError) as err:
        await broker.bind("q", lambda d: None)
    assert err.value.code == "egress_disabled"
    with pytest.raises(BindError):
        await broker.bind("missing", lambda d: None)
    await broker.queues.update("q", {"egress_enabled": True})
    reasons: list[str] = []
    await broker.bind("q", lambda d: None, on_closed=reasons.append)
    await broker.delete_queue("q")
    await wait_for(lambda: reasons == ["queue deleted"])
    with pytest.raises(QueueError) as qerr:
        await broker.delete_queue("q")
    assert qerr.value.code == "not_found"


def test_every_queue_property_is_compared_on_redeclare_or_changed_at_run_time() -> None:
    """A property neither compared nor a run-time setting would let a re-declaration with
    another value pass and keep the old one without a word."""
    identity = {"name", "created_ms", "owner_connection", "owner_node"}  # set by the broker
    fields = {f.name for f in dataclasses.fields(QueueConfig)} - identity
    repartitioned = {"partition_count"}  # changed at run time by a repartition (PATCH)
    assert fields == queues.RUNTIME_SETTINGS | set(queues.EQUIVALENCE_FIELDS) | repartitioned


@pytest.mark.parametrize("timing", ["partition_rebalance_delay_ms", "partition_handoff_timeout_ms"])
async def test_redeclaring_a_partitioned_queue_with_other_timings_is_refused(
    broker: Broker, timing: str
) -> None:
    assert await broker.queues.create(QueueConfig(name="pt", partition_count=2))
    with pytest.raises(QueueError) as err:
        await broker.queues.create(QueueConfig(name="pt", partition_count=2, **{timing: 9000}))
    assert err.value.code == "precondition_failed" and timing in str(err.value)


async def test_queue_names_and_equivalence(broker: Broker) -> None:
    for bad in ["", "a b", "a{b}", "x" * 256, "#tmp/x", "amq.q", "a*"]:
        with pytest.raises(QueueError) as err:
            await broker.queues.create(QueueConfig(name=bad))
        assert err.value.code == "invalid"
    assert await broker.queues.create(QueueConfig(name="q/with/slashes"))
    assert not await broker.queues.create(QueueConfig(name="q/with/slashes"))
    with pytest.raises(QueueError) as err:
        await broker.queues.create(QueueConfig(name="q/with/slashes", access_type="exclusive"))
    assert err.value.code == "precondition_failed"
    with pytest.raises(QueueError) as err:
        await broker.queues.create(
            QueueConfig(name="p", partition_count=4, access_type="exclusive")
        )
    assert err.value.code == "invalid"
    assert await broker.queues.create(QueueConfig(name="#DEAD_MSG_QUEUE"))


async def test_deleting_a_queue_removes_its_routes(broker: Broker, second_node: Broker) -> None:
    await broker.queues.create(QueueConfig(name="q"), [("a/>", "smf")])
    await broker.router.reload()
    await wait_for(lambda: second_node.router.match("a/b") == {"q"})
    await broker.delete_queue("q")
    assert broker.router.match("a/b") == frozenset()
    await wait_for(lambda: second_node.router.match("a/b") == frozenset())
    assert await second_node.publish(Message(destination="a/b")) is Outcome.NO_SUBSCRIBERS


async def test_a_removed_subscription_routes_nothing_on_any_node_once_answered(
    broker: Broker, second_node: Broker
) -> None:
    """MQTT-3.10.4-2: no new messages once the UNSUBACK is sent, whichever node they
    come to: the removal waits, as an addition does, for every node to route by it."""
    await broker.declare_queue(QueueConfig(name="q"), [("a/>", "smf")])
    assert await second_node.publish(Message(destination="a/0", payload=b"0")) is Outcome.OK
    assert await broker.unsubscribe_queue("q", ["a/>"]) == 1
    assert await second_node.publish(Message(destination="a/1")) is Outcome.NO_SUBSCRIBERS
    assert (await broker.queues.info("q")).messages == 1


async def test_direct_subscribers_get_topic_messages(broker: Broker) -> None:
    got: list[Message] = []
    token = await broker.subscribe_direct("sensors/#", "mqtt", got.append)
    await broker.publish(Message(destination="sensors/1/temp", payload=b"21"))
    broker.unsubscribe_direct(token)
    await broker.publish(Message(destination="sensors/1/temp", payload=b"22"))
    assert [m.payload for m in got] == [b"21"]


async def test_direct_messages_wait_for_their_delivery_time_on_another_node_too(
    broker: Broker,
    second_node: Broker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Held on the publishing node until due, then delivered here and relayed there; past
    MAX_HELD held at once a direct message is dropped (at most once) with a warning."""
    monkeypatch.setattr(direct, "MAX_HELD", 2)
    here: list[Message] = []
    there: list[Message] = []
    await broker.subscribe_direct("later/#", "mqtt", here.append)
    await second_node.subscribe_direct("later/#", "mqtt", there.append)
    await wait_for(lambda: broker.direct._others)
    due = int(time.time() * 1000) + 300
    for i in range(3):
        await broker.publish(Message(destination="later/x", payload=b"%d" % i, not_before=due))
    await asyncio.sleep(0.15)
    assert here == [] and there == []
    await wait_for(lambda: len(here) == 2 and len(there) == 2)
    # (two due at the same millisecond may go in either order: asyncio's timers do)
    assert sorted(m.payload for m in here) == [b"0", b"1"] == sorted(m.payload for m in there)
    assert "dropped: 2 already held" in caplog.text


async def test_keys_module_names_every_key(redis_url: str, broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="q"), [("a", "smf")])
    await broker.publish(to_queue("q", b"x"))
    await broker.bind("q", lambda d: None)
    client = aioredis.Redis.from_url(redis_url)
    names = {k.decode() for k in await client.keys("*")}
    await client.aclose()
    expected = {
        keys.queues,
        keys.seq,
        keys.nodes,
        keys.liveness,
        keys.sub_version,
        keys.route_changes,
        keys.route_changes_state,
        keys.last_created,
        keys.queue_config("q"),
        keys.queue_stream("q"),
        keys.queue_stats("q"),
        keys.queue_subs("q"),
        keys.queue_flows("q"),
        keys.node_alive(broker.node_id),
        keys.node_queues(broker.node_id),
        keys.node_queue_flows(broker.node_id),
        keys.spool_usage,
    }
    assert names == expected


async def test_non_durable_queue_dies_with_its_node(redis_url: str, broker: Broker) -> None:
    client = await library.connect(redis_url)
    other = Broker(client, heartbeat=0.2, node_ttl=1.0)
    await other.start()
    await other.declare_queue(QueueConfig(name="transient", durable=False), [("t/#", "mqtt")])
    await other.declare_queue(QueueConfig(name="kept"))
    assert (await broker.queues.config("transient")).owner_node == other.node_id
    await other.stop()  # a clean shutdown deletes it at once
    await client.aclose()
    assert not await broker.queues.exists("transient")
    assert await broker.queues.exists("kept")
    await wait_for(lambda: broker.router.match("t/x") == frozenset())


async def test_non_durable_queue_lives_while_a_node_that_declared_it_lives(
    redis_url: str, broker: Broker
) -> None:
    """Nodes sharing a config file each declare its non-durable queue: the first one's
    going hands the queue, with its messages, to the other, and the last one's going
    deletes it."""
    client = await library.connect(redis_url)
    first = Broker(client, heartbeat=0.2, node_ttl=1.0)
    second = Broker(client, heartbeat=0.2, node_ttl=1.0)
    await first.start()
    await second.start()
    try:
        await first.declare_queue(QueueConfig(name="shared", durable=False), [("s/#", "mqtt")])
        assert not await second.declare_queue(
            QueueConfig(name="shared", durable=False), [("s/#", "mqtt")]
        )
        await wait_for(lambda: broker.router.match("s/1") != frozenset())
        await broker.publish(Message(destination="s/1", payload=b"kept"))
        assert (await broker.queues.info("shared")).messages == 1
        await first.stop()
        config = await broker.queues.config("shared")
        assert config.owner_node == second.node_id, "the live declarer owns it now"
        assert (await broker.queues.info("shared")).messages == 1, "with its messages"
        await second.stop()
        assert not await broker.queues.exists("shared"), "gone with the last declarer"
        leftover = [k async for k in client.scan_iter(keys.queue_owner_nodes("shared"))]
        assert leftover == []
        # deleted while co-owned: no node's set names it any more
        await first.start()
        await second.start()
        await first.declare_queue(QueueConfig(name="gone", durable=False))
        await second.declare_queue(QueueConfig(name="gone", durable=False))
        await broker.delete_queue("gone")
        for node in (first, second):
            assert not await client.sismember(keys.node_queues(node.node_id), "gone")
    finally:
        await first.stop()
        await second.stop()
        await client.aclose()


async def test_retained_messages_follow_the_last_publish(broker: Broker) -> None:
    await broker.publish(Message(destination="home/1/temp", payload=b"20", retain=True))
    await broker.publish(Message(destination="home/1/temp", payload=b"21", retain=True))
    await broker.publish(Message(destination="home/2/temp", payload=b"19", retain=True))
    await broker.publish(Message(destination="home/3/temp", payload=b"x", retain=False))
    got = await retained_matching(broker, "home/+/temp", "mqtt")
    assert [(m.destination, m.payload) for m in got] == [
        ("home/1/temp", b"21"),
        ("home/2/temp", b"19"),
    ]
    await broker.publish(Message(destination="home/1/temp", payload=b"", retain=True))
    assert [m.destination for m in await retained_matching(broker, "#", "mqtt")] == ["home/2/temp"]


async def test_a_filter_without_wildcards_reads_one_retained_message(
    broker: Broker, redis_url: str
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    for i in range(50):
        await broker.publish(Message(destination=f"dev/{i}/state", payload=b"%d" % i, retain=True))
    await client.config_resetstat()
    got = await retained_matching(broker, "dev/7/state", "mqtt")
    assert [(m.destination, m.payload) for m in got] == [("dev/7/state", b"7")]
    assert await retained_matching(broker, "dev/77/state", "mqtt") == []
    assert await retained_matching(broker, "dev/*/state", "mqtt") == []  # "*": a level in MQTT
    stats = await client.info("commandstats")
    assert "cmdstat_hscan" not in stats  # looked up, not scanned
    smf = await retained_matching(broker, "dev/1*/state", "smf")  # a prefix: scanned
    assert [m.destination for m in smf] == [f"dev/{i}/state" for i in (1, *range(10, 20))]
    assert "cmdstat_hscan" in await client.info("commandstats")
    await client.aclose()


async def test_a_wildcard_filter_scans_only_its_literal_start(
    broker: Broker, redis_url: str
) -> None:
    """Redis sends a filter with a literal start only the retained messages that start so,
    and the MATCH pattern reads the topics' own "*", "?", "[", "]" and "\\" literally."""
    topics = [
        *(f"other/{i}" for i in range(200)),
        "site/7",
        "site/7/a/temp",
        "site/7/b/temp",
        "site/70/a/temp",
        "site/7/a/hum",
        "s*te/7/a/temp",
        "site/[7]/a/temp",
        "site/7?/a",
        "site\\7/a/temp",
        "$SYS/site/7",
    ]
    for topic in topics:
        await broker.retained.put(Message(destination=topic, payload=b"p" * 1024, retain=True))
    filters = [
        ("site/7/+/temp", "mqtt"),
        ("site/7/#", "mqtt"),
        ("site/+/a/temp", "mqtt"),
        ("s*te/7/#", "mqtt"),
        ("site/[7]/#", "mqtt"),
        ("site/7?/#", "mqtt"),
        ("site\\7/#", "mqtt"),
        ("site/7*/a", "smf"),
        ("site/*/a/>", "smf"),
        ("#", "mqtt"),
    ]
    for pattern, syntax in filters:
        got = [m.destination for m in await retained_matching(broker, pattern, syntax)]
        assert got == sorted(t for t in topics if pattern_matches(pattern, t, syntax)), pattern
    client = aioredis.Redis.from_url(redis_url)
    before = (await client.info("stats"))["total_net_output_bytes"]
    got = await retained_matching(broker, "site/7/#", "mqtt")
    sent = (await client.info("stats"))["total_net_output_bytes"] - before
    assert len(got) == 4 and sent < 50_000, sent  # not the 200 KiB under other/
    await client.aclose()


async def test_client_state_and_exactly_once_receipt(broker: Broker) -> None:
    clients = broker.clients
    assert await clients.save("dev:1", b"state", None, claim=1)
    assert await clients.load("dev:1") == b"state"
    assert await clients.load("dev:1", claim=3) == b"state"  # the connection of claim 3's
    assert not await clients.save("dev:1", b"older", None, claim=2)  # taken over: refused
    assert await clients.save("dev:1", b"newer", None, claim=3)
    assert await clients.load("dev:1") == b"newer"
    assert await clients.mark_received("dev:1", 7, claim=3) is True
    assert await clients.mark_received("dev:1", 7, claim=3) is False  # duplicate
    await clients.release_received("dev:1", 7)
    assert await clients.mark_received("dev:1", 7, claim=3) is True
    await clients.expire("dev:1", 0)
    assert await clients.load("dev:1") is None and await clients.received("dev:1") == set()


async def test_a_late_mark_counts_only_while_its_session_lasts(broker: Broker) -> None:
    """The id of a QoS 2 publish no queue took is marked after its answer: one resolved late
    (held in the routing hold) marked an id of a session a newer connection started afresh,
    swallowing that session's message with the id, or made an ended session's received-ids
    key again, with no expiry. (Found by a review.)"""
    clients = broker.clients
    old, _ = await broker.claim_client("dev:2", lambda: None)
    new, _ = await broker.claim_client("dev:2", lambda: None)
    await clients.start_afresh("dev:2", new)
    assert await clients.mark_received("dev:2", 5, claim=old) is False
    assert await clients.received("dev:2") == set()
    assert await clients.mark_received("dev:2", 5, claim=new) is True
    await clients.forget("dev:2", new)  # a clean session ended, nothing holds it
    await broker.release_client("dev:2", new)
    assert await clients.mark_received("dev:2", 6, claim=new) is False
    assert not await broker.redis.exists(keys.client_received("dev:2"))


async def test_client_takeover_across_nodes(broker: Broker, second_node: Broker) -> None:
    taken: list[str] = []
    token, before = await broker.claim_client("sensor-9", lambda: taken.append("first"))
    assert before is None
    _, before = await second_node.claim_client("sensor-9", lambda: taken.append("second"))
    assert before == f"{broker.node_id} {token}"  # held on a live node: wait for its end
    await wait_for(lambda: taken == ["first"])
    waiting = asyncio.ensure_future(second_node.handed_over("sensor-9", before, 5))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    await broker.release_client("sensor-9", token)  # a stale release leaves the holder be
    assert await waiting
    local, before = await second_node.claim_client("sensor-9", lambda: taken.append("third"))
    assert taken == ["first", "second"] and before is None  # on the same node
    await second_node.clients.load("sensor-9", local)  # notes the claim that loaded it
    await second_node.release_client("sensor-9", local)
    claims = keys.client_claims("sensor-9")
    assert await broker.redis.hget(claims, "loaded") == str(local).encode()  # refuses saves
    assert 0 < await broker.redis.ttl(claims) <= 120  # of older ones a while; no holder
    _, before = await broker.claim_client("sensor-9", lambda: None)
    assert before is None  # released: nothing to wait for
    assert not await broker.handed_over("sensor-9", "gone 1", 0.1)


async def read_and_consumed(
    redis_url: str, broker: Broker, reader: str, n: int, window: int
) -> tuple[aioredis.Redis, Flow, list[Delivery]]:
    """Queue q with a stream reader at its start, n messages and a flow holding `window`."""
    await broker.declare_queue(QueueConfig(name="q"))
    client = aioredis.Redis.from_url(redis_url)
    await client.hset(keys.queue_readers("q"), reader, "0-0")
    await client.sadd(keys.read_queues, "q")
    for i in range(n):
        await broker.publish(to_queue("q", b"%d" % i))
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=window)
    await wait_for(lambda: len(got) == window)
    return client, flow, got


async def test_stream_readers_keep_settled_entries_until_they_pass(
    redis_url: str, broker: Broker
) -> None:
    client, flow, got = await read_and_consumed(redis_url, broker, "archiver", 6, window=4)
    for d in got[:3]:
        flow.ack(d.entry_id)
    await wait_for(lambda: len(flow.unacked) == 1)
    await asyncio.sleep(0.2)
    stream = keys.queue_stream("q")
    assert await client.xlen(stream) == 6, "acked entries stay while a reader needs them"
    assert (await broker.queues.info("q")).messages == 3
    # the reader passes everything: trimming stops at the oldest unacked entry
    await client.hset(keys.queue_readers("q"), "archiver", got[-1].entry_id)
    await broker.liveness.beat()
    ids = [e[0].decode() for e in await client.xrange(stream)]
    assert ids[0] == got[3].entry_id and len(ids) == 3
    await client.aclose()


async def test_a_fault_of_ours_in_the_heartbeat_is_told_in_full_and_it_beats_on(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """Any failure of a beat was one line, a bug's traceback lost; a Redis failure still is
    one line (tests/test_redis_refusing.py)."""
    beat = broker.liveness.beat
    beats = 0

    async def faulty_once() -> None:
        nonlocal beats
        beats += 1
        if beats == 1:
            raise KeyError("a fault of ours")
        await beat()

    broker.liveness.beat = faulty_once  # type: ignore[method-assign]
    await wait_for(lambda: beats >= 2)
    [record] = [r for r in caplog.records if r.getMessage() == "heartbeat failed"]
    assert record.exc_info is not None and record.exc_info[0] is KeyError


async def test_tests_run_on_uvloop() -> None:
    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")


async def test_competing_flows_share_a_backlog(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    await broker.queues.create(QueueConfig(name="q"))
    got: dict[int, list[Delivery]] = {0: [], 1: [], 2: []}
    for i in range(3):
        await broker.bind("q", got[i].append, window=1024)
    await asyncio.gather(*[broker.publish_nowait(to_queue("q", b"%d" % i)) for i in range(300)])
    await wait_for(lambda: sum(len(v) for v in got.values()) == 300)
    counts = {k: len(v) for k, v in got.items()}
    # none takes the whole backlog (the log says why, should one go without: a rare failure
    # in a full run, {0: 0, 1: 85, 2: 215}, never reproduced since)
    assert all(0 < n <= 200 for n in counts.values()), (counts, caplog.text)


async def test_forgetting_a_stream_reader_lets_trimming_resume(
    redis_url: str, broker: Broker
) -> None:
    await broker.declare_queue(QueueConfig(name="q"))
    client = aioredis.Redis.from_url(redis_url)
    await client.hset(keys.queue_readers("q"), "old-job", "0-0")
    await client.sadd(keys.read_queues, "q")
    assert await broker.queues.forget_reader("q", "old-job") == 1
    assert await broker.queues.forget_reader("q", "old-job") == 0
    assert not await client.sismember(keys.read_queues, "q")
    await client.aclose()


async def test_direct_subscribers_on_another_node(broker: Broker, second_node: Broker) -> None:
    got: list[Message] = []
    token = await second_node.subscribe_direct("sensors/+/temp", "mqtt", got.append)
    await wait_for(lambda: broker.direct._others)  # the other node announced itself
    await broker.publish(Message(destination="sensors/1/temp", payload=b"21"))
    await broker.publish(Message(destination="sensors/1/hum", payload=b"40"))
    await wait_for(lambda: len(got) == 1)
    assert got[0].payload == b"21"
    second_node.unsubscribe_direct(token)
    await wait_for(lambda: not broker.direct._others)
    await broker.publish(Message(destination="sensors/1/temp", payload=b"22"))
    assert broker.direct.relayed == 2


async def test_acked_entries_leave_the_stream_in_and_out_of_order(
    redis_url: str, broker: Broker
) -> None:
    """Acked entries leave the stream at once, whether acked in order or ahead of older
    unsettled ones: the stream keeps exactly the unsettled and the waiting messages."""
    await broker.queues.create(QueueConfig(name="q"))
    for i in range(12):
        await broker.publish(to_queue("q", b"%d" % i))
    first: list[Delivery] = []
    second: list[Delivery] = []
    a = await broker.bind("q", first.append, window=4)
    await wait_for(lambda: len(first) == 4)
    b = await broker.bind("q", second.append, window=4)
    await wait_for(lambda: len(second) == 4)
    client = aioredis.Redis.from_url(redis_url)
    stream = keys.queue_stream("q")

    async def stored() -> list[str]:
        return [e[0].decode() for e in await client.xrange(stream)]

    # the second flow acks ahead of the first flow's older, unsettled entries: those go,
    # the older ones stay
    for d in second[:3]:
        b.ack(d.entry_id)
    await wait_for(lambda: len(b.unacked) == 4)  # refilled with 3 more
    await asyncio.sleep(0.1)
    settled = {d.entry_id for d in second[:3]}
    ids = await stored()
    assert not settled & set(ids) and len(ids) == 9
    # the first flow acks its oldest two in order, and requeues its third
    a.ack(first[0].entry_id)
    a.ack(first[1].entry_id)
    a.requeue(first[2].entry_id)
    await wait_for(lambda: first[2].entry_id in [d.entry_id for d in first[4:] + second[4:]])
    await asyncio.sleep(0.1)
    ids = await stored()
    assert first[0].entry_id not in ids and first[1].entry_id not in ids
    assert first[2].entry_id in ids, "a requeued entry is still on the queue"
    assert len(ids) == 7 == (await broker.queues.info("q")).messages
    # everything settled: nothing is left
    await a.close()
    await b.close()
    rest: list[Delivery] = []
    c = await broker.bind("q", rest.append, window=100)
    await wait_for(lambda: len(rest) == 7)
    for d in rest:
        c.ack(d.entry_id)
    await wait_for(lambda: not c.unacked)
    for _ in range(100):  # the acks reach Redis with the next dispatch round
        if not await stored():
            break
        await asyncio.sleep(0.02)
    assert await stored() == []
    assert (await broker.queues.info("q")).messages == 0
    await client.aclose()


async def test_competing_flows_take_turns_at_small_batches(broker: Broker) -> None:
    """Non-exclusive queue, two local consumers with room to spare, messages arriving a few
    at a time: both get about half (the first woken does not take every batch)."""
    await broker.queues.create(QueueConfig(name="q"))
    got: dict[int, list[Delivery]] = {0: [], 1: []}
    flows = {}
    for i in range(2):

        def on(d: Delivery, i: int = i) -> None:
            got[i].append(d)
            flows[i].ack(d.entry_id)

        flows[i] = await broker.bind("q", on, window=256)
    for n in range(40):
        batch = [broker.publish_nowait(to_queue("q", b"%d" % (n * 5 + k))) for k in range(5)]
        await asyncio.gather(*batch)
        await wait_for(lambda n=n: sum(len(v) for v in got.values()) == 5 * (n + 1))
    counts = {k: len(v) for k, v in got.items()}
    assert all(60 <= c <= 140 for c in counts.values()), counts
    for flow in flows.values():
        await flow.close()


async def test_entries_a_former_reader_kept_go_with_later_acks(
    redis_url: str, broker: Broker
) -> None:
    """Acked entries kept for a stream reader that was then forgotten are trimmed by the
    next acks, and the trim takes nothing still waiting or unsettled."""
    client, flow, got = await read_and_consumed(redis_url, broker, "old-job", 10, window=3)
    stream = keys.queue_stream("q")
    for d in got[:3]:
        flow.ack(d.entry_id)
    await wait_for(lambda: len(got) == 6)
    assert await client.xlen(stream) == 10, "kept for the reader"
    assert await broker.queues.forget_reader("q", "old-job") == 1
    flow.ack(got[4].entry_id)  # ahead of the older, unsettled got[3]
    await wait_for(lambda: len(got) == 7)
    await asyncio.sleep(0.1)
    ids = [e[0].decode() for e in await client.xrange(stream)]
    # the three kept entries and got[4] are gone; got[3] (unsettled) and the rest stay
    assert ids[:3] == [d.entry_id for d in (got[3], got[5], got[6])] and len(ids) == 6
    for d in got[3:4] + got[5:7]:
        flow.ack(d.entry_id)
    await wait_for(lambda: len(got) == 10)
    for d in got[7:]:
        flow.ack(d.entry_id)
    await wait_for(lambda: not flow.unacked)
    for _ in range(100):  # the acks reach Redis with the next dispatch round
        if await client.xlen(stream) == 0:
            break
        await asyncio.sleep(0.02)
    assert await client.xlen(stream) == 0
    assert (await broker.queues.info("q")).messages == 0
    await client.aclose()


@pytest.mark.parametrize(
    ("config", "selector"),
    [
        ({}, None),
        ({"message_groups": "default"}, None),
        ({"sort_key": "k"}, None),
        ({"priorities": True}, None),
        ({"partition_count": 2}, None),
        ({}, "n >= 0"),
        ({"sort_key": "k"}, "n >= 0"),
    ],
    ids=["plain", "groups", "sorted", "priorities", "partitioned", "selector", "sorted-selector"],
)
async def test_a_released_message_says_it_was_acquired_before(
    broker: Broker, config: dict, selector: str | None
) -> None:
    """A release gives a message back with its delivery count as it was (AMQP §3.4.4),
    and its next delivery says a consumer acquired it before (first-acquirer false,
    §3.2.1); a failed delivery after that raises the count and keeps the mark."""
    await broker.queues.create(QueueConfig(name="q", **config))
    msg = to_queue("q", b"m")
    msg.user_properties = [("k", "a"), ("n", 1)]
    await broker.publish(msg)
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=1, selector=selector)
    await wait_for(lambda: len(got) == 1)
    assert (got[0].delivery_count, got[0].first_acquirer) == (1, True)
    flow.release(got[0].entry_id)
    await wait_for(lambda: len(got) == 2)
    assert (got[1].delivery_count, got[1].acquired_before) == (1, True)
    assert not got[1].first_acquirer and not got[1].redelivered
    flow.requeue(got[1].entry_id)
    await wait_for(lambda: len(got) == 3)
    assert (got[2].delivery_count, got[2].acquired_before) == (2, True)
    flow.ack(got[2].entry_id)
    await wait_for(lambda: not flow.unacked)


async def test_a_direct_subscriber_right_after_the_last_one_left_hears_other_nodes(
    broker: Broker, second_node: Broker
) -> None:
    """A node's withdrawal (its last direct subscriber gone) still under way when a new
    first subscriber comes goes first, or not at all: it must not stop the node
    listening after the new announcement."""
    first = await broker.subscribe_direct("warm/#", "mqtt", lambda m: None)
    await wait_for(lambda: second_node.direct._others)
    broker.unsubscribe_direct(first)
    got: list[Message] = []
    await broker.subscribe_direct("race/#", "mqtt", got.append)
    await asyncio.sleep(0.5)
    await second_node.publish(Message(destination="race/1", payload=b"x"))
    await wait_for(lambda: [m.payload for m in got] == [b"x"])


async def test_an_ack_after_a_reader_went_takes_its_own_entry_not_a_kept_one(
    redis_url: str, broker: Broker
) -> None:
    """An entry a forgotten stream reader kept sits below an unsettled one; an ack above
    that one deletes its own entry (a trim took the kept one and, counting one entry as
    expected, left the acked entry standing, where browsers saw it)."""
    client, flow, got = await read_and_consumed(redis_url, broker, "old-job", 3, window=3)
    flow.ack(got[0].entry_id)  # kept for the reader
    await wait_for(lambda: len(flow.unacked) == 2)
    await asyncio.sleep(0.1)
    assert await broker.queues.forget_reader("q", "old-job") == 1
    flow.ack(got[2].entry_id)  # above the unsettled got[1]
    await wait_for(lambda: len(flow.unacked) == 1)
    stream = keys.queue_stream("q")
    for _ in range(100):  # the ack reaches Redis with the next dispatch round
        if await client.xlen(stream) == 1:
            break
        await asyncio.sleep(0.02)
    assert [e[0].decode() for e in await client.xrange(stream)] == [got[1].entry_id]
    flow.ack(got[1].entry_id)
    await wait_for(lambda: not flow.unacked)
    for _ in range(100):
        if not await client.exists(keys.queue_kept("q"), stream):
            break
        await asyncio.sleep(0.02)
    assert not await client.exists(keys.queue_kept("q")), "the mark goes once all kept went"
    await client.aclose()


async def test_a_handover_waits_for_an_old_node_the_engine_counts_alive(redis_url: str) -> None:
    """Its liveness key gone, a node is still alive while the liveness grace lasts (every
    node lost its key alike when Redis was out of touch): the takeover waits for its
    teardown, which saves what the session needs next, as the engine reaps nothing."""
    clients = [await library.connect(redis_url) for _ in range(2)]
    old = Broker(clients[0], heartbeat=5.0, node_ttl=15.0)  # beats rarely: the key stays gone
    new = Broker(clients[1], heartbeat=5.0, node_ttl=15.0)
    await old.start()
    await new.start()
    try:
        claim, _ = await old.claim_client("roamer", lambda: None)
        _, before = await new.claim_client("roamer", lambda: None)
        assert before == f"{old.node_id} {claim}"
        await clients[0].delete(keys.node_alive(old.node_id))
        await clients[0].set(keys.liveness_grace, "1", px=20000)

        async def teardown() -> None:
            await asyncio.sleep(1.5)
            await old.release_client("roamer", claim)

        releasing = asyncio.create_task(teardown())
        assert await asyncio.wait_for(new.handed_over("roamer", before, 15.0), 10)
        await releasing
    finally:
        await new.stop()
        await old.stop()
        for client in clients:
            await client.aclose()


@pytest.mark.parametrize("bound", ["count", "bytes"])
async def test_direct_messages_go_to_other_nodes_in_bounded_batches_in_order(
    broker: Broker,
    second_node: Broker,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    bound: str,
) -> None:
    """What gathers at once goes in parts: one PUBLISH too large for a subscriber's pub/sub
    output buffer (32 MB by default) would disconnect the other nodes' listeners."""
    if bound == "count":
        monkeypatch.setattr(direct, "MAX_RELAY_BATCH", 10)
    else:  # ten 1,000-byte payloads a part
        monkeypatch.setattr(direct, "MAX_RELAY_BYTES", 10 * 1000 + 500)
    there: list[Message] = []
    await second_node.subscribe_direct("parts/#", "mqtt", there.append)
    await wait_for(lambda: broker.direct._others)
    watcher = aioredis.Redis.from_url(redis_url)
    channel = watcher.pubsub()
    await channel.subscribe(keys.direct_channel)
    try:
        for i in range(35):  # one loop turn: one outbox
            payload = b"%d" % i if bound == "count" else b"%-1000d" % i
            broker.publish_nowait(Message(destination="parts/x", payload=payload))
        await wait_for(lambda: len(there) == 35)
        relays = 0
        deadline = asyncio.get_running_loop().time() + 1.0
        while asyncio.get_running_loop().time() < deadline:
            got = await channel.get_message(ignore_subscribe_messages=True, timeout=0.1)
            relays += got is not None and got["type"] == "message"
    finally:
        await channel.aclose()
        await watcher.aclose()
    assert [int(m.payload) for m in there] == list(range(35))
    assert relays == 4
