"""The HTTP/1.1 server's listening side: connections accepted, requests served one at a
time per connection with the ASGI app, and the graceful shutdown (B3)."""

from __future__ import annotations

import errno
import logging
import os
import resource
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote_to_bytes

import trio

from .._listen import open_listeners
from ._connection import KEEP_ALIVE_TIMEOUT, Connection, Request
from ._exchange import Exchange, Message
from ._watch import ReadWatch

logger = logging.getLogger("trio_disagg.server")

Scope = dict[str, Any]
App = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
               Awaitable[None]]

#: The ASGI scope extension saying that this server's sends are whole or break the
#: connection, each bounded by the write timeout (so an app need not shield them). Its
#: ``"body"`` sends ``{"type": "http.response.body", "body": data, "more_body": True}``
#: as ``await body(data)``: no message made and read for each part of a stream.
WHOLE_SENDS = "trio_disagg.whole_sends"
#: The ASGI scope extension with which an app hears of its client's disconnect without a
#: task of its own: ``scope["extensions"][ON_DISCONNECT]["register"](callback)`` has the
#: server call ``callback()`` once, synchronously, when the client goes away (or the
#: connection breaks) while this request is served; at once if it is already gone.
ON_DISCONNECT = "trio_disagg.on_disconnect"

#: accept() errors that mean no capacity for now (file descriptors, memory): wait this
#: many seconds and accept again, as trio's serve_listeners does.
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_DELAY = 0.1
#: The share of the file descriptors still free when the server starts that client
#: connections may take (by default): the rest stay for what the app opens, connections
#: to the workers and their health probes, which a flood of clients must not starve.
CLIENT_FD_SHARE = 0.5


def descriptors_left() -> tuple[int, int]:
    """The file descriptors the process may still open (``RLIMIT_NOFILE`` less those open
    now), and that limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: a guess
        open_now = 32
    return soft - open_now, soft


def default_max_connections() -> int:
    """The connections a server accepts at once by default: :data:`CLIENT_FD_SHARE` of the
    file descriptors the process may still open (:func:`descriptors_left`)."""
    return max(1, int(descriptors_left()[0] * CLIENT_FD_SHARE))


class Server:
    def __init__(self, app: App, *, head_with_body: bool = True,
                 watch: ReadWatch | None = None, max_connections: int | None = None,
                 keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT) -> None:
        self.app = app
        self.head_with_body = head_with_body
        self.keep_alive_timeout = keep_alive_timeout
        #: Reads the served connections in one task (else each in a task of its own).
        self.watch = watch
        #: Connections open at once, at most (None: no limit).
        self.max_connections = max_connections
        self.connections: set[Connection] = set()
        self.accepted = 0  # connections accepted and not yet closed
        self.shutting_down = False
        self.idle_event = trio.Event()
        #: Set when a connection opens, goes idle or closes (room may be made).
        self.churn = trio.Event()
        self.room = trio.Lock()  # held by the listener waiting for room (_make_room)

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = Connection(stream, head_with_body=self.head_with_body,
                          keep_alive_timeout=self.keep_alive_timeout)
        self.connections.add(conn)
        self.churn.set()
        try:
            with conn.scope:
                await self._serve(conn)
        except Exception:
            # One connection's failure (a bug, an unforeseen socket state) closes that
            # connection, never the server and the others.
            logger.exception("the connection from %s failed", conn.client)
        finally:
            # Closed at once: a socket's close needs no wait (a forced aclose would cost
            # a cancel scope and a raised Cancelled a connection).
            stream.socket.close()
            conn.parser = None  # (a reference cycle: see Connection)
            self.connections.discard(conn)
            self.accepted -= 1
            self.churn.set()
            if not self.connections:
                self.idle_event.set()

    async def accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept connections on ``listener`` until cancelled, each handled in
        ``nursery``."""
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                        raise
                    logger.error("accept failed: %s; accepting again in %g s",
                                 os.strerror(exc.errno), ACCEPT_RETRY_DELAY)
                    await trio.sleep(ACCEPT_RETRY_DELAY)
                else:
                    handed = counted = False
                    try:
                        if not self.room.locked() and (
                                self.max_connections is None
                                or self.accepted < self.max_connections):
                            self.accepted += 1  # room for it: no wait, no schedule point
                            counted = True
                        else:
                            # One listener at a time waits for room: two (a host's two
                            # addresses) would each wait on an event the other replaced.
                            async with self.room:
                                self.accepted += 1
                                counted = True
                                await self._make_room()
                        nursery.start_soon(self.handle, stream)
                        handed = True
                    finally:
                        if not handed:  # cancelled (shutdown) while waiting for room
                            self.accepted -= counted
                            stream.socket.close()

    async def _make_room(self) -> None:
        """Return once the connection just accepted may be served. Past
        ``max_connections`` a connection that holds no whole request is closed to make
        room: the one idle the longest, else (a slow-headers client) the one whose
        head began the longest ago. With none, the next to close or go idle is waited
        for, and the clients that come meanwhile wait in the listen backlog. So the
        server never runs out of file descriptors for its clients' sake, and connections
        held open doing nothing never lock other clients out."""
        while self.max_connections is not None and self.accepted > self.max_connections:
            idle = [conn for conn in self.connections
                    if conn.idle and not conn.closing and not conn.requests]
            if idle:
                oldest = min(idle, key=lambda conn: (conn.parsing is not None,
                                                     conn.idle_since, conn.head_deadline))
                oldest.closing = True
                oldest.scope.cancel()
            self.churn = trio.Event()
            await self.churn.wait()

    async def shut_down(self, grace: float) -> None:
        """Close the idle connections, and wait at most ``grace`` seconds for the others
        to finish the response in progress (accepting has stopped)."""
        self.shutting_down = True
        for conn in list(self.connections):
            conn.closing = True
            if conn.idle:
                conn.scope.cancel()
        with trio.move_on_after(grace):
            while self.connections:
                self.idle_event = trio.Event()
                await self.idle_event.wait()

    async def _serve(self, conn: Connection) -> None:
        while not self.shutting_down:
            conn.idle = True
            conn.idle_since = trio.current_time()
            self.churn.set()  # a client waiting for room may have this one's
            request = await conn.next_request()
            if request is None:
                return
            conn.idle = False
            exchange = Exchange(conn, request)
            if self.watch is not None:
                self.watch.add(conn)
                try:
                    await self._run_app(conn, request, exchange)
                finally:
                    conn.on_gone = None  # the request is over: its app hears no more
                    self.watch.discard(conn)
            else:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(conn.read_while_serving, request)
                    try:
                        await self._run_app(conn, request, exchange)
                    finally:
                        conn.on_gone = None
                    nursery.cancel_scope.cancel()
            if exchange.body_timed_out and not exchange.started and not conn.closed:
                # Answered once nothing else reads the connection: the client may still
                # be sending its body, which the lingering close reads and throws away
                # (closed with it unread, the client would get a reset, not the 408).
                await conn.refuse(408, b"request body not received in time", linger=True)
                return
            conn.request_over(request)
            if not exchange.done or not exchange.keep_alive or conn.closed:
                return
            if not request.complete:
                return  # answered before its body ended (the head said close)

    async def _run_app(self, conn: Connection, request: Request,
                       exchange: Exchange) -> None:
        path, _, query = request.url.partition(b"?")
        scope: Scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.version, "method": request.method, "scheme": "http",
            "path": unquote(path), "raw_path": path, "query_string": query,
            "root_path": "", "headers": request.headers,
            "client": conn.client, "server": conn.local,
            # Each send goes out whole or breaks the connection, bounded by WRITE_TIMEOUT,
            # whatever becomes of the app's task: the app needs no shield of its own.
            "extensions": {WHOLE_SENDS: {"body": exchange.send_body},
                           ON_DISCONNECT: {"register": conn.on_disconnect}},
        }
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except Exception:
            logger.exception("the ASGI app failed serving %s %s", request.method,
                             scope["path"])
        if not exchange.started and not conn.closed:
            if exchange.body_timed_out:
                return  # the 408 is _serve's, once the connection is no longer read
            if conn.refusal is not None and not request.complete:  # the body broke off
                # Nothing reads the connection any more (a refusal stops the reads).
                await conn.refuse(*conn.refusal, linger=True)
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


