"""Engine edge cases against a real redis-server: ring drops of refused messages, partition
rules on repartition, whole change sets and concurrent declares."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as aioredis

from gateway.broker import Broker
from gateway.config import load_settings
from gateway.engine import keys
from gateway.engine.flows import ROUND_MESSAGES
from gateway.engine.queues import QueueConfig, QueueError
from gateway.engine.spool_usage import (
    SpoolLimits,
    SpoolMonitor,
    apply_limits,
    read_usage,
    stored_limits,
)
from gateway.model import Delivery, Message, Outcome, encode
from tests.test_engine import second_node, wait_for  # noqa: F401

PAYLOAD = b"x" * 100


def topic(n: int) -> Message:
    return Message(destination="t/x", payload=PAYLOAD, id=f"m{n:08d}")


def to_queue(name: str, n: int) -> Message:
    return Message(
        destination=name, to_queue=True, payload=PAYLOAD, id=f"m{n:08d}", dmq_eligible=True
    )


TBLOB = len(encode(topic(0)))
BLOB = len(encode(to_queue("q", 0)))


async def test_refused_fan_out_drops_nothing_from_a_ring_queue(broker: Broker) -> None:
    await broker.declare_queue(
        QueueConfig(name="a", max_spool_bytes=2 * TBLOB, overflow="ring"), [("t/x", "smf")]
    )
    assert [await broker.publish(topic(i)) for i in range(2)] == [Outcome.OK] * 2, "a is full"
    await broker.declare_queue(QueueConfig(name="b"), [("t/x", "smf")])
    await apply_limits(broker.redis, SpoolLimits(broker_bytes=2 * TBLOB))  # broker full too
    assert await broker.publish(topic(2)) is Outcome.QUOTA_EXCEEDED
    info = await broker.queues.info("a")
    assert info.messages == 2 and info.counters.get("dropped", 0) == 0, "stored nowhere"
    assert (await broker.queues.info("b")).messages == 0
    await apply_limits(broker.redis, SpoolLimits(broker_bytes=3 * TBLOB))
    assert await broker.publish(topic(3)) is Outcome.OK, "a drops one, b stores one"
    info = await broker.queues.info("a")
    assert info.messages == 2 and info.counters.get("dropped") == 1


async def test_ring_dmq_keeps_its_messages_when_the_broker_is_full(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="d", max_messages=1, overflow="ring"))
    await broker.declare_queue(QueueConfig(name="q", dead_message_queue="d"))
    assert await broker.publish(to_queue("d", 1)) is Outcome.OK
    assert await broker.publish(to_queue("q", 2)) is Outcome.OK
    await apply_limits(broker.redis, SpoolLimits(broker_bytes=BLOB - 1))
    got = []
    flow = await broker.bind("q", got.append)
    await wait_for(lambda: len(got) == 1)
    flow.reject(got[0].entry_id)

    async def failed() -> bool:
        return (await broker.queues.info("q")).counters.get("dmq_failed") == 1

    for _ in range(250):
        if await failed():
            break
        await broker.redis.ping()
    assert await failed(), "the dead message was discarded"
    info = await broker.queues.info("d")
    assert info.messages == 1 and info.counters.get("dropped", 0) == 0


@pytest.mark.parametrize(
    "config",
    [
        QueueConfig(name="p", priorities=True),
        QueueConfig(name="p", message_groups="default"),
        QueueConfig(name="p", non_destructive=True),
    ],
)
async def test_repartition_refuses_what_validate_forbids(
    broker: Broker, config: QueueConfig
) -> None:
    await broker.declare_queue(config)
    await broker.update_queue("p", {"egress_enabled": False})
    with pytest.raises(QueueError) as caught:
        await broker.queues.repartition("p", 2)
    assert caught.value.code == "invalid"
    assert (await broker.queues.config("p")).partition_count == 0


async def test_update_queue_validates_the_whole_change_set(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="q", egress_enabled=False))
    with pytest.raises(QueueError, match="overflow"):
        await broker.update_queue("q", {"partition_count": 4, "overflow": "bogus"})
    config = await broker.queues.config("q")
    assert config.partition_count == 0 and config.overflow == "reject"
    with pytest.raises(QueueError, match="cannot change priorities"):
        await broker.update_queue("q", {"partition_count": 2, "priorities": True})
    assert await broker.update_queue("q", {"partition_count": 2, "max_messages": 5}) == 0
    config = await broker.queues.config("q")
    assert config.partition_count == 2 and config.max_messages == 5


async def test_redeclare_checks_the_existing_queue_not_the_new_one(broker: Broker) -> None:
    """The modify-topic check reads the config the create found, in the same call."""
    await broker.declare_queue(QueueConfig(name="q", permission="consume"), user="alice")
    with pytest.raises(QueueError) as caught:
        await broker.declare_queue(QueueConfig(name="q"), [("t/>", "smf")], user="bob")
    assert caught.value.code == "unauthorized"
    assert (await broker.queues.info("q")).subscriptions == []
    assert not await broker.declare_queue(QueueConfig(name="q"), [("t/>", "smf")], user="alice")


async def test_missing_totals_are_rebuilt_from_the_queues(broker: Broker) -> None:
    """A Redis written before the totals existed: acks must not drive them negative."""
    await broker.declare_queue(QueueConfig(name="q"))
    await broker.declare_queue(QueueConfig(name="p", partition_count=2, vpn="red"))
    for i in range(3):
        assert await broker.publish(to_queue("q", i)) is Outcome.OK
    assert await broker.publish(to_queue("p", 9)) is Outcome.OK
    await broker.redis.delete(keys.spool_usage)
    await apply_limits(broker.redis, SpoolLimits())
    used = {s.scope + s.name: s.bytes for s in (await read_usage(broker.redis)).scopes}
    assert used["broker"] == 4 * BLOB
    assert used["vpndefault"] == 3 * BLOB and used["vpnred"] == BLOB
    await broker.redis.hset(keys.spool_usage, "broker", 0)  # rebuilt once, not every start
    await apply_limits(broker.redis, SpoolLimits())
    assert (await read_usage(broker.redis)).scopes[0].bytes == 0


async def test_a_node_without_quota_settings_keeps_the_stored_ones(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    explicit = SpoolLimits(broker_bytes=1000, vpn_bytes={"red": 500}, set_percent=70)
    first = SpoolMonitor(broker.redis, "n1", broker.events, explicit)
    await first.start()
    await first.stop()
    caplog.set_level(logging.WARNING, logger="gateway.spool")
    second = SpoolMonitor(broker.redis, "n2", broker.events, SpoolLimits())
    await second.start()
    await second.stop()
    assert await stored_limits(broker.redis) == explicit
    assert any("keeping the stored" in r.getMessage() for r in caplog.records)
    third = SpoolMonitor(broker.redis, "n3", broker.events, SpoolLimits(broker_bytes=9))
    await third.start()
    await third.stop()
    assert await stored_limits(broker.redis) == SpoolLimits(  # what it sets wins, the rest
        broker_bytes=9,
        vpn_bytes={"red": 500},
        set_percent=70,  # stays
    )
    assert third.limits == await stored_limits(broker.redis)  # what it enforces


@pytest.mark.parametrize(
    ("given", "left"),
    [
        ({"spool_quota_bytes": 0}, SpoolLimits(vpn_bytes={"red": 500}, set_percent=70)),
        ({"vpn_spool_quotas": {}}, SpoolLimits(broker_bytes=2000, set_percent=70)),
        (  # the defaults, in the README's sample file: the quotas stay
            {"spool_threshold_set_percent": 80},
            SpoolLimits(broker_bytes=2000, vpn_bytes={"red": 500}),
        ),
    ],
    ids=["quota-0", "no-vpn-quotas", "thresholds"],
)
async def test_a_node_given_a_default_sets_that_part_of_the_stored_limits(
    broker: Broker, given: dict, left: SpoolLimits
) -> None:
    """`--spool-quota-bytes 0` is "0: none" (the CLI's help, README): a node started with it
    kept the quota stored before, which nothing else could then lift. It sets what it is
    given; the rest stays as stored (a review found my first version lifted every quota of a
    node given only a threshold percent)."""
    stored = SpoolLimits(broker_bytes=2000, vpn_bytes={"red": 500}, set_percent=70)
    first = SpoolMonitor(broker.redis, "n1", broker.events, stored)
    await first.start()
    await first.stop()
    limits = SpoolLimits.from_settings(load_settings(overrides=given, env={}))
    second = SpoolMonitor(broker.redis, "n2", broker.events, limits)
    await second.start()
    await second.stop()
    assert await stored_limits(broker.redis) == left


async def test_a_node_of_the_release_before_still_stores_its_limits(broker: Broker) -> None:
    """During a rolling upgrade a node of the release before calls gw_spool_limits with its
    layout (no parts first): under the same name, a new layout read its quota as the parts
    and its percents as quotas (a review found an 80-byte broker quota that way)."""
    await apply_limits(broker.redis, SpoolLimits(broker_bytes=7, set_percent=70))
    await broker.redis.fcall("gw_spool_limits", 0, 5000, 80, 60, "red", 1000)
    stored = SpoolLimits(broker_bytes=5000, vpn_bytes={"red": 1000})
    assert await stored_limits(broker.redis) == stored  # all of it set, as it was


async def test_nodes_starting_together_keep_what_each_set(redis_url: str) -> None:
    """One node's quota and another's threshold percents, stored at once: each node read
    the stored limits and wrote its own in separate calls, so one lost the other's (a
    review showed a quota lost in 9 of 10 joint starts)."""
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(2)]
    try:
        for attempt in range(10):
            await clients[0].delete(keys.spool_limits)
            with_quota = SpoolLimits(broker_bytes=5000)
            with_percents = SpoolLimits(set_percent=90, clear_percent=50)
            await asyncio.gather(
                *(
                    apply_limits(client, limits, limits.parts_set())
                    for client, limits in zip(clients, (with_quota, with_percents), strict=True)
                )
            )
            both = SpoolLimits(broker_bytes=5000, set_percent=90, clear_percent=50)
            assert await stored_limits(clients[0]) == both, attempt
    finally:
        for client in clients:
            await client.aclose()


async def raised(broker: Broker, scope: str) -> bool:
    return any(
        f"{s.scope}:{s.name}" == scope and s.raised for s in (await read_usage(broker.redis)).scopes
    )


async def test_queue_alarms_follow_quota_and_percent_changes(broker: Broker) -> None:
    await broker.declare_queue(QueueConfig(name="q", max_spool_bytes=10 * BLOB))
    for i in range(7):  # 70%: below the default set level (80%)
        assert await broker.publish(to_queue("q", i)) is Outcome.OK
    assert not await raised(broker, "queue:q")
    await apply_limits(broker.redis, SpoolLimits(set_percent=60, clear_percent=50))
    assert await raised(broker, "queue:q"), "the lower set level is reached"
    await broker.update_queue("q", {"max_spool_bytes": 100 * BLOB})
    assert not await raised(broker, "queue:q"), "7% of the larger quota"
    await broker.update_queue("q", {"max_spool_bytes": 8 * BLOB})
    assert await raised(broker, "queue:q")


async def test_a_settlement_redis_refuses_is_logged(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """An error answer to gw_settle (not a lost connection, so not retried) is logged, not
    dropped in silence."""
    await broker.declare_queue(QueueConfig(name="q"))
    assert await broker.publish(Message("q", b"x", to_queue=True)) is Outcome.OK
    got = []
    flow = await broker.bind("q", got.append, window=10)
    await wait_for(lambda: len(got) == 1)
    stream = keys.queue_stream("q")
    await broker.redis.delete(stream)
    await broker.redis.set(stream, "not a stream")  # XACK now answers WRONGTYPE
    caplog.set_level(logging.ERROR, logger="gateway.engine.flows")
    flow.ack(got[0].entry_id)
    await wait_for(
        lambda: any("settling 1 entries (ack) failed" in r.getMessage() for r in caplog.records)
    )
    await broker.redis.delete(stream)


async def test_a_refused_fetch_is_tried_again_later_not_at_once(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis refusing a flow's fetch (here: its stream key holds a string) is logged and tried
    again after FETCH_RETRY, instead of thousands of times a second; once the key is sound,
    the flow gets its message."""
    await broker.declare_queue(QueueConfig(name="q"))
    assert await broker.publish(Message("q", b"kept", to_queue=True)) is Outcome.OK
    stream = keys.queue_stream("q")
    aside = stream + ":aside"
    await broker.redis.rename(stream, aside)
    await broker.redis.set(stream, "not a stream")
    caplog.set_level(logging.WARNING, logger="gateway.engine.flows")
    got = []
    await broker.bind("q", got.append, window=10)
    await asyncio.sleep(0.5)
    refusals = [r for r in caplog.records if "fetch for flow" in r.getMessage()]
    assert len(refusals) == 1
    await broker.redis.delete(stream)
    await broker.redis.rename(aside, stream)
    await wait_for(lambda: len(got) == 1, timeout=3)
    assert got[0].message.payload == b"kept"


