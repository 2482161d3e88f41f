"""AMQP 1.0 message sections <-> gateway `Message`, in plain Python, for the common shapes.

Why: proton's Python `Message` was the largest cost of the durable-queue path in profiles
(decode ~14 µs, build + encode ~10 µs a message, mostly wrapper objects and per-field cffi
calls). Here the wire sections are read and written directly: header, delivery and message
annotations, properties, application properties and footer of simple values, with one data
section or an amqp-value that is binary, a string or null. Anything else (an amqp-sequence,
several data sections, an amqp-value map / list, a symbolic descriptor, a value type not
listed below, sections repeated or out of order, malformed bytes) raises `Unsupported`, and
`mapping` falls back to proton (or refuses what proton would store otherwise than sent), so
both paths give the same message. The field mapping is the one in mapping.py's table.
"""

from __future__ import annotations

import struct
import time
from typing import TypeGuard
from uuid import UUID

from gateway.model import (
    DEFAULT_PRIORITY,
    GROUP_PROPERTIES,
    MAX_PRIORITY,
    MAX_USER_PROPERTIES,
    PRIORITY_PROPERTY,
    TOPIC_ADDRESS,
    Delivery,
    Message,
    PropertyValue,
    Publisher,
    priority_of,
)
from protocols.amqp import framing

AMQP_VALUE = "x-amqp-value"  # mapping.AMQP_VALUE: such messages take the proton path

# section descriptors (smallulong codes)
HEADER, DELIVERY_ANN, MESSAGE_ANN, PROPERTIES, APP_PROPS, DATA, SEQUENCE, VALUE, FOOTER = range(
    0x70, 0x79
)

_B = struct.Struct(">b").unpack_from
_H = struct.Struct(">H").unpack_from
_h = struct.Struct(">h").unpack_from
_I = struct.Struct(">I").unpack_from
_i = struct.Struct(">i").unpack_from
_Q = struct.Struct(">Q").unpack_from
_q = struct.Struct(">q").unpack_from
_f = struct.Struct(">f").unpack_from
_d = struct.Struct(">d").unpack_from


_NO_PROPERTIES: list = [None] * 13  # read only
# Items of one list or map read here: a map of MAX_USER_PROPERTIES application properties
MAX_ITEMS = 2 * MAX_USER_PROPERTIES
_COMPOUND = frozenset((0xC0, 0xC1, 0xD0, 0xD1, 0xE0, 0xF0))  # list, map, array


class Unsupported(Exception):
    """Not a shape handled here: use proton instead."""


# -- decoding ----------------------------------------------------------------------------------


def _read(buf: bytes, i: int, nested: bool = False) -> tuple[object, int]:
    """One encoded value at offset i: (value, offset after it). Lists and maps come back as
    lists (a map as its flat key, value, ... list); uuids as UUID; symbols as str. A list
    or map `nested` in one raises Unsupported: the proton path bounds a message's values."""
    code = buf[i]
    i += 1
    if code == 0x40:
        return None, i
    if code == 0xC0 or code == 0xC1:  # list8 / map8: header, properties, annotations
        if nested:
            raise Unsupported("a list or map in a list or map")
        return _items(buf, i + 2, buf[i + 1])
    if code == 0xD0 or code == 0xD1:  # list32 / map32: proton's maps
        if nested:
            raise Unsupported("a list or map in a list or map")
        return _items(buf, i + 8, _I(buf, i + 4)[0])
    if code == 0x45:  # list0: an empty properties section
        return [], i
    if code == 0x41:
        return True, i
    if code == 0x42:
        return False, i
    if code in (0xA1, 0xA3, 0xA0):
        end = i + 1 + buf[i]
        raw = buf[i + 1 : end]
        if end > len(buf):
            raise Unsupported("truncated")
        return (raw if code == 0xA0 else raw.decode()), end
    if code in (0xB1, 0xB3, 0xB0):
        end = i + 4 + _I(buf, i)[0]
        if end > len(buf):
            raise Unsupported("truncated")
        raw = buf[i + 4 : end]
        return (raw if code == 0xB0 else raw.decode()), end
    if code in (0x43, 0x44):
        return 0, i
    if code in (0x50, 0x52, 0x53):
        return buf[i], i + 1
    if code in (0x51, 0x54, 0x55):
        return _B(buf, i)[0], i + 1
    if code == 0x56:
        return buf[i] != 0, i + 1
    if code == 0x60:
        return _H(buf, i)[0], i + 2
    if code == 0x61:
        return _h(buf, i)[0], i + 2
    if code == 0x70:
        return _I(buf, i)[0], i + 4
    if code == 0x71:
        return _i(buf, i)[0], i + 4
    if code == 0x72:
        return _f(buf, i)[0], i + 4
    if code == 0x80:
        return _Q(buf, i)[0], i + 8
    if code in (0x81, 0x83):
        return _q(buf, i)[0], i + 8
    if code == 0x82:
        return _d(buf, i)[0], i + 8
    if code == 0x98:
        return UUID(bytes=bytes(buf[i : i + 16])), i + 16
    raise Unsupported(f"type 0x{code:02x}")


