"""AMQP adapter against off-the-shelf clients: real sockets, real Redis, no mocks.

proton's BlockingConnection and Container are blocking, so each client runs in a worker
thread (`asyncio.to_thread`) while the gateway serves on the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from proton import (
    UNDESCRIBED,
    Array,
    Connection,
    ConnectionException,
    Data,
    Delivery,
    Described,
    Disposition,
    Message,
    Terminus,
    Timeout,
    Transport,
    int32,
    short,
    symbol,
    ubyte,
    uint,
    ulong,
)
from proton.handlers import MessagingHandler
from proton.reactor import (
    AtMostOnce,
    Container,
    Copy,
    DurableSubscription,
    Filter,
    LinkOption,
    Selector,
)
from proton.utils import BlockingConnection, BlockingReceiver, LinkDetached, SendException

from gateway.broker import Broker, QueueConfig
from gateway.config import Settings, User
from gateway.engine import roll_call
from gateway.model import Message as GatewayMessage
from protocols.amqp import connection, terminus
from protocols.amqp.listener import Listener, start
from protocols.amqp.outbound import Outbound
from protocols.amqp.sasl import AMQP_HEADER, SASL_HEADER
from tests.amqp_raw import ATTACH, SOURCE, TARGET, Peer, frame, performative, sasl_init

TIMEOUT = 5.0


@pytest.fixture
async def amqp(broker: Broker) -> AsyncIterator[Listener]:
    settings = Settings(amqp_port=0, host="127.0.0.1", users=[User("alice", "s3cret")])
    listener = await start(broker, settings)
    assert listener is not None
    yield listener
    await listener.close()


async def queued(broker: Broker, queue: str, expected: int) -> int:
    """The queue's message count once it equals `expected` (or at the deadline): acks and
    unbinds reach Redis a little after a client has returned."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT
    while (count := (await broker.queues.info(queue)).messages) != expected:
        if loop.time() > deadline:
            break
        await asyncio.sleep(0.02)
    return count


async def durable_queues(broker: Broker, expected: int) -> list[str]:
    """The durable subscription queues, once there are `expected` of them (or at the deadline)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT
    while True:
        names = [n for n in await broker.queues.names() if n.startswith("#dts/")]
        if len(names) == expected or loop.time() > deadline:
            return names
        await asyncio.sleep(0.02)


def url(listener: Listener, user: str | None = None, password: str | None = None) -> str:
    auth = f"{user}:{password}@" if user else ""
    return f"amqp://{auth}127.0.0.1:{listener.port}"


async def test_send_unsettled_is_stored(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="orders"))

    def client() -> None:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        snd = conn.create_sender("orders")
        for i in range(3):
            snd.send(Message(body=f"m{i}".encode(), durable=True))
        conn.close()

    await asyncio.to_thread(client)
    assert (await broker.queues.info("orders")).messages == 3


async def test_messages_of_growing_and_shrinking_sizes_arrive_intact(
    broker: Broker, amqp: Listener
) -> None:
    """One sender link reads every delivery through the buffer it keeps (grown as bigger
    messages come; those over RECEIVE_BUFFER_MAX get their own): no message keeps bytes of
    the one before."""
    await broker.queues.create(QueueConfig(name="sizes"))
    sizes = [100, 3000, 40, 70_000, 2000, 300_000, 10, 65_536, 5]
    bodies = [bytes([65 + i]) * size for i, size in enumerate(sizes)]

    def client() -> list[bytes]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("sizes")
            for body in bodies:
                snd.send(Message(body=body, durable=True))
            rcv = conn.create_receiver("sizes", credit=len(bodies))
            got = []
            for _ in bodies:
                # keep the message while copying: its binary body is a view of proton
                # memory that goes with it (copied after, its first bytes are freed memory)
                msg = rcv.receive(TIMEOUT)
                got.append(bytes(msg.body))
                rcv.accept()
            return got
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == bodies


async def test_client_without_sasl_is_anonymous(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="nosasl"))

    def client() -> None:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT, sasl_enabled=False)
        conn.create_sender("nosasl").send(Message(body=b"plain header"))
        conn.close()

    await asyncio.to_thread(client)
    assert (await broker.queues.info("nosasl")).messages == 1


async def test_unknown_queue_is_not_found(amqp: Listener) -> None:
    def client() -> str:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            conn.create_sender("nope")
        except LinkDetached as exc:
            return str(exc)
        finally:
            conn.close()
        return "attached"

    assert "amqp:not-found" in await asyncio.to_thread(client)


async def test_receive_accept_release_reject(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="work"))

    def client() -> list[tuple[bytes, int | None, bool | None]]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("work")
            snd.send(Message(body=b"one", subject="s1", properties={"k": "v", "n": 1}))
            snd.send(Message(body=b"two"))
            rcv = conn.create_receiver("work", credit=10)
            seen = []
            first = rcv.receive(TIMEOUT)
            seen.append((bytes(first.body), first.delivery_count, first.first_acquirer))
            assert first.subject == "s1" and first.properties == {"k": "v", "n": 1}
            rcv.fetcher.unsettled[0].local.failed = True  # a failed delivery attempt:
            rcv.release()  # modified, back to the queue, delivered again with a higher count
            for _ in range(2):
                msg = rcv.receive(TIMEOUT)
                seen.append((bytes(msg.body), msg.delivery_count, msg.first_acquirer))
                if bytes(msg.body) == b"two":
                    rcv.reject()
                else:
                    rcv.accept()
            return seen
        finally:
            conn.close()

    seen = await asyncio.to_thread(client)
    assert seen[0] == (b"one", 0, True)
    assert (b"one", 1, False) in seen[1:]
    assert any(body == b"two" for body, _, _ in seen[1:])
    await asyncio.sleep(0.1)  # settlements are batched per turn
    assert (await broker.queues.info("work")).messages == 0


async def test_only_a_failed_delivery_counts_toward_max_redelivery(
    broker: Broker, amqp: Listener
) -> None:
    """Released (§3.4.4) and modified without delivery-failed (§3.4.5) leave the delivery
    count as it was, and received (§3.4.1) is no outcome: none of them uses up the queue's
    max_redelivery of 1, nor settles the message; accepted does."""
    await broker.queues.create(QueueConfig(name="kept", max_redelivery=1))

    def client() -> list[tuple[int | None, bool | None]]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            conn.create_sender("kept").send(Message(body=b"m"))
            seen = []
            for outcome in ("released", "modified", "received", "released", "accepted"):
                rcv = conn.create_receiver("kept")  # one credit, given by receive()
                msg = rcv.receive(TIMEOUT)
                seen.append((msg.delivery_count, msg.first_acquirer))
                dlv = rcv.fetcher.unsettled.popleft()
                if outcome == "received":  # not settled: the message stays this link's
                    dlv.update(Delivery.RECEIVED)
                    time.sleep(0.3)
                    assert not dlv.settled  # by the gateway
                    rcv.close()  # unsettled: back to the queue, a failed delivery
                    continue
                if outcome == "modified":
                    dlv.local.failed = False
                state = {"released": Delivery.RELEASED, "modified": Delivery.MODIFIED}
                dlv.update(state.get(outcome, Delivery.ACCEPTED))
                dlv.settle()
                rcv.close()
            return seen
        finally:
            conn.close()

    seen = await asyncio.to_thread(client)
    # acquired before (released, modified): first-acquirer false, the count unchanged
    assert seen == [(0, True), (0, False), (0, False), (1, False), (1, False)]
    assert await queued(broker, "kept", 0) == 0


async def test_amqp_value_map_comes_back_as_sent(broker: Broker, amqp: Listener) -> None:
    """A body the plain codec leaves to proton (an amqp-value map) is sent back by proton's
    encoder, next to one the plain codec writes."""
    await broker.queues.create(QueueConfig(name="maps"))

    def client() -> list[object]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("maps")
            snd.send(Message(body={"sequence": 1, "list": [1, "two"]}))
            snd.send(Message(body=b"plain"))
            rcv = conn.create_receiver("maps", credit=10)
            bodies = []
            for _ in range(2):
                msg = rcv.receive(TIMEOUT)  # held: a binary body is a view into it
                bodies.append(msg.body if isinstance(msg.body, dict) else bytes(msg.body))
                rcv.accept()
            return bodies
        finally:
            conn.close()

    bodies = await asyncio.to_thread(client)
    assert bodies == [{"sequence": 1, "list": [1, "two"]}, b"plain"]
    assert await queued(broker, "maps", 0) == 0


def send_outcome(conn: BlockingConnection, snd, msg: Message) -> tuple[int, str | None]:
    """Send on a blocking sender and return (remote state, condition name) of the delivery."""
    dlv = snd.link.send(msg)
    conn.wait(lambda: dlv.settled, timeout=TIMEOUT)
    cond = dlv.remote.condition
    return dlv.remote_state, cond.name if cond else None


async def test_sasl_plain_good_and_bad_password(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="q"))

    def good() -> None:
        conn = BlockingConnection(
            url(amqp, "alice", "s3cret"), timeout=TIMEOUT, allowed_mechs="PLAIN"
        )
        conn.create_sender("q").send(Message(body=b"hi"))
        conn.close()

    def bad() -> str:
        try:
            conn = BlockingConnection(
                url(amqp, "alice", "wrong"), timeout=TIMEOUT, allowed_mechs="PLAIN"
            )
        except ConnectionException as exc:
            return str(exc)
        conn.close()
        return "connected"

    await asyncio.to_thread(good)
    assert "amqp:unauthorized-access" in await asyncio.to_thread(bad)
    assert (await broker.queues.info("q")).messages == 1


@pytest.mark.parametrize(
    ("response", "outcome"),
    [
        (b"\x00alice\x00s3cret", 0),
        (b"alice\x00alice\x00s3cret", 0),  # the user's own authorization identity
        (b"root\x00alice\x00s3cret", 1),  # alice acting as another: no user may
        (b"\x00al\xffice\x00s3cret", 1),  # not UTF-8 (RFC 4616 §2)
    ],
    ids=["plain", "own-authzid", "other-authzid", "not-utf8"],
)
async def test_sasl_plain_authorization_identity(
    amqp: Listener, response: bytes, outcome: int
) -> None:
    """An authorization identity was ignored: alice logging in "as root" was let in."""
    peer = await Peer.connect(amqp.port)
    try:
        peer.send(SASL_HEADER + sasl_init("PLAIN", response))
        assert await peer.read_header() == SASL_HEADER
        await peer.read()  # the mechanisms
        assert (await peer.read()).fields == [ubyte(outcome)]  # 0 ok, 1 auth
    finally:
        peer.close()


async def test_anonymous_refused_when_disabled(broker: Broker) -> None:
    settings = Settings(
        amqp_port=0, host="127.0.0.1", allow_anonymous=False, users=[User("alice", "s3cret")]
    )
    listener = await start(broker, settings)
    assert listener is not None

    def anonymous() -> str:
        try:
            BlockingConnection(url(listener), timeout=TIMEOUT).close()
        except ConnectionException as exc:
            return str(exc)
        return "connected"

    def plain() -> None:
        BlockingConnection(
            url(listener, "alice", "s3cret"), timeout=TIMEOUT, allowed_mechs="PLAIN"
        ).close()

    try:
        assert "amqp:unauthorized-access" in await asyncio.to_thread(anonymous)
        await asyncio.to_thread(plain)
        # a client that skips SASL is told to speak it, then cut off
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        writer.write(AMQP_HEADER)
        assert await asyncio.wait_for(reader.read(), TIMEOUT) == SASL_HEADER
        writer.close()
    finally:
        await listener.close()


async def test_a_no_local_topic_subscriber_skips_its_own_connections_messages(
    broker: Broker, amqp: Listener
) -> None:
    """JMS noLocal (Qpid JMS's apache.org:no-local-filter:list) was ignored and not echoed:
    the consumer got its own connection's messages (found by a review)."""
    described = Described(symbol("apache.org:no-local-filter:list"), [])
    no_local = Filter({symbol("no-local"): described})

    def client() -> tuple[bool, list[bytes]]:
        me = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="me")
        other = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="other")
        try:
            receiver = me.create_receiver("topic://news", credit=10, options=no_local)
            echoed = terminus.no_local(receiver.link.remote_source) is not None
            me.create_sender("topic://news").send(Message(body=b"own"))
            other.create_sender("topic://news").send(Message(body=b"theirs"))
            got = []
            with contextlib.suppress(Timeout):
                while True:
                    msg = receiver.receive(0.5)
                    got.append(bytes(msg.body))
                    receiver.accept()
            return echoed, got
        finally:
            me.close()
            other.close()

    assert await asyncio.to_thread(client) == (True, [b"theirs"])


