"""The transfer keeper and its prefill tasks: rules T1-T3 in docs/semantics.md, with B3/B5
exit behaviour."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

from trio_disagg import (
    Annotated,
    DisaggRouter,
    Gatekeeper,
    HandoffStyle,
    LLMEngineOutput,
    PrefillError,
    PrefillTask,
    PreprocessedRequest,
    RequestContext,
    TransferKeeper,
    WorkerPool,
)
from trio_disagg.engines import mock_cluster

KEEPER_LOGGER = "trio_disagg.keeper"


class Drain:
    """A drain whose end the test decides: ``finish()``, ``fail()`` or ``crash()``."""

    def __init__(self, value: str = "done") -> None:
        self.value = value
        self.go = trio.Event()
        self.error: BaseException | None = None
        self.completed = False
        self.cancelled = False

    async def __call__(self) -> str:
        try:
            await self.go.wait()
        except trio.Cancelled:
            self.cancelled = True
            raise
        if self.error is not None:
            raise self.error
        self.completed = True
        return self.value

    def finish(self) -> None:
        self.go.set()

    def fail(self, message: str = "kv transfer failed") -> None:
        self.error = PrefillError(message)
        self.go.set()

    def crash(self) -> None:
        self.error = RuntimeError("boom")
        self.go.set()


async def sleep_then(seconds: float, value: str) -> str:
    await trio.sleep(seconds)
    return value


def sleeper(seconds: float, value: str = "done") -> Callable[[], Awaitable[str]]:
    """A drain that ends by itself after ``seconds``."""
    return functools.partial(sleep_then, seconds, value)


# --- T1 ---------------------------------------------------------------------------------


async def test_T1_cancelled_observer_detaches_drain(
    autojump_clock: trio.testing.MockClock,
) -> None:
    drain = Drain("kv-staged")
    async with TransferKeeper() as keeper:
        task = keeper.start(drain, name="r-1")
        with trio.move_on_after(1) as observer:
            await task.result()  # the request waits, then goes away
        assert observer.cancelled_caught
        await trio.sleep(10)
        assert not task.done  # still running, owned by the keeper
        assert keeper.in_flight == 1
        drain.finish()
        with trio.fail_after(1):
            assert await task.result() == "kv-staged"
    assert drain.completed
    assert not drain.cancelled


async def test_T1_drain_outlives_the_cancelled_request_nursery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    drain = Drain()
    tasks: list[PrefillTask[str]] = []

    async def request(keeper: TransferKeeper) -> None:
        task = keeper.start(drain, name="r-1")
        tasks.append(task)
        await task.wait()

    async with TransferKeeper() as keeper:
        async with trio.open_nursery() as request_nursery:
            request_nursery.start_soon(request, keeper)
            await trio.testing.wait_all_tasks_blocked()
            request_nursery.cancel_scope.cancel()  # the client disconnected
        drain.finish()
        with trio.fail_after(1):
            await keeper.wait_idle()
    assert drain.completed
    assert tasks[0].succeeded


async def test_T1_many_observers_see_the_same_outcome(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every observer gets the one outcome, also after another one left its wait."""
    drain = Drain("v")
    results: list[str] = []

    async def observe(task: PrefillTask[str]) -> None:
        results.append(await task.result())

    async with TransferKeeper() as keeper, trio.open_nursery() as nursery:
        task = keeper.start(drain, name="r-1")
        nursery.start_soon(observe, task)
        with trio.move_on_after(1) as leaving:  # the second of four leaves first
            async with trio.open_nursery() as middle:
                middle.start_soon(observe, task)
                await trio.sleep_forever()
        for _ in range(2):
            nursery.start_soon(observe, task)
        await trio.testing.wait_all_tasks_blocked()
        assert leaving.cancelled_caught
        assert repr(task) == "<PrefillTask 'r-1' running>"
        drain.finish()
    assert results == ["v", "v", "v"]
    assert repr(task) == "<PrefillTask 'r-1' succeeded>"


# --- T2 ---------------------------------------------------------------------------------


