"""The HTTP/1.1 server (trio_disagg/_http11/) against clients that would make it spend
memory, time or admission slots without bound: pipelined floods, heads made of many tiny
headers, bodies trickled in. Real server, real sockets, each test with the server's one
reader and with a reader task per request (test_http11's ``reads`` fixture)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, ClassVar

import orjson
import pytest
import trio
import trio.testing
from test_http11 import (  # noqa: F401 (reads: the fixture that runs each test twice)
    EchoApp,
    WaitForDisconnectApp,
    post,
    read_all,
    reads,
    serving,
)

from trio_disagg import _http11
from trio_disagg._http11 import _connection, _server

Message = dict[str, Any]


class Recorded(_connection.Connection):
    """The server's connections, kept for a look at what they hold."""

    made: ClassVar[list[Recorded]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        Recorded.made.append(self)


class HoldApp(EchoApp):
    """Echoes each request, but holds ``/hold`` (a long stream's time) until ``go``."""

    def __init__(self) -> None:
        super().__init__()
        self.go = trio.Event()
        self.holding = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["path"] == "/hold":
            self.holding.set()
            await self.go.wait()
        await super().__call__(scope, receive, send)


async def test_pipelined_requests_are_read_ahead_only_up_to_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that pipelines request after request (no body: they cost the read-ahead
    nothing before) while its first one is served has the server stop reading once
    MAX_BUFFERED_BYTES of requests wait, as a body does: one connection held 700 MB of
    parsed requests after 8 s of such a flood. The requests read are answered in order."""
    monkeypatch.setattr(_connection, "MAX_BUFFERED_BYTES", 64 * 1024)
    monkeypatch.setattr(_server, "Connection", Recorded)
    Recorded.made = []
    app = HoldApp()
    get = b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n"
    flood = 20_000
    with trio.fail_after(20):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
            await app.holding.wait()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(s.send_all, get * flood)
                await trio.testing.wait_all_tasks_blocked()
                (conn,) = Recorded.made
                # What one read may bring past the limit, at most.
                bound = (64 * 1024 + _connection.READ_SIZE) // len(get)
                assert len(conn.requests) <= bound < flood
                nursery.cancel_scope.cancel()
            app.go.set()
            answers = b""
            while answers.count(b"HTTP/1.1 200 OK") < 3:
                answers += await s.receive_some(65536)
    first, second = (orjson.loads(part.partition(b"\r\n\r\n")[2].split(b"\r\n")[1])
                     for part in answers.split(b"HTTP/1.1 200 OK")[1:3])
    assert (first["path"], second["path"]) == ("/hold", "/x")


@pytest.mark.parametrize("headers", [101, 20_000])
async def test_a_head_of_many_tiny_headers_gets_a_431(headers: int) -> None:
    """Headers are counted as the bytes they take on the wire (name, value, ``: `` and
    CRLF) and in number (at most MAX_HEADERS): 60 000 empty headers (240 KB, each a
    Python tuple) held 7 MB of the server's memory per connection before."""
    head = b"GET /x HTTP/1.1\r\nhost: x\r\n" + b"a:\r\n" * headers + b"\r\n"
    with trio.fail_after(10):
        async with serving(EchoApp()) as port:
            async with await trio.open_tcp_stream("127.0.0.1", port) as s:
                await s.send_all(head)
                data = await read_all(s)
            assert data.startswith(b"HTTP/1.1 431 ")
            error = orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]
            assert error["code"] == "request_header_fields_too_large"
            async with await trio.open_tcp_stream("127.0.0.1", port) as s:
                await s.send_all(b"GET /x HTTP/1.1\r\nconnection: close\r\n"
                                 + b"a:\r\n" * (_connection.MAX_HEADERS - 1) + b"\r\n")
                assert (await read_all(s)).startswith(b"HTTP/1.1 200 OK")