def unquote(path: bytes) -> str:
    if b"%" not in path:
        return path.decode("latin-1")
    return unquote_to_bytes(path).decode("utf-8", "replace")


async def serve_http(
    app: App, *, host: str, port: int,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    shutdown_timeout: float = 30.0, reuse_port: bool = False, head_with_body: bool = True,
    max_connections: int | None = None, keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT,
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

    At most ``max_connections`` client connections are open at once (default: half of
    the file descriptors left, :func:`default_max_connections`): past it the one idle the
    longest is closed to make room, or the new client waits in the listen backlog. An
    idle keep-alive connection is closed after ``keep_alive_timeout`` seconds without a
    request.

    Raises:
        OSError: the address could not be bound.
        ValueError: ``max_connections`` < 1, or ``keep_alive_timeout`` not > 0.
    """
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    if not keep_alive_timeout > 0:
        raise ValueError(f"keep_alive_timeout must be > 0 seconds, got {keep_alive_timeout}")
    server = Server(app, head_with_body=head_with_body,
                    watch=ReadWatch() if ReadWatch.available else None,
                    max_connections=max_connections or default_max_connections(),
                    keep_alive_timeout=keep_alive_timeout)
    listeners = await open_listeners(host, port, reuse_port=reuse_port)
    bound = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        if server.watch is not None:
            nursery.start_soon(server.watch.run)
        accepting = trio.CancelScope()

        async def accept() -> None:
            with accepting:
                async with trio.open_nursery() as accepters:
                    for listener in listeners:
                        accepters.start_soon(server.accept, listener, nursery)

        nursery.start_soon(accept)
        task_status.started(bound)
        if shutdown_trigger is None:
            await trio.sleep_forever()
        await shutdown_trigger()
        accepting.cancel()
        await server.shut_down(shutdown_timeout)
        nursery.cancel_scope.cancel()
