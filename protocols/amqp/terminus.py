"""What a client asks for in a terminus: capabilities, filters, durability.

Filters are recognised by their descriptor, not their key: proton's `Selector` sends key
``selector`` with the symbolic descriptor, Qpid JMS key ``jms-selector`` with the numeric
one. The gateway's own ``gateway:replay-period`` filter (an unsigned number of
milliseconds) asks a browser (distribution-mode ``copy``, or any consumer of a
non-destructive queue) for the messages of that last period plus new ones. JMS no-local
(``apache.org:no-local-filter:list``) keeps a topic subscriber from its own container's
messages. Filters the node applies are echoed on attach; others are not applied, so they
are not echoed, as the spec asks of a node that ignores a filter.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from proton import Data, Described, Terminus, symbol, ulong

from gateway.engine.queues import DURABLE_SUBSCRIPTION_PREFIX, VOLATILE_SUBSCRIPTION_PREFIX

SELECTOR_SYMBOL = symbol("apache.org:selector-filter:string")
SELECTOR_CODE = ulong(0x0000468C00000004)
REPLAY_SYMBOL = symbol("gateway:replay-period")
NO_LOCAL_SYMBOL = symbol("apache.org:no-local-filter:list")
NO_LOCAL_CODE = ulong(0x0000468C00000003)
SHARED, GLOBAL = "shared", "global"  # source capabilities of JMS 2.0 shared subscriptions
GLOBAL_SUFFIX = "|global"
MAX_QUEUE_NAME = 255


class InvalidField(ValueError):
    """A terminus field the node reads has a value it cannot use (amqp:invalid-field): a
    filter it would apply, or a map proton cannot decode (binary keys)."""


@dataclass(frozen=True, slots=True)
class SelectorFilter:
    """One selector entry of a source filter map, kept as sent so it can be echoed."""

    key: object
    descriptor: object
    text: str

    def described(self) -> Described:
        return Described(self.descriptor, self.text)


@dataclass(frozen=True, slots=True)
class EchoedFilter:
    """An entry of a source filter map the node applies (no-local), kept as sent so it can
    be echoed."""

    key: object
    descriptor: object
    value: object  # as sent, for the echo

    def described(self) -> Described:
        return Described(self.descriptor, self.value)


@dataclass(frozen=True, slots=True)
class ReplayFilter(EchoedFilter):
    """A replay-period entry of a source filter map: browse the last `ms` milliseconds."""

    ms: int = 0


Filter = SelectorFilter | EchoedFilter


def echo(terminus: Terminus, filters: list[Filter]) -> None:
    """Set the terminus' filter map to the entries the node applies (none: no map)."""
    terminus.filter.clear()
    if filters:
        terminus.filter.put_dict({f.key: f.described() for f in filters})


def capabilities(terminus: Terminus) -> frozenset[str]:
    """The symbols of a terminus' capabilities (a single symbol or an array)."""
    value = first(terminus.capabilities)
    if value is None:
        return frozenset()
    values = value.elements if hasattr(value, "elements") else [value]
    return frozenset(str(v) for v in values)


def selector(terminus: Terminus) -> SelectorFilter | None:
    """The JMS selector of a source's filter map, if it has one; InvalidField unless its
    value is a string (a null or a boolean made selector text 'None' or 'True')."""
    for key, value in _filters(terminus):
        if value.descriptor in (SELECTOR_SYMBOL, SELECTOR_CODE):
            if not isinstance(value.value, str):
                raise InvalidField(f"a selector filter's value is a string, not {value.value!r}")
            return SelectorFilter(key, value.descriptor, value.value)
    return None


def replay_period(terminus: Terminus) -> ReplayFilter | None:
    """The replay period a source's filter map asks for, if any; InvalidField unless it is
    a positive whole number of milliseconds."""
    for key, value in _filters(terminus):
        if value.descriptor == REPLAY_SYMBOL:
            ms = value.value
            if not isinstance(ms, int) or isinstance(ms, bool) or ms < 1:
                raise InvalidField(
                    f"{REPLAY_SYMBOL} needs a positive number of milliseconds, not {ms!r}"
                )
            return ReplayFilter(key, value.descriptor, ms, ms=int(ms))
    return None


def no_local(terminus: Terminus) -> EchoedFilter | None:
    """The JMS no-local entry of a source's filter map, if it has one."""
    for key, value in _filters(terminus):
        if value.descriptor in (NO_LOCAL_SYMBOL, NO_LOCAL_CODE):
            return EchoedFilter(key, value.descriptor, value.value)
    return None


def _filters(terminus: Terminus) -> list[tuple[object, Described]]:
    """The described entries of a terminus' filter map."""
    filters = first(terminus.filter)
    if not isinstance(filters, dict):
        return []
    return [(k, v) for k, v in filters.items() if isinstance(v, Described)]


def is_durable(terminus: Terminus) -> bool:
    """A durable source: the client expects the node to outlive the link (JMS durable topic
    subscriber: durability configuration / unsettled-state, or expiry-policy never)."""
    return (
        terminus.durability != Terminus.NONDURABLE
        or terminus.expiry_policy == Terminus.EXPIRE_NEVER
    )


def durable_queue_name(
    container_id: str, link_name: str, prefix: str = DURABLE_SUBSCRIPTION_PREFIX
) -> str:
    """The queue of a durable subscription: one per container id + link name, reversible
    (hex) while it fits a queue name, else a digest of both. `prefix`:
    VOLATILE_SUBSCRIPTION_PREFIX for a shared non-durable subscription's."""
    name = f"{prefix}{container_id.encode().hex()}/{link_name.encode().hex()}"
    if len(name) <= MAX_QUEUE_NAME:
        return name
    digest = hashlib.sha256(f"{container_id}\0{link_name}".encode()).hexdigest()
    return f"{prefix}h/{digest}"


@dataclass(frozen=True, slots=True)
class Subscription:
    """Who names a topic subscription, and how (JMS 2.0 shared subscriptions as Qpid JMS
    and Qpid Broker-J map them). Capability ``shared``: several links consume from it, each
    named by the subscription's name up to a ``|`` (``sub``, ``sub|2``: distinct links,
    one subscription); ``global``: its name is not scoped to the container id."""

    container_id: str  # '' for a global one
    name: str
    shared: bool

    def queue(self, durable: bool) -> str:
        prefix = DURABLE_SUBSCRIPTION_PREFIX if durable else VOLATILE_SUBSCRIPTION_PREFIX
        return durable_queue_name(self.container_id, self.name, prefix)


def subscription(container_id: str, link_name: str, caps: frozenset[str]) -> Subscription:
    """The subscription a topic source's link names (see Subscription)."""
    if SHARED not in caps:
        return Subscription(container_id, link_name, False)
    return Subscription("" if GLOBAL in caps else container_id, link_name.split("|")[0], True)


def looked_up(container_id: str, link_name: str) -> Subscription:
    """The durable subscription a link with a null source names (Qpid JMS unsubscribe):
    a global shared one's link name ends ``|global``."""
    if link_name.endswith(GLOBAL_SUFFIX):
        return Subscription("", link_name[: -len(GLOBAL_SUFFIX)], True)
    return Subscription(container_id, link_name, False)


def first(data: Data) -> object:
    """The first value of a terminus field (None if empty); InvalidField if proton cannot
    make it a Python value (a map with binary keys: memoryviews do not hash)."""
    data.rewind()
    try:
        return data.get_object() if data.next() else None
    except (TypeError, ValueError) as exc:
        raise InvalidField(f"unreadable terminus field: {exc}") from None
