"""The interop matrix files change only when a result does, not with each run's ports."""

from __future__ import annotations

import json
from pathlib import Path

from interop.report import Cell, write


def cells(port: int, node: str) -> list[Cell]:
    return [
        Cell("proton-python", "auth_bad", "pass", f"refused (amqp://127.0.0.1:{port} closed)"),
        Cell("rhea", "request_reply", "pass", f"dynamic reply-to #tmp/{node}/192cd9737665c3de"),
        Cell("paho-v5", "qos1", "fail", "lost 3 of 100"),
    ]


def test_two_runs_with_other_ports_and_nodes_write_the_same_files(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    clients, scenarios = ["proton-python", "rhea", "paho-v5"], ["auth_bad", "request_reply", "qos1"]
    write(cells(42583, "n60260370a0"), clients, scenarios, first)
    write(cells(38085, "n9fa2e4f633"), clients, scenarios, second)
    for name in ("matrix.json", "matrix.md"):
        assert (first / name).read_text() == (second / name).read_text()
    details = [c["detail"] for c in json.loads((first / "matrix.json").read_text())["cells"]]
    assert details == [
        "refused (amqp://127.0.0.1:<port> closed)",
        "dynamic reply-to #tmp/<node>/<id>",
        "lost 3 of 100",
    ]
