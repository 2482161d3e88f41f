"""A small HTTP/1.1 server on asyncio streams with h11 doing the protocol work.

Enough for a JSON admin API and a metrics endpoint: keep-alive, request bodies up to a
limit, a clear 4xx for malformed requests, and no framework to install.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import h11

log = logging.getLogger(__name__)

MAX_BODY = 16 * 1024 * 1024
LINGER_S = 2.0  # after refusing a body: what the client still sends is read for this long
# A connection holds a task and a socket, so none may be held by a client that sends or reads
# nothing: one idle between requests is closed after IDLE_S, a request whose head and body
# have not all come REQUEST_S after its first byte gets a 408, and a response the client
# does not take within SEND_S is dropped with its connection.
IDLE_S = 60.0
REQUEST_S = 30.0
SEND_S = 30.0


@dataclass(slots=True)
class Request:
    method: str
    path: list[str]  # decoded segments: /api/v1/queues/a%2Fb -> ["api", "v1", "queues", "a/b"]
    query: dict[str, str]
    headers: dict[str, str]  # lower-cased names; a name given twice keeps its last value
    body: bytes
    peer: str = ""  # the client's IP address: the admin API trusts loopback when open
    repeated: frozenset[str] = frozenset()  # the names given more than once

    def header(self, name: str) -> str | None:
        """One header's value (None: absent); HttpError 400 if it came more than once,
        as which one counts would be a guess."""
        if name in self.repeated:
            raise HttpError(400, f"header {name!r} is given more than once")
        return self.headers.get(name)

    def json(self) -> object:
        """The body as strict JSON (an empty body is {}). Python's parser takes NaN and
        Infinity, which are not JSON, and lone surrogates ("\\ud800" is valid JSON), which
        no protocol can carry: both are refused here, for every field of every endpoint."""
        if not self.body:
            return {}
        try:
            data = json.loads(self.body, parse_constant=_not_json)
        except RecursionError:
            raise HttpError(400, "request body is nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"request body is not valid JSON: {exc}") from None
        where = _lone_surrogate(data)
        if where is not None:
            raise HttpError(400, f"{where} is not valid Unicode (a lone surrogate)")
        return data


@dataclass(slots=True)
class Response:
    status: int = 200
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def json(
        cls, data: object, status: int = 200, headers: list[tuple[str, str]] | None = None
    ) -> Response:
        body = json.dumps(data, indent=1, default=str).encode() + b"\n"
        return cls(status, body, [("Content-Type", "application/json"), *(headers or [])])


class HttpError(Exception):
    """Raised by handlers; becomes a JSON error response."""

    def __init__(
        self, status: int, message: str, headers: list[tuple[str, str]] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or []  # e.g. WWW-Authenticate on a 401


Handler = Callable[[Request], Awaitable[Response]]


def _not_json(constant: str) -> float:
    """json.loads' hook for NaN, Infinity and -Infinity: not JSON (RFC 8259), and not a
    value any field takes."""
    raise ValueError(f"{constant} is not a JSON number")


def _lone_surrogate(data: object) -> str | None:
    """Where in parsed JSON a string or object key has a lone surrogate (None: nowhere),
    as a field path such as `subscriptions[0].pattern`. Iterative: bodies may nest deep."""
    if isinstance(data, str):
        return None if _is_utf8(data) else "the request body"
    todo: list[tuple[object, str]] = [(data, "")]
    while todo:
        node, where = todo.pop()
        if isinstance(node, dict):
            if not all(_is_utf8(key) for key in node):
                return f"a field name in {where or 'the request body'}"
            items: Iterable[tuple[str | int, object]] = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        for key, item in items:
            if isinstance(item, str):
                if not _is_utf8(item):
                    return _field_path(where, key)
            elif isinstance(item, dict | list):
                todo.append((item, _field_path(where, key)))
    return None


def _field_path(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def _is_utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def error_response(status: int, message: str) -> Response:
    return Response.json({"error": message, "status": status}, status)


class HttpServer:
    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._server: asyncio.base_events.Server | None = None
        self._clients: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._clients):
            task.cancel()
        if self._clients:
            await asyncio.gather(*self._clients, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._clients.add(task)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        peername = writer.get_extra_info("peername")
        peer = peername[0] if isinstance(peername, tuple) else ""
        try:
            while True:
                request = await self._read_request(conn, reader, writer)
                if request is None:
                    if conn.their_state is h11.SEND_BODY:  # refused while it sends its body
                        await _linger(reader, writer)
                    break
                request.peer = peer
                head = request.method == "HEAD"  # answered as a GET, without the body
                if head:
                    request.method = "GET"
                try:
                    response = await self._handler(request)
                except HttpError as exc:
                    response = error_response(exc.status, str(exc))
                    response.headers += exc.headers
                except Exception:
                    log.exception("admin request %s %s failed", request.method, request.path)
                    response = error_response(500, "internal error")
                await self._send(conn, writer, response, head)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    break
                try:
                    conn.start_next_cycle()
                except h11.LocalProtocolError:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except TimeoutError:  # a response not taken: closing would wait to flush it
            writer.transport.abort()
        finally:
            writer.close()
            if task is not None:
                self._clients.discard(task)

    async def _read_request(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Request | None:
        head: h11.Request | None = None
        body = bytearray()
        loop = asyncio.get_running_loop()
        started = bool(conn.trailing_data[0])  # a pipelined request's bytes came already
        deadline = loop.time() + (REQUEST_S if started else IDLE_S)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                await self._send_error(conn, writer, exc.error_status_hint, str(exc))
                return None
            if event is h11.NEED_DATA:
                try:
                    async with asyncio.timeout_at(deadline):
                        data = await reader.read(65536)
                except TimeoutError:
                    if started:  # RFC 9110 §15.5.9
                        await self._send_error(conn, writer, 408, "request not completed in time")
                    return None
                if data and not started:
                    started = True
                    deadline = loop.time() + REQUEST_S
                conn.receive_data(data)
                if not data and conn.their_state is h11.IDLE:
                    return None
                continue
            if isinstance(event, h11.Request):
                head = event
                if _declared_length(head) > MAX_BODY:  # refused before it is sent
                    await self._send_error(conn, writer, 413, "request body too large")
                    return None
                if conn.they_are_waiting_for_100_continue:  # RFC 9110 §10.1.1
                    writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY:
                    await self._send_error(conn, writer, 413, "request body too large")
                    return None
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                try:
                    return _to_request(head, bytes(body))
                except HttpError as exc:
                    await self._send_error(conn, writer, exc.status, str(exc))
                    return None
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def _send_error(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, status: int, message: str
    ) -> None:
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            with contextlib.suppress(h11.LocalProtocolError):
                await self._send(conn, writer, error_response(status, message))

    @staticmethod
    async def _send(
        conn: h11.Connection, writer: asyncio.StreamWriter, resp: Response, head: bool = False
    ) -> None:
        """`head`: the answer to a HEAD request, whose body is left out (RFC 9110 §9.3.2)."""
        headers = [*resp.headers, ("Content-Length", str(len(resp.body)))]
        out = conn.send(h11.Response(status_code=resp.status, headers=headers))
        out += conn.send(h11.Data(data=resp.body)) if resp.body and not head else b""
        out += conn.send(h11.EndOfMessage())
        writer.write(out)
        async with asyncio.timeout(SEND_S):
            await writer.drain()


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A lingering close (RFC 9112 §9.6): the error went out while the client still sends
    its body; closing at once would reset the connection before the client read the error.
    Stop sending, then read what it sends, for LINGER_S at most."""
    with contextlib.suppress(OSError, RuntimeError):
        if writer.can_write_eof():
            writer.write_eof()
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(LINGER_S):
            while await reader.read(65536):
                pass


