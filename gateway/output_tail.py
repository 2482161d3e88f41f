"""The last lines a child process printed, read from its pipe in the background: they say
why it exited, and a chatty child never fills the pipe and blocks, nor grows a buffer."""

from __future__ import annotations

import threading
from collections import deque
from typing import IO


class OutputTail:
    """Keeps the last `lines` non-blank lines written to `pipe`, each cut to `width` bytes,
    until the pipe ends (the child and everything it started are gone)."""

    def __init__(self, pipe: IO[bytes], lines: int = 10, width: int = 512) -> None:
        self._pipe = pipe
        self._width = width
        self._kept: deque[str] = deque(maxlen=lines)
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="child-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        continued = False  # the rest of a line longer than `width`: dropped
        with self._pipe:
            while chunk := self._pipe.readline(self._width):
                text = chunk.decode(errors="replace").strip()
                if text and not continued:
                    with self._lock:
                        self._kept.append(text)
                continued = not chunk.endswith(b"\n")

    def lines(self, timeout: float = 1.0) -> list[str]:
        """What it printed, once its output ended; what came so far after `timeout` s."""
        self._reader.join(timeout)
        with self._lock:
            return list(self._kept)
