"""Reading a worker's answer from its socket: trio's wait for readability first, then one
system call (docs/performance.md, P4a and P4b)."""

from __future__ import annotations

import os

import trio


async def receive_some(
    stream: trio.abc.Stream, socket: trio.socket.SocketType | None, max_bytes: int
) -> bytes | bytearray:
    """``stream.receive_some(max_bytes)``, a checkpoint as it is: the next bytes of
    ``socket`` (the stream's own; None for TLS, read through ``stream``), ``b""`` at its
    end.

    The wait comes first and the read after it, one system call: a worker leg reads only
    after it sent a request (whose answer is not there yet) or after a read that drained
    the socket (a paced stream's next token comes later). A read first, as trio's
    ``receive_some`` does, would be refused most times, and both its refusal and the
    schedule point after a read that succeeds cost more than the wait. A cancelled wait
    takes no bytes.

    Raises:
        trio.ClosedResourceError: another task closed the socket during the wait.
        OSError: the connection broke (as ``receive_some`` would, via
            :exc:`trio.BrokenResourceError` for a TLS stream).
    """
    if socket is None:
        return await stream.receive_some(max_bytes)
    while True:
        await trio.lowlevel.wait_readable(socket)
        # Its number now, not before the wait: another task may have closed the socket
        # once the wait was over (a stopping decode leg, while its stream's reader reads
        # it), and the number may already be another file's.
        fileno = socket.fileno()
        if fileno < 0:
            raise trio.ClosedResourceError("another task closed this socket")
        try:
            return os.read(fileno, max_bytes)
        except BlockingIOError:  # woken with nothing to read after all
            continue
