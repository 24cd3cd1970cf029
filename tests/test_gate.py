"""The gatekeeper between the decode stream and the client: rules G1-G9 in docs/semantics.md
(and B2).

Ports every test of the 1.6.2 reference (``dynamo-llm-1.6.2-handoff.rs.txt``). A decode leg
is a memory channel the test feeds; the prefill is a real drain in a real
:class:`~trio_disagg.TransferKeeper` whose outcome the test decides.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import trio
import trio.testing

from trio_disagg import (
    Annotated,
    DeadlineExceeded,
    FinishReason,
    Gatekeeper,
    Handoff,
    LLMEngineOutput,
    PrefillDeadlineExceeded,
    PrefillError,
    PrefillTask,
    RequestContext,
    Terminal,
    TransferKeeper,
    WorkerError,
    consume_prefill_stream,
)

Item = Annotated[LLMEngineOutput]
LOST = "prefill connection lost"
SUCCESS_FINISHES = [
    FinishReason.EOS,
    FinishReason.STOP,
    FinishReason.LENGTH,
    FinishReason.CONTENT_FILTER,
]


def token(*ids: int) -> Item:
    return Annotated.from_data(LLMEngineOutput(token_ids=list(ids)))


def finished(reason: FinishReason, *ids: int) -> Item:
    return Annotated.from_data(LLMEngineOutput(token_ids=list(ids), finish_reason=reason))


def decode_failures() -> list[Item]:
    return [
        Annotated[LLMEngineOutput].from_error("decode failed"),
        Annotated[LLMEngineOutput].from_exception(
            WorkerError("decode failed", status=502, worker="decode-0")),
        finished(FinishReason.error("decode failed")),
        finished(FinishReason.CANCELLED),
    ]


DECODE_FAILURE_IDS = ["envelope", "envelope-with-exception", "finish-error", "finish-cancelled"]


class Prefill:
    """A prefill drain owned by the keeper; the test decides when and how it ends."""

    def __init__(self, keeper: TransferKeeper, name: str = "r-1") -> None:
        self._go = trio.Event()
        self._error: PrefillError | None = None
        self.completed = False
        self.task: PrefillTask[None] = keeper.start(self._drain, name=name)

    async def _drain(self) -> None:
        await self._go.wait()
        if self._error is not None:
            raise self._error
        self.completed = True

    def succeed(self) -> None:
        self._go.set()

    def fail(self, message: str = LOST, *, error: PrefillError | None = None) -> None:
        """Fail the drain with ``error``, or else with a PrefillError saying ``message``."""
        self._error = error if error is not None else PrefillError(message)
        self._go.set()

    async def succeed_after(self, seconds: float) -> None:
        await trio.sleep(seconds)
        self.succeed()

    async def fail_after(self, seconds: float) -> None:
        await trio.sleep(seconds)
        self.fail()

    async def settled(self) -> None:
        """Resolve by hand, then let the drain run so the outcome is known."""
        with trio.fail_after(1):
            await self.task.wait_done()


class Stream:
    """One request: decode leg -> gatekeeper -> client, each end a memory channel."""

    def __init__(
        self,
        prefill: PrefillTask[Any],
        *,
        client_buffer: float = math.inf,
        idle_timeout: float = math.inf,
        terminal_hold_timeout: float = math.inf,
    ) -> None:
        self.client = RequestContext("r-1")
        self.decode_ctx = RequestContext("r-1")  # not linked: the gate must stop it itself
        self.gate = Gatekeeper(
            prefill,
            self.client,
            idle_timeout=idle_timeout,
            terminal_hold_timeout=terminal_hold_timeout,
        )
        self.decode_send, self.decode_recv = trio.open_memory_channel[Item](math.inf)
        self.client_send, self.client_recv = trio.open_memory_channel[Item](client_buffer)

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self.gate.forward, self.decode_recv, self.client_send, self.decode_ctx)

    def feed(self, *items: Item, end: bool = False) -> None:
        for item in items:
            self.decode_send.send_nowait(item)
        if end:
            self.decode_send.close()

    async def next(self) -> Item:
        with trio.fail_after(10):
            return await self.client_recv.receive()

    async def assert_nothing_yet(self) -> None:
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.WouldBlock):
            self.client_recv.receive_nowait()

    async def assert_ended(self) -> None:
        with trio.fail_after(1), pytest.raises(trio.EndOfChannel):
            await self.client_recv.receive()

    async def rest(self) -> list[Item]:
        """Everything the client still gets, up to the end of the stream."""
        with trio.fail_after(10):
            return [item async for item in self.client_recv]


def error_text(item: Item) -> str:
    assert item.is_error, item
    message = item.error_message()
    assert message is not None
    return message


async def decode_leg(  # noqa: ASYNC114
    value: Any, delay: float = 0, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED
) -> None:
    """A decode dispatch that the worker accepts after ``delay`` seconds."""
    await trio.sleep(delay)
    task_status.started(value)
    await trio.sleep_forever()


# --- G1 ---------------------------------------------------------------------------------


async def test_G1_failure_interrupts_pending_decode_dispatch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ports 1.6.2 ``failure_interrupts_pending_decode_dispatch``."""
    dispatch_cancelled: list[bool] = []

    async def never_accepts(  # noqa: ASYNC114, ASYNC128 (a worker that never accepts)
        *, task_status: trio.TaskStatus[None]
    ) -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            dispatch_cancelled.append(True)
            raise

    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        client = RequestContext("r-1")
        gate = Gatekeeper(prefill.task, client)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prefill.fail_after, 5)
            with trio.fail_after(10), pytest.raises(PrefillError, match=LOST) as info:
                await gate.dispatch(nursery, never_accepts)
            assert trio.current_time() == 5.0
    assert info.value is prefill.task.error  # the prefill's own error, typed
    assert client.is_stopped
    assert dispatch_cancelled == [True]


