"""Queue features through off-the-shelf clients: proton (AMQP 1.0), paho (MQTT 5), urllib
(admin API), over real sockets to in-process listeners, against a real Redis.

The broker-level tests (test_dead_letters, test_delayed, test_last_value, test_overflow,
test_priority, test_browse_select, test_permissions) pin the semantics; these pin what a
client sees on the wire. Covered elsewhere through a real client, and not repeated here:
browsing oldest to newest without taking anything (test_amqp_clients
test_browse_takes_nothing), a refused selector with amqp:invalid-field and its position
(test_amqp_clients test_selectors_symbolic_and_numeric_descriptor), dead-lettering of
rejected messages (test_amqp_clients test_dead_lettered_message_annotations), over-long
and reserved queue names and property equivalence over HTTP (test_admin_api
test_create_refuses_bad_specs, test_create_is_idempotent_and_checks_equivalence).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from proton import Disposition, Message, Terminus, Timeout, symbol
from proton.reactor import Selector
from proton.utils import BlockingConnection

from gateway.broker import Broker, QueueConfig
from gateway.engine.queues import DEAD_MESSAGE_QUEUE
from tests.conftest import Ports
from tests.test_admin_api import q
from tests.test_amqp_clients import Browse, queued, send_outcome
from tests.test_mqtt_paho import V5, Client

TIMEOUT = 5.0
QUIET = 0.3  # how long "nothing more arrives" is watched


def body(rcv, timeout: float = TIMEOUT) -> bytes:
    """The next message's body, accepted (copied while the message is alive: proton's body is
    a view into it)."""
    msg = rcv.receive(timeout)
    rcv.accept()
    return bytes(msg.body)


def pump(conn: BlockingConnection, seconds: float) -> None:
    """Let the connection process whatever arrives for `seconds`."""
    with contextlib.suppress(Timeout):
        conn.wait(lambda: False, timeout=seconds)


def drain(rcv, timeout: float = QUIET) -> list[bytes]:
    """Bodies of whatever else arrives within `timeout` (accepted)."""
    out = []
    while True:
        try:
            msg = rcv.receive(timeout)
        except Timeout:
            return out
        rcv.accept()
        out.append(bytes(msg.body))


def mqtt_props(**values: object) -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    for name, value in values.items():
        setattr(props, name, value)
    return props


async def until(predicate, timeout: float = TIMEOUT) -> None:
    """Poll an async predicate until true; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# -- 1. dead message queue by max_redelivery ------------------------------------------------


async def test_max_redelivery_dead_letters_over_amqp(broker: Broker, ports: Ports) -> None:
    await broker.declare_queue(QueueConfig(name=DEAD_MESSAGE_QUEUE, permission="consume"))
    await broker.declare_queue(QueueConfig(name="work", max_redelivery=2))

    def client() -> tuple[list[tuple[bytes, int]], dict, bytes, list[bytes]]:
        conn = ports.connect()
        try:
            snd = conn.create_sender("work")
            poison = Message(body=b"poison")
            poison.annotations = {symbol("x-opt-dmq-eligible"): True}
            snd.send(poison)
            snd.send(Message(body=b"plain"))  # not eligible: discarded after its last try
            rcv = conn.create_receiver("work", credit=10)
            seen = []
            for _ in range(6):  # 1 + max_redelivery deliveries each
                msg = rcv.receive(TIMEOUT)
                seen.append((bytes(msg.body), msg.delivery_count))
                rcv.fetcher.unsettled[0].local.failed = True
                rcv.release()  # modified, delivery-failed
            assert drain(rcv) == [], "no delivery past max_redelivery"
            dmq = conn.create_receiver(DEAD_MESSAGE_QUEUE, credit=10)
            dead = dmq.receive(TIMEOUT)
            dmq.accept()
            annotations = {str(k): v for k, v in dead.annotations.items()}
            return seen, annotations, bytes(dead.body), drain(dmq)
        finally:
            conn.close()

    seen, annotations, body, more_dead = await asyncio.to_thread(client)
    assert sorted(seen) == [(b"plain", n) for n in range(3)] + [(b"poison", n) for n in range(3)]
    assert body == b"poison" and more_dead == []
    assert annotations["x-origin-queue"] == "work"
    assert annotations["x-dmq-reason"] == "max_redelivered"
    assert await queued(broker, "work", 0) == 0
    counters = (await broker.queues.info("work")).counters
    assert counters["discarded"] == 1 and counters["dead_lettered"] == 1


