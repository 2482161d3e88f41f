"""The embedded redis-server: a child process under the data directory, AOF on.

It listens on a unix socket only (no port to collide with), dies with the gateway (the
kernel sends it SIGTERM if the gateway dies, even by SIGKILL), is started again if it dies
while the gateway runs (`supervise`), and each start replays its append-only file, so
spooled messages survive a crash of either.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from gateway.cpus import pin
from gateway.output_tail import OutputTail

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "redis-server not found: install it (Debian/Ubuntu: apt-get install redis-server) "
    "or pass --redis-url"
)
_PR_SET_PDEATHSIG = 1
START_TIMEOUT = 15.0  # seconds for a start, the AOF loaded
SUPERVISE_EVERY = 0.2  # seconds between checks that the embedded redis-server still runs
SUPERVISE_BACKOFF_MAX = 5.0  # seconds between attempts when it does not start again
LOG_TAIL_BYTES = 4096  # of its log, read for the lines that say why it exited


def socket_of(data_dir: str | Path) -> Path:
    """The unix socket the embedded redis-server of `data_dir` listens on."""
    return Path(data_dir).resolve() / "redis.sock"


class RedisStartError(RuntimeError):
    """The embedded redis-server could not be started; the message says why."""


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the gateway goes away."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_setup(cpus: set[int] | None) -> Callable[[], None]:
    """What the child runs before exec: die with the gateway, keep to `cpus` (all of its
    threads, started after this, inherit them)."""

    def setup() -> None:
        _die_with_parent()
        if cpus:
            pin(cpus)

    return setup


def repair_aof(data_dir: Path) -> str | None:
    """Cut a torn transaction off the end of the AOF in `data_dir`, before redis-server
    loads it; returns redis-check-aof's report when it cut something. Damage before the
    end (a disk error, an edit) is no torn write: cutting there would drop everything
    after it, so RedisStartError says so and nothing is cut (as Redis refuses it).

    A crash in the middle of writing a function's effects (one MULTI/EXEC in the AOF)
    leaves a torn tail. Redis 7.0 cuts it at the last whole command, which can leave a
    MULTI without its EXEC at the end of the file; whatever it appends afterwards is read
    into that transaction at the following start, and is lost, or applied together with
    the torn function's first effects (a spool batch's entries without their counters).
    redis-check-aof --fix cuts at the MULTI, so the torn function is dropped whole."""
    manifests = sorted((data_dir / "appendonlydir").glob("*.manifest"))
    tool = shutil.which("redis-check-aof")
    if not manifests or tool is None:
        return None
    checked = subprocess.run([tool, str(manifests[0])], capture_output=True, timeout=600)
    report = checked.stdout.decode(errors="replace")
    if "is not valid" not in report:
        return None
    if not _torn_at_the_end(data_dir / "appendonlydir", report):
        lines = [line for line in report.splitlines() if "0x" in line or "analyzed" in line]
        raise RedisStartError(
            f"the AOF in {data_dir / 'appendonlydir'} is damaged before its end "
            f"({' | '.join(lines) or 'format error'}): nothing was cut; back it up, then "
            "cut it yourself with redis-check-aof --fix (everything after the damage goes)"
        )
    done = subprocess.run(
        [tool, "--fix", str(manifests[0])], input=b"y\n", capture_output=True, timeout=600
    )
    report = done.stdout.decode(errors="replace")
    if "Successfully truncated" not in report:
        return None
    return " | ".join(line for line in report.splitlines() if "AOF" in line and "shrink" in line)


# What an AOF holds: Redis 7.0's write commands (COMMAND LIST FILTERBY ACLCAT write), MULTI
# and SELECT. A verb outside it in what a fix would cut is damage, not a torn write.
AOF_VERBS = frozenset(
    b"""
