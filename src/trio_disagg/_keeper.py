"""The transfer keeper: the service-lifetime owner of prefill drains (rules T1-T4 in
docs/semantics.md)."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from types import TracebackType
from typing import Any, Generic, TypeVar

import trio
from trio_util import AsyncValue

from ._crash import crash_message, first_leaf, worker_refusal
from ._errors import PrefillCancelled, PrefillError
from ._leg import TransferLeg as TransferLeg
from ._tracker import PhasePermit

T = TypeVar("T")

logger = logging.getLogger("trio_disagg.keeper")

#: Kinds of keeper tasks, counted apart (:meth:`TransferKeeper.in_flight_by_kind`).
PREFILL_DRAIN = "prefill drain"
DECODE_LEG = "decode leg"
CLEANUP = "B1 cleanup"


class PrefillTask(Generic[T]):
    """The observable outcome of one prefill drain running in a :class:`TransferKeeper`
    (:meth:`TransferKeeper.start` returns it).

    The drain belongs to the keeper, not to whoever holds this object: cancelling or
    dropping the observer detaches it and the drain runs on until the prefill stream ends
    (T1). Any number of tasks may wait on it. A :class:`~trio_disagg.Gatekeeper` takes
    it as the request's prefill.

    Attributes:
        name: the drain's name, as the keeper's logs show it (usually the request id).
    """

    __slots__ = ("_callbacks", "_ended", "_error", "_value", "_waiters", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._ended = False
        # The tasks waiting for the end; made only when one waits before it (P3: an
        # Event and its parking lot cost about 1 KiB a request).
        self._waiters: list[trio.lowlevel.Task] | None = None
        self._callbacks: list[Callable[[], None]] | None = None
        self._value: T | None = None
        self._error: PrefillError | None = None

    def __repr__(self) -> str:
        state = "running" if not self.done else "failed" if self.failed else "succeeded"
        return f"<PrefillTask {self.name!r} {state}>"

    @property
    def done(self) -> bool:
        """True once the drain ended, however it ended."""
        return self._ended

    @property
    def failed(self) -> bool:
        """True once the drain failed, crashed or was cancelled (:attr:`error` says why)."""
        return self._error is not None

    @property
    def succeeded(self) -> bool:
        """True once the drain returned (:attr:`value` is what it returned)."""
        return self._ended and self._error is None

    @property
    def error(self) -> PrefillError | None:
        """The failure, once the task failed; else None."""
        return self._error

    @property
    def value(self) -> T | None:
        """The drain's result once it succeeded; None before that or after a failure."""
        return self._value

    async def wait_done(self) -> None:
        """Return once the drain ended, however it ended. Never raises but ``Cancelled``."""
        await self._ended_wait()

    async def result(self) -> T:
        """Wait for the drain and return its value.

        Raises:
            PrefillError: the drain failed; a drain that crashed with another exception or
                was cancelled reports "did not complete" (T3). The same exception object
                for every waiter.

        Cancelling the wait does not affect the drain (T1).
        """
        await self._ended_wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    async def wait(self) -> None:
        """Like :meth:`result`, discarding the value."""
        await self.result()

    async def _ended_wait(self) -> None:
        if self._ended:
            await trio.lowlevel.checkpoint()  # as Event.wait() on a set event
            return
        task = trio.lowlevel.current_task()
        if self._waiters is None:
            self._waiters = []
        waiters = self._waiters
        waiters.append(task)

        def abort(_: object) -> trio.lowlevel.Abort:
            waiters.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def _on_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the drain ended (at once if it has). For the core's
        own watchers (the gatekeeper's), which must not raise nor await: they run in the
        keeper's task, into whose nursery nothing may raise."""
        if self._ended:
            callback()
            return
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)

    def _forget_on_done(self, callback: Callable[[], None]) -> None:
        """Drop a callback of :meth:`_on_done` that has no more use; one not registered
        (or already called) is ignored."""
        if self._callbacks is not None and callback in self._callbacks:
            self._callbacks.remove(callback)

    def _finish(self, value: T | None, error: PrefillError | None) -> None:
        self._value = value
        self._error = error
        self._ended = True
        waiters, self._waiters = self._waiters, None
        for task in waiters or ():
            trio.lowlevel.reschedule(task)
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            try:
                callback()
            except Exception:  # (one that reached user code) never into the keeper (T2)
                logger.exception("a watcher of the prefill %s raised", self.name)