# -- 2. time to live --------------------------------------------------------------------------


async def test_amqp_ttl_and_queue_max_ttl(broker: Broker, ports: Ports) -> None:
    await broker.declare_queue(QueueConfig(name="fresh", max_ttl_ms=400))

    def client() -> tuple[bytes, float, list[bytes]]:
        conn = ports.connect()
        try:
            snd = conn.create_sender("fresh")
            snd.send(Message(body=b"short", ttl=0.1))  # its own TTL runs out
            snd.send(Message(body=b"capped", ttl=60))  # the queue's 400 ms cap runs out first
            time.sleep(0.5)
            snd.send(Message(body=b"new", ttl=60))
            rcv = conn.create_receiver("fresh", credit=10)
            msg = rcv.receive(TIMEOUT)
            rcv.accept()
            return bytes(msg.body), msg.ttl, drain(rcv)
        finally:
            conn.close()

    body, ttl, rest = await asyncio.to_thread(client)
    assert body == b"new" and rest == [], "expired messages are never delivered"
    assert 0 < ttl <= 0.4, "header.ttl is the time the queue's cap leaves"
    assert (await broker.queues.info("fresh")).counters["expired"] == 2


async def test_mqtt5_message_expiry(broker: Broker, ports: Ports) -> None:
    def scenario() -> list[tuple[bytes, int]]:
        session = Properties(PacketTypes.CONNECT)
        session.SessionExpiryInterval = 60
        sub = Client(ports.mqtt, V5, "ttl-sub", clean=False, properties=session)
        sub.subscribe("ttl/t", 1)
        sub.close()
        pub = Client(ports.mqtt, V5, "ttl-pub")
        pub.publish("ttl/t", b"gone", 1, mqtt_props(MessageExpiryInterval=1))
        pub.publish("ttl/t", b"kept", 1, mqtt_props(MessageExpiryInterval=10))
        pub.close()
        time.sleep(1.1)  # MQTT expiry has whole seconds: "gone" expires, "kept" ages
        sub = Client(ports.mqtt, V5, "ttl-sub", clean=False, properties=session)
        try:
            got = [(m.payload, m.properties.MessageExpiryInterval) for m in sub.receive(1)]
            assert sub.nothing_more(), "the expired message is never delivered"
            return got
        finally:
            sub.close()

    [(payload, left)] = await asyncio.to_thread(scenario)
    assert payload == b"kept"
    assert 1 <= left <= 9, "the subscriber sees the remaining interval"


# -- 3. last value queues ---------------------------------------------------------------------


async def test_last_value_queue_keeps_the_last_over_amqp(broker: Broker, ports: Ports) -> None:
    await broker.declare_queue(QueueConfig(name="last", max_spool_bytes=0), [("prices/>", "smf")])

    def client() -> list[bytes]:
        conn = ports.connect()
        try:
            snd = conn.create_sender("topic://prices/x")
            for i in range(5):
                snd.send(Message(body=f"v{i}".encode()))
            return drain(conn.create_receiver("last", credit=10), TIMEOUT / 5)
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == [b"v4"]


async def test_lvq_key_from_amqp_and_mqtt5_properties(broker: Broker, ports: Ports) -> None:
    await broker.declare_queue(QueueConfig(name="ticks", lvq_key="symbol"), [("ticks/#", "mqtt")])

    def scenario() -> tuple[list[tuple[bytes, str]], int]:
        conn = ports.connect()
        pub = Client(ports.mqtt, V5, "ticker")
        try:
            snd = conn.create_sender("topic://ticks/a")
            snd.send(Message(body=b"a1", properties={"symbol": "AAA"}))
            pub.publish("ticks/b", b"b1", 1, mqtt_props(UserProperty=[("symbol", "BBB")]))
            pub.publish("ticks/a", b"a2", 1, mqtt_props(UserProperty=[("symbol", "AAA")]))
            snd.send(Message(body=b"b2", properties={"symbol": "BBB"}))
            browser = conn.create_receiver("ticks", name="b", credit=10, options=Browse())
            mode = browser.link.remote_source.distribution_mode
            seen = []
            while True:
                try:
                    msg = browser.receive(QUIET)
                except Timeout:
                    return seen, mode
                browser.accept()
                seen.append((bytes(msg.body), msg.properties["symbol"]))
        finally:
            pub.close()
            conn.close()

    seen, mode = await asyncio.to_thread(scenario)
    assert seen == [(b"a2", "AAA"), (b"b2", "BBB")], "one per key, newest last"
    assert mode == Terminus.DIST_MODE_COPY
    assert await queued(broker, "ticks", 2) == 2, "browsing left both"


