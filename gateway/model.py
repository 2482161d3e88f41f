"""The internal message model every protocol adapter converts to and from.

`Message` carries what any of the protocols can express (see the mapping table in
ARCHITECTURE.md); delivery metadata (stream id, delivery count, redelivered) lives in
`Delivery`, beside the message, because it changes per delivery while the message does not.

Stream-entry encoding: one field, ``m``, holding a msgpack array with the payload and the
header fields in fixed positions, trailing defaults trimmed. Chosen by measurement
(`bench/encoding.py`; a 100-byte MQTT-sized message with a user property, this machine):
msgpack encodes and decodes it in ~2.2 µs against ~4.8 µs for JSON (178 against 249
bytes), and one field costs Redis ~1.5 µs of CPU per XADD against ~3.5 µs for a field per
attribute; the latter saves ~10% of memory per entry (listpack shares field names), not
worth twice the server CPU on the hot path.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack

ENCODING_VERSION = 1
DEFAULT_PRIORITY = 4
MAX_PRIORITY = 9  # JMS's 0-9: higher AMQP priorities are clamped to it
# User properties a published message may carry: each costs its decoding and every copy's
# encoding on the event loop, so one message of hundreds of thousands held the node, and
# every other client, for seconds. Brokers bound them too (Alibaba's IoT Platform: 20).
MAX_USER_PROPERTIES = 1024
# `reply_to` is an address: "topic://a/b" a topic, anything else a queue
TOPIC_ADDRESS = "topic://"
# MQTT 5 has no field for the partition key or the priority: user properties carry them
GROUP_PROPERTY, PRIORITY_PROPERTY = "JMSXGroupId", "JMSPriority"
# the partition key's names a publisher may use: Solace's clients spell it JMSXGroupID
GROUP_PROPERTIES = frozenset({GROUP_PROPERTY, "JMSXGroupID"})

FLAG_PERSISTENT = 1
FLAG_DMQ_ELIGIBLE = 2
FLAG_RETAIN = 4
FLAG_TO_QUEUE = 8
FLAG_DMQ_SET = 16  # the publisher said whether the message is DMQ-eligible

# Annotations on messages delivered from a dead message queue.
ORIGIN_QUEUE = "x-origin-queue"
DEAD_LETTER_REASON = "x-dmq-reason"  # expired, max_redelivered or rejected

PropertyValue = str | int | float | bool | bytes | None
UserProperties = list[tuple[str, PropertyValue]]


@dataclass(slots=True)
class Publisher:
    """Who sent a message: kept for no-local, auditing and the DMQ report."""

    protocol: str
    client_id: str = ""
    user: str | None = None


# The latest epoch ms a message's times may name (the end of the year 9999): a later expiry
# is none, a later delivery time this. Redis functions print larger numbers with an
# exponent (and doubles lose whole milliseconds past 2**53).
LATEST_MS = 253_402_300_799_999


# Spooler.submit's mark: the set recording exactly-once publishes and this one's member
# there, a hash and a claim (the record is ignored while the hash's 'fresh' field is above
# the claim: a newer session cleared it), and a key: the record is made only while the hash
# has a 'holder' field or that key exists (its owner still lives).
SpoolMark = tuple[str, str, str, int, str]


@dataclass(slots=True)
class Message:
    """One message as the gateway routes and stores it. Treat as immutable once published."""

    destination: str
    payload: bytes = b""
    partition_key: str | None = None
    priority: int = DEFAULT_PRIORITY
    expiration: int | None = None  # epoch ms
    not_before: int | None = None  # epoch ms
    persistent: bool = True
    dmq_eligible: bool | None = None  # None: the queue's default decides
    content_type: str | None = None
    correlation_id: str | bytes | int | None = None
    reply_to: str | None = None
    message_id: str | bytes | int | None = None
    subject: str | None = None
    user_properties: UserProperties = field(default_factory=list)
    annotations: dict[str, PropertyValue] = field(default_factory=dict)
    publisher: Publisher | None = None
    retain: bool = False
    to_queue: bool = False  # destination names a queue, not a topic
    id: str = ""  # gateway-assigned unique id, stable across redeliveries
    # The AMQP bare message as its publisher encoded it (properties, application properties,
    # body: immutable in transit, AMQP 1.0 §3.2), sent on to AMQP receivers as it came; the
    # engine never reads it. `payload_in_bare`: where `payload` starts in it (the body is its
    # last section), so the payload is stored once; None when it is not a slice of it.
    amqp_bare: bytes | None = None
    payload_in_bare: int | None = None
    # The AMQP publisher's message-annotations section (sent on with the gateway's own merged
    # in, such as x-opt-jms-dest); None when it sent none.
    amqp_annotations: bytes | None = None
    timestamp: int | None = None  # epoch ms its publisher made it (AMQP creation-time)
    # The AMQP publisher's footer section (hashes or signatures of the bare message, §3.2.10),
    # sent on after it; None when it sent none.
    amqp_footer: bytes | None = None
    # An exactly-once publish (an MQTT QoS 2 one, a Spark sink row): the spool records it
    # in the same step as it stores it, and stores none recorded already (a resend). See
    # SpoolMark. Not stored.
    exactly_once: SpoolMark | None = None


class Outcome(IntEnum):
    """What the spool did with one published message; adapters map these to NACKs."""

    OK = 0
    NO_SUBSCRIBERS = 1  # topic matched no queue: accepted, nothing stored
    NOT_FOUND = 2  # queue named directly does not exist
    INGRESS_DISABLED = 3
    TOO_LARGE = 4  # over the queue's max_message_size
    QUOTA_EXCEEDED = 5  # queue byte quota (max_spool_bytes)
    QUEUE_FULL = 6  # queue message-count limit (max_messages)
    FLOW_CONTROLLED = 7  # full, overflow = flow_control: the spooler retries (ack withheld)
    OUT_OF_MEMORY = 8  # Redis is over its maxmemory: the node refuses, Redis never returns it

    @property
    def accepted(self) -> bool:
        """True when the publisher may be acked."""
        return self in (Outcome.OK, Outcome.NO_SUBSCRIBERS)


@dataclass(slots=True)
class Delivery:
    """A message handed to a flow; `entry_id` identifies it for ack / nack."""

    queue: str
    entry_id: str
    message: Message
    delivery_count: int = 1
    size: int = 0
    acquired_before: bool = False  # by a consumer that gave it back uncounted (released)

    @property
    def redelivered(self) -> bool:
        """RabbitMQ / JMS redelivered flag: delivered to some consumer before."""
        return self.delivery_count > 1

    @property
    def first_acquirer(self) -> bool:
        """AMQP first-acquirer (§3.2.1): no consumer acquired the message before."""
        return self.delivery_count == 1 and not self.acquired_before


_counter = itertools.count(1)
_node_tag = os.urandom(6).hex()


def bound_times(msg: Message) -> None:
    """Keep a message's expiry and delivery time within what the engine stores: an expiry
    past LATEST_MS is none, one before the epoch is long past (1); a delivery time lies
    between the epoch (none) and LATEST_MS."""
    if msg.expiration is not None:
        msg.expiration = None if msg.expiration > LATEST_MS else max(msg.expiration, 1)
    if msg.not_before is not None:
        msg.not_before = min(max(msg.not_before, 0), LATEST_MS)


def priority_of(value: PropertyValue) -> int | None:
    """The priority a PRIORITY_PROPERTY value sets: 0-9 in ASCII digits ("²" is a digit
    to str.isdigit, not to int), else None (it stays an ordinary user property)."""
    ok = isinstance(value, str) and value.isascii() and value.isdigit()
    return int(value) if ok and int(value) <= MAX_PRIORITY else None


def property_text(value: PropertyValue) -> str:
    """A property's value as text, where keys and columns compare values of both protocols:
    booleans as JMS, JSON and MQTT egress spell them, binary (AMQP) that is not UTF-8 as its
    escaped text."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def new_message_id() -> str:
    """Cheap unique id: per-process random tag plus a counter (no uuid4 on the hot path)."""
    return f"{_node_tag}-{next(_counter):x}"


