"""The worker client's connections: one kept connection, and the idle ones kept per
worker (:class:`~trio_disagg.engines.WorkerClient`)."""

from __future__ import annotations

from collections import deque

import trio


class Connection:
    """One keep-alive connection to a worker; ``slot``: it counts towards the client's
    ``max_connections`` (else it was opened past the bound for a GET, and is not kept)."""

    __slots__ = ("idle_since", "slot", "socket", "stream")

    def __init__(self, stream: trio.abc.Stream, socket: trio.socket.SocketType | None) -> None:
        self.stream = stream
        self.socket = socket
        self.idle_since = 0.0
        self.slot = True

    def usable(self, now: float, expiry: float) -> bool:
        """Whether an idle connection may carry a new request: not expired, and nothing
        to read (a readable idle socket is one the worker closed)."""
        if now - self.idle_since > expiry:
            return False
        return self.socket is None or not self.socket.is_readable()


class Pool:
    """The idle connections to one worker (host, port, scheme)."""

    __slots__ = ("host", "idle", "port", "tls")

    def __init__(self, host: str, port: int, tls: bool) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.idle: deque[Connection] = deque()
