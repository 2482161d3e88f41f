"""Partitioned queues: key hashing and the partition map as nodes see it.

`partition = xxh3_64(partition_key) % partition_count`; a message without a key goes to a
random partition. Python hashes, the spool function (which knows the partition count)
takes the modulus. Assignment, rebalance and handoff run in Redis (`rebalance` in
functions.lua), so flows on several nodes agree on one owner per partition.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import xxhash

_random = random.Random()


def key_hash(partition_key: str | None) -> tuple[int, int]:
    """High and low 32 bits of xxh3_64(key) (Lua numbers are doubles: 64 bits would not fit
    exactly); a random value for a message without a key."""
    if partition_key is None:
        return 0, _random.getrandbits(31)
    h = xxhash.xxh3_64_intdigest(partition_key.encode())
    return h >> 32, h & 0xFFFFFFFF


def partition_of(partition_key: str, partition_count: int) -> int:
    """The partition a key lands in (what the spool function computes)."""
    return xxhash.xxh3_64_intdigest(partition_key.encode()) % partition_count


@dataclass(slots=True)
class PartitionMap:
    """A partitioned queue's assignment as read from Redis (`gw_partitions`)."""

    owners: list[str]  # per partition: the flow dispatching it, "" while unowned / handing off
    fences: list[str]
    targets: list[str]  # per partition: the flow it is assigned to
    holders: list[str]  # per partition: the flow still holding its unacked messages
    flows: list[str]  # every flow bound to the parent, in bind order

    @classmethod
    def from_reply(cls, reply: list) -> PartitionMap:
        n = int(reply[0])
        cells = [c.decode() if isinstance(c, bytes) else str(c) for c in reply[1 : 1 + 4 * n]]
        rest = reply[1 + 4 * n :]
        return cls(
            owners=cells[0::4],
            fences=cells[1::4],
            targets=cells[2::4],
            holders=cells[3::4],
            flows=[f.decode() for f in rest],
        )

    def owned_by(self, flow_id: str) -> dict[int, str]:
        """Partition index -> fence for the partitions `flow_id` may dispatch now."""
        return {i: self.fences[i] for i, o in enumerate(self.owners) if o == flow_id}


def split_window(space: int, parts: int) -> list[int]:
    """Share a flow's free window among its partitions (never more than `space` in all)."""
    base, extra = divmod(space, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
