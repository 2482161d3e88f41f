"""Queue configuration, name rules and provisioning (create / delete / show / list).

A queue is a config hash plus one stream with one consumer group (see keys.py); every
change here is one call into the Redis function library, so two nodes provisioning the
same queue at once cannot leave half a queue behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from gateway.engine import keys, library
from gateway.engine.partitions import PartitionMap
from gateway.engine.permissions import CONSUME, DELETE, LEVELS, MODIFY_TOPIC, NO_ACCESS, allowed
from gateway.engine.spool_usage import DEFAULT_VPN, vpn_name_error
from gateway.selectors import MAX_SELECTOR_BYTES, SelectorError, compile_selector
from gateway.topics import TopicError, parse_pattern

MAX_NAME_BYTES = 255
INFO_BATCH = 500  # queues read in one round trip by Queues.infos (and a caller of configs)
MAX_CONFIG_INT = 2**53 - 1  # the Redis functions count in doubles, exact up to here
DEAD_MESSAGE_QUEUE = "#DEAD_MSG_QUEUE"
TEMPORARY_PREFIX = "#tmp/"
RESERVED_PREFIXES = ("#", "amq.")
# Queues an adapter keeps for its clients' topic subscriptions: an MQTT session's (a
# non-persistent one's temporary), an MQTT shared group's, an AMQP durable, shared
# non-durable or plain topic subscription's (temporary). Only their subscriptions fill them
# and only their adapter reads them, holding each reader to the topic ACL: no client names
# them (an AMQP address, the admin API's calls of a user).
MQTT_SESSION_PREFIX = "#mqtt/"
MQTT_SHARED_PREFIX = "#share/"
DURABLE_SUBSCRIPTION_PREFIX = "#dts/"
VOLATILE_SUBSCRIPTION_PREFIX = "#vts/"
TEMPORARY_SUBSCRIPTION_PREFIX = "#tsub/"
SUBSCRIPTION_PREFIXES = (
    MQTT_SESSION_PREFIX,
    MQTT_SHARED_PREFIX,
    DURABLE_SUBSCRIPTION_PREFIX,
    VOLATILE_SUBSCRIPTION_PREFIX,
    TEMPORARY_SUBSCRIPTION_PREFIX,
)
ACCESS_TYPES = ("exclusive", "non-exclusive")
GROUP_MODES = ("", "default", "shared")
OVERFLOW_POLICIES = ("reject", "ring", "flow_control")
SYNTAXES = ("smf", "mqtt")
_FORBIDDEN = set("{}'\"<>*?&;") | {chr(c) for c in range(0x20)} | {"\x7f"}


class _PartitionsChanged(Exception):
    """A queue's partitions were not those its config said when read a moment before."""


class QueueError(Exception):
    """A refused queue operation; `code` maps to an HTTP status and protocol errors."""

    STATUS = {
        "invalid": 400,
        "not_found": 404,
        "exists": 409,
        "precondition_failed": 409,
        "unsupported": 400,
        "unauthorized": 403,
    }

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def http_status(self) -> int:
        return self.STATUS.get(self.code, 400)


# A config field only partitions and priority levels have: no client or operator names one.
_HIDDEN = b"parent"


def validate_queue_name(name: str, *, reserved_ok: bool = False) -> None:
    """Raise QueueError unless `name` may name a queue (created by a client unless reserved_ok)."""
    if not isinstance(name, str) or not name:
        raise QueueError("invalid", "queue name must be a non-empty string")
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise QueueError("invalid", f"queue name is longer than {MAX_NAME_BYTES} bytes")
    bad = sorted({c for c in name if c in _FORBIDDEN or c.isspace()})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        raise QueueError("invalid", f"queue name {name!r} contains forbidden characters: {shown}")
    if (
        not reserved_ok
        and name != DEAD_MESSAGE_QUEUE
        and any(name.startswith(p) for p in RESERVED_PREFIXES)
    ):
        raise QueueError(
            "invalid",
            f"queue name {name!r} uses a reserved prefix ({', '.join(RESERVED_PREFIXES)})",
        )


def subscription_queue(name: str) -> bool:
    """Whether `name` is an adapter's subscription queue (SUBSCRIPTION_PREFIXES)."""
    return name.startswith(SUBSCRIPTION_PREFIXES)


