"""`gateway serve` provisioning the queues of its TOML file (the file's other refusals:
tests/test_config.py)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gateway.broker import Broker
from gateway.engine.queues import QueueConfig
from tests.processes import GATEWAY, Proc, node_env


def serve(config: Path, redis_url: str) -> list[str]:
    return [
        *GATEWAY, "serve", "--config", str(config), "--redis-url", redis_url,
        "--admin-port", "0", "--mqtt-port", "0", "--amqp-port", "0",
    ]  # fmt: skip


async def ready_or_exit(gw: Proc, timeout: float = 20.0) -> dict[str, Any] | int:
    """The node's ready line, or its exit code if it ended before."""
    assert gw.proc.stdout is not None
    while True:
        raw = await asyncio.wait_for(gw.proc.stdout.readline(), timeout)
        if not raw:
            return await asyncio.wait_for(gw.proc.wait(), timeout)
        line = json.loads(raw)
        if line.get("event") == "ready":
            return line


def admin_call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/v1{path}",
        json.dumps(body).encode() if body is not None else None,
        method=method,
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    return status, json.loads(raw) if raw else None


# --- [[queues]] at start ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        # exists (made by an earlier start, or through the admin API) as non-exclusive
        ('name = "orders"\naccess_type = "exclusive"\nsubscriptions = ["orders/>"]\n', "orders"),
        # read before Redis is reached (tests/test_config.py has the other cases)
        ('name = "orders2"\nsubscriptions = "orders/>"\n', "subscriptions"),
    ],
    ids=["exists-with-other-properties", "subscriptions-as-a-string"],
)
async def test_a_provisioned_queue_the_node_cannot_make_is_one_clear_line(
    tmp_path: Path, redis_url: str, broker: Broker, spec: str, named: str
) -> None:
    """Reported as every other bad setting is (tests/test_serve.py): exit code 2 and one
    `gateway: ...` line naming the problem, not a Python traceback and exit code 1."""
    await broker.declare_queue(QueueConfig(name="orders"), [("orders/>", "smf")])
    config = tmp_path / "g.toml"
    config.write_text("[[queues]]\n" + spec)
    gw = await Proc.start(serve(config, redis_url))
    try:
        outcome = await ready_or_exit(gw)
    finally:
        await gw.stop()
    text = gw.log.read_text(errors="replace")
    assert outcome == 2 and "Traceback" not in text, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("gateway: ") and named in last, last


async def test_a_run_time_setting_changed_in_the_file_is_kept_as_stored_and_named(
    tmp_path: Path, redis_url: str
) -> None:
    """The file provisions the queue; an operator raises max_spool_bytes in it and restarts
    the node. Run-time settings are PATCH's to change (a restart must not undo one), so the
    stored limit holds, and the node's warning says so: it once kept it silently."""
    config = tmp_path / "g.toml"
    base = '[[queues]]\nname = "orders"\nsubscriptions = ["orders/>"]\n'
    config.write_text(base + "max_spool_bytes = 1000\n")
    gw = await Proc.start(serve(config, redis_url))
    ready = await ready_or_exit(gw)
    assert isinstance(ready, dict), gw.stderr_tail()
    assert await gw.stop() == 0

    config.write_text(base + "max_spool_bytes = 5000000\n")
    gw = await Proc.start(serve(config, redis_url))
    try:
        ready = await ready_or_exit(gw)
        assert isinstance(ready, dict), gw.stderr_tail()
        status, body = await asyncio.to_thread(
            admin_call, ready["admin_port"], "GET", "/queues/orders"
        )
    finally:
        await gw.stop()
    assert status == 200 and body["max_spool_bytes"] == 1000, (status, body)
    warning = "keeps its stored max_spool_bytes=1000 (the file: 5000000)"
    assert warning in gw.log.read_text(errors="replace"), gw.stderr_tail(5)


