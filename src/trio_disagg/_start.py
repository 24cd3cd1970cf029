"""``await nursery.start(async_fn, *args)`` for the task every request starts and waits
for, its decode leg, without the nursery trio opens for each start (docs/performance.md,
P4a): the task runs in the target nursery from the first, under a cancel scope of its own
that the start cancels if it is cancelled before ``task_status.started()``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio


class _Status(trio.TaskStatus[Any]):
    """The ``task_status`` a task started by :func:`start_in` reports to, and what the
    start learns of it: its value once started, or what ended it before."""

    __slots__ = ("error", "exited", "reported", "scope", "value", "waiter")

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.reported = False  # started() was called
        self.exited = False  # the task ended before started()
        self.value: Any = None
        self.error: BaseException | None = None
        self.waiter: trio.lowlevel.Task | None = None  # the start, while it waits

    def started(self, value: Any = None) -> None:
        if self.reported:
            raise RuntimeError("called 'started' twice on the same task status")
        self.reported = True
        self.value = value
        self._wake()

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            trio.lowlevel.reschedule(waiter)


async def _run(status: _Status, async_fn: Callable[..., Awaitable[object]],
               args: tuple[Any, ...]) -> None:
    try:
        with status.scope:
            await async_fn(*args, task_status=status)
    except Exception as exc:
        if status.reported:
            raise  # after started(): the nursery's, as with nursery.start
        status.error = exc  # before: the start's to raise
    else:
        if not status.reported and not status.scope.cancelled_caught:
            status.error = RuntimeError("child exited without calling task_status.started()")
    finally:
        if not status.reported:
            status.exited = True
            status._wake()


async def start_in(nursery: trio.Nursery, async_fn: Callable[..., Awaitable[object]],
                   *args: Any) -> Any:
    """``await nursery.start(async_fn, *args)``, as trio documents it: ``async_fn`` runs in
    ``nursery``; what it raises before it calls ``task_status.started(value)`` is raised
    here and never reaches the nursery; then this returns ``value``, and what it raises
    is the nursery's.

    Cancelled before ``started()``, this cancels the task and returns once it ended, then
    raises :exc:`trio.Cancelled` (or what the task raised meanwhile). The caller must be
    in ``nursery``'s cancel scope (its ``async with`` block): the task is the nursery's
    from the first, where trio's own start keeps it under the caller's scopes until then.

    Raises:
        RuntimeError: ``nursery`` is closed to new tasks, or the task ended without
            calling ``started()``.
        Exception: what the task raised before ``started()``, as it raised it.
    """
    status = _Status()
    nursery.start_soon(_run, status, async_fn, args)
    try:
        while not (status.reported or status.exited):
            status.waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(_abort_wait(status))
    except BaseException as exc:
        if not status.reported:
            status.scope.cancel()
            with trio.CancelScope(shield=True):  # (short: the task is cancelled)
                while not status.exited and not status.reported:
                    status.waiter = trio.lowlevel.current_task()
                    await trio.lowlevel.wait_task_rescheduled(_abort_wait(status))
            if status.error is not None:  # it failed on its way out: that, as a nursery would
                raise status.error from exc  # noqa: ASYNC104
        raise
    if status.error is not None:
        raise status.error
    if not status.reported:  # cancelled from the nursery, as this task is
        await trio.lowlevel.checkpoint()
        raise RuntimeError("child was cancelled before it called task_status.started()")
    return status.value


def _abort_wait(status: _Status) -> Callable[[Any], trio.lowlevel.Abort]:
    def abort(_: Any) -> trio.lowlevel.Abort:
        status.waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    return abort
