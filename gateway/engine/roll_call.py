"""Questions to the other nodes over the event channel, each answered once its node acted
on it: what a client is told must then hold on every node (a SUBACK: the nodes route and
relay to the new subscription), while a pub/sub event alone may be read after the client's
next packet reached another node.

Event formats: "ask <node> <n> <what> [<arg>]" and "answer <node> <n>".
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.engine import keys

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 2.0  # a question waits this long for the answers of stalled nodes


class _Answers:
    """The answers to one question, counted before their number is known (an answer can
    come before the asking PUBLISH returns how many got it)."""

    def __init__(self) -> None:
        self.got = 0
        self.expected: int | None = None
        self.all_in = asyncio.Event()

    def answered(self) -> None:
        self.got += 1
        self._check()

    def expect(self, count: int) -> None:
        self.expected = count
        self._check()

    def _check(self) -> None:
        if self.expected is not None and self.got >= self.expected:
            self.all_in.set()


class RollCall:
    def __init__(self, redis: aioredis.Redis, node_id: str) -> None:
        self._redis = redis
        self._node = node_id
        self._numbers = itertools.count(1)
        self._waiting: dict[str, _Answers] = {}  # by question tag "<node> <n>"

    async def ask(self, what: str, arg: str = "") -> None:
        """Ask every other node listening and return once each answered, or after
        ANSWER_TIMEOUT_S (a stalled node is not waited for longer). RedisError if the
        question could not go."""
        tag = f"{self._node} {next(self._numbers)}"
        answers = self._waiting[tag] = _Answers()
        try:
            receivers = await self._redis.publish(keys.events, f"ask {tag} {what} {arg}".rstrip())
            answers.expect(receivers - 1)  # this node got it too
            await asyncio.wait_for(answers.all_in.wait(), ANSWER_TIMEOUT_S)
        except TimeoutError:
            log.warning("%d of %d nodes answered %r in time", answers.got, answers.expected, what)
        finally:
            del self._waiting[tag]

    def parse(self, arg: str) -> tuple[str, str, str, str] | None:
        """An 'ask' event's (asking node, tag, what, arg); None for this node's own."""
        node, _, rest = arg.partition(" ")
        if node == self._node:
            return None
        number, _, rest = rest.partition(" ")
        what, _, value = rest.partition(" ")
        return node, f"{node} {number}", what, value

    async def answer(self, tag: str) -> None:
        try:
            await self._redis.publish(keys.events, f"answer {tag}")
        except RedisError as exc:  # the asking node stops waiting after a while
            log.warning("cannot answer another node's question: %s", exc)

    def answered(self, tag: str) -> None:
        """An 'answer' event (perhaps to another node's question)."""
        answers = self._waiting.get(tag)
        if answers is not None:
            answers.answered()