def _items(buf: bytes, i: int, count: int) -> tuple[list, int]:
    """The `count` values of a list or map starting at offset i (nulls, booleans, small
    integers and short strings or symbols, most of a header, a properties list or a map,
    read inline: a call each was most of the cost of a JMS client's message). More than
    MAX_ITEMS are left to the proton path, which bounds a message's values."""
    if count > MAX_ITEMS:
        raise Unsupported("a list or map of many items")
    items: list = []
    append = items.append
    for _ in range(count):
        code = buf[i]
        if code == 0x40:
            append(None)
            i += 1
        elif code == 0x41 or code == 0x42:  # true / false
            append(code == 0x41)
            i += 1
        elif code == 0x50 or code == 0x52 or code == 0x53:  # ubyte, smalluint, smallulong
            append(buf[i + 1])
            i += 2
        elif code == 0x51 or code == 0x54 or code == 0x55:  # byte, smallint, smalllong
            append(_B(buf, i + 1)[0])
            i += 2
        elif code == 0xA1 or code == 0xA3:
            end = i + 2 + buf[i + 1]
            if end > len(buf):
                raise Unsupported("truncated")
            append(buf[i + 2 : end].decode())
            i = end
        else:
            value, i = _read(buf, i, True)
            append(value)
    return items, i


# isinstance with a tuple: a `str | bytes` union is built anew on every call (4 x slower)
_TEXT_TYPES = (str, bytes)
_PROPERTY_TYPES = (str, bytes, bool, int, float)


def _map(value: object, constructor: int) -> dict:
    """A map section's value; `_read` gives lists and maps alike, so the type code tells."""
    if value is None:
        return {}
    if (constructor != 0xC1 and constructor != 0xD1) or len(value) % 2:  # map8 / map32
        raise Unsupported("not a map")
    return dict(zip(value[::2], value[1::2], strict=True))


def _ident(value: object) -> str | bytes | int | None:
    if value is None or isinstance(value, _TEXT_TYPES):
        return value
    if isinstance(value, int) and value >= 0 and value.__class__ is not bool:
        return value  # a ulong; a negative long is no id type: proton drops it (and a
        # stored one could not be sent on to AMQP receivers)
    if isinstance(value, UUID):
        return str(value)
    raise Unsupported("message id type")


# A uuid correlation-id as text, the form MQTT correlation data carries it in (RabbitMQ's):
# a responder's echo of it becomes the uuid again for an AMQP requester.
URN_UUID = "urn:uuid:"


def correlation_in(value: object) -> str | bytes | int | None:
    return URN_UUID + str(value) if isinstance(value, UUID) else _ident(value)


def correlation_out(value: str | bytes | int) -> object:
    """The AMQP correlation-id of a model one: a uuid again when it is one's URN."""
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    if isinstance(text, str) and len(text) == 45 and text.startswith(URN_UUID):
        try:
            return UUID(text[9:])
        except ValueError:
            pass
    return value


