"""Partitioned queues: key hashing, rebalance, handoff, per-key order."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import pytest
import redis.asyncio as aioredis

from gateway.broker import Broker
from gateway.engine import keys
from gateway.engine.flows import Flow
from gateway.engine.partitions import partition_of
from gateway.engine.queues import QueueConfig, QueueError
from gateway.model import Delivery, Message
from tests import test_engine
from tests.test_engine import wait_for

second_node = test_engine.second_node  # a fixture: another node on the same Redis


def keyed(queue: str, key: str | None, payload: bytes) -> Message:
    return Message(destination=queue, to_queue=True, payload=payload, partition_key=key)


async def make_queue(broker: Broker, name: str = "p", **kw) -> None:
    kw.setdefault("partition_count", 4)
    kw.setdefault("partition_rebalance_delay_ms", 0)
    await broker.declare_queue(QueueConfig(name=name, **kw))


def owned(flows: list[Flow]) -> list[int]:
    return sorted(len(f.parts) for f in flows)


async def test_keys_land_in_their_partition(redis_url: str, broker: Broker) -> None:
    await make_queue(broker)
    for i in range(40):
        assert (await broker.publish(keyed("p", f"dev-{i % 10}", b"%d" % i))).accepted
    for _ in range(200):
        await broker.publish(keyed("p", None, b"no key"))
    client = aioredis.Redis.from_url(redis_url)
    for index in range(4):
        entries = await client.xrange(keys.queue_stream(keys.partition_queue("p", index)))
        keyed_here = {
            e[1][b"m"] for e in entries if b"dev-" in e[1][b"m"]
        }  # payload bytes carry the key in the encoded message
        expected = sum(1 for i in range(40) if partition_of(f"dev-{i % 10}", 4) == index)
        assert len(keyed_here) == expected
        assert len(entries) - len(keyed_here) > 10, "keyless messages spread over partitions"
    await client.aclose()
    info = await broker.queues.info("p")
    assert info.messages == 240
    assert "#P/0/p" not in await broker.queues.names(), "partitions are hidden"


async def test_rebalance_spreads_partitions_and_parks_extra_flows(broker: Broker) -> None:
    await make_queue(broker)
    flows = [await broker.bind("p", lambda d: None) for _ in range(3)]
    await wait_for(lambda: owned(flows) == [1, 1, 2])
    flows.append(await broker.bind("p", lambda d: None))
    await wait_for(lambda: owned(flows) == [1, 1, 1, 1])
    extra = await broker.bind("p", lambda d: None)
    await asyncio.sleep(0.3)
    assert extra.parts == {} and not extra.active, "a fifth flow is inactive"
    await flows[0].close()
    await flows[1].close()
    remaining = [*flows[2:], extra]
    await wait_for(lambda: owned(remaining) == [1, 1, 2])
    info = (await broker.queues.info("p")).to_json()
    assert sorted(p["owner"] for p in info["partitions"]) == sorted(
        f.id for f in remaining for _ in f.parts
    )


def key_for_partition(index: int, count: int) -> str:
    return next(f"k{i}" for i in range(1000) if partition_of(f"k{i}", count) == index)


async def test_handoff_waits_for_the_old_owner_to_settle(broker: Broker) -> None:
    await make_queue(broker, partition_count=2, partition_handoff_timeout_ms=60_000)
    key = key_for_partition(1, 2)  # the partition that moves to the second flow
    for i in range(3):
        await broker.publish(keyed("p", key, b"%d" % i))
    first: list[Delivery] = []
    a = await broker.bind("p", first.append, window=1)
    await wait_for(lambda: len(first) == 1)
    second: list[Delivery] = []
    b = None

    def on_b(d: Delivery) -> None:
        second.append(d)
        b.ack(d.entry_id)

    b = await broker.bind("p", on_b, window=10)
    await wait_for(lambda: len(a.parts) == 1)
    await asyncio.sleep(0.5)
    assert second == [], "the new owner waits while the old one holds the key's message"
    a.ack(first[0].entry_id)
    await wait_for(lambda: len(second) == 2)
    assert [d.message.payload for d in first + second] == [b"0", b"1", b"2"]
    assert len(first) == 1


async def test_handoff_timeout_requeues_in_order(broker: Broker) -> None:
    await make_queue(broker, partition_count=2, partition_handoff_timeout_ms=300)
    key = key_for_partition(1, 2)
    for i in range(3):
        await broker.publish(keyed("p", key, b"%d" % i))
    first: list[Delivery] = []
    await broker.bind("p", first.append, window=1)
    await wait_for(lambda: len(first) == 1)
    second: list[Delivery] = []
    await broker.bind("p", second.append, window=10)
    await wait_for(lambda: len(second) == 3, timeout=5)
    assert [d.message.payload for d in second] == [b"0", b"1", b"2"]
    assert second[0].redelivered and not second[1].redelivered
    assert len(first) == 1


@pytest.mark.parametrize("turns", [0, 1])  # the order its two fetches are sent in
async def test_a_flow_losing_a_partition_mid_fetch_says_it_has_nothing(
    broker: Broker, turns: int
) -> None:
    """A flow given credit (an AMQP drain) as a bind moves one of its two partitions away:
    the fetch of the one it keeps finds nothing, that of the other is refused. When the
    refusal came last, the flow never said it had nothing, so the drain waited for the
    wake-up of every flow ten heartbeats on (found by a review)."""
    await make_queue(broker, partition_count=2, partition_handoff_timeout_ms=60_000)
    await broker.publish(keyed("p", key_for_partition(1, 2), b"held"))
    got: list[Delivery] = []
    a = await broker.bind("p", got.append, window=10)
    await wait_for(lambda: len(got) == 1)  # held unsettled: partition 1 hands off slowly
    for _ in range(turns):
        a.set_credit(None)
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    empty = asyncio.Event()
    a.on_empty = empty.set
    await broker.bind("p", lambda d: None, window=10)  # rebalances at once
    a.set_credit(5)  # in the same round
    await asyncio.wait_for(empty.wait(), 0.5)  # heartbeats 0.2 s: not the 10th one's
    assert list(a.parts) == [0]


async def test_no_partition_shows_a_handoff_once_its_last_consumer_left(
    broker: Broker,
) -> None:
    """The queue's only consumer closes holding nothing: every partition showed it as
    handing off (owner and target none) until another consumer bound (found by a
    review)."""
    await make_queue(broker, partition_count=2)
    flow = await broker.bind("p", lambda d: None)
    await wait_for(lambda: len(flow.parts) == 2)
    await flow.close()

    async def handoffs() -> list[object]:
        info = (await broker.queues.info("p")).to_json()
        return [p["handing_off_from"] for p in info["partitions"]]

    deadline = time.monotonic() + 3
    while (shown := await handoffs()) != [None, None]:
        assert time.monotonic() < deadline, shown
        await asyncio.sleep(0.05)


async def test_partition_ownership_survives_across_nodes(broker: Broker, redis_url: str) -> None:
    from gateway.engine import library

    await make_queue(broker)
    client = await library.connect(redis_url)
    other = Broker(client, heartbeat=0.2, node_ttl=1.0)
    await other.start()
    try:
        here = [await broker.bind("p", lambda d: None) for _ in range(2)]
        there = [await other.bind("p", lambda d: None) for _ in range(2)]
        await wait_for(lambda: owned(here + there) == [1, 1, 1, 1])
        other.liveness._task.cancel()  # the other node dies without a word
        await other.events.stop()
        await wait_for(lambda: owned(here) == [2, 2], timeout=10)
    finally:
        await client.aclose()


async def test_repartition_needs_egress_disabled_and_reports_deleted(broker: Broker) -> None:
    await make_queue(broker)
    for i in range(20):
        await broker.publish(keyed("p", f"k{i}", b"x"))
    with pytest.raises(QueueError) as err:
        await broker.queues.repartition("p", 2)
    assert err.value.code == "precondition_failed"
    await broker.queues.update("p", {"egress_enabled": False})
    removed = sum(1 for i in range(20) if partition_of(f"k{i}", 4) >= 2)
    assert await broker.queues.repartition("p", 2) == removed
    assert (await broker.queues.info("p")).messages == 20 - removed
    assert await broker.queues.repartition("p", 0) == 20 - removed  # switching kind
    await broker.queues.update("p", {"egress_enabled": True})
    await broker.publish(keyed("p", "k1", b"plain"))
    got: list[Delivery] = []
    await broker.bind("p", got.append)
    await wait_for(lambda: len(got) == 1)
    assert got[0].entry_id.count("/") == 0, "not partitioned any more"


async def test_admin_api_shows_and_scales_partitions(broker: Broker) -> None:
    from gateway.admin.api import AdminApi
    from gateway.admin.http import HttpServer
    from tests.test_admin_api import Admin  # the admin test client over a real socket

    server = HttpServer(AdminApi(broker))
    port = await server.start("127.0.0.1", 0)
    try:
        admin = Admin(port)
        reply = await admin.post(
            "/api/v1/queues",
            {"name": "pq", "partition_count": 3, "partition_rebalance_delay_ms": 0},
        )
        assert reply.status == 201 and len(reply.body["partitions"]) == 3
        flow = await broker.bind("pq", lambda d: None)
        await wait_for(lambda: len(flow.parts) == 3)
        shown = (await admin.get("/api/v1/queues/pq")).body
        assert {p["owner"] for p in shown["partitions"]} == {flow.id}
        assert shown["flows"] == [{"id": flow.id, "active": True}]
        refused = await admin.request("PATCH", "/api/v1/queues/pq", {"partition_count": 2})
        assert refused.status == 409 and "egress" in refused.error
        for i in range(10):
            await broker.publish(keyed("pq", f"k{i}", b"x"))
        reply = await admin.request(
            "PATCH", "/api/v1/queues/pq", {"egress_enabled": False, "partition_count": 2}
        )
        assert reply.status == 409, "egress must be off before, not in the same request"
        assert (
            await admin.request("PATCH", "/api/v1/queues/pq", {"egress_enabled": False})
        ).status == 200
        reply = await admin.request("PATCH", "/api/v1/queues/pq", {"partition_count": 2})
        gone = sum(1 for i in range(10) if partition_of(f"k{i}", 3) == 2)
        assert reply.status == 200 and reply.body["deleted_messages"] == gone
        assert reply.body["messages"] == 10 - gone
    finally:
        await server.close()


async def test_http_publish_keys_and_active_flow_metrics(broker: Broker) -> None:
    import urllib.request

    from gateway.admin.api import AdminApi
    from gateway.admin.http import HttpServer

    await make_queue(broker, name="hq", partition_count=1)
    got: list[Delivery] = []
    flows = [await broker.bind("hq", got.append) for _ in range(2)]
    await wait_for(lambda: owned(flows) == [0, 1])
    server = HttpServer(AdminApi(broker))
    port = await server.start("127.0.0.1", 0)
    try:

        def publish() -> int:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/api/v1/queues/hq/messages",
                data=b'{"payload": "x"}',
                method="POST",
                headers={
                    "Solace-User-Property-JMSXGroupID": "device-9",
                    "Solace-User-Property-site": "north",
                },
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status

        def metrics() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                return r.read().decode()

        assert await asyncio.to_thread(publish) == 200
        await wait_for(lambda: len(got) == 1)
        assert got[0].message.partition_key == "device-9"
        assert ("site", "north") in got[0].message.user_properties
        text = await asyncio.to_thread(metrics)
        assert 'gateway_queue_flows{queue="hq",state="active"} 1' in text
        assert 'gateway_queue_flows{queue="hq",state="inactive"} 1' in text
    finally:
        await server.close()


async def test_a_rebalance_redis_refuses_is_logged(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """An error answer to gw_rebalance (not a lost connection, so not retried) is logged."""
    await make_queue(broker)
    flow = await broker.bind("p", lambda d: None)
    await wait_for(lambda: owned([flow]) == [4])
    parts = keys.queue_parts("p")
    saved = await broker.redis.hgetall(parts)
    await broker.redis.delete(parts)
    await broker.redis.set(parts, "not a hash")  # HGETALL now answers WRONGTYPE
    caplog.set_level(logging.ERROR, logger="gateway.engine.flows")
    broker.dispatcher.request_rebalance("p")
    await wait_for(
        lambda: any(
            "rebalancing the partitions of p failed" in r.getMessage() for r in caplog.records
        )
    )
    await broker.redis.delete(parts)
    await broker.redis.hset(parts, mapping=saved)


async def test_a_message_stored_during_an_empty_fetch_is_not_left_waiting(
    broker: Broker, second_node: Broker
) -> None:
    """A message stored on another node while the flow's fetch of its (then empty)
    partition is in flight wakes the flow before that fetch answers: the empty answer
    must not mark the partition idle, or the message waits for the next wake-up of every
    flow (ten heartbeats). Heartbeats are slowed here so that one cannot hide it."""
    broker.liveness.ttl_ms = 60_000
    broker.liveness.interval = 3.0
    await broker.declare_queue(
        QueueConfig(name="p", partition_count=4, partition_rebalance_delay_ms=0)
    )
    got: list[Delivery] = []

    def take(d: Delivery) -> None:
        got.append(d)
        asyncio.get_running_loop().call_soon(flow.ack, d.entry_id)

    flow = await broker.bind("p", take, window=10)
    await wait_for(lambda: len(flow.parts) == 4)
    sent, deadline = 0, time.monotonic() + 4
    while time.monotonic() < deadline:
        await second_node.publish(keyed("p", f"k{sent % 7}", b"%d" % sent))
        sent += 1
        await asyncio.sleep(random.random() * 0.001)
        if sent % 100 == 0:
            await wait_for(lambda n=sent: len(got) == n, 1.0)
    await wait_for(lambda: len(got) == sent, 1.0)


@pytest.mark.parametrize("new_count", [2, 0, 8])
async def test_a_repartition_keeps_the_consumers(broker: Broker, new_count: int) -> None:
    """A changed partition_count unbinds the queue's flows for them to bind again: a flow
    that fetches from a partition the change removed is not told the queue was deleted,
    and one whose bind again finds egress still disabled (the operator's pause before
    enabling it) waits for egress, as a bound flow does, rather than being ended."""
    await make_queue(broker)
    got: list[Delivery] = []
    closed: list[str] = []
    flow = await broker.bind("p", got.append, on_closed=closed.append)
    await wait_for(lambda: len(flow.parts) == 4)
    await broker.update_queue("p", {"egress_enabled": False})
    await broker.update_queue("p", {"partition_count": new_count})
    await asyncio.sleep(0.3)
    await broker.update_queue("p", {"egress_enabled": True})
    for i in range(10):
        await broker.publish(keyed("p", f"k{i}", b"%d" % i))
    await wait_for(lambda: len(got) == 10)
    assert closed == []


async def test_a_one_credit_flow_serves_each_of_its_partitions_in_turn(broker: Broker) -> None:
    """A flow with room for one message takes its partitions in turn by its own count: by
    the dispatcher's round number, a consumer that settles and gives credit in separate
    turns (two rounds a delivery, as an AMQP receiver may) always got the same one."""
    await make_queue(broker, partition_count=2)
    k0, k1 = (next(f"k{i}" for i in range(1000) if partition_of(f"k{i}", 2) == p) for p in (0, 1))
    await broker.publish(keyed("p", k1, b"old"))  # the oldest message, in partition 1
    for i in range(40):
        await broker.publish(keyed("p", k0, b"a%d" % i))  # a backlog in partition 0
    got: list[bytes] = []
    loop = asyncio.get_running_loop()

    def take(d: Delivery) -> None:  # a disposition, then a flow frame
        got.append(d.message.payload)
        loop.call_later(0.002, flow.ack, d.entry_id)
        loop.call_later(0.004, flow.set_credit, 1)

    flow = await broker.bind("p", take, window=10, credit=1)
    await wait_for(lambda: len(got) >= 10, 10)
    assert b"old" in got[:10], got[:10]
