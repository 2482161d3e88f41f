"""Dynamic nodes: the temporary queues a client asks for with a dynamic source or target.

A dynamic node is exclusive to the connection that created it (RabbitMQ ``exclusive``):
only that connection may consume from it (others get ``amqp:resource-locked``), anyone may
send to it (it is a reply-to address), and it goes when that connection ends at the latest.
Its ``lifetime-policy`` (dynamic-node-properties) is mapped to what the queue engine can do:

| lifetime-policy | here |
|---|---|
| delete-on-close (the default) | deleted once its link is closed, or its session ends |
| delete-on-no-links | deleted once no link of its connection is attached to or from it |
| delete-on-no-links-or-messages | as delete-on-no-links (emptiness is not watched) |
| delete-on-no-messages | kept until the connection ends (emptiness is not watched) |

A link detached without close counts until its session ends. Other connections' links,
which may only send to it, do not count.

Other dynamic-node-properties (supported-dist-modes...) are ignored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine, Iterable
from enum import Enum
from typing import Any

from proton import Described, Terminus, symbol, ulong

from gateway.broker import Broker, QueueError
from gateway.topics import temporary_topic_name
from protocols.amqp.terminus import first

LIFETIME_POLICY = symbol("lifetime-policy")

LinkId = tuple[str, bool]  # a link's name, and whether the client receives on it


class Lifetime(Enum):
    """How long a dynamic node lives (AMQP 1.0 section 3.5.10)."""

    LINK = "delete-on-close"
    NO_LINKS = "delete-on-no-links"
    NO_MESSAGES = "delete-on-no-messages"
    NO_LINKS_OR_MESSAGES = "delete-on-no-links-or-messages"

    @property
    def no_links(self) -> bool:
        return self in (Lifetime.NO_LINKS, Lifetime.NO_LINKS_OR_MESSAGES)


_CODES = {
    0x2B: Lifetime.LINK,
    0x2C: Lifetime.NO_LINKS,
    0x2D: Lifetime.NO_MESSAGES,
    0x2E: Lifetime.NO_LINKS_OR_MESSAGES,
}


def lifetime(terminus: Terminus) -> Lifetime:
    """The lifetime policy a dynamic terminus asks for (by symbolic or numeric descriptor);
    delete-on-close when it names none or one this code does not know."""
    props = first(terminus.properties)
    policy = props.get(LIFETIME_POLICY) if isinstance(props, dict) else None
    if not isinstance(policy, Described):
        return Lifetime.LINK
    descriptor = policy.descriptor
    if isinstance(descriptor, ulong | int):
        return _CODES.get(int(descriptor), Lifetime.LINK)
    name = str(descriptor).removeprefix("amqp:").removesuffix(":list")
    return next((p for p in Lifetime if p.value == name), Lifetime.LINK)


class DynamicNodes:
    """The temporary queues of one connection (its dynamic nodes and the queues of its
    non-durable topic subscriptions), so the last of them go when it ends."""

    def __init__(self, broker: Broker, user: str, connection: str) -> None:
        self.broker = broker
        self.user = user
        self.connection = connection
        self.names: set[str] = set()
        # delete-on-close nodes of links detached without closing (§3.5.10: the node goes
        # when the link ceases to exist): node -> (link, session). A link is its name and
        # role (§2.6.1): a sender and a receiver of one name are two links
        self.suspended: dict[str, tuple[LinkId, Any]] = {}
        # delete-on-no-links nodes: how many of this connection's links are attached to or
        # from each, and those detached without closing: (node, link) -> session
        self.links: dict[str, int] = {}
        self.suspended_links: dict[tuple[str, LinkId], Any] = {}
        self.ended = False  # the connection is gone: a node created now goes at once
        # temporary topics (a dynamic target with the temporary-topic capability): a name,
        # nothing in Redis; this connection's receivers alone may subscribe to one, while
        # the connection lasts
        self.topics: set[str] = set()

    async def create(
        self, policy: Lifetime, subscriptions: Iterable[tuple[str, str]] = (), selector: str = ""
    ) -> str:
        subscriptions = list(subscriptions)
        name = await self.broker.create_temporary_queue(
            owner=self.user,
            subscriptions=subscriptions,
            connection=self.connection,
            selector=selector,
            subscription=bool(subscriptions),  # a topic receiver's: no address
        )
        self.names.add(name)
        if policy.no_links:
            self.links[name] = 0
        if self.ended:  # it ended while the queue was being created: nothing will use it
            await self.delete(name)
        return name

    def create_topic(self) -> str:
        name = temporary_topic_name(self.broker.node_id)
        self.topics.add(name)
        return name

    def suspend(self, name: str, link: LinkId, session: Any) -> None:
        """Keep the node of link `link`, detached without closing, for its resumption."""
        self.suspended[name] = (link, session)

    def resume(self, name: str, link: LinkId) -> bool:
        """Whether `link` resumes the suspended link that made node `name`: it is then the
        link's again, deleted when it is closed."""
        held = self.suspended.get(name)
        if held is None or held[0] != link:
            return False
        del self.suspended[name]
        return True

    def link(self, name: str, link: LinkId) -> bool:
        """A link attached to or from node `name`: whether it counts toward the node's life
        (delete-on-no-links); one resuming a link detached without close takes its place."""
        if name not in self.links:
            return False
        if self.suspended_links.pop((name, link), None) is None:
            self.links[name] += 1
        return True

    def suspend_link(self, name: str, link: LinkId, session: Any) -> None:
        """A counted link detached without close: it counts until its session ends."""
        self.suspended_links[(name, link)] = session

    async def unlink(self, name: str) -> None:
        """A counted link closed: the node goes with the last."""
        left = self.links.get(name)
        if left is None:
            return
        if left <= 1:
            await self.delete(name)
        else:
            self.links[name] = left - 1

    def end_session(self, session: Any) -> Coroutine[Any, Any, None]:
        """The session ended: the links suspended on it are gone, and so are their nodes
        (delete-on-close), or their counts (delete-on-no-links). What it held is taken at
        once (the session is freed next); the coroutine returned releases it."""
        nodes = [name for name, (_, held) in self.suspended.items() if held == session]
        links = [key for key, held in self.suspended_links.items() if held == session]
        for name in nodes:
            del self.suspended[name]
        for key in links:
            del self.suspended_links[key]
        return self._release(nodes, [name for name, _ in links])

    async def _release(self, nodes: list[str], counted: list[str]) -> None:
        for name in nodes:
            await self.delete(name)
        for name in counted:
            await self.unlink(name)

    async def delete(self, name: str) -> None:
        self.names.discard(name)
        self.suspended.pop(name, None)
        self.links.pop(name, None)
        with contextlib.suppress(QueueError):  # gone already (auto-delete)
            await self.broker.delete_temporary_queue(name, user=self.user)

    async def delete_all(self) -> None:
        """The connection ended: every node it still has, or creates from now on, goes."""
        self.ended = True
        for name in list(self.names):
            await self.delete(name)
