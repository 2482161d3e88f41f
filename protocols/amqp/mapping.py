"""proton `Message` <-> gateway `Message`.

An AMQP publisher's bare message (properties, application-properties, body: immutable in
transit, §3.2) and footer are kept as sent (`Message.amqp_bare`, `Message.amqp_footer`) and
go to AMQP receivers unchanged, with only a missing `to` filled in (not with a footer); the
model fields below are read from it for routing, selectors and the other protocols, and are
what AMQP receivers get of other publishers' messages.

| model            | AMQP 1.0                                                         |
|------------------|------------------------------------------------------------------|
| destination      | ingress: link address, or properties.to on the anonymous relay;  |
|                  | egress: properties.to (``topic://`` prefixed for a topic) and    |
|                  | message-annotation x-opt-jms-dest (0 queue, 1 topic, Qpid JMS)   |
| partition_key    | properties.group-id                                              |
| user_properties  | application-properties (order kept)                              |
| expiration       | header.ttl / properties.absolute-expiry-time (epoch ms)          |
| persistent       | header.durable                                                   |
| priority         | header.priority (0-9; higher AMQP values are clamped to 9)       |
| correlation_id   | properties.correlation-id                                        |
| reply_to         | properties.reply-to                                              |
| message_id       | properties.message-id                                            |
| subject          | properties.subject                                               |
| content_type     | properties.content-type                                          |
| timestamp        | properties.creation-time (epoch ms; JMSTimestamp in selectors)   |
| payload          | one data section; amqp-value str (utf-8, text/plain) or binary   |
|                  | accepted on ingress; egress sends one data section               |
|                  | other amqp-values (map, list...): JSON payload for other         |
|                  | protocols; AMQP consumers get the value in the bare message      |
|                  | (entries stored before: kept in annotation x-amqp-value)         |
|                  | several data (or amqp-sequence) sections: refused on ingress     |
|                  | (amqp:not-implemented), proton's Message would keep one          |
| delivery_count   | header.delivery-count = count - 1, first-acquirer = count == 1   |
|                  | unless a consumer acquired it before (released: uncounted)       |
| dmq_eligible     | message-annotation x-opt-dmq-eligible (bool, ingress)            |
| not_before       | message-annotation x-opt-delivery-time / x-qpid-not-valid-before |
|                  | (epoch ms, ingress), or x-opt-delivery-delay (ms from arrival):   |
|                  | held in the queue until then                                     |
| annotations      | message-annotations on egress (x-origin-queue, x-dmq-reason on   |
|                  | messages from a dead message queue), with an AMQP publisher's    |
|                  | own (Message.amqp_annotations) under other names                 |

Egress sets header.ttl to the time left, not the original TTL, as a broker relaying a
stored message should.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from uuid import UUID

from proton import Array, Data, Described, byte, symbol, ulong
from proton import Message as AmqpMessage

from gateway.model import (
    MAX_PRIORITY,
    MAX_USER_PROPERTIES,
    Delivery,
    Message,
    PropertyValue,
    Publisher,
)
from protocols.amqp import framing, sections

MAX_TTL_S = 0xFFFFFFFF / 1000  # header.ttl is a uint of milliseconds
JMS_DEST = symbol("x-opt-jms-dest")
AMQP_VALUE = "x-amqp-value"  # annotation keeping an amqp-value body that is not str or bytes
JMS_QUEUE, JMS_TOPIC = byte(0), byte(1)


class BodyError(ValueError):
    """The message cannot be decoded, or its body is not one the gateway stores as bytes;
    `condition` is the error the refusal carries."""

    condition = "amqp:decode-error"


class UnsupportedBody(BodyError):
    """A well-formed message the gateway cannot store as it was sent."""

    condition = "amqp:not-implemented"


class OverLimit(BodyError):
    """A well-formed message with more values or application properties than the gateway
    takes in one (framing.MAX_VALUES, MAX_USER_PROPERTIES)."""

    condition = "amqp:resource-limit-exceeded"


@dataclass(slots=True)
class Ingress:
    """A decoded client message: `to` and `jms_dest` pick the destination on the relay."""

    message: Message
    to: str | None
    jms_dest: int | None  # Qpid JMS annotation x-opt-jms-dest: 0 queue, 1 topic, 2/3 temporary


def decode(data: bytes, publisher: Publisher) -> Ingress:
    """Ingress: the gateway message for an encoded AMQP message (destination left empty).

    The common shapes are read by `sections` (a fraction of proton's cost); the rest, and
    anything else well-framed, go through proton's Message (malformed bytes: BodyError)."""
    if not data:
        raise BodyError("empty transfer: an AMQP message has at least one section")
    try:
        return Ingress(*sections.decode(data, publisher))
    except sections.Unsupported:
        pass
    try:
        bodies = framing.check_message(data)
    except framing.Malformed as exc:
        raise BodyError(f"malformed AMQP message: {exc}") from None
    except framing.OverLimit as exc:
        raise OverLimit(str(exc)) from None
    if bodies > 1:  # proton's Message would keep one of them
        raise UnsupportedBody(f"{bodies} body sections: the gateway stores one payload")
    amqp = AmqpMessage()
    try:
        amqp.decode(data)
    except Exception as exc:
        raise BodyError(f"undecodable AMQP message: {exc}") from exc
    properties, annotations = amqp.properties or {}, amqp.annotations or {}
    if not isinstance(properties, dict) or not isinstance(annotations, dict):
        raise BodyError("application-properties and message-annotations must be maps")
    if len(properties) > MAX_USER_PROPERTIES:
        raise OverLimit(f"more than {MAX_USER_PROPERTIES} application-properties")
    body = amqp.body
    content_type = _content_type(amqp)
    if body is None:
        payload = b""
    elif isinstance(body, str):
        payload = body.encode()
        content_type = content_type or "text/plain"
    elif isinstance(body, (bytes, memoryview)):
        payload = bytes(body)  # a view into `amqp`: copy it while that is alive
    else:  # another AMQP value (map, list, number...): AMQP consumers get the bare message
        # as sent, everyone else (MQTT subscribers) the value as JSON
        try:
            payload = _json_text(body).encode()
        except Exception as exc:
            raise UnsupportedBody(f"unsupported AMQP body {type(body).__name__}: {exc}") from exc
        content_type = content_type or "application/json"
    msg = Message(
        destination="",
        payload=payload,
        partition_key=amqp.group_id or None,
        priority=min(int(amqp.priority), MAX_PRIORITY),
        expiration=_expiration(amqp),
        persistent=bool(amqp.durable),
        content_type=content_type,
        correlation_id=_correlation(amqp.correlation_id),
        reply_to=amqp.reply_to or None,
        message_id=_ident(amqp.id),
        subject=amqp.subject or None,
        user_properties=[(str(k), _value(v)) for k, v in properties.items()],
        publisher=publisher,
        timestamp=int(amqp.creation_time * 1000) if amqp.creation_time else None,
    )
    start, end = framing.bare_range(data)
    if start < end:
        sections.keep_bare(msg, bytes(data[start:end]))
    if end < len(data):  # a footer (check_message: the last section)
        msg.amqp_footer = bytes(data[end:])
    if annotations:
        start, end = framing.section_span(data, framing.MESSAGE_ANNOTATIONS)
        msg.amqp_annotations = bytes(data[start:end])
    return Ingress(msg, amqp.address or None, sections.annotated(msg, annotations))


def from_delivery(delivery: Delivery) -> AmqpMessage:
    """Egress: the proton message for one delivery (payload as a single data section)."""
    msg = delivery.message
    kept = msg.annotations.get(AMQP_VALUE)
    if isinstance(kept, bytes):  # the publisher's AMQP value, as it sent it
        amqp = AmqpMessage(body=_decode_value(kept))
    else:
        amqp = AmqpMessage(body=msg.payload, inferred=True)
    amqp.durable = msg.persistent
    amqp.priority = msg.priority
    amqp.delivery_count = delivery.delivery_count - 1
    amqp.first_acquirer = delivery.first_acquirer
    if msg.expiration is not None:
        amqp.expiry_time = msg.expiration / 1000
        left = (msg.expiration - time.time() * 1000) / 1000
        amqp.ttl = min(max(0.001, left), MAX_TTL_S)  # a uint of ms; expiry_time has the rest
    if msg.timestamp is not None:
        amqp.creation_time = msg.timestamp / 1000
    amqp.address = msg.destination if msg.to_queue else f"topic://{msg.destination}"
    annotations: dict[symbol, object] = {
        symbol(k): v for k, v in msg.annotations.items() if k != AMQP_VALUE
    }
    annotations[JMS_DEST] = JMS_QUEUE if msg.to_queue else JMS_TOPIC
    amqp.annotations = annotations
    if msg.partition_key is not None:
        amqp.group_id = msg.partition_key
    if (content_type := sections.content_type_out(msg.content_type)) is not None:
        amqp.content_type = content_type
    if msg.correlation_id is not None:
        amqp.correlation_id = sections.correlation_out(msg.correlation_id)
    if msg.reply_to is not None:
        amqp.reply_to = msg.reply_to
    if msg.message_id is not None:
        amqp.id = msg.message_id
    if msg.subject is not None:
        amqp.subject = msg.subject
    if msg.user_properties and (props := sections.application_properties(msg)):
        # ints past a long's range came in as ulong
        amqp.properties = {k: ulong(v) if _past_long(v) else v for k, v in props}
    return amqp


def _past_long(value: object) -> bool:
    return isinstance(value, int) and value >= 1 << 63


def _decode_value(encoded: bytes) -> object:
    data = Data()
    data.decode(encoded)
    data.next()
    return data.get_object()


def _json_ready(value: object) -> object:
    """JSON has string keys only; bytes become text where they can; an array is a list and
    a described value its descriptor and value (not Python's text of them)."""
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    if isinstance(value, Array):
        return [_json_ready(v) for v in value.elements]
    if isinstance(value, Described):
        return {"descriptor": _json_ready(value.descriptor), "value": _json_ready(value.value)}
    if isinstance(value, bytes | memoryview):
        return bytes(value).decode("utf-8", "replace")
    return value


def _json_text(value: object) -> str:
    return json.dumps(_json_ready(value), default=str)


def _content_type(amqp: AmqpMessage) -> str | None:
    # proton 0.40 returns symbol('None') for an absent content-type
    value = amqp.content_type
    return str(value) if value and value != "None" else None


def _expiration(amqp: AmqpMessage) -> int | None:
    """Epoch ms: absolute-expiry-time wins over ttl (proton gives both in seconds)."""
    if amqp.expiry_time:
        return int(amqp.expiry_time * 1000)
    if amqp.ttl:
        return int(time.time() * 1000 + amqp.ttl * 1000)
    return None


def _correlation(value: object) -> str | bytes | int | None:
    """A uuid as its URN, as the section decoder reads it (sections.correlation_in)."""
    return sections.correlation_in(value) if isinstance(value, UUID) else _ident(value)


_PLAIN = (str, bytes, bool, int, float)  # bool before int: it subclasses int


def _ident(value: object) -> str | bytes | int | None:
    """Message / correlation ids: binary stays bytes, uuid and the rest travel as strings."""
    if value is None or isinstance(value, (str, bytes, int)):
        return value  # type: ignore[return-value]
    if isinstance(value, memoryview):
        return bytes(value)
    return str(value)


def _value(value: object) -> PropertyValue:
    """Application property values the message model can hold (others become strings: a
    list, map, array or described value its JSON text). Proton's typed ones (int32, ulong,
    float32, char, timestamp, ...) become the plain type they subclass, as the fast decoder
    gives them: their own text ("int32(5)") made another key, sort key and MQTT property."""
    if value is None or value.__class__ in _PLAIN:
        return value  # type: ignore[return-value]
    for plain in _PLAIN:
        if isinstance(value, plain):
            return plain(value)  # type: ignore[return-value]
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, dict | list | tuple | Array | Described):
        return _json_text(value)
    return str(value)
