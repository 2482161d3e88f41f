"""Hostile and malformed AMQP 1.0 input over real sockets against a real gateway and Redis:
each is answered with the protocol's error (a close, detach or rejected outcome carrying the
condition, then EOF where the spec says so), the gateway keeps serving, and messages accepted
before are still delivered."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
from proton import Described, Message, symbol, ubyte, uint, ulong

from gateway.broker import Broker, QueueConfig
from protocols.amqp import connection, links
from protocols.amqp.listener import Listener
from tests.amqp_raw import (
    ACCEPTED,
    AMQP_HEADER,
    ATTACH,
    BEGIN,
    CLOSE,
    DETACH,
    DISPOSITION,
    END,
    OPEN,
    RECEIVER,
    REJECTED,
    SASL_HEADER,
    SASL_OUTCOME,
    SENDER,
    SOURCE,
    TARGET,
    TIMEOUT,
    TRANSFER,
    Frame,
    Peer,
    encode,
    flow,
    frame,
    performative,
    sasl_init,
)
from tests.conftest import Ports, logged_errors
from tests.test_engine import wait_for
from tests.test_mqtt_paho import V5, Client

QUEUE = "hostile-q"
KEPT = bytes(Message(body=b"kept", durable=True).encode())
OK = (ACCEPTED, None)


@pytest.fixture(autouse=True)
def no_error_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Hostile input is the client's problem: nothing it sends may reach an ERROR log."""
    caplog.set_level(logging.WARNING)
    yield
    assert not logged_errors(caplog)


@pytest.fixture
async def port(broker: Broker, amqp: Listener) -> int:
    """The gateway's AMQP port, with QUEUE declared and one message accepted on it."""
    await broker.declare_queue(QueueConfig(name=QUEUE))
    peer = await Peer.opened(amqp.port)
    await peer.sender(0, QUEUE)
    assert await peer.send_all(0, [KEPT]) == [OK]
    peer.close()
    return amqp.port


async def still_serving(port: int, kept: int = 1) -> None:
    """A fresh connection can publish to QUEUE and receive, with accept, the `kept` messages
    accepted before (each 'kept') and its own."""
    peer = await Peer.opened(port)
    await peer.sender(0, QUEUE)
    assert await peer.send_all(0, [bytes(Message(body=b"fresh").encode())]) == [OK]
    got = await peer.receive(1, QUEUE, kept + 1)
    bodies = []
    for payload in got:
        msg = Message()
        msg.decode(payload)
        bodies.append(bytes(msg.body))
    assert bodies == [b"kept"] * kept + [b"fresh"]
    peer.close()


def data(payload: bytes = b"x") -> bytes:
    return b"\x00\x53\x75\xa0" + bytes((len(payload),)) + payload


def section(code: int, value: object) -> bytes:
    return bytes((0x00, 0x53, code)) + encode(value)


# -- frames the engine cannot decode -------------------------------------------------------------

BEGIN_FRAME = frame(performative(BEGIN, None, uint(0), uint(10), uint(10)))


@pytest.mark.parametrize(
    "bad",
    [
        frame(b"\x00\x53\x99\x45"),  # a described list with an unknown performative code
        frame(b"\x45"),  # a body that is not a described type
        frame(b"\x00\x53\x12\xd0\x00\x00\x01\x00"),  # an attach whose list is cut short
        frame(b"\x00\x53\x13\x40"),  # a flow whose fields are not a list
        frame(performative(BEGIN, None, uint(0), uint(10), uint(10)), kind=7),  # frame type 7
        sasl_init("ANONYMOUS"),  # a SASL frame after open
    ],
    ids=["unknown-performative", "not-described", "truncated", "not-a-list", "type-7", "sasl"],
)
async def test_an_undecodable_frame_closes_with_decode_error(port: int, bad: bytes) -> None:
    """Proton stopped reading at such a frame and said nothing: the connection stayed open
    and deaf until the client gave up."""
    peer = await Peer.opened(port)
    peer.send(bad + BEGIN_FRAME)
    assert await peer.closed_with() == "amqp:decode-error"
    await still_serving(port)


