"""bench/peers.py: a broker's CPU, read from /proc around a run, covers all its processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import peers

# Waits for a line, then runs a child that burns 0.3 s of CPU and exits, and says so.
PARENT = """
import subprocess, sys
sys.stdin.readline()
burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass"
subprocess.run([sys.executable, "-c", burn], check=True)
print("done", flush=True)
sys.stdin.readline()
"""


def test_tree_cpu_counts_a_child_that_ran_and_exited_between_readings() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert parent.stdin is not None and parent.stdout is not None
    try:
        before = {pid: s for (pid, _), s in peers.tree_cpu(parent.pid).items()}
        parent.stdin.write(b"go\n")
        parent.stdin.flush()
        assert parent.stdout.readline() == b"done\n"  # the child was waited for: it is gone
        after = {pid: s for (pid, _), s in peers.tree_cpu(parent.pid).items()}
        assert set(after) == {parent.pid}
        assert after[parent.pid] - before[parent.pid] >= 0.25
    finally:
        parent.stdin.close()
        parent.wait(timeout=10)


def test_the_gateway_runs_from_this_checkout_whatever_the_venv_points_at(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = peers.gateway_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(peers.ROOT), "/elsewhere"]
    where = subprocess.run(
        [sys.executable, "-c", "import gateway; print(gateway.__file__)"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where == str(peers.ROOT / "gateway" / "__init__.py")
