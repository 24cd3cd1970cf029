"""The client's end of a decode stream read through the gatekeeper in the reader's own task
(:meth:`Gatekeeper.outputs`, :class:`GatedOutputs`): rules G3-G9 and B2 in
docs/semantics.md where the pull differs from a forwarding task. (The rules themselves are
checked on both paths in tests/test_gate_properties.py.)"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import trio
import trio.testing

from trio_disagg import (
    Annotated,
    DeadlineExceeded,
    FinishReason,
    GatedOutputs,
    Gatekeeper,
    LLMEngineOutput,
    PrefillError,
    PrefillTask,
    RequestContext,
    TransferKeeper,
    WorkerError,
)

Item = Annotated[LLMEngineOutput]
LOST = "prefill connection lost"


def token(*ids: int) -> Item:
    return Annotated.from_data(LLMEngineOutput(token_ids=list(ids)))


def finished(*ids: int) -> Item:
    return Annotated.from_data(LLMEngineOutput(token_ids=list(ids),
                                               finish_reason=FinishReason.STOP))


class Prefill:
    """A prefill drain in the keeper whose outcome the test decides."""

    def __init__(self, keeper: TransferKeeper) -> None:
        self._go = trio.Event()
        self._error: PrefillError | None = None
        self.task: PrefillTask[None] = keeper.start(self._drain, name="r-1")

    async def _drain(self) -> None:
        await self._go.wait()
        if self._error is not None:
            raise self._error

    def succeed(self) -> None:
        self._go.set()

    def fail(self) -> None:
        self._error = PrefillError(LOST)
        self._go.set()


class Request:
    """One request's gate and its reader's channel, with the end counted."""

    def __init__(self, prefill: PrefillTask[None], *, idle_timeout: float = math.inf,
                 on_first_output: bool = False) -> None:
        self.client = RequestContext("r-1")
        self.decode_ctx = RequestContext("r-1")
        self.first_outputs = 0
        self.ends = 0
        self.gate = Gatekeeper(prefill, self.client, idle_timeout=idle_timeout,
                               on_first_output=self._first if on_first_output else None)
        self.decode_send, decode_recv = trio.open_memory_channel[Item](math.inf)
        self.outputs: GatedOutputs = self.gate.outputs(decode_recv, self.decode_ctx,
                                                       self._end)

    def _first(self) -> None:
        self.first_outputs += 1

    def _end(self) -> None:
        self.ends += 1

    async def rest(self) -> list[Item]:
        with trio.fail_after(100):
            return [item async for item in self.outputs]

    async def rest_in_another_task(self, meanwhile: Callable[[], object]) -> list[Item]:
        """What a reader in a task of its own gets when ``meanwhile()`` is called while it
        waits."""
        got: list[Item] = []

        async def read() -> None:
            got.extend(await self.rest())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            meanwhile()
        return got


async def read_a_second_at_a_time(outputs: GatedOutputs) -> list[Item]:
    """Read to the end, each read under a 1 s timeout of the reader's own, carrying on
    after each that expires."""
    items: list[Item] = []
    with trio.fail_after(100):
        while True:
            with trio.move_on_after(1):
                try:
                    items.append(await outputs.receive())
                except trio.EndOfChannel:
                    return items


async def test_G6_a_prefill_failure_stops_both_contexts_before_the_next_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nobody has to be reading: the prefill's own task stops the client and the decode
    leg when it fails, and the reader's next item is the error, then the end."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        request = Request(prefill.task)
        request.decode_send.send_nowait(token(1))
        assert (await request.outputs.receive()).data == token(1).data  # G3
        prefill.fail()
        await trio.testing.wait_all_tasks_blocked()
        assert request.client.is_stopped and request.decode_ctx.is_stopped
        assert isinstance(request.gate.failure, PrefillError)
        assert request.ends == 1  # the request ended with the failure, not at the read
        request.decode_send.send_nowait(token(2))  # too late: never read
        items = await request.rest()
        assert len(items) == 1 and items[0].exception is request.gate.failure


async def test_B2_decode_idle_before_the_first_output_of_a_kept_leg(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A leg kept for the transfer (with a first-output hook) that never sends: the idle
    deadline ends the stream, though the prefill already succeeded."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        prefill.succeed()
        await prefill.task.wait_done()
        request = Request(prefill.task, idle_timeout=3, on_first_output=True)
        items = await request.rest()
        assert trio.current_time() == 3.0
        assert len(items) == 1
        assert isinstance(items[0].exception, DeadlineExceeded)
        assert items[0].exception.what == "decode idle"
        assert request.first_outputs == 0 and request.ends == 1


async def test_G5_a_cancelled_read_keeps_the_held_terminal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        request = Request(prefill.task)
        request.decode_send.send_nowait(finished(1))
        with trio.move_on_after(1) as reader:
            await request.outputs.receive()  # holds the terminal for the prefill (G5)
        assert reader.cancelled_caught
        prefill.succeed()
        items = await request.rest()
        assert [item.data for item in items] == [finished(1).data]
        assert request.ends == 1


async def test_receive_nowait_waits_for_the_gate_while_the_prefill_is_pending(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        request = Request(prefill.task)
        request.decode_send.send_nowait(token(1))
        request.decode_send.send_nowait(token(2))
        with pytest.raises(trio.WouldBlock):
            request.outputs.receive_nowait()  # the gate may have to wait: receive()
        assert request.outputs.receive_ready() is None  # (the same, without the exception)
        assert (await request.outputs.receive()).data == token(1).data
        prefill.succeed()
        await request.gate.prefill.wait_done()
        assert (await request.outputs.receive()).data == token(2).data
        assert request.outputs.receive_ready() is None  # nothing waiting
        request.decode_send.send_nowait(finished(3))
        assert request.outputs.receive_nowait().data == finished(3).data  # G7, no wait
        with pytest.raises(trio.EndOfChannel):
            request.outputs.receive_nowait()  # G8
        with pytest.raises(trio.EndOfChannel):
            request.outputs.receive_ready()
        assert request.ends == 1


async def test_closing_before_the_end_stops_the_decode_leg(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The reader left: the decode leg is stopped and its next send fails; the prefill
    runs on (G9)."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        request = Request(prefill.task)
        with request.outputs:
            request.decode_send.send_nowait(token(1))
            await request.outputs.receive()
        assert request.decode_ctx.is_stopped and not request.client.is_stopped
        with pytest.raises(trio.BrokenResourceError):
            request.decode_send.send_nowait(token(2))
        with pytest.raises(trio.ClosedResourceError):
            await request.outputs.receive()
        assert request.ends == 1
        assert not prefill.task.done
        prefill.succeed()


async def test_G9_a_reader_leaving_on_its_own_timeout_stops_only_the_decode_leg(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reader whose own timeout ends its ``with`` block left: the decode leg is stopped
    (a stalled one would otherwise hold the request's nursery for good), never the
    client's context, and the prefill runs on in the keeper."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        request = Request(prefill.task)
        with trio.move_on_after(1):
            with request.outputs:
                await request.outputs.receive()
        assert request.decode_ctx.is_stopped and not request.client.is_stopped
        with pytest.raises(trio.BrokenResourceError):
            request.decode_send.send_nowait(token(1))
        assert request.ends == 1 and not prefill.task.done
        prefill.succeed()


async def test_G9_abandon_ends_a_stream_its_reader_never_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        prefill.succeed()
        request = Request(prefill.task)
        request.outputs.abandon()
        request.outputs.abandon()  # idempotent
        assert request.ends == 1 and not request.decode_ctx.is_stopped
        with pytest.raises(trio.BrokenResourceError):
            request.decode_send.send_nowait(token(1))
        with pytest.raises(trio.EndOfChannel):
            await request.outputs.receive()


@pytest.mark.parametrize("killed", [False, True], ids=["stopped", "killed"])
async def test_C3_G9_stop_ends_the_stream_of_a_kept_leg_at_once(
    autojump_clock: trio.testing.MockClock, killed: bool,
) -> None:
    """What the router does for a client that stops its context before a kept leg's first
    output: the waiting reader's stream ends at once, as a request stopped before its
    decode was handed it (C3): with one ``cancelled`` finish for a stop, with nothing for
    a kill. No context is stopped: the leg goes on to fetch its KV (G9)."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        prefill.succeed()
        request = Request(prefill.task, on_first_output=True)
        got = await request.rest_in_another_task(lambda: request.outputs.stop(killed))
        if killed:
            assert got == []
        else:
            (item,) = got
            assert item.data is not None and item.data.finish_reason == FinishReason.CANCELLED
        assert request.ends == 1 and request.first_outputs == 0
        assert not request.decode_ctx.is_stopped


