"""The `gateway` sink: publishes DataFrame rows as messages through a Broker's spool path.

Going through `Broker.publish_nowait` (not a raw XADD) means quotas, routing and topic
subscriptions apply exactly as for a protocol client. Replays are idempotent: markers in
`keys.sink_marks(sink)`, each kept MARK_TTL_S from when it was written, record each
(batch, Spark partition) once its messages are spooled, and, for batch writes, the
whole batch once the driver commits it; a task that finds either marker publishes
nothing. A streaming micro-batch replays as it ran, so its partition markers hold across
runs, and a partition that failed part-way (a refusal: say,
a full queue) noted which of its messages it spooled (`keys.sink_progress`), so that its
replay spools only the rest. A batch write replayed after it failed part-way may
partition differently, so its partition markers (and the message ids of rows without an
`id` column) belong to one attempt: the replay publishes every row again (duplicates,
never a loss). Message ids go out as the AMQP message-id: a task retried within a write,
and every copy of a row with an `id` column, carry the same one.

Row columns: ``payload`` (binary or string, required); optional ``partition_key``,
``properties`` (map of user properties), ``content_type``, ``correlation_id``, ``id``
(a stable row id; otherwise the id comes from batch, partition and row index),
``priority`` (0-9, clamped as an AMQP priority is), ``expiration`` (a timestamp: the
message expires then), ``persistent``, ``subject`` and ``reply_to``. A column of a type a
message cannot carry (COLUMN_TYPES) is refused when the write is planned; other columns
are not read, so a source's DataFrame (queue, entry_id, ...) can be written as it is: its
header columns are these.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import chain, islice
from typing import Any

import redis
import redis.asyncio as aioredis
from pyspark import TaskContext
from pyspark.sql import Row
from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from gateway.broker import Broker
from gateway.engine import keys, library
from gateway.model import DEFAULT_PRIORITY, MAX_PRIORITY, Message, Outcome

log = logging.getLogger(__name__)

CHUNK = 1000  # publishes in flight per gather: bounds memory, still group-committed
MARK_TTL_S = 7 * 24 * 3600  # replays of batches older than a week are not recognised
OPTIONAL_COLUMNS = (
    "partition_key",
    "properties",
    "content_type",
    "correlation_id",
    "id",
    "message_id",
    "priority",
    "expiration",
    "persistent",
    "subject",
    "reply_to",
)
BATCH_ID_PROPERTY = "streaming.sql.batchId"  # local properties Spark sets per micro-batch
QUERY_ID_PROPERTY = "sql.streaming.queryId"


class SinkRefused(RuntimeError):
    """The gateway refused a message (quota, missing queue, ingress off): fail the task."""


_TEXT = (StringType,)
_INTEGERS = (ByteType, ShortType, IntegerType, LongType)
_VALUES = (
    StringType,
    BinaryType,
    BooleanType,
    ByteType,
    ShortType,
    IntegerType,
    LongType,
    FloatType,
    DoubleType,
)
# column -> (what to say, the Spark types it may have); bytes(5) would be five zero bytes
COLUMN_TYPES: dict[str, tuple[str, tuple[type, ...]]] = {
    "payload": ("binary or string", (BinaryType, StringType)),
    "partition_key": ("a string", _TEXT),
    "content_type": ("a string", _TEXT),
    "correlation_id": ("a string or binary", (StringType, BinaryType)),
    "properties": ("a map of strings to strings, numbers, booleans or binary", (MapType,)),
    "priority": ("an integer", _INTEGERS),
    "expiration": ("a timestamp", (TimestampType, TimestampNTZType)),
    "persistent": ("a boolean", (BooleanType,)),
    "subject": ("a string", _TEXT),
    "reply_to": ("a string", _TEXT),
    "message_id": ("a string", _TEXT),
}


def _is(kind: DataType, wanted: tuple[str, tuple[type, ...]]) -> bool:
    if not isinstance(kind, wanted[1]):
        return False
    if isinstance(kind, MapType):  # user properties: names, and values a message can carry
        return isinstance(kind.keyType, StringType) and isinstance(kind.valueType, _VALUES)
    return True


SINK_OPTIONS = ("redis_url", "topic", "queue", "sinkName", "batchId")
# Spark's own, handed to data sources too (measured: a stream sink gets queryName when the
# query is named, a read of several paths gets paths)
SPARK_OPTIONS = ("path", "paths", "checkpointLocation", "queryName")


def refuse_unknown(options: Mapping[str, str], known: tuple[str, ...], what: str) -> None:
    """A misspelt option (say readerName) would otherwise be ignored without a word.
    Spark hands options over in lower case: they match in any case."""
    allowed = {name.lower() for name in (*known, *SPARK_OPTIONS)}
    unknown = sorted(name for name in options if name.lower() not in allowed)
    if unknown:
        raise ValueError(
            f"the gateway {what} has no option {', '.join(map(repr, unknown))} "
            f"(it takes {', '.join(known)})"
        )


def required(options: Mapping[str, str], name: str, what: str) -> str:
    """The option's value; a missing one is named (a default Redis would be some other
    gateway's, or none)."""
    value = options.get(name)
    if not value:
        raise ValueError(f"the gateway {what} needs option {name!r}")
    return value