async def test_T2_failed_drain_logs_its_error_with_no_observer(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=KEEPER_LOGGER)
    drain = Drain()
    async with TransferKeeper() as keeper:
        task = keeper.start(drain, name="req-77")
        del task  # nobody observes it: the client has gone
        drain.fail("bootstrap room 5 lost")
    records = [r for r in caplog.records if r.name == KEEPER_LOGGER]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert "req-77" in records[0].getMessage()
    assert "bootstrap room 5 lost" in records[0].getMessage()
    assert keeper.failed_total == 1


async def test_T2_crashed_drain_logs_traceback(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=KEEPER_LOGGER)
    drain = Drain()
    async with TransferKeeper() as keeper:
        keeper.start(drain, name="req-78")
        drain.crash()
    records = [r for r in caplog.records if r.name == KEEPER_LOGGER]
    assert len(records) == 1
    assert "req-78" in records[0].getMessage()
    assert records[0].exc_info is not None
    assert isinstance(records[0].exc_info[1], RuntimeError)


# --- T3 ---------------------------------------------------------------------------------


async def test_T3_crashed_drain_reports_did_not_complete(
    autojump_clock: trio.testing.MockClock,
) -> None:
    crashing = Drain()
    healthy = Drain("ok")
    async with TransferKeeper() as keeper:
        task = keeper.start(crashing, name="r-1")
        other = keeper.start(healthy, name="r-2")
        crashing.crash()
        with pytest.raises(PrefillError, match="did not complete") as info:
            await task.wait()
        assert isinstance(info.value.__cause__, RuntimeError)
        assert task.failed and task.error is info.value
        # The crash stayed inside its drain: the keeper and its other drains go on.
        healthy.finish()
        assert await other.result() == "ok"
    assert keeper.failed_total == 1


async def test_T3_crash_inside_nested_nurseries_reads_as_one_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A drain whose engine crashed inside nurseries of its own: the error names the
    crash once, in words, not the repr of the exception groups it arrived in; the
    consequence (the stream ended with no output) is left out."""

    async def engine() -> None:
        raise RuntimeError("engine crash")

    async def drain() -> None:
        try:
            async with trio.open_nursery() as outer:
                outer.start_soon(engine)
                async with trio.open_nursery() as inner:
                    inner.start_soon(engine)
                    inner.start_soon(trio.sleep_forever)
        except* RuntimeError:
            raise PrefillError("Prefill returned no output (stream ended)") from None

    async def crashing_leg() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine)
            await drain()

    async with TransferKeeper() as keeper:
        task = keeper.start(crashing_leg, name="r-1")
        with pytest.raises(PrefillError) as info:
            await task.wait()
    assert str(info.value) == (
        "Prefill background task did not complete: r-1 crashed: RuntimeError: engine crash")


async def test_T3_engine_crash_through_the_router_is_one_readable_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A prefill engine that raises after started() (a broken engine): the client's
    error is one PrefillError, raised bare, whose message says what crashed."""

    class CrashingPrefill:
        name = "crashing"
        handoff_style = HandoffStyle.SEQUENTIAL
        bootstrap_host: str | None = None
        bootstrap_port: int | None = None

        async def generate(
            self,
            request: PreprocessedRequest,
            context: RequestContext,
            send_channel: trio.MemorySendChannel[Annotated[LLMEngineOutput]],
            *,
            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
        ) -> None:
            with send_channel:
                task_status.started()
                await trio.sleep(0.01)
                raise RuntimeError("engine crash")

    cluster = mock_cluster()
    request = PreprocessedRequest(request_id="r-1", model="m", body={"prompt": "x"})
    async with TransferKeeper() as keeper:
        router = DisaggRouter(WorkerPool([CrashingPrefill()]), WorkerPool(cluster.decode),
                              keeper)
        async with trio.open_nursery() as nursery:
            with pytest.raises(PrefillError) as info:
                await router.stream(nursery, request, RequestContext("r-1"))
    assert str(info.value) == (
        "Prefill background task did not complete: r-1 crashed: RuntimeError: engine crash")


async def test_T3_cancelled_drain_reports_did_not_complete(
    autojump_clock: trio.testing.MockClock,
) -> None:
    drain = Drain()
    async with TransferKeeper(drain_window=1) as keeper:
        task = keeper.start(drain, name="r-1")
    assert drain.cancelled
    with pytest.raises(PrefillError, match=r"did not complete.*cancelled"):
        await task.wait()


