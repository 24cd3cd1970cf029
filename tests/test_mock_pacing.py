"""The mock engines' clock (``trio_disagg.mock._pacing``): its waits behave as
``trio.sleep``'s do, with one timer for all of them."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_disagg.mock._pacing import sleep


async def test_sleepers_wake_at_their_deadlines_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await sleep(seconds)
        woke.append((name, trio.current_time() - start))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sleeper, "late", 3.0)
        await trio.testing.wait_all_tasks_blocked()
        # An earlier deadline than the one the timer sleeps for wakes on time.
        nursery.start_soon(sleeper, "early", 1.0)
        nursery.start_soon(sleeper, "middle", 2.0)
        nursery.start_soon(sleeper, "also early", 1.0)
    # (trio runs the tasks woken in one batch in any order: the two at 1 s either way)
    assert sorted(woke) == sorted(
        [("early", 1.0), ("also early", 1.0), ("middle", 2.0), ("late", 3.0)])
    assert [at for _, at in woke] == [1.0, 1.0, 2.0, 3.0]


async def test_a_cancelled_sleep_ends_at_once_and_leaves_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    woke: list[float] = []

    async def sleeper(seconds: float) -> None:
        await sleep(seconds)
        woke.append(trio.current_time() - start)

    async with trio.open_nursery() as nursery:
        with trio.move_on_after(0.5) as cancelled:
            await sleep(1.0)
        assert cancelled.cancelled_caught
        assert trio.current_time() - start == 0.5
        nursery.start_soon(sleeper, 1.0)  # due when the cancelled one was
        nursery.start_soon(sleeper, 2.0)
    assert woke == [1.5, 2.5]


@pytest.mark.parametrize("seconds", [0.0, -1.0])
async def test_a_wait_already_due_is_a_checkpoint(seconds: float) -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        await sleep(seconds)
    assert scope.cancelled_caught


def test_every_trio_run_has_a_timer_of_its_own() -> None:
    async def main() -> float:
        clock_start = trio.current_time()
        await sleep(0.001)
        return trio.current_time() - clock_start

    for _ in range(2):
        assert trio.run(main) >= 0.001
