"""Several spool batches in flight on one Redis connection: order, refusals, broken links."""

from __future__ import annotations

import asyncio
import os
from functools import partial
from typing import Any

import hiredis
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from gateway.broker import Broker
from gateway.engine import flows, keys, library, spool
from gateway.engine.flows import Flow, _Fetch
from gateway.engine.ordered_calls import NotSent, OrderedCalls
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message, Outcome
from tests.test_engine import to_queue, wait_for


async def test_replies_come_back_in_order_and_a_refusal_stays_with_its_command(
    redis_url: str,
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    calls = OrderedCalls(client)
    replies: list[Any] = []
    await calls.send(replies.append, "SET", "text", "not a number")
    for _ in range(50):
        await calls.send(replies.append, "INCR", "n")
    await calls.send(replies.append, "INCR", "text")  # refused by Redis
    await calls.send(replies.append, "INCR", "n")
    assert calls.in_flight > 0  # nothing was awaited: the commands are pipelined
    await wait_for(lambda: len(replies) == 53)
    assert replies[1:51] == list(range(1, 51))
    assert isinstance(replies[51], ResponseError)
    assert replies[52] == 51
    await calls.close()
    await client.aclose()


async def test_a_broken_connection_tells_every_command_in_flight_then_reconnects(
    redis_url: str,
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    calls = OrderedCalls(client)
    ids: list[Any] = []
    await calls.send(ids.append, "CLIENT", "ID")
    await wait_for(lambda: ids)
    replies: list[Any] = []
    await calls.send(replies.append, "BLPOP", "never", 10)  # holds the connection
    await calls.send(replies.append, "PING")
    redis.Redis.from_url(redis_url).client_kill_filter(_id=ids[0])
    await wait_for(lambda: len(replies) == 2)
    assert all(isinstance(r, redis.exceptions.ConnectionError) for r in replies)
    assert calls.in_flight == 0
    after: list[Any] = []
    await calls.send(after.append, "PING")
    await wait_for(lambda: after)
    assert after == [b"PONG"]
    await calls.close()
    await client.aclose()


async def test_a_connection_redis_closed_while_idle_is_not_written_to(redis_url: str) -> None:
    """Redis closed the connection while nothing was in flight (a restart): the next command
    was written into it and told the connection broke, "ran or not, unknown", so an AMQP
    publisher's link ended with its transfer in doubt though nothing could have run
    (found by a review). It goes on a new connection."""
    client = aioredis.Redis.from_url(redis_url)
    calls = OrderedCalls(client)
    ids: list[Any] = []
    await calls.send(ids.append, "CLIENT", "ID")
    await wait_for(lambda: ids)
    redis.Redis.from_url(redis_url).client_kill_filter(_id=ids[0])
    await asyncio.sleep(0.1)  # the end reaches the node
    replies: list[Any] = []
    await calls.send(replies.append, "PING")
    await wait_for(lambda: replies)
    assert replies == [b"PONG"]
    await calls.close()
    await client.aclose()


async def test_commands_no_connection_was_made_for_did_not_run(redis_server) -> None:
    """Told NotSent, not a broken connection's "may have run" (a publisher is told its
    message was not stored only then). One waiting for the connection another failed to
    make is told so, and is not written once a connection comes: its reply went to the
    next command."""
    accepted = 0

    async def first_refused(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        if accepted == 1:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", redis_server.port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(first_refused, "127.0.0.1", 0)
    client = aioredis.Redis(port=server.sockets[0].getsockname()[1])
    calls = OrderedCalls(client)
    replies: dict[str, Any] = {}
    await asyncio.gather(
        calls.send(partial(replies.__setitem__, "a"), "ECHO", "a"),
        calls.send(partial(replies.__setitem__, "b"), "ECHO", "b"),
    )
    assert isinstance(replies["a"], NotSent) and isinstance(replies["b"], NotSent)
    await calls.send(partial(replies.__setitem__, "c"), "ECHO", "c")
    await wait_for(lambda: "c" in replies)
    assert replies["c"] == b"c"
    await calls.close()
    await client.aclose()
    server.close()


def test_long_arguments_are_packed_in_place() -> None:
    long, longer = b"a" * library.IN_PLACE_BYTES, b"\r\n" * 3000
    args = ("FCALL", "f", 0, 7, long, b"short", "text", longer, 2.5)
    chunks = library.pack_in_place(args)
    assert b"".join(chunks) == hiredis.pack_command(args)
    assert any(c is long for c in chunks) and any(c is longer for c in chunks)  # not copied
    assert b"".join(library.pack_in_place(("PING",))) == hiredis.pack_command(("PING",))


async def test_a_command_packed_in_place_reaches_redis_whole(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    calls = OrderedCalls(client)
    items = [b"x", os.urandom(5000), b"", os.urandom(library.IN_PLACE_BYTES), b"\r\n"]
    replies: list[Any] = []
    await calls.send(replies.append, "RPUSH", "list", *items, in_place=True)
    await calls.send(replies.append, "LRANGE", "list", 0, -1)
    await wait_for(lambda: len(replies) == 2)
    assert replies == [len(items), items]
    await calls.close()
    await client.aclose()


async def test_batches_of_long_messages_are_stored_whole_and_in_order(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed_in_place: list[int] = []

    def counting(args: tuple) -> list[bytes]:
        packed_in_place.append(len(args))
        return library.pack_in_place(args)

    monkeypatch.setattr("gateway.engine.ordered_calls.pack_in_place", counting)
    await broker.queues.create(QueueConfig(name="q"))
    assert await broker.publish(to_queue("q", b"short")) is Outcome.OK
    assert packed_in_place == []  # short messages: hiredis packs the batch
    one_batch = spool.IN_PLACE_BATCH_BYTES // 4096 + 4
    assert spool.IN_PLACE_BATCH_BYTES <= one_batch * 4096 < spool.MAX_BATCH_BYTES
    payloads = [os.urandom(4096) for _ in range(one_batch)]
    before = broker.spooler.batches
    futures = [broker.publish_nowait(to_queue("q", p)) for p in payloads]
    assert set(await asyncio.gather(*futures)) == {Outcome.OK}
    assert broker.spooler.batches == before + 1 and len(packed_in_place) == 1
    payloads.insert(0, b"short")
    more = [os.urandom(4096) for _ in range(3 * spool.MAX_BATCH_BYTES // 4096)]
    futures = [broker.publish_nowait(to_queue("q", p)) for p in more]
    assert set(await asyncio.gather(*futures)) == {Outcome.OK}
    assert broker.spooler.batches >= before + 4  # split by MAX_BATCH_BYTES
    payloads += more
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=len(payloads))
    await wait_for(lambda: len(got) == len(payloads))
    assert [d.message.payload for d in got] == payloads
    await flow.close()


async def test_a_fanned_out_message_counts_once_per_queue_against_the_batch_size(
    broker: Broker,
) -> None:
    names = [f"q{i}" for i in range(10)]
    for name in names:
        await broker.queues.create(QueueConfig(name=name), [("t", "smf")])
    await broker.router.reload()
    payloads = [os.urandom(4096) for _ in range(8)]  # 32 KiB, stored 10 times: 320 KiB
    assert sum(map(len, payloads)) * len(names) >= 2 * spool.MAX_BATCH_BYTES
    before = broker.spooler.batches
    futures = [broker.publish_nowait(Message(destination="t", payload=p)) for p in payloads]
    assert set(await asyncio.gather(*futures)) == {Outcome.OK}
    assert broker.spooler.batches >= before + 2
    for name in names:
        got: list[Delivery] = []
        flow = await broker.bind(name, got.append, window=10)
        await wait_for(lambda got=got: len(got) == len(payloads))
        assert [d.message.payload for d in got] == payloads
        await flow.close()


async def test_batches_in_flight_keep_one_publishers_order(broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    count = 4 * spool.MAX_BATCH_MESSAGES
    assert await _peak_in_flight(broker, count) > 1
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=count)
    await wait_for(lambda: len(got) == count)
    assert [d.message.payload for d in got] == [b"%d" % i for i in range(count)]
    await flow.close()


async def test_a_lost_spool_connection_acks_only_what_was_stored(
    broker: Broker, redis_url: str
) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    assert await broker.publish(to_queue("q", b"first")) is Outcome.OK  # connects
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("CLIENT", "PAUSE", "5000", "WRITE")  # the batches wait in Redis
    futures = [broker.publish_nowait(to_queue("q", b"%d" % i)) for i in range(3000)]
    for _ in range(3):
        await asyncio.sleep(0)  # the first batches are written
    spool_conn = broker.spooler._calls._conn
    assert spool_conn is not None
    host, port = spool_conn._writer.get_extra_info("sockname")[:2]
    admin.client_kill(f"{host}:{port}")  # with batches in flight, unanswered
    admin.execute_command("CLIENT", "UNPAUSE")
    results = await asyncio.gather(*futures, return_exceptions=True)
    stored = [i for i, r in enumerate(results) if r is Outcome.OK]
    refused = [r for r in results if r is not Outcome.OK]
    assert refused and all(isinstance(r, redis.exceptions.ConnectionError) for r in refused)
    payloads = {
        fields[b"m"] for _, fields in redis.Redis.from_url(redis_url).xrange(keys.queue_stream("q"))
    }
    assert len(payloads) >= len(stored)  # every acked message is in the queue
    assert await broker.publish(to_queue("q", b"after")) is Outcome.OK  # reconnected


async def test_what_a_lost_fetch_answer_took_is_handed_out_first(
    broker: Broker, redis_url: str
) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    for i in range(20):
        assert await broker.publish(to_queue("q", b"%d" % i)) is Outcome.OK
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=0)  # fetches nothing by itself yet
    flow_id = flow.id
    # a fetch that ran in Redis but whose answer never reached the node
    taken = redis.Redis.from_url(redis_url).fcall("gw_fetch", 0, "q", flow_id, 5, "")
    assert taken[0] == b"ok" and len(taken) == 2 + 5 * 4
    broker.dispatcher._fetch_lost(_Fetch(flow, "q", None, 5))
    flow.set_window(100)
    await wait_for(lambda: len(got) == 20)
    assert [d.message.payload for d in got] == [b"%d" % i for i in range(20)]
    assert flow.id == flow_id and not any(d.redelivered for d in got)
    for d in got:
        flow.ack(d.entry_id)
    await wait_for(lambda: not flow.unacked)
    assert await _drained(broker)
    await flow.close()


async def test_a_lost_dispatch_connection_loses_no_delivery(broker: Broker, redis_url: str) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    count = 3000
    outcomes = await asyncio.gather(
        *[broker.publish_nowait(to_queue("q", b"%d" % i)) for i in range(count)]
    )
    assert set(outcomes) == {Outcome.OK}
    seen: set[bytes] = set()
    flows: list[Any] = []

    def on_delivery(d: Delivery) -> None:
        seen.add(d.message.payload)
        flows[0].ack(d.entry_id)

    flows.append(await broker.bind("q", on_delivery, window=300))
    await wait_for(lambda: len(seen) >= 300)
    conn = broker.dispatcher._calls._conn
    assert conn is not None
    host, port = conn._writer.get_extra_info("sockname")[:2]
    redis.Redis.from_url(redis_url).client_kill(f"{host}:{port}")
    await wait_for(lambda: len(seen) == count, timeout=15)
    await wait_for(lambda: not flows[0].unacked)
    assert await _drained(broker)
    await flows[0].close()


async def _drained(broker: Broker) -> bool:
    for _ in range(100):
        if (await broker.queues.info("q")).messages == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def _peak_in_flight(broker: Broker, count: int, queue: str = "q") -> int:
    """Publish `count` messages to `queue` in one turn (several batches); the most batches
    in flight, read as each batch is sent."""
    calls = broker.spooler._calls
    send = calls.send
    peak = 0

    async def send_and_count(*args: Any, **kwargs: Any) -> None:
        nonlocal peak
        await send(*args, **kwargs)
        peak = max(peak, calls.in_flight)

    calls.send = send_and_count  # type: ignore[method-assign]
    try:
        futures = [broker.publish_nowait(to_queue(queue, b"%d" % i)) for i in range(count)]
        assert set(await asyncio.gather(*futures)) == {Outcome.OK}
    finally:
        del calls.send
    return peak


async def test_publishers_go_at_the_pace_of_consumers_that_are_behind(broker: Broker) -> None:
    await broker.queues.create(QueueConfig(name="q"))
    assert await _peak_in_flight(broker, 4 * spool.MAX_BATCH_MESSAGES) > 1  # nobody behind
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=10)
    await wait_for(lambda: len(got) == 10)  # a full fetch: the consumer is behind
    assert broker.dispatcher.behind_on(["q"])
    assert await _peak_in_flight(broker, 4 * spool.MAX_BATCH_MESSAGES) == 1
    # publishers to another queue keep the pipeline (the consumer of "q" stays stalled)
    await broker.queues.create(QueueConfig(name="other"))
    assert not broker.dispatcher.behind_on(["other"])
    assert await _peak_in_flight(broker, 4 * spool.MAX_BATCH_MESSAGES, "other") > 1
    await flow.close()
    assert not broker.dispatcher.behind_on(["q"])


async def test_pacing_looks_only_at_the_queues_of_the_next_batch(broker: Broker) -> None:
    """Long messages end a batch by bytes, well before MAX_BATCH_MESSAGES: a message to a
    queue with a behind consumer that waits past the next batch does not pace it."""
    await broker.queues.create(QueueConfig(name="other"))
    await _behind_consumer(broker)
    per_batch = spool.MAX_BATCH_BYTES // 4096
    assert 3 * per_batch < spool.MAX_BATCH_MESSAGES
    calls = broker.spooler._calls
    send = calls.send
    in_flight: list[int] = []

    async def send_and_count(*args: Any, **kwargs: Any) -> None:
        await send(*args, **kwargs)
        in_flight.append(calls.in_flight)

    calls.send = send_and_count  # type: ignore[method-assign]
    try:
        futures = [
            broker.publish_nowait(to_queue("other", os.urandom(4096))) for _ in range(3 * per_batch)
        ]
        futures.append(broker.publish_nowait(to_queue("q", b"last")))
        assert set(await asyncio.gather(*futures)) == {Outcome.OK}
    finally:
        del calls.send
    assert len(in_flight) == 4  # three batches for "other", then the one for "q"
    assert max(in_flight[:3]) > 1  # not paced: the pipeline fills
    assert in_flight[3] == 1  # paced: it waited until nothing was in flight


async def _behind_consumer(broker: Broker) -> tuple[Flow, list[Delivery]]:
    """A consumer of queue "q" with a window of 10 whose first fetch came back full: 5 more
    messages wait, so it is behind. It settles nothing by itself."""
    await broker.queues.create(QueueConfig(name="q"))
    for i in range(15):
        assert await broker.publish(to_queue("q", b"old %d" % i)) is Outcome.OK
    got: list[Delivery] = []
    flow = await broker.bind("q", got.append, window=10)
    await wait_for(lambda: len(got) == 10)
    assert broker.dispatcher.behind_on(["q"])
    return flow, got


async def test_a_publisher_waits_for_a_draining_consumer_to_catch_up(
    broker: Broker, monkeypatch: Any
) -> None:
    monkeypatch.setattr(spool, "MAX_HOLD", 30.0)  # only catching up ends the wait here
    flow, got = await _behind_consumer(broker)
    flow.ack(got[0].entry_id)  # it is taking messages: draining, not stalled
    new = broker.publish_nowait(to_queue("q", b"new"))
    await asyncio.sleep(0.02)
    assert not new.done()  # held while the backlog drains
    for d in got[1:10]:
        flow.ack(d.entry_id)  # the next fetch takes the other 5: caught up
    assert await asyncio.wait_for(new, 5) is Outcome.OK
    await wait_for(lambda: len(got) == 16)
    assert [d.message.payload for d in got[10:]] == [b"old %d" % i for i in range(10, 15)] + [
        b"new"
    ]
    await flow.close()


async def test_a_stalled_consumer_does_not_hold_publishers(
    broker: Broker, monkeypatch: Any
) -> None:
    monkeypatch.setattr(spool, "MAX_HOLD", 3.0)  # a hold would outlast the wait below
    flow, _ = await _behind_consumer(broker)  # and it never settles: stalled
    await asyncio.sleep(2 * flows.STALLED_AFTER)
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(broker.publish_nowait(to_queue("q", b"new")) for _ in range(3))), 1.5
    )
    assert outcomes == [Outcome.OK] * 3
    await flow.close()


async def test_the_hold_for_a_draining_consumer_is_bounded(
    broker: Broker, monkeypatch: Any
) -> None:
    monkeypatch.setattr(spool, "MAX_HOLD", 0.02)
    await broker.queues.create(QueueConfig(name="q"))
    backlog = 4000
    futures = [broker.publish_nowait(to_queue("q", b"old %d" % i)) for i in range(backlog)]
    assert set(await asyncio.gather(*futures)) == {Outcome.OK}
    got: list[Delivery] = []
    flow: Any = None

    def take(delivery: Delivery) -> None:  # a consumer that keeps up its pace: it drains
        got.append(delivery)
        flow.ack(delivery.entry_id)

    flow = await broker.bind("q", take, window=10)
    await wait_for(lambda: len(got) >= 10)
    assert broker.dispatcher.behind_on(["q"])
    assert await broker.publish(to_queue("q", b"new")) is Outcome.OK
    assert len(got) < backlog  # stored long before the consumer caught up
    await wait_for(lambda: len(got) == backlog + 1, timeout=30)
    assert got[-1].message.payload == b"new"
    await flow.close()
