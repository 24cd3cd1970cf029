"""Reading a worker's answer from its socket: one system call first, then trio's wait
(docs/performance.md, P4b)."""

from __future__ import annotations

import os

import trio


async def receive_some(
    stream: trio.abc.Stream, socket: trio.socket.SocketType | None, max_bytes: int
) -> bytes | bytearray:
    """``stream.receive_some(max_bytes)``, a checkpoint as it is: what ``socket`` (the
    stream's own, None for TLS) holds, else the next bytes to arrive.

    A plain system call first, then trio's wait for readability: on a paced stream the
    previous read drained the socket, and trio's own first attempt costs more than the
    system call it wraps.

    Raises:
        OSError: the connection broke (as ``receive_some`` would, via
            :exc:`trio.BrokenResourceError` for a TLS stream).
    """
    if socket is None:
        return await stream.receive_some(max_bytes)
    fileno = socket.fileno()
    await trio.lowlevel.checkpoint_if_cancelled()  # never after bytes were taken
    try:
        data = os.read(fileno, max_bytes)
    except BlockingIOError:
        while True:
            await trio.lowlevel.wait_readable(socket)
            try:
                return os.read(fileno, max_bytes)
            except BlockingIOError:  # woken with nothing to read after all
                continue
    await trio.lowlevel.cancel_shielded_checkpoint()
    return data
