"""Topic routing: which queues a published topic reaches.

One trie per node holds every queue's topic subscriptions. It is loaded from Redis in one
call and reloaded when the shared subscription version moves past the one loaded (the event
arrives over pub/sub; the node that made a change reloads at once).
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gateway.engine.queues import parse_subscription_entry
from gateway.topics import SubscriptionTrie


class Router:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._trie: SubscriptionTrie[str] = SubscriptionTrie()
        self.version = -1
        self._lock = asyncio.Lock()

    def match(self, topic: str) -> frozenset[str]:
        """Names of the queues whose subscriptions match `topic`."""
        return self._trie.match(topic)

    async def reload(self, at_least: int = 0) -> None:
        """Rebuild the trie unless the loaded version is already `at_least`."""
        async with self._lock:
            if self.version >= at_least and at_least > 0:
                return
            reply = await self._redis.fcall("gw_routes", 0)
            trie: SubscriptionTrie[str] = SubscriptionTrie()
            pos = 1
            while pos < len(reply):
                queue = reply[pos].decode()
                count = int(reply[pos + 1])
                for entry in reply[pos + 2 : pos + 2 + count]:
                    pattern, syntax = parse_subscription_entry(entry.decode())
                    trie.add(pattern, queue, syntax)
                pos += 2 + count
            self._trie = trie
            self.version = int(reply[0])

    def subscriptions(self) -> list[tuple[str, str, str]]:
        """(pattern, syntax, queue) for every loaded subscription."""
        return list(self._trie.entries())
