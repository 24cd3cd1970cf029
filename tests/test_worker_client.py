"""The worker client (engines.WorkerClient): keep-alive HTTP/1.1 over trio, against real
sockets on loopback. Each test's server is a few lines of raw HTTP, so the client's framing,
reuse and abort behaviour are checked byte for byte."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest
import trio

from trio_disagg.engines import (
    ConnectError,
    PoolTimeout,
    ReadTimeout,
    RemoteProtocolError,
    WorkerClient,
)

Handler = Callable[[trio.SocketStream], Awaitable[None]]
HEADERS = {b"content-type": b"application/json"}


async def read_request(stream: trio.SocketStream, buffer: bytearray) -> bytes | None:
    """One request's bytes (head and content-length body) from ``buffer`` + the stream;
    None at EOF."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        rest += data
    buffer[:] = rest[length:]
    return head + b"\r\n\r\n" + rest[:length]


def chunked(*parts: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n")


async def start_server(nursery: trio.Nursery, handler: Handler) -> str:
    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_keep_alive_reuses_one_connection_and_decodes_chunks() -> None:
    connections = 0
    seen: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        buffer = bytearray()
        while (request := await read_request(stream, buffer)) is not None:
            seen.append(request)
            await stream.send_all(chunked(b"data: 1\n\n", b"data: 2\n\ndata: [DONE]\n\n"))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, WorkerClient() as client:
            url = await start_server(nursery, handler)
            bodies = []
            for _ in range(3):
                async with client.stream("POST", url + "/v1/completions", content=b"{}",
                                         headers=HEADERS) as response:
                    assert response.status_code == 200
                    assert response.headers["content-type"] == "text/event-stream"
                    bodies.append(await response.aread())
            assert client.connections_idle == 1
            nursery.cancel_scope.cancel()
    assert bodies == [b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"] * 3
    assert connections == 1
    assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"content-length: 2\r\n" in seen[0] and seen[0].endswith(b"\r\n\r\n{}")


async def test_closing_a_response_before_its_end_closes_the_connection() -> None:
    """How the worker learns that the router is gone: its connection closes (B1, P5)."""
    worker_saw_eof = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                              b"9\r\ndata: 1\n\n\r\n")
        while await stream.receive_some(65536):
            pass
        worker_saw_eof.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, WorkerClient() as client:
            url = await start_server(nursery, handler)
            async with client.stream("POST", url, content=b"{}", headers=HEADERS) as response:
                assert await response.read() == b"data: 1\n\n"
            await worker_saw_eof.wait()
            assert client.connections_open == 0
            nursery.cancel_scope.cancel()


async def test_reading_a_response_closed_before_its_end_is_a_closed_resource_error() -> None:
    """A read after ``aclose`` is trio's error for a closed resource, never an assertion;
    a response read to its end still reads as ended (``b""``) after it."""

    connections = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        await read_request(stream, bytearray())
        if connections == 1:  # half an answer: the client closes it before its end
            await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                                  b"9\r\ndata: 1\n\n\r\n")
        else:
            await stream.send_all(chunked(b"data: 2\n\n"))
        await trio.sleep_forever()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, WorkerClient() as client:
            url = await start_server(nursery, handler)
            async with client.stream("POST", url, content=b"{}", headers=HEADERS) as cut:
                assert await cut.read() == b"data: 1\n\n"
            with pytest.raises(trio.ClosedResourceError):
                await cut.read()
            with pytest.raises(trio.ClosedResourceError):
                await cut.aread()
            async with client.stream("POST", url, content=b"{}", headers=HEADERS) as whole:
                assert await whole.aread() == b"data: 2\n\n"
            assert await whole.read() == b""
            nursery.cancel_scope.cancel()


async def test_a_kept_connection_the_worker_closed_is_replaced() -> None:
    """A worker that closes an idle keep-alive connection: the next request goes out once
    more on a new connection, and succeeds."""
    connections = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        await read_request(stream, bytearray())
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        # then closes without saying so (as a worker's keep-alive timeout does)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, WorkerClient() as client:
            url = await start_server(nursery, handler)
            for _ in range(3):
                async with client.stream("POST", url, content=b"{}",
                                         headers=HEADERS) as response:
                    assert await response.aread() == b"ok"
            nursery.cancel_scope.cancel()
    assert connections == 3


