"""The `gateway pipeline ...` command line; importable without the [spark] extra."""

from __future__ import annotations

import argparse
import os

from gateway.config import Settings
from gateway.engine.queues import DEAD_MESSAGE_QUEUE
from gateway.redis_server import socket_of
from gateway.spark import DEFAULT_REDIS_URL


def add_pipeline_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`pipeline archive|aggregate|dmq-report`, for the `gateway` command."""
    parser = subparsers.add_parser("pipeline", help="Spark jobs over gateway queues")
    parser.add_argument(
        "--master", help="Spark master (default local[*]; spark-submit's own when under it)"
    )
    parser.add_argument(
        "--redis-url",
        help="the gateway's Redis (default: GATEWAY_REDIS_URL, else the embedded Redis of a "
        f"node run here with its default data directory, else {DEFAULT_REDIS_URL})",
    )
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


def pipeline_redis_url(given: str | None) -> str:
    """The Redis a job reads: the one given, else the embedded one of `./run serve` here
    (a unix socket: the default TCP port reached nothing for a new user), else the default."""
    if given:
        return given
    if os.environ.get("GATEWAY_REDIS_URL"):
        return os.environ["GATEWAY_REDIS_URL"]
    socket = socket_of(os.environ.get("GATEWAY_DATA_DIR") or Settings().data_dir)
    return f"unix://{socket}?db=0" if socket.is_socket() else DEFAULT_REDIS_URL
