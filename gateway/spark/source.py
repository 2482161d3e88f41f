"""The `gateway` Python data source: batch and streaming reads of a queue's streams.

Reads go by id range with XRANGE, never through the queue's consumer group, so a Spark job
takes no work from live consumers and sees acked entries the engine keeps for registered
readers. Offsets are per-stream entry ids (``{child queue: "ms-seq"}``, start exclusive,
end inclusive); one Spark input partition reads one stream. Writes go to `sink.py`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import redis
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from gateway.engine import keys
from gateway.engine.queues import stream_queues
from gateway.model import (
    DEAD_LETTER_REASON,
    ORIGIN_QUEUE,
    Message,
    PropertyValue,
    decode,
    property_text,
)
from gateway.spark.sink import BatchWriter, SinkOptions, StreamWriter, refuse_unknown, required

log = logging.getLogger(__name__)

# The header columns after `payload` are the sink's (sink.COLUMN_TYPES): a source's
# DataFrame written to the sink as it is keeps its messages' headers
SCHEMA = (
    "queue string, partition int, entry_id string, ingest_ts timestamp, topic string, "
    "partition_key string, properties map<string,string>, payload binary, "
    "content_type string, correlation_id string, message_id string, priority int, "
    "expiration timestamp, persistent boolean, subject string, reply_to string"
)
_UTC_TIMESTAMP = pa.timestamp("us", tz="UTC")
ARROW_SCHEMA = pa.schema(
    [
        ("queue", pa.string()),
        ("partition", pa.int32()),
        ("entry_id", pa.string()),
        ("ingest_ts", _UTC_TIMESTAMP),
        ("topic", pa.string()),
        ("partition_key", pa.string()),
        ("properties", pa.map_(pa.string(), pa.string())),
        ("payload", pa.binary()),
        ("content_type", pa.string()),
        ("correlation_id", pa.string()),
        ("message_id", pa.string()),
        ("priority", pa.int32()),
        ("expiration", _UTC_TIMESTAMP),
        ("persistent", pa.bool_()),
        ("subject", pa.string()),
        ("reply_to", pa.string()),
    ]
)
SOURCE_OPTIONS = (
    "redis_url",
    "queue",
    "startingOffsets",
    "maxEntriesPerBatch",
    "failOnDataLoss",
    "readerName",
)
PAGE = 5000  # XRANGE COUNT per round trip
ZERO = "0-0"

StreamId = tuple[int, int]


class DataLossError(RuntimeError):
    """Entries a reader still needed were trimmed or deleted from a stream."""


def parse_id(text: str | bytes) -> StreamId:
    """(ms, seq) of a stream id: ids compare as integer pairs, never as strings."""
    if isinstance(text, bytes):
        text = text.decode()
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def format_id(sid: StreamId) -> str:
    return f"{sid[0]}-{sid[1]}"


BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    """A value outside BOOLEANS is refused: taken as false, a misspelt "ture" would turn a
    safety check off without a word."""
    value = options.get(name)
    if value is None:
        return default
    try:
        return BOOLEANS[str(value).strip().lower()]
    except KeyError:
        raise ValueError(f"option {name} must be true or false, not {value!r}") from None


def _positive_int(options: Mapping[str, str], name: str) -> int | None:
    """The option's value, named in the error when it is not a positive integer (int()'s
    own message names only the value)."""
    value = options.get(name)
    if value is None:
        return None
    try:
        number = int(str(value).strip())
    except ValueError:
        number = 0
    if number <= 0:
        raise ValueError(f"option {name} must be a positive integer, not {value!r}")
    return number


@dataclass(frozen=True, slots=True)
class Options:
    """Reader options; plain data so that readers pickle to executors cheaply."""

    redis_url: str
    queue: str
    starting: str
    max_entries: int | None
    fail_on_data_loss: bool
    reader_name: str | None
    # the columns a schema the job gave names, in its order (empty: all of SCHEMA): a job
    # that set the source's schema before it had the header columns still reads
    columns: tuple[str, ...] = ()

    def for_schema(self, schema: StructType) -> Options:
        names = tuple(schema.fieldNames())
        if names == tuple(ARROW_SCHEMA.names):
            return self
        unknown = sorted(set(names) - set(ARROW_SCHEMA.names))
        if unknown:
            raise ValueError(f"the gateway source has no column {', '.join(unknown)}")
        return dataclasses.replace(self, columns=names)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> Options:
        refuse_unknown(options, SOURCE_OPTIONS, "source")
        return cls(
            redis_url=required(options, "redis_url", "source"),
            queue=required(options, "queue", "source"),
            starting=options.get("startingOffsets", "").strip(),
            max_entries=_positive_int(options, "maxEntriesPerBatch"),
            fail_on_data_loss=_bool(options, "failOnDataLoss", True),
            reader_name=options.get("readerName") or None,
        )


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """What XINFO STREAM tells about retention; ids as integer pairs."""

    length: int
    first: StreamId
    last_generated: StreamId
    max_deleted: StreamId
    added: int = 0  # entries ever added

    @classmethod
    def fetch(cls, client: redis.Redis, queue: str) -> StreamInfo:
        try:
            return cls.parse(client.execute_command("XINFO", "STREAM", keys.queue_stream(queue)))
        except redis.ResponseError as exc:
            return cls.parse(exc)

    @classmethod
    def parse(cls, raw: Any) -> StreamInfo:
        """From an XINFO STREAM reply; an error reply is no stream (the queue was deleted):
        nothing to read."""
        if isinstance(raw, redis.ResponseError):
            return cls(0, (0, 0), (0, 0), (0, 0))
        if isinstance(raw, list):
            raw = dict(zip(raw[::2], raw[1::2], strict=False))
        info = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
        first = info.get("first-entry")
        return cls(
            length=int(info["length"]),
            first=parse_id(first[0]) if first else (0, 0),
            last_generated=parse_id(info["last-generated-id"]),
            max_deleted=parse_id(info.get("max-deleted-entry-id", ZERO)),
            added=int(info.get("entries-added", 0)),
        )


# what followed a batch's end when it was planned: the next entry's id, or None when
# there was none yet, with the stream's count of entries ever added then
Following = tuple[StreamId | None, int]


def lost_range(
    client: redis.Redis,
    queue: str,
    start: StreamId,
    baseline: StreamId = (0, 0),
    began: StreamInfo | None = None,
    following: Following | None = None,
) -> str | None:
    """Why entries after `start` are gone, or None when nothing a reader needed was removed.

    XDEL moves `max-deleted-entry-id`; XTRIM only moves the first entry. A trim is loss when
    `start` itself was trimmed (the engine keeps a reader's committed entry) or when the
    stream is empty although entries after `start` were added. `baseline` is the
    `max-deleted-entry-id` when the reader began: holes made before then (say, entries acked
    out of order) were never its to read, so a max-deleted id up to it is no loss.
    A range from the stream's start (0-0) has no entry to hold on to: what the stream was
    when the query began (`began`, None when unknown) tells.
    """
    if start == (0, 0):
        return None if began is None else _lost_since(client, queue, began)
    info = StreamInfo.fetch(client, queue)
    at = format_id(start)
    if info.max_deleted > start and info.max_deleted > baseline:
        deleted = format_id(info.max_deleted)
        return f"entries after {at} were deleted (max-deleted-entry-id {deleted})"
    if info.length == 0:
        if info.last_generated > start:
            return f"stream is empty but entries up to {format_id(info.last_generated)} were added"
        return None
    if (
        info.first > start
        and info.max_deleted < start
        and not client.xrange(keys.queue_stream(queue), at, at)
        and (following is None or _trimmed_after(client, queue, start, info, following))
    ):
        return f"stream was trimmed past {at} (first entry now {format_id(info.first)})"
    return None


def _trimmed_after(
    client: redis.Redis, queue: str, start: StreamId, info: StreamInfo, following: Following
) -> bool:
    """Whether the trim that took `start` (the end of the batch before, already read)
    took entries after it too: consumers that settled just what the query read trim up
    to the entry after it, no loss."""
    after, added = following
    if after is not None:
        return info.first > after
    created = info.added - added  # since it was planned, all after it
    if created <= 0:
        return False
    there = client.xrange(keys.queue_stream(queue), "(" + format_id(start), "+", count=created)
    return len(there) < created


def _lost_since(client: redis.Redis, queue: str, began: StreamInfo) -> str | None:
    """Why entries of a stream read from its start are gone since the query began (it was
    then `began`), or None."""
    info = StreamInfo.fetch(client, queue)
    if info.max_deleted > began.max_deleted:
        deleted = format_id(info.max_deleted)
        return f"entries were deleted after the query began (max-deleted-entry-id {deleted})"
    if began.length and (info.length == 0 or info.first > began.first):
        first = format_id(began.first)
        return f"stream was trimmed past {first}, its first entry when the query began"
    return None


def check_loss(
    client: redis.Redis,
    opts: Options,
    queue: str,
    start: StreamId,
    baseline: StreamId = (0, 0),
    began: StreamInfo | None = None,
    following: Following | None = None,
) -> None:
    """Raise (failOnDataLoss) or warn when the range after `start` lost entries."""
    reason = lost_range(client, queue, start, baseline, began, following)
    if reason is not None:
        report_loss(opts, queue, reason)


def report_loss(opts: Options, queue: str, reason: str) -> None:
    """Raise (failOnDataLoss) or warn."""
    message = f"data loss in queue {opts.queue!r} stream {queue!r}: {reason}"
    if opts.fail_on_data_loss:
        raise DataLossError(f"{message}; set failOnDataLoss=false to skip the missing range")
    log.warning("%s; skipping the missing range", message)


def _text(value: PropertyValue) -> str | None:
    return None if value is None else property_text(value)


def properties(msg: Message) -> dict[str, str | None]:
    """The user properties as strings (of a repeated name, the first: as selectors and
    AMQP consumers read it), and a dead message's origin and reason. Headers have columns
    of their own: in this map, a copy through the sink would make them user properties."""
    out: dict[str, str | None] = {}
    for name, value in msg.user_properties:
        if name not in out:
            out[name] = _text(value)
    for name in (ORIGIN_QUEUE, DEAD_LETTER_REASON):  # the engine's word, not a publisher's
        if name in msg.annotations:
            out[name] = _text(msg.annotations[name])
    return out


def dead_letter_fields(msg: Message, fields: list[bytes]) -> None:
    """A dead message queue's entry keeps where its message came from and why beside it
    (fields 'o' and 'r'): its properties carry them, as a consumer's delivery does."""
    extra = dict(zip(fields[2::2], fields[3::2], strict=False))
    origin, reason = extra.get(b"o"), extra.get(b"r")
    if origin is not None:
        msg.annotations[ORIGIN_QUEUE] = origin.decode()
        msg.annotations[DEAD_LETTER_REASON] = (reason or b"").decode()


def to_batch(parent: str, partition: int | None, queue: str, page: list) -> pa.RecordBatch:
    """One raw XRANGE page as an Arrow batch: Spark takes it without per-row conversion."""
    ids: list[str] = []
    stamps: list[int] = []
    msgs: list[Message] = []
    for entry_id, fields in page:
        try:
            if fields[0] != b"m":
                raise ValueError(f"unexpected field {fields[0]!r}")
            msg = decode(fields[1])
        except (IndexError, ValueError) as exc:
            log.warning("skipping entry %s of %s: %s", entry_id, queue, exc)
            continue
        dead_letter_fields(msg, fields)
        eid = entry_id.decode()
        ids.append(eid)
        stamps.append(int(eid.partition("-")[0]) * 1000)
        msgs.append(msg)
    n = len(ids)
    columns = [
        pa.array([parent] * n, pa.string()),
        pa.array([partition] * n, pa.int32()),
        pa.array(ids, pa.string()),
        pa.array(stamps, pa.timestamp("us", tz="UTC")),
        pa.array([m.destination for m in msgs], pa.string()),
        pa.array([m.partition_key for m in msgs], pa.string()),
        pa.array(
            [list(properties(m).items()) for m in msgs], ARROW_SCHEMA.field("properties").type
        ),
        pa.array([m.payload for m in msgs], pa.binary()),
        pa.array([m.content_type for m in msgs], pa.string()),
        pa.array([_text(m.correlation_id) for m in msgs], pa.string()),
        pa.array([_text(m.message_id) for m in msgs], pa.string()),
        pa.array([m.priority for m in msgs], pa.int32()),
        pa.array(
            [None if m.expiration is None else m.expiration * 1000 for m in msgs], _UTC_TIMESTAMP
        ),
        pa.array([m.persistent for m in msgs], pa.bool_()),
        pa.array([m.subject for m in msgs], pa.string()),
        pa.array([m.reply_to for m in msgs], pa.string()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)


@dataclass(frozen=True, slots=True)
class Planned:
    """A range's stream when its batch was planned: its max-deleted id, and the range's
    first entry then ("" for none). The task that reads the range tells by them what went
    between planning and reading (see read_range)."""

    max_deleted: str
    first: str

    @classmethod
    def now(cls, client: redis.Redis, queue: str, start: str, end: str) -> Planned:
        low = "-" if start == ZERO else "(" + start
        first = client.xrange(keys.queue_stream(queue), low, end, count=1)
        info = StreamInfo.fetch(client, queue)
        return cls(format_id(info.max_deleted), first[0][0].decode() if first else "")


class StreamRange(InputPartition):
    """One stream's id range (start exclusive, end inclusive): one Spark task. `planned`:
    what the range was at planning, where loss is checked (None: it is not)."""

    def __init__(
        self,
        partition: int | None,
        queue: str,
        start: str,
        end: str,
        planned: Planned | None = None,
    ) -> None:
        super().__init__((partition, queue, start, end))
        self.partition = partition
        self.queue = queue
        self.start = start
        self.end = end
        self.planned = planned


def read_range(opts: Options, part: InputPartition) -> Iterator[pa.RecordBatch]:
    """XRANGE the range page by page; runs on an executor with its own client. A plan with
    no range (nothing to read) still runs one task, given a partition of its own: it reads
    nothing."""
    if not isinstance(part, StreamRange):
        return
    client = redis.Redis.from_url(opts.redis_url)
    # raw [id, [field, value]] replies: redis-py's pairs-to-dict costs ~4 µs per entry
    client.set_response_callback("XRANGE", lambda response, **_: response)
    try:
        key = keys.queue_stream(part.queue)
        low = "-" if part.start == ZERO else "(" + part.start
        end = parse_id(part.end)
        watch = None if part.planned is None else _Watch(opts, part)
        while True:
            if watch is None:
                page = client.xrange(key, low, part.end, count=PAGE)
            else:  # the stream right after the page: what went before it was read
                pipe = client.pipeline(transaction=False)
                pipe.xrange(key, low, part.end, count=PAGE)
                pipe.execute_command("XINFO", "STREAM", key)
                page, info = pipe.execute(raise_on_error=False)
                watch.check(page, StreamInfo.parse(info))
            if page:
                batch = to_batch(opts.queue, part.partition, part.queue, page)
                yield batch.select(list(opts.columns)) if opts.columns else batch
            if len(page) < PAGE or parse_id(page[-1][0]) >= end:
                return
            low = "(" + page[-1][0].decode()
    finally:
        client.close()


class _Watch:
    """Entries of a range deleted after its batch was planned, before its task read them:
    no reader holds them (readerName does), so consumers may settle them meanwhile. Each
    page is followed by XINFO: a max-deleted id that moved into the range is lost unless
    the page holds it or the pages before passed it, and a first page that does not start
    with the range's planned first entry means that one was trimmed."""

    def __init__(self, opts: Options, part: StreamRange) -> None:
        assert part.planned is not None
        self.opts, self.part = opts, part
        self.start, self.end = parse_id(part.start), parse_id(part.end)
        self.max_deleted = parse_id(part.planned.max_deleted)
        self.first: str | None = part.planned.first or None  # until the first page is read
        self.read_up_to = self.start

    def check(self, page: list, info: StreamInfo) -> None:
        if self.first is not None:
            got = page[0][0].decode() if page else None
            if got != self.first:
                report_loss(self.opts, self.part.queue, f"entry {self.first} went unread")
            self.first = None
        deleted = info.max_deleted
        if deleted > self.max_deleted:
            self.max_deleted = deleted
            if self.read_up_to < deleted <= self.end:
                at = format_id(deleted).encode()
                if not any(entry[0] == at for entry in page):
                    reason = f"entry {format_id(deleted)} was deleted before it was read"
                    report_loss(self.opts, self.part.queue, reason)
        if page:
            self.read_up_to = parse_id(page[-1][0])


def queue_streams(client: redis.Redis, queue: str) -> list[tuple[int | None, str]]:
    """(partition, child queue) of every stream of `queue`, from its config hash."""
    count, priorities = client.hmget(keys.queue_config(queue), "partition_count", "priorities")
    if count is None and not client.exists(keys.queue_config(queue)):
        raise ValueError(f"queue {queue!r} does not exist")
    return stream_queues(queue, int(count or 0), priorities == b"1")


def refuse_last_value_queue(client: redis.Redis, queue: str) -> None:
    """A last value queue deletes a waiting value when a newer one of its slot comes, read
    or not: it cannot keep entries for a named reader, whose every batch would then fail
    as data loss."""
    lvq_key, spool = client.hmget(keys.queue_config(queue), "lvq_key", "max_spool_bytes")
    if lvq_key or spool == b"0":
        raise ValueError(
            f"queue {queue!r} is a last value queue: it replaces values a reader has not "
            "read, so it cannot keep them for readerName; read it without readerName"
        )


def starting_offsets(client: redis.Redis, opts: Options) -> tuple[dict[str, str], bool]:
    """Start id per stream, and whether they were chosen explicitly (then loss is checked).

    Explicit `startingOffsets` wins, then the committed offsets of `readerName`, then earliest.
    """
    streams = [q for _, q in queue_streams(client, opts.queue)]
    starting = opts.starting.lower()
    if starting == "latest":
        return {q: format_id(StreamInfo.fetch(client, q).last_generated) for q in streams}, False
    if starting.startswith("{"):
        given = json.loads(opts.starting)
        unknown = sorted(set(given) - set(streams))
        if unknown:
            raise ValueError(f"startingOffsets names unknown streams: {', '.join(unknown)}")
        return {q: format_id(parse_id(given.get(q, ZERO))) for q in streams}, True
    if starting not in ("", "earliest"):
        raise ValueError("startingOffsets must be earliest, latest or a JSON object of ids")
    if not starting and opts.reader_name:
        pipe = client.pipeline(transaction=False)
        for q in streams:
            pipe.hget(keys.queue_readers(q), opts.reader_name)
        committed = pipe.execute()
        if any(committed):
            pairs = zip(streams, committed, strict=True)
            return {q: (c.decode() if c else ZERO) for q, c in pairs}, True
    return dict.fromkeys(streams, ZERO), False


def reader_baselines(
    client: redis.Redis, opts: Options, streams: Sequence[str]
) -> dict[str, StreamId]:
    """Each stream's max-deleted id when `readerName` registered where its query began
    (kept in Redis, so restarts know it too). Explicit JSON offsets get none: they stay
    strict."""
    if opts.reader_name is None or opts.starting.startswith("{"):
        return {}
    pipe = client.pipeline(transaction=False)
    for q in streams:
        pipe.hget(keys.queue_reader_baselines(q), opts.reader_name)
    return {q: parse_id(b) for q, b in zip(streams, pipe.execute(), strict=True) if b}


class GatewayDataSource(DataSource):
    """``spark.read.format("gateway")`` / ``writeStream.format("gateway")``."""

    @classmethod
    def name(cls) -> str:
        return "gateway"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return BatchReader(Options.parse(self.options).for_schema(schema))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return StreamReader(Options.parse(self.options).for_schema(schema))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:  # published messages cannot be taken back
            raise ValueError("the gateway sink publishes messages: use mode 'append'")
        return BatchWriter(SinkOptions.parse(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        # complete mode arrives as overwrite: each batch publishes the whole result table
        return StreamWriter(SinkOptions.parse(self.options), schema)


class BatchReader(DataSourceReader):
    """Everything spooled up to planning time, one task per stream."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        client = redis.Redis.from_url(self.opts.redis_url)
        try:
            starts, explicit = starting_offsets(client, self.opts)
            streams = queue_streams(client, self.opts.queue)
            baselines = reader_baselines(client, self.opts, [q for _, q in streams])
            out = []
            for partition, queue in streams:
                start = parse_id(starts[queue])
                end = StreamInfo.fetch(client, queue).last_generated
                if end <= start:
                    continue
                if explicit:
                    check_loss(client, self.opts, queue, start, baselines.get(queue, (0, 0)))
                first, last = format_id(start), format_id(end)
                planned = Planned.now(client, queue, first, last) if explicit else None
                out.append(StreamRange(partition, queue, first, last, planned))
            return out
        finally:
            client.close()

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_range(self.opts, partition)


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches over id ranges; commits record the reader's position for retention."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self._client: redis.Redis | None = None
        self._registered: set[str] = set()  # streams the reader announced itself in
        self._target: dict[str, StreamId] | None = None  # Trigger.AvailableNow end
        # where this query began when it chose its start itself (earliest or latest), with
        # each stream's max-deleted id then: holes made before it began are not its loss
        self._initial: dict[str, str] = {}
        self._baselines: dict[str, StreamId] = {}
        # each stream when the query began or first saw it at 0-0 (a partition added
        # later, one empty when a restarted query began), for ranges from 0-0
        self._began: dict[str, StreamInfo] = {}
        self._start: dict[str, str] | None = None  # initialOffset's first answer
        # (stream, a batch's end) -> what followed it when planned (see lost_range)
        self._following: dict[tuple[str, StreamId], Following] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Executors get the options only; the driver's client stays behind."""
        return {"opts": self.opts}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["opts"])  # type: ignore[misc]

    @property
    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(self.opts.redis_url)
        return self._client

    def initialOffset(self) -> dict:
        """Where the query begins. Chosen here (earliest or latest), the stream as it was
        first (max-deleted ids, first entries) says which holes predate it. Spark asks again
        before it plans the first batch: the first answer stands, or what went in between
        would be no loss, and a start at `latest` would skip what came in between. (A
        restart before the first batch committed asks a new reader: the stream as it is
        then.)"""
        if self._start is not None:
            return self._start
        streams = [q for _, q in queue_streams(self.client, self.opts.queue)]
        began = {q: StreamInfo.fetch(self.client, q) for q in streams}
        offsets, explicit = starting_offsets(self.client, self.opts)
        if not explicit:
            self._initial = offsets
            self._baselines = {q: info.max_deleted for q, info in began.items()}
            self._began = began
        self._start = offsets
        return offsets

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_entries is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.opts.max_entries)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {
            q: StreamInfo.fetch(self.client, q).last_generated
            for _, q in queue_streams(self.client, self.opts.queue)
        }

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        self._register(start)
        ends: dict[str, StreamId] = {}
        added: dict[str, int] = {}
        for _, queue in queue_streams(self.client, self.opts.queue):
            info = StreamInfo.fetch(self.client, queue)
            added[queue] = info.added
            if parse_id(start.get(queue, ZERO)) == (0, 0):
                self._began.setdefault(queue, info)
            if queue not in start:
                self._register({queue: ZERO})
            end = info.last_generated
            if self._target is not None:
                end = min(end, self._target.get(queue, (0, 0)))
            ends[queue] = max(end, parse_id(start.get(queue, ZERO)))
        if isinstance(limit, ReadMaxRows):
            self._cap(start, ends, limit.max_rows)
        self._note_following(start, ends, added)
        return {q: format_id(e) for q, e in ends.items()}

    def _note_following(
        self, start: dict, ends: dict[str, StreamId], added: dict[str, int]
    ) -> None:
        """What follows each end now: the next batch's loss check tells a trim of what
        the query read from one of what it had not (see lost_range). Ends before this
        batch's start are no batch's start any more."""
        pipe = self.client.pipeline(transaction=False)
        for queue, end in ends.items():
            pipe.xrange(keys.queue_stream(queue), "(" + format_id(end), "+", count=1)
        pages = pipe.execute()
        self._following = {
            (queue, end): v
            for (queue, end), v in self._following.items()
            if end >= parse_id(start.get(queue, ZERO))
        }
        for (queue, end), page in zip(ends.items(), pages, strict=True):  # the first seen
            following = (parse_id(page[0][0]) if page else None, added[queue])
            self._following.setdefault((queue, end), following)

    def _cap(self, start: dict, ends: dict[str, StreamId], max_rows: int) -> None:
        """Share `max_rows` among streams with new entries; move their ends back to fit."""
        busy = [q for q, e in ends.items() if e > parse_id(start.get(q, ZERO))]
        for i, queue in enumerate(busy):
            budget = max_rows // len(busy) + (1 if i < max_rows % len(busy) else 0)
            if budget == 0:
                ends[queue] = parse_id(start.get(queue, ZERO))
                continue
            low = start.get(queue, ZERO)
            page = self.client.xrange(
                keys.queue_stream(queue),
                "-" if low == ZERO else "(" + low,
                format_id(ends[queue]),
                count=budget,
            )
            if len(page) == budget:
                ends[queue] = parse_id(page[-1][0])

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        out = []
        streams = dict((q, p) for p, q in queue_streams(self.client, self.opts.queue))
        persisted = reader_baselines(self.client, self.opts, list(streams))
        for queue, last in end.items():
            low = parse_id(start.get(queue, ZERO))
            if parse_id(last) <= low or queue not in streams:
                continue
            baseline = max(self._baselines.get(queue, (0, 0)), persisted.get(queue, (0, 0)))
            began = self._began.get(queue)
            following = self._following.get((queue, low))
            check_loss(self.client, self.opts, queue, low, baseline, began, following)
            first = format_id(low)
            planned = Planned.now(self.client, queue, first, last)
            out.append(StreamRange(streams[queue], queue, first, last, planned))
        return out

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_range(self.opts, partition)

    def _register(self, start: dict) -> None:
        """Announce the reader at its start position in each stream it did not know yet,
        so the engine retains from here (a partition added later: the engine placed it
        there already when it had a place in the queue's other streams).

        Registered where this query began (not from a checkpoint or explicit offsets), the
        engine notes the max-deleted id then too, so that restarts excuse the same old holes.
        """
        if self.opts.reader_name is None:
            return
        if not self._registered:
            refuse_last_value_queue(self.client, self.opts.queue)
        start = {q: sid for q, sid in start.items() if q not in self._registered}
        if not start:
            return
        pipe = self.client.pipeline(transaction=False)
        for queue, sid in start.items():  # a function: it runs while Redis is full
            args = [queue, self.opts.reader_name, sid, 1]
            baseline = self._baselines.get(queue, (0, 0))
            if baseline != (0, 0) and self._initial.get(queue) == sid:
                args.append(format_id(baseline))
            pipe.fcall("gw_reader_at", 0, *args)
        pipe.execute()
        self._registered.update(start)

    def commit(self, end: dict) -> None:
        if self.opts.reader_name is None:
            return
        pipe = self.client.pipeline(transaction=False)
        for queue, sid in end.items():
            pipe.fcall("gw_reader_at", 0, queue, self.opts.reader_name, sid, 0)
        pipe.execute()

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
