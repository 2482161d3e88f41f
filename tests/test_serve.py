"""`gateway serve` as users run it: embedded Redis, external Redis, clean errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from proton import Message as AmqpMessage
from proton.utils import BlockingConnection

from gateway.cpus import split
from gateway.engine.library import MIN_REDIS, parse_version, redacted
from gateway.redis_server import memory_limit
from tests.conftest import free_port
from tests.processes import GATEWAY, Proc, serve_argv
from tests.test_mqtt_paho import V311, Client

pytestmark = pytest.mark.slow


async def test_sigint_stops_node_and_embedded_redis(tmp_path: Path) -> None:
    data_dir = tmp_path / "d"
    gw = await Proc.start(serve_argv(data_dir, "--appendfsync", "always"))
    ready = await gw.wait_event("ready")
    assert ready["redis_url"].startswith("unix://")
    redis_pid = int((data_dir / "redis.pid").read_text())
    assert (
        "appendonly.aof" in " ".join(os.listdir(data_dir)) or (data_dir / "appendonlydir").is_dir()
    )
    embedded = redis.Redis(unix_socket_path=str(data_dir / "redis.sock"), decode_responses=True)
    limits = {**embedded.config_get("maxmemory"), **embedded.config_get("maxmemory-policy")}
    embedded.close()
    assert limits == {"maxmemory": str(memory_limit(40)), "maxmemory-policy": "noeviction"}
    gw.proc.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(gw.proc.wait(), 20) == 0
    assert not Path(f"/proc/{redis_pid}").exists(), "no orphaned redis-server"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "unit-stop"])
async def test_a_signal_to_the_whole_process_group_stops_the_node_cleanly(
    tmp_path: Path, sig: int
) -> None:
    """A terminal's Ctrl-C, or a service manager's stop of the whole unit, reaches every
    process of the group: the node still ends its consumers with Redis there, and exits 0."""
    gw = await Proc.start(serve_argv(tmp_path / "d"), session=True)
    ready = await gw.wait_event("ready")
    conn = None
    try:
        conn = await asyncio.to_thread(_consume_unsettled, ready["admin_port"], ready["amqp_port"])
    finally:
        os.killpg(gw.proc.pid, sig)
        assert await asyncio.wait_for(gw.proc.wait(), 20) == 0
        if conn is not None:
            with contextlib.suppress(Exception):  # the node is gone: it may not answer
                conn.close()
    assert "Traceback" not in gw.log.read_text(errors="replace"), gw.stderr_tail()


def _consume_unsettled(admin_port: int, port: int) -> BlockingConnection:
    """A queue, and a consumer that holds its messages unsettled (left open)."""
    create = urllib.request.Request(
        f"http://127.0.0.1:{admin_port}/api/v1/queues", json.dumps({"name": "held"}).encode()
    )
    urllib.request.urlopen(create, timeout=10).close()
    conn = BlockingConnection(f"127.0.0.1:{port}", timeout=10)
    conn.create_sender("held").send(AmqpMessage(body=b"x", durable=True))
    receiver = conn.create_receiver("held", credit=5)
    receiver.receive(5)
    return conn


async def test_an_embedded_redis_that_dies_is_started_again(tmp_path: Path) -> None:
    """Killed as the kernel's OOM killer would, the embedded redis-server is started again
    with what its AOF holds; the node runs on and its clients carry on."""
    data_dir = tmp_path / "d"
    gw = await Proc.start(serve_argv(data_dir, "--appendfsync", "always"))
    port = (await gw.wait_event("ready"))["mqtt_port"]

    def keep(topic: str) -> None:
        keeper = Client(port, V311, "keeper", clean=False)
        try:
            keeper.subscribe(topic, 1)
        finally:
            keeper.close()

    def publish(payload: bytes) -> None:
        """Until acked: a publish the node could not store while Redis was away gets no
        PUBACK (its connection closes), so the client sends it again, as clients do."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                pub = Client(port, V311, "pub")
            except (TimeoutError, OSError):
                time.sleep(0.1)
                continue
            try:
                if pub.publish("kept/a", payload, 1).is_published():
                    return
            except RuntimeError:  # paho: closed before its PUBACK came; send it again
                time.sleep(0.1)
            finally:
                pub.close()
        raise AssertionError(f"{payload!r} never acked:\n{gw.stderr_tail()}")

    def receive(n: int) -> list[bytes]:
        keeper = Client(port, V311, "keeper", clean=False)
        try:
            return [m.payload for m in keeper.receive(n)]
        finally:
            keeper.close()

    try:
        await asyncio.to_thread(keep, "kept/#")
        await asyncio.to_thread(publish, b"before")
        first = int((data_dir / "redis.pid").read_text())
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while (data_dir / "redis.pid").read_text().strip() in ("", str(first)):
            assert time.monotonic() < deadline, gw.stderr_tail()
            await asyncio.sleep(0.05)
        await asyncio.to_thread(publish, b"after")
        assert await asyncio.to_thread(receive, 2) == [b"before", b"after"]
        assert gw.proc.returncode is None
        assert "starting it again" in gw.stderr_tail()
    finally:
        assert await gw.stop() == 0, gw.stderr_tail()


