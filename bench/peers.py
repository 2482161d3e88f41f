"""The brokers under test: start each on free 127.0.0.1 ports, measure it from /proc, stop it.

The gateway runs as `gateway serve` (embedded redis-server, AOF everysec); the peers are the
Debian packages: Mosquitto 2.0 (MQTT), RabbitMQ 3.10 (AMQP 1.0 + MQTT plugins) and ActiveMQ
5.17 (MQTT only: Debian's package has no AMQP 1.0 module). A missing peer is installed with
apt-get (sudo when not root) or skipped with a line saying why. Every broker runs in its own
process group and is stopped with it; epmd too when this run caused it to start.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
ROOT = Path(__file__).resolve().parent.parent
GATEWAY = ROOT / ".venv" / "bin" / "gateway"
RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")  # the real scripts; /usr/sbin ones su to rabbitmq
ACTIVEMQ_HOME = Path("/usr/share/activemq")
ACTIVEMQ_JARS = {  # Debian package -> jars its MQTT connector needs in ActiveMQ's lib dir
    "libmqtt-client-java": ["mqtt-client.jar"],
    "libhawtdispatch-java": ["hawtdispatch.jar", "hawtdispatch-transport.jar"],
}
START_TIMEOUT = 120.0  # seconds a broker may take to come up
NO_AMQP_ACTIVEMQ = "ActiveMQ: no AMQP 1.0 comparison: Debian's activemq package has no AMQP module"


def say(text: str) -> None:
    """Progress lines go to stderr: stdout stays the result table."""
    print(text, file=sys.stderr, flush=True)


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


def stat_cpu(stat: str) -> float:
    """User + sys seconds in a /proc/<pid>/stat line, with those of the process's children
    that exited and were waited for (cutime + cstime): a helper that starts and ends within
    a run, such as redis-server's AOF rewrite child, is the broker's work too."""
    utime, stime, cutime, cstime = (int(v) for v in stat.rsplit(")", 1)[1].split()[11:15])
    return (utime + stime + cutime + cstime) / TICK


def process_cpu(pid: int) -> float:
    """stat_cpu of one process."""
    return stat_cpu(Path(f"/proc/{pid}/stat").read_text())


def tree_cpu(pid: int) -> dict[tuple[int, str], float]:
    """stat_cpu of each process under pid, keyed by (pid, command): per process, so that a
    saturated single-threaded one shows."""
    out = {}
    for p in descendants(pid):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[(p, stat.split("(", 1)[1].rsplit(")", 1)[0])] = stat_cpu(stat)
    return out


def tree_rss(pid: int) -> dict[str, float]:
    """Resident MB per command name of the processes under pid."""
    out: dict[str, float] = {}
    for p in descendants(pid):
        try:
            name = Path(f"/proc/{p}/stat").read_text().split("(", 1)[1].rsplit(")", 1)[0]
            pages = int(Path(f"/proc/{p}/statm").read_text().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[name] = out.get(name, 0.0) + pages * PAGE / 1e6
    return out


def machine_busy() -> float:
    """Non-idle CPU seconds of the whole machine (/proc/stat): what else ran during a run."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK  # minus idle and iowait


def wait_quiet(limit: float, cores: float = 0.25) -> float:
    """Wait (at most `limit` s) for a 1 s stretch in which the machine is nearly idle: on a
    shared 2-core machine other jobs otherwise decide the figures. Returns the busy cores seen."""
    deadline = time.monotonic() + limit
    while True:
        busy0 = machine_busy()
        time.sleep(1.0)
        seen = machine_busy() - busy0
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