def _config_int(value: object) -> bool:
    """Whether `value` may be an integer setting: JSON gives floats and booleans too (bool
    is an int), and a number past MAX_CONFIG_INT (a ttl added to the clock) came back from
    the Redis functions in exponent form, which no integer field can be read from."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_CONFIG_INT


def _stored_int(h: dict[str, str], name: str, default: int) -> int:
    """An integer setting as stored. One stored before settings were bounded by
    MAX_CONFIG_INT reads as the bound, the same "no practical limit": else the queue could
    not be changed at all (every update validates the whole config)."""
    return min(int(h.get(name, default)), MAX_CONFIG_INT)


partition_queue_name = keys.partition_queue

PER_FLOW_DEFAULT = 10_000  # max_delivered_unacked_msgs_per_flow: Solace's default
# max_message_size of the queues the adapters make for their clients (subscriptions,
# temporary queues): none, so that the size each protocol accepts (an AMQP link offers
# 16 MiB) is the limit, not the default of a declared queue (Solace's 10,000,000), which
# earlier releases gave them: found on one the adapter declares again, it is raised
ADAPTER_QUEUE_MESSAGE_SIZE = 0
EARLIER_ADAPTER_QUEUE_MESSAGE_SIZE = 10_000_000

# What QueueStore.update may change on an existing queue.
RUNTIME_SETTINGS = {
    "permission",
    "overflow",
    "resume_percent",
    "ingress_enabled",
    "egress_enabled",
    "max_message_size",
    "max_spool_bytes",
    "max_messages",
    "max_delivered_unacked_msgs_per_flow",
    "owner",
}


def _applied(current: QueueConfig, changes: dict[str, Any], repartition: bool) -> QueueConfig:
    """`current` with `changes` (run-time settings; `repartition`: partition_count too)
    applied, validated as a whole."""
    allowed = RUNTIME_SETTINGS | ({"partition_count"} if repartition else set())
    bad = sorted(set(changes) - allowed)
    if bad:
        raise QueueError("invalid", f"cannot change {', '.join(bad)} on an existing queue")
    if changes.get("permission") == "":  # a declaration's "not given", not a level
        raise QueueError("invalid", f"permission must be one of {', '.join(LEVELS)}")
    updated = dataclasses.replace(current, **changes)
    updated.validate(reserved_ok=True)
    return updated


# gw_repartition's refusals: what QueueConfig.validate forbids to combine with partitions.
_UNPARTITIONABLE = {
    "exclusive": "only non-exclusive queues can be partitioned",
    "sorted": "a sorted queue (sort_key) cannot be partitioned",
    "priority": "a priority queue cannot be partitioned or grouped",
    "grouped": "message groups are for non-partitioned queues",
    "non_destructive": "a partitioned queue cannot be non-destructive",
    # its partitions are streams of their own: one key's values would live in several
    "lvq": "a last value queue (lvq_key, max_spool_bytes=0) cannot be partitioned",
}


def stream_queues(
    parent: str, partition_count: int, priorities: bool = False
) -> list[tuple[int | None, str]]:
    """(partition, queue name) of every stream that holds a queue's messages: its own, its
    partitions', or its priority levels' (highest first; partition None)."""
    if partition_count > 0:
        return [(i, keys.partition_queue(parent, i)) for i in range(partition_count)]
    if priorities:
        levels = range(keys.PRIORITY_LEVELS - 1, -1, -1)
        return [(None, keys.priority_queue(parent, level)) for level in levels]
    return [(None, parent)]


def temporary_queue_name(node_id: str, prefix: str = TEMPORARY_PREFIX) -> str:
    """A server-generated (anonymous) queue name, unique across nodes."""
    return f"{prefix}{node_id}/{os.urandom(8).hex()}"


def default_permission(queue: str) -> str:
    """What other users may do on a queue created without a permission: consume, except on
    the default dead message queue, where other users' dead messages gather."""
    return NO_ACCESS if queue == DEAD_MESSAGE_QUEUE else CONSUME


