"""The `gateway pipeline ...` command line; importable without the [spark] extra."""

from __future__ import annotations

import argparse

from gateway.engine.queues import DEAD_MESSAGE_QUEUE
from gateway.spark import DEFAULT_REDIS_URL


def add_pipeline_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`pipeline archive|aggregate|dmq-report`, for the `gateway` command."""
    parser = subparsers.add_parser("pipeline", help="Spark jobs over gateway queues")
    parser.add_argument(
        "--master", help="Spark master (default local[*]; spark-submit's own when under it)"
    )
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="the gateway's Redis")
    parser.add_argument(
        "--shuffle-partitions",
        type=int,
        default=8,
        help="spark.sql.shuffle.partitions (fixed in an aggregate's checkpoint at its start)",
    )
    jobs = parser.add_subparsers(dest="pipeline_command", required=True)

    arch = jobs.add_parser("archive", help="archive a queue to Parquet (queue=/date=)")
    arch.add_argument("queue")
    arch.add_argument("path", help="output directory (any Spark path)")
    arch.add_argument("--checkpoint", help="incremental: archive only what is new since last run")

    agg = jobs.add_parser("aggregate", help="windowed per-key aggregates into a topic")
    agg.add_argument("queue")
    agg.add_argument("topic")
    agg.add_argument("--checkpoint", required=True, help="streaming checkpoint directory")
    agg.add_argument("--window", default="1 minute")
    agg.add_argument("--watermark", default="10 seconds")
    agg.add_argument("--value", default="payload", help="payload or property:NAME")
    agg.add_argument("--once", action="store_true", help="process what is there, then stop")

    dmq = jobs.add_parser("dmq-report", help="dead messages by origin queue and reason")
    dmq.add_argument("queue", nargs="?", default=DEAD_MESSAGE_QUEUE)
    dmq.add_argument("--json", action="store_true", help="one JSON object per line")
    return parser
