"""Wills and sessions of clients whose node crashed. A surviving node publishes their wills
(MQTT 5 §3.1.3.2.2: a will goes when the network connection closes without DISCONNECT 0x00,
after its delay, unless a connection to the session came first), and their sessions expire
their expiry after the crash."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from gateway.broker import Broker
from gateway.engine import keys
from protocols.listening import Listener
from protocols.mqtt.codec import (
    Disconnect,
    Properties,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Will,
)
from tests.processes import GATEWAY, Proc, node_env
from tests.test_mqtt_nodes import KEEP, serve
from tests.test_mqtt_protocol import Raw


@asynccontextmanager
async def node(redis_url: str, ttl: float = 1.0) -> AsyncIterator[tuple[Proc, int]]:
    """A `gateway serve` node with node TTL `ttl` the test kills or stops (SIGSTOP)."""
    argv = [*GATEWAY, "serve", "--redis-url", redis_url, "--mqtt-port", "0", "--admin-port",
            "0", "--amqp-port", "0"]  # fmt: skip
    proc = await Proc.start(argv, node_env(ttl))
    try:
        yield proc, (await proc.wait_event("ready", timeout=30))["mqtt_port"]
    finally:
        if proc.proc.returncode is None:
            os.kill(proc.proc.pid, signal.SIGCONT)
        proc.kill()
        await proc.proc.wait()


@asynccontextmanager
async def two_nodes(redis_url: str, ttl: float = 1.0) -> AsyncIterator[tuple[Proc, int, int]]:
    """A node the test kills or stops (node TTL `ttl`) and another that survives it on the
    same Redis: the first, its MQTT port and the survivor's."""
    async with node(redis_url, ttl) as (first, port), serve("--redis-url", redis_url) as (_, other):
        yield first, port, other


async def nothing_more(watcher: Raw, seconds: float) -> None:
    with pytest.raises(TimeoutError):
        got = await watcher.recv(timeout=seconds)
        pytest.fail(f"published: {got}")


async def watch(port: int, topic_filter: str) -> Raw:
    watcher, _ = await Raw.connected(port, 5, client_id="watcher")
    await watcher.send(Subscribe(1, [(topic_filter, SubscriptionOptions(qos=1))]))
    assert await watcher.recv() == Suback(1, [1])
    return watcher


async def crash(proc: Proc) -> float:
    proc.kill()
    await proc.proc.wait()
    return asyncio.get_running_loop().time()


async def test_the_will_of_a_client_on_a_crashed_node_is_published_by_a_survivor(
    redis_url: str,
) -> None:
    async with two_nodes(redis_url) as (node, port, other_port):
        watcher = await watch(other_port, "status/#")
        will = Will("status/dev1", b"offline", qos=1, retain=True)
        await Raw.connected(port, 4, client_id="dev1", will=will)
        crashed = await crash(node)
        got = await watcher.recv(timeout=10)
        took = asyncio.get_running_loop().time() - crashed
        assert isinstance(got, Publish)
        assert (got.topic, got.payload, got.qos) == ("status/dev1", b"offline", 1)
        assert took < 5, f"published {took:.1f} s after the crash (node TTL 1 s)"
        late, _ = await Raw.connected(other_port, 4, client_id="late")  # it was retained
        await late.send(Subscribe(1, [("status/#", SubscriptionOptions(qos=1))]))
        assert await late.recv() == Suback(1, [1])
        kept = await late.recv()
        assert isinstance(kept, Publish) and (kept.payload, kept.retain) == (b"offline", True)
        await nothing_more(watcher, 2)  # once, not again after the take's lease
        watcher.close()
        late.close()


async def test_a_will_dropped_by_disconnect_is_not_published_when_its_node_crashes_later(
    redis_url: str,
) -> None:
    async with two_nodes(redis_url) as (node, port, other_port):
        watcher = await watch(other_port, "gone/#")
        polite, _ = await Raw.connected(port, 4, client_id="polite", will=Will("gone/p", b"x"))
        await polite.send(Disconnect())
        await polite.closed()
        await asyncio.sleep(0.3)  # its node drops the will in Redis
        await crash(node)
        await nothing_more(watcher, 4)
        watcher.close()


