"""MQTT packets <-> `gateway.model.Message`.

The MQTT rows of the mapping table (ARCHITECTURE.md), both directions:

| model | MQTT 5 | MQTT 3.1 / 3.1.1 |
|---|---|---|
| destination | topic name (to_queue=False) | topic name |
| partition_key | user property `JMSXGroupId` | none |
| priority | user property `JMSPriority` (0-9; other values stay user properties) | 4 |
| user_properties | user properties, order kept | dropped on egress |
| expiration | Message Expiry Interval (epoch ms in; remaining seconds out) | none |
| dmq_eligible | user property `x-opt-dmq-eligible` `true` / `false` (ingress) | none |
| not_before | user property `x-opt-delivery-time` (epoch ms) / `x-opt-delivery-delay` (ms) | none |
| persistent | QoS > 0 | QoS > 0 |
| correlation_id | Correlation Data (bytes; str/int egress as UTF-8) | none |
| reply_to | Response Topic (`topic://` address; a queue's is left out) | none |
| content_type | Content Type | none |
| annotations `x-mqtt-payload-format` | Payload Format Indicator | none |
| annotations `x-mqtt-qos` | 2 for a QoS 2 publish (QoS 0/1: from persistent) | same |
| retain | RETAIN flag | RETAIN flag |
| publisher | ("mqtt", client id, user name) | same |

Messages from other protocols carry no `x-mqtt-qos`: they go out at QoS 1 when persistent,
else QoS 0 (always capped by the subscription's QoS). Their text that MQTT 5 cannot carry
goes out with U+FFFD in place of each U+0000 and of bytes that are not UTF-8.

The DMQ and delivery-time user properties (ingress only) mirror the AMQP message annotations
of the same names, `x-qpid-not-valid-before` included as an alias of `x-opt-delivery-time`;
Solace's MQTT service defines none for these. Those two, once applied, are consumed (not
forwarded); `JMSXGroupId` and `JMSPriority` stay where they were among the user
properties, unaltered (MQTT-3.3.2-17, -18), and go to AMQP receivers as group-id and
header.priority only. A user property with an invalid value (or a second delivery time)
is forwarded unchanged as an ordinary user property and never refuses the publish.
"""

from __future__ import annotations

import math
import time

from gateway.model import (
    DEFAULT_PRIORITY,
    GROUP_PROPERTIES,
    GROUP_PROPERTY,
    LATEST_MS,
    PRIORITY_PROPERTY,
    TOPIC_ADDRESS,
    Message,
    PropertyValue,
    Publisher,
    priority_of,
)
from protocols.mqtt.codec import Properties, Publish, Will, encode_publish

PAYLOAD_FORMAT = "x-mqtt-payload-format"
QOS = "x-mqtt-qos"
DMQ_ELIGIBLE = "x-opt-dmq-eligible"
DELIVERY_TIME = ("x-opt-delivery-time", "x-qpid-not-valid-before")  # epoch ms
DELIVERY_DELAY = "x-opt-delivery-delay"  # ms from now


def now_ms() -> int:
    return int(time.time() * 1000)


def to_message(publish: Publish | Will, publisher: Publisher, level: int) -> Message:
    """Build the Message for an inbound PUBLISH (or a will, which has the same fields)."""
    msg = Message(  # all positional: 0.25 µs against 0.42 with five keywords
        publish.topic,  # destination
        publish.payload,
        None,  # partition_key
        DEFAULT_PRIORITY,
        None,  # expiration
        None,  # not_before
        publish.qos > 0,  # persistent
        None,  # dmq_eligible
        None,  # content_type
        None,  # correlation_id
        None,  # reply_to
        None,  # message_id
        None,  # subject
        [],  # user_properties
        {},  # annotations
        publisher,
        publish.retain,
    )
    if publish.qos == 2:  # QoS 0 / 1 are told apart by `persistent`: no bytes spent on them
        msg.annotations[QOS] = 2
    props = publish.properties
    if level == 5 and props is not None:
        _apply_properties(msg, props)
    return msg


def _apply_properties(msg: Message, props: Properties) -> None:
    if props.message_expiry_interval:  # 0: none, as Mosquitto reads it (and an AMQP ttl 0);
        # it expired the message on arrival, acked and given to no subscriber
        msg.expiration = now_ms() + props.message_expiry_interval * 1000
    msg.content_type = props.content_type
    if props.response_topic is not None:  # an address: a bare name would be a queue
        msg.reply_to = TOPIC_ADDRESS + props.response_topic
    msg.correlation_id = props.correlation_data
    if props.payload_format_indicator is not None:
        msg.annotations[PAYLOAD_FORMAT] = props.payload_format_indicator
    for key, value in props.user_properties:
        if key in GROUP_PROPERTIES:
            if msg.partition_key is None:
                msg.partition_key = value
        elif key == PRIORITY_PROPERTY:
            if (priority := priority_of(value)) is not None:
                msg.priority = priority
        elif key == DMQ_ELIGIBLE and value.lower() in ("true", "false"):
            msg.dmq_eligible = value.lower() == "true"
            continue
        elif msg.not_before is None and (not_before := _not_before(key, value)) is not None:
            msg.not_before = not_before
            continue
        msg.user_properties.append((key, value))  # the group and priority too: in place