async def test_one_reader_at_a_time(autojump_clock: trio.testing.MockClock) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        prefill.succeed()
        request = Request(prefill.task)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(request.outputs.receive)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await request.outputs.receive()
            with pytest.raises(trio.BusyResourceError):
                request.outputs.receive_nowait()
            request.decode_send.send_nowait(token(1))
        request.decode_send.send_nowait(finished(2))
        assert (await request.outputs.receive()).data == finished(2).data  # free again


async def test_G9_a_read_waiting_when_the_request_is_abandoned_ends_the_channel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reader in another task than the request's, waiting when the request's nursery
    is cancelled: its read ends the channel, as a memory channel whose sender closed."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        prefill.succeed()
        request = Request(prefill.task)
        assert await request.rest_in_another_task(request.outputs.abandon) == []
        assert request.ends == 1


async def test_B2_a_readers_own_timeouts_do_not_restart_the_decode_idle_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The decode is idle since the first wait for its next output: a reader that waits a
    second at a time, and carries on, still gets the decode-idle error at 5 s."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        prefill.succeed()
        request = Request(prefill.task, idle_timeout=5)
        items = await read_a_second_at_a_time(request.outputs)
        assert trio.current_time() == pytest.approx(5)
        assert len(items) == 1 and isinstance(items[0].exception, DeadlineExceeded)


