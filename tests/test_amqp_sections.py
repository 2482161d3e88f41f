"""protocols/amqp/sections.py against proton: the plain-Python section codec must give the
same gateway message (ingress) and the same AMQP message (egress) as proton's Message does,
and hand every shape it does not cover back to proton."""

from __future__ import annotations

import json
import math
import struct
import time
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proton import Array, Data, Described, byte, char, int32, short, symbol, ubyte, ulong
from proton import Message as AmqpMessage

from gateway.model import Delivery, Message, Publisher, bound_times, decode, encode
from protocols.amqp import framing, mapping, sections

PUB = Publisher("amqp", "c1", "alice")
NOW = int(time.time() * 1000)


def proton_ingress(data: bytes) -> tuple[Message, str | None, int | None]:
    """The proton path of mapping.decode, whatever sections would do."""
    original = sections.decode

    def refuse(*_: object) -> None:
        raise sections.Unsupported("test")

    sections.decode = refuse  # type: ignore[assignment]
    try:
        ingress = mapping.decode(data, PUB)
    finally:
        sections.decode = original  # type: ignore[assignment]
    return ingress.message, ingress.to, ingress.jms_dest


INGRESS = [
    AmqpMessage(body=b"x" * 100, durable=True),  # the C load generator's message
    AmqpMessage(body=b"y" * 300, inferred=True),  # a data section
    AmqpMessage(body="text"),
    AmqpMessage(),
    AmqpMessage(body=b"z" * 70_000, inferred=True, id=b"\x01\x02", expiry_time=NOW / 1000 + 60),
    AmqpMessage(body=b"u", id=uuid.uuid4(), correlation_id=uuid.uuid4(), ttl=30),
    # a header of null, ubyte, null, true
    AmqpMessage(body=b"p", durable=False, priority=9, first_acquirer=True),
    AmqpMessage(
        body=b"full",
        inferred=True,
        durable=True,
        priority=7,
        id=42,
        correlation_id="corr",
        reply_to="replies",
        subject="subj",
        group_id="g1",
        content_type="application/octet-stream",
        address="queue://q",
        properties={"a": 1, "b": "two", "c": 2.5, "d": True, "e": None, "f": b"bin", "g": -5},
        annotations={
            symbol("x-opt-jms-dest"): 1,
            symbol("x-opt-dmq-eligible"): True,
            symbol("x-opt-delivery-time"): NOW + 5000,
        },
    ),
]


@pytest.mark.parametrize("amqp", INGRESS, ids=range(len(INGRESS)))
def test_ingress_matches_proton(amqp: AmqpMessage) -> None:
    data = bytes(amqp.encode())
    fast, to, jms_dest = sections.decode(data, PUB)
    slow, slow_to, slow_jms = proton_ingress(data)
    assert (to, jms_dest) == (slow_to, slow_jms)
    for name in Message.__slots__:
        a, b = getattr(fast, name), getattr(slow, name)
        if name == "expiration" and a is not None and b is not None:
            assert abs(a - b) <= 2  # proton goes through float seconds
        else:
            assert a == b, name
            assert type(a) is type(b), name


def test_a_jms_topic_reply_to_is_a_topic_address_on_both_paths() -> None:
    annotations = {symbol("x-opt-jms-reply-to"): byte(1)}
    data = bytes(AmqpMessage(body=b"x", reply_to="replies/t", annotations=annotations).encode())
    fast, slow = sections.decode(data, PUB)[0], proton_ingress(data)[0]
    assert fast.reply_to == slow.reply_to == "topic://replies/t"


@pytest.mark.parametrize(
    "amqp",
    [
        AmqpMessage(body={"a": 1}),  # amqp-value map: JSON payload, kept value
        AmqpMessage(body=[1, 2]),
        AmqpMessage(body=b"x", properties={"k": [1]}),  # a list as a property value
    ],
)
def test_other_shapes_are_left_to_proton(amqp: AmqpMessage) -> None:
    data = bytes(amqp.encode())
    with pytest.raises(sections.Unsupported):
        sections.decode(data, PUB)
    assert mapping.decode(data, PUB).message.payload  # the proton path still takes it


