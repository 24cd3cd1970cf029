"""The router's HTTP/1.1 server (trio_disagg/_http11/) byte for byte, on real sockets: framing,
keep-alive, pipelining, 100-continue, and the answers it gives by itself (400, 408)."""

from __future__ import annotations

import errno
import gzip
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import orjson
import pytest
import trio
import trio.testing

from trio_disagg import _http11
from trio_disagg._http11._watch import ReadWatch

Message = dict[str, Any]


@pytest.fixture(params=["one reader", "a reader a request"], autouse=True)
def reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: the served connections read by the server's one reader (epoll),
    and each by a task of its own (where there is no epoll)."""
    if request.param == "a reader a request":
        monkeypatch.setattr(ReadWatch, "available", False)
    return str(request.param)


class EchoApp:
    """Answers each request with its method, path and body, as JSON; remembers how each
    request ended (``"answered"`` or ``"disconnect"``)."""

    def __init__(self) -> None:
        self.endings: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.endings.append("disconnect")
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        answer = orjson.dumps({"method": scope["method"], "path": scope["path"],
                               "body": body.decode()})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer, "more_body": False})
        self.endings.append("answered")


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[int]:
    async with trio.open_nursery() as nursery:
        port: int = await nursery.start(partial(_http11.serve_http, app, host="127.0.0.1",
                                                port=0))
        yield port
        nursery.cancel_scope.cancel()


async def read_all(stream: trio.SocketStream) -> bytes:
    data = b""
    while part := await stream.receive_some(65536):
        data += part
    return data


def post(path: bytes, body: bytes, *extra: bytes) -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n" % len(body)
            + b"".join(extra) + b"\r\n" + body)


async def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    app = EchoApp()
    with trio.fail_after(10):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(post(b"/a", b"one") + post(b"/b", b"two")
                             + post(b"/c", b"three", b"connection: close\r\n"))
            data = await read_all(s)
    answers = [part for part in data.split(b"HTTP/1.1 200 OK\r\n") if part]
    assert len(answers) == 3
    bodies = [orjson.loads(_http11_dechunk(a.partition(b"\r\n\r\n")[2])) for a in answers]
    assert [(b["path"], b["body"]) for b in bodies] == [("/a", "one"), ("/b", "two"),
                                                       ("/c", "three")]
    assert b"connection: close" in answers[2]
    assert app.endings == ["answered"] * 3


async def test_expect_100_continue_is_answered_before_the_body() -> None:
    app = EchoApp()
    with trio.fail_after(10):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
                             b"expect: 100-continue\r\nconnection: close\r\n\r\n")
            first = await s.receive_some(65536)
            assert first.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            await s.send_all(b"hello")
            data = first + await read_all(s)
    assert b'"body":"hello"' in data


async def test_a_malformed_request_gets_an_openai_shaped_400() -> None:
    with trio.fail_after(10):
        async with serving(EchoApp()) as port, \
                await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(b"NOT HTTP AT ALL\r\n\r\n")
            data = await read_all(s)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    error = orjson.loads(body)["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", None, "malformed_request")


async def test_a_body_that_stops_coming_ends_the_request_with_a_408(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that sends its headers and part of its body, then nothing, does not hold
    the request (and its admission slot) for ever."""
    monkeypatch.setattr(_http11._exchange, "BODY_TIMEOUT", 0.2)
    app = EchoApp()
    with trio.fail_after(10):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
            data = await read_all(s)
    assert data.startswith(b"HTTP/1.1 408")
    assert orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert app.endings == ["disconnect"]


