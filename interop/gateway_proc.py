"""A private `gateway serve` for one interop run, and the admin API calls scenarios need."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

CONFIG = """\
[server]
allow_anonymous = true

[[users]]
name = "alice"
password = "s3cret"
"""


class Gateway:
    """One gateway node on loopback with ephemeral ports, read from its JSON ready line."""

    def __init__(self, repo: Path, workdir: Path) -> None:
        self.repo = repo
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}

    def start(self, timeout: float = 30.0) -> None:
        data = self.workdir / "data"
        shutil.rmtree(data, ignore_errors=True)  # a fresh spool every run
        config = self.workdir / "gateway.toml"
        config.write_text(CONFIG)
        argv = [
            str(self.repo / ".venv/bin/gateway"),
            "serve",
            "--data-dir",
            str(data),
            "--host",
            "127.0.0.1",
            "--mqtt-port",
            "0",
            "--amqp-port",
            "0",
            "--admin-port",
            "0",
            "--config",
            str(config),
        ]
        log = (self.workdir / "gateway.log").open("wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, cwd=self.repo)
        assert self.proc.stdout is not None
        line = _readline(self.proc, timeout)
        ready = json.loads(line)
        if ready.get("event") != "ready":
            raise RuntimeError(f"gateway did not start: {line!r}")
        self.ports = {k: ready[k] for k in ("mqtt_port", "amqp_port", "admin_port")}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One admin API call; raises RuntimeError with the status and body on an error."""
        url = f"http://127.0.0.1:{self.ports['admin_port']}/api/v1/{path}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=15) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{method} {path}: {exc.code} {exc.read()[:300]!r}") from exc

    def create_queue(self, name: str, subscriptions: list[str], **extra: Any) -> None:
        self.admin("POST", "queues", {"name": name, "subscriptions": subscriptions, **extra})


def _readline(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    """First stdout line of `proc`, or RuntimeError after `timeout` seconds."""
    box: list[bytes] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box or not box[0]:
        proc.kill()
        raise RuntimeError("gateway printed no ready line (see gateway.log)")
    return box[0]
