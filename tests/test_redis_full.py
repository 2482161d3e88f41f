"""A Redis over its maxmemory, against a real redis-server (maxmemory set at run time) and
real clients: new messages are refused whole and their publishers NACKed, while consumers
connect, fetch and settle, so they drain it, and nodes keep their heartbeats and start.
An evicting Redis is refused outright: it would delete stored messages."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from proton import Disposition
from proton import Message as AmqpMessage
from proton.utils import BlockingConnection

from gateway.admin.metrics import render_metrics
from gateway.broker import Broker
from gateway.engine import keys, library
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message, Outcome
from protocols.amqp.listener import Listener as AmqpListener
from protocols.mqtt.listener import Listener as MqttListener
from tests.processes import Proc, serve_argv
from tests.test_amqp_clients import TIMEOUT, send_outcome, url
from tests.test_engine import retained_matching, wait_for
from tests.test_mqtt_paho import V5, V311, Client
from tests.test_spool_quota import eventually


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A plain client for CONFIG; the limits go back to none after the test."""
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.config_set("maxmemory", 0)
    await client.config_set("maxmemory-policy", "noeviction")
    await client.aclose()


async def fill(admin: aioredis.Redis) -> None:
    """Redis over its maxmemory from now on, whatever it holds."""
    await admin.config_set("maxmemory", 1)


def to_queue(name: str, body: bytes) -> Message:
    return Message(destination=name, to_queue=True, payload=body)


async def test_publishes_are_refused_whole_and_consumers_drain(
    broker: Broker, admin: aioredis.Redis
) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    for i in range(3):
        assert await broker.publish(to_queue("q", b"%d" % i)) is Outcome.OK
    await admin.fcall("gw_reader_at", 0, "q", "job", "0-0", 1)  # as a Spark reader does
    await fill(admin)
    refused = await asyncio.gather(*(broker.publish_nowait(to_queue("q", b"x")) for _ in range(5)))
    assert refused == [Outcome.OUT_OF_MEMORY] * 5
    assert broker.spooler.redis_full
    assert await admin.xlen(keys.queue_stream("q")) == 3  # nothing of the refused batch
    assert (await broker.queues.info("q")).messages == 3
    assert await broker.queues.forget_reader("q", "job") == 1  # it would hold settled entries

    got: list[Delivery] = []
    flow = await broker.bind("q", got.append)
    await wait_for(lambda: len(got) == 3)
    assert [d.message.payload for d in got] == [b"0", b"1", b"2"]
    for d in got:
        flow.ack(d.entry_id)
    await eventually(lambda: stream_is_empty(admin, "q"))
    await broker.liveness.beat()  # the heartbeat still runs: the node is not presumed dead

    metrics = await render_metrics(broker)
    assert "gateway_refused_out_of_memory 5" in metrics.replace(f'{{node="{broker.node_id}"}}', "")
    assert "gateway_redis_maxmemory_bytes 1\n" in metrics
    used = int(metrics.split("\ngateway_redis_used_memory_bytes ")[1].split()[0])
    assert used > 1_000_000  # an empty Redis uses about a megabyte

    await admin.config_set("maxmemory", 0)
    assert await broker.publish(to_queue("q", b"again")) is Outcome.OK
    assert not broker.spooler.redis_full
    await wait_for(lambda: len(got) == 4)


async def test_a_retained_message_no_queue_takes_is_refused_when_full(
    broker: Broker, admin: aioredis.Redis
) -> None:
    def retained(body: bytes) -> Message:
        return Message(destination="full/r", payload=body, retain=True)

    assert await broker.publish(retained(b"old")) is Outcome.NO_SUBSCRIBERS
    await fill(admin)
    assert await broker.publish(retained(b"new")) is Outcome.OUT_OF_MEMORY
    assert [m.payload for m in await retained_matching(broker, "full/r")] == [b"old"]
    assert broker.spooler.refused == {"out_of_memory": 1}
    assert await broker.publish(retained(b"")) is Outcome.NO_SUBSCRIBERS  # clearing frees memory
    assert await retained_matching(broker, "full/r") == []


async def test_a_queued_message_is_retained_on_a_full_redis(
    broker: Broker, admin: aioredis.Redis
) -> None:
    """The spool and the retain are two calls: Redis may fill up between them. A message its
    queues took keeps its retained copy; one no queue took is refused."""
    await fill(admin)
    assert await broker.retained.put(Message(destination="full/q", payload=b"q", retain=True), True)
    assert not await broker.retained.put(Message(destination="full/n", payload=b"n", retain=True))
    assert [m.payload for m in await retained_matching(broker, "full/#")] == [b"q"]


async def test_a_node_starts_on_a_full_redis(redis_url: str, admin: aioredis.Redis) -> None:
    first = await library.connect(redis_url)  # loads the function library
    await first.aclose()
    await fill(admin)
    client = await library.connect(redis_url)
    node = Broker(client, heartbeat=0.2, node_ttl=1.0)
    try:
        await node.start()
        await node.queues.create(QueueConfig(name="later"))
        assert await node.publish(to_queue("later", b"x")) is Outcome.OUT_OF_MEMORY
    finally:
        await node.stop()
        await client.aclose()


