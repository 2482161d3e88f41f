"""What a session sends its subscriber: a subscription replaced at another QoS loses
nothing (MQTT-3.8.4-3), one copy of a message matching overlapping filters carries all
their subscription ids (MQTT-3.3.4-5), topic aliases are only used once the client was told."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import pytest

from protocols.listening import Listener
from protocols.mqtt.state import SessionState
from tests import test_mqtt_hostile
from tests.test_mqtt_codec import frame
from tests.test_mqtt_hostile import (
    Peer,
    connect,
    connected,
    props,
    publish,
    published,
    s,
    subscribe,
    u16,
    u32,
)

gw = test_mqtt_hostile.gw  # the MQTT listener fixture, failing a test on any ERROR log

SUBACK_QOS1 = b"\x90\x03\x00\x01\x01"


def publish_parts(packet: bytes) -> tuple[int, str, bytes, bytes]:
    """QoS, topic, packet id bytes (empty at QoS 0) and payload of a v3.1.1 PUBLISH."""
    size = struct.unpack("!H", packet[2:4])[0]
    topic = packet[4 : 4 + size].decode()
    qos = packet[0] >> 1 & 3
    at = 4 + size
    pid = packet[at : at + 2] if qos else b""
    return qos, topic, pid, packet[at + len(pid) :]


async def take(peer: Peer, got: list[bytes], others: list[bytes]) -> None:
    """Read `peer`'s packets for good: payloads of PUBLISHes (QoS 1 ones acknowledged) into
    `got`, every other packet into `others`."""
    while True:
        packet = await peer.packet()
        if packet[0] >> 4 != 3:
            others.append(packet)
            continue
        qos, _, pid, payload = publish_parts(packet)
        got.append(payload)
        if qos == 1:
            await peer.send(b"\x40\x02" + pid)


async def test_resubscribing_at_qos0_still_delivers_what_the_session_queued(gw: Listener) -> None:
    """Messages queued for an offline persistent session at QoS 1 reach it though it
    subscribes the same filter again at QoS 0 as it comes back."""
    first = await connected(gw.port, 4, "resub", flags=0x00)
    await first.send(subscribe(4, 1, ("rq/#", 1)))
    assert await first.packet() == SUBACK_QOS1
    await first.send(b"\xe0\x00")  # DISCONNECT: the session stays
    await first.until_eof()
    pub = await connected(gw.port, 4, "resub-pub")
    for i in range(5):
        await published(pub, 4, f"rq/{i}", b"m%d" % i, pid=i + 1)
    again = await Peer.open(gw.port)
    await again.send(connect(4, "resub", flags=0x00) + subscribe(4, 2, ("rq/#", 0)))
    got: list[bytes] = []
    others: list[bytes] = []
    reader = asyncio.create_task(take(again, got, others))
    try:
        async with asyncio.timeout(5):
            while len(got) < 5 or len(others) < 2:
                await asyncio.sleep(0.01)
    finally:
        reader.cancel()
    assert sorted(got) == [b"m%d" % i for i in range(5)]
    assert others[0][:3] == b"\x20\x02\x01"  # CONNACK, session present
    assert others[1] == b"\x90\x03\x00\x02\x00"
    pub.close()
    again.close()


async def test_switching_a_filter_between_qos0_and_qos1_loses_and_doubles_nothing(
    gw: Listener,
) -> None:
    """A subscriber changes its filter's QoS back and forth while messages stream in:
    each message arrives once."""
    n = 400
    sub = await connected(gw.port, 4, "switcher")
    await sub.send(subscribe(4, 1, ("sw/#", 1)))
    assert await sub.packet() == SUBACK_QOS1
    got: list[bytes] = []
    others: list[bytes] = []
    reader = asyncio.create_task(take(sub, got, others))
    pub = await connected(gw.port, 4, "switch-pub")

    async def stream() -> None:
        for i in range(n):
            await published(pub, 4, "sw/x", b"%d" % i, pid=i % 60000 + 1)

    sender = asyncio.create_task(stream())
    pid = 2
    while not sender.done():
        await sub.send(subscribe(4, pid, ("sw/#", pid % 2)))
        pid += 1
        await asyncio.sleep(0.005)
    await sender
    async with asyncio.timeout(5):
        while len(got) < n:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # a copy sent twice would come now
    reader.cancel()
    assert sorted(int(p) for p in got) == list(range(n))
    assert len(others) == pid - 2  # a SUBACK for each SUBSCRIBE
    pub.close()
    sub.close()


async def test_one_copy_for_overlapping_filters_carries_all_their_subscription_ids(
    gw: Listener,
) -> None:
    sub = await connected(gw.port, 5, "overlap")
    await sub.send(subscribe(5, 1, ("ov/#", 0), sprops=props(b"\x0b\x01")))
    assert (await sub.packet())[0] == 0x90
    await sub.send(subscribe(5, 2, ("ov/a", 1), sprops=props(b"\x0b\x02")))
    assert (await sub.packet())[0] == 0x90
    pub = await connected(gw.port, 4, "overlap-pub")
    await published(pub, 4, "ov/a", b"both")
    got = await sub.packet()
    assert got[0] == 0x32 and got.endswith(b"both"), got  # once, at QoS 1
    size = struct.unpack("!H", got[2:4])[0]
    properties = got[4 + size + 2 :]
    assert b"\x0b\x01" in properties and b"\x0b\x02" in properties, got
    await published(pub, 4, "ov/b", b"one")  # only the QoS 0 filter: direct
    got = await sub.packet()
    assert got[0] == 0x30 and got.endswith(b"one") and b"\x0b\x01" in got, got
    pub.close()
    sub.close()


async def test_a_topic_alias_is_used_only_once_a_sent_packet_told_the_client(
    gw: Listener,
) -> None:
    """The first message on a topic is over the client's maximum packet size and dropped:
    the next one on that topic still names the topic with the alias (MQTT 5 §3.3.2.3.4)."""
    limits = props(b"\x22\x00\x0a", b"\x27\x00\x00\x00\xc8")  # aliases 10, packets 200 B
    sub = await connected(gw.port, 5, "aliased", cprops=limits)
    await sub.send(subscribe(5, 1, ("al/t", 1)))
    assert (await sub.packet())[0] == 0x90
    pub = await connected(gw.port, 4, "alias-pub")
    await published(pub, 4, "al/t", b"x" * 500)
    await published(pub, 4, "al/t", b"small", pid=2)
    got = await sub.packet()
    assert got[0] == 0x32 and got.endswith(b"small"), got
    assert got[2:8] == b"\x00\x04al/t", got  # the topic, with the alias that stands for it
    assert b"\x23\x00\x01" in got, got
    pub.close()
    sub.close()


async def test_a_qos2_delivery_waiting_for_its_pubcomp_counts_against_receive_maximum(
    gw: Listener,
) -> None:
    """Receive Maximum 1: after the PUBREC the gateway sends the PUBREL, and the next
    PUBLISH only once the PUBCOMP came (MQTT 5 §4.9)."""
    sub = await connected(gw.port, 5, "one-at-a-time", cprops=props(b"\x21\x00\x01"))
    await sub.send(subscribe(5, 1, ("rm/#", 2)))
    assert (await sub.packet())[0] == 0x90
    pub = await connected(gw.port, 4, "rm-pub")
    for pid_out, payload in ((1, b"first"), (2, b"second")):  # at QoS 2
        await pub.send(publish(4, "rm/a", payload, qos=2, pid=pid_out))
        assert await pub.packet() == b"\x50\x02\x00" + bytes((pid_out,))
        await pub.send(b"\x62\x02\x00" + bytes((pid_out,)))
        assert await pub.packet() == b"\x70\x02\x00" + bytes((pid_out,))
    first = await sub.packet()
    assert first[0] == 0x34 and first.endswith(b"first"), first
    pid = first[8:10]
    await sub.send(b"\x50\x02" + pid)  # PUBREC
    assert await sub.packet() == b"\x62\x02" + pid  # PUBREL
    try:
        early = await asyncio.wait_for(sub.packet(), 0.3)
    except TimeoutError:
        early = None
    assert early is None, early
    await sub.send(b"\x70\x02" + pid)  # PUBCOMP
    second = await sub.packet()
    assert second[0] == 0x34 and second.endswith(b"second"), second
    pub.close()
    sub.close()


async def test_retained_messages_for_a_new_subscription_keep_to_receive_maximum(
    gw: Listener,
) -> None:
    """Ten retained QoS 1 messages and Receive Maximum 2: two go out, then one more for
    each PUBACK (MQTT-3.3.4-9)."""
    pub = await connected(gw.port, 4, "retainer")
    for i in range(10):
        await pub.send(publish(4, f"kept/{i}", b"r%d" % i, qos=1, pid=i + 1, flags=1))
        assert await pub.packet() == b"\x40\x02\x00" + bytes((i + 1,))
    sub = await connected(gw.port, 5, "two-at-a-time", cprops=props(b"\x21\x00\x02"))
    await sub.send(subscribe(5, 1, ("kept/#", 1)))
    assert (await sub.packet())[0] == 0x90
    got = [await sub.packet(), await sub.packet()]
    for acked in range(10):
        try:
            extra = await asyncio.wait_for(sub.packet(), 0.1)
        except TimeoutError:
            extra = None
        assert extra is None, (acked, extra)  # a third unacknowledged PUBLISH
        size = struct.unpack("!H", got[acked][2:4])[0]
        await sub.send(b"\x40\x02" + got[acked][4 + size : 6 + size])  # PUBACK
        if len(got) < 10:
            got.append(await sub.packet())
    assert sorted(p[-2:] for p in got) == sorted(b"r%d" % i for i in range(10))
    pub.close()
    sub.close()


async def test_retained_qos2_messages_go_on_as_pubcomps_free_the_receive_maximum(
    gw: Listener,
) -> None:
    """Receive Maximum 1 and two retained QoS 2 messages: a PUBCOMP frees the room the
    next one waits for (MQTT-3.3.4-9). Only a PUBACK or PUBREC sent it, so the second and
    every live message after it waited for good (found by a review)."""
    pub = await connected(gw.port, 4, "retainer-2")
    for pid, topic in ((1, "kept2/a"), (2, "kept2/b")):
        await pub.send(publish(4, topic, topic.encode(), qos=2, pid=pid, flags=1))
        assert await pub.packet() == b"\x50\x02\x00" + bytes((pid,))  # PUBREC
        await pub.send(b"\x62\x02\x00" + bytes((pid,)))
        assert await pub.packet() == b"\x70\x02\x00" + bytes((pid,))  # PUBCOMP
    sub = await connected(gw.port, 5, "one-qos2", cprops=props(b"\x21\x00\x01"))
    await sub.send(subscribe(5, 1, ("kept2/#", 2)))
    assert (await sub.packet())[0] == 0x90
    got = []
    for _ in range(2):
        packet = await sub.packet()
        assert packet[0] == 0x35, packet  # QoS 2, retained
        size = struct.unpack("!H", packet[2:4])[0]
        got.append(packet[4 : 4 + size])
        pid = packet[4 + size : 6 + size]
        await sub.send(b"\x50\x02" + pid)  # PUBREC
        assert await sub.packet() == b"\x62\x02" + pid  # PUBREL
        await sub.send(b"\x70\x02" + pid)  # PUBCOMP
    assert sorted(got) == [b"kept2/a", b"kept2/b"]
    await pub.send(publish(4, "kept2/live", b"live", qos=1, pid=3))
    assert await pub.packet() == b"\x40\x02\x00\x03"
    live = await sub.packet()
    assert live[0] == 0x32 and live.endswith(b"live"), live  # QoS 1 as published, live
    pub.close()
    sub.close()


async def unacked_then_resent(gw: Listener, client_id: str, takeover: bool) -> list[bytes]:
    """Packet ids of the QoS 1 messages a persistent session had in flight, as sent, then
    as resent to its next connection (after a dropped connection, or a takeover)."""
    first = await connected(gw.port, 4, client_id, flags=0x00)
    await first.send(subscribe(4, 1, (f"{client_id}/#", 1)))
    assert await first.packet() == SUBACK_QOS1
    pub = await connected(gw.port, 4, f"{client_id}-pub")
    for i in range(8):
        await published(pub, 4, f"{client_id}/t", b"m%d" % i, pid=i + 1)
    sent = []
    for i in range(8):
        qos, _, pid, payload = publish_parts(await first.packet())
        assert (qos, payload) == (1, b"m%d" % i)
        if i < 5:
            await first.send(b"\x40\x02" + pid)  # the first five acknowledged
        else:
            sent.append(pid)
    await asyncio.sleep(0.1)  # the acks reach the session
    if not takeover:
        first.close()
    second = await connected(gw.port, 4, client_id, flags=0x00)
    resent = []
    for i in range(5, 8):
        packet = await second.packet()
        assert packet[0] == 0x3A, "QoS 1 with DUP"
        _, _, pid, payload = publish_parts(packet)
        assert payload == b"m%d" % i
        resent.append(pid)
        await second.send(b"\x40\x02" + pid)
    await published(pub, 4, f"{client_id}/t", b"new", pid=9)
    qos, _, pid, payload = publish_parts(await second.packet())
    assert (qos, payload) == (1, b"new") and pid not in resent
    if takeover:
        await first.until_eof()
    return sent + resent


async def test_a_resumed_session_resends_with_the_same_packet_ids(gw: Listener) -> None:
    """MQTT-4.4.0-1: unacknowledged PUBLISHes go again with their original packet ids."""
    ids = await unacked_then_resent(gw, "keep-ids", takeover=False)
    assert ids[:3] == ids[3:] and len(set(ids[:3])) == 3


async def test_a_taken_over_session_resends_with_the_same_packet_ids(gw: Listener) -> None:
    ids = await unacked_then_resent(gw, "keep-ids-t", takeover=True)
    assert ids[:3] == ids[3:] and len(set(ids[:3])) == 3


async def test_receive_maximum_holds_across_a_sessions_queue_and_shared_groups(
    gw: Listener,
) -> None:
    """MQTT-3.3.4-9: with receive maximum 2, no more than 2 QoS 1 PUBLISHes are unacked at
    once, though they come from the session's queue and a shared group's."""
    client = await connected(gw.port, 5, "rm-sub", cprops=props(b"\x21\x00\x02"))
    await client.send(subscribe(5, 1, ("rm/a/#", 1), ("$share/g/rm/b/#", 1)))
    assert (await client.packet())[0] == 0x90
    pub = await connected(gw.port, 4, "rm-pub")
    for i in range(3):
        await published(pub, 4, "rm/a/x", b"a%d" % i, pid=2 * i + 1)
        await published(pub, 4, "rm/b/x", b"b%d" % i, pid=2 * i + 2)
    unacked: list[bytes] = []
    received = 0
    deadline = asyncio.get_running_loop().time() + 10
    while received < 6:
        assert asyncio.get_running_loop().time() < deadline, f"{received} of 6 received"
        try:
            packet = await asyncio.wait_for(client.packet(), 0.3)
        except TimeoutError:
            if len(unacked) == 2:  # nothing more comes until an ack
                await client.send(b"\x40\x02" + unacked.pop(0))
            continue
        assert packet[0] >> 4 == 3 and packet[0] & 0x06 == 0x02, packet
        topic_size = struct.unpack("!H", packet[2:4])[0]
        unacked.append(packet[4 + topic_size : 6 + topic_size])
        received += 1
        assert len(unacked) <= 2, "past the client's receive maximum"


async def test_a_delivery_waiting_for_room_goes_with_its_shared_subscription(
    gw: Listener,
) -> None:
    """A shared group's message waiting for the client's receive maximum is not sent once
    the client unsubscribed from the group."""
    client = await connected(gw.port, 5, "rm-leave", cprops=props(b"\x21\x00\x01"))
    await client.send(subscribe(5, 1, ("rl/a/#", 1), ("$share/g/rl/b/#", 1)))
    assert (await client.packet())[0] == 0x90
    pub = await connected(gw.port, 4, "rl-pub")
    await published(pub, 4, "rl/a/x", b"own", pid=1)
    first = await client.packet()
    await published(pub, 4, "rl/b/x", b"shared", pid=2)  # waits: receive maximum 1
    await asyncio.sleep(0.2)
    await client.send(unsubscribe5(2, "$share/g/rl/b/#"))
    assert (await client.packet())[0] == 0xB0  # UNSUBACK
    topic_size = struct.unpack("!H", first[2:4])[0]
    await client.send(b"\x40\x02" + first[4 + topic_size : 6 + topic_size])
    await nothing_more(client, "sent after the unsubscribe", 0.5)


@pytest.mark.parametrize("takeover", [False, True])
async def test_a_retained_message_in_flight_is_resent_to_the_resumed_session(
    gw: Listener, takeover: bool
) -> None:
    """A retained QoS 1 message a persistent session got on SUBSCRIBE and had not
    acknowledged when its connection dropped (or was taken over) goes again, with DUP, its
    packet id and RETAIN."""
    pub = await connected(gw.port, 4, "rr-pub")
    await pub.send(publish(4, "rr/t", b"kept", qos=1, pid=1, flags=0x01))  # RETAIN
    assert await pub.packet() == b"\x40\x02\x00\x01"
    first = await connected(gw.port, 4, "rr-sub", flags=0x00)
    await first.send(subscribe(4, 1, ("rr/#", 1)))
    assert await first.packet() == SUBACK_QOS1
    packet = await first.packet()
    qos, topic, pid, payload = publish_parts(packet)
    assert (qos, topic, payload, packet[0] & 0x01) == (1, "rr/t", b"kept", 1)
    if not takeover:
        first.close()  # unacknowledged
    second = await connected(gw.port, 4, "rr-sub", flags=0x00)
    packet = await second.packet()
    assert packet[0] & 0x09 == 0x09, "DUP, and RETAIN as it went on SUBSCRIBE (MQTT-3.3.1-8)"
    assert publish_parts(packet) == (1, "rr/t", pid, b"kept")
    await second.send(b"\x40\x02" + pid)
    await nothing_more(second, "sent again", 0.3)


async def nothing_more(peer: Peer, what: str, wait: float = 0.5) -> None:
    """`peer` gets no packet within `wait` seconds; else fail with `what`."""
    with contextlib.suppress(TimeoutError):
        extra = await asyncio.wait_for(peer.packet(), wait)
        raise AssertionError(f"{what}: {extra!r}")


def unsubscribe5(pid: int, pattern: str) -> bytes:
    return frame(0xA2, struct.pack("!H", pid) + b"\x00" + s(pattern))


async def shared_qos2_in_flight(
    gw: Listener, name: str, cprops: bytes = b"\x00"
) -> tuple[Peer, bytes]:
    """Member `<name>-a` of group g on `<name>/#` (a persistent session with `cprops` that set
    an expiry) holds one QoS 2 message, `once`, unacknowledged: the member and the PUBLISH."""
    member = await connected(gw.port, 5, f"{name}-a", flags=0x00, cprops=cprops)
    await member.send(subscribe(5, 1, (f"$share/g/{name}/#", 2)))
    assert (await member.packet())[0] == 0x90
    pub = await connected(gw.port, 4, f"{name}-pub")
    await pub.send(publish(4, f"{name}/t", b"once", qos=2, pid=1))
    assert await pub.packet() == b"\x50\x02\x00\x01"  # PUBREC
    packet = await member.packet()
    qos, topic, _, payload = v5_publish_parts(packet)
    assert (qos, topic, payload) == (2, f"{name}/t", b"once")
    return member, packet


def v5_publish_parts(packet: bytes) -> tuple[int, str, bytes, bytes]:
    """QoS, topic, packet id bytes and payload of a v5 PUBLISH without properties."""
    qos, topic, pid, rest = publish_parts(packet)
    assert rest[:1] == b"\x00", "no properties"
    return qos, topic, pid, rest[1:]


async def test_a_shared_qos2_message_in_flight_waits_for_its_client(gw: Listener) -> None:
    """MQTT-4.8.2-4: a shared group's QoS 2 message in flight when its client's connection
    broke goes to that client when it reconnects (with DUP and its packet id), not to
    another member of the group."""
    expiry = props(u32(0x11, 300))
    first, packet = await shared_qos2_in_flight(gw, "sq", expiry)
    pid = v5_publish_parts(packet)[2]
    first.close()  # no PUBREC
    other = await connected(gw.port, 5, "sq-b")
    await other.send(subscribe(5, 1, ("$share/g/sq/#", 2)))
    assert (await other.packet())[0] == 0x90
    await nothing_more(other, "another member got it", 0.5)
    again = await connected(gw.port, 5, "sq-a", flags=0x00, cprops=expiry)
    packet = await again.packet()
    assert packet[0] & 0x08, "DUP"
    assert v5_publish_parts(packet) == (2, "sq/t", pid, b"once")
    await again.send(b"\x50\x02" + pid)  # PUBREC
    assert await again.packet() == b"\x62\x02" + pid  # PUBREL
    await again.send(b"\x70\x02" + pid)  # PUBCOMP


async def test_a_shared_qos2_message_in_flight_to_an_ended_session_goes_to_no_one(
    gw: Listener,
) -> None:
    """MQTT-4.8.2-5: once that client's session ended, no other member gets it."""
    first, _ = await shared_qos2_in_flight(gw, "se")  # expiry 0: it ends at the drop
    other = await connected(gw.port, 5, "se-b")
    await other.send(subscribe(5, 1, ("$share/g/se/#", 2)))
    assert (await other.packet())[0] == 0x90
    first.close()
    await nothing_more(other, "another member got it", 0.5)


