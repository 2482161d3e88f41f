"""AMQP 1.0 link negotiation and credit, frame by frame (a raw peer, tests/amqp_raw.py):
settlement modes echoed on attach, credit past 2^31, drains answered (while a queue's
egress is off, and once the client's session window lets the last deliveries go), and
deliveries a link took but never put on the wire given back as they were."""

from __future__ import annotations

import asyncio

import pytest
from proton import Described, symbol, ubyte, uint, ulong
from proton import Message as AmqpMessage

from gateway.broker import Broker, QueueConfig
from gateway.config import Settings
from gateway.model import Message
from protocols.amqp import links
from protocols.amqp.listener import Listener
from protocols.amqp.listener import start as start_amqp
from tests.amqp_raw import (
    ACCEPTED,
    ATTACH,
    DETACH,
    DISPOSITION,
    FLOW,
    RECEIVER,
    SENDER,
    SOURCE,
    TARGET,
    TRANSFER,
    Peer,
    flow,
    frame,
    performative,
)
from tests.redis_proxy import CuttingProxy
from tests.test_engine import wait_for
from tests.test_redis_outages import node, proxy  # noqa: F401

UNSETTLED, SETTLED = 0, 1  # snd-settle-mode
SECOND = 1  # rcv-settle-mode


async def fill(broker: Broker, queue: str, count: int) -> None:
    await broker.queues.create(QueueConfig(name=queue))
    for i in range(count):
        await broker.publish(Message(queue, b"%d" % i, to_queue=True))


async def first_deliveries(port: int, queue: str, count: int) -> list[tuple[bytes, int, bool]]:
    """(body, header delivery-count, first-acquirer) of `count` messages a new link gets."""
    peer = await Peer.opened(port)
    peer.attach("check", 0, RECEIVER, queue)
    await peer.expect(ATTACH)
    peer.send(flow(0, count))
    got = []
    for _ in range(count):
        message = AmqpMessage()
        message.decode((await peer.expect(TRANSFER)).payload)
        got.append((bytes(message.body), message.delivery_count, message.first_acquirer))
    peer.close()
    return sorted(got)


async def detach(peer: Peer) -> None:
    peer.send(frame(performative(DETACH, uint(0), True)))
    await peer.expect(DETACH)
    await asyncio.sleep(0.3)  # the link's flow is closed after the detach is answered


@pytest.mark.parametrize("mode", [UNSETTLED, SETTLED], ids=["unsettled", "settled"])
async def test_a_sending_clients_settle_mode_is_echoed(
    broker: Broker, amqp: Listener, mode: int
) -> None:
    """§2.7.3: the sender's snd-settle-mode is the mode in use; clients that check the
    answer (go-amqp) refuse a link answered with another one."""
    await broker.queues.create(QueueConfig(name="in"))
    peer = await Peer.opened(amqp.port)
    peer.attach("s", 0, SENDER, "in", snd_mode=mode)
    answer = await peer.expect(ATTACH)
    assert answer.fields[6] is not None and int(answer.fields[3]) == mode
    peer.close()


async def test_a_sending_clients_rcv_settle_mode_second_is_echoed_and_kept(
    broker: Broker, amqp: Listener
) -> None:
    """Found by a review: a sender's rcv-settle-mode second was answered with first, and
    go-amqp refuses such a link. It is echoed now, and kept (§2.6.12): the gateway's
    outcome comes unsettled once the message is spooled, and the gateway settles the
    delivery only after the client has (it settled it with the outcome)."""
    await broker.queues.create(QueueConfig(name="in"))
    peer = await Peer.opened(amqp.port)
    peer.attach("s", 0, SENDER, "in", snd_mode=UNSETTLED, rcv_mode=SECOND)
    answer = await peer.expect(ATTACH)
    assert answer.fields[6] is not None and int(answer.fields[4]) == SECOND
    await peer.expect(FLOW)
    peer.transfer(0, 0, performative(0x77, "m"))  # an amqp-value body
    outcome = await peer.expect(DISPOSITION)  # once the message is spooled
    assert not outcome.fields[3] and outcome.outcome() == (ACCEPTED, None)  # unsettled
    assert (await broker.queues.info("in")).messages == 1
    assert not [f for f in await peer.frames_for(0.3) if f.code == DISPOSITION]
    ((endpoint,),) = [list(c.endpoints.values()) for c in amqp.registry.connections]
    assert endpoint.link.unsettled == 1, "settled before the client"
    accepted = Described(ulong(ACCEPTED), [])
    peer.send(frame(performative(DISPOSITION, SENDER, uint(0), None, True, accepted)))
    # then the gateway settles it too (no frame: the client has forgotten it, §2.6.12)
    await wait_for(lambda: endpoint.link.unsettled == 0)
    assert (await broker.queues.info("in")).messages == 1  # stored once
    peer.close()


