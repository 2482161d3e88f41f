"""What one AMQP connection may make the node hold: the bytes of deliveries it leaves
unfinished are bounded per connection (the gateway's
memory, measured with glibc's mallinfo2, in this process, where the gateway runs)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import struct

import pytest
from proton import Described, Message, symbol, ubyte, uint, ulong

from gateway.broker import Broker, QueueConfig
from gateway.model import MAX_USER_PROPERTIES
from protocols.amqp import framing, links
from protocols.amqp.listener import Listener
from tests.amqp_raw import (
    ACCEPTED,
    ATTACH,
    BEGIN,
    DETACH,
    DISPOSITION,
    END,
    RECEIVER,
    REJECTED,
    SOURCE,
    TARGET,
    Peer,
    frame,
    performative,
)

CHUNK = 32_000  # under the gateway's max-frame-size (32 KiB)
MiB = 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2


def allocated() -> int:
    """Bytes malloc has handed out and not had back (arena chunks and mmapped ones), so
    memory an earlier test freed does not hide growth."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class Peak:
    """The most `allocated()` grew over its value at the start, sampled every 20 ms."""

    def __init__(self) -> None:
        self.base = self.peak = allocated()
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, allocated())
            await asyncio.sleep(0.02)

    def stop(self) -> int:
        self._task.cancel()
        self.peak = max(self.peak, allocated())
        return self.peak - self.base