def parts5(packet: bytes) -> tuple[int, bool, bytes, bytes]:
    """QoS, DUP, packet id and (properties + payload) of a v5 PUBLISH."""
    size = struct.unpack("!H", packet[2:4])[0]
    at = 4 + size
    return packet[0] >> 1 & 3, bool(packet[0] & 0x08), packet[at : at + 2], packet[at + 2 :]


async def test_ids_of_messages_not_yet_resent_survive_a_second_drop(gw: Listener) -> None:
    """A connection that ends before it resent all of the last one's messages keeps the
    ids of those it did not resend for the next."""
    expiry = u32(0x11, 300)
    first = await connected(gw.port, 5, "rk", flags=0x00, cprops=props(expiry))
    await first.send(subscribe(5, 1, ("rk/#", 1)))
    assert (await first.packet())[0] == 0x90
    pub = await connected(gw.port, 4, "rk-pub")
    for i in range(3):
        await published(pub, 4, "rk/t", b"m%d" % i, pid=i + 1)
    ids = {}
    for i in range(3):
        qos, dup, pid, rest = parts5(await first.packet())
        assert qos == 1 and rest.endswith(b"m%d" % i)
        ids[i] = pid
    await first.send(b"\x40\x02" + ids[0])  # m0 acknowledged; m1, m2 in flight
    await asyncio.sleep(0.2)
    first.close()
    await asyncio.sleep(0.3)

    # receive maximum 1: m1 is resent, m2 waits for room; the connection drops again
    second = await connected(gw.port, 5, "rk", flags=0x00, cprops=props(expiry + u16(0x21, 1)))
    qos, dup, pid, rest = parts5(await second.packet())
    assert rest.endswith(b"m1") and pid == ids[1] and dup
    await asyncio.sleep(0.3)
    second.close()
    await asyncio.sleep(0.3)

    third = await connected(gw.port, 5, "rk", flags=0x00, cprops=props(expiry))
    got = {}
    for _ in range(2):
        qos, dup, pid, rest = parts5(await third.packet())
        got[rest[-2:]] = (pid, dup)
        await third.send(b"\x40\x02" + pid)
    assert got[b"m1"] == (ids[1], True)
    assert got[b"m2"] == (ids[2], True), "m2 was sent (unacknowledged) with another id"
    third.close()
    pub.close()