async def test_a_body_that_trickles_in_still_gets_a_408_from_its_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that sends its body a byte at a time, each well within BODY_TIMEOUT, does
    not hold the request (and its admission slot: --max-in-flight) for as long as it
    likes: once BODY_TIMEOUT from its head has passed, the body must come at BODY_MIN_RATE
    on average, as the head must be in HEADERS_TIMEOUT after its first byte."""
    monkeypatch.setattr(_http11._exchange, "BODY_TIMEOUT", 0.3)
    app = EchoApp()
    body = b"x" * 200
    with trio.fail_after(10):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
                             % len(body))

            async def trickle() -> None:
                for at in range(len(body)):  # 200 bytes, 20 ms apart: 4 s in all
                    await trio.sleep(0.02)
                    try:
                        await s.send_all(body[at:at + 1])
                    except trio.BrokenResourceError:
                        return  # the server closed the connection

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trickle)
                data = await read_all(s)
                nursery.cancel_scope.cancel()
    assert data.startswith(b"HTTP/1.1 408")
    assert orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert app.endings == ["disconnect"]


def _http11_dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return out


async def test_a_client_that_stops_reading_loses_its_connection_after_the_write_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A send goes out whole or breaks the connection: a client that reads nothing while
    a large answer waits is cut off after WRITE_TIMEOUT, and the app's send returns."""
    monkeypatch.setattr(_http11._exchange, "WRITE_TIMEOUT", 0.3)
    big = b"x" * (32 * 1024 * 1024)
    sent = trio.Event()

    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                  send: Callable[[Message], Awaitable[None]]) -> None:
        assert _http11.WHOLE_SENDS in scope["extensions"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": big, "more_body": True})
        sent.set()

    with trio.fail_after(10):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            await sent.wait()  # the send returned although nobody read
            data = await read_all(s)
    assert data.startswith(b"HTTP/1.1 200")
    assert len(data) < len(big)  # cut off, not delivered whole


class _ListenerOutOfFiles:
    """A listener whose first accept fails for want of file descriptors."""

    def __init__(self, stream: object) -> None:
        self.stream = stream
        self.accepts = 0

    async def __aenter__(self) -> _ListenerOutOfFiles:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def accept(self) -> object:
        self.accepts += 1
        if self.accepts == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        if self.accepts == 2:
            return self.stream
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_accept_waits_and_retries_when_out_of_file_descriptors(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """EMFILE and its kin are a lack of capacity, not a crash: the server logs, waits
    ACCEPT_RETRY_DELAY seconds and accepts again."""
    server = _http11.Server(_never_called_app)
    handled: list[object] = []
    accepted = trio.Event()

    async def handle(stream: object) -> None:
        handled.append(stream)
        accepted.set()

    server.handle = handle  # type: ignore[method-assign]
    listener = _ListenerOutOfFiles(stream=object())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.accept, listener, nursery)  # type: ignore[arg-type]
        await accepted.wait()
        assert trio.current_time() == pytest.approx(_http11.ACCEPT_RETRY_DELAY)
        nursery.cancel_scope.cancel()
    assert handled == [listener.stream]
    assert "accept failed" in caplog.text


async def _never_called_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("no request was made")


class StreamingApp:
    """Streams ``parts`` body parts, each once ``go`` is set for it: the test decides
    when the response goes on."""

    def __init__(self, parts: int) -> None:
        self.parts = parts
        self.go = trio.Semaphore(0)
        self.sent = 0

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(self.parts):
            await self.go.acquire()
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % i,
                        "more_body": i < self.parts - 1})
            self.sent += 1


