"""Admin API authentication and per-user permissions, over real HTTP against a real Redis."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import http.client
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from gateway.admin.api import AdminApi
from gateway.admin.auth import AdminAuth, is_loopback
from gateway.admin.http import HttpError, HttpServer
from gateway.broker import Broker
from gateway.config import ConfigError, User, load_settings
from gateway.engine.queues import QueueConfig

USERS = [User("root", "root-pw", admin=True), User("alice", "a-pw"), User("bob", "b-pw")]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: Any


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


class Client:
    """One caller: http.client in a thread, so the server on this loop keeps running."""

    def __init__(self, port: int, authorization: str | None) -> None:
        self.port = port
        self.authorization = authorization

    def _call(self, method: str, path: str, body: Any) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        headers = {"Authorization": self.authorization} if self.authorization else {}
        data = None if body is None else json.dumps(body).encode()
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            ctype = resp.getheader("Content-Type", "")
            parsed = json.loads(raw) if raw and ctype == "application/json" else raw
            return Reply(resp.status, dict(resp.getheaders()), parsed)
        finally:
            conn.close()

    async def call(self, method: str, path: str, body: Any = None) -> Reply:
        return await asyncio.to_thread(self._call, method, path, body)


def q(name: str, *rest: str) -> str:
    return "/".join(["/api/v1/queues", quote(name, safe=""), *rest])


def refused(reply: Reply, status: int = 403) -> None:
    assert reply.status == status, reply
    assert reply.body["status"] == status and reply.body["error"], reply


@pytest.fixture
async def port(broker: Broker) -> AsyncIterator[int]:
    server = HttpServer(AdminApi(broker, USERS))
    try:
        yield await server.start("127.0.0.1", 0)
    finally:
        await server.close()


# -- authentication -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        basic("alice", "wrong"),
        basic("mallory", "a-pw"),
        basic("alice", ""),
        "Bearer a-pw",
        "Basic not-base64!",
        "Basic " + base64.b64encode(b"alice").decode(),  # no colon
    ],
    ids=["none", "bad-password", "unknown-user", "empty-password", "bearer", "garbage", "no-colon"],
)
async def test_missing_or_bad_credentials_get_401_with_a_challenge(
    port: int, authorization: str | None
) -> None:
    for method, path in (("GET", "/api/v1/queues"), ("GET", "/metrics"), ("DELETE", q("x"))):
        reply = await Client(port, authorization).call(method, path)
        refused(reply, 401)
        assert reply.headers["WWW-Authenticate"] == 'Basic realm="gateway"'


async def test_health_probe_needs_no_credentials(port: int) -> None:
    reply = await Client(port, None).call("GET", "/api/v1/health")
    assert reply.status == 200 and reply.body["status"] == "ok"


async def test_any_user_may_list_show_and_scrape(port: int) -> None:
    root = Client(port, basic("root", "root-pw"))
    assert (await root.call("POST", "/api/v1/queues", {"name": "shown"})).status == 201
    bob = Client(port, basic("bob", "b-pw"))
    assert [x["name"] for x in (await bob.call("GET", "/api/v1/queues")).body] == ["shown"]
    assert (await bob.call("GET", q("shown"))).body["name"] == "shown"
    metrics = await bob.call("GET", "/metrics")
    assert metrics.status == 200 and b"gateway_" in metrics.body


async def test_a_users_pages_of_the_queue_list_hold_and_name_only_what_it_sees(
    port: int,
) -> None:
    """Pages are filled with the queues the user may browse; their Link names the last of
    those (a hidden name told its owner's client id), and no link follows a page when only
    hidden queues are left."""
    alice = Client(port, basic("alice", "a-pw"))
    bob = Client(port, basic("bob", "b-pw"))
    hidden = {"k2", "k3", "k6"}
    for name in ("k1", "k2", "k3", "k4", "k5", "k6"):
        body = {"name": name, "permission": "none" if name in hidden else "read-only"}
        assert (await alice.call("POST", "/api/v1/queues", body)).status == 201
    first = await bob.call("GET", "/api/v1/queues?limit=2")
    assert [x["name"] for x in first.body] == ["k1", "k4"]
    assert first.headers["Link"] == '</api/v1/queues?limit=2&after=k4>; rel="next"'
    second = await bob.call("GET", "/api/v1/queues?limit=2&after=k4")
    assert [x["name"] for x in second.body] == ["k5"] and "Link" not in second.headers
    mine = await alice.call("GET", "/api/v1/queues?limit=5")
    assert [x["name"] for x in mine.body] == ["k1", "k2", "k3", "k4", "k5"]
    assert mine.headers["Link"] == '</api/v1/queues?limit=5&after=k5>; rel="next"'


async def test_a_users_page_reads_the_queues_it_may_not_see_a_batch_a_round_trip(
    port: int, broker: Broker
) -> None:
    """A user's page among 1,000 priority queues it may not see read each one's whole info,
    one round trip a queue (its levels' counters), to drop it. (The pipelines the page
    makes are counted as they go to Redis.)"""
    private = QueueConfig("a", owner="alice", permission="none", priorities=True)
    hidden = [dataclasses.replace(private, name=f"a{i:04d}") for i in range(1000)]
    for start in range(0, len(hidden), 200):
        await asyncio.gather(*(broker.queues.create(c) for c in hidden[start : start + 200]))
    await broker.queues.create(QueueConfig("zz", owner="alice", permission="read-only"))
    pipelines = 0
    pipeline = broker.redis.pipeline

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal pipelines
        pipelines += 1
        return pipeline(*args, **kwargs)

    broker.redis.pipeline = counted  # type: ignore[method-assign]
    try:
        page = await Client(port, basic("bob", "b-pw")).call("GET", "/api/v1/queues?limit=1")
    finally:
        broker.redis.pipeline = pipeline  # type: ignore[method-assign]
    assert [x["name"] for x in page.body] == ["zz"] and "Link" not in page.headers
    assert pipelines <= 4, pipelines  # the configs, 500 a trip, then the info of one


async def test_admin_user_is_the_operator(port: int) -> None:
    root = Client(port, basic("root", "root-pw"))
    alice = Client(port, basic("alice", "a-pw"))
    reply = await alice.call("POST", "/api/v1/queues", {"name": "hers", "permission": "none"})
    assert reply.status == 201
    # the operator is not bound by alice's ownership or the queue's permission
    assert (await root.call("PATCH", q("hers"), {"max_messages": 7})).status == 200
    assert (await root.call("POST", q("hers", "subscriptions"), {"pattern": "a/>"})).status == 200
    assert (
        await root.call("POST", "/api/v1/messages", {"topic": "a/b", "payload": "x"})
    ).status == 200
    got = await root.call("POST", q("hers", "get"), {"count": 1, "timeout_ms": 2000})
    assert [m["payload"] for m in got.body] == ["x"]
    assert (await root.call("DELETE", q("hers", "readers", "spark"))).status == 404  # no reader
    assert (await root.call("PATCH", q("hers"), {"owner": "bob"})).body["owner"] == "bob"
    assert (await root.call("DELETE", q("hers"))).status == 204


# -- users act as themselves ----------------------------------------------------------------


async def test_a_user_owns_the_queue_it_declares_and_alone_may_change_it(port: int) -> None:
    alice = Client(port, basic("alice", "a-pw"))
    bob = Client(port, basic("bob", "b-pw"))
    reply = await alice.call("POST", "/api/v1/queues", {"name": "mine", "owner": "bob"})
    assert reply.status == 201 and reply.body["owner"] == "alice"
    assert (await alice.call("PATCH", q("mine"), {"max_messages": 3})).status == 200
    refused(await alice.call("PATCH", q("mine"), {"owner": "bob"}))  # no giving it away
    refused(await bob.call("PATCH", q("mine"), {"max_messages": 9}))  # permission is delete
    config = (await bob.call("GET", q("mine"))).body
    assert (config["owner"], config["max_messages"]) == ("alice", 3)
    refused(await alice.call("DELETE", q("mine", "readers", "spark")))  # operator only


async def test_only_the_operator_declares_the_dead_message_queue(port: int) -> None:
    """#DEAD_MSG_QUEUE is every queue's default dead message queue (a system endpoint on
    Solace): a user who declared it would own other users' dead messages."""
    root = Client(port, basic("root", "root-pw"))
    alice = Client(port, basic("alice", "a-pw"))
    body = {"name": "#DEAD_MSG_QUEUE", "permission": "none"}
    refused(await alice.call("POST", "/api/v1/queues", body))
    assert (await root.call("GET", q("#DEAD_MSG_QUEUE"))).status == 404
    reply = await root.call("POST", "/api/v1/queues", {"name": "#DEAD_MSG_QUEUE"})
    assert reply.status == 201 and reply.body["owner"] is None


