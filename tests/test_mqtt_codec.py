"""Tests for protocols.mqtt.codec: round trips, independent encoders/decoders, negatives, fuzz.

Oracles: paho-mqtt (a real client talking to a tiny in-test broker built on this codec,
v3.1 / v3.1.1 / v5) and, if installed, the Rust-backed ``mqtt5`` package (MQTT 5 only).
"""

from __future__ import annotations

import socket
import struct
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.mqtt.codec import (
    Auth,
    Connack,
    ConnackReturnCode,
    Connect,
    Disconnect,
    MqttDecoder,
    MqttProtocolError,
    Pingreq,
    Pingresp,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    ReasonCode,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
    encode,
    encode_puback,
    encode_publish,
    v3_connack_return_code,
)

try:
    import mqtt5
except ImportError:  # pragma: no cover - depends on the environment
    mqtt5 = None
try:
    import paho.mqtt.client as paho
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties as PahoProperties
    from paho.mqtt.subscribeoptions import SubscribeOptions
except ImportError:  # pragma: no cover - depends on the environment
    paho = None

LEVELS = (3, 4, 5)
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- strategies

_text_chars = st.characters(codec="utf-8", exclude_characters="\x00")
text = st.text(_text_chars, max_size=10)
topic_names = st.text(
    st.characters(codec="utf-8", exclude_characters="\x00+#"), min_size=1, max_size=12
)
_level_chars = st.characters(codec="utf-8", exclude_characters="\x00+#/")
# Syntactically valid filters (the mqtt5 oracle insists); the decoder itself leaves filter
# syntax to the session, see test_topic_filter_syntax_not_checked.
topic_filters = st.builds(
    lambda levels, hash_: "/".join(levels + (["#"] if hash_ else [])) or "#",
    st.lists(st.text(_level_chars, max_size=4) | st.just("+"), max_size=4),
    st.booleans(),
)
binary = st.binary(max_size=16)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
flag01 = st.integers(0, 1)
packet_ids = st.integers(1, 0xFFFF)
sub_ids = st.integers(1, 268_435_455)

# Written from the spec (MQTT 5 §2.2.2.2, table 2-4), independently of the codec's tables.
PROP_VALUES = {
    "payload_format_indicator": flag01,
    "message_expiry_interval": u32,
    "content_type": text,
    "response_topic": topic_names,
    "correlation_data": binary,
    "subscription_identifiers": None,  # list, drawn specially
    "session_expiry_interval": u32,
    "assigned_client_identifier": text,
    "server_keep_alive": u16,
    "authentication_method": text,
    "authentication_data": binary,
    "request_problem_information": flag01,
    "will_delay_interval": u32,
    "request_response_information": flag01,
    "response_information": text,
    "server_reference": text,
    "reason_string": text,
    "receive_maximum": st.integers(1, 0xFFFF),
    "topic_alias_maximum": u16,
    "topic_alias": st.integers(1, 0xFFFF),
    "maximum_qos": flag01,
    "retain_available": flag01,
    "user_properties": st.lists(st.tuples(text, text), min_size=1, max_size=4),
    "maximum_packet_size": st.integers(1, 0xFFFFFFFF),
    "wildcard_subscription_available": flag01,
    "subscription_identifier_available": flag01,
    "shared_subscription_available": flag01,
}
ALLOWED = {
    "publish": [
        "payload_format_indicator",
        "message_expiry_interval",
        "content_type",
        "response_topic",
        "correlation_data",
        "subscription_identifiers",
        "topic_alias",
        "user_properties",
    ],
    "will": [
        "payload_format_indicator",
        "message_expiry_interval",
        "content_type",
        "response_topic",
        "correlation_data",
        "will_delay_interval",
        "user_properties",
    ],
    "connect": [
        "session_expiry_interval",
        "authentication_method",
        "authentication_data",
        "request_problem_information",
        "request_response_information",
        "receive_maximum",
        "topic_alias_maximum",
        "user_properties",
        "maximum_packet_size",
    ],
    "connack": [
        "session_expiry_interval",
        "assigned_client_identifier",
        "server_keep_alive",
        "authentication_method",
        "authentication_data",
        "response_information",
        "server_reference",
        "reason_string",
        "receive_maximum",
        "topic_alias_maximum",
        "maximum_qos",
        "retain_available",
        "user_properties",
        "maximum_packet_size",
        "wildcard_subscription_available",
        "subscription_identifier_available",
        "shared_subscription_available",
    ],
    "ack": ["reason_string", "user_properties"],
    "subscribe": ["subscription_identifiers", "user_properties"],
    "unsubscribe": ["user_properties"],
    "disconnect": [
        "session_expiry_interval",
        "server_reference",
        "reason_string",
        "user_properties",
    ],
    "auth": ["authentication_method", "authentication_data", "reason_string", "user_properties"],
}
RC = {
    "connack": [
        0x00,
        0x80,
        0x81,
        0x82,
        0x83,
        0x84,
        0x85,
        0x86,
        0x87,
        0x88,
        0x89,
        0x8A,
        0x8C,
        0x90,
        0x95,
        0x97,
        0x99,
        0x9A,
        0x9B,
        0x9C,
        0x9D,
        0x9F,
    ],
    "puback": [0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99],
    "pubrel": [0x00, 0x92],
    "suback": [0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2],
    "unsuback": [0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91],
    "disconnect": [
        0x00,
        0x04,
        0x80,
        0x81,
        0x82,
        0x83,
        0x87,
        0x89,
        0x8B,
        0x8D,
        0x8E,
        0x8F,
        0x90,
        0x93,
        0x94,
        0x95,
        0x96,
        0x97,
        0x98,
        0x99,
        0x9A,
        0x9B,
        0x9C,
        0x9D,
        0x9E,
        0x9F,
        0xA0,
        0xA1,
        0xA2,
    ],
    "auth": [0x00, 0x18, 0x19],
}


@st.composite
def nonempty_properties(draw, ctx: str, force: tuple[str, ...] = ()) -> Properties:
    names = draw(st.sets(st.sampled_from(ALLOWED[ctx]), min_size=0 if force else 1))
    names |= set(force)
    kw = {}
    for name in names:
        if name == "subscription_identifiers":
            kw[name] = draw(st.lists(sub_ids, min_size=1, max_size=3 if ctx == "publish" else 1))
        else:
            kw[name] = draw(PROP_VALUES[name])
    if "authentication_data" in kw and "authentication_method" not in kw:
        kw["authentication_method"] = draw(text)
    return Properties(**kw)


def props(ctx: str, level: int):
    if level != 5:
        return st.none()
    return st.none() | nonempty_properties(ctx)


@st.composite
def connects(draw, level: int) -> Connect:
    clean_start = draw(st.booleans())
    if level == 5 or (level == 4 and clean_start):
        client_id = draw(st.text(_text_chars, max_size=23))
    else:
        client_id = draw(st.text(_text_chars, min_size=1, max_size=23))
    username = draw(st.none() | text)
    # before v5 a password needs a user name
    password = None if username is None and level != 5 else draw(st.none() | binary)
    will = None
    if draw(st.booleans()):
        will = Will(
            draw(topic_names),
            draw(binary),
            draw(st.integers(0, 2)),
            draw(st.booleans()),
            draw(props("will", level)),
        )
    return Connect(
        level,
        clean_start,
        draw(u16),
        client_id,
        username,
        password,
        will,
        draw(props("connect", level)),
    )


@st.composite
def connacks(draw, level: int) -> Connack:
    rc = draw(st.sampled_from(RC["connack"] if level == 5 else range(6)))
    session_present = False if rc or level == 3 else draw(st.booleans())
    return Connack(session_present, rc, draw(props("connack", level)))