_packer = msgpack.Packer(use_bin_type=True)


def encode(msg: Message) -> bytes:
    """Pack `msg` for a stream entry (see the module docstring for why msgpack)."""
    flags = (
        (FLAG_PERSISTENT if msg.persistent else 0)
        | (FLAG_DMQ_ELIGIBLE if msg.dmq_eligible else 0)
        | (FLAG_DMQ_SET if msg.dmq_eligible is not None else 0)
        | (FLAG_RETAIN if msg.retain else 0)
        | (FLAG_TO_QUEUE if msg.to_queue else 0)
    )
    pub = msg.publisher
    fields: list[Any] = [
        ENCODING_VERSION,
        msg.payload,
        msg.destination,
        msg.id,
        flags,
        msg.priority,
        msg.partition_key,
        msg.expiration,
        msg.not_before,
        msg.content_type,
        msg.correlation_id,
        msg.reply_to,
        msg.message_id,
        msg.subject,
        msg.user_properties or None,
        msg.annotations or None,
        (pub.protocol, pub.client_id, pub.user) if pub is not None else None,
        msg.amqp_bare,
        msg.payload_in_bare,
        msg.amqp_annotations,
        msg.timestamp,
        msg.amqp_footer,
    ]
    if msg.payload_in_bare is not None:
        fields[1] = b""  # read back from the bare message
    end = len(fields)
    while fields[end - 1] is None:
        end -= 1
    return _packer.pack(fields[:end] if end < len(fields) else fields)