@pytest.mark.parametrize(
    "data",
    [
        bytes(AmqpMessage(body=b"x" * 50, durable=True).encode())[:-10],  # truncated
        b"\x00\x53\x75\xa0\xff",  # a data section shorter than its length
        b"\x00\x53\x99\x40",  # an unknown section
        b"garbage",
    ],
)
def test_malformed_bytes_are_left_to_proton(data: bytes) -> None:
    with pytest.raises(sections.Unsupported):
        sections.decode(data, PUB)


@pytest.mark.parametrize("section", [b"\x72", b"\x74"], ids=["annotations", "application"])
def test_a_list_where_a_map_belongs_is_refused(section: bytes) -> None:
    """Lists and maps share a shape in the decoder: a list of key, value, ... must not pass
    for message-annotations or application-properties."""
    data = b"\x00\x53" + section + b"\xc0\x07\x02\xa3\x01a\xa1\x01b\x00\x53\x75\xa0\x01x"
    with pytest.raises(sections.Unsupported):
        sections.decode(data, PUB)
    with pytest.raises(mapping.BodyError, match="must be maps"):
        mapping.decode(data, PUB)


def _properties(expiry: bytes) -> bytes:
    """A properties section of eight nulls and this absolute-expiry-time, then a body."""
    items = b"\x40" * 8 + expiry
    return b"\x00\x53\x73\xc0" + bytes((len(items) + 1, 9)) + items + b"\x00\x53\x75\xa0\x01x"


@pytest.mark.parametrize(
    "data",
    [
        _properties(b"\x82" + struct.pack(">d", math.inf)),  # a double
        _properties(b"\x82" + struct.pack(">d", math.nan)),
        b"\x00\x53\x70\xc0\x0c\x03\x40\x40\x82"
        + struct.pack(">d", 1e300)
        + b"\x00\x53\x75\xa0\x01x",
    ],
    ids=["expiry-inf", "expiry-nan", "ttl-double"],
)
def test_times_of_another_type_are_left_to_proton(data: bytes) -> None:
    """absolute-expiry-time is a timestamp and ttl a uint: proton ignores other types."""
    with pytest.raises(sections.Unsupported):
        sections.decode(data, PUB)
    assert mapping.decode(data, PUB).message.expiration is None


def egress_fields(data: bytes) -> dict[str, object]:
    amqp = AmqpMessage()
    amqp.decode(data)
    names = [
        "durable",
        "priority",
        "first_acquirer",
        "delivery_count",
        "id",
        "correlation_id",
        "address",
        "subject",
        "reply_to",
        "content_type",
        "group_id",
        "body",
        "properties",
        "annotations",
        "expiry_time",
    ]
    fields = {n: getattr(amqp, n) for n in names}
    for name, value in fields.items():  # views into `amqp`, which goes away
        if isinstance(value, memoryview):
            fields[name] = bytes(value)
    return fields | {"ttl": round(amqp.ttl)}


EGRESS = [
    Delivery("q", "1-0", Message("q", b"p" * 100, to_queue=True)),
    Delivery(
        "q",
        "2-0",
        Message(
            "a/b",
            b"p" * 400,
            partition_key="k",
            priority=9,
            expiration=NOW + 60_000,
            persistent=False,
            content_type="text/plain",
            correlation_id=b"cc",
            reply_to="rr",
            message_id=7,
            subject="subj",
            user_properties=[("a", 1), ("b", "x"), ("c", 1.5), ("d", False), ("a", 3)],
            annotations={"x-origin-queue": "q1", "x-dmq-reason": "expired"},
        ),
        delivery_count=3,
    ),
    Delivery("q", "3-0", Message("q", b"x" * 70_000, message_id="mid", to_queue=True)),
]