@st.composite
def publishes(draw, level: int) -> Publish:
    qos = draw(st.integers(0, 2))
    dup = draw(st.booleans()) if qos or level == 3 else False
    packet_id = draw(packet_ids) if qos else None
    if level == 5 and draw(st.integers(0, 4)) == 0:
        # Empty topic: only legal in v5 together with a topic alias.
        topic = ""
        properties = draw(nonempty_properties("publish", force=("topic_alias",)))
    else:
        topic = draw(topic_names)
        properties = draw(props("publish", level))
    payload = draw(st.binary(max_size=300) if draw(st.integers(0, 9)) == 0 else binary)
    return Publish(topic, payload, qos, draw(st.booleans()), dup, packet_id, properties)


def pub_acks(cls, level: int):
    if level != 5:
        return st.builds(cls, packet_ids)
    codes = RC["puback"] if cls in (Puback, Pubrec) else RC["pubrel"]
    return st.builds(cls, packet_ids, st.sampled_from(codes), props("ack", level))


@st.composite
def subscribes(draw, level: int) -> Subscribe:
    subs = []
    for topic_filter in draw(st.lists(topic_filters, min_size=1, max_size=4)):
        qos = draw(st.integers(0, 2))
        if level == 5:
            no_local = draw(st.booleans()) and not topic_filter.startswith("$share/")
            opts = SubscriptionOptions(qos, no_local, draw(st.booleans()), draw(st.integers(0, 2)))
        else:
            opts = SubscriptionOptions(qos)
        subs.append((topic_filter, opts))
    return Subscribe(draw(packet_ids), subs, draw(props("subscribe", level)))


def subacks(level: int):
    codes = RC["suback"] if level == 5 else [0, 1, 2, 0x80]
    return st.builds(
        Suback,
        packet_ids,
        st.lists(st.sampled_from(codes), min_size=1, max_size=5),
        props("ack", level),
    )


def unsubscribes(level: int):
    return st.builds(
        Unsubscribe,
        packet_ids,
        st.lists(topic_filters, min_size=1, max_size=4),
        props("unsubscribe", level),
    )


def unsubacks(level: int):
    if level != 5:
        return st.builds(Unsuback, packet_ids)
    return st.builds(
        Unsuback,
        packet_ids,
        st.lists(st.sampled_from(RC["unsuback"]), min_size=1, max_size=5),
        props("ack", 5),
    )


def disconnects(level: int):
    if level != 5:
        return st.just(Disconnect())
    return st.builds(Disconnect, st.sampled_from(RC["disconnect"]), props("disconnect", 5))


def auths():
    return st.builds(Auth, st.sampled_from(RC["auth"]), props("auth", 5))


def packet_strategies(level: int) -> dict[str, st.SearchStrategy]:
    strategies = {
        "connect": connects(level),
        "connack": connacks(level),
        "publish": publishes(level),
        "puback": pub_acks(Puback, level),
        "pubrec": pub_acks(Pubrec, level),
        "pubrel": pub_acks(Pubrel, level),
        "pubcomp": pub_acks(Pubcomp, level),
        "subscribe": subscribes(level),
        "suback": subacks(level),
        "unsubscribe": unsubscribes(level),
        "unsuback": unsubacks(level),
        "pingreq": st.just(Pingreq()),
        "pingresp": st.just(Pingresp()),
        "disconnect": disconnects(level),
    }
    if level == 5:
        strategies["auth"] = auths()
    return strategies


def any_packet(level: int) -> st.SearchStrategy:
    return st.one_of(*packet_strategies(level).values())


def level_and(strategy_name: str):
    """(level, packet) for every level the packet type exists in."""
    levels = (5,) if strategy_name == "auth" else LEVELS
    return st.sampled_from(levels).flatmap(
        lambda lvl: st.tuples(st.just(lvl), packet_strategies(lvl)[strategy_name])
    )


PACKET_NAMES = list(packet_strategies(5))

# --------------------------------------------------------------------------- helpers


def decode_all(data: bytes, level: int | None, **kw) -> list:
    return MqttDecoder(protocol_level=level, **kw).feed(data)


def decode_one(data: bytes, level: int | None):
    packets = decode_all(data, level)
    assert len(packets) == 1, packets
    return packets[0]


def feed_in_chunks(decoder: MqttDecoder, data: bytes, cuts: list[int]) -> list:
    out = []
    prev = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        out += decoder.feed(data[prev:cut])
        prev = cut
    return out


def expect_error(data: bytes, level: int | None, code: int, **kw) -> MqttProtocolError:
    with pytest.raises(MqttProtocolError) as info:
        decode_all(data, level, **kw)
    assert info.value.reason_code == code, str(info.value)
    return info.value


