"""Reading a worker's answer (``trio_disagg.engines._reads``): as ``receive_some``, never
losing bytes to a cancellation."""

from __future__ import annotations

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