def _prop(value: object) -> PropertyValue:
    if value is None or isinstance(value, _PROPERTY_TYPES):
        return value
    if isinstance(value, UUID):
        return str(value)
    raise Unsupported("property value type")


def _priority(value: object) -> int:
    """The model priority (0-9) of a header priority: a ubyte, clamped to 9. Anything else
    (a negative byte, a wider integer, another type) is the default, as proton reads it."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0xFF:
        return min(value, MAX_PRIORITY)
    return DEFAULT_PRIORITY


# what malformed bytes raise in the decoder (UnicodeDecodeError is a ValueError)
_MALFORMED = (IndexError, struct.error, TypeError, ValueError, OverflowError)


def decode(data: bytes | bytearray, publisher: Publisher) -> tuple[Message, str | None, int | None]:
    """(message with destination left empty, properties.to, x-opt-jms-dest) of one encoded
    AMQP message; raises Unsupported for shapes left to proton."""
    try:
        return _decode(bytes(data), publisher)
    except _MALFORMED as exc:
        raise Unsupported(str(exc)) from exc


def _decode(data: bytes, publisher: Publisher) -> tuple[Message, str | None, int | None]:
    header: list | None = None
    props: list | None = None
    annotations: dict | None = None
    app: dict | None = None
    body: object = None
    bodies, last = 0, -1
    i, n = 0, len(data)
    bare_start = bare_end = n  # see Message.amqp_bare
    footer = None
    annotations_span = 0, 0
    while i < n:
        if data[i] != 0x00:
            raise Unsupported("not a described section")
        start = i
        if data[i + 1] == 0x53:
            code, i = data[i + 2], i + 3
        elif data[i + 1] == 0x80:
            code, i = _Q(data, i + 2)[0], i + 10
        else:
            raise Unsupported("symbolic descriptor")
        if code <= last:  # repeated or out of order: framing tells which (or several data)
            raise Unsupported("section order")
        last = code
        if code >= PROPERTIES and bare_start == n:
            bare_start = start
        constructor = data[i]
        if code == SEQUENCE or (code == VALUE and constructor in _COMPOUND):
            raise Unsupported("amqp-sequence, or amqp-value list, map or array")  # unread:
            # the proton path bounds its values
        value, i = _read(data, i)
        if code in (DATA, VALUE):
            bodies += 1
            body = value
            if code == DATA and value.__class__ is not bytes:
                raise Unsupported("data section without binary")
        elif code == HEADER:
            header = value if value.__class__ is list else None
        elif code == PROPERTIES:
            props = value if value.__class__ is list else None
        elif code == MESSAGE_ANN:
            annotations = _map(value, constructor)
            annotations_span = start, i
        elif code == APP_PROPS:
            app = _map(value, constructor)
        elif code == FOOTER:
            bare_end, footer = start, data[start:]  # the last section (check_message)
        elif code != DELIVERY_ANN:
            raise Unsupported(f"section 0x{code:x}")
    if bodies > 1:
        raise Unsupported("several body sections")
    if props:
        if len(props) < 13:
            props += _NO_PROPERTIES[len(props) :]
        to, subject, reply_to, group_id = props[2], props[3], props[4], props[10]
        for text in (to, subject, reply_to, group_id):
            if text is not None and text.__class__ is not str:
                raise Unsupported("property type")
        content_type = props[6]
        if content_type is not None and content_type.__class__ is not str:
            raise Unsupported("content-type type")
        if not content_type or content_type == "None":
            content_type = None
        expiry, created = props[8], props[9]
        if created is not None and created.__class__ is not int:  # a timestamp
            raise Unsupported("creation-time type")
        message_id, correlation_id = _ident(props[0]), correlation_in(props[5])
    else:
        to = subject = reply_to = group_id = content_type = expiry = created = None
        message_id = correlation_id = None
    if body is None:
        payload = b""
    elif body.__class__ is bytes:  # _read slices the bytes copy of `data`: never a subclass
        payload = body
    elif isinstance(body, str):
        payload = body.encode()
        content_type = content_type or "text/plain"
    else:
        raise Unsupported("amqp-value of another type")
    user_properties = []
    if app:
        for key, value in app.items():
            if key.__class__ is not str:
                raise Unsupported("application property key")
            user_properties.append((key, _prop(value)))
    durable = priority = ttl = None
    if header:
        durable = header[0]
        if len(header) > 2:
            priority, ttl = header[1], header[2]
        elif len(header) > 1:
            priority = header[1]
    if expiry:
        if expiry.__class__ is not int:  # a timestamp; proton's path judges other types
            raise Unsupported("absolute-expiry-time type")
        expiration: int | None = expiry  # type: ignore[assignment]
    elif ttl:
        if ttl.__class__ is not int:  # a uint
            raise Unsupported("ttl type")
        expiration = int(time.time() * 1000 + ttl)  # type: ignore[operator]
    else:
        expiration = None
    msg = Message(  # positional: 0.25 µs against 0.63 with keywords
        "",  # destination: the caller's
        payload,
        group_id or None,  # partition_key
        DEFAULT_PRIORITY if priority is None else _priority(priority),
        expiration,
        None,  # not_before
        bool(durable),  # persistent
        None,  # dmq_eligible
        content_type,
        correlation_id,
        reply_to or None,
        message_id,
        subject or None,
        user_properties,
        {},  # annotations
        publisher,
    )
    msg.timestamp = created  # type: ignore[assignment]
    if bare_start < bare_end:
        keep_bare(msg, data[bare_start:bare_end])
    msg.amqp_footer = footer
    if not annotations:
        return msg, to or None, None
    msg.amqp_annotations = data[annotations_span[0] : annotations_span[1]]
    return msg, to or None, annotated(msg, annotations)


def annotated(msg: Message, annotations: dict[str, object]) -> int | None:
    """What the message annotations set in the model (DMQ eligibility, a delivery time, a
    topic reply-to); their x-opt-jms-dest, if any."""
    eligible = annotations.get("x-opt-dmq-eligible")
    if isinstance(eligible, bool):
        msg.dmq_eligible = eligible
    not_before = annotations.get("x-opt-delivery-time", annotations.get("x-qpid-not-valid-before"))
    delay = annotations.get("x-opt-delivery-delay")  # Artemis's clients: ms from now
    if _integer(not_before):
        msg.not_before = int(not_before)
    elif _integer(delay) and delay > 0:
        msg.not_before = int(time.time() * 1000) + delay
    jms_topic_reply_to(msg, annotations)
    jms_dest = annotations.get("x-opt-jms-dest")
    return jms_dest if _integer(jms_dest) else None


def _integer(value: object) -> TypeGuard[int]:
    """An AMQP integer (of any width): not a boolean, which Python counts as one."""
    return isinstance(value, int) and not isinstance(value, bool)


JMS_TOPICS = (1, 3)  # x-opt-jms-dest, x-opt-jms-reply-to: a topic, a temporary topic
_PREFIXED = ("topic://", "queue://", "/queues/")


def jms_topic_reply_to(msg: Message, annotations: dict[str, object]) -> None:
    """Qpid JMS names a Topic reply-to by its bare name with x-opt-jms-reply-to 1 (3: a
    temporary one): the model's reply-to is then an address that says it is a topic, as
    an MQTT responder's response topic needs (the AMQP sections go on as they came)."""
    kind, reply_to = annotations.get("x-opt-jms-reply-to"), msg.reply_to
    if (
        reply_to
        and kind in JMS_TOPICS
        and not isinstance(kind, bool)
        and not reply_to.startswith(_PREFIXED)
    ):
        msg.reply_to = TOPIC_ADDRESS + reply_to


