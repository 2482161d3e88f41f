"""AMQP links of a node that crashed: the client reconnects (to another node, or to the
node started again) and attaches its links again. Real `gateway serve` processes on the
test's Redis, real proton clients."""

from __future__ import annotations

import asyncio
import time

from proton import Message
from proton.reactor import DurableSubscription
from proton.utils import BlockingConnection, LinkDetached

from gateway.broker import Broker
from protocols.amqp.listener import Listener
from tests.processes import GATEWAY, Proc, node_env

TIMEOUT = 10.0
NODE_TTL = 3.0  # the crashed node's: its flows stay until its liveness key expires


def serve(redis_url: str) -> list[str]:
    return [*GATEWAY, "serve", "--redis-url", redis_url, "--mqtt-port", "0", "--admin-port",
            "0", "--amqp-port", "0"]  # fmt: skip


def subscribe(port: int) -> BlockingConnection:
    """Container "app"'s durable subscription "sub", attached and left open."""
    conn = BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=TIMEOUT, container_id="app")
    try:
        conn.create_receiver("topic://crash/t", name="sub", options=DurableSubscription())
    except LinkDetached:
        conn.close()
        raise
    return conn


async def test_a_durable_subscriber_of_a_crashed_node_attaches_again_elsewhere(
    broker: Broker, amqp: Listener, redis_url: str
) -> None:
    """rhea's and Qpid JMS's recipe: a fixed container id and link name, reconnecting
    when the connection drops. After its node was killed, the attach of the durable
    subscription was refused with amqp:resource-locked (its dead link still held it) until
    the node's TTL passed, and a refused link is not attached again: nothing more came.
    The attach now waits until the dead link is released; a live one still locks it."""
    crashed = await Proc.start(serve(redis_url), node_env(NODE_TTL))
    try:
        port = (await crashed.wait_event("ready", timeout=30))["amqp_port"]
        await asyncio.to_thread(subscribe, port)  # left open: the node dies under it
        crashed.kill()
        await crashed.proc.wait()
    finally:
        crashed.kill()

    def reconnect() -> tuple[float, str]:
        start = time.monotonic()
        conn = BlockingConnection(f"amqp://127.0.0.1:{amqp.port}", timeout=TIMEOUT,
                                  container_id="app")  # fmt: skip
        try:
            sub = conn.create_receiver("topic://crash/t", name="sub", options=DurableSubscription())
            waited = time.monotonic() - start
            conn.create_sender("topic://crash/t").send(Message(body="after"))
            got = sub.receive(TIMEOUT)
            sub.accept()
            other = BlockingConnection(f"amqp://127.0.0.1:{amqp.port}", timeout=TIMEOUT,
                                       container_id="app")  # fmt: skip
            try:  # the live link locks the subscription: refused at once
                refused = time.monotonic()
                other.create_receiver("topic://crash/t", name="sub", options=DurableSubscription())
                raise AssertionError("a second link of a live subscription was attached")
            except LinkDetached as exc:
                assert "amqp:resource-locked" in str(exc)
                assert time.monotonic() - refused < 1.0
            finally:
                other.close()
            return waited, got.body
        finally:
            conn.close()

    waited, body = await asyncio.to_thread(reconnect)
    assert body == "after"
    assert waited < NODE_TTL + 2


async def test_a_durable_subscription_a_live_node_serves_is_locked_at_its_next_beat(
    amqp: Listener, redis_url: str
) -> None:
    """Its link on another node that lives locks the subscription: the attach is refused
    once that node renews its liveness (a beat), not after a node TTL."""
    live = await Proc.start(serve(redis_url), node_env(NODE_TTL))
    try:
        port = (await live.wait_event("ready", timeout=30))["amqp_port"]
        first = await asyncio.to_thread(subscribe, port)

        def second() -> float:
            start = time.monotonic()
            try:
                subscribe(amqp.port).close()
            except LinkDetached as exc:
                assert "amqp:resource-locked" in str(exc)
                return time.monotonic() - start
            raise AssertionError("a second link of a live subscription was attached")

        took = await asyncio.to_thread(second)
        await asyncio.to_thread(first.close)
        assert took < NODE_TTL / 5 * 2 + 1  # two of its beats (node_env), and some slack
    finally:
        await live.stop()
