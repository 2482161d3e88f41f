"""A private `gateway serve` for one interop run, and the admin API calls scenarios need."""

from __future__ import annotations

import base64
import json
import shutil
import socket
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

[[users]]
name = "operator"
password = "interop-admin"
admin = true
"""
ADMIN_AUTH = "Basic " + base64.b64encode(b"operator:interop-admin").decode()


def make_cert(directory: Path) -> Path:
    """A self-signed certificate for 127.0.0.1 and localhost (key.pem beside it)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    argv = [
        "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
    ]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, timeout=60)
    return cert


def free_port() -> int:
    """A free loopback port: the ready line names only the plain ports, so the TLS ports
    are chosen here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """One gateway node on loopback with ephemeral ports (the plain ones read from its JSON
    ready line) and TLS listeners with a certificate made for the run (`cert`)."""

    def __init__(self, repo: Path, workdir: Path) -> None:
        self.repo = repo
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}
        self.cert = workdir / "tls" / "cert.pem"

    def start(self, timeout: float = 30.0) -> None:
        data = self.workdir / "data"
        shutil.rmtree(data, ignore_errors=True)  # a fresh spool every run
        config = self.workdir / "gateway.toml"
        config.write_text(CONFIG)
        self.cert.parent.mkdir(exist_ok=True)
        make_cert(self.cert.parent)
        tls_ports = {"mqtt_tls_port": free_port(), "amqp_tls_port": free_port()}
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
            "--mqtt-ws-port",
            "-1",
            "--tls-cert",
            str(self.cert),
            "--tls-key",
            str(self.cert.parent / "key.pem"),
            "--mqtt-tls-port",
            str(tls_ports["mqtt_tls_port"]),
            "--amqp-tls-port",
            str(tls_ports["amqp_tls_port"]),
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
        self.ports.update(tls_ports)

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
        req.add_header("Authorization", ADMIN_AUTH)
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