async def test_bytes_that_are_not_http_during_a_response_never_tear_it() -> None:
    """Garbage from the client while its response streams: the response goes on whole,
    the 400 the server owes comes after its end, and the server serves on (a refusal
    written into the stream tore it, and one written beside a blocked write crashed the
    server)."""
    app = StreamingApp(parts=3)
    with trio.fail_after(10):
        async with serving(app) as port:
            async with await trio.open_tcp_stream("127.0.0.1", port) as s:
                await s.send_all(post(b"/stream", b""))
                app.go.release()
                head = await s.receive_some(65536)
                assert head.startswith(b"HTTP/1.1 200 OK")
                await s.send_all(b"\x00\r\n\r\n")  # not HTTP
                await trio.testing.wait_all_tasks_blocked()
                app.go.release()
                app.go.release()
                data = head + await read_all(s)
            end = data.index(b"\r\n0\r\n\r\n")  # the chunked body's end
            assert b"data: 2" in data[:end] and b"HTTP/1.1 400" not in data[:end]
            assert data[end:].count(b"HTTP/1.1 400 Bad Request") == 1
            async with await trio.open_tcp_stream("127.0.0.1", port) as again:
                await again.send_all(b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n")
                for _ in range(app.parts):
                    app.go.release()
                assert (await again.receive_some(65536)).startswith(b"HTTP/1.1 200 OK")


async def test_headers_trickled_in_still_get_a_408_from_their_first_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that sends its headers a few bytes at a time, each well within the
    timeout, gets its 408 HEADERS_TIMEOUT after the first byte: a read does not restart
    the clock (a slow-headers client would otherwise hold the connection for ever)."""
    monkeypatch.setattr(_http11._connection, "HEADERS_TIMEOUT", 0.5)
    head = b"POST /x HTTP/1.1\r\nhost: x\r\nx-padding: " + b"a" * 200
    with trio.fail_after(10):
        async with serving(EchoApp()) as port, \
                await trio.open_tcp_stream("127.0.0.1", port) as s:
            start = trio.current_time()
            for i in range(0, len(head), 8):
                try:
                    await s.send_all(head[i:i + 8])
                except trio.BrokenResourceError:
                    break  # the server answered and closed
                with trio.move_on_after(0.1):
                    data = await s.receive_some(65536)
                    break
            else:
                data = await read_all(s)
    assert data.startswith(b"HTTP/1.1 408")
    assert trio.current_time() - start < 1.5


class WaitForDisconnectApp:
    """Registers for its client's disconnect and waits for it, writing nothing (a request
    whose prefill runs); its callback may fail."""

    def __init__(self, *, callback_fails: bool = False) -> None:
        self.callback_fails = callback_fails
        self.waiting = trio.Event()
        self.gone = trio.Event()
        self.heard: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["path"] != "/wait":
            await EchoApp()(scope, receive, send)
            return
        def on_disconnect() -> None:
            self.heard.append("disconnect")
            self.gone.set()
            if self.callback_fails:
                raise RuntimeError("the app's disconnect callback failed")

        scope["extensions"][_http11.ON_DISCONNECT]["register"](on_disconnect)
        self.waiting.set()
        await self.gone.wait()

    async def leave_while_waiting(self, port: int) -> None:
        """A client sends a request to /wait, and closes its connection once the app
        waits."""
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all(post(b"/wait", b"{}"))
        await self.waiting.wait()
        await s.aclose()


async def test_a_client_that_leaves_while_nothing_is_written_is_heard_at_once() -> None:
    """C3: the app hears of a client that closed its connection while its request was
    served and nothing was written (the prefill's time), not at its next write."""
    app = WaitForDisconnectApp()
    with trio.fail_after(10):
        async with serving(app) as port:
            await app.leave_while_waiting(port)
            await app.gone.wait()
    assert app.heard == ["disconnect"]


async def test_a_failing_disconnect_callback_ends_its_connection_not_the_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = WaitForDisconnectApp(callback_fails=True)
    with trio.fail_after(10):
        async with serving(app) as port:
            await app.leave_while_waiting(port)
            async with await trio.open_tcp_stream("127.0.0.1", port) as again:
                await again.send_all(post(b"/echo", b"after", b"connection: close\r\n"))
                data = await read_all(again)
    assert data.startswith(b"HTTP/1.1 200 OK") and b'"body":"after"' in data
    assert app.heard == ["disconnect"]
    assert "the app's disconnect callback failed" in caplog.text


class SlowBodyApp(EchoApp):
    """Echoes the body, starting to read it only once ``go`` is set: the server reads
    ahead meanwhile, then stops reading until the app takes some."""

    def __init__(self) -> None:
        super().__init__()
        self.go = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        await self.go.wait()
        await super().__call__(scope, receive, send)


async def test_a_body_larger_than_the_read_ahead_arrives_whole() -> None:
    """The server stops reading a request body past its read-ahead limit until the app
    takes some, then reads on: a body of 2.5 times the limit arrives whole."""
    body = bytes(range(97, 123)) * (_http11._connection.MAX_BUFFERED_BYTES * 5 // 2 // 26)
    app = SlowBodyApp()
    with trio.fail_after(20):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(s.send_all, post(b"/big", body, b"connection: close\r\n"))
                await trio.testing.wait_all_tasks_blocked()
                app.go.set()
            data = await read_all(s)
    assert orjson.loads(_http11_dechunk(data.partition(b"\r\n\r\n")[2]))["body"] == (
        body.decode())


async def test_a_chunked_bodys_trailers_do_not_become_headers() -> None:
    """Trailers after a chunked body count towards the head's limits, but the app's
    headers are the head's: a trailer cannot add one the client did not send in its head
    (an ``authorization`` after the edge checked the head, say). ASGI has no request
    trailers; they are dropped, as uvicorn does."""
    seen: list[list[tuple[bytes, bytes]]] = []

    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                  send: Callable[[Message], Awaitable[None]]) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen.append(list(scope["headers"]))  # after the whole body, trailers included
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    with trio.fail_after(10):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
                             b"connection: close\r\n\r\n2\r\n{}\r\n0\r\n"
                             b"authorization: Bearer sneaked-in\r\n\r\n")
            data = await read_all(s)
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"{}\r\n0\r\n\r\n")
    (headers,) = seen
    assert [name for name, _ in headers] == [b"host", b"transfer-encoding", b"connection"]