@pytest.mark.parametrize("delivery", EGRESS, ids=range(len(EGRESS)))
def test_egress_matches_proton(delivery: Delivery) -> None:
    fast = egress_fields(sections.encode(delivery))
    assert fast == egress_fields(bytes(mapping.from_delivery(delivery).encode()))


def test_kept_properties_section_matches_proton() -> None:
    """A message whose only property is `to` reuses the section kept for its address."""
    for to_queue in (True, False):
        delivery = Delivery("q", "4-0", Message("kept/address", b"k", to_queue=to_queue))
        first = sections.encode(delivery)
        assert sections.encode(delivery) == first
        proton = bytes(mapping.from_delivery(delivery).encode())
        assert egress_fields(first) == egress_fields(proton)


def through_storage(data: bytes, destination: str = "q", to_queue: bool = True) -> AmqpMessage:
    """An AMQP message as a receiver gets it: decoded at ingress, addressed as the inbound
    link does, stored (model encode / decode) and encoded for a delivery."""
    ingress = mapping.decode(data, PUB)
    msg = ingress.message
    msg.destination, msg.to_queue = destination, to_queue
    if ingress.to is None:
        sections.address_bare(msg)
    stored = decode(encode(msg))
    out = AmqpMessage()
    out.decode(sections.encode(Delivery(destination, "1-0", stored, delivery_count=2)))
    return out


def test_an_amqp_value_goes_out_as_sent() -> None:
    assert through_storage(bytes(AmqpMessage(body={"a": 1}).encode())).body == {"a": 1}


def test_the_bare_message_goes_out_as_sent() -> None:
    """AMQP 1.0 §3.2: properties, application properties and the body reach receivers as
    the publisher encoded them (no field lost, no value retyped); the header is the
    delivery's."""
    sent = AmqpMessage(
        body="text body",
        id=uuid.uuid4(),
        correlation_id=uuid.uuid4(),
        user_id=b"alice",
        address="q",
        reply_to_group_id="rg",
        group_id="g",
        group_sequence=7,
        content_encoding="gzip",
        creation_time=NOW / 1000,
        properties={"i": int32(-5), "s": short(3), "u": ubyte(9), "y": symbol("x"), "c": char("é")},
    )
    got = through_storage(bytes(sent.encode()))
    for field in ("body", "id", "correlation_id", "user_id", "address", "reply_to_group_id",
                  "group_id", "group_sequence", "content_encoding", "creation_time"):  # fmt: skip
        assert getattr(got, field) == getattr(sent, field), field
    assert got.properties == sent.properties
    assert {k: type(v) for k, v in got.properties.items()} == {
        k: type(v) for k, v in sent.properties.items()
    }
    assert got.delivery_count == 1 and not got.first_acquirer


@pytest.mark.parametrize(
    "sent",
    [
        AmqpMessage(body=b"no properties section", inferred=True),
        AmqpMessage(body=b"x" * 300, inferred=True, id="m1", subject="s"),  # no `to` in it
    ],
)
def test_a_bare_message_without_to_gets_its_address(sent: AmqpMessage) -> None:
    for to_queue, address in ((True, "q"), (False, "topic://q")):
        got = through_storage(bytes(sent.encode()), "q", to_queue)
        assert (got.address, got.body, got.id, got.subject) == (
            address,
            sent.body,
            sent.id,
            sent.subject,
        )


def test_publisher_annotations_go_on_with_the_gateways_own() -> None:
    """Message annotations the publisher sent reach receivers typed as sent; those the
    gateway sets (x-opt-jms-dest, a dead message's origin) replace the publisher's."""
    sent = AmqpMessage(
        body=b"b",
        annotations={
            symbol("x-opt-jms-msg-type"): byte(3),
            symbol("x-opt-jms-dest"): byte(0),
            symbol("x-origin-queue"): "forged",
            symbol("custom"): ulong(7),
        },
    )
    ingress = mapping.decode(bytes(sent.encode()), PUB)
    msg = ingress.message
    msg.destination, msg.to_queue = "t", False
    msg.annotations.update({"x-origin-queue": "q1", "x-dmq-reason": "expired"})
    data = sections.encode(Delivery("t", "1-0", decode(encode(msg))))
    assert data.count(b"x-opt-jms-dest") == data.count(b"x-origin-queue") == 1
    got = AmqpMessage()
    got.decode(data)
    assert got.annotations == {
        "x-opt-jms-msg-type": 3,
        "custom": 7,
        "x-origin-queue": "q1",
        "x-dmq-reason": "expired",
        "x-opt-jms-dest": 1,
    }
    assert (type(got.annotations["x-opt-jms-msg-type"]), type(got.annotations["custom"])) == (
        byte,
        ulong,
    )


