"""Prometheus text exposition of node counters and per-queue depth."""

from __future__ import annotations

from gateway.broker import Broker
from gateway.engine.queues import QueueError


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def render_metrics(broker: Broker) -> str:
    node = _label(broker.node_id)
    lines = []
    for name, value in broker.stats().items():
        metric = f"gateway_{name}"
        lines.append(f"# TYPE {metric} {'gauge' if name == 'flows' else 'counter'}")
        lines.append(f'{metric}{{node="{node}"}} {value}')
    queue_lines: dict[str, list[str]] = {}
    for name in await broker.queues.names():
        try:
            info = await broker.queues.info(name)
        except QueueError:
            continue
        q = _label(name)
        queue_lines.setdefault("gateway_queue_messages", []).append(
            f'gateway_queue_messages{{queue="{q}"}} {info.messages}'
        )
        queue_lines.setdefault("gateway_queue_spooled_bytes", []).append(
            f'gateway_queue_spooled_bytes{{queue="{q}"}} {info.spooled_bytes}'
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
    return "\n".join(lines) + "\n"
