"""A TCP proxy in front of Redis that works command by command (real sockets, real Redis):

- `cut_on`: at the first command holding all these markers, the commands before it are
  run and answered, then (`pre` seconds later, so those answers reach the client) it is
  run and nothing after it: no later command reaches Redis, no reply reaches the client,
  and `after` seconds later the connection is aborted (a command that ran in Redis whose
  answer was lost with the connection); `cuts_on`: several such marker lists at once,
  each used once, on whichever connection first sends a command holding all its markers;
- `delay_on`: the replies of the connection that sent a command holding it wait `delay`
  seconds (a slow answer, while the client's other connections go on);
- `delay_reply_on`: the first chunk to the client holding it waits `delay` seconds (e.g. a
  pub/sub message read late);
- `loading_on`: the first command holding it is not run; Redis answers it, in its place,
  with the -LOADING error it gives while it loads its data.
"""

from __future__ import annotations

import asyncio
import contextlib

_LOADING = b"return redis.error_reply('LOADING Redis is loading the dataset in memory')"
LOADING_COMMAND = b"*3\r\n$4\r\nEVAL\r\n$%d\r\n%s\r\n$1\r\n0\r\n" % (len(_LOADING), _LOADING)


def split_commands(buf: bytes) -> tuple[list[bytes], bytes]:
    """The whole RESP commands (arrays of bulk strings) at the start of `buf`, and the rest."""
    commands: list[bytes] = []
    pos = 0
    while pos < len(buf):
        start = pos
        end = buf.find(b"\r\n", pos)
        if end < 0:
            break
        args, pos = int(buf[pos + 1 : end]), end + 2
        for _ in range(args):
            end = buf.find(b"\r\n", pos)
            if end < 0:
                return commands, buf[start:]
            pos = end + 2 + int(buf[pos + 1 : end]) + 2
            if pos > len(buf):
                return commands, buf[start:]
        commands.append(buf[start:pos])
    return commands, buf[pos:]


class CuttingProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.cut_on: list[bytes] | None = None
        self.cuts_on: list[list[bytes]] = []
        self.pre = 0.15  # seconds
        self.after = 0.2  # seconds
        self.delay_on: bytes | None = None
        self.delay_reply_on: bytes | None = None
        self.delay = 0.0  # seconds
        self.loading_on: bytes | None = None
        # from the first command holding all of these on, the connection's commands reach
        # Redis no more: what a process killed then had not written
        self.drop_from: list[bytes] | None = None
        self.dropped = 0
        self.cuts = 0
        self.ran = 0  # cut commands that reached Redis
        self.refused = 0
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

    def _cuts(self, command: bytes) -> bool:
        """Whether an armed cut takes `command` (it is then used up)."""
        if self.cut_on and all(m in command for m in self.cut_on):
            self.cut_on = None
            return True
        for markers in self.cuts_on:
            if all(m in command for m in markers):
                self.cuts_on.remove(markers)
                return True
        return False

    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers += [cw, uw]
        state = {"blackhole": False, "held_until": 0.0, "dropping": False}
        loop = asyncio.get_running_loop()

        async def cut(command: bytes) -> None:
            await uw.drain()
            await asyncio.sleep(self.pre)  # the answers before it reach the client
            state["blackhole"] = True
            uw.write(command)
            await uw.drain()
            self.ran += 1
            await asyncio.sleep(self.after)  # Redis runs it and answers, to nobody
            self.cuts += 1
            cw.transport.abort()
            uw.transport.abort()

        async def up() -> None:
            rest = b""
            try:
                while data := await cr.read(65536):
                    commands, rest = split_commands(rest + data)
                    for command in commands:
                        if self.drop_from and all(m in command for m in self.drop_from):
                            state["dropping"] = True
                        if state["dropping"]:
                            self.dropped += 1
                            continue
                        if self._cuts(command):
                            await cut(command)
                            return
                        if self.loading_on and self.loading_on in command:
                            self.loading_on = None
                            self.refused += 1
                            command = LOADING_COMMAND
                        if self.delay_on and self.delay_on in command:
                            self.delay_on = None
                            state["held_until"] = loop.time() + self.delay
                        uw.write(command)
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