async def test_a_header_value_comes_without_its_surrounding_whitespace() -> None:
    """RFC 9110 section 5.5: a field value excludes the whitespace around it. The trailing
    whitespace stayed: ``X-Request-Id: abc  `` came back as the id ``cmpl-abc  ``, and a
    client's ``Authorization`` key with a trailing space was refused."""
    seen: list[list[tuple[bytes, bytes]]] = []

    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                  send: Callable[[Message], Awaitable[None]]) -> None:
        seen.append(list(scope["headers"]))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    with trio.fail_after(10):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(b"GET / HTTP/1.1\r\nhost: x\r\nx-request-id:  abc \t \r\n"
                             b"x-inner: a  b\r\nconnection: close\r\n\r\n")
            data = await read_all(s)
    assert data.startswith(b"HTTP/1.1 204")
    headers = dict(seen[0])
    assert (headers[b"x-request-id"], headers[b"x-inner"]) == (b"abc", b"a  b")


@pytest.mark.parametrize("head", [
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n"
                 b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
                 b"http2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n{}", id="curl-http2"),
    pytest.param(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\n"
                 b"upgrade: websocket\r\n\r\n", id="websocket"),
])
async def test_an_upgrade_is_refused_with_a_400_and_never_served_without_its_body(
        head: bytes) -> None:
    """An offer to switch protocols (``curl --http2`` on an ``http://`` URL offers h2c)
    gets the documented 400. httptools stops parsing at the head of such a request (what
    follows would be the new protocol's): served, it reached the app with its body
    dropped, and the client got the app's answer to an empty body."""
    with trio.fail_after(10):
        async with serving(_never_called_app) as port, \
                await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(head)
            data = await read_all(s)
    status, _, body = data.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400 Bad Request\r\n"), data
    error = orjson.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "malformed_request")
    assert "upgrades are not supported" in error["message"]


@pytest.mark.parametrize("codings", [b"gzip, chunked", b"deflate,chunked", b"x-custom , chunked"])
async def test_a_transfer_coding_other_than_chunked_gets_a_501_and_is_never_served(
        codings: bytes) -> None:
    """httptools frames a body sent ``Transfer-Encoding: gzip, chunked`` by its chunks
    and leaves the gzip on: served, the app read compressed bytes as the body (the router
    answered 400 invalid_json for a body the client had sent right). RFC 9112 section
    6.1: a transfer coding the server does not understand is a 501."""
    payload = gzip.compress(b'{"a": 1}')
    with trio.fail_after(10):
        async with serving(_never_called_app) as port, \
                await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: " + codings
                             + b"\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))
            data = await read_all(s)
    status, _, body = data.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 501 Not Implemented\r\n"), data
    error = orjson.loads(body)["error"]
    assert error["code"] == "not_implemented" and "Transfer-Encoding" in error["message"]


@pytest.mark.parametrize("seconds", [0.2, 0.5])
async def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(
        seconds: float) -> None:
    """``keep_alive_timeout``: an idle connection is kept that long after its last
    response (a load balancer in front may keep its own longer: serve's
    ``--keep-alive-timeout``), then closed; a connection in use is not."""
    async with trio.open_nursery() as nursery:
        port: int = await nursery.start(partial(
            _http11.serve_http, EchoApp(), host="127.0.0.1", port=0,
            keep_alive_timeout=seconds))
        with trio.fail_after(10):
            async with await trio.open_tcp_stream("127.0.0.1", port) as s:
                sent = trio.current_time()  # (the server's idle wait starts after it)
                await s.send_all(post(b"/a", b"one"))
                data = b""
                while not data.endswith(b"0\r\n\r\n"):
                    data += await s.receive_some(65536)
                assert data.startswith(b"HTTP/1.1 200")
                assert await s.receive_some(65536) == b""  # closed by the server
                assert trio.current_time() - sent >= seconds
        nursery.cancel_scope.cancel()
    with pytest.raises(ValueError, match="keep_alive_timeout"):
        await _http11.serve_http(EchoApp(), host="127.0.0.1", port=0, keep_alive_timeout=0)


