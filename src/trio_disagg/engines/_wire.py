"""The worker client: keep-alive HTTP/1.1 to the workers, over trio, parsed by httptools.

The relay's hot path (docs/performance.md): every token of every stream crosses this
module, so it holds only what a worker leg needs. A POST with a body, a response read as
raw body parts (chunked transfer decoded), a pool of idle connections per worker taken
and given back in O(1), and closing a response before its end closes its connection (the
worker sees the disconnect and aborts the request, B1/P5). A profile of the router behind
httpx showed the client's per-request pool scans and per-read layers as the largest part
of the router's CPU; this client does the same work with one parser call per socket read.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

import trio

from ._connections import Connection, Pool
from ._headers import DefaultHeaders, HeaderMap
from ._response import WorkerResponse
from ._transport import (
    ConnectError,
    PoolTimeout,
    RemoteProtocolError,
    TransportError,
    WriteTimeout,
)


class _Exchange:
    """``async with client.stream(...) as response``: the response once its headers are
    in; closed on the way out."""

    __slots__ = ("_client", "_content", "_headers", "_method", "_path", "_pool", "_response")

    def __init__(self, client: WorkerClient, pool: Pool, method: str, path: str,
                 headers: Mapping[bytes, bytes], content: bytes) -> None:
        self._client, self._method, self._pool = client, method, pool
        self._path, self._headers, self._content = path, headers, content
        self._response: WorkerResponse | None = None

    async def __aenter__(self) -> WorkerResponse:
        client, pool = self._client, self._pool
        head = [self._method.encode(), b" ", self._path.encode(), b" HTTP/1.1\r\nhost: ",
                pool.host.encode(),
                b"\r\ncontent-length: ", str(len(self._content)).encode(), b"\r\n"]
        for name, value in self._headers.items():
            head += (name, b": ", value, b"\r\n")
        head += (client.headers.for_request(self._headers), b"\r\n", self._content)
        request = b"".join(head)
        for attempt in range(2):  # a kept connection the worker closed: once more, anew
            connection, reused = await client._acquire(pool, fresh=attempt > 0,
                                                       get=self._method == "GET")
            response = WorkerResponse(client, pool, connection)
            self._response = response
            try:
                await client._send(connection, request)
                await response._read_head()
            except (trio.BrokenResourceError, OSError, RemoteProtocolError) as exc:
                response._discard()
                if reused and not response._raw_headers:
                    continue
                if isinstance(exc, RemoteProtocolError):
                    raise
                raise RemoteProtocolError(f"connection lost: {_why(exc)}") from exc
            except BaseException:
                response._discard()
                raise
            return response
        raise AssertionError("unreachable")  # pragma: no cover

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._response is not None:
            await self._response.aclose()


def _why(exc: BaseException) -> str:
    """What ended a connection, for its error: a TLS failure (an empty
    :class:`trio.BrokenResourceError` whose cause says it) named as one."""
    cause = exc.__cause__
    if isinstance(cause, ssl.SSLError):
        hint = (": an https:// URL for a worker that speaks plain HTTP?"
                if cause.reason == "WRONG_VERSION_NUMBER" else "")
        return f"TLS failed ({cause.reason or cause}){hint}"
    return str(exc)


class WorkerClient:
    """Keep-alive HTTP/1.1 connections to the workers, shared by the HTTP engines.

    Connections are opened on demand, at most ``max_connections`` at once over all
    workers; an idle one is kept (at most ``max_idle_per_worker`` per worker) for
    ``keepalive_expiry`` seconds, shorter than the workers' own keep-alive timeout, and
    checked before reuse; one past its expiry is closed when its worker's pool is next
    used. A request on a kept connection the worker had closed is sent once more on a
    new one (the worker never saw it). With ``max_connections`` open, a request closes
    the connection idle the longest, of any worker, to open its own: it waits only if
    none is idle. A GET (a health probe, a model list, SGLang's server information: a
    few per worker) never waits: it opens a connection past the bound, closed after its
    answer, so that a fleet busy with streams never fails its probes for want of one.

    Args:
        max_connections: connections open at once, over all workers.
        max_idle_per_worker: idle connections kept per worker.
        keepalive_expiry: seconds an idle connection is kept.
        connect_timeout: seconds to open a connection.
        read_timeout: seconds between two reads of an answer, or None (the default) for
            no bound of the client's own: the router's deadlines bound every wait (the
            prefill deadline, the decode-idle deadline, the transfer deadline), and a
            cancel scope per read would cost the relay's hot path one scope per token.
        write_timeout: seconds to write a request.
        pool_timeout: seconds to wait for a free connection when ``max_connections``
            are open and none of them is idle.
        headers: sent with every request, probes too (a worker's API key:
            ``{"authorization": "Bearer KEY"}``), checked and encoded once
            (:class:`~trio_disagg.engines.DefaultHeaders`); a request's own header of
            the same name wins.

    Use it as an async context manager, or call :meth:`aclose`; closing it closes the
    idle connections (the ones in use close with their responses).

    Raises:
        ValueError: ``max_connections`` < 1 or ``max_idle_per_worker`` < 0, or a bad
            header (one that could inject another: a CR, LF or NUL).
        TypeError: a header name or value neither ``str`` nor ``bytes``.
    """

    def __init__(
        self,
        *,
        max_connections: int = 1024,
        max_idle_per_worker: int = 256,
        keepalive_expiry: float = 4.0,
        connect_timeout: float = 5.0,
        read_timeout: float | None = None,
        write_timeout: float = 30.0,
        pool_timeout: float = 30.0,
        headers: HeaderMap | None = None,
    ) -> None:
        if max_connections < 1 or max_idle_per_worker < 0:
            raise ValueError("max_connections must be >= 1 and max_idle_per_worker >= 0")
        for name, value in [("keepalive_expiry", keepalive_expiry),
                            ("connect_timeout", connect_timeout),
                            ("read_timeout", 1.0 if read_timeout is None else read_timeout),
                            ("write_timeout", write_timeout), ("pool_timeout", pool_timeout)]:
            if not value > 0:  # NaN too
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        self.max_idle_per_worker = max_idle_per_worker
        self.keepalive_expiry = keepalive_expiry
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.pool_timeout = pool_timeout
        #: The headers sent with every request.
        self.headers = DefaultHeaders(headers)
        self._max_connections = max_connections
        self._slots = trio.Semaphore(max_connections)
        self._pools: dict[str, Pool] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    @property
    def connections_open(self) -> int:
        """Connections open now, idle or carrying a request (a GET's past the bound
        not counted)."""
        return self._max_connections - self._slots.value

    @property
    def connections_idle(self) -> int:
        """Idle connections kept for reuse."""
        return sum(len(pool.idle) for pool in self._pools.values())

    def stream(self, method: str, url: str, *, content: bytes,
               headers: Mapping[bytes, bytes]) -> _Exchange:
        """Send ``method`` (``POST``, or ``GET`` for a probe) with ``content`` to ``url``
        with ``headers``; ``async with`` it for the :class:`WorkerResponse`, once its status
        and headers are in.

        Nothing is sent until the ``async with`` is entered. Leaving it closes the
        response (:meth:`WorkerResponse.aclose`): the connection goes back to the pool if
        the body was read to its end, else it is closed and the worker aborts the
        request. A cancelled entry closes the connection it was using.

        Args:
            method: ``"POST"`` or ``"GET"``.
            url: the worker's URL with the path (``http://host:port/v1/completions``).
            content: the request body, in bytes (``b""`` for none); ``content-length`` is
                set from it.
            headers: extra header names to values, in bytes (``host`` is set), sent
                with the client's :attr:`headers` (one of the same name replaces it).

        Raises:
            ValueError: ``method`` is not POST or GET, or ``url`` is not an http(s) URL.
            TransportError: on entering: the worker could not be reached or broke the
                exchange before its headers (a :class:`ConnectError`,
                :class:`PoolTimeout`, :class:`WriteTimeout`, :class:`ReadTimeout` or
                :class:`RemoteProtocolError`).
        """
        if method not in ("POST", "GET"):
            raise ValueError(f"the worker client only POSTs and GETs, not {method}")
        base, _, rest = url.partition("://")
        authority, slash, path = rest.partition("/")
        key = f"{base}://{authority}"
        pool = self._pools.get(key)
        if pool is None:
            pool = self._new_pool(url)
            self._pools[key] = pool
        return _Exchange(self, pool, method, slash + path, headers, content)

    def _new_pool(self, url: str) -> Pool:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        return Pool(parts.hostname, parts.port or (443 if tls else 80), tls)

    async def _acquire(self, pool: Pool, *, fresh: bool = False, get: bool = False
                       ) -> tuple[Connection, bool]:
        if self._closed:
            raise TransportError("the worker client is closed")
        now = trio.current_time()
        idle = pool.idle
        while idle and not fresh:
            connection = idle.pop()  # the most recent: the likeliest to be alive
            if connection.usable(now, self.keepalive_expiry):
                return connection, True
            self._forget(connection)
        slot = self._take_slot() or self._make_room()
        if not (slot or get):
            with trio.move_on_after(self.pool_timeout) as waited:
                await self._slots.acquire()
            if waited.cancelled_caught:
                raise PoolTimeout(f"no free connection in {self.pool_timeout:g} s")
            slot = True
        try:
            connection = await self._connect(pool)
        except BaseException:
            if slot:
                self._slots.release()
            raise
        connection.slot = slot
        return connection, False

    async def _send(self, connection: Connection, request: bytes) -> None:
        """Write ``request`` whole: one non-blocking write when the socket takes it all
        (the usual case: a request is small and the socket's buffer empty), with no
        cancel scope; else the rest under :attr:`write_timeout`.

        Raises:
            WriteTimeout: the rest was not written in time.
            OSError, trio.BrokenResourceError: the connection broke.
        """
        sent = 0
        if connection.socket is not None:
            try:
                sent = os.write(connection.socket.fileno(), request)
            except BlockingIOError:
                sent = 0
        if sent == len(request):
            return  # the caller's next step, reading the answer, is the checkpoint
        with trio.move_on_after(self.write_timeout) as writing:
            await connection.stream.send_all(memoryview(request)[sent:])
        if writing.cancelled_caught:
            raise WriteTimeout(f"request not written in {self.write_timeout:g} s")

    def _take_slot(self) -> bool:
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            return False
        return True

    def _make_room(self) -> bool:
        """Close the connection idle the longest, of any worker, and take its slot: kept
        connections never make a request wait (False: none is idle)."""
        while True:
            pools = [pool for pool in self._pools.values() if pool.idle]
            if not pools:
                return False
            oldest = min(pools, key=lambda pool: pool.idle[0].idle_since)
            self._forget(oldest.idle.popleft())
            if self._take_slot():  # (else a waiting request took the slot: once more)
                return True

    async def _connect(self, pool: Pool) -> Connection:
        with trio.move_on_after(self.connect_timeout) as connecting:
            try:
                tcp = await trio.open_tcp_stream(pool.host, pool.port)
            except OSError as exc:
                raise ConnectError(str(exc)) from exc
        if connecting.cancelled_caught:
            raise ConnectError(f"connect timed out after {self.connect_timeout:g} s")
        if not pool.tls:
            return Connection(tcp, tcp.socket)
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return Connection(trio.SSLStream(tcp, self._ssl, server_hostname=pool.host,
                                          https_compatible=True), None)

    def _give_back(self, pool: Pool, connection: Connection) -> None:
        idle = pool.idle
        if self._closed or len(idle) >= self.max_idle_per_worker or not connection.slot:
            self._forget(connection)
            return
        connection.idle_since = now = trio.current_time()
        # The oldest first: close those past their expiry, which only the newest, reused
        # first, would otherwise keep from being looked at.
        while idle and now - idle[0].idle_since > self.keepalive_expiry:
            self._forget(idle.popleft())
        idle.append(connection)

    def _forget(self, connection: Connection) -> None:
        """Close a connection without a checkpoint (its answer is complete)."""
        if connection.socket is not None:
            connection.socket.close()
        else:  # TLS: no close_notify, the answer was complete
            transport = connection.stream
            assert isinstance(transport, trio.SSLStream)
            inner = transport.transport_stream
            assert isinstance(inner, trio.SocketStream)
            inner.socket.close()
        if connection.slot:
            self._slots.release()

    async def _close(self, connection: Connection) -> None:
        try:
            await connection.stream.aclose()
        finally:
            if connection.slot:
                self._slots.release()

    async def aclose(self) -> None:
        """Close the idle connections; later requests raise :class:`TransportError`.
        Connections carrying a response are closed when that response is. Idempotent."""
        self._closed = True
        for pool in self._pools.values():
            while pool.idle:
                self._forget(pool.idle.pop())
        await trio.lowlevel.checkpoint()


__all__ = ["WorkerClient", "WorkerResponse"]