# -- encoding ----------------------------------------------------------------------------------

_pack_I = struct.Struct(">I").pack
_pack_q = struct.Struct(">q").pack
_pack_Q = struct.Struct(">Q").pack
_pack_d = struct.Struct(">d").pack
_NULL, _TRUE, _FALSE = b"\x40", b"\x41", b"\x42"


def _variable(small: int, large: int, raw: bytes) -> bytes:
    n = len(raw)
    if n < 256:
        return bytes((small, n)) + raw
    return bytes((large,)) + _pack_I(n) + raw


def _str(value: str) -> bytes:
    return _variable(0xA1, 0xB1, value.encode())


def _sym(value: str) -> bytes:
    try:
        return _variable(0xA3, 0xB3, value.encode("ascii"))
    except UnicodeEncodeError as exc:
        raise Unsupported("non-ascii symbol") from exc


def _long(value: int) -> bytes:
    if -128 <= value <= 127:
        return bytes((0x55, value & 0xFF))
    if -(1 << 63) <= value < 1 << 63:
        return b"\x81" + _pack_q(value)
    if 0 <= value < 1 << 64:  # a ulong the client sent
        return b"\x80" + _pack_Q(value)
    raise Unsupported("integer out of range")


def _uint(value: int) -> bytes:
    if value == 0:
        return b"\x43"
    if value < 256:
        return bytes((0x52, value))
    return b"\x70" + _pack_I(min(value, 0xFFFFFFFF))


