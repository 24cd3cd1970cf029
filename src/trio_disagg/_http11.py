"""The project's HTTP/1.1 server: ASGI over trio sockets, parsed by httptools; it serves the
router (``trio_disagg.server``) and the mock workers (``trio_disagg.mock``).

The relay's other end (docs/performance.md): every batch of tokens a stream sends crosses
this module, so it does per message only what HTTP/1.1 needs. A response's head goes out
with its first body, and a body's last bytes with the end of the chunked stream, in one
socket write each; a request's headers and body are parsed by httptools (C) in one call
per socket read. A client that goes away is an ``http.disconnect`` at once (the app then
cancels the request's nursery, docs/semantics.md C3); the app is never cancelled by the
server except at the end of a graceful shutdown (B3).

What it serves: HTTP/1.1 and 1.0 with keep-alive, pipelined requests one at a time,
``Expect: 100-continue``, chunked and content-length request bodies. Not: TLS, HTTP/2,
upgrades (refused with a 400); put a TLS proxy in front, as is usual for a router inside a
cluster, or pass ``serve(config=...)`` to run under hypercorn instead.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any
from urllib.parse import unquote_to_bytes

import httptools
import trio

from ._listen import open_listeners

logger = logging.getLogger("trio_disagg.server")

Scope = dict[str, Any]
Message = dict[str, Any]
App = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
               Awaitable[None]]

READ_SIZE = 65536
#: Seconds an idle keep-alive connection is kept open (uvicorn's default).
KEEP_ALIVE_TIMEOUT = 5.0
#: The ASGI scope extension saying that this server's sends are whole or break the
#: connection, each bounded by :data:`WRITE_TIMEOUT` (so an app need not shield them).
WHOLE_SENDS = "trio_disagg.whole_sends"
#: Seconds a response write may wait for a client that does not read before the
#: connection is closed.
WRITE_TIMEOUT = 10.0
#: Seconds a client gets to send a request's headers once it started sending them.
HEADERS_TIMEOUT = 10.0
#: Seconds a request body may pause between two reads before the request ends (408).
BODY_TIMEOUT = 10.0
#: Bytes of request line and headers accepted (else 431).
MAX_HEAD_BYTES = 64 * 1024
#: Bytes read ahead (request bodies not yet received by the app, pipelined requests)
#: before the server stops reading from the client.
MAX_BUFFERED_BYTES = 1024 * 1024

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 408: b"Request Timeout",
            431: b"Request Header Fields Too Large", 500: b"Internal Server Error"}


#: The OpenAI-style error code of each answer the server gives by itself.
_CODES = {400: b"malformed_request", 408: b"request_timeout",
          431: b"request_header_fields_too_large"}


class _Request:
    """One request as it is parsed: its head, then its body as it arrives."""

    __slots__ = ("body", "complete", "expect_continue", "headers", "keep_alive", "method",
                 "url", "version")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: deque[bytes] = deque()
        self.complete = False
        self.method = "GET"
        self.version = "1.1"
        self.keep_alive = True
        self.expect_continue = False


class _Connection:
    """One client connection: its parser, the requests parsed from it, and the response
    of the one being served."""

    def __init__(self, server: _Server, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.parser = httptools.HttpRequestParser(self)
        self.requests: deque[_Request] = deque()
        self.parsing: _Request | None = None
        self.head_bytes = 0
        self.buffered = 0
        self.closed = False  # the client went away (or the connection broke)
        self.closing = False  # the server closes it after the current response
        self.idle = True
        self.changed = trio.Event()
        self.scope = trio.CancelScope()
        self.fileno = stream.socket.fileno()
        try:
            self.client: tuple[str, int] | None = stream.socket.getpeername()[:2]
            self.local: tuple[str, int] | None = stream.socket.getsockname()[:2]
        except OSError:
            self.client = self.local = None

    # httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.parsing = _Request()
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        assert self.parsing is not None
        self.parsing.url += url
        self.head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.parsing is not None
        self.parsing.headers.append((name.lower(), value))
        self.head_bytes += len(name) + len(value)

    def on_headers_complete(self) -> None:
        request = self.parsing
        assert request is not None
        parser = self.parser
        request.method = parser.get_method().decode("ascii")
        request.version = parser.get_http_version()
        request.keep_alive = parser.should_keep_alive()
        request.expect_continue = (b"expect", b"100-continue") in request.headers
        self.requests.append(request)

    def on_body(self, body: bytes) -> None:
        assert self.parsing is not None
        self.parsing.body.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        assert self.parsing is not None
        self.parsing.complete = True
        self.parsing = None

    # reading ----------------------------------------------------------------------------

    def _wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def read_once(self) -> bool:
        """Read what the client sent into the parser; False if it went away."""
        try:
            data = await self.stream.receive_some(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            data = b""
        if not data:
            self.closed = True
            self._wake()
            return False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.closing = True
            await self.refuse(400, b"upgrades are not supported")
            return False
        except httptools.HttpParserError:
            self.closing = True
            await self.refuse(400, b"malformed HTTP request")
            return False
        if self.parsing is not None and self.head_bytes > MAX_HEAD_BYTES \
                and not self.requests:
            self.closing = True
            await self.refuse(431, b"request headers too large")
            return False
        self._wake()
        return True

    async def next_request(self) -> _Request | None:
        """The next request whose head is in, or None when the connection is done."""
        while not self.requests:
            if self.closed or self.closing:
                return None
            waiting_for_start = self.parsing is None
            timeout = KEEP_ALIVE_TIMEOUT if waiting_for_start else HEADERS_TIMEOUT
            with trio.move_on_after(timeout) as waited:
                alive = await self.read_once()
            if waited.cancelled_caught:
                if not waiting_for_start:
                    await self.refuse(408, b"request headers not received in time")
                return None
            if not alive:
                return None
        return self.requests.popleft()

    async def read_while_serving(self, request: _Request) -> None:
        """Read on while the app serves ``request``: its body, then whatever comes (a
        pipelined request is parsed and waits; the end of the connection is a
        disconnect). Reading pauses while too much is buffered."""
        while not self.closed:
            if self.buffered > MAX_BUFFERED_BYTES:
                await self.changed.wait()  # the app took some of the body
                continue
            if not await self.read_once():
                return

    async def refuse(self, status: int, message: bytes) -> None:
        """Answer an error that no app saw (the request was not HTTP), then close."""
        body = (b'{"error":{"message":"' + message + b'","type":"invalid_request_error",'
                b'"param":null,"code":"' + _CODES.get(status, b"bad_request") + b'"}}')
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n"
                % (status, _REASONS.get(status, b""), len(body)))
        with trio.move_on_after(1), suppress(trio.BrokenResourceError,
                                             trio.ClosedResourceError, OSError):
            await self.stream.send_all(head + body)
        self.closed = True


class _Exchange:
    """The ASGI ``receive`` and ``send`` of one request."""

    __slots__ = ("body_ended", "body_timed_out", "chunked", "conn", "done", "head",
                 "head_only", "keep_alive", "request", "started")

    def __init__(self, conn: _Connection, request: _Request) -> None:
        self.conn = conn
        self.request = request
        self.started = False  # the app sent http.response.start
        self.head: bytes | None = None  # the response head, until it goes out
        self.done = False  # the response is complete
        self.body_ended = False  # the app received the request body's last part
        self.body_timed_out = False  # the body stopped coming (BODY_TIMEOUT)
        self.chunked = True
        self.head_only = request.method == "HEAD"
        self.keep_alive = request.keep_alive

    async def receive(self) -> Message:
        request, conn = self.request, self.conn
        while True:
            if request.body:
                parts = request.body
                body = parts.popleft() if len(parts) == 1 else b"".join(parts)
                parts.clear()
                conn.buffered -= len(body)
                conn._wake()  # a reader paused on a full buffer reads on
                self.body_ended = request.complete
                return {"type": "http.request", "body": body, "more_body": not request.complete}
            if request.complete and not self.body_ended:
                self.body_ended = True
                await trio.lowlevel.checkpoint()
                return {"type": "http.request", "body": b"", "more_body": False}
            if conn.closed or self.done:
                await trio.lowlevel.checkpoint()
                return {"type": "http.disconnect"}
            if request.expect_continue and not self.started:
                request.expect_continue = False
                await self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
                continue
            if request.complete:
                await conn.changed.wait()  # the body is all in: wait for the end
                continue
            with trio.move_on_after(BODY_TIMEOUT) as waited:
                await conn.changed.wait()
            if waited.cancelled_caught:
                # A body that stopped coming holds the request's slot (admission control)
                # for nothing: the request ends as a disconnect, and the client gets a 408.
                self.body_timed_out = True
                conn.closing = True
                return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            status = int(message["status"])
            self.head = self._head(status, message.get("headers", ()))
            if not self.conn.server.head_with_body:
                head, self.head = self.head, None
                await self._write(head)  # at once, as uvicorn does: the client sees 2xx
            else:
                await trio.lowlevel.cancel_shielded_checkpoint()  # recorded: not undone
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.started or self.done:
            raise RuntimeError("http.response.body outside of a response")
        body: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        parts: list[bytes] = []
        if self.head is not None:
            parts.append(self.head)
            self.head = None
        if body and not self.head_only:
            if self.chunked:
                parts += (b"%x\r\n" % len(body), body, b"\r\n")
            else:
                parts.append(body)
        if not more:
            self.done = True
            if self.chunked and not self.head_only:
                parts.append(b"0\r\n\r\n")
        if parts:
            await self._write(parts[0] if len(parts) == 1 else b"".join(parts))
        if self.done:
            self.conn._wake()  # a receive() waiting for the disconnect returns

    def _head(self, status: int, headers: Any) -> bytes:
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                self.chunked = False
            elif lower == b"connection" and value.lower() == b"close":
                self.keep_alive = False
                continue
            elif lower == b"transfer-encoding":
                continue  # the server frames the body itself
            lines += (name, b": ", value, b"\r\n")
        if self.request.version == "1.0":
            self.chunked = False  # delimited by the connection's end, unless sized
            if not any(name.lower() == b"content-length" for name, _ in headers):
                self.keep_alive = False
        if self.chunked:
            lines.append(b"transfer-encoding: chunked\r\n")
        if not self.request.complete:
            # Answered before its body ended (a refusal): the rest is not read, so the
            # connection cannot carry another request.
            self.keep_alive = False
        if not self.keep_alive or self.conn.closing:
            self.keep_alive = False
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def _write(self, data: bytes) -> None:
        """Write ``data`` whole, or break the connection: never half of it and return.

        The common case costs one system call and no cancel scope: the socket takes all
        of ``data`` at once (it is non-blocking). Only when its buffer is full (a slow
        client) does the rest go out under a shielded deadline (:data:`WRITE_TIMEOUT`);
        a client that does not read for that long loses its connection. So a send never
        stops half-way because the app's request was cancelled (B4: the stream a client
        sees is whole events or broken, never a torn one)."""
        conn = self.conn
        if conn.closed:
            await trio.lowlevel.checkpoint()  # the client is gone: the app hears of it
            return
        try:
            sent = os.write(conn.fileno, data)
        except BlockingIOError:
            sent = 0
        except OSError:
            conn.closed = True
            conn._wake()
            await trio.lowlevel.checkpoint()
            return
        if sent == len(data):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        with trio.CancelScope(deadline=trio.current_time() + WRITE_TIMEOUT, shield=True):
            try:
                await conn.stream.send_all(memoryview(data)[sent:])
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        conn.closed = True  # broken, or the client did not read for WRITE_TIMEOUT
        conn._wake()


class _Server:
    def __init__(self, app: App, *, head_with_body: bool = True) -> None:
        self.app = app
        self.head_with_body = head_with_body
        self.connections: set[_Connection] = set()
        self.shutting_down = False
        self.idle_event = trio.Event()

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = _Connection(self, stream)
        self.connections.add(conn)
        try:
            with conn.scope:
                await self._serve(conn)
        finally:
            self.connections.discard(conn)
            with trio.move_on_after(1, shield=True):
                await trio.aclose_forcefully(stream)
            if not self.connections:
                self.idle_event.set()

    async def _serve(self, conn: _Connection) -> None:
        while not self.shutting_down:
            conn.idle = True
            request = await conn.next_request()
            if request is None:
                return
            conn.idle = False
            exchange = _Exchange(conn, request)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.read_while_serving, request)
                await self._run_app(conn, request, exchange)
                nursery.cancel_scope.cancel()
            if not exchange.done or not exchange.keep_alive or conn.closed:
                return
            if not request.complete:
                return  # answered before its body ended (the head said close)

    async def _run_app(self, conn: _Connection, request: _Request,
                       exchange: _Exchange) -> None:
        path, _, query = request.url.partition(b"?")
        scope: Scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.version, "method": request.method, "scheme": "http",
            "path": _unquote(path), "raw_path": path, "query_string": query,
            "root_path": "", "headers": request.headers,
            "client": conn.client, "server": conn.local,
            # Each send goes out whole or breaks the connection, bounded by WRITE_TIMEOUT,
            # whatever becomes of the app's task: the app needs no shield of its own.
            "extensions": {WHOLE_SENDS: {}},
        }
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except Exception:
            logger.exception("the ASGI app failed serving %s %s", request.method,
                             scope["path"])
        if exchange.body_timed_out and not exchange.started and not conn.closed:
            await conn.refuse(408, b"request body not received in time")
            return
        if conn.closed or exchange.done:
            return
        if not exchange.started:
            await exchange.send({"type": "http.response.start", "status": 500,
                                 "headers": [(b"content-length", b"0")]})
            exchange.keep_alive = False
            await exchange.send({"type": "http.response.body", "body": b"",
                                 "more_body": False})
        elif exchange.head is not None:  # started, nothing sent: an empty answer
            exchange.keep_alive = False
            await exchange.send({"type": "http.response.body", "body": b"",
                                 "more_body": False})
        else:
            # The app returned in the middle of its answer: the client must see a broken
            # answer, not a complete one cut short, so the connection closes as it is.
            conn.closed = True


def _unquote(path: bytes) -> str:
    if b"%" not in path:
        return path.decode("latin-1")
    return unquote_to_bytes(path).decode("utf-8", "replace")


async def serve_http(
    app: App,
    *,
    host: str,
    port: int,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    shutdown_timeout: float = 30.0,
    reuse_port: bool = False,
    head_with_body: bool = True,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` (ASGI 3, http scope) on ``host``:``port`` until cancelled, or until
    ``shutdown_trigger`` returns and the connections have finished.

    With ``head_with_body`` (the router's way) a response's head waits for its first body
    and goes out in the same write; without it (the mock workers', as uvicorn in front of
    a real worker does) the head goes out as soon as the app starts the response, so the
    client knows at once that the worker accepted the request.

    On shutdown the server stops accepting, closes idle keep-alive connections at once,
    lets the others finish the response in progress (then closes them), and after
    ``shutdown_timeout`` seconds cancels what is left. ``task_status`` reports the bound
    port. ``reuse_port`` shares the port with other processes (``SO_REUSEPORT``: see
    :func:`trio_disagg._listen.open_listeners`).

    Raises:
        OSError: the address could not be bound.
    """
    server = _Server(app, head_with_body=head_with_body)
    listeners = await open_listeners(host, port, reuse_port=reuse_port)
    bound = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        accepting = trio.CancelScope()

        async def accept() -> None:
            with accepting:
                await trio.serve_listeners(server.handle, listeners,
                                           handler_nursery=nursery)

        nursery.start_soon(accept)
        task_status.started(bound)
        if shutdown_trigger is None:
            await trio.sleep_forever()
        await shutdown_trigger()
        server.shutting_down = True
        accepting.cancel()
        for conn in list(server.connections):
            conn.closing = True
            if conn.idle:
                conn.scope.cancel()
        with trio.move_on_after(shutdown_timeout):
            while server.connections:
                server.idle_event = trio.Event()
                await server.idle_event.wait()
        nursery.cancel_scope.cancel()
