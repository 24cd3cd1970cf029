"""The client's end of a request's decode stream, read through its gatekeeper in the
reader's own task (rules G3-G8 in docs/semantics.md)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import trio

from ._context import RequestContext
from ._engine import decode_output as _engine_output
from ._engine import is_decode_failure, is_terminal
from ._errors import DeadlineExceeded, WorkerError
from ._protocols import Annotated, FinishReason, LLMEngineOutput
from ._pull import pull_slot, receive_decode
from ._sync_close import SyncCloseReceiveChannel

if TYPE_CHECKING:
    from ._gate import Gatekeeper

Item = Annotated[LLMEngineOutput]

_OPEN: Final = 0
_ENDED: Final = 1  # the last item went out, or the decode stream ended
_CLOSED: Final = 2

#: What an interrupted wait returns: the prefill ended meanwhile, look again.
_AGAIN: Final = Annotated[LLMEngineOutput](comment=["the prefill ended"])
#: A held end of the decode stream (no terminal item), as :attr:`GatedOutputs._held`.
_END: Final = Annotated[LLMEngineOutput](comment=["the decode stream ended"])


class GatedOutputs(SyncCloseReceiveChannel[Item]):
    """A request's decode outputs, read through its :class:`Gatekeeper` (G3-G8).

    Each :meth:`receive` pulls the next decode output through the gate in the reader's
    own task: no forwarding task and no second channel stand between the decode leg and
    the client (docs/performance.md, P3 and P4); a leg that hands the reader its
    worker's response (:class:`~._pull.PullSlot`) is read in that task. The reader gets:

    - a decode output without a finish reason at once, even while the prefill is
      pending (G3);
    - a decode failure at once, as the engine sent it, as the last item (G4);
    - a success terminal, or the end of the decode stream, only once the prefill
      succeeded; if it failed, one error item carrying the prefill's error instead (G5);
    - after a successful prefill, every output unchanged (G7); after a terminal item,
      the end of the channel (G8).

    A prefill that fails while the reader waits, or reads nothing at all, is acted on
    when it fails, not when the reader next asks (G6): a watcher on the prefill's task
    stops the client's context and ``decode_context`` at once, and the reader's next
    item is the error. Every error item the gate makes itself carries its typed
    exception in ``item.exception`` (a :class:`PrefillError`, or the
    :class:`DeadlineExceeded` of the B2 decode-idle or terminal-hold wait), and
    :attr:`Gatekeeper.failure` says which.

    A gate made from a :class:`Terminal` (S7) gives the prefill's answer alone.

    Cancelling a :meth:`receive` loses nothing: a held terminal stays held for the next
    call, and the B2 deadlines are absolute, not restarted by the next call. Closing the
    channel before its end (the reader left, whyever: ``close()``, a ``with`` block left
    on an exception or ``Cancelled``) closes the decode leg's channel and stops
    ``decode_context``; a leg that is part of a KV transfer gets None there, and its
    handoff owner ends it (G9). The prefill is never touched.

    Any task may read it, one at a time (a second concurrent reader gets
    ``trio.BusyResourceError``, as with a trio stream): the gate's state is the stream's.
    A read waiting while the request is abandoned (:meth:`abandon`) ends the channel.
    Made by :meth:`Gatekeeper.outputs`.
    """

    __slots__ = ("_decode", "_decode_context", "_decode_ended", "_ended", "_final",
                 "_finished", "_gate", "_held", "_hold_at", "_idle_at", "_leg_exit",
                 "_leg_running", "_on_end", "_passing", "_prefill", "_raced", "_reading",
                 "_slot", "_state", "_stop_finish", "_stopped", "_waiting", "_watcher")

    def __init__(
        self,
        gate: Gatekeeper,
        decode_outputs: trio.MemoryReceiveChannel[Item],
        decode_context: RequestContext | None = None,
        on_end: Callable[[], object] | None = None,
    ) -> None:
        self._gate = gate
        self._prefill = gate.prefill
        self._decode = decode_outputs
        self._decode_context = decode_context
        self._on_end = on_end
        self._state: int = _OPEN
        self._final: Item | None = None  # the item the gate ends the stream with itself
        self._held: Item | None = None  # a terminal (or _END) held for the prefill (G5)
        self._waiting: trio.CancelScope | None = None  # a receive's wait, interruptible
        self._stopped = False
        #: The one ``cancelled`` finish a stopped (not killed) stream ends with (C3).
        self._stop_finish: Item | None = None
        #: When the decode-idle wait (B2) and the terminal hold (G5) end, once begun.
        self._idle_at: float | None = None
        self._hold_at: float | None = None
        self._reading = False  # a receive is in progress (one reader at a time)
        #: A forwarder's cancel scope races the whole stream against the prefill
        #: (:meth:`Gatekeeper.forward`): a wait needs no scope of its own for it.
        self._raced = False
        #: Prefill succeeded and the first output seen: the hot path (G7).
        self._passing = False
        self._watcher: Callable[[], None] | None = None
        self._finished = False  # the bookkeeping of the stream's end is done
        self._decode_ended = False  # the decode leg ended on its own
        self._ended: trio.Event | None = None  # made only for wait_ended()
        self._leg_running = False  # see follow_leg()
        self._leg_exit: trio.Event | None = None  # made only for a wait for it
        #: Where the decode leg may hand this reader the reading of its worker (_pull.py).
        self._slot = pull_slot(decode_context) if decode_context is not None else None
        if self._slot is not None:
            self._slot.on_idle = self._idle_expired
        if not self._prefill.done:
            self._watcher = self._prefill_ended
            self._prefill._on_done(self._watcher)

    # --- the channel ----------------------------------------------------------------

    async def receive(self) -> Item:
        """The next item through the gate.

        Raises:
            trio.EndOfChannel: the stream ended (after its last item, or with none).
            trio.ClosedResourceError: this channel was closed.
            trio.BusyResourceError: another task is reading it (one reader at a time:
                the gate's state is the stream's).
        """
        if self._state:
            raise trio.ClosedResourceError if self._state == _CLOSED else trio.EndOfChannel
        if self._final is None:
            if self._reading:
                raise trio.BusyResourceError("another task is reading this stream")
            self._reading = True
            try:
                item = await (self._pass() if self._passing else self._gated())
                if item is None and self._leg_running and not self._stopped:
                    await self._wait_leg_exit()  # (its crash may come first: B4)
            except (DeadlineExceeded, WorkerError) as exc:  # (B2; a garbage output, G4)
                item = self._fail(exc)
            except trio.ClosedResourceError:
                if self._abandoned():  # while this read waited
                    raise trio.EndOfChannel from None
                raise
            finally:
                self._reading = False
            if self._final is None:  # (else the prefill's outcome won meanwhile)
                return self._deliver(item)
        self._state = _ENDED
        self._end()
        return self._final

    def receive_nowait(self) -> Item:
        """The next item if it is ready and needs no wait for the prefill.

        Raises:
            trio.WouldBlock: no item is ready, or the gate must wait (the prefill is
                pending or the first output not yet seen): await :meth:`receive`.
            trio.EndOfChannel: the stream ended.
            trio.ClosedResourceError: this channel was closed.
        """
        if (item := self.receive_ready()) is None:
            raise trio.WouldBlock
        return item

    def receive_ready(self) -> Item | None:
        """:meth:`receive_nowait`, with None where it raises ``trio.WouldBlock``: the
        relay's poll after each output, with no exception raised per output
        (docs/performance.md)."""
        if self._state:
            raise trio.ClosedResourceError if self._state == _CLOSED else trio.EndOfChannel
        if self._final is not None:
            self._state = _ENDED
            self._end()
            return self._final
        if self._reading:
            raise trio.BusyResourceError("another task is reading this stream")
        if not self._passing:
            return None
        slot = self._slot
        if slot is not None and (source := slot.source) is not None:
            pulled = source.pull_nowait()  # (the reader reads the worker: no channel)
            return None if pulled is None else self._deliver(pulled)
        try:
            item = _engine_output(self._decode.receive_nowait())
        except trio.WouldBlock:
            return None
        except trio.EndOfChannel:
            if self._leg_running:
                return None  # receive() waits for the leg's exit
            item = None
        except WorkerError as exc:  # G4: not an engine output
            item = self._fail(exc)
            self._state = _ENDED
            self._end()
        return self._deliver(item)

    def _deliver(self, item: Item | None) -> Item:
        if item is None:
            self._state = _ENDED
            self._end()
            raise trio.EndOfChannel
        data = item.data
        if item.event == "error" or (data is not None and data.finish_reason is not None):
            self._state = _ENDED  # G8
            self._end()
        return item

    def statistics(self) -> Any:
        """The decode leg's channel's ``statistics()``: the items it ran ahead."""
        return self._decode.statistics()

    def close(self) -> None:
        """Close the channel; before its end, the decode leg's context is stopped (the
        reader left) and ``receive`` raises ``ClosedResourceError``. Idempotent."""
        if self._state == _CLOSED:
            return
        early = self._state == _OPEN
        self._state = _CLOSED
        self._decode.close()
        self._gate._on_first_output = None  # none is read now (it holds the request: a cycle)
        if early and self._decode_context is not None:
            # Nobody reads the decode leg any more, whyever the reader left (its own
            # timeout too: a stalled leg would otherwise hold the request's nursery).
            self._decode_context.stop_generating()
        self._end()

    def abandon(self) -> None:
        """The request is over (its nursery was cancelled), whether or not its reader
        closes this channel: the leg's channel is closed (its next send fails), nothing is
        stopped; a later receive gives what the gate still owes (G6) or the end."""
        if self._state == _OPEN and self._final is None:
            self._state = _ENDED
        if self._state != _CLOSED:
            self._decode.close()
        self._end()

    def decode_ended(self) -> None:
        """The decode leg ended on its own, its whole stream in the channel: once the
        prefill has succeeded too, the request ends (its ``on_end``) while the reader may
        still read the channel, as a forwarder that buffered its last item is done (B5)."""
        self._decode_ended = True
        self._complete_if_whole()

    def follow_leg(self) -> None:
        """A decode leg of the router's feeds this stream: its channel's end is the stream's
        only once the leg exited (:meth:`leg_exited`), so that a crash it reports meanwhile
        (:meth:`decode_crashed`) ends the stream instead of an end that reads as a success
        (B4): an engine may close its channel (``async with``) before its crash arrives."""
        self._leg_running = True

    def leg_exited(self) -> None:
        """The decode leg's task is over (see :meth:`follow_leg`)."""
        self._leg_running = False
        if self._leg_exit is not None:
            self._leg_exit.set()

    async def _wait_leg_exit(self) -> None:
        """Wait for the leg to exit once its channel ended, at most decode-idle (B2)."""
        if self._leg_exit is None:
            self._leg_exit = trio.Event()
        with trio.move_on_after(self._gate.idle_timeout):
            await self._leg_exit.wait()

    def decode_crashed(self, error: Exception) -> None:
        """The decode engine raised after its worker accepted (G4): the stream ends with
        ``error``, not an end that reads as a success (B4), for a reader that saw the
        channel's end (it waits for the leg's exit, :meth:`follow_leg`) too."""
        if self._state == _OPEN and not self._stopped:
            self._fail(error)

    def _complete_if_whole(self) -> None:
        if (self._decode_ended and self._prefill.succeeded and self._final is None
                and self._gate._prefill_answer() is None):
            self._end()

    def _note_output_waiting(self) -> bool:
        """Call the pending first-output hook if an output waits unread (the leg fetched
        its KV, read or not, G9); True if called."""
        if self._gate._on_first_output is None or not self._decode.statistics().current_buffer_used:
            return False
        self._gate._first_output()
        return True

    def _abandoned(self) -> bool:  # (a method: mypy narrows self._state in receive())
        return self._state == _ENDED

    async def wait_ended(self) -> None:
        """Return once the stream ended (its bookkeeping done), however it ended."""
        if self._finished:
            await trio.lowlevel.checkpoint()
            return
        if self._ended is None:
            self._ended = trio.Event()
        await self._ended.wait()

    def stop(self, killed: bool = False) -> None:
        """End the stream at once: its next (or pending) receive gets one ``cancelled``
        finish, then the end; ``killed``: the end only (C3). For a client that stopped
        while its decode leg, part of the KV transfer, may not hear of it yet (G9). A leg
        whose first output waits in the channel has its KV: the first-output hook is
        called instead (the router links the leg's context to the client's, C4)."""
        if self._state == _OPEN and self._final is None:
            if self._note_output_waiting():
                return
            self._stopped = True
            if not killed:
                self._stop_finish = Annotated(data=LLMEngineOutput(
                    finish_reason=FinishReason.CANCELLED))
            if self._waiting is not None:
                self._waiting.cancel()

    def _stopped_end(self) -> Item | None:  # its ``cancelled`` finish once, then the end
        item, self._stop_finish = self._stop_finish, None
        return item

    # --- the gate ---------------------------------------------------------------------

    async def _pass(self) -> Item | None:
        """G7, the hot path: the next decode output; None at the stream's end."""
        slot = self._slot
        if slot is not None and (source := slot.source) is not None:
            # (an item the last read brought after the one given, else a read)
            return source.pull_nowait() or await self._wait()
        try:
            item = _engine_output(self._decode.receive_nowait())
        except trio.WouldBlock:
            item = _AGAIN  # awaited outside the clause: a parked wait keeps no exception
        except trio.EndOfChannel:
            return None
        if item is _AGAIN:
            return await self._wait()
        self._idle_at = None
        return item

    async def _wait(self) -> Item | None:
        """Wait for the next decode output, at most the decode-idle deadline (B2); a stop
        or the prefill's end interrupts the wait (None, or :data:`_AGAIN`)."""
        timeout = self._gate.idle_timeout
        slot = self._slot
        if (slot is not None and (source := slot.source) is not None
                and (self._passing or self._prefill.done)):
            # No scope: the leg keeps the idle deadline, and a stop reaches the leg.
            if self._idle_at is None:
                self._idle_at = trio.current_time() + timeout
            slot.idle_at = self._idle_at
            item = await source.pull()  # (receive_decode's first step, one call less)
            if item is None and not slot.released:  # the leg took the reading back
                item = await receive_decode(slot, self._decode)
            if self._final is not None:  # the idle deadline passed meanwhile
                return _AGAIN
            self._idle_at = slot.idle_at = None
            return item
        if timeout == math.inf and (self._passing or self._raced):
            # Nothing of ours interrupts it (or a forwarder's one race does): no scope.
            return await receive_decode(self._slot, self._decode)
        # The deadline is absolute and outlives a wait the reader's own timeout cut: the
        # decode is idle since the first wait for this output, not since the last (B2), and
        # not before its first while it waits on a pending prefill (see _prefill_ended).
        if self._idle_at is None and (self._prefill.done or self._gate._output_seen):
            self._idle_at = trio.current_time() + timeout
        with trio.CancelScope(deadline=self._idle_at or math.inf) as wait:
            self._waiting = wait
            try:
                item = await receive_decode(self._slot, self._decode)
            finally:
                self._waiting = None
            self._idle_at = None
            return item
        if self._stopped:
            return self._stopped_end() if self._passing else _AGAIN  # (the loop looks again)
        if self._final is not None:  # the prefill's watcher ended the stream
            return _AGAIN
        raise DeadlineExceeded("decode idle", timeout)

    async def _gated(self) -> Item | None:
        """The prefill pending, a terminal held, or the first output not yet seen."""
        prefill = self._prefill
        while True:
            if self._final is not None:  # (the idle deadline passed: a pulled wait's)
                return _AGAIN
            if self._stopped:
                return self._stopped_end()
            if self._held is not None:
                return await self._hold(None if self._held is _END else self._held)
            if prefill.done:
                if prefill.failed or self._gate._prefill_answer() is not None:
                    return self._conclude()
                if self._gate._on_first_output is None:
                    self._passing = True
                    return await self._pass()
            item: Item | None
            try:
                item = (_AGAIN if self._slot is not None and self._slot.source is not None
                        else _engine_output(self._decode.receive_nowait()))
            except trio.WouldBlock:
                item = _AGAIN
            except trio.EndOfChannel:
                item = None
            if item is _AGAIN:
                item = await self._wait()
                if item is _AGAIN:
                    continue
            else:
                self._idle_at = None
            self._gate._first_output()
            if item is not None and is_decode_failure(item):
                return item  # G4: does not wait for the prefill
            if item is not None and not is_terminal(item):
                return item  # G3
            if prefill.succeeded and self._gate._prefill_answer() is None:
                return item  # G7
            return await self._hold(item)

    async def _hold(self, item: Item | None) -> Item | None:
        """G5: hold a success terminal (or the stream's end, None) for the prefill, at
        most ``terminal_hold_timeout`` seconds (B2)."""
        self._held = _END if item is None else item  # kept if this wait is cancelled
        prefill = self._prefill
        if not prefill.done:
            if self._hold_at is None:  # absolute: a cut wait does not restart it (B2)
                self._hold_at = trio.current_time() + self._gate.terminal_hold_timeout
            with trio.move_on_at(self._hold_at):
                await prefill.wait_done()
        self._held = None
        if not prefill.done:
            return self._fail(DeadlineExceeded("terminal hold",
                                               self._gate.terminal_hold_timeout))
        if prefill.failed or self._gate._prefill_answer() is not None:
            return self._conclude()
        return item

    def _idle_expired(self) -> None:
        """A pulled wait's decode-idle deadline passed (B2; the leg keeps it): fail."""
        if self._state == _OPEN and self._final is None:
            self._fail(DeadlineExceeded("decode idle", self._gate.idle_timeout))
            self._end()

    def _prefill_ended(self) -> None:
        """The prefill's watcher, called by its task when it ends: a failure (G6) or an
        answer of its own (S7) ends the stream now, whatever the reader is doing."""
        self._watcher = None
        if self._state == _OPEN and self._final is None:
            prefill = self._prefill
            if prefill.failed or self._gate._prefill_answer() is not None:
                self._conclude()
                self._end()  # the request is over: its last item waits for the reader
                if self._waiting is not None:
                    self._waiting.cancel()
            else:
                if self._waiting is not None and self._idle_at is None:  # see _wait (B2)
                    self._idle_at = trio.current_time() + self._gate.idle_timeout
                    self._waiting.deadline = self._idle_at
                self._complete_if_whole()

    def _conclude(self) -> Item:
        """The item the prefill's outcome ends the stream with: its error (G5, G6) or its
        own answer (S7)."""
        error = self._prefill.error
        if error is not None:
            return self._fail(error)
        answer = self._gate._prefill_answer()
        assert answer is not None
        if self._final is None:
            # The bootstrap style: the prefill finished the request on its first token
            # and staged nothing, so the decode has nothing to pull; it is stopped.
            if self._decode_context is not None:
                self._decode_context.stop_generating()
            self._final = answer
        return self._final

    def _fail(self, error: Exception) -> Item:
        """End the stream with one error item of the gate's own, both contexts stopped."""
        if self._final is None:
            self._gate.failure = error
            self._gate.client_context.stop_generating()
            if self._decode_context is not None:
                self._decode_context.stop_generating()
            # The item carries the exception itself: the server maps its type to a status.
            self._final = Annotated.from_exception(error)
        return self._final

    def _end(self) -> None:
        """Once, when the stream ends however it ends: the watcher goes, the owner hears."""
        if self._finished:
            return
        self._finished = True
        if self._slot is not None:
            self._slot.release()
        if self._watcher is not None:
            self._prefill._forget_on_done(self._watcher)
            self._watcher = None
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()
        if self._ended is not None:
            self._ended.set()
