"""The reads of every connection whose request is being served, in one task of the
server's: a request's body as it arrives, then whatever comes (a pipelined request, or
the end of the connection: a disconnect, which cancels the request's nursery, G9).

Watching a served connection is what lets the router hear a client that went away
during the prefill, when nothing is written to it. One task per request doing that costs
a nursery, a task and its cancellation each request (about 35 us, 3% of a request's CPU
under P4, docs/performance.md); here a request costs two ``epoll_ctl`` calls. Where there
is no epoll (not Linux) the server reads each served connection in a task of its own
(:meth:`Connection.read_while_serving`).
"""

from __future__ import annotations

import logging
import os
import select

import trio

from ._connection import READ_SIZE, Connection

logger = logging.getLogger("trio_disagg.server")

#: The epoll events watched: data (or the end of the connection), and a half-close.
_READABLE = getattr(select, "EPOLLIN", 0) | getattr(select, "EPOLLRDHUP", 0)


class ReadWatch:
    """One epoll set of the connections being served, read in one task (:meth:`run`).

    A connection is watched from :meth:`add` to :meth:`discard`, and paused while its
    read-ahead is full (:meth:`Connection.read_ahead_full`: its bytes wait unread by the
    app; :meth:`resume` watches it again)."""

    available = hasattr(select, "epoll")

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._watched: dict[int, Connection] = {}

    def add(self, conn: Connection) -> None:
        """Read ``conn`` until :meth:`discard` (the request it serves is over)."""
        conn.watch = self
        self.resume(conn)

    def discard(self, conn: Connection) -> None:
        conn.watch = None
        self._pause(conn)

    def resume(self, conn: Connection) -> None:
        """Read ``conn`` again, if it was paused and its bytes unread are few enough."""
        if (conn.fileno not in self._watched and not conn.closed
                and conn.refusal is None and not conn.read_ahead_full()):
            self._epoll.register(conn.fileno, _READABLE)
            self._watched[conn.fileno] = conn

    def _pause(self, conn: Connection) -> None:
        if self._watched.pop(conn.fileno, None) is not None:
            self._epoll.unregister(conn.fileno)

    async def run(self) -> None:
        """Read the watched connections as their bytes arrive, until cancelled."""
        try:
            while True:
                await trio.lowlevel.wait_readable(self._epoll)
                for fileno, _ in self._epoll.poll(0):
                    conn = self._watched.get(fileno)
                    if conn is not None:
                        self._read(conn)
        finally:
            self._watched.clear()
            self._epoll.close()

    def _read(self, conn: Connection) -> None:
        try:
            data = os.read(conn.fileno, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        try:
            reading = conn._take(data)
        except Exception:
            # The app's disconnect callback failed: that request's connection ends, and
            # the server's other connections are read on.
            logger.exception("the disconnect of %s failed", conn.client)
            conn.scope.cancel()
            reading = False
        if not reading or conn.read_ahead_full():
            self._pause(conn)  # gone, owed a refusal, or the app is behind
