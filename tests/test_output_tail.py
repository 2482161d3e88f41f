"""A child's last lines, read in the background: kept however much it prints, and it never
blocks on a full pipe."""

from __future__ import annotations

import subprocess
import sys

from gateway.output_tail import OutputTail

CHATTY = """
import sys
for i in range(200_000):  # megabytes: far more than a pipe holds
    print("line", i)
print("x" * 100_000)
print()
print("the reason")
sys.exit(1)
"""


def test_a_chatty_child_keeps_its_last_lines_and_never_blocks() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHATTY], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert child.stdout is not None
    tail = OutputTail(child.stdout, lines=3, width=64)
    try:
        assert child.wait(30) == 1  # a pipe nobody read would have stopped it
    finally:
        child.kill()
    # a long line cut to its first bytes, blank lines skipped
    assert tail.lines() == ["line 199999", "x" * 64, "the reason"]
