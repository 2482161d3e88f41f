"""A gateway node process with one consumer flow, for the multi-node tests.

Runs the real node start-up (`gateway.server.run_node`) against a shared Redis, binds one
flow and prints a JSON line per delivery, acking each one `--ack-delay` seconds later.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from gateway.broker import Broker
from gateway.config import load_settings
from gateway.logs import setup_logging
from gateway.model import Delivery
from gateway.server import run_node


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--ack-delay", type=float, default=0.0)
    parser.add_argument(
        "--ack-limit", type=int, default=0, help="ack only this many, then hold (0: no limit)"
    )
    args = parser.parse_args()
    settings = load_settings({"admin_port": 0, "mqtt_port": 0, "amqp_port": 0})
    setup_logging("INFO")

    async def consume(broker: Broker) -> None:
        loop = asyncio.get_running_loop()

        delivered = 0

        def on_deliver(d: Delivery) -> None:
            nonlocal delivered
            emit(
                event="delivered",
                payload=d.message.payload.decode(),
                redelivered=d.redelivered,
                count=d.delivery_count,
            )
            delivered += 1
            if args.ack_limit and delivered > args.ack_limit:
                return  # a consumer that hangs: holds what it has
            if args.ack_delay:
                loop.call_later(args.ack_delay, flow.ack, d.entry_id)
            else:
                flow.ack(d.entry_id)

        flow = await broker.bind(args.queue, on_deliver, window=args.window)
        emit(event="bound", flow=flow.id, active=flow.active)

    await run_node(settings, args.redis_url, on_ready=consume)


if __name__ == "__main__":
    asyncio.run(main())
