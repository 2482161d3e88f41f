"""Sans-IO MQTT codec for protocol levels 3 (3.1, ``MQIsdp``), 4 (3.1.1) and 5 (5.0).

Shaped like h11: no sockets and no asyncio. :class:`MqttDecoder` turns bytes into typed
packet objects (one decoder per connection, because the protocol level is fixed by the
first CONNECT); :func:`encode` / :func:`encode_publish` turn packet objects into bytes.

The decoder is strict (it is the server side: anything a client gets wrong should be
detected here and reported with the MQTT 5 reason code the server must answer with),
the encoder trusts its caller for cheap-to-violate invariants such as topic syntax,
because the server only re-encodes values it has already validated.

Things deliberately left to the session layer: topic alias ranges (0x94), receive
maximum, packet-id bookkeeping, a second CONNECT, direction (the decoder decodes every
packet type so that both ends can be tested), topic *filter* syntax (a per-filter
SUBACK code in v5), and whether a client may send a given property (e.g. a
subscription identifier in a client PUBLISH).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar

from gateway.model import MAX_USER_PROPERTIES

__all__ = [
    "MAX_PACKET_SIZE",
    "Auth",
    "Connack",
    "ConnackReturnCode",
    "Connect",
    "Disconnect",
    "MqttDecoder",
    "MqttProtocolError",
    "Packet",
    "PacketType",
    "Pingreq",
    "Pingresp",
    "Properties",
    "PropertyId",
    "Puback",
    "Pubcomp",
    "Publish",
    "Pubrec",
    "Pubrel",
    "ReasonCode",
    "Suback",
    "Subscribe",
    "SubscriptionOptions",
    "Unsuback",
    "Unsubscribe",
    "Will",
    "encode",
    "encode_publish",
    "v3_connack_return_code",
]

#: Largest value the 4-byte Remaining Length can express (MQTT 5 §1.5.5).
MAX_PACKET_SIZE = 268_435_455


# --------------------------------------------------------------------------- constants


class PacketType(IntEnum):
    """Control packet types: the high nibble of the fixed header's first byte."""

    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


class ReasonCode(IntEnum):
    """MQTT 5 reason codes (§2.4). Value 0 has three spec names; all are aliases here."""

    SUCCESS = 0x00
    NORMAL_DISCONNECTION = 0x00
    GRANTED_QOS_0 = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL_MESSAGE = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    RE_AUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


class ConnackReturnCode(IntEnum):
    """MQTT 3.1 / 3.1.1 CONNACK return codes (3.1.1 §3.2.2.3)."""

    ACCEPTED = 0
    UNACCEPTABLE_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_USERNAME_OR_PASSWORD = 4
    NOT_AUTHORIZED = 5


class PropertyId(IntEnum):
    """MQTT 5 property identifiers (§2.2.2.2)."""

    PAYLOAD_FORMAT_INDICATOR = 0x01
    MESSAGE_EXPIRY_INTERVAL = 0x02
    CONTENT_TYPE = 0x03
    RESPONSE_TOPIC = 0x08
    CORRELATION_DATA = 0x09
    SUBSCRIPTION_IDENTIFIER = 0x0B
    SESSION_EXPIRY_INTERVAL = 0x11
    ASSIGNED_CLIENT_IDENTIFIER = 0x12
    SERVER_KEEP_ALIVE = 0x13
    AUTHENTICATION_METHOD = 0x15
    AUTHENTICATION_DATA = 0x16
    REQUEST_PROBLEM_INFORMATION = 0x17
    WILL_DELAY_INTERVAL = 0x18
    REQUEST_RESPONSE_INFORMATION = 0x19
    RESPONSE_INFORMATION = 0x1A
    SERVER_REFERENCE = 0x1C
    REASON_STRING = 0x1F
    RECEIVE_MAXIMUM = 0x21
    TOPIC_ALIAS_MAXIMUM = 0x22
    TOPIC_ALIAS = 0x23
    MAXIMUM_QOS = 0x24
    RETAIN_AVAILABLE = 0x25
    USER_PROPERTY = 0x26
    MAXIMUM_PACKET_SIZE = 0x27
    WILDCARD_SUBSCRIPTION_AVAILABLE = 0x28
    SUBSCRIPTION_IDENTIFIER_AVAILABLE = 0x29
    SHARED_SUBSCRIPTION_AVAILABLE = 0x2A


_MALFORMED = 0x81
_PROTOCOL_ERROR = 0x82
_UNSUPPORTED_VERSION = 0x84
_CLIENT_ID_INVALID = 0x85
_TOPIC_NAME_INVALID = 0x90
_PACKET_TOO_LARGE = 0x95
_QUOTA_EXCEEDED = 0x97

# MQTT 5 reason codes each packet may carry (tables in §3.2.2.2, §3.4.2.1, ...).
_RC_CONNACK = frozenset(
    {
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
    }
)
_RC_PUBACK = frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99})
_RC_PUBREL = frozenset({0x00, 0x92})
_RC_SUBACK = frozenset({0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2})
_RC_UNSUBACK = frozenset({0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91})
_RC_DISCONNECT = frozenset(
    {
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
    }
)
_RC_AUTH = frozenset({0x00, 0x18, 0x19})
_RC_SUBACK_V3 = frozenset({0x00, 0x01, 0x02, 0x80})

# v5 CONNACK reason code -> closest 3.1/3.1.1 return code (anything else: 3).
_V5_TO_V3_CONNACK = {
    0x00: 0,
    0x84: 1,
    0x85: 2,
    0x86: 4,
    0x8C: 4,
    0x87: 5,
    0x8A: 5,
}


def v3_connack_return_code(reason_code: int) -> int:
    """Map an MQTT 5 CONNACK reason code (or a 0..5 return code) to a v3/v4 return code.

    Lets the session answer ``MqttProtocolError.reason_code`` on any protocol level.
    """
    if 0 <= reason_code <= 5:
        return reason_code
    return _V5_TO_V3_CONNACK.get(reason_code, 3)


class MqttProtocolError(Exception):
    """The peer broke the protocol; ``reason_code`` is what the server should answer with.

    ``packets`` holds the packets that were complete before the bad one in the same
    :meth:`MqttDecoder.feed` call, so the session may still process them in order.
    """

    def __init__(self, reason_code: int, message: str) -> None:
        super().__init__(reason_code, message)
        self.reason_code = reason_code
        self.message = message
        self.packets: list[Packet] = []

    def __str__(self) -> str:
        return f"{self.message} (reason code 0x{self.reason_code:02X})"


