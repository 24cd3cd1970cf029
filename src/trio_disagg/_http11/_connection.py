"""One client connection of the HTTP/1.1 server: its bytes parsed by httptools into requests
(head, then body as it arrives), its limits, and the answers the server gives by itself."""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from http import HTTPStatus
from typing import TYPE_CHECKING

import httptools
import trio

if TYPE_CHECKING:
    from ._watch import ReadWatch

READ_SIZE = 65536
#: Seconds an idle keep-alive connection is kept open (uvicorn's default).
KEEP_ALIVE_TIMEOUT = 5.0
#: Seconds a client gets to send a request's headers once it started sending them.
HEADERS_TIMEOUT = 10.0
#: Bytes of request line and headers accepted, as they come on the wire (else 431).
MAX_HEAD_BYTES = 64 * 1024
#: Header fields accepted in a request (else 431): each costs the server a few hundred
#: bytes of Python objects, far more than the 4 bytes of ``a:\r\n`` on the wire.
MAX_HEADERS = 100
#: Bytes read ahead (request bodies not yet received by the app, pipelined requests)
#: before the server stops reading from the client.
MAX_BUFFERED_BYTES = 1024 * 1024
#: Bytes read and thrown away after an answer of the server's own, before it closes.
LINGER_BYTES = 1024 * 1024
#: Bytes a pipelined request waiting its turn counts for in the read-ahead, on top of its
#: head's: what its parsed form costs in memory (a request of 20 bytes costs as much).
REQUEST_COST = 1024

#: The answer to an offer to switch protocols (``curl --http2`` offers h2c on ``http://``).
UPGRADE_REFUSED = (b"upgrades are not supported: this server speaks HTTP/1.1 only; send the "
                   b"request without an Upgrade header")

#: The answer to a request body sent with a transfer coding other than chunked (gzip).
TRANSFER_CODING_REFUSED = (b"Transfer-Encoding other than chunked is not supported: send "
                           b"the body uncompressed")

#: The reason phrase of every status an answer may have (``HTTP/1.1 415 Unsupported ...``).
REASONS = {int(status): status.phrase.encode("ascii") for status in HTTPStatus}

#: The OpenAI-style error code of each answer the server gives by itself.
CODES = {400: b"malformed_request", 408: b"request_timeout",
         431: b"request_header_fields_too_large", 501: b"not_implemented"}


class Request:
    """One request as it is parsed: its head, then its body as it arrives."""

    __slots__ = ("body", "complete", "expect_continue", "head_done", "headers", "keep_alive",
                 "method", "queued", "received", "url", "version")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: deque[bytes] = deque()
        self.complete = False
        self.method = "GET"
        self.version = "1.1"
        self.keep_alive = True
        self.expect_continue = False
        self.received = 0  # bytes of body arrived
        self.queued = 0  # bytes it counts for in the read-ahead while it waits its turn
        self.head_done = False  # (later header fields are a chunked body's trailers)