@pytest.mark.parametrize(
    ("first", "condition"),
    [
        (frame(b"\x00\x53\x99\x45"), "amqp:decode-error"),  # unknown performative
        (frame(b"\x45"), "amqp:decode-error"),  # not a described type
        (frame(b"\x00\x53\x10\xd0\x00\x00\x01\x00"), "amqp:decode-error"),  # open cut short
        (frame(b"\x00\x53\x10\x40"), "amqp:decode-error"),  # open's fields not a list
        (BEGIN_FRAME, "amqp:not-allowed"),  # §2.4.1: the open comes first
    ],
    ids=["unknown-performative", "not-described", "open-cut-short", "open-not-a-list", "begin"],
)
async def test_a_bad_first_frame_gets_a_close_at_once(
    port: int, first: bytes, condition: str
) -> None:
    """In the open's place proton wrote our open and never the close (it waits for the
    client's open): the client learnt nothing until the handshake timeout cut it off."""
    peer = await Peer.connect(port)
    peer.send(AMQP_HEADER + first)
    assert await peer.read_header() == AMQP_HEADER
    assert await peer.closed_with() == condition
    await still_serving(port)


@pytest.mark.parametrize(
    "bad",
    [
        struct.pack(">IBBH", 4, 2, 0, 0),  # size below the 8-byte header
        struct.pack(">IBBH", 8, 1, 0, 0),  # doff 1: the header is at least 2 words
        struct.pack(">IBBH", 12, 5, 0, 0) + bytes(4),  # doff past the frame's end
        frame(performative(ATTACH, "big", uint(0), SENDER, None, None, None, "x" * 300_000)),
    ],
    ids=["size-4", "doff-1", "doff-beyond", "over-max-frame-size"],
)
async def test_a_malformed_frame_closes_with_framing_error(port: int, bad: bytes) -> None:
    """The over-sized frame is sent whole: the close must not be lost to a reset, as it was
    when the socket was closed with the rest unread."""
    peer = await Peer.opened(port)
    peer.send(bad)
    assert await peer.closed_with() == "amqp:connection:framing-error"
    await still_serving(port)


@pytest.mark.parametrize(
    ("bad", "condition"),
    [
        (
            frame(performative(BEGIN, None, uint(0), uint(9), uint(9)), channel=60000),
            "amqp:connection:framing-error",
        ),
        (frame(performative(END), channel=7), "amqp:not-allowed"),
        (frame(performative(DETACH, uint(42), True)), "amqp:invalid-field"),
        (frame(performative(TRANSFER, uint(9), uint(0), b"t") + KEPT), "amqp:invalid-field"),
        (flow(77, 0xFFFFFFFF), "amqp:invalid-field"),
    ],
    ids=[
        "channel-above-max",
        "end-unknown-channel",
        "detach-unknown",
        "transfer-unattached",
        "flow",
    ],
)
async def test_unknown_channels_and_handles_close_the_connection(
    port: int, bad: bytes, condition: str
) -> None:
    peer = await Peer.opened(port)
    peer.send(frame() + bad)  # an empty frame (heartbeat) first: ignored
    assert await peer.closed_with() == condition
    await still_serving(port)


async def test_an_interleaved_delivery_closes_and_loses_nothing_accepted(port: int) -> None:
    peer = await Peer.opened(port)
    await peer.sender(0, QUEUE)
    assert await peer.send_all(0, [KEPT], first_id=0) == [OK]
    peer.transfer(0, 1, KEPT[:5], more=True, tag=b"a")
    peer.transfer(0, 2, KEPT, tag=b"b")  # a new delivery before the first one ended
    assert await peer.closed_with() == "amqp:invalid-field"
    await still_serving(port, kept=2)


# -- the protocol header and SASL ----------------------------------------------------------------


@pytest.mark.parametrize("header", [b"AMQP\x02\x01\x00\x00", b"AMQP\x02"])
async def test_a_tls_header_on_the_plain_port_gets_the_sasl_header_then_eof(
    port: int, header: bytes
) -> None:
    """AMQP 1.0 §2.2: answer with a supported header and close. Proton started a TLS
    session of its own and closed without a byte."""
    peer = await Peer.connect(port)
    peer.send(header)
    assert await peer.read_header() == SASL_HEADER
    assert await peer.eof()
    await still_serving(port)


SASL_DONE = SASL_HEADER + sasl_init("ANONYMOUS")