def _value(value: object) -> bytes:
    """Encoding of a model property value (as proton's put_object would type it)."""
    if value is None:
        return _NULL
    if value is True:
        return _TRUE
    if value is False:
        return _FALSE
    if isinstance(value, str):
        return _str(value)
    if isinstance(value, bytes):
        return _variable(0xA0, 0xB0, value)
    if isinstance(value, int):
        return _long(value)
    if isinstance(value, float):
        return b"\x82" + _pack_d(value)
    raise Unsupported(f"value type {type(value).__name__}")


def _msgid(value: object) -> bytes:
    if isinstance(value, UUID):
        return b"\x98" + value.bytes
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < 1 << 64:
            raise Unsupported("message id out of range")
        return b"\x80" + _pack_Q(value)
    return _value(value)


def _compound(small: int, large: int, items: list[bytes]) -> bytes:
    body = b"".join(items)
    count = len(items)
    if len(body) + 1 < 256 and count < 256:
        return bytes((small, len(body) + 1, count)) + body
    return bytes((large,)) + _pack_I(len(body) + 4) + _pack_I(count) + body


def _section(code: int, value: bytes) -> bytes:
    return bytes((0x00, 0x53, code)) + value


def _header(persistent: bool, priority: int, ttl: bytes, count: int, first: bool) -> bytes:
    items = [
        _TRUE if persistent else _FALSE,
        bytes((0x50, max(0, min(priority, MAX_PRIORITY)))),
        ttl,
        _TRUE if first else _FALSE,
        _uint(max(0, count - 1)),
    ]
    return _section(HEADER, _compound(0xC0, 0xD0, items))


# x-opt-jms-dest, encoded, by to_queue: 0 a queue, 1 a topic (Qpid JMS)
_JMS_DEST = {
    True: (b"\xa3\x0ex-opt-jms-dest", b"\x51\x00"),
    False: (b"\xa3\x0ex-opt-jms-dest", b"\x51\x01"),
}


def _annotations(annotations: dict[str, PropertyValue], to_queue: bool) -> bytes:
    items: list[bytes] = []
    for key, value in annotations.items():
        items += (_sym(key), _value(value))
    items += _JMS_DEST[to_queue]
    return _section(MESSAGE_ANN, _compound(0xC1, 0xD1, items))


def _merged(section: bytes, ours: dict[str, PropertyValue], to_queue: bool) -> bytes:
    """The publisher's message annotations with the gateway's own (x-opt-jms-dest, a dead
    message's origin) in place of any it sent under those keys."""
    if not ours:
        merged = _MERGED.get((section, to_queue))
        if merged is not None:
            return merged
    items, _ = framing.compound_items(section, framing.section_at(section, 0)[1])
    kept: list[bytes] = []
    for key, value in zip(items[::2], items[1::2], strict=True):
        code = key[0]  # a symbol key may be one of ours
        name = key[2 if code == 0xA3 else 5 :].decode() if code in (0xA3, 0xB3) else None
        if name != "x-opt-jms-dest" and name not in ours:
            kept += (key, value)
    for name, value in ours.items():
        kept += (_sym(name), _value(value))
    kept += _JMS_DEST[to_queue]
    merged = _section(MESSAGE_ANN, _compound(0xC1, 0xD1, kept))
    if not ours and len(_MERGED) < _MERGED_MAX and len(section) <= _MERGED_SIZE:
        _MERGED[section, to_queue] = merged
    return merged


