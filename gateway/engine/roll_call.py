"""Questions to the other nodes over the event channel, each answered once its node acted
on it: what a client is told must then hold on every node (a SUBACK: the nodes route and
relay to the new subscription), while a pub/sub event alone may be read after the client's
next packet reached another node.

A question waits for the nodes registered live in Redis (gw:nodes), not for whoever got the
PUBLISH: a node whose event channel is reconnecting is waited for too. A node that did not
answer in time (stalled, or too old to answer) is silent: later questions do not wait for
it until it answers one again, so it costs one wait, not one per subscription. A node whose
event channel was down (so it missed questions) says "back" once it read the routes again:
that answers the routes questions its read covers, and makes it not silent.

Event formats: "ask <node> <n> <what> [<arg>]", "answer <node> <n> <answering node>" and
"back <node> <routes version>".
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import redis.asyncio as aioredis

from gateway.engine import keys
from gateway.engine.events import EventListener

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 2.0  # a question waits this long for the answers of stalled nodes


class _Answers:
    """The answers to one question, gathered before the nodes to wait for are known (an
    answer can come before the asking round trip returns)."""

    def __init__(self, what: str, arg: str) -> None:
        self.what = what
        self.arg = arg
        self.answered: set[str] = set()
        self.back: set[str] = set()  # nodes that said back meanwhile: not silent
        self.waiting: set[str] | None = None
        self.all_in = asyncio.Event()

    def answer(self, node: str) -> None:
        self.answered.add(node)
        self._check()

    def wait_for(self, nodes: set[str]) -> None:
        self.waiting = nodes
        self._check()

    def missing(self) -> set[str]:
        return (self.waiting or set()) - self.answered

    def _check(self) -> None:
        if self.waiting is not None and self.waiting <= self.answered:
            self.all_in.set()


class RollCall:
    def __init__(self, redis: aioredis.Redis, node_id: str, events: EventListener) -> None:
        self._redis = redis
        self._node = node_id
        self._events = events  # the answers come on its channel
        self._numbers = itertools.count(1)
        self._pending: dict[str, _Answers] = {}  # by question tag "<node> <n>"
        self._silent: set[str] = set()  # nodes that did not answer the last time

    async def ask(self, what: str, arg: str = "") -> None:
        """Ask the other live nodes and return once each answered, or after
        ANSWER_TIMEOUT_S (a stalled node is not waited for longer; nor is this node's own
        event channel, reconnecting, which the answers come on). RedisError if the
        question could not go."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ANSWER_TIMEOUT_S
        try:
            await asyncio.wait_for(self._events.listening.wait(), ANSWER_TIMEOUT_S)
        except TimeoutError:
            log.warning("%r not asked: this node's event channel is down", what)
            return
        losses = self._events.losses
        tag = f"{self._node} {next(self._numbers)}"
        answers = self._pending[tag] = _Answers(what, arg)
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.smembers(keys.nodes)
            pipe.publish(keys.events, f"ask {tag} {what} {arg}".rstrip())
            nodes, _ = await pipe.execute()
            live = {n.decode() for n in nodes} - {self._node}
            answers.wait_for(live - self._silent)
            try:
                await asyncio.wait_for(answers.all_in.wait(), max(0, deadline - loop.time()))
            except TimeoutError:
                missing = answers.missing()
                if self._events.losses == losses:  # else their answers may have been missed
                    self._silent |= missing - answers.back
                log.warning(
                    "nodes %s did not answer %r in %.0f s: not waited for until they answer",
                    ", ".join(sorted(missing)),
                    what,
                    ANSWER_TIMEOUT_S,
                )
            self._silent &= live  # forget nodes gone
        finally:
            del self._pending[tag]

    def parse(self, arg: str) -> tuple[str, str, str, str] | None:
        """An 'ask' event's (asking node, tag, what, arg); None for this node's own."""
        node, _, rest = arg.partition(" ")
        if node == self._node:
            return None
        number, _, rest = rest.partition(" ")
        what, _, value = rest.partition(" ")
        return node, f"{node} {number}", what, value

    async def tell_back(self, routes_version: int) -> None:
        """This node's event channel is back and its routes read again (RedisError if the
        word could not go: its next answer makes it not silent)."""
        await self._redis.publish(keys.events, f"back {self._node} {routes_version}")

    def back(self, arg: str) -> None:
        """A 'back' event: another node read the routes again after missing questions."""
        node, _, version = arg.partition(" ")
        if node == self._node:
            return
        self._silent.discard(node)
        for answers in self._pending.values():
            answers.back.add(node)
            # (a 'back' sent before another question may come after it: only a routes
            # read covering the question's version answers it)
            if answers.what == "routes" and int(answers.arg) <= int(version):
                answers.answer(node)

    async def answer(self, tag: str) -> None:
        """RedisError if the answer could not go (the asking node stops waiting later)."""
        await self._redis.publish(keys.events, f"answer {tag} {self._node}")

    def answered(self, arg: str) -> None:
        """An 'answer' event (perhaps to another node's question)."""
        asker, _, rest = arg.partition(" ")
        number, _, node = rest.partition(" ")
        if asker != self._node:
            return
        self._silent.discard(node)
        answers = self._pending.get(f"{asker} {number}")
        if answers is not None:
            answers.answer(node)
