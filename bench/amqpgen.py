"""The AMQP 1.0 load generator: build bench/loadgen/{send,recv}.c and run senders/receivers.

Every broker gets the same C client (Qpid Proton proactor, Debian's libqpid-proton11-dev): a
Python client would cost more CPU per message than the brokers under test. Receivers attach
first and report "ready"; senders attach, report "ready" and wait for "go" on stdin, so that
connection setup stays out of the measured interval. Competing receivers are told with
SIGUSR1 that every sender is done and then end after IDLE_MS without a message.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from peers import read_line

SOURCES = Path(__file__).resolve().parent / "loadgen"
IDLE_MS = 1000  # a receiver that got no message for this long after the senders ended is done


@dataclass
class Tools:
    send: Path
    recv: Path


def build(workdir: Path) -> Tools:
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
        src = SOURCES / f"{name}.c"
        subprocess.run(["gcc", "-O2", "-Wall", "-o", str(binary), str(src), *flags], check=True)
        out.append(binary)
    return Tools(*out)


def wait_rusage(proc: subprocess.Popen, deadline: float) -> tuple[str, float]:
    """proc's stdout and its own user + sys CPU (wait4), by deadline or it is killed."""
    assert proc.stdout is not None
    out = b""
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
            out += chunk
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return out.decode(), usage.ru_utime + usage.ru_stime


def last_json(text: str, what: str) -> dict:
    lines = text.strip().splitlines()
    if not lines:
        raise RuntimeError(f"{what} printed nothing")
    return json.loads(lines[-1])


class Receivers:
    """Receivers started before the load: one per address (an address may repeat: competing
    consumers); each expects `expect` messages, or with `competing` ends by idleness."""

    def __init__(
        self,
        tools: Tools,
        port: int,
        sasl: bool,
        addresses: list[str],
        expect: int,
        workdir: Path,
        competing: bool,
        window: int = 300,
    ) -> None:
        self.competing = competing
        self.files = [workdir / f"lat-{i}.bin" for i in range(len(addresses))]
        idle = str(IDLE_MS if competing else 0)
        self.procs = [
            subprocess.Popen(
                [
                    str(tools.recv),
                    "127.0.0.1",
                    str(port),
                    a,
                    str(expect),
                    str(window),
                    str(int(sasl)),
                    idle,
                    str(f),
                ],
                stdout=subprocess.PIPE,
            )
            for a, f in zip(addresses, self.files, strict=True)
        ]
        for p in self.procs:
            if read_line(p, 30.0).strip() != b"ready":
                self.kill()
                raise RuntimeError("AMQP receiver could not attach")

    def senders_done(self) -> None:
        if self.competing:
            for p in self.procs:
                p.send_signal(signal.SIGUSR1)

    def collect(self, deadline: float) -> dict:
        """Received count, last arrival (ns) and the merged latencies (ns)."""
        results = [last_json(wait_rusage(p, deadline)[0], "AMQP receiver") for p in self.procs]
        lat = array.array("q")
        for f in self.files:
            if f.exists():
                lat.frombytes(f.read_bytes())
                f.unlink()
        return {
            "received": sum(r["received"] for r in results),
            "last_ns": max(r["last_ns"] for r in results),
            "latencies_ns": lat,
        }

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


class Senders:
    """N senders, attached and waiting for "go"; together they send `total` messages."""

    def __init__(
        self,
        tools: Tools,
        port: int,
        sasl: bool,
        address: str,
        total: int,
        size: int,
        count: int,
        window: int = 300,
    ) -> None:
        shares = [total // count + (i < total % count) for i in range(count)]
        self.procs = [
            subprocess.Popen(
                [
                    str(tools.send),
                    "127.0.0.1",
                    str(port),
                    address,
                    str(n),
                    str(size),
                    str(window),
                    str(int(sasl)),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            for n in shares
        ]
        for p in self.procs:
            if read_line(p, 30.0).strip() != b"ready":
                self.kill()
                raise RuntimeError("AMQP sender could not attach")

    def go(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.close()

    def collect(self, deadline: float) -> dict:
        results, cpu = [], 0.0
        for p in self.procs:
            out, seconds = wait_rusage(p, deadline)
            results.append(last_json(out, "AMQP sender"))
            cpu += seconds
        return {"accepted": sum(r["accepted"] for r in results), "cpu": cpu}

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