async def test_a_delayed_will_of_a_crashed_node_waits_its_delay_and_a_resume_cancels_it(
    redis_url: str,
) -> None:
    async with two_nodes(redis_url) as (node, port, other_port):
        watcher = await watch(other_port, "late/#")
        delayed = Properties(will_delay_interval=4)
        for client_id in ("resumes", "stays-away"):
            will = Will(f"late/{client_id}", b"bye", 1, properties=delayed)
            await Raw.connected(port, 5, client_id=client_id, properties=KEEP, will=will)
        crashed = await crash(node)
        back, ack = await Raw.connected(
            other_port, 5, client_id="resumes", clean_start=False, properties=KEEP
        )
        assert ack.session_present
        await nothing_more(watcher, 2.5)  # nothing before the delay ends
        got = await watcher.recv(timeout=6)
        took = asyncio.get_running_loop().time() - crashed
        assert isinstance(got, Publish) and got.topic == "late/stays-away"
        assert 3.5 < took < 8, f"published {took:.1f} s after the crash (delay 4 s)"
        await nothing_more(watcher, 2)  # the resumed session's will stays unsent
        back.close()
        watcher.close()


async def test_a_will_without_delay_goes_when_its_client_is_back_before_the_crash_is_seen(
    redis_url: str,
) -> None:
    """The client reconnects to the survivor at once: its old connection still closed
    without DISCONNECT, so its will goes, as a live node's does on a takeover."""
    async with two_nodes(redis_url) as (node, port, other_port):
        watcher = await watch(other_port, "quick/#")
        await Raw.connected(port, 5, client_id="quick", properties=KEEP,
                            will=Will("quick/1", b"first connection's", 1))  # fmt: skip
        await crash(node)
        will = Will("quick/2", b"second's", 1)
        back, ack = await Raw.connected(
            other_port, 5, client_id="quick", clean_start=False, properties=KEEP, will=will
        )
        assert ack.session_present
        got = await watcher.recv(timeout=6)
        assert isinstance(got, Publish) and got.payload == b"first connection's"
        await nothing_more(watcher, 3)  # the new connection's will stays with it
        back.close()
        watcher.close()


async def test_a_will_waiting_its_delay_on_a_node_that_crashes_goes_when_it_was_due(
    redis_url: str,
) -> None:
    async with two_nodes(redis_url) as (node, port, other_port):
        watcher = await watch(other_port, "waiting/#")
        will = Will("waiting/1", b"bye", 1, properties=Properties(will_delay_interval=4))
        raw, _ = await Raw.connected(port, 5, client_id="waiting", properties=KEEP, will=will)
        raw.writer.transport.abort()
        lost = asyncio.get_running_loop().time()
        await asyncio.sleep(1)  # its node times the delay, then dies
        await crash(node)
        got = await watcher.recv(timeout=8)
        took = asyncio.get_running_loop().time() - lost
        assert isinstance(got, Publish) and got.payload == b"bye"
        assert 3.5 < took < 6.5, f"published {took:.1f} s after the connection ended (delay 4 s)"
        watcher.close()


async def test_the_session_of_a_crashed_node_expires_its_expiry_after_the_crash(
    redis_url: str,
) -> None:
    """Not a lease later: a connected session's state outlives its node by up to a minute
    only should no node reap that node."""
    async with two_nodes(redis_url) as (node, port, other_port):
        short = Properties(session_expiry_interval=2)
        await Raw.connected(port, 5, client_id="brief", properties=short)
        await crash(node)
        await asyncio.sleep(5)  # presumed dead after 1 s, reaped within the next beat
        back, ack = await Raw.connected(
            other_port, 5, client_id="brief", clean_start=False, properties=short
        )
        assert not ack.session_present
        back.close()


async def test_a_node_keeps_no_will_nor_session_index_of_its_ended_connections(
    broker: Broker, mqtt: Listener
) -> None:
    """What Redis keeps for a node's connections goes with each connection: a busy node's
    index of its sessions and wills does not grow with every client it ever had."""
    node_keys = (keys.node_sessions(broker.node_id), keys.node_parting(broker.node_id))
    for i in range(3):
        will = Will(f"bye/{i}", b"x", properties=Properties(will_delay_interval=1))
        raw, _ = await Raw.connected(mqtt.port, 5, client_id=f"c{i}", properties=KEEP, will=will)
        assert [await broker.redis.exists(k) for k in node_keys] == [1, 1]
        if i == 0:
            await raw.send(Disconnect())  # its will dropped
        elif i == 1:
            raw.writer.transport.abort()  # its will sent after its delay
        else:  # taken over by a connection that ends without a will
            again, _ = await Raw.connected(
                mqtt.port, 5, client_id=f"c{i}", properties=KEEP, clean_start=False
            )
            await again.send(Disconnect())
        names = [*node_keys, keys.client_parting(f"c{i}")]
        async with asyncio.timeout(5):
            while await broker.redis.exists(*names):
                await asyncio.sleep(0.05)