async def test_anonymous_relay(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="r1"))

    def client() -> tuple[list[str], list[tuple[int, str | None]]]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            caps = [str(c) for c in conn.conn.remote_offered_capabilities or []]
            snd = conn.create_sender(None)
            outcomes = [
                send_outcome(conn, snd, Message(address="r1", body=b"x")),
                send_outcome(conn, snd, Message(address="queue://r1", body=b"y")),
                send_outcome(conn, snd, Message(address="missing", body=b"z")),
            ]
            return caps, outcomes
        finally:
            conn.close()

    caps, outcomes = await asyncio.to_thread(client)
    assert "ANONYMOUS-RELAY" in caps and "DELAYED_DELIVERY" in caps
    assert "SHARED-SUBS" in caps  # else Qpid JMS creates no shared subscription (a review)
    assert outcomes[:2] == [(Disposition.ACCEPTED, None)] * 2
    assert outcomes[2] == (Disposition.REJECTED, "amqp:not-found")
    assert (await broker.queues.info("r1")).messages == 2


async def test_too_large_is_rejected(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="small", max_message_size=100))

    def client() -> list[tuple[int, str | None]]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("small")
            return [
                send_outcome(conn, snd, Message(body=b"x" * 10)),
                send_outcome(conn, snd, Message(body=b"x" * 1000)),
            ]
        finally:
            conn.close()

    ok, big = await asyncio.to_thread(client)
    assert ok == (Disposition.ACCEPTED, None)
    assert big == (Disposition.REJECTED, "amqp:resource-limit-exceeded")


async def test_garbage_closes_only_that_connection(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="after"))
    reader, writer = await asyncio.open_connection("127.0.0.1", amqp.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = await asyncio.wait_for(reader.read(), TIMEOUT)  # read until the server closes
    writer.close()
    assert reply.startswith(b"AMQP")

    def client() -> None:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        conn.create_sender("after").send(Message(body=b"still serving"))
        conn.close()

    await asyncio.to_thread(client)
    assert (await broker.queues.info("after")).messages == 1


async def test_topic_publish_reaches_subscribed_queue(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="tq"), [("a/>", "smf")])
    await broker.router.reload()

    def client() -> bytes:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            sub = conn.create_receiver("topic://a/*", credit=10)  # a temporary queue
            conn.create_sender("topic://a/b").send(Message(body=b"t1"))
            msg = sub.receive(TIMEOUT)
            sub.accept()
            return bytes(msg.body)
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == b"t1"
    assert (await broker.queues.info("tq")).messages == 1


async def test_dynamic_reply_to(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="requests"))

    def requester(addr_out: list[str]) -> bytes:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            replies = conn.create_receiver(None, dynamic=True, credit=10)
            reply_to = replies.link.remote_source.address
            addr_out.append(reply_to)
            conn.create_sender("requests").send(
                Message(body=b"ping", reply_to=reply_to, correlation_id="c-1")
            )
            msg = replies.receive(TIMEOUT)
            replies.accept()
            assert msg.correlation_id == "c-1"
            return bytes(msg.body)
        finally:
            conn.close()

    def responder() -> None:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            rcv = conn.create_receiver("requests", credit=1)
            req = rcv.receive(TIMEOUT)
            conn.create_sender(req.reply_to).send(
                Message(body=b"pong", correlation_id=req.correlation_id)
            )
            rcv.accept()
        finally:
            conn.close()

    addr: list[str] = []
    req_task = asyncio.create_task(asyncio.to_thread(requester, addr))
    await asyncio.to_thread(responder)
    assert await req_task == b"pong"
    await asyncio.sleep(0.2)
    assert addr and not await broker.queues.exists(addr[0])  # deleted with its link