async def test_G1_tie_prefill_looked_at_first(autojump_clock: trio.testing.MockClock) -> None:
    """The prefill drain fails in the very instant the decode worker accepts: the prefill
    failure still wins, and the decode leg that did start is stopped through the client
    context it is linked to. Repeated, so both scheduling orders of the tie occur."""

    async def prefill_fails_in(seconds: float) -> None:
        await trio.sleep(seconds)
        raise PrefillError(LOST)

    async with TransferKeeper() as keeper:
        for _ in range(20):
            task = keeper.start(functools.partial(prefill_fails_in, 1), name="r-1")
            client = RequestContext("r-1")
            decode_ctx = RequestContext("r-1")
            client.link_child(decode_ctx)
            gate = Gatekeeper(task, client)
            async with trio.open_nursery() as nursery:
                with trio.fail_after(10), pytest.raises(PrefillError, match=LOST):
                    await gate.dispatch(nursery, decode_leg, "decode stream", 1)
                nursery.cancel_scope.cancel()
            assert client.is_stopped
            assert decode_ctx.is_stopped


async def test_G1_tie_already_failed_prefill_dispatches_no_decode(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatched: list[bool] = []

    async def accepts_at_once(*, task_status: trio.TaskStatus[str]) -> None:  # noqa: ASYNC114
        dispatched.append(True)
        task_status.started("decode stream")
        await trio.sleep_forever()

    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        prefill.fail()
        await prefill.settled()
        client = RequestContext("r-1")
        gate = Gatekeeper(prefill.task, client)
        async with trio.open_nursery() as nursery:
            with pytest.raises(PrefillError, match=LOST):
                await gate.dispatch(nursery, accepts_at_once)
    assert dispatched == []
    assert client.is_stopped


@pytest.mark.parametrize("prefill_state", ["pending", "succeeded"])
async def test_G1_decode_dispatch_error_is_raised_as_is(
    autojump_clock: trio.testing.MockClock, prefill_state: str
) -> None:
    """A decode worker that refuses the request raises its own error from dispatch, the same
    whether or not the prefill is still racing it (no ExceptionGroup wrapping)."""

    async def refuses(  # noqa: ASYNC114, ASYNC128 (a worker that refuses)
        *, task_status: trio.TaskStatus[None]
    ) -> None:
        await trio.sleep(1)
        raise WorkerError("decode worker refused", status=503, worker="decode-0")

    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        if prefill_state == "succeeded":
            prefill.succeed()
            await prefill.settled()
        client = RequestContext("r-1")
        gate = Gatekeeper(prefill.task, client)
        async with trio.open_nursery() as nursery:
            with pytest.raises(WorkerError, match="decode worker refused") as info:
                await gate.dispatch(nursery, refuses)
        assert info.value.status == 503
        assert not client.is_stopped
        prefill.succeed()


# --- G2 ---------------------------------------------------------------------------------


async def test_G2_prefill_success_while_dispatch_pending_returns_decode_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prefill.succeed_after, 1)
            with trio.fail_after(10):
                got = await stream.gate.dispatch(nursery, decode_leg, stream.decode_recv, 3)
            assert got is stream.decode_recv  # returned unchanged
            assert trio.current_time() == 3.0  # waited for the worker, not cut short
            assert not stream.client.is_stopped
            nursery.cancel_scope.cancel()


