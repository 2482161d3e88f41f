"""Gateway processes for multi-process tests: start, read their JSON lines, kill."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GATEWAY = [sys.executable, "-m", "gateway.cli"]
NODE_DRIVER = [sys.executable, str(Path(__file__).with_name("node_driver.py"))]
# the children's stderr logs, kept for failure reports until the test run ends
_LOGS = tempfile.TemporaryDirectory(prefix="gw-procs-")


def serve_argv(data_dir: Path, *extra: str) -> list[str]:
    """`gateway serve` with its embedded Redis under `data_dir`, every port picked free."""
    return [
        *GATEWAY,
        "serve",
        "--data-dir",
        str(data_dir),
        "--admin-port",
        "0",
        "--mqtt-port",
        "0",
        "--amqp-port",
        "0",
        *extra,
    ]


class Proc:
    """A child whose stdout carries one JSON object per line."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc = proc
        self.log = log  # its stderr, for failure reports
        self.lines: list[dict[str, Any]] = []

    @classmethod
    async def start(
        cls, argv: list[str], env: dict[str, str] | None = None, session: bool = False
    ) -> Proc:
        """`session`: in a process group of its own, as a terminal's job is."""
        fd, name = tempfile.mkstemp(prefix="gw-proc-", suffix=".log", dir=_LOGS.name)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=fd,
                env={**os.environ, **(env or {})},
                cwd=ROOT,
                start_new_session=session,
            )
        finally:
            os.close(fd)
        return cls(proc, Path(name))

    def stderr_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    async def next_line(self, timeout: float = 20.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not raw:
            raise AssertionError(f"process ended: {self.stderr_tail()}")
        line = json.loads(raw)
        self.lines.append(line)
        return line

    async def wait_event(self, event: str, timeout: float = 20.0) -> dict[str, Any]:
        while True:
            line = await self.next_line(timeout)
            if line.get("event") == event:
                return line

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()

    async def stop(self, timeout: float = 15.0) -> int:
        if self.proc.returncode is None:
            self.proc.terminate()
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.proc.kill()
            return await self.proc.wait()


def node_env(ttl: float = 1.0) -> dict[str, str]:
    """Fast failure detection for tests."""
    return {"GATEWAY_HEARTBEAT_S": str(ttl / 5), "GATEWAY_NODE_TTL_S": str(ttl)}