async def test_a_body_delimited_by_the_connections_end_is_read_whole() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await stream.aclose()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, WorkerClient() as client:
            url = await start_server(nursery, handler)
            async with client.stream("POST", url, content=b"{}", headers=HEADERS) as response:
                assert await response.aread() == b"all of it"
            assert client.connections_open == 0  # not kept: the worker said close
            nursery.cancel_scope.cancel()


async def test_a_refused_connection_is_a_connect_error() -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nobody listens there now
    with trio.fail_after(10):
        async with WorkerClient() as client:
            with pytest.raises(ConnectError):
                async with client.stream("POST", f"http://127.0.0.1:{port}/", content=b"{}",
                                         headers=HEADERS):
                    pass  # pragma: no cover
            assert client.connections_open == 0


async def test_a_worker_that_answers_garbage_is_a_protocol_error() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(b"SMTP ready\r\n\r\n")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, WorkerClient() as client:
            url = await start_server(nursery, handler)
            with pytest.raises(RemoteProtocolError):
                async with client.stream("POST", url, content=b"{}", headers=HEADERS):
                    pass  # pragma: no cover
            assert client.connections_open == 0
            nursery.cancel_scope.cancel()


async def test_a_worker_that_dies_mid_body_is_a_protocol_error() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await stream.aclose()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, WorkerClient() as client:
            url = await start_server(nursery, handler)
            async with client.stream("POST", url, content=b"{}", headers=HEADERS) as response:
                assert await response.read() == b"partial"
                with pytest.raises(RemoteProtocolError):
                    await response.read()
            nursery.cancel_scope.cancel()


async def test_connections_are_bounded() -> None:
    """``max_connections`` bounds the connections open at once; past it a request waits
    for one to be freed, at most ``pool_timeout`` seconds."""
    release = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        buffer = bytearray()
        while await read_request(stream, buffer) is not None:
            await release.wait()
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    with trio.fail_after(10):
        async with (trio.open_nursery() as nursery,
                    WorkerClient(max_connections=1, pool_timeout=0.2) as client):
            url = await start_server(nursery, handler)

            async def first() -> None:
                async with client.stream("POST", url, content=b"{}",
                                         headers=HEADERS) as response:
                    assert await response.aread() == b"ok"

            nursery.start_soon(first)
            await trio.testing.wait_all_tasks_blocked()
            assert client.connections_open == 1
            with pytest.raises(PoolTimeout):
                async with client.stream("POST", url, content=b"{}", headers=HEADERS):
                    pass  # pragma: no cover
            release.set()
            await trio.testing.wait_all_tasks_blocked()
            async with client.stream("POST", url, content=b"{}", headers=HEADERS) as response:
                assert await response.aread() == b"ok"  # the freed connection, reused
            assert client.connections_open == 1
            nursery.cancel_scope.cancel()


async def test_only_post_to_http_urls() -> None:
    async with WorkerClient() as client:
        with pytest.raises(ValueError, match="only POSTs and GETs"):
            client.stream("PUT", "http://127.0.0.1:1/", content=b"", headers=HEADERS)
        with pytest.raises(ValueError, match="http"):
            client.stream("POST", "ftp://example.com/", content=b"", headers=HEADERS)