def _malformed(message: str) -> MqttProtocolError:
    return MqttProtocolError(_MALFORMED, message)


def _protocol_error(message: str) -> MqttProtocolError:
    return MqttProtocolError(_PROTOCOL_ERROR, message)


# --------------------------------------------------------------------------- properties


@dataclass(slots=True)
class Properties:
    """MQTT 5 properties; ``None`` (or an empty list) means absent.

    Byte-valued flags stay ints (0/1) to keep the wire value. The two repeatable
    properties are lists in wire order: ``user_properties`` ((key, value) pairs,
    duplicates allowed) and ``subscription_identifiers`` (several only in PUBLISH).
    The decoder returns ``None`` instead of an empty Properties.
    """

    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_identifiers: list[int] = field(default_factory=list)
    session_expiry_interval: int | None = None
    assigned_client_identifier: str | None = None
    server_keep_alive: int | None = None
    authentication_method: str | None = None
    authentication_data: bytes | None = None
    request_problem_information: int | None = None
    will_delay_interval: int | None = None
    request_response_information: int | None = None
    response_information: str | None = None
    server_reference: str | None = None
    reason_string: str | None = None
    receive_maximum: int | None = None
    topic_alias_maximum: int | None = None
    topic_alias: int | None = None
    maximum_qos: int | None = None
    retain_available: int | None = None
    user_properties: list[tuple[str, str]] = field(default_factory=list)
    maximum_packet_size: int | None = None
    wildcard_subscription_available: int | None = None
    subscription_identifier_available: int | None = None
    shared_subscription_available: int | None = None

    def is_empty(self) -> bool:
        for pid, name, _kind in _PROP_TABLE:
            value = getattr(self, name)
            if pid == 0x0B or pid == 0x26:
                if value:
                    return False
            elif value is not None:
                return False
        return True


# Property value kinds (§1.5 data representations).
_BYTE, _U16, _U32, _VBI, _STR, _BIN, _PAIR = range(7)

_PROP_TABLE: tuple[tuple[int, str, int], ...] = (
    (0x01, "payload_format_indicator", _BYTE),
    (0x02, "message_expiry_interval", _U32),
    (0x03, "content_type", _STR),
    (0x08, "response_topic", _STR),
    (0x09, "correlation_data", _BIN),
    (0x0B, "subscription_identifiers", _VBI),
    (0x11, "session_expiry_interval", _U32),
    (0x12, "assigned_client_identifier", _STR),
    (0x13, "server_keep_alive", _U16),
    (0x15, "authentication_method", _STR),
    (0x16, "authentication_data", _BIN),
    (0x17, "request_problem_information", _BYTE),
    (0x18, "will_delay_interval", _U32),
    (0x19, "request_response_information", _BYTE),
    (0x1A, "response_information", _STR),
    (0x1C, "server_reference", _STR),
    (0x1F, "reason_string", _STR),
    (0x21, "receive_maximum", _U16),
    (0x22, "topic_alias_maximum", _U16),
    (0x23, "topic_alias", _U16),
    (0x24, "maximum_qos", _BYTE),
    (0x25, "retain_available", _BYTE),
    (0x26, "user_properties", _PAIR),
    (0x27, "maximum_packet_size", _U32),
    (0x28, "wildcard_subscription_available", _BYTE),
    (0x29, "subscription_identifier_available", _BYTE),
    (0x2A, "shared_subscription_available", _BYTE),
)
_PROP_BY_ID: dict[int, tuple[str, int]] = {pid: (name, kind) for pid, name, kind in _PROP_TABLE}
# Byte properties whose only legal values are 0 and 1.
_BOOL_PROPS = frozenset({0x01, 0x17, 0x19, 0x24, 0x25, 0x28, 0x29, 0x2A})
# Properties for which the value 0 is a Protocol Error.
_NONZERO_PROPS = frozenset({0x0B, 0x21, 0x27})


def _mask(*ids: int) -> int:
    m = 0
    for i in ids:
        m |= 1 << i
    return m


# Which properties each packet may carry (§2.2.2.2 table 2-4), as bitmasks over ids.
_P_PUBLISH = _mask(0x01, 0x02, 0x03, 0x08, 0x09, 0x0B, 0x23, 0x26)
_P_WILL = _mask(0x01, 0x02, 0x03, 0x08, 0x09, 0x18, 0x26)
_P_CONNECT = _mask(0x11, 0x15, 0x16, 0x17, 0x19, 0x21, 0x22, 0x26, 0x27)
_P_CONNACK = _mask(
    0x11,
    0x12,
    0x13,
    0x15,
    0x16,
    0x1A,
    0x1C,
    0x1F,
    0x21,
    0x22,
    0x24,
    0x25,
    0x26,
    0x27,
    0x28,
    0x29,
    0x2A,
)
_P_ACK = _mask(0x1F, 0x26)  # PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK, UNSUBACK
_P_SUBSCRIBE = _mask(0x0B, 0x26)
_P_UNSUBSCRIBE = _mask(0x26)
_P_DISCONNECT = _mask(0x11, 0x1C, 0x1F, 0x26)
_P_AUTH = _mask(0x15, 0x16, 0x1F, 0x26)

_PROP_CONTEXT_NAMES = {
    _P_PUBLISH: "PUBLISH",
    _P_WILL: "Will",
    _P_CONNECT: "CONNECT",
    _P_CONNACK: "CONNACK",
    _P_ACK: "acknowledgement",
    _P_SUBSCRIBE: "SUBSCRIBE",
    _P_UNSUBSCRIBE: "UNSUBSCRIBE",
    _P_DISCONNECT: "DISCONNECT",
    _P_AUTH: "AUTH",
}


# --------------------------------------------------------------------------- packets


@dataclass(slots=True)
class Will:
    """Will message carried in CONNECT."""

    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    properties: Properties | None = None


@dataclass(slots=True)
class Connect:
    """CONNECT. ``clean_start`` is "clean session" in 3.1/3.1.1."""

    packet_type: ClassVar[int] = 1
    protocol_level: int = 4
    clean_start: bool = True
    keep_alive: int = 0
    client_id: str = ""
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Properties | None = None


@dataclass(slots=True)
class Connack:
    """CONNACK. ``reason_code`` is the v5 reason code, or the 0..5 v3/v4 return code."""

    packet_type: ClassVar[int] = 2
    session_present: bool = False
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class Publish:
    """PUBLISH. ``packet_id`` is None for QoS 0."""

    packet_type: ClassVar[int] = 3
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: Properties | None = None