def _not_before(key: str, value: str) -> int | None:
    """The epoch ms a delivery-time or delivery-delay user property holds the message
    until; None when `key` is neither or `value` is not a usable number of ms."""
    if key not in DELIVERY_TIME and key != DELIVERY_DELAY:
        return None
    if not (value.isascii() and value.isdigit()):
        return None
    at = int(value) + (now_ms() if key == DELIVERY_DELAY else 0)
    return at if at <= LATEST_MS else None


MAX_EXPIRY_INTERVAL = 0xFFFF_FFFF  # seconds: a four-byte integer (MQTT 5 §3.3.2.3.3)


def remaining_expiry(msg: Message, now: int) -> int | None:
    """Seconds left before `msg` expires (at least 1, at most the 136 years MQTT 5's four
    bytes hold), 0 if expired, None if it never does."""
    if msg.expiration is None:
        return None
    left = msg.expiration - now
    return min(max(1, math.ceil(left / 1000)), MAX_EXPIRY_INTERVAL) if left > 0 else 0


def message_qos(msg: Message) -> int:
    """The QoS the message was published with (see the module docstring for non-MQTT)."""
    qos = msg.annotations.get(QOS)
    if isinstance(qos, int) and 0 <= qos <= 2:
        return qos
    return 1 if msg.persistent else 0


def _text(value: PropertyValue) -> str:
    if isinstance(value, str):
        return _mqtt_string(value)
    if isinstance(value, bool):  # as JMS, JSON and the Spark source spell them
        return "true" if value else "false"
    if isinstance(value, bytes):
        return _mqtt_string(value.decode("utf-8", "replace"))
    return "" if value is None else str(value)


def _mqtt_string(text: str) -> str:
    """MQTT strings may not hold U+0000 (§1.5.4); AMQP's and the admin API's may. It becomes
    U+FFFD, as bytes that are not UTF-8 do: the PUBLISH could not be encoded otherwise, and
    the message would stay undelivered."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def is_topic_name(topic: str) -> bool:
    """An MQTT topic name: at least a character and no wildcard (MQTT-4.7.3-1, -3.3.2-2)."""
    return bool(topic) and "+" not in topic and "#" not in topic


def egress_properties(
    msg: Message, expiry: int | None, subscription_ids: list[int]
) -> Properties | None:
    """MQTT 5 PUBLISH properties for `msg` (None when it needs none)."""
    user: list[tuple[str, str]] = []
    key, priority, props = msg.partition_key, msg.priority, msg.user_properties
    if key is not None and not _says_group(props, key):
        user.append((GROUP_PROPERTY, _mqtt_string(key)))
    if priority != DEFAULT_PRIORITY and not _says_priority(props, priority):
        user.append((PRIORITY_PROPERTY, str(priority)))
    user.extend((_mqtt_string(k), _text(v)) for k, v in props)
    corr = msg.correlation_id
    if corr is not None and not isinstance(corr, bytes):
        corr = str(corr).encode()
    fmt = msg.annotations.get(PAYLOAD_FORMAT)
    reply = _response_topic(msg)
    props = Properties(
        payload_format_indicator=fmt if fmt in (0, 1) else None,
        message_expiry_interval=expiry,
        content_type=msg.content_type and _mqtt_string(msg.content_type),
        response_topic=_mqtt_string(reply) if is_topic_name(reply) else None,
        correlation_data=corr,
        subscription_identifiers=subscription_ids,
        user_properties=user,
    )
    return None if props.is_empty() else props


def _response_topic(msg: Message) -> str:
    """The topic of a reply-to address; "" for none, or one MQTT cannot reply to: a queue
    (a bare name, but an MQTT publisher's stored before reply-tos were addresses), a
    filter (MQTT-3.3.2-14)."""
    reply_to = msg.reply_to
    if not reply_to:
        return ""
    if reply_to.startswith(TOPIC_ADDRESS):
        return reply_to[len(TOPIC_ADDRESS) :]
    publisher = msg.publisher
    return reply_to if publisher is not None and publisher.protocol == "mqtt" else ""


def _says_group(props: list[tuple[str, PropertyValue]], key: str) -> bool:
    """An MQTT publisher's partition key, in place among its user properties."""
    return any(k in GROUP_PROPERTIES and v == key for k, v in props)


def _says_priority(props: list[tuple[str, PropertyValue]], priority: int) -> bool:
    return any(k == PRIORITY_PROPERTY and priority_of(v) == priority for k, v in props)


def encode_delivery(
    msg: Message,
    qos: int,
    packet_id: int | None,
    dup: bool,
    retain: bool,
    subscription_ids: list[int],
    expiry: int | None,
    level: int,
    alias: tuple[int, bool] | None = None,
) -> bytes:
    """Wire bytes of the PUBLISH that delivers `msg` to a subscriber. `alias` (v5): the
    topic alias to use, and whether the client knows it already (then the topic is left out)."""
    props = egress_properties(msg, expiry, subscription_ids) if level == 5 else None
    topic = msg.destination
    if alias is not None:
        props = props or Properties()
        props.topic_alias = alias[0]
        if alias[1]:
            topic = ""
    return encode_publish(topic, msg.payload, qos, retain, dup, packet_id, props, level)
