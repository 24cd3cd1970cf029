"""``start_in``: the decode leg's start (G1, G2) keeps ``nursery.start``'s contract without
trio's nursery per start (P4a). Each case as trio's own start behaves."""

from __future__ import annotations

import pytest
import trio

from trio_disagg._start import start_in


async def test_it_returns_what_the_task_reported_and_the_task_runs_on_in_the_nursery(
        autojump_clock: trio.abc.Clock) -> None:
    steps: list[str] = []

    async def leg(name: str, *, task_status: trio.TaskStatus[str]) -> None:
        steps.append("accepted")
        task_status.started(name)
        await trio.sleep(1)
        steps.append("ended")

    async with trio.open_nursery() as nursery:
        assert await start_in(nursery, leg, "decode") == "decode"
        assert steps == ["accepted"]
    assert steps == ["accepted", "ended"]


async def test_what_it_raises_before_started_is_raised_by_the_start_not_the_nursery() -> None:
    async def refused(*, task_status: trio.TaskStatus[None]) -> None:
        await trio.lowlevel.checkpoint()
        raise ValueError("refused")

    async with trio.open_nursery() as nursery:
        with pytest.raises(ValueError, match="refused"):
            await start_in(nursery, refused)
        assert not nursery.child_tasks


async def test_what_it_raises_after_started_is_the_nurserys() -> None:
    async def crashes(*, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        await trio.lowlevel.checkpoint()
        raise ValueError("after")

    with pytest.RaisesGroup(pytest.RaisesExc(ValueError, match="after")):
        async with trio.open_nursery() as nursery:
            await start_in(nursery, crashes)


async def test_a_task_that_ends_without_started_is_an_error() -> None:
    async def silent(*, task_status: trio.TaskStatus[None]) -> None:
        await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        with pytest.raises(RuntimeError, match="without calling task_status"):
            await start_in(nursery, silent)


async def test_started_twice_is_an_error_in_the_task() -> None:
    async def twice(*, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        task_status.started()

    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="twice")):
        async with trio.open_nursery() as nursery:
            await start_in(nursery, twice)


async def test_cancelled_before_started_it_cancels_the_task_and_waits_for_its_end(
        autojump_clock: trio.abc.Clock) -> None:
    cleaned: list[float] = []

    async def slow(*, task_status: trio.TaskStatus[None]) -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(1)  # a bounded cleanup, shielded
            cleaned.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        with trio.move_on_after(5) as waited:
            await start_in(nursery, slow)
        assert waited.cancelled_caught
        assert cleaned == [6.0]  # the start returned once the task had ended
        assert not nursery.child_tasks


async def test_an_error_the_task_raises_while_cancelled_is_raised_by_the_start(
        autojump_clock: trio.abc.Clock) -> None:
    async def fails_on_the_way_out(*, task_status: trio.TaskStatus[None]) -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise ValueError("cleanup failed")

    async with trio.open_nursery() as nursery:
        with trio.move_on_after(5), pytest.raises(ValueError, match="cleanup failed"):
            await start_in(nursery, fails_on_the_way_out)


async def test_the_nursery_cancelled_before_started_cancels_the_start_too() -> None:
    ended: list[str] = []

    async def waits(*, task_status: trio.TaskStatus[None]) -> None:
        try:
            await trio.sleep_forever()
        finally:
            ended.append("task")

    async with trio.open_nursery() as nursery:
        nursery.cancel_scope.cancel()
        try:
            await start_in(nursery, waits)
        except trio.Cancelled:
            ended.append("start")
            raise
    assert sorted(ended) == ["start", "task"]


async def test_a_closed_nursery_takes_no_task() -> None:
    async def leg(*, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()

    async with trio.open_nursery() as nursery:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        await start_in(nursery, leg)
