"""Messages a node takes while its event channel is down, routed only by routes read after
they came.

A node learns of other nodes' new subscriptions (and keyed queues) from the event channel;
while it is down it may have missed one whose SUBACK already went, so its routes may be
stale. What it takes then waits, in order, for a routes read that started after it came:
the next read it makes for them (a message that waits for nothing else is not held past
Redis's answer), or the read after the channel is back. A read that fails fails them, as
a spool would: their publishers are not acked and send them again, rather than having
them stored long after they gave up on this node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gateway.engine.spool import Done
from gateway.model import Message, Outcome

Route = Callable[[Message, "Done | None"], "asyncio.Future[Outcome] | None"]
_Held = tuple[Message, "Done | None", "asyncio.Future[Outcome] | None"]


class RoutingHold:
    def __init__(self, reload: Callable[[], Awaitable[None]], route: Route) -> None:
        self._reload = reload
        self._route = route
        self.active = False  # the event channel is down: messages wait
        self._held: list[_Held] = []
        self._reading: asyncio.Task | None = None
        self._backs = 0  # times the channel came back: a read from before may not release
        self._closed: BaseException | None = None  # the node stopped: what comes fails so

    def hold(self, msg: Message, done: Done | None) -> asyncio.Future[Outcome] | None:
        fut = None if done is not None else asyncio.get_running_loop().create_future()
        if self._closed is not None:
            _tell(done, fut, self._closed)
            return fut
        self._held.append((msg, done, fut))
        if self._reading is None:
            self._reading = asyncio.get_running_loop().create_task(self._read_for_held())
        return fut

    def lost(self) -> None:
        self.active = True

    def back(self) -> None:
        """The routes were read after the event channel came back: route what waited."""
        self.active = False
        self._backs += 1
        self._release(len(self._held))

    async def close(self, exc: BaseException) -> None:
        """The node stops: what is held fails with `exc`, and nothing more is routed."""
        self._closed = exc
        if self._reading is not None:
            self._reading.cancel()
            await asyncio.gather(self._reading, return_exceptions=True)
        held, self._held = self._held, []
        for _, done, fut in held:
            _tell(done, fut, exc)

    async def _read_for_held(self) -> None:
        try:
            while self._held and self.active:
                count, backs = len(self._held), self._backs  # before the read starts
                try:
                    await self._reload()
                except Exception as exc:  # Redis, or routes it cannot read: they fail
                    if backs != self._backs:  # (all went, and these came since)
                        continue
                    held, self._held = self._held[:count], self._held[count:]
                    for _, done, fut in held:
                        _tell(done, fut, exc)
                else:
                    if backs == self._backs:  # (else all went, and these came since)
                        self._release(count)
        finally:
            self._reading = None

    def _release(self, count: int) -> None:
        """Route the first `count` held messages, in order."""
        held, self._held = self._held[:count], self._held[count:]
        for msg, done, fut in held:
            try:
                routed = self._route(msg, done)
            except Exception as exc:  # that one fails, not those after it
                _tell(done, fut, exc)
                continue
            if fut is not None and routed is not None:
                _chain(routed, fut)


def _tell(done: Done | None, fut: asyncio.Future[Outcome] | None, exc: BaseException) -> None:
    if done is not None:
        done(exc)
    elif fut is not None and not fut.done():
        fut.set_exception(exc)


def _chain(source: asyncio.Future[Outcome], target: asyncio.Future[Outcome]) -> None:
    def copy(done: asyncio.Future[Outcome]) -> None:
        if target.done():
            return
        if done.cancelled():
            target.cancel()
        elif done.exception() is not None:
            target.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)