def many_files() -> None:
    """preexec_fn: raise the open-files limit to its hard limit (10,000 idle connections)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def spawn(argv: list[str], log: Path, stdout: int | None = None, **kw: object) -> subprocess.Popen:
    """A broker in its own process group, output to log, with many open files allowed."""
    with log.open("w") as out:
        return subprocess.Popen(
            argv,
            stdout=out if stdout is None else stdout,
            stderr=out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=many_files,
            **kw,
        )


def wait_port(proc: subprocess.Popen, port: int, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not port_open(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.2)


# -- packages ---------------------------------------------------------------------------------


def apt_get(*args: str) -> subprocess.CompletedProcess:
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(
        [*sudo, "apt-get", *args], env=env, capture_output=True, text=True, timeout=900
    )


def ensure_packages(wanted: dict[str, Callable[[], bool]]) -> dict[str, bool]:
    """Install each missing package with apt-get (one `update`), saying what happens."""
    status: dict[str, bool] = {}
    updated = False
    for package, present in wanted.items():
        if present():
            status[package] = True
            continue
        if not shutil.which("apt-get"):
            say(f"[setup] {package}: missing and no apt-get here: skipping what needs it")
            status[package] = False
            continue
        if not updated:
            say("[setup] apt-get update")
            apt_get("update", "-q")
            updated = True
        say(f"[setup] {package}: installing with apt-get")
        done = apt_get("install", "-y", "-q", "--no-install-recommends", package)
        status[package] = done.returncode == 0 and present()
        if not status[package]:
            say(f"[setup] {package}: install FAILED ({done.stderr.strip()[-300:]})")
    return status


def activemq_mqtt_jars(workdir: Path) -> bool:
    """Put the jars ActiveMQ's MQTT connector needs into its lib dir (`apt-get download` +
    unpack: Debian's activemq does not depend on them)."""
    lib = ACTIVEMQ_HOME / "lib"
    for package, jars in ACTIVEMQ_JARS.items():
        if all((lib / j).exists() for j in jars):
            continue
        say(f"[setup] ActiveMQ MQTT: fetching {package} jars into {lib}")
        got = subprocess.run(
            ["apt-get", "download", package], cwd=workdir, capture_output=True, timeout=300
        )
        debs = sorted(workdir.glob(f"{package}_*.deb"))
        if got.returncode or not debs:
            say(f"[setup] apt-get download {package} FAILED: {got.stderr.decode()[-200:]}")
            return False
        unpacked = workdir / package
        subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(unpacked)], check=True)
        sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
        jars_from = [str(unpacked / "usr/share/java" / jar) for jar in jars]
        if subprocess.run([*sudo, "cp", *jars_from, str(lib)], timeout=60).returncode:
            say(f"[setup] could not copy {package} jars into {lib}")
            return False
    return True


# -- brokers ----------------------------------------------------------------------------------


@dataclass
class Broker:
    """A started broker: where it listens, whose CPU counts, and how to make queues on it."""

    name: str
    pid: int  # root of the server process tree whose CPU is counted
    mqtt_port: int | None = None
    amqp_port: int | None = None
    amqp_sasl: bool = False  # RabbitMQ needs a SASL layer (ANONYMOUS)
    # declare(names, topic, partitions): durable queues, each subscribed to / bound to the
    # MQTT topic when one is given; returns their AMQP addresses
    declare: Callable[[list[str], str | None, int], list[str]] | None = None
    delete: Callable[[list[str]], None] | None = None
    # wait_assigned(names): return once every partition of these queues has a consumer
    # (the gateway hands partitions out after the queue's rebalance delay)
    wait_assigned: Callable[[list[str]], None] | None = None
    notes: list[str] = field(default_factory=list)


def http_json(method: str, url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"content-type": "application/json"}, method=method)
    with urllib.request.urlopen(req, timeout=60) as resp:
        text = resp.read()
    return json.loads(text) if text else {}


