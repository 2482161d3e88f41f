"""Python face of the C MQTT load generator (bench/loadgen/mqtt.c) for the bench scripts.

A Python MQTT client costs more CPU per message than the brokers under test (paho: ~57 µs per
QoS 1 message here), so it would cap them; the C generator costs a few µs. This module builds
it and runs it, returning its JSON report as a dict.

API (stable; every keyword maps to the binary's `--flag`, underscores becoming dashes):

    build(workdir) -> Path
        Compile mqtt.c with `gcc -O2 -Wall ... -lm` into workdir as `mqttgen-<source hash>`;
        an existing binary of the same source is reused. Raises BuildError (no gcc, or
        compiler errors).

    run_pubsub(binary, *, port, pairs=1, messages=10000, size=100, qos=1, inflight=100,
               timeout=60.0, **more) -> dict
    run_pub(binary, *, port, ...) -> dict        # publishers only
    run_sub(binary, *, port, ...) -> dict        # subscribers only (start it first)
    start_sub(binary, *, port, ...) -> Run
        a `sub` in the background, returned once all its subscriptions are acknowledged
        (Run.ready = {"subscribed", "seconds"}); publish, then Run.result() -> report.
    idle(binary, *, port, connections=1000, keepalive=600, ...) -> context manager
        yields an Idle once all connections are up (Idle.ready = {"connected", "failed",
        "seconds"}), holds them while the block runs (measure the broker then), then
        disconnects them; afterwards Idle.final adds "held", "dropped", "held_seconds".

    More keywords: host, version (4|5), publishers, subscribers, topic_prefix, publish_topic,
    subscribe_topic, expect, client_prefix, user, password, rate (msgs/s, 0 = unpaced),
    keepalive, ramp (handshakes at a time), hold. Errors (bad flags, refused connection,
    refused CONNECT/SUBSCRIBE, a dropped connection) raise LoadgenError with the stderr text.

Report of pubsub / pub / sub (keys present as they apply): mode, version, qos, size,
publishers, subscribers, inflight, sent, acked, expected, received (unique), duplicates, lost
(expected - received), latency_ms {p50, p99, p999, max} (monotonic send stamp in the payload
-> arrival, same host), seconds (first send -> last arrival; pub: -> last PUBACK), msgs_per_s
(arrivals per second; pub: sends), client_cpu_us_per_msg (the generator's own user+sys CPU per
arrival, per send for `pub`, from the first send on), client_cores, capped (client_cores >= 0.9:
the generator, not the broker, may be the limit), timed_out (--timeout hit: received < expected).

Fan-out: publishers=1, subscribers=K, publish_topic="t/x", subscribe_topic="t/#" -> every
subscriber expects every message, expected = messages x K. QoS 0 pacing in pubsub: publishers
pause while sent - received reaches inflight x publishers (QoS 0 has no acks to pace by). A QoS 0
`pub` has nothing to pace by but TCP back-pressure (its msgs_per_s is the rate of writes into
the socket): give it `rate` and measure at the consumer. Mosquitto needs `set_tcp_nodelay true`
for a fair latency tail (without it, Nagle + delayed ACK put ~40 ms on its p99.9 at QoS 0).
Payloads also carry "TS:" + 19 digits of CLOCK_REALTIME ns from byte 16 (size >= 38), which
the AMQP receiver bench/loadgen/recv.c reads, so `pub` can feed an AMQP consumer.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent / "loadgen" / "mqtt.c"
GRACE = 30.0  # seconds beyond the generator's own --timeout before it is killed


class BuildError(RuntimeError):
    """The generator could not be compiled."""


class LoadgenError(RuntimeError):
    """The generator exited with an error (its stderr is the message)."""


def build(workdir: Path) -> Path:
    """Compile once per source version: the binary name carries the source hash."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildError("gcc is not installed (apt-get install gcc)")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    binary = Path(workdir) / f"mqttgen-{digest}"
    if binary.exists():
        return binary
    partial = binary.with_suffix(".tmp")
    done = subprocess.run(
        [gcc, "-O2", "-Wall", "-o", str(partial), str(SOURCE), "-lm"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise BuildError(done.stderr.strip())
    partial.replace(binary)  # atomic: a concurrent build never sees half a binary
    return binary


def argv(binary: Path, mode: str, options: dict[str, Any]) -> list[str]:
    """`binary mode --flag value ...`; None values are left out."""
    out = [str(binary), mode]
    for key, value in options.items():
        if value is not None:
            out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def _parse(stdout: str, stderr: str, code: int) -> dict[str, Any]:
    if code != 0:
        raise LoadgenError(stderr.strip() or f"mqttgen exited with {code}")
    return json.loads(stdout.strip().splitlines()[-1])


def _run(binary: Path, mode: str, options: dict[str, Any]) -> dict[str, Any]:
    timeout = float(options.get("timeout", 60.0))
    done = subprocess.run(
        argv(binary, mode, {"timeout": timeout, **options}),
        capture_output=True,
        text=True,
        timeout=timeout + GRACE,
    )
    return _parse(done.stdout, done.stderr, done.returncode)


def run_pubsub(binary: Path, **options: Any) -> dict[str, Any]:
    """Subscribers and publishers in one process; returns the report."""
    return _run(binary, "pubsub", options)


def run_pub(binary: Path, **options: Any) -> dict[str, Any]:
    """Publishers only (e.g. MQTT in, AMQP out); returns the report."""
    return _run(binary, "pub", options)


def run_sub(binary: Path, **options: Any) -> dict[str, Any]:
    """Subscribers only, until the expected messages arrived or --timeout."""
    return _run(binary, "sub", options)


class Run:
    """Subscribers running in the background while another tool publishes."""

    def __init__(self, binary: Path, options: dict[str, Any]) -> None:
        self.timeout = float(options.get("timeout", 60.0))
        self.proc = subprocess.Popen(
            argv(binary, "sub", {"timeout": self.timeout, **options}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the subscribed line, or EOF on an error
        if not line:
            self.result()  # raises with the generator's stderr
            raise LoadgenError("mqttgen sub ended before subscribing")
        self.ready: dict[str, Any] = json.loads(line)

    def result(self) -> dict[str, Any]:
        """Wait for the report (bounded by the run's own timeout plus a grace period)."""
        try:
            out, err = self.proc.communicate(timeout=self.timeout + GRACE)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise LoadgenError("mqttgen did not stop by itself") from None
        return _parse(out, err, self.proc.returncode)


def start_sub(binary: Path, **options: Any) -> Run:
    """Start subscribers in the background; returns once all are subscribed."""
    return Run(binary, options)


class Idle:
    """The idle run's ready report (`ready`) and, after release, its final report."""

    def __init__(self, ready: dict[str, Any]) -> None:
        self.ready = ready
        self.final: dict[str, Any] = {}


@contextmanager
def idle(binary: Path, **options: Any) -> Iterator[Idle]:
    """Open many idle connections and hold them for the body of the `with` block."""
    timeout = float(options.get("timeout", 120.0))
    proc = subprocess.Popen(
        argv(binary, "idle", {"timeout": timeout, **options}),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()  # returns by --timeout at the latest
        if not line:
            proc.wait(timeout=GRACE)
            raise LoadgenError(proc.stderr.read().strip() if proc.stderr else "no ready line")
        held = Idle(json.loads(line))
        yield held
        proc.stdin.close()  # release: the generator disconnects and reports
        code = proc.wait(timeout=GRACE)
        held.final = _parse(proc.stdout.read(), proc.stderr.read() if proc.stderr else "", code)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