async def test_permission_levels_gate_other_users(port: int) -> None:
    alice = Client(port, basic("alice", "a-pw"))
    bob = Client(port, basic("bob", "b-pw"))
    body = {"name": "gated", "permission": "none", "subscriptions": ["g/>"]}
    assert (await alice.call("POST", "/api/v1/queues", body)).status == 201
    assert (await bob.call("POST", q("gated", "messages"), {"payload": "m1"})).status == 200

    browse = {"count": 1, "browse": True, "timeout_ms": 2000}
    take = {"count": 1, "timeout_ms": 2000}
    sub = {"pattern": "h/>"}

    async def bob_may() -> dict[str, bool]:
        return {
            "browse": (await bob.call("POST", q("gated", "get"), browse)).status == 200,
            "consume": (
                await bob.call("POST", q("gated", "get"), {**take, "ackmode": "requeue"})
            ).status
            == 200,
            "subscribe": (await bob.call("POST", q("gated", "subscriptions"), sub)).status == 200,
            "unsubscribe": (
                await bob.call("DELETE", q("gated", "subscriptions") + "?pattern=g/%3E")
            ).status
            == 200,
        }

    expected = {
        "none": {"browse": False, "consume": False, "subscribe": False, "unsubscribe": False},
        "read-only": {"browse": True, "consume": False, "subscribe": False, "unsubscribe": False},
        "consume": {"browse": True, "consume": True, "subscribe": False, "unsubscribe": False},
        "modify-topic": {"browse": True, "consume": True, "subscribe": True, "unsubscribe": True},
    }
    for level, may in expected.items():
        assert (await alice.call("PATCH", q("gated"), {"permission": level})).status == 200
        assert await bob_may() == may, level
        hidden = 404 if not may["browse"] else 403  # as if none were there: its name untold
        refused(await bob.call("DELETE", q("gated")), hidden)
        if not may["browse"]:
            refused(await bob.call("POST", q("gated", "get"), browse), 404)
    assert (await alice.call("GET", q("gated"))).body["messages"] == 1  # nothing was taken
    assert (await alice.call("PATCH", q("gated"), {"permission": "delete"})).status == 200
    assert (await bob.call("DELETE", q("gated"))).status == 204


