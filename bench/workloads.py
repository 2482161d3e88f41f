"""The workloads: what one measured run does against one broker, and what it reports.

Every broker gets the same load generators (C: bench/loadgen/mqtt.c through mqttgen.py,
bench/loadgen/{send,recv}.c through amqpgen.py). One run returns messages/s (delivered
messages per second, first send -> last arrival), end-to-end latency p50 / p99 / p99.9 (send
timestamp in the payload -> arrival), server CPU µs per delivered message (user + sys of the
broker's process tree from /proc, before/after), the load generator's CPU, what else used the
machine meanwhile, and which side capped the rate.
"""

from __future__ import annotations

import itertools
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import amqpgen
import mqttgen
from peers import Broker, machine_busy, tree_cpu

RUN_TIMEOUT = 240.0  # seconds one measured run may take
FANOUT = 10  # queues / subscribers of the fan-out topic
FANOUT_SHARE = 4  # fan-out publishes messages / 4, each delivered FANOUT times
PARTITIONS, PARTITION_CONSUMERS = 4, 8
INFLIGHT = 100  # unacknowledged messages per MQTT publisher (QoS 1), per AMQP sender / 3
NO_AMQP = "no AMQP 1.0 module in Debian's activemq package"


@dataclass
class Tools:
    amqp: amqpgen.Tools | None
    mqtt: Path
    workdir: Path
    names: itertools.count = field(default_factory=itertools.count)

    def queue_names(self, k: int) -> list[str]:
        """Fresh queue names per run: a failed run's leftovers never reach the next one."""
        n = next(self.names)
        return [f"bench-{n}-{i}" for i in range(k)]


@dataclass(frozen=True)
class Target:
    """One column of a workload's table: a broker, possibly with a workload option."""

    label: str
    broker: Broker
    partitions: int = 0  # of the queue (the partitioned workload)
    consumers: int = 0  # AMQP receivers; 0: one per publisher


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    run: Callable[[Tools, Target, int, int, int], dict]  # (tools, target, size, pairs, n)
    targets: Callable[[dict[str, Broker]], tuple[list[Target], dict[str, str]]]
    baseline_note: str = ""  # when the ratio is not gateway / peer


def children_cpu() -> float:
    """User + sys seconds of this process's waited-for children: the load generators."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def percentile(sorted_ns: list[int], q: float) -> float:
    if not sorted_ns:
        return 0.0
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1e6


def cap(busiest_server: float, loadgen_max: float, total: float) -> str:
    """Which side limited the rate: a saturated process (one core) or the whole machine."""
    if busiest_server >= 0.85 and busiest_server >= loadgen_max:
        return "broker"
    if loadgen_max >= 0.85:
        return "load generator"
    if total >= 1.7:
        return "machine (2 cores)"
    return "window / latency"


def measured(b: Broker, n: int, load: Callable[[], dict]) -> dict:
    """Run `load` with the CPU of the broker, of the load generators (the children `load`
    waited for) and of the machine counted around it. `load` returns delivered, wall,
    p50/p99/p999 ms and loadgen_max_cores (the busiest generator process)."""
    cpu0, busy0, gen0, t0 = tree_cpu(b.pid), machine_busy(), children_cpu(), time.time_ns()
    r = load()
    cpu1, busy1, gen = tree_cpu(b.pid), machine_busy(), children_cpu() - gen0
    # competing receivers idle a while after the last arrival: the broker's cores are averaged
    # up to that arrival, the machine's over the whole interval
    t1 = time.time_ns()
    active, interval = ((r.get("last_ns") or t1) - t0) / 1e9, (t1 - t0) / 1e9
    by_proc: dict[str, float] = {}
    for key, seconds in cpu1.items():
        by_proc[key[1]] = by_proc.get(key[1], 0.0) + seconds - cpu0.get(key, 0.0)
    server, wall, delivered = sum(by_proc.values()), r["wall"], r["delivered"]
    if delivered < n:
        raise RuntimeError(f"{b.name}: only {delivered} of {n} messages arrived")
    busiest = max(by_proc.values(), default=0.0) / active
    other = max(0.0, (busy1 - busy0 - server - gen) / interval)
    total = (busy1 - busy0) / interval
    return {
        "msgs_per_s": delivered / wall,
        "p50_ms": r["p50_ms"],
        "p99_ms": r["p99_ms"],
        "p999_ms": r["p999_ms"],
        "server_cpu_us_per_msg": server * 1e6 / delivered,
        "server_cores": server / active,
        "busiest_server_process_cores": busiest,
        "server_cpu_us_per_msg_by_process": {k: v * 1e6 / delivered for k, v in by_proc.items()},
        "loadgen_cpu_us_per_msg": gen * 1e6 / delivered,
        "loadgen_cores": gen / interval,
        "other_cores": other,
        "cap": cap(busiest, r["loadgen_max_cores"], total),
    }


# -- loads ------------------------------------------------------------------------------------


def mqtt_report(r: dict) -> dict:
    """A generator report as the fields `measured` needs."""
    if r.get("timed_out"):
        raise RuntimeError(f"MQTT generator timed out: {r.get('received')} received")
    lat = r["latency_ms"]
    return {
        "delivered": r["received"],
        "wall": r["seconds"],
        "p50_ms": lat["p50"],
        "p99_ms": lat["p99"],
        "p999_ms": lat["p999"],
        "loadgen_max_cores": r["client_cores"],
    }


def mqtt_pubsub(qos: int) -> Callable[[Tools, Target, int, int, int], dict]:
    def run(tools: Tools, t: Target, size: int, pairs: int, n: int) -> dict:
        def load() -> dict:
            r = mqttgen.run_pubsub(
                tools.mqtt,
                port=t.broker.mqtt_port,
                pairs=pairs,
                messages=n,
                size=size,
                qos=qos,
                inflight=INFLIGHT,
                timeout=RUN_TIMEOUT,
            )
            return mqtt_report(r)

        return measured(t.broker, n, load)

    return run


def amqp_load(receivers: amqpgen.Receivers, start: Callable[[], dict]) -> dict:
    """Receivers are attached; `start` drives the senders to the end and returns the busiest
    sender's cores; then the receivers drain and report."""
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        go = time.time_ns()
        sent = start()
        receivers.senders_done()
        got = receivers.collect(deadline)
    finally:
        receivers.kill()
    lat = sorted(got["latencies_ns"])
    wall = (got["last_ns"] - go) / 1e9 if got["last_ns"] else float("inf")
    return {
        "delivered": got["received"],
        "wall": wall,
        "last_ns": got["last_ns"],
        "p50_ms": percentile(lat, 0.5),
        "p99_ms": percentile(lat, 0.99),
        "p999_ms": percentile(lat, 0.999),
        "loadgen_max_cores": sent["max_cores"],
    }