# -- 4. priority ------------------------------------------------------------------------------


async def test_priority_order_over_amqp(broker: Broker, ports: Ports) -> None:
    await broker.declare_queue(QueueConfig(name="urgent", priorities=True))
    sent = [(1, "l1"), (9, "h1"), (4, "m1"), (9, "h2"), (1, "l2"), (4, "m2"), (0, "z1")]

    def client() -> list[tuple[str, int]]:
        conn = ports.connect()
        try:
            snd = conn.create_sender("urgent")
            for priority, body in sent:
                snd.send(Message(body=body.encode(), priority=priority))
            rcv = conn.create_receiver("urgent", credit=10)
            got = []
            for _ in sent:
                msg = rcv.receive(TIMEOUT)
                rcv.accept()
                got.append((bytes(msg.body).decode(), msg.priority))
            return got
        finally:
            conn.close()

    got = await asyncio.to_thread(client)
    assert [body for body, _ in got] == ["h1", "h2", "m1", "m2", "l1", "l2", "z1"]
    assert [p for _, p in got] == [9, 9, 4, 4, 1, 1, 0]


# -- 5. browsing, non-destructive queues, replay ----------------------------------------------
# Browsing: test_amqp_clients test_browse_takes_nothing. A replay period (bind replay_ms)
# has no client-side form: the AMQP adapter does not map any source filter to it, so it is
# reachable through the broker API only (test_browse_select).


async def test_non_destructive_queue_every_consumer_gets_everything(
    broker: Broker, ports: Ports
) -> None:
    await broker.declare_queue(QueueConfig(name="board", non_destructive=True))

    def client() -> list[tuple[list[bytes], int]]:
        conns = [ports.connect() for _ in range(2)]
        try:
            snd = conns[0].create_sender("board")
            for i in range(3):
                snd.send(Message(body=f"n{i}".encode()))
            receivers = [c.create_receiver("board", name="r", credit=10) for c in conns]
            out = []
            for rcv in receivers:  # two plain consumers: neither asked to browse
                got = [body(rcv) for _ in range(3)]
                out.append((got, rcv.link.remote_source.distribution_mode))
            return out
        finally:
            for c in conns:
                c.close()

    expected = [b"n0", b"n1", b"n2"]
    for got, mode in await asyncio.to_thread(client):
        assert got == expected
        assert mode == Terminus.DIST_MODE_COPY  # the client is told it browses
    assert await queued(broker, "board", 3) == 3


# -- 6. selectors -----------------------------------------------------------------------------
# A refused selector (amqp:invalid-field, with the position) and the echoed filter:
# test_amqp_clients test_selectors_symbolic_and_numeric_descriptor.


async def test_selector_leaves_the_rest_for_another_receiver(broker: Broker, ports: Ports) -> None:
    await broker.declare_queue(QueueConfig(name="paint"))

    def client() -> tuple[list[bytes], list[bytes]]:
        conn = ports.connect()
        try:
            snd = conn.create_sender("paint")
            for i, colour in enumerate(["red", "blue", "red", "green"]):
                snd.send(Message(body=f"{colour}{i}".encode(), properties={"colour": colour}))
            reds = conn.create_receiver(
                "paint", name="reds", credit=10, options=Selector("colour = 'red'")
            )
            matched = drain(reds)
            others = drain(conn.create_receiver("paint", name="rest", credit=10))
            return matched, others
        finally:
            conn.close()

    matched, others = await asyncio.to_thread(client)
    assert matched == [b"red0", b"red2"]
    assert others == [b"blue1", b"green3"]
    assert await queued(broker, "paint", 0) == 0


# -- 7. overflow policies ---------------------------------------------------------------------