async def woken_together(broker: Broker, n: int, window: int) -> int:
    """Bind a consumer with `window` to each of n queues, wake them all with one publish
    and return how many dispatch rounds it took until each had its message."""
    got: dict[int, list] = {i: [] for i in range(n)}
    for i in range(n):
        await broker.declare_queue(QueueConfig(name=f"q{i}"), [("t/x", "smf")])
        await broker.bind(f"q{i}", got[i].append, window=window)
    await asyncio.sleep(0.2)  # the binds' first fetches found nothing
    before = broker.dispatcher.rounds
    assert await broker.publish(topic(0)) is Outcome.OK
    await wait_for(lambda: all(len(g) == 1 for g in got.values()))
    assert {g[0].message.id for g in got.values()} == {"m00000000"}
    return broker.dispatcher.rounds - before


async def test_big_fetches_woken_together_go_in_rounds_of_their_own(broker: Broker) -> None:
    """Flows whose fetches ask for ROUND_MESSAGES each, woken by one publish, fetch one to a
    round: each flow's batch is handed over when its own round is answered, not once every
    flow's is."""
    assert await woken_together(broker, 5, window=ROUND_MESSAGES) >= 5


async def test_small_fetches_woken_together_share_a_round(broker: Broker) -> None:
    """Flows with small windows (a shared group's members) fetch many to a round: a round
    per flow would cost the node a round's overhead for a few messages each."""
    assert await woken_together(broker, 9, window=8) <= 2