class TransferKeeper:
    """An async context manager owning the nursery in which prefill drains run (rules
    T1-T3, B3, B5 in docs/semantics.md).

    Open it once for the life of the service, outside every request's nursery, so that a
    client's cancellation is never the parent of a KV transfer (T1, G9). A drain never
    raises into the keeper's nursery: its outcome is stored in its :class:`PrefillTask`
    and a failure is logged from inside the drain (T2), so the evidence survives a client
    that has gone.

    On exit the keeper stops accepting drains, waits up to ``drain_window`` seconds for the
    in-flight ones to end, then cancels what is left, logging each one it cancelled
    (rule B3 in docs/semantics.md). Within that window a task of the keeper's own may
    still start its follow-ups (a B1 cleanup decode for the KV its prefill staged, the
    drain of a bootstrap stream, a decode leg kept for the transfer), so that a transfer
    in flight at shutdown ends as it would have; nothing else is admitted. If the code
    around the keeper is itself cancelled, the drains are cancelled with it: that is a
    hard stop, not a graceful one. An exception raised in the ``async with`` body comes
    out as it was raised, never wrapped in an exception group.

    Args:
        drain_window: seconds to let in-flight drains finish on exit.

    Raises:
        ValueError: a negative or NaN ``drain_window``.
        TypeError: a ``drain_window`` that is not a number.
        RuntimeError: on entering a keeper a second time.

    Attributes:
        drain_window: as given.
        started_total: drains and legs started, in all.
        failed_total: drains that failed or crashed (not those ended on purpose, B6, B10).
        cancelled_total: drains cancelled before they completed (B3).
    """

    def __init__(self, *, drain_window: float = 30.0) -> None:
        if not isinstance(drain_window, int | float) or isinstance(drain_window, bool):
            raise TypeError(f"drain_window must be a number of seconds, got {drain_window!r}")
        if drain_window < 0 or math.isnan(drain_window):
            raise ValueError(f"drain_window must be >= 0 seconds, got {drain_window}")
        self.drain_window = drain_window
        self._nursery_manager: Any = None
        self._nursery: trio.Nursery | None = None
        # While exiting: the nursery, open to the follow-ups of its own tasks only (B3).
        self._exiting: trio.Nursery | None = None
        self._in_flight: dict[object, str] = {}  # drains and legs, by identity: their kind
        # None in flight, for the tasks waiting for the keeper to go idle (flipped only
        # at none, not on every task).
        self._idle = AsyncValue(True)
        #: Tasks started, by kind (:data:`PREFILL_DRAIN`, :data:`DECODE_LEG`, ...).
        self.started_by_kind: Counter[str] = Counter()
        self.started_total = 0
        self.failed_total = 0
        self.cancelled_total = 0

    @property
    def in_flight(self) -> int:
        """Drains and legs started and not yet ended (rule B5 in docs/semantics.md)."""
        return len(self._in_flight)

    @property
    def closing(self) -> bool:
        """The keeper is shutting down (or was never entered): it starts no new drains,
        only the follow-ups of those in flight (B3)."""
        return self._nursery is None

    def in_flight_by_kind(self) -> Counter[str]:
        """What is in flight, by kind: prefill drains, decode legs kept for a transfer,
        B1 cleanups."""
        return Counter(self._in_flight.values())

    async def __aenter__(self) -> TransferKeeper:
        if self._nursery_manager is not None:
            raise RuntimeError("a TransferKeeper can be entered only once")
        self._nursery_manager = trio.open_nursery()
        self._nursery = await self._nursery_manager.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        nursery, self._nursery = self._nursery, None  # admit no more drains...
        assert nursery is not None
        self._exiting = nursery  # ...but the follow-ups of those in flight (B3)
        # Shielded and bounded, so that exiting on an exception still gives the drains their
        # window. (If the code around the keeper was cancelled, so were the drains.)
        with trio.move_on_after(self.drain_window, shield=True):
            await self.wait_idle()
        if self._in_flight:
            logger.warning(
                "drain window of %g s over; cancelling %d prefill drain(s)",
                self.drain_window, len(self._in_flight),
            )
        nursery.cancel_scope.cancel()
        # The nursery must be exited here; its drains are cancelled by now.
        try:
            result: bool = await self._nursery_manager.__aexit__(  # noqa: ASYNC102
                exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # A drain never raises into the nursery: a group of just the body's exception
            # is the nursery wrapping it (a copy, for a group): let it out as raised.
            if (exc is not None and len(group.exceptions) == 1
                    and type(group.exceptions[0]) is type(exc)):
                return False
            raise
        finally:
            self._exiting = None
        return result

    async def wait_idle(self) -> None:
        """Return once no drain or leg is in flight (B5); at once if none is. Cancelling
        the wait affects nothing else."""
        await self._idle.wait_value(True)

    def start(
        self,
        async_fn: Callable[[], Awaitable[T]],
        *,
        name: str,
        guard: AbstractContextManager[Any] | None = None,
        permit: PhasePermit | None = None,
        kind: str = PREFILL_DRAIN,
    ) -> PrefillTask[T]:
        """Start a prefill drain in the keeper's nursery and return its observer.

        Args:
            async_fn: the drain, called with no arguments. Its return value becomes the
                task's result; a :class:`PrefillError` it raises becomes the task's error;
                any other exception, or cancellation, becomes "did not complete" (T3).
            name: shown in logs (``prefill drain <name> failed: ...``) and in the trio
                task's name (``<kind> <name>``); usually the request id.
            guard: a teardown guard, entered here and held until the drain ends (S5).
            permit: the request's phase-transition permit, released as the drain
                starts (S11).
            kind: what the task is, for metrics and logs (:data:`PREFILL_DRAIN`,
                :data:`CLEANUP`, ...).

        Returns:
            The :class:`PrefillTask` observing the drain.

        Raises:
            RuntimeError: if the keeper is not open: never entered, exited, or exiting
                and the caller is not one of its own tasks (see the class).
        """
        nursery = self._admitting("drains")
        task: PrefillTask[T] = PrefillTask(name)
        held = None  # made only for a guard (P3: memory per stream)
        if guard is not None:
            held = ExitStack()
            held.enter_context(guard)  # S5: held from the handoff on, not from the first run
        self._enter(task, kind)
        nursery.start_soon(self._run, task, async_fn, held, permit, kind, name=f"{kind} {name}")
        return task

    def _admitting(self, what: str) -> trio.Nursery:
        """The nursery a new task goes in: the keeper's while it is open; while it exits,
        only for a task of its own starting a follow-up of its transfer (B3)."""
        if self._nursery is not None:
            return self._nursery
        if self._exiting is not None and _runs_in(self._exiting):
            return self._exiting
        raise RuntimeError(f"the TransferKeeper is not open; no new {what} are accepted")

    async def _run(
        self,
        task: PrefillTask[T],
        async_fn: Callable[[], Awaitable[T]],
        held: ExitStack | None,
        permit: PhasePermit | None,
        kind: str,
    ) -> None:
        try:
            if permit is not None:
                permit.release()  # S11: the decode phase may begin once the drain runs
            with held if held is not None else _UNGUARDED:
                value = await async_fn()
        except trio.Cancelled:
            self.cancelled_total += 1
            logger.warning("%s %s cancelled before it completed", kind, task.name)
            task._finish(None, PrefillError(
                f"Prefill background task did not complete: {task.name} was cancelled"))
            raise
        except PrefillCancelled as error:  # ended on purpose (B6, B10): not a failure
            logger.info("%s %s ended: %s", kind, task.name, error)
            task._finish(None, error)
        except PrefillError as error:
            self.failed_total += 1
            logger.warning("%s %s failed: %s", kind, task.name, error)  # T2
            task._finish(None, error)
        except BaseException as exc:
            if isinstance(exc, BaseExceptionGroup) and exc.split(PrefillError)[1] is None:
                # A PrefillError raised inside a nursery of the drain arrives wrapped.
                leaf = first_leaf(exc)
                self.failed_total += 1
                logger.warning("%s %s failed: %s", kind, task.name, leaf)  # T2
                task._finish(None, leaf)
                return
            if isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None:
                # only cancellation inside a nursery of the drain
                self.cancelled_total += 1
                logger.warning("%s %s cancelled before it completed", kind, task.name)
                task._finish(None, PrefillError(
                    f"Prefill background task did not complete: {task.name} was cancelled"))
                raise
            self.failed_total += 1
            logger.warning("%s %s crashed", kind, task.name, exc_info=exc)  # T2
            crash = PrefillError(
                f"Prefill background task did not complete: {task.name} crashed: "
                f"{crash_message(exc)}")
            crash.__cause__ = exc
            task._finish(None, crash)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and friends are not ours to swallow
        else:
            task._finish(value, None)
        finally:
            self._leave(task)

    def _enter(self, key: object, kind: str) -> None:
        self._in_flight[key] = kind
        self.started_by_kind[kind] += 1
        self.started_total += 1
        if len(self._in_flight) == 1:
            self._idle.value = False

    def _leave(self, key: object) -> None:
        del self._in_flight[key]
        if not self._in_flight:
            self._idle.value = True

    def spawn_leg(
        self,
        async_fn: Callable[..., Awaitable[object]],
        *args: Any,
        name: str,
        kind: str = DECODE_LEG,
    ) -> TransferLeg:
        """Start a worker leg that is part of a KV transfer, in the keeper's nursery.

        The leg is dispatched as ``await nursery.start(async_fn, *args)`` *inside* the
        keeper, so not even its dispatch is under the caller's cancel scope: an SGLang
        decode leg that a leaving client cancelled half-way through its dispatch could
        have joined its bootstrap room or not, and nobody could tell (G9, B1). The caller
        awaits :meth:`TransferLeg.wait_started` instead, which it may abandon. An exception
        the leg raises after it started is logged, never raised into the keeper's nursery.
        It counts as in flight until it ends. When it ends, the memory send channels among
        ``args`` are closed (its stream ends with it, even if the engine forgot to close
        its channel: its reader would wait for ever).

        Args:
            async_fn: the leg (an engine's ``generate``, or a wrapper): it must call
                ``task_status.started()`` once its worker accepted the request.
            *args: passed to ``async_fn``.
            name: shown in logs and in the trio task's name; usually the request id.
            kind: what the leg is, for :meth:`in_flight_by_kind` and the task's name.

        Returns:
            The leg's :class:`TransferLeg`.

        Raises:
            RuntimeError: if the keeper is not open (as for :meth:`start`).
        """
        nursery = self._admitting("legs")
        leg = TransferLeg(name)
        key = object()
        self._enter(key, kind)
        nursery.start_soon(self._run_leg, leg, key, async_fn, args, name=f"{kind} {name}")
        return leg

    async def _run_leg(
        self,
        leg: TransferLeg,
        key: object,
        async_fn: Callable[..., Awaitable[object]],
        args: tuple[Any, ...],
    ) -> None:
        try:
            with leg.scope:
                async with trio.open_nursery() as nursery:
                    try:
                        await nursery.start(async_fn, *args)
                    except Exception as exc:  # refused before it started: the waiter's error
                        leg._settle(worker_refusal(exc) or exc)
                    else:
                        leg._settle(None)
        except* Exception as errors:
            # Nothing raises into the keeper's nursery: errors are logged, even when they
            # arrive in one group with a cancellation, which goes on alone (the keeper
            # closing), as do KeyboardInterrupt and friends.
            logger.warning("transfer leg %s failed", leg.name, exc_info=errors)
            leg.crash = errors
        finally:
            for arg in args:  # its stream ends with it, closed or not by the engine
                if isinstance(arg, trio.MemorySendChannel):
                    arg.close()
            if not leg.settled.is_set():  # cancelled before it started
                leg._settle(RuntimeError(f"transfer leg {leg.name} was cancelled"))
            leg._end()
            self._leave(key)


#: What a drain without a guard holds: nothing (a nullcontext can be entered any number of
#: times).
_UNGUARDED = nullcontext()


def _runs_in(nursery: trio.Nursery) -> bool:
    """Whether the calling task descends from ``nursery``."""
    parent = trio.lowlevel.current_task().parent_nursery
    while parent is not None:
        if parent is nursery:
            return True
        parent = parent.parent_task.parent_nursery
    return False