async def test_redeclaring_with_subscriptions_needs_modify_topic(port: int) -> None:
    alice = Client(port, basic("alice", "a-pw"))
    bob = Client(port, basic("bob", "b-pw"))
    body = {"name": "shared", "permission": "consume"}
    assert (await alice.call("POST", "/api/v1/queues", body)).status == 201
    assert (await bob.call("POST", "/api/v1/queues", body)).status == 200  # idempotent
    refused(await bob.call("POST", "/api/v1/queues", {**body, "subscriptions": ["s/>"]}))
    info = (await alice.call("GET", q("shared"))).body
    assert info["subscriptions"] == [] and info["owner"] == "alice"


async def test_a_bound_flow_refusal_is_403_and_the_message_stays(port: int) -> None:
    alice = Client(port, basic("alice", "a-pw"))
    bob = Client(port, basic("bob", "b-pw"))
    body = {"name": "kept", "permission": "read-only"}
    assert (await alice.call("POST", "/api/v1/queues", body)).status == 201
    assert (await alice.call("POST", q("kept", "messages"), {"payload": "p"})).status == 200
    refused(await bob.call("POST", q("kept", "get"), {"count": 1}))
    got = await alice.call("POST", q("kept", "get"), {"count": 1, "timeout_ms": 2000})
    assert [m["payload"] for m in got.body] == ["p"]