async def test_a_clean_start_on_a_survivor_sends_a_will_that_waited_on_the_crashed_node(
    redis_url: str,
) -> None:
    """The connection ended, its will waits its delay on node A; A crashes; the client
    comes back to B with a clean start, which ends the session: the will goes (§3.1.3.2.2),
    though A's liveness key has not expired yet (TTL 5 s)."""
    async with two_nodes(redis_url, ttl=5.0) as (a, port, other_port):
        watcher = await watch(other_port, "ended/#")
        will = Will("ended/1", b"bye", 1, properties=Properties(will_delay_interval=30))
        raw, _ = await Raw.connected(port, 5, client_id="ended", properties=KEEP, will=will)
        raw.writer.transport.abort()
        await asyncio.sleep(0.5)  # A times the delay, its record is due in 30 s
        await crash(a)
        back, _ = await Raw.connected(other_port, 5, client_id="ended", clean_start=True)
        got = await watcher.recv(timeout=8)  # at once, or at the latest once A is reaped
        assert isinstance(got, Publish) and got.payload == b"bye"
        back.close()
        watcher.close()


async def test_a_reconnection_after_the_delay_ended_does_not_cancel_the_will_of_a_crashed_node(
    redis_url: str,
) -> None:
    """The connection ended at t0 with a 2 s will delay; its node crashed before sending it;
    the client resumes at t0 + 3 s, before the node is presumed dead: the delay ended
    before that, so the will goes (§3.1.3.2.2)."""
    async with two_nodes(redis_url, ttl=5.0) as (a, port, other_port):
        watcher = await watch(other_port, "due/#")
        will = Will("due/1", b"bye", 1, properties=Properties(will_delay_interval=2))
        raw, _ = await Raw.connected(port, 5, client_id="due", properties=KEEP, will=will)
        raw.writer.transport.abort()
        t0 = asyncio.get_running_loop().time()
        await asyncio.sleep(0.5)  # A notes the due time in Redis
        await crash(a)
        await asyncio.sleep(t0 + 3 - asyncio.get_running_loop().time())
        back, ack = await Raw.connected(
            other_port, 5, client_id="due", clean_start=False, properties=KEEP
        )
        assert ack.session_present
        got = await watcher.recv(timeout=8)
        assert isinstance(got, Publish) and got.payload == b"bye"
        back.close()
        watcher.close()


