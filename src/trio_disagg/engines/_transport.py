"""The worker client's failures (one :class:`TransportError` family for every client, the
project's own and the httpx adapter) and what both clients share to read a whole body."""

from __future__ import annotations

from collections.abc import Awaitable, Callable


class TransportError(Exception):
    """A worker could not be reached, or broke the HTTP exchange (no status to report).

    The base of the worker client's failures, raised by :meth:`WorkerClient.stream` (on
    entering) and :meth:`WorkerResponse.read`; also raised as is when a request is made
    on a closed client. The HTTP engines turn it into a
    :class:`~trio_disagg.WorkerError` with status 502 before the worker accepted the
    request, or into one error item after.
    """


class ConnectError(TransportError):
    """The connection to the worker could not be opened: refused, unreachable, or not
    open within the client's ``connect_timeout`` (seconds)."""


class ReadTimeout(TransportError):
    """The worker sent nothing for the client's ``read_timeout`` (seconds); never raised
    by a client without one (the default)."""


class WriteTimeout(TransportError):
    """The request could not be written within the client's ``write_timeout`` (seconds)."""


class PoolTimeout(TransportError):
    """No connection became free within the client's ``pool_timeout`` (seconds), with
    ``max_connections`` open."""


class RemoteProtocolError(TransportError):
    """The worker closed the connection early (before or in the middle of its answer),
    the connection broke, or the worker sent something that is not HTTP/1.1 (or headers
    larger than 64 KiB)."""


async def read_up_to(read: Callable[[], Awaitable[bytes]], limit: int | None) -> bytes:
    """The parts ``read`` returns until ``b""`` (or until about ``limit`` bytes), joined."""
    parts: list[bytes] = []
    size = 0
    while part := await read():
        parts.append(part)
        size += len(part)
        if limit is not None and size >= limit:
            break
    return b"".join(parts)


__all__ = [
    "ConnectError",
    "PoolTimeout",
    "ReadTimeout",
    "RemoteProtocolError",
    "TransportError",
    "WriteTimeout",
    "read_up_to",
]