APPEND BITFIELD BITOP BLMOVE BLMPOP BLPOP BRPOP BRPOPLPUSH BZMPOP BZPOPMAX BZPOPMIN
COPY DECR DECRBY DEL EXPIRE EXPIREAT FLUSHALL FLUSHDB FUNCTION GEOADD GEORADIUS
GEORADIUSBYMEMBER GEOSEARCHSTORE GETDEL GETEX GETSET HDEL HINCRBY HINCRBYFLOAT HMSET
HSET HSETNX INCR INCRBY INCRBYFLOAT LINSERT LMOVE LMPOP LPOP LPUSH LPUSHX LREM LSET
LTRIM MIGRATE MOVE MSET MSETNX PERSIST PEXPIRE PEXPIREAT PFADD PFDEBUG PFMERGE PSETEX
RENAME RENAMENX RESTORE RESTORE-ASKING RPOP RPOPLPUSH RPUSH RPUSHX SADD SDIFFSTORE SET
SETBIT SETEX SETNX SETRANGE SINTERSTORE SMOVE SORT SPOP SREM SUNIONSTORE SWAPDB UNLINK
XACK XADD XAUTOCLAIM XCLAIM XDEL XGROUP XREADGROUP XSETID XTRIM ZADD ZDIFFSTORE ZINCRBY
ZINTERSTORE ZMPOP ZPOPMAX ZPOPMIN ZRANGESTORE ZREM ZREMRANGEBYLEX ZREMRANGEBYRANK
ZREMRANGEBYSCORE ZUNIONSTORE MULTI SELECT PUBLISH SPUBLISH
""".split()
)


_ANALYZED = re.compile(r"AOF analyzed: filename=([^,]+), size=\d+, ok_up_to=(\d+),")


def _torn_at_the_end(aof_dir: Path, report: str) -> bool:
    """Whether what redis-check-aof would cut is one write a crash cut short: in the
    newest file, whole commands (a MULTI only first, no EXEC: one function's effects),
    then at most one command cut short or the zeros a crash can leave. Damage amid the
    file is anything else (a broken byte, or a broken EXEC that would take every later
    transaction with it)."""
    found = _ANALYZED.findall(report)
    if not found:
        return False
    name, ok_up_to = found[-1]
    path = aof_dir / Path(name).name
    if path != _newest_file(aof_dir):
        return False
    tail = path.read_bytes()[int(ok_up_to) :]
    at, commands = 0, 0
    while at < len(tail):
        if not tail[at:].strip(b"\0"):
            return True  # zeros to the end: space the file got, data that never came
        parsed = _command(tail, at)
        if parsed is None:
            return True  # cut short at the end
        if parsed is False:
            return False
        at, name_bytes = parsed
        verb = name_bytes.upper()
        if verb not in AOF_VERBS or (verb == b"MULTI" and commands):
            return False  # an EXEC too: a whole transaction is no torn one
        commands += 1
    return True


def _newest_file(aof_dir: Path) -> Path | None:
    """The incr file Redis appends to: the manifest's last one."""
    manifests = sorted(aof_dir.glob("*.manifest"))
    if not manifests:
        return None
    names = [
        line.split()[1]
        for line in manifests[0].read_text().splitlines()
        if len(line.split()) > 1 and line.split()[0] == "file"
    ]
    return aof_dir / names[-1] if names else None


def _command(buf: bytes, at: int) -> tuple[int, bytes] | bool | None:
    """The RESP command at `at`: (where it ends, its name); None if the bytes end first;
    False if it is malformed."""
    line = buf.find(b"\r\n", at)
    if line < 0:
        return None
    if buf[at : at + 1] != b"*" or not buf[at + 1 : line].isdigit():
        return False
    pos, name = line + 2, b""
    for i in range(int(buf[at + 1 : line])):
        line = buf.find(b"\r\n", pos)
        if line < 0:
            return None
        if buf[pos : pos + 1] != b"$" or not buf[pos + 1 : line].isdigit():
            return False
        start = line + 2
        end = start + int(buf[pos + 1 : line])
        if end + 2 > len(buf):
            return None
        if buf[end : end + 2] != b"\r\n":
            return False
        if i == 0:
            name = buf[start:end]
        pos = end + 2
    return pos, name


def memory_limit(percent: int) -> int:
    """`percent` of the memory this process may use (the machine's, or its cgroup's limit
    when lower), in bytes; 0 for 0 %."""
    if percent <= 0:
        return 0
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError, ValueError):
        total = min(total, int(Path("/sys/fs/cgroup/memory.max").read_text()))  # "max": none
    return total * percent // 100