async def test_reject_overflow_amqp_and_mqtt5(broker: Broker, ports: Ports) -> None:
    await broker.declare_queue(QueueConfig(name="small", max_messages=2), [("full/#", "mqtt")])

    def scenario() -> tuple[list[tuple[int, str | None]], int]:
        conn = ports.connect()
        try:
            snd = conn.create_sender("small")
            outcomes = [send_outcome(conn, snd, Message(body=f"m{i}".encode())) for i in range(3)]
        finally:
            conn.close()
        pub = Client(ports.mqtt, V5, "overflow-pub")
        reasons: list[int] = []
        pub.c.on_publish = lambda _c, _u, _mid, reason, _p: reasons.append(reason.value)
        try:
            pub.publish("full/x", b"one too many", 1)
        finally:
            pub.close()
        return outcomes, reasons[0]

    outcomes, puback = await asyncio.to_thread(scenario)
    accepted = (Disposition.ACCEPTED, None)
    assert outcomes == [accepted, accepted, (Disposition.REJECTED, "amqp:resource-limit-exceeded")]
    assert puback == 0x97
    assert await queued(broker, "small", 2) == 2


async def test_ring_overflow_drops_the_oldest(broker: Broker, ports: Ports) -> None:
    await broker.declare_queue(QueueConfig(name="ring", max_messages=3, overflow="ring"))

    def client() -> tuple[list[tuple[int, str | None]], list[bytes]]:
        conn = ports.connect()
        try:
            snd = conn.create_sender("ring")
            outcomes = [send_outcome(conn, snd, Message(body=f"r{i}".encode())) for i in range(6)]
            return outcomes, drain(conn.create_receiver("ring", credit=10))
        finally:
            conn.close()

    outcomes, got = await asyncio.to_thread(client)
    assert outcomes == [(Disposition.ACCEPTED, None)] * 6, "the publisher is never refused"
    assert got == [b"r3", b"r4", b"r5"]
    assert (await broker.queues.info("ring")).counters["dropped"] == 3


async def test_flow_control_withholds_the_outcome_until_drained(
    broker: Broker, ports: Ports
) -> None:
    await broker.declare_queue(
        QueueConfig(name="paced", max_messages=4, overflow="flow_control", resume_percent=50)
    )

    def client() -> tuple[list[bool], list[bool], list[int], list[bytes]]:
        conn = ports.connect()  # one connection: its event loop serves both links
        try:
            snd = conn.create_sender("paced")
            dlvs = [snd.link.send(Message(body=f"p{i}".encode())) for i in range(6)]
            conn.wait(lambda: sum(d.settled for d in dlvs) >= 4, timeout=TIMEOUT)
            pump(conn, QUIET)
            full = [d.settled for d in dlvs]
            rcv = conn.create_receiver("paced", credit=1)
            got = [body(rcv) for _ in range(2)]  # depth 4 -> 2: not below 50%: still held
            pump(conn, QUIET)
            held = [d.settled for d in dlvs]
            got.append(body(rcv))  # depth 1: publishing resumes
            conn.wait(lambda: all(d.settled for d in dlvs), timeout=TIMEOUT)
            got += [body(rcv) for _ in range(3)]
            return full, held, [d.remote_state for d in dlvs], got
        finally:
            conn.close()

    full, held, states, got = await asyncio.to_thread(client)
    assert full == [True] * 4 + [False] * 2, "the outcome of the overflowing sends waits"
    assert held == full
    assert states == [Disposition.ACCEPTED] * 6
    assert got == [f"p{i}".encode() for i in range(6)], "nothing lost, in order"


# -- 8. hold until valid ----------------------------------------------------------------------


@pytest.mark.parametrize("annotation", ["x-opt-delivery-time", "x-opt-delivery-delay"])
async def test_delivery_time_annotation_holds_the_message(
    broker: Broker, ports: Ports, annotation: str
) -> None:
    """Qpid JMS sends the time (epoch ms), Artemis's clients the delay (ms) too."""
    await broker.declare_queue(QueueConfig(name="later"))

    def client() -> tuple[list[bytes], list[bytes], float, int]:
        conn = ports.connect()
        try:
            snd = conn.create_sender("later")
            due = int(time.time() * 1000) + 700
            held = Message(body=b"held")
            at = due if annotation == "x-opt-delivery-time" else 700
            held.annotations = {symbol(annotation): at}
            snd.send(held)
            snd.send(Message(body=b"now"))
            rcv = conn.create_receiver("later", credit=10)
            early = drain(rcv)
            msg = rcv.receive(TIMEOUT)
            arrived = time.time() * 1000
            rcv.accept()
            return early, [bytes(msg.body)], arrived - due, msg.delivery_count
        finally:
            conn.close()

    early, late, lateness, count = await asyncio.to_thread(client)
    assert early == [b"now"], "not delivered before its delivery time"
    assert late == [b"held"] and lateness >= 0
    assert count == 0, "holding is no delivery attempt"