async def test_answers_the_client_has_not_settled_take_its_credit_in_mode_second(
    broker: Broker, amqp: Listener
) -> None:
    """rcv-settle-mode second: each answered delivery holds its bytes until the client
    settles it. Credit came back as each was answered, so a client that never settled
    grew the node by every message it sent (10,000 of 30 kB: 353 MiB; found by a
    review). Those not settled yet count against the link's credit."""
    await broker.queues.create(QueueConfig(name="in"))
    peer = await Peer.opened(amqp.port)
    peer.attach("s", 0, SENDER, "in", snd_mode=UNSETTLED, rcv_mode=SECOND)
    await peer.expect(ATTACH)
    await peer.expect(FLOW)
    ((endpoint,),) = [list(c.endpoints.values()) for c in amqp.registry.connections]
    for i in range(links.CREDIT):
        peer.transfer(0, i, performative(0x77, "m"), tag=b"%d" % i)
    answered: set[int] = set()
    while len(answered) < links.CREDIT:
        answered.update((await peer.expect(DISPOSITION)).deliveries())
    await asyncio.sleep(0.1)
    assert endpoint.link.credit == 0
    accepted = Described(ulong(ACCEPTED), [])
    last = uint(links.CREDIT - 1)
    peer.send(frame(performative(DISPOSITION, SENDER, uint(0), last, True, accepted)))
    await wait_for(lambda: endpoint.link.credit > links.CREDIT * 3 // 4)  # back: near CREDIT
    assert (await broker.queues.info("in")).messages == links.CREDIT
    peer.close()


async def test_a_client_sending_past_its_credit_in_mode_second_holds_no_more(
    broker: Broker, amqp: Listener
) -> None:
    """The link ends (§2.6.7: no transfers without credit), and what the client sends on
    until it has the detach is refused and forgotten, not held for a settlement that
    cannot come."""
    await broker.queues.create(QueueConfig(name="in"))
    peer = await Peer.opened(amqp.port, window=10_000)
    peer.attach("s", 0, SENDER, "in", snd_mode=UNSETTLED, rcv_mode=SECOND)
    await peer.expect(ATTACH)
    await peer.expect(FLOW)
    ((endpoint,),) = [list(c.endpoints.values()) for c in amqp.registry.connections]
    sent = answered = 0
    for _ in range(4):  # as the reviewer's client: a batch, then its answers
        for _ in range(links.CREDIT // 2):
            peer.transfer(0, sent, performative(0x77, "m"), tag=b"%d" % sent)
            sent += 1
        while answered < sent:
            got = await peer.expect(DISPOSITION)
            answered += len(got.deliveries())
    assert endpoint.closed and endpoint.link.condition.name == links.TRANSFER_LIMIT
    assert len(endpoint._answered) == links.CREDIT  # those answered before it ended
    peer.close()


@pytest.mark.parametrize("closed", [False, True], ids=["detach", "close"])
@pytest.mark.parametrize("role", [SENDER, RECEIVER], ids=["client-sender", "client-receiver"])
async def test_a_detach_before_the_attach_is_answered_gets_both_answered(
    broker: Broker, amqp: Listener, role: bool, closed: bool
) -> None:
    """§2.6.3, §2.6.6: an attach is answered by an attach, a detach by a detach. A client
    that detached without closing (proton's Link.detach, rhea's detach()) before its
    attach was answered (that takes Redis round trips) got neither, and waited for good
    (found by a review). Read together, the first attach waited on its own detach, and
    the name was dead for the connection (found by a review of the fix)."""
    await fill(broker, "early", 1)
    peer = await Peer.opened(amqp.port)
    attach = frame(performative(ATTACH, "early", uint(0), role, ubyte(0), ubyte(0), *termini(role)))
    peer.send(attach + frame(performative(DETACH, uint(0), closed)))  # read together
    got = await peer.frames_for(0.5)
    assert [f.code for f in got if f.code is not None] == [ATTACH, DETACH]
    peer.send(attach)  # its name is free again (the attach of the first had waited on it)
    assert (await peer.expect(ATTACH)).fields[5 if role == RECEIVER else 6] is not None
    peer.close()


def termini(role: bool) -> tuple[Described, Described]:
    """(source, target) of an attach to queue "early" as `role`."""
    queue = Described(ulong(SOURCE if role == RECEIVER else TARGET), ["early"])
    other = Described(ulong(TARGET if role == RECEIVER else SOURCE), [None])
    return (queue, other) if role == RECEIVER else (other, queue)


@pytest.mark.parametrize(("role", "snd", "rcv"), [(SENDER, 9, 0), (RECEIVER, 0, 7)])
async def test_settle_modes_out_of_range_are_refused(
    broker: Broker, amqp: Listener, role: bool, snd: int, rcv: int
) -> None:
    """They were echoed back in the gateway's attach, which no client could read."""
    await broker.queues.create(QueueConfig(name="modes"))
    peer = await Peer.opened(amqp.port)
    peer.attach("m", 0, role, "modes", snd_mode=snd, rcv_mode=rcv)
    await peer.expect(ATTACH)
    assert (await peer.expect(DETACH)).error() == "amqp:invalid-field"
    peer.close()


async def test_a_receiving_clients_rcv_settle_mode_second_is_echoed_and_kept(
    broker: Broker, amqp: Listener
) -> None:
    await fill(broker, "out", 1)
    peer = await Peer.opened(amqp.port)
    peer.attach("r", 0, RECEIVER, "out", snd_mode=UNSETTLED, rcv_mode=SECOND)
    assert int((await peer.expect(ATTACH)).fields[4]) == SECOND
    peer.send(flow(0, 1))
    transfer = await peer.expect(TRANSFER)
    accepted = Described(ulong(ACCEPTED), [])  # the client's outcome, unsettled (mode second)
    peer.send(frame(performative(DISPOSITION, RECEIVER, transfer.fields[1], None, False, accepted)))
    settled = await peer.expect(DISPOSITION)
    assert settled.fields[3] is True  # the gateway settles after the outcome
    await asyncio.sleep(0.2)
    assert (await broker.queues.info("out")).messages == 0
    peer.close()


async def test_a_drain_is_answered_while_the_queues_egress_is_off(
    broker: Broker, amqp: Listener
) -> None:
    """§2.6.7: a sender that cannot use a drain's credit uses it up and says so."""
    await broker.queues.create(QueueConfig(name="paused"))
    peer = await Peer.opened(amqp.port)
    peer.attach("r", 0, RECEIVER, "paused")
    await peer.expect(ATTACH)
    await broker.update_queue("paused", {"egress_enabled": False})
    await asyncio.sleep(0.3)
    peer.send(flow(0, 5, drain=True))
    answer = await peer.expect(FLOW)
    assert (answer.fields[5], answer.fields[6]) == (5, 0)  # delivery-count, credit
    peer.close()


async def test_deliveries_the_clients_session_window_held_back_come_back_as_they_were(
    broker: Broker, amqp: Listener
) -> None:
    """Never put on the wire, they were no attempts (§3.2.1): a first delivery next time,
    not a failed one counting toward max_redelivery."""
    await fill(broker, "windowed", 5)
    peer = await Peer.opened(amqp.port, window=1)
    peer.attach("r", 0, RECEIVER, "windowed")
    await peer.expect(ATTACH)
    peer.send(flow(0, 5, window=1))
    await peer.expect(TRANSFER)  # "0": on the wire, left unsettled
    assert [f.code for f in await peer.frames_for(0.5)] == []  # the rest wait for the window
    await detach(peer)
    got = await first_deliveries(amqp.port, "windowed", 5)
    assert got == [(b"0", 1, False)] + [(b"%d" % i, 0, True) for i in range(1, 5)]


async def test_deliveries_fetched_as_the_credit_went_to_zero_come_back_as_they_were(
    node: Broker,  # noqa: F811
    proxy: CuttingProxy,  # noqa: F811
) -> None:
    listener = await start_amqp(node, Settings(amqp_port=0, host="127.0.0.1"))
    try:
        await fill(node, "stopped", 5)
        peer = await Peer.opened(listener.port)
        peer.attach("r", 0, RECEIVER, "stopped")
        await peer.expect(ATTACH)
        proxy.delay_on, proxy.delay = b"gw_fetch", 0.5
        peer.send(flow(0, 5))
        await asyncio.sleep(0.2)  # the fetch is under way
        peer.send(flow(0, 0))  # the client stops the link: nothing may be sent now
        assert [f.code for f in await peer.frames_for(1.0)] == []
        await detach(peer)
        proxy.delay_on = None
        got = await first_deliveries(listener.port, "stopped", 5)
        assert got == [(b"%d" % i, 0, True) for i in range(5)]
    finally:
        await listener.close()


@pytest.mark.parametrize("between", [False, True], ids=["at-once", "another-between"])
async def test_a_durable_subscriber_detached_while_its_attach_binds_may_attach_again(
    node: Broker,  # noqa: F811
    proxy: CuttingProxy,  # noqa: F811
    between: bool,
) -> None:
    """JMS closes a durable consumer with a detach (closed=false). Sent while its attach
    was binding, the detach was answered at once and the bind went on: the link attached
    again under its name was refused as the subscription's other consumer (found by a
    review). The new attach waits until the old one's is served and released, also past
    a link of the name attached and detached in between (found by a review of the fix)."""
    listener = await start_amqp(node, Settings(amqp_port=0, host="127.0.0.1"))
    try:
        peer = await Peer.opened(listener.port)
        source = Described(ulong(SOURCE), ["topic://t/again", uint(2), symbol("never")])
        target = Described(ulong(TARGET), [None])

        def attach(handle: int) -> bytes:
            fields = ("sub", uint(handle), RECEIVER, ubyte(0), ubyte(0), source, target)
            return frame(performative(ATTACH, *fields))

        def detach(handle: int) -> bytes:
            return frame(performative(DETACH, uint(handle), False))

        proxy.delay_on, proxy.delay = b"gw_bind", 0.5  # bound in Redis, answered late
        peer.send(attach(0))
        await asyncio.sleep(0.2)
        peer.send(detach(0) + (attach(1) + detach(1) if between else b"") + attach(2))
        answers = [f for f in await peer.frames_for(2.0) if f.code == ATTACH]
        assert len(answers) == 3 if between else 2
        assert answers[-1].fields[5] is not None  # the last one: not refused
        peer.close()
    finally:
        proxy.delay_on = None
        await listener.close()


async def test_presettled_deliveries_are_acked_once_written_and_kept_if_never_written(
    broker: Broker, amqp: Listener
) -> None:
    """At most once (snd-settle-mode settled): what went on the wire is gone from the
    queue; what the client's session window held back when the link closed is not lost."""
    await fill(broker, "atmostonce", 5)
    peer = await Peer.opened(amqp.port, window=2)
    peer.attach("r", 0, RECEIVER, "atmostonce", snd_mode=SETTLED)
    await peer.expect(ATTACH)
    peer.send(flow(0, 5, window=2))
    sent = [await peer.expect(TRANSFER) for _ in range(2)]
    assert all(t.fields[4] is True for t in sent)  # settled
    assert [f.code for f in await peer.frames_for(0.5)] == []  # the rest wait for the window
    assert (await broker.queues.info("atmostonce")).messages == 3  # the two written: acked
    await detach(peer)
    got = await first_deliveries(amqp.port, "atmostonce", 3)
    assert got == [(b"%d" % i, 0, True) for i in range(2, 5)]


@pytest.mark.parametrize("mode", [UNSETTLED, SETTLED], ids=["unsettled", "settled"])
async def test_deliveries_held_when_the_window_opens_with_the_detach_come_back_as_they_were(
    broker: Broker, amqp: Listener, mode: int
) -> None:
    """One write opens the session window and detaches the link (a client accepting a
    message, then closing its receiver): proton may write the held deliveries in that
    turn, to a link the client has left. They were no deliveries to it."""
    await fill(broker, "both", 5)
    peer = await Peer.opened(amqp.port, window=1)
    peer.attach("r", 0, RECEIVER, "both", snd_mode=mode)
    await peer.expect(ATTACH)
    peer.send(flow(0, 5, window=1))
    await peer.expect(TRANSFER)  # "0"; the other four wait for the session window
    assert [f.code for f in await peer.frames_for(0.5)] == []
    peer.send(flow(None, 0, window=1000) + frame(performative(DETACH, uint(0), True)))
    await peer.expect(DETACH)
    await asyncio.sleep(0.3)
    got = await first_deliveries(amqp.port, "both", 5 if mode == UNSETTLED else 4)
    held_back = [(b"%d" % i, 0, True) for i in range(1, 5)]
    assert got == ([(b"0", 1, False)] if mode == UNSETTLED else []) + held_back


def session_flow(next_incoming_id: int, window: int) -> bytes:
    """A flow frame of the session alone: the client's incoming window opened again."""
    return frame(performative(FLOW, uint(next_incoming_id), uint(window), uint(0), uint(1000)))


@pytest.mark.parametrize("credit", [2**31, 2**32 - 1], ids=["2^31", "uint-max"])
@pytest.mark.parametrize("drain", [False, True], ids=["plain", "drain"])
async def test_a_link_credit_of_2_31_or_more_is_honoured(
    broker: Broker, amqp: Listener, credit: int, drain: bool
) -> None:
    """link-credit is a uint (§2.7.4); Azure's AMQP clients grant 2^32 - 1. Proton keeps
    the credit in a C int, which such credit wrapped to a negative: nothing was sent."""
    await fill(broker, "big-credit", 3)
    peer = await Peer.opened(amqp.port)
    peer.attach("r", 0, RECEIVER, "big-credit")
    await peer.expect(ATTACH)
    peer.send(flow(0, credit, drain=drain))
    frames = await peer.frames_for(1.5)
    peer.close()
    assert sum(1 for f in frames if f.code == TRANSFER) == 3
    if drain:
        assert any(f.code == FLOW and f.fields[6] == 0 for f in frames), "drain unanswered"


async def test_a_drain_is_answered_once_the_session_window_lets_its_deliveries_go(
    broker: Broker, amqp: Listener
) -> None:
    """§2.6.7: a drain's answer (delivery-count advanced, credit 0) follows the messages
    sent for it. With some held back by the client's session window (§2.5.6), proton
    was told before it wrote them, and the answer never came."""
    await fill(broker, "windowed-drain", 3)
    peer = await Peer.opened(amqp.port, window=1)
    peer.attach("r", 0, RECEIVER, "windowed-drain")
    await peer.expect(ATTACH)
    peer.send(flow(0, 5, drain=True, window=1))
    first = await peer.frames_for(0.8)
    assert [f.code for f in first] == [TRANSFER]  # the window lets one go
    peer.send(session_flow(1, 100))
    rest = await peer.frames_for(2.0)
    peer.close()
    assert sum(1 for f in rest if f.code == TRANSFER) == 2
    answers = [f for f in rest if f.code == FLOW and f.fields[4] == 0]
    assert answers, "the drain was never answered"
    assert (answers[-1].fields[5], answers[-1].fields[6]) == (5, 0)  # delivery-count, credit


async def test_a_flow_crossing_deliveries_in_flight_grants_no_credit(
    broker: Broker, amqp: Listener
) -> None:
    """§2.6.7: link-credit(snd) = delivery-count(rcv) + link-credit(rcv) - delivery-count(snd).
    A flow the client wrote before the deliveries in flight reached it makes that negative:
    no credit, though proton's int holds it as a wrapped credit of 2^31 or more does."""
    await fill(broker, "crossing", 10)
    peer = await Peer.opened(amqp.port)
    peer.attach("r", 0, RECEIVER, "crossing")
    await peer.expect(ATTACH)
    peer.send(flow(0, 3))
    first = await peer.frames_for(1.0)
    assert sum(1 for f in first if f.code == TRANSFER) == 3
    peer.send(flow(0, 1, delivery_count=0))  # credit cut to 1, the 3 not seen yet
    rest = await peer.frames_for(1.5)
    peer.close()
    assert sum(1 for f in rest if f.code == TRANSFER) == 0


async def test_a_drain_is_answered_while_a_repartition_waits_for_egress(
    broker: Broker, amqp: Listener
) -> None:
    """A repartition unbinds every flow and egress is still off when they bind again: a
    consumer's drain (Qpid JMS's receive() with prefetch 0) is answered while they wait,
    not held until egress is back (Qpid JMS gives up on the connection after 60 s)."""
    await broker.queues.create(QueueConfig(name="parts", partition_count=2))
    peer = await Peer.opened(amqp.port)
    peer.attach("r", 0, RECEIVER, "parts")
    await peer.expect(ATTACH)
    await asyncio.sleep(0.3)  # the partitions are the flow's
    await broker.update_queue("parts", {"egress_enabled": False})
    await broker.update_queue("parts", {"partition_count": 4})
    await asyncio.sleep(0.3)  # the flow's bind again is refused: egress is off
    peer.send(flow(0, 5, drain=True))
    frames = await peer.frames_for(1.0)
    peer.close()
    answers = [f for f in frames if f.code == FLOW and f.fields[4] == 0]
    assert answers and (answers[-1].fields[5], answers[-1].fields[6]) == (5, 0)
