"""The ASGI 3 plumbing shared by the package's two HTTP faces, the router's OpenAI server
(``server/``) and the mock workers (``mock/``): the ASGI types, request headers and query
parameters (parsed with the standard library), reading a request body with a size limit,
the lifespan protocol, and waiting for the client to go away.

What each face answers stays its own: the server's OpenAI errors and its responder, the
mock's error shapes and response state. Nothing here is on the per-token path."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import parse_qs

Scope = Mapping[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_TYPE = b"application/json"
SSE_TYPE = b"text/event-stream"


class BodyTooLarge(Exception):
    """A request body is over its limit; each face answers it with its own 413.

    Attributes:
        limit: the limit the body is over, in bytes.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over {limit} bytes")
        self.limit = limit


def header_bytes(scope: Scope, name: bytes) -> bytes | None:
    """The first request header called ``name`` (lower case), as sent; None if absent."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def header(scope: Scope, name: bytes, *, strip: bool = False) -> str | None:
    """The first request header called ``name`` (lower case), decoded as latin-1 so that
    any bytes round-trip; None if absent. With ``strip``, stripped of surrounding
    whitespace, and None if nothing is left."""
    value = header_bytes(scope, name)
    if value is None:
        return None
    text = value.decode("latin-1")
    if strip:
        return text.strip() or None
    return text


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length`` in bytes, or None if absent or not a number."""
    declared = header(scope, b"content-length")
    return int(declared) if declared is not None and declared.isdecimal() else None


def query_param(scope: Scope, name: str) -> str | None:
    """A query string parameter (the first, percent-decoded), or None."""
    query = bytes(scope.get("query_string") or b"").decode("latin-1")
    values = parse_qs(query, keep_blank_values=True).get(name)
    return values[0] if values else None


async def read_body(
    receive: Receive, limit: int, *, drain: int = 0, declared: int | None = None
) -> bytes | None:
    """Read a request body of at most ``limit`` bytes.

    A body over the limit is still read, and thrown away, up to ``drain`` bytes past the
    limit, so that the client sees the answer rather than a connection reset; with no
    ``drain`` it raises right after the message that crossed the limit. Cancellation
    leaves the rest of the body unread.

    Args:
        receive: the request's ASGI ``receive``.
        limit: the largest body accepted, in bytes.
        drain: bytes past ``limit`` read before raising.
        declared: the body's declared length (``Content-Length``) in bytes, if known: a
            body declared over ``limit + drain`` raises before anything is read, one
            declared over ``limit`` raises even if fewer bytes arrive.

    Returns:
        The body, or None if the client went away first (``http.disconnect``).

    Raises:
        BodyTooLarge: the body is (or is declared) over ``limit`` bytes.
    """
    too_large = declared is not None and declared > limit
    if declared is not None and declared > limit + drain:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        data = message.get("body", b"")
        size += len(data)
        if size > limit:
            too_large = True
            chunks.clear()
        if not too_large:
            chunks.append(data)
        if not message.get("more_body", False) or size > limit + drain:
            break  # past the drain, the server closes the connection after the answer
    if too_large:
        raise BodyTooLarge(limit)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client goes away (``http.disconnect``); other messages are dropped.

    An ASGI server never cancels an app by itself: a client that disconnects is only this
    message. Hypercorn also sends it once the response is complete, so a listener must be
    cancelled before the response's last message goes out.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer the ASGI lifespan protocol: startup and shutdown complete at once."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