async def test_a_late_deletion_event_spares_the_flows_of_the_queue_made_again(
    broker: Broker,
) -> None:
    """A queue deleted and made again under its name (an MQTT clean start does so with its
    session's queue) may have its new flows bound before the node hears of the deletion
    (pub/sub is a connection of its own). That late event ends only the flows of the
    deleted queue: the new consumer keeps its flow and gets its messages."""
    await broker.declare_queue(QueueConfig(name="q"))
    old_reasons: list[str] = []
    await broker.bind("q", lambda d: None, on_closed=old_reasons.append)
    await broker.delete_queue("q")
    await wait_for(lambda: old_reasons == ["queue deleted"])
    await broker.declare_queue(QueueConfig(name="q"))
    got: list = []
    reasons: list[str] = []
    flow = await broker.bind("q", got.append, on_closed=reasons.append)
    await broker.redis.publish(keys.events, "qdel q")  # the deletion's event, heard late
    await asyncio.sleep(0.3)
    assert reasons == [] and not flow.closed
    assert await broker.publish(Message("q", b"kept", to_queue=True)) is Outcome.OK
    await wait_for(lambda: len(got) == 1)
    await broker.delete_queue("q")  # a deletion heard in time still ends it
    await wait_for(lambda: reasons == ["queue deleted"])