async def test_T3_drain_cancelled_inside_its_own_nursery_reports_did_not_complete(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def drain_with_helpers() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            await trio.sleep_forever()

    async with TransferKeeper(drain_window=1) as keeper:
        task = keeper.start(drain_with_helpers, name="r-1")
    with pytest.raises(PrefillError, match="did not complete"):
        await task.wait()
    assert keeper.cancelled_total == 1
    assert keeper.failed_total == 0


async def test_T3_prefill_error_is_reported_as_is(
    autojump_clock: trio.testing.MockClock,
) -> None:
    drain = Drain()
    async with TransferKeeper() as keeper:
        task = keeper.start(drain, name="r-1")
        drain.fail("Prefill backend failed: oom")
        with pytest.raises(PrefillError) as info:
            await task.result()
    assert str(info.value) == "Prefill backend failed: oom"
    assert task.error is info.value
    assert task.done and task.failed and not task.succeeded
    assert repr(task) == "<PrefillTask 'r-1' failed>"


async def test_T3_prefill_error_raised_in_a_drain_nursery_is_reported_as_is(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def drain_with_helpers() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            await trio.sleep(1)
            raise PrefillError("Prefill backend failed: oom")

    async with TransferKeeper() as keeper:
        task = keeper.start(drain_with_helpers, name="r-1")
        with pytest.raises(PrefillError) as info:
            await task.wait()
    assert str(info.value) == "Prefill backend failed: oom"  # not wrapped, not "crashed"
    assert keeper.failed_total == 1


async def test_T3_other_error_beside_a_prefill_error_is_did_not_complete(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def fails(exc: Exception) -> None:
        with trio.CancelScope(shield=True):  # so both failures land in the group
            await trio.sleep(1)
        raise exc

    async def drain_with_two_failures() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails, PrefillError("prefill lost"))
            nursery.start_soon(fails, RuntimeError("bug"))

    async with TransferKeeper() as keeper:
        task = keeper.start(drain_with_two_failures, name="r-1")
        with pytest.raises(PrefillError, match="did not complete"):
            await task.wait()


# --- exit behaviour, counters (B3, B5) --------------------------------------------------


async def test_B5_in_flight_counts_every_outcome(autojump_clock: trio.testing.MockClock) -> None:
    drains = [Drain() for _ in range(4)]
    async with TransferKeeper() as keeper:
        assert keeper.in_flight == 0
        tasks = [keeper.start(d, name=f"r-{i}") for i, d in enumerate(drains)]
        assert keeper.in_flight == 4
        drains[0].finish()
        await tasks[0].wait_done()
        assert keeper.in_flight == 3
        drains[1].fail()
        await tasks[1].wait_done()
        assert keeper.in_flight == 2
        drains[2].crash()
        await tasks[2].wait_done()
        assert keeper.in_flight == 1
        drains[3].finish()
        with trio.fail_after(1):
            await keeper.wait_idle()
        assert keeper.in_flight == 0
        assert keeper.started_total == 4
        assert keeper.failed_total == 2
        assert keeper.cancelled_total == 0
        # Busy again after idle: wait_idle waits for the new drain.
        again = keeper.start(sleeper(2), name="r-5")
        assert keeper.in_flight == 1
        await keeper.wait_idle()
        assert again.succeeded
        assert trio.current_time() == 2.0


async def test_B3_exit_waits_for_drains_within_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper(drain_window=10) as keeper:
        first = keeper.start(sleeper(2, "a"), name="a")
        second = keeper.start(sleeper(3, "b"), name="b")
    assert trio.current_time() == 3.0  # as soon as the last drain ended, not the window
    assert await first.result() == "a"
    assert await second.result() == "b"
    assert keeper.cancelled_total == 0
    assert keeper.in_flight == 0


async def test_B3_exit_cancels_drains_past_the_window_logging_each(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=KEEPER_LOGGER)
    stuck_a, stuck_b = Drain(), Drain()
    async with TransferKeeper(drain_window=5) as keeper:
        a = keeper.start(stuck_a, name="stuck-a")
        b = keeper.start(stuck_b, name="stuck-b")
        quick = keeper.start(sleeper(1, "quick"), name="quick")
    assert trio.current_time() == 5.0
    assert await quick.result() == "quick"
    assert stuck_a.cancelled and stuck_b.cancelled
    for task in (a, b):
        with pytest.raises(PrefillError, match="did not complete"):
            await task.wait()
    assert keeper.in_flight == 0
    assert keeper.cancelled_total == 2
    messages = [r.getMessage() for r in caplog.records if r.name == KEEPER_LOGGER]
    assert any("drain window of 5 s over; cancelling 2" in m for m in messages)
    cancelled = sorted(m for m in messages if "cancelled before it completed" in m)
    assert len(cancelled) == 2
    assert "stuck-a" in cancelled[0]
    assert "stuck-b" in cancelled[1]


async def test_B3_zero_window_cancels_at_once(autojump_clock: trio.testing.MockClock) -> None:
    drain = Drain()
    async with TransferKeeper(drain_window=0) as keeper:
        task = keeper.start(drain, name="r-1")
    assert trio.current_time() == 0.0
    assert task.failed
    assert keeper.in_flight == 0


async def test_B3_outer_cancellation_is_a_hard_stop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    drain = Drain()
    with trio.move_on_after(1):
        async with TransferKeeper(drain_window=30) as keeper:
            task = keeper.start(drain, name="r-1")
            await trio.sleep_forever()
    assert trio.current_time() == 1.0  # did not wait out the 30 s window
    assert drain.cancelled
    assert task.failed
    assert keeper.in_flight == 0


async def test_B3_start_during_exit_admits_only_the_keepers_own_follow_ups(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Within the drain window a drain may start its follow-up (a B1 cleanup for the KV
    it staged, the drain of a bootstrap stream), which the window waits for; a task that
    is not the keeper's is refused, and after the exit everyone is."""
    refused: list[str] = []
    follow_ups: list[PrefillTask[str]] = []
    keeper = TransferKeeper(drain_window=10)

    async def drain_that_starts_a_follow_up() -> None:
        await trio.sleep(1)  # by now the keeper is exiting
        follow_ups.append(keeper.start(sleeper(2, "cleanup"), name="cleanup"))

    async def outsider() -> None:
        await trio.sleep(1)
        try:
            keeper.start(sleeper(1), name="late")
        except RuntimeError as exc:
            refused.append(str(exc))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(outsider)
        async with keeper:
            keeper.start(drain_that_starts_a_follow_up, name="first")
    assert refused == ["the TransferKeeper is not open; no new drains are accepted"]
    assert trio.current_time() == 3.0  # the window waited for the follow-up
    assert [await task.result() for task in follow_ups] == ["cleanup"]
    with pytest.raises(RuntimeError, match="not open"):
        keeper.start(sleeper(1), name="after")
    with pytest.raises(RuntimeError, match="not open"):
        keeper.spawn_leg(sleeper(1), name="after")
    assert keeper.started_total == 2
    assert keeper.cancelled_total == 0


async def test_B3_a_follow_up_started_past_the_window_is_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A follow-up a drain starts while the keeper cancels it (past the window) is
    cancelled with it and reported, not left running."""
    follow_ups: list[PrefillTask[str]] = []
    keeper = TransferKeeper(drain_window=1)

    async def drain() -> None:
        try:
            await trio.sleep_forever()
        finally:
            follow_ups.append(keeper.start(sleeper(5, "cleanup"), name="cleanup"))

    async with keeper:
        keeper.start(drain, name="stuck")
    assert trio.current_time() == 1.0
    assert follow_ups[0].failed
    assert keeper.in_flight == 0
    assert keeper.cancelled_total == 2


def test_B3_start_before_enter_raises() -> None:
    with pytest.raises(RuntimeError, match="not open"):
        TransferKeeper().start(sleeper(1), name="r-1")


async def test_B3_keeper_is_entered_once(autojump_clock: trio.testing.MockClock) -> None:
    keeper = TransferKeeper()
    async with keeper:
        pass
    with pytest.raises(RuntimeError, match="only once"):
        async with keeper:
            pass


@pytest.mark.parametrize("window", [-1.0, math.nan])
def test_B3_drain_window_must_be_non_negative(window: float) -> None:
    with pytest.raises(ValueError, match="drain_window"):
        TransferKeeper(drain_window=window)


@pytest.mark.parametrize("window", ["30", None, True])
def test_B3_drain_window_must_be_a_number(window: Any) -> None:
    """A string raised trio's comparison TypeError ("'<' not supported"); now a TypeError
    naming the argument. (A bool is not a number of seconds either.)"""
    with pytest.raises(TypeError, match="drain_window must be a number of seconds"):
        TransferKeeper(drain_window=window)


async def test_B5_a_leg_failing_as_the_keeper_closes_never_raises_into_its_nursery(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A started leg whose cleanup fails while the keeper cancels it at shutdown raises a
    group of a cancellation and an error. The error is logged; the keeper exits cleanly."""
    caplog.set_level(logging.WARNING, logger=KEEPER_LOGGER)

    async def leg(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async def fails_on_cancel() -> None:
            try:
                await trio.sleep_forever()
            finally:
                raise ValueError("cleanup failed")  # the point of the test

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails_on_cancel)
            nursery.start_soon(trio.sleep_forever)
            task_status.started()

    async with TransferKeeper(drain_window=1) as keeper:
        started = keeper.spawn_leg(leg, name="leg")
        await started.wait_started()
        assert keeper.in_flight_by_kind() == {"decode leg": 1}
    assert keeper.in_flight == 0
    messages = [r.getMessage() for r in caplog.records if r.name == KEEPER_LOGGER]
    assert any("transfer leg leg failed" in m for m in messages)


async def test_B5_keeper_counts_tasks_by_kind(autojump_clock: trio.testing.MockClock) -> None:
    async with TransferKeeper() as keeper:
        keeper.start(sleeper(1, "a"), name="a")
        keeper.start(sleeper(1, "b"), name="b", kind="B1 cleanup")
        assert keeper.in_flight_by_kind() == {"prefill drain": 1, "B1 cleanup": 1}
        await keeper.wait_idle()
    assert keeper.started_by_kind == {"prefill drain": 1, "B1 cleanup": 1}


async def test_an_exception_in_the_keepers_body_comes_out_bare(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``async with TransferKeeper()`` is a context manager, not a nursery a caller opened:
    an exception raised in its body used to come out wrapped in an ExceptionGroup, and so
    did its own documented RuntimeError for a second entry. The drains still get their
    window (B3)."""
    keeper = TransferKeeper(drain_window=1)
    with pytest.raises(KeyError, match="mine") as info:
        async with keeper:
            task = keeper.start(functools.partial(trio.sleep, 0.5), name="late")
            raise KeyError("mine")
    assert info.value.__context__ is None  # as raised, not re-raised from a group
    assert task.succeeded and keeper.in_flight == 0
    with pytest.raises(RuntimeError, match="entered only once"):
        async with keeper:
            pass
    reentered = TransferKeeper()
    with pytest.raises(RuntimeError, match="entered only once"):
        async with reentered, reentered:
            pass
    # a group raised there stays as it was, not wrapped in another
    with pytest.RaisesGroup(KeyError, KeyError, match="^mine$"):
        async with TransferKeeper():
            raise ExceptionGroup("mine", [KeyError("a"), KeyError("b")])


async def test_T2_a_watcher_that_raises_never_reaches_the_keepers_nursery(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A gatekeeper watching a drain calls its reader's ``on_end`` from inside the drain's
    task when the drain fails. One that raises (a bug) is logged: it must not crash the
    keeper's nursery and cancel the other drains (T1, T2)."""
    failing, other = Drain(), Drain("other")
    async with TransferKeeper() as keeper:
        task = keeper.start(failing, name="r-1")
        bystander = keeper.start(other, name="r-2")
        gate = Gatekeeper(task, RequestContext("r-1"))
        _, receive = trio.open_memory_channel[Annotated[LLMEngineOutput]](1)
        outputs = gate.outputs(receive, None, on_end=lambda: 1 / 0)
        failing.fail()
        await task.wait_done()
        other.finish()
    assert await bystander.result() == "other"
    with outputs:
        assert (await outputs.receive()).is_error  # the prefill's error (G6)
    assert keeper.cancelled_total == 0
    assert any("watcher" in r.getMessage() and r.exc_info for r in caplog.records)
