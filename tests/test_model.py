"""The internal message model: stream-entry encoding round trip, decode errors, outcomes."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.model import (
    DEFAULT_PRIORITY,
    ENCODING_VERSION,
    Delivery,
    Message,
    Outcome,
    Publisher,
    decode,
    encode,
    new_message_id,
)

# msgpack integers are 64-bit: signed down to -2**63, unsigned up to 2**64 - 1.
MSGPACK_INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)

property_values = st.one_of(
    st.none(),
    st.booleans(),
    MSGPACK_INTS,
    st.floats(allow_nan=False),
    st.text(),
    st.binary(max_size=64),
)
ids = st.one_of(st.none(), st.text(max_size=40), st.binary(max_size=40), MSGPACK_INTS)
opt_text = st.one_of(st.none(), st.text(max_size=40))
epoch_ms = st.one_of(st.none(), st.integers(min_value=0, max_value=2**63 - 1))

# repeated keys made likely by drawing keys from a small alphabet
user_properties = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "k", "", "ключ", "a b"]) | st.text(max_size=8), property_values
    ),
    max_size=8,
)
publishers = st.one_of(
    st.none(),
    st.builds(
        Publisher,
        protocol=st.sampled_from(["mqtt", "amqp", "http"]),
        client_id=st.text(max_size=20),
        user=opt_text,
    ),
)

small_payloads = st.one_of(st.just(b""), st.binary(max_size=300))
# large payloads (bin32 in msgpack) built from a drawn pattern: hypothesis buffers are small
large_payloads = st.tuples(
    st.integers(min_value=65_536, max_value=300_000), st.binary(min_size=1, max_size=16)
).map(lambda t: (t[1] * (t[0] // len(t[1]) + 1))[: t[0]])


def message_strategy(payloads: st.SearchStrategy[bytes]) -> st.SearchStrategy[Message]:
    return st.builds(
        Message,
        destination=st.text(min_size=1, max_size=60),  # unicode topic and queue names
        payload=payloads,
        partition_key=opt_text,
        priority=st.integers(min_value=0, max_value=9),
        expiration=epoch_ms,
        not_before=epoch_ms,
        persistent=st.booleans(),
        dmq_eligible=st.booleans(),
        content_type=opt_text,
        correlation_id=ids,
        reply_to=opt_text,
        message_id=ids,
        subject=opt_text,
        user_properties=user_properties,
        annotations=st.dictionaries(st.text(max_size=12), property_values, max_size=6),
        publisher=publishers,
        retain=st.booleans(),
        to_queue=st.booleans(),
        id=st.one_of(st.just(""), st.text(min_size=1, max_size=30)),
        timestamp=epoch_ms,
    )


small_messages = message_strategy(small_payloads)
messages = message_strategy(st.one_of(small_payloads, large_payloads))


def _types(msg: Message) -> list[object]:
    """Type shape of the loosely typed fields (1 == True would hide an int/bool swap)."""
    return [
        type(msg.correlation_id),
        type(msg.message_id),
        [(type(k), type(v)) for k, v in msg.user_properties],
        {k: type(v) for k, v in msg.annotations.items()},
        type(msg.payload),
    ]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_encode_decode_round_trip(msg: Message) -> None:
    blob = encode(msg)
    assert isinstance(blob, bytes)
    back = decode(blob)
    assert back == msg
    assert back.id == msg.id
    assert back.user_properties == msg.user_properties  # order and repeated keys kept
    assert list(back.annotations) == list(msg.annotations)
    assert _types(back) == _types(msg)


def test_round_trip_of_a_fully_populated_message() -> None:
    msg = Message(
        destination="шоп/éu/🚀/created",
        payload=b"\x00\xff" * 10,
        partition_key="dev-7",
        priority=0,
        expiration=1_900_000_000_000,
        not_before=1_800_000_000_000,
        persistent=False,
        dmq_eligible=True,
        content_type="application/json",
        correlation_id=b"\x01\x02",
        reply_to="replies/1",
        message_id=2**64 - 1,
        subject="subj",
        user_properties=[
            ("k", "v"),
            ("k", 1),
            ("f", 2.5),
            ("b", True),
            ("raw", b"\x00"),
            ("n", None),
            ("k", False),
        ],
        annotations={"x-mqtt-qos": 1, "x-opt": b"z", "none": None},
        timestamp=1_700_000_000_123,
        publisher=Publisher("mqtt", "client-1", "alice"),
        retain=True,
        id=new_message_id(),
    )
    back = decode(encode(msg))
    assert back == msg
    assert back.user_properties[3] == ("b", True)
    assert back.user_properties[3][1] is True
    assert back.user_properties[1][1] == 1 and type(back.user_properties[1][1]) is int


def test_defaults_survive_and_trailing_defaults_are_trimmed() -> None:
    msg = Message(destination="t")
    blob = encode(msg)
    # version, payload, destination, id, flags, priority: nothing after that is stored
    assert msgpack.unpackb(blob) == [ENCODING_VERSION, b"", "t", "", 1, DEFAULT_PRIORITY]
    back = decode(blob)
    assert back == msg
    assert back.payload == b""
    assert back.priority == DEFAULT_PRIORITY
    assert back.persistent is True
    assert back.publisher is None
    assert back.user_properties == [] and back.annotations == {}


@pytest.mark.parametrize("size", [0, 255, 65_536, 5 * 1024 * 1024])
def test_large_payload_round_trip(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + b"\x07" * (size % 256)
    msg = Message(destination="big", payload=payload, id="x-1")
    back = decode(encode(msg))
    assert len(back.payload) == size
    assert back.payload == payload
    assert back.id == "x-1"


def test_message_ids_are_unique() -> None:
    made = {new_message_id() for _ in range(10_000)}
    assert len(made) == 10_000
    assert all(isinstance(i, str) and i for i in made)


def test_to_queue_survives_the_round_trip() -> None:
    msg = Message(destination="orders", payload=b"x", to_queue=True)
    assert decode(encode(msg)).to_queue is True


# -- decode errors --------------------------------------------------------------------------


@given(small_messages, st.data())
def test_truncated_entry_raises_value_error(msg: Message, data: st.DataObject) -> None:
    blob = encode(msg)
    cut = data.draw(st.integers(min_value=0, max_value=len(blob) - 1))
    with pytest.raises(ValueError, match="undecodable"):
        decode(blob[:cut])


@given(small_messages, st.binary(min_size=1, max_size=20))
def test_trailing_bytes_raise_value_error(msg: Message, extra: bytes) -> None:
    with pytest.raises(ValueError, match="undecodable"):
        decode(encode(msg) + extra)


wrong_versions = st.one_of(
    MSGPACK_INTS.filter(lambda v: v != ENCODING_VERSION),
    st.text(),
    st.binary(),
    st.none(),
    st.floats(allow_nan=False).filter(lambda v: v != ENCODING_VERSION),
)


@given(wrong_versions, st.lists(st.one_of(st.none(), st.binary(), st.text()), max_size=5))
@example(0, [b"", "t"])
@example(2, [b"", "t"])
@example("1", [b"", "t"])
def test_wrong_version_raises_value_error(version: object, rest: list[object]) -> None:
    with pytest.raises(ValueError, match="unknown encoding version"):
        decode(msgpack.packb([version, *rest], use_bin_type=True))


@pytest.mark.parametrize(
    "doc",
    [[], {}, {"0": 1}, 1, "text", b"bytes", None, True, [[1, b"", "t"]]],
    ids=["empty-list", "empty-map", "map", "int", "str", "bin", "nil", "bool", "nested"],
)
def test_non_array_or_empty_entry_raises_value_error(doc: object) -> None:
    with pytest.raises(ValueError, match="unknown encoding version"):
        decode(msgpack.packb(doc, use_bin_type=True))


@pytest.mark.parametrize(
    "blob", [b"", b"\xc1", b"\x92\x01", b"\xdd\xff\xff\xff\xff", b"\x91\x01\x01"]
)
def test_garbage_bytes_raise_value_error(blob: bytes) -> None:
    with pytest.raises(ValueError, match="undecodable"):
        decode(blob)


@settings(max_examples=300)
@given(st.binary(max_size=64))
@example(b"\x81\x91\x01\x01")  # {[1]: 1}
@example(b"\x81\x80\x01")  # {{}: 1}
def test_random_bytes_raise_only_value_error(blob: bytes) -> None:
    try:
        msg = decode(blob)
    except ValueError:
        return
    assert isinstance(msg, Message)


@pytest.mark.parametrize(
    "fields",
    [
        [1, b"", "t", "", "flags"],
        [1, b"", "t", "", 1, 4, None, None, None, None, None, None, None, None, 5],
        [1, b"", "t", "", 1, 4, None, None, None, None, None, None, None, None, None, None, 7],
        [1, b"", "t", "", 1, 4, *[None] * 11, "bare", 0],
        [1, b"", "t", "", 1, 4, *[None] * 11, b"bare", -1],
        [1, b"", "t", "", 1, 4, *[None] * 11, None, 0],
        [1, b"", "t", "", 1, 4, *[None] * 11, None, None, "annotations"],
    ],
    ids=[
        "str-flags",
        "int-user-properties",
        "int-publisher",
        "str-bare",
        "at-minus-1",
        "no-bare",
        "str-annotations",
    ],
)
def test_version_1_entry_with_wrong_field_types_raises_value_error(fields: list) -> None:
    with pytest.raises(ValueError):
        decode(msgpack.packb(fields, use_bin_type=True))


# -- outcomes and deliveries ----------------------------------------------------------------

ACCEPTED = {
    Outcome.OK: True,
    Outcome.NO_SUBSCRIBERS: True,
    Outcome.NOT_FOUND: False,
    Outcome.INGRESS_DISABLED: False,
    Outcome.TOO_LARGE: False,
    Outcome.QUOTA_EXCEEDED: False,
    Outcome.QUEUE_FULL: False,
    Outcome.FLOW_CONTROLLED: False,  # never reaches a publisher: the spooler retries
    Outcome.OUT_OF_MEMORY: False,
}


def test_every_outcome_is_classified() -> None:
    assert set(Outcome) == set(ACCEPTED)


@pytest.mark.parametrize("outcome", list(Outcome), ids=lambda o: o.name)
def test_outcome_accepted(outcome: Outcome) -> None:
    assert outcome.accepted is ACCEPTED[outcome]


def test_outcome_codes_are_stable() -> None:
    # the Lua spool function returns these numbers
    assert [(o.name, int(o)) for o in Outcome] == [
        ("OK", 0),
        ("NO_SUBSCRIBERS", 1),
        ("NOT_FOUND", 2),
        ("INGRESS_DISABLED", 3),
        ("TOO_LARGE", 4),
        ("QUOTA_EXCEEDED", 5),
        ("QUEUE_FULL", 6),
        ("FLOW_CONTROLLED", 7),
        ("OUT_OF_MEMORY", 8),
    ]


@pytest.mark.parametrize(("count", "redelivered"), [(1, False), (2, True), (7, True)])
def test_delivery_redelivered(count: int, redelivered: bool) -> None:
    d = Delivery("q", "1-0", Message(destination="q"), delivery_count=count)
    assert d.redelivered is redelivered


def test_message_field_order_is_the_one_positional_builders_use() -> None:
    """model.decode, protocols/mqtt/mapping.to_message and protocols/amqp/sections build a
    Message positionally (for speed): a reordered field would silently mislabel values."""
    assert [f.name for f in dataclasses.fields(Message)] == [
        "destination", "payload", "partition_key", "priority", "expiration", "not_before",
        "persistent", "dmq_eligible", "content_type", "correlation_id", "reply_to",
        "message_id", "subject", "user_properties", "annotations", "publisher", "retain",
        "to_queue", "id", "amqp_bare", "payload_in_bare", "amqp_annotations", "timestamp",
        "amqp_footer", "exactly_once",
    ]  # fmt: skip