class EmbeddedRedis:
    def __init__(
        self,
        data_dir: str | Path,
        appendfsync: str = "everysec",
        cpus: set[int] | None = None,
        maxmemory: int = 0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.appendfsync = appendfsync
        self.cpus = cpus  # None: wherever the gateway may run
        # bytes (0: none); once there, Redis refuses new messages and never evicts any
        self.maxmemory = maxmemory
        self.socket = socket_of(self.data_dir)
        self.pidfile = self.data_dir / "redis.pid"
        self.logfile = self.data_dir / "redis.log"
        self.proc: subprocess.Popen | None = None
        # what the running redis-server printed (it logs to `logfile`, but says on stdout
        # and stderr why it cannot, e.g. in a data directory it may not write), and where
        # its lines in `logfile` begin
        self._output: OutputTail | None = None
        self._log_start = 0

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RedisStartError("the embedded redis-server was not started")
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def start(self, timeout: float = START_TIMEOUT) -> None:
        binary = self._prepare(timeout)
        self._launch(binary)
        self._wait_ready(timeout)

    def _prepare(self, timeout: float) -> str:
        """Everything before the launch (the AOF checked); returns the redis-server path."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisStartError(INSTALL_HINT)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._wait_previous_exit(timeout)
        cut = repair_aof(self.data_dir)
        if cut is not None:
            log.warning("the AOF ended in a torn transaction, dropped whole: %s", cut)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        return binary

    def _launch(self, binary: str) -> None:
        args = [
            binary,
            "--port",
            "0",
            "--unixsocket",
            str(self.socket),
            "--unixsocketperm",
            "700",
            "--dir",
            str(self.data_dir),
            "--pidfile",
            str(self.pidfile),
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--maxmemory",
            str(self.maxmemory),
            "--maxmemory-policy",
            "noeviction",
            "--logfile",
            str(self.logfile),
            "--daemonize",
            "no",
        ]
        try:
            self._log_start = self.logfile.stat().st_size
        except OSError:
            self._log_start = 0
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_child_setup(self.cpus),
            # its own session: a terminal's Ctrl-C, or a service manager's stop sent to the
            # whole group, reaches the gateway only, which stops it last, after its own
            # clean-up needed it (it dies with the gateway all the same: _die_with_parent)
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self._output = OutputTail(self.proc.stdout)

    async def supervise(self) -> None:
        """Start redis-server again (its AOF checked first) whenever it exits while the node
        runs, e.g. killed for memory: the node's connections come back by themselves, and
        so does what its AOF holds. Runs until cancelled."""
        pause = SUPERVISE_EVERY
        while True:
            await asyncio.sleep(pause)
            if self.proc is None or self.proc.poll() is None:
                continue
            log.error(
                "embedded redis-server exited (code %s: %s); starting it again",
                self.proc.returncode,
                await asyncio.to_thread(self._exit_reason),
            )
            try:
                binary = await asyncio.to_thread(self._prepare, START_TIMEOUT)
                # launched from this thread: a fork that runs Python (the CPU pinning before
                # exec) from another thread can hang
                self._launch(binary)
                await asyncio.to_thread(self._wait_ready, START_TIMEOUT)
            except RedisStartError as exc:
                pause = min(pause * 2, SUPERVISE_BACKOFF_MAX)
                log.error("embedded redis-server did not start again: %s", exc)
                continue
            pause = SUPERVISE_EVERY
            log.info("embedded redis-server started again (pid %s)", self.pid)

    def _wait_previous_exit(self, timeout: float) -> None:
        """A redis-server of a crashed gateway may still be flushing its AOF: let it finish."""
        try:
            pid = int(self.pidfile.read_text().strip())
        except (FileNotFoundError, ValueError):
            return
        deadline = time.monotonic() + timeout
        while _alive(pid) and _serves(pid, self.socket):
            if time.monotonic() > deadline:
                raise RedisStartError(
                    f"redis-server pid {pid} still runs on {self.data_dir}: another gateway "
                    "uses this data directory"
                )
            time.sleep(0.05)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(unix_socket_path=str(self.socket))
        try:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RedisStartError(
                        f"redis-server exited with code {self.proc.returncode}: "
                        + self._exit_reason()
                    )
                try:
                    # PING answers while the AOF is still loading; wait until it is loaded
                    if client.info("persistence").get("loading", 0) == 0:
                        return
                except redis.BusyLoadingError:
                    pass
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RedisStartError("redis-server did not answer in time")
                time.sleep(0.02)
        finally:
            client.close()

    def _exit_reason(self) -> str:
        """What the exited redis-server printed, and the last lines it logged since its
        start (not those of an earlier run)."""
        printed = self._output.lines() if self._output is not None else []
        try:
            with self.logfile.open("rb") as f:
                f.seek(max(self._log_start, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                logged = f.read().decode(errors="replace").strip().splitlines()[-3:]
        except OSError:
            logged = []
        return " | ".join(printed + logged) or "it printed no reason"

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM: redis-server fsyncs its AOF and exits."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _serves(pid: int, socket: Path) -> bool:
    """Whether `pid` is a redis-server on `socket` (its title names its listening socket):
    a stale pid file may name another process, even another redis-server, by now."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"redis" in title and str(socket).encode() in title
