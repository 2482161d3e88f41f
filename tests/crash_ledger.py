"""Redis-level accounting of a queue and its dead message queue after a crash.

Reads the streams, pending lists and stats hashes directly, in one transaction (key names
from gateway/engine/keys.py), and checks them against the clients' ledger: every message the
gateway confirmed is in exactly one place (the queue, the dead message queue, accepted by
the consumer, or counted as dropped / discarded), nothing is in two places, and the stats
counters agree with the streams' real contents.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import redis

from gateway.engine import keys
from gateway.model import decode
from tests.crash_clients import Ledger, seq_of

MAX_PENDING = 1_000_000  # far above what a test leaves pending


@dataclass
class StreamState:
    """One queue's stream as Redis holds it."""

    seqs: Counter[int]  # sequence number -> entries carrying it
    blob_bytes: int
    pending: list[bytes]  # entry ids in the consumer group's pending list
    entry_ids: set[bytes]
    fields: list[dict[bytes, bytes]]
    stats: dict[str, int]


def snapshot(r: redis.Redis, queues: list[str]) -> dict[str, StreamState]:
    """The queues' streams, pending lists and stats in one MULTI/EXEC: a consistent view
    even while a surviving gateway keeps working."""
    pipe = r.pipeline(transaction=True)
    for q in queues:
        pipe.xrange(keys.queue_stream(q))
        pipe.xpending_range(keys.queue_stream(q), keys.GROUP, "-", "+", MAX_PENDING)
        pipe.hgetall(keys.queue_stats(q))
    replies = pipe.execute()
    out = {}
    for i, q in enumerate(queues):
        entries, pending, raw = replies[3 * i : 3 * i + 3]
        seqs: Counter[int] = Counter()
        for _, f in entries:
            seqs[seq_of(decode(f[b"m"]).payload)] += 1
        out[q] = StreamState(
            seqs,
            sum(len(f[b"m"]) for _, f in entries),
            [p["message_id"] for p in pending],
            {entry_id for entry_id, _ in entries},
            [f for _, f in entries],
            {k.decode(): int(v) for k, v in raw.items() if v.lstrip(b"-").isdigit()},
        )
    return out


def check_stream(state: StreamState, queue: str) -> list[str]:
    """The stats hash agrees with the stream; no entry is pending without existing."""
    errors = []
    total = sum(state.seqs.values())
    if state.stats.get("msgs", 0) != total:
        errors.append(f"{queue}: stats msgs {state.stats.get('msgs')} but {total} entries")
    if state.stats.get("bytes", 0) != state.blob_bytes:
        errors.append(f"{queue}: stats bytes {state.stats.get('bytes')} but {state.blob_bytes}")
    dangling = [p for p in state.pending if p not in state.entry_ids]
    if dangling:
        errors.append(f"{queue}: {len(dangling)} pending entries not in the stream")
    dupes = sorted(seq for seq, n in state.seqs.items() if n > 1)
    if dupes:
        errors.append(f"{queue}: {len(dupes)} messages stored twice, e.g. {dupes[:5]}")
    return errors


def account(
    r: redis.Redis,
    queue: str,
    dmq: str,
    ledger: Ledger,
    reasons: set[str],
    *,
    refusals_final: bool = True,
) -> list[str]:
    """Check the queue and its DMQ against the ledger (see the module docstring); returns
    every way the invariant fails (none: it holds).

    `reasons`: the dead-letter reasons the scenario may produce. `refusals_final`: false
    when Redis itself crashed, since a spool whose reply was lost is refused yet stored.
    """
    # confirmations come after the store, the rest before it: read them on either side
    with ledger.lock:
        confirmed = set(ledger.confirmed)
    states = snapshot(r, [queue, dmq])
    q, d = states[queue], states[dmq]
    with ledger.lock:
        sent, refused, accepted = set(ledger.sent), set(ledger.refused), set(ledger.accepted)
    errors = check_stream(q, queue) + check_stream(d, dmq)
    both = sorted(set(q.seqs) & set(d.seqs))
    if both:
        errors.append(f"{len(both)} messages both in {queue} and in {dmq}, e.g. {both[:5]}")
    for f in d.fields:
        if f.get(b"o") != queue.encode() or f.get(b"r", b"").decode() not in reasons:
            errors.append(f"{dmq} entry with origin {f.get(b'o')!r} reason {f.get(b'r')!r}")
            break
    found = set(q.seqs) | set(d.seqs)
    if found - sent:
        errors.append(f"{len(found - sent)} stored messages were never sent")
    if refusals_final and found & refused:
        errors.append(f"{len(found & refused)} refused messages were stored")
    st = q.stats
    spooled, acked = st.get("spooled", 0), st.get("acked", 0)
    dropped, discarded = st.get("dropped", 0), st.get("discarded", 0)
    dead_lettered = st.get("dead_lettered", 0)
    # counters: every spooled message is queued, acked, dead-lettered, discarded or dropped
    gone = acked + dead_lettered + discarded + dropped
    if spooled != sum(q.seqs.values()) + gone:
        errors.append(
            f"{queue}: spooled {spooled} != queued {sum(q.seqs.values())} + acked {acked}"
            f" + dead-lettered {dead_lettered} + discarded {discarded} + dropped {dropped}"
        )
    if not len(confirmed) <= spooled <= len(sent):
        errors.append(f"{queue}: spooled {spooled} outside [{len(confirmed)}, {len(sent)}]")
    if dead_lettered != d.stats.get("spooled", 0) or d.stats.get("acked", 0):
        errors.append(f"{queue}: dead-lettered {dead_lettered} but {dmq} got {d.stats}")
    if acked > len(accepted):
        errors.append(f"{queue}: {acked} acked but the consumer accepted {len(accepted)}")
    # a confirmed message the consumer never accepted may only be gone if counted gone
    missing = confirmed - accepted - found
    if len(missing) > dropped + discarded:
        errors.append(
            f"{len(missing)} confirmed messages vanished (dropped {dropped},"
            f" discarded {discarded}), e.g. {sorted(missing)[:5]}"
        )
    return errors