async def test_G2_dispatch_after_prefill_succeeded_just_starts_decode(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        prefill.succeed()
        await prefill.settled()
        gate = Gatekeeper(prefill.task, RequestContext("r-1"))
        async with trio.open_nursery() as nursery:
            assert await gate.dispatch(nursery, decode_leg, "decode stream", 2) == "decode stream"
            assert trio.current_time() == 2.0
            nursery.cancel_scope.cancel()


# --- G3 ---------------------------------------------------------------------------------


async def test_G3_tokens_flow_while_prefill_is_pending_but_success_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ports 1.6.2 ``tokens_flow_while_prefill_is_pending_but_success_waits``."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            stream.feed(token(42), Annotated.from_data(LLMEngineOutput.length()), end=True)
            first = await stream.next()
            assert first.data is not None
            assert first.data.token_ids == [42]
            await stream.assert_nothing_yet()
            prefill.succeed()
            last = await stream.next()
            assert last.data is not None
            assert last.data.finish_reason == FinishReason.LENGTH
            await stream.assert_ended()
    assert not stream.client.is_stopped


async def test_G3_each_token_is_forwarded_as_it_arrives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        arrivals: list[tuple[float, list[int]]] = []

        async def decode_worker() -> None:
            for i in range(3):
                await trio.sleep(1)
                stream.feed(token(i))

        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            nursery.start_soon(decode_worker)
            for _ in range(3):
                item = await stream.next()
                assert item.data is not None
                arrivals.append((trio.current_time(), item.data.token_ids))
            prefill.succeed()
            stream.feed(finished(FinishReason.EOS), end=True)
    assert arrivals == [(1.0, [0]), (2.0, [1]), (3.0, [2])]


# --- G4 ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "failure",
    decode_failures(),
    ids=DECODE_FAILURE_IDS,
)
async def test_G4_decode_failure_does_not_wait_for_prefill(
    autojump_clock: trio.testing.MockClock, failure: Item
) -> None:
    """Ports 1.6.2 ``decode_failure_does_not_wait_for_prefill``."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            first = token(1)
            stream.feed(first, failure, token(2))
            await trio.testing.wait_all_tasks_blocked()
            assert stream.client_recv.receive_nowait() is first
            got = stream.client_recv.receive_nowait()
            assert got is failure  # at once, unchanged
            assert got.exception is failure.exception  # with its exception or without
            await stream.assert_ended()
        assert stream.gate.failure is None  # the decode's error, not one of the gate's
        prefill.succeed()


# --- G5 ---------------------------------------------------------------------------------


async def test_G5_late_prefill_failure_replaces_decode_success(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ports 1.6.2 ``late_prefill_failure_replaces_decode_success``."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            stream.feed(Annotated.from_data(LLMEngineOutput.length()), end=True)
            await stream.assert_nothing_yet()
            prefill.fail()
            assert LOST in error_text(await stream.next())
            await stream.assert_ended()


@pytest.mark.parametrize("reason", SUCCESS_FINISHES, ids=str)
async def test_G5_held_terminal_replaced_and_both_contexts_stopped(
    autojump_clock: trio.testing.MockClock, reason: FinishReason
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            stream.feed(token(1), finished(reason, 2), end=True)
            nursery.start_soon(prefill.fail_after, 3)
            items = await stream.rest()
    assert [i.data.token_ids for i in items[:-1] if i.data] == [[1]]
    assert len(items) == 2
    assert error_text(items[1]) == LOST
    assert items[1].exception is prefill.task.error
    assert stream.client.is_stopped
    assert stream.decode_ctx.is_stopped
    assert isinstance(stream.gate.failure, PrefillError)


@pytest.mark.parametrize("reason", SUCCESS_FINISHES, ids=str)
async def test_G5_success_terminal_held_until_prefill_succeeds(
    autojump_clock: trio.testing.MockClock, reason: FinishReason
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        terminal = finished(reason, 9)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            stream.feed(terminal, end=True)
            nursery.start_soon(prefill.succeed_after, 4)
            assert await stream.next() is terminal
            assert trio.current_time() == 4.0
            await stream.assert_ended()
    assert not stream.client.is_stopped
    assert not stream.decode_ctx.is_stopped


@pytest.mark.parametrize("outcome", ["fails", "succeeds"])
async def test_G5_stream_end_without_terminal_is_held_too(
    autojump_clock: trio.testing.MockClock, outcome: str
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            stream.feed(token(1), end=True)
            assert await stream.next() is not None
            await trio.sleep(2)
            await stream.assert_nothing_yet()  # the end is not passed on yet
            if outcome == "fails":
                prefill.fail()
                assert error_text(await stream.next()) == LOST
            else:
                prefill.succeed()
            await stream.assert_ended()
            assert trio.current_time() == 2.0


PREFILL_ERRORS = [
    PrefillError(LOST),
    PrefillDeadlineExceeded("prefill", 5),
]


@pytest.mark.parametrize("error", PREFILL_ERRORS, ids=lambda error: type(error).__name__)
async def test_G5_error_item_carries_the_prefill_error(
    autojump_clock: trio.testing.MockClock, error: PrefillError
) -> None:
    """The item that replaces the held terminal carries the prefill's exception itself,
    so the server answers from its type (a deadline is a 504, not a 502)."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            stream.feed(token(1), finished(FinishReason.EOS, 2), end=True)
            await trio.sleep(1)
            prefill.fail(error=error)
            items = await stream.rest()
    assert len(items) == 2
    assert items[1].exception is error
    assert error_text(items[1]) == str(error)
    assert stream.gate.failure is error


