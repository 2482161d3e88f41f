"""A Redis that refuses writes for a while, against a real redis-server made a replica of
an address nobody serves (as in a failover; a full disk or a start's loading refuses the
same way): settlements are sent again once it takes writes, an MQTT client that connects
meanwhile is told the server is unavailable, and nothing of it is an error in the log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis
from proton import Disposition
from proton import Message as AmqpMessage
from proton.utils import BlockingConnection, LinkDetached
from redis.exceptions import ReadOnlyError, ResponseError

from gateway.broker import Broker, Flow
from gateway.engine import keys, library
from gateway.engine.flows import FETCH_RETRY
from gateway.engine.ordered_calls import refused_for_now
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message, Outcome
from protocols.amqp.listener import Listener as AmqpListener
from protocols.mqtt.listener import Listener as MqttListener
from tests.test_admin_api import Admin
from tests.test_amqp_clients import TIMEOUT, send_outcome, url
from tests.test_engine import to_queue, wait_for
from tests.test_mqtt_paho import V5, V311, Client
from tests.test_spool_quota import eventually

ReadOnly = Callable[[bool], Awaitable[None]]


@pytest.fixture
async def read_only(redis_url: str) -> AsyncIterator[ReadOnly]:
    """read_only(True) makes Redis a replica (writes refused: READONLY), False a primary
    again, with its data; it is a primary again after the test."""
    client = aioredis.Redis.from_url(redis_url)

    async def switch(on: bool) -> None:
        if on:
            await client.execute_command("REPLICAOF", "127.0.0.1", "1")  # nobody there
        else:
            await client.execute_command("REPLICAOF", "NO", "ONE")

    yield switch
    await switch(False)
    await client.aclose()


def test_what_counts_as_refused_for_now() -> None:
    assert refused_for_now(ReadOnlyError("You can't write against a read only replica."))
    assert refused_for_now(ResponseError("MISCONF Errors writing to the AOF file: No space"))
    assert refused_for_now(ResponseError("BUSY Redis is busy running a script."))
    assert not refused_for_now(ResponseError("ERR user_script:1: Script attempted to access"))
    assert not refused_for_now(ConnectionError("Connection closed by server."))


async def three_delivered(broker: Broker, queue: str) -> tuple[Flow, list[Delivery]]:
    """A new queue with three messages, all delivered to a flow and not yet settled."""
    await broker.queues.create(QueueConfig(name=queue))
    for i in range(3):
        message = Message(destination=queue, to_queue=True, payload=b"%d" % i)
        assert await broker.publish(message) is Outcome.OK
    got: list[Delivery] = []
    flow = await broker.bind(queue, got.append)
    await wait_for(lambda: len(got) == 3)
    return flow, got


async def test_settlements_refused_for_now_are_sent_again(
    broker: Broker, read_only: ReadOnly, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.engine.flows")
    flow, got = await three_delivered(broker, "q")
    admin = aioredis.Redis.from_url(redis_url)
    try:
        await read_only(True)
        for d in got:
            flow.ack(d.entry_id)
        await asyncio.sleep(FETCH_RETRY * 1.5)  # refused, and refused again
        assert await admin.xlen(keys.queue_stream("q")) == 3
        # the log says why (redis-py's own message for a failed pipeline command would not)
        await wait_for(lambda: "heartbeat failed: You can't write against" in caplog.text)
        await read_only(False)

        async def settled() -> bool:
            return await admin.xlen(keys.queue_stream("q")) == 0

        await eventually(settled)
        assert (await broker.queues.info("q")).messages == 0
        await wait_for(lambda: "Redis takes fetches, settlements and unbinds again" in caplog.text)
        assert caplog.text.count("Redis refuses fetches, settlements and unbinds for now") == 1
    finally:
        await admin.aclose()


async def test_an_unbind_refused_for_now_releases_the_flows_entries_later(
    broker: Broker, read_only: ReadOnly
) -> None:
    """The caller goes on (the unbind is the dispatcher's to finish); the flow's unsettled
    entries go back to the queue once Redis takes writes, not when the node stops."""
    flow, _ = await three_delivered(broker, "u")
    await read_only(True)
    await flow.close()
    assert flow.id in (await broker.queues.info("u")).flows  # its entries still its own
    await read_only(False)
    again: list[Delivery] = []
    await broker.bind("u", again.append)
    await wait_for(lambda: len(again) == 3)
    assert sorted(d.message.payload for d in again) == [b"0", b"1", b"2"]
    assert all(d.redelivered for d in again)


async def test_a_selecting_flow_refused_for_now_asks_again(
    broker: Broker, read_only: ReadOnly, caplog: pytest.LogCaptureFixture
) -> None:
    """A flow with a selector peeks and takes with calls of its own: Redis refusing them is
    the one line of the other refusals, not an error, and the flow gets the messages its
    selector matches once Redis takes writes again."""
    caplog.set_level(logging.INFO, logger="gateway.engine.flows")
    await broker.queues.create(QueueConfig(name="sel"))
    for i in range(3):
        message = Message(
            destination="sel", to_queue=True, payload=b"%d" % i, user_properties=[("n", i)]
        )
        assert await broker.publish(message) is Outcome.OK
    got: list[Delivery] = []
    flow = await broker.bind("sel", got.append, credit=0, selector="n >= 1")
    await read_only(True)
    flow.set_credit(10)
    await wait_for(lambda: "Redis refuses fetches, settlements and unbinds for now" in caplog.text)
    await read_only(False)
    await wait_for(lambda: len(got) == 2)
    assert sorted(d.message.payload for d in got) == [b"1", b"2"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_route_reload_redis_does_not_answer_is_tried_again(
    broker: Broker, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another node subscribes a queue while Redis refuses this node's calls (an ACL here,
    so that only this node is refused): this node's routes follow once Redis answers."""
    admin = aioredis.Redis.from_url(redis_url)
    await admin.execute_command("ACL", "SETUSER", "other", "on", ">pw", "+@all", "~*", "&*")
    other_client = await library.connect(redis_url.replace("redis://", "redis://other:pw@"))
    other = Broker(other_client, heartbeat=0.2, node_ttl=1.0)
    await other.start()
    try:
        await admin.execute_command("ACL", "SETUSER", "default", "-fcall")
        await other.declare_queue(QueueConfig(name="late"), [("late/#", "mqtt")])
        await wait_for(lambda: "reloading the routes failed" in caplog.text)
        assert broker.router.match("late/x") == frozenset()
        await admin.execute_command("ACL", "SETUSER", "default", "+fcall")
        await wait_for(lambda: broker.router.match("late/x") == {"late"})
    finally:
        await admin.execute_command("ACL", "SETUSER", "default", "+@all")
        await other.stop()
        await other_client.aclose()
        await admin.execute_command("ACL", "DELUSER", "other")
        await admin.aclose()


@pytest.mark.parametrize("version", [V311, V5], ids=["v311", "v5"])
async def test_mqtt_connect_while_redis_refuses_writes_is_server_unavailable(
    broker: Broker, mqtt: MqttListener, read_only: ReadOnly, version: int
) -> None:
    await read_only(True)
    refused = await asyncio.to_thread(Client, mqtt.port, version, "later")
    try:
        # 0x88 Server unavailable (paho reports 3.1.1's return code 3 as the same)
        assert int(getattr(refused.reason, "value", refused.reason)) == 0x88
    finally:
        refused.close()
    await read_only(False)
    accepted = await asyncio.to_thread(Client, mqtt.port, version, "later")
    try:
        assert accepted.accepted
    finally:
        accepted.close()


async def test_mqtt_disconnect_while_redis_refuses_writes_is_logged_not_raised(
    broker: Broker, mqtt: MqttListener, read_only: ReadOnly, caplog: pytest.LogCaptureFixture
) -> None:
    client = await asyncio.to_thread(Client, mqtt.port, V311, "leaving")
    await read_only(True)
    await asyncio.to_thread(client.close)
    await wait_for(lambda: "'leaving': ending its connection in Redis failed" in caplog.text)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_amqp_while_redis_refuses_writes(
    broker: Broker, amqp: AmqpListener, read_only: ReadOnly, caplog: pytest.LogCaptureFixture
) -> None:
    """A transfer is released (the client may send it again); a receiver's attach is
    refused with Redis's reason; neither is an error in the log."""
    await broker.queues.create(QueueConfig(name="dq"))
    await read_only(True)

    def run() -> tuple[object, str]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            outcome = send_outcome(conn, conn.create_sender("dq"), AmqpMessage(body=b"x"))
            with pytest.raises(LinkDetached) as refused:
                conn.create_receiver("dq")
            return outcome, str(refused.value)
        finally:
            conn.close()

    outcome, refusal = await asyncio.to_thread(run)
    assert outcome == (Disposition.RELEASED, None)
    assert "amqp:internal-error" in refusal and "read only replica" in refusal
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_temporary_queues_redis_refused_to_delete_go_later(
    broker: Broker,
    mqtt: MqttListener,
    amqp: AmqpListener,
    read_only: ReadOnly,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A non-persistent MQTT session's queue and an AMQP dynamic node, ended while Redis
    refuses writes, are deleted once it takes them again (else they would gather their
    topics' messages until the node stops)."""
    caplog.set_level(logging.INFO, logger="gateway.broker")
    client = await asyncio.to_thread(Client, mqtt.port, V311, "brief")
    await asyncio.to_thread(client.subscribe, "brief/#", 1)
    state = mqtt.registry.sessions["brief"].state
    assert state is not None and state.queue is not None
    mqtt_queue = state.queue

    def attach_dynamic() -> tuple[BlockingConnection, str]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        receiver = conn.create_receiver(None, dynamic=True)
        return conn, receiver.link.remote_source.address

    conn, amqp_queue = await asyncio.to_thread(attach_dynamic)
    await read_only(True)
    await asyncio.to_thread(client.close)
    await asyncio.to_thread(conn.close)
    await wait_for(lambda: "deleting temporary queues is tried again" in caplog.text)
    assert await broker.queues.exists(mqtt_queue) and await broker.queues.exists(amqp_queue)
    await read_only(False)

    async def both_gone() -> bool:
        return not (
            await broker.queues.exists(mqtt_queue) or await broker.queues.exists(amqp_queue)
        )

    await eventually(both_gone)
    await wait_for(
        lambda: "temporary queues Redis had refused to delete are deleted" in caplog.text
    )
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_a_node_stops_cleanly_while_redis_refuses_writes(
    redis_url: str, read_only: ReadOnly, caplog: pytest.LogCaptureFixture
) -> None:
    """A node stopping (SIGTERM) while Redis refuses writes cannot say so in Redis: it says
    so in its log and stops all the same (its pub/sub connection too); other nodes take
    over after its TTL."""
    client = await library.connect(redis_url)
    node = Broker(client, heartbeat=0.2, node_ttl=1.0)
    await node.start()
    await read_only(True)
    caplog.set_level(logging.WARNING, logger="gateway.broker")
    await asyncio.wait_for(node.stop(), 10)
    await client.aclose()
    assert any("stops" in r.getMessage() for r in caplog.records)
    assert node.events._task is not None and node.events._task.done()


async def test_a_standby_whose_rebind_was_refused_binds_again(
    broker: Broker, read_only: ReadOnly
) -> None:
    """An exclusive queue's standby is taken for lost while Redis refuses writes (a
    failover): its rebind, refused for now, is tried again, and the standby takes over
    once the holder goes."""
    await broker.queues.create(QueueConfig(name="x", access_type="exclusive"))
    got_h: list[Delivery] = []
    holder = await broker.bind("x", got_h.append, window=10)
    got_s: list[Delivery] = []
    standby = await broker.bind("x", got_s.append, window=10)
    await asyncio.sleep(0.3)
    assert holder.active and not standby.active
    await read_only(True)
    broker.dispatcher._lost(standby, "test: released while presumed dead")
    await asyncio.sleep(0.3)  # the rebind is refused (READONLY)
    await read_only(False)
    await asyncio.sleep(1.0)  # several beats: lease checks of the standby queue
    await holder.close()
    assert await broker.publish(to_queue("x", b"m")) is Outcome.OK
    await wait_for(lambda: len(got_s) == 1, timeout=5)


async def test_admin_requests_redis_refuses_for_now_are_503_told_on_one_line(
    admin: Admin, broker: Broker, read_only: ReadOnly, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica during a failover refuses writes (READONLY), a state that passes as the
    engine and both protocols take it: the admin API answered 500 "internal error", with
    a traceback for each request."""
    assert (await admin.create("q1")).status == 201
    await read_only(True)
    replies = [
        await admin.create("q2"),
        await admin.publish("q1", "x"),
        await admin.request("DELETE", "/api/v1/queues/q1"),
    ]
    for reply in replies:
        assert reply.status == 503 and "Redis refuses for now" in reply.error, reply
    assert not [r for r in caplog.records if r.exc_info is not None]


@contextlib.asynccontextmanager
async def busy_redis(redis_url: str) -> AsyncIterator[None]:
    """Redis runs a script that loops (every other client is answered BUSY) until the
    block ends, when SCRIPT KILL stops it."""
    looper, killer = aioredis.Redis.from_url(redis_url), aioredis.Redis.from_url(redis_url)
    await killer.config_set("busy-reply-threshold", 20)  # ms
    loop = asyncio.create_task(looper.eval("while true do end", 0))
    await asyncio.sleep(0.3)
    try:
        yield
    finally:
        for _ in range(50):
            try:
                await killer.script_kill()
                break
            except ResponseError:  # NOTBUSY: not running yet
                await asyncio.sleep(0.05)
        with contextlib.suppress(ResponseError):
            await loop
        await killer.config_set("busy-reply-threshold", 5000)
        await looper.aclose()
        await killer.aclose()


async def test_an_admin_read_while_redis_runs_a_long_script_is_a_503(
    admin: Admin, broker: Broker, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A queue's page reads it in a pipeline, and redis-py rewrites the error a pipeline
    raises to a template without Redis's text: the BUSY refusal was taken for a fault, a
    500 with a traceback, while a publish (no pipeline) answered 503."""
    assert (await admin.create("q1")).status == 201
    async with busy_redis(redis_url):
        replies = [await admin.publish("q1", "x"), await admin.get("/api/v1/queues/q1")]
    for reply in replies:
        assert reply.status == 503 and "BUSY" in reply.error, reply
    assert not [r for r in caplog.records if r.exc_info is not None]


async def test_admin_reads_go_on_while_redis_refuses_writes(
    admin: Admin, broker: Broker, read_only: ReadOnly
) -> None:
    """A replica runs the functions that only read (flagged no-writes): a partitioned
    queue's page, the list holding one, /metrics and the spool report answered 503,
    though a plain queue's page was 200."""
    await broker.queues.create(QueueConfig(name="plain"))
    await broker.queues.create(QueueConfig(name="part", partition_count=2))
    await read_only(True)
    for path in ("/api/v1/queues/part", "/api/v1/queues", "/metrics", "/api/v1/spool"):
        reply = await admin.get(path)
        assert reply.status == 200, (path, reply)
    assert [row["name"] for row in (await admin.get("/api/v1/queues")).body] == ["part", "plain"]
