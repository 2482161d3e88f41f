"""AMQP adapter against off-the-shelf clients: real sockets, real Redis, no mocks.

proton's BlockingConnection and Container are blocking, so each client runs in a worker
thread (`asyncio.to_thread`) while the gateway serves on the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from proton import (
    ConnectionException,
    Disposition,
    Message,
    Terminus,
    Timeout,
    symbol,
    ubyte,
)
from proton.handlers import MessagingHandler
from proton.reactor import AtMostOnce, Container, LinkOption, Selector
from proton.utils import BlockingConnection, LinkDetached

from gateway.broker import Broker, QueueConfig
from gateway.config import Settings, User
from protocols.amqp import connection
from protocols.amqp.listener import Listener, start
from protocols.amqp.sasl import AMQP_HEADER, SASL_HEADER

TIMEOUT = 5.0


@pytest.fixture
async def amqp(broker: Broker) -> AsyncIterator[Listener]:
    settings = Settings(amqp_port=0, host="127.0.0.1", users=[User("alice", "s3cret")])
    listener = await start(broker, settings)
    assert listener is not None
    yield listener
    await listener.close()


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
            rcv.release()  # back to the queue, delivered again with a higher count
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
    assert "ANONYMOUS-RELAY" in caps
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


async def test_drain(broker: Broker, amqp: Listener) -> None:
    await broker.queues.create(QueueConfig(name="d"))

    def client() -> tuple[list[bytes], int]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("d")
            for i in range(2):
                snd.send(Message(body=f"{i}".encode()))
            rcv = conn.create_receiver("d", credit=0)
            rcv.link.drain(10)
            conn.wait(lambda: not rcv.link.draining(), timeout=TIMEOUT)
            credit = rcv.link.credit  # the gateway gave back the 8 it could not use
            messages = [rcv.receive(TIMEOUT) for _ in range(2)]
            bodies = [bytes(m.body) for m in messages]  # a body is a view into its message
            rcv.accept()
            return bodies, credit
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == ([b"0", b"1"], 0)


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

    def run() -> None:
        container = Container(handler)
        container.timeout = TIMEOUT
        container.run()

    await asyncio.wait_for(asyncio.to_thread(run), TIMEOUT * 2)
    assert handler.error is None
    assert handler.received == [f"c{i}".encode() for i in range(20)]
    await asyncio.sleep(0.1)
    assert (await broker.queues.info("jobs")).messages == 0


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
    """Qpid JMS style: mark the terminus with a capability ('queue', 'topic', ...)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def apply(self, link) -> None:
        terminus = link.source if link.is_receiver else link.target
        terminus.capabilities.put_object(symbol(self.name))


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
    await broker.queues.create(QueueConfig(name="sized"))

    def client() -> bytes:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            snd = conn.create_sender("sized")
            snd.send(Message(body=b"x" * 5000))
            snd.send(Message(body=b"small"))
            rcv = conn.create_receiver("sized", credit=10, options=MaxMessageSize(1000))
            msg = rcv.receive(TIMEOUT)
            rcv.accept()
            return bytes(msg.body)
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == b"small"  # the big one is refused, not sent
    await asyncio.sleep(0.1)
    assert (await broker.queues.info("sized")).messages == 0


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


async def test_unsupported_source_features_are_not_pretended(
    broker: Broker, amqp: Listener
) -> None:
    await broker.queues.create(QueueConfig(name="plain"))

    def client() -> tuple[str, bool]:
        conn = BlockingConnection(url(amqp), timeout=TIMEOUT)
        try:
            with pytest.raises(LinkDetached) as info:
                conn.create_receiver("plain", options=Browse())
            # a new link name: proton sends this attach before the refused link's detach
            rcv = conn.create_receiver(
                "plain", name="selecting", credit=1, options=Selector("colour = 'red'")
            )
            filters = rcv.link.remote_source.filter
            filters.rewind()
            return str(info.value), filters.next() is None
        finally:
            conn.close()

    refused, no_filter = await asyncio.to_thread(client)
    assert "amqp:not-implemented" in refused  # browsing would consume the messages
    assert no_filter  # the selector is not echoed, so the client knows it is not applied


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