def amqp_senders(
    tools: Tools,
    b: Broker,
    address: str,
    n: int,
    size: int,
    count: int,
) -> Callable[[], dict]:
    assert tools.amqp and b.amqp_port
    senders = amqpgen.Senders(
        tools.amqp, b.amqp_port, b.amqp_sasl, address, n, size, count, window=3 * INFLIGHT
    )

    def start() -> dict:
        t0 = time.monotonic()
        try:
            senders.go()
            done = senders.collect(time.monotonic() + RUN_TIMEOUT)
        finally:
            senders.kill()
        if done["accepted"] < n:
            raise RuntimeError(f"{b.name}: {done['accepted']} of {n} sends accepted")
        return {"max_cores": done["cpu"] / count / (time.monotonic() - t0)}

    return start


def mqtt_publishers(
    tools: Tools,
    b: Broker,
    n: int,
    size: int,
    pairs: int,
    **topic: str,
) -> Callable[[], dict]:
    def start() -> dict:
        r = mqttgen.run_pub(
            tools.mqtt,
            port=b.mqtt_port,
            publishers=pairs,
            messages=n,
            size=size,
            qos=1,
            inflight=INFLIGHT,
            timeout=RUN_TIMEOUT,
            **topic,
        )
        if r["acked"] < n:
            raise RuntimeError(f"{b.name}: {r['acked']} of {n} MQTT publishes acknowledged")
        return {"max_cores": r["client_cores"]}

    return start


def with_queues(
    tools: Tools,
    b: Broker,
    k: int,
    topic: str | None,
    partitions: int,
    body: Callable[[list[str]], dict],
) -> dict:
    """Declare k fresh durable queues (subscribed to topic), run body, delete them."""
    assert b.declare and b.delete
    names = tools.queue_names(k)
    try:
        return body(b.declare(names, topic, partitions))
    finally:
        b.delete(names)


def amqp_receivers(
    tools: Tools, b: Broker, addresses: list[str], n: int, competing: bool
) -> amqpgen.Receivers:
    """One C receiver per address (repeat an address for competing receivers), together
    expecting `n` messages, each with a credit window of 3 * INFLIGHT."""
    assert tools.amqp and b.amqp_port
    return amqpgen.Receivers(
        tools.amqp,
        b.amqp_port,
        b.amqp_sasl,
        addresses,
        n,
        tools.workdir,
        competing=competing,
        window=3 * INFLIGHT,
    )


def amqp_queue(tools: Tools, t: Target, size: int, pairs: int, n: int) -> dict:
    """`pairs` senders -> one durable queue -> `pairs` competing receivers (accept)."""
    b = t.broker
    consumers = t.consumers or pairs

    def body(addresses: list[str]) -> dict:
        assert tools.amqp and b.amqp_port
        receivers = amqp_receivers(tools, b, addresses * consumers, n, competing=consumers > 1)
        if t.partitions and b.wait_assigned:  # steady state: not the rebalance delay
            b.wait_assigned(addresses)
        start = amqp_senders(tools, b, addresses[0], n, size, pairs)
        return measured(b, n, lambda: amqp_load(receivers, start))

    return with_queues(tools, b, 1, None, t.partitions, body)