class Connection:
    """One client connection: its parser, the requests parsed from it, and the response
    of the one being served."""

    def __init__(self, stream: trio.SocketStream, *, head_with_body: bool,
                 keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT) -> None:
        self.head_with_body = head_with_body  # a response's head waits for its first body
        self.keep_alive_timeout = keep_alive_timeout  # seconds an idle connection is kept
        self.stream = stream
        # Its callbacks hold this connection: dropped by the server when the connection
        # ends, so that the connection and its requests are freed at once, not by the
        # garbage collector (P4a, P3).
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.requests: deque[Request] = deque()
        self.parsing: Request | None = None
        self.head_bytes = 0
        self.buffered = 0
        self.closed = False  # the client went away (or the connection broke)
        self.closing = False  # the server closes it after the current response
        #: An answer the server owes the client by itself (a malformed request, headers
        #: too large): written once the response in progress and the requests parsed
        #: before it are answered, never into the middle of a response.
        self.refusal: tuple[int, bytes] | None = None
        #: When the headers of the request being parsed must be in (HEADERS_TIMEOUT from
        #: its first byte: a client trickling bytes does not restart it).
        self.head_deadline = math.inf
        self.idle = True  # between requests (or before the first)
        self.served = 0  # requests handed to the app
        self.idle_since = trio.current_time()
        self.changed = trio.Event()
        #: Called once when the client goes away while a request is served (the app's
        #: disconnect callback, :data:`ON_DISCONNECT`); None between requests.
        self.on_gone: Callable[[], object] | None = None
        #: The server's reader of served connections, while this one's request is served
        #: (None: not watched, or the server reads it in a task, read_while_serving).
        self.watch: ReadWatch | None = None
        self.scope = trio.CancelScope()
        self.fileno = stream.socket.fileno()
        try:
            self.client: tuple[str, int] | None = stream.socket.getpeername()[:2]
            self.local: tuple[str, int] | None = stream.socket.getsockname()[:2]
        except OSError:
            self.client = self.local = None

    # httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.parsing = Request()
        self.head_bytes = 0
        self.head_deadline = trio.current_time() + HEADERS_TIMEOUT

    def on_url(self, url: bytes) -> None:
        assert self.parsing is not None
        self.parsing.url += url
        self.head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.parsing is not None
        headers = self.parsing.headers
        # A chunked body's trailers count towards the limits but are not headers: the app
        # has the headers already (ASGI has no request trailers), and a trailer must not
        # add to them what the client did not send in its head.
        if len(headers) <= MAX_HEADERS and not self.parsing.head_done:
            # The parser leaves the trailing whitespace, which is not the value's (RFC 9110
            # section 5.5): an X-Request-Id would come back with it.
            headers.append((name.lower(), value.rstrip(b" \t")))
        self.head_bytes += len(name) + len(value) + 4  # with ": " and CRLF

    def on_headers_complete(self) -> None:
        request = self.parsing
        assert request is not None
        request.head_done = True
        parser = self.parser
        assert parser is not None  # (called by it)
        request.method = parser.get_method().decode("ascii")
        request.version = parser.get_http_version()
        request.keep_alive = parser.should_keep_alive()
        request.expect_continue = (b"expect", b"100-continue") in request.headers
        if self._head_too_large():  # (a head that came whole in one read too)
            self._refuse_later(431, b"request headers too large")
            return
        if any(name == b"transfer-encoding" and value.lower().replace(b" ", b"")
               not in (b"chunked", b"") for name, value in request.headers):
            # httptools frames the body by its final ``chunked`` and leaves the other
            # codings on it: the app would read compressed bytes as the body.
            self._refuse_later(501, TRANSFER_CODING_REFUSED)
            return
        if parser.should_upgrade():
            # httptools parses no further than an upgrade's head (what follows is the new
            # protocol's): served, the request would reach the app without its body.
            self._refuse_later(400, UPGRADE_REFUSED)
            return
        # Until the app takes it, a request counts in the read-ahead as its body does: a
        # client pipelining requests with no body is stopped like one sending a body.
        request.queued = self.head_bytes + REQUEST_COST
        self.buffered += request.queued
        self.requests.append(request)

    def on_body(self, body: bytes) -> None:
        assert self.parsing is not None
        self.parsing.body.append(body)
        self.parsing.received += len(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        assert self.parsing is not None
        self.parsing.complete = True
        self.parsing = None

    def _head_too_large(self) -> bool:
        """Whether the head being parsed (or its trailers) is over a limit (431)."""
        return self.parsing is not None and (self.head_bytes > MAX_HEAD_BYTES
                                             or len(self.parsing.headers) > MAX_HEADERS)

    # reading ----------------------------------------------------------------------------

    def read_ahead_full(self) -> bool:
        """Whether so much waits unread by the app (request bodies, pipelined requests)
        that the server stops reading from the client until the app takes some."""
        return self.buffered > MAX_BUFFERED_BYTES

    def _wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def body_taken(self, size: int) -> None:
        """The app took ``size`` bytes of body: a read paused on a full buffer goes on."""
        self.buffered -= size
        self._wake()
        if self.watch is not None:
            self.watch.resume(self)

    def request_over(self, request: Request) -> None:
        """``request`` was answered: what of its body the app did not take (an answer
        given before reading it) leaves the read-ahead, which would stay full for good."""
        self.buffered -= sum(map(len, request.body))
        request.body.clear()

    def gone(self) -> None:
        """The client went away (or the connection broke): wake what waits on the
        connection and tell the request being served, once (:data:`ON_DISCONNECT`)."""
        self.closed = True
        self._wake()
        on_gone, self.on_gone = self.on_gone, None
        if on_gone is not None:
            on_gone()

    def on_disconnect(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` once when the client goes away during the request being
        served (at once if it is gone already)."""
        if self.closed:
            callback()
        else:
            self.on_gone = callback

    async def read_once(self) -> bool:
        """Read what the client sent into the parser; False if the connection is done."""
        try:
            data = await self.stream.receive_some(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            data = b""
        return self._take(data)

    def _take(self, data: bytes) -> bool:
        """Parse what one read brought (``b""``: the client went away); False if the
        connection is done (gone, or owed a refusal: nothing more is read)."""
        parser = self.parser
        if parser is None:  # the connection ended (its server let go of it)
            return False
        if not data:
            self.gone()
            return False
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse_later(400, UPGRADE_REFUSED)
        except httptools.HttpParserError:
            self._refuse_later(400, b"malformed HTTP request")
        if self._head_too_large():
            self._refuse_later(431, b"request headers too large")
        self._wake()  # (a request whose body broke off with a refusal ends at once)
        return self.refusal is None

    def _refuse_later(self, status: int, message: bytes) -> None:
        if self.refusal is None:
            self.refusal = (status, message)
        self.closing = True

    async def next_request(self) -> Request | None:
        """The next request whose head is in, or None when the connection is done.

        Requests parsed before a refusal the server owes are answered first; then the
        refusal is written and the connection closes. An idle connection waits at most
        ``keep_alive_timeout`` seconds for a request to start, a started head at most
        HEADERS_TIMEOUT seconds from its first byte (then 408)."""
        idle_deadline = trio.current_time() + self.keep_alive_timeout
        waited = False
        while not self.requests:
            if self.closed:
                return None
            if self.closing:
                refusal, self.refusal = self.refusal, None
                if refusal is not None:
                    await self.refuse(*refusal, linger=True)
                return None
            try:
                # What the client already sent (a new connection's request usually is
                # there): one system call, with no cancel scope for the wait below.
                data: bytes | None = os.read(self.fileno, READ_SIZE)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data is not None:
                self._take(data)
                continue
            head_started = self.parsing is not None
            with trio.move_on_at(self.head_deadline if head_started else idle_deadline):
                await self.read_once()
                waited = True
                continue
            if head_started:
                await self.refuse(408, b"request headers not received in time", linger=True)
            return None
        if waited or not self.served:  # (a first request: this task has just begun)
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
            # A request that was there already (pipelined): a schedule point, as the
            # server's writes have none when the socket takes them, so that a client's
            # burst of requests the app answers at once does not hold the others up.
            await trio.lowlevel.checkpoint()
        self.served += 1
        request = self.requests.popleft()
        self.buffered -= request.queued
        return request

    async def read_while_serving(self, request: Request) -> None:
        """Read on while the app serves ``request``: its body, then whatever comes (a
        pipelined request is parsed and waits; the end of the connection is a
        disconnect). Reading pauses while too much is buffered, and stops at a refusal
        (the bytes after it are not HTTP; the server drains them as it answers)."""
        while not self.closed and self.refusal is None:
            if self.read_ahead_full():
                await self.changed.wait()  # the app took some of the body
                continue
            if not await self.read_once():
                return

    async def refuse(self, status: int, message: bytes, *, linger: bool = False) -> None:
        """Answer an error that no app saw (the request was not HTTP), then close.

        With ``linger`` (no other task reads the connection), what the client is still
        sending is read and thrown away, up to LINGER_BYTES, until the end of the same
        second: closing a socket with bytes unread resets the connection, and the client
        may lose the answer (a 431 to a head still coming) before it reads it."""
        body = (b'{"error":{"message":"' + message + b'","type":"invalid_request_error",'
                b'"param":null,"code":"' + CODES.get(status, b"bad_request") + b'"}}')
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n"
                % (status, REASONS.get(status, b""), len(body)))
        with trio.move_on_after(1), suppress(trio.BrokenResourceError,
                                             trio.ClosedResourceError, OSError):
            await self.stream.send_all(head + body)
            if linger:
                await self.stream.send_eof()
                left = LINGER_BYTES
                while left > 0 and (data := await self.stream.receive_some(READ_SIZE)):
                    left -= len(data)
        self.closed = True
