"""The `gateway:replay-period` source filter: an AMQP browser (distribution-mode copy, or any
consumer of a non-destructive queue) asks for the messages of the last N ms plus new ones.
Applied filters are echoed on attach; a bad value is refused with amqp:invalid-field.
Real Redis, real sockets, a stock proton client.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from proton import Described, Message, Timeout, symbol, uint, ulong
from proton.reactor import Filter
from proton.utils import BlockingConnection, LinkDetached

from gateway.broker import Broker, QueueConfig
from protocols.amqp.listener import Listener
from tests.test_amqp_clients import Browse, echoed_filter

TIMEOUT = 5.0
REPLAY = symbol("gateway:replay-period")
KEY = symbol("replay")


def replay(value: object) -> Filter:
    return Filter({KEY: Described(REPLAY, value)})


def bodies(rcv, quiet: float = 0.3) -> list[bytes]:
    """What arrives until nothing more does for `quiet` seconds (settled)."""
    out = []
    while True:
        try:
            msg = rcv.receive(quiet)
        except Timeout:
            return out
        rcv.accept()
        out.append(bytes(msg.body))


def connect(listener: Listener) -> BlockingConnection:
    return BlockingConnection(f"amqp://127.0.0.1:{listener.port}", timeout=TIMEOUT)


def send_old_then_recent(conn: BlockingConnection, queue: str):
    """Two messages, then 600 ms later one more: a 300 ms period holds the last only.
    Returns the sender."""
    snd = conn.create_sender(queue)
    snd.send(Message(body=b"old1"))
    snd.send(Message(body=b"old2"))
    time.sleep(0.6)
    snd.send(Message(body=b"recent"))
    return snd


async def test_browser_replays_the_period_then_gets_new_ones(
    broker: Broker, amqp: Listener
) -> None:
    await broker.declare_queue(QueueConfig(name="history"))

    def client() -> tuple[list[bytes], list[bytes], dict, list[bytes]]:
        conn = connect(amqp)
        try:
            snd = send_old_then_recent(conn, "history")
            browser = conn.create_receiver(
                "history", name="b", credit=10, options=[Browse(), replay(ulong(300))]
            )
            first = bodies(browser)
            snd.send(Message(body=b"new"))
            later = bodies(browser)
            everything = conn.create_receiver("history", name="all", credit=10, options=Browse())
            return first, later, echoed_filter(browser), bodies(everything)
        finally:
            conn.close()

    first, later, echoed, everything = await asyncio.to_thread(client)
    assert first == [b"recent"] and later == [b"new"]
    assert echoed == {KEY: Described(REPLAY, ulong(300))}
    assert everything == [b"old1", b"old2", b"recent", b"new"], "browsing took nothing"


async def test_non_destructive_queue_consumer_replays(broker: Broker, amqp: Listener) -> None:
    await broker.declare_queue(QueueConfig(name="log", non_destructive=True))

    def client() -> tuple[list[bytes], dict]:
        conn = connect(amqp)
        try:
            send_old_then_recent(conn, "log")
            rcv = conn.create_receiver("log", name="r", credit=10, options=replay(uint(300)))
            return bodies(rcv), echoed_filter(rcv)
        finally:
            conn.close()

    got, echoed = await asyncio.to_thread(client)
    assert got == [b"recent"]
    assert echoed == {KEY: Described(REPLAY, uint(300))}


async def test_consumer_of_a_destructive_queue_ignores_it(broker: Broker, amqp: Listener) -> None:
    await broker.declare_queue(QueueConfig(name="work"))

    def client() -> tuple[list[bytes], dict]:
        conn = connect(amqp)
        try:
            send_old_then_recent(conn, "work")
            rcv = conn.create_receiver("work", name="r", credit=10, options=replay(ulong(300)))
            return bodies(rcv), echoed_filter(rcv)
        finally:
            conn.close()

    got, echoed = await asyncio.to_thread(client)
    assert got == [b"old1", b"old2", b"recent"], "a consumer takes the whole queue"
    assert echoed == {}, "a filter not applied is not echoed"


@pytest.mark.parametrize("value", ["300", -5, 0, 1.5])
async def test_bad_value_is_refused(broker: Broker, amqp: Listener, value: object) -> None:
    await broker.declare_queue(QueueConfig(name="history"))

    def client() -> str:
        conn = connect(amqp)
        try:
            with pytest.raises(LinkDetached) as refused:
                conn.create_receiver("history", name="b", options=[Browse(), replay(value)])
            return str(refused.value)
        finally:
            conn.close()

    refused = await asyncio.to_thread(client)
    assert "amqp:invalid-field" in refused and "gateway:replay-period" in refused