def _declared_length(head: h11.Request) -> int:
    """The Content-Length a request announces (h11 has checked it is a number), else 0."""
    for name, value in head.headers:
        if name == b"content-length":
            return int(value)
    return 0


def _to_request(head: h11.Request, body: bytes) -> Request:
    """HttpError 400 for percent-escapes that are not UTF-8 (decoded with replacement
    characters, "%FF" named the queue "\\ufffd") and for a query parameter given twice.
    A blank parameter is kept: dropped, it left the handler to use its default."""
    target = urlsplit(head.target.decode("latin-1"))
    try:
        segments = [unquote(s, errors="strict") for s in target.path.split("/") if s]
        pairs = [  # not parse_qsl: a '+' is itself in a URL's query (an MQTT wildcard),
            # not a space as in an HTML form
            (unquote(name, errors="strict"), unquote(value, errors="strict"))
            for name, _, value in (p.partition("=") for p in target.query.split("&") if p)
        ]
    except UnicodeDecodeError:
        raise HttpError(400, "the request target's percent-escapes are not UTF-8") from None
    query: dict[str, str] = {}
    for name, value in pairs:
        if name in query:
            raise HttpError(400, f"query parameter {name!r} is given more than once")
        query[name] = value
    headers: dict[str, str] = {}
    repeated = set()
    for name, value in head.headers:  # h11 gives the names lower-cased
        key = name.decode()
        if key in headers:
            repeated.add(key)
        headers[key] = value.decode("latin-1")
    return Request(
        head.method.decode(), segments, query, headers, body, repeated=frozenset(repeated)
    )
