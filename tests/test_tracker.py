"""RequestTracker: first-wins recording (S3) and the phase-transition permit (S11)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_disagg import Phase, PrefillError, RequestTracker, TransferKeeper


def phase_of(tracker: RequestTracker) -> Phase:
    return tracker.phase


async def test_S3_record_prefill_complete_first_call_wins(
    autojump_clock: trio.testing.MockClock,
) -> None:
    await trio.sleep(1)
    tracker = RequestTracker()
    assert tracker.created_at == 1.0
    assert tracker.prefill_complete_at is None
    await trio.sleep(2)
    assert tracker.record_prefill_complete() is True
    await trio.sleep(5)
    assert tracker.record_prefill_complete() is False
    assert tracker.prefill_complete_at == 3.0  # the first call's time is kept


async def test_S3_record_decode_first_token_first_call_wins(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tracker = RequestTracker()
    await trio.sleep(4)
    assert tracker.record_decode_first_token() is True
    await trio.sleep(1)
    assert tracker.record_decode_first_token() is False
    assert tracker.decode_first_token_at == 4.0


async def test_S3_kv_transfer_latency_and_ttft(autojump_clock: trio.testing.MockClock) -> None:
    tracker = RequestTracker()  # t = 0
    assert tracker.kv_transfer_latency is None
    assert tracker.time_to_first_token is None
    await trio.sleep(1.5)
    tracker.record_prefill_complete()
    assert tracker.kv_transfer_latency is None  # decode not started yet
    await trio.sleep(0.25)
    tracker.record_decode_first_token()
    assert tracker.kv_transfer_latency == pytest.approx(0.25)
    assert tracker.time_to_first_token == pytest.approx(1.75)


async def test_S3_finish_keeps_first_time(autojump_clock: trio.testing.MockClock) -> None:
    tracker = RequestTracker()
    await trio.sleep(2)
    tracker.finish()
    await trio.sleep(2)
    tracker.finish()
    assert phase_of(tracker) is Phase.DONE
    assert tracker.finished_at == 2.0


def test_S11_one_permit_per_request() -> None:
    tracker = RequestTracker()
    assert phase_of(tracker) is Phase.QUEUED
    tracker.enter_prefill()
    assert phase_of(tracker) is Phase.PREFILL
    with pytest.raises(RuntimeError, match="permit is already held"):
        tracker.enter_prefill()


async def test_S11_enter_decode_blocks_until_permit_released(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tracker = RequestTracker()
    permit = tracker.enter_prefill()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tracker.enter_decode)
            await trio.sleep(5)
            assert phase_of(tracker) is Phase.PREFILL  # still blocked on the permit
            permit.release()
    assert phase_of(tracker) is Phase.DECODE
    assert trio.current_time() == 5.0


def test_S11_releasing_twice_does_not_create_a_second_permit() -> None:
    tracker = RequestTracker()
    permit = tracker.enter_prefill()
    permit.release()
    permit.release()
    assert permit.released
    tracker.enter_prefill()  # the one permit is free again...
    with pytest.raises(RuntimeError):
        tracker.enter_prefill()  # ...but there is still only one


async def test_S11_keeper_start_releases_permit_when_drain_starts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tracker = RequestTracker()
    permit = tracker.enter_prefill()
    finish_drain = trio.Event()

    async def drain() -> None:
        await finish_drain.wait()

    with trio.fail_after(10):
        async with TransferKeeper() as keeper, trio.open_nursery() as nursery:
            nursery.start_soon(tracker.enter_decode)
            await trio.testing.wait_all_tasks_blocked()
            assert phase_of(tracker) is Phase.PREFILL
            task = keeper.start(drain, name="r-1", permit=permit)
            await trio.testing.wait_all_tasks_blocked()
            # The drain has started and is still running: decode may begin.
            assert permit.released
            assert not task.done
            assert phase_of(tracker) is Phase.DECODE
            finish_drain.set()
    assert task.succeeded


async def test_S11_permit_released_even_if_drain_fails_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tracker = RequestTracker()
    permit = tracker.enter_prefill()

    async def drain() -> None:
        await trio.lowlevel.checkpoint()
        raise PrefillError("prefill worker refused")

    with trio.fail_after(10):
        async with TransferKeeper() as keeper:
            task = keeper.start(drain, name="r-1", permit=permit)
            await tracker.enter_decode()
    assert phase_of(tracker) is Phase.DECODE
    assert task.failed
