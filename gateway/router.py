"""Topic routing: which queues a published topic reaches (and which message properties
last value queues key on).

A queue may have a subscription selector (a Solace topic endpoint's selector): a topic
message reaches it only if the selector matches. The selectors are compiled here at load
and evaluated in `select`, which the publish path calls only when some queue has one.

One trie per node holds every queue's topic subscriptions. It is loaded from Redis in one
call and reloaded when the shared subscription version moves past the one loaded (the event
arrives over pub/sub; the node that made a change reloads at once).
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
        self.keyed_properties: frozenset[str] = frozenset()  # lvq_key / sort_key names
        self.selectors: dict[str, Selector] = {}  # queue -> its subscription selector
        # queue -> its created_ms as loaded: a message routed by its subscriptions goes to
        # that queue, not to one made again under its name before this node reloaded
        self.created: dict[str, str] = {}
        self._lock = asyncio.Lock()
        self._asked = 0  # reloads asked for
        self._served = 0  # those a finished load began after (it read what they changed)

    def match(self, topic: str) -> frozenset[str]:
        """Names of the queues whose subscriptions match `topic`."""
        return self._trie.match(topic)

    async def reload(self, at_least: int = 0) -> None:
        """Rebuild the trie unless the loaded version is already `at_least`. Callers that
        wait meanwhile share one load, begun after they asked: a client attaching and
        detaching topic links in a loop queued a whole load each (every route read each
        time), and other clients' subscriptions waited seconds behind them."""
        self._asked += 1
        asked = self._asked
        async with self._lock:
            if (self.version >= at_least and at_least > 0) or self._served >= asked:
                return
            serving = self._asked
            await self._load()
            self._served = serving

    async def _load(self) -> None:
        """One load of every route, in one call."""
        reply = await self._redis.fcall("gw_routes", 0)
        trie: SubscriptionTrie[str] = SubscriptionTrie()
        pos = 1
        keyed = set()
        selectors: dict[str, Selector] = {}
        created: dict[str, str] = {}
        while pos < len(reply):
            queue = reply[pos].decode()
            if reply[pos + 1]:
                keyed.add(reply[pos + 1].decode())
            if reply[pos + 2]:
                selectors[queue] = self._compiled(queue, reply[pos + 2].decode())
            count = int(reply[pos + 4])
            if count and reply[pos + 3]:
                created[queue] = reply[pos + 3].decode()
            for entry in reply[pos + 5 : pos + 5 + count]:
                pattern, syntax = parse_subscription_entry(entry.decode())
                trie.add(pattern, queue, syntax)
            pos += 5 + count
        self._trie = trie
        self.keyed_properties = frozenset(keyed)
        self.selectors = selectors
        self.created = created
        self.version = int(reply[0])

    def _compiled(self, queue: str, text: str) -> Selector:
        """The queue's selector, reusing the one compiled at the last load."""
        old = self.selectors.get(queue)
        if old is not None and old.text == text:
            return old
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