def test_the_payload_is_stored_once() -> None:
    """A data section's bytes are the bare message's last: the stored entry holds them once,
    and reads them back from there."""
    payload = b"p" * 4096
    msg = mapping.decode(bytes(AmqpMessage(body=payload, inferred=True, id="i").encode()), PUB)
    blob = encode(msg.message)
    assert blob.count(payload) == 1 and decode(blob).payload == payload
    assert decode(blob).amqp_bare == msg.message.amqp_bare


values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 63) - 1),
    st.floats(allow_nan=False),
    st.text(max_size=300),
    st.binary(max_size=300),
)


@given(
    payload=st.binary(max_size=600),
    props=st.lists(st.tuples(st.text(min_size=1, max_size=20), values), max_size=8),
    # proton reads the subject as a C string: it would end at a NUL
    # (and a message's strings are Unicode text: no lone surrogates)
    subject=st.none()
    | st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40),
)
def test_round_trip_through_both_codecs(
    payload: bytes, props: list[tuple[str, object]], subject: str | None
) -> None:
    """Egress by sections, ingress by sections and by proton: one message throughout."""
    sent = Message("q", payload, subject=subject, user_properties=props, to_queue=True)  # type: ignore[arg-type]
    data = sections.encode(Delivery("q", "1-0", sent))
    fast, _, _ = sections.decode(data, PUB)
    slow, _, _ = proton_ingress(data)
    assert fast.payload == slow.payload == payload
    assert fast.subject == slow.subject == (subject or None)
    assert fast.user_properties == slow.user_properties == list(dict(props).items())


SEEDS = [bytes(amqp.encode()) for amqp in INGRESS]