@pytest.mark.parametrize(
    ("cpus", "halves"),
    [
        ({0}, None),
        ({0, 1}, ({0}, {1})),
        ({4, 2, 7}, ({2}, {4, 7})),
        ({0, 1, 2, 3}, ({0, 1}, {2, 3})),
    ],
)
def test_cpu_halves(cpus: set[int], halves: tuple[set[int], set[int]] | None) -> None:
    assert split(cpus) == halves


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
async def test_node_and_embedded_redis_run_on_separate_cpus(tmp_path: Path) -> None:
    """By default the node keeps to the first half of its CPUs and its redis-server (every
    thread of it) to the second; --no-pin-cpus leaves both on all of them."""
    mine = os.sched_getaffinity(0)
    for argv, expected in (([], split(mine)), (["--no-pin-cpus"], (mine, mine))):
        data_dir = tmp_path / f"d{len(argv)}"
        gw = await Proc.start(serve_argv(data_dir, *argv))
        await gw.wait_event("ready")
        redis_pid = int((data_dir / "redis.pid").read_text())
        threads = [int(t) for t in os.listdir(f"/proc/{redis_pid}/task")]
        redis_cpus = {frozenset(os.sched_getaffinity(t)) for t in threads}
        assert os.sched_getaffinity(gw.proc.pid) == expected[0], argv
        assert redis_cpus == {frozenset(expected[1])}, argv  # every thread of it
        assert await gw.stop() == 0


async def test_external_redis_url(tmp_path: Path, redis_url: str) -> None:
    data_dir = tmp_path / "unused"
    gw = await Proc.start(serve_argv(data_dir, "--redis-url", redis_url))
    ready = await gw.wait_event("ready")
    assert ready["redis_url"] == redis_url
    assert not data_dir.exists(), "no embedded Redis with --redis-url"
    assert await gw.stop() == 0


async def test_missing_redis_server_is_one_clear_line(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path)}  # no redis-server on this PATH
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--data-dir",
        str(tmp_path / "d"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "apt-get install redis-server" in lines[0], lines


async def test_an_unwritable_data_dir_is_one_clear_line_with_redis_server_s_reason() -> None:
    """redis-server cannot open its log file there and says so on stderr before it exits:
    that reason is in the line. /sys/kernel is a directory no one may create files in,
    root included (root writes in a directory chmod-ed read-only)."""
    proc = await asyncio.create_subprocess_exec(
        *serve_argv(Path("/sys/kernel")),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    text = err.decode()
    assert proc.returncode == 2 and len(text.strip().splitlines()) == 1, text
    assert "redis-server exited with code 1" in text, text
    assert "Can't open the log file" in text, text


async def test_bad_config_is_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "g.toml"
    bad.write_text("[server]\nmqtt_prot = 1\n")
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "serve",
        "--config",
        str(bad),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert "mqtt_prot" in err.decode() and len(err.decode().strip().splitlines()) == 1


@pytest.mark.parametrize("password", [None, "s3cret-pw"], ids=["refused", "with-password"])
async def test_a_redis_out_of_reach_is_one_clear_line_without_its_password(
    password: str | None,
) -> None:
    port = free_port()  # nothing listens there
    auth = f":{password}@" if password else ""
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "serve",
        "--redis-url",
        f"redis://{auth}127.0.0.1:{port}/0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    text = err.decode()
    assert proc.returncode == 2, text
    assert "cannot use Redis at" in text and len(text.strip().splitlines()) == 1, text
    if password:
        assert password not in text + out.decode() and ":***@" in text


async def test_a_redis_url_redis_cannot_read_is_one_clear_line() -> None:
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "serve",
        "--redis-url",
        "redis://:pw@127.0.0.1:noport/0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    text = err.decode()
    assert proc.returncode == 2 and len(text.strip().splitlines()) == 1, text
    assert "cannot use Redis at" in text and "pw" not in text


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://user:pw@h/0?db=1", "redis://user:***@h/0?db=1"),
        ("redis://h:1/0?password=pw&db=1", "redis://h:1/0?password=***&db=1"),
        ("unix:///tmp/r.sock?db=0", "unix:///tmp/r.sock?db=0"),
        ("redis://:p#a?b/c@h:1/0", "redis://:***@h:1/0"),  # not %-encoded, as people write
    ],
)
def test_a_redis_url_is_shown_without_its_password(url: str, shown: str) -> None:
    assert redacted(url) == shown


def test_redis_version_gate() -> None:
    assert parse_version("6.2.14")[:2] < MIN_REDIS
    assert parse_version("7.0.15")[:2] >= MIN_REDIS
    assert parse_version("7.2.4")[:2] >= MIN_REDIS