@dataclass(frozen=True, slots=True)
class SinkOptions:
    redis_url: str
    destination: str
    to_queue: bool
    sink_name: str
    batch_id: str | None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        refuse_unknown(options, SINK_OPTIONS, "sink")
        topic, queue = options.get("topic"), options.get("queue")
        if bool(topic) == bool(queue):
            raise ValueError("the gateway sink needs exactly one of options 'topic' or 'queue'")
        destination = topic or queue
        assert destination is not None
        return cls(
            redis_url=required(options, "redis_url", "sink"),
            destination=destination,
            to_queue=bool(queue),
            sink_name=options.get("sinkName") or f"{'queue' if queue else 'topic'}:{destination}",
            batch_id=options.get("batchId") or None,
        )


@dataclass(frozen=True, slots=True)
class SinkCommit(WriterCommitMessage):
    marker: str
    published: int
    skipped: bool
    unrouted: int = 0  # published to a topic no queue subscribes to: accepted, not stored


def message_id(sink: str, key: str) -> str:
    """Deterministic id: the same row of the same batch always gets the same id."""
    return hashlib.blake2b(f"{sink}\x00{key}".encode(), digest_size=16).hexdigest()


class RowMapper:
    """Turns rows into Messages using column positions found once from the schema."""

    def __init__(self, opts: SinkOptions, schema: StructType) -> None:
        names = schema.fieldNames()
        if "payload" not in names:
            raise ValueError("the gateway sink needs a 'payload' column (binary or string)")
        for f in schema.fields:  # at planning, not as an executor's error halfway through
            wanted = COLUMN_TYPES.get(f.name)
            if wanted is not None and not _is(f.dataType, wanted):
                raise ValueError(
                    f"the gateway sink's {f.name!r} column must be {wanted[0]}, not "
                    f"{f.dataType.simpleString()} (cast it)"
                )
        self.opts = opts
        self.payload = names.index("payload")
        self.optional = {c: names.index(c) for c in OPTIONAL_COLUMNS if c in names}
        kinds = {f.name: f.dataType for f in schema.fields}
        self.expiration_ntz = isinstance(kinds.get("expiration"), TimestampNTZType)

    def _get(self, row: Row, name: str) -> Any:
        index = self.optional.get(name)
        return None if index is None else row[index]

    def message(self, row: Row, batch: str, index: int) -> Message:
        payload = row[self.payload]
        if isinstance(payload, str):
            payload = payload.encode()
        row_id = self._get(row, "id")
        key = f"id\x00{row_id}" if row_id is not None else f"{batch}\x00{index}"
        return Message(
            destination=self.opts.destination,
            payload=bytes(payload or b""),
            to_queue=self.opts.to_queue,
            partition_key=self._get(row, "partition_key"),
            content_type=self._get(row, "content_type"),
            correlation_id=self._get(row, "correlation_id"),
            user_properties=sorted((self._get(row, "properties") or {}).items()),
            priority=_priority(self._get(row, "priority")),
            expiration=_epoch_ms(self._get(row, "expiration"), self.expiration_ntz),
            persistent=self._get(row, "persistent") is not False,
            subject=self._get(row, "subject"),
            reply_to=self._get(row, "reply_to"),
            id=(stable := message_id(self.opts.sink_name, key)),
            message_id=self._get(row, "message_id") or stable,  # a copied message's own
        )


def _priority(value: int | None) -> int:
    return DEFAULT_PRIORITY if value is None else max(0, min(value, MAX_PRIORITY))


def _epoch_ms(value: datetime | None, ntz: bool) -> int | None:
    """A TimestampType value arrives naive in the worker's local zone (pyspark converts
    the instant so), which datetime.timestamp() reads back as that instant; a
    TimestampNTZType one (`ntz`) names no zone and is taken as UTC."""
    if value is None:
        return None
    if ntz and value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return max(1, round(value.timestamp() * 1000))


