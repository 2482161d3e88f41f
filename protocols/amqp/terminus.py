"""What a client asks for in a terminus: capabilities, a selector filter, durability.

Selectors are recognised by the filter's descriptor, not its key: proton's `Selector` sends
key ``selector`` with the symbolic descriptor, Qpid JMS key ``jms-selector`` with the numeric
one. Other filters (no-local...) are not applied, so they are not echoed on attach, as the
spec asks of a node that ignores a filter.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from proton import Data, Described, Terminus, symbol, ulong

SELECTOR_SYMBOL = symbol("apache.org:selector-filter:string")
SELECTOR_CODE = ulong(0x0000468C00000004)
DURABLE_PREFIX = "#dts/"  # reserved: clients cannot create or name such queues themselves
MAX_QUEUE_NAME = 255


@dataclass(frozen=True, slots=True)
class SelectorFilter:
    """One selector entry of a source filter map, kept as sent so it can be echoed."""

    key: object
    descriptor: object
    text: str

    def echo(self, terminus: Terminus) -> None:
        """Set the terminus' filter to this entry alone (the filters the node applies)."""
        terminus.filter.clear()
        terminus.filter.put_dict({self.key: Described(self.descriptor, self.text)})


def capabilities(terminus: Terminus) -> frozenset[str]:
    """The symbols of a terminus' capabilities (a single symbol or an array)."""
    value = _first(terminus.capabilities)
    if value is None:
        return frozenset()
    values = value.elements if hasattr(value, "elements") else [value]
    return frozenset(str(v) for v in values)


def selector(terminus: Terminus) -> SelectorFilter | None:
    """The JMS selector of a source's filter map, if it has one."""
    filters = _first(terminus.filter)
    if not isinstance(filters, dict):
        return None
    for key, value in filters.items():
        if isinstance(value, Described) and value.descriptor in (SELECTOR_SYMBOL, SELECTOR_CODE):
            return SelectorFilter(key, value.descriptor, str(value.value))
    return None


def is_durable(terminus: Terminus) -> bool:
    """A durable source: the client expects the node to outlive the link (JMS durable topic
    subscriber: durability configuration / unsettled-state, or expiry-policy never)."""
    return (
        terminus.durability != Terminus.NONDURABLE
        or terminus.expiry_policy == Terminus.EXPIRE_NEVER
    )


def durable_queue_name(container_id: str, link_name: str) -> str:
    """The queue of a durable subscription: one per container id + link name, reversible
    (hex) while it fits a queue name, else a digest of both."""
    name = f"{DURABLE_PREFIX}{container_id.encode().hex()}/{link_name.encode().hex()}"
    if len(name) <= MAX_QUEUE_NAME:
        return name
    digest = hashlib.sha256(f"{container_id}\0{link_name}".encode()).hexdigest()
    return f"{DURABLE_PREFIX}h/{digest}"


def _first(data: Data) -> object:
    data.rewind()
    return data.get_object() if data.next() else None