async def test_many_empty_sasl_frames_at_once_are_skipped(port: int) -> None:
    """Empty frames are allowed in SASL (§2.3.2): each was skipped by a recursive call, and
    a thousand in one write ended the connection with a RecursionError traceback (found by
    a review). They are skipped in a loop: the handshake goes on."""
    peer = await Peer.connect(port)
    empty = struct.pack(">IBBH", 8, 2, 1, 0)
    peer.send(SASL_HEADER + empty * 3000 + sasl_init("ANONYMOUS") + AMQP_HEADER)
    assert await peer.read_header() == SASL_HEADER
    assert (await peer.expect(SASL_OUTCOME)).fields[0] == 0  # ok
    peer.close()
    await still_serving(port)


@pytest.mark.parametrize(
    "sent",
    [b"", b"AM", SASL_HEADER, SASL_DONE, SASL_DONE + b"AMQ", SASL_DONE + AMQP_HEADER],
    ids=["nothing", "partial", "sasl", "after-sasl", "after-sasl-partial", "no-open"],
)
async def test_a_client_that_never_finishes_the_handshake_is_dropped(
    broker: Broker, amqp: Listener, monkeypatch: pytest.MonkeyPatch, sent: bytes
) -> None:
    """Proton's idle timeout starts with its AMQP layer: before this, a client that sent
    nothing, stopped inside SASL, or went silent after it held its socket for ever."""
    monkeypatch.setattr(connection, "HANDSHAKE_TIMEOUT", 0.3)
    monkeypatch.setattr(connection, "IDLE_TIMEOUT", 30)  # not what drops them
    peer = await Peer.connect(amqp.port)
    peer.send(sent)
    start = time.monotonic()
    assert await peer.eof()
    assert time.monotonic() - start < 3


async def test_heartbeats_come_every_half_of_the_clients_idle_timeout(port: int) -> None:
    """A client advertising idle-time-out T gets a frame at least every T / 2 (§2.4.5), the
    first one too: what proton's tick makes is written at that tick, not at the next."""
    peer = await Peer.connect(port)
    peer.send(AMQP_HEADER + frame(performative(OPEN, "hb", None, uint(65536), None, uint(1000))))
    assert await peer.read_header() == AMQP_HEADER
    assert (await peer.expect(OPEN)).code == OPEN
    last = time.monotonic()
    gaps = []
    for _ in range(4):
        head = await asyncio.wait_for(peer.reader.readexactly(8), TIMEOUT)
        await peer.reader.readexactly(struct.unpack(">I", head[:4])[0] - 8)
        gaps.append(time.monotonic() - last)
        last = time.monotonic()
    assert max(gaps) < 0.85, gaps  # 0.5 s apart; 1 s when a tick's frame waited a tick
    peer.close()


