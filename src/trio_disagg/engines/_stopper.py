"""The bridge from a request's context to the cancel scope around its worker response: a stop
or a kill closes the response, which aborts the request on the worker (C3, B10)."""

from __future__ import annotations

import math

import trio

from .._context import RequestContext
from .._protocols import Annotated, FinishReason, LLMEngineOutput
from .._pull import pull_slot

Item = Annotated[LLMEngineOutput]
SendChannel = trio.MemorySendChannel[Item]


class Stopper:
    """Connects a request's context to the cancel scope around its worker response: a stop
    or a kill cancels :attr:`scope`, which closes the response, which aborts the request
    on the worker. After a stop, :meth:`send_cancelled` sends the ``cancelled`` finish
    unless a kill comes first. :meth:`disarm` makes later stops do nothing (kills still
    close the response).

    With a ``stop_grace`` (seconds), a stop closes the response only if the answer has not
    started within that time: an answer the worker had already sent when the stop came is
    read (then :meth:`disarm` keeps it), so its KV is not left staged for nobody (a
    prefill stopped inside its cancel window, B10, B1).
    """

    __slots__ = ("_kill_scope", "_killed", "armed", "pull", "scope", "stop_grace")

    def __init__(self, context: RequestContext, *, stop_grace: float = 0.0) -> None:
        self.scope = trio.CancelScope()
        self._kill_scope: trio.CancelScope | None = None
        # The context is not kept: it holds this object (its callback), and a cycle
        # between them would outlive the request until a full garbage collection.
        self._killed = False
        self.armed = True
        self.stop_grace = stop_grace
        #: The leg's :class:`~trio_disagg._pull.PullSlot`, if its reader reads the worker.
        self.pull = pull_slot(context)
        context.on_stop(self)

    def __call__(self, killed: bool) -> None:
        self._killed = self._killed or killed
        if killed or (self.armed and not self.stop_grace):
            self.scope.cancel()
        elif self.armed:
            self.scope.deadline = min(self.scope.deadline,
                                      trio.current_time() + self.stop_grace)
        if killed and self._kill_scope is not None:
            self._kill_scope.cancel()

    def disarm(self) -> None:
        """From now on only a kill closes the response (a stop's grace is lifted)."""
        self.armed = False
        if not self.scope.cancel_called:
            self.scope.deadline = math.inf

    async def send_cancelled(self, send: SendChannel) -> None:
        self._kill_scope = trio.CancelScope()
        if self._killed:
            self._kill_scope.cancel()
        with self._kill_scope:
            await send.send(Annotated(data=LLMEngineOutput(finish_reason=FinishReason.CANCELLED)))


async def send_quietly(send: SendChannel, item: Item) -> None:
    """Send ``item`` unless the receiver is gone."""
    try:
        await send.send(item)
    except trio.BrokenResourceError:
        await trio.lowlevel.checkpoint()
