"""AMQP 1.0 benchmark: durable queue send -> receive through the gateway and RabbitMQ 3.10.

Both brokers get the same load from the same C load generator (bench/loadgen/, Qpid Proton
proactor, compiled with gcc into a temp dir at start): one sender sends --messages durable
messages of --size bytes (a send timestamp inside) to a durable queue, unsettled, with at most
--window awaiting their disposition; one receiver, running at the same time, takes them with
--window credit and accepts each. Per run: messages/s (go -> last arrival), end-to-end latency
p50 / p99 / p99.9 and server CPU µs per message (user + sys from /proc of the broker's process
tree: `gateway serve` + its redis-server; RabbitMQ's beam.smp + its children), plus the load
generator's own CPU per message, so one can tell which side caps the rate. Runs alternate
between the brokers, so each run gives a gateway / RabbitMQ ratio measured side by side; the
table shows medians with min-max over --runs runs.

Missing packages (libqpid-proton11-dev, rabbitmq-server) are installed with apt-get; a peer
that cannot be installed or started is skipped with a line saying so. ActiveMQ is skipped:
Debian's package has no AMQP 1.0 module. Everything listens on 127.0.0.1 only, on free ports,
and is stopped at the end (process groups; epmd too if this script caused it to start).

    python bench/amqp.py [--messages 50000] [--size 100] [--runs 3] [--window 300]
                         [--wait-quiet 30] [--json F]

Before each run it waits up to --wait-quiet seconds for the machine to be nearly idle, and it
reports how many cores other processes used during each run (a shared machine skews figures).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parent.parent
LOADGEN_SRC = Path(__file__).resolve().parent / "loadgen"
GATEWAY = ROOT / ".venv" / "bin" / "gateway"
RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")  # the real scripts; /usr/sbin ones su to rabbitmq
QUEUE = "bench-amqp"
START_TIMEOUT = 120.0  # seconds a broker may take to come up
RUN_TIMEOUT = 300.0  # seconds one measured run may take


def say(text: str) -> None:
    """Progress lines go to stderr so that stdout stays the result table."""
    print(text, file=sys.stderr, flush=True)


# -- setup: packages and the load generator ---------------------------------------------------


def have_proton_dev() -> bool:
    return subprocess.run(["pkg-config", "--exists", "libqpid-proton"]).returncode == 0


def have_rabbitmq() -> bool:
    return (RABBIT_BIN / "rabbitmq-server").exists()


def ensure_packages() -> dict[str, bool]:
    """Install what is missing with apt-get (one `update`), saying what happens to each."""
    wanted = {"libqpid-proton11-dev": have_proton_dev, "rabbitmq-server": have_rabbitmq}
    if not shutil.which("pkg-config") or not shutil.which("gcc"):
        wanted = {"gcc": lambda: bool(shutil.which("gcc")), "pkg-config": lambda: False, **wanted}
    status: dict[str, bool] = {}
    updated = False
    for package, present in wanted.items():
        if present():
            say(f"[setup] {package}: present")
            status[package] = True
            continue
        if not shutil.which("apt-get"):
            say(f"[setup] {package}: missing and no apt-get here; skipping what needs it")
            status[package] = False
            continue
        if not updated:
            say("[setup] apt-get update")
            subprocess.run(["apt-get", "update", "-q"], stdout=subprocess.DEVNULL)
            updated = True
        say(f"[setup] {package}: installing with apt-get")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        done = subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", package],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        status[package] = done.returncode == 0 and present()
        if not status[package]:
            say(f"[setup] {package}: install FAILED ({done.stderr.strip()[-300:]})")
    say("[setup] ActiveMQ: skipped, Debian's activemq has no AMQP 1.0 module")
    return status


def build_loadgen(workdir: Path) -> tuple[Path, Path]:
    """Compile send.c and recv.c into workdir: the repository keeps sources, not binaries."""
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "libqpid-proton"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    out = []
    for name in ("send", "recv"):
        binary = workdir / f"amqp-{name}"
        subprocess.run(
            ["gcc", "-O2", "-Wall", "-o", str(binary), str(LOADGEN_SRC / f"{name}.c"), *flags],
            check=True,
        )
        out.append(binary)
    say(f"[setup] load generator built in {workdir}")
    return out[0], out[1]


# -- process helpers --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """pid and every live process below it (redis-server; beam.smp and its helpers)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def tree_cpu(pid: int) -> dict[tuple[int, str], float]:
    """User + sys seconds of each process in the tree under pid, from /proc, keyed by
    (pid, command): per process, so that a saturated single-threaded one shows."""
    out = {}
    for p in descendants(pid):
        try:
            head, tail = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = tail.split()
        out[(p, head.split("(", 1)[1])] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def machine_busy() -> float:
    """Non-idle CPU seconds of the whole machine (/proc/stat): what else ran during a run."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK  # minus idle and iowait


def wait_quiet(limit: float, cores: float = 0.25) -> float:
    """Wait (at most `limit` s) for a 2 s stretch in which the machine is nearly idle: on a
    shared 2-core machine other jobs otherwise decide the figures. Returns the busy cores seen."""
    deadline = time.monotonic() + limit
    while True:
        busy0 = machine_busy()
        time.sleep(2.0)
        seen = (machine_busy() - busy0) / 2.0
        if seen < cores or time.monotonic() > deadline:
            return seen


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One stdout line of proc, or "" on timeout / exit: a hung child must not hang us."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the child's whole process group, SIGKILL what is left after `grace`."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers such as a redis-server child
    proc.wait()


# -- brokers ----------------------------------------------------------------------------------


@dataclass
class Broker:
    name: str
    pid: int  # root of the server process tree whose CPU is counted
    port: int
    address: str  # AMQP 1.0 address of the durable queue


@contextmanager
def gateway(tmp: Path) -> Iterator[Broker]:
    """`gateway serve` (embedded redis-server, AOF everysec) and a durable queue."""
    admin, amqp = free_port(), free_port()
    data = tmp / "gateway"
    argv = [str(GATEWAY), "serve", "--data-dir", str(data), "--admin-port", str(admin),
            "--mqtt-port", "0", "--amqp-port", str(amqp)]  # fmt: skip
    log = (tmp / "gateway.log").open("w")
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while '"ready"' not in (line := read_line(proc, 1.0)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start (log: {tmp / 'gateway.log'})")
        port = json.loads(line)["amqp_port"]
        subprocess.run(
            [str(GATEWAY), "queue", "--admin-url", f"http://127.0.0.1:{admin}", "create", QUEUE],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=60,
        )
        redis_pid = int((data / "redis.pid").read_text())
        if redis_pid not in descendants(proc.pid):
            say(f"[gateway] note: redis-server {redis_pid} is not a child; CPU misses it")
        say(f"[gateway] pid {proc.pid} (redis-server {redis_pid}), AMQP on 127.0.0.1:{port}")
        yield Broker("gateway", proc.pid, port, QUEUE)
    finally:
        stop_group(proc)
        log.close()


def rabbit_env(tmp: Path, node: str, port: int) -> dict[str, str]:
    """Everything of the node under tmp: own cookie (HOME), data, logs, plugins, config."""
    home = tmp / "rabbit-home"
    home.mkdir(exist_ok=True)
    return {
        **os.environ,
        "HOME": str(home),
        "RABBITMQ_NODENAME": node,
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_NODE_PORT": str(port),
        "RABBITMQ_DIST_PORT": str(free_port()),
        "RABBITMQ_MNESIA_BASE": str(tmp / "rabbit-mnesia"),
        "RABBITMQ_LOG_BASE": str(tmp / "rabbit-log"),
        "RABBITMQ_CONFIG_FILE": str(tmp / "rabbitmq.conf"),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(tmp / "advanced.config"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(tmp / "enabled_plugins"),
        "RABBITMQ_PID_FILE": str(tmp / "rabbit.pid"),
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        "ERL_EPMD_ADDRESS": "127.0.0.1",
    }


def rabbitmqctl(env: dict[str, str], node: str, *args: str, timeout: float = 90) -> str:
    done = subprocess.run(
        [str(RABBIT_BIN / "rabbitmqctl"), "-n", node, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode:
        raise RuntimeError(f"rabbitmqctl {args[0]}: {done.stderr.strip() or done.stdout}")
    return done.stdout


@contextmanager
def rabbitmq(tmp: Path) -> Iterator[Broker]:
    """RabbitMQ 3.10 with rabbitmq_amqp1_0 as a child process, and a durable classic queue."""
    port = free_port()
    node = f"bench{secrets.token_hex(3)}@localhost"
    env = rabbit_env(tmp, node, port)
    (tmp / "rabbitmq.conf").write_text(
        f"listeners.tcp.1 = 127.0.0.1:{port}\n"
        "amqp1_0.default_user = guest\n"
        "amqp1_0.default_vhost = /\n"
        "amqp1_0.protocol_strict_mode = false\n"
    )
    subprocess.run(
        [str(RABBIT_BIN / "rabbitmq-plugins"), "enable", "--offline", "rabbitmq_amqp1_0"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    epmd_was_running = port_open(4369)
    log = (tmp / "rabbit-console.log").open("w")
    proc = subprocess.Popen(
        [str(RABBIT_BIN / "rabbitmq-server")],
        env=env,
        cwd=tmp,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not port_open(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rabbitmq did not start (logs: {tmp / 'rabbit-log'})")
            time.sleep(0.5)
        rabbitmqctl(env, node, "await_startup")
        # rabbit_amqqueue:declare(Name, Durable, AutoDelete, Args, Owner, ActingUser)
        out = rabbitmqctl(
            env,
            node,
            "eval",
            f'rabbit_amqqueue:declare(rabbit_misc:r(<<"/">>, queue, <<"{QUEUE}">>), '
            'true, false, [], none, <<"bench">>).',
        )
        listed = rabbitmqctl(env, node, "list_queues", "-q", "name", "durable")
        if not any(line.split() == [QUEUE, "true"] for line in listed.splitlines()):
            raise RuntimeError(f"durable queue not declared: {out.strip()} / {listed.strip()}")
        say(f"[rabbitmq] node {node} pid {proc.pid}, AMQP on 127.0.0.1:{port}")
        yield Broker("rabbitmq", proc.pid, port, f"/amq/queue/{QUEUE}")
    finally:
        with suppress(RuntimeError, subprocess.TimeoutExpired):
            rabbitmqctl(env, node, "stop", timeout=60)
        stop_group(proc)
        log.close()
        if not epmd_was_running and port_open(4369):
            epmd = shutil.which("epmd") or "/usr/lib/erlang/bin/epmd"
            subprocess.run([epmd, "-kill"], env=env, stdout=subprocess.DEVNULL, check=False)
            say("[rabbitmq] stopped epmd (started by this run)")


# -- one measured run -------------------------------------------------------------------------


def wait_rusage(proc: subprocess.Popen, timeout: float) -> tuple[str, float]:
    """Collect proc's stdout and its own user + sys CPU (wait4), within timeout."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    out = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            proc.kill()
            raise RuntimeError("load generator timed out")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            out += chunk.decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return out, usage.ru_utime + usage.ru_stime


