"""MQTT adapter against paho-mqtt 2.x (3.1, 3.1.1, 5): real sockets, real Redis, no mocks.

paho is a blocking, threaded client, so each scenario runs in a worker thread
(`asyncio.to_thread`) while the gateway serves on the test's event loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gateway.broker import Broker
from gateway.config import AclRule, Settings, User
from protocols.mqtt.listener import Listener, queue_name, start

V31, V311, V5 = paho.MQTTv31, paho.MQTTv311, paho.MQTTv5
VERSIONS = [pytest.param(V31, id="v31"), pytest.param(V311, id="v311"), pytest.param(V5, id="v5")]
WAIT = 5.0


@pytest.fixture
async def mqtt(broker: Broker) -> AsyncIterator[Listener]:
    settings = Settings(
        mqtt_port=0,
        host="127.0.0.1",
        users=[User("alice", "s3cret")],
        acl=[AclRule(deny_subscribe=["test/nosubscribe"], deny_publish=["test/nopublish"])],
    )
    listener = await start(broker, settings)
    assert listener is not None
    yield listener
    await listener.close()


class Client:
    """A connected paho client with synchronous helpers that wait (bounded) for acks."""

    def __init__(
        self,
        port: int,
        version: int,
        client_id: str = "",
        clean: bool = True,
        username: str | None = None,
        password: str | None = None,
        properties: Properties | None = None,
    ) -> None:
        self.version = version
        self.messages: queue.Queue[paho.MQTTMessage] = queue.Queue()
        self.connected = threading.Event()
        self.disconnected = threading.Event()
        self.subacks: queue.Queue[list] = queue.Queue()
        self.reason: object = None
        self.session_present = False
        self.c = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=version,
            clean_session=None if version == V5 else clean,
            reconnect_on_failure=False,
        )
        if username is not None:
            self.c.username_pw_set(username, password)
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = lambda *a: self.disconnected.set()
        self.c.on_message = lambda _c, _u, msg: self.messages.put(msg)
        self.c.on_subscribe = lambda _c, _u, _mid, codes, _p: self.subacks.put(codes)
        kwargs = {"clean_start": clean, "properties": properties} if version == V5 else {}
        self.c.connect("127.0.0.1", port, keepalive=30, **kwargs)
        self.c.loop_start()
        if not self.connected.wait(WAIT):
            raise TimeoutError("no CONNACK")

    def _on_connect(self, _c, _u, flags, reason, _props) -> None:
        self.reason = reason
        self.session_present = flags.session_present
        self.connected.set()

    @property
    def accepted(self) -> bool:
        return not self.reason.is_failure

    def subscribe(self, topic: str, qos: int) -> list:
        self.c.subscribe(topic, qos)
        return self.subacks.get(timeout=WAIT)

    def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        properties: Properties | None = None,
        retain: bool = False,
    ) -> paho.MQTTMessageInfo:
        info = self.c.publish(topic, payload, qos, retain, properties)
        info.wait_for_publish(WAIT)
        return info

    def receive(self, n: int) -> list[paho.MQTTMessage]:
        return [self.messages.get(timeout=WAIT) for _ in range(n)]

    def nothing_more(self, wait: float = 0.3) -> bool:
        try:
            self.messages.get(timeout=wait)
        except queue.Empty:
            return True
        return False

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("qos", [0, 1, 2])
async def test_pub_sub_each_qos(mqtt: Listener, version: int, qos: int) -> None:
    def scenario() -> None:
        sub = Client(mqtt.port, version, "sub-1")
        pub = Client(mqtt.port, version, "pub-1")
        try:
            assert [int(getattr(c, "value", c)) for c in sub.subscribe("room/+/temp", qos)] == [qos]
            for i in range(5):
                info = pub.publish(f"room/{i}/temp", f"m{i}".encode(), qos)
                assert info.is_published()
            got = sub.receive(5)
            assert [m.payload for m in got] == [f"m{i}".encode() for i in range(5)]
            assert {m.qos for m in got} == {qos}
            assert got[0].topic == "room/0/temp"
            assert sub.nothing_more()
        finally:
            sub.close()
            pub.close()

    await asyncio.to_thread(scenario)


async def test_subscription_qos_downgrades_delivery(mqtt: Listener) -> None:
    def scenario() -> None:
        sub = Client(mqtt.port, V311, "down-sub")
        pub = Client(mqtt.port, V311, "down-pub")
        try:
            sub.subscribe("d/#", 1)
            pub.publish("d/x", b"two", 2)
            pub.publish("d/y", b"zero", 0)
            got = {m.payload: m.qos for m in sub.receive(2)}
            assert got == {b"two": 1, b"zero": 0}
        finally:
            sub.close()
            pub.close()

    await asyncio.to_thread(scenario)


async def test_v5_properties_round_trip(mqtt: Listener) -> None:
    def scenario() -> None:
        sub = Client(mqtt.port, V5, "props-sub")
        pub = Client(mqtt.port, V5, "props-pub")
        try:
            sub.subscribe("p/t", 1)
            props = Properties(PacketTypes.PUBLISH)
            props.UserProperty = [("a", "1"), ("JMSXGroupId", "g7"), ("b", "2")]
            props.ContentType = "text/plain"
            props.ResponseTopic = "p/reply"
            props.CorrelationData = b"\x00corr"
            props.MessageExpiryInterval = 60
            props.PayloadFormatIndicator = 1
            pub.publish("p/t", b"hello", 1, props)
            (msg,) = sub.receive(1)
            p = msg.properties
            assert ("a", "1") in p.UserProperty and ("b", "2") in p.UserProperty
            assert ("JMSXGroupId", "g7") in p.UserProperty
            assert p.ContentType == "text/plain"
            assert p.ResponseTopic == "p/reply"
            assert p.CorrelationData == b"\x00corr"
            assert 0 < p.MessageExpiryInterval <= 60
            assert p.PayloadFormatIndicator == 1
        finally:
            sub.close()
            pub.close()

    await asyncio.to_thread(scenario)


@pytest.mark.parametrize("version", VERSIONS)
async def test_persistent_session_gets_offline_messages(
    mqtt: Listener, broker: Broker, version: int
) -> None:
    def scenario() -> None:
        expiry = Properties(PacketTypes.CONNECT)
        expiry.SessionExpiryInterval = 300
        props = expiry if version == V5 else None
        first = Client(mqtt.port, version, "durable-1", clean=False, properties=props)
        assert not first.session_present
        first.subscribe("news/#", 1)
        first.close()
        pub = Client(mqtt.port, version, "news-pub")
        for i in range(3):
            pub.publish(f"news/{i}", f"n{i}".encode(), 1)
        pub.close()
        again = Client(mqtt.port, version, "durable-1", clean=False, properties=props)
        try:
            assert again.session_present or version == V31  # 3.1 has no such flag
            assert sorted(m.payload for m in again.receive(3)) == [b"n0", b"n1", b"n2"]
        finally:
            again.close()

    await asyncio.to_thread(scenario)
    info = await broker.queues.info(queue_name("durable-1"))
    assert info.config.durable
    assert info.subscriptions == [("news/#", "mqtt")]


async def test_clean_session_discards_state(mqtt: Listener, broker: Broker) -> None:
    def scenario() -> None:
        first = Client(mqtt.port, V311, "cleaner", clean=False)
        first.subscribe("c/#", 1)
        first.close()
        again = Client(mqtt.port, V311, "cleaner", clean=True)
        assert not again.session_present
        again.close()

    await asyncio.to_thread(scenario)
    await asyncio.sleep(0.2)
    assert not await broker.queues.exists(queue_name("cleaner"))


@pytest.mark.parametrize("version", VERSIONS)
async def test_bad_password_refused(mqtt: Listener, version: int) -> None:
    def scenario() -> None:
        bad = Client(mqtt.port, version, "bad", username="alice", password="wrong")
        assert not bad.accepted
        assert int(bad.reason.value) in (4, 0x86)
        bad.c.loop_stop()
        good = Client(mqtt.port, version, "good", username="alice", password="s3cret")
        assert good.accepted
        good.close()

    await asyncio.to_thread(scenario)


async def test_anonymous_refused_when_not_allowed(broker: Broker) -> None:
    listener = await start(broker, Settings(mqtt_port=0, allow_anonymous=False))
    assert listener is not None

    def scenario() -> None:
        for version in (V311, V5):  # paho reports v3 return code 5 as 0x87 too
            c = Client(listener.port, version, "anon")
            assert int(c.reason.value) == 0x87
            c.c.loop_stop()

    try:
        await asyncio.to_thread(scenario)
    finally:
        await listener.close()


@pytest.mark.parametrize("version", [V311, V5], ids=["v311", "v5"])
async def test_acl(mqtt: Listener, version: int) -> None:
    def scenario() -> None:
        c = Client(mqtt.port, version, "acl")
        try:
            codes = c.subscribe("test/nosubscribe", 1)
            assert int(getattr(codes[0], "value", codes[0])) in (0x80, 0x87)
            c.subscribe("test/#", 1)
            c.publish("test/nosubscribe", b"hidden", 1)  # not delivered: read denied
            info = c.publish("test/nopublish", b"denied", 1)
            assert info.is_published()  # v5: PUBACK 0x87; v3/v4: acked and dropped
            c.publish("test/ok", b"fine", 1)
            assert [m.payload for m in c.receive(1)] == [b"fine"]
            assert c.nothing_more()
        finally:
            c.close()

    await asyncio.to_thread(scenario)


async def test_v5_connack_properties(mqtt: Listener) -> None:
    def scenario() -> Properties:
        got: list = []
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id="", protocol=V5)
        done = threading.Event()

        def on_connect(_c, _u, _f, _r, props) -> None:
            got.append(props)
            done.set()

        c.on_connect = on_connect
        c.connect("127.0.0.1", mqtt.port, keepalive=7200)
        c.loop_start()
        assert done.wait(WAIT)
        c.disconnect()
        c.loop_stop()
        return got[0]

    props = await asyncio.to_thread(scenario)
    assert props.AssignedClientIdentifier.startswith("auto-")
    assert props.ServerKeepAlive == 3600
    assert props.ReceiveMaximum > 0 and props.MaximumPacketSize > 0
    assert props.TopicAliasMaximum > 0
    assert props.RetainAvailable == 1
    assert props.WildcardSubscriptionAvailable == 1
    assert props.SubscriptionIdentifierAvailable == 1
    assert props.SharedSubscriptionAvailable == 1


async def test_will_published_on_abnormal_close(mqtt: Listener) -> None:
    def scenario() -> None:
        watcher = Client(mqtt.port, V311, "watcher")
        watcher.subscribe("wills/#", 1)
        dying = paho.Client(CallbackAPIVersion.VERSION2, client_id="dying", protocol=V311)
        dying.will_set("wills/dying", b"gone", 1)
        dying.connect("127.0.0.1", mqtt.port)
        dying.loop(1.0)  # CONNECT / CONNACK only
        dying.socket().close()  # no DISCONNECT: abnormal
        try:
            assert [m.payload for m in watcher.receive(1)] == [b"gone"]
            polite = paho.Client(CallbackAPIVersion.VERSION2, client_id="polite", protocol=V311)
            polite.will_set("wills/polite", b"never", 1)
            polite.connect("127.0.0.1", mqtt.port)
            polite.loop(1.0)
            polite.disconnect()
            assert watcher.nothing_more(0.5)
        finally:
            watcher.close()

    await asyncio.to_thread(scenario)


async def test_session_takeover(mqtt: Listener) -> None:
    def scenario() -> None:
        first = Client(mqtt.port, V5, "twin")
        second = Client(mqtt.port, V5, "twin")
        try:
            assert first.disconnected.wait(WAIT)
            assert second.accepted
        finally:
            first.c.loop_stop()
            second.close()

    await asyncio.to_thread(scenario)