async def test_gateway_serve_starts_on_a_full_redis(
    tmp_path: Path, redis_url: str, admin: aioredis.Redis
) -> None:
    client = await library.connect(redis_url)  # the library is loaded, as after any node ran
    await client.aclose()
    await fill(admin)
    gw = await Proc.start(serve_argv(tmp_path / "unused", "--redis-url", redis_url))
    try:
        await gw.wait_event("ready")
    finally:
        assert await gw.stop() == 0, gw.stderr_tail()


async def test_an_evicting_redis_is_refused(redis_url: str, admin: aioredis.Redis) -> None:
    await admin.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(library.RedisUnsuitable, match="maxmemory-policy allkeys-lru"):
        await library.connect(redis_url)


async def test_a_redis_without_an_aof_is_warned_of(
    redis_url: str, admin: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis with appendonly no (Debian's default config) lost every acked message when
    it restarted, and the node started on it without a word (found by a review)."""
    caplog.set_level(logging.WARNING, logger="gateway.engine.library")
    await (await library.connect(redis_url)).aclose()
    assert "keeps no AOF" not in caplog.text
    await admin.config_set("appendonly", "no")
    try:
        await (await library.connect(redis_url)).aclose()
    finally:
        await admin.config_set("appendonly", "yes")  # the session's Redis, for later tests
    assert "keeps no AOF (appendonly no)" in caplog.text


async def test_only_storing_messages_is_refused_when_full(redis_url: str) -> None:
    client = await library.connect(redis_url)
    try:
        reply = await client.execute_command("FUNCTION", "LIST", "LIBRARYNAME", library.LIBRARY)
    finally:
        await client.aclose()
    flags = {}
    for function in dict(zip(reply[0][::2], reply[0][1::2], strict=True))[b"functions"]:
        fields = dict(zip(function[::2], function[1::2], strict=True))
        flags[fields[b"name"].decode()] = {f.decode() for f in fields[b"flags"]}
    assert flags.pop("gw_spool") == set()
    assert flags.pop("gw_spool_marked") == set()  # an MQTT QoS 2 publish
    assert flags.pop("gw_retain_new") == set()  # a retained message no queue took: new data
    for reading in ("gw_node_alive", "gw_partitions", "gw_spool_report"):  # only read
        assert flags.pop(reading) == {"allow-oom", "no-writes"}, reading
    assert flags and all(f == {"allow-oom"} for f in flags.values()), flags


async def test_mqtt_publisher_nacked_and_persistent_subscriber_drains(
    broker: Broker, mqtt: MqttListener, admin: aioredis.Redis
) -> None:
    port = mqtt.port

    def publish_v5(payload: bytes, topic: str = "full/a", retain: bool = False) -> list[int]:
        """The PUBACK reason codes of a publish and then of a second one: the connection
        stays open after a refusal."""
        codes: list[int] = []
        pub = Client(port, V5, "loud")
        pub.c.on_publish = lambda _c, _u, _mid, reason, _p: codes.append(int(reason.value))
        try:
            for _ in range(2):
                assert pub.publish(topic, payload, 1, retain=retain).is_published()
        finally:
            pub.close()
        return codes

    def keeper(subscribe: bool) -> list[bytes]:
        """A persistent session: subscribes, or comes back for what was kept for it."""
        sub = Client(port, V311, "keeper", clean=False)
        try:
            if subscribe:
                assert [int(getattr(c, "value", c)) for c in sub.subscribe("full/#", 1)] == [1]
                return []
            return [m.payload for m in sub.receive(6)]
        finally:
            sub.close()

    def glance() -> list[int]:
        """A clean session subscribing at QoS 0: a direct subscriber."""
        sub = Client(port, V311, "glance")
        try:
            return [int(getattr(c, "value", c)) for c in sub.subscribe("full/#", 0)]
        finally:
            sub.close()

    await asyncio.to_thread(keeper, True)
    for i in range(3):
        assert await asyncio.to_thread(publish_v5, b"m%d" % i) == [0, 0]
    await fill(admin)
    assert await asyncio.to_thread(publish_v5, b"refused") == [0x97, 0x97]  # quota exceeded
    # retained on a topic no queue takes: refused as new data, not the connection's end
    assert await asyncio.to_thread(publish_v5, b"r", "lonely/t", True) == [0x97, 0x97]
    assert await asyncio.to_thread(glance) == [0]
    assert sorted(await asyncio.to_thread(keeper, False)) == sorted([b"m0", b"m1", b"m2"] * 2)


async def test_amqp_sender_rejected_with_resource_limit(
    broker: Broker, amqp: AmqpListener, admin: aioredis.Redis
) -> None:
    await broker.queues.create(QueueConfig(name="dq"))
    conn = await asyncio.to_thread(BlockingConnection, url(amqp), timeout=TIMEOUT)
    try:
        snd = await asyncio.to_thread(conn.create_sender, "dq")
        before = await asyncio.to_thread(send_outcome, conn, snd, AmqpMessage(body=b"kept"))
        await fill(admin)
        after = await asyncio.to_thread(send_outcome, conn, snd, AmqpMessage(body=b"refused"))
    finally:
        await asyncio.to_thread(conn.close)
    assert before == (Disposition.ACCEPTED, None)
    assert after == (Disposition.REJECTED, "amqp:resource-limit-exceeded")
    assert (await broker.queues.info("dq")).messages == 1


async def stream_is_empty(admin: aioredis.Redis, queue: str) -> bool:
    return await admin.xlen(keys.queue_stream(queue)) == 0
