"""The mock engines' clock: one timer per trio run for every simulated wait (a token's
inter-token latency, a prefill's compute, a KV pull).

A real engine steps its whole batch at once; the simulator's sequences each wait for
their own next token. With ``trio.sleep`` each of those waits is a cancel scope of its
own (with its cancel status and two sets, about 2 KiB while it waits, docs/performance.md
P3), entered and left once per token per sequence. Here a waiting sequence is one heap
entry and its parked task, and one system task sleeps until the earliest deadline and
wakes every sequence that is due.
"""

from __future__ import annotations

import heapq
import itertools
import math

import trio


class _Pacer:
    """The timer of one trio run (:data:`_PACER`): a heap of parked tasks and the system
    task that wakes them."""

    def __init__(self) -> None:
        # (deadline on the trio clock, order of arrival, the parked task)
        self._heap: list[tuple[float, int, _Waiter]] = []
        self._order = itertools.count()
        # The timer's scope while it sleeps: an earlier deadline moves its deadline.
        self._scope: trio.CancelScope | None = None
        trio.lowlevel.spawn_system_task(self._run, name="trio_disagg.mock pacer")

    async def sleep_until(self, deadline: float) -> None:
        if deadline <= trio.current_time():
            await trio.lowlevel.checkpoint()
            return
        waiter = _Waiter(trio.lowlevel.current_task())
        heapq.heappush(self._heap, (deadline, next(self._order), waiter))
        if self._scope is not None and deadline < self._scope.deadline:
            self._scope.deadline = deadline
        await trio.lowlevel.wait_task_rescheduled(waiter.abort)

    async def _run(self) -> None:
        heap = self._heap
        while True:
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                heapq.heappop(heap)[2].wake()
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as scope:
                self._scope = scope
                await trio.sleep_forever()
            self._scope = None


class _Waiter:
    """A task parked until its deadline; a cancelled wait leaves its entry behind,
    inert."""

    __slots__ = ("task",)

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task: trio.lowlevel.Task | None = task

    def abort(self, _: object) -> trio.lowlevel.Abort:
        self.task = None
        return trio.lowlevel.Abort.SUCCEEDED

    def wake(self) -> None:
        if self.task is not None:
            trio.lowlevel.reschedule(self.task)
            self.task = None


_PACER: trio.lowlevel.RunVar[_Pacer] = trio.lowlevel.RunVar("trio_disagg.mock pacer")


async def sleep(seconds: float) -> None:
    """Wait ``seconds`` (> 0), as :func:`trio.sleep` does (a checkpoint; cancellable),
    for a fraction of its memory while waiting."""
    try:
        pacer = _PACER.get()
    except LookupError:
        pacer = _Pacer()
        _PACER.set(pacer)
    await pacer.sleep_until(trio.current_time() + seconds)