def measure(b: Broker, tools: tuple[Path, Path], n: int, size: int, window: int) -> dict:
    """One run: receiver attached first, then the sender; CPU counted from "go" to the end."""
    send, recv = tools
    common = {"stdout": subprocess.PIPE, "text": True}
    receiver = subprocess.Popen(
        [str(recv), "127.0.0.1", str(b.port), b.address, str(n), str(window), "1"], **common
    )
    sender = subprocess.Popen(
        [str(send), "127.0.0.1", str(b.port), b.address, str(n), str(size), str(window), "1"],
        stdin=subprocess.PIPE,
        **common,
    )
    try:
        for proc in (receiver, sender):
            if read_line(proc, 30.0).strip() != "ready":
                raise RuntimeError(f"{b.name}: load generator could not attach")
        cpu0, busy0 = tree_cpu(b.pid), machine_busy()
        go = time.time_ns()
        assert sender.stdin is not None
        sender.stdin.write("go\n")
        sender.stdin.close()
        r_out, r_cpu = wait_rusage(receiver, RUN_TIMEOUT)
        s_out, s_cpu = wait_rusage(sender, RUN_TIMEOUT)
        cpu1, busy1 = tree_cpu(b.pid), machine_busy()
    finally:
        for proc in (receiver, sender):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if not r_out.strip() or not s_out.strip():
        raise RuntimeError(
            f"{b.name}: load generator exited {receiver.returncode}/{sender.returncode}"
        )
    r, s = json.loads(r_out.strip().splitlines()[-1]), json.loads(s_out.strip().splitlines()[-1])
    if r["received"] < n or s["accepted"] < n:
        raise RuntimeError(f"{b.name}: {s} / received {r['received']} of {n}")
    wall = (r["last_ns"] - go) / 1e9
    per_proc: dict[str, float] = {}
    for key, seconds in cpu1.items():
        name = key[1]
        per_proc[name] = per_proc.get(name, 0.0) + seconds - cpu0.get(key, 0.0)
    cpu = sum(per_proc.values())
    return {
        "msgs_per_s": n / wall,
        "send_msgs_per_s": n / ((s["end_ns"] - go) / 1e9),  # all dispositions in
        "p50_ms": r["p50_us"] / 1000,
        "p99_ms": r["p99_us"] / 1000,
        "p999_ms": r["p999_us"] / 1000,
        "server_cpu_us_per_msg": cpu * 1e6 / n,
        "server_cores": cpu / wall,
        "busiest_server_process_cores": max(per_proc.values()) / wall,
        "server_cpu_us_per_msg_by_process": {k: v * 1e6 / n for k, v in per_proc.items()},
        "loadgen_cpu_us_per_msg": (r_cpu + s_cpu) * 1e6 / n,
        "loadgen_cores": (r_cpu + s_cpu) / wall,
        "other_cores": max(0.0, (busy1 - busy0 - cpu - r_cpu - s_cpu) / wall),
    }