async def test_a_deny_pattern_mqtt_cannot_read_is_a_topic_name_and_said_so(
    tmp_path: Path, redis_url: str
) -> None:
    """An AMQP topic may hold '+' or '#' (`c++/releases`): a rule denying it is valid, and
    denies that name only. The node starts, and says so, should a filter have been meant.
    So with a user name with ':', which logs in over MQTT and AMQP but not to the admin API
    (HTTP Basic, RFC 7617 §2)."""
    config = tmp_path / "g.toml"
    config.write_text(
        '[[acl]]\nuser = "bob"\ndeny_publish = ["c++/releases", "a/#"]\n'
        '[[users]]\nname = "shop:alice"\npassword = "pw"\n'
    )
    gw = await Proc.start(serve(config, redis_url))
    try:
        ready = await ready_or_exit(gw)
    finally:
        await gw.stop()
    assert isinstance(ready, dict), gw.stderr_tail()
    log = gw.log.read_text(errors="replace")
    assert "'c++/releases' of user 'bob' is no MQTT filter" in log, gw.stderr_tail(5)
    assert "'a/#'" not in log
    assert "'shop:alice' has ':'" in log, gw.stderr_tail(5)


async def test_a_node_starts_again_after_its_provisioned_queue_was_repartitioned(
    tmp_path: Path, redis_url: str
) -> None:
    """README, admin API: PATCH changes partition_count at run time, and a declaration is
    refused (409) only for other properties than 'the run-time settings PATCH changes'.
    The README's own [[queues]] example has partition_count = 4. After the operator
    repartitions the queue as documented, the node no longer starts with its unchanged
    file: provisioning compares partition_count and dies with a QueueError traceback."""
    config = tmp_path / "g.toml"
    config.write_text(
        '[[queues]]\nname = "orders"\npartition_count = 2\nsubscriptions = ["orders/>"]\n'
    )
    gw = await Proc.start(serve(config, redis_url))
    ready = await ready_or_exit(gw)
    assert isinstance(ready, dict), gw.stderr_tail()
    try:
        port = ready["admin_port"]
        for change in ({"egress_enabled": False}, {"partition_count": 4}, {"egress_enabled": True}):
            status, body = await asyncio.to_thread(
                admin_call, port, "PATCH", "/queues/orders", change
            )
            assert status == 200, (change, status, body)
        # the POST the README documents: 200 for a queue equal but for run-time settings
        status, body = await asyncio.to_thread(
            admin_call, port, "POST", "/queues",
            {"name": "orders", "partition_count": 2, "subscriptions": ["orders/>"]},
        )  # fmt: skip
        post_status = status
    finally:
        assert await gw.stop() == 0

    gw = await Proc.start(serve(config, redis_url))
    try:
        outcome = await ready_or_exit(gw)
    finally:
        await gw.stop()
    assert isinstance(outcome, dict), (outcome, gw.stderr_tail(1))
    assert post_status == 200, (post_status, body)


async def test_a_non_durable_queue_of_the_file_outlives_the_crashed_node_before(
    tmp_path: Path, redis_url: str
) -> None:
    """A node killed and started again before its TTL passes declares its file's non-durable
    queue while the dead node still owns it: the queue stays when the dead node is reaped
    (it was deleted with it, and the node ran on without the queue its file declares)."""
    config = tmp_path / "g.toml"
    config.write_text('[[queues]]\nname = "scratch"\ndurable = false\nsubscriptions = ["s/>"]\n')
    env = node_env(1.0)
    gw = await Proc.start(serve(config, redis_url), env=env)
    ready = await ready_or_exit(gw)
    assert isinstance(ready, dict), gw.stderr_tail()
    gw.kill()  # SIGKILL: the queue stays until the node is presumed dead and reaped
    await gw.proc.wait()
    gw = await Proc.start(serve(config, redis_url), env=env)
    try:
        ready = await ready_or_exit(gw)
        assert isinstance(ready, dict), gw.stderr_tail()
        port = ready["admin_port"]
        await asyncio.sleep(3.0)  # past the killed node's TTL (1 s) and its reaping
        status, body = await asyncio.to_thread(admin_call, port, "GET", "/queues/scratch")
        assert status == 200, (status, body)
        assert body["owner_node"] == ready["node"], body
    finally:
        await gw.stop()