async def test_a_handshake_sent_after_its_timeout_is_not_answered(
    broker: Broker, amqp: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The socket is shut for writing at the timeout: a header arriving in the grace period
    after it is drained unread (answering it failed the transport with an ERROR log)."""
    monkeypatch.setattr(connection, "HANDSHAKE_TIMEOUT", 0.2)
    peer = await Peer.connect(amqp.port)
    await asyncio.sleep(0.4)
    peer.send(SASL_HEADER)
    assert await peer.eof()
    await wait_for(lambda: not amqp.registry.connections)  # the header was taken in


async def test_sasl_frames_after_the_outcome_are_a_framing_error(port: int) -> None:
    peer = await Peer.connect(port)
    peer.send(SASL_HEADER + sasl_init("ANONYMOUS") + sasl_init("ANONYMOUS"))
    assert await peer.read_header() == SASL_HEADER
    await peer.read()  # mechanisms
    assert (await peer.read()).fields == [ubyte(0)]  # outcome: ok
    assert await peer.read_header() == AMQP_HEADER  # the next "header" is a SASL frame
    assert await peer.closed_with() == "amqp:connection:framing-error"
    await still_serving(port)


async def test_an_unknown_sasl_mechanism_fails_authentication(port: int) -> None:
    peer = await Peer.connect(port)
    peer.send(SASL_HEADER + sasl_init("NO-SUCH-MECH", b"x"))
    assert await peer.read_header() == SASL_HEADER
    await peer.read()
    assert (await peer.read()).fields == [ubyte(1)]  # auth
    assert await peer.eof()


# -- links -----------------------------------------------------------------------------------


async def burst(
    peer: Peer, delivery_ids: range
) -> tuple[Frame | None, dict[tuple[int, str | None], int]]:
    """Send these transfers on link 0 at once; the frame that ended the link (a detach, or
    None at EOF) and how many deliveries got each outcome until then."""
    for i in delivery_ids:
        peer.transfer(0, i, KEPT, tag=b"%d" % i)
    outcomes: dict[tuple[int, str | None], int] = {}
    while (got := await peer.read()) is not None and got.code != DETACH:
        if got.code == DISPOSITION:
            outcome = got.outcome()
            outcomes[outcome] = outcomes.get(outcome, 0) + len(got.deliveries())
    return got, outcomes


async def test_transfers_beyond_the_credit_end_the_link(port: int, broker: Broker) -> None:
    """Proton does not enforce credit on what it receives: a client ignoring it had every
    transfer published, with no bound on what was in flight."""
    peer = await Peer.opened(port)
    await peer.sender(0, QUEUE)
    got, outcomes = await burst(peer, range(links.CREDIT * 3))
    assert got is not None and got.error() == links.TRANSFER_LIMIT and got.fields[1] is True
    accepted = outcomes.pop(OK, 0)
    assert set(outcomes) == {(REJECTED, links.TRANSFER_LIMIT)}, outcomes
    stored = (await broker.queues.info(QUEUE)).messages - 1  # the fixture's
    assert accepted <= stored <= links.CREDIT + accepted
    peer.close()
    peer = await Peer.opened(port)
    got = await peer.receive(1, QUEUE, stored + 1)
    assert len(got) == stored + 1
    peer.close()


async def test_one_transfer_past_the_credit_left_ends_the_link(port: int) -> None:
    """The limit is the credit the client was given, not a count of publishes in flight:
    with 400 left (100 used, all stored, no top-up yet), the 401st transfer of a burst is
    refused and the link ends."""
    peer = await Peer.opened(port)
    await peer.sender(0, QUEUE)
    for i in range(100):
        peer.transfer(0, i, KEPT, tag=b"%d" % i)
    settled = 0
    while settled < 100:
        got = await peer.read()
        assert got is not None, "closed"
        if got.code == DISPOSITION:
            assert got.outcome() == OK
            settled += len(got.deliveries())
    got, outcomes = await burst(peer, range(100, 501))
    assert got is not None and got.error() == links.TRANSFER_LIMIT
    assert outcomes.get(OK, 0) <= 400, outcomes
    peer.close()


async def test_an_oversized_multi_frame_delivery_is_rejected_and_dropped(port: int) -> None:
    """The delivery gets a rejected outcome and the link a detach with
    message-size-exceeded; what the client sends on is settled, not kept by proton."""
    peer = await Peer.opened(port)
    await peer.sender(0, QUEUE)
    chunk = bytes(16_000)
    peer.transfer(0, 0, chunk, more=True, tag=b"big")
    for _ in range(links.MAX_MESSAGE_SIZE // len(chunk) + 200):
        peer.transfer(0, None, chunk, more=True, tag=None)
        await peer.writer.drain()
    outcome = await peer.expect(DISPOSITION)
    assert outcome.fields[1] == 0 and int(outcome.fields[4].descriptor) == REJECTED
    detach = await peer.expect(DETACH)
    assert detach.error() == links.MESSAGE_SIZE_EXCEEDED
    peer.close()
    await still_serving(port)


async def send_past_the_size_limit_in_the_last_frame(peer: Peer, delivery_id: int) -> None:
    """A delivery on link 0 of 16,000-byte frames, 100 bytes over max-message-size."""
    chunk = bytes(16_000)
    whole, rest = divmod(links.MAX_MESSAGE_SIZE - 100, len(chunk))
    peer.transfer(0, delivery_id, chunk, more=True, tag=b"big")
    for _ in range(whole - 1):
        peer.transfer(0, None, chunk, more=True, tag=None)
        await peer.writer.drain()
    peer.transfer(0, None, bytes(rest + 200), more=False, tag=None)


async def send_past_the_size_limit_in_a_middle_frame(peer: Peer, delivery_id: int) -> None:
    """A delivery on link 0 of 16,000-byte frames that crosses max-message-size with 100
    frames still to come."""
    chunk = bytes(16_000)
    peer.transfer(0, delivery_id, chunk, more=True, tag=b"big")
    for _ in range(links.MAX_MESSAGE_SIZE // len(chunk) + 100):
        peer.transfer(0, None, chunk, more=True, tag=None)
        await peer.writer.drain()
    peer.transfer(0, None, chunk, more=False, tag=None)


async def test_a_delivery_whose_last_frame_crosses_the_size_limit_ends_the_link(
    port: int,
) -> None:
    """§2.7.3: a message larger than max-message-size is a message-size-exceeded link
    error, wherever the frames fall (it was a rejected outcome when the last one crossed)."""
    peer = await Peer.opened(port)
    await peer.sender(0, QUEUE)
    await send_past_the_size_limit_in_the_last_frame(peer, 0)
    outcome = await peer.expect(DISPOSITION)
    assert outcome.fields[1] == 0 and int(outcome.fields[4].descriptor) == REJECTED
    detach = await peer.expect(DETACH)
    assert detach.error() == links.MESSAGE_SIZE_EXCEEDED
    peer.close()
    await still_serving(port)


async def test_an_aborted_delivery_is_dropped_and_the_next_one_stored(port: int) -> None:
    peer = await Peer.opened(port)
    await peer.sender(0, QUEUE)
    peer.transfer(0, 0, KEPT[:5], more=True, tag=b"a")
    peer.transfer(0, None, b"", aborted=True, tag=None)
    assert await peer.send_all(0, [KEPT], first_id=1) == [OK]
    peer.close()
    await still_serving(port, kept=2)


def source(address: str | None, filters: object = None) -> Described:
    return Described(ulong(SOURCE), [address, None, None, None, None, None, None, filters])


@pytest.mark.parametrize(
    "filters",
    [
        {b"binary-key": Described(symbol("apache.org:selector-filter:string"), "a = 1")},
        {symbol("s"): Described(symbol("gateway:replay-period"), -5)},
        {symbol("s"): Described(symbol("apache.org:selector-filter:string"), "a = = 1")},
        {symbol("s"): Described(symbol("apache.org:selector-filter:string"), None)},
        {symbol("s"): Described(symbol("apache.org:selector-filter:string"), True)},
    ],
    ids=["binary-key", "negative-replay", "bad-selector", "null-selector", "true-selector"],
)
async def test_a_bad_filter_refuses_the_link_with_invalid_field(port: int, filters) -> None:
    """A filter map proton cannot decode (binary keys do not hash) was an internal-error."""
    peer = await Peer.opened(port)
    target = Described(ulong(TARGET), [None])
    peer.send(
        frame(
            performative(ATTACH, "r", uint(0), RECEIVER, None, None, source(QUEUE, filters), target)
        )
    )
    answer = await peer.expect(ATTACH)
    assert answer.fields[5] is None  # a null source: refused
    assert (await peer.expect(DETACH)).error() == "amqp:invalid-field"
    peer.close()
    await still_serving(port)


async def test_a_resumed_link_gets_tags_its_client_may_not_hold_unsettled(port: int) -> None:
    """§2.6.12: a delivery tag is unique among the deliveries either end may hold
    unsettled. A receiver detaches (not closed) with a delivery unsettled and attaches the
    link again, that tag in its unsettled map: new deliveries never reuse it."""
    peer = await Peer.opened(port)
    target = Described(ulong(TARGET), [None])
    attach = [uint(0), RECEIVER, ubyte(0), ubyte(0), source(QUEUE), target]
    peer.send(frame(performative(ATTACH, "r", *attach)))
    await peer.expect(ATTACH)
    peer.send(flow(0, 1))
    tag = (await peer.expect(TRANSFER)).fields[2]
    peer.send(frame(performative(DETACH, uint(0), False)))
    await peer.expect(DETACH)
    peer.send(frame(performative(ATTACH, "r", *attach, {tag: None})))
    await peer.expect(ATTACH)
    peer.send(flow(0, 1, delivery_count=1))
    again = await peer.expect(TRANSFER)
    assert again.fields[2] != tag
    peer.close()


# -- message payloads ---------------------------------------------------------------------------


def not_utf8(encoded: bytes) -> bytes:
    """`encoded` with its string "TO" made two bytes that are no UTF-8 (a string of the
    same length: proton's encoder writes only valid ones)."""
    assert encoded.count(b"TO") == 1
    return encoded.replace(b"TO", b"\xc0\xff")


HEADER = section(0x70, [True])


@pytest.mark.parametrize(
    ("payload", "condition"),
    [
        (section(0x74, [1, 2, 3]) + data(), "amqp:decode-error"),  # properties: a list
        (section(0x72, 5) + data(), "amqp:decode-error"),  # annotations: a number
        (HEADER + HEADER + data(), "amqp:decode-error"),  # a header twice
        (data() + HEADER, "amqp:decode-error"),  # out of order
        (data() + section(0x77, 5), "amqp:decode-error"),  # a body of two kinds
        (b"\x00\xa3\x08amqp:foo" + encode(1) + data(), "amqp:decode-error"),  # unknown section
        (section(0x74, {}) + b"\x00\x53\x74\xc1\x04\x03\x41\x41\x41" + data(), "amqp:decode"),
        (b"\x00\x53\x74\xc1\x04\x03\x41\x41\x41" + data(), "amqp:decode-error"),  # odd map
        (data(b"a") + data(b"b"), "amqp:not-implemented"),  # proton kept one of them
        (not_utf8(section(0x73, [None, None, "TO"])) + data(), "amqp:decode-error"),  # to
        (not_utf8(section(0x74, {"k": "TO"})) + data(), "amqp:decode-error"),
    ],
    ids=[
        "app-props-list",
        "annotations-number",
        "header-twice",
        "out-of-order",
        "data-and-value",
        "unknown-symbolic-section",
        "app-props-twice",
        "odd-map",
        "two-data-sections",
        "to-not-utf8",
        "property-not-utf8",
    ],
)
async def test_a_message_that_cannot_be_stored_as_sent_is_rejected(
    port: int, payload: bytes, condition: str
) -> None:
    """Non-map application properties raised AttributeError: the delivery was never
    settled. The rest were stored with sections (or data) silently dropped."""
    peer = await Peer.opened(port)
    await peer.sender(0, QUEUE)
    outcomes = await peer.send_all(0, [payload, KEPT])
    assert outcomes[0][0] == REJECTED and outcomes[0][1].startswith(condition), outcomes
    assert outcomes[1] == OK
    peer.close()
    await still_serving(port, kept=2)


async def test_an_open_with_a_container_id_not_utf8_closes_with_decode_error(port: int) -> None:
    """Proton passes such strings on: reading it raised in the open's event handler, and
    the connection was left unopened."""
    peer = await Peer.connect(port)
    peer.send(AMQP_HEADER + not_utf8(frame(performative(OPEN, "TO"))))
    assert await peer.read_header() == AMQP_HEADER
    assert await peer.closed_with() == "amqp:decode-error"
    await still_serving(port)


@pytest.mark.parametrize("role", [SENDER, RECEIVER], ids=["sender", "receiver"])
async def test_an_attach_with_an_address_not_utf8_is_refused(port: int, role: bool) -> None:
    peer = await Peer.opened(port)
    terminus = Described(ulong(SOURCE if role else TARGET), ["TO"])
    other = Described(ulong(TARGET if role else SOURCE), [None])
    source, target = (terminus, other) if role else (other, terminus)
    attach = performative(ATTACH, "odd", uint(0), role, ubyte(0), ubyte(0), source, target)
    peer.send(not_utf8(frame(attach)))
    await peer.expect(ATTACH)
    assert (await peer.expect(DETACH)).error() == "amqp:decode-error"
    await peer.sender(1, QUEUE)  # the connection goes on
    peer.close()
    await still_serving(port)


async def test_a_transport_error_quoting_a_name_not_utf8_closes_quietly(port: int) -> None:
    """A second attach on a handle in use: proton's error text quotes the link name, and
    reading that text raised in two event handlers (ERRORs, not one close)."""
    peer = await Peer.opened(port)
    source = Described(ulong(SOURCE), [QUEUE])
    target = Described(ulong(TARGET), [None])
    attach = performative(ATTACH, "TO", uint(1), RECEIVER, ubyte(0), ubyte(0), source, target)
    peer.send(not_utf8(frame(attach)) * 2)
    answer = await asyncio.wait_for(peer.reader.read(), TIMEOUT)  # to EOF: proton's close
    assert b"\x00\x53\x18" in answer  # quotes the name as sent, so it is left undecoded
    await still_serving(port)


@pytest.mark.parametrize("role", [SENDER, RECEIVER], ids=["sender", "receiver"])
async def test_an_attach_without_a_name_is_refused(port: int, role: bool) -> None:
    """The name is mandatory (§2.7.3): a durable subscription is named by it."""
    peer = await Peer.opened(port)
    durable = Described(ulong(SOURCE), [QUEUE, uint(2)])  # durable: unsettled-state
    other = Described(ulong(TARGET), [None])
    source, target = (durable, other) if role else (other, Described(ulong(TARGET), [QUEUE]))
    peer.send(frame(performative(ATTACH, None, uint(0), role, ubyte(0), ubyte(0), source, target)))
    await peer.expect(ATTACH)
    assert (await peer.expect(DETACH)).error() == "amqp:invalid-field"
    peer.close()
    await still_serving(port)


async def test_a_transaction_coordinator_link_is_refused(port: int) -> None:
    """The gateway has no transaction coordinator (§4.2): the link is refused with
    amqp:not-implemented rather than taken for an anonymous relay."""
    peer = await Peer.opened(port)
    coordinator = Described(ulong(0x30), [[symbol("amqp:local-transactions")]])
    source = Described(ulong(SOURCE), [None])
    peer.send(
        frame(performative(ATTACH, "txn", uint(0), SENDER, ubyte(0), ubyte(0), source, coordinator))
    )
    assert (await peer.expect(ATTACH)).fields[6] is None  # a null target: refused
    assert (await peer.expect(DETACH)).error() == "amqp:not-implemented"
    peer.close()
    await still_serving(port)


TRANSACTIONAL_STATE = 0x34


def in_transaction(outcome: Described | None) -> Described:
    """transactional-state (§4.5.5) naming a transaction no coordinator declared."""
    return Described(ulong(TRANSACTIONAL_STATE), [b"txn-1", outcome])


@pytest.mark.parametrize("settled", [True, False])
async def test_an_outcome_in_a_transaction_is_refused_and_the_message_kept(
    port: int, settled: bool
) -> None:
    """With no coordinator, a disposition's transactional-state names an unknown
    transaction (§4.5.6): a settled one with `released` inside was taken as an accept and
    the message deleted, an unsettled one went unanswered. The link ends with
    transaction:unknown-id and the message is delivered again."""
    peer = await Peer.opened(port)
    peer.attach("r", 0, RECEIVER, QUEUE)
    await peer.expect(ATTACH)
    peer.send(flow(0, 1))
    delivery = (await peer.expect(TRANSFER)).fields[1]
    released = in_transaction(Described(ulong(0x26), []))
    peer.send(frame(performative(DISPOSITION, RECEIVER, delivery, None, settled, released)))
    assert (await peer.expect(DETACH)).error() == "amqp:transaction:unknown-id"
    peer.close()
    await still_serving(port)


async def test_a_transfer_in_a_transaction_is_refused_not_stored(port: int) -> None:
    """A transfer posted into a transaction (§4.4.1) was stored and accepted at once, as if
    it named none: rejected with transaction:unknown-id now, and not stored."""
    peer = await Peer.opened(port)
    await peer.sender(0, QUEUE)
    fields = [uint(0), uint(0), b"t", uint(0), False, False, None, in_transaction(None)]
    peer.send(frame(performative(TRANSFER, *fields) + bytes(Message(body=b"txn").encode())))
    got = await peer.expect(DISPOSITION)
    assert got.outcome() == (REJECTED, "amqp:transaction:unknown-id")
    peer.close()
    await still_serving(port)


async def test_a_message_with_negative_ids_is_stored_deliverable(port: int) -> None:
    """A long message-id or correlation-id (not an id type) was stored as sent and then
    could not be encoded for an AMQP receiver: rejected at delivery, lost to it. Dropped
    at publish now, as proton drops every property of the wrong type."""
    peer = await Peer.opened(port)
    await peer.sender(0, QUEUE)
    odd = section(0x73, [-5, None, None, "subj", None, -7]) + data(b"kept")
    assert await peer.send_all(0, [odd]) == [OK]
    got = await peer.receive(1, QUEUE, 2)
    msg = Message()
    msg.decode(got[1])
    assert (msg.id, msg.correlation_id, bytes(msg.body)) == (None, None, b"kept")
    peer.close()


async def test_odd_property_values_reach_amqp_and_mqtt_receivers(
    broker: Broker, ports: Ports
) -> None:
    """A ulong past a long's range was stored but could not be encoded for an AMQP
    receiver (either encoder): rejected at delivery, so lost to it. AMQP receivers get the
    values as sent (the bare message), MQTT ones as text."""
    await broker.declare_queue(QueueConfig(name=QUEUE), [("odd/>", "smf")])
    props = {"big": ulong(2**64 - 1), "neg": -5, "sym": symbol("s"), "list": [1, 2]}
    payloads = [section(0x74, props) + data(b"odd"), section(0x74, props) + section(0x77, [7])]
    subscriber = await asyncio.to_thread(Client, ports.mqtt, V5, "odd-sub")
    try:
        await asyncio.to_thread(subscriber.subscribe, "odd/#", 1)
        peer = await Peer.opened(ports.amqp)
        await peer.sender(0, "topic://odd/x")
        assert await peer.send_all(0, payloads) == [OK, OK]
        bodies = []
        for got in await peer.receive(1, QUEUE, 2):
            msg = Message()
            msg.decode(got)
            assert msg.properties == props
            assert [type(v) for v in msg.properties.values()] == [ulong, int, symbol, list]
            body = msg.body  # binary: a view into `msg`, copied while it lives
            bodies.append(bytes(body) if isinstance(body, memoryview) else body)
        assert bodies == [b"odd", [7]]
        peer.close()
        received = await asyncio.to_thread(subscriber.receive, 2)
        assert [m.payload for m in received] == [b"odd", b"[7]"]
        for mqtt_msg in received:
            user = dict(mqtt_msg.properties.UserProperty)
            assert user["big"] == str(2**64 - 1) and user["neg"] == "-5"
    finally:
        await asyncio.to_thread(subscriber.close)


async def test_many_hostile_connections_at_once_leave_others_unaffected(port: int) -> None:
    """Other connections are unaffected while hostile ones are closed."""
    good = await Peer.opened(port)
    await good.sender(0, QUEUE)

    async def hostile(bad: bytes) -> str | None:
        peer = await Peer.opened(port)
        peer.send(bad)
        return await peer.closed_with()

    closes: list[Callable[[], Awaitable[str | None]]] = [
        lambda: hostile(frame(b"\x45")),
        lambda: hostile(struct.pack(">IBBH", 4, 2, 0, 0)),
        lambda: hostile(frame(performative(END), channel=9)),
    ]
    results = await asyncio.gather(*(make() for make in closes * 3))
    assert all(results)
    assert await good.send_all(0, [KEPT]) == [OK]
    good.close()
    await still_serving(port, kept=2)


async def test_a_close_is_answered_and_data_after_it_ignored(port: int) -> None:
    peer = await Peer.opened(port)
    peer.send(frame(performative(CLOSE)) + BEGIN_FRAME)
    close = await peer.expect(CLOSE)
    assert close.error() is None
    assert await peer.eof()
    await still_serving(port)


@pytest.mark.parametrize(
    "sent",
    [b"AMQP\x03\x01\x00\x01", b"AMQP\x00\x01\x00\x01", bytes.fromhex("1603010005") + b"hello"],
    ids=["sasl-1.0.1", "amqp-1.0.1", "tls-client-hello"],
)
async def test_a_header_it_does_not_take_is_answered_with_the_sasl_header_then_closed(
    port: int, sent: bytes
) -> None:
    """AMQP 1.0 §2.2: the header of a version it supports, then close; an amqps client
    pointed at the plain port (a TLS ClientHello) too."""
    peer = await Peer.connect(port)
    peer.send(sent)
    assert await peer.read_header() == SASL_HEADER
    assert await peer.eof()


async def test_links_beyond_the_connections_limit_are_refused(
    port: int, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One connection attached 2,000 receivers to one queue, each a consumer in Redis."""
    monkeypatch.setattr(connection, "MAX_LINKS", 5)
    peer = await Peer.opened(port)
    for handle in range(7):
        peer.attach(f"r{handle}", handle, RECEIVER, QUEUE)
    refused = []
    while len(refused) < 2:
        got = await peer.read()
        assert got is not None
        if got.code == DETACH:
            refused.append(got.error())
    assert refused == ["amqp:resource-limit-exceeded"] * 2
    await asyncio.sleep(0.2)
    assert len((await broker.queues.info(QUEUE)).flows) == 5
    peer.close()