async def test_drain_is_exact(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="d"))

    def client() -> tuple[list[bytes], int, bool]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("d")
            for i in range(2):
                snd.send(Message(body=f"{i}".encode()))
            rcv = conn.create_receiver("d", credit=0)
            fetched = rcv.fetcher
            rcv.link.drain(10)
            conn.wait(lambda: fetched.has_message == 2 and not rcv.link.draining(), timeout=TIMEOUT)
            credit = rcv.link.credit  # the gateway gave back the 8 it could not use
            messages = [fetched.pop() for _ in range(2)]
            bodies = [bytes(m.body) for m in messages]  # a body is a view into its message
            rcv.accept()
            rcv.accept()
            snd.send(Message(body=b"after the drain"))  # no credit left: must stay queued
            with contextlib.suppress(Timeout):
                conn.wait(lambda: fetched.has_message > 0, timeout=0.3)
            return bodies, credit, fetched.has_message > 0
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == ([b"0", b"1"], 0, False)
    assert await queued(broker, "d", 1) == 1


async def test_drain_on_exclusive_standby(broker: Broker, amqp: Listener) -> None:
    """A standby cannot fetch, so nothing would report it empty: its drain ends at once."""
    await broker.queues.create(QueueConfig(name="ex", access_type="exclusive"))

    def client() -> tuple[int, bytes]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            conn.create_sender("ex").send(Message(body=b"for the active one"))
            active = conn.create_receiver("ex", name="active", credit=0)
            standby = conn.create_receiver("ex", name="standby", credit=0)
            standby.link.drain(5)
            conn.wait(lambda: not standby.link.draining(), timeout=TIMEOUT)
            msg = active.receive(TIMEOUT)
            active.accept()
            return standby.link.credit, bytes(msg.body)
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == (0, b"for the active one")


class Drainer(MessagingHandler):
    """Container client that only ever drains: `link.drain(3)` until a drain comes back
    short (credit used up by transfers, or handed back by the gateway's drained flow)."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(prefetch=0)
        self.url, self.queue = url, queue
        self.received: list[bytes] = []
        self.drains = 0
        self.draining = False
        self.error: str | None = None

    def on_start(self, event) -> None:
        self.conn = event.container.connect(self.url)
        event.container.create_receiver(self.conn, self.queue)
        self.timer = event.container.schedule(TIMEOUT, self)

    def on_link_opened(self, event) -> None:
        self._drain(event.receiver)

    def _drain(self, link) -> None:
        self.draining = True
        link.drain(3)

    def on_message(self, event) -> None:
        self.received.append(bytes(event.message.body))
        self._check(event.receiver)

    def on_link_flow(self, event) -> None:
        if event.receiver is not None:
            self._check(event.receiver)

    def _check(self, link) -> None:
        if not self.draining or link.draining() or link.credit or link.queued:
            return
        self.draining = False
        self.drains += 1
        if self.drains < 10 and len(self.received) == 3 * self.drains:
            self._drain(link)  # the last drain came back full: there may be more
        else:
            self.timer.cancel()
            link.connection.close()

    def on_timer_task(self, event) -> None:
        self.error = "timed out"
        self.conn.close()


async def run_container(handler: MessagingHandler) -> None:
    """Run a proton Container with `handler` in a worker thread until it stops."""

    def run() -> None:
        container = Container(handler)
        container.timeout = TIMEOUT
        container.run()

    await asyncio.wait_for(asyncio.to_thread(run), TIMEOUT * 2)


async def test_container_drain_until_empty(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="drained"))
    for i in range(7):
        await broker.publish(GatewayMessage("drained", f"{i}".encode(), to_queue=True))
    handler = Drainer(url(amqp), "drained")

    await run_container(handler)
    assert handler.error is None
    assert handler.received == [f"{i}".encode() for i in range(7)]
    assert handler.drains == 3  # 3 + 3 + 1: the third drain ended early, exactly


async def test_heartbeats_keep_an_idle_client(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="hb"))

    def client() -> None:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT, heartbeat=0.4)
        try:
            with pytest.raises(Timeout):
                conn.wait(lambda: False, timeout=1.5)  # the server must send empty frames
            conn.create_sender("hb").send(Message(body=b"alive"))
        finally:
            conn.close()

    await asyncio.to_thread(client)
    assert (await broker.queues.info("hb")).messages == 1


class RoundTrip(MessagingHandler):
    """Container client: send N messages to a queue, receive and accept them, close."""

    def __init__(self, url: str, queue: str, count: int) -> None:
        super().__init__()
        self.url, self.queue, self.count = url, queue, count
        self.sent = 0
        self.received: list[bytes] = []
        self.error: str | None = None

    def on_start(self, event) -> None:
        self.conn = event.container.connect(self.url)
        event.container.create_receiver(self.conn, self.queue)
        event.container.create_sender(self.conn, self.queue)
        self.timer = event.container.schedule(TIMEOUT, self)  # bound the run

    def on_timer_task(self, event) -> None:
        self.error = self.error or "timed out"
        self.conn.close()

    def on_sendable(self, event) -> None:
        while event.sender.credit and self.sent < self.count:
            event.sender.send(Message(body=f"c{self.sent}".encode(), group_id="k"))
            self.sent += 1

    def on_message(self, event) -> None:
        self.received.append(bytes(event.message.body))
        if len(self.received) == self.count:
            self.accept(event.delivery)  # before auto-accept would: we close now
            self.timer.cancel()
            event.connection.close()

    def on_transport_error(self, event) -> None:
        self.error = str(event.transport.condition)
        event.connection.close()


async def test_container_client_round_trip(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="jobs"))
    handler = RoundTrip(url(amqp), "jobs", 20)

    await run_container(handler)
    assert handler.error is None
    assert handler.received == [f"c{i}".encode() for i in range(20)]
    await asyncio.sleep(0.1)
    assert (await broker.queues.info("jobs")).messages == 0


class SettlingReceiver(MessagingHandler):
    """Container client that settles by hand: one receiver on `queue`, given up (with
    `error` set) after TIMEOUT."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(auto_accept=False)
        self.url, self.queue = url, queue
        self.held: list = []
        self.error: str | None = None

    def on_start(self, event) -> None:
        self.conn = event.container.connect(self.url)
        event.container.create_receiver(self.conn, self.queue)
        self.timer = event.container.schedule(TIMEOUT, self)

    def on_timer_task(self, event) -> None:
        self.error = "timed out"
        self.conn.close()


class OutOfOrder(SettlingReceiver):
    """Take three messages unsettled, then settle them last first (accept the third,
    reject the second, release the first) and take the redelivery."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(url, queue)
        self.received: list[tuple[bytes, int]] = []

    def on_message(self, event) -> None:
        self.received.append((bytes(event.message.body), event.message.delivery_count))
        if len(self.received) == 4:  # the released one, back
            self.accept(event.delivery)
            self.timer.cancel()
            event.connection.close()
            return
        self.held.append(event.delivery)
        if len(self.held) == 3:
            first, second, third = self.held
            self.accept(third)
            self.reject(second)
            self.release(first)


async def test_outcomes_settled_out_of_order_reach_their_messages(
    broker: Broker, amqp: Listener
) -> None:
    await broker.queues.create(QueueConfig(name="ooo"))
    for body in (b"m0", b"m1", b"m2"):
        await broker.publish(GatewayMessage("ooo", body, to_queue=True))
    handler = OutOfOrder(url(amqp), "ooo")

    await run_container(handler)
    assert handler.error is None
    # proton's release() is modified without delivery-failed: the count stays (§3.4.5)
    assert handler.received == [(b"m0", 0), (b"m1", 0), (b"m2", 0), (b"m0", 0)]
    assert await queued(broker, "ooo", 0) == 0


class TagWatcher(SettlingReceiver):
    """Hold the first messages unsettled, accept the others at once, and note each
    delivery's tag."""

    def __init__(self, url: str, queue: str, total: int, hold: int) -> None:
        super().__init__(url, queue)
        self.total, self.hold = total, hold
        self.tags: list[str] = []

    def on_message(self, event) -> None:
        self.tags.append(str(event.delivery.tag))
        if len(self.held) < self.hold:
            self.held.append(event.delivery)
        else:
            self.accept(event.delivery)
        if len(self.tags) == self.total:
            for delivery in self.held:
                self.accept(delivery)
            self.timer.cancel()
            event.connection.close()


