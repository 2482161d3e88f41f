"""Topic routing: which queues a published topic reaches (and which message properties
last value queues key on).

A queue may have a subscription selector (a Solace topic endpoint's selector): a topic
message reaches it only if the selector matches. The selectors are compiled here at load
and evaluated in `select`, which the publish path calls only when some queue has one.

One trie per node holds every queue's topic subscriptions. It is loaded from Redis in one
call, and when the shared subscription version moves past the one loaded (the event
arrives over pub/sub; the node that made a change loads at once) the routes of the queues
changed since are loaded and replace theirs: a change costs what it changed, not every
route again.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from gateway.engine.queues import parse_subscription_entry
from gateway.engine.selection import matches
from gateway.model import Message, property_text
from gateway.selectors import Selector, SelectorError, compile_selector
from gateway.topics import SubscriptionTrie

log = logging.getLogger(__name__)


class Router:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._trie: SubscriptionTrie[str] = SubscriptionTrie()
        self.version = -1
        self.generation = ""  # of the Redis data loaded (gw_routes_since)
        self._forgets = 0  # times forget() was called
        self.keyed_properties: frozenset[str] = frozenset()  # lvq_key / sort_key names
        self.selectors: dict[str, Selector] = {}  # queue -> its subscription selector
        # queue -> its created_ms as loaded: a message routed by its subscriptions goes to
        # that queue, not to one made again under its name before this node reloaded
        self.created: dict[str, str] = {}
        self._routes: dict[str, list[tuple[str, str]]] = {}  # queue -> (pattern, syntax)s
        self._keys: dict[str, str] = {}  # queue -> the property its LVQ or sort key names
        self._lock = asyncio.Lock()
        self._asked = 0  # reloads asked for
        self._served = 0  # those a finished load began after (it read what they changed)

    def match(self, topic: str) -> frozenset[str]:
        """Names of the queues whose subscriptions match `topic`."""
        return self._trie.match(topic)

    async def reload(self, at_least: int = 0) -> None:
        """Load what changed unless the loaded version is already `at_least`. Callers that
        wait meanwhile share one load, begun after they asked: a client attaching and
        detaching topic links in a loop queued a load each, and other clients'
        subscriptions waited seconds behind them."""
        self._asked += 1
        asked = self._asked
        async with self._lock:
            if (self.version >= at_least and at_least > 0) or self._served >= asked:
                return
            serving = self._asked
            await self._load()
            self._served = serving

    def forget(self) -> None:
        """Have the next load read every route: what was loaded may no longer be a part of
        what Redis holds (it came back from an older copy of its data)."""
        self.generation = ""
        self._forgets += 1

    async def _load(self) -> None:
        """One call: the routes of the queues changed since the version loaded, or every
        route (the first load, the changes since no longer kept, or Redis came back without
        its data). Every route read at each change held Redis 190 ms at 16,000 queues, and
        every SUBACK 300 ms."""
        forgets = self._forgets
        reply = await self._redis.fcall("gw_routes_since", 0, self.version, self.generation)
        # read from the Redis that forget() doubted: the next load reads every route again
        self.generation = reply[1].decode() if forgets == self._forgets else ""
        old_selectors = self.selectors
        if reply[2] == b"all":
            self._trie = SubscriptionTrie()
            self._routes, self._keys, self.selectors, self.created = {}, {}, {}, {}
        self.created = dict(self.created)  # one object per load: messages routed hold it
        pos = 3
        while pos < len(reply):
            queue = reply[pos].decode()
            for pattern, syntax in self._routes.pop(queue, ()):
                self._trie.remove(pattern, queue, syntax)
            self._keys.pop(queue, None)
            earlier = self.selectors.pop(queue, None) or old_selectors.get(queue)
            self.created.pop(queue, None)
            count = int(reply[pos + 4])
            if count >= 0:
                if reply[pos + 1]:
                    self._keys[queue] = reply[pos + 1].decode()
                if reply[pos + 2]:
                    text = reply[pos + 2].decode()
                    self.selectors[queue] = self._compiled(queue, text, earlier)
                if count and reply[pos + 3]:
                    self.created[queue] = reply[pos + 3].decode()
                routes = [
                    parse_subscription_entry(e.decode()) for e in reply[pos + 5 : pos + 5 + count]
                ]
                for pattern, syntax in routes:
                    self._trie.add(pattern, queue, syntax)
                if routes:
                    self._routes[queue] = routes
            pos += 5 + max(count, 0)
        self.keyed_properties = frozenset(self._keys.values())
        self.version = int(reply[0])

    @staticmethod
    def _compiled(queue: str, text: str, earlier: Selector | None) -> Selector:
        """The queue's selector, reusing the one compiled before."""
        if earlier is not None and earlier.text == text:
            return earlier
        try:
            return compile_selector(text)
        except SelectorError:  # validated at declare: only a foreign writer gets here
            log.error("queue %s has an invalid subscription selector; it takes nothing", queue)
            return compile_selector("FALSE")

    def select(self, queues: frozenset[str], msg: Message) -> frozenset[str]:
        """`queues` without those whose subscription selector does not match `msg`."""
        selectors = self.selectors
        if queues.isdisjoint(selectors):
            return queues
        return frozenset(q for q in queues if q not in selectors or matches(selectors[q], msg, 1))

    def spool_properties(self, msg: Message) -> str:
        """The message's values of the properties some queue keys on (a last value queue's
        lvq_key, a sorted queue's sort_key), as "\0name\0size\0value..." for the spool
        function (property_value), the size in UTF-8 bytes: a value may hold U+0000 (""
        almost always)."""
        if not self.keyed_properties or not msg.user_properties:
            return ""
        found: dict[str, str] = {}
        for name, value in msg.user_properties:
            if name in self.keyed_properties and name not in found and value is not None:
                found[name] = property_text(value)  # AMQP true and MQTT "true" are one key
        if not found:
            return ""
        return "\0" + "".join(f"{k}\0{len(v.encode())}\0{v}" for k, v in found.items())

    def subscriptions(self) -> list[tuple[str, str, str]]:
        """(pattern, syntax, queue) for every loaded subscription."""
        return list(self._trie.entries())