@settings(max_examples=400, deadline=None)
@given(
    seed=st.sampled_from(SEEDS),
    edits=st.lists(
        st.tuples(
            st.integers(0, 1 << 20),
            st.sampled_from(["set", "cut", "insert"]),
            st.binary(min_size=1, max_size=9),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_mutated_messages_are_taken_or_refused_as_bodies(
    seed: bytes, edits: list[tuple[int, str, bytes]]
) -> None:
    """Whatever the bytes, a transfer's message is stored or rejected (BodyError: the
    client's delivery gets amqp:decode-error), and what is taken can be stored: no other
    exception leaves the delivery unsettled (a mutation fuzzer found inf / nan times and
    strings that are not UTF-8 doing that)."""
    data = bytearray(seed)
    for at, how, chunk in edits:
        at %= len(data) + 1
        if how == "set":
            data[at : at + len(chunk)] = chunk
        elif how == "cut":
            del data[at : at + len(chunk)]
        else:
            data[at:at] = chunk
    try:
        msg = mapping.decode(bytes(data), PUB).message
    except mapping.BodyError:
        return
    msg.destination = "q"
    bound_times(msg)
    assert decode(encode(msg)).payload == msg.payload


def test_other_amqp_values_reach_other_protocols_as_json() -> None:
    """An array or described body, and list, map or described application property values,
    reached MQTT subscribers as Python's text of them ("Described(symbol('x:y'), [1, 2])",
    "{'k': 2}"; found by a review): their JSON now."""
    props = {"l": [1, "a"], "m": {"k": 2}, "d": Described(symbol("t"), 3)}
    sent = AmqpMessage(body=Described(symbol("x:y"), [1, 2]), properties=props)
    msg = mapping.decode(bytes(sent.encode()), PUB).message
    assert json.loads(msg.payload) == {"descriptor": "x:y", "value": [1, 2]}
    assert dict(msg.user_properties) == {
        "l": '[1, "a"]',
        "m": '{"k": 2}',
        "d": '{"descriptor": "t", "value": 3}',
    }
    array = AmqpMessage(body=Array(None, Data.INT, 1, 2, 3))
    assert json.loads(mapping.decode(bytes(array.encode()), PUB).message.payload) == [1, 2, 3]


def described(code: int, value: object) -> bytes:
    data = Data()
    data.put_object(Described(ulong(code), value))
    return bytes(data.encode())


@pytest.mark.parametrize("path", ["sections", "proton"])
def test_a_footer_goes_on_with_the_bare_message(path: str) -> None:
    """AMQP 1.0 §3.2.10: a footer carries hashes, HMACs or signatures of the bare message.
    It was cut off at ingress; receivers get it after the bare message, as sent: with no
    `to` filled in (that would change what it signs), the payload still stored once."""
    sent = described(0x73, ["m1"]) + described(0x75, b"signed" * 100)
    sent += described(0x78, {symbol("x-hmac"): b"sig"})
    framing.check_message(sent)
    msg = mapping.decode(sent, PUB).message if path == "sections" else proton_ingress(sent)[0]
    msg.destination, msg.to_queue = "q", True
    sections.address_bare(msg)  # as the inbound link does for a message without `to`
    assert msg.payload_in_bare is not None
    out = sections.encode(Delivery("q", "1-0", decode(encode(msg))))
    framing.check_message(out)
    assert out.endswith(sent)


def test_a_symbolic_properties_section_without_to_gets_it_filled_in() -> None:
    def sym(name: str) -> bytes:
        return bytes((0xA3, len(name))) + name.encode()

    def str8(text: str) -> bytes:
        return bytes((0xA1, len(text))) + text.encode()

    # properties (symbolic descriptor) with only message-id, then a data section
    props_list = bytes((0xC0, 1 + len(str8("m1")), 1)) + str8("m1")
    properties = b"\x00" + sym("amqp:properties:list") + props_list
    body = b"\x00\x53\x75" + bytes((0xA0, 3)) + b"abc"
    data = properties + body
    framing.check_message(data)  # what the gateway accepts from a publisher
    ingress = mapping.decode(data, PUB)
    msg = ingress.message
    msg.destination, msg.to_queue = "q", True
    sections.address_bare(msg)
    out = sections.encode(Delivery("q", "1-0", decode(encode(msg))))
    framing.check_message(out)  # one properties section (§3.2: at most one of each)
    got = AmqpMessage()
    got.decode(out)
    assert (got.id, got.address, bytes(got.body)) == ("m1", "q", b"abc")


@pytest.mark.parametrize("protocol, dropped", [("mqtt", True), ("http", False)])
@pytest.mark.parametrize("encoder", ["sections", "proton"])
def test_jms_named_user_properties_are_left_out_only_when_an_mqtt_publisher_set_them(
    protocol: str, dropped: bool, encoder: str
) -> None:
    """An MQTT 5 publisher's JMSXGroupId / JMSPriority travel as group-id and priority;
    another publisher's properties of those names are its own."""
    msg = Message(
        "orders",
        b"x",
        to_queue=True,
        partition_key="g1",
        user_properties=[("JMSXGroupId", "g1"), ("JMSPriority", "4"), ("other", "y")],
        publisher=Publisher(protocol),
    )
    delivery = Delivery("orders", "1-0", msg)
    if encoder == "sections":
        amqp = AmqpMessage()
        amqp.decode(sections.encode(delivery))
    else:
        amqp = mapping.from_delivery(delivery)
    kept = {"other": "y"} if dropped else {"JMSXGroupId": "g1", "JMSPriority": "4", "other": "y"}
    assert amqp.properties == kept
