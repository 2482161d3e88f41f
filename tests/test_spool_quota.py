"""Broker-wide and per-VPN spool quotas and spool usage threshold events, against a real
redis-server (and a real paho-mqtt 2.x client for the MQTT 5 refusal)."""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import threading
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import paho.mqtt.client as paho
import pytest
import redis.asyncio as aioredis
from paho.mqtt.enums import CallbackAPIVersion

from gateway.admin.api import AdminApi
from gateway.admin.http import HttpServer
from gateway.admin.metrics import render_metrics
from gateway.broker import Broker
from gateway.config import ConfigError, Settings, load_settings
from gateway.engine import keys, library
from gateway.engine.queues import DEAD_MESSAGE_QUEUE, QueueConfig, QueueError
from gateway.engine.spool_usage import SpoolLimits, SpoolMonitor, apply_limits, read_usage
from gateway.logs import JsonFormatter
from gateway.model import Delivery, Message, Outcome, encode
from protocols.mqtt.listener import start as start_mqtt
from tests.test_engine import wait_for

PAYLOAD = b"x" * 100


def to_queue(name: str, n: int = 0, **kw) -> Message:
    return Message(destination=name, to_queue=True, payload=PAYLOAD, id=f"m{n:08d}", **kw)


def topic(name: str, n: int = 0) -> Message:
    return Message(destination=name, payload=PAYLOAD, id=f"m{n:08d}")


# What one stored copy counts: the encoded entry. Queue names here are one letter long,
# so every message to a queue has the same size, and every message to topic t/x too.
BLOB = len(encode(to_queue("q")))
TBLOB = len(encode(topic("t/x")))


async def usage(broker: Broker) -> dict[str, int]:
    """Bytes per scope: "broker", "vpn:<name>", "queue:<name>"."""
    report = await read_usage(broker.redis)
    return {
        (s.scope if s.scope == "broker" else f"{s.scope}:{s.name}"): s.bytes for s in report.scopes
    }


async def stats_bytes(redis: aioredis.Redis) -> int:
    """The sum of every queue's own byte counter (hidden children included)."""
    total = 0
    async for key in redis.scan_iter(match=keys.queue_stats("*")):
        total += int(await redis.hget(key, "bytes") or 0)
    return total


async def eventually(check, timeout: float = 5.0) -> None:
    """Poll an async predicate (settlements are batched per turn, then sent)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def consistent(broker: Broker) -> int:
    """The broker-wide total equals the sum of the queues' counters; returns it."""
    total = (await usage(broker))["broker"]
    assert total == await stats_bytes(broker.redis)
    return total


async def test_broker_quota_refuses_fan_out_all_or_nothing(broker: Broker) -> None:
    await apply_limits(broker.redis, SpoolLimits(broker_bytes=5 * TBLOB))
    for name in ("a", "b"):
        await broker.declare_queue(QueueConfig(name=name), [("t/>", "smf")])
    outcomes = [await broker.publish(topic("t/x", i)) for i in range(3)]
    assert outcomes == [Outcome.OK, Outcome.OK, Outcome.QUOTA_EXCEEDED], "2 copies each"
    for name in ("a", "b"):
        assert (await broker.queues.info(name)).messages == 2, "the third went nowhere"
    assert await consistent(broker) == 4 * TBLOB
    await broker.declare_queue(QueueConfig(name="c"))
    assert await broker.publish(to_queue("c", 9)) is Outcome.OK, "one copy still fits"
    assert await broker.publish(to_queue("c", 10)) is Outcome.QUOTA_EXCEEDED
    assert broker.spooler.refused["quota_exceeded"] == 2


async def test_one_batch_counts_its_own_messages(broker: Broker) -> None:
    await apply_limits(broker.redis, SpoolLimits(broker_bytes=3 * BLOB))
    await broker.declare_queue(QueueConfig(name="q"))
    futures = [broker.publish_nowait(to_queue("q", i)) for i in range(5)]  # one group commit
    assert [await f for f in futures] == [Outcome.OK] * 3 + [Outcome.QUOTA_EXCEEDED] * 2
    assert broker.spooler.batches == 1
    assert await consistent(broker) == 3 * BLOB


