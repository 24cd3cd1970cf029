"""A worker leg the transfer keeper runs (:meth:`TransferKeeper.spawn_leg
<trio_disagg.TransferKeeper.spawn_leg>`; rules T1, G9 in docs/semantics.md)."""

from __future__ import annotations

import trio


class TransferLeg:
    """A worker leg running in a :class:`~trio_disagg.TransferKeeper` (see
    :meth:`~trio_disagg.TransferKeeper.spawn_leg`).

    Attributes:
        name: shown in logs.
        scope: the leg's cancel scope; :meth:`bound` sets its deadline.
        settled: set once the leg started, or failed to.
        error: why it failed to start, once settled; None if it started.
        crash: what the leg raised after it started (logged by the keeper, never
            raised), once it ended; None if it raised nothing.
    """

    __slots__ = ("_ended", "crash", "done", "error", "name", "scope", "settled")

    def __init__(self, name: str) -> None:
        self.name = name
        self.scope = trio.CancelScope()
        self.settled = trio.Event()
        self.error: BaseException | None = None
        self.crash: BaseException | None = None
        #: True once the leg ended, however it ended.
        self.done = False
        self._ended: trio.Event | None = None  # made only when a task waits for the end

    @property
    def started(self) -> bool:
        """True once the leg's worker accepted the request."""
        return self.settled.is_set() and self.error is None

    async def wait_started(self) -> None:
        """Return once the leg started (its worker accepted the request).

        Raises:
            Exception: what the leg raised before it started (e.g. a
                :class:`~trio_disagg.WorkerError`).

        Cancelling this wait does not affect the leg.
        """
        await self.settled.wait()
        if self.error is not None:
            raise self.error

    async def wait_done(self) -> None:
        """Return once the leg ended, however it ended (:attr:`error` and :attr:`crash`
        say how). Never raises but ``Cancelled``; cancelling it does not affect the leg."""
        if self.done:
            await trio.lowlevel.checkpoint()
            return
        if self._ended is None:
            self._ended = trio.Event()
        await self._ended.wait()

    def bound(self, grace: float) -> None:
        """Cancel the leg if it is still running ``grace`` seconds from now."""
        self.scope.deadline = min(self.scope.deadline, trio.current_time() + grace)

    def _settle(self, error: BaseException | None) -> None:
        self.error = error
        self.settled.set()

    def _end(self) -> None:
        self.done = True
        if self._ended is not None:
            self._ended.set()
