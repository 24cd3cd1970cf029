"""The ASGI plumbing both HTTP faces share (``trio_disagg._asgi``): body reading with a
limit and a drain, headers, query parameters, the lifespan protocol, the disconnect wait;
and the mock worker's own 413 on a real port."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import pytest
import trio

from trio_disagg._asgi import (
    BodyTooLarge,
    Message,
    declared_length,
    header,
    lifespan,
    query_param,
    read_body,
    wait_disconnect,
)
from trio_disagg.workers import create_mock_worker, serve_worker


class Feed:
    """A ``receive`` that hands out ``messages`` in order and counts what was read."""

    def __init__(self, *messages: Message) -> None:
        self.messages = list(messages)
        self.read = 0

    async def __call__(self) -> Message:
        await trio.lowlevel.checkpoint()
        message = self.messages[self.read]
        self.read += 1
        return message


def body(data: bytes, more: bool = True) -> Message:
    return {"type": "http.request", "body": data, "more_body": more}


def scope(*headers: tuple[bytes, bytes], query: bytes = b"") -> dict[str, Any]:
    return {"type": "http", "headers": list(headers), "query_string": query}


async def test_a_body_within_the_limit_is_joined() -> None:
    assert await read_body(Feed(body(b"ab"), body(b"cd", more=False)), 4) == b"abcd"
    assert await read_body(Feed({"type": "http.request"}), 4) == b""


async def test_without_a_drain_the_read_stops_at_the_message_over_the_limit() -> None:
    feed = Feed(body(b"abc"), body(b"def"), body(b"g", more=False))
    with pytest.raises(BodyTooLarge, match="request body over 4 bytes") as caught:
        await read_body(feed, 4)
    assert caught.value.limit == 4
    assert feed.read == 2


async def test_an_oversized_body_is_drained_to_its_end_or_past_the_drain() -> None:
    feed = Feed(body(b"abcdef"), body(b"gh"), body(b"i", more=False))
    with pytest.raises(BodyTooLarge):
        await read_body(feed, 4, drain=10)
    assert feed.read == 3  # the whole body, so the client reads the answer
    feed = Feed(body(b"abcdef"), body(b"ghijklmnop"), body(b"q", more=False))
    with pytest.raises(BodyTooLarge):
        await read_body(feed, 4, drain=10)
    assert feed.read == 2  # 16 bytes > 4 + 10: the rest is left to the connection's close


async def test_a_declared_length_over_the_limit_is_refused() -> None:
    feed = Feed(body(b"ab", more=False))
    with pytest.raises(BodyTooLarge):
        await read_body(feed, 4, drain=10, declared=100)
    assert feed.read == 0  # over limit + drain: nothing read
    with pytest.raises(BodyTooLarge):  # a declared size the body does not reach
        await read_body(Feed(body(b"ab", more=False)), 4, drain=10, declared=5)


async def test_a_disconnect_while_reading_or_draining_is_none() -> None:
    disconnect: Message = {"type": "http.disconnect"}
    assert await read_body(Feed(body(b"ab"), disconnect), 4) is None
    assert await read_body(Feed(body(b"abcdef"), disconnect), 4, drain=10) is None


def test_headers_and_query_parameters() -> None:
    request = scope((b"x-request-id", b" r\xe9 "), (b"x-empty", b"  "),
                    (b"content-length", b"12"), query=b"timeout=2.5&a=%20x&a=y&b=")
    assert header(request, b"x-request-id") == " r\u00e9 "  # latin-1, as sent
    assert header(request, b"x-request-id", strip=True) == "r\u00e9"
    assert header(request, b"x-empty", strip=True) is None
    assert header(request, b"absent") is None
    assert declared_length(request) == 12
    assert declared_length(scope((b"content-length", b"\xb2"))) is None  # a superscript 2
    assert query_param(request, "timeout") == "2.5"
    assert query_param(request, "a") == " x"
    assert query_param(request, "b") == ""
    assert query_param(request, "c") is None


async def test_lifespan_and_the_disconnect_wait() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        await trio.lowlevel.checkpoint()
        sent.append(message)

    feed = Feed({"type": "lifespan.startup"}, {"type": "lifespan.shutdown"})
    await lifespan(feed, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete",
                                         "lifespan.shutdown.complete"]
    feed = Feed(body(b"late"), {"type": "http.disconnect"})
    await wait_disconnect(feed)
    assert feed.read == 2


async def test_a_mock_worker_answers_an_oversized_body_413_in_its_error_shape() -> None:
    worker = create_mock_worker("decode", max_body_bytes=1000)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_worker, worker))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                response = await http.post("/v1/completions", json={
                    "model": "mock-model", "prompt": "x" * 2000, "max_tokens": 1})
                assert response.status_code == 413
                error = response.json()["error"]
                assert error["message"] == "request body over 1000 bytes"
                assert error["code"] == 413
                # The worker keeps serving.
                response = await http.post("/v1/completions", json={
                    "model": "mock-model", "prompt": "hello", "max_tokens": 1})
                assert response.status_code == 200, response.text
            nursery.cancel_scope.cancel()
    assert worker.stats.failed == 1
