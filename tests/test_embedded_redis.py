"""The embedded redis-server across crashes: a torn transaction at the end of its AOF is
dropped whole before it loads, so what is written after the restart survives the next. And
its memory limit: a share of the machine's, reached without evicting anything."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import redis

from gateway.redis_server import EmbeddedRedis, RedisStartError, memory_limit, repair_aof
from tests.conftest import RedisServer

# three writes in one call: Redis puts the effects in the AOF as one MULTI ... EXEC
THREE_WRITES = "redis.call('SET', 'x1', 1); redis.call('SET', 'x2', 2); redis.call('SET', 'x3', 3)"


def crash(server: EmbeddedRedis) -> None:
    assert server.proc is not None
    server.proc.kill()
    server.proc.wait(10)


def incr_file(data_dir: Path) -> Path:
    return sorted((data_dir / "appendonlydir").glob("*.incr.aof"))[-1]


def client(server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis(unix_socket_path=str(server.socket), decode_responses=True)


def test_a_torn_transaction_is_dropped_whole_and_later_writes_survive(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = EmbeddedRedis(tmp_path, appendfsync="always")
    server.start()
    try:
        c = client(server)
        c.set("before", 1)
        c.eval(THREE_WRITES, 0)
        c.close()
        crash(server)
        torn = incr_file(tmp_path)
        with torn.open("r+b") as f:  # the crash cut the write inside the transaction
            f.truncate(torn.stat().st_size - 30)
        server.start()
        c = client(server)
        assert (c.get("before"), c.get("x1"), c.get("x2")) == ("1", None, None)
        c.set("after", 1)
        c.close()
        crash(server)
        server.start()  # a second start reads what came after the first one
        c = client(server)
        assert (c.get("before"), c.get("after"), c.get("x1"), c.get("x2")) == ("1", "1", None, None)
        c.close()
        assert "the AOF ended in a torn transaction" in caplog.text
    finally:
        server.stop()


def test_a_crash_stopping_at_any_byte_of_the_last_writes_is_a_torn_end(tmp_path: Path) -> None:
    """Every cut inside the last transaction and the single write before it (line ends
    and bulk strings cut short, a cut on a line boundary) is taken for a torn end and cut
    (or is a whole file already), never refused as damage."""
    server = EmbeddedRedis(tmp_path / "made", appendfsync="always")
    server.start()
    try:
        c = client(server)
        c.set("before", 1)
        c.set("single", "s" * 40)
        c.eval(THREE_WRITES, 0)
        c.close()
    finally:
        server.stop()
    made = tmp_path / "made" / "appendonlydir"
    whole = incr_file(tmp_path / "made").read_bytes()
    last = len(whole) - whole.rindex(b"*3\r\n$3\r\nSET\r\n$6\r\nsingle")
    for cut in range(1, last):
        data_dir = tmp_path / f"cut{cut}"
        shutil.copytree(made, data_dir / "appendonlydir")
        aof = incr_file(data_dir)
        aof.write_bytes(whole[:-cut])
        repair_aof(data_dir)  # raises for what it takes for damage
        assert repair_aof(data_dir) is None, f"a cut of {cut} bytes left a bad AOF"
        shutil.rmtree(data_dir)


def test_damage_before_the_end_of_the_aof_is_not_cut_away(tmp_path: Path) -> None:
    """A damaged byte amid the file is no torn write: cutting there would drop all that
    follows. The start is refused, as Redis refuses such a file, and nothing is cut."""
    server = EmbeddedRedis(tmp_path, appendfsync="always")
    server.start()
    try:
        c = client(server)
        for i in range(1000):
            c.set(f"k{i}", "v" * 50)
        c.close()
        crash(server)
        aof = incr_file(tmp_path)
        data = bytearray(aof.read_bytes())
        at = data.index(b"*3\r\n", len(data) // 10)
        data[at : at + 2] = b"*9"  # one command's header, a tenth into the file
        aof.write_bytes(bytes(data))
        with pytest.raises(RedisStartError, match="damaged before its end"):
            server.start()
        assert aof.read_bytes() == bytes(data)
    finally:
        server.stop()


def test_a_broken_exec_amid_the_aof_is_not_cut_away(tmp_path: Path) -> None:
    """One broken EXEC leaves its transaction open to the end of the file: that is no
    torn write, and a fix would take every later write with it."""
    server = EmbeddedRedis(tmp_path, appendfsync="always")
    server.start()
    try:
        c = client(server)
        c.eval(THREE_WRITES, 0)
        for i in range(200):
            c.set(f"k{i}", "v")
        c.close()
        crash(server)
        aof = incr_file(tmp_path)
        data = aof.read_bytes()
        at = data.index(b"EXEC\r\n")
        damaged = data[:at] + b"EXEX" + data[at + 4 :]
        aof.write_bytes(damaged)
        with pytest.raises(RedisStartError, match="damaged before its end"):
            server.start()
        assert aof.read_bytes() == damaged
    finally:
        server.stop()


def test_the_memory_limit_is_a_share_of_the_machine_and_never_evicts(tmp_path: Path) -> None:
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < memory_limit(40) <= machine * 40 // 100
    assert memory_limit(0) == 0
    server = EmbeddedRedis(tmp_path, maxmemory=64 << 20)
    server.start()
    try:
        c = client(server)
        assert c.config_get("maxmemory") == {"maxmemory": str(64 << 20)}
        assert c.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        c.close()
    finally:
        server.stop()


def test_a_stale_pid_file_naming_another_redis_server_is_no_obstacle(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """After a crash and a reboot the pid file's pid may be another redis-server's (the
    distribution's, another gateway's): it does not serve this data directory."""
    assert redis_server.proc is not None
    (tmp_path / "redis.pid").write_text(f"{redis_server.proc.pid}\n")
    server = EmbeddedRedis(tmp_path)
    try:
        server.start(timeout=5)
        assert client(server).ping()
    finally:
        server.stop()
    other = EmbeddedRedis(tmp_path / "busy")
    other.start()
    try:  # one that serves the data directory still keeps a second one out
        with pytest.raises(RedisStartError, match="another gateway uses this data directory"):
            EmbeddedRedis(tmp_path / "busy").start(timeout=1)
    finally:
        other.stop()
