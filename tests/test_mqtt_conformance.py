"""MQTT 5 normative statements about wills, topic names on the way out, strings MQTT cannot
carry and the client's maximum packet size (real sockets, real Redis)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.broker import Broker
from gateway.model import Message
from protocols.listening import Listener
from protocols.mqtt.codec import MqttDecoder
from tests import test_mqtt_hostile
from tests.test_mqtt_hostile import Peer, connect, connected, props, publish, s, subscribe, u32
from tests.test_mqtt_outbound import publish_parts

gw = test_mqtt_hostile.gw


def will5(topic: str, payload: bytes = b"bye", wprops: bytes = b"\x00") -> bytes:
    return wprops + s(topic) + s(payload)


async def v4_watcher(port: int, cid: str, topic: str) -> Peer:
    peer = await connected(port, 4, cid)
    await peer.send(subscribe(4, 1, (topic, 1)))
    assert (await peer.packet())[0] == 0x90
    return peer


async def v5_watcher(
    port: int, cid: str, topic: str, qos: int = 1, cprops: bytes = b"\x00"
) -> Peer:
    peer = await connected(port, 5, cid, cprops=cprops)
    await peer.send(subscribe(5, 1, (topic, qos)))
    assert (await peer.packet())[0] == 0x90
    return peer


def decode5(packet: bytes):
    (pkt,) = MqttDecoder(protocol_level=5).feed(packet)
    return pkt


async def test_disconnect_with_error_reason_code_keeps_the_will(gw: Listener) -> None:
    """MQTT-3.1.2-8 / MQTT-3.14.4-3: only DISCONNECT 0x00 deletes the will; a client that
    closes with e.g. 0x80 (Unspecified error) must get its will published."""
    watch = await v4_watcher(gw.port, "d1-w", "d1/#")
    peer = await connected(gw.port, 5, "d1", flags=0x06, rest=will5("d1/will"))
    await peer.send(b"\xe0\x01\x80")  # DISCONNECT, reason code 0x80
    await peer.until_eof()
    got = await asyncio.wait_for(watch.packet(), 3)
    assert publish_parts(got)[1] == "d1/will"


@pytest.mark.parametrize("expiry", [10, 2])
async def test_a_delayed_wills_expiry_counts_from_when_it_goes(gw: Listener, expiry: int) -> None:
    """§3.1.3.2.4: the will's Message Expiry Interval 'is sent as the Publication Expiry
    Interval when the Server publishes the Will Message': after a 2 s will delay it is
    whole, and a will whose expiry is not above its delay still goes."""
    watch = await v5_watcher(gw.port, f"d2-{expiry}-w", "d2/#")
    peer = await connected(
        gw.port,
        5,
        f"d2-{expiry}",
        flags=0x06,
        cprops=props(u32(0x11, 60)),
        rest=will5("d2/will", wprops=props(u32(0x18, 2), u32(0x02, expiry))),
    )
    peer.close()
    got = decode5(await asyncio.wait_for(watch.packet(), 5))
    assert (got.topic, got.properties.message_expiry_interval) == ("d2/will", expiry)


async def test_egress_topic_name_has_no_wildcards(gw: Listener, broker: Broker) -> None:
    """MQTT-3.3.2-2: the Topic Name in a PUBLISH MUST NOT contain wildcard characters. An
    AMQP publisher may send to topic://d3/a+b: such a message is not sent to MQTT clients."""
    sub = await connected(gw.port, 4, "d3")
    await sub.send(subscribe(4, 1, ("d3/#", 0)))
    assert (await sub.packet())[0] == 0x90
    await broker.publish(Message("d3/a+b", b"x", persistent=False))
    await broker.publish(Message("d3/ok", b"y", persistent=False))
    got = await asyncio.wait_for(sub.packet(), 3)
    assert publish_parts(got)[1:4:2] == ("d3/ok", b"y"), got


async def test_egress_response_topic_has_no_wildcards(gw: Listener, broker: Broker) -> None:
    """MQTT-3.3.2-14: the Response Topic MUST NOT contain wildcard characters (an AMQP
    reply-to is forwarded as is)."""
    sub = await v5_watcher(gw.port, "d3b", "d3b/#", qos=0)
    await broker.publish(Message("d3b/t", b"x", persistent=False, reply_to="replies/#"))
    got = decode5(await asyncio.wait_for(sub.packet(), 3))
    rt = got.properties.response_topic if got.properties else None
    assert rt is None or not ("+" in rt or "#" in rt), rt


async def test_unencodable_long_string_does_not_stall_the_subscriber(
    gw: Listener, broker: Broker
) -> None:
    """§1.5.4 / §1.5.7: an MQTT string holds at most 65,535 bytes. A queued message (from
    AMQP, say) with a longer user property is dropped for this client, as a packet over its
    maximum size is (MQTT-3.1.2-25): it does not hold its place (receive maximum 1)."""
    sub = await v5_watcher(gw.port, "d4", "d4/#", cprops=props(b"\x21\x00\x01"))
    await broker.publish(Message("d4/t", b"big", user_properties=[("k", "v" * 70000)]))
    await broker.publish(Message("d4/t", b"next"))
    got = await asyncio.wait_for(sub.packet(), 3)
    assert got.endswith(b"next"), got  # "big" cannot be carried: not sent


async def test_empty_response_topic_is_refused(gw: Listener) -> None:
    """MQTT-3.3.2-13/-14 with MQTT-4.7.3-1: the Response Topic is a Topic Name (at least
    one character): an empty one is a malformed packet, never forwarded."""
    watch = await v5_watcher(gw.port, "d5-w", "d5/#", qos=0)
    pub = await connected(gw.port, 5, "d5")
    await pub.send(publish(5, "d5/t", b"p", pprops=props(b"\x08" + s(""))))
    try:
        fwd = decode5(await asyncio.wait_for(watch.packet(), 1))
        assert fwd.properties is None or fwd.properties.response_topic != "", "forwarded ''"
    except TimeoutError:
        pass
    assert await pub.until_eof(2) == b"\xe0\x01\x82"


async def test_connack_respects_the_clients_maximum_packet_size(gw: Listener) -> None:
    """MQTT-3.1.2-24: the Server MUST NOT send packets exceeding the client's Maximum Packet
    Size. A 20-byte limit; every CONNACK property here is optional (3 bytes would do)."""
    peer = await Peer.open(gw.port)
    await peer.send(connect(5, "d6", cprops=props(u32(0x27, 20))))
    ack = await peer.packet()
    assert ack[3] == 0 and len(ack) <= 20, (len(ack), ack)