async def test_delivery_tags_are_reused_only_once_settled(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="tags"))
    for i in range(60):
        await broker.publish(GatewayMessage("tags", b"%d" % i, to_queue=True))
    handler = TagWatcher(url(amqp), "tags", total=60, hold=5)

    await run_container(handler)
    assert handler.error is None
    held, later = handler.tags[:5], handler.tags[5:]
    assert len(set(held)) == 5
    assert not set(held) & set(later)  # unique among the unsettled deliveries
    assert len(set(later)) < len(later)  # settled deliveries' tags came back
    assert await queued(broker, "tags", 0) == 0


RHEA_SCRIPT = r"""
const container = require('rhea');
const port = Number(process.argv[2]);
const total = 5;
let sent = 0;
const received = [];
setTimeout(() => { console.error('timed out'); process.exit(3); }, 8000).unref();
container.on('connection_open', (ctx) => {
  ctx.connection.open_receiver('rhea-q');
  ctx.connection.open_sender('rhea-q');
});
container.on('sendable', (ctx) => {
  while (ctx.sender.sendable() && sent < total) {
    ctx.sender.send({body: 'r' + sent, application_properties: {n: sent}});
    sent++;
  }
});
container.on('message', (ctx) => {
  const body = ctx.message.body;
  const content = body && body.content !== undefined ? body.content : body;
  received.push([Buffer.from(content).toString(), ctx.message.application_properties.n]);
  if (received.length === total) {
    console.log(JSON.stringify(received));
    ctx.connection.close();
  }
});
container.on('error', (err) => { console.error(String(err)); process.exit(2); });
container.on('disconnected', (ctx) => {
  if (ctx.error) { console.error(String(ctx.error)); process.exit(4); }
});
container.connect({host: '127.0.0.1', port, username: 'alice', password: 's3cret',
                   reconnect: false});
"""


@pytest.fixture(scope="session")
def rhea_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with rhea installed from npm (skips when node or npm cannot provide it)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the rhea interop test")
    path = tmp_path_factory.mktemp("rhea")
    try:
        result = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(path), "rhea"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.skip("npm install rhea timed out")
    if result.returncode != 0 or not (path / "node_modules" / "rhea").is_dir():
        pytest.skip(f"npm could not install rhea: {result.stderr.strip()[-300:]}")
    (path / "roundtrip.js").write_text(RHEA_SCRIPT)
    return path