@dataclass(slots=True)
class Puback:
    packet_type: ClassVar[int] = 4
    packet_id: int
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class Pubrec:
    packet_type: ClassVar[int] = 5
    packet_id: int
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class Pubrel:
    packet_type: ClassVar[int] = 6
    packet_id: int
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class Pubcomp:
    packet_type: ClassVar[int] = 7
    packet_id: int
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True, frozen=True)
class SubscriptionOptions:
    """Per-filter subscription options; v3/v4 only carry ``qos``. Immutable and cached."""

    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(slots=True)
class Subscribe:
    """SUBSCRIBE: ``subscriptions`` is a list of (topic filter, options)."""

    packet_type: ClassVar[int] = 8
    packet_id: int
    subscriptions: list[tuple[str, SubscriptionOptions]] = field(default_factory=list)
    properties: Properties | None = None


@dataclass(slots=True)
class Suback:
    packet_type: ClassVar[int] = 9
    packet_id: int
    reason_codes: list[int] = field(default_factory=list)
    properties: Properties | None = None


@dataclass(slots=True)
class Unsubscribe:
    packet_type: ClassVar[int] = 10
    packet_id: int
    topic_filters: list[str] = field(default_factory=list)
    properties: Properties | None = None


@dataclass(slots=True)
class Unsuback:
    """UNSUBACK; ``reason_codes`` is empty on v3/v4 (they have none)."""

    packet_type: ClassVar[int] = 11
    packet_id: int
    reason_codes: list[int] = field(default_factory=list)
    properties: Properties | None = None


@dataclass(slots=True)
class Pingreq:
    packet_type: ClassVar[int] = 12


@dataclass(slots=True)
class Pingresp:
    packet_type: ClassVar[int] = 13


@dataclass(slots=True)
class Disconnect:
    packet_type: ClassVar[int] = 14
    reason_code: int = 0
    properties: Properties | None = None


@dataclass(slots=True)
class Auth:
    """AUTH (MQTT 5 only)."""

    packet_type: ClassVar[int] = 15
    reason_code: int = 0
    properties: Properties | None = None


Packet = (
    Connect
    | Connack
    | Publish
    | Puback
    | Pubrec
    | Pubrel
    | Pubcomp
    | Subscribe
    | Suback
    | Unsubscribe
    | Unsuback
    | Pingreq
    | Pingresp
    | Disconnect
    | Auth
)

# Every (qos, no_local, retain_as_published, retain_handling) combination, indexed by the
# wire byte, so decoding SUBSCRIBE allocates no options objects.
_SUBOPTS: tuple[SubscriptionOptions, ...] = tuple(
    SubscriptionOptions(b & 3, bool(b & 4), bool(b & 8), (b >> 4) & 3) for b in range(64)
)
_PINGREQ = Pingreq()
_PINGRESP = Pingresp()


# --------------------------------------------------------------------------- decoding helpers


def _read_u16(data: bytes, i: int, end: int) -> int:
    if i + 2 > end:
        raise _malformed("packet truncated (two byte integer)")
    return data[i] << 8 | data[i + 1]


def _read_str(data: bytes, i: int, end: int, what: str) -> tuple[str, int]:
    """UTF-8 string (§1.5.4): valid UTF-8 (Python rejects surrogates/overlongs), no U+0000."""
    if i + 2 > end:
        raise _malformed(f"packet truncated ({what} length)")
    j = i + 2 + (data[i] << 8 | data[i + 1])
    if j > end:
        raise _malformed(f"packet truncated ({what})")
    try:
        s = data[i + 2 : j].decode()
    except UnicodeDecodeError:
        raise _malformed(f"{what} is not valid UTF-8") from None
    if "\x00" in s:
        raise _malformed(f"{what} contains U+0000")
    return s, j


def _read_bin(data: bytes, i: int, end: int, what: str) -> tuple[bytes, int]:
    if i + 2 > end:
        raise _malformed(f"packet truncated ({what} length)")
    j = i + 2 + (data[i] << 8 | data[i + 1])
    if j > end:
        raise _malformed(f"packet truncated ({what})")
    return data[i + 2 : j], j


def _read_vbi(data: bytes, i: int, end: int) -> tuple[int, int]:
    """Variable Byte Integer (§1.5.5): at most 4 bytes."""
    value = 0
    shift = 0
    while True:
        if i >= end:
            raise _malformed("packet truncated (variable byte integer)")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift == 28:
            raise _malformed("variable byte integer longer than 4 bytes")


def _read_packet_id(data: bytes, i: int, end: int) -> int:
    if i + 2 > end:
        raise _malformed("packet truncated (packet identifier)")
    pid = data[i] << 8 | data[i + 1]
    if not pid:
        raise _protocol_error("packet identifier must not be 0")
    return pid


def _read_props(data: bytes, i: int, end: int, allowed: int) -> tuple[Properties | None, int]:
    """Decode a property block; reject ids not allowed for ``allowed``'s packet."""
    if i < end and data[i] == 0:  # the common empty block
        return None, i + 1
    plen, i = _read_vbi(data, i, end)
    pend = i + plen
    if pend > end:
        raise _malformed("property length exceeds packet")
    if not plen:
        return None, i
    p = Properties()
    while i < pend:
        pid = data[i]
        i += 1
        spec = _PROP_BY_ID.get(pid)
        if spec is None or not (allowed >> pid) & 1:
            where = _PROP_CONTEXT_NAMES.get(allowed, "this packet")
            raise _malformed(f"property 0x{pid:02X} not allowed in {where}")
        name, kind = spec
        if kind == _BYTE:
            if i >= pend:
                raise _malformed("property truncated")
            value = data[i]
            i += 1
        elif kind == _U32:
            if i + 4 > pend:
                raise _malformed("property truncated")
            value = int.from_bytes(data[i : i + 4], "big")
            i += 4
        elif kind == _U16:
            value = _read_u16(data, i, pend)
            i += 2
        elif kind == _STR:
            value, i = _read_str(data, i, pend, name)
        elif kind == _BIN:
            value, i = _read_bin(data, i, pend, name)
        elif kind == _VBI:
            value, i = _read_vbi(data, i, pend)
        else:  # _PAIR
            key, i = _read_str(data, i, pend, "user property name")
            val, i = _read_str(data, i, pend, "user property value")
            p.user_properties.append((key, val))
            if len(p.user_properties) > MAX_USER_PROPERTIES:
                raise MqttProtocolError(
                    _QUOTA_EXCEEDED, f"more than {MAX_USER_PROPERTIES} user properties"
                )
            continue
        if pid in _NONZERO_PROPS and not value:
            raise _protocol_error(f"{name} must not be 0")
        if pid == 0x0B:
            if p.subscription_identifiers and allowed != _P_PUBLISH:
                raise _protocol_error("subscription identifier included more than once")
            p.subscription_identifiers.append(value)
            continue
        if getattr(p, name) is not None:
            raise _protocol_error(f"{name} included more than once")
        if pid in _BOOL_PROPS and value > 1:
            raise _protocol_error(f"{name} must be 0 or 1")
        setattr(p, name, value)
    if p.authentication_data is not None and p.authentication_method is None:
        raise _protocol_error("authentication data without authentication method")
    return p, i