# -- 9. declaration -------------------------------------------------------------------------
# Over-long and reserved names and the equivalence of access_type / durable:
# test_admin_api test_create_refuses_bad_specs / test_create_is_idempotent_and_checks_equivalence.


async def test_declared_auto_delete_queue_goes_with_its_last_amqp_consumer(
    ports: Ports,
) -> None:
    admin = ports.admin
    declared = await admin.create("scratch", durable=False, auto_delete=True)
    assert declared.status == 201
    assert (declared.body["durable"], declared.body["auto_delete"]) == (False, True)
    assert (await admin.create("scratch", durable=False, auto_delete=True)).status == 200
    other = await admin.create("scratch", durable=False, auto_delete=False)
    assert other.status == 409 and "auto_delete" in other.error
    exclusive = await admin.create("scratch", access_type="exclusive", durable=False)
    assert exclusive.status == 409 and "access_type" in exclusive.error

    def client() -> bytes:
        conn = ports.connect()
        try:
            sender = conn.create_sender("scratch")
            sender.send(Message(body=b"x"))
            first = conn.create_receiver("scratch", name="a", credit=1)
            second = conn.create_receiver("scratch", name="b", credit=0)
            msg = first.receive(TIMEOUT)
            first.accept()
            first.close()
            pump(conn, QUIET)
            late = conn.create_sender("scratch", name="late")  # one consumer left: still there
            assert send_outcome(conn, late, Message(body=b"y")) == (Disposition.ACCEPTED, None)
            sender.close()  # the queue's deletion detaches senders still attached to it,
            late.close()  # which the blocking client raises from whatever it waits for
            second.close()
            return bytes(msg.body)
        finally:
            conn.close()

    assert await asyncio.to_thread(client) == b"x"

    async def gone() -> bool:
        return (await admin.get(q("scratch"))).status == 404

    await until(gone)


async def test_a_non_destructive_auto_delete_queue_goes_with_its_last_amqp_consumer(
    ports: Ports,
) -> None:
    """Its consumers browse (Qpid non-destructive consumers) and are consumers all the
    same: the queue stays while one is attached, and goes with the last."""
    admin = ports.admin
    assert (await admin.create("board", non_destructive=True, auto_delete=True)).status == 201

    def client() -> list[bytes]:
        conns = [ports.connect() for _ in range(2)]
        try:
            conns[0].create_sender("board").send(Message(body=b"x"))
            first, second = (c.create_receiver("board", name="r", credit=10) for c in conns)
            got = [body(first), body(second)]
            first.close()
            pump(conns[0], QUIET)
            late = conns[0].create_sender("board", name="late")  # one consumer left: still there
            assert send_outcome(conns[0], late, Message(body=b"y")) == (Disposition.ACCEPTED, None)
            got.append(body(second))
            second.close()
            return got
        finally:
            for c in conns:
                c.close()

    assert await asyncio.to_thread(client) == [b"x", b"x", b"y"]

    async def gone() -> bool:
        return (await admin.get(q("board"))).status == 404

    await until(gone)


# -- regressions ------------------------------------------------------------------------------


async def test_accept_from_a_receiver_without_credit_reaches_the_queue(
    broker: Broker, ports: Ports
) -> None:
    """proton refills credit on receipt, so the next message uses it up before the accept of
    the first arrives: that accept must still be applied at once, not with a later event."""
    await broker.declare_queue(QueueConfig(name="one"))

    accepted, checked = threading.Event(), threading.Event()

    def client() -> bytes:
        conn = ports.connect()
        try:
            snd = conn.create_sender("one")
            for i in range(5):
                snd.send(Message(body=f"o{i}".encode()))
            got = body(conn.create_receiver("one", credit=1))
            pump(conn, 0.05)  # the accept goes out; the receiver holds more, no credit left
            accepted.set()
            checked.wait(TIMEOUT)  # the connection stays open meanwhile
            return got
        finally:
            conn.close()

    task = asyncio.create_task(asyncio.to_thread(client))
    assert await asyncio.to_thread(accepted.wait, TIMEOUT)
    try:

        async def acked() -> bool:
            return (await broker.queues.info("one")).messages == 4

        await until(acked, timeout=1.0)  # promptly, while the connection is open
    finally:
        checked.set()
    assert await task == b"o0"