def gateway_env() -> dict[str, str]:
    """The environment that runs this checkout's gateway code, even when the virtualenv's
    editable install points at another checkout (a worktree sharing one .venv)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@contextmanager
def gateway(tmp: Path) -> Iterator[Broker]:
    """`gateway serve` (embedded redis-server, AOF everysec) with MQTT, AMQP and admin."""
    data = tmp / "gateway"
    argv = [str(GATEWAY), "serve", "--data-dir", str(data), "--admin-port", str(free_port()),
            "--mqtt-port", str(free_port()), "--amqp-port", str(free_port())]  # fmt: skip
    proc = spawn(
        argv, tmp / "gateway.log", stdout=subprocess.PIPE, text=True, cwd=ROOT, env=gateway_env()
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while '"ready"' not in (line := read_line(proc, 1.0)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start (log: {tmp / 'gateway.log'})")
        ready = json.loads(line)
        admin = f"http://127.0.0.1:{ready['admin_port']}/api/v1/queues"
        redis_pid = int((data / "redis.pid").read_text())
        if redis_pid not in descendants(proc.pid):
            say(f"[gateway] note: redis-server {redis_pid} is not a child; CPU misses it")

        def declare(names: list[str], topic: str | None, partitions: int) -> list[str]:
            for name in names:
                body: dict = {"name": name, "access_type": "non-exclusive"}
                if partitions:
                    body["partition_count"] = partitions
                if topic:
                    body["subscriptions"] = [{"pattern": topic, "syntax": "mqtt"}]
                http_json("POST", admin, body)
            return names

        def delete(names: list[str]) -> None:
            for name in names:
                with suppress(OSError):
                    http_json("DELETE", f"{admin}/{name}")

        def wait_assigned(names: list[str]) -> None:
            deadline = time.monotonic() + START_TIMEOUT
            for name in names:
                while not all(
                    p["owner"] for p in http_json("GET", f"{admin}/{name}")["partitions"]
                ):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"partitions of {name} not assigned")
                    time.sleep(0.05)

        say(f"[gateway] pid {proc.pid} (redis-server {redis_pid}), {ready}")
        yield Broker(
            "gateway",
            proc.pid,
            mqtt_port=ready["mqtt_port"],
            amqp_port=ready["amqp_port"],
            declare=declare,
            delete=delete,
            wait_assigned=wait_assigned,
        )
    finally:
        stop_group(proc)


@contextmanager
def mosquitto(tmp: Path) -> Iterator[Broker]:
    """Debian's mosquitto; `max_queued_messages 0`: its default 1000 drops QoS 1 under load;
    `set_tcp_nodelay`: without it Nagle's algorithm adds ~40 ms to its tail latencies."""
    port = free_port()
    conf = tmp / "mosquitto.conf"
    conf.write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\n"
        "max_connections -1\nset_tcp_nodelay true\n"
    )
    proc = spawn([shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(conf)],
                 tmp / "mosquitto.log")  # fmt: skip
    try:
        wait_port(proc, port, "mosquitto")
        say(f"[mosquitto] pid {proc.pid}, MQTT on 127.0.0.1:{port}")
        yield Broker("mosquitto", proc.pid, mqtt_port=port)
    finally:
        stop_group(proc)


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
    """RabbitMQ 3.10 with rabbitmq_amqp1_0 and rabbitmq_mqtt; queues bound to amq.topic."""
    port, mqtt = free_port(), free_port()
    node = f"bench{secrets.token_hex(3)}@localhost"
    env = rabbit_env(tmp, node, port)
    (tmp / "rabbitmq.conf").write_text(
        f"listeners.tcp.1 = 127.0.0.1:{port}\n"
        f"mqtt.listeners.tcp.1 = 127.0.0.1:{mqtt}\n"
        "mqtt.allow_anonymous = true\n"
        "amqp1_0.default_user = guest\n"
        "amqp1_0.default_vhost = /\n"
        "amqp1_0.protocol_strict_mode = false\n"
        "loopback_users = none\n"
    )
    subprocess.run(
        [str(RABBIT_BIN / "rabbitmq-plugins"), "enable", "--offline", "rabbitmq_amqp1_0",
         "rabbitmq_mqtt"],
        env=env, check=True, stdout=subprocess.DEVNULL, timeout=120,
    )  # fmt: skip
    epmd_was_running = port_open(4369)
    proc = spawn([str(RABBIT_BIN / "rabbitmq-server")], tmp / "rabbit-console.log", env=env,
                 cwd=tmp)  # fmt: skip
    try:
        wait_port(proc, port, f"rabbitmq (logs: {tmp / 'rabbit-log'})")
        rabbitmqctl(env, node, "await_startup")
        wait_port(proc, mqtt, "rabbitmq mqtt listener")

        def declare(names: list[str], topic: str | None, partitions: int) -> list[str]:
            # rabbit_amqqueue:declare(Name, Durable, AutoDelete, Args, Owner, ActingUser);
            # an MQTT topic a/b is the routing key a.b on amq.topic (+ -> *, # stays #)
            key = (topic or "").replace("/", ".").replace("+", "*")
            exprs = []
            for name in names:
                q = f'rabbit_misc:r(<<"/">>, queue, <<"{name}">>)'
                exprs.append(f'rabbit_amqqueue:declare({q}, true, false, [], none, <<"bench">>)')
                if topic:
                    x = 'rabbit_misc:r(<<"/">>, exchange, <<"amq.topic">>)'
                    exprs.append(
                        f'ok = rabbit_binding:add({{binding, {x}, <<"{key}">>, {q}, []}}, '
                        '<<"bench">>)'
                    )
            rabbitmqctl(env, node, "eval", ", ".join(exprs) + ".")
            listed = rabbitmqctl(env, node, "list_queues", "-q", "name", "durable")
            missing = set(names) - {ln.split()[0] for ln in listed.splitlines() if ln.strip()}
            if missing:
                raise RuntimeError(f"rabbitmq: queues not declared: {sorted(missing)}")
            return [f"/amq/queue/{n}" for n in names]

        def delete(names: list[str]) -> None:
            exprs = [
                f'rabbit_amqqueue:delete(element(2, rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, '
                f'queue, <<"{n}">>))), false, false, <<"bench">>)'
                for n in names
            ]
            with suppress(RuntimeError, subprocess.TimeoutExpired):
                rabbitmqctl(env, node, "eval", ", ".join(exprs) + ".")

        say(f"[rabbitmq] node {node} pid {proc.pid}, AMQP 127.0.0.1:{port}, MQTT :{mqtt}")
        yield Broker(
            "rabbitmq",
            proc.pid,
            mqtt_port=mqtt,
            amqp_port=port,
            amqp_sasl=True,
            declare=declare,
            delete=delete,
        )
    finally:
        with suppress(RuntimeError, subprocess.TimeoutExpired):
            rabbitmqctl(env, node, "stop", timeout=60)
        stop_group(proc)
        if not epmd_was_running and port_open(4369):
            epmd = shutil.which("epmd") or "/usr/lib/erlang/bin/epmd"
            subprocess.run([epmd, "-kill"], env=env, stdout=subprocess.DEVNULL, check=False)
            say("[rabbitmq] stopped epmd (started by this run)")


