"""What MQTT keeps between connections of one client id, and its form in Redis.

The blob saved with `broker.clients.save` holds the owning user, the session expiry, the
subscriptions with all their options (QoS 0 ones too, and shared ones), the outbound QoS 2
packet ids awaiting PUBCOMP and those of the messages in flight when the connection ended.
Inbound QoS 2 ids are not in it: they are the client's
exactly-once set (`broker.clients.mark_received`), so a duplicate is recognised on any node,
after a restart.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from gateway.engine.queues import MQTT_SHARED_PREFIX
from gateway.topics import MQTT, SubscriptionTrie
from protocols.mqtt.codec import SubscriptionOptions

SHARE_PREFIX = "$share/"
STATE_VERSION = 1


def shared_filter(pattern: str) -> tuple[str, str] | None:
    """(group, filter) of a `$share/<group>/<filter>` subscription, else None."""
    if not pattern.startswith(SHARE_PREFIX):
        return None
    group, _, topic_filter = pattern[len(SHARE_PREFIX) :].partition("/")
    return group, topic_filter


def shared_queue_name(group: str, topic_filter: str) -> str:
    """The group's queue: hex parts keep queue-name rules; hashed if that would not fit."""
    tail = f"{group.encode().hex()}/{topic_filter.encode().hex()}"
    if len(MQTT_SHARED_PREFIX) + len(tail) > 255:
        digest = hashlib.sha256(f"{group}\0{topic_filter}".encode()).hexdigest()
        tail = f"{group.encode().hex()[:64]}/h{digest}"
    return MQTT_SHARED_PREFIX + tail


@dataclass(slots=True)
class SessionState:
    """One client's session; `trie` indexes the non-shared filters for delivery."""

    client_id: str
    persistent: bool = False
    expiry: int = 0  # session expiry interval, seconds
    subscriptions: dict[str, SubscriptionOptions] = field(default_factory=dict)
    subscription_ids: dict[str, int] = field(default_factory=dict)
    trie: SubscriptionTrie[str] = field(default_factory=lambda: SubscriptionTrie(64))
    queue: str | None = None
    qos2_in: set[int] = field(default_factory=set)  # mirror of the Redis exactly-once set
    # PUBREL sent, PUBCOMP not yet seen: in the order of their PUBRECs, the order they are
    # sent again in on a new connection (MQTT-4.6.0-3)
    pubrel_out: dict[int, None] = field(default_factory=dict)
    # QoS 1/2 messages of the session's queue in flight when its last connection ended:
    # entry id -> packet id, resent with that id (MQTT-4.4.0-1)
    resend_ids: dict[str, int] = field(default_factory=dict)
    # ... and the QoS each went at: it goes again so, whatever the subscriptions say now
    resend_qos: dict[str, int] = field(default_factory=dict)
    # shared groups' QoS 2 messages stored in the session's queue for a resend: message id
    # -> the `$share/...` filter that delivered it
    resend_shared: dict[str, str] = field(default_factory=dict)
    # retained messages sent on SUBSCRIBE, or waiting for room, when the last connection
    # ended, stored in the session's queue: message id -> [QoS, subscription ids] they went
    # (or would have gone) with, resent so, RETAIN=1 (MQTT-3.3.1-8)
    resend_retained: dict[str, list[Any]] = field(default_factory=dict)
    # shared groups' QoS 1 messages in flight when the last connection ended, given back to
    # their group: [queue, entry id]; one that comes back to this session is sent with DUP
    shared_in_flight: list[list[str]] = field(default_factory=list)
    version: int = 0  # moves with every change of the subscriptions (delivery caches key on it)
    user: str | None = None  # who owns the session: only that user may connect as client_id

    def set_subscription(self, pattern: str, options: SubscriptionOptions) -> None:
        self.subscriptions[pattern] = options
        if shared_filter(pattern) is None:
            self.trie.add(pattern, pattern, MQTT)
        self.version += 1

    def drop_subscription(self, pattern: str) -> None:
        del self.subscriptions[pattern]
        self.subscription_ids.pop(pattern, None)
        if shared_filter(pattern) is None:
            self.trie.remove(pattern, pattern, MQTT)
        self.version += 1

    def set_subscription_id(self, pattern: str, sub_id: int | None) -> None:
        """The MQTT 5 subscription identifier of a filter (None: it has none)."""
        if sub_id is None:
            self.subscription_ids.pop(pattern, None)
        else:
            self.subscription_ids[pattern] = sub_id
        self.version += 1

    def dumps(self) -> bytes:
        subs = [
            [p, o.qos, o.no_local, o.retain_as_published, o.retain_handling,
             self.subscription_ids.get(p)]
            for p, o in self.subscriptions.items()
        ]  # fmt: skip
        blob = {
            "v": STATE_VERSION,
            "expiry": self.expiry,
            "queue": self.queue,
            "subs": subs,
            "pubrel": list(self.pubrel_out),
            "resend": self.resend_ids,
            "resend_qos": self.resend_qos,
            "resend_shared": self.resend_shared,
            "resend_retained": self.resend_retained,
            "shared_in_flight": self.shared_in_flight,
            "user": self.user,
        }
        return json.dumps(blob, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, client_id: str, raw: bytes) -> SessionState:
        blob = json.loads(raw)
        state = cls(client_id, persistent=True, expiry=int(blob["expiry"]), queue=blob["queue"])
        for pattern, qos, no_local, rap, handling, sub_id in blob["subs"]:
            state.set_subscription(pattern, SubscriptionOptions(qos, no_local, rap, handling))
            if sub_id is not None:
                state.set_subscription_id(pattern, sub_id)
        state.pubrel_out = dict.fromkeys(blob["pubrel"])
        state.resend_ids = blob.get("resend", {})  # absent in states saved before
        state.resend_qos = blob.get("resend_qos", {})
        state.resend_shared = blob.get("resend_shared", {})
        state.resend_retained = blob.get("resend_retained", {})
        state.shared_in_flight = blob.get("shared_in_flight", [])
        state.user = blob.get("user")  # absent in states saved before owners were recorded
        return state
