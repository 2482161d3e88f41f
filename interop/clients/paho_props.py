"""MQTT 5 properties <-> the runner's JSON shape, for drivers built on paho (1.6 and 2.x)."""

from __future__ import annotations

from typing import Any

from common import b64, unb64
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


def publish_props(props: dict[str, Any]) -> Properties | None:
    """MQTT 5 PUBLISH properties from the runner's JSON shape."""
    if not props:
        return None
    out = Properties(PacketTypes.PUBLISH)
    if "user_properties" in props:
        out.UserProperty = [tuple(p) for p in props["user_properties"]]
    if "correlation_data" in props:
        out.CorrelationData = unb64(props["correlation_data"])
    if "response_topic" in props:
        out.ResponseTopic = props["response_topic"]
    if "content_type" in props:
        out.ContentType = props["content_type"]
    return out


def props_json(props: Properties | None) -> dict[str, Any]:
    """The received properties in the runner's JSON shape."""
    out: dict[str, Any] = {}
    if props is None:
        return out
    if hasattr(props, "UserProperty"):
        out["user_properties"] = [list(p) for p in props.UserProperty]
    if hasattr(props, "CorrelationData"):
        out["correlation_data"] = b64(props.CorrelationData)
    if hasattr(props, "ResponseTopic"):
        out["response_topic"] = props.ResponseTopic
    if hasattr(props, "ContentType"):
        out["content_type"] = props.ContentType
    return out


def session_props() -> Properties:
    """CONNECT properties of a persistent MQTT 5 session (clean_start=False)."""
    out = Properties(PacketTypes.CONNECT)
    out.SessionExpiryInterval = 300
    return out
