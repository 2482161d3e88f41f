"""Partitioned queue end to end: AMQP consumers on two gateway processes, publishers over
AMQP (group-id), MQTT 5 (JMSXGroupId) and MQTT 3.1.1 (no key); consumers come and go and a
gateway node is killed. Per-key order holds on every consumer and every message arrives."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from proton import Message as AmqpMessage
from proton import Timeout
from proton.utils import BlockingConnection

from gateway.broker import Broker
from gateway.engine.queues import QueueConfig
from tests.processes import Proc, node_env, serve_argv

pytestmark = pytest.mark.slow

KEYS = [f"dev-{i}" for i in range(8)]


@dataclass
class Consumer:
    """A proton receiver in a thread: accepts everything, records what it got."""

    name: str
    port: int
    got: list[tuple[str, int, bool]] = field(default_factory=list)  # key, seq, redelivered
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    error: str = ""

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn = BlockingConnection(f"amqp://127.0.0.1:{self.port}", timeout=5)
            receiver = conn.create_receiver("pq", credit=5)
            while not self.stop.is_set():
                try:
                    msg = receiver.receive(timeout=0.2)
                except Timeout:
                    continue
                key, _, seq = bytes(msg.body).decode().partition(":")
                self.got.append((key, int(seq), msg.delivery_count > 0))
                receiver.accept()
            conn.close()
        except Exception as exc:  # the node under it was killed
            self.error = repr(exc)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(10)


class Publishers:
    """AMQP with group-id, MQTT 5 with JMSXGroupId, MQTT 3.1.1 without a key."""

    def __init__(self, amqp_port: int, mqtt_port: int) -> None:
        self.amqp = BlockingConnection(f"amqp://127.0.0.1:{amqp_port}", timeout=10)
        self.sender = self.amqp.create_sender("pq")
        self.v5 = paho.Client(CallbackAPIVersion.VERSION2, "pub-v5", protocol=paho.MQTTv5)
        self.v311 = paho.Client(CallbackAPIVersion.VERSION2, "pub-v311", protocol=paho.MQTTv311)
        for client in (self.v5, self.v311):
            client.connect("127.0.0.1", mqtt_port)
            client.loop_start()
        self.seq = dict.fromkeys([*KEYS, "none"], 0)

    def round(self) -> None:
        """One message per key from each keyed publisher, one keyless."""
        for i, key in enumerate(KEYS):
            self.seq[key] += 1
            body = f"{key}:{self.seq[key]}".encode()
            if i % 2:
                self.sender.send(AmqpMessage(body=body, group_id=key, durable=True))
            else:
                props = Properties(PacketTypes.PUBLISH)
                props.UserProperty = [("JMSXGroupId", key)]
                self.v5.publish("pq/in", body, qos=1, properties=props).wait_for_publish(10)
        self.seq["none"] += 1
        self.v311.publish("pq/in", f"none:{self.seq['none']}".encode(), qos=1).wait_for_publish(10)

    def close(self) -> None:
        self.amqp.close()
        for client in (self.v5, self.v311):
            client.loop_stop()
            client.disconnect()


async def test_partitioned_queue_with_elastic_consumers_and_a_lost_node(
    redis_url: str, broker: Broker, tmp_path
) -> None:
    await broker.declare_queue(
        QueueConfig(
            name="pq",
            partition_count=4,
            partition_rebalance_delay_ms=100,
            partition_handoff_timeout_ms=1000,
        ),
        [("pq/in", "smf")],
    )
    env = node_env(ttl=1.0)
    nodes = []
    for name in ("a", "b"):
        proc = await Proc.start(serve_argv(tmp_path / name, "--redis-url", redis_url), env)
        nodes.append((proc, await proc.wait_event("ready")))
    (_, a), (node_b, b) = nodes
    consumers = [
        Consumer("c1", a["amqp_port"]),
        Consumer("c2", a["amqp_port"]),
        Consumer("c3", b["amqp_port"]),
    ]
    publishers = Publishers(a["amqp_port"], a["mqtt_port"])  # node a survives
    everyone = list(consumers)
    try:
        for c in consumers:
            c.start()
        await asyncio.sleep(0.5)

        async def rounds(n: int) -> None:
            for _ in range(n):
                await asyncio.to_thread(publishers.round)

        await rounds(10)
        for c in (Consumer("c4", b["amqp_port"]), Consumer("c5", a["amqp_port"])):
            c.start()
            everyone.append(c)
        await rounds(10)
        await asyncio.to_thread(everyone[0].close)
        await asyncio.to_thread(everyone[1].close)
        await rounds(10)
        node_b.kill()  # c3 and c4 lose their gateway; their partitions move to c5
        await node_b.proc.wait()
        await rounds(10)
        expected = {(k, s) for k, n in publishers.seq.items() for s in range(1, n + 1)}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = {(k, s) for c in everyone for k, s, _ in c.got}
            if got >= expected:
                break
            await asyncio.sleep(0.2)
    finally:
        await asyncio.to_thread(publishers.close)
        for c in everyone:
            await asyncio.to_thread(c.close)
        for proc, _ in nodes:
            proc.kill()
    got = {(k, s) for c in everyone for k, s, _ in c.got}
    assert got == expected, f"missing {sorted(expected - got)[:10]}"
    for c in everyone:
        for key in KEYS:
            seqs = [s for k, s, _ in c.got if k == key]
            assert seqs == sorted(seqs), f"{c.name} got {key} out of order: {seqs}"
    assert {c.name for c in everyone if c.got} >= {"c1", "c2", "c5"}, "partitions moved"
    assert (await broker.queues.info("pq")).messages == 0