def mqtt_to_amqp(tools: Tools, t: Target, size: int, pairs: int, n: int) -> dict:
    """`pairs` MQTT QoS 1 publishers on bench/<i> -> a durable queue subscribed to bench/#
    (RabbitMQ: bound to amq.topic with bench.#) -> `pairs` competing AMQP receivers."""
    b = t.broker

    def body(addresses: list[str]) -> dict:
        assert tools.amqp and b.amqp_port
        receivers = amqp_receivers(tools, b, addresses * pairs, n, competing=pairs > 1)
        start = mqtt_publishers(tools, b, n, size, pairs, topic_prefix="bench/")
        return measured(b, n, lambda: amqp_load(receivers, start))

    return with_queues(tools, b, 1, "bench/#", 0, body)


def fanout(tools: Tools, t: Target, size: int, pairs: int, n: int) -> dict:
    """`pairs` MQTT QoS 1 publishers on fan/x; FANOUT queues subscribed to it, one AMQP
    receiver each (gateway, RabbitMQ), or FANOUT MQTT QoS 1 subscribers (MQTT-only peers).
    Each published message is delivered FANOUT times; rates and CPU count deliveries."""
    b, per = t.broker, n // FANOUT_SHARE
    if b.amqp_port is None:

        def load() -> dict:
            r = mqttgen.run_pubsub(
                tools.mqtt,
                port=b.mqtt_port,
                publishers=pairs,
                subscribers=FANOUT,
                publish_topic="fan/x",
                subscribe_topic="fan/#",
                messages=per,
                size=size,
                qos=1,
                inflight=INFLIGHT,
                timeout=RUN_TIMEOUT,
            )
            return mqtt_report(r)

        return measured(b, per * FANOUT, load)

    def body(addresses: list[str]) -> dict:
        assert tools.amqp and b.amqp_port
        receivers = amqp_receivers(tools, b, addresses, per, competing=False)
        start = mqtt_publishers(tools, b, per, size, pairs, publish_topic="fan/x")
        return measured(b, per * FANOUT, lambda: amqp_load(receivers, start))

    return with_queues(tools, b, FANOUT, "fan/#", 0, body)


# -- which broker takes part in what ----------------------------------------------------------


def supported(
    brokers: dict[str, Broker], want: Callable[[Broker], bool], why_not: Callable[[str], str]
) -> tuple[list[Target], dict[str, str]]:
    """The brokers that can take the workload (the gateway first), and why the others not."""
    targets = [Target(name, b) for name, b in brokers.items() if want(b)]
    return targets, {name: why_not(name) for name, b in brokers.items() if not want(b)}


def mqtt_targets(brokers: dict[str, Broker]) -> tuple[list[Target], dict[str, str]]:
    return supported(brokers, lambda b: b.mqtt_port is not None, lambda _: "no MQTT")


def amqp_targets(brokers: dict[str, Broker]) -> tuple[list[Target], dict[str, str]]:
    return supported(
        brokers,
        lambda b: b.amqp_port is not None,
        lambda name: NO_AMQP if name == "activemq" else "MQTT only",
    )


def partition_targets(brokers: dict[str, Broker]) -> tuple[list[Target], dict[str, str]]:
    g = brokers["gateway"]
    others = {name: "no peer equivalent" for name in brokers if name != "gateway"}
    return [
        Target("gateway", g, PARTITIONS, PARTITION_CONSUMERS),
        Target("gateway, 1 queue", g, 0, PARTITION_CONSUMERS),
    ], others


WORKLOADS = [
    Workload("mqtt-qos0", "MQTT QoS 0 publish -> subscribe", mqtt_pubsub(0), mqtt_targets),
    Workload("mqtt-qos1", "MQTT QoS 1 publish -> subscribe", mqtt_pubsub(1), mqtt_targets),
    Workload(
        "amqp-queue", "AMQP 1.0 send -> durable queue -> receive (accept)", amqp_queue, amqp_targets
    ),
    Workload(
        "mqtt-amqp",
        "MQTT QoS 1 publish -> queue (topic subscription) -> AMQP receive",
        mqtt_to_amqp,
        amqp_targets,
    ),
    Workload(
        "partitioned",
        f"AMQP 1.0, {PARTITIONS}-partition queue, {PARTITION_CONSUMERS} receivers",
        amqp_queue,
        partition_targets,
        baseline_note="no peer equivalent: ratio against the gateway's non-partitioned "
        f"queue with {PARTITION_CONSUMERS} receivers",
    ),
    Workload(
        "fanout",
        f"MQTT QoS 1 publish -> {FANOUT} queues (AMQP) / {FANOUT} QoS 1 subscribers",
        fanout,
        mqtt_targets,
    ),
]
BY_NAME = {w.name: w for w in WORKLOADS}