# -- report -----------------------------------------------------------------------------------

ROWS = (
    ("msgs_per_s", "messages/s (send -> last receive)", "{:,.0f}"),
    ("send_msgs_per_s", "sender: messages/s acked", "{:,.0f}"),
    ("p50_ms", "latency p50 ms", "{:.2f}"),
    ("p99_ms", "latency p99 ms", "{:.2f}"),
    ("p999_ms", "latency p99.9 ms", "{:.2f}"),
    ("server_cpu_us_per_msg", "server CPU µs/msg", "{:.1f}"),
    ("server_cores", "server cores busy", "{:.2f}"),
    ("busiest_server_process_cores", "busiest server process, cores", "{:.2f}"),
    ("loadgen_cpu_us_per_msg", "load generator CPU µs/msg", "{:.1f}"),
    ("loadgen_cores", "load generator cores busy", "{:.2f}"),
    ("other_cores", "other processes on the machine, cores", "{:.2f}"),
)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def cell(s: dict[str, float], fmt: str) -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def report(args: argparse.Namespace, runs: dict[str, list[dict | None]]) -> dict:
    """Markdown table of medians (min-max); ratios gateway / RabbitMQ are taken per run."""
    ok = {n: [r for r in runs.get(n, []) if r] for n in ("gateway", "rabbitmq")}
    names = [n for n in ok if ok[n]]
    summary = {n: {k: spread([r[k] for r in ok[n]]) for k, _, _ in ROWS} for n in names}
    ratios: dict[str, dict[str, float]] = {}
    if len(names) == 2:
        pairs = [(g, q) for g, q in zip(runs["gateway"], runs["rabbitmq"], strict=False) if g and q]
        for key, _, _ in ROWS:
            values = [g[key] / q[key] for g, q in pairs if q[key] and key != "other_cores"]
            if values:
                ratios[key] = spread(values)
    print(
        f"\nAMQP 1.0 durable queue, {args.messages} x {args.size} B, window {args.window}, "
        f"1 sender + 1 receiver (C, Qpid Proton), median (min-max) of {args.runs} runs\n"
    )
    head = "| metric | " + " | ".join(names) + (" | gateway / rabbitmq |" if ratios else " |")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for key, label, fmt in ROWS:
        cells = [cell(summary[n][key], fmt) for n in names]
        if ratios:
            cells.append(cell(ratios[key], "{:.2f}") if key in ratios else "")
        print(f"| {label} | " + " | ".join(cells) + " |")
    return {
        "messages": args.messages,
        "size": args.size,
        "window": args.window,
        "runs": runs,
        "summary": summary,
        "ratio_gateway_over_rabbitmq": ratios,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--window", type=int, default=300, help="unsettled sends / credit")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=30.0,
        help="seconds to wait at most before each run for other load to pass (0: never)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.size < 32:
        parser.error("--size must be at least 32 (the timestamp lives in the payload)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with `&`
    status = ensure_packages()
    if not status.get("libqpid-proton11-dev"):
        raise SystemExit("no Qpid Proton C library: cannot build the load generator")
    runs: dict[str, list[dict | None]] = {"gateway": [], "rabbitmq": []}
    with tempfile.TemporaryDirectory(prefix="bench-amqp-") as tmp, ExitStack() as stack:
        tools = build_loadgen(Path(tmp))
        brokers = [stack.enter_context(gateway(Path(tmp)))]
        if status.get("rabbitmq-server"):
            try:
                brokers.append(stack.enter_context(rabbitmq(Path(tmp))))
            except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                say(f"[rabbitmq] skipped: {exc}")
        else:
            say("[rabbitmq] skipped: rabbitmq-server is not installed")
        for b in brokers:  # warm-up: connections, code paths, JIT-free but cache-warm
            measure(b, tools, min(2000, args.messages), args.size, args.window)
        for i in range(args.runs):  # alternate so that drift hits both alike
            for b in brokers:
                if args.wait_quiet and (seen := wait_quiet(args.wait_quiet)) >= 0.25:
                    say(f"[run {i + 1}] machine still busy ({seen:.2f} cores); measuring anyway")
                try:
                    r = measure(b, tools, args.messages, args.size, args.window)
                except (RuntimeError, ValueError) as exc:  # one bad run must not hide the rest
                    say(f"[run {i + 1}] {b.name}: FAILED: {exc}")
                    runs[b.name].append(None)
                    continue
                runs[b.name].append(r)
                say(
                    f"[run {i + 1}] {b.name}: {r['msgs_per_s']:,.0f} msg/s, "
                    f"p50 {r['p50_ms']:.2f} ms, server {r['server_cpu_us_per_msg']:.1f} µs/msg, "
                    f"other load {r['other_cores']:.2f} cores"
                )
                if r["other_cores"] > 0.3:
                    say(f"[run {i + 1}] warning: other processes were busy; figures disturbed")
    result = report(args, runs)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
