"""Sans-IO parts of the AMQP adapter: SASL negotiation, addresses, message mapping."""

from __future__ import annotations

import json
import struct
import time

import pytest
from proton import (
    Connection,
    Data,
    Described,
    Link,
    Message,
    Terminus,
    char,
    float32,
    int32,
    symbol,
    timestamp,
    ulong,
)
from proton.reactor import DurableSubscription, Filter, LinkOption, Selector

from gateway.broker import QueueConfig
from gateway.config import Settings
from gateway.model import Delivery, Publisher, property_text
from gateway.model import Message as GatewayMessage
from protocols.amqp import mapping, sections, terminus
from protocols.amqp.links import Address, parse_address
from protocols.amqp.sasl import AMQP_HEADER, SASL_HEADER, SaslServer, State
from tests.amqp_raw import sasl_init

USERS = {"alice": "s3cret"}


def server(anonymous: bool = True) -> SaslServer:
    return SaslServer(anonymous, lambda u, p: (USERS.get(u) == p, u))


def outcome_code(output: bytes) -> int:
    """The code of the sasl-outcome frame at the end of `output`."""
    data = Data()
    size = struct.unpack_from(">I", output, len(output) - _last_frame_size(output))[0]
    data.decode(output[-size + 8 :])
    data.rewind()
    data.next()
    return int(data.get_object().value[0])


def _last_frame_size(output: bytes) -> int:
    pos = len(SASL_HEADER) if output.startswith(SASL_HEADER) else 0
    last = 0
    while pos < len(output):
        last = struct.unpack_from(">I", output, pos)[0]
        pos += last
    return last


@pytest.mark.parametrize("anonymous", [True, False])
def test_plain_without_configured_users(anonymous: bool) -> None:
    """No users to check a name against: PLAIN with any name connects while anonymous
    clients are allowed (as Mosquitto does), as anonymous; else it fails."""
    sasl = SaslServer(anonymous, Settings(allow_anonymous=anonymous).login)
    sasl.feed(SASL_HEADER + sasl_init("PLAIN", b"\0device1\0any") + AMQP_HEADER)
    assert sasl.state is (State.DONE if anonymous else State.FAILED)
    assert sasl.user is None
    assert outcome_code(bytes(sasl.output)) == (0 if anonymous else 1)


def test_plain_fed_byte_by_byte_keeps_pipelined_bytes() -> None:
    sasl = server(anonymous=False)
    wire = SASL_HEADER + sasl_init("PLAIN", b"\0alice\0s3cret") + AMQP_HEADER + b"more"
    for i in range(len(wire)):
        sasl.feed(wire[i : i + 1])
        if sasl.state is not State.NEGOTIATING:
            break
    assert sasl.state is State.DONE
    assert sasl.user == "alice"
    assert sasl.output.startswith(SASL_HEADER) and b"PLAIN" in sasl.output
    assert b"ANONYMOUS" not in sasl.output  # not offered when anonymous is off
    assert outcome_code(bytes(sasl.output)) == 0
    remaining = wire[i + 1 :]
    assert sasl.rest + remaining == AMQP_HEADER + b"more"


@pytest.mark.parametrize(
    ("mechanism", "response"),
    [("PLAIN", b"\0alice\0wrong"), ("PLAIN", b"garbage"), ("ANONYMOUS", None), ("CRAM", b"")],
)
def test_refused_logins(mechanism: str, response: bytes | None) -> None:
    sasl = server(anonymous=False)
    sasl.feed(SASL_HEADER + sasl_init(mechanism, response))
    assert sasl.state is State.FAILED
    assert outcome_code(bytes(sasl.output)) == 1


def test_anonymous_and_headers() -> None:
    sasl = server()
    sasl.feed(SASL_HEADER + sasl_init("ANONYMOUS", b""))
    assert (sasl.state, sasl.user) == (State.DONE, None)
    plain = server()
    plain.feed(AMQP_HEADER[:4])
    assert plain.state is State.NEGOTIATING
    plain.feed(AMQP_HEADER[4:] + b"x")
    assert (plain.state, plain.rest, bytes(plain.output)) == (State.DONE, AMQP_HEADER + b"x", b"")
    refused = server(anonymous=False)
    refused.feed(AMQP_HEADER)
    assert (refused.state, bytes(refused.output)) == (State.FAILED, SASL_HEADER)
    for anonymous in (True, False):  # a header it supports, then close (§2.2)
        for unsupported in (b"GET / HTTP/1.1\r\n", b"AMQP\x00\x01\x00\x01", b"\x16\x03\x01"):
            other = server(anonymous=anonymous)
            other.feed(unsupported)
            assert (other.state, bytes(other.output)) == (State.FAILED, SASL_HEADER)
    oversized = server()
    oversized.feed(SASL_HEADER + struct.pack(">IBBH", 1 << 20, 2, 1, 0))
    assert oversized.state is State.FAILED


