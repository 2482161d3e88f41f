"""The admin HTTP API (`/api/v1/...`) and the Prometheus endpoint (`/metrics`).

Queues: list, create (idempotent, property equivalence checked), show, change run-time
settings, delete, and change topic subscriptions. Messages: publish to a topic or a queue
(answered only after the message is spooled) and get-with-ack from a queue, as RabbitMQ's
management API offers for testing and operations; not a consumer API for applications.
Spool: usage against the broker-wide and per-VPN quotas, and the usage threshold alarms
(`GET /api/v1/spool`).

Callers are told apart by `AdminAuth`: the operator (an admin user, or loopback while no
users are configured) is not checked; any other user acts as itself, so queue ownership
and permissions apply as they do to its AMQP and MQTT clients. The health probe is open.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import logging
import math
from collections.abc import Collection, Iterable
from typing import Any
from urllib.parse import quote

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.acl import NO_DENIALS, TopicAccess, topic_access
from gateway.admin.auth import AdminAuth
from gateway.admin.http import HttpError, Request, Response
from gateway.admin.metrics import hide_queues, render_metrics
from gateway.broker import BindError, Broker, InDoubt
from gateway.config import AclRule, User
from gateway.engine.ordered_calls import refused_for_now
from gateway.engine.permissions import BROWSE, allowed
from gateway.engine.queues import (
    INFO_BATCH,
    QueueConfig,
    QueueError,
    QueueInfo,
    subscription_queue,
)
from gateway.engine.spool_usage import read_usage
from gateway.model import Delivery, Message, Outcome, Publisher
from gateway.topics import TopicError, reaches_temporary_topics, validate_topic

log = logging.getLogger(__name__)

OUTCOME_STATUS = {
    Outcome.NOT_FOUND: 404,
    Outcome.INGRESS_DISABLED: 503,
    Outcome.TOO_LARGE: 413,
    Outcome.QUOTA_EXCEEDED: 507,
    Outcome.QUEUE_FULL: 507,
    Outcome.OUT_OF_MEMORY: 507,
}
MAX_GET = 1000
# a get without timeout_ms waits for its first fetch to find no more this long at most (a
# standby of an exclusive queue never fetches); a partitioned queue's rebalance delay more
GET_WAIT_S = 0.25
HEALTH_TIMEOUT_S = 2.0
USER_PROPERTY_HEADER = "solace-user-property-"  # header names arrive lower-cased
AMQP_INTEGERS = range(-(2**63), 2**64)  # a user property as AMQP carries it: long or ulong
MESSAGE_FIELDS = (
    "queue",
    "topic",
    "payload",
    "payload_base64",
    "partition_key",
    "priority",
    "persistent",
    "content_type",
    "correlation_id",
    "reply_to",
    "user_properties",
)
GET_FIELDS = ("count", "timeout_ms", "browse", "ackmode")
LIST_FIELDS = ("limit", "after")  # paging the queue list
MAX_LIST = 10_000  # queues a page of the list holds at most
SUBSCRIPTION_FIELDS = ("pattern", "syntax")
# The methods each resource answers, by path ("*": any one segment). Another method gets a
# 405 that names them in its Allow header (RFC 9110 §15.5.6); another path, a 404.
METHODS = {
    ("metrics",): ("GET",),
    ("api", "v1", "health"): ("GET",),
    ("api", "v1", "spool"): ("GET",),
    ("api", "v1", "messages"): ("POST",),
    ("api", "v1", "queues"): ("GET", "POST"),
    ("api", "v1", "queues", "*"): ("GET", "PATCH", "DELETE"),
    ("api", "v1", "queues", "*", "subscriptions"): ("POST", "DELETE"),
    ("api", "v1", "queues", "*", "messages"): ("POST",),
    ("api", "v1", "queues", "*", "get"): ("POST",),
    ("api", "v1", "queues", "*", "readers", "*"): ("DELETE",),
}


BIND_STATUS = {"not_found": 404, "unauthorized": 403}


def not_routed(path: list[str], method: str) -> HttpError:
    """A 405 naming the methods of a resource the path names, else a 404."""
    where = f"/{'/'.join(path)}"
    for shape, methods in METHODS.items():
        if len(shape) == len(path) and all(
            s in ("*", seg) for s, seg in zip(shape, path, strict=True)
        ):
            allow = ", ".join(methods)
            return HttpError(405, f"no route for {method} {where}: use {allow}", [("Allow", allow)])
    return HttpError(404, f"no such resource: {where}")


class AdminApi:
    def __init__(
        self, broker: Broker, users: Iterable[User] = (), acl: Iterable[AclRule] = ()
    ) -> None:
        self.broker = broker
        self.auth = AdminAuth(users)
        self.acl = list(acl)
        self.stopping = False  # the node shuts down: load balancers should send no more

    def _topics(self, user: str | None) -> TopicAccess:
        """The topic ACL binds every user but the operator (None), as on AMQP and MQTT."""
        return NO_DENIALS if user is None else topic_access(self.acl, user)

    def _check_subscribe(self, subscriptions: Iterable[tuple[str, str]], user: str | None) -> None:
        topics = self._topics(user)
        for pattern, syntax in subscriptions:
            try:
                allowed = topics.may_route(pattern, syntax)
            except TopicError as exc:
                raise HttpError(400, f"invalid subscription {pattern!r}: {exc}") from None
            if not allowed or (user is not None and reaches_temporary_topics(pattern, syntax)):
                raise HttpError(403, f"{pattern!r} may match topics the user may not read")

    async def __call__(self, req: Request) -> Response:
        try:
            if req.path == ["api", "v1", "health"] and req.method == "GET":
                return await self._health()
            user = self.auth.caller(req.header("authorization"), req.peer)
            return await self._route(req, user)
        except QueueError as exc:
            raise HttpError(exc.http_status, str(exc)) from None
        except BindError as exc:
            raise HttpError(BIND_STATUS.get(exc.code, 409), str(exc)) from None
        except RedisError as exc:
            answer = _redis_failure(req, exc)
            if answer is None:  # a fault: told in full, as a 500
                raise
            raise answer from None

    async def _health(self) -> Response:
        """Open to all: load balancers and orchestrators probe without credentials. 503
        (RFC 9110 §15.6.4) while the node cannot serve: it is stopping, Redis does not
        answer within HEALTH_TIMEOUT_S, or the node's liveness lapsed, so other nodes take
        its flows."""
        node = self.broker.node_id
        if self.stopping:
            reason = "the node is stopping"
            return Response.json({"status": "unavailable", "node": node, "reason": reason}, 503)
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                await self.broker.redis.ping()
        except TimeoutError:  # (its text is empty)
            reason = f"Redis does not answer within {HEALTH_TIMEOUT_S:g} s"
            return Response.json({"status": "unavailable", "node": node, "reason": reason}, 503)
        except (RedisError, OSError) as exc:
            reason = _unanswered(exc)
            return Response.json({"status": "unavailable", "node": node, "reason": reason}, 503)
        if not self.broker.liveness.presumed_alive():
            reason = "the node's heartbeat lapsed: other nodes presume it dead"
            return Response.json({"status": "unavailable", "node": node, "reason": reason}, 503)
        return Response.json({"status": "ok", "node": node})

    async def _route(self, req: Request, user: str | None) -> Response:
        """`user` None is the operator; a user name is checked by the broker."""
        p, m = req.path, req.method
        rest = p[2:] if p[:2] == ["api", "v1"] else []
        unsubscribing = len(rest) == 3 and rest[2] == "subscriptions" and m == "DELETE"
        # a parameter no route reads would be ignored: DELETE ...?if-empty=true deleted
        # the queue with its messages
        listing = rest == ["queues"] and m == "GET"
        _known(
            req.query,
            ("pattern", "syntax") if unsubscribing else LIST_FIELDS if listing else (),
            "query",
        )
        if m in ("GET", "DELETE") and req.body:  # no route reads one: DELETE {"if_empty":
            # true} deleted the queue with its messages
            _known(_object(req), (), m)
        if p == ["metrics"] and m == "GET":
            text = await render_metrics(self.broker, lambda config: _visible(config, user))
            return Response(200, text.encode(), [("Content-Type", "text/plain; version=0.0.4")])
        if rest == ["spool"] and m == "GET":
            report = await read_usage(self.broker.redis)
            if user is not None:
                report = hide_queues(report, await self._hidden(user))
            return Response.json(report.to_json())
        if rest == ["queues"]:
            if m == "GET":
                return await self._list_queues(req.query, user)
            if m == "POST":
                return await self._create_queue(_object(req), user)
        if len(rest) >= 2 and rest[0] == "queues" and user is not None and rest[2:] != ["messages"]:
            await self._check_visible(rest[1], user)  # a publish is answered as AMQP's
        if len(rest) == 2 and rest[0] == "queues":
            name = rest[1]
            if m == "GET":
                return Response.json((await self.broker.queues.info(name)).to_json())
            if m == "PATCH":
                return await self._update_queue(name, _object(req), user)
            if m == "DELETE":
                await self.broker.delete_queue(name, user=user)
                return Response(204)
        if (
            len(rest) == 3
            and rest[0] == "queues"
            and rest[2] == "subscriptions"
            and m in ("POST", "DELETE")
        ):
            return await self._subscriptions(rest[1], req, user)
        if len(rest) == 4 and rest[0] == "queues" and rest[2] == "readers" and m == "DELETE":
            if user is not None:
                raise HttpError(403, "only an admin user may forget a queue's readers")
            if not await self.broker.queues.forget_reader(rest[1], rest[3]):
                raise HttpError(404, f"no reader {rest[3]!r} on queue {rest[1]!r}")
            return Response(204)
        if len(rest) == 3 and rest[0] == "queues" and rest[2] == "messages" and m == "POST":
            return await self._publish({**_object(req), "queue": rest[1]}, req, user)
        if len(rest) == 3 and rest[0] == "queues" and rest[2] == "get" and m == "POST":
            return await self._get(rest[1], _object(req), user)
        if rest == ["messages"] and m == "POST":
            return await self._publish(_object(req), req, user)
        raise not_routed(p, m)

    async def _check_visible(self, name: str, user: str) -> None:
        """A queue `user` may not browse is answered as one that does not exist: a 403
        told its name (an owner's client id and subscription) was taken."""
        config = await self._existing(name)
        if config is not None and not _visible(config, user):  # (none: the route answers)
            raise HttpError(404, f"no queue {name!r}")

    async def _existing(self, name: str) -> QueueConfig | None:
        try:
            return await self.broker.queues.config(name)
        except QueueError:
            return None

    async def _hidden(self, user: str) -> set[str]:
        """The queues `user` may not browse."""
        queues = self.broker.queues
        return {
            i.config.name
            async for i in queues.infos(await queues.names())
            if not _visible(i.config, user)
        }

    async def _list_queues(self, query: dict[str, str], user: str | None) -> Response:
        """Queues in name order; `?limit=N` pages them, `after=` the last name of the page
        before. A page that has more after it links the next (RFC 8288, as GitHub's API
        does): the whole list of 16,000 queues took 1.3 s, in one body."""
        limit = _query_int(query, "limit", 1, MAX_LIST) if "limit" in query else None
        names = await self.broker.queues.names()
        if "after" in query:
            names = names[bisect.bisect_right(names, query["after"]) :]
        out: list[dict[str, Any]] = []
        read = 0
        while read < len(names):
            # the page and one more tell of a next page, read again for those deleted
            # meanwhile; a user's are the queues it may see, by their owners and permissions
            wanted = len(names) if limit is None else limit + 1 - len(out)
            if user is None:
                chunk = names[read : read + wanted]
                read += len(chunk)
            else:
                chunk, read = await self._visible_names(names, read, wanted, user)
            async with contextlib.aclosing(self.broker.queues.infos(chunk)) as infos:
                async for info in infos:
                    if not _visible(info.config, user):  # changed since
                        continue
                    if len(out) == limit:
                        link = _next_page(limit, out[-1])
                        return Response.json(out, headers=[("Link", link)])
                    out.append(_listed(info))
        return Response.json(out)

    async def _visible_names(
        self, names: list[str], start: int, wanted: int, user: str
    ) -> tuple[list[str], int]:
        """At least `wanted` of names[start:] that `user` may see (or all there are), and
        where the read stopped, by their owners and permissions alone: a user's page
        among 16,000 queues it may not see read each one's whole info (a priority or
        partitioned one's in a round trip of its own) to drop it, 0.7 s for a page of one."""
        found: list[str] = []
        while start < len(names) and len(found) < wanted:
            batch = names[start : start + INFO_BATCH]
            start += len(batch)
            access = await self.broker.queues.access(batch)
            found += [name for name, *level in access if allowed(*level, user, BROWSE)]
        return found, start

    async def _create_queue(self, body: dict[str, Any], user: str | None) -> Response:
        subs = _subscriptions(body.get("subscriptions", []))
        self._check_subscribe(subs, user)
        config = QueueConfig.from_json(body)
        if user is not None:
            await self._check_redeclare(config.name, subs, user)
        created = await self.broker.declare_queue(config, subs, user=user)
        info = await self.broker.queues.info(config.name)
        return Response.json(info.to_json(), 201 if created else 200)

    async def _check_redeclare(
        self, name: str, subscriptions: list[tuple[str, str]], user: str
    ) -> None:
        """Declaring another user's queue: one the user may not see is not shown (nor
        compared), and the subscriptions it adds bind its owner's ACL too, as a POST to its
        subscriptions does."""
        existing = await self._existing(name)
        if existing is None:
            return  # made by this declaration
        if not _visible(existing, user):
            raise HttpError(409, f"a queue named {name!r} exists and is not the user's to see")
        self._check_owner_topics(existing, subscriptions, user)

    def _check_owner_topics(
        self, config: QueueConfig, subscriptions: list[tuple[str, str]], user: str | None
    ) -> None:
        """A queue's owner reads what it holds: another user (modify-topic) may not add a
        topic the owner's ACL denies."""
        if user is not None and config.owner is not None and config.owner != user:
            self._check_subscribe(subscriptions, config.owner)

    async def _update_queue(self, name: str, body: dict[str, Any], user: str | None) -> Response:
        """Run-time changes; `partition_count` (egress disabled) reports deleted messages."""
        result: dict[str, Any] = {}
        deleted = await self.broker.update_queue(name, body, user=user)
        if "partition_count" in body:
            result["deleted_messages"] = deleted
        info = await self.broker.queues.info(name)
        return Response.json({**info.to_json(), **result})

    async def _subscriptions(self, name: str, req: Request, user: str | None) -> Response:
        if user is not None and subscription_queue(name):  # its adapter's: a topic removed
            # there would leave its client reading whatever it holds, as by name
            raise HttpError(403, f"{name!r} is subscribed by its client alone")
        if req.method == "POST":
            [(pattern, syntax)] = _subscriptions([_object(req)])
            self._check_subscribe([(pattern, syntax)], user)
            config = await self.broker.queues.config(name)
            self._check_owner_topics(config, [(pattern, syntax)], user)
            change = self.broker.subscribe_queue
        else:  # DELETE
            pattern = req.query.get("pattern", "")
            if not pattern:
                raise HttpError(400, "DELETE needs ?pattern=...&syntax=smf|mqtt")
            syntax = req.query.get("syntax", "smf")
            change = self.broker.unsubscribe_queue
        changed = await change(name, [pattern], syntax, user=user)
        return Response.json({"changed": changed})

    async def _publish(self, body: dict[str, Any], req: Request, user: str | None) -> Response:
        msg = _message(body)
        if not msg.to_queue and not self._topics(user).may_publish(msg.destination):
            raise HttpError(403, f"may not publish to topic {msg.destination!r}")
        if msg.to_queue and user is not None and subscription_queue(msg.destination):
            raise HttpError(403, f"{msg.destination!r} is filled by its subscriptions alone")
        msg.publisher.user = user
        # Solace REST messaging headers: user properties, JMSXGroupID as the partition key
        for name in req.headers:
            if name.startswith(USER_PROPERTY_HEADER):
                prop = name[len(USER_PROPERTY_HEADER) :]
                if not prop:
                    raise HttpError(400, "a Solace-User-Property- header needs a property name")
                text = _header_text(req.header(name) or "", name)
                if prop == "jmsxgroupid":
                    msg.partition_key = text
                else:
                    msg.user_properties.append((prop, text))
        outcome = await self.broker.publish(msg)
        status = OUTCOME_STATUS.get(outcome, 200)
        result = {"outcome": outcome.name.lower(), "id": msg.id}
        if status >= 400:
            raise HttpError(status, f"message refused: {outcome.name.lower()}")
        return Response.json(result)

    async def _get(self, name: str, body: dict[str, Any], user: str | None) -> Response:
        """Take (consume permission) or, with `browse`, copy (read-only) messages."""
        _known(body, GET_FIELDS, "get")
        count = _int(body, "count", 1, 1, MAX_GET)
        timeout = _int(body, "timeout_ms", 0, 0, 30_000) / 1000
        browse = _bool(body, "browse", False)
        mode = body.get("ackmode", "ack")
        if mode not in ("ack", "requeue", "reject"):
            raise HttpError(400, "ackmode must be ack, requeue or reject")
        if browse and mode != "ack":
            raise HttpError(400, "a browse takes nothing: ackmode does not apply")
        if user is not None and subscription_queue(name):  # its adapter applies the ACL
            raise HttpError(403, f"{name!r} is read by its subscriber alone")
        got: list[Delivery] = []
        enough = asyncio.Event()
        ended: list[str] = []

        def on_deliver(delivery: Delivery) -> None:
            got.append(delivery)
            if len(got) >= count:
                enough.set()

        def on_closed(reason: str) -> None:  # the queue went while the get waited
            ended.append(reason)
            enough.set()

        flow = await self.broker.bind(
            name,
            on_deliver,
            window=count,
            browse=browse,
            user=user,
            get=True,
            on_closed=on_closed,
        )
        try:
            if not timeout:  # what waits now: until a fetch finds no more (a partitioned
                # queue's flow fetches once the rebalance gave it partitions)
                flow.on_empty = enough.set
                config = await self.broker.queues.config(name)
                timeout = GET_WAIT_S
                if config.partition_count:
                    timeout += config.partition_rebalance_delay_ms / 1000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(enough.wait(), timeout)
            if ended and not got:
                raise HttpError(404, f"queue {name!r} was deleted while the get waited")
            settle = {"ack": flow.ack, "requeue": flow.requeue, "reject": flow.reject}[mode]
            for d in got:
                settle(d.entry_id)
        finally:
            await flow.close()
        return Response.json([_delivery_json(d) for d in got])


def _redis_failure(req: Request, exc: RedisError) -> HttpError | None:
    """What a request that Redis failed answers, told on one line: 504 when a message was
    sent and the answer lost (it may be stored: a retry may store it twice), 503 while
    Redis does not answer or refuses for now (RFC 9110 §15.6.4: a state that passes, as
    the health probe says); None for any other failure."""
    if isinstance(exc, InDoubt):
        status, reason = 504, str(exc)
    elif isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        status, reason = 503, _unanswered(exc)
    elif refused_for_now(exc):
        status, reason = 503, f"Redis refuses for now: {exc}"
    else:
        return None
    log.warning("admin request %s /%s: %s", req.method, "/".join(req.path), reason)
    return HttpError(status, reason)


def _unanswered(exc: BaseException) -> str:
    """Why Redis does not answer, as the health probe and any request tell it."""
    return f"Redis does not answer: {str(exc) or type(exc).__name__}"


def _visible(config: QueueConfig, user: str | None) -> bool:
    """A user sees the queues it may browse at least (a private one's name tells its owner's
    client id, subscriptions and selector); an admin sees every queue."""
    return allowed(config.owner, config.permission, user, BROWSE)


def _object(req: Request) -> dict[str, Any]:
    body = req.json()
    if not isinstance(body, dict):
        raise HttpError(400, "request body must be a JSON object")
    return body


def _header_text(value: str, name: str) -> str:
    """A header value as the UTF-8 its client sent: the HTTP layer keeps header bytes as
    latin-1, which turned "Zürich" into "ZÃ¼rich"."""
    try:
        return value.encode("latin-1").decode()
    except UnicodeDecodeError:
        raise HttpError(400, f"header {name} is not UTF-8") from None


def _known(body: dict[str, Any], fields: Collection[str], what: str) -> None:
    """Refuse fields a request does not take: a misspelt optional field ("cout") would be
    ignored and its default used without a word."""
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise HttpError(400, f"unknown {what} fields: {', '.join(unknown)}")


def _listed(info: QueueInfo) -> dict[str, Any]:
    """A queue as the list shows it."""
    return {
        "name": info.config.name,
        "access_type": info.config.access_type,
        "durable": info.config.durable,
        "messages": info.messages,
        "spooled_bytes": info.spooled_bytes,
        "flows": len(info.flows),
    }


def _query_int(query: dict[str, str], key: str, lo: int, hi: int) -> int:
    value = query[key]
    digits = value.isascii() and value.isdigit() and len(value) <= len(str(hi))
    if not digits or not lo <= int(value) <= hi:  # (int() refuses over 4,300 digits)
        raise HttpError(400, f"{key} must be an integer from {lo} to {hi}")
    return int(value)


def _next_page(limit: int, last: dict[str, Any]) -> str:
    """The Link header of a page of queues that has more after it."""
    after = quote(last["name"], safe="")
    return f'</api/v1/queues?limit={limit}&after={after}>; rel="next"'


def _int(body: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise HttpError(400, f"{key} must be an integer from {lo} to {hi}")
    return value


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    """A switch must be true or false: "false" (a string) is true to Python."""
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise HttpError(400, f"{key} must be true or false")
    return value


def _subscriptions(items: Any) -> list[tuple[str, str]]:
    if not isinstance(items, list):
        raise HttpError(400, "subscriptions must be a list")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append((item, "smf"))
        elif isinstance(item, dict) and isinstance(item.get("pattern"), str):
            _known(item, SUBSCRIPTION_FIELDS, "subscription")
            syntax = _optional_text(item, "syntax")
            out.append((item["pattern"], "smf" if syntax is None else syntax))
        else:
            raise HttpError(400, "a subscription is a pattern string or {pattern, syntax}")
    return out


def _message(body: dict[str, Any]) -> Message:
    _known(body, MESSAGE_FIELDS, "message")
    queue, topic = _optional_text(body, "queue"), _optional_text(body, "topic")
    if (queue is None) == (topic is None):
        raise HttpError(400, "give exactly one of queue or topic")
    if topic is not None:
        try:
            validate_topic(topic)
        except TopicError as exc:
            raise HttpError(400, f"invalid topic: {exc}") from None
    if "payload_base64" in body:
        try:
            payload = base64.b64decode(body["payload_base64"], validate=True)
        except (ValueError, TypeError):
            raise HttpError(400, "payload_base64 is not valid base64") from None
    else:
        payload = (_optional_text(body, "payload") or "").encode()
    props = body.get("user_properties", {})
    if not isinstance(props, dict):
        raise HttpError(400, "user_properties must be an object")
    for name, value in props.items():
        if value is not None and not isinstance(value, str | int | float):  # bool is an int
            raise HttpError(400, f"user property {name!r} must be a string, number or boolean")
        if isinstance(value, int) and value not in AMQP_INTEGERS:
            raise HttpError(400, f"user property {name!r} must be from -2**63 to 2**64 - 1")
    return Message(
        destination=queue if queue is not None else topic,
        to_queue=queue is not None,
        payload=payload,
        partition_key=_optional_text(body, "partition_key"),
        priority=_int(body, "priority", 4, 0, 9),
        persistent=_bool(body, "persistent", True),
        content_type=_optional_text(body, "content_type"),
        correlation_id=_optional_text(body, "correlation_id"),
        reply_to=_optional_text(body, "reply_to"),
        user_properties=list(props.items()),
        publisher=Publisher("http"),
    )


def _optional_text(body: dict[str, Any], name: str) -> str | None:
    """A text field, None when absent or null (its text is valid Unicode: Request.json)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise HttpError(400, f"{name} must be a string")
    return value


def _delivery_json(d: Delivery) -> dict[str, Any]:
    m = d.message
    try:
        text: str | None = m.payload.decode()
    except UnicodeDecodeError:
        text = None
    return {
        "entry_id": d.entry_id,
        "id": m.id,
        "destination": m.destination,
        "delivery_count": d.delivery_count,
        "redelivered": d.redelivered,
        "payload": text,
        "payload_base64": base64.b64encode(m.payload).decode(),
        "partition_key": m.partition_key,
        "priority": m.priority,
        "content_type": m.content_type,
        "correlation_id": _json_value(m.correlation_id),
        "reply_to": m.reply_to,
        "expiration": m.expiration,  # epoch ms
        "user_properties": {k: _json_value(v) for k, v in m.user_properties},
        # the gateway's: a dead message's x-origin-queue and x-dmq-reason (an AMQP
        # publisher's own travel as the section it sent, for AMQP consumers)
        "annotations": {str(k): _json_value(v) for k, v in m.annotations.items()},
    }


def _json_value(value: Any) -> Any:
    """A property as JSON: binary (from AMQP) as {"base64": ...}, not as text; what JSON
    lacks (an AMQP uuid, a double's NaN or infinity: strict parsers refuse the whole
    answer) as its text."""
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