async def test_rhea_send_and_receive(broker: Broker, amqp: Listener, rhea_dir: Path) -> None:
    await broker.queues.create(QueueConfig(name="rhea-q"))
    proc = await asyncio.create_subprocess_exec(
        "node",
        str(rhea_dir / "roundtrip.js"),
        str(amqp.port),
        cwd=rhea_dir,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert json.loads(out) == [[f"r{i}", i] for i in range(5)]


class Capability(LinkOption):
    """Qpid JMS style: mark the terminus with capabilities ('queue', 'topic', 'shared'...;
    several go as an array of symbols)."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def apply(self, link) -> None:
        terminus = link.source if link.is_receiver else link.target
        symbols = [symbol(name) for name in self.names]
        value = symbols[0] if len(symbols) == 1 else Array(UNDESCRIBED, Data.SYMBOL, *symbols)
        terminus.capabilities.put_object(value)


class DynamicTarget(LinkOption):
    """Qpid JMS temporary queue: a sender with target.dynamic = true."""

    def apply(self, link) -> None:
        link.target.dynamic = True


async def test_address_forms_and_capabilities(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="forms"))
    await broker.queues.create(QueueConfig(name="caps"), [("news/>", "smf")])
    await broker.router.reload()

    def client() -> None:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            conn.create_sender("/queues/forms").send(Message(body=b"rabbit style"))
            conn.create_sender("queue://forms").send(Message(body=b"scheme"))
            conn.create_sender("news/today", options=Capability("topic")).send(
                Message(body=b"jms topic")
            )
        finally:
            conn.close()

    await asyncio.to_thread(client)
    assert (await broker.queues.info("forms")).messages == 2
    assert (await broker.queues.info("caps")).messages == 1


async def test_presettled_both_ways(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="fire"))

    def client() -> list[bytes]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("fire", options=AtMostOnce())
            for i in range(3):
                snd.send(Message(body=f"p{i}".encode()))
            rcv = conn.create_receiver("fire", credit=10, options=AtMostOnce())
            messages = [rcv.receive(TIMEOUT) for _ in range(3)]
            return [bytes(m.body) for m in messages]
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == [b"p0", b"p1", b"p2"]
    await asyncio.sleep(0.1)
    assert (await broker.queues.info("fire")).messages == 0  # acked when sent


async def test_dynamic_target_is_a_temporary_queue(broker: Broker, amqp: Listener) -> None:
    def client() -> tuple[str, bytes]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender(None, options=DynamicTarget())
            name = snd.link.remote_target.address
            snd.send(Message(body=b"to myself"))
            rcv = conn.create_receiver(name, credit=1)
            msg = rcv.receive(TIMEOUT)
            rcv.accept()
            return name, bytes(msg.body)
        finally:
            conn.close()

    name, body = await asyncio.to_thread(client)
    assert body == b"to myself"
    await asyncio.sleep(0.2)
    assert not await broker.queues.exists(name)


LOST_CLIENT = """
import contextlib, os, sys
from proton import Message, Timeout
from proton.utils import BlockingConnection
conn = BlockingConnection(f"amqp://127.0.0.1:{sys.argv[1]}", timeout=5)
conn.create_receiver("held", credit=1).receive(5)
snd = conn.create_sender("burst")
for _ in range(50):
    snd.link.send(Message(body=b"burst"))  # outcomes may come back after the socket is gone
with contextlib.suppress(Timeout):
    conn.wait(lambda: False, timeout=0.01)
os._exit(0)  # the socket drops with deliveries unsettled both ways
"""


async def test_unknown_source_and_lost_client(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="held"))
    await broker.queues.create(QueueConfig(name="burst"))

    def first() -> str:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            with pytest.raises(LinkDetached) as info:
                conn.create_receiver("no-such-queue")
            conn.create_sender("held").send(Message(body=b"unsettled"))
            return str(info.value)
        finally:
            conn.close()

    def second() -> tuple[bytes, int]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            msg = conn.create_receiver("held", credit=1).receive(TIMEOUT)
            return bytes(msg.body), msg.delivery_count
        finally:
            conn.close()

    assert "amqp:not-found" in await asyncio.to_thread(first)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", LOST_CLIENT, str(amqp.port))
    assert await asyncio.wait_for(proc.wait(), TIMEOUT * 2) == 0
    assert await asyncio.to_thread(second) == (b"unsettled", 1)


async def test_idle_client_is_disconnected(
    broker: Broker, amqp: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "IDLE_TIMEOUT", 0.4)
    await broker.queues.create(QueueConfig(name="idle"))

    def client() -> str:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            time.sleep(1.2)  # no I/O at all, so no heartbeats either
            conn.create_sender("idle")
        except ConnectionException as exc:
            return str(exc)
        finally:
            with contextlib.suppress(Exception):
                conn.close()
        return "still open"

    assert "idle" in await asyncio.to_thread(client)


class MaxMessageSize(LinkOption):
    """A receiver that announces a max-message-size on attach."""

    def __init__(self, size: int) -> None:
        self.size = size

    def apply(self, link) -> None:
        link.max_message_size = self.size


async def test_receiver_max_message_size_is_honoured(broker: Broker, amqp: Listener) -> None:
    """A message over the receiver's max-message-size is not sent to it (§2.7.3): it is
    rejected, and the link's credit is not spent on it (the message after it came only
    with more credit)."""
    await broker.queues.create(QueueConfig(name="sized"))

    def client() -> bytes:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("sized")
            snd.send(Message(body=b"x" * 5000))
            snd.send(Message(body=b"small"))
            rcv = conn.create_receiver("sized", credit=1, options=MaxMessageSize(1000))
            msg = rcv.receive(TIMEOUT)
            rcv.accept()
            return bytes(msg.body)
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == b"small"
    await asyncio.sleep(0.1)
    assert (await broker.queues.info("sized")).messages == 0


async def test_a_message_over_a_topic_subscribers_max_message_size_is_rejected(
    broker: Broker, amqp: Listener
) -> None:
    """A non-durable topic subscription's queue has no other consumer: a message too big
    for its link is rejected there, not kept in it until the link goes."""
    loop = asyncio.get_running_loop()

    async def held() -> int:
        names = [n for n in await broker.queues.names() if n.startswith("#tsub/")]
        return sum([(await broker.queues.info(n)).messages for n in names])

    def client() -> tuple[bytes, int]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            rcv = conn.create_receiver("topic://sized", credit=10, options=MaxMessageSize(1000))
            snd = conn.create_sender("topic://sized")
            snd.send(Message(body=b"x" * 5000))
            snd.send(Message(body=b"small"))
            msg = rcv.receive(TIMEOUT)
            rcv.accept()
            with pytest.raises(Timeout):  # sends the accept, and the big one is not sent
                rcv.receive(0.5)
            return bytes(msg.body), asyncio.run_coroutine_threadsafe(held(), loop).result()
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == (b"small", 0), "kept for a link that cannot"


async def test_link_churn_on_one_connection(
    broker: Broker, amqp: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    await broker.queues.create(QueueConfig(name="churn"))

    def client() -> None:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            for i in range(30):
                snd = conn.create_sender("churn")
                snd.send(Message(body=f"{i}".encode()))
                snd.close()
            snd = conn.create_sender("churn")
            for _ in range(50):  # detach with outcomes still on their way back
                snd.link.send(Message(body=b"burst"))
            snd.close()
            rcv = conn.create_receiver("churn", credit=5)
            rcv.receive(TIMEOUT)
            rcv.close()  # detach with deliveries unsettled: they go back to the queue
            conn.create_sender("churn").send(Message(body=b"last"))
        finally:
            conn.close()

    await asyncio.to_thread(client)
    await asyncio.sleep(0.2)
    # every transfer reached the gateway before its detach, so all were stored; the
    # received-but-unsettled one went back to the queue
    assert (await broker.queues.info("churn")).messages == 30 + 50 + 1
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_listener_close_closes_clients(broker: Broker) -> None:
    listener = await start(broker, Settings(amqp_port=0, host="127.0.0.1"))
    assert listener is not None
    connected = threading.Event()

    def client() -> str:
        conn = BlockingConnection(url(listener), timeout=TIMEOUT)
        connected.set()
        try:
            conn.wait(lambda: False, timeout=TIMEOUT)
        except ConnectionException as exc:
            return str(exc)
        finally:
            with contextlib.suppress(Exception):
                conn.close()
        return "not closed"

    task = asyncio.create_task(asyncio.to_thread(client))
    assert await asyncio.to_thread(connected.wait, TIMEOUT)
    await listener.close()
    assert "amqp:connection:forced" in await task


async def test_multi_frame_message_round_trip(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="big"))
    payload = bytes(range(256)) * 1200  # ~300 KB: many transfer frames each way

    def client() -> bytes:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            conn.create_sender("big").send(Message(body=payload))
            rcv = conn.create_receiver("big", credit=1)
            msg = rcv.receive(TIMEOUT)
            rcv.accept()
            return bytes(msg.body)
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == payload


async def test_deleted_queue_detaches_its_receivers(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="doomed"))
    attached = threading.Event()

    def client() -> str:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            conn.create_receiver("doomed", credit=1)
            attached.set()
            conn.wait(lambda: False, timeout=TIMEOUT)  # the detach raises out of here
        except LinkDetached as exc:
            return str(exc)
        finally:
            conn.close()
        return "still attached"

    task = asyncio.create_task(asyncio.to_thread(client))
    assert await asyncio.to_thread(attached.wait, TIMEOUT)
    await broker.delete_queue("doomed")
    assert "amqp:resource-deleted" in await task


class Browse(LinkOption):
    """A browsing receiver (distribution-mode copy), as Qpid JMS QueueBrowser attaches."""

    def apply(self, link) -> None:
        link.source.distribution_mode = Terminus.DIST_MODE_COPY


def echoed_filter(rcv) -> dict:
    """The filter map the gateway echoed on attach (the filters it applies)."""
    data = rcv.link.remote_source.filter
    data.rewind()
    return data.get_object() if data.next() else {}


JMS_SELECTOR_CODE = ulong(0x0000468C00000004)


async def test_selectors_symbolic_and_numeric_descriptor(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="paint"))

    def client() -> tuple[list[str], list[str], dict, dict, str]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("paint")
            for i, colour in enumerate(["red", "blue", "red", "green", "blue"]):
                snd.send(Message(body=f"{colour}{i}".encode(), properties={"colour": colour}))
            reds = conn.create_receiver(
                "paint", name="reds", credit=10, options=Selector("colour = 'red'")
            )
            jms = {symbol("jms-selector"): Described(JMS_SELECTOR_CODE, "colour = 'blue'")}
            blues = conn.create_receiver("paint", name="blues", credit=10, options=Filter(jms))
            got = []
            for rcv in (reds, blues):
                messages = [rcv.receive(TIMEOUT) for _ in range(2)]
                got.append([bytes(m.body).decode() for m in messages])
                rcv.accept()
                rcv.accept()
            with pytest.raises(LinkDetached) as info:
                conn.create_receiver("paint", name="bad", options=Selector("colour = = 'x'"))
            return got[0], got[1], echoed_filter(reds), echoed_filter(blues), str(info.value)
        finally:
            conn.close()

    reds, blues, red_filter, blue_filter, refused = await asyncio.to_thread(client)
    assert reds == ["red0", "red2"] and blues == ["blue1", "blue4"]
    assert red_filter == {
        symbol("selector"): Described(symbol("apache.org:selector-filter:string"), "colour = 'red'")
    }
    assert blue_filter == {symbol("jms-selector"): Described(JMS_SELECTOR_CODE, "colour = 'blue'")}
    assert "amqp:invalid-field" in refused and "position" in refused
    assert await queued(broker, "paint", 1) == 1  # green: left for others


async def test_jms_timestamp_selects_on_creation_time(broker: Broker, amqp: Listener) -> None:
    """JMS 2.0 §3.8.1.1: selectors may use JMSTimestamp, which Qpid JMS sends as
    properties.creation-time; a message without one has none (NULL)."""
    await broker.queues.create(QueueConfig(name="stamped"))

    def client() -> tuple[list[str], list[str]]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("stamped")
            for body, created in (("old", 1_000_000_000), ("new", 2_000_000_000), ("none", 0)):
                msg = Message(body=body)
                if created:
                    msg.creation_time = created  # seconds, as proton's Message has it
                snd.send(msg)
            got = []
            for name, text in (
                ("late", "JMSTimestamp > 1500000000000"),
                ("bare", "JMSTimestamp IS NULL"),
            ):
                rcv = conn.create_receiver("stamped", name=name, credit=10, options=Selector(text))
                got.append([str(rcv.receive(TIMEOUT).body)])
                rcv.accept()
            return got[0], got[1]
        finally:
            conn.close()

    late, bare = await asyncio.to_thread(client)
    assert late == ["new"] and bare == ["none"]
    assert await queued(broker, "stamped", 1) == 1  # old: left for others


async def test_browse_takes_nothing(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="shelf"))

    def client() -> tuple[list[bytes], int, list[bytes]]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("shelf")
            for i in range(4):
                snd.send(Message(body=f"b{i}".encode()))
            browser = conn.create_receiver("shelf", name="browser", credit=10, options=Browse())
            mode = browser.link.remote_source.distribution_mode
            seen = [browser.receive(TIMEOUT) for _ in range(4)]
            for _ in seen:
                browser.accept()  # settling a browsed message only frees the window
            browsed = [bytes(m.body) for m in seen]
            browser.close()
            consumer = conn.create_receiver("shelf", name="consumer", credit=10)
            taken = [consumer.receive(TIMEOUT) for _ in range(4)]
            for _ in taken:
                consumer.accept()
            return browsed, mode, [bytes(m.body) for m in taken]
        finally:
            conn.close()

    browsed, mode, taken = await asyncio.to_thread(client)
    expected = [f"b{i}".encode() for i in range(4)]
    assert browsed == expected and taken == expected
    assert mode == Terminus.DIST_MODE_COPY  # echoed: the client knows it browses
    assert await queued(broker, "shelf", 0) == 0


async def test_durable_topic_subscription(broker: Broker, amqp: Listener) -> None:
    def subscribe_then_detach() -> bytes:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="jms-client-1")
        try:
            sub = conn.create_receiver(
                "topic://news/>", name="sub1", credit=10, options=DurableSubscription()
            )
            conn.create_sender("topic://news/a").send(Message(body=b"while attached"))
            msg = sub.receive(TIMEOUT)
            sub.accept()
            sub.link.detach()  # detach without closing: the subscription stays
            return bytes(msg.body)
        finally:
            conn.close()

    def publish(body: bytes) -> None:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            conn.create_sender("topic://news/b").send(Message(body=body))
        finally:
            conn.close()

    def resume_then_close() -> list[bytes]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="jms-client-1")
        try:
            sub = conn.create_receiver(
                "topic://news/>", name="sub1", credit=10, options=DurableSubscription()
            )
            messages = [sub.receive(TIMEOUT) for _ in range(2)]
            sub.accept()
            sub.accept()
            sub.close()  # closing the link ends the subscription (JMS unsubscribe)
            return [bytes(m.body) for m in messages]
        finally:
            conn.close()

    assert await asyncio.to_thread(subscribe_then_detach) == b"while attached"
    [queue] = await durable_queues(broker, 1)
    assert (await broker.queues.config(queue)).durable
    await asyncio.to_thread(publish, b"missed 1")
    await asyncio.to_thread(publish, b"missed 2")
    assert (await broker.queues.info(queue)).messages == 2  # kept while nobody is attached
    assert await asyncio.to_thread(resume_then_close) == [b"missed 1", b"missed 2"]
    assert await durable_queues(broker, 0) == []


async def test_durable_subscription_unsubscribe_by_lookup(broker: Broker, amqp: Listener) -> None:
    """Qpid JMS unsubscribe: attach the subscription's link name with a null source address,
    then close the link. A bad selector leaves no subscription behind."""

    def client() -> tuple[str, str, int, str]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="jms-client-2")
        try:
            with pytest.raises(LinkDetached) as bad:
                conn.create_receiver(
                    "topic://x/y",
                    name="bad",
                    options=[DurableSubscription(), Selector("a = = 1")],
                )
            sub = conn.create_receiver(  # Qpid JMS style: a bare name marked as a topic
                "x/y", name="sub2", credit=10, options=[DurableSubscription(), Capability("topic")]
            )
            sub.link.detach()
            with pytest.raises(LinkDetached) as missing:
                conn.create_receiver(None, name="never-subscribed")
            lookup = conn.create_receiver(None, name="sub2", credit=0)
            source = lookup.link.remote_source
            found = source.address, source.durability
            lookup.close()
            return *found, str(bad.value) + str(missing.value)
        finally:
            conn.close()

    address, durability, refusals = await asyncio.to_thread(client)
    assert (address, durability) == ("topic://x/y", Terminus.DELIVERIES)
    assert "amqp:invalid-field" in refusals and "amqp:not-found" in refusals
    assert await durable_queues(broker, 0) == []


async def test_a_durable_subscription_in_use_is_locked(broker: Broker, amqp: Listener) -> None:
    """A durable subscription (container id + link name) has one link at a time (§2.6.1;
    JMS: one active consumer on an unshared durable subscription, never changed or removed
    while it has one): a second attach, with the same topic or another, and an unsubscribe
    lookup are refused with amqp:resource-locked; the first link keeps its messages,
    unsettled one included."""

    def client() -> tuple[list[str], list[str]]:
        first = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="jms-locked")
        try:
            sub = first.create_receiver(
                "topic://lk/a", name="sub", credit=10, options=DurableSubscription()
            )
            sender = first.create_sender("topic://lk/a")
            sender.send(Message(body="held"))
            held = sub.receive(TIMEOUT)  # unsettled
            refusals = []
            for address in ("topic://lk/a", "topic://lk/b", None):
                second = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="jms-locked")
                try:
                    with pytest.raises(LinkDetached) as refused:
                        options = DurableSubscription() if address else None
                        second.create_receiver(address, name="sub", credit=10, options=options)
                    refusals.append(str(refused.value))
                finally:
                    second.close()
            assert held.body == "held"
            sub.release()  # back to the subscription, which is still there
            sender.send(Message(body="after"))
            got = [sub.receive(TIMEOUT).body for _ in range(2)]  # strings: no views
            sub.accept()
            sub.accept()
            sub.close()
            return refusals, got
        finally:
            first.close()

    refusals, got = await asyncio.to_thread(client)
    assert all("amqp:resource-locked" in r for r in refusals), refusals
    assert got == ["held", "after"]
    assert await durable_queues(broker, 0) == []


async def test_shared_subscriptions(broker: Broker, amqp: Listener) -> None:
    """JMS 2.0 shared subscriptions as Qpid JMS maps them: capability `shared`, one
    subscription for the link names up to `|` (`sub`, `sub|2`), scoped to the container id
    or, with `global`, to none. Their links share its messages; a shared durable one outlives
    them and a close ends it only once no other link consumes; a shared non-durable one goes
    with its last link; another topic is refused while a link consumes."""

    def take(receiver: BlockingReceiver) -> list[str]:
        got = []
        with contextlib.suppress(Timeout):
            while True:
                got.append(receiver.receive(0.5).body)
                receiver.accept()
        return got

    def client() -> dict[str, object]:
        one = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="shared-1")
        two = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="shared-2")
        out: dict[str, object] = {}
        try:
            durable = [DurableSubscription(), Capability("shared", "global")]
            a = one.create_receiver("topic://sh/d", name="sub|global", credit=10, options=durable)
            b = two.create_receiver("topic://sh/d", name="sub|global", credit=10, options=durable)
            volatile = [Capability("shared")]
            c = one.create_receiver("topic://sh/v", name="vol", credit=10, options=volatile)
            d = one.create_receiver("topic://sh/v", name="vol|2", credit=10, options=volatile)
            with pytest.raises(LinkDetached) as refused:
                other = [DurableSubscription(), Capability("shared", "global")]
                two.create_receiver("topic://sh/x", name="sub|global2", options=other)
            out["refused"] = str(refused.value)
            sender = one.create_sender("topic://sh/d")
            for i in range(6):
                sender.send(Message(body=f"d{i}"))
            volatile_sender = one.create_sender("topic://sh/v")
            for i in range(6):
                volatile_sender.send(Message(body=f"v{i}"))
            out["durable"] = (take(a), take(b))
            out["volatile"] = (take(c), take(d))
            a.close()  # another link still consumes: the subscription stays
            sender.send(Message(body="after a"))
            out["after"] = take(b)
            b.link.detach()  # the last link goes: the durable subscription stays
            c.close()
            d.close()
            sender.send(Message(body="while away"))
            return out
        finally:
            one.close()
            two.close()

    def resume_then_end() -> list[str]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="shared-3")
        try:
            durable = [DurableSubscription(), Capability("shared", "global")]
            sub = conn.create_receiver(
                "topic://sh/d", name="sub|global", credit=10, options=durable
            )
            got = take(sub)
            sub.close()  # the last link closes: the subscription ends
            return got
        finally:
            conn.close()

    out = await asyncio.to_thread(client)
    assert "amqp:resource-locked" in str(out["refused"])
    for kind in ("durable", "volatile"):
        first, second = out[kind]
        assert first and second, (kind, out[kind])  # shared, not each a copy
        prefix = kind[0]
        assert sorted(first + second) == [f"{prefix}{i}" for i in range(6)]
    assert out["after"] == ["after a"]
    assert [n for n in await broker.queues.names() if n.startswith("#vts/")] == []
    [queue] = await durable_queues(broker, 1)
    assert (await broker.queues.info(queue)).messages == 1
    assert await asyncio.to_thread(resume_then_end) == ["while away"]
    assert await durable_queues(broker, 0) == []


async def test_a_subscription_asked_for_copy_says_its_links_take(
    broker: Broker, amqp: Listener
) -> None:
    """A link to a shared or durable subscription takes what it gets from the others (the
    subscription is a queue). Asked for `copy`, the source echoed it, telling the client
    its messages stay for other links (AMQP 1.0 §3.5.3: the node's actual mode; found by a
    review). A plain topic link copies: every link gets every message."""

    def modes() -> list[object]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="copy-asked")
        try:
            shared = [Capability("shared"), Copy()]
            durable = [DurableSubscription(), Copy()]
            return [
                conn.create_receiver(
                    "topic://cp/t", name=name, options=options
                ).link.remote_source.distribution_mode
                for name, options in (("sh", shared), ("du", durable), ("plain", [Copy()]))
            ]
        finally:
            conn.close()

    assert await asyncio.to_thread(modes) == [
        Terminus.DIST_MODE_MOVE,
        Terminus.DIST_MODE_MOVE,
        Terminus.DIST_MODE_COPY,
    ]


async def test_a_shared_subscription_whose_attach_its_client_left_goes(
    broker: Broker, amqp: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared non-durable subscription goes with its last link. A client that went while
    its attach was being served (here: waiting for a live node slow to answer the
    subscription's roll call) left the subscription's queue behind, with no link ever to
    leave it, gathering its topic's messages for good (found by a review)."""
    monkeypatch.setattr(roll_call, "ANSWER_TIMEOUT_S", 1.0)
    await broker.redis.fcall("gw_node_up", 0, "nslow", 60_000)
    peer = await Peer.opened(amqp.port)
    shared = symbol("shared")
    source = [
        "topic://left", uint(0), symbol("session-end"), uint(0), False,
        None, None, None, None, None, shared,
    ]  # fmt: skip
    attach = performative(
        ATTACH, "left", uint(0), True, ubyte(0), ubyte(0),
        Described(ulong(SOURCE), source), Described(ulong(TARGET), [None]),
    )  # fmt: skip
    peer.send(frame(attach))
    await asyncio.sleep(0.3)  # the queue is made; the roll call waits
    peer.close()

    async def subscriptions() -> list[str]:
        return [n for n in await broker.queues.names() if n.startswith("#vts/")]

    deadline = time.monotonic() + 3
    while left := await subscriptions():
        assert time.monotonic() < deadline, left
        await asyncio.sleep(0.05)


