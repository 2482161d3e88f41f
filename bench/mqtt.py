"""MQTT benchmark: QoS 1 publish -> subscribe through the gateway and through Mosquitto.

Both brokers get the same load in the same run: --publishers paho publisher processes send
--messages QoS 1 messages of --size bytes (a send timestamp inside) in total to topics
bench/<n>, and one subscriber process (QoS 1, clean session; asyncio on the project's codec,
faster than paho) receives them all.
Publishers keep at most INFLIGHT messages unacked each (closed loop). Reported, each the
median of --runs runs: throughput (messages / time from "go" to the last arrival), latency
p50 / p99 (send timestamp to arrival) and server CPU µs per message (user +
sys from /proc of the broker process and its children: the gateway's embedded redis-server),
then the ratios gateway / mosquitto. The gateway runs as `gateway serve` (embedded Redis,
AOF) on a free loopback port; Mosquitto (Debian's `mosquitto` binary) gets a config file
with `max_queued_messages 0` on another. Both are stopped at the end.

    python bench/mqtt.py [--messages 30000] [--publishers 2] [--size 100] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300.0  # seconds any one run may take
INFLIGHT = 200  # unacked QoS 1 publishes per publisher


# -- load generator roles (run as child processes of this script) ---------------------------


def run_subscriber(port: int, count: int) -> None:
    """Print "ready" once subscribed, then one JSON line when `count` messages arrived.

    A lean asyncio client on the project's sans-IO codec (PUBACKs batched per read), so that
    one subscriber process keeps up with what either broker delivers."""
    import asyncio

    import uvloop

    from protocols.mqtt.codec import (
        Connect,
        MqttDecoder,
        Puback,
        Publish,
        Subscribe,
        SubscriptionOptions,
        encode,
    )

    async def main() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        decoder = MqttDecoder(protocol_level=4)
        writer.write(encode(Connect(protocol_level=4, client_id="bench-sub"), 4))
        writer.write(encode(Subscribe(1, [("bench/#", SubscriptionOptions(qos=1))]), 4))
        latencies: list[int] = []
        last = 0
        try:
            async with asyncio.timeout(TIMEOUT):
                acks = 0
                while acks < 2:  # CONNACK, SUBACK
                    acks += len(decoder.feed(await reader.read(65536)))
                print("ready", flush=True)
                while len(latencies) < count:
                    data = await reader.read(1 << 20)
                    if not data:
                        break
                    now = time.time_ns()
                    out = bytearray()
                    for packet in decoder.feed(data):
                        if isinstance(packet, Publish):
                            latencies.append(now - int(packet.payload[:19]))
                            out += encode(Puback(packet.packet_id or 0), 4)
                            last = now
                    writer.write(out)
        finally:  # whatever arrived, also after a timeout: the driver reports a shortfall
            writer.close()
            print(json.dumps({"received": len(latencies), "last_ns": last, "lat_ns": latencies}))

    uvloop.run(main())


def run_publisher(port: int, count: int, size: int, index: int) -> None:
    """Connect, print "ready", wait for "go" on stdin, publish `count` QoS 1 messages with
    at most INFLIGHT unacked (closed loop: latency is the broker's, not a client backlog)."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    window = threading.BoundedSemaphore(INFLIGHT)
    c = paho.Client(
        CallbackAPIVersion.VERSION2, client_id=f"bench-pub-{index}", protocol=paho.MQTTv311
    )
    c.max_inflight_messages_set(INFLIGHT + 1)
    c.max_queued_messages_set(0)
    c.on_publish = lambda *_: window.release()
    c.connect("127.0.0.1", port, keepalive=60)
    c.loop_start()
    print("ready", flush=True)
    sys.stdin.readline()
    pad = b"x" * max(0, size - 20)
    for _ in range(count):
        if not window.acquire(timeout=TIMEOUT):
            sys.exit("no PUBACK")
        c.publish(f"bench/{index}", b"%019d " % time.time_ns() + pad, 1)
    for _ in range(INFLIGHT):  # every PUBACK is in
        window.acquire(timeout=TIMEOUT)
    c.disconnect()
    c.loop_stop()


# -- brokers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + sys CPU of `pid` and its live children (the embedded redis-server)."""
    total = 0.0
    for p in [pid, *children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(c) for c in text]
    return found


@contextmanager
def gateway(tmp: Path) -> Iterator[tuple[int, int]]:
    """`gateway serve` with an embedded Redis; yields (pid, mqtt port)."""
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--data-dir", str(tmp / "gw"),
            "--mqtt-port", str(port), "--admin-port", "0", "--amqp-port", "0"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while b'"ready"' not in proc.stdout.readline():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("gateway did not start")
        yield proc.pid, port
    finally:
        stop(proc)


@contextmanager
def mosquitto(tmp: Path) -> Iterator[tuple[int, int]]:
    """Debian's mosquitto on a free loopback port; yields (pid, port)."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(binary).exists():
        raise SystemExit("mosquitto not found: apt-get install mosquitto")
    port = free_port()
    conf = tmp / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\n")
    proc = subprocess.Popen([binary, "-c", str(conf)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("mosquitto did not start") from None
                time.sleep(0.05)
        yield proc.pid, port
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- one measured run -------------------------------------------------------------------------


def role(*args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def ready(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit("load generator failed to start")


def measure(pid: int, port: int, messages: int, publishers: int, size: int) -> dict:
    sub = role("sub", port, messages)
    ready(sub)
    share = [messages // publishers + (i < messages % publishers) for i in range(publishers)]
    pubs = [role("pub", port, n, size, i) for i, n in enumerate(share)]
    for p in pubs:
        ready(p)
    cpu0 = cpu_seconds(pid)
    start = time.time_ns()
    for p in pubs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    out, _ = sub.communicate(timeout=TIMEOUT)
    for p in pubs:
        p.communicate(timeout=TIMEOUT)
    cpu = cpu_seconds(pid) - cpu0
    if not out.strip():
        raise SystemExit(f"the subscriber failed (exit status {sub.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    if result["received"] < messages:
        raise SystemExit(f"only {result['received']} of {messages} messages arrived")
    lat = sorted(result["lat_ns"])
    return {
        "msg_per_s": messages / ((result["last_ns"] - start) / 1e9),
        "p50_ms": lat[len(lat) // 2] / 1e6,
        "p99_ms": lat[int(len(lat) * 0.99)] / 1e6,
        "cpu_us_per_msg": cpu * 1e6 / messages,
    }


def bench(args: argparse.Namespace) -> None:
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-mqtt-") as tmp:
        for name, server in (("gateway", gateway), ("mosquitto", mosquitto)):
            with server(Path(tmp)) as (pid, port):
                measure(pid, port, min(2000, args.messages), args.publishers, args.size)  # warm
                runs = [
                    measure(pid, port, args.messages, args.publishers, args.size)
                    for _ in range(args.runs)
                ]
            results[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(
        f"MQTT QoS 1, {args.messages} x {args.size} B, {args.publishers} publishers -> "
        f"1 subscriber, median of {args.runs} runs"
    )
    print(f"{'':16}{'gateway':>12}{'mosquitto':>12}{'ratio':>10}")
    for key, label in (
        ("msg_per_s", "msg/s"),
        ("p50_ms", "p50 ms"),
        ("p99_ms", "p99 ms"),
        ("cpu_us_per_msg", "CPU µs/msg"),
    ):
        gw, mq = results["gateway"][key], results["mosquitto"][key]
        print(f"{label:16}{gw:12.1f}{mq:12.1f}{gw / mq:10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "sub":
        run_subscriber(int(sys.argv[2]), int(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "pub":
        run_publisher(*map(int, sys.argv[2:6]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=30_000)
    parser.add_argument("--publishers", type=int, default=2)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="also write the medians to this file")
    bench(parser.parse_args())


if __name__ == "__main__":
    main()