async def send_multi(
    peer: Peer, handle: int, delivery_id: int, data: bytes | memoryview, finish: bool = True
) -> None:
    """One delivery in frames of CHUNK bytes (more=true on all but the last, unless not
    `finish`ed), waiting for the socket to drain now and then."""
    view = memoryview(data)  # not copied: the test's own bytes would count as the node's
    pieces = [view[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    for i, piece in enumerate(pieces):
        more = i < len(pieces) - 1 or not finish
        tag = b"%d" % delivery_id if i == 0 else None
        peer.transfer(handle, delivery_id if i == 0 else None, piece, more=more, tag=tag)
        if i % 32 == 31:
            await peer.writer.drain()
    await peer.writer.drain()


@pytest.fixture
async def port(broker: Broker, amqp: Listener) -> int:
    await broker.declare_queue(QueueConfig(name="big", max_message_size=16 * MiB))
    return amqp.port


async def test_unfinished_deliveries_are_bounded_per_connection(port: int) -> None:
    """A client that starts large deliveries on many links and never finishes them cannot
    make the node hold more than the connection's budget: the link whose delivery would
    pass it is ended with resource-limit-exceeded (each delivery is under the 16 MiB
    max-message-size), and the deliveries within it can still be finished and stored."""
    peer = await Peer.opened(port)
    count = 12
    for handle in range(count):
        await peer.sender(handle, "big")
    body = os.urandom(15 * MiB)
    data = bytes(Message(body=body).encode())
    unfinished = memoryview(data)[: 15 * MiB - 1000]
    await asyncio.sleep(0.2)
    peak = Peak()
    for handle in range(count):
        await send_multi(peer, handle, handle, unfinished, finish=False)
    await asyncio.sleep(0.5)
    grown = peak.stop()
    assert grown < 2 * links.PARTIAL_BYTES_MAX + 16 * MiB, f"grew {grown / MiB:.0f} MiB"
    within = links.PARTIAL_BYTES_MAX // (15 * MiB)
    detached = set()
    while len(detached) < count - within:
        got = await peer.expect(DETACH)
        assert got.error() == links.RESOURCE_LIMIT
        detached.add(got.fields[0])
    assert detached == set(range(within, count))
    for handle in range(within):  # the rest of each delivery: stored
        rest = data[15 * MiB - 1000 :]
        peer.transfer(handle, None, rest, tag=None)
        assert (await peer.expect(DISPOSITION)).outcome()[0] == ACCEPTED
    peer.close()


async def test_a_finished_or_dropped_delivery_leaves_the_budget(port: int, amqp: Listener) -> None:
    """Unfinished deliveries count only while they are: finished, aborted or on a link the
    client detached, they leave room for the next ones."""
    peer = await Peer.opened(port)
    await peer.sender(0, "big")
    await peer.sender(1, "big")
    data = bytes(Message(body=os.urandom(12 * MiB)).encode())
    for i in range(3):  # 3 x 24 MiB: past the budget, were they not let go
        await send_multi(peer, 1, 2 * i, data[: 12 * MiB], finish=False)
        peer.transfer(1, None, b"", aborted=True, tag=None)
        await send_multi(peer, 0, 2 * i + 1, data)
        assert (await peer.expect(DISPOSITION)).outcome()[0] == ACCEPTED
    (conn,) = amqp.registry.connections
    assert conn.partial_bytes == 0
    for handle in range(2, 5):  # on links detached with their delivery unfinished
        await peer.sender(handle, "big")
        await send_multi(peer, handle, 4 + handle, data[: 12 * MiB], finish=False)
        peer.send(frame(performative(DETACH, uint(handle), True)))
        assert (await peer.expect(DETACH)).error() is None
    assert conn.partial_bytes == 0
    peer.close()


def _properties(count: int) -> bytes:
    return bytes(Message(body=b"p", properties={f"k{i}": None for i in range(count)}).encode())


def _list32(items: bytes, count: int) -> bytes:
    return b"\xd0" + struct.pack(">II", 4 + len(items), count) + items


def _nulls(count: int) -> bytes:
    """An amqp-value section holding a list32 of `count` nulls."""
    return b"\x00\x53\x77" + _list32(b"\x40" * count, count)


def _annotated(lists: int) -> bytes:
    """Message annotations {x-k: [[null x 1000] x `lists`]}, then a data section."""
    inner = _list32(b"\x40" * 1000, 1000)
    pair = b"\xa3\x03x-k" + _list32(inner * lists, lists)
    annotations = b"\xd1" + struct.pack(">II", 4 + len(pair), 2) + pair
    return b"\x00\x53\x72" + annotations + b"\x00\x53\x75\xa0\x01p"


@pytest.mark.parametrize(
    ("most", "more"),
    [
        (_properties(MAX_USER_PROPERTIES), _properties(MAX_USER_PROPERTIES + 1)),
        (_nulls(framing.MAX_VALUES - 10), _nulls(framing.MAX_VALUES)),
        (_annotated(framing.MAX_VALUES // 1001 - 1), _annotated(framing.MAX_VALUES // 1001 + 1)),
    ],
    ids=["application-properties", "amqp-value-list", "message-annotations"],
)
async def test_a_message_of_more_values_than_the_gateway_decodes_is_refused(
    port: int, most: bytes, more: bytes
) -> None:
    """One message of 1.4 million application properties, or one amqp-value list of 14
    million nulls, held the node and every other client for seconds as it was decoded,
    and annotations of nested lists at each delivery (found by reviews): past
    MAX_USER_PROPERTIES application properties, or MAX_VALUES values in all, a message is
    rejected with resource-limit-exceeded."""
    peer = await Peer.opened(port)
    await peer.sender(0, "big")
    await send_multi(peer, 0, 0, most)
    assert (await peer.expect(DISPOSITION)).outcome() == (ACCEPTED, None)
    await send_multi(peer, 0, 1, more)
    assert (await peer.expect(DISPOSITION)).outcome() == (REJECTED, links.RESOURCE_LIMIT)
    peer.close()


async def test_ended_sessions_are_freed_and_take_their_detached_links_nodes(
    broker: Broker, amqp: Listener
) -> None:
    """A client that begins and ends sessions on one connection (a JMS session per unit of
    work) grew the node ~3.7 KiB a session for as long as the connection lasted: proton
    kept every ended one (found by a review). The delete-on-close node of a link detached
    without closing still goes with its session."""
    peer = await Peer.opened(amqp.port)
    begin = performative(BEGIN, None, uint(0), uint(100), uint(100))
    peer.send(frame(begin, channel=1))
    await peer.expect(BEGIN)
    dynamic = Described(ulong(SOURCE), [None, uint(0), symbol("session-end"), uint(0), True])
    no_target = Described(ulong(TARGET), [None])
    attach = performative(
        ATTACH, "reply", uint(0), RECEIVER, ubyte(0), ubyte(0), dynamic, no_target
    )
    peer.send(frame(attach, channel=1))
    node = (await peer.expect(ATTACH)).fields[5].value[0]
    peer.send(frame(performative(DETACH, uint(0), False), channel=1))  # not closed
    await peer.expect(DETACH)
    assert await broker.queues.exists(node)
    peer.send(frame(performative(END), channel=1))
    await peer.expect(END)
    for _ in range(1000):
        peer.send(frame(begin, channel=1) + frame(performative(END), channel=1))
    for _ in range(1000):
        await peer.expect(END)
    [connection] = amqp.registry.connections
    sessions, session = 0, connection.conn.session_head(0)
    while session is not None:
        sessions += 1
        session = session.next(0)
    assert sessions <= 1, sessions
    deadline = asyncio.get_running_loop().time() + 3
    while await broker.queues.exists(node):
        assert asyncio.get_running_loop().time() < deadline, "the node outlived its session"
        await asyncio.sleep(0.05)
    peer.close()
