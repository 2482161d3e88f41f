"""Stream-entry encoding choices, measured: how gateway/model.py stores a message.

    python bench/encoding.py

Compares, for a typical MQTT-sized message (100-byte payload, a user property, publisher):
msgpack in one field (what the model uses) against JSON in one field, per message
encode + decode time in Python; and in Redis (embedded redis-server), the memory per entry
and the server CPU of XADD for one field against one field per attribute.
"""

from __future__ import annotations

import json
import tempfile
import timeit

import redis
from peers import process_cpu

from gateway.model import Message, Publisher, decode, encode
from gateway.redis_server import EmbeddedRedis

N = 20_000


def sample() -> Message:
    return Message(
        destination="devices/dev-7/temp",
        payload=b"x" * 100,
        user_properties=[("site", "north")],
        publisher=Publisher("mqtt", "dev-7"),
        id="a1b2c3d4e5f6-1f",
    )


def as_json(msg: Message) -> bytes:
    return json.dumps(
        {
            "payload": msg.payload.decode(),
            "destination": msg.destination,
            "id": msg.id,
            "user_properties": msg.user_properties,
            "publisher": [msg.publisher.protocol, msg.publisher.client_id],
        }
    ).encode()


def as_fields(msg: Message) -> dict[str, bytes | str]:
    """One stream field per attribute that is set."""
    return {
        "payload": msg.payload,
        "destination": msg.destination,
        "id": msg.id,
        "priority": str(msg.priority),
        "persistent": "1",
        "up:site": "north",
        "publisher": "mqtt/dev-7",
    }


def redis_cost(client: redis.Redis, pid: int, key: str, entry: dict) -> tuple[float, float]:
    """(bytes per entry, server CPU µs per XADD) for N entries."""
    before = process_cpu(pid)
    for start in range(0, N, 500):
        pipe = client.pipeline(transaction=False)
        for _ in range(min(500, N - start)):
            pipe.xadd(key, entry)
        pipe.execute()
    used = process_cpu(pid) - before
    return client.memory_usage(key, samples=0) / N, used / N * 1e6


def main() -> None:
    msg = sample()
    blob, text = encode(msg), as_json(msg)
    rows = [
        ("msgpack, one field", timeit.timeit(lambda: decode(encode(msg)), number=N) / N),
        ("JSON, one field", timeit.timeit(lambda: json.loads(as_json(msg)), number=N) / N),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(tmp)
        server.start()
        try:
            client = redis.Redis(unix_socket_path=str(server.socket))
            pid = server.proc.pid  # type: ignore[union-attr]
            one = redis_cost(client, pid, "one", {"m": blob})
            many = redis_cost(client, pid, "many", as_fields(msg))
            client.close()
        finally:
            server.stop()
    print(f"{'encoding':<22} {'encode+decode µs':>17} {'bytes':>6}")
    print(f"{rows[0][0]:<22} {rows[0][1] * 1e6:>17.2f} {len(blob):>6}")
    print(f"{rows[1][0]:<22} {rows[1][1] * 1e6:>17.2f} {len(text):>6}")
    print(f"\nin Redis, {N} entries  {'bytes/entry':>12} {'XADD CPU µs':>12}")
    print(f"{'one field (msgpack)':<22} {one[0]:>12.0f} {one[1]:>12.2f}")
    print(f"{'a field per attribute':<22} {many[0]:>12.0f} {many[1]:>12.2f}")


if __name__ == "__main__":
    main()
