"""A TCP proxy in front of Redis that can cut a connection right after forwarding a command
whose bytes contain a marker, before its reply reaches the client: a command that ran in
Redis whose answer was lost with the connection; or hold back the replies of the
connection that sent such a command for a while: a slow answer, while the client's other
connections go on; or hold back one chunk to the client holding a marker (e.g. a pub/sub
message read late); or answer the commands of a chunk holding a marker as Redis does while
it loads its data, without running them (real sockets, real Redis)."""

from __future__ import annotations

import asyncio
import contextlib

LOADING = b"-LOADING Redis is loading the dataset in memory\r\n"


def _commands_in(chunk: bytes) -> int:
    """How many whole RESP commands (arrays of bulk strings) `chunk` holds."""
    count = pos = 0
    while pos < len(chunk):
        end = chunk.index(b"\r\n", pos)
        args, pos = int(chunk[pos + 1 : end]), end + 2
        for _ in range(args):
            end = chunk.index(b"\r\n", pos)
            pos = end + 2 + int(chunk[pos + 1 : end]) + 2
        count += 1
    return count


class CuttingProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.cut_on: list[bytes] | None = None  # all of these in one chunk: cut after it
        self.delay_on: bytes | None = None  # in a chunk: that connection's replies wait
        self.delay = 0.0  # seconds
        self.delay_reply_on: bytes | None = None  # in a chunk to the client: it waits
        self.loading_on: bytes | None = None  # in a chunk: its commands get -LOADING
        self.refused = 0
        self.cuts = 0
        self._tasks: set[asyncio.Task] = set()
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in self._writers:
            w.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers += [cw, uw]
        state = {"blackhole": False, "held_until": 0.0}
        loop = asyncio.get_running_loop()

        async def up() -> None:
            try:
                while data := await cr.read(65536):
                    marker = self.cut_on
                    if marker and all(m in data for m in marker):
                        self.cut_on = None
                        state["blackhole"] = True  # its reply never reaches the client
                        uw.write(data)
                        await uw.drain()
                        await asyncio.sleep(0.2)  # Redis runs it and answers
                        self.cuts += 1
                        cw.transport.abort()
                        uw.transport.abort()
                        return
                    if self.loading_on and self.loading_on in data:
                        self.loading_on = None
                        self.refused += 1
                        cw.write(LOADING * _commands_in(data))
                        await cw.drain()
                        continue
                    if self.delay_on and self.delay_on in data:
                        self.delay_on = None
                        state["held_until"] = loop.time() + self.delay
                    uw.write(data)
                    await uw.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    uw.close()

        async def down() -> None:
            try:
                while data := await ur.read(65536):
                    if state["blackhole"]:
                        continue
                    held = state["held_until"] - loop.time()
                    if held > 0:
                        await asyncio.sleep(held)
                    if self.delay_reply_on and self.delay_reply_on in data:
                        self.delay_reply_on = None
                        await asyncio.sleep(self.delay)
                    cw.write(data)
                    await cw.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    cw.close()

        for coro in (up(), down()):
            t = asyncio.get_running_loop().create_task(coro)
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
