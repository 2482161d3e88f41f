"""Prometheus text exposition of node counters, per-queue depth, spool usage and Redis's
memory against its maxmemory."""

from __future__ import annotations

from collections.abc import Callable, Collection

from gateway.broker import Broker
from gateway.engine.queues import QueueConfig
from gateway.engine.spool_usage import SpoolReport, read_usage


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def render_metrics(
    broker: Broker, visible: Callable[[QueueConfig], bool] = lambda _: True
) -> str:
    """`visible`: the queues whose lines the caller sees (their names tell a private
    queue's owner's client id and subscription)."""
    node = _label(broker.node_id)
    lines = []
    for name, value in broker.stats().items():
        metric = f"gateway_{name}"
        lines.append(f"# TYPE {metric} {'gauge' if name == 'flows' else 'counter'}")
        lines.append(f'{metric}{{node="{node}"}} {value}')
    queue_lines: dict[str, list[str]] = {}
    hidden = set()
    async for info in broker.queues.infos(await broker.queues.names()):
        name = info.config.name
        if not visible(info.config):
            hidden.add(name)
            continue
        q = _label(name)
        queue_lines.setdefault("gateway_queue_messages", []).append(
            f'gateway_queue_messages{{queue="{q}"}} {info.messages}'
        )
        queue_lines.setdefault("gateway_queue_spooled_bytes", []).append(
            f'gateway_queue_spooled_bytes{{queue="{q}"}} {info.spooled_bytes}'
        )
        queue_lines.setdefault("gateway_queue_blocked", []).append(
            f'gateway_queue_blocked{{queue="{q}"}} {int(info.blocked)}'
        )
        flows = info.to_json()["flows"]
        active = sum(1 for f in flows if f["active"])
        queue_lines.setdefault("gateway_queue_flows", []).extend(
            [
                f'gateway_queue_flows{{queue="{q}",state="active"}} {active}',
                f'gateway_queue_flows{{queue="{q}",state="inactive"}} {len(flows) - active}',
            ]
        )
        for counter, value in sorted(info.counters.items()):
            metric = f"gateway_queue_{counter}_total"
            queue_lines.setdefault(metric, []).append(f'{metric}{{queue="{q}"}} {value}')
    for metric, rows in queue_lines.items():
        kind = "counter" if metric.endswith("_total") else "gauge"
        lines.append(f"# TYPE {metric} {kind}")
        lines.extend(rows)
    lines += _spool_lines(hide_queues(await read_usage(broker.redis), hidden))
    memory = await broker.redis.info("memory")  # how close Redis is to refusing messages
    for name in ("used_memory", "maxmemory"):
        lines += [
            f"# TYPE gateway_redis_{name}_bytes gauge",
            f"gateway_redis_{name}_bytes {memory[name]}",
        ]
    return "\n".join(lines) + "\n"


def hide_queues(report: SpoolReport, hidden: Collection[str]) -> SpoolReport:
    """`report` without the queue scopes of `hidden`."""
    if hidden:
        report.scopes = [s for s in report.scopes if s.scope != "queue" or s.name not in hidden]
    return report


def _spool_lines(report: SpoolReport) -> list[str]:
    """Per scope (broker, VPN, queue with threshold events): bytes stored, quota (0:
    unlimited), the usage threshold alarm (0/1) and its set / clear events so far."""
    usage, quota, raised, events = [], [], [], []
    for s in report.scopes:
        labels = f'scope="{s.scope}",name="{_label(s.name)}"'
        usage.append(f"gateway_spool_usage_bytes{{{labels}}} {s.bytes}")
        quota.append(f"gateway_spool_quota_bytes{{{labels}}} {s.quota}")
        raised.append(f"gateway_spool_threshold_raised{{{labels}}} {int(s.raised)}")
        events.append(f'gateway_spool_threshold_events_total{{{labels},event="set"}} {s.sets}')
        events.append(f'gateway_spool_threshold_events_total{{{labels},event="clear"}} {s.clears}')
    return [
        "# TYPE gateway_spool_usage_bytes gauge",
        *usage,
        "# TYPE gateway_spool_quota_bytes gauge",
        *quota,
        "# TYPE gateway_spool_threshold_raised gauge",
        *raised,
        "# TYPE gateway_spool_threshold_events_total counter",
        *events,
    ]