async def published2(peer: Peer, topic: str, payload: bytes, pid: int) -> None:
    await peer.send(publish(4, topic, payload, qos=2, pid=pid))
    assert await peer.packet() == b"\x50\x02" + struct.pack("!H", pid)
    await peer.send(b"\x62\x02" + struct.pack("!H", pid))
    assert await peer.packet() == b"\x70\x02" + struct.pack("!H", pid)


@pytest.mark.parametrize("rc", [0x00, 0x80], ids=["pubrec-ok", "pubrec-failed"])
async def test_a_pubrec_lets_the_next_waiting_delivery_go(gw: Listener, rc: int) -> None:
    """A PUBREC that fails ends the exchange: the next delivery waiting for room goes."""
    sub = await connected(gw.port, 5, f"prc-sub{rc}", cprops=props(u16(0x21, 1)))
    await sub.send(subscribe(5, 1, ("prc/a/#", 2), ("$share/g/prc/b/#", 2)))
    assert (await sub.packet())[0] == 0x90
    pub = await connected(gw.port, 4, "prc-pub")
    await published2(pub, "prc/a/t", b"m0", 1)
    first = await sub.packet()
    await published2(pub, "prc/b/t", b"m1", 2)  # the shared group's: waits for room
    await asyncio.sleep(0.3)
    assert first[0] >> 4 == 3 and first.endswith(b"m0"), first
    size = struct.unpack("!H", first[2:4])[0]
    pid = first[4 + size : 6 + size]
    await sub.send(b"\x50\x03" + pid + bytes((rc,)))  # 0x80: unspecified error, exchange over
    if rc == 0:  # control: the exchange completes, PUBCOMP frees the slot
        assert await sub.packet() == b"\x62\x02" + pid
        await sub.send(b"\x70\x02" + pid)
    try:
        second = await asyncio.wait_for(sub.packet(), 3)
    except TimeoutError:
        raise AssertionError("m1 never sent though the receive maximum has room") from None
    assert second[0] >> 4 == 3 and second.endswith(b"m1"), second
    sub.close()
    pub.close()


