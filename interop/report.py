"""The matrix: cells in, matrix.json / matrix.md / a terminal table out."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

MARK = {"pass": "pass", "fail": "FAIL", "unsupported": "unsup"}

# What changes from run to run in a cell's detail (the gateway's free port, the name of a
# dynamic node): written as placeholders, so the tracked matrix changes only with results.
_VOLATILE = (
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:<port>"),
    (re.compile(r"#tmp/[0-9a-z]+/[0-9a-f]+"), "#tmp/<node>/<id>"),
)


def stable(detail: str) -> str:
    """`detail` with its run-specific parts replaced by placeholders."""
    for pattern, placeholder in _VOLATILE:
        detail = pattern.sub(placeholder, detail)
    return detail


@dataclass(frozen=True)
class Cell:
    client: str
    scenario: str
    result: str  # "pass" | "fail" | "unsupported"
    detail: str


def write(cells: list[Cell], clients: list[str], scenarios: list[str], out: Path) -> str:
    """Write matrix.json and matrix.md under `out`; return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    cells = [replace(c, detail=stable(c.detail)) for c in cells]
    doc = {"clients": clients, "scenarios": scenarios, "cells": [asdict(c) for c in cells]}
    (out / "matrix.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    md = markdown(cells, clients, scenarios)
    (out / "matrix.md").write_text(md)
    return md


def markdown(cells: list[Cell], clients: list[str], scenarios: list[str]) -> str:
    by = {(c.client, c.scenario): c for c in cells}
    plain = [s for s in scenarios if not s.startswith("to:")]
    cross = [s for s in scenarios if s.startswith("to:")]
    lines = ["# Interop matrix", "", "Client x scenario (rows: clients).", ""]
    lines += table(by, clients, plain)
    lines += [
        "",
        "Cross-protocol: publisher (row) -> consumer (column), mapped properties "
        "checked per ARCHITECTURE.md.",
        "",
    ]
    lines += table(by, clients, cross)
    counts = {r: sum(c.result == r for c in cells) for r in MARK}
    lines += [
        "",
        f"Totals: {counts['pass']} pass, {counts['fail']} fail, "
        f"{counts['unsupported']} unsupported.",
        "",
        "## Failures and unsupported cells",
        "",
    ]
    for c in cells:
        if c.result != "pass":
            lines.append(f"- **{c.result}** `{c.client}` / `{c.scenario}`: {c.detail}")
    return "\n".join(lines) + "\n"


def table(by: dict[tuple[str, str], Cell], clients: list[str], scenarios: list[str]) -> list[str]:
    rows = [c for c in clients if any((c, s) in by for s in scenarios)]
    head = "| client | " + " | ".join(s.removeprefix("to:") for s in scenarios) + " |"
    lines = [head, "|" + "---|" * (len(scenarios) + 1)]
    for client in rows:
        marks = [MARK[by[(client, s)].result] if (client, s) in by else "" for s in scenarios]
        lines.append(f"| {client} | " + " | ".join(marks) + " |")
    return lines