async def test_shared_and_unshared_durable_subscriptions_do_not_mix(
    broker: Broker, amqp: Listener
) -> None:
    """JMS 2.0: a shared durable subscription cannot be created where an unshared one of
    the same name and client id exists (createSharedDurableConsumer), nor the other way
    round (createDurableConsumer); the existing one and its messages stay."""

    def attach(name: str, caps: list[str]) -> str:
        """Attach and leave (the connection goes, the subscription stays); why refused."""
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="mix")
        options = [DurableSubscription(), *([Capability(*caps)] if caps else [])]
        try:
            conn.create_receiver("topic://mix/t", name=name, options=options)
            return ""
        except LinkDetached as exc:
            return str(exc)
        finally:
            conn.close()

    def client() -> list[str]:
        refusals = []
        for name, first, then in (("a", [], ["shared"]), ("b", ["shared"], [])):
            assert attach(name, first) == ""
            refusals.append(attach(name, then))
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            conn.create_sender("topic://mix/t").send(Message(body="kept"))
        finally:
            conn.close()
        return refusals

    refusals = await asyncio.to_thread(client)
    assert len(refusals) == 2
    assert all("amqp:precondition-failed" in r for r in refusals), refusals
    for queue in await durable_queues(broker, 2):
        assert (await broker.queues.info(queue)).messages == 1