async def test_vpn_quotas_are_separate(broker: Broker) -> None:
    await apply_limits(broker.redis, SpoolLimits(vpn_bytes={"red": BLOB + TBLOB}))
    await broker.declare_queue(QueueConfig(name="r", vpn="red"), [("t/>", "smf")])
    await broker.declare_queue(QueueConfig(name="s", vpn="red"))
    await broker.declare_queue(QueueConfig(name="g", vpn="green"), [("t/>", "smf")])
    assert await broker.publish(to_queue("s", 1)) is Outcome.OK
    assert await broker.publish(topic("t/x", 2)) is Outcome.OK, "r + g: red is full now"
    assert await broker.publish(topic("t/x", 3)) is Outcome.QUOTA_EXCEEDED, "red is full"
    assert (await broker.queues.info("g")).messages == 1, "nothing of the refused fan-out"
    for i in range(4, 10):
        assert await broker.publish(to_queue("g", i)) is Outcome.OK, "green has no quota"
    used = await usage(broker)
    assert used["vpn:red"] == BLOB + TBLOB and used["vpn:green"] == TBLOB + 6 * BLOB
    assert used["broker"] == 2 * TBLOB + 7 * BLOB == await stats_bytes(broker.redis)
    got: list[Delivery] = []
    flow = await broker.bind("s", got.append)
    await wait_for(lambda: len(got) == 1)
    flow.ack(got[0].entry_id)

    async def red_freed() -> bool:
        return (await usage(broker))["vpn:red"] == TBLOB

    await eventually(red_freed)
    assert await broker.publish(to_queue("s", 11)) is Outcome.OK, "room again after the ack"


@pytest.mark.parametrize("overflow", ["reject", "ring"])
async def test_a_full_quota_takes_a_last_value_that_replaces_a_waiting_one(
    broker: Broker, overflow: str
) -> None:
    """A replacement does not grow the spool: a full queue takes it (Qpid's LVQ), and so
    must a full VPN or broker quota. Those refused it: a backlog elsewhere in the VPN
    stopped every status update."""
    await broker.declare_queue(
        QueueConfig(name="status", lvq_key="device", vpn="red", overflow=overflow)
    )

    def value(n: int, device: str = "d1") -> Message:
        return to_queue("status", n, user_properties=[("device", device)])

    assert await broker.publish(value(1)) is Outcome.OK
    used = (await usage(broker))["vpn:red"]
    await apply_limits(broker.redis, SpoolLimits(broker_bytes=used, vpn_bytes={"red": used}))
    assert await broker.publish(value(2)) is Outcome.OK, "it replaces the waiting value"
    assert await broker.publish(value(3, "d2")) is Outcome.QUOTA_EXCEEDED, "a new key grows it"
    assert (await broker.queues.info("status")).messages == 1
    assert await consistent(broker) == used


