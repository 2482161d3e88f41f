"""Turn the raw runs of a benchmark into results: a Markdown table, a JSON file and a chart.

Input: the dict bench/run.py collects (`meta`, `workloads` with per-cell per-broker lists of
run figures, None for a failed run, and `memory`). Every figure is reported as the median
with min-max over the runs; the ratio gateway / peer is taken run by run (the brokers ran
alternately, so each run's pair saw the same machine) and then summarised the same way.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

METRICS = ("msgs_per_s", "p50_ms", "p99_ms", "p999_ms", "server_cpu_us_per_msg")
RATIOS = ("msgs_per_s", "p99_ms", "server_cpu_us_per_msg")  # shown as gateway / peer


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise_cell(cell: dict) -> dict:
    """Medians (min-max) per broker, ratios against the cell's baseline (its first broker),
    and the cap seen most often."""
    runs: dict[str, list[dict | None]] = cell["runs"]
    summary: dict[str, dict] = {}
    base_name = next(iter(runs), None)
    for name, rs in runs.items():
        ok = [r for r in rs if r]
        entry: dict = {"runs_ok": len(ok), "runs": len(rs)}
        for key in METRICS:
            entry[key] = spread([r[key] for r in ok])
        caps = Counter(r["cap"] for r in ok)
        entry["cap"] = caps.most_common(1)[0][0] if caps else None
        if name != base_name and base_name is not None:
            pairs = [(g, p) for g, p in zip(runs[base_name], rs, strict=False) if g and p]
            entry["ratio"] = {
                key: spread([g[key] / p[key] for g, p in pairs if p[key]]) for key in RATIOS
            }
        summary[name] = entry
    return summary


def summarise(results: dict) -> dict:
    """results with a `summary` added to every cell (the input is left as it was)."""
    out = json.loads(json.dumps(results))
    for w in out["workloads"]:
        for cell in w["cells"]:
            cell["summary"] = summarise_cell(cell)
    return out


def fmt(s: dict | None, pattern: str) -> str:
    if s is None:
        return "failed"
    lo, mid, hi = (pattern.format(s[k]) for k in ("min", "median", "max"))
    return mid if lo == hi else f"{mid} ({lo}-{hi})"


def size_label(size: int) -> str:
    return f"{size // 1024} KiB" if size >= 1024 and size % 1024 == 0 else f"{size} B"


def markdown(results: dict) -> str:
    """The results as Markdown: one table per workload, then memory and notes."""
    meta = results["meta"]
    lines = [
        f"# Benchmark: gateway vs peers ({meta.get('date', '')})",
        "",
        f"{meta.get('machine', '')}. Median (min-max) of {meta['runs']} run(s) per cell; "
        "brokers alternate run by run and each ratio is gateway / peer taken within the same "
        "run. Messages/s counts delivered messages (first send -> last arrival); latency is "
        "end to end (send timestamp in the payload); CPU is the broker's user + sys per "
        "delivered message (gateway: its node process plus redis-server). *cap*: which side "
        "limited the rate (a broker process or the load generator at >= 0.85 core, the "
        "machine's 2 cores, or neither: window / latency).",
        "",
    ]
    for note in meta.get("notes", []):
        lines.append(f"- {note}")
    if meta.get("notes"):
        lines.append("")
    for w in results["workloads"]:
        bullets = [f"- {name}: not run ({why})" for name, why in w.get("skipped", {}).items()]
        if w.get("baseline_note"):
            bullets.append(f"- ratio: {w['baseline_note']}")
        lines += [f"## {w['title']} (`{w['name']}`)", "", *bullets, *([""] if bullets else [])]
        lines += [
            "| size | pairs | broker | msg/s | p50 ms | p99 ms | p99.9 ms | CPU µs/msg | cap "
            "| gw/peer msg/s | gw/peer p99 | gw/peer CPU |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for cell in w["cells"]:
            summary = cell.get("summary") or summarise_cell(cell)
            for name, s in summary.items():
                ratio = s.get("ratio")
                ratio_cells = (
                    [fmt(ratio[k], "{:.2f}") for k in RATIOS] if ratio else ["—", "—", "—"]
                )
                lines.append(
                    f"| {size_label(cell['size'])} | {cell['pairs']} | {name} "
                    f"| {fmt(s['msgs_per_s'], '{:,.0f}')} | {fmt(s['p50_ms'], '{:.2f}')} "
                    f"| {fmt(s['p99_ms'], '{:.2f}')} | {fmt(s['p999_ms'], '{:.2f}')} "
                    f"| {fmt(s['server_cpu_us_per_msg'], '{:.1f}')} | {s['cap'] or '—'} | "
                    + " | ".join(ratio_cells)
                    + " |"
                )
        lines.append("")
    memory = results.get("memory")
    if memory:
        lines += [
            f"## Memory: {memory['connections']:,} idle MQTT connections",
            "",
            f"Target for the gateway: < {memory.get('target_mb', 500)} MB resident.",
            "",
            "| broker | connected | resident MB with them | resident MB before | processes |",
            "|---|---|---|---|---|",
        ]
        for name, m in memory["brokers"].items():
            if "error" in m:
                lines.append(f"| {name} | failed: {m['error']} | | | |")
                continue
            procs = ", ".join(f"{p} {mb:.0f}" for p, mb in m["rss_mb"].items())
            lines.append(
                f"| {name} | {m['connected']:,} | {sum(m['rss_mb'].values()):.0f} "
                f"| {sum(m['before_mb'].values()):.0f} | {procs} |"
            )
        lines.append("")
    if meta.get("duration_s"):
        lines.append(f"Run time: {meta['duration_s'] / 60:.1f} min (`{meta.get('command', '')}`).")
    return "\n".join(lines) + "\n"


def chart(results: dict, path: Path) -> None:
    """Per workload: messages/s and server CPU µs/msg per cell, one bar per broker, with
    min-max whiskers."""
    workloads = [w for w in results["workloads"] if w["cells"]]
    every = list(dict.fromkeys(n for w in workloads for c in w["cells"] for n in c["runs"]))
    color = {name: f"C{i}" for i, name in enumerate(every)}  # one colour per broker throughout
    fig, axes = plt.subplots(
        max(1, len(workloads)), 2, figsize=(13, 2.8 * max(1, len(workloads))), squeeze=False
    )
    for row, w in zip(axes, workloads, strict=False):
        cells = w["cells"]
        labels = [f"{size_label(c['size'])}\n{c['pairs']} pair(s)" for c in cells]
        names = list(dict.fromkeys(n for c in cells for n in c["runs"]))
        width = 0.8 / max(1, len(names))
        for ax, key, title in (
            (row[0], "msgs_per_s", "messages/s"),
            (row[1], "server_cpu_us_per_msg", "server CPU µs/msg"),
        ):
            for i, name in enumerate(names):
                xs, mids, los, his = [], [], [], []
                for x, c in enumerate(cells):
                    s = (c.get("summary") or summarise_cell(c)).get(name, {}).get(key)
                    if s:
                        xs.append(x + i * width)
                        mids.append(s["median"])
                        los.append(s["median"] - s["min"])
                        his.append(s["max"] - s["median"])
                ax.bar(xs, mids, width, yerr=[los, his], capsize=2, label=name, color=color[name])
            ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(cells))], labels)
            ax.set_title(f"{w['name']}: {title}", fontsize=9)
            ax.tick_params(labelsize=7)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(results: dict, outdir: Path, stem: str = "latest") -> dict[str, Path]:
    """Write <stem>.json (raw runs + summaries), <stem>.md and <stem>.png into outdir."""
    outdir.mkdir(parents=True, exist_ok=True)
    full = summarise(results)
    paths = {ext: outdir / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps(full, indent=1) + "\n")
    paths["md"].write_text(markdown(full))
    chart(full, paths["png"])
    return paths