async def test_a_will_goes_once_when_its_node_was_only_stopped(redis_url: str) -> None:
    """Node A stalls (SIGSTOP) past its TTL: B reaps it and publishes the will of a client
    still connected to A. A resumes; the client then goes without DISCONNECT: A does not
    publish the same connection's will again."""
    async with two_nodes(redis_url) as (a, port, other_port):
        watcher = await watch(other_port, "stall/#")
        raw, _ = await Raw.connected(port, 4, client_id="stall", will=Will("stall/1", b"bye", 1))
        os.kill(a.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(3)
        os.kill(a.proc.pid, signal.SIGCONT)
        await asyncio.sleep(1)
        raw.writer.transport.abort()
        wills = []
        with pytest.raises(TimeoutError):
            while True:
                got = await watcher.recv(timeout=3)
                assert isinstance(got, Publish)
                wills.append(got.payload)
        assert wills == [b"bye"], f"one connection's will published {len(wills)} times"
        watcher.close()


async def test_a_survivors_will_counts_its_delivery_delay_from_when_it_goes(
    redis_url: str,
) -> None:
    """A will with x-opt-delivery-delay: as a live node makes the message when it goes,
    the survivor's copy (made at CONNECT) counts the delay from when it goes."""
    async with two_nodes(redis_url) as (a, port, other_port):
        watcher = await watch(other_port, "held/#")
        props = Properties(user_properties=[("x-opt-delivery-delay", "3000")])
        will = Will("held/1", b"bye", 1, properties=props)
        await Raw.connected(port, 5, client_id="held", will=will)
        await asyncio.sleep(3.5)  # connected longer than the delivery delay
        crashed = await crash(a)
        got = await watcher.recv(timeout=10)
        took = asyncio.get_running_loop().time() - crashed
        assert isinstance(got, Publish) and got.payload == b"bye"
        assert took > 3, f"delivered {took:.1f} s after the crash: its delay counted from CONNECT"
        watcher.close()


async def test_a_node_stopped_by_sigterm_leaves_its_delayed_wills_to_the_others(
    redis_url: str,
) -> None:
    """Wills without delay go as it stops, once. Delayed ones go when due, from the other
    node, unless their client came back there within the delay (as clients of a node
    stopped for a rolling restart do)."""
    async with two_nodes(redis_url) as (stopping, port, other_port):
        watcher = await watch(other_port, "term/#")
        for i in range(3):
            will = Will(f"term/{i}", b"bye", 1)
            await Raw.connected(port, 5, client_id=f"t{i}", properties=KEEP, will=will)
        delayed = Properties(will_delay_interval=3)
        will = Will("term/back", b"later", 1, properties=delayed)
        raw, _ = await Raw.connected(port, 5, client_id="back", properties=KEEP, will=will)
        raw.writer.transport.abort()  # its will waits its delay on the node
        will = Will("term/gone", b"later", 1, properties=delayed)
        await Raw.connected(port, 5, client_id="gone", properties=KEEP, will=will)  # to the stop
        ended = asyncio.get_running_loop().time()
        await asyncio.sleep(0.3)
        assert await stopping.stop() == 0
        back, ack = await Raw.connected(
            other_port, 5, client_id="back", clean_start=False, properties=KEEP
        )
        assert ack.session_present
        got = {}
        with pytest.raises(TimeoutError):
            while True:
                packet = await watcher.recv(timeout=4)
                assert isinstance(packet, Publish) and packet.topic not in got
                got[packet.topic] = asyncio.get_running_loop().time() - ended
        assert sorted(got) == ["term/0", "term/1", "term/2", "term/gone"]
        assert got["term/gone"] > 2.5, "a delayed will went as its node stopped"
        back.close()
        watcher.close()


@pytest.mark.parametrize("claims_gone", [False, True])
async def test_the_reap_of_a_node_keeps_the_expiry_a_later_connection_elsewhere_set(
    broker: Broker, mqtt: Listener, claims_gone: bool
) -> None:
    """Node A held 'moved' (expiry 2 s) and crashed before its teardown unclaimed it (or its
    unclaim failed). The client came back to node B (this one) with expiry 3600 s and
    left. A's reap (or its clean stop: gw_node_down), at once or minutes later when the
    claims hash is gone, leaves the session its 3600 s (MQTT 5 §3.1.2.11.2)."""
    client_id, dead = "moved", "nrev21dead"
    claims = keys.client_claims(client_id)
    # node A's connection: claimed, holding the session with a 2 s expiry (a lease of 62 s)
    claim, _ = await broker.redis.fcall("gw_claim", 1, claims, dead, client_id.encode().hex())
    await broker.clients.hold(client_id, 62, dead, int(claim), 2)
    assert await broker.redis.hget(keys.node_sessions(dead), client_id.encode().hex())
    # the client comes back to node B, resumes with a long expiry, and leaves
    long = Properties(session_expiry_interval=3600)
    raw, _ = await Raw.connected(
        mqtt.port, 5, client_id=client_id, properties=long, clean_start=False
    )
    await raw.send(Disconnect())
    await raw.closed()
    async with asyncio.timeout(5):
        while await broker.redis.hget(claims, "holder") is not None:
            await asyncio.sleep(0.05)
    assert await broker.redis.ttl(keys.client_state(client_id)) > 3000
    if claims_gone:
        assert 0 < await broker.redis.ttl(claims) <= 120  # it goes 120 s after
        await broker.redis.delete(claims)  # ... as it has by the time node A is reaped
    await broker.redis.fcall("gw_node_down", 0, dead)
    ttl = await broker.redis.ttl(keys.client_state(client_id))
    assert ttl > 3000, f"session cut to {ttl} s by the reap of a node it had left"
