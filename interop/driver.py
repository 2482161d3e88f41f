"""Running one driver action in its client's environment, bounded in time."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

CLIENTS_DIR = Path(__file__).resolve().parent / "clients"
HARD_TIMEOUT = 20.0  # a driver's own timeout is 10 s; this only catches hangs


class DriverError(Exception):
    """The driver crashed, hung or printed something that is not its JSON result."""


class Running:
    """A driver process whose stdout lines arrive on a queue (read by a daemon thread)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def next(self, timeout: float = HARD_TIMEOUT) -> dict[str, Any]:
        """The next JSON line; DriverError on exit, timeout or garbage."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise DriverError(f"no output within {timeout:.0f} s") from None
        if line is None:
            raise DriverError(f"exited without a result: {self.stderr()}")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise DriverError(f"not JSON: {line[:200]!r}; {self.stderr()}") from None

    def wait_ready(self) -> None:
        line = self.next()
        if line.get("event") != "ready":
            self.kill()
            raise DriverError(f"expected a ready line, got {line}")

    def result(self) -> dict[str, Any]:
        out = self.next()
        while out.get("event") == "ready":
            out = self.next()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()
        return out

    def stderr(self) -> str:
        self.kill()
        assert self.proc.stderr is not None
        return self.proc.stderr.read()[-800:]

    def kill(self) -> None:
        """Kill the driver's whole process group (mosquitto_sub, receive.c ... included)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def start(command: list[str], env: dict[str, str], driver: str, args: dict[str, Any]) -> Running:
    return Running([*command, str(CLIENTS_DIR / driver), json.dumps(args)], env)