async def test_totals_return_to_zero(broker: Broker) -> None:
    """Acks, rejects to the DMQ, expiry, ring drops, last-value replacement, repartition
    and queue deletion all keep the totals equal to the queues' own counters."""
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE))
    await broker.declare_queue(QueueConfig(name="q", respect_ttl=True))
    await broker.declare_queue(QueueConfig(name="r", max_messages=2, overflow="ring"))
    await broker.declare_queue(QueueConfig(name="l", max_spool_bytes=0))
    await broker.declare_queue(QueueConfig(name="p", partition_count=3, vpn="p"))
    q_msgs = [to_queue("q", i, dmq_eligible=True) for i in range(6)]
    expired = to_queue("q", 7, expiration=1, dmq_eligible=True)  # dead-lettered at the fetch
    p_msgs = [
        Message(
            destination="p", to_queue=True, payload=PAYLOAD, id=f"m{i:08d}", partition_key=f"k{i}"
        )
        for i in range(6)
    ]
    for i in range(6):
        for m in (q_msgs[i], to_queue("r", i), to_queue("l", i), p_msgs[i]):
            assert await broker.publish(m) is Outcome.OK
    assert await broker.publish(expired) is Outcome.OK
    size = {name: sum(len(encode(m)) for m in ms) for name, ms in (("q", q_msgs), ("p", p_msgs))}
    assert (await broker.queues.info("r")).spooled_bytes == 2 * BLOB, "4 dropped by the ring"
    assert (await broker.queues.info("l")).spooled_bytes == BLOB, "5 replaced"
    assert (await usage(broker))["vpn:p"] == size["p"]
    assert await consistent(broker) == size["q"] + len(encode(expired)) + 3 * BLOB + size["p"]
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=10)
    await wait_for(lambda: len(got) == 6)
    for d in got[:3]:
        flow.ack(d.entry_id)
    for d in got[3:]:
        flow.reject(d.entry_id)  # to the DMQ: moves, counted on both sides

    async def settled() -> bool:
        return (await broker.queues.info("q")).counters.get("acked") == 3 and (
            await broker.queues.info(DEAD_MESSAGE_QUEUE)
        ).messages == 4

    await eventually(settled)
    info = await broker.queues.info("q")
    assert info.messages == 0 and info.counters["expired"] == 1
    moved = sum(len(encode(m)) for m in q_msgs[3:]) + len(encode(expired))
    assert (await broker.queues.info(DEAD_MESSAGE_QUEUE)).spooled_bytes == moved
    assert await consistent(broker) == moved + 3 * BLOB + size["p"]
    await broker.update_queue("p", {"egress_enabled": False})
    assert await broker.update_queue("p", {"partition_count": 0}) == 6
    assert (await usage(broker))["vpn:p"] == 0
    for name in ("q", "r", "l", "p", DEAD_MESSAGE_QUEUE):
        await broker.delete_queue(name)
    assert await consistent(broker) == 0
    assert (await usage(broker))["vpn:default"] == 0


async def test_queue_vpn_is_validated_and_kept(broker: Broker) -> None:
    with pytest.raises(QueueError, match="VPN name"):
        await broker.declare_queue(QueueConfig(name="bad", vpn="no spaces"))
    await broker.declare_queue(QueueConfig(name="q", vpn="blue"))
    assert (await broker.queues.config("q")).vpn == "blue"
    with pytest.raises(QueueError, match="vpn"):
        await broker.declare_queue(QueueConfig(name="q", vpn="green"))


@pytest.fixture
async def two_nodes(redis_url: str) -> AsyncIterator[list[tuple[Broker, SpoolMonitor]]]:
    """Two brokers on one Redis, each with its spool monitor (the limits of the second)."""
    nodes = []
    limits = SpoolLimits(broker_bytes=10 * BLOB, set_percent=80, clear_percent=60)
    for _ in range(2):
        client = await library.connect(redis_url)
        node = Broker(client, heartbeat=0.2, node_ttl=1.0)
        await node.start()
        monitor = SpoolMonitor(client, node.node_id, node.events, limits)
        await monitor.start()
        nodes.append((node, monitor))
    yield nodes
    for node, monitor in nodes:
        await monitor.stop()
        await node.stop()
        await node.redis.aclose()


def threshold_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "gateway.spool"]


