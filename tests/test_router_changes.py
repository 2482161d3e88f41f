"""A node's routing trie follows subscription changes by loading only the queues changed
since the version it loaded, and every route when those changes are no longer kept or
Redis holds an older version. Real Redis (its command counters), a real node."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.broker import Broker, QueueConfig
from gateway.engine import keys
from gateway.model import Message, Outcome
from gateway.router import Router
from tests.conftest import RedisServer, running_node


async def set_reads(redis: aioredis.Redis) -> int:
    """SMEMBERS calls so far: a load reads each queue's subscriptions with one."""
    return (await redis.info("commandstats")).get("cmdstat_smembers", {}).get("calls", 0)


async def test_a_subscription_change_reads_only_the_queue_changed(broker: Broker) -> None:
    """2,000 device queues with a subscription each: one more subscription had every node
    read all 2,000 again (16,000: Redis held 190 ms, the SUBACK 300 ms) and rebuild its
    trie; now the node reads that queue's routes."""
    for i in range(2000):
        await broker.declare_queue(QueueConfig(name=f"device{i}"), [(f"devices/{i}/cmd", "smf")])
    before = await set_reads(broker.redis)
    await broker.subscribe_queue("device7", ["devices/all/cmd"])
    assert await set_reads(broker.redis) - before < 20
    assert broker.router.match("devices/all/cmd") == {"device7"}
    assert broker.router.match("devices/1999/cmd") == {"device1999"}


async def test_a_router_follows_each_kind_of_change(broker: Broker) -> None:
    """Another node's view (a Router of its own) after subscriptions added and removed, a
    queue deleted and one made again under its name, and a key property gone."""
    other = Router(broker.redis)
    await broker.declare_queue(QueueConfig(name="a"), [("t/a", "smf")])
    await broker.declare_queue(QueueConfig(name="lvq", lvq_key="sensor"), [("t/>", "smf")])
    await other.reload()
    assert other.match("t/a") == {"a", "lvq"} and other.keyed_properties == {"sensor"}
    made = other.created["a"]

    await broker.subscribe_queue("a", ["t/b"])
    await broker.unsubscribe_queue("a", ["t/a"])
    await broker.delete_queue("lvq")
    await other.reload()
    assert other.match("t/a") == frozenset() and other.match("t/b") == {"a"}
    assert other.keyed_properties == frozenset() and "lvq" not in other.created

    routed_by = other.created
    await broker.delete_queue("a")
    await broker.declare_queue(QueueConfig(name="a"), [("t/c", "smf")])
    await other.reload()
    assert other.match("t/b") == frozenset() and other.match("t/c") == {"a"}
    assert other.created["a"] != made
    assert routed_by["a"] == made  # what messages routed before hold is left as it was
    assert other.version == broker.router.version
    assert sorted(other.subscriptions()) == sorted(broker.router.subscriptions())


async def test_a_router_too_far_behind_loads_every_route(broker: Broker) -> None:
    other = Router(broker.redis)
    await broker.declare_queue(QueueConfig(name="a"), [("t/a", "smf")])
    await other.reload()
    await broker.subscribe_queue("a", ["t/b"])
    await broker.declare_queue(QueueConfig(name="b"), [("t/b", "smf")])
    # the changes since its version were dropped (more than 10,000 queues changed since)
    state = keys.route_changes_state
    await broker.redis.hset(state, "floor", broker.router.version)
    before = await set_reads(broker.redis)
    await other.reload()
    assert await set_reads(broker.redis) - before == 3  # the queue list, both queues
    assert other.match("t/b") == {"a", "b"} and other.match("t/a") == {"a"}


async def test_a_router_ahead_of_redis_loads_every_route(broker: Broker) -> None:
    """Redis came back with an older version than the one loaded (without its data, or
    from an older copy): what it holds now is read whole."""
    other = Router(broker.redis)
    await broker.declare_queue(QueueConfig(name="a"), [("t/a", "smf")])
    await other.reload()
    await broker.redis.flushall()
    await broker.declare_queue(QueueConfig(name="b"), [("t/b", "smf")])
    assert broker.router.version <= other.version  # as many changes since as before
    await other.reload()
    assert other.match("t/a") == frozenset() and other.match("t/b") == {"b"}


async def test_a_node_follows_a_redis_restarted_from_an_older_copy(tmp_path: Path) -> None:
    """Redis restarted from an older copy of its data (a backup, an AOF that lost its last
    second) holds other routes under the versions the node loaded: losing its event
    channel, the node reads every route next, so a subscription made right after is routed
    by and one the copy lacks is not."""
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        async with running_node(server.url) as node:
            await node.declare_queue(QueueConfig(name="a"), [("t/a", "smf")])
            server.stop()  # a clean stop: the copy holds every write
            shutil.copytree(server.workdir, tmp_path / "copy")
            server.start()
            await asyncio.sleep(1.5)  # the node is back on its event channel
            await retried(node.subscribe_queue, "a", ["t/lost"])
            server.stop()
            shutil.rmtree(server.workdir)
            shutil.copytree(tmp_path / "copy", server.workdir)
            server.start()  # back from the older copy
            await retried(node.subscribe_queue, "a", ["t/new"])
            await node.declare_queue(QueueConfig(name="d"), [("t/d", "smf")])
            await asyncio.sleep(2)  # its event channel is back: it read the routes again
            new = await node.publish(Message(destination="t/new", payload=b"x"))
            lost = await node.publish(Message(destination="t/lost", payload=b"y"))
            assert (new, lost) == (Outcome.OK, Outcome.NO_SUBSCRIBERS)
    finally:
        server.stop()


async def retried(call: Callable[..., Awaitable[object]], *args: object) -> object:
    """A call tried again while the client's pooled connections find Redis restarted."""
    for _ in range(20):
        try:
            return await call(*args)
        except RedisError:
            await asyncio.sleep(0.05)
    return await call(*args)


async def test_a_load_in_flight_when_the_router_is_forgotten_is_not_trusted(
    broker: Broker,
) -> None:
    """The event channel was lost while a load's reply was on its way (maybe from the Redis
    that went): the next load reads every route still."""
    router = Router(broker.redis)
    await router.reload()
    await broker.declare_queue(QueueConfig(name="a"), [("t/a", "smf")])
    loading = asyncio.create_task(router.reload())
    await asyncio.sleep(0)  # its call is sent
    router.forget()
    await loading
    assert router.generation == ""
    before = await set_reads(broker.redis)
    await router.reload(router.version + 1)
    assert await set_reads(broker.redis) - before == 2  # the queue list, queue a