@pytest.mark.parametrize("error", PREFILL_ERRORS, ids=lambda error: type(error).__name__)
async def test_G6_error_item_carries_the_prefill_error(
    autojump_clock: trio.testing.MockClock, error: PrefillError
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)  # the decode leg never sends anything
            await trio.sleep(3)
            prefill.fail(error=error)
            items = await stream.rest()
    assert len(items) == 1
    assert items[0].exception is error
    assert error_text(items[0]) == str(error)


# --- G6 ---------------------------------------------------------------------------------


async def test_G6_failure_interrupts_wait_for_decode_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ports 1.6.2 ``failure_interrupts_wait_for_decode_tokens``."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)  # the decode leg never sends anything
            await trio.sleep(7)
            prefill.fail()
            assert LOST in error_text(await stream.next())
            assert trio.current_time() == 7.0
            assert stream.client.is_stopped
            assert stream.decode_ctx.is_stopped
            await stream.assert_ended()


async def test_G6_tokens_already_forwarded_stay_and_one_error_follows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            stream.feed(token(1), token(2))
            await trio.testing.wait_all_tasks_blocked()
            prefill.fail()
            items = await stream.rest()
    assert [i.data.token_ids for i in items if i.data] == [[1], [2]]
    assert len(items) == 3
    assert error_text(items[2]) == LOST


async def test_G6_prefill_failure_during_blocked_decode_error_send_still_ends_with_one_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The client is slow: the decode's error item is waiting to be taken when the prefill
    fails. The client must still get exactly one error item, then the end of the stream."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task, client_buffer=0)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            stream.feed(Annotated[LLMEngineOutput].from_error("decode failed"), end=True)
            await trio.testing.wait_all_tasks_blocked()  # the gate blocks in its send
            prefill.fail()
            await trio.testing.wait_all_tasks_blocked()
            items = await stream.rest()
    # The decode error never reached the client, so the prefill failure does (B4, G6).
    assert len(items) == 1, items
    assert error_text(items[0]) == LOST
    assert stream.client.is_stopped and stream.decode_ctx.is_stopped


# --- G7 ---------------------------------------------------------------------------------