ACTIVEMQ_XML = """<beans xmlns="http://www.springframework.org/schema/beans"
  xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"
  xsi:schemaLocation="http://www.springframework.org/schema/beans
  http://www.springframework.org/schema/beans/spring-beans-2.0.xsd
  http://activemq.apache.org/schema/core
  http://activemq.apache.org/schema/core/activemq-core.xsd">
  <broker xmlns="http://activemq.apache.org/schema/core" useJmx="false" brokerName="bench"
          dataDirectory="{data}" persistent="true">
    <persistenceAdapter><kahaDB directory="{data}/kahadb"/></persistenceAdapter>
    <transportConnectors>
      <transportConnector name="mqtt" uri="mqtt://127.0.0.1:{port}?maximumConnections=20000&amp;transport.tcpNoDelay=true"/>
    </transportConnectors>
  </broker>
</beans>
"""


@contextmanager
def activemq(tmp: Path) -> Iterator[Broker]:
    """ActiveMQ 5.17 (Debian) with one MQTT connector and KahaDB persistence, run as
    `java -jar activemq.jar start` with its base, conf and data under tmp."""
    port, base = free_port(), tmp / "activemq"
    (base / "data").mkdir(parents=True)
    (base / "activemq.xml").write_text(ACTIVEMQ_XML.format(data=base / "data", port=port))
    java = shutil.which("java") or "java"
    argv = [java, "-Xms512M", "-Xmx512M", f"-Dactivemq.home={ACTIVEMQ_HOME}",
            f"-Dactivemq.base={base}", f"-Dactivemq.conf={base}",
            f"-Dactivemq.data={base / 'data'}", "-jar", str(ACTIVEMQ_HOME / "bin/activemq.jar"),
            "start", f"xbean:file:{base / 'activemq.xml'}"]  # fmt: skip
    proc = spawn(argv, tmp / "activemq.log", cwd=base)
    try:
        wait_port(proc, port, f"activemq (log: {tmp / 'activemq.log'})")
        say(f"[activemq] pid {proc.pid}, MQTT on 127.0.0.1:{port}; {NO_AMQP_ACTIVEMQ}")
        yield Broker("activemq", proc.pid, mqtt_port=port, notes=[NO_AMQP_ACTIVEMQ])
    finally:
        stop_group(proc)


def have_rabbitmq() -> bool:
    return (RABBIT_BIN / "rabbitmq-server").exists()


def have_mosquitto() -> bool:
    return bool(shutil.which("mosquitto") or Path("/usr/sbin/mosquitto").exists())


def have_activemq() -> bool:
    return (ACTIVEMQ_HOME / "bin/activemq.jar").exists() and bool(shutil.which("java"))


PEERS: dict[str, tuple[str, Callable[[], bool], Callable[[Path], object]]] = {
    # name -> (Debian package, installed?, context manager)
    "mosquitto": ("mosquitto", have_mosquitto, mosquitto),
    "rabbitmq": ("rabbitmq-server", have_rabbitmq, rabbitmq),
    "activemq": ("activemq", have_activemq, activemq),
}