async def test_a_browser_of_a_deleted_queue_ends_even_if_the_name_is_made_again(
    broker: Broker,
) -> None:
    """A browser attached to queue q (AMQP distribution-mode copy, or any consumer of a
    non-destructive queue) browses that queue; q is deleted and a new queue q made (another
    owner, other settings) before the node hears the deletion. Like every other flow of
    the deleted queue, the browser ends (AMQP: detached, resource-deleted); it must not go
    on reading the new queue."""
    await broker.queues.create(QueueConfig(name="q"))
    assert await broker.publish(Message("q", b"old", to_queue=True)) is Outcome.OK
    got: list[Delivery] = []
    closed: list[str] = []
    await broker.bind("q", got.append, browse=True, on_closed=closed.append)
    await wait_for(lambda: len(got) == 1, timeout=5)
    # deleted and made again before the node handles the 'qdel' event
    cfg = QueueConfig(name="q", owner="someone-else")
    pipe = broker.redis.pipeline(transaction=True)
    pipe.fcall("gw_queue_delete", 0, "q")
    pipe.fcall("gw_queue_create", 0, "q", *cfg.to_redis())
    await pipe.execute()
    assert await broker.publish(Message("q", b"new queue's", to_queue=True)) is Outcome.OK
    await asyncio.sleep(1.0)
    assert closed, (
        f"the browser of the deleted queue goes on browsing the new one: got "
        f"{[d.message.payload for d in got]}"
    )