async def test_dead_lettered_message_annotations(broker: Broker, amqp: Listener) -> None:
    await broker.declare_queue(QueueConfig(name="#DEAD_MSG_QUEUE", permission="consume"))
    await broker.queues.create(QueueConfig(name="q", dmq_eligible_default=True))
    await broker.queues.create(QueueConfig(name="q2"))

    def client() -> tuple[dict, dict, bytes]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            conn.create_sender("q").send(Message(body=b"poison"))
            eligible = Message(body=b"opted in")
            eligible.annotations = {symbol("x-opt-dmq-eligible"): True}
            conn.create_sender("q2").send(eligible)
            received = {}
            for queue in ("q", "q2"):
                rcv = conn.create_receiver(queue, credit=1)
                received[queue] = rcv.receive(TIMEOUT)
                assert received[queue].annotations[symbol("x-opt-jms-dest")] == 0
                rcv.reject()
            dmq = conn.create_receiver("#DEAD_MSG_QUEUE", credit=10)
            dead = {}
            for _ in range(2):
                msg = dmq.receive(TIMEOUT)
                dmq.accept()
                dead[msg.annotations[symbol("x-origin-queue")]] = msg
            return (
                {str(k): v for k, v in dead["q"].annotations.items()},
                {str(k): v for k, v in dead["q2"].annotations.items()},
                bytes(dead["q"].body),
            )
        finally:
            conn.close()

    first, second, body = await asyncio.to_thread(client)
    assert first["x-origin-queue"] == "q" and first["x-dmq-reason"] == "rejected"
    assert second["x-origin-queue"] == "q2" and second["x-dmq-reason"] == "rejected"
    assert body == b"poison"


async def test_topic_egress_says_topic(broker: Broker, amqp: Listener) -> None:
    def client() -> tuple[str, int]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            sub = conn.create_receiver("topic://t/x", credit=1)
            conn.create_sender("topic://t/x").send(Message(body=b"news"))
            msg = sub.receive(TIMEOUT)
            sub.accept()
            return msg.address, msg.annotations[symbol("x-opt-jms-dest")]
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == ("topic://t/x", 1)


async def test_undeliverable_here_goes_to_another_link(broker: Broker, amqp: Listener) -> None:
    """§3.4.5: a message modified with undeliverable-here is not sent to that link again;
    another link on the queue gets it."""
    await broker.queues.create(QueueConfig(name="picky"))

    def client() -> tuple[list[bytes], bytes]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("picky")
            snd.send(Message(body=b"m1"))
            first = conn.create_receiver("picky", credit=5)

            def body(receiver: BlockingReceiver, timeout: float = TIMEOUT) -> bytes:
                msg = receiver.receive(timeout)
                return bytes(msg.body)  # a view into `msg`: copied while it lives

            seen = [body(first)]
            first.fetcher.unsettled[0].local.undeliverable = True
            first.release()  # modified, undeliverable-here
            snd.send(Message(body=b"m2"))
            seen.append(body(first))
            first.accept()
            with contextlib.suppress(Timeout):
                seen.append(body(first, 0.3))
            other = conn.create_receiver("picky", credit=5, name="other")
            got = body(other)
            other.accept()
            return seen, got
        finally:
            conn.close()

    seen, got = await asyncio.to_thread(client)
    assert (seen, got) == ([b"m1", b"m2"], b"m1")
    assert await queued(broker, "picky", 0) == 0


async def test_receivers_get_the_bare_message_as_sent(broker: Broker, amqp: Listener) -> None:
    """AMQP 1.0 §3.2: the bare message is immutable in transit. Through Redis, a receiver
    gets properties the model has no field for, and application properties typed as sent."""
    await broker.queues.create(QueueConfig(name="fidelity"))
    sent = Message(
        body=b"body",
        inferred=True,
        id=uuid.uuid4(),
        user_id=b"anonymous",
        creation_time=1_700_000_000.5,
        content_encoding="gzip",
        group_id="g",
        group_sequence=3,
        reply_to_group_id="rg",
        properties={"i": int32(-5), "s": short(2), "u": ubyte(7), "sym": symbol("x")},
    )

    def client() -> Message:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            conn.create_sender("fidelity").send(sent)
            receiver = conn.create_receiver("fidelity", credit=1)
            got = receiver.receive(TIMEOUT)
            receiver.accept()
            return got
        finally:
            conn.close()

    got = await asyncio.to_thread(client)
    fields = ("body", "id", "user_id", "creation_time", "content_encoding", "group_id",
              "group_sequence", "reply_to_group_id", "properties")  # fmt: skip
    assert [getattr(got, f) for f in fields] == [getattr(sent, f) for f in fields]
    assert [type(v) for v in got.properties.values()] == [int32, short, ubyte, symbol]
    assert got.address == "fidelity", "the address the publisher left out is filled in"