# -- no users configured: loopback only -----------------------------------------------------


async def test_without_users_loopback_is_the_operator(broker: Broker, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.admin.auth"):
        server = HttpServer(AdminApi(broker))
    assert [r.getMessage() for r in caplog.records if "unauthenticated" in r.getMessage()]
    port = await server.start("127.0.0.1", 0)
    try:
        anyone = Client(port, None)
        assert (await anyone.call("POST", "/api/v1/queues", {"name": "open"})).status == 201
        assert (await anyone.call("DELETE", q("open"))).status == 204
    finally:
        await server.close()


def test_without_users_other_addresses_are_refused() -> None:
    auth = AdminAuth()
    for peer in ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"):
        assert auth.caller(None, peer) is None, peer
    for peer in ("10.1.2.3", "192.168.0.7", "::ffff:10.0.0.1", "fe80::1%eth0", ""):
        with pytest.raises(HttpError) as exc:
            auth.caller(basic("alice", "a-pw"), peer)
        assert exc.value.status == 403, peer


def test_with_users_loopback_needs_credentials_too(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.admin.auth"):
        auth = AdminAuth(USERS)
    assert not caplog.records
    with pytest.raises(HttpError) as exc:
        auth.caller(None, "127.0.0.1")
    assert exc.value.status == 401
    assert auth.caller(basic("alice", "a-pw"), "10.1.2.3") == "alice"
    assert auth.caller(basic("root", "root-pw"), "10.1.2.3") is None
    assert is_loopback("::1") and not is_loopback("not an address")


def test_admin_flag_in_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    users = '[[users]]\nname = "root"\npassword = "p"\nadmin = true\n'
    path.write_text(users + '[[users]]\nname = "alice"\npassword = "q"\n')
    s = load_settings(env={}, config_path=str(path))
    assert s.users == [User("root", "p", admin=True), User("alice", "q")]
    path.write_text('[[users]]\nname = "root"\npassword = "p"\nadmin = "yes"\n')
    with pytest.raises(ConfigError, match="admin of user 'root' must be true or false"):
        load_settings(env={}, config_path=str(path))
    path.write_text('[[users]]\nname = "root"\npassword = 1234\n')
    with pytest.raises(ConfigError, match="passwords are strings"):
        load_settings(env={}, config_path=str(path))


async def test_cli_sends_the_user_from_its_flag_and_environment(port: int) -> None:
    """`gateway queue --user` (password from GATEWAY_ADMIN_PASSWORD) authenticates; without
    credentials the node refuses with 401 and the CLI says so."""
    cli = Path(sys.executable).with_name("gateway")
    base = f"http://127.0.0.1:{port}"

    async def run(*args: str, password: str | None = None) -> tuple[int, str]:
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.pop("GATEWAY_ADMIN_USER", None)
        if password is not None:
            env["GATEWAY_ADMIN_PASSWORD"] = password
        proc = await asyncio.create_subprocess_exec(
            str(cli), "queue", "--admin-url", base, *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode is not None
        return proc.returncode, (out + err).decode()

    rc, text = await run("create", "cli-owned")
    assert rc == 1 and "GATEWAY_ADMIN_PASSWORD" in text, text
    rc, text = await run("--user", "alice", "create", "cli-owned", password="a-pw")
    assert rc == 0, text
    shown = await Client(port, basic("root", "root-pw")).call("GET", q("cli-owned"))
    assert shown.body["owner"] == "alice", shown
    rc, text = await run("--user", "alice", "list", password="wrong")
    assert rc == 1, text
