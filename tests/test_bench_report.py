"""bench/report.py: raw benchmark runs -> Markdown table with ratios, JSON summary, PNG chart.

The README shows these files, so the figures in them must be the medians,
ranges and same-run ratios of the runs they came from.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import report


def run(msgs: float, p99: float, cpu: float, cap: str = "broker") -> dict:
    return {
        "msgs_per_s": msgs,
        "p50_ms": p99 / 2,
        "p99_ms": p99,
        "p999_ms": p99 * 1.5,
        "server_cpu_us_per_msg": cpu,
        "cap": cap,
    }


RESULTS = {
    "meta": {"date": "2026-01-01", "machine": "2 cores", "runs": 3, "notes": ["a note"]},
    "workloads": [
        {
            "name": "mqtt-qos1",
            "title": "MQTT QoS 1 publish -> subscribe",
            "baseline_note": "",
            "skipped": {"rabbitmq": "did not start"},
            "cells": [
                {
                    "size": 100,
                    "pairs": 1,
                    "messages": 1000,
                    "runs": {
                        # run by run: gateway / mosquitto = 0.5, 0.25, (failed run: no pair)
                        "gateway": [run(1000, 4, 30), run(1000, 4, 30), run(3000, 2, 20)],
                        "mosquitto": [run(2000, 2, 10), run(4000, 2, 10, "load generator"), None],
                    },
                },
                {
                    "size": 4096,
                    "pairs": 8,
                    "messages": 500,
                    "runs": {"gateway": [None], "mosquitto": [run(500, 8, 40)]},
                },
            ],
        }
    ],
    "memory": {
        "connections": 10000,
        "target_mb": 500,
        "brokers": {
            "gateway": {
                "connected": 10000,
                "rss_mb": {"gateway": 300.0, "redis-server": 20.0},
                "before_mb": {"gateway": 80.0, "redis-server": 10.0},
            },
            "activemq": {"error": "refused"},
        },
    },
}


def test_summary_takes_medians_ranges_and_same_run_ratios() -> None:
    cell = report.summarise_cell(RESULTS["workloads"][0]["cells"][0])
    gw, mq = cell["gateway"], cell["mosquitto"]
    assert gw["msgs_per_s"] == {"median": 1000, "min": 1000, "max": 3000}
    assert mq["runs_ok"] == 2 and mq["runs"] == 3
    assert mq["ratio"]["msgs_per_s"] == {"median": 0.375, "min": 0.25, "max": 0.5}
    assert mq["ratio"]["server_cpu_us_per_msg"]["median"] == 3.0
    assert "ratio" not in gw
    assert gw["cap"] == "broker"


def test_write_makes_markdown_json_and_png(tmp_path: Path) -> None:
    paths = report.write(RESULTS, tmp_path)
    md = paths["md"].read_text()
    lines = md.splitlines()
    row = next(ln for ln in lines if ln.startswith("| 100 B | 1 | mosquitto |"))
    # msg/s median (min-max), then the ratios gateway / mosquitto: msg/s, p99, CPU
    assert "| 3,000 (2,000-4,000) |" in row
    assert row.endswith("| 0.38 (0.25-0.50) | 2.00 | 3.00 |")
    gw_row = next(ln for ln in lines if ln.startswith("| 100 B | 1 | gateway |"))
    assert gw_row.endswith("| — | — | — |")
    assert "| 4 KiB | 8 | gateway | failed |" in md
    assert "- rabbitmq: not run (did not start)" in md
    assert "| gateway | 10,000 | 320 | 90 |" in md
    assert "| activemq | failed: refused |" in md

    data = json.loads(paths["json"].read_text())
    assert data["workloads"][0]["cells"][0]["summary"]["mosquitto"]["ratio"]
    assert data["workloads"][0]["cells"][0]["runs"]["mosquitto"][2] is None

    png = paths["png"].read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