async def test_a_stream_sent_through_the_whole_sends_body_is_the_bytes_of_its_messages(
) -> None:
    """The ``WHOLE_SENDS`` extension's ``body`` (the relay's per-output write) frames each
    part as ``send()`` does: the same bytes on the wire, an empty part writing nothing,
    the head with the first part, and a HEAD request's parts never written."""
    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                  send: Callable[[Message], Awaitable[None]]) -> None:
        await receive()
        body = scope["extensions"][_http11.WHOLE_SENDS]["body"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        parts = [b"data: 1\n\n", b"", b"data: 2\n\n"]
        for part in parts:
            if scope["path"] == "/direct":
                await body(part)
            else:
                await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: 3\n\n", "more_body": False})

    answers = {}
    with trio.fail_after(10):
        async with serving(app) as port:
            for path in (b"/direct", b"/messages"):
                async with await trio.open_tcp_stream("127.0.0.1", port) as s:
                    await s.send_all(post(path, b"", b"connection: close\r\n"))
                    answers[path] = await read_all(s)
            async with await trio.open_tcp_stream("127.0.0.1", port) as s:
                await s.send_all(b"HEAD /direct HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                head_answer = await read_all(s)
    assert answers[b"/direct"] == answers[b"/messages"]
    head, _, body = answers[b"/direct"].partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head
    assert body == b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n9\r\ndata: 3\n\n\r\n0\r\n\r\n"
    assert head_answer.endswith(b"\r\n\r\n") and b"data:" not in head_answer


async def test_a_send_the_socket_takes_at_once_is_no_schedule_point() -> None:
    """As uvicorn's send: a part the socket takes at once costs no schedule point (the
    app's next wait is one, P4a); a part the socket cannot take yet (a full buffer) is
    waited for, and other tasks run meanwhile."""
    ran_during: list[bool] = []

    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                  send: Callable[[Message], Awaitable[None]]) -> None:
        await receive()
        ran: list[bool] = []

        async def other() -> None:
            ran.append(True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            big = b"x" * 32 * 1024 * 1024  # more than the sockets' buffers hold
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/plain"), (b"content-length", b"%d" % (5 + len(big)))]})
            await send({"type": "http.response.body", "body": b"small", "more_body": True})
            ran_during.append(bool(ran))
            await send({"type": "http.response.body", "body": big, "more_body": False})
            ran_during.append(bool(ran))

    with trio.fail_after(10):
        async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as s:
            await s.send_all(post(b"/", b"", b"connection: close\r\n"))
            answer = await read_all(s)
    assert answer.endswith(b"\r\n\r\nsmall" + b"x" * 32 * 1024 * 1024)
    assert ran_during == [False, True]


async def test_pipelined_requests_the_app_answers_at_once_let_other_tasks_run() -> None:
    """A send has no schedule point when the socket takes it: a burst of pipelined
    requests that the app answers without a wait of its own still gives the other tasks
    a turn between two of them (a schedule point per request that was already there)."""
    turns = 0
    seen: list[int] = []

    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                  send: Callable[[Message], Awaitable[None]]) -> None:
        await receive()
        seen.append(turns)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await trio.lowlevel.checkpoint()

    with trio.fail_after(10):
        async with serving(app) as port, trio.open_nursery() as nursery:
            nursery.start_soon(other)
            async with await trio.open_tcp_stream("127.0.0.1", port) as s:
                await s.send_all(post(b"/", b"") * 9 + post(b"/", b"", b"connection: close\r\n"))
                answer = await read_all(s)
            nursery.cancel_scope.cancel()
    assert answer.count(b"HTTP/1.1 200") == 10
    assert seen == sorted(set(seen)), seen  # the other task ran between any two