@dataclass(slots=True)
class QueueConfig:
    """What a queue is; stored as its config hash. Defaults follow Solace's queue defaults."""

    name: str
    access_type: str = "non-exclusive"
    durable: bool = True
    owner: str | None = None
    owner_node: str | None = None  # set for temporary queues: they die with that node
    ingress_enabled: bool = True
    egress_enabled: bool = True
    max_message_size: int = 10_000_000
    max_spool_bytes: int = 5_000_000_000  # 0: a last value queue (Solace): one message
    max_messages: int = 0  # 0: unlimited
    max_redelivery: int = 0  # 0: unlimited
    # messages a consumer may hold delivered but unacked (Solace's default); its own window
    # (AMQP link credit, MQTT receive maximum) may be smaller. From 1; a change applies to
    # consumers that bind after it
    max_delivered_unacked_msgs_per_flow: int = PER_FLOW_DEFAULT
    dead_message_queue: str = DEAD_MESSAGE_QUEUE
    max_ttl_ms: int = 0  # 0: none; else messages expire this long after spooling at the latest
    respect_ttl: bool = False  # expired messages go to the DMQ (else they are discarded)
    dmq_eligible_default: bool = False  # for messages whose publisher did not say
    partition_count: int = 0
    partition_rebalance_delay_ms: int = 500  # coalesces bursts of binds
    partition_handoff_timeout_ms: int = 3000  # then the old owner's unacked are requeued
    message_groups: str = ""  # "", "default" or "shared" (Qpid Broker-J semantics)
    default_group: str = "qpid.no-group"  # shared mode: the group of messages without one
    non_destructive: bool = False  # every consumer browses (Qpid non-destructive consumers)
    lvq_key: str = ""  # a last value queue by this user property (Qpid); see max_spool_bytes
    priorities: bool = False  # deliver by message priority (9 first), FIFO within a priority
    # a sorted queue (Qpid Broker-J) by this user property: delivered in ascending string
    # order of its value, messages without it first, arrival order among equal values
    sort_key: str = ""
    # a topic endpoint's selector (Solace): a message its topic subscriptions attract is
    # stored only if it matches; messages sent to the queue by name are not filtered
    subscription_selector: str = ""
    # what users other than the owner may do (permissions.LEVELS); "": consume, except on
    # the default dead message queue, where other users' dead messages gather: none
    permission: str = ""
    auto_delete: bool = False  # deleted when its last consumer goes (RabbitMQ)
    owner_connection: str = ""  # RabbitMQ exclusive: only this connection may use it
    overflow: str = "reject"  # when full: reject (NACK), ring (drop oldest), flow_control
    resume_percent: int = 80  # flow control: publishers resume below this share of the limit
    vpn: str = DEFAULT_VPN  # the Message VPN whose spool quota its messages count against
    created_ms: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.permission == "":  # not given
            self.permission = default_permission(self.name)

    def validate(self, *, reserved_ok: bool = False) -> None:
        """Raise QueueError for a config this version cannot honour."""
        validate_queue_name(self.name, reserved_ok=reserved_ok)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise QueueError("invalid", f"{f.name} must be true or false")
            if f.type == "str" and not isinstance(value, str):  # null would be stored as "None"
                raise QueueError("invalid", f"{f.name} must be a string")
            if f.type == "str | None" and not isinstance(value, str | None):
                raise QueueError("invalid", f"{f.name} must be a string or null")
            if f.type == "int" and not _config_int(value):
                raise QueueError(
                    "invalid", f"{f.name} must be an integer from 0 to {MAX_CONFIG_INT}"
                )
        if self.access_type not in ACCESS_TYPES:
            raise QueueError("invalid", f"access_type must be one of {', '.join(ACCESS_TYPES)}")
        try:
            # a client's queue may not dead-letter into an adapter's or another's private one
            validate_queue_name(self.dead_message_queue, reserved_ok=reserved_ok)
        except QueueError as exc:
            raise QueueError("invalid", f"dead_message_queue: {exc}") from None
        if self.partition_count and self.access_type != "non-exclusive":
            raise QueueError("invalid", "only non-exclusive queues can be partitioned")
        if self.message_groups not in GROUP_MODES:
            raise QueueError("invalid", "message_groups must be '', 'default' or 'shared'")
        if self.permission not in LEVELS:
            raise QueueError("invalid", f"permission must be one of {', '.join(LEVELS)}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise QueueError("invalid", f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}")
        problem = vpn_name_error(self.vpn)
        if problem:
            raise QueueError("invalid", f"vpn: {problem}")
        if self.max_delivered_unacked_msgs_per_flow < 1:
            raise QueueError("invalid", "max_delivered_unacked_msgs_per_flow must be at least 1")
        if not 1 <= self.resume_percent <= 100:
            raise QueueError("invalid", "resume_percent must be from 1 to 100")
        if self.priorities and (self.partition_count or self.message_groups):
            raise QueueError("invalid", "a priority queue cannot be partitioned or grouped")
        if self.priorities and (self.lvq_key or self.max_spool_bytes == 0):
            # its levels are streams of their own: one key's values would live in several
            raise QueueError(
                "invalid",
                "a priority queue cannot be a last value queue (lvq_key, max_spool_bytes=0)",
            )
        if self.lvq_key and self.max_spool_bytes == 0:  # it held one value of all keys
            raise QueueError(
                "invalid",
                "a last value queue keeps a value per lvq_key or one message "
                "(max_spool_bytes=0), not both",
            )
        if self.partition_count and (self.lvq_key or self.max_spool_bytes == 0):
            raise QueueError("invalid", _UNPARTITIONABLE["lvq"])  # as a priority queue's
        if self.priorities and self.non_destructive:  # its consumers would browse: refused
            raise QueueError("invalid", "a priority queue cannot be non-destructive")
        if self.non_destructive and self.partition_count:
            raise QueueError("invalid", "a partitioned queue cannot be non-destructive")
        if self.message_groups and self.partition_count:
            raise QueueError("invalid", "message groups are for non-partitioned queues")
        if not self.default_group:
            raise QueueError("invalid", "default_group must not be empty")
        if self.partition_count > 1024:
            raise QueueError("invalid", "partition_count must be at most 1024")
        for name in ("lvq_key", "sort_key"):  # spooled as "name\0value\0" (Router)
            if "\0" in getattr(self, name):
                raise QueueError("invalid", f"{name} must not contain NUL characters")
        self._validate_sorted()
        self._validate_selector()

    def _validate_selector(self) -> None:
        """A spool-time selector must compile now: a bad one would drop every message."""
        if not self.subscription_selector:
            return
        if len(self.subscription_selector.encode("utf-8")) > MAX_SELECTOR_BYTES:
            raise QueueError(
                "invalid", f"subscription_selector is longer than {MAX_SELECTOR_BYTES} bytes"
            )
        try:
            compile_selector(self.subscription_selector)
        except SelectorError as exc:
            raise QueueError("invalid", f"invalid subscription_selector: {exc}") from None

    def _validate_sorted(self) -> None:
        """A sorted queue delivers by its own order: features that pick the next message
        another way (partitions, priorities, last values, message groups) or drop the
        oldest (ring overflow) cannot be honoured with it."""
        if not self.sort_key:
            return
        clashes = [
            name
            for name, on in (
                ("partition_count", self.partition_count > 0),
                ("priorities", self.priorities),
                ("lvq_key", bool(self.lvq_key)),
                ("max_spool_bytes=0 (last value queue)", self.max_spool_bytes == 0),
                ("message_groups", bool(self.message_groups)),
                ("overflow=ring", self.overflow == "ring"),
            )
            if on
        ]
        if clashes:
            raise QueueError(
                "invalid", f"a sorted queue (sort_key) cannot have {', '.join(clashes)}"
            )

    def to_redis(self) -> list[str]:
        """Field/value pairs for the config hash (the Lua side reads a few of them)."""
        values = {
            "access": self.access_type,
            "durable": self.durable,
            "owner": self.owner or "",
            "owner_node": self.owner_node or "",
            "ingress": self.ingress_enabled,
            "egress": self.egress_enabled,
            "max_message_size": self.max_message_size,
            "max_spool_bytes": self.max_spool_bytes,
            "max_messages": self.max_messages,
            "max_redelivery": self.max_redelivery,
            "max_delivered_unacked_msgs_per_flow": self.max_delivered_unacked_msgs_per_flow,
            "dead_message_queue": self.dead_message_queue,
            "max_ttl_ms": self.max_ttl_ms,
            "respect_ttl": self.respect_ttl,
            "dmq_eligible_default": self.dmq_eligible_default,
            "partition_count": self.partition_count,
            "partition_rebalance_delay_ms": self.partition_rebalance_delay_ms,
            "partition_handoff_timeout_ms": self.partition_handoff_timeout_ms,
            "message_groups": self.message_groups,
            "default_group": self.default_group,
            "non_destructive": self.non_destructive,
            "lvq_key": self.lvq_key,
            "priorities": self.priorities,
            "sort_key": self.sort_key,
            "subscription_selector": self.subscription_selector,
            "permission": self.permission,
            "auto_delete": self.auto_delete,
            "owner_connection": self.owner_connection,
            "overflow": self.overflow,
            "resume_percent": self.resume_percent,
            "vpn": self.vpn,
            "created_ms": self.created_ms,
        }
        out: list[str] = []
        for k, v in values.items():
            out += [k, str(int(v)) if isinstance(v, bool) else str(v)]
        return out

    @classmethod
    def from_redis(cls, name: str, raw: dict[bytes, bytes]) -> QueueConfig:
        h = {k.decode(): v.decode() for k, v in raw.items()}
        return cls(
            name=name,
            access_type=h.get("access", "non-exclusive"),
            durable=h.get("durable", "1") == "1",
            owner=h.get("owner") or None,
            owner_node=h.get("owner_node") or None,
            ingress_enabled=h.get("ingress", "1") == "1",
            egress_enabled=h.get("egress", "1") == "1",
            max_message_size=_stored_int(h, "max_message_size", 0),
            max_spool_bytes=_stored_int(h, "max_spool_bytes", 0),
            max_messages=_stored_int(h, "max_messages", 0),
            max_redelivery=_stored_int(h, "max_redelivery", 0),
            max_delivered_unacked_msgs_per_flow=_stored_int(
                h, "max_delivered_unacked_msgs_per_flow", PER_FLOW_DEFAULT
            ),
            dead_message_queue=h.get("dead_message_queue", DEAD_MESSAGE_QUEUE),
            max_ttl_ms=_stored_int(h, "max_ttl_ms", 0),
            respect_ttl=h.get("respect_ttl", "0") == "1",
            dmq_eligible_default=h.get("dmq_eligible_default", "0") == "1",
            partition_count=_stored_int(h, "partition_count", 0),
            partition_rebalance_delay_ms=_stored_int(h, "partition_rebalance_delay_ms", 500),
            partition_handoff_timeout_ms=_stored_int(h, "partition_handoff_timeout_ms", 3000),
            message_groups=h.get("message_groups", ""),
            default_group=h.get("default_group", "qpid.no-group"),
            non_destructive=h.get("non_destructive", "0") == "1",
            lvq_key=h.get("lvq_key", ""),
            priorities=h.get("priorities", "0") == "1",
            sort_key=h.get("sort_key", ""),
            subscription_selector=h.get("subscription_selector", ""),
            permission=h.get("permission", DELETE),
            auto_delete=h.get("auto_delete", "0") == "1",
            owner_connection=h.get("owner_connection", ""),
            overflow=h.get("overflow", "reject"),
            resume_percent=_stored_int(h, "resume_percent", 80),
            vpn=h.get("vpn", DEFAULT_VPN),
            created_ms=_stored_int(h, "created_ms", 0),
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> QueueConfig:
        """Build from user input (TOML table, JSON body); unknown fields are an error."""
        known = {f.name for f in dataclasses.fields(cls)} - {
            "owner_node",
            "created_ms",
            "owner_connection",
        }
        unknown = sorted(set(data) - known - {"subscriptions"})
        if unknown:
            raise QueueError("invalid", f"unknown queue properties: {', '.join(unknown)}")
        if "name" not in data:
            raise QueueError("invalid", "queue needs a name")
        return cls(**{k: v for k, v in data.items() if k in known})


# Fields whose change would alter how existing messages or flows behave: a re-declaration
# with other values is refused (RabbitMQ's property equivalence). The run-time settings
# (RUNTIME_SETTINGS: limits, overflow...) are not compared: an operator may have changed
# them since, as a RabbitMQ policy does.
EQUIVALENCE_FIELDS = (
    "access_type",
    "durable",
    "auto_delete",
    "partition_rebalance_delay_ms",
    "partition_handoff_timeout_ms",
    "message_groups",
    "default_group",
    "priorities",
    "sort_key",
    "lvq_key",
    "non_destructive",
    "subscription_selector",
    "max_ttl_ms",
    "respect_ttl",
    "max_redelivery",
    "dead_message_queue",
    "dmq_eligible_default",
    "vpn",
)


def subscription_entry(pattern: str, syntax: str) -> str:
    """Validated stored form of a topic subscription (syntax and pattern in one string)."""
    if syntax not in SYNTAXES:
        raise QueueError("invalid", f"subscription syntax must be one of {', '.join(SYNTAXES)}")
    try:
        parse_pattern(pattern, syntax)
    except TopicError as exc:
        raise QueueError("invalid", f"invalid subscription {pattern!r}: {exc}") from exc
    return f"{syntax}:{pattern}"


def parse_subscription_entry(entry: str) -> tuple[str, str]:
    """(pattern, syntax) from a stored entry."""
    syntax, _, pattern = entry.partition(":")
    return pattern, syntax


@dataclass(slots=True)
class QueueInfo:
    """A queue as shown by the admin API and the CLI."""

    config: QueueConfig
    subscriptions: list[tuple[str, str]]
    messages: int
    spooled_bytes: int
    counters: dict[str, int]
    flows: list[str]
    active_flow: str | None
    partitions: list[dict[str, Any]] = field(default_factory=list)
    # holding publishers back (overflow flow_control; a partitioned queue: any partition)
    blocked: bool = False

    def to_json(self) -> dict[str, Any]:
        active = {p["owner"] for p in self.partitions if p["owner"]}
        return {
            **self.config.to_json(),
            "subscriptions": [{"pattern": p, "syntax": s} for p, s in sorted(self.subscriptions)],
            "messages": self.messages,
            "spooled_bytes": self.spooled_bytes,
            "counters": self.counters,
            "blocked": self.blocked,
            "flows": [
                {
                    "id": f,
                    "active": f in active
                    if self.partitions
                    else f == self.active_flow
                    or self.config.access_type == "non-exclusive"
                    or self.config.non_destructive,  # every consumer browses, none waits
                }
                for f in self.flows
            ],
            "active_flow": self.active_flow,
            "partitions": self.partitions,
        }


class QueueStore:
    """Provisioning over the function library; shared by the broker, admin API and config."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

    async def create(
        self,
        config: QueueConfig,
        subscriptions: list[tuple[str, str]] = (),  # type: ignore[assignment]
        **options: Any,
    ) -> bool:
        """`declare`, saying only whether the queue was created."""
        return (await self.declare(config, subscriptions, **options))[0]

    async def declare(
        self,
        config: QueueConfig,
        subscriptions: list[tuple[str, str]] = (),  # type: ignore[assignment]
        *,
        reserved_ok: bool = False,
        user: str | None = None,
        as_it_is: bool = False,
    ) -> tuple[bool, int]:
        """Create a queue; returns whether it was created (not when an equivalent one
        exists: an idempotent declare) and how many of `subscriptions` it did not have.
        Subscribing `user` (None: the operator) to a queue that already existed needs
        modify-topic on it, checked on the config the create found, before any is added.
        `as_it_is`: an existing queue is taken with its properties (an adapter's own queue
        that an operator may have provisioned beforehand, such as an MQTT shared group's
        with a TTL)."""
        config.validate(reserved_ok=reserved_ok)
        entries = [subscription_entry(p, s) for p, s in subscriptions]
        config.created_ms = int(time.time() * 1000)
        reply = await self._redis.fcall("gw_queue_create", 0, config.name, *config.to_redis())
        created = reply[0] == 1
        if not created:
            existing = QueueConfig.from_redis(
                config.name, dict(zip(reply[1::2], reply[2::2], strict=False))
            )
            for name in () if as_it_is else EQUIVALENCE_FIELDS:
                if getattr(existing, name) != getattr(config, name):
                    raise QueueError(
                        "precondition_failed",
                        f"queue {config.name!r} exists with {name}={getattr(existing, name)!r}",
                    )
            if (
                entries
                and user is not None
                and not allowed(existing.owner, existing.permission, user, MODIFY_TOPIC)
            ):
                raise QueueError(
                    "unauthorized", f"user {user!r} may not {MODIFY_TOPIC} queue {config.name!r}"
                )
            if not await self._co_own(existing, config.owner_node):  # gone since
                return await self.declare(
                    config, subscriptions, reserved_ok=reserved_ok, user=user, as_it_is=as_it_is
                )
            if config.max_message_size == ADAPTER_QUEUE_MESSAGE_SIZE:
                await self.lift_earlier_size_limit(existing.name, existing.max_message_size)
        added = 0
        if entries:
            added = int(await self._redis.fcall("gw_subscription", 0, config.name, "add", *entries))
        return created, added

    async def lift_earlier_size_limit(self, name: str, size: int | None = None) -> None:
        """An adapter's queue an earlier release made has its size limit (`size`, read when
        not given) raised (see ADAPTER_QUEUE_MESSAGE_SIZE)."""
        if not subscription_queue(name):
            return
        if size is None:
            size = int(await self._redis.hget(keys.queue_config(name), "max_message_size") or 0)
        if size == EARLIER_ADAPTER_QUEUE_MESSAGE_SIZE:
            with contextlib.suppress(QueueError):  # deleted meanwhile
                await self.update(name, {"max_message_size": ADAPTER_QUEUE_MESSAGE_SIZE})

    async def _co_own(self, existing: QueueConfig, node: str | None) -> bool:
        """`node` declared non-durable `existing`, which another node owns: the queue lives
        while either does (see gw_queue_co_own). False if the queue is gone."""
        if existing.durable or not node or existing.owner_node in (None, node):
            return True
        reply = await self._redis.fcall(
            "gw_queue_co_own", 0, existing.name, node, existing.created_ms
        )
        return bool(reply)

    async def delete(self, name: str) -> None:
        if not await self._redis.fcall("gw_queue_delete", 0, name):
            raise QueueError("not_found", f"queue {name!r} does not exist")

    async def join(self, name: str, member: str, until_ms: float) -> None:
        """Record `member` of a queue that lives while it has members, until `until_ms`
        (epoch ms; math.inf: for ever). Call it before declaring and binding the queue."""
        until = "inf" if until_ms == math.inf else str(int(until_ms))
        await self._redis.fcall("gw_queue_join", 0, name, member, until)

    async def leave(self, name: str, member: str = "") -> int:
        """`member` leaves; the queue is deleted once no member is left and no flow is
        bound. Returns 1 if deleted (or gone), 0 while members remain, 2 while only bound
        flows keep it (ask again later with no member)."""
        return int(
            await self._redis.fcall("gw_queue_leave", 0, name, member, int(time.time() * 1000))
        )

    async def lapse(self, name: str) -> int:
        """Delete a queue whose memberships all lapsed (one that never had members stays);
        returns as `leave` does."""
        return int(await self._redis.fcall("gw_queue_lapsed", 0, name, int(time.time() * 1000)))

    async def exists(self, name: str) -> bool:
        return bool(await self._redis.exists(keys.queue_config(name)))

    async def config(self, name: str) -> QueueConfig:
        raw = await self._redis.hgetall(keys.queue_config(name))
        if not raw or _HIDDEN in raw:
            raise QueueError("not_found", f"queue {name!r} does not exist")
        return QueueConfig.from_redis(name, raw)

    async def changed(
        self, name: str, changes: dict[str, Any], *, repartition: bool = False
    ) -> QueueConfig:
        """The queue's config with `changes` applied, validated as a whole (nothing is
        written): a change set is refused before any part of it is applied.
        `repartition`: partition_count may be among the changes."""
        return _applied(await self.config(name), changes, repartition)

    async def update(self, name: str, changes: dict[str, Any]) -> QueueConfig:
        """Change run-time settings (ingress / egress switches, limits). Only the fields
        that change are written: another change made meanwhile to other fields stays."""
        current = await self.config(name)
        updated = _applied(current, changes, False)
        old, new = current.to_redis(), updated.to_redis()
        pairs = [
            v
            for i in range(0, len(new), 2)
            if new[i + 1] != old[i + 1]
            for v in (new[i], new[i + 1])
        ]
        if not await self._redis.fcall("gw_queue_update", 0, name, *pairs):
            raise QueueError("not_found", f"queue {name!r} does not exist")
        return updated

    async def change_subscriptions(
        self, name: str, op: str, subscriptions: list[tuple[str, str]]
    ) -> int:
        entries = [subscription_entry(p, s) for p, s in subscriptions]
        if not entries:
            return 0
        changed = await self._redis.fcall("gw_subscription", 0, name, op, *entries)
        if changed < 0:
            raise QueueError("not_found", f"queue {name!r} does not exist")
        return int(changed)

    async def names(self) -> list[str]:
        return sorted(n.decode() for n in await self._redis.smembers(keys.queues))

    async def info(self, name: str) -> QueueInfo:
        for _ in range(3):  # its partitions changed between its two reads: read again
            pipe = self._redis.pipeline(transaction=False)
            self._ask_info(pipe, name)
            try:
                found = await self._info_from(name, await library.replies(pipe))
            except _PartitionsChanged:
                continue
            if found is not None:
                return found
            break
        raise QueueError("not_found", f"queue {name!r} does not exist")

    async def access(self, names: list[str]) -> list[tuple[str, str | None, str]]:
        """The owner and permission of each of `names` that exists, in one round trip:
        enough to tell which queues a user may see before their info is read."""
        pipe = self._redis.pipeline(transaction=False)
        for name in names:  # `access` is in every queue's config (to_redis)
            pipe.hmget(keys.queue_config(name), "access", "owner", "permission", _HIDDEN)
        found = []
        for name, (access, owner, permission, hidden) in zip(
            names, await library.replies(pipe), strict=True
        ):
            if access is not None and hidden is None:
                # the permission as from_redis reads it, then as a config made without one
                level = DELETE if permission is None else permission.decode()
                owned = owner.decode() if owner else None
                found.append((name, owned, level or default_permission(name)))
        return found

    async def infos(self, names: list[str]) -> AsyncIterator[QueueInfo]:
        """The info of each of `names` that exists, INFO_BATCH queues a round trip: one
        trip a queue had a metrics scrape of 16,000 queues take 3.5 s."""
        for start in range(0, len(names), INFO_BATCH):
            batch = names[start : start + INFO_BATCH]
            pipe = self._redis.pipeline(transaction=False)
            for name in batch:
                self._ask_info(pipe, name)
            replies = await library.replies(pipe)
            for i, name in enumerate(batch):
                try:
                    found = await self._info_from(name, replies[i * 5 : i * 5 + 5])
                except _PartitionsChanged:  # deleted or repartitioned since the batch
                    try:
                        found = await self.info(name)
                    except QueueError:
                        continue
                if found is not None:
                    yield found

    @staticmethod
    def _ask_info(pipe: Any, name: str) -> None:
        """The five reads _info_from takes."""
        pipe.hgetall(keys.queue_config(name))
        pipe.smembers(keys.queue_subs(name))
        pipe.hgetall(keys.queue_stats(name))
        pipe.zrange(keys.queue_flows(name), 0, -1)
        pipe.hget(keys.queue_lease(name), "flow")

    async def _info_from(self, name: str, replies: list[Any]) -> QueueInfo | None:
        """A queue's info from _ask_info's replies (and its children's counters); None if
        it does not exist."""
        raw, subs, stats, flows, active = replies
        if not raw or _HIDDEN in raw:
            return None
        config = QueueConfig.from_redis(name, raw)
        counters = {k.decode(): int(v) for k, v in stats.items()}
        partitions: list[dict[str, Any]] = []
        if config.partition_count:
            partitions = await self._partitions(name, config.partition_count, counters)
        elif config.priorities:
            levels = [keys.priority_queue(name, p) for p in range(keys.PRIORITY_LEVELS)]
            await self._add_counters(levels, counters)
        counters.pop("flow_held", None)  # a state: producer flow control's marks exist
        return QueueInfo(
            config=config,
            subscriptions=[parse_subscription_entry(e.decode()) for e in subs],
            messages=counters.pop("msgs", 0),
            spooled_bytes=counters.pop("bytes", 0),
            blocked=counters.pop("blocked", 0) > 0,  # a state, not an event count
            counters=counters,
            flows=[f.decode() for f in flows],
            active_flow=active.decode() if active else None,
            partitions=partitions,
        )

    async def _partitions(
        self, name: str, count: int, totals: dict[str, int]
    ) -> list[dict[str, Any]]:
        """Per-partition owner and depth; adds the partitions' counters into `totals`."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.fcall("gw_partitions", 0, name)
        for index in range(count):
            pipe.hgetall(keys.queue_stats(keys.partition_queue(name, index)))
        reply, *stats = await library.replies(pipe)
        pmap = PartitionMap.from_reply(reply)
        if len(pmap.owners) != count:
            raise _PartitionsChanged
        out = []
        for index, raw in enumerate(stats):
            part = {k.decode(): int(v) for k, v in raw.items()}
            for k, v in part.items():
                totals[k] = totals.get(k, 0) + v
            out.append(
                {
                    "index": index,
                    "owner": pmap.owners[index] or None,
                    "target": pmap.targets[index] or None,
                    "handing_off_from": pmap.holders[index]
                    if pmap.holders[index] and pmap.holders[index] != pmap.owners[index]
                    else None,
                    "messages": part.get("msgs", 0),
                }
            )
        return out

    async def _add_counters(self, queues: list[str], totals: dict[str, int]) -> None:
        """Add the counters of child queues (a priority queue's levels) into `totals`."""
        pipe = self._redis.pipeline(transaction=False)
        for queue in queues:
            pipe.hgetall(keys.queue_stats(queue))
        for raw in await library.replies(pipe):
            for k, v in raw.items():
                totals[k.decode()] = totals.get(k.decode(), 0) + int(v)

    async def forget_reader(self, name: str, reader: str) -> int:
        """Drop a stream reader's committed offsets (e.g. a retired Spark query), so its
        retention stops holding settled messages. Returns the streams it was registered on."""
        config = await self.config(name)
        dropped = 0
        for _, queue in stream_queues(name, config.partition_count, config.priorities):
            dropped += await self._redis.fcall("gw_forget_reader", 0, queue, reader)
        return dropped

    async def repartition(
        self, name: str, partition_count: int, max_spool_bytes: int | None = None
    ) -> int:
        """Change the partition count (0: not partitioned); egress must be disabled.
        Every flow is unbound. Returns how many messages the removed partitions held.
        `max_spool_bytes`: set by the same change (applied after: see gw_repartition)."""
        if not isinstance(partition_count, int) or not 0 <= partition_count <= 1024:
            raise QueueError("invalid", "partition_count must be an integer from 0 to 1024")
        spool = () if max_spool_bytes is None else (max_spool_bytes,)
        reply = await self._redis.fcall("gw_repartition", 0, name, partition_count, *spool)
        status = reply[0].decode()
        if status == "noqueue":
            raise QueueError("not_found", f"queue {name!r} does not exist")
        if status == "egress":
            raise QueueError(
                "precondition_failed", "disable egress before changing partition_count"
            )
        if status in _UNPARTITIONABLE:
            raise QueueError("invalid", _UNPARTITIONABLE[status])
        return int(reply[1])