# Sections that most deliveries share, encoded once: the header of a message without
# expiry, by (persistent, priority, delivery count, first acquirer), and the annotations
# of a message that has none of its own, by to_queue.
_HEADERS: dict[tuple[bool, int, int, bool], bytes] = {}
_HEADERS_MAX = 256
_ANNOTATIONS = {to_queue: _annotations({}, to_queue) for to_queue in (False, True)}
# The properties section of a message whose only property is `to`, by (destination,
# to_queue): most messages, and encoding it was most of the encode (1.58 -> 0.43 µs).
_PROPERTIES_TO: dict[tuple[str, bool], bytes] = {}
_PROPERTIES_TO_MAX = 1024
_DATA = bytes((0x00, 0x53, DATA))
# A publisher's message annotations merged with x-opt-jms-dest, by (section, to_queue): a
# producer's messages mostly carry the same ones.
_MERGED: dict[tuple[bytes, bool], bytes] = {}
_MERGED_MAX = 256
_MERGED_SIZE = 1024  # longer sections are merged each time: the cache stays small


def encode(delivery: Delivery, now_ms: int | None = None) -> bytes:
    """The AMQP message for one delivery: the delivery's header and annotations, then the
    publisher's bare message as it came; for a message from another protocol, what
    mapping.from_delivery(...).encode() gives (Unsupported for an amqp-value body kept in
    an annotation by an earlier version: left to proton)."""
    msg = delivery.message
    count, first = delivery.delivery_count, delivery.first_acquirer
    if msg.expiration is None:
        key = (msg.persistent, msg.priority, count, first)
        header = _HEADERS.get(key)
        if header is None:
            header = _header(msg.persistent, msg.priority, _NULL, count, first)
            if len(_HEADERS) < _HEADERS_MAX:
                _HEADERS[key] = header
        expiry = _NULL
    else:
        now = time.time() * 1000 if now_ms is None else now_ms
        ttl = _uint(max(1, int(msg.expiration - now)))
        header = _header(msg.persistent, msg.priority, ttl, count, first)
        expiry = b"\x83" + _pack_q(msg.expiration)
    if msg.amqp_bare is not None:  # the publisher's bare message, as it came
        if msg.amqp_annotations:
            annotations = _merged(msg.amqp_annotations, msg.annotations, msg.to_queue)
        elif msg.annotations:
            annotations = _annotations(msg.annotations, msg.to_queue)
        else:
            annotations = _ANNOTATIONS[msg.to_queue]
        footer = msg.amqp_footer
        if footer is not None:
            return b"".join((header, annotations, msg.amqp_bare, footer))
        return b"".join((header, annotations, msg.amqp_bare))
    if msg.annotations:
        if AMQP_VALUE in msg.annotations:
            raise Unsupported("amqp-value body")
        annotations = _annotations(msg.annotations, msg.to_queue)
    else:
        annotations = _ANNOTATIONS[msg.to_queue]
    if (
        expiry is _NULL
        and msg.message_id is None
        and msg.subject is None
        and msg.reply_to is None
        and msg.correlation_id is None
        and msg.content_type is None
        and msg.partition_key is None
    ):
        properties = _PROPERTIES_TO.get((msg.destination, msg.to_queue))
        if properties is None:
            properties = _properties_to(msg.destination, msg.to_queue)
    else:
        properties = _properties(msg, expiry)
    parts = [header, annotations, properties]
    if msg.user_properties and (props := application_properties(msg)):
        app: list[bytes] = []
        for key, value in dict(props).items():
            app += (_str(key), _value(value))
        parts.append(_section(APP_PROPS, _compound(0xC1, 0xD1, app)))
    payload = msg.payload
    size = len(payload)
    if size < 256:
        parts += (_DATA, bytes((0xA0, size)), payload)
    else:
        parts += (_DATA, b"\xb0", _pack_I(size), payload)
    return b"".join(parts)