async def test_a_read_timeout_bounds_a_stalled_answer() -> None:
    """With ``read_timeout`` set, a worker that stops sending mid-answer is a ReadTimeout;
    by default the client sets no bound of its own (the router's deadlines bound it)."""
    async def handler(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                              b"9\r\ndata: 1\n\n\r\n")
        await trio.sleep_forever()

    assert WorkerClient().read_timeout is None
    with trio.fail_after(10):
        async with (trio.open_nursery() as nursery,
                    WorkerClient(read_timeout=0.2) as client):
            url = await start_server(nursery, handler)
            async with client.stream("POST", url, content=b"{}", headers=HEADERS) as response:
                assert await response.read() == b"data: 1\n\n"
                with pytest.raises(ReadTimeout):
                    await response.read()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("option", ["connect_timeout", "read_timeout", "write_timeout",
                                    "pool_timeout", "keepalive_expiry"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_a_timeout_must_be_a_positive_number_of_seconds(option: str, value: float) -> None:
    options: dict[str, Any] = {option: value}
    with pytest.raises(ValueError, match=option):
        WorkerClient(**options)


# --- default headers: a worker's API key on every request ---------------------------------


async def test_default_headers_go_with_every_request_and_a_requests_own_wins() -> None:
    seen: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        buffer = bytearray()
        while (request := await read_request(stream, buffer)) is not None:
            seen.append(request)
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    key: dict[str | bytes, str | bytes] = {"Authorization": "Bearer sk-1", b"x-team": b"kv"}
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, WorkerClient(headers=key) as client:
            url = await start_server(nursery, handler)
            for method, headers in [("POST", HEADERS), ("GET", {}),
                                    ("POST", {b"Authorization": b"Bearer other"})]:
                async with client.stream(method, url + "/v1/completions", content=b"",
                                         headers=headers) as response:
                    assert response.status_code == 200
            nursery.cancel_scope.cancel()
    post, probe, own = (request.lower() for request in seen)
    for request in (post, probe):
        assert request.count(b"authorization") == 1
        assert b"\r\nauthorization: bearer sk-1\r\nx-team: kv\r\n\r\n" in request
    assert b"content-type: application/json\r\n" in post
    # A request's own header of the same name (any case) replaces the default, as httpx.
    assert own.count(b"authorization") == 1 and b"authorization: bearer other\r\n" in own
    assert b"x-team: kv\r\n" in own
    assert "sk-1" not in repr(client.headers)  # a key is never shown


@pytest.mark.parametrize(("headers", "error", "message"), [
    ({"authorization": "Bearer k\r\nx-evil: 1"}, ValueError,
     "the value of header 'authorization' has a CR, LF or NUL"),
    ({"authorization": b"Bearer k\n"}, ValueError, "'authorization' has a CR, LF or NUL"),
    ({"authorization": "Bearer k\0"}, ValueError, "'authorization' has a CR, LF or NUL"),
    ({"x-a\r\nx-evil": "1"}, ValueError, "is not an HTTP token"),
    ({b"x-a\0": "1"}, ValueError, "is not an HTTP token"),
    ({"x-a: b": "1"}, ValueError, "is not an HTTP token"),
    ({"": "1"}, ValueError, "is not an HTTP token"),
    ({"clé": "1"}, ValueError, "header name 'clé' is not ASCII"),
    ({"Host": "elsewhere"}, ValueError, "'host' is set by the client itself"),
    ({"content-length": "0"}, ValueError, "'content-length' is set by the client itself"),
    ({"x-a": "1", "X-A": "2"}, ValueError, "'x-a' is given twice"),
    ({"x-a": 1}, TypeError, "the value of header 'x-a' must be str or bytes, got int"),
    ({1: "1"}, TypeError, "a header name must be str or bytes, got int"),
], ids=["crlf-value", "lf-value", "nul-value", "crlf-name", "nul-name", "colon-name",
        "empty-name", "non-ascii-name", "host", "content-length", "twice", "int-value",
        "int-name"])
def test_a_header_that_could_inject_another_is_refused_at_construction(
    headers: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        WorkerClient(headers=headers)
    assert message in str(caught.value)
    assert "Bearer k" not in str(caught.value)  # a value may be a secret: never shown


async def ok_after(both: trio.Event | None, stream: trio.SocketStream) -> None:
    """Answer each request ``ok``, keeping the connection; the first one only once
    ``both`` is set (None: at once)."""
    buffer = bytearray()
    while await read_request(stream, buffer) is not None:
        if both is not None:
            await both.wait()
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")


async def post_ok(client: WorkerClient, url: str) -> None:
    async with client.stream("POST", url, content=b"{}", headers=HEADERS) as response:
        assert await response.aread() == b"ok"


async def test_idle_connections_never_keep_a_request_waiting() -> None:
    """Connections kept idle for one worker (after a burst to it) hold ``max_connections``
    slots: a request to another worker closes the one idle the longest and takes its
    place, rather than wait ``pool_timeout`` for a connection nobody will free."""
    both = trio.Event()
    with trio.fail_after(10):
        async with (trio.open_nursery() as nursery,
                    WorkerClient(max_connections=2, pool_timeout=5) as client):
            busy = await start_server(nursery, partial(ok_after, both))
            other = await start_server(nursery, partial(ok_after, None))
            async with trio.open_nursery() as burst:  # two at once: two connections
                burst.start_soon(post_ok, client, busy)
                burst.start_soon(post_ok, client, busy)
                await trio.testing.wait_all_tasks_blocked()
                both.set()
            assert (client.connections_open, client.connections_idle) == (2, 2)
            with trio.fail_after(1):  # not pool_timeout
                await post_ok(client, other)
            assert (client.connections_open, client.connections_idle) == (2, 2)
            nursery.cancel_scope.cancel()


async def test_an_idle_connection_is_closed_once_past_its_expiry() -> None:
    """An idle connection is kept ``keepalive_expiry`` seconds, not for as long as the
    worker's newer connections are reused: after a burst, the ones left over close."""
    both = trio.Event()
    expiry = 0.05
    with trio.fail_after(10):
        async with (trio.open_nursery() as nursery,
                    WorkerClient(keepalive_expiry=expiry) as client):
            url = await start_server(nursery, partial(ok_after, both))
            async with trio.open_nursery() as burst:
                burst.start_soon(post_ok, client, url)
                burst.start_soon(post_ok, client, url)
                await trio.testing.wait_all_tasks_blocked()
                both.set()
            assert client.connections_idle == 2
            start = trio.current_time()
            while trio.current_time() < start + 3 * expiry:  # one request at a time
                await post_ok(client, url)
                await trio.sleep(expiry / 5)
            assert (client.connections_open, client.connections_idle) == (1, 1)
            nursery.cancel_scope.cancel()


async def test_an_https_url_for_a_plain_http_worker_says_tls_failed() -> None:
    """Once: ``--decode https://...`` for a worker that speaks plain HTTP failed every
    probe and request with ``connection lost: `` and nothing after it (the TLS error was
    only the cause of an empty ``BrokenResourceError``)."""
    async def plain(stream: trio.SocketStream) -> None:  # answers a ClientHello as HTTP
        await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n"
                              b"connection: close\r\n\r\n")
        await stream.aclose()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery, WorkerClient() as client:
            url = (await start_server(nursery, plain)).replace("http://", "https://")
            with pytest.raises(RemoteProtocolError) as raised:
                async with client.stream("GET", url + "/health", content=b"", headers={}):
                    pass  # pragma: no cover
            nursery.cancel_scope.cancel()
    message = str(raised.value)
    assert "TLS" in message and "WRONG_VERSION_NUMBER" in message, message
    assert "https:// URL for a worker that speaks plain HTTP?" in message


async def test_a_get_never_waits_for_a_connection_every_stream_holds() -> None:
    """Once: with ``max_connections`` carrying streams (at load: ``serve`` has 1024, and an
    SGLang request holds two), a health probe waited for one of them to end, ran out of
    its timeout, and the healthy worker was marked down. A GET (a probe, a model list, a
    server information) opens a connection past the bound, closed after its answer."""
    release = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        request = await read_request(stream, bytearray())
        if request is not None and request.startswith(b"GET "):
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await read_request(stream, bytearray())  # until the client closes it
            return
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                              b"9\r\ndata: 1\n\n\r\n")
        await release.wait()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery, WorkerClient(max_connections=1) as client:
            url = await start_server(nursery, handler)
            async with client.stream("POST", url, content=b"{}", headers=HEADERS) as held:
                assert await held.read() == b"data: 1\n\n"
                with trio.fail_after(1):
                    async with client.stream("GET", url + "/health", content=b"",
                                             headers={}) as probe:
                        assert (probe.status_code, await probe.aread()) == (200, b"ok")
                assert (client.connections_open, client.connections_idle) == (1, 0)
                with pytest.raises(PoolTimeout):  # a POST still waits for its turn
                    client.pool_timeout = 0.05
                    async with client.stream("POST", url, content=b"{}", headers=HEADERS):
                        pass  # pragma: no cover
            release.set()
            nursery.cancel_scope.cancel()
