"""Reading a worker's answer (``trio_disagg.engines._reads``): as ``receive_some``, never
losing bytes to a cancellation."""

from __future__ import annotations

import os

import trio
import trio.testing

from trio_disagg.engines._reads import receive_some


async def test_what_is_there_is_read_at_once_and_what_comes_later_is_waited_for() -> None:
    a, b = trio.socket.socketpair()
    with a, b:
        stream = trio.SocketStream(a)
        await b.send(b"first")
        assert await receive_some(stream, a, 100) == b"first"
        async with trio.open_nursery() as nursery:
            got: list[bytes | bytearray] = []

            async def read() -> None:
                got.append(await receive_some(stream, a, 100))

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            await b.send(b"second")
        assert got == [b"second"]
        b.close()
        assert await receive_some(stream, a, 100) == b""


async def test_a_cancelled_read_takes_no_bytes() -> None:
    a, b = trio.socket.socketpair()
    with a, b:
        stream = trio.SocketStream(a)
        await b.send(b"kept")
        with trio.CancelScope() as scope:
            scope.cancel()
            await receive_some(stream, a, 100)
        assert scope.cancelled_caught
        assert await receive_some(stream, a, 100) == b"kept"



async def test_a_read_woken_as_another_task_closes_its_socket_reads_nothing_else() -> None:
    """The socket is closed by another task (a decode leg that stops while its stream's
    reader reads its worker) after the read was woken, before it ran: the read raises
    ``ClosedResourceError``; it never reads the file that took the closed descriptor's
    number meanwhile (another connection's bytes). The scheduler runs the two tasks in
    either order: tried until the close ran first three times."""
    raced = 0
    for _ in range(60):
        with trio.fail_after(2):
            outcome = await _close_as_the_read_wakes()
        if outcome is not None:
            raced += 1
            read, left = outcome
            assert isinstance(read, trio.ClosedResourceError), read
            assert left == b"another connection's"
            if raced == 3:
                break
    assert raced == 3


async def _close_as_the_read_wakes() -> tuple[object, bytes] | None:
    """A read woken by its socket's bytes while this task closes that socket and opens
    another on the same number, with bytes of its own: what the read gave, and what the
    other socket still holds; None if the read ran first."""
    a, b = trio.socket.socketpair()
    stream = trio.SocketStream(a)
    read: list[object] = []

    async def reader() -> None:
        try:
            read.append(await receive_some(stream, a, 100))
        except trio.ClosedResourceError as exc:
            read.append(exc)

    with b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            number = a.fileno()
            os.write(b.fileno(), b"mine")  # the read wakes at the next look at sockets
            await trio.lowlevel.cancel_shielded_checkpoint()  # the same batch as the read
            stream.socket.close()
            first = bool(read)  # the read ran first
            c, d = trio.socket.socketpair()  # the lowest free number: the closed one's
            with c, d:
                assert first or c.fileno() == number
                os.write(d.fileno(), b"another connection's")
                await trio.testing.wait_all_tasks_blocked()
                try:
                    left = os.read(c.fileno(), 100)
                except BlockingIOError:
                    left = b""
    return None if first else (read[0], left)