def _read_reason_code(data: bytes, i: int, allowed: frozenset[int], what: str) -> int:
    rc = data[i]
    if rc not in allowed:
        raise _protocol_error(f"reason code 0x{rc:02X} not valid in {what}")
    return rc


def _expect_end(i: int, end: int, what: str) -> None:
    if i != end:
        raise _malformed(f"{end - i} unexpected trailing bytes in {what}")


# --------------------------------------------------------------------------- packet decoders


def _decode_publish(b0: int, data: bytes, i: int, end: int, level: int) -> Publish:
    """The hot path: straight-line code, no helper calls for the usual case."""
    qos = (b0 >> 1) & 3
    if qos == 3:
        raise _malformed("PUBLISH with QoS 3")
    if i + 2 > end:
        raise _malformed("packet truncated (topic length)")
    j = i + 2 + (data[i] << 8 | data[i + 1])
    if j > end:
        raise _malformed("packet truncated (topic)")
    try:
        topic = data[i + 2 : j].decode()
    except UnicodeDecodeError:
        raise _malformed("topic name is not valid UTF-8") from None
    # str containment is several times faster than bytes containment in CPython.
    if "+" in topic or "#" in topic:
        raise MqttProtocolError(_TOPIC_NAME_INVALID, "topic name contains a wildcard")
    if "\x00" in topic:
        raise _malformed("topic name contains U+0000")
    if qos:
        if j + 2 > end:
            raise _malformed("packet truncated (packet identifier)")
        packet_id = data[j] << 8 | data[j + 1]
        if not packet_id:
            raise _protocol_error("packet identifier must not be 0")
        j += 2
    else:
        if b0 & 8 and level != 3:
            raise _malformed("DUP flag set on a QoS 0 PUBLISH")
        packet_id = None
    props = None
    if level == 5:
        if j < end and data[j] == 0:
            j += 1
        else:
            props, j = _read_props(data, j, end, _P_PUBLISH)
        if not topic and (props is None or props.topic_alias is None):
            raise _protocol_error("empty topic name without a topic alias")
    elif not topic:
        raise MqttProtocolError(_TOPIC_NAME_INVALID, "empty topic name")
    return Publish(topic, data[j:end], qos, (b0 & 1) != 0, (b0 & 8) != 0, packet_id, props)


def _read_connect_header(data: bytes, i: int, end: int) -> tuple[int, int]:
    """Protocol name + level: decides the connection's protocol level."""
    if i + 2 > end:
        raise _malformed("packet truncated (protocol name)")
    j = i + 2 + (data[i] << 8 | data[i + 1])
    if j >= end:
        raise _malformed("packet truncated (protocol name/level)")
    name = data[i + 2 : j]
    level = data[j]
    if not ((name == b"MQTT" and level in (4, 5)) or (name == b"MQIsdp" and level == 3)):
        raise MqttProtocolError(
            _UNSUPPORTED_VERSION,
            f"unsupported protocol version (name {name!r}, level {level})",
        )
    return level, j + 1


def _decode_connect_body(level: int, data: bytes, i: int, end: int) -> Connect:
    if i + 3 > end:
        raise _malformed("packet truncated (connect flags/keep alive)")
    flags = data[i]
    keep_alive = data[i + 1] << 8 | data[i + 2]
    i += 3
    if flags & 0x01:
        raise _malformed("CONNECT reserved flag is set")
    will_flag = flags & 0x04
    will_qos = (flags >> 3) & 3
    will_retain = (flags & 0x20) != 0
    if will_qos == 3:
        raise _malformed("will QoS 3")
    if not will_flag and (will_qos or will_retain):
        raise _malformed("will QoS/retain set without the will flag")
    has_user = flags & 0x80
    has_pass = flags & 0x40
    if has_pass and not has_user and level != 5:
        raise _malformed("password flag set without user name flag")
    props = None
    if level == 5:
        props, i = _read_props(data, i, end, _P_CONNECT)
    client_id, i = _read_str(data, i, end, "client identifier")
    will = None
    if will_flag:
        wprops = None
        if level == 5:
            wprops, i = _read_props(data, i, end, _P_WILL)
        wtopic, i = _read_str(data, i, end, "will topic")
        if not wtopic or "+" in wtopic or "#" in wtopic:
            raise MqttProtocolError(_TOPIC_NAME_INVALID, "invalid will topic")
        wpayload, i = _read_bin(data, i, end, "will payload")
        will = Will(wtopic, wpayload, will_qos, will_retain, wprops)
    username = None
    password = None
    # MQTT 3.1 lets the flags be set with the fields missing ("Remaining Length ...
    # takes precedence over the User Name flag"), so only v3 tolerates the absence.
    if has_user and not (level == 3 and i == end):
        username, i = _read_str(data, i, end, "user name")
    if has_pass and not (level == 3 and i == end):
        password, i = _read_bin(data, i, end, "password")
    _expect_end(i, end, "CONNECT")
    clean_start = (flags & 0x02) != 0
    if not client_id:
        if level == 3:
            raise MqttProtocolError(_CLIENT_ID_INVALID, "empty client identifier (MQTT 3.1)")
        if level == 4 and not clean_start:
            raise MqttProtocolError(
                _CLIENT_ID_INVALID, "empty client identifier requires clean session"
            )
    return Connect(level, clean_start, keep_alive, client_id, username, password, will, props)