@dataclass(slots=True)
class Progress:
    """Which of a partition's messages are spooled: every one below `prefix`, and `extra`
    ones after it (a refusal can fall amid a chunk published at once)."""

    prefix: int = 0
    extra: set[int] = field(default_factory=set)

    @classmethod
    def parse(cls, raw: bytes | None) -> Progress:
        if not raw:
            return cls()
        head, _, tail = raw.decode().partition(":")
        return cls(int(head), {int(i) for i in tail.split(",") if i})

    def __contains__(self, index: int) -> bool:
        return index < self.prefix or index in self.extra

    def add(self, indexes: Iterable[int]) -> None:
        self.extra.update(indexes)
        while self.prefix in self.extra:
            self.extra.discard(self.prefix)
            self.prefix += 1

    def __str__(self) -> str:
        return f"{self.prefix}:{','.join(map(str, sorted(self.extra)))}"


async def publish(
    opts: SinkOptions, batch: str, marker: str, messages: Iterable[Message]
) -> SinkCommit:
    """Spool `messages` through a Broker unless the batch or this partition is done. What
    a failed attempt spooled is noted, chunk by chunk, so that a replay (a streaming
    micro-batch replays its partitions as they ran) spools only the rest; what it stored
    of a chunk it died amid is recorded as each is stored (`keys.sink_stored`, noted
    while its progress is), so the replay stores none of them again."""
    client = await library.connect(opts.redis_url, replace=False)
    sink_name = opts.sink_name
    try:
        if await _written(client, sink_name, [batch, marker]):
            return SinkCommit(marker, 0, True)
        progress = keys.sink_progress(sink_name)
        done = Progress.parse(await client.hget(progress, marker))
        await _start_progress(client.pipeline(transaction=False), sink_name, marker)
        stored = keys.sink_stored(sink_name, marker)
        broker = Broker(client)
        await broker.start()
        published = unrouted = 0
        try:
            it = ((i, m) for i, m in enumerate(messages) if i not in done)
            while chunk := list(islice(it, CHUNK)):
                for i, msg in chunk:
                    msg.exactly_once = (stored, str(i), progress, 0, progress)
                outcomes = await asyncio.gather(
                    *(broker.publish_nowait(m) for _, m in chunk), return_exceptions=True
                )
                spooled = [i for (i, _), o in zip(chunk, outcomes, strict=True) if _spooled(o)]
                published += len(spooled)
                unrouted += sum(o is Outcome.NO_SUBSCRIBERS for o in outcomes)
                done.add(spooled)
                await _note_progress(client.pipeline(), sink_name, marker, done, spooled)
                for (_, msg), outcome in zip(chunk, outcomes, strict=True):
                    if isinstance(outcome, BaseException):
                        raise outcome
                    if not outcome.accepted:
                        raise SinkRefused(
                            f"gateway refused message {msg.id} to {opts.destination!r}: "
                            f"{outcome.name} ({published} of this task's messages were "
                            "spooled; a replay of a streaming micro-batch spools the rest)"
                        )
            pipe = _mark(client.pipeline(transaction=False), sink_name, marker)
            pipe.hdel(progress, marker)
            pipe.zrem(keys.sink_progress_times(sink_name), marker)
            pipe.delete(stored)
            await pipe.execute()
        finally:
            await broker.stop()
        return SinkCommit(marker, published, False, unrouted)
    finally:
        await client.aclose()


async def _written(client: aioredis.Redis, sink: str, markers: list[str]) -> bool:
    """Whether any of `markers` was written within MARK_TTL_S (or before markers were timed,
    in the set that then held them)."""
    pipe = client.pipeline(transaction=False)
    pipe.zmscore(keys.sink_marks(sink), markers)
    pipe.smismember(keys.sink_batches(sink), markers)
    written, legacy = await pipe.execute()
    since = (time.time() - MARK_TTL_S) * 1000
    return any(at is not None and at > since for at in written) or any(legacy)


Pipeline = redis.client.Pipeline | aioredis.client.Pipeline


def _mark(pipe: Pipeline, sink: str, marker: str) -> Pipeline:
    """Queue on `pipe`: note `marker` as written now, forget those older than MARK_TTL_S
    (the markers of a sink that keeps writing do not pile up), the lot gone when idle."""
    now = time.time() * 1000
    marks = keys.sink_marks(sink)
    pipe.zadd(marks, {marker: now})
    pipe.zremrangebyscore(marks, "-inf", now - MARK_TTL_S * 1000)
    pipe.expire(marks, MARK_TTL_S)
    return pipe


async def _start_progress(pipe: aioredis.client.Pipeline, sink: str, marker: str) -> None:
    """Note a partition's progress as none, unless a failed attempt noted some: the spool
    records the rows it stores only while the progress hash exists (SpoolMark), in a set
    made here (a member no row has) so that it goes MARK_TTL_S after its last note too."""
    progress, times = keys.sink_progress(sink), keys.sink_progress_times(sink)
    stored = keys.sink_stored(sink, marker)
    pipe.hsetnx(progress, marker, str(Progress()))
    pipe.zadd(times, {marker: time.time() * 1000}, nx=True)
    pipe.sadd(stored, "")
    for key in (progress, times, stored):
        pipe.expire(key, MARK_TTL_S)
    await pipe.execute()


