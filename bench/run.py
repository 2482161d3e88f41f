"""Benchmark the gateway against Mosquitto, RabbitMQ and ActiveMQ with the same load generators.

    ./run bench [--quick] [--only WORKLOAD[,..]] [--peers mosquitto,rabbitmq,activemq]
                [--runs 5] [--wait-quiet 5] [--out bench/results]

Starts `gateway serve` and the peers (Debian packages, installed with apt-get when missing,
or skipped with a line saying why) on free 127.0.0.1 ports, runs every workload for 100 B and
4 KiB messages with 1 and 8 publisher/consumer pairs, each broker in turn within every run,
then holds 10,000 idle MQTT connections on each broker and reads its resident memory. Writes
<out>/latest.md, latest.json and latest.png and prints the Markdown; stops everything it
started. --quick: one run of fewer messages, 100 B only, 2,000 idle connections.
Workloads: mqtt-qos0, mqtt-qos1, amqp-queue, mqtt-amqp, partitioned, fanout, memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import amqpgen
import mqttgen
import peers
import report
import workloads
from peers import Broker, say

HERE = Path(__file__).resolve().parent
IDLE_TARGET_MB = 500
# Runs per cell: the machine is shared and a run's CPU per message moves by up to a third
# from one run to the next (same batching, no steal), so the median takes five.
RUNS = 5


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 run, fewer messages, 100 B only")
    p.add_argument("--only", help="comma-separated workloads (default: all, and memory)")
    p.add_argument("--peers", default=",".join(peers.PEERS), help="comma-separated, or none")
    p.add_argument("--runs", type=int, help=f"runs per cell (default {RUNS}; --quick 1)")
    p.add_argument("--messages", type=int, help="messages per 100 B run (4 KiB: half)")
    p.add_argument("--connections", type=int, help="idle MQTT connections (default 10000)")
    p.add_argument("--wait-quiet", type=float, help="max seconds to wait for an idle machine")
    p.add_argument("--out", type=Path, default=HERE / "results")
    a = p.parse_args()
    names = [*workloads.BY_NAME, "memory"]
    a.only = a.only.split(",") if a.only else names
    if bad := [w for w in a.only if w not in names]:
        p.error(f"unknown workload(s) {bad}; choose from {names}")
    a.peers = [] if a.peers == "none" else a.peers.split(",")
    if bad := [x for x in a.peers if x not in peers.PEERS]:
        p.error(f"unknown peer(s) {bad}; choose from {list(peers.PEERS)}")
    a.runs = a.runs or (1 if a.quick else RUNS)
    a.messages = a.messages or (3000 if a.quick else 20000)
    a.connections = a.connections or (2000 if a.quick else 10000)
    a.wait_quiet = a.wait_quiet if a.wait_quiet is not None else (0 if a.quick else 5)
    a.sizes = [100] if a.quick else [100, 4096]
    a.pairs = [1, 8]
    return a


def have_proton() -> bool:
    """Qpid Proton's C headers and library, as pkg-config sees them."""
    if not shutil.which("pkg-config"):
        return False
    return subprocess.run(["pkg-config", "--exists", "libqpid-proton"]).returncode == 0


def setup(a: argparse.Namespace, tmp: Path) -> tuple[workloads.Tools, dict[str, str]]:
    """Packages, load generators; returns the tools and the peers that cannot run, with why."""
    wanted = {
        "gcc": lambda: bool(shutil.which("gcc")),
        "pkg-config": lambda: bool(shutil.which("pkg-config")),
        "libqpid-proton11-dev": have_proton,
        **{peers.PEERS[name][0]: peers.PEERS[name][1] for name in a.peers},
    }
    status = peers.ensure_packages(wanted)
    missing = {
        name: f"Debian package {peers.PEERS[name][0]} is not installed and could not be"
        for name in a.peers
        if not status[peers.PEERS[name][0]]
    }
    if "activemq" in a.peers and "activemq" not in missing and not peers.activemq_mqtt_jars(tmp):
        missing["activemq"] = "its MQTT connector's jars could not be fetched"
    amqp = amqpgen.build(tmp) if status["libqpid-proton11-dev"] else None
    if amqp is None:
        say("[setup] no Qpid Proton C library: AMQP workloads are skipped")
    return workloads.Tools(amqp, mqttgen.build(tmp), tmp), missing