async def test_a_body_trickled_in_gets_a_408_however_often_a_byte_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body must come at BODY_MIN_RATE bytes a second on average (after BODY_TIMEOUT's
    grace): a byte every so often, each within BODY_TIMEOUT of the last, held the request
    and its admission slot for ever (50 such clients held every slot of a router with
    ``--max-in-flight 50`` for as long as they liked)."""
    monkeypatch.setattr(_http11._exchange, "BODY_TIMEOUT", 0.5)
    monkeypatch.setattr(_http11._exchange, "BODY_MIN_RATE", 100)
    app = EchoApp()
    data = b""
    with trio.fail_after(10):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n")
            while True:  # a byte each 0.1 s until the answer (for ever, before)
                with trio.move_on_after(0.1):
                    data = await s.receive_some(65536)
                    break
                try:
                    await s.send_all(b" ")
                except trio.BrokenResourceError:
                    break  # the server answered and closed
            data += await read_all(s)
    assert data.startswith(b"HTTP/1.1 408")
    assert orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert app.endings == ["disconnect"]


async def test_at_the_connection_limit_the_longest_idle_connection_makes_room() -> None:
    """Connections opened and never written to (or idle keep-alive ones) cannot lock a
    client out: at max_connections the server closes the one idle the longest to accept
    the next. Before, a server with no limit took client connections until it ran out of
    file descriptors: then it could neither accept a client nor open a connection to a
    worker (its health probes failed, and the workers were marked down)."""
    app = EchoApp()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port: int = await nursery.start(partial(
                _http11.serve_http, app, host="127.0.0.1", port=0, max_connections=2))
            idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
            async with await trio.open_tcp_stream("127.0.0.1", port) as s:
                await s.send_all(b"GET /x HTTP/1.1\r\nconnection: close\r\n\r\n")
                assert (await read_all(s)).startswith(b"HTTP/1.1 200 OK")
            assert await idle[0].receive_some(1) == b""  # the first opened: closed
            await idle[1].send_all(b"GET /y HTTP/1.1\r\nconnection: close\r\n\r\n")
            assert b'"path":"/y"' in await read_all(idle[1])
            for stream in idle:
                await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_at_the_connection_limit_a_head_still_coming_makes_room() -> None:
    """With every connection sending its headers a byte at a time (none idle), the one
    whose head began the longest ago is closed for the new client: slow headers hold the
    server's connections no longer than an idle client's."""
    app = EchoApp()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port: int = await nursery.start(partial(
                _http11.serve_http, app, host="127.0.0.1", port=0, max_connections=2))
            slow = []
            for _ in range(2):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(b"GET /slow HTTP/1.1\r\nx-a: ")
                slow.append(stream)
                await trio.testing.wait_all_tasks_blocked()  # its head began
            async with await trio.open_tcp_stream("127.0.0.1", port) as s:
                await s.send_all(b"GET /x HTTP/1.1\r\nconnection: close\r\n\r\n")
                assert (await read_all(s)).startswith(b"HTTP/1.1 200 OK")
            assert await read_all(slow[0]) == b""  # the oldest head: closed
            await slow[1].send_all(b"b\r\nconnection: close\r\n\r\n")
            assert b'"path":"/slow"' in await read_all(slow[1])
            for stream in slow:
                await stream.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("chunks", [
    b"zz\r\n{}\r\n0\r\n\r\n",
    b"2\r\n{}XX\r\n0\r\n\r\n",
    b"2\r\n{}\r\nzz\r\n",
    b"2\r\n{}\r\n0\r\n" + b"x-t: y\r\n" * 20_000 + b"\r\n",
], ids=["bad first chunk size", "no line end after data", "bad later chunk size",
        "trailers too large"])
async def test_a_body_that_is_not_http_is_answered_at_once(
    monkeypatch: pytest.MonkeyPatch, chunks: bytes,
) -> None:
    """A chunked body that is not HTTP, from its start or half-way (or whose trailers are
    too large), is a malformed request like a head that is not: its request ends at once
    with the server's 400 ``malformed_request`` (431). The app, waiting for a body that
    would never parse, held the request (and its admission slot) until BODY_TIMEOUT, and
    the client got a 408 for a request it had sent whole."""
    monkeypatch.setattr(_http11._exchange, "BODY_TIMEOUT", 1)
    app = EchoApp()
    with trio.fail_after(10):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
                             b"\r\n" + chunks)
            data = await read_all(s)
    head, _, body = data.partition(b"\r\n\r\n")
    if b"x-t" in chunks:
        assert head.startswith(b"HTTP/1.1 431")
    else:
        assert head.startswith(b"HTTP/1.1 400")
        assert orjson.loads(body)["error"]["code"] == "malformed_request"
    assert app.endings == ["disconnect"]


async def test_a_client_that_half_closes_after_its_request_has_left() -> None:
    """``shutdown(SHUT_WR)`` after the request is the end of the connection, as for
    nginx, uvicorn and Go (docs/router.md): the app hears the disconnect at once (C3),
    and the server closes the connection without writing to it."""
    app = WaitForDisconnectApp()
    with trio.fail_after(10):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(post(b"/wait", b"{}"))
            await app.waiting.wait()
            await s.send_eof()
            assert await read_all(s) == b""
    assert app.heard == ["disconnect"]


async def test_at_the_connection_limit_every_listener_gets_its_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host that resolves to two addresses (``localhost``: 127.0.0.1 and ::1) has two
    listeners, each accepting on its own. At the limit both may wait for room at once:
    each is served once connections close. The second used to replace the event the
    first waited on, and the first listener never accepted again."""
    listeners: list[trio.SocketListener] = []

    async def two_listeners(host: str, port: int, **kwargs: Any) -> list[trio.SocketListener]:
        for _ in range(2):
            listeners.extend(await trio.open_tcp_listeners(0, host="127.0.0.1"))
        return listeners

    monkeypatch.setattr(_server, "open_listeners", two_listeners)
    app = HoldApp()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(
                _http11.serve_http, app, host="127.0.0.1", port=0, max_connections=2))
            ports = [listener.socket.getsockname()[1] for listener in listeners]
            held = []
            for _ in range(2):  # the two connections allowed, both serving
                stream = await trio.open_tcp_stream("127.0.0.1", ports[0])
                await stream.send_all(b"GET /hold HTTP/1.1\r\nconnection: close\r\n\r\n")
                held.append(stream)
                await trio.testing.wait_all_tasks_blocked()
            waiting = []
            for port in ports:  # one more on each listener: both wait for room
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(b"GET /x HTTP/1.1\r\nconnection: close\r\n\r\n")
                waiting.append(stream)
                await trio.testing.wait_all_tasks_blocked()
            app.go.set()
            for stream in held + waiting:
                assert (await read_all(stream)).startswith(b"HTTP/1.1 200 OK")
                await stream.aclose()
            nursery.cancel_scope.cancel()