async def test_receiver_without_credit_holds_nothing(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="stingy"))

    def client() -> list[bytes]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            idle = conn.create_receiver("stingy", name="idle", credit=0)
            snd = conn.create_sender("stingy")
            for i in range(3):
                snd.send(Message(body=f"s{i}".encode()))
            with contextlib.suppress(Timeout):
                conn.wait(lambda: idle.fetcher.has_message > 0, timeout=0.3)
            assert idle.fetcher.has_message == 0
            worker = conn.create_receiver("stingy", name="worker", credit=10)
            messages = [worker.receive(TIMEOUT) for _ in range(3)]
            for _ in messages:
                worker.accept()
            return [bytes(m.body) for m in messages]
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == [b"s0", b"s1", b"s2"]
    assert await queued(broker, "stingy", 0) == 0


async def test_relay_honours_jms_destination_annotation(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="jms-topic-sub"), [("prices/>", "smf")])
    await broker.router.reload()

    def client() -> list[tuple[int, str | None]]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender(None)
            topic = Message(address="prices/eur", body=b"1.08")
            topic.annotations = {symbol("x-opt-jms-dest"): ubyte(1)}  # a JMS Topic
            queue = Message(address="prices/eur", body=b"1.09")  # no annotation: a queue
            return [send_outcome(conn, snd, topic), send_outcome(conn, snd, queue)]
        finally:
            conn.close()

    as_topic, as_queue = await asyncio.to_thread(client)
    assert as_topic == (Disposition.ACCEPTED, None)
    assert as_queue == (Disposition.REJECTED, "amqp:not-found")  # no queue of that name
    assert (await broker.queues.info("jms-topic-sub")).messages == 1


async def test_client_vanishing_mid_transfer(
    broker: Broker, amqp: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    """A sans-IO proton client sends half of a multi-frame message, then drops the socket."""
    await broker.queues.create(QueueConfig(name="halfway"))
    conn, transport = Connection(), Transport()
    transport.bind(conn)
    conn.open()
    session = conn.session()
    session.open()
    snd = session.sender("halfway-sender")
    snd.target.address = "halfway"
    snd.open()
    reader, writer = await asyncio.open_connection("127.0.0.1", amqp.port)

    async def exchange_until(done: Callable[[], bool]) -> None:
        deadline = asyncio.get_running_loop().time() + TIMEOUT
        while not done():
            if (pending := transport.pending()) > 0:
                writer.write(transport.peek(pending))
                transport.pop(pending)
            timeout = deadline - asyncio.get_running_loop().time()
            transport.push(await asyncio.wait_for(reader.read(65536), max(timeout, 0.01)))

    await exchange_until(lambda: snd.credit > 0)
    assert transport.remote_max_frame_size < 100_000  # so the message takes many frames
    snd.delivery(b"1")
    snd.send(Message(body=b"x" * 300_000).encode())
    snd.advance()
    wire = b""
    while (pending := transport.pending()) > 0:
        wire += transport.peek(pending)
        transport.pop(pending)
    assert len(wire) > 300_000
    writer.write(wire[: len(wire) // 2])  # a few whole transfer frames, then a cut one
    await writer.drain()
    writer.transport.abort()  # gone without a detach, a close or the rest of the message
    transport.unbind()

    def other_client() -> bytes:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            conn.create_sender("halfway").send(Message(body=b"whole"))
            rcv = conn.create_receiver("halfway", credit=10)
            msg = rcv.receive(TIMEOUT)
            rcv.accept()
            return bytes(msg.body)
        finally:
            conn.close()

    assert await asyncio.to_thread(other_client) == b"whole"  # the half message never landed
    assert await queued(broker, "halfway", 0) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_message_expiring_past_the_header_ttls_range_still_reaches_a_consumer(
    broker: Broker, amqp: Listener
) -> None:
    """header.ttl is a uint of milliseconds (49.7 days): a message with longer to live
    goes with it capped, its absolute-expiry-time exact. (A content type that is no ASCII
    symbol takes proton's encoder, where the overflow had rejected the message.)"""
    await broker.declare_queue(QueueConfig(name="long"))
    in_60_days = int(time.time() * 1000) + 60 * 86400 * 1000
    for content_type in ("text/plain", "text/plain; é"):
        msg = GatewayMessage(
            destination="long",
            to_queue=True,
            payload=content_type.encode(),
            content_type=content_type,
            expiration=in_60_days,
        )
        assert (await broker.publish(msg)).accepted

    def receive() -> list[tuple[bytes, float, float]]:
        conn = BlockingConnection(f"amqp://127.0.0.1:{amqp.port}", timeout=5)
        try:
            receiver = conn.create_receiver("long", credit=10)
            got = []
            for _ in range(2):
                m = receiver.receive(5)
                got.append((bytes(m.body), m.ttl, m.expiry_time))
                receiver.accept()
            return got
        finally:
            conn.close()

    got = await asyncio.to_thread(receive)
    assert [body for body, _, _ in got] == [b"text/plain", "text/plain; é".encode()]
    for _, ttl, expiry_time in got:
        assert 4294967 <= ttl <= 4294967.295 and expiry_time == in_60_days / 1000


async def test_a_durable_subscription_attached_again_waits_for_its_last_link_to_close(
    broker: Broker, amqp: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link detached and attached again at once (Qpid JMS: close a consumer, then
    unsubscribe): the new attach comes after the old link released its flow, not into
    'in use' while that release is under way."""
    close = Outbound.close

    async def slow_close(self: Outbound, ended: bool = False) -> None:
        await asyncio.sleep(0.3)
        await close(self, ended)

    monkeypatch.setattr(Outbound, "close", slow_close)

    def client() -> str | None:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT, container_id="jms-client-3")
        try:
            options = [DurableSubscription(), Capability("topic")]
            sub = conn.create_receiver("x/z", name="sub3", credit=10, options=options)
            sub.link.detach()
            with pytest.raises(LinkDetached):  # a round trip: the detach was answered,
                conn.create_receiver(None, name="none")  # its flow's release is slow here
            lookup = conn.create_receiver(None, name="sub3", credit=0)
            address = lookup.link.remote_source.address
            lookup.close()
            return address
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == "topic://x/z"


async def test_a_topic_no_router_can_take_is_refused(broker: Broker, amqp: Listener) -> None:
    """A legal AMQP string the router cannot take (over 65,535 UTF-8 bytes): the relay's
    transfer raised inside the router, was never settled, and kept one of the link's
    credits for good. (proton's client cuts an address at U+0000, the other such case.)"""

    def scenario() -> str:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            relay = conn.create_sender(None)
            try:
                relay.send(Message(address="topic://" + "a" * 70_000, body=b"x"))
                refused = "accepted"
            except SendException as exc:
                refused = str(exc.state)
            relay.send(Message(address="topic://fine", body=b"x"))  # the link still serves
            return refused
        finally:
            conn.close()

    assert await asyncio.to_thread(scenario) != "accepted"


async def test_sasl_plain_without_an_initial_response_gets_an_empty_challenge(
    amqp: Listener,
) -> None:
    """RFC 4616 §2: a client may send PLAIN's message as the response to an empty
    challenge; the init without it failed authentication."""
    peer = await Peer.connect(amqp.port)
    try:
        peer.send(SASL_HEADER + sasl_init("PLAIN"))
        assert await peer.read_header() == SASL_HEADER
        await peer.read()  # the mechanisms
        challenge = await peer.read()
        assert challenge.code == 0x42 and challenge.fields == [b""]
        peer.send(frame(performative(0x43, b"\x00alice\x00s3cret"), kind=1))
        assert (await peer.read()).fields == [ubyte(0)]  # ok
    finally:
        peer.close()