async def test_G7_completed_prefill_leaves_decode_stream_unchanged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ports 1.6.2 ``completed_prefill_leaves_decode_stream_unchanged``."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        prefill.succeed()
        await prefill.settled()
        stream = Stream(prefill.task)
        async with trio.open_nursery() as nursery:
            decode = await stream.gate.dispatch(nursery, decode_leg, stream.decode_recv)
            assert decode is stream.decode_recv
            stream.start(nursery)
            terminal = Annotated.from_data(LLMEngineOutput.length())
            stream.feed(terminal, end=True)
            item = await stream.next()
            assert item is terminal
            assert item.data is not None
            assert item.data.finish_reason == FinishReason.LENGTH
            await stream.assert_ended()
            nursery.cancel_scope.cancel()
    assert not stream.client.is_stopped


async def test_G7_after_prefill_succeeds_mid_stream_outputs_pass_unchanged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        before = [token(1), token(2)]
        after = [
            token(3),
            Annotated(data=LLMEngineOutput(token_ids=[4], text="x"), id="r-1", event="delta"),
            finished(FinishReason.STOP, 5),
        ]
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            stream.feed(*before)
            await trio.testing.wait_all_tasks_blocked()
            prefill.succeed()
            await prefill.settled()
            stream.feed(*after, end=True)
            items = await stream.rest()
    assert len(items) == 5
    assert all(got is sent for got, sent in zip(items, before + after, strict=True))
    assert stream.gate.failure is None
    assert not stream.client.is_stopped