async def test_a_qos2_message_of_a_group_left_before_the_drop(gw: Listener) -> None:
    """A shared QoS 2 message still in flight after the client left the group: the drop
    that follows ends the connection cleanly (the group's queue had the message back), and
    the session resumes."""
    expiry = props(u32(0x11, 300))
    first, _ = await shared_qos2_in_flight(gw, "lg", expiry)
    await first.send(unsubscribe5(2, "$share/g/lg/#"))
    assert (await first.packet())[0] == 0xB0  # UNSUBACK
    first.close()
    again = await Peer.open(gw.port)
    await again.send(connect(5, "lg-a", flags=0x00, cprops=expiry))
    ack = await again.packet()
    assert ack[0] == 0x20 and ack[2:4] == b"\x01\x00", "session present, accepted"


ONE_AT_A_TIME = props(u32(0x11, 300), u16(0x21, 1))  # session expiry 300 s, receive max 1


async def retained_one_at_a_time(gw: Listener, name: str, count: int) -> tuple[Peer, Peer, bytes]:
    """`count` retained QoS 1 messages on `<name>/<i>`, then a persistent v5 session
    `<name>-sub` with Receive Maximum 1 subscribing `<name>/#` with subscription id 7:
    the publisher, the subscriber and the one PUBLISH it got."""
    pub = await connected(gw.port, 4, f"{name}-pub")
    for i in range(count):
        await pub.send(publish(4, f"{name}/{i}", b"r%d" % i, qos=1, pid=i + 1, flags=0x01))
        assert await pub.packet() == b"\x40\x02\x00" + bytes((i + 1,))
    first = await connected(gw.port, 5, f"{name}-sub", flags=0x00, cprops=ONE_AT_A_TIME)
    await first.send(subscribe(5, 1, (f"{name}/#", 1), sprops=props(b"\x0b\x07")))
    assert (await first.packet())[0] == 0x90
    return pub, first, await first.packet()


