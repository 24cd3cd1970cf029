"""The ASGI ``receive`` and ``send`` of one request: its body handed to the app, its
response framed (chunked or sized) and written whole, or the connection broken."""

from __future__ import annotations

import os
from typing import Any

import trio

from ._connection import REASONS, Connection, Request

Message = dict[str, Any]

#: Seconds a response write may wait for a client that does not read before the
#: connection is closed.
WRITE_TIMEOUT = 10.0
#: Seconds a request body may pause between two reads before the request ends (408);
#: also the grace a body gets before :data:`BODY_MIN_RATE` applies.
BODY_TIMEOUT = 10.0
#: Bytes a second a request body must come at, on average, once BODY_TIMEOUT seconds
#: from its request's head have passed (else 408): a body trickled in a byte at a time,
#: each within BODY_TIMEOUT of the last, would hold its request (and its admission slot)
#: for ever. At this rate the router's largest body (2 MiB) may take 42 seconds.
BODY_MIN_RATE = 64 * 1024


class Exchange:
    """The ASGI ``receive`` and ``send`` of one request."""

    __slots__ = ("body_ended", "body_grace", "body_timed_out", "chunked", "conn", "done",
                 "head", "head_only", "keep_alive", "request", "started")

    def __init__(self, conn: Connection, request: Request) -> None:
        self.conn = conn
        self.request = request
        self.started = False  # the app sent http.response.start
        self.head: bytes | None = None  # the response head, until it goes out
        self.done = False  # the response is complete
        self.body_ended = False  # the app received the request body's last part
        self.body_timed_out = False  # the body stopped coming (BODY_TIMEOUT)
        #: When the body must be in if nothing of it came (BODY_MIN_RATE extends it).
        self.body_grace = trio.current_time() + BODY_TIMEOUT
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
                conn.body_taken(len(body))
                self.body_ended = request.complete
                return {"type": "http.request", "body": body, "more_body": not request.complete}
            if request.complete and not self.body_ended:
                self.body_ended = True
                await trio.lowlevel.checkpoint()
                return {"type": "http.request", "body": b"", "more_body": False}
            if conn.closed or self.done or (conn.refusal is not None and not request.complete):
                # (A body that broke off, not HTTP any more, never comes: the server
                # answers the refusal it owes once the app returned.)
                await trio.lowlevel.checkpoint()
                return {"type": "http.disconnect"}
            if request.expect_continue and not self.started:
                request.expect_continue = False
                await self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
                continue
            if request.complete:
                await conn.changed.wait()  # the body is all in: wait for the end
                continue
            # A pause of BODY_TIMEOUT, or a body slower than BODY_MIN_RATE on average.
            deadline = min(trio.current_time() + BODY_TIMEOUT,
                           self.body_grace + request.received / BODY_MIN_RATE)
            with trio.move_on_at(deadline) as waited:
                await conn.changed.wait()
            if waited.cancelled_caught:
                # A body that stopped coming (or trickles) holds the request's slot
                # (admission control) for nothing: the request ends as a disconnect, and
                # the client gets a 408.
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
            if not self.conn.head_with_body:
                head, self.head = self.head, None
                await self._write(head)  # at once, as uvicorn does: the client sees 2xx
            # Else only recorded: the first body's send writes the head with it.
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

    async def send_body(self, data: bytes) -> None:
        """``send({"type": "http.response.body", "body": data, "more_body": True})``
        (the :data:`~._server.WHOLE_SENDS` extension's ``body``)."""
        if (data and self.head is None and self.chunked and self.started
                and not (self.done or self.head_only)):
            # A part of a streamed body, the head gone: one chunk (an empty one, which
            # would end the body, takes the general path: it writes nothing).
            await self._write(b"%x\r\n%b\r\n" % (len(data), data))
            return
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    def _head(self, status: int, headers: Any) -> bytes:
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b""))]
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

        The common case costs one system call, no cancel scope and no schedule point: the
        socket takes all of ``data`` at once (it is non-blocking). The app's next wait,
        for its next bytes, is its schedule point, as with uvicorn, whose send yields only
        when the transport's buffer is full (a task step less per write, P4a). Only when
        the socket's buffer is full (a slow client) does the rest go out under a shielded
        deadline (:data:`WRITE_TIMEOUT`); a client that does not read for that long loses
        its connection. So a send never stops half-way because the app's request was
        cancelled (B4: the stream a client sees is whole events or broken, never a torn
        one)."""
        conn = self.conn
        if conn.closed:
            await trio.lowlevel.checkpoint()  # the client is gone: the app hears of it
            return
        try:
            sent = os.write(conn.fileno, data)
        except BlockingIOError:
            sent = 0
        except OSError:
            conn.gone()
            await trio.lowlevel.checkpoint()
            return
        if sent == len(data):
            return
        with trio.CancelScope(deadline=trio.current_time() + WRITE_TIMEOUT, shield=True):
            try:
                await conn.stream.send_all(memoryview(data)[sent:])
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        conn.gone()  # broken, or the client did not read for WRITE_TIMEOUT
