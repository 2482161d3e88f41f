"""Off-the-shelf clients for crash tests: each runs in its own thread and keeps a ledger.

A publisher (paho-mqtt, MQTT 5, QoS 1) records every sequence number it sent and which of
them the gateway confirmed (PUBACK success) or refused; a consumer (python-qpid-proton)
settles each delivery as its policy says and records the ones it accepted. When the
gateway is killed the clients' connections break and their threads end; the ledgers then
tell which messages Redis must still account for.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from proton import Message, Timeout
from proton.utils import BlockingConnection

MAX_OUTSTANDING = 200  # unconfirmed publishes at once (below the receive maximum)


def payload(seq: int) -> bytes:
    return b"seq:%d" % seq


def seq_of(body: bytes | memoryview | str) -> int:
    """The sequence number a test payload carries."""
    text = body if isinstance(body, str) else bytes(body).decode()
    if not text.startswith("seq:"):
        raise ValueError(f"not a test payload: {text!r}")
    return int(text[4:])


@dataclass
class Ledger:
    """What the clients know; shared by every round of one scenario."""

    sent: set[int] = field(default_factory=set)
    confirmed: set[int] = field(default_factory=set)
    refused: set[int] = field(default_factory=set)
    accepted: set[int] = field(default_factory=set)  # settled as accepted (may not have arrived)
    delivered: Counter[int] = field(default_factory=Counter)  # times each reached the consumer
    seqs: itertools.count = field(default_factory=itertools.count)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Publisher(threading.Thread):
    """Publishes numbered QoS 1 messages to `topic`, `rate` a second, until stopped or
    disconnected."""

    def __init__(self, port: int, topic: str, ledger: Ledger, name: str, rate: float) -> None:
        super().__init__(daemon=True, name=name)
        self.ledger = ledger
        self.topic = topic
        self.rate = rate
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._by_mid: dict[int, int] = {}
        self._acks: list[tuple[int, bool]] = []
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5
        )
        self.client.on_publish = self._on_publish
        self.client.max_inflight_messages_set(MAX_OUTSTANDING)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 0  # nothing is resent on another connection
        self.client.connect("127.0.0.1", port, keepalive=30, clean_start=True, properties=props)

    def _on_publish(self, _c, _u, mid: int, reason: mqtt.ReasonCode, _p) -> None:
        self._acks.append((mid, not reason.is_failure))

    def _settle_acks(self) -> None:
        acks, self._acks = self._acks, []
        with self.ledger.lock:
            for mid, ok in acks:
                seq = self._by_mid.pop(mid)
                (self.ledger.confirmed if ok else self.ledger.refused).add(seq)

    def run(self) -> None:
        start, published = time.monotonic(), 0
        try:
            while not self.stop.is_set():
                if self.client.loop(timeout=0.002) != mqtt.MQTT_ERR_SUCCESS:
                    break  # the gateway went away
                self._settle_acks()
                due = int(self.rate * (time.monotonic() - start)) - published
                for _ in range(min(due, 50, MAX_OUTSTANDING - len(self._by_mid))):
                    published += 1
                    with self.ledger.lock:
                        seq = next(self.ledger.seqs)
                        self.ledger.sent.add(seq)
                    info = self.client.publish(self.topic, payload(seq), qos=1)
                    if info.rc != mqtt.MQTT_ERR_SUCCESS:
                        return
                    self._by_mid[info.mid] = seq
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self._settle_acks()
            sock = self.client.socket()
            if sock is not None:  # no DISCONNECT: a crashed gateway gets none either
                sock.close()


# what a consumer does with one message: "accept", "release" (modified, delivery-failed) or
# "reject"
Policy = Callable[[int], str]


class Consumer(threading.Thread):
    """Receives from `queue` with `credit`, settling each message as `policy` says."""

    def __init__(
        self,
        port: int,
        queue: str,
        ledger: Ledger,
        policy: Policy,
        credit: int = 50,
        pause: float = 0.0,
    ) -> None:
        super().__init__(daemon=True, name=f"consumer-{queue}")
        self.ledger = ledger
        self.policy = policy
        self.pause = pause  # seconds per message: a slow consumer lets a backlog build
        self.stop = threading.Event()
        self.error: Exception | None = None
        self.conn = BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=10)
        self.receiver = self.conn.create_receiver(queue, credit=credit)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    msg: Message = self.receiver.receive(timeout=0.2)
                except Timeout:
                    continue
                seq = seq_of(msg.body)
                outcome = self.policy(seq)
                with self.ledger.lock:
                    self.ledger.delivered[seq] += 1
                    if outcome == "accept":
                        self.ledger.accepted.add(seq)
                if outcome == "accept":
                    self.receiver.accept()
                elif outcome == "release":  # modified, as a failed delivery (§3.4.5)
                    self.receiver.fetcher.unsettled[0].local.failed = True
                    self.receiver.release(delivered=True)
                else:
                    self.receiver.reject()
                if self.pause:
                    time.sleep(self.pause)
        except Exception as exc:  # the gateway went away: what was settled is in the ledger
            self.error = exc
        if self.error is None:  # closing a broken connection would wait for its timeout
            self.conn.close()
