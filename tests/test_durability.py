"""Durability: `gateway serve` with its embedded Redis, killed with SIGKILL, restarted."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.processes import Proc, serve_argv

pytestmark = pytest.mark.slow

N = 10_000


class Admin:
    """A keep-alive HTTP client for the admin API (runs in a worker thread)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body) if body is not None else None
        self.conn.request(method, path, data, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else None

    def publish_all(self, queue: str, n: int) -> None:
        for i in range(n):
            status, body = self.call(
                "POST", f"/api/v1/queues/{queue}/messages", {"payload": f"{i:05d}"}
            )
            assert status == 200 and body["outcome"] == "ok", body

    def get(self, queue: str, count: int) -> list[dict]:
        status, body = self.call(
            "POST", f"/api/v1/queues/{queue}/get", {"count": count, "timeout_ms": 500}
        )
        assert status == 200, body
        return body


async def start_gateway(data_dir: Path) -> tuple[Proc, Admin]:
    argv = serve_argv(data_dir)
    proc = await Proc.start(argv)
    ready = await proc.wait_event("ready", timeout=30)
    return proc, Admin(ready["admin_port"])


async def test_spooled_messages_survive_sigkill_and_redis_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    gw, admin = await start_gateway(data_dir)
    try:
        status, _ = await asyncio.to_thread(
            admin.call, "POST", "/api/v1/queues", {"name": "durable-q"}
        )
        assert status == 201
        await asyncio.to_thread(admin.publish_all, "durable-q", N)
        # consume and ack the first 1,000 before the crash: they must never come back
        acked: list[str] = []
        while len(acked) < 1000:
            got = await asyncio.to_thread(admin.get, "durable-q", 1000 - len(acked))
            acked += [m["payload"] for m in got]
        assert acked == [f"{i:05d}" for i in range(1000)]
    finally:
        redis_pid = int((data_dir / "redis.pid").read_text())
        gw.kill()
        await gw.proc.wait()
    os.kill(redis_pid, signal.SIGKILL)  # the embedded Redis dies hard as well
    for _ in range(200):
        if not Path(f"/proc/{redis_pid}").exists():
            break
        await asyncio.sleep(0.05)

    gw, admin = await start_gateway(data_dir)  # replays the AOF
    new_redis_pid = int((data_dir / "redis.pid").read_text())
    try:
        rest: list[dict] = []
        while True:
            got = await asyncio.to_thread(admin.get, "durable-q", 1000)
            if not got:
                break
            rest += got
        payloads = [m["payload"] for m in rest]
        assert payloads == [f"{i:05d}" for i in range(1000, N)], "all delivered, in order"
        assert not any(m["redelivered"] for m in rest)
        status, info = await asyncio.to_thread(admin.call, "GET", "/api/v1/queues/durable-q")
        assert info["messages"] == 0 and info["counters"]["acked"] == N
    finally:
        assert await gw.stop() == 0
    assert not Path(f"/proc/{new_redis_pid}").exists(), "SIGTERM stops the embedded Redis too"
