"""Retained messages through the MQTT adapter: paho 3.1.1 / 5 and mosquitto_sub."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest
from paho.mqtt.subscribeoptions import SubscribeOptions

from gateway.broker import Broker
from gateway.engine import keys
from gateway.engine.clients import RETAINED_BATCH
from gateway.model import Message
from gateway.model import encode as encode_message
from protocols.mqtt.codec import (
    Connack,
    Connect,
    Properties,
    Puback,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Will,
    encode,
)
from protocols.mqtt.listener import Listener
from protocols.mqtt.session import MAX_WAITING, Session
from tests.test_engine import retained_matching, wait_for
from tests.test_mqtt_paho import V5, V311, WAIT, Client
from tests.test_mqtt_protocol import Raw
from tests.test_mqtt_subscribe import publishes


@pytest.mark.parametrize("version", [V311, V5], ids=["v311", "v5"])
async def test_retained_sent_to_new_subscriptions(mqtt: Listener, version: int) -> None:
    def scenario() -> None:
        pub = Client(mqtt.port, version, "r-pub")
        pub.c.publish("r/a", b"A", 1, retain=True).wait_for_publish(WAIT)
        pub.c.publish("r/b", b"B", 0, retain=True).wait_for_publish(WAIT)
        pub.c.publish("r/gone", b"G", 1, retain=True).wait_for_publish(WAIT)
        pub.c.publish("r/gone", b"", 1, retain=True).wait_for_publish(WAIT)  # clears it
        sub = Client(mqtt.port, version, "r-sub")
        try:
            sub.subscribe("r/#", 1)
            got = sorted(sub.receive(2), key=lambda m: m.topic)
            assert [(m.topic, m.payload, m.qos, m.retain) for m in got] == [
                ("r/a", b"A", 1, True),
                ("r/b", b"B", 0, True),
            ]
            pub.c.publish("r/a", b"A2", 1, retain=True).wait_for_publish(WAIT)
            (live,) = sub.receive(1)  # to an existing subscription: RETAIN 0
            assert (live.payload, live.retain) == (b"A2", False)
            assert sub.nothing_more()
        finally:
            sub.close()
            pub.close()

    await asyncio.to_thread(scenario)


async def test_v5_retain_handling_and_retain_as_published(mqtt: Listener) -> None:
    def scenario() -> None:
        pub = Client(mqtt.port, V5, "rh-pub")
        pub.c.publish("rh/x", b"kept", 1, retain=True).wait_for_publish(WAIT)
        sub = Client(mqtt.port, V5, "rh-sub")

        def subscribe(topic: str, handling: int, rap: bool = False) -> None:
            opts = SubscribeOptions(qos=1, retainHandling=handling, retainAsPublished=rap)
            sub.c.subscribe(topic, options=opts)
            sub.subacks.get(timeout=WAIT)

        try:
            subscribe("rh/+", 1)  # 1: only for a new subscription
            assert [m.payload for m in sub.receive(1)] == [b"kept"]
            subscribe("rh/+", 1)
            assert sub.nothing_more()
            subscribe("rh/#", 2)  # 2: never
            assert sub.nothing_more()
            subscribe("rh/+", 0)  # 0: at every subscribe
            (again,) = sub.receive(1)
            assert again.retain
            subscribe("rh/x", 2, rap=True)  # RAP: a live retained message keeps RETAIN 1
            pub.c.publish("rh/x", b"new", 1, retain=True).wait_for_publish(WAIT)
            (live,) = sub.receive(1)  # one delivery although three filters match
            assert (live.payload, live.retain) == (b"new", True)
            assert sub.nothing_more()
        finally:
            sub.close()
            pub.close()

    await asyncio.to_thread(scenario)


@pytest.mark.skipif(shutil.which("mosquitto_sub") is None, reason="mosquitto clients missing")
@pytest.mark.parametrize("version", ["mqttv311", "mqttv5"])
async def test_mosquitto_sub_retained_only(mqtt: Listener, version: str) -> None:
    port = str(mqtt.port)
    for topic, payload in (("ms/1", "one"), ("ms/2", "two")):
        pub = await asyncio.create_subprocess_exec(
            "mosquitto_pub", "-h", "127.0.0.1", "-p", port, "-V", version, "-q", "1",
            "-r", "-t", topic, "-m", payload,
        )  # fmt: skip
        assert await asyncio.wait_for(pub.wait(), WAIT) == 0
    sub = await asyncio.create_subprocess_exec(
        "mosquitto_sub", "-h", "127.0.0.1", "-p", port, "-V", version, "-q", "1",
        "-t", "ms/#", "--retained-only", "-C", "2", "-W", "5", "-v",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(sub.communicate(), WAIT * 2)
    assert sub.returncode == 0
    assert sorted(out.decode().splitlines()) == ["ms/1 one", "ms/2 two"]


async def test_retained_will(mqtt: Listener) -> None:
    raw, _ = await Raw.connected(
        mqtt.port, 5, client_id="dies", will=Will("st/dies", b"offline", 1, retain=True)
    )
    raw.writer.transport.abort()  # abnormal: the will is published, and retained
    await asyncio.sleep(0.3)
    late, _ = await Raw.connected(mqtt.port, 5, client_id="late")
    await late.send(Subscribe(1, [("st/+", SubscriptionOptions(qos=1))]))
    assert await late.recv() == Suback(1, [1])
    got = await late.recv()
    assert isinstance(got, Publish) and (got.payload, got.retain) == (b"offline", True)
    late.close()


async def test_a_new_subscription_gets_no_retained_value_older_than_live_ones(
    mqtt: Listener,
) -> None:
    """MQTT-4.6.0-6 (a topic's messages in order), as Mosquitto: while a publisher keeps
    updating a retained topic, a new QoS 0 subscriber never gets the retained value after
    newer live ones (it was read once the subscription was live: it came last)."""
    topic = "ret-order/t"
    pub, _ = await Raw.connected(mqtt.port, 4, client_id="ret-order-pub")
    stop = asyncio.Event()

    async def publish() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            pub.writer.write(encode(Publish(topic, b"%d" % i, qos=0, retain=True), 4))
            if i % 5 == 0:
                await pub.writer.drain()
                await asyncio.sleep(0.001)

    task = asyncio.create_task(publish())
    await asyncio.sleep(0.2)
    backwards = []
    try:
        for k in range(15):
            sub, _ = await Raw.connected(mqtt.port, 4, client_id=f"ret-order-{k}")
            await sub.send(Subscribe(1, [(topic, SubscriptionOptions(qos=0))]))
            seen: list[int] = []
            while len(seen) < 15:
                p = await sub.recv()
                if isinstance(p, Publish):
                    seen.append(int(p.payload))
            sub.close()
            if any(b < a for a, b in itertools.pairwise(seen)):
                backwards.append(seen)
    finally:
        stop.set()
        await task
        pub.close()
    assert not backwards, backwards[:2]


async def _publishes(raw: Raw, timeout: float, ack: bool = True) -> list[Publish]:
    """What `raw` receives until `timeout` seconds pass without a packet (QoS 1 acked)."""
    got = []
    with contextlib.suppress(TimeoutError):
        while True:
            packet = await raw.recv(timeout=timeout)
            if isinstance(packet, Publish):
                got.append(packet)
                if packet.qos and ack:
                    await raw.send(Puback(packet.packet_id))
    return got


async def test_a_retained_message_held_by_a_delivery_delay_takes_the_topic_when_due(
    mqtt: Listener,
) -> None:
    """Until it is due, new subscribers get the value before it, as live ones last heard."""
    early, _ = await Raw.connected(mqtt.port, 5, client_id="dl-early")
    await early.send(Subscribe(1, [("dl/t", SubscriptionOptions(qos=1))]))
    await early.recv()  # SUBACK
    pub, _ = await Raw.connected(mqtt.port, 5, client_id="dl-pub")
    await pub.send(Publish("dl/t", b"now", qos=1, retain=True, packet_id=1))
    assert isinstance(await pub.recv(), Puback)
    delay = Properties(user_properties=[("x-opt-delivery-delay", "1500")])
    await pub.send(Publish("dl/t", b"later", qos=1, retain=True, packet_id=2, properties=delay))
    assert isinstance(await pub.recv(), Puback)
    before, _ = await Raw.connected(mqtt.port, 5, client_id="dl-before")
    await before.send(Subscribe(1, [("dl/t", SubscriptionOptions(qos=1))]))
    assert [p.payload for p in await _publishes(before, 0.5)] == [b"now"]  # not "later" yet
    assert [p.payload for p in await _publishes(early, 0.1)] == [b"now"]
    await asyncio.sleep(1.2)
    after, _ = await Raw.connected(mqtt.port, 5, client_id="dl-after")
    await after.send(Subscribe(1, [("dl/t", SubscriptionOptions(qos=1))]))
    assert [(p.payload, p.retain) for p in await _publishes(after, 0.5)] == [(b"later", True)]
    assert [p.payload for p in await _publishes(early, 0.3)] == [b"later"]  # live, once
    assert [p.payload for p in await _publishes(before, 0.1)] == []  # subscribed after it


def _held(topic: str, payload: bytes, due_in_ms: int | None) -> Message:
    due = None if due_in_ms is None else int(time.time() * 1000) + due_in_ms
    return Message(destination=topic, payload=payload, retain=True, not_before=due)


async def _value(broker: Broker, topic: str) -> bytes | None:
    found = await retained_matching(broker, topic)
    return found[0].payload if found else None


@pytest.mark.parametrize("wildcard", [False, True], ids=["exact", "wildcard"])
async def test_held_retained_messages_take_the_topic_in_the_order_they_fall_due(
    broker: Broker, wildcard: bool
) -> None:
    """What live subscribers hear last is the value: a held message published before an
    unheld one still wins once due, a later one due sooner goes before it, a held clear
    clears when due, and another topic's held message is not this topic's."""
    read = "dd/#" if wildcard else "dd/t"
    await broker.retained.put(_held("dd/t", b"v0", None))
    await broker.retained.put(_held("dd/t", b"slow", 900))
    await broker.retained.put(_held("dd/t", b"fast", 300))
    await broker.retained.put(_held("dd/t", b"v1", None))  # published last, heard before both
    await broker.retained.put(_held("dd/t", b"", 1300))  # a clear, held
    await broker.retained.put(_held("dd/tt", b"other", 0))
    assert await _value(broker, read) == b"v1"
    await asyncio.sleep(0.5)
    assert await _value(broker, read) == b"fast"
    await asyncio.sleep(0.6)
    assert await _value(broker, read) == b"slow"
    await broker.retained.put(_held("de/u", b"x", None))  # another topic: promotes nothing here
    assert await _value(broker, read) == b"slow"
    await asyncio.sleep(0.5)
    found = await retained_matching(broker, read)
    assert [(m.destination, m.payload) for m in found] == (
        [("dd/tt", b"other")] if wildcard else []
    )
    await broker.retained.put(_held("dd/t", b"v2", None))  # stored over what fell due
    assert await _value(broker, "dd/t") == b"v2"
    assert not await broker.redis.exists(keys.retained_held("dd/t"))  # nothing left held
    assert await broker.redis.smembers(keys.retained_held_topics) == set()


async def test_a_held_retained_value_stored_before_held_ones_waited_apart_shows_when_due(
    broker: Broker,
) -> None:
    """Stored as the topic's value with its delivery time (as it was before held messages
    waited apart): it is not shown before it is due, by an exact or a wildcard read."""
    msg = _held("old/t", b"later", 400)
    await broker.redis.hset(keys.retained, "old/t", encode_message(msg))
    assert await retained_matching(broker, "old/t") == []
    assert await retained_matching(broker, "old/#") == []
    await asyncio.sleep(0.5)
    assert [m.payload for m in await retained_matching(broker, "old/#")] == [b"later"]


async def test_a_wildcard_read_takes_what_fell_due_at_the_instant_it_reads_the_topic(
    broker: Broker,
) -> None:
    """A held message falls due; a newer value is stored afterwards: that one is the
    topic's, whatever fell due between a scan's steps."""
    await broker.retained.put(_held("wr/t", b"held", 200))
    await asyncio.sleep(0.3)  # due, not yet promoted: no store since
    assert [m.payload for m in await retained_matching(broker, "wr/#")] == [b"held"]
    await broker.retained.put(_held("wr/t", b"newer", None))
    assert [m.payload for m in await retained_matching(broker, "wr/#")] == [b"newer"]
    assert [m.payload for m in await retained_matching(broker, "wr/t")] == [b"newer"]


async def test_a_wildcard_read_sees_what_a_store_between_its_scans_left(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """V is the value, H falls due over it, and W is stored while the read scans: the read
    gives W or H, never V, which H replaced already."""
    await broker.retained.put(_held("sc/t", b"V", None))
    await broker.retained.put(_held("sc/t", b"H", 200))
    await asyncio.sleep(0.3)  # H is due: not promoted, no store since
    started = []

    def second_after_a_store(name: str):  # W is stored as the read's second scan starts
        scan = getattr(broker.redis, name)

        def scanning(*args, **kwargs):
            async def scanned():
                started.append(name)
                if len(started) == 2:
                    await broker.retained.put(_held("sc/t", b"W", None))
                async for item in scan(*args, **kwargs):
                    yield item

            return scanned()

        return scanning

    for name in ("hscan_iter", "sscan_iter"):
        monkeypatch.setattr(broker.redis, name, second_after_a_store(name))
    assert [m.payload for m in await retained_matching(broker, "sc/#")] == [b"W"]
    assert len(started) == 2


async def test_a_topic_whose_held_messages_all_fell_due_is_no_held_topic_once_read(
    broker: Broker,
) -> None:
    await broker.retained.put(_held("gone/t", b"H", 100))
    await asyncio.sleep(0.2)
    assert [m.payload for m in await retained_matching(broker, "gone/#")] == [b"H"]
    assert not await broker.redis.exists(keys.retained_held("gone/t"))
    assert await broker.redis.smembers(keys.retained_held_topics) == set()


async def test_expired_retained_messages_leave_the_store_and_crowd_out_no_live_one(
    mqtt: Listener, broker: Broker
) -> None:
    """MQTT 5 §3.3.2.3.3: the server deletes its copy of an expired message. Expired
    retained ones stayed stored for good, and took the places of a subscriber's first
    1,000 retained messages, so a live one after them was dropped."""
    expiration = int(time.time() * 1000) + 300
    stored = [
        broker.publish(Message(f"crowd/a{i:04d}", b"old", retain=True, expiration=expiration))
        for i in range(1000)
    ]
    assert all(outcome.accepted for outcome in await asyncio.gather(*stored))
    assert (await broker.publish(Message("crowd/z", b"live", retain=True))).accepted
    await asyncio.sleep(max(0.0, expiration / 1000 - time.time()) + 0.1)

    def subscribe() -> list[str]:
        sub = Client(mqtt.port, V5, "crowd-sub")
        try:
            sub.subscribe("crowd/#", 1)
            [message] = sub.receive(1)
            assert sub.nothing_more(0.5)
            return [message.topic]
        finally:
            sub.close()

    assert await asyncio.to_thread(subscribe) == ["crowd/z"]
    assert await broker.redis.hkeys(keys.retained) == [b"crowd/z"]


def transmits(session: Session) -> Callable[[], int]:
    """How many messages `session` has sent so far: a spy on `_transmit` that counts, then
    calls the real one."""
    sent = 0
    transmit = session._transmit

    def counting(*args: Any) -> None:
        nonlocal sent
        sent += 1
        transmit(*args)

    session._transmit = counting  # type: ignore[method-assign]
    return lambda: sent


async def test_many_retained_messages_go_out_in_batches_between_other_work(
    broker: Broker, mqtt: Listener
) -> None:
    """SUBSCRIBE '#' over 100,000 retained messages decoded and sent them all in one turn
    of the event loop, holding every other client near a second. A probe task, woken each
    turn, now sees some of them sent and some not; the subscriber still gets every one, in
    topic order."""
    total = 4 * RETAINED_BATCH
    topics = [f"many/{i:05d}" for i in range(total)]
    stored = [broker.retained.put(Message(t, b"v", retain=True)) for t in topics]
    assert all(await asyncio.gather(*stored))
    sub = await asyncio.to_thread(Client, mqtt.port, V5, "many-sub")
    sent = transmits(mqtt.registry.sessions["many-sub"])
    seen: list[int] = []

    async def probe() -> None:
        while True:
            seen.append(sent())
            await asyncio.sleep(0)

    probing = asyncio.create_task(probe())

    def subscribe() -> list[str]:
        try:
            sub.subscribe("many/#", 0)
            return [message.topic for message in sub.receive(total)]
        finally:
            sub.close()

    try:
        assert await asyncio.to_thread(subscribe) == topics
    finally:
        probing.cancel()
    assert sent() == total
    assert any(0 < count < total for count in seen), sorted(set(seen))


SLOW_PAYLOAD = b"p" * 16384


async def stuck_subscriber(
    broker: Broker, mqtt: Listener, client_id: str, keep_alive: int = 0
) -> tuple[Raw, Session, list[str], Callable[[], int]]:
    """A client with a small receive buffer that subscribes to `slow/#` over 32 MiB of
    retained messages and reads nothing for now: its SUBSCRIBE waits for its socket. The
    topics in order, and how many messages went to it."""
    topics = [f"slow/{i:05d}" for i in range(8 * RETAINED_BATCH)]
    stored = [broker.retained.put(Message(t, SLOW_PAYLOAD, retain=True)) for t in topics]
    assert all(await asyncio.gather(*stored))
    raw = await Raw.open(mqtt.port, 5, rcvbuf=4096)
    await raw.send(Connect(protocol_level=5, client_id=client_id, keep_alive=keep_alive))
    assert isinstance(await raw.recv(), Connack)
    session = mqtt.registry.sessions[client_id]
    sent = transmits(session)
    await raw.send(Subscribe(1, [("slow/#", SubscriptionOptions(qos=0))]))
    await wait_for(lambda: not session.link.writable)
    return raw, session, topics, sent


async def test_retained_messages_for_a_client_not_reading_wait_for_its_socket(
    broker: Broker, mqtt: Listener
) -> None:
    """32 MiB of retained messages for a client that reads nothing for now: sent all at
    once they sat in the node's memory, and sent batch by batch without waiting they
    passed the buffer cap that drops a client as one not reading. The batches wait while
    its socket is backed up; once it reads, it gets every one, in topic order."""
    raw, _, topics, sent = await stuck_subscriber(broker, mqtt, "slow-sub")
    try:
        await asyncio.sleep(0.3)  # while the client reads nothing, no more goes
        assert sent() < len(topics)
        got: list[str] = []
        while len(got) < len(topics):
            packet = await raw.recv()
            if isinstance(packet, Publish):
                assert packet.payload == SLOW_PAYLOAD
                got.append(packet.topic)
        assert got == topics
    finally:
        raw.close()


async def test_a_client_reading_nothing_while_retained_messages_wait_is_dropped_by_keep_alive(
    broker: Broker, mqtt: Listener
) -> None:
    """Keep alive 1 s: the SUBSCRIBE waiting for the socket kept the reading paused as
    'busy', which the keep alive takes for a pause of ours, and the client was never
    dropped (MQTT-3.1.2-22), nor its will sent."""
    raw, session, _, _ = await stuck_subscriber(broker, mqtt, "ka-stuck", keep_alive=1)
    try:
        await wait_for(lambda: session.closing, 6)
    finally:
        raw.close()


async def test_live_messages_at_the_gate_of_a_client_not_reading_are_bounded(
    broker: Broker, mqtt: Listener
) -> None:
    """While the retained messages wait for the socket, live QoS 0 ones of the filter
    wait at the gate: they grew there without bound. Past MAX_WAITING the oldest is
    dropped and counted; once the client reads, the newest is still its last word."""
    raw, session, topics, _ = await stuck_subscriber(broker, mqtt, "gate-stuck")
    dropped = broker.counters.get("mqtt_qos0_dropped", 0)
    try:
        for i in range(MAX_WAITING + 200):
            await broker.publish(Message(destination="slow/live", payload=b"%d" % i))
        assert session._gate is not None and len(session._gate) == MAX_WAITING
        assert broker.counters["mqtt_qos0_dropped"] - dropped == 200
        got: list[Publish] = []
        while len(got) < len(topics) + MAX_WAITING:
            packet = await raw.recv()
            if isinstance(packet, Publish):
                got.append(packet)
        assert [p.topic for p in got[: len(topics)]] == topics
        live = [int(p.payload) for p in got[len(topics) :]]
        assert live == list(range(200, MAX_WAITING + 200))
    finally:
        raw.close()


@pytest.mark.parametrize("how", ["takeover", "reset"])
async def test_qos1_retained_messages_not_yet_sent_wait_for_the_next_connection(
    broker: Broker, mqtt: Listener, how: str
) -> None:
    """A persistent session's connection ended while its SUBSCRIBE's retained messages
    waited for the socket: those not yet read from the store were dropped, uncounted,
    though messages pending transmission are session state (MQTT 3.1.1 §4.1)."""
    topics = [f"keep/{i:05d}" for i in range(750)]
    payload = b"q" * 32768
    stored = [
        broker.retained.put(Message(t, payload, retain=True, persistent=True)) for t in topics
    ]
    assert all(await asyncio.gather(*stored))
    old = await Raw.open(mqtt.port, 4, rcvbuf=4096)
    connect = Connect(protocol_level=4, client_id="dev-1", clean_start=False, keep_alive=0)
    await old.send(connect)
    assert isinstance(await old.recv(), Connack)
    session = mqtt.registry.sessions["dev-1"]
    await old.send(Subscribe(1, [("keep/#", SubscriptionOptions(qos=1))]))
    await wait_for(lambda: not session.link.writable)
    if how == "reset":
        old.writer.transport.abort()
        await wait_for(lambda: session.detached.done())
    new = await Raw.open(mqtt.port, 4)
    try:
        await new.send(connect)
        ack = await new.recv()
        assert isinstance(ack, Connack) and ack.session_present
        got = {p.topic for p in await publishes(new, 2.0)}
        assert sorted(got) == topics
    finally:
        new.close()
        old.close()


async def test_a_client_reading_slowly_is_not_dropped_as_one_not_reading(
    broker: Broker, mqtt: Listener
) -> None:
    """The wait for the socket looked before the batch just sent was written: the next
    batch went too, and a live message after them found the buffer past the cap set when
    the first one backed up. A client reading 3 MB/s was dropped as not reading."""
    payload = b"b" * 65536
    stored = [
        broker.retained.put(Message(f"cfg/{i:05d}", payload, retain=True)) for i in range(500)
    ]
    assert all(await asyncio.gather(*stored))
    raw = await Raw.open(mqtt.port, 4, rcvbuf=65536)
    await raw.send(Connect(protocol_level=4, client_id="slow-reader", keep_alive=0))
    assert isinstance(await raw.recv(), Connack)
    session = mqtt.registry.sessions["slow-reader"]
    await raw.send(Subscribe(1, [("tick/now", SubscriptionOptions(qos=0))]))
    assert isinstance(await raw.recv(), Suback)
    received = 0

    async def read_slowly() -> None:
        nonlocal received
        while data := await raw.reader.read(65536):
            received += len(data)
            await asyncio.sleep(0.02)

    async def tick() -> None:
        while True:
            await broker.publish(Message(destination="tick/now", payload=b"t"))
            await asyncio.sleep(0.1)

    tasks = [asyncio.create_task(read_slowly()), asyncio.create_task(tick())]
    try:
        await raw.send(Subscribe(2, [("cfg/#", SubscriptionOptions(qos=0))]))
        await wait_for(lambda: received > 8 * 1024 * 1024 or session.closing, 10)
        assert not session.closing and not tasks[0].done()
    finally:
        for task in tasks:
            task.cancel()
        raw.close()


async def test_the_gate_drops_a_message_a_newer_one_of_its_topic_follows(
    broker: Broker, mqtt: Listener
) -> None:
    """The gate's cap dropped its oldest message: the only live value of a topic, whose
    older retained value then stayed the client's last word on it."""
    raw, _, topics, _ = await stuck_subscriber(broker, mqtt, "gate-last-word")
    try:
        await broker.publish(Message(destination="slow/00100", payload=b"new", retain=True))
        for i in range(MAX_WAITING):
            await broker.publish(Message(destination="slow/live", payload=b"%d" % i))
        last: dict[str, bytes] = {}
        for packet in await publishes(raw, 2.0):
            last[packet.topic] = packet.payload
        assert last["slow/00100"] == b"new"
        assert last["slow/live"] == b"%d" % (MAX_WAITING - 1)
        assert set(last) == {*topics, "slow/live"}
    finally:
        raw.close()