async def test_retained_messages_waiting_for_room_go_to_the_resumed_session(
    gw: Listener,
) -> None:
    """Three retained QoS 1 messages for a subscription with id 7 and Receive Maximum 1:
    one goes, two wait (MQTT-3.3.4-9). The connection drops: the resumed session gets the
    one in flight again (DUP, its packet id), then the two pending transmission (part of
    the session state, §4.1), each as it went or would have gone on SUBSCRIBE: RETAIN=1
    and the subscription's id (MQTT-3.3.1-8 / -3.3.4-3), though that subscription is not
    Retain As Published."""
    pub, first, packet = await retained_one_at_a_time(gw, "rw", 3)
    qos, topic, pid, rest = publish_parts(packet)
    assert (qos, packet[0] & 0x09, rest) == (1, 0x01, b"\x02\x0b\x07" + b"r0")
    await nothing_more(first, "past receive maximum", 0.2)
    first.close()  # unacknowledged, two more waiting
    second = await connected(gw.port, 5, "rw-sub", flags=0x00, cprops=ONE_AT_A_TIME)
    got = []
    for _ in range(3):
        packet = await second.packet()
        qos, topic, again, rest = publish_parts(packet)
        assert (qos, packet[0] & 0x01, rest[:3]) == (1, 0x01, b"\x02\x0b\x07"), packet
        got.append((topic, rest[3:], bool(packet[0] & 0x08)))
        if not got[1:]:
            assert again == pid, "resent with its packet id (MQTT-4.4.0-1)"
        await second.send(b"\x40\x02" + again)
    assert got == [("rw/0", b"r0", True), ("rw/1", b"r1", False), ("rw/2", b"r2", False)]
    await nothing_more(second, "sent again", 0.3)
    pub.close()
    second.close()