def run_workload(
    a: argparse.Namespace,
    w: workloads.Workload,
    tools: workloads.Tools,
    brokers: dict[str, Broker],
    unavailable: dict[str, str],
) -> dict:
    targets, skipped = w.targets(brokers)
    skipped = {**skipped, **{n: why for n, why in unavailable.items() if n not in skipped}}
    if tools.amqp is None and w.name in ("amqp-queue", "mqtt-amqp", "partitioned"):
        targets = []
        skipped["all"] = "no AMQP load generator (libqpid-proton11-dev missing)"
    for name, why in skipped.items():
        say(f"[{w.name}] {name}: not run ({why})")
    out: dict = {
        "name": w.name,
        "title": w.title,
        "baseline_note": w.baseline_note,
        "skipped": skipped,
        "cells": [],
    }
    if not targets:
        return out
    if not a.quick:  # warm-up: connections, code paths, caches; not recorded
        for t in targets:
            try:
                w.run(tools, t, a.sizes[0], 1, max(1000, a.messages // 10))
            except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
                say(f"[{w.name}] warm-up {t.label}: {exc}")
    for size in a.sizes:
        n = a.messages if size < 1024 else a.messages // 2
        for pairs in a.pairs:
            cell: dict = {"size": size, "pairs": pairs, "messages": n, "runs": {}}
            for i in range(a.runs):
                for t in targets:  # alternate: drift hits every broker alike
                    if a.wait_quiet and (seen := peers.wait_quiet(a.wait_quiet)) >= 0.25:
                        say(f"[{w.name}] machine busy ({seen:.2f} cores); measuring anyway")
                    try:
                        r = w.run(tools, t, size, pairs, n)
                    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
                        say(f"[{w.name}] {size} B x{pairs} run {i + 1} {t.label}: FAILED: {exc}")
                        r = None
                    else:
                        say(
                            f"[{w.name}] {size} B x{pairs} run {i + 1} {t.label}: "
                            f"{r['msgs_per_s']:,.0f} msg/s, p50 {r['p50_ms']:.2f} ms, "
                            f"p99 {r['p99_ms']:.2f} ms, {r['server_cpu_us_per_msg']:.1f} µs/msg, "
                            f"cap {r['cap']}, other load {r['other_cores']:.2f} cores"
                        )
                    cell["runs"].setdefault(t.label, []).append(r)
            out["cells"].append(cell)
    return out


def memory(a: argparse.Namespace, tools: workloads.Tools, brokers: dict[str, Broker]) -> dict:
    """Resident memory of each broker's processes with `a.connections` idle MQTT clients."""
    out: dict = {"connections": a.connections, "target_mb": IDLE_TARGET_MB, "brokers": {}}
    for name, b in brokers.items():
        before = peers.tree_rss(b.pid)
        try:
            with mqttgen.idle(
                tools.mqtt, port=b.mqtt_port, connections=a.connections, keepalive=600, timeout=180
            ) as held:
                time.sleep(2.0)  # let the broker settle after the ramp
                rss = peers.tree_rss(b.pid)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            say(f"[memory] {name}: FAILED: {exc}")
            out["brokers"][name] = {"error": str(exc)[:200]}
            continue
        out["brokers"][name] = {
            "connected": held.ready["connected"],
            "rss_mb": rss,
            "before_mb": before,
            "ramp_s": held.ready["seconds"],
        }
        say(
            f"[memory] {name}: {held.ready['connected']} connections, "
            f"{sum(rss.values()):.0f} MB resident ({sum(before.values()):.0f} MB before)"
        )
    return out


def main() -> None:
    a = parse()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with `&`
    started = time.monotonic()
    results: dict = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}",
            "command": "./run bench " + " ".join(sys.argv[1:]),
            "runs": a.runs,
            "quick": a.quick,
            "notes": [peers.NO_AMQP_ACTIVEMQ],
        },
        "workloads": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-") as tmpdir, ExitStack() as stack:
        tmp = Path(tmpdir)
        tools, unavailable = setup(a, tmp)
        brokers = {"gateway": stack.enter_context(peers.gateway(tmp))}
        for name in a.peers:
            if name in unavailable:
                say(f"[{name}] skipped: {unavailable[name]}")
                continue
            try:
                brokers[name] = stack.enter_context(peers.PEERS[name][2](tmp))
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                unavailable[name] = f"did not start: {exc}"
                say(f"[{name}] skipped: {unavailable[name]}")
        results["meta"]["notes"] += [f"{n}: skipped ({why})" for n, why in unavailable.items()]
        for w in workloads.WORKLOADS:
            if w.name in a.only:
                results["workloads"].append(run_workload(a, w, tools, brokers, unavailable))
        if "memory" in a.only:
            results["memory"] = memory(a, tools, brokers)
        say("[bench] stopping the brokers")
    results["meta"]["duration_s"] = time.monotonic() - started
    paths = report.write(results, a.out)
    print(paths["md"].read_text())
    say(
        f"[bench] wrote {', '.join(str(p) for p in paths.values())} "
        f"in {results['meta']['duration_s'] / 60:.1f} min"
    )


if __name__ == "__main__":
    main()