def _decode_connack(b0: int, data: bytes, i: int, end: int, level: int) -> Connack:
    if i + 2 > end:
        raise _malformed("packet truncated (CONNACK)")
    flags = data[i]
    if flags & 0xFE:
        raise _malformed("CONNACK reserved flags set")
    if level == 5:
        rc = _read_reason_code(data, i + 1, _RC_CONNACK, "CONNACK")
        props, j = _read_props(data, i + 2, end, _P_CONNACK)
    else:
        rc = data[i + 1]
        if rc > 5:
            raise _protocol_error(f"CONNACK return code {rc} out of range")
        props, j = None, i + 2
    _expect_end(j, end, "CONNACK")
    if rc and flags:
        raise _protocol_error("session present with a failure reason code")
    return Connack(flags == 1, rc, props)


def _decode_pub_ack(b0: int, data: bytes, i: int, end: int, level: int) -> Packet:
    cls = _ACK_CLASSES[b0 >> 4]
    packet_id = _read_packet_id(data, i, end)
    i += 2
    if level != 5 or i == end:
        _expect_end(i, end, cls.__name__.upper())
        return cls(packet_id)
    allowed = _RC_PUBACK if cls is Puback or cls is Pubrec else _RC_PUBREL
    rc = _read_reason_code(data, i, allowed, cls.__name__.upper())
    props, i = (None, i + 1) if i + 1 == end else _read_props(data, i + 1, end, _P_ACK)
    _expect_end(i, end, cls.__name__.upper())
    return cls(packet_id, rc, props)


_ACK_CLASSES: dict[int, type[Puback | Pubrec | Pubrel | Pubcomp]] = {
    4: Puback,
    5: Pubrec,
    6: Pubrel,
    7: Pubcomp,
}


def _decode_subscribe(b0: int, data: bytes, i: int, end: int, level: int) -> Subscribe:
    packet_id = _read_packet_id(data, i, end)
    i += 2
    props = None
    if level == 5:
        props, i = _read_props(data, i, end, _P_SUBSCRIBE)
    subs: list[tuple[str, SubscriptionOptions]] = []
    reserved = 0xC0 if level == 5 else 0xFC
    while i < end:
        topic_filter, i = _read_str(data, i, end, "topic filter")
        if i >= end:
            raise _malformed("packet truncated (subscription options)")
        opt = data[i]
        i += 1
        if opt & reserved:
            raise _malformed("subscription options reserved bits set")
        if opt & 3 == 3:
            raise _malformed("subscription with QoS 3")
        if opt & 0x30 == 0x30:
            raise _protocol_error("retain handling 3")
        if opt & 4 and topic_filter.startswith("$share/"):
            raise _protocol_error("no local set on a shared subscription")
        subs.append((topic_filter, _SUBOPTS[opt]))
    if not subs:
        raise _protocol_error("SUBSCRIBE without topic filters")
    return Subscribe(packet_id, subs, props)


def _decode_suback(b0: int, data: bytes, i: int, end: int, level: int) -> Suback:
    packet_id = _read_packet_id(data, i, end)
    i += 2
    props = None
    if level == 5:
        props, i = _read_props(data, i, end, _P_ACK)
        allowed = _RC_SUBACK
    else:
        allowed = _RC_SUBACK_V3
    codes = list(data[i:end])
    if not codes:
        raise _protocol_error("SUBACK without reason codes")
    for rc in codes:
        if rc not in allowed:
            raise _protocol_error(f"reason code 0x{rc:02X} not valid in SUBACK")
    return Suback(packet_id, codes, props)


def _decode_unsubscribe(b0: int, data: bytes, i: int, end: int, level: int) -> Unsubscribe:
    packet_id = _read_packet_id(data, i, end)
    i += 2
    props = None
    if level == 5:
        props, i = _read_props(data, i, end, _P_UNSUBSCRIBE)
    filters: list[str] = []
    while i < end:
        topic_filter, i = _read_str(data, i, end, "topic filter")
        filters.append(topic_filter)
    if not filters:
        raise _protocol_error("UNSUBSCRIBE without topic filters")
    return Unsubscribe(packet_id, filters, props)


def _decode_unsuback(b0: int, data: bytes, i: int, end: int, level: int) -> Unsuback:
    packet_id = _read_packet_id(data, i, end)
    i += 2
    if level != 5:
        _expect_end(i, end, "UNSUBACK")
        return Unsuback(packet_id)
    props, i = _read_props(data, i, end, _P_ACK)
    codes = list(data[i:end])
    if not codes:
        raise _protocol_error("UNSUBACK without reason codes")
    for rc in codes:
        if rc not in _RC_UNSUBACK:
            raise _protocol_error(f"reason code 0x{rc:02X} not valid in UNSUBACK")
    return Unsuback(packet_id, codes, props)


def _decode_pingreq(b0: int, data: bytes, i: int, end: int, level: int) -> Pingreq:
    _expect_end(i, end, "PINGREQ")
    return _PINGREQ


def _decode_pingresp(b0: int, data: bytes, i: int, end: int, level: int) -> Pingresp:
    _expect_end(i, end, "PINGRESP")
    return _PINGRESP


def _decode_disconnect(b0: int, data: bytes, i: int, end: int, level: int) -> Disconnect:
    if level != 5 or i == end:
        _expect_end(i, end, "DISCONNECT")
        return Disconnect()
    rc = _read_reason_code(data, i, _RC_DISCONNECT, "DISCONNECT")
    props, i = (None, i + 1) if i + 1 == end else _read_props(data, i + 1, end, _P_DISCONNECT)
    _expect_end(i, end, "DISCONNECT")
    return Disconnect(rc, props)


def _decode_auth(b0: int, data: bytes, i: int, end: int, level: int) -> Auth:
    if level != 5:
        raise _malformed("AUTH packet before MQTT 5 (reserved packet type 15)")
    if i == end:
        return Auth()
    rc = _read_reason_code(data, i, _RC_AUTH, "AUTH")
    props, i = (None, i + 1) if i + 1 == end else _read_props(data, i + 1, end, _P_AUTH)
    _expect_end(i, end, "AUTH")
    return Auth(rc, props)


def _decode_connect_again(b0: int, data: bytes, i: int, end: int, level: int) -> Connect:
    # A second CONNECT is the session's business; decode it by its own header.
    own_level, i = _read_connect_header(data, i, end)
    return _decode_connect_body(own_level, data, i, end)


# Index = packet type; the flags nibble every type except PUBLISH must carry (§2.1.3).
_DECODERS = (
    None,
    _decode_connect_again,
    _decode_connack,
    _decode_publish,
    _decode_pub_ack,
    _decode_pub_ack,
    _decode_pub_ack,
    _decode_pub_ack,
    _decode_subscribe,
    _decode_suback,
    _decode_unsubscribe,
    _decode_unsuback,
    _decode_pingreq,
    _decode_pingresp,
    _decode_disconnect,
    _decode_auth,
)
_REQUIRED_FLAGS = (-1, 0, 0, -1, 0, 0, 2, 0, 2, 0, 2, 0, 0, 0, 0, 0)