async def test_threshold_events_once_per_crossing_across_nodes(
    two_nodes: list[tuple[Broker, SpoolMonitor]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.spool")
    (a, mon_a), (b, mon_b) = two_nodes
    await a.declare_queue(QueueConfig(name="q", max_spool_bytes=100 * BLOB))
    for i in range(7):  # 70%: nothing yet; both nodes publish
        assert await (a if i % 2 else b).publish(to_queue("q", i)) is Outcome.OK
    assert (await read_usage(a.redis)).scopes[0].raised is False
    for i in range(7, 10):  # 80%, 90%, 100%: one crossing
        assert await (a if i % 2 else b).publish(to_queue("q", i)) is Outcome.OK
    assert await a.publish(to_queue("q", 10)) is Outcome.QUOTA_EXCEEDED
    await wait_for(lambda: len(threshold_records(caplog)) >= 1)
    await asyncio.sleep(0.2)  # a second (wrong) log line would arrive by now
    records = threshold_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    entry = json.loads(JsonFormatter().format(records[0]))
    assert entry["event"] == "spool_threshold_set" and entry["scope"] == "broker"
    assert entry["bytes"] == 8 * BLOB and entry["quota"] == 10 * BLOB
    assert mon_a.logged + mon_b.logged == 1
    report = await read_usage(b.redis)
    assert report.scopes[0].raised and report.scopes[0].sets == 1

    got: list[Delivery] = []
    flow = await b.bind("q", got.append, window=10)
    await wait_for(lambda: len(got) == 10)
    for d in got[:4]:  # 60%: not below the clear threshold yet
        flow.ack(d.entry_id)
    await asyncio.sleep(0.3)
    assert len(threshold_records(caplog)) == 1
    flow.ack(got[4].entry_id)  # 50%: cleared, once
    await wait_for(lambda: len(threshold_records(caplog)) == 2)
    await asyncio.sleep(0.2)
    records = threshold_records(caplog)
    assert len(records) == 2 and records[1].levelno == logging.INFO
    assert json.loads(JsonFormatter().format(records[1]))["event"] == "spool_threshold_clear"
    broker_scope = (await read_usage(a.redis)).scopes[0]
    assert (broker_scope.raised, broker_scope.sets, broker_scope.clears) == (False, 1, 1)


async def test_vpn_and_queue_thresholds_and_metrics(broker: Broker) -> None:
    await apply_limits(broker.redis, SpoolLimits(vpn_bytes={"red": 5 * BLOB}))
    await broker.declare_queue(QueueConfig(name="r", vpn="red", max_spool_bytes=20 * BLOB))
    for i in range(4):  # red at 80% of its quota, the queue at 20% of its own
        assert await broker.publish(to_queue("r", i)) is Outcome.OK
    report = {(s.scope, s.name): s for s in (await read_usage(broker.redis)).scopes}
    assert report[("vpn", "red")].raised and report[("vpn", "red")].sets == 1
    assert ("queue", "r") not in report, "no queue alarm, no queue events"
    assert not report[("broker", "")].raised, "no broker-wide quota"
    await broker.declare_queue(QueueConfig(name="s", vpn="red", max_spool_bytes=BLOB))
    assert await broker.publish(to_queue("s", 5)) is Outcome.OK  # s at 100% of its quota
    text = await render_metrics(broker)
    assert f'gateway_spool_usage_bytes{{scope="vpn",name="red"}} {5 * BLOB}' in text
    assert f'gateway_spool_quota_bytes{{scope="vpn",name="red"}} {5 * BLOB}' in text
    assert 'gateway_spool_threshold_raised{scope="vpn",name="red"} 1' in text
    assert 'gateway_spool_threshold_raised{scope="broker",name=""} 0' in text
    assert 'gateway_spool_threshold_raised{scope="queue",name="s"} 1' in text
    assert 'gateway_spool_threshold_events_total{scope="vpn",name="red",event="set"} 1' in text
    assert "# TYPE gateway_spool_threshold_events_total counter" in text
    await broker.delete_queue("s")  # its alarm goes with it
    await apply_limits(broker.redis, SpoolLimits())  # no quota: the VPN alarm clears
    report = {(s.scope, s.name): s for s in (await read_usage(broker.redis)).scopes}
    assert ("queue", "s") not in report
    assert not report[("vpn", "red")].raised and report[("vpn", "red")].clears == 1
    assert await broker.publish(to_queue("r", 6)) is Outcome.OK


async def test_mqtt5_publish_refused_with_quota_exceeded(broker: Broker) -> None:
    await apply_limits(broker.redis, SpoolLimits(broker_bytes=1))
    await broker.declare_queue(QueueConfig(name="q"), [("t/#", "mqtt")])
    listener = await start_mqtt(broker, Settings(mqtt_port=0, host="127.0.0.1"))
    assert listener is not None

    def scenario() -> list[int]:
        codes: list[int] = []
        acked = threading.Event()
        connected = threading.Event()
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id="quota", protocol=paho.MQTTv5)
        c.on_connect = lambda *_: connected.set()

        def on_publish(_c, _u, _mid, reason, _props) -> None:
            codes.append(int(getattr(reason, "value", reason)))
            acked.set()

        c.on_publish = on_publish
        c.connect("127.0.0.1", listener.port, keepalive=30)
        c.loop_start()
        try:
            assert connected.wait(5)
            c.publish("t/x", b"too much", qos=1)
            assert acked.wait(5), "no PUBACK"
        finally:
            c.disconnect()
            c.loop_stop()
        return codes

    try:
        assert await asyncio.to_thread(scenario) == [0x97]
    finally:
        await listener.close()
    assert (await broker.queues.info("q")).messages == 0


def test_settings_from_env_and_file(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(
        "[server]\nspool_quota_bytes = 1000\nvpn_spool_quotas = { red = 10, blue = 0 }\n"
    )
    s = load_settings(env={}, config_path=str(path))
    assert s.spool_quota_bytes == 1000 and s.vpn_spool_quotas == {"red": 10, "blue": 0}
    s = load_settings(
        env={"GATEWAY_VPN_SPOOL_QUOTAS": "red=5, green=7", "GATEWAY_SPOOL_QUOTA_BYTES": "9"},
        config_path=str(path),
    )
    assert s.vpn_spool_quotas == {"red": 5, "green": 7} and s.spool_quota_bytes == 9
    limits = SpoolLimits.from_settings(s)
    assert (limits.broker_bytes, limits.set_percent, limits.clear_percent) == (9, 80, 60)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GATEWAY_SPOOL_QUOTA_BYTES": "-1"}, "spool_quota_bytes"),
        ({"GATEWAY_VPN_SPOOL_QUOTAS": "red"}, "name=bytes"),
        ({"GATEWAY_VPN_SPOOL_QUOTAS": "red=lots"}, "integer"),
        ({"GATEWAY_VPN_SPOOL_QUOTAS": "a b=1"}, "VPN name"),
        ({"GATEWAY_VPN_SPOOL_QUOTAS": "red=-5"}, "0 or more"),
        ({"GATEWAY_SPOOL_THRESHOLD_CLEAR_PERCENT": "90"}, "spool thresholds"),
        ({"GATEWAY_SPOOL_THRESHOLD_SET_PERCENT": "101"}, "spool thresholds"),
    ],
)
def test_bad_spool_settings(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(env=env)


async def test_admin_api_shows_spool_usage(broker: Broker) -> None:
    await apply_limits(broker.redis, SpoolLimits(broker_bytes=4 * BLOB, vpn_bytes={"red": 0}))
    await broker.declare_queue(QueueConfig(name="q"))
    for i in range(3):  # 75%: below the set threshold
        assert await broker.publish(to_queue("q", i)) is Outcome.OK
    server = HttpServer(AdminApi(broker))
    port = await server.start("127.0.0.1", 0)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get() -> dict:
        with opener.open(f"http://127.0.0.1:{port}/api/v1/spool", timeout=5) as reply:
            return json.loads(reply.read())

    try:
        body = await asyncio.to_thread(get)
        assert await broker.publish(to_queue("q", 3)) is Outcome.OK  # 100%: raised
        raised = await asyncio.to_thread(get)
    finally:
        await server.close()
    assert body["threshold_set_percent"] == 80 and body["threshold_clear_percent"] == 60
    assert body["broker"] == {
        "bytes": 3 * BLOB,
        "quota": 4 * BLOB,
        "threshold_raised": False,
        "threshold_events": {"set": 0, "clear": 0},
    }
    assert {v["name"]: v["bytes"] for v in body["vpns"]} == {"default": 3 * BLOB, "red": 0}
    assert raised["broker"]["threshold_raised"] is True
    assert raised["broker"]["threshold_events"] == {"set": 1, "clear": 0}


@pytest.mark.parametrize("kind", ["plain", "stream reader", "shared groups"])
async def test_settling_again_counts_each_entry_once(broker: Broker, kind: str) -> None:
    """A settlement batch whose entries were partly settled before (a retried round) takes
    off the bytes of only the others: gw_settle then reads each entry's own size, on the
    one-XACK path, the per-entry path of a queue with stream readers and that of shared
    message groups."""
    await broker.declare_queue(
        QueueConfig(name="q", message_groups="shared" if kind == "shared groups" else "")
    )
    if kind == "stream reader":
        await broker.redis.hset(keys.queue_readers("q"), "spark", "0-0")
    for n, size in enumerate((10, 2000, 300, 40)):
        message = Message(destination="q", to_queue=True, payload=b"x" * size, id=f"m{n}")
        assert await broker.publish(message) is Outcome.OK
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=10)
    await wait_for(lambda: len(got) == 4)
    assert len({d.size for d in got}) == 4
    for d in got[::2]:
        flow.ack(d.entry_id)

    async def acked(n: int) -> bool:
        return (await broker.queues.info("q")).counters.get("acked") == n

    await eventually(lambda: acked(2))
    sizes = [d.size for d in got]
    group = ["q", flow.id, 4, sum(sizes), struct.pack("<4I", *sizes)]
    settled = await broker.redis.fcall("gw_settle", 0, "ack", *group, *(d.entry_id for d in got))
    assert settled == 2
    info = await broker.queues.info("q")
    assert (info.messages, info.spooled_bytes, info.counters["acked"]) == (0, 0, 4)
    assert await consistent(broker) == 0