def content_type_out(content_type: str | None) -> str | None:
    """AMQP's content-type is a symbol, ASCII only (§3.2.4, §1.6.20): an MQTT 5 publisher's
    content type past ASCII is left out, as RabbitMQ does."""
    return content_type if content_type is not None and content_type.isascii() else None


def application_properties(msg: Message) -> list[tuple[str, PropertyValue]]:
    """`msg`'s user properties but an MQTT publisher's for the group and the priority:
    AMQP carries what they set in group-id and header.priority (another publisher's
    properties of those names are its own). Of a key an MQTT publisher repeated, the
    first value: the one selectors read (engine/selection.py), as RabbitMQ keeps."""
    props, publisher = msg.user_properties, msg.publisher
    if publisher is None or publisher.protocol != "mqtt":
        return props
    first: dict[str, PropertyValue] = {}
    for k, v in props:
        if (k in GROUP_PROPERTIES and v == msg.partition_key) or (
            k == PRIORITY_PROPERTY and priority_of(v) == msg.priority
        ):
            continue
        first.setdefault(k, v)
    return list(first.items())


def keep_bare(msg: Message, bare: bytes) -> None:
    """Keep the bare message for AMQP receivers, with the payload stored once where it is
    the bare message's last bytes (a data section's, a string's or binary amqp-value's)."""
    msg.amqp_bare = bare
    payload = msg.payload
    if bare.endswith(payload):
        msg.payload_in_bare = len(bare) - len(payload)


def address_bare(msg: Message) -> None:
    """Give a kept bare message the `to` its publisher left out: the address it was sent to,
    which receivers such as Qpid JMS take its destination from. Everything else stays, and
    all of it with a footer: its hashes or signatures are of the bare message as sent."""
    bare = msg.amqp_bare
    if bare is None or msg.amqp_footer is not None:
        return
    code, head = framing.section_at(bare, 0)
    if code != PROPERTIES:  # no properties section: one with only `to` goes first
        head = 0
    if head:
        items, end = framing.compound_items(bare, head)
        items += [_NULL] * (3 - len(items))
        items[2] = _str(msg.destination if msg.to_queue else f"topic://{msg.destination}")
        section = _section(PROPERTIES, _compound(0xC0, 0xD0, items))
    else:
        section = _PROPERTIES_TO.get((msg.destination, msg.to_queue))
        if section is None:
            section = _properties_to(msg.destination, msg.to_queue)
        end = 0
    msg.amqp_bare = section + bare[end:]
    if msg.payload_in_bare is not None:
        msg.payload_in_bare += len(section) - end


def _properties_to(destination: str, to_queue: bool) -> bytes:
    """The properties section with only `to`, kept for the next message to that address."""
    to = destination if to_queue else f"topic://{destination}"
    section = _section(PROPERTIES, _compound(0xC0, 0xD0, [_NULL, _NULL, _str(to)]))
    if len(_PROPERTIES_TO) < _PROPERTIES_TO_MAX:
        _PROPERTIES_TO[destination, to_queue] = section
    return section


def _properties(msg: Message, expiry: bytes) -> bytes:
    to = msg.destination if msg.to_queue else f"topic://{msg.destination}"
    props = [
        _NULL if msg.message_id is None else _msgid(msg.message_id),
        _NULL,  # user-id
        _str(to),
        _NULL if msg.subject is None else _str(msg.subject),
        _NULL if msg.reply_to is None else _str(msg.reply_to),
        _NULL if msg.correlation_id is None else _msgid(correlation_out(msg.correlation_id)),
        _NULL if (ctype := content_type_out(msg.content_type)) is None else _sym(ctype),
        _NULL,  # content-encoding
        expiry,
        _NULL if msg.timestamp is None else b"\x83" + _pack_q(msg.timestamp),  # creation-time
        _NULL if msg.partition_key is None else _str(msg.partition_key),
    ]
    while props[-1] is _NULL:
        props.pop()
    return _section(PROPERTIES, _compound(0xC0, 0xD0, props))