async def _note_progress(
    pipe: aioredis.client.Pipeline,
    sink: str,
    marker: str,
    done: Progress,
    spooled: list[int] | None = None,
) -> None:
    """Note what a partition spooled so far, the records of the rows `spooled` now adds
    going in the same step (those of rows whose outcome was lost stay: they may be
    stored); what partitions noted over MARK_TTL_S ago (an attempt never replayed under
    its marker) goes, and the lot when the sink is idle."""
    now = time.time() * 1000
    progress, times = keys.sink_progress(sink), keys.sink_progress_times(sink)
    pipe.hset(progress, marker, str(done))
    stored = keys.sink_stored(sink, marker)
    if spooled:
        pipe.srem(stored, *map(str, spooled))
    pipe.expire(stored, MARK_TTL_S)
    pipe.zadd(times, {marker: now})
    pipe.zrangebyscore(times, "-inf", now - MARK_TTL_S * 1000)
    *_, stale = await pipe.execute()
    if stale:
        pipe.hdel(progress, *stale)
        pipe.zrem(times, *stale)
        pipe.delete(*(keys.sink_stored(sink, m.decode()) for m in stale))
    pipe.expire(progress, MARK_TTL_S)
    pipe.expire(times, MARK_TTL_S)
    await pipe.execute()


def _spooled(outcome: Outcome | BaseException) -> bool:
    return isinstance(outcome, Outcome) and outcome.accepted


def write_partition(
    opts: SinkOptions, mapper: RowMapper, batch: str, attempt: str, rows: Iterator[Row]
) -> SinkCommit:
    """Runs on an executor: one event loop, one client and one Broker per task. `attempt`
    names what the partition markers hold for (see the module docstring)."""
    ctx = TaskContext.get()
    partition = ctx.partitionId() if ctx is not None else 0
    marker = f"{attempt}:{partition}"
    rows = iter(rows)
    first = next(rows, None)
    if first is None:  # stateful queries run many empty tasks: no client, no Broker
        return SinkCommit(marker, 0, False)
    messages = (mapper.message(row, marker, i) for i, row in enumerate(chain([first], rows)))
    return asyncio.run(publish(opts, batch, marker, messages))


def _report(opts: SinkOptions, messages: list[WriterCommitMessage | None], batch: str) -> None:
    done = [m for m in messages if isinstance(m, SinkCommit)]
    log.info(
        "sink %s batch %s: %d messages published (%d matched no subscription, so none was "
        "stored), %d partitions skipped as replays",
        opts.sink_name,
        batch,
        sum(m.published for m in done),
        sum(m.unrouted for m in done),
        sum(m.skipped for m in done),
    )


class BatchWriter(DataSourceWriter):
    """`df.write.format("gateway")`: one batch id per write (option `batchId` to replay)."""

    def __init__(self, opts: SinkOptions, schema: StructType) -> None:
        self.opts = opts
        self.mapper = RowMapper(opts, schema)
        self.batch = opts.batch_id or uuid.uuid4().hex
        self.attempt = f"{self.batch}/{uuid.uuid4().hex}"  # this write, not a replay of it

    def write(self, iterator: Iterator[Row]) -> SinkCommit:
        return write_partition(self.opts, self.mapper, self.batch, self.attempt, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        client = redis.Redis.from_url(self.opts.redis_url)
        try:
            _mark(client.pipeline(transaction=False), self.opts.sink_name, self.batch).execute()
        finally:
            client.close()
        _report(self.opts, messages, self.batch)


class StreamWriter(DataSourceStreamWriter):
    """`writeStream.format("gateway")`: batch id = query id + micro-batch id (replay-stable)."""

    def __init__(self, opts: SinkOptions, schema: StructType) -> None:
        self.opts = opts
        self.mapper = RowMapper(opts, schema)

    def write(self, iterator: Iterator[Row]) -> SinkCommit:
        ctx = TaskContext.get()
        if ctx is None or ctx.getLocalProperty(BATCH_ID_PROPERTY) is None:
            raise RuntimeError("the gateway stream sink runs only inside a streaming query")
        batch = (
            f"{ctx.getLocalProperty(QUERY_ID_PROPERTY)}/{ctx.getLocalProperty(BATCH_ID_PROPERTY)}"
        )
        return write_partition(self.opts, self.mapper, batch, batch, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _report(self.opts, messages, str(batchId))