def vbi(n: int) -> bytes:
    """Independent Variable Byte Integer encoder for hand-made negative cases."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def frame(b0: int, body: bytes) -> bytes:
    """Independent fixed-header builder for hand-made negative cases."""
    return bytes((b0,)) + vbi(len(body)) + body


def s(text_: str | bytes) -> bytes:
    raw = text_.encode() if isinstance(text_, str) else text_
    return struct.pack("!H", len(raw)) + raw


def connect_raw(
    level: int = 4, flags: int = 0x02, payload: bytes = s("cid"), props: bytes = b"\x00"
) -> bytes:
    name = b"MQIsdp" if level == 3 else b"MQTT"
    body = s(name) + bytes((level, flags)) + b"\x00\x3c"
    if level == 5:
        body += props
    return frame(0x10, body + payload)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", PACKET_NAMES)
@SETTINGS
@given(data=st.data())
def test_round_trip(name, data):
    level, packet = data.draw(level_and(name))
    raw = encode(packet, level)
    # CONNECT goes to a fresh decoder (it fixes the level); everything else to a preset one.
    preset = None if name == "connect" else level
    assert decode_one(raw, preset) == packet
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=6))
    decoder = MqttDecoder(protocol_level=preset)
    assert feed_in_chunks(decoder, raw, cuts) == [packet]
    assert decoder.buffered == 0


@pytest.mark.parametrize("level", LEVELS)
@SETTINGS
@given(data=st.data())
def test_stream_round_trip_chunked(level, data):
    """A CONNECT followed by arbitrary packets, fed in random chunks, decodes in order."""
    packets = [data.draw(connects(level))]
    packets += data.draw(st.lists(any_packet(level), max_size=8))
    raw = b"".join(encode(p, level) for p in packets)
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=12))
    decoder = MqttDecoder()
    assert feed_in_chunks(decoder, raw, cuts) == packets
    assert decoder.protocol_level == level


@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_stream_byte_by_byte(level, data):
    packets = [data.draw(connects(level))]
    packets += data.draw(st.lists(any_packet(level), max_size=4))
    raw = b"".join(encode(p, level) for p in packets)
    decoder = MqttDecoder()
    out = []
    for i in range(len(raw)):
        out += decoder.feed(raw[i : i + 1])
    assert out == packets


@pytest.mark.parametrize("level", LEVELS)
def test_large_publish_in_small_chunks(level):
    payload = bytes(range(256)) * 2000  # 512 KB: 4-byte... 3-byte remaining length
    raw = encode(Publish("big/one", payload, 1, packet_id=9), level)
    decoder = MqttDecoder(protocol_level=level)
    out = []
    for i in range(0, len(raw), 4096):
        out += decoder.feed(raw[i : i + 4096])
        if i + 4096 < len(raw):
            assert decoder.buffered == i + 4096
    assert out == [Publish("big/one", payload, 1, packet_id=9)]
    assert isinstance(out[0].payload, bytes)


def test_feed_accepts_bytearray_and_memoryview():
    raw = encode(Publish("a", b"x"), 4)
    assert decode_all(bytearray(raw), 4) == [Publish("a", b"x")]
    assert MqttDecoder(protocol_level=4).feed(memoryview(raw)) == [Publish("a", b"x")]


@pytest.mark.parametrize("level", LEVELS)
@SETTINGS
@given(data=st.data())
def test_encode_publish_matches_encode(level, data):
    p = data.draw(publishes(level))
    raw = encode(p, level)
    assert (
        encode_publish(p.topic, p.payload, p.qos, p.retain, p.dup, p.packet_id, p.properties, level)
        == raw
    )
    assert (
        encode_publish(
            p.topic.encode(), p.payload, p.qos, p.retain, p.dup, p.packet_id, p.properties, level
        )
        == raw
    )


# --------------------------------------------------------------------------- wire shapes


def test_publish_wire_bytes():
    assert encode(Publish("a/b", b"hi"), 4) == b"\x30\x07\x00\x03a/bhi"
    assert encode(Publish("a/b", b"hi", 1, True, True, 10), 3) == b"\x3b\x09\x00\x03a/b\x00\x0ahi"
    assert encode(Publish("a/b", b"hi"), 5) == b"\x30\x08\x00\x03a/b\x00hi"
    # properties are dropped below v5
    assert encode(Publish("a/b", b"hi", properties=Properties(topic_alias=1)), 4) == (
        b"\x30\x07\x00\x03a/bhi"
    )
    big = encode(Publish("t", b"x" * 200), 4)
    assert big[:3] == b"\x30\xcb\x01"  # 203 = 0x4B | 0x80, 0x01


def test_ack_short_forms():
    assert encode(Puback(1), 5) == b"\x40\x02\x00\x01"
    assert encode(Puback(1, 0, Properties()), 5) == b"\x40\x02\x00\x01"
    assert encode(Puback(1, 0x10), 5) == b"\x40\x03\x00\x01\x10"
    assert encode(Puback(1, 0x10), 4) == b"\x40\x02\x00\x01"
    assert encode(Pubrel(7), 4) == b"\x62\x02\x00\x07"
    assert encode(Pubrel(7, 0x92), 5) == b"\x62\x03\x00\x07\x92"
    assert encode(Pubcomp(7, 0, Properties(reason_string="x")), 5) == (
        b"\x70\x08\x00\x07\x00\x04\x1f\x00\x01x"
    )
    assert encode(Disconnect(), 5) == b"\xe0\x00"
    assert encode(Disconnect(0x8B), 5) == b"\xe0\x01\x8b"
    assert encode(Disconnect(0x8B), 4) == b"\xe0\x00"
    assert encode(Auth(), 5) == b"\xf0\x00"
    assert encode(Pingresp(), 3) == b"\xd0\x00"


def test_connack_v3_v4_shapes():
    assert encode(Connack(True, 0), 4) == b"\x20\x02\x01\x00"
    assert encode(Connack(True, 0), 3) == b"\x20\x02\x00\x00"  # 3.1 has no session present
    assert encode(Connack(False, ConnackReturnCode.NOT_AUTHORIZED), 4) == b"\x20\x02\x00\x05"
    # v5 reason codes are mapped to the nearest v3 return code
    assert encode(Connack(False, ReasonCode.UNSUPPORTED_PROTOCOL_VERSION), 4)[-1] == 1
    assert encode(Connack(False, ReasonCode.CLIENT_IDENTIFIER_NOT_VALID), 3)[-1] == 2
    assert encode(Connack(False, ReasonCode.BAD_USER_NAME_OR_PASSWORD), 4)[-1] == 4
    assert encode(Connack(False, ReasonCode.SERVER_BUSY), 4)[-1] == 3
    assert v3_connack_return_code(0x87) == 5
    assert encode(Connack(False, 0x86, Properties(reason_string="no")), 5) == (
        b"\x20\x08\x00\x86\x05\x1f\x00\x02no"
    )


def test_suback_unsuback_v3_v4_shapes():
    assert encode(Suback(3, [0, 1, 2, 0x80]), 3) == b"\x90\x06\x00\x03\x00\x01\x02\x80"
    assert encode(Suback(3, [1, 0x87, 0xA2]), 4) == b"\x90\x05\x00\x03\x01\x80\x80"
    assert encode(Unsuback(3, [0x11]), 4) == b"\xb0\x02\x00\x03"
    assert encode(Unsuback(3, [0x11]), 5) == b"\xb0\x04\x00\x03\x00\x11"


def test_subscribe_options_v3_drops_v5_bits():
    opts = SubscriptionOptions(1, True, True, 2)
    raw = encode(Subscribe(5, [("a/#", opts)]), 4)
    assert raw == b"\x82\x08\x00\x05\x00\x03a/#\x01"
    raw5 = encode(Subscribe(5, [("a/#", opts)]), 5)
    assert raw5 == b"\x82\x09\x00\x05\x00\x00\x03a/#\x2d"


def test_user_properties_keep_order_and_repeats():
    pairs = [("k", "2"), ("a", "1"), ("k", "1"), ("k", "2")]
    props = Properties(user_properties=pairs, subscription_identifiers=[3, 1, 3])
    p = Publish("t", b"", properties=props)
    assert decode_one(encode(p, 5), 5).properties.user_properties == pairs
    assert decode_one(encode(p, 5), 5).properties.subscription_identifiers == [3, 1, 3]


def test_encode_rejects_invalid_packets():
    with pytest.raises(ValueError):
        encode(Auth(), 4)
    with pytest.raises(ValueError):
        encode(Publish("t", b"", properties=Properties(session_expiry_interval=1)), 5)
    with pytest.raises(ValueError):
        encode(Publish("t", b"", 1), 4)  # QoS 1 needs a packet id
    with pytest.raises(ValueError):
        encode(Publish("t", b"", 3, packet_id=1), 4)
    with pytest.raises(ValueError):
        encode(Publish("t", b"", 0, dup=True), 4)
    assert encode(Publish("t", b"", 0, dup=True), 3) == b"\x38\x03\x00\x01t"
    with pytest.raises(ValueError):
        encode(Puback(0), 4)
    with pytest.raises(ValueError):
        encode(Puback(1, 0x92), 5)
    with pytest.raises(ValueError):
        encode(Subscribe(1, []), 4)
    with pytest.raises(ValueError):
        encode(
            Subscribe(
                1, [("a", SubscriptionOptions(0))], Properties(subscription_identifiers=[1, 2])
            ),
            5,
        )
    with pytest.raises(ValueError):
        encode(Connect(4, client_id="x", password=b"p"), 4)
    with pytest.raises(ValueError):
        encode(Connect(4, client_id="x"), 5)
    with pytest.raises(ValueError):
        encode(Connack(), 6)
    with pytest.raises(ValueError):
        encode(Unsubscribe(1, ["a\x00"]), 4)
    with pytest.raises(TypeError):
        encode(object(), 4)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- negatives

PUB_V4 = frame(0x30, s("a/b") + b"x")


def test_first_packet_must_be_connect():
    expect_error(PUB_V4, None, 0x82)
    expect_error(b"\xc0\x00", None, 0x82)
    expect_error(b"GET / HTTP/1.1\r\n\r\n", None, 0x82)


@pytest.mark.parametrize(
    ("name", "level"),
    [(b"MQTT", 3), (b"MQIsdp", 4), (b"MQIsdp", 5), (b"MQTT", 6), (b"MQTT", 0x84), (b"HTTP", 4)],
)
def test_unsupported_protocol_version(name, level):
    raw = frame(0x10, s(name) + bytes((level, 2)) + b"\x00\x3c" + s("cid"))
    decoder = MqttDecoder()
    with pytest.raises(MqttProtocolError) as info:
        decoder.feed(raw)
    assert info.value.reason_code == ReasonCode.UNSUPPORTED_PROTOCOL_VERSION
    assert v3_connack_return_code(info.value.reason_code) == 1
    assert decoder.protocol_level is None


@pytest.mark.parametrize("level", LEVELS)
def test_connect_valid_minimal(level):
    p = decode_one(connect_raw(level), None)
    assert p == Connect(level, True, 60, "cid")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    ("flags", "code"),
    [
        (0x03, 0x81),  # reserved bit
        (0x0A, 0x81),  # will QoS without will flag
        (0x22, 0x81),  # will retain without will flag
        (0x12, 0x81),  # will QoS 2 without will flag
        (0x1E, 0x81),  # will flag + QoS 3
    ],
)
def test_connect_flag_errors(level, flags, code):
    payload = s("cid") + (b"\x00" if level == 5 else b"") + s("w") + s(b"")
    decoder = MqttDecoder()
    with pytest.raises(MqttProtocolError) as info:
        decoder.feed(connect_raw(level, flags, payload))
    assert info.value.reason_code == code
    assert decoder.protocol_level == level  # known, so a CONNACK of the right version fits


@pytest.mark.parametrize("level", LEVELS)
def test_password_without_username(level):
    raw = connect_raw(level, 0x42, s("cid") + s(b"pw"))
    if level == 5:
        assert decode_one(raw, None).password == b"pw"
    else:
        expect_error(raw, None, 0x81)


def test_connect_client_identifier_rules():
    expect_error(connect_raw(3, 0x02, s("")), None, 0x85)
    expect_error(connect_raw(4, 0x00, s("")), None, 0x85)
    assert decode_one(connect_raw(4, 0x02, s("")), None).client_id == ""
    assert decode_one(connect_raw(5, 0x00, s("")), None).client_id == ""
    # 3.1's 23 character limit is not enforced (brokers commonly accept longer ids)
    assert decode_one(connect_raw(3, 0x02, s("x" * 40)), None).client_id == "x" * 40


def test_connect_v3_missing_user_fields_tolerated():
    p = decode_one(connect_raw(3, 0xC2, s("cid")), None)
    assert (p.username, p.password) == (None, None)
    p = decode_one(connect_raw(3, 0xC2, s("cid") + s("u")), None)
    assert (p.username, p.password) == ("u", None)
    expect_error(connect_raw(4, 0xC2, s("cid")), None, 0x81)


def test_connect_trailing_bytes_and_truncation():
    expect_error(connect_raw(4, 0x02, s("cid") + b"x"), None, 0x81)
    expect_error(frame(0x10, s("MQTT") + b"\x04\x02\x00"), None, 0x81)
    expect_error(frame(0x10, b"\x00"), None, 0x81)
    expect_error(b"\x11\x00", None, 0x81)  # CONNECT flags


def test_connect_will_topic_validation():
    expect_error(connect_raw(4, 0x06, s("cid") + s("a/#") + s(b"")), None, 0x90)
    expect_error(connect_raw(4, 0x06, s("cid") + s("") + s(b"")), None, 0x90)


def test_second_connect_is_just_decoded():
    first = connect_raw(4)
    packets = decode_all(first + connect_raw(5), None)
    assert [p.protocol_level for p in packets] == [4, 5]


@pytest.mark.parametrize(
    ("level", "raw"),
    [
        (4, b"\x60\x02\x00\x01"),  # PUBREL must be 0b0010
        (4, b"\x68\x02\x00\x01"),
        (5, b"\x63\x02\x00\x01"),
        (4, frame(0x80, b"\x00\x01" + s("a") + b"\x00")),  # SUBSCRIBE
        (5, frame(0x80, b"\x00\x01\x00" + s("a") + b"\x00")),
        (4, frame(0xA0, b"\x00\x01" + s("a"))),  # UNSUBSCRIBE
        (4, b"\x41\x02\x00\x01"),  # PUBACK
        (4, b"\x52\x02\x00\x01"),  # PUBREC
        (4, b"\x72\x02\x00\x01"),  # PUBCOMP
        (4, b"\xc1\x00"),  # PINGREQ
        (4, b"\xd8\x00"),  # PINGRESP
        (4, b"\xe2\x00"),  # DISCONNECT
        (5, b"\xf1\x00"),  # AUTH
        (4, b"\x21\x02\x00\x00"),  # CONNACK
        (4, b"\x00\x00"),  # reserved type 0
        (4, b"\xf0\x00"),  # AUTH does not exist before v5
        (3, b"\xf0\x00"),
    ],
)
def test_fixed_header_flags(level, raw):
    expect_error(raw, level, 0x81)


def test_mqtt31_allows_qos1_dup_on_pubrel_subscribe_unsubscribe():
    assert decode_one(b"\x6a\x02\x00\x01", 3) == Pubrel(1)
    assert decode_one(b"\x62\x02\x00\x01", 3) == Pubrel(1)
    assert decode_one(frame(0x8A, b"\x00\x01" + s("a") + b"\x01"), 3) == Subscribe(
        1, [("a", SubscriptionOptions(1))]
    )
    expect_error(b"\x6a\x02\x00\x01", 4, 0x81)


@pytest.mark.parametrize("level", LEVELS)
def test_publish_qos3(level):
    expect_error(frame(0x36, s("a") + b"\x00\x01" + (b"\x00" if level == 5 else b"")), level, 0x81)


@pytest.mark.parametrize("level", LEVELS)
def test_publish_dup_with_qos0(level):
    raw = frame(0x38, s("a") + (b"\x00" if level == 5 else b"") + b"x")
    if level == 3:
        assert decode_one(raw, 3) == Publish("a", b"x", dup=True)
    else:
        expect_error(raw, level, 0x81)


@pytest.mark.parametrize("level", LEVELS)
def test_publish_topic_rules(level):
    tail = b"\x00" if level == 5 else b""
    expect_error(frame(0x30, s("a/+") + tail), level, 0x90)
    expect_error(frame(0x30, s("#") + tail), level, 0x90)
    expect_error(frame(0x30, s("a\x00b") + tail), level, 0x81)
    if level == 5:
        expect_error(frame(0x30, s("") + b"\x00"), 5, 0x82)  # empty topic needs an alias
        p = decode_one(frame(0x30, s("") + b"\x03\x23\x00\x01"), 5)
        assert p.topic == "" and p.properties.topic_alias == 1
        # topic alias 0 / above the maximum is the session's job (0x94)
        assert decode_one(frame(0x30, s("a") + b"\x03\x23\x00\x00"), 5).properties.topic_alias == 0
    else:
        expect_error(frame(0x30, s("") + b"x"), level, 0x90)


@pytest.mark.parametrize(
    "bad",
    [
        b"\xc3\x28",  # invalid continuation
        b"\xed\xa0\x80",  # UTF-16 surrogate U+D800
        b"\xc0\xaf",  # overlong '/'
        b"\xf4\x90\x80\x80",  # > U+10FFFF
        b"\xe2\x82",  # truncated sequence
        b"\xff",
    ],
)
def test_invalid_utf8_is_malformed(bad):
    expect_error(frame(0x30, s(bad) + b"x"), 4, 0x81)
    expect_error(frame(0x82, b"\x00\x01" + s(bad) + b"\x00"), 4, 0x81)
    expect_error(connect_raw(4, 0x82, s("cid") + s(bad)), None, 0x81)


def test_control_and_noncharacters_allowed():
    for topic in ("a\x01b", "\x1f", "x\x7f", "\x85\x9f", "\ufeff", "\uffff", "\U0010ffff"):
        assert decode_one(encode(Publish(topic, b""), 4), 4).topic == topic


@pytest.mark.parametrize("level", LEVELS)
def test_packet_id_zero(level):
    p5 = b"\x00" if level == 5 else b""
    expect_error(frame(0x32, s("a") + b"\x00\x00" + p5), level, 0x82)
    expect_error(b"\x40\x02\x00\x00", level, 0x82)
    expect_error(b"\x62\x02\x00\x00", level, 0x82)
    expect_error(frame(0x82, b"\x00\x00" + p5 + s("a") + b"\x00"), level, 0x82)
    expect_error(frame(0xA2, b"\x00\x00" + p5 + s("a")), level, 0x82)
    expect_error(frame(0x90, b"\x00\x00" + p5 + b"\x00"), level, 0x82)


@pytest.mark.parametrize("level", LEVELS)
def test_subscribe_unsubscribe_without_filters(level):
    p5 = b"\x00" if level == 5 else b""
    expect_error(frame(0x82, b"\x00\x01" + p5), level, 0x82)
    expect_error(frame(0xA2, b"\x00\x01" + p5), level, 0x82)
    expect_error(frame(0x82, b"\x00\x01" + p5 + s("a")), level, 0x81)  # options missing


@pytest.mark.parametrize(
    ("level", "opt", "code"),
    [
        (4, 0x03, 0x81),  # QoS 3
        (4, 0x04, 0x81),  # reserved bits in v3.1.1
        (3, 0x80, 0x81),
        (5, 0x03, 0x81),
        (5, 0x40, 0x81),  # reserved bits in v5
        (5, 0x80, 0x81),
        (5, 0x30, 0x82),  # retain handling 3
    ],
)
def test_subscription_options_errors(level, opt, code):
    p5 = b"\x00" if level == 5 else b""
    expect_error(frame(0x82, b"\x00\x01" + p5 + s("a/b") + bytes((opt,))), level, code)


def test_subscription_options_v5_decode_and_shared_no_local():
    p = decode_one(frame(0x82, b"\x00\x01\x00" + s("a") + b"\x2e"), 5)
    assert p.subscriptions == [("a", SubscriptionOptions(2, True, True, 2))]
    expect_error(frame(0x82, b"\x00\x01\x00" + s("$share/g/a") + b"\x04"), 5, 0x82)


def test_remaining_length_limits():
    expect_error(b"\x30\xff\xff\xff\xff\x01", 4, 0x81)
    expect_error(b"\x30\xff\xff\xff\x80", 4, 0x81)  # 5th byte announced: reject early
    # non-minimal encodings are accepted (minimality binds encoders only)
    assert decode_one(b"\xc0\x80\x00", 4) == Pingreq()
    # a 4-byte length is fine while under the size limit: the decoder just waits
    d = MqttDecoder(protocol_level=4)
    assert d.feed(b"\x30\xff\xff\xff\x7e\x00\x01a") == []
    assert d.buffered == 8
    # the default limit (268435455) covers the whole packet, fixed header included
    expect_error(b"\x30\xff\xff\xff\x7f", 4, 0x95)


def test_packet_too_large_detected_from_fixed_header():
    d = MqttDecoder(max_packet_size=100, protocol_level=4)
    with pytest.raises(MqttProtocolError) as info:
        d.feed(b"\x30\x80\x01")  # announces 128 bytes; nothing of the body is needed
    assert info.value.reason_code == ReasonCode.PACKET_TOO_LARGE
    ok = encode(Publish("t", b"x" * 95), 4)  # exactly 100 bytes with its header
    assert len(ok) == 100
    assert len(decode_all(ok, 4, max_packet_size=100)) == 1
    big = encode(Publish("t", b"x" * 96), 4)
    expect_error(big[:2], 4, 0x95, max_packet_size=100)
    expect_error(connect_raw(4, 0x02, s("c" * 200)), None, 0x95, max_packet_size=100)


@pytest.mark.parametrize(
    ("level", "raw"),
    [
        (4, b"\x40\x03\x00\x01\x00"),  # PUBACK with a reason code in v3.1.1
        (4, b"\xc0\x01\x00"),  # PINGREQ with a body
        (4, b"\xd0\x01\x00"),
        (4, b"\xe0\x01\x00"),  # DISCONNECT with a body before v5
        (4, b"\xb0\x03\x00\x01\x00"),
        (4, b"\x20\x03\x00\x00\x00"),
        (5, b"\x40\x05\x00\x01\x00\x00\x00"),  # trailing byte after properties
        (5, b"\xe0\x03\x00\x00\x00"),
        (4, b"\x30\x01\x00"),  # truncated topic length
        (4, b"\x30\x03\x00\x05a"),  # topic longer than the packet
        (4, b"\x32\x04\x00\x01a\x00"),  # truncated packet id
        (5, b"\x30\x03\x00\x01a"),  # properties missing
        (4, b"\x40\x01\x00"),
        (4, b"\x20\x02\x02\x00"),  # CONNACK reserved flag
    ],
)
def test_malformed_lengths_and_values(level, raw):
    expect_error(raw, level, 0x81)


def test_v3_return_code_errors():
    expect_error(b"\x20\x02\x00\x06", 4, 0x82)  # CONNACK return code out of range
    expect_error(b"\x20\x02\x01\x05", 4, 0x82)  # session present with a failure
    expect_error(b"\x90\x03\x00\x01\x03", 4, 0x82)  # SUBACK v3.1.1 code 3
    expect_error(b"\x90\x03\x00\x01\x87", 3, 0x82)  # v5-only code


def test_topic_filter_syntax_not_checked():
    # Filter syntax errors are a per-filter SUBACK code (0x8F) in v5: the session decides.
    raw = frame(0x82, b"\x00\x01" + s("a#b") + b"\x00" + s("") + b"\x01")
    assert decode_one(raw, 4).subscriptions == [
        ("a#b", SubscriptionOptions(0)),
        ("", SubscriptionOptions(1)),
    ]


def _pub5(props: bytes) -> bytes:
    return frame(0x30, s("t") + bytes((len(props),)) + props + b"payload")


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        # not allowed in PUBLISH (allowed elsewhere) / unknown ids -> malformed (§2.2.2.2)
        (_pub5(b"\x11\x00\x00\x00\x01"), 0x81),
        (_pub5(b"\x21\x00\x01"), 0x81),
        (_pub5(b"\x7f\x00"), 0x81),
        (_pub5(b"\x00"), 0x81),
        # duplicates of non-repeatable properties -> protocol error
        (_pub5(b"\x02\x00\x00\x00\x01\x02\x00\x00\x00\x02"), 0x82),
        (_pub5(b"\x03\x00\x01a\x03\x00\x01b"), 0x82),
        (_pub5(b"\x01\x00\x01\x00"), 0x82),
        # value errors
        (_pub5(b"\x01\x02"), 0x82),  # payload format indicator 2
        (_pub5(b"\x0b\x00"), 0x82),  # subscription identifier 0
        # truncated values / property length past the end
        (_pub5(b"\x02\x00\x00"), 0x81),
        (_pub5(b"\x0b\x80\x80\x80\x80\x01"), 0x81),
        (frame(0x30, s("t") + b"\x09\x01\x00"), 0x81),
        (_pub5(b"\x26\x00\x01a"), 0x81),
        (_pub5(b"\x03\x00\x02\xc3\x28"), 0x81),
    ],
)
def test_publish_property_errors(raw, code):
    expect_error(raw, 5, code)


def test_properties_per_packet_rules():
    sub = lambda props: frame(0x82, b"\x00\x01" + bytes((len(props),)) + props + s("a") + b"\x00")  # noqa: E731
    assert decode_one(sub(b"\x0b\x05"), 5).properties.subscription_identifiers == [5]
    expect_error(sub(b"\x0b\x05\x0b\x06"), 5, 0x82)  # only one in SUBSCRIBE
    expect_error(sub(b"\x23\x00\x01"), 5, 0x81)  # topic alias not allowed
    con = lambda props: connect_raw(5, 0x02, props=bytes((len(props),)) + props)  # noqa: E731
    assert decode_one(con(b"\x21\x00\x05"), None).properties.receive_maximum == 5
    expect_error(con(b"\x21\x00\x00"), None, 0x82)  # receive maximum 0
    expect_error(con(b"\x27\x00\x00\x00\x00"), None, 0x82)  # maximum packet size 0
    expect_error(con(b"\x17\x02"), None, 0x82)  # request problem information 2
    expect_error(con(b"\x16\x00\x01x"), None, 0x82)  # authentication data without method
    expect_error(con(b"\x23\x00\x01"), None, 0x81)
    expect_error(con(b"\x18\x00\x00\x00\x01"), None, 0x81)  # will delay outside the will
    will = s("cid") + b"\x05\x18\x00\x00\x00\x0a" + s("w/t") + s(b"bye")
    p = decode_one(connect_raw(5, 0x06, will), None)
    assert p.will == Will("w/t", b"bye", 0, False, Properties(will_delay_interval=10))
    expect_error(connect_raw(5, 0x06, s("cid") + b"\x02\x23\x00" + s("w") + s(b"")), None, 0x81)
    ack = b"\x40\x06\x00\x01\x00\x02\x24\x01"  # maximum QoS in PUBACK
    expect_error(ack, 5, 0x81)
    expect_error(b"\x20\x05\x00\x00\x02\x24\x02", 5, 0x82)  # maximum QoS 2
    assert decode_one(b"\xe0\x07\x00\x05\x11\x00\x00\x00\x01", 5) == Disconnect(
        0, Properties(session_expiry_interval=1)
    )
    expect_error(b"\xe0\x05\x00\x03\x23\x00\x01", 5, 0x81)  # topic alias in DISCONNECT
    expect_error(b"\xe0\x06\x00\x03\x11\x00\x00\x00", 5, 0x81)  # value cut by length


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"\x40\x03\x00\x01\x05", 0x82),  # PUBACK reason code not in its table
        (b"\x62\x03\x00\x01\x10", 0x82),  # PUBREL: 0x10 is a PUBACK code
        (b"\xe0\x01\x05", 0x82),
        (b"\xf0\x01\x01", 0x82),
        (b"\x20\x03\x00\x01\x00", 0x82),  # CONNACK 0x01
        (b"\x20\x03\x01\x80\x00", 0x82),  # session present with an error
        (b"\x90\x04\x00\x01\x00\x03", 0x82),
        (b"\xb0\x03\x00\x01\x00", 0x82),  # v5 UNSUBACK without reason codes
        (b"\x90\x03\x00\x01\x00", 0x82),  # SUBACK without reason codes
    ],
)
def test_v5_reason_code_errors(raw, code):
    expect_error(raw, 5, code)


def test_v5_short_forms_decode():
    assert decode_one(b"\x40\x02\x00\x01", 5) == Puback(1)
    assert decode_one(b"\x50\x03\x00\x01\x10", 5) == Pubrec(1, 0x10)
    assert decode_one(b"\x50\x04\x00\x01\x10\x00", 5) == Pubrec(1, 0x10)
    assert decode_one(b"\xe0\x00", 5) == Disconnect()
    assert decode_one(b"\xe0\x01\x04", 5) == Disconnect(4)
    assert decode_one(b"\xf0\x00", 5) == Auth()
    assert decode_one(b"\xf0\x01\x18", 5) == Auth(0x18)


def test_error_is_sticky_and_keeps_earlier_packets():
    good = encode(Puback(1), 4) + encode(Pingreq(), 4)
    d = MqttDecoder(protocol_level=4)
    with pytest.raises(MqttProtocolError) as info:
        d.feed(good + b"\x60\x02\x00\x01" + good)
    assert info.value.packets == [Puback(1), Pingreq()]
    with pytest.raises(MqttProtocolError) as again:
        d.feed(good)
    assert again.value is info.value
    assert "0x81" in str(info.value)


def test_decoder_rejects_bad_level():
    with pytest.raises(ValueError):
        MqttDecoder(protocol_level=6)


# --------------------------------------------------------------------------- fuzz


@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(max_size=200), cut=st.integers(0, 200))
def test_fuzz_garbage_after_connect(level, garbage, cut):
    decoder = MqttDecoder()
    assert len(decoder.feed(connect_raw(level))) == 1
    try:
        decoder.feed(garbage[:cut])
        decoder.feed(garbage[cut:])
    except MqttProtocolError as exc:
        assert 0x80 <= exc.reason_code <= 0xA2


@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_fuzz_mutated_valid_packets(level, data):
    """Flip bytes of valid packets: reaches deep decoder paths that pure noise does not."""
    packet = data.draw(any_packet(level))
    raw = bytearray(encode(packet, level))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    decoder = MqttDecoder(protocol_level=level)
    try:
        for p in decoder.feed(bytes(raw)):
            # anything the decoder accepts must re-encode
            encode(p, p.protocol_level if isinstance(p, Connect) else level)
    except MqttProtocolError as exc:
        assert 0x80 <= exc.reason_code <= 0xA2


# --------------------------------------------------------------------------- paho-mqtt


class _FakeBroker:
    """One-connection broker built on the codec: records decoded packets and answers."""

    def __init__(self, level: int) -> None:
        self.level = level
        self.received: list = []
        self.error: BaseException | None = None
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.sock.settimeout(10)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _replies(self, p):
        lvl = self.level
        if isinstance(p, Connect):
            props = Properties(receive_maximum=20, user_properties=[("srv", "1")])
            return [Connack(False, 0, props if lvl == 5 else None)]
        if isinstance(p, Subscribe):
            props = Properties(
                content_type="text/plain",
                user_properties=[("src", "codec"), ("src", "2")],
                subscription_identifiers=[7],
            )
            return [
                Suback(p.packet_id, [o.qos for _, o in p.subscriptions]),
                Publish("a/x", b"from-server", 1, False, False, 1, props if lvl == 5 else None),
            ]
        if isinstance(p, Publish):
            if p.qos == 1:
                return [Puback(p.packet_id)]
            if p.qos == 2:
                return [Pubrec(p.packet_id)]
        if isinstance(p, Pubrel):
            return [Pubcomp(p.packet_id)]
        if isinstance(p, Unsubscribe):
            return [Unsuback(p.packet_id, [0x11] * len(p.topic_filters) if lvl == 5 else [])]
        if isinstance(p, Pingreq):
            return [Pingresp()]
        return []

    def _run(self) -> None:
        try:
            conn, _ = self.sock.accept()
            conn.settimeout(10)
            decoder = MqttDecoder()
            with conn:
                while True:
                    data = conn.recv(65536)
                    if not data:
                        return
                    for p in decoder.feed(data):
                        self.received.append(p)
                        for reply in self._replies(p):
                            conn.sendall(encode(reply, self.level))
                        if isinstance(p, Disconnect):
                            return
        except BaseException as exc:  # surfaced by the test
            self.error = exc
        finally:
            self.sock.close()


def _run_paho_session(level: int):
    protocol = {3: paho.MQTTv31, 4: paho.MQTTv311, 5: paho.MQTTv5}[level]
    broker = _FakeBroker(level)
    kwargs = {} if level == 5 else {"clean_session": True}
    client = paho.Client(
        paho.CallbackAPIVersion.VERSION2, client_id=f"paho-{level}", protocol=protocol, **kwargs
    )
    events = {name: threading.Event() for name in ("conn", "sub", "msg", "unsub")}
    seen: dict = {}

    def on_connect(c, userdata, flags, reason_code, properties):
        seen["connack"] = (reason_code, properties)
        events["conn"].set()

    def on_subscribe(c, userdata, mid, reason_codes, properties):
        seen["suback"] = [int(rc.value) for rc in reason_codes]
        events["sub"].set()

    def on_message(c, userdata, msg):
        seen["message"] = msg
        events["msg"].set()

    def on_unsubscribe(c, userdata, mid, reason_codes, properties):
        seen["unsuback"] = reason_codes
        events["unsub"].set()

    client.on_connect = on_connect
    client.on_subscribe = on_subscribe
    client.on_message = on_message
    client.on_unsubscribe = on_unsubscribe
    client.username_pw_set("user", "secret")
    will_props = None
    connect_props = None
    sub_props = None
    pub_props = None
    if level == 5:
        will_props = PahoProperties(PacketTypes.WILLMESSAGE)
        will_props.WillDelayInterval = 10
        will_props.ContentType = "text/plain"
        connect_props = PahoProperties(PacketTypes.CONNECT)
        connect_props.SessionExpiryInterval = 60
        connect_props.ReceiveMaximum = 10
        connect_props.UserProperty = ("a", "1")
        connect_props.UserProperty = ("a", "2")
        sub_props = PahoProperties(PacketTypes.SUBSCRIBE)
        sub_props.SubscriptionIdentifier = 7
        pub_props = PahoProperties(PacketTypes.PUBLISH)
        pub_props.MessageExpiryInterval = 30
        pub_props.ResponseTopic = "reply/here"
        pub_props.CorrelationData = b"\x00\x01"
        pub_props.UserProperty = [("x", "1"), ("y", "2")]
    client.will_set("will/topic", b"bye", qos=1, retain=True, properties=will_props)
    if level == 5:
        client.connect("127.0.0.1", broker.port, keepalive=30, properties=connect_props)
    else:
        client.connect("127.0.0.1", broker.port, keepalive=30)
    client.loop_start()
    try:
        assert events["conn"].wait(5), broker.error
        if level == 5:
            subs = [
                (
                    "a/+",
                    SubscribeOptions(qos=1, noLocal=True, retainAsPublished=True, retainHandling=1),
                ),
                ("b/#", SubscribeOptions(qos=2)),
            ]
            client.subscribe(subs, properties=sub_props)
        else:
            client.subscribe([("a/+", 1), ("b/#", 2)])
        assert events["sub"].wait(5), broker.error
        assert events["msg"].wait(5), broker.error
        client.publish("t/0", b"q0", qos=0)
        client.publish("t/1", b"q1", qos=1, retain=True, properties=pub_props).wait_for_publish(5)
        client.publish("t/2", b"q2" * 100, qos=2).wait_for_publish(5)
        client.unsubscribe("a/+")
        assert events["unsub"].wait(5), broker.error
        client.disconnect()
    finally:
        client.loop_stop()
    broker.thread.join(5)
    assert broker.error is None, broker.error
    return broker.received, seen


@pytest.mark.skipif(paho is None, reason="paho-mqtt is not installed")
@pytest.mark.parametrize("level", LEVELS)
def test_paho_client_session(level):
    received, seen = _run_paho_session(level)
    by_type: dict = {}
    for p in received:
        by_type.setdefault(type(p), []).append(p)

    (connect,) = by_type[Connect]
    assert received[0] is connect
    assert connect.protocol_level == level
    assert connect.client_id == f"paho-{level}"
    assert connect.keep_alive == 30
    assert connect.clean_start is True
    assert (connect.username, connect.password) == ("user", b"secret")
    assert connect.will is not None
    assert (connect.will.topic, connect.will.payload) == ("will/topic", b"bye")
    assert (connect.will.qos, connect.will.retain) == (1, True)

    (sub,) = by_type[Subscribe]
    assert [f for f, _ in sub.subscriptions] == ["a/+", "b/#"]
    assert [o.qos for _, o in sub.subscriptions] == [1, 2]

    pubs = by_type[Publish]
    assert [(p.topic, p.qos) for p in pubs] == [("t/0", 0), ("t/1", 1), ("t/2", 2)]
    assert pubs[0].payload == b"q0" and pubs[0].packet_id is None
    assert pubs[1].retain is True and pubs[1].packet_id
    assert pubs[2].payload == b"q2" * 100
    assert by_type[Puback] == [Puback(1)]  # the client acknowledged the server's PUBLISH
    assert by_type[Pubrel] == [Pubrel(pubs[2].packet_id)]
    (unsub,) = by_type[Unsubscribe]
    assert unsub.topic_filters == ["a/+"]
    assert isinstance(received[-1], Disconnect)

    # paho decoded what the codec encoded
    assert seen["suback"] == [1, 2]
    msg = seen["message"]
    assert (msg.topic, msg.payload, msg.qos) == ("a/x", b"from-server", 1)

    if level == 5:
        cp = connect.properties
        assert cp.session_expiry_interval == 60 and cp.receive_maximum == 10
        assert cp.user_properties == [("a", "1"), ("a", "2")]
        wp = connect.will.properties
        assert (wp.will_delay_interval, wp.content_type) == (10, "text/plain")
        assert sub.properties.subscription_identifiers == [7]
        assert sub.subscriptions[0][1] == SubscriptionOptions(1, True, True, 1)
        assert sub.subscriptions[1][1] == SubscriptionOptions(2)
        pp = pubs[1].properties
        assert pp.message_expiry_interval == 30
        assert (pp.response_topic, pp.correlation_data) == ("reply/here", b"\x00\x01")
        assert pp.user_properties == [("x", "1"), ("y", "2")]
        reason_code, connack_props = seen["connack"]
        assert reason_code == 0 and connack_props.ReceiveMaximum == 20
        assert connack_props.UserProperty == [("srv", "1")]
        assert msg.properties.ContentType == "text/plain"
        assert msg.properties.UserProperty == [("src", "codec"), ("src", "2")]
        assert msg.properties.SubscriptionIdentifier == [7]
        assert [int(rc.value) for rc in seen["unsuback"]] == [0x11]
    else:
        assert connect.properties is None


# --------------------------------------------------------------------------- mqtt5 (Rust)

needs_mqtt5 = pytest.mark.skipif(
    mqtt5 is None, reason="the 'mqtt5' package (Rust MQTT 5 codec) is not installed"
)


def _up(p: Properties | None) -> list:
    return list(p.user_properties) if p is not None else []


def to_mqtt5(p):
    """Our packet -> the equivalent mqtt5 object, filling the spec defaults mqtt5 uses."""
    m = mqtt5
    pr = getattr(p, "properties", None) or Properties()
    up = list(pr.user_properties)
    if isinstance(p, Connect):
        will = None
        if p.will is not None:
            wp = p.will.properties or Properties()
            will = m.Will(
                p.will.topic,
                payload=p.will.payload,
                qos=m.QoS(p.will.qos),
                retain=p.will.retain,
                payload_format_indicator=wp.payload_format_indicator or 0,
                message_expiry_interval=wp.message_expiry_interval,
                content_type=wp.content_type,
                response_topic=wp.response_topic,
                correlation_data=wp.correlation_data,
                will_delay_interval=wp.will_delay_interval or 0,
                user_properties=list(wp.user_properties),
            )
        rpi = pr.request_problem_information
        return m.ConnectPacket(
            p.client_id,
            username=p.username,
            password=p.password,
            clean_start=p.clean_start,
            will=will,
            keep_alive=p.keep_alive,
            session_expiry_interval=pr.session_expiry_interval or 0,
            authentication_method=pr.authentication_method,
            authentication_data=pr.authentication_data,
            request_problem_info=bool(1 if rpi is None else rpi),
            request_response_info=bool(pr.request_response_information or 0),
            receive_max=pr.receive_maximum or 65535,
            topic_alias_max=pr.topic_alias_maximum or 0,
            max_packet_size=pr.maximum_packet_size,
            user_properties=up,
        )
    if isinstance(p, Connack):

        def flag(v):
            return True if v is None else bool(v)

        return m.ConnAckPacket(
            session_present=p.session_present,
            reason_code=m.ConnAckReasonCode(p.reason_code),
            session_expiry_interval=pr.session_expiry_interval,
            assigned_client_id=pr.assigned_client_identifier,
            server_keep_alive=pr.server_keep_alive,
            authentication_method=pr.authentication_method,
            authentication_data=pr.authentication_data,
            response_info=pr.response_information,
            server_reference=pr.server_reference,
            reason_str=pr.reason_string,
            receive_max=pr.receive_maximum or 65535,
            topic_alias_max=pr.topic_alias_maximum or 0,
            max_qos=m.QoS(2 if pr.maximum_qos is None else pr.maximum_qos),
            retain_available=flag(pr.retain_available),
            max_packet_size=pr.maximum_packet_size,
            wildcard_subscription_available=flag(pr.wildcard_subscription_available),
            subscription_id_available=flag(pr.subscription_identifier_available),
            shared_subscription_available=flag(pr.shared_subscription_available),
            user_properties=up,
        )
    if isinstance(p, Publish):
        return m.PublishPacket(
            p.topic,
            p.payload,
            qos=m.QoS(p.qos),
            retain=p.retain,
            packet_id=p.packet_id,
            duplicate=p.dup,
            payload_format_indicator=pr.payload_format_indicator or 0,
            message_expiry_interval=pr.message_expiry_interval,
            content_type=pr.content_type,
            response_topic=pr.response_topic,
            correlation_data=pr.correlation_data,
            subscription_ids=list(pr.subscription_identifiers),
            topic_alias=pr.topic_alias,
            user_properties=up,
        )
    acks = {
        Puback: (m.PubAckPacket, m.PubAckReasonCode),
        Pubrec: (m.PubRecPacket, m.PubRecReasonCode),
        Pubrel: (m.PubRelPacket, m.PubRelReasonCode),
        Pubcomp: (m.PubCompPacket, m.PubCompReasonCode),
    }
    if type(p) in acks:
        cls, rc = acks[type(p)]
        return cls(
            p.packet_id,
            reason_code=rc(p.reason_code),
            reason_str=pr.reason_string,
            user_properties=up,
        )
    if isinstance(p, Subscribe):
        filters = [
            m.TopicFilter(
                f,
                max_qos=m.QoS(o.qos),
                no_local=o.no_local,
                retain_as_published=o.retain_as_published,
                retain_handling=m.RetainHandling(o.retain_handling),
            )
            for f, o in p.subscriptions
        ]
        sid = pr.subscription_identifiers[0] if pr.subscription_identifiers else None
        return m.SubscribePacket(p.packet_id, filters, subscription_id=sid, user_properties=up)
    if isinstance(p, Suback):
        return m.SubAckPacket(
            p.packet_id,
            [m.SubAckReasonCode(c) for c in p.reason_codes],
            reason_str=pr.reason_string,
            user_properties=up,
        )
    if isinstance(p, Unsubscribe):
        return m.UnsubscribePacket(p.packet_id, list(p.topic_filters), user_properties=up)
    if isinstance(p, Unsuback):
        return m.UnsubAckPacket(
            p.packet_id,
            [m.UnsubAckReasonCode(c) for c in p.reason_codes],
            reason_str=pr.reason_string,
            user_properties=up,
        )
    if isinstance(p, Pingreq):
        return m.PingReqPacket()
    if isinstance(p, Pingresp):
        return m.PingRespPacket()
    if isinstance(p, Disconnect):
        return m.DisconnectPacket(
            reason_code=m.DisconnectReasonCode(p.reason_code),
            session_expiry_interval=pr.session_expiry_interval,
            server_reference=pr.server_reference,
            reason_str=pr.reason_string,
            user_properties=up,
        )
    if isinstance(p, Auth):
        return m.AuthPacket(
            reason_code=m.AuthReasonCode(p.reason_code),
            authentication_method=pr.authentication_method,
            authentication_data=pr.authentication_data,
            reason_str=pr.reason_string,
            user_properties=up,
        )
    raise TypeError(p)


@needs_mqtt5
@pytest.mark.parametrize("name", PACKET_NAMES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_mqtt5_cross_check(name, data):
    packet = data.draw(packet_strategies(5)[name])
    expected = to_mqtt5(packet)
    # ours -> bytes -> mqtt5
    raw = encode(packet, 5)
    if raw != b"\xf0\x00":
        theirs, consumed = mqtt5.read(memoryview(raw))
        assert consumed == len(raw)
        assert theirs == expected
    # else: mqtt5 0.8 rejects the 0-length AUTH that §3.15.2.2.1 allows; see
    # test_mqtt5_rejects_short_auth.
    # mqtt5 -> bytes -> ours
    raw2 = expected.write()
    ours = decode_one(raw2, None if name == "connect" else 5)
    assert to_mqtt5(ours) == expected


@needs_mqtt5
def test_mqtt5_cross_check_examples():
    """A few fixed packets with every property their type allows."""
    pub = mqtt5.PublishPacket(
        "a/b",
        b"\x00\xff",
        qos=mqtt5.QoS.EXACTLY_ONCE,
        packet_id=65535,
        retain=True,
        duplicate=True,
        payload_format_indicator=1,
        message_expiry_interval=2**32 - 1,
        content_type="ct",
        response_topic="r/t",
        correlation_data=b"c",
        subscription_ids=[1, 268_435_455],
        topic_alias=3,
        user_properties=[("k", "v")] * 3,
    )
    p = decode_one(pub.write(), 5)
    assert p.properties.subscription_identifiers == [1, 268_435_455]
    assert p.properties.user_properties == [("k", "v")] * 3
    assert to_mqtt5(p) == pub
    conn = mqtt5.ConnectPacket(
        "c",
        username="u",
        password=b"p",
        clean_start=True,
        keep_alive=65535,
        will=mqtt5.Will(
            "w",
            payload=b"x",
            qos=mqtt5.QoS.EXACTLY_ONCE,
            retain=True,
            will_delay_interval=9,
            user_properties=[("a", "b")],
        ),
        session_expiry_interval=5,
        authentication_method="m",
        authentication_data=b"d",
        request_problem_info=False,
        request_response_info=True,
        receive_max=7,
        topic_alias_max=8,
        max_packet_size=1000,
        user_properties=[("x", "y")],
    )
    c = decode_one(conn.write(), None)
    assert c.properties.request_problem_information == 0
    assert to_mqtt5(c) == conn
    assert mqtt5.read(memoryview(encode(c, 5)))[0] == conn


@needs_mqtt5
def test_mqtt5_rejects_short_auth():
    """Documents an oracle quirk: MQTT 5 §3.15.2.2.1 allows AUTH with Remaining Length 0
    (success, no properties) and this codec emits it, but mqtt5 0.8 cannot read it."""
    assert decode_one(b"\xf0\x00", 5) == Auth()
    with pytest.raises(ValueError):
        mqtt5.read(memoryview(b"\xf0\x00"))


def test_fast_puback_matches_the_generic_encoder() -> None:
    for level in (3, 4, 5):
        for pid in (1, 0x7F, 0x100, 0xFFFF):
            assert encode_puback(pid) == encode(Puback(pid), level)