async def test_a_nodes_queue_index_holds_only_queues_it_has_flows_on_or_owns(
    broker: Broker,
    second_node: Broker,  # noqa: F811
) -> None:
    """The index is for the node's reaper. Every queue a flow of the node ever bound stayed
    in it, deleted ones too (a request/reply client's temporary queue each time): it grew
    without bound, and a reap walked all of it in one Redis call."""

    async def index() -> set[str]:
        members = await broker.redis.smembers(keys.node_queues(broker.node_id))
        return {m.decode() for m in members}

    await broker.queues.create(QueueConfig(name="plain"))
    first = await broker.bind("plain", lambda d: None)
    second = await broker.bind("plain", lambda d: None)
    elsewhere = await second_node.bind("plain", lambda d: None)
    await first.close()
    assert "plain" in await index()  # a flow of the node is still there
    await second.close()
    assert "plain" not in await index()  # another node's flow is no reason
    await elsewhere.close()

    temporary = await broker.create_temporary_queue()
    flow = await broker.bind(temporary, lambda d: None)
    await flow.close()
    assert temporary in await index()  # it owns the queue: its reaper deletes it
    await broker.delete_temporary_queue(temporary)
    await broker.queues.create(QueueConfig(name="gone"))
    await broker.bind("gone", lambda d: None)
    await broker.delete_queue("gone")  # deleted under a flow
    assert await index() == set()


async def test_reaping_a_node_reads_its_flows_once_not_once_a_flow(broker: Broker) -> None:
    """The node index's upkeep read a queue's whole flow set at every flow's release: a
    reap of a node with 10,000 consumers on one queue held Redis for seconds. Counted in
    Redis's own command statistics, not timed."""
    redis = broker.redis
    await broker.queues.create(QueueConfig(name="many"))
    await redis.fcall("gw_node_up", 0, "ndead", 1000)
    for i in range(200):
        await redis.fcall("gw_bind", 0, "many", f"ndead.{i}", "ndead", "", "")
    await redis.delete(keys.node_alive("ndead"))  # its TTL ran out
    await redis.config_resetstat()
    assert await redis.fcall("gw_reap", 0) == 200
    stats = await redis.info("commandstats")
    assert (await broker.queues.info("many")).flows == []
    assert stats["cmdstat_zrange"]["calls"] < 10
    assert not await redis.exists(keys.node_queues("ndead"), keys.node_queue_flows("ndead"))


async def test_a_nodes_flow_counts_hold_through_a_bind_run_twice_and_older_flows(
    broker: Broker,
) -> None:
    """A bind run again after a lost reply counted its flow twice (the queue then stayed
    in the index for good), and a flow bound before the counts were kept let the count
    reach 0 under a newer flow, so a reap of the node missed that one."""
    redis = broker.redis
    await broker.queues.create(QueueConfig(name="twice"))
    await broker.queues.create(QueueConfig(name="mixed"))
    await redis.fcall("gw_node_up", 0, "nx", 1000)
    await redis.fcall("gw_bind", 0, "twice", "nx.1", "nx", "", "")
    await redis.fcall("gw_bind", 0, "twice", "nx.1", "nx", "", "")  # the retry
    await redis.fcall("gw_unbind", 0, "twice", "nx.1")
    await redis.fcall("gw_bind", 0, "mixed", "nx.old", "nx", "", "")
    await redis.hdel(keys.node_queue_flows("nx"), "mixed")  # as bound before the counts
    await redis.fcall("gw_bind", 0, "mixed", "nx.new", "nx", "", "")
    await redis.fcall("gw_unbind", 0, "mixed", "nx.old")
    assert await redis.smembers(keys.node_queues("nx")) == {b"mixed"}
    await redis.delete(keys.node_alive("nx"))
    assert await redis.fcall("gw_reap", 0) == 1  # nx.new, released
    assert (await broker.queues.info("mixed")).flows == []