def test_the_resend_notes_survive_the_stored_session_state() -> None:
    """What a resumed session needs to resend as it went is saved with the session (read
    back by another node, or this one after the connection's teardown)."""
    state = SessionState("noted", True, 300, queue="q")
    state.resend_ids = {"1-0": 3, "id:abc": 4}
    state.resend_shared = {"def": "$share/g/t/#"}
    state.resend_retained = {"abc": [1, [7]]}
    back = SessionState.loads("noted", state.dumps())
    assert (back.resend_ids, back.resend_shared, back.resend_retained) == (
        {"1-0": 3, "id:abc": 4},
        {"def": "$share/g/t/#"},
        {"abc": [1, [7]]},
    )


async def test_a_retained_message_keeps_its_resend_route_until_acknowledged(
    gw: Listener,
) -> None:
    """A retained message stored for the session's next connection, sent again and not
    acknowledged before that connection drops too, still goes as it did on SUBSCRIBE on
    the third: RETAIN=1 and the subscription's id; once acknowledged, it goes no more."""
    pub, first, packet = await retained_one_at_a_time(gw, "r2", 2)
    assert publish_parts(packet)[3].endswith(b"r0")  # r1 waits for room
    first.close()
    second = await connected(gw.port, 5, "r2-sub", flags=0x00, cprops=ONE_AT_A_TIME)
    packet = await second.packet()
    assert (publish_parts(packet)[1], packet[0] & 0x09) == ("r2/0", 0x09)  # DUP, RETAIN
    second.close()  # unacknowledged once more
    third = await connected(gw.port, 5, "r2-sub", flags=0x00, cprops=ONE_AT_A_TIME)
    seen = []
    for _ in range(2):
        packet = await third.packet()
        _, topic, pid, rest = publish_parts(packet)
        seen.append((topic, packet[0] & 0x01, rest[:3]))
        await third.send(b"\x40\x02" + pid)
    assert seen == [("r2/0", 1, b"\x02\x0b\x07"), ("r2/1", 1, b"\x02\x0b\x07")]
    await nothing_more(third, "sent again", 0.3)
    third.close()
    fourth = await connected(gw.port, 5, "r2-sub", flags=0x00, cprops=ONE_AT_A_TIME)
    await nothing_more(fourth, "acknowledged, yet sent again", 0.3)
    pub.close()
    fourth.close()