@pytest.mark.parametrize(
    ("address", "caps", "expected"),
    [
        ("orders", frozenset(), Address("orders", True)),
        ("queue://orders", frozenset(), Address("orders", True)),
        ("/queues/a%2Fb", frozenset(), Address("a/b", True)),
        ("topic://a/b", frozenset(), Address("a/b", False)),
        ("a/b", frozenset({"topic"}), Address("a/b", False)),
        ("a/b", frozenset({"queue"}), Address("a/b", True)),
        ("", frozenset(), None),
        (None, frozenset(), None),
        ("queue://", frozenset(), None),
    ],
)
def test_parse_address(address: str | None, caps: frozenset[str], expected: Address | None) -> None:
    assert parse_address(address, caps) == expected


def test_ingress_mapping() -> None:
    amqp = Message(
        body="héllo",
        durable=True,
        priority=200,
        ttl=10,
        group_id="key-1",
        correlation_id=b"\x01\x02",
        reply_to="replies",
        id=7,
        subject="subj",
        properties={"z": 1, "a": "two", "b": b"\x00"},
    )
    amqp.address = "topic://x"
    amqp.annotations = {symbol("x-opt-jms-dest"): 1}
    before = int(time.time() * 1000)
    ingress = mapping.decode(amqp.encode(), Publisher("amqp", "c1"))
    assert (ingress.to, ingress.jms_dest) == ("topic://x", 1)
    msg = ingress.message
    assert msg.payload == "héllo".encode()
    assert msg.content_type == "text/plain"
    assert msg.persistent and msg.publisher == Publisher("amqp", "c1")
    assert msg.priority == 9
    assert before + 9_000 <= msg.expiration <= before + 11_000
    assert msg.partition_key == "key-1"
    assert (msg.correlation_id, msg.reply_to, msg.message_id) == (b"\x01\x02", "replies", 7)
    assert msg.user_properties == [("z", 1), ("a", "two"), ("b", b"\x00")]
    plain = mapping.decode(Message(body=b"raw", inferred=True).encode(), Publisher("amqp"))
    assert plain.message.payload == b"raw" and plain.message.content_type is None
    assert plain.message.expiration is None and plain.message.priority == 4


def test_egress_mapping() -> None:
    expiration = int(time.time() * 1000) + 60_000
    msg = GatewayMessage(
        destination="orders",
        payload=b"\x00bin",
        priority=7,
        expiration=expiration,
        persistent=False,
        content_type="application/octet-stream",
        correlation_id="c",
        partition_key="k",
        user_properties=[("x", 1), ("y", "z")],
    )
    amqp = Message()
    amqp.decode(mapping.from_delivery(Delivery("orders", "1-0", msg, delivery_count=3)).encode())
    assert bytes(amqp.body) == b"\x00bin" and amqp.inferred  # a data section
    assert (amqp.delivery_count, amqp.first_acquirer) == (2, False)
    assert (amqp.priority, amqp.durable, amqp.group_id) == (7, False, "k")
    assert amqp.expiry_time == pytest.approx(expiration / 1000)
    assert 55 < amqp.ttl <= 60
    assert amqp.correlation_id == "c"
    assert list(amqp.properties.items()) == [("x", 1), ("y", "z")]


def receiver(*options: LinkOption) -> Link:
    """A receiver link with `options` applied (its terminus is only valid while it lives)."""
    link = Connection().session().receiver("r")
    for option in options:
        option.apply(link)
    return link


def test_selector_is_found_by_descriptor_not_key() -> None:
    jms = {symbol("jms-selector"): Described(terminus.SELECTOR_CODE, "b > 2")}
    no_local = {symbol("selector"): Described(symbol("apache.org:no-local-filter:list"), [])}
    proton_style, jms_style, other, plain = (
        receiver(Selector("a = 1")),
        receiver(Filter(jms)),
        receiver(Filter(no_local)),
        receiver(),
    )
    found = terminus.selector(proton_style.source)
    assert found is not None and found.text == "a = 1"
    found = terminus.selector(jms_style.source)
    assert found is not None and found.text == "b > 2"
    assert terminus.selector(other.source) is None
    assert terminus.selector(plain.source) is None
    terminus.echo(plain.source, [found])
    plain.source.filter.rewind()
    plain.source.filter.next()
    assert plain.source.filter.get_object() == jms