_unpackb = msgpack.unpackb
_FIELDS = 22
_PADDING = [[None] * (_FIELDS - n) for n in range(_FIELDS + 1)]  # by the number of fields read


def decode(blob: bytes) -> Message:
    """Inverse of `encode`; raises ValueError on an entry this version cannot read."""
    try:
        f = _unpackb(blob, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise ValueError(f"undecodable stream entry: {exc}") from exc
    if f.__class__ is not list or not f or f[0].__class__ is not int or f[0] != ENCODING_VERSION:
        raise ValueError("stream entry has an unknown encoding version")
    n = len(f)
    if n < 3 or f[1].__class__ is not bytes or f[2].__class__ is not str:
        raise ValueError("stream entry has no payload or destination")
    if n < _FIELDS:
        f += _PADDING[n]
    try:
        flags = f[4] or 0
        pub = f[16]
        bare, at, annotations = f[17], f[18], f[19]
        if bare is not None and (bare.__class__ is not bytes or (at is not None and at < 0)):
            raise ValueError("bare message is not bytes")
        if annotations is not None and annotations.__class__ is not bytes:
            raise ValueError("message annotations are not bytes")
        if f[20] is not None and f[20].__class__ is not int:
            raise ValueError("timestamp is not an integer")
        if f[21] is not None and f[21].__class__ is not bytes:
            raise ValueError("footer is not bytes")
        return Message(  # positional, in field order: measurably faster on the hot path
            f[2],  # destination
            f[1] if at is None else bare[at:],  # payload
            f[6],  # partition_key
            DEFAULT_PRIORITY if f[5] is None else f[5],
            f[7],  # expiration
            f[8],  # not_before
            flags & FLAG_PERSISTENT != 0,
            flags & FLAG_DMQ_ELIGIBLE != 0 if flags & FLAG_DMQ_SET else None,
            f[9],  # content_type
            f[10],  # correlation_id
            f[11],  # reply_to
            f[12],  # message_id
            f[13],  # subject
            [(k, v) for k, v in f[14]] if f[14] else [],
            dict(f[15]) if f[15] else {},
            Publisher(pub[0], pub[1], pub[2]) if pub else None,
            flags & FLAG_RETAIN != 0,
            flags & FLAG_TO_QUEUE != 0,
            f[3] or "",  # id
            bare,
            at,
            annotations,
            f[20],  # timestamp
            f[21],  # amqp_footer
        )
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"stream entry has malformed fields: {exc}") from exc