# --- G8 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prefill_at", ["before", "during"])
@pytest.mark.parametrize(
    "terminal",
    [finished(FinishReason.EOS), *decode_failures()],
    ids=["eos", *DECODE_FAILURE_IDS],
)
async def test_G8_nothing_forwarded_after_a_decode_terminal(
    autojump_clock: trio.testing.MockClock, prefill_at: str, terminal: Item
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        if prefill_at == "before":
            prefill.succeed()
            await prefill.settled()
        stream = Stream(prefill.task)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            stream.feed(token(1), terminal, token(2), finished(FinishReason.EOS), token(3))
            if prefill_at == "during":
                await trio.testing.wait_all_tasks_blocked()
                prefill.succeed()
            items = await stream.rest()
    assert len(items) == 2
    assert items[1] is terminal


async def test_G8_nothing_forwarded_after_the_gates_own_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        sent_after: list[int] = []

        async def decode_worker_that_keeps_going() -> None:
            for i in range(5):
                await trio.sleep(1)
                try:
                    stream.decode_send.send_nowait(token(i))
                except trio.BrokenResourceError:
                    return
                sent_after.append(i)

        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            nursery.start_soon(decode_worker_that_keeps_going)
            nursery.start_soon(prefill.fail_after, 2.5)
            items = await stream.rest()
    assert [i.data.token_ids for i in items if i.data] == [[0], [1]]
    assert error_text(items[-1]) == LOST
    assert len(items) == 3
    assert sent_after == [0, 1]  # the decode channel was closed by the gate


# --- G9 ---------------------------------------------------------------------------------


async def test_G9_disconnected_client_does_not_drop_prefill_transfer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ports 1.6.2 ``disconnected_client_does_not_drop_prefill_transfer``."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        async with trio.open_nursery() as request:  # the request's nursery
            stream.start(request)
            await trio.testing.wait_all_tasks_blocked()
            stream.client.stop_generating()
            request.cancel_scope.cancel()  # the client disconnected
        assert keeper.in_flight == 1
        prefill.succeed()
        with trio.fail_after(1):
            await keeper.wait_idle()
        assert prefill.completed
        assert keeper.in_flight == 0


async def test_G9_client_cancelled_while_terminal_held_prefill_still_completes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A cancelled client whose prefill still completes: the keeper's count is back at 0."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task)
        with trio.move_on_after(2):
            async with trio.open_nursery() as request:
                stream.start(request)
                stream.feed(token(1), finished(FinishReason.EOS), end=True)
                await stream.next()
                await trio.sleep_forever()  # the client waits for the held terminal...
        assert not prefill.task.done  # ...and goes away; the prefill is untouched
        assert keeper.in_flight == 1
        await trio.sleep(3)
        prefill.succeed()
        await prefill.settled()
        assert prefill.task.succeeded and prefill.completed
        assert keeper.in_flight == 0


@pytest.mark.parametrize("prefill_state", ["pending", "succeeded"])
async def test_G9_client_closing_its_stream_does_not_stop_prefill(
    autojump_clock: trio.testing.MockClock, prefill_state: str
) -> None:
    """A client that closes its end makes the forwarder end quietly and stop the decode
    leg (nobody is listening), and never touches the prefill."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        if prefill_state == "succeeded":
            prefill.succeed()
            await prefill.settled()
        stream = Stream(prefill.task)
        stream.client_recv.close()
        stream.feed(token(1))
        with trio.fail_after(1):
            await stream.gate.forward(stream.decode_recv, stream.client_send, stream.decode_ctx)
        assert stream.decode_ctx.is_stopped
        prefill.succeed()
        with trio.fail_after(1):
            await keeper.wait_idle()
        assert prefill.completed


# --- B2: every wait has a deadline ------------------------------------------------------


async def test_B2_a_slow_client_is_not_an_idle_decode(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The decode-idle deadline bounds the wait for the decode, not the wait for a client
    that reads slowly: a full client channel for longer than the deadline is no error."""
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        prefill.succeed()
        await prefill.settled()
        stream = Stream(prefill.task, idle_timeout=3, client_buffer=0)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            await trio.testing.wait_all_tasks_blocked()  # the gate waits for the decode
            stream.feed(token(1), token(2))
            await trio.sleep(10)  # the client reads nothing for 10 s (autojump clock)
            first = await stream.next()
            second = await stream.next()
            stream.feed(finished(FinishReason.STOP, 3), end=True)
            items = await stream.rest()
        assert [first.data.token_ids, second.data.token_ids] == [[1], [2]]  # type: ignore[union-attr]
        assert [item.event for item in items] == [None]
        assert stream.gate.failure is None


@pytest.mark.parametrize("prefill_state", ["pending", "succeeded"])
async def test_B2_decode_idle_deadline_ends_stream_with_one_error(
    autojump_clock: trio.testing.MockClock, prefill_state: str
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        if prefill_state == "succeeded":
            prefill.succeed()
            await prefill.settled()
        stream = Stream(prefill.task, idle_timeout=3)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            stream.feed(token(1))
            items = await stream.rest()
        assert trio.current_time() == 3.0
        assert len(items) == 2
        assert error_text(items[1]) == "decode idle deadline of 3 s exceeded"
        assert isinstance(stream.gate.failure, DeadlineExceeded)
        assert stream.gate.failure.what == "decode idle"
        assert items[1].exception is stream.gate.failure  # typed, for the server
        assert stream.client.is_stopped and stream.decode_ctx.is_stopped
        prefill.succeed()


async def test_B2_terminal_hold_deadline_ends_stream_with_one_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        prefill = Prefill(keeper)
        stream = Stream(prefill.task, terminal_hold_timeout=2)
        async with trio.open_nursery() as nursery:
            stream.start(nursery)
            stream.feed(finished(FinishReason.EOS), end=True)
            items = await stream.rest()
        assert trio.current_time() == 2.0
        assert len(items) == 1
        assert error_text(items[0]) == "terminal hold deadline of 2 s exceeded"
        assert isinstance(stream.gate.failure, DeadlineExceeded)
        assert stream.gate.failure.what == "terminal hold"
        assert items[0].exception is stream.gate.failure  # typed, for the server
        assert stream.client.is_stopped and stream.decode_ctx.is_stopped
        assert not prefill.task.done  # the keeper still owns the prefill
        prefill.succeed()



# --- the gate takes what the core gives: consume_prefill_stream's completion ----------

BOOTSTRAP_PARAMS = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 7}


def prefill_stream(*items: Item) -> trio.MemoryReceiveChannel[Item]:
    send, receive = trio.open_memory_channel[Item](len(items))
    with send:
        for item in items:
            send.send_nowait(item)
    return receive


def task_names(task: trio.lowlevel.Task) -> list[str]:
    """The names of ``task`` and of every task below it."""
    names = [task.name]
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            names += task_names(child)
    return names


async def forward_all(gate: Gatekeeper, decode: list[Item]) -> list[Item]:
    """Run ``decode`` through ``gate.forward`` and return what the client received."""
    decode_send, decode_receive = trio.open_memory_channel[Item](len(decode))
    with decode_send:
        for item in decode:
            decode_send.send_nowait(item)
    client_send, client_receive = trio.open_memory_channel[Item](math.inf)
    await gate.forward(decode_receive, client_send)
    with client_receive:
        return [item async for item in client_receive]


async def test_G5_gate_takes_a_named_bootstrap_drain_and_its_failure_is_logged_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A pipeline of the core pieces, no glue: the Handoff that consume_prefill_stream
    returned goes to the gate as it is; the drain is named after the request in the
    keeper's task names and logs, and a late failure is logged once (T2) and reaches the
    client as one error item in place of the held terminal (G5)."""
    send, receive = trio.open_memory_channel[Item](0)

    async def prefill_worker() -> None:
        with send:
            await send.send(Annotated.from_data(
                LLMEngineOutput(disaggregated_params=BOOTSTRAP_PARAMS)))
            await trio.sleep(5)
            await send.send(Annotated[LLMEngineOutput].from_error("KV ack lost"))

    async with TransferKeeper() as keeper, trio.open_nursery() as workers:
        workers.start_soon(prefill_worker)
        completion = await consume_prefill_stream(receive, keeper=keeper, name="req-7")
        assert isinstance(completion, Handoff) and completion.drain is not None
        root = trio.lowlevel.current_root_task()
        assert root is not None and "prefill drain req-7" in task_names(root)
        client = RequestContext("req-7")
        gate = Gatekeeper(completion, client)
        assert gate.prefill is completion.drain
        received = await forward_all(gate, [token(1), finished(FinishReason.EOS, 2)])
    assert trio.current_time() == 5.0  # the terminal was held for the prefill outcome
    assert [item.is_error for item in received] == [False, True]
    assert "KV ack lost" in (received[-1].error_message() or "")
    assert client.is_stopped
    failures = [record for record in caplog.records if "KV ack lost" in record.getMessage()]
    assert [record.getMessage().split(":")[0] for record in failures] == [
        "prefill drain req-7 failed"]


async def test_T2_an_unnamed_bootstrap_drain_is_named_after_its_room(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with TransferKeeper() as keeper:
        completion = await consume_prefill_stream(prefill_stream(
            Annotated.from_data(LLMEngineOutput(disaggregated_params=BOOTSTRAP_PARAMS)),
            Annotated[LLMEngineOutput].from_error("KV ack lost")), keeper=keeper)
        assert isinstance(completion, Handoff) and completion.drain is not None
        drain = completion.drain
        await drain.wait_done()
    assert drain.name == "room 7"
    assert [record.getMessage().split(":")[0] for record in caplog.records] == [
        "prefill drain room 7 failed"]


async def test_G7_gate_takes_a_handoff_read_to_its_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A sequential handoff has no drain: its stream was read to its end before
    consume_prefill_stream returned, so the gate knows the prefill succeeded, and the
    drain's value is the completed handoff (S4)."""
    async with TransferKeeper() as keeper:
        completion = await consume_prefill_stream(prefill_stream(
            Annotated.from_data(LLMEngineOutput(disaggregated_params={"kv": 1})),
            Annotated.from_data(LLMEngineOutput.length())), keeper=keeper)
        assert keeper.started_total == 0
    assert isinstance(completion, Handoff) and completion.drain is None
    client = RequestContext("r-1")
    gate = Gatekeeper(completion, client)
    assert gate.prefill.succeeded and gate.prefill.value is completion
    decode = [token(1), finished(FinishReason.EOS, 2)]
    with trio.fail_after(1):
        dispatched = await dispatch_with(gate, "decode stream")
        assert await forward_all(gate, decode) == decode
    assert dispatched == "decode stream" and not client.is_stopped


async def test_S7_gate_from_a_terminal_dispatches_nothing_and_sends_the_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    completion = await consume_prefill_stream(prefill_stream(
        Annotated.from_data(LLMEngineOutput(token_ids=[9], finish_reason=FinishReason.EOS))))
    assert isinstance(completion, Terminal)
    gate = Gatekeeper(completion, RequestContext("r-1"))
    with trio.fail_after(1):
        assert await dispatch_with(gate, "never") is None
        received = await forward_all(gate, [])
    assert received == [completion.output]


async def test_G1_bootstrap_drain_already_failed_fails_the_dispatch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        completion = await consume_prefill_stream(prefill_stream(
            Annotated.from_data(LLMEngineOutput(disaggregated_params=BOOTSTRAP_PARAMS)),
            Annotated[LLMEngineOutput].from_error("KV ack lost")), keeper=keeper, name="r-1")
        assert isinstance(completion, Handoff) and completion.drain is not None
        await completion.drain.wait_done()
        client = RequestContext("r-1")
        gate = Gatekeeper(completion, client)
        async with trio.open_nursery() as nursery:
            with pytest.raises(PrefillError, match="KV ack lost"):
                await gate.dispatch(nursery, trio.sleep_forever)
    assert client.is_stopped


def test_gate_refuses_what_is_not_a_prefill() -> None:
    with pytest.raises(TypeError, match="PrefillTask, a Handoff or a Terminal"):
        Gatekeeper("prefill", RequestContext("r-1"))  # type: ignore[arg-type]


@pytest.mark.parametrize("prefill_done", [False, True], ids=["pending", "succeeded"])
async def test_G1_G2_a_refusal_from_inside_the_engines_own_nursery_is_raised_bare(
    autojump_clock: trio.testing.MockClock, prefill_done: bool
) -> None:
    """docs/howto-engine.md: a group whose one exception is a ``WorkerError`` is the
    engine's refusal. ``dispatch`` of such an engine raised the whole ExceptionGroup to a
    pipeline of one's own; it raises the ``WorkerError`` itself, bare, as the router's
    decode leg does. A group of anything else is left as it is (a bug, not a refusal)."""

    async def refuses(*, task_status: trio.TaskStatus[None]) -> None:  # noqa: ASYNC114
        async with trio.open_nursery():
            raise WorkerError("decode worker busy", status=503)

    async def crashes(*, task_status: trio.TaskStatus[None]) -> None:  # noqa: ASYNC114
        async with trio.open_nursery():
            raise KeyError("bug")

    async with TransferKeeper() as keeper:
        go = trio.Event()
        prefill = keeper.start(go.wait, name="r-1")
        if prefill_done:
            go.set()
            await prefill.wait_done()
        gate = Gatekeeper(prefill, RequestContext("r-1"))
        async with trio.open_nursery() as nursery:
            with pytest.raises(WorkerError, match="decode worker busy") as refused:
                await gate.dispatch(nursery, refuses)
            assert refused.value.status == 503
            crashed: list[BaseException] = []
            try:
                await gate.dispatch(nursery, crashes)
            except ExceptionGroup as group:  # (the engine's own group, as it raised it)
                crashed.extend(group.exceptions)
            assert [type(exc) for exc in crashed] == [KeyError]
        go.set()


def test_gate_refuses_a_client_context_that_is_not_one() -> None:
    """A request id given as the client context raised an AttributeError ("'str' object
    has no attribute 'id'"); now a TypeError that names the argument."""
    with pytest.raises(TypeError, match=r"client_context must be a trio_disagg\.RequestContext"):
        Gatekeeper(PrefillTask("r"), "r")  # type: ignore[arg-type]


async def dispatch_with(gate: Gatekeeper, value: str) -> Any:
    """``gate.dispatch`` of a decode leg that accepts at once with ``value``."""

    async def accepts(*, task_status: trio.TaskStatus[str]) -> None:  # noqa: ASYNC114
        task_status.started(value)

    async with trio.open_nursery() as nursery:
        started = await gate.dispatch(nursery, accepts)
    return started


@pytest.mark.parametrize("name", ["idle_timeout", "terminal_hold_timeout"])
@pytest.mark.parametrize("value", [-1, 0, math.nan, "5"])
def test_B2_a_gate_refuses_a_timeout_that_is_not_a_positive_number_of_seconds(
    name: str, value: Any
) -> None:
    """A negative timeout was accepted and failed every stream at once with "deadline of
    -1 s exceeded"; a NaN one was accepted and raised trio's ValueError from inside the
    reader's first wait. Refused when the gate is made, as :class:`Deadlines` does."""
    with pytest.raises(ValueError, match=f"{name} must be > 0 seconds, got {value!r}"):
        Gatekeeper(PrefillTask("r"), RequestContext("r"), **{name: value})
    no_deadline: dict[str, Any] = {name: math.inf}
    Gatekeeper(PrefillTask("r"), RequestContext("r"), **no_deadline)
