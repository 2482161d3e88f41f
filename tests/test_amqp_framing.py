"""Malformed AMQP message bytes are refused (amqp:decode-error), never stored as an empty
message: proton's own decoder would accept them."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st
from proton import Disposition, Message, symbol

from gateway.broker import Broker, QueueConfig
from gateway.model import Publisher
from protocols.amqp import framing, mapping, sections
from protocols.amqp.listener import Listener
from tests.test_adapter_fixes import send_raw

PUB = Publisher("amqp")
SAMPLES = [
    Message(body=b"hello", properties={"a": 1}),
    Message(body={"a": [1, 2, {"b": None}]}, annotations={symbol("x-opt-x"): 5}),
    Message(body=[1, 2, 3], inferred=True),
    Message(body="text", subject="s", ttl=5, priority=7, durable=True),
    Message(),
]


EMPTY_HEADER_AND_PROPERTIES = len(Message().encode())  # proton always writes both


@pytest.mark.parametrize("msg", SAMPLES, ids=["data", "map", "sequence", "string", "empty"])
def test_whole_messages_pass_and_truncated_ones_are_refused(msg: Message) -> None:
    data = bytes(msg.encode())
    framing.check_message(data)
    mapping.decode(data, PUB)
    for cut in range(len(data)):
        try:
            mapping.decode(data[:cut], PUB)
        except mapping.BodyError:
            continue
        framing.check_message(data[cut:])  # accepted only when cut between whole sections
    if msg.body is not None:  # any cut inside the body section (the last one) is refused
        body = bytes(Message(body=msg.body, inferred=msg.inferred).encode())
        body_start = len(data) - (len(body) - EMPTY_HEADER_AND_PROPERTIES)
        for cut in range(body_start + 1, len(data)):
            with pytest.raises(mapping.BodyError):
                mapping.decode(data[:cut], PUB)


@given(
    body=st.one_of(st.binary(max_size=64), st.text(max_size=32), st.none()),
    props=st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=8), st.booleans()),
        max_size=4,
    ),
    junk=st.binary(min_size=1, max_size=8),
)
def test_trailing_bytes_are_refused(body, props, junk: bytes) -> None:
    data = bytes(Message(body=body, properties=props).encode())
    mapping.decode(data, PUB)
    with pytest.raises(mapping.BodyError):
        mapping.decode(data + b"\x01" + junk, PUB)


@given(st.binary(max_size=64))
def test_random_bytes_are_refused_cleanly_or_decoded(data: bytes) -> None:
    """Fuzz: BodyError is the only way decoding may fail."""
    with contextlib.suppress(mapping.BodyError):
        mapping.decode(data, PUB)


def nested_lists(depth: int, wide: bool) -> bytes:
    """`depth` lists each holding the next (list32 or list8), around an empty list."""
    value = b"\x45"
    for _ in range(depth):
        if wide:
            value = b"\xd0" + (len(value) + 4).to_bytes(4, "big") + b"\x00\x00\x00\x01" + value
        else:
            value = b"\xc0" + bytes((min(len(value) + 1, 255), 1)) + value
    return value


@pytest.mark.parametrize("section", [0x70, 0x74, 0x77], ids=["header", "app-props", "value"])
@pytest.mark.parametrize("wide", [False, True], ids=["list8", "list32"])
def test_deeply_nested_values_are_a_body_error(section: int, wide: bool) -> None:
    """Past framing.MAX_DEPTH the fast reader gives up and framing refuses: no
    RecursionError (or anything but BodyError) escapes."""
    data = b"\x00\x53" + bytes((section,)) + nested_lists(1000, wide)
    with pytest.raises(sections.Unsupported):
        sections.decode(data, PUB)
    with pytest.raises(mapping.BodyError):
        mapping.decode(data, PUB)


def test_nesting_up_to_the_limit_is_decoded() -> None:
    data = b"\x00\x53\x77" + nested_lists(framing.MAX_DEPTH - 1, True)
    assert mapping.decode(data, PUB).message.payload.startswith(b"[")


async def test_a_truncated_transfer_is_rejected_and_nothing_is_stored(
    broker: Broker, amqp: Listener
) -> None:
    await broker.declare_queue(QueueConfig(name="raw-q"))
    good = bytes(Message(body=b"kept", durable=True).encode())
    payloads = [good[:-2], b"\x00garbage", good]
    outcomes = await asyncio.wait_for(asyncio.to_thread(send_raw, amqp, "raw-q", payloads), 20)
    rejected = (Disposition.REJECTED, "amqp:decode-error")
    assert outcomes == [rejected, rejected, (Disposition.ACCEPTED, None)], outcomes
    info = await broker.queues.info("raw-q")
    assert info.messages == 1
