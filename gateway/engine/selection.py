"""Selectors over gateway messages: JMS header fields and user properties as selector names."""

from __future__ import annotations

from gateway.model import Message
from gateway.selectors import Selector, compile_selector, make_lookup


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def redelivery_selector(selector_text: str) -> Selector | None:
    """The selector, if it names what only a delivery tells (JMSXDeliveryCount): a topic
    subscription's spool-time check saw a first delivery, and a redelivery must be checked
    again."""
    selector = compile_selector(selector_text)
    return selector if "JMSXDeliveryCount" in selector.identifiers else None


def matches(selector: Selector, msg: Message, delivery_count: int) -> bool:
    """Whether `msg` is selected; header fields map as Qpid JMS maps them onto AMQP."""
    headers = {
        "JMSPriority": msg.priority,
        "JMSCorrelationID": _text(msg.correlation_id),
        "JMSMessageID": _text(msg.message_id),
        "JMSType": msg.subject,
        "JMSDeliveryMode": "PERSISTENT" if msg.persistent else "NON_PERSISTENT",
        "JMSExpiration": msg.expiration or 0,
        "JMSTimestamp": msg.timestamp,
        "JMSXGroupID": msg.partition_key,
        "JMSXDeliveryCount": delivery_count,
    }
    properties: dict[str, object] = {}
    for key, value in msg.user_properties:
        properties.setdefault(key, value)  # the first of repeated MQTT user properties
    return selector.matches(make_lookup(headers, properties))
