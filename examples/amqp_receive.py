"""Receive messages from a gateway queue with a stock Qpid Proton client.

python examples/amqp_receive.py orders [--url amqp://127.0.0.1:5672] [--count 1]
"""

from __future__ import annotations

import argparse

from proton.utils import BlockingConnection


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("queue")
    parser.add_argument("--url", default="amqp://127.0.0.1:5672")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    conn = BlockingConnection(args.url)
    try:
        receiver = conn.create_receiver(args.queue, credit=args.count)
        for _ in range(args.count):
            msg = receiver.receive(timeout=args.timeout)
            body = msg.body
            if isinstance(body, bytes | memoryview):
                body = bytes(body).decode(errors="replace")
            print(f"{msg.address or ''} {body!r} properties={msg.properties}")
            receiver.accept()
    finally:
        conn.close()


if __name__ == "__main__":
    main()