def test_durable_source_and_subscription_queue_name() -> None:
    durable, plain, configured = receiver(DurableSubscription()), receiver(), receiver()
    configured.source.durability = Terminus.CONFIGURATION
    assert terminus.is_durable(durable.source) and terminus.is_durable(configured.source)
    assert not terminus.is_durable(plain.source)
    name = terminus.durable_queue_name("client-1", "sub")
    assert name == f"#dts/{b'client-1'.hex()}/{b'sub'.hex()}"
    long_name = terminus.durable_queue_name("c" * 200, "s")
    assert long_name.startswith("#dts/h/") and len(long_name) <= 255
    assert long_name != terminus.durable_queue_name("c" * 200, "t")
    for queue in (name, long_name):
        QueueConfig(name=queue).validate(reserved_ok=True)


def test_the_subscription_a_link_names() -> None:
    """Qpid JMS's link names: `sub` (unshared, or shared with a client id), `sub|2` (the next
    link of a shared one), `sub|global`, `sub|global2` (shared, no client id)."""
    none: frozenset[str] = frozenset()
    shared, shared_global = frozenset({"shared"}), frozenset({"shared", "global", "topic"})
    unshared = terminus.subscription("c", "sub|2", none)
    assert (unshared.container_id, unshared.name, unshared.shared) == ("c", "sub|2", False)
    assert terminus.subscription("c", "sub|2", shared).queue(True) == (
        terminus.subscription("c", "sub", shared).queue(True)
    )
    assert terminus.subscription("c", "sub", shared).queue(True) == (
        terminus.durable_queue_name("c", "sub")  # what an unsubscribe's lookup finds
    )
    global_sub = terminus.subscription("c", "sub|global2", shared_global)
    assert global_sub == terminus.subscription("other", "sub|global", shared_global)
    assert global_sub == terminus.looked_up("c", "sub|global")
    assert global_sub.queue(False).startswith("#vts/")
    assert global_sub.queue(True) != terminus.subscription("c", "sub", shared).queue(True)


def test_annotations_both_ways() -> None:
    amqp = Message(body=b"x")
    amqp.annotations = {
        symbol("x-opt-dmq-eligible"): True,
        symbol("x-opt-delivery-time"): 1_900_000_000_000,
    }
    msg = mapping.decode(amqp.encode(), Publisher("amqp")).message
    assert (msg.dmq_eligible, msg.not_before) == (True, 1_900_000_000_000)
    assert (
        mapping.decode(Message(body=b"x").encode(), Publisher("amqp")).message.dmq_eligible is None
    )
    dead = GatewayMessage(destination="a/b", annotations={"x-origin-queue": "q"})
    out = Message()
    out.decode(mapping.from_delivery(Delivery("#DEAD_MSG_QUEUE", "1-0", dead)).encode())
    assert out.annotations == {symbol("x-origin-queue"): "q", symbol("x-opt-jms-dest"): 1}
    assert out.address == "topic://a/b"


PUBLISHER = Publisher("amqp")


def test_typed_property_values_are_the_same_for_either_decoder() -> None:
    """A JMS MapMessage (a map body: proton decodes it) with an int property: the model
    holds 5, as for a TextMessage the fast decoder reads, not proton's int32(5), whose
    text ("int32(5)") made another last-value or sort key and MQTT property value."""
    typed = {"i": int32(5), "u": ulong(7), "f": float32(2.5), "c": char("x"), "t": timestamp(9)}
    texts = []
    for body in ({"px": 100}, "px=100"):
        msg = mapping.decode(Message(body=body, properties=typed).encode(), PUBLISHER).message
        texts.append([property_text(value) for _, value in sorted(msg.user_properties)])
    assert texts[0] == texts[1] == ["x", "2.5", "5", "9", "7"]


def test_other_amqp_values_are_kept_for_amqp_and_json_for_others() -> None:
    value = {"sequence": 7, "tags": ["a", "b"], symbol("k"): 1.5}
    msg = mapping.decode(Message(body=value).encode(), Publisher("amqp")).message
    assert json.loads(msg.payload) == {"sequence": 7, "tags": ["a", "b"], "k": 1.5}
    assert msg.content_type == "application/json"
    out = Message()
    out.decode(sections.encode(Delivery("q", "1-0", msg)))
    assert out.body == value, "AMQP consumers get the value the publisher sent"
    assert "x-amqp-value" not in (out.annotations or {})
