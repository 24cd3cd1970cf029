"""A worker's answer as the worker client reads it (:class:`WorkerResponse`): its head at
once, its body part by part, parsed by httptools (the relay's hot path,
docs/performance.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httptools
import trio

from ._connections import Connection, Pool
from ._reads import receive_some
from ._transport import ReadTimeout, RemoteProtocolError, read_up_to

if TYPE_CHECKING:
    from ._wire import WorkerClient

#: Bytes asked of the socket per read.
READ_SIZE = 65536
#: Bytes of response headers accepted before the answer is refused as malformed.
MAX_HEADER_BYTES = 64 * 1024


class WorkerResponse:
    """A worker's answer: its status and headers at once, its body read part by part.

    Read the body with :meth:`read` until it returns ``b""``; :meth:`aclose` (or leaving
    the ``async with`` of :meth:`WorkerClient.stream`) ends the exchange. A response read
    to its end gives its connection back to the pool; one closed before its end closes the
    connection, which is how the worker learns that the router has gone (it aborts).
    Made by :meth:`WorkerClient.stream`, never directly.
    """

    __slots__ = ("_body", "_client", "_complete", "_connection", "_headers_done",
                 "_keep_alive", "_parser", "_pool", "_raw_headers", "_read_by",
                 "headers", "status_code")

    def __init__(self, client: WorkerClient, pool: Pool, connection: Connection) -> None:
        self._client = client
        self._pool = pool
        self._connection: Connection | None = connection
        # Its callbacks hold this response: dropped with the connection (_let_go), so
        # that the response is freed at once, not by the garbage collector (P4a, P3).
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(
            self)
        self._body: list[bytes] = []
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._headers_done = False
        self._complete = False
        self._keep_alive = False
        #: When the wait for the next bytes times out (with a read timeout), once begun.
        self._read_by: float | None = None
        #: The status code, once the headers are in.
        self.status_code = 0
        #: Header names (lower case) to values, as ``str``.
        self.headers: dict[str, str] = {}

    # httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self._parser is not None  # (called by it)
        self.status_code = self._parser.get_status_code()
        self.headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                        for name, value in self._raw_headers}
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._complete = True
        assert self._parser is not None  # (called by it)
        self._keep_alive = self._parser.should_keep_alive()

    # reading ------------------------------------------------------------------------------

    async def _feed(self) -> bool:
        """One socket read into the parser; False at the end of the connection."""
        connection = self._connection
        if connection is None:
            raise trio.ClosedResourceError("the response was closed before its end")
        timeout = self._client.read_timeout
        try:
            data: bytes | bytearray
            if timeout is None:  # no cancel scope per read: the caller's deadlines bound it
                data = await receive_some(connection.stream, connection.socket, READ_SIZE)
            else:  # absolute: a read cut short (a reader's own timeout) does not restart it
                if self._read_by is None:
                    self._read_by = trio.current_time() + timeout
                with trio.move_on_at(self._read_by) as waited:
                    data = await connection.stream.receive_some(READ_SIZE)
                if waited.cancelled_caught:
                    raise ReadTimeout(f"no data for {timeout:g} s")
                self._read_by = None
        except (trio.BrokenResourceError, OSError) as exc:
            raise RemoteProtocolError(f"connection lost: {exc}") from exc
        if not data or self._parser is None:  # (None: another task ended the response)
            return False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise RemoteProtocolError(f"malformed HTTP answer: {exc}") from exc
        return True

    async def _read_head(self) -> None:
        while not self._headers_done:
            if not await self._feed():
                raise RemoteProtocolError("the worker closed the connection without answering")
            if not self._headers_done and sum(
                    len(v) + len(n) for n, v in self._raw_headers) > MAX_HEADER_BYTES:
                raise RemoteProtocolError("the answer's headers are too large")

    async def read(self) -> bytes:
        """The next part of the body: what one socket read brought (possibly several
        events of a stream), decoded from chunked transfer; ``b""`` at its end.

        Raises:
            ReadTimeout: nothing arrived for the client's ``read_timeout`` seconds (only
                with one).
            RemoteProtocolError: the connection broke before the body's end, or the
                answer is not valid HTTP/1.1.
            trio.ClosedResourceError: the response was closed (:meth:`aclose`) before
                its end.

        Cancelled, it leaves the response open and the rest of the body unread; the
        exchange's ``async with`` (or :meth:`aclose`) then closes the connection.
        """
        while not self._body:
            if self._complete:
                self._release()
                return b""
            if not await self._feed():
                if self._headers_framed():
                    raise RemoteProtocolError("the worker closed the connection mid-answer")
                self._complete = True  # a body delimited by the connection's end
        parts = self._body
        self._body = []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def at_end(self) -> bool:
        """True once the whole body has been read: :meth:`read` would return ``b""``."""
        return self._complete and not self._body

    def _headers_framed(self) -> bool:
        return "content-length" in self.headers or "chunked" in self.headers.get(
            "transfer-encoding", "").lower()

    async def aread(self, limit: int | None = None) -> bytes:
        """The rest of the body, as :meth:`read` returns it part by part, joined.

        Args:
            limit: stop after the read that brings the total to this many bytes or
                more (the result may be longer; the rest is left unread); None: read to
                the end.

        Raises:
            ReadTimeout, RemoteProtocolError, trio.ClosedResourceError: as :meth:`read`.
        """
        return await read_up_to(self.read, limit)

    def _let_go(self) -> Connection | None:
        """The connection, which this response lets go of, with its parser."""
        connection, self._connection = self._connection, None
        self._parser = None
        return connection

    def _release(self) -> None:
        connection = self._let_go()
        if connection is None:
            return
        if self._keep_alive:
            self._client._give_back(self._pool, connection)
        else:
            self._client._forget(connection)

    def _discard(self) -> None:
        """Close the connection at once, without a checkpoint (a failed exchange)."""
        connection = self._let_go()
        if connection is not None:
            self._client._forget(connection)

    async def aclose(self) -> None:
        """End the exchange: give the connection back if the answer was read to its end,
        else close it (the worker aborts the request). Idempotent. Closing is done even if
        the call is cancelled (trio closes a socket on a cancelled ``aclose``)."""
        if self._complete:
            self._release()
            return
        connection = self._let_go()
        if connection is not None:
            await self._client._close(connection)
