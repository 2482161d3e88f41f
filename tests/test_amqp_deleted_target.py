"""A queue deleted under an AMQP sender link whose target it is: the link ends with
amqp:resource-deleted (§2.8.16, as RabbitMQ and ActiveMQ Artemis do), whichever node
deleted it, and every transfer sent on it is settled with what became of it. Real proton
clients and a raw peer against a real node, real Redis (through a proxy where a reply or
an event must come late)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from proton import Delivery, Message, Timeout
from proton.utils import BlockingConnection, LinkDetached

from gateway.broker import Broker, QueueConfig
from gateway.config import Settings
from protocols.amqp import links
from protocols.amqp.listener import Listener, start
from tests.amqp_raw import ACCEPTED, DETACH, DISPOSITION, REJECTED, Peer
from tests.redis_proxy import CuttingProxy
from tests.test_admin_api import Admin
from tests.test_amqp_hostile import (
    send_past_the_size_limit_in_a_middle_frame,
    send_past_the_size_limit_in_the_last_frame,
)
from tests.test_engine import second_node  # noqa: F401
from tests.test_redis_outages import node, proxy  # noqa: F401

TIMEOUT = 5.0
DELETED = "amqp:resource-deleted"


@pytest.fixture
async def node_amqp(node: Broker) -> AsyncIterator[Listener]:  # noqa: F811
    """An AMQP listener on the node that talks to Redis through the proxy."""
    listener = await start(node, Settings(amqp_port=0, host="127.0.0.1"))
    assert listener is not None
    yield listener
    await listener.close()


def connect(listener: Listener) -> BlockingConnection:
    return BlockingConnection(f"amqp://127.0.0.1:{listener.port}", timeout=TIMEOUT)


def detached(conn: BlockingConnection, timeout: float = TIMEOUT) -> LinkDetached | None:
    """The next detach of a link of `conn` (None: none within `timeout`)."""
    try:
        conn.wait(lambda: False, timeout=timeout)
    except LinkDetached as exc:
        return exc
    except Timeout:
        return None
    return None


def detached_condition(conn: BlockingConnection) -> str | None:
    """The condition the next detach of a link of `conn` carries."""
    exc = detached(conn)
    return exc.condition if exc is not None else None


def pump_until(conn: BlockingConnection, done: Callable[[], bool]) -> None:
    """Keep `conn` working (sending, reading) until `done()`, set by another thread."""
    deadline = time.monotonic() + TIMEOUT
    while not done():
        assert time.monotonic() < deadline, "not done in time"
        with contextlib.suppress(Timeout):
            conn.wait(done, timeout=0.05)


async def depth(broker: Broker, queue: str) -> int:
    return (await broker.queues.info(queue)).messages


async def test_a_queue_deleted_through_another_node_detaches_its_senders_only(
    broker: Broker,
    amqp: Listener,
    second_node: Broker,  # noqa: F811
) -> None:
    """Senders to a topic, to another queue and the anonymous relay stay attached."""
    for name in ("q", "other"):
        await broker.queues.create(QueueConfig(name=name))
    attached = threading.Event()

    def client() -> tuple[str | None, bool, list[object]]:
        conn = connect(amqp)
        try:
            doomed = conn.create_sender("q")
            topic = conn.create_sender("topic://t/1")
            other = conn.create_sender("other")
            relay = conn.create_sender(None)
            doomed.send(Message(body=b"stored"))
            attached.set()
            exc = detached(conn)
            if exc is None:
                return None, False, []
            outcomes = [
                topic.send(Message(body=b"t")).remote_state,
                other.send(Message(body=b"o")).remote_state,
                relay.send(Message(address="other", body=b"r")).remote_state,
            ]
            return exc.condition, exc.link.name == doomed.link.name, outcomes
        finally:
            conn.close()

    task = asyncio.create_task(asyncio.to_thread(client))
    assert await asyncio.to_thread(attached.wait, TIMEOUT)
    await second_node.delete_queue("q")
    condition, doomed, outcomes = await task
    assert condition == DELETED
    assert doomed  # the link to the deleted queue, not another
    assert outcomes == [Delivery.ACCEPTED] * 3
    assert await depth(broker, "other") == 2


async def test_a_transfer_that_crossed_the_detach_is_rejected_with_its_error(
    broker: Broker, amqp: Listener, admin: Admin
) -> None:
    """The queue deleted with the admin API: a transfer that reaches the node after its
    detach is rejected with the error, never left unsettled or stored."""
    await broker.queues.create(QueueConfig(name="q"))
    peer = await Peer.opened(amqp.port)
    await peer.sender(0, "q")
    body = bytes(Message(body=b"x").encode())
    assert await peer.send_all(0, [body]) == [(0x24, None)]  # accepted
    assert (await admin.request("DELETE", "/api/v1/queues/q")).status == 204
    detach = await peer.expect(DETACH)
    assert detach.fields[1] is True and detach.error() == DELETED  # closed, with the error
    peer.transfer(0, 1, body, tag=b"a")  # sent before the client read the detach
    dispositions = [f for f in await peer.frames_for(0.5) if f.code == DISPOSITION]
    assert [(f.fields[1], f.outcome()) for f in dispositions] == [(1, (REJECTED, DELETED))]
    peer.close()
    assert not await broker.queues.exists("q")  # nothing made it again


async def test_a_transfer_in_flight_across_the_deletion_is_settled_before_the_detach(
    proxy: CuttingProxy,  # noqa: F811
    node: Broker,  # noqa: F811
    node_amqp: Listener,
    second_node: Broker,  # noqa: F811
) -> None:
    """The first message is stored before the queue goes, its answer from Redis late: it
    is accepted, then the link ends; the second, sent once the node knows, is rejected
    with the error and never spooled."""
    await node.queues.create(QueueConfig(name="q"))
    attached, told = threading.Event(), threading.Event()
    proxy.delay = 1.5

    def client() -> tuple[object, object, str | None, str | None]:
        conn = connect(node_amqp)
        try:
            snd = conn.create_sender("q")
            attached.set()
            first = snd.link.send(Message(body=b"1"))
            pump_until(conn, told.is_set)
            second = snd.link.send(Message(body=b"2"))
            condition = detached_condition(conn)
            refusal = second.remote.condition
            return first.remote_state, second.remote_state, refusal and refusal.name, condition
        finally:
            conn.close()

    proxy.delay_on = b"gw_spool"  # the spool runs; its answer reaches the node 1.5 s later
    task = asyncio.create_task(asyncio.to_thread(client))
    assert await asyncio.to_thread(attached.wait, TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while await depth(second_node, "q") != 1:
        assert time.monotonic() < deadline, "the first message was never stored"
        await asyncio.sleep(0.01)
    await second_node.delete_queue("q")
    await asyncio.sleep(0.3)  # the node hears of it
    told.set()
    first, second, refusal, condition = await task
    assert (first, second, refusal, condition) == (
        Delivery.ACCEPTED,
        Delivery.REJECTED,
        DELETED,
        DELETED,
    )
    assert node.stats()["published"] == 1  # the second never went to the spool


async def test_an_auto_delete_queue_that_goes_with_its_consumer_detaches_its_senders(
    broker: Broker, amqp: Listener
) -> None:
    await broker.queues.create(QueueConfig(name="auto", auto_delete=True))

    def client() -> str | None:
        conn = connect(amqp)
        try:
            rcv = conn.create_receiver("auto")
            sender = conn.create_sender("auto")
            sender.send(Message(body=b"x"))
            try:
                rcv.close()  # its last consumer: the queue goes
            except LinkDetached as exc:  # the sender's detach came while the close waited
                assert exc.link.name == sender.link.name  # (proton wraps it anew)
                return exc.condition
            return detached_condition(conn)
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == DELETED
    assert not await broker.queues.exists("auto")


async def test_a_deletion_while_the_event_channel_was_lost_detaches_once_it_is_back(
    broker: Broker,
    amqp: Listener,
    second_node: Broker,  # noqa: F811
) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    attached = threading.Event()

    def client() -> str | None:
        conn = connect(amqp)
        try:
            conn.create_sender("q")
            attached.set()
            return detached_condition(conn)
        finally:
            conn.close()

    task = asyncio.create_task(asyncio.to_thread(client))
    assert await asyncio.to_thread(attached.wait, TIMEOUT)
    await second_node.redis.client_kill_filter(_type="pubsub")  # the nodes reconnect later
    await second_node.delete_queue("q")  # its event reaches no node
    assert await task == DELETED


async def test_a_late_event_of_a_deletion_leaves_a_sender_to_the_queue_made_again(
    proxy: CuttingProxy,  # noqa: F811
    node: Broker,  # noqa: F811
    node_amqp: Listener,
    second_node: Broker,  # noqa: F811
) -> None:
    await node.queues.create(QueueConfig(name="q"))
    proxy.delay_reply_on = b"qdel q"  # the node hears of the deletion 1 s late
    proxy.delay = 1.0
    await second_node.delete_queue("q")
    await second_node.queues.create(QueueConfig(name="q"))

    def client() -> tuple[str | None, object]:
        conn = connect(node_amqp)
        try:
            snd = conn.create_sender("q")  # to the queue made again
            exc = detached(conn, timeout=1.5)  # the old deletion's event comes meanwhile
            if exc is not None:
                return exc.condition, None
            return None, snd.send(Message(body=b"x")).remote_state
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == (None, Delivery.ACCEPTED)
    assert await depth(node, "q") == 1


@pytest.mark.parametrize(
    "send_oversized",
    [send_past_the_size_limit_in_the_last_frame, send_past_the_size_limit_in_a_middle_frame],
)
async def test_a_size_error_ends_the_link_once_the_publishes_in_flight_are_answered(
    node: Broker,  # noqa: F811
    proxy: CuttingProxy,  # noqa: F811
    node_amqp: Listener,
    send_oversized: Callable[[Peer, int], Awaitable[None]],
) -> None:
    """A delivery that takes the link past max-message-size ends it, as a deleted queue
    does, once the publish before it is answered: it was ended at once, and that publish,
    stored, was never answered (a client sends it again). The oversized delivery is
    refused, wherever its frames cross the limit."""
    queue = send_oversized.__name__  # the proxied node's Redis is not emptied between tests
    await node.declare_queue(QueueConfig(name=queue))
    peer = await Peer.opened(node_amqp.port)
    await peer.sender(0, queue)
    proxy.delay_on, proxy.delay = b"IN-FLIGHT", 1.5
    peer.transfer(0, 0, bytes(Message(body=b"IN-FLIGHT", durable=True).encode()), tag=b"a")
    await peer.writer.drain()
    await asyncio.sleep(0.2)  # its publish waits on Redis's answer
    await send_oversized(peer, 1)
    frames = await peer.frames_for(3.0)
    peer.close()
    outcomes = {
        d: int(f.fields[4].descriptor)
        for f in frames
        if f.code == DISPOSITION
        for d in f.deliveries()
    }
    detaches = [f.error() for f in frames if f.code == DETACH]
    assert outcomes == {0: ACCEPTED, 1: REJECTED} and detaches == [links.MESSAGE_SIZE_EXCEEDED]
    assert (await node.queues.info(queue)).messages == 1