class MqttDecoder:
    """Incremental decoder for one connection (server side, but decodes every type).

    The protocol level is unknown until the first packet, which must be CONNECT
    (``protocol_level`` may be given up front, e.g. for a client or for tests).
    Packets larger than ``max_packet_size`` (fixed header included) are rejected with
    0x95 as soon as their fixed header is seen, without buffering them. After an error
    the decoder is dead: every later :meth:`feed` re-raises the same error.
    """

    __slots__ = ("_buf", "_error", "_max", "_need", "protocol_level")

    def __init__(
        self, max_packet_size: int = MAX_PACKET_SIZE, *, protocol_level: int | None = None
    ) -> None:
        if protocol_level not in (None, 3, 4, 5):
            raise ValueError(f"unsupported protocol level {protocol_level}")
        self._max = max_packet_size
        self.protocol_level: int | None = protocol_level
        self._buf = bytearray()
        self._need = 0
        self._error: MqttProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete packet held back."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Packet]:
        """Add received bytes; return the packets they complete, in order.

        Raises MqttProtocolError; its ``packets`` are the packets decoded before the
        error in this call.
        """
        if self._error is not None:
            raise self._error
        buf = self._buf
        if buf:
            buf += data
            if len(buf) < self._need:
                return []
            data = bytes(buf)
            buf.clear()
        elif data.__class__ is not bytes:
            data = bytes(data)
        n = len(data)
        pos = 0
        need = 0
        out: list[Packet] = []
        level = self.protocol_level
        max_size = self._max
        try:
            while True:
                if n - pos < 2:
                    need = n - pos + 1
                    if need == 2:
                        self._check_first_byte(data[pos])
                    break
                b0 = data[pos]
                rl = data[pos + 1]
                if rl < 0x80:
                    hdr = pos + 2
                else:
                    rl, hdr = _read_remaining_length(data, pos, n)
                    if hdr < 0:
                        need = n - pos + 1
                        self._check_first_byte(b0)
                        break
                end = hdr + rl
                if end - pos > max_size:
                    raise MqttProtocolError(
                        _PACKET_TOO_LARGE,
                        f"packet of {end - pos} bytes exceeds maximum packet size {max_size}",
                    )
                if end > n:
                    need = end - pos
                    self._check_first_byte(b0)
                    break
                if b0 >> 4 == 3 and level:
                    out.append(_decode_publish(b0, data, hdr, end, level))
                elif b0 == 0x40 and rl == 2 and level and (data[hdr] or data[hdr + 1]):
                    # a PUBACK without reason code (one per QoS 1 delivery), decoded inline
                    out.append(Puback(data[hdr] << 8 | data[hdr + 1]))
                else:
                    out.append(self._decode_other(b0, data, hdr, end))
                    level = self.protocol_level
                pos = end
        except MqttProtocolError as exc:
            exc.packets = out
            self._error = exc
            raise
        except (IndexError, ValueError, struct.error) as exc:  # defensive: never leak these
            err = _malformed(f"malformed packet ({exc})")
            err.packets = out
            self._error = err
            raise err from exc
        if pos < n:
            buf += data[pos:] if pos else data
            self._need = need
        return out

    def _check_first_byte(self, b0: int) -> None:
        """Reject a bad packet type/flags while its body is still arriving.

        Without this a non-MQTT peer (say an HTTP request) would just sit in the buffer.
        """
        ptype = b0 >> 4
        level = self.protocol_level
        if level is None:
            if ptype != 1:
                raise _protocol_error("first packet must be CONNECT")
        elif ptype == 3:
            if b0 & 6 == 6:
                raise _malformed("PUBLISH with QoS 3")
            return
        elif ptype == 0 or (ptype == 15 and level != 5):
            raise _malformed(f"reserved packet type {ptype}")
        required = _REQUIRED_FLAGS[ptype]
        flags = b0 & 0x0F
        if flags != required and not (level == 3 and required == 2 and flags == 0x0A):
            raise _malformed(f"invalid fixed header flags 0x{flags:X} for packet type {ptype}")

    def _decode_other(self, b0: int, data: bytes, i: int, end: int) -> Packet:
        ptype = b0 >> 4
        level = self.protocol_level
        flags = b0 & 0x0F
        if level is None:
            if ptype != 1:
                raise _protocol_error("first packet must be CONNECT")
            if flags:
                raise _malformed("CONNECT fixed header flags must be 0")
            level, i = _read_connect_header(data, i, end)
            # Fixed before the rest is validated so that a failing CONNECT can still be
            # answered with a CONNACK of the right version.
            self.protocol_level = level
            return _decode_connect_body(level, data, i, end)
        if ptype == 0:
            raise _malformed("reserved packet type 0")
        required = _REQUIRED_FLAGS[ptype]
        # MQTT 3.1 sent PUBREL/SUBSCRIBE/UNSUBSCRIBE as QoS 1 and may set DUP on them.
        if (
            required >= 0
            and flags != required
            and not (level == 3 and required == 2 and flags == 0x0A)
        ):
            raise _malformed(f"invalid fixed header flags 0x{flags:X} for packet type {ptype}")
        return _DECODERS[ptype](b0, data, i, end, level)


def _read_remaining_length(data: bytes, pos: int, n: int) -> tuple[int, int]:
    """Multi-byte Remaining Length; (-1, -1) if incomplete, error past 4 bytes."""
    value = 0
    shift = 0
    i = pos + 1
    while True:
        if i >= n:
            return -1, -1
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift == 28:
            raise _malformed("remaining length longer than 4 bytes")


# --------------------------------------------------------------------------- encoding helpers

_pack_H = struct.Struct("!H").pack
_pack_BBH = struct.Struct("!BBH").pack
_pack_BBBH = struct.Struct("!BBBH").pack
_pack_I = struct.Struct("!I").pack
_PROTOCOL_NAMES = {3: b"\x00\x06MQIsdp\x03", 4: b"\x00\x04MQTT\x04", 5: b"\x00\x04MQTT\x05"}