class SkipBodyApp(EchoApp):
    """Echoes each request, but answers ``/skip`` at once without reading its body (as an
    edge refusal does: a 401, a 503 of admission control)."""

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["path"] != "/skip":
            await super().__call__(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})


async def test_a_body_the_app_did_not_read_stops_counting_in_the_read_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bodies of requests answered without being read (refusals at the edge, on a
    keep-alive connection) leave the read-ahead when their request ends. They used to
    stay counted for the connection's life: past MAX_BUFFERED_BYTES of them the server
    stopped reading the connection while it served a request, and the next body that
    came in more than one read got a 408 (and a client leaving was not heard, C3)."""
    monkeypatch.setattr(_connection, "MAX_BUFFERED_BYTES", 1000)
    monkeypatch.setattr(_http11._exchange, "BODY_TIMEOUT", 1)
    app = SkipBodyApp()
    with trio.fail_after(10):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            for _ in range(6):  # 1200 bytes of bodies never read
                await s.send_all(post(b"/skip", b"x" * 200))
                data = b""
                while not data.endswith(b"\r\n\r\n{}"):
                    data += await s.receive_some(65536)
                assert data.startswith(b"HTTP/1.1 401 ")
            await s.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n"
                             b"connection: close\r\n\r\n12345")
            await trio.testing.wait_all_tasks_blocked()  # the app waits for the rest
            await s.send_all(b"67890")
            data = await read_all(s)
    assert data.startswith(b"HTTP/1.1 200 OK"), data
    assert b'"body":"1234567890"' in data
