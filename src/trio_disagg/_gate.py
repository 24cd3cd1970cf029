"""The gatekeeper between the decode stream and the client (rules G1-G9 in docs/semantics.md)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import trio

from ._context import RequestContext
from ._errors import DeadlineExceeded, PrefillError
from ._keeper import PrefillTask
from ._prefill import Handoff, PrefillCompletion, Terminal
from ._protocols import Annotated, FinishKind, LLMEngineOutput

T = TypeVar("T")
Item = Annotated[LLMEngineOutput]


def is_decode_failure(item: Item) -> bool:
    """An error envelope, or ``finish_reason`` error or cancelled (G4)."""
    if item.event == "error":
        return True
    data = item.data
    if data is None or data.finish_reason is None:
        return False
    kind = data.finish_reason.kind
    return kind is FinishKind.ERROR or kind is FinishKind.CANCELLED


def _is_terminal(item: Item) -> bool:
    data = item.data
    return item.event == "error" or (data is not None and data.finish_reason is not None)


class Gatekeeper:
    """Holds the success terminal of a decode stream until the prefill outcome is known.

    One gatekeeper serves one request. :meth:`dispatch` starts the decode leg while
    watching the prefill (G1, G2); :meth:`forward` then moves decode outputs from one
    memory channel to another (G3-G8). A successful prefill costs the stream nothing but
    a check per item; a late prefill failure turns what would have been a success into
    one error item (G5, G6).

    The gate takes the prefill as the core gives it: the :class:`PrefillTask` of a
    prefill leg run by a :class:`TransferKeeper` (whose value, once it succeeded, is a
    :class:`Handoff` or a :class:`Terminal`), or what :func:`consume_prefill_stream`
    returned. A :class:`Handoff` with a ``drain`` (a bootstrap stream the keeper drains)
    is watched through that drain; one without has been read to its end, so the prefill
    succeeded. A :class:`Terminal` (the prefill answered the request itself, S7) makes a
    gate that dispatches nothing and forwards that answer alone.

    The gate logs nothing: a prefill failure is logged once, by the keeper, from inside
    the drain that saw it (T2), and reaches the client as one error item (G5, G6) or as
    the exception :meth:`dispatch` raises (G1).

    Args:
        prefill: the request's prefill: a :class:`PrefillTask`, a :class:`Handoff` or a
            :class:`Terminal`.
        client_context: stopped when a prefill failure ends the request (G1, G5, G6).
        idle_timeout: seconds to wait for each decode output before failing the stream
            with a "decode idle" error (B2).
        terminal_hold_timeout: seconds to hold a success terminal for the prefill outcome
            before failing the stream with a "terminal hold" error (B2).
        on_first_output: called once, synchronously, when the first decode output (or
            the end of the decode stream) arrives. The router links the client's context
            to a decode leg that is part of a KV transfer only then (B6, G9).

    Raises:
        TypeError: ``prefill`` is none of those.

    Attributes:
        prefill: the :class:`PrefillTask` the gate watches.
    """

    def __init__(
        self,
        prefill: PrefillTask[Any] | PrefillCompletion,
        client_context: RequestContext,
        *,
        idle_timeout: float = math.inf,
        terminal_hold_timeout: float = math.inf,
        on_first_output: Callable[[], object] | None = None,
    ) -> None:
        #: A Terminal: there is no decode to dispatch (S7).
        self._answer_only = isinstance(prefill, Terminal)
        self.prefill: PrefillTask[Any] = _as_task(prefill, client_context.id)
        self._on_first_output = on_first_output
        if on_first_output is not None:
            self._receive = self._receive_first  # type: ignore[method-assign]
        self.client_context = client_context
        self.idle_timeout = idle_timeout
        self.terminal_hold_timeout = terminal_hold_timeout
        #: Why the gate ended the stream with an error item of its own, if it did: the
        #: prefill's :class:`PrefillError` or a :class:`DeadlineExceeded` (B2); else None.
        self.failure: Exception | None = None
        self._ended = False

    async def dispatch(
        self,
        nursery: trio.Nursery,
        start_decode: Callable[..., Awaitable[Any]],
        *args: Any,
    ) -> Any:
        """Start the decode leg as ``await nursery.start(start_decode, *args)``, racing the
        prefill (G1, G2).

        The race is a cancel scope that a prefill watcher cancels: a prefill failure while
        the dispatch is pending cancels the dispatch. If both are ready together the prefill
        is looked at first, so a failed prefill always wins (G1).

        A gate made from a :class:`Terminal` starts nothing and returns None (S7): the
        prefill's answer is all :meth:`forward` sends.

        Args:
            nursery: the request's nursery, where the decode leg runs.
            start_decode: an async function that calls ``task_status.started()`` once the
                decode worker accepted the request (an engine's ``generate``, or a
                wrapper around it).
            *args: passed to ``start_decode``.

        Returns:
            Whatever ``start_decode`` passed to ``task_status.started()``.

        Raises:
            PrefillError: the prefill failed first; the client context is stopped, and a
                decode leg that was already started is stopped through it when linked.
            Exception: what ``start_decode`` raised before it started (e.g. a
                :class:`~trio_disagg.WorkerError`), bare, when the prefill did not fail.

        Cancellation (the client left) cancels the dispatch; the prefill is the keeper's
        and runs on (G9).
        """
        if self._answer_only:
            return None
        if self.prefill.succeeded:
            return await nursery.start(start_decode, *args)  # G2
        started: Any = None
        if not self.prefill.done:
            started = await self._start_racing_prefill(nursery, start_decode, args)
        if self.prefill.failed:  # looked at first, also on a tie (G1)
            self._raise_prefill_failure()
        return started

    async def _start_racing_prefill(
        self, nursery: trio.Nursery, start_decode: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
    ) -> Any:
        """``nursery.start(start_decode, *args)`` in a cancel scope that a prefill failure
        cancels (G1); None if it was cancelled so."""
        # The watcher lives in ``nursery`` rather than in a nursery of its own, so an error
        # from start_decode reaches the caller bare, not in an ExceptionGroup.
        watcher = trio.CancelScope()
        with trio.CancelScope() as race:
            nursery.start_soon(self._cancel_on_prefill_failure, race, watcher)
            try:
                return await nursery.start(start_decode, *args)
            except Exception as exc:
                if not self.prefill.failed:
                    raise
                # A decode refusal in the same instant as a prefill failure: the prefill
                # is looked at first (G1).
                self._raise_prefill_failure(exc)
            finally:
                watcher.cancel()
        return None

    def _raise_prefill_failure(self, cause: BaseException | None = None) -> NoReturn:
        """Stop the client context and raise the prefill's error (G1)."""
        self.client_context.stop_generating()
        error = self.prefill.error
        assert error is not None
        if cause is None:
            raise error
        raise error from cause

    async def _cancel_on_prefill_failure(
        self, scope: trio.CancelScope, watcher: trio.CancelScope | None = None
    ) -> None:
        with watcher if watcher is not None else trio.CancelScope():
            await self.prefill.wait_done()
            if self.prefill.failed:
                scope.cancel()

    async def _cancel_on_prefill_end(self, scope: trio.CancelScope) -> None:
        """While forwarding: a failure (G6) or a terminal answer (S7) ends the stream."""
        await self.prefill.wait_done()
        if self.prefill.failed or self._prefill_answer() is not None:
            scope.cancel()

    def _prefill_answer(self) -> Item | None:
        """The prefill's own answer, if it finished the request by itself (S7)."""
        completion = self.prefill.value
        return completion.output if isinstance(completion, Terminal) else None

    async def forward(
        self,
        decode_outputs: trio.MemoryReceiveChannel[Item],
        send_channel: trio.MemorySendChannel[Item],
        decode_context: RequestContext | None = None,
    ) -> None:
        """Move decode outputs to ``send_channel`` until a terminal item (G3-G8).

        Non-terminal tokens pass at once, even while the prefill is pending (G3). A decode
        failure passes at once, as the engine sent it, and ends the stream (G4). A success
        terminal, or the end of ``decode_outputs``, is held until the prefill outcome is
        known; if the prefill failed, one error item carrying the prefill error replaces
        it, both contexts are stopped and the stream ends (G5). A prefill failure while
        waiting for a decode output does the same (G6). After a successful prefill items
        pass unchanged (G7). Nothing passes after a terminal item (G8). Both channels are
        closed on return.

        Every error item the gatekeeper makes itself carries its typed exception in
        ``item.exception``, so the server can answer from the type rather than the text:
        the :class:`PrefillError` (G5, G6; a :class:`PrefillDeadlineExceeded` if the
        prefill ran out of time), or the :class:`DeadlineExceeded` of the decode-idle or
        terminal-hold wait (B2).

        A gate made from a :class:`Terminal` forwards the prefill's answer alone (S7). A
        receiver of ``send_channel`` that is gone (broken or closed) ends forwarding
        quietly and stops ``decode_context``.

        Args:
            decode_outputs: the decode leg's outputs (what the engine sends).
            send_channel: the client's channel.
            decode_context: the decode leg's context, stopped when the gate ends the stream
                early (a prefill failure, an answer from the prefill, a receiver gone), or
                None when the leg must not be stopped from here (the router passes None
                for a decode leg that is part of a KV transfer: its handoff owner ends
                it, G9).

        It raises nothing of its own: a deadline (B2) or a prefill failure becomes the
        last item, and :attr:`failure` says which.

        Cancellation (the client went away) just stops forwarding, and both channels are
        closed; ``decode_context`` is not stopped (the decode leg lives in the same
        nursery, or belongs to the keeper), and the prefill is owned by the keeper and is
        not affected (G9).
        """
        with send_channel, decode_outputs:
            try:
                await self._forward(decode_outputs, send_channel, decode_context)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # The client closed its end: nobody is listening, so stop the decode leg
                # and end quietly. The prefill is not ours to stop (G9).
                if decode_context is not None:
                    decode_context.stop_generating()

    async def _forward(
        self,
        decode_outputs: trio.MemoryReceiveChannel[Item],
        send_channel: trio.MemorySendChannel[Item],
        decode_context: RequestContext | None,
    ) -> None:
        error: Exception | None = None
        try:
            if not self.prefill.done:
                escaped: Exception | None = None
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._cancel_on_prefill_end, nursery.cancel_scope)
                    try:
                        error = await self._forward_while_pending(decode_outputs, send_channel)
                    except Exception as exc:  # e.g. BrokenResourceError: the client closed
                        escaped = exc  # re-raised bare below, as in the pass-through path
                    nursery.cancel_scope.cancel()
                if escaped is not None:
                    raise escaped
            if not self._ended and error is None:
                if self.prefill.failed:
                    error = self.prefill.error  # G5, G6
                elif (answer := self._prefill_answer()) is not None:
                    await self._answer(answer, send_channel, decode_context)
                else:
                    await self._pass_through(decode_outputs, send_channel)
        except DeadlineExceeded as exc:
            error = exc
        if error is not None:
            await self._fail(error, send_channel, decode_context)

    async def _receive_first(
        self, decode_outputs: trio.MemoryReceiveChannel[Item]
    ) -> Item | None:
        """:meth:`_receive`, calling ``on_first_output`` after the first one. Used only by a
        gate that has the hook, so the common path pays nothing for it."""
        item = await Gatekeeper._receive(self, decode_outputs)
        if self._on_first_output is not None:
            first, self._on_first_output = self._on_first_output, None
            first()
        return item

    async def _receive(self, decode_outputs: trio.MemoryReceiveChannel[Item]) -> Item | None:
        """The next decode output, or None at the end of the stream (B2 decode idle)."""
        try:
            return decode_outputs.receive_nowait()
        except trio.WouldBlock:
            pass
        except trio.EndOfChannel:
            return None
        if self.idle_timeout == math.inf:  # no deadline: no cancel scope per wait
            try:
                return await decode_outputs.receive()
            except trio.EndOfChannel:
                return None
        with trio.move_on_after(self.idle_timeout) as idle:
            try:
                return await decode_outputs.receive()
            except trio.EndOfChannel:
                return None
        assert idle.cancelled_caught
        raise DeadlineExceeded("decode idle", self.idle_timeout)

    async def _forward_while_pending(
        self,
        decode_outputs: trio.MemoryReceiveChannel[Item],
        send_channel: trio.MemorySendChannel[Item],
    ) -> DeadlineExceeded | None:
        # Returns a deadline error rather than raising it: inside the nursery it would
        # arrive wrapped in an ExceptionGroup.
        prefill = self.prefill
        while not prefill.done:
            try:
                item = await self._receive(decode_outputs)
            except DeadlineExceeded as exc:
                return exc
            if item is not None and is_decode_failure(item):
                # G4: a decode failure does not wait for prefill. Ended only once sent: if a
                # prefill failure cancels the send, the prefill error is sent instead (B4).
                await send_channel.send(item)
                self._ended = True
                return None
            if item is None or _is_terminal(item):
                with trio.move_on_after(self.terminal_hold_timeout):
                    await prefill.wait_done()  # G5: hold the success terminal
                if not prefill.done:
                    return DeadlineExceeded("terminal hold", self.terminal_hold_timeout)
                if prefill.failed or self._prefill_answer() is not None:
                    # The caller replaces the terminal with the prefill's error (G5) or with
                    # the prefill's own answer (S7).
                    return None
                if item is not None:
                    await send_channel.send(item)
                self._ended = True
                return None
            await send_channel.send(item)  # G3
        return None

    async def _pass_through(
        self,
        decode_outputs: trio.MemoryReceiveChannel[Item],
        send_channel: trio.MemorySendChannel[Item],
    ) -> None:
        # G7/G8: the hot path once the prefill succeeded. Items move without a schedule
        # point while both channels allow it, so a burst from the engine reaches the client
        # writer as a burst (one socket write) instead of one item per task switch. The
        # loop still blocks, and so checkpoints, whenever either channel is empty or full.
        if self._on_first_output is not None:
            await self._pass_through_hooked(decode_outputs, send_channel)
            return
        # One cancel scope bounds every wait for the decode (B2 decode idle): its deadline
        # is armed when the loop is about to wait on an empty channel and lifted while it
        # waits on a full one (a slow client is not an idle decode), instead of a new scope
        # per token (a scope costs more than the rest of a token's trip through the gate).
        timeout = self.idle_timeout
        armed = timeout != math.inf
        clock = trio.current_time
        receive_nowait = decode_outputs.receive_nowait
        receive = decode_outputs.receive
        send = send_channel.send
        send_nowait = send_channel.send_nowait
        # Waits are awaited outside the except clauses: a task parked in one would keep the
        # WouldBlock and its traceback alive for as long as it waits (P3, per stream).
        with trio.CancelScope() as idle:
            while True:
                try:
                    item = receive_nowait()
                    ready = True
                except trio.WouldBlock:
                    ready = False
                except trio.EndOfChannel:
                    break
                if not ready:
                    if armed:
                        idle.deadline = clock() + timeout
                    try:
                        item = await receive()
                    except trio.EndOfChannel:
                        break
                try:
                    send_nowait(item)
                    sent = True
                except trio.WouldBlock:
                    sent = False
                if not sent:
                    idle.deadline = math.inf
                    await send(item)
                data = item.data
                if item.event == "error" or (data is not None and data.finish_reason is not None):
                    break
        self._ended = True
        if idle.cancelled_caught:
            raise DeadlineExceeded("decode idle", timeout)

    async def _pass_through_hooked(
        self,
        decode_outputs: trio.MemoryReceiveChannel[Item],
        send_channel: trio.MemorySendChannel[Item],
    ) -> None:
        """:meth:`_pass_through` for a gate whose ``on_first_output`` has not fired yet."""
        receive = self._receive
        send = send_channel.send
        send_nowait = send_channel.send_nowait
        while (item := await receive(decode_outputs)) is not None:
            try:
                send_nowait(item)
                sent = True
            except trio.WouldBlock:
                sent = False
            if not sent:  # awaited outside the except: a parked send keeps no exception
                await send(item)
            data = item.data
            if item.event == "error" or (data is not None and data.finish_reason is not None):
                break
        self._ended = True

    async def _answer(
        self,
        answer: Item,
        send_channel: trio.MemorySendChannel[Item],
        decode_context: RequestContext | None,
    ) -> None:
        """S7 for a decode dispatched alongside its prefill (the bootstrap style): the
        prefill finished the request on its first token and staged nothing, so the decode
        has nothing to pull. Its answer ends the stream; the decode leg is stopped."""
        self._ended = True
        if decode_context is not None:
            decode_context.stop_generating()
        await send_channel.send(answer)

    async def _fail(
        self,
        error: Exception,
        send_channel: trio.MemorySendChannel[Item],
        decode_context: RequestContext | None,
    ) -> None:
        self.failure = error
        self._ended = True
        self.client_context.stop_generating()
        if decode_context is not None:
            decode_context.stop_generating()
        # The item carries the exception itself: the server maps its type to a status.
        await send_channel.send(Annotated.from_exception(error))


def _as_task(prefill: PrefillTask[Any] | PrefillCompletion, name: str) -> PrefillTask[Any]:
    """The task a gate watches, from what the core gave for the prefill."""
    if isinstance(prefill, PrefillTask):
        return prefill
    if isinstance(prefill, Handoff) and prefill.drain is not None:
        return prefill.drain  # the keeper drains the rest: its outcome is the prefill's
    if isinstance(prefill, (Handoff, Terminal)):
        done: PrefillTask[PrefillCompletion] = PrefillTask(name)
        done._finish(prefill, None)  # read to its end already: the prefill succeeded
        return done
    raise TypeError(f"a Gatekeeper needs a PrefillTask, a Handoff or a Terminal, "
                    f"got {type(prefill).__name__}")


__all__ = ["Gatekeeper", "PrefillError", "is_decode_failure"]