async def test_B2_a_readers_own_timeouts_do_not_restart_the_terminal_hold(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        client = RequestContext("r-1")
        gate = Gatekeeper(prefill.task, client, terminal_hold_timeout=5)
        send, receive = trio.open_memory_channel[Item](math.inf)
        send.send_nowait(finished(1))
        items = await read_a_second_at_a_time(gate.outputs(receive))
        assert trio.current_time() == pytest.approx(5)
        assert len(items) == 1 and isinstance(items[0].exception, DeadlineExceeded)
        assert items[0].exception.what == "terminal hold"
        prefill.succeed()


async def test_B5_a_whole_decode_stream_ends_the_request_before_it_is_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A decode leg that ended on its own after the prefill succeeded leaves nothing to
    gate: the request ends then (as a forwarder done with its last item did), and the
    reader still reads every item."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        request = Request(prefill.task)
        request.decode_send.send_nowait(token(1))
        request.decode_send.send_nowait(finished(2))
        request.decode_send.close()
        request.outputs.decode_ended()
        assert request.ends == 0  # the prefill is pending: the terminal is still held
        prefill.succeed()
        await prefill.task.wait_done()
        assert request.ends == 1
        assert [item.data for item in await request.rest()] == [token(1).data,
                                                               finished(2).data]


@pytest.mark.parametrize("read", ["receive", "receive_nowait"])
@pytest.mark.parametrize("prefill_done", [False, True], ids=["prefill pending", "passing"])
async def test_G4_B4_an_output_that_is_not_an_engine_output_ends_the_stream_with_an_error(
    autojump_clock: trio.testing.MockClock, read: str, prefill_done: bool,
) -> None:
    """A decode output that is not an ``Annotated[LLMEngineOutput]`` (a str, a ``None``,
    an ``Annotated`` of a dict) ends the stream with one error item of the gate's, a
    :class:`WorkerError` naming what was sent, and stops both contexts: never an
    ``AttributeError`` in the reader's task, nor (for ``None``) an end that reads as a
    success (G4, B4). Whether the gate still waits for the prefill or lets everything
    pass (G7), and whichever way the reader reads."""
    async with TransferKeeper() as keeper:
        for garbage in ["a token", None, Annotated(data={"token_ids": [1]})]:
            prefill = Prefill(keeper)
            request = Request(prefill.task)
            if prefill_done:
                prefill.succeed()
                await request.gate.prefill.wait_done()
                request.decode_send.send_nowait(token(1))
                assert (await request.outputs.receive()).data == token(1).data  # G7
            request.decode_send.send_nowait(garbage)  # type: ignore[arg-type]
            request.decode_send.send_nowait(finished(2))
            if read == "receive_nowait" and prefill_done:
                error = request.outputs.receive_nowait()
            else:
                error = await request.outputs.receive()
            assert error.is_error and isinstance(error.exception, WorkerError)
            assert "not an Annotated[LLMEngineOutput]" in str(error.error_message())
            assert request.gate.failure is error.exception
            assert request.client.is_stopped and request.decode_ctx.is_stopped
            assert await request.rest() == []  # G8: nothing after it
            assert request.ends == 1
            prefill.succeed()


async def test_B2_the_decode_idle_clock_of_a_wait_on_a_pending_prefill_starts_at_its_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A decode waiting for its first output while its prefill is pending (a bootstrap
    decode waits on the prefill's KV) is not idle: the prefill succeeds after 5 s, and
    the decode that still sends nothing fails at the decode-idle deadline from then."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        request = Request(prefill.task, idle_timeout=3)

        async def succeed_later() -> None:
            await trio.sleep(5)
            prefill.succeed()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(succeed_later)
            items = await request.rest()
        assert trio.current_time() == 8.0
        assert len(items) == 1
        assert isinstance(items[0].exception, DeadlineExceeded)
        assert items[0].exception.what == "decode idle"