async def test_one_settlement_of_more_ids_than_lua_can_unpack(broker: Broker) -> None:
    """A flow with a window wider than Lua's unpack limit (~8,000 values) requeues, then acks,
    everything in one turn: gw_settle hands the ids to XCLAIM, XACK and XDEL in several
    calls."""
    await broker.declare_queue(QueueConfig(name="wide"))
    total = 9_000
    outcomes = await asyncio.gather(
        *(broker.publish_nowait(to_queue("wide", n)) for n in range(total))
    )
    assert set(outcomes) == {Outcome.OK}
    got: list[Delivery] = []
    flow = await broker.bind("wide", got.append, window=total)
    await wait_for(lambda: len(got) == total, timeout=20)
    for d in got:
        flow.requeue(d.entry_id)
    await wait_for(lambda: len(got) == 2 * total, timeout=20)
    again = got[total:]
    assert all(d.redelivered for d in again)
    assert {d.message.id for d in again} == {d.message.id for d in got[:total]}
    for d in again:
        flow.ack(d.entry_id)

    async def drained() -> bool:
        return (await broker.queues.info("wide")).counters.get("acked") == total

    await eventually(drained, timeout=20)
    info = await broker.queues.info("wide")
    assert (info.messages, info.spooled_bytes) == (0, 0)
    assert await broker.redis.xlen(keys.queue_stream("wide")) == 0
    assert await consistent(broker) == 0