def _vbi(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    if n > MAX_PACKET_SIZE:
        raise ValueError(f"{n} does not fit a variable byte integer")
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _frame(b0: int, body: bytes | bytearray) -> bytes:
    n = len(body)
    if n < 0x80:
        return bytes((b0, n)) + body
    return bytes((b0,)) + _vbi(n) + body


def _enc_str(s: str) -> bytes:
    b = s.encode()
    if len(b) > 0xFFFF:
        raise ValueError("string longer than 65535 bytes")
    if b"\x00" in b:
        raise ValueError("string contains U+0000")
    return _pack_H(len(b)) + b


def _enc_bin(b: bytes) -> bytes:
    if len(b) > 0xFFFF:
        raise ValueError("binary data longer than 65535 bytes")
    return _pack_H(len(b)) + bytes(b)


def _enc_props(p: Properties | None, allowed: int) -> bytes:
    """Property block with its length prefix; ValueError for a property the packet lacks."""
    if p is None:
        return b"\x00"
    out = bytearray()
    for pid, name, kind in _PROP_TABLE:
        value = getattr(p, name)
        if kind == _PAIR or pid == 0x0B:
            if not value:
                continue
        elif value is None:
            continue
        if not (allowed >> pid) & 1:
            where = _PROP_CONTEXT_NAMES.get(allowed, "this packet")
            raise ValueError(f"property {name} not allowed in {where}")
        if kind == _BYTE:
            out.append(pid)
            out.append(value)
        elif kind == _U16:
            out.append(pid)
            out += _pack_H(value)
        elif kind == _U32:
            out.append(pid)
            out += _pack_I(value)
        elif kind == _STR:
            out.append(pid)
            out += _enc_str(value)
        elif kind == _BIN:
            out.append(pid)
            out += _enc_bin(value)
        elif kind == _VBI:
            if len(value) > 1 and allowed != _P_PUBLISH:
                raise ValueError("only PUBLISH may carry several subscription identifiers")
            for v in value:
                if not 0 < v <= MAX_PACKET_SIZE:
                    raise ValueError(f"subscription identifier {v} out of range")
                out.append(pid)
                out += _vbi(v)
        else:
            for key, val in value:
                out.append(pid)
                out += _enc_str(key)
                out += _enc_str(val)
    return _vbi(len(out)) + out


def _check_level(level: int) -> None:
    if level not in (3, 4, 5):
        raise ValueError(f"unsupported protocol level {level}")


def _check_packet_id(packet_id: int | None) -> int:
    if packet_id is None or not 0 < packet_id <= 0xFFFF:
        raise ValueError(f"packet identifier {packet_id!r} must be in 1..65535")
    return packet_id


def _check_rc(rc: int, allowed: frozenset[int], what: str) -> None:
    if rc not in allowed:
        raise ValueError(f"reason code 0x{rc:02X} not valid in {what}")


# --------------------------------------------------------------------------- encoders


def encode_publish(
    topic: str | bytes,
    payload: bytes,
    qos: int = 0,
    retain: bool = False,
    dup: bool = False,
    packet_id: int | None = None,
    properties: Properties | None = None,
    protocol_level: int = 4,
) -> bytes:
    """Encode PUBLISH directly (the forwarding hot path).

    The topic is trusted (no wildcard/U+0000 check): the server only forwards topics it
    has decoded. Properties are dropped below level 5.
    """
    t = topic.encode() if topic.__class__ is str else topic
    tl = len(t)
    if tl > 0xFFFF:
        raise ValueError("topic longer than 65535 bytes")
    if qos:
        if qos != 1 and qos != 2:
            raise ValueError(f"invalid QoS {qos!r}")
        if packet_id is None or not 0 < packet_id <= 0xFFFF:
            raise ValueError(f"packet identifier {packet_id!r} must be in 1..65535")
        pid = _pack_H(packet_id)
    else:
        pid = b""
    b0 = 0x30 | qos << 1
    if retain:
        b0 |= 1
    if dup:
        if not qos and protocol_level != 3:
            raise ValueError("DUP must be 0 on a QoS 0 PUBLISH")
        b0 |= 8
    if protocol_level == 5:
        props = b"\x00" if properties is None else _enc_props(properties, _P_PUBLISH)
    elif protocol_level == 4 or protocol_level == 3:
        props = b""
    else:
        raise ValueError(f"unsupported protocol level {protocol_level}")
    rl = 2 + tl + len(pid) + len(props) + len(payload)
    if rl < 0x80:
        head = _pack_BBH(b0, rl, tl)
    elif rl < 0x4000:
        head = _pack_BBBH(b0, rl & 0x7F | 0x80, rl >> 7, tl)
    else:
        head = bytes((b0,)) + _vbi(rl) + _pack_H(tl)
    return b"".join((head, t, pid, props, payload))


def _enc_publish(p: Publish, level: int) -> bytes:
    return encode_publish(
        p.topic, p.payload, p.qos, p.retain, p.dup, p.packet_id, p.properties, level
    )


def _enc_connect(p: Connect, level: int) -> bytes:
    if p.protocol_level != level:
        raise ValueError(f"Connect.protocol_level {p.protocol_level} != protocol_level {level}")
    flags = 0x02 if p.clean_start else 0
    will = p.will
    if will is not None:
        if will.qos not in (0, 1, 2):
            raise ValueError(f"invalid will QoS {will.qos!r}")
        flags |= 0x04 | will.qos << 3 | (0x20 if will.retain else 0)
    if p.username is not None:
        flags |= 0x80
    if p.password is not None:
        if p.username is None and level != 5:
            raise ValueError("a password requires a user name before MQTT 5")
        flags |= 0x40
    parts = [_PROTOCOL_NAMES[level], bytes((flags,)), _pack_H(p.keep_alive)]
    if level == 5:
        parts.append(_enc_props(p.properties, _P_CONNECT))
    parts.append(_enc_str(p.client_id))
    if will is not None:
        if level == 5:
            parts.append(_enc_props(will.properties, _P_WILL))
        parts.append(_enc_str(will.topic))
        parts.append(_enc_bin(will.payload))
    if p.username is not None:
        parts.append(_enc_str(p.username))
    if p.password is not None:
        parts.append(_enc_bin(p.password))
    return _frame(0x10, b"".join(parts))


def _enc_connack(p: Connack, level: int) -> bytes:
    if level == 5:
        _check_rc(p.reason_code, _RC_CONNACK, "CONNACK")
        sp = 1 if p.session_present else 0
        return _frame(0x20, bytes((sp, p.reason_code)) + _enc_props(p.properties, _P_CONNACK))
    # 3.1 has no session present flag; v5 reason codes are mapped to return codes.
    sp = 1 if p.session_present and level == 4 else 0
    return bytes((0x20, 2, sp, v3_connack_return_code(p.reason_code)))


def encode_puback(packet_id: int) -> bytes:
    """A successful PUBACK without properties: the same bytes at every protocol level
    (the hot path of QoS 1 ingress; `packet_id` comes from a decoded PUBLISH)."""
    return _pack_BBH(0x40, 2, packet_id)


def _enc_pub_ack(p: Puback | Pubrec | Pubrel | Pubcomp, level: int) -> bytes:
    b0 = p.packet_type << 4 | (2 if p.packet_type == 6 else 0)
    pid = _pack_H(_check_packet_id(p.packet_id))
    no_props = p.properties is None or p.properties.is_empty()
    if level != 5 or (p.reason_code == 0 and no_props):
        return bytes((b0, 2)) + pid
    allowed = _RC_PUBREL if p.packet_type in (6, 7) else _RC_PUBACK
    _check_rc(p.reason_code, allowed, type(p).__name__.upper())
    if no_props:
        return bytes((b0, 3)) + pid + bytes((p.reason_code,))
    return _frame(b0, pid + bytes((p.reason_code,)) + _enc_props(p.properties, _P_ACK))


def _enc_subscribe(p: Subscribe, level: int) -> bytes:
    if not p.subscriptions:
        raise ValueError("SUBSCRIBE needs at least one topic filter")
    parts = [_pack_H(_check_packet_id(p.packet_id))]
    if level == 5:
        parts.append(_enc_props(p.properties, _P_SUBSCRIBE))
    for topic_filter, o in p.subscriptions:
        if o.qos not in (0, 1, 2) or o.retain_handling not in (0, 1, 2):
            raise ValueError(f"invalid subscription options {o!r}")
        opt = o.qos
        if level == 5:
            opt |= (4 if o.no_local else 0) | (8 if o.retain_as_published else 0)
            opt |= o.retain_handling << 4
        parts.append(_enc_str(topic_filter))
        parts.append(bytes((opt,)))
    return _frame(0x82, b"".join(parts))


def _enc_suback(p: Suback, level: int) -> bytes:
    if not p.reason_codes:
        raise ValueError("SUBACK needs at least one reason code")
    pid = _pack_H(_check_packet_id(p.packet_id))
    if level == 5:
        for rc in p.reason_codes:
            _check_rc(rc, _RC_SUBACK, "SUBACK")
        return _frame(0x90, pid + _enc_props(p.properties, _P_ACK) + bytes(p.reason_codes))
    # v3/v4 only know 0, 1, 2 and 0x80 (failure).
    codes = bytes(rc if rc < 0x80 else 0x80 for rc in p.reason_codes)
    for rc in codes:
        _check_rc(rc, _RC_SUBACK_V3, "SUBACK")
    return _frame(0x90, pid + codes)


def _enc_unsubscribe(p: Unsubscribe, level: int) -> bytes:
    if not p.topic_filters:
        raise ValueError("UNSUBSCRIBE needs at least one topic filter")
    parts = [_pack_H(_check_packet_id(p.packet_id))]
    if level == 5:
        parts.append(_enc_props(p.properties, _P_UNSUBSCRIBE))
    parts.extend(_enc_str(f) for f in p.topic_filters)
    return _frame(0xA2, b"".join(parts))


def _enc_unsuback(p: Unsuback, level: int) -> bytes:
    pid = _pack_H(_check_packet_id(p.packet_id))
    if level != 5:
        return b"\xb0\x02" + pid
    if not p.reason_codes:
        raise ValueError("MQTT 5 UNSUBACK needs at least one reason code")
    for rc in p.reason_codes:
        _check_rc(rc, _RC_UNSUBACK, "UNSUBACK")
    return _frame(0xB0, pid + _enc_props(p.properties, _P_ACK) + bytes(p.reason_codes))


def _enc_pingreq(p: Pingreq, level: int) -> bytes:
    return b"\xc0\x00"


def _enc_pingresp(p: Pingresp, level: int) -> bytes:
    return b"\xd0\x00"


def _enc_disconnect(p: Disconnect, level: int) -> bytes:
    no_props = p.properties is None or p.properties.is_empty()
    if level != 5 or (p.reason_code == 0 and no_props):
        return b"\xe0\x00"
    _check_rc(p.reason_code, _RC_DISCONNECT, "DISCONNECT")
    if no_props:
        return bytes((0xE0, 1, p.reason_code))
    return _frame(0xE0, bytes((p.reason_code,)) + _enc_props(p.properties, _P_DISCONNECT))


def _enc_auth(p: Auth, level: int) -> bytes:
    if level != 5:
        raise ValueError("AUTH exists only in MQTT 5")
    _check_rc(p.reason_code, _RC_AUTH, "AUTH")
    if p.reason_code == 0 and (p.properties is None or p.properties.is_empty()):
        return b"\xf0\x00"
    return _frame(0xF0, bytes((p.reason_code,)) + _enc_props(p.properties, _P_AUTH))


_ENCODERS = {
    Connect: _enc_connect,
    Connack: _enc_connack,
    Publish: _enc_publish,
    Puback: _enc_pub_ack,
    Pubrec: _enc_pub_ack,
    Pubrel: _enc_pub_ack,
    Pubcomp: _enc_pub_ack,
    Subscribe: _enc_subscribe,
    Suback: _enc_suback,
    Unsubscribe: _enc_unsubscribe,
    Unsuback: _enc_unsuback,
    Pingreq: _enc_pingreq,
    Pingresp: _enc_pingresp,
    Disconnect: _enc_disconnect,
    Auth: _enc_auth,
}


def encode(packet: Packet, protocol_level: int) -> bytes:
    """Encode any packet for ``protocol_level``; fields a level lacks are dropped.

    Raises ValueError for packets that cannot be encoded (bad ranges, a property the
    packet type may not carry, AUTH below level 5).
    """
    if packet.__class__ is Publish:
        return encode_publish(
            packet.topic,
            packet.payload,
            packet.qos,
            packet.retain,
            packet.dup,
            packet.packet_id,
            packet.properties,
            protocol_level,
        )
    _check_level(protocol_level)
    fn = _ENCODERS.get(packet.__class__)
    if fn is None:
        raise TypeError(f"not an MQTT packet: {packet!r}")
    try:
        return fn(packet, protocol_level)
    except struct.error as exc:
        raise ValueError(str(exc)) from exc
