"""A decode leg whose worker's stream its reader reads in its own task: one task a token
instead of two (docs/performance.md, the twelfth round).

The router gives a decode leg in the request's nursery a :class:`PullSlot` on its
context before dispatching it. An engine that reads its worker's answer itself may
offer the slot a :class:`PulledSource` instead of sending each output to its channel;
it then waits (:meth:`PullSlot.wait_released`) while the stream's reader, the
gatekeeper's :class:`~trio_disagg.GatedOutputs`, calls :meth:`PulledSource.pull` in its
own task. The leg keeps what it owns: the worker's response (closed when it leaves),
its stop (its context's), its end and its crash (B4). Nothing else changes: the items
are the ones the engine would have sent, through the same gate (G3-G8).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import trio

from ._context import RequestContext
from ._engine import decode_output
from ._protocols import Annotated, LLMEngineOutput

Item = Annotated[LLMEngineOutput]


class PulledSource(Protocol):
    """A worker's stream, read a part at a time in the reader's task."""

    async def pull(self) -> Item | None:
        """The next output, waited for: what one read of the worker brought, or the
        stream's last item (its finish, or an error item).

        Returns:
            The item; None once the source can give no more (its leg took it back:
            read the leg's channel for the rest).

        Cancelled, it loses nothing: the next call goes on where this one stopped.
        """
        ...

    def pull_nowait(self) -> Item | None:
        """The next item if a read already brought it (the stream's last item, read with
        the burst :meth:`pull` gave), else None; no wait, no read."""
        ...


class PullSlot:
    """Where a decode leg hands its stream's reader the reading of its worker.

    Made by the router for a decode leg in the request's nursery (never for one the
    keeper holds for the KV transfer, G9: its reader may leave before it fetched its
    KV). One source at most, offered before the leg sent anything to its channel.

    The leg, idle meanwhile, also keeps the decode-idle deadline (B2) of a reader that
    waits on the worker: the reader notes when its wait's deadline falls
    (:attr:`idle_at`), and the leg's wait wakes at that time (at least once every
    ``idle_timeout`` seconds, never per token) and ends the stream
    (:attr:`on_idle`) if no output came meanwhile. A cancel scope a wait costs as much
    as the rest of a paced token's relay (docs/performance.md).

    Args:
        idle_timeout: the decode-idle deadline (seconds; ``math.inf``: none).

    Attributes:
        source: the offered source while the reader may pull it, else None.
        released: the reader needs no more of it (the stream ended, or its reader left).
        idle_at: when the reader's wait for the next output fails (trio clock), while it
            waits for one; else None.
        on_idle: what ends the stream when ``idle_at`` passed (the reader's), or None.
    """

    __slots__ = ("_released_event", "idle_at", "idle_timeout", "on_idle", "released",
                 "source")

    def __init__(self, idle_timeout: float = math.inf) -> None:
        self.source: PulledSource | None = None
        self.released = False
        self.idle_timeout = idle_timeout
        self.idle_at: float | None = None
        self.on_idle: Callable[[], object] | None = None
        self._released_event: trio.Event | None = None

    def offer(self, source: PulledSource) -> bool:
        """Hand the reader ``source``; False if the reader already left (send to the
        channel, which is closed: the send raises ``BrokenResourceError``)."""
        if self.released:
            return False
        self.source = source
        return True

    def withdraw(self) -> None:
        """The leg takes the reading back (it is stopping): the reader's next pull, or
        the one it waits in, reads the leg's channel instead."""
        self.source = None

    def release(self) -> None:
        """The reader needs nothing more: the leg's wait ends. Idempotent."""
        if not self.released:
            self.released = True
            # The reader's callback holds the reader, which holds the leg's context, which
            # holds this slot: a reference cycle, kept for the garbage collector if kept.
            self.on_idle = None
            if self._released_event is not None:
                self._released_event.set()

    async def wait_released(self) -> None:
        """Wait until :meth:`release`, keeping the reader's decode-idle deadline (see
        the class docstring). The leg's context's stop cancels the wait."""
        if self.released:
            await trio.lowlevel.checkpoint()
            return
        released = self._released_event = trio.Event()
        timeout = self.idle_timeout
        while not self.released:
            if timeout == math.inf:
                await released.wait()
                return
            now = trio.current_time()
            idle_at = self.idle_at
            if idle_at is not None and idle_at <= now:
                if self.on_idle is not None:
                    self.on_idle()  # (it releases the slot: the stream ended)
                    continue
                idle_at = None
            # A wait that starts later falls no earlier than now + timeout.
            with trio.move_on_at(idle_at if idle_at is not None else now + timeout):
                await released.wait()


def reader_may_pull(engine: object) -> bool:
    """Whether a decode engine may hand its stream's reader its worker's answer (its
    ``reader_pulls`` attribute; the HTTP adapters with the project's worker client): the
    router opens a slot only for those (P2: nothing per request for the others)."""
    return getattr(engine, "reader_pulls", False) is True


def open_pull_slot(context: RequestContext, idle_timeout: float) -> PullSlot:
    """Give the leg of ``context`` a :class:`PullSlot` (the router, before a dispatch),
    with the decode-idle deadline (seconds) its reader's waits keep."""
    slot = context._pull = PullSlot(idle_timeout)
    return slot


def pull_slot(context: RequestContext) -> PullSlot | None:
    """The slot the router gave the leg of ``context``, or None: send every output."""
    return context._pull


async def receive_decode(slot: PullSlot | None,
                         channel: trio.MemoryReceiveChannel[Item]) -> Item | None:
    """The next decode output, waited for: read from the worker in this task while the
    leg's source is offered (its channel holds nothing meanwhile), else from the leg's
    channel; None at the end of the stream.

    Raises:
        WorkerError: the leg sent something that is not an engine output (G4).
    """
    if slot is not None and (source := slot.source) is not None:
        pulled = await source.pull()
        if pulled is not None:
            return pulled
        if slot.released:
            return None  # the stream ended meanwhile (its idle deadline passed)
        # (the leg took the reading back: the rest is in its channel)
    try:
        return decode_output(await channel.receive())
    except trio.EndOfChannel:
        return None