@pytest.mark.parametrize(
    "config",
    [{"partition_count": 4}, {"priorities": True}],
    ids=["partitioned", "priority"],
)
async def test_a_family_queues_alarm_is_its_own_on_the_whole_usage(
    broker: Broker, config: dict
) -> None:
    """A partitioned or priority queue's max_spool_bytes bounds the whole queue, and so
    does its alarm: it was kept per hidden partition or level, on that one's share (a full
    partitioned queue raised none), under the hidden name (shown to every admin user)."""
    blob = len(encode(to_queue("fam", 0, partition_key="k0")))
    await broker.declare_queue(QueueConfig(name="fam", max_spool_bytes=10 * blob, **config))
    for i in range(10):
        assert await broker.publish(to_queue("fam", i, partition_key=f"k{i}")) is Outcome.OK
    queues = [s for s in (await read_usage(broker.redis)).scopes if s.scope == "queue"]
    assert [(s.name, s.bytes, s.raised) for s in queues] == [("fam", 10 * blob, True)]
    await broker.update_queue("fam", {"max_spool_bytes": 100 * blob})
    queues = [s for s in (await read_usage(broker.redis)).scopes if s.scope == "queue"]
    assert [(s.name, s.raised, s.clears) for s in queues] == [("fam", False, 1)]
