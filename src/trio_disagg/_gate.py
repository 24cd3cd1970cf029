"""The gatekeeper between the decode stream and the client (rules G1-G9 in docs/semantics.md)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import trio

from ._context import RequestContext
from ._crash import worker_refusal
from ._engine import is_decode_failure
from ._errors import PrefillError
from ._gated import GatedOutputs
from ._keeper import PrefillTask
from ._prefill import Handoff, PrefillCompletion, Terminal
from ._protocols import Annotated, LLMEngineOutput
from ._start import start_in

T = TypeVar("T")
Item = Annotated[LLMEngineOutput]


class Gatekeeper:
    """Holds the success terminal of a decode stream until the prefill outcome is known.

    One gatekeeper serves one request. :meth:`dispatch` starts the decode leg while
    watching the prefill (G1, G2); :meth:`outputs` then gives the client's end of the
    decode stream, each item pulled through the gate in the reader's own task (G3-G8),
    and :meth:`forward` pushes the same into a memory channel. A successful prefill costs
    the stream nothing but a check per item; a late prefill failure turns what would have
    been a success into one error item (G5, G6).

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
            with a "decode idle" error (B2). Before the first output, the wait counts from
            the prefill's end: a decode dispatched alongside its prefill (bootstrap) waits
            on that prefill, which its own deadline bounds.
        terminal_hold_timeout: seconds to hold a success terminal for the prefill outcome
            before failing the stream with a "terminal hold" error (B2).
        on_first_output: called once, synchronously, when the first decode output (or
            the end of the decode stream) arrives. The router links the client's context
            to a decode leg that is part of a KV transfer only then (B6, G9).

    Raises:
        TypeError: ``prefill`` is none of those, or ``client_context`` is not a
            :class:`RequestContext`.
        ValueError: ``idle_timeout`` or ``terminal_hold_timeout`` is not a positive
            number of seconds (``math.inf``, the default, is no deadline).

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
        for name, value in (("idle_timeout", idle_timeout),
                            ("terminal_hold_timeout", terminal_hold_timeout)):
            # A negative one failed every stream at once; a NaN one, trio's first wait.
            if not (isinstance(value, int | float) and value > 0):  # also refuses NaN
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        if not isinstance(client_context, RequestContext):
            raise TypeError(f"client_context must be a trio_disagg.RequestContext, got "
                            f"{type(client_context).__name__}")
        #: A Terminal: there is no decode to dispatch (S7).
        self._answer_only = isinstance(prefill, Terminal)
        self.prefill: PrefillTask[Any] = _as_task(prefill, client_context.id)
        self._on_first_output = on_first_output
        self._output_seen = False  # the first decode output (or the stream's end) came
        self.client_context = client_context
        self.idle_timeout = idle_timeout
        self.terminal_hold_timeout = terminal_hold_timeout
        #: Why the gate ended the stream with an error item of its own, if it did: the
        #: prefill's :class:`PrefillError` or a :class:`DeadlineExceeded` (B2); else None.
        self.failure: Exception | None = None

    async def dispatch(
        self,
        nursery: trio.Nursery,
        start_decode: Callable[..., Awaitable[Any]],
        *args: Any,
    ) -> Any:
        """Start the decode leg as ``await nursery.start(start_decode, *args)`` would (with
        no nursery of trio's per start: :func:`~trio_disagg._start.start_in`), racing the
        prefill (G1, G2).

        The race is a cancel scope that a prefill watcher cancels: a prefill failure while
        the dispatch is pending cancels the dispatch. If both are ready together the prefill
        is looked at first, so a failed prefill always wins (G1).

        A gate made from a :class:`Terminal` starts nothing and returns None (S7): the
        prefill's answer is all :meth:`forward` sends.

        Args:
            nursery: the request's nursery, where the decode leg runs; the caller runs in
                it (in its ``async with`` block).
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
                A group whose one exception is a :class:`~trio_disagg.WorkerError` (an
                engine that refused from inside a nursery of its own) raises that one.

        Cancellation (the client left) cancels the dispatch; the prefill is the keeper's
        and runs on (G9).
        """
        if self._answer_only:
            return None
        started: Any = None
        try:
            if self.prefill.succeeded:
                return await start_in(nursery, start_decode, *args)  # G2
            if not self.prefill.done:
                started = await self._start_racing_prefill(nursery, start_decode, args)
        except Exception as exc:
            refusal = worker_refusal(exc)  # from inside a nursery of the engine's own
            if refusal is None or refusal is exc:
                raise
            raise refusal from refusal.__cause__
        if self.prefill.failed:  # looked at first, also on a tie (G1)
            self._raise_prefill_failure()
        return started

    async def _start_racing_prefill(
        self, nursery: trio.Nursery, start_decode: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
    ) -> Any:
        """``nursery.start(start_decode, *args)`` in a cancel scope that a prefill failure
        cancels (G1); None if it was cancelled so."""
        prefill = self.prefill
        with trio.CancelScope() as race:
            # A watcher called by the prefill's task, not a task of its own: an error
            # from start_decode reaches the caller bare, not in an ExceptionGroup.
            def on_prefill_end() -> None:
                if prefill.failed:
                    race.cancel()

            prefill._on_done(on_prefill_end)
            try:
                return await start_in(nursery, start_decode, *args)
            except Exception as exc:
                if not prefill.failed:
                    raise
                # A decode refusal in the same instant as a prefill failure: the prefill
                # is looked at first (G1).
                self._raise_prefill_failure(exc)
            finally:
                prefill._forget_on_done(on_prefill_end)
        return None

    def _raise_prefill_failure(self, cause: BaseException | None = None) -> NoReturn:
        """Stop the client context and raise the prefill's error (G1)."""
        self.client_context.stop_generating()
        error = self.prefill.error
        assert error is not None
        if cause is None:
            raise error
        raise error from cause

    def _prefill_answer(self) -> Item | None:
        """The prefill's own answer, if it finished the request by itself (S7)."""
        completion = self.prefill.value
        return completion.output if isinstance(completion, Terminal) else None

    def _first_output(self) -> None:
        """The first decode output (or the decode stream's end) arrived: call
        ``on_first_output``, once."""
        self._output_seen = True
        first, self._on_first_output = self._on_first_output, None
        if first is not None:
            first()

    def outputs(
        self,
        decode_outputs: trio.MemoryReceiveChannel[Item],
        decode_context: RequestContext | None = None,
        on_end: Callable[[], object] | None = None,
    ) -> GatedOutputs:
        """The client's end of the decode stream: a receive channel that pulls each decode
        output through the gate in the reader's own task (G3-G8), with no task of its own.

        Args:
            decode_outputs: the decode leg's outputs (what the engine sends).
            decode_context: the decode leg's context, stopped when the gate ends the
                stream early (a prefill failure, an answer from the prefill, the reader
                closed the channel before its end), or None when the leg must not be
                stopped from here (the router passes None for a decode leg that is part
                of a KV transfer: its handoff owner ends it, G9).
            on_end: called once, synchronously, when the stream ends however it ends:
                its last item taken, its decode stream ended, or the channel closed.

        Returns:
            A :class:`GatedOutputs`; see there for what it gives and when.
        """
        return GatedOutputs(self, decode_outputs, decode_context, on_end)

    async def forward(
        self,
        decode_outputs: trio.MemoryReceiveChannel[Item],
        send_channel: trio.MemorySendChannel[Item],
        decode_context: RequestContext | None = None,
    ) -> None:
        """Move decode outputs to ``send_channel`` until a terminal item (G3-G8): what
        :meth:`outputs` gives, pushed into a channel by the calling task.

        Non-terminal tokens pass at once, even while the prefill is pending (G3). A decode
        failure passes at once, as the engine sent it, and ends the stream (G4). A success
        terminal, or the end of ``decode_outputs``, is held until the prefill outcome is
        known; if the prefill failed, one error item carrying the prefill error replaces
        it, both contexts are stopped and the stream ends (G5). A prefill failure while
        waiting for a decode output does the same (G6), and so does one while an item
        waits for a slow receiver: the prefill's error goes in its place (B4). After a
        successful prefill items pass unchanged (G7). Nothing passes after a terminal item
        (G8). Both channels are closed on return.

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
                None when the leg must not be stopped from here (G9).

        It raises nothing of its own: a deadline (B2) or a prefill failure becomes the
        last item, and :attr:`failure` says which.

        Cancellation (the client went away) just stops forwarding, and both channels are
        closed; ``decode_context`` is not stopped (the decode leg lives in the same
        nursery, or belongs to the keeper), and the prefill is owned by the keeper and is
        not affected (G9).
        """
        gated = self.outputs(decode_outputs, decode_context)
        with send_channel:
            try:
                with gated:
                    await self._push(gated, send_channel)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # The client closed its end: nobody is listening, so stop the decode leg
                # and end quietly. The prefill is not ours to stop (G9).
                if decode_context is not None:
                    decode_context.stop_generating()

    async def _push(self, gated: GatedOutputs, send_channel: trio.MemorySendChannel[Item]
                    ) -> None:
        """:meth:`forward`'s loop. One race for the whole wait for the prefill, not a
        scope per item: its failure, or its own answer (S7), cancels whatever the loop is
        doing, a wait for the decode or a send to a slow receiver (B4, G6)."""
        prefill = self.prefill
        with trio.CancelScope() as race:
            def on_prefill_end() -> None:
                if prefill.failed or self._prefill_answer() is not None:
                    race.cancel()

            if not prefill.done:
                gated._raced = True
                prefill._on_done(on_prefill_end)
            try:
                async for item in gated:
                    await send_channel.send(item)
            finally:
                prefill._forget_on_done(on_prefill_end)
        if race.cancelled_caught:
            # What the loop held never reached the receiver: the prefill's outcome goes
            # in its place.
            await send_channel.send(gated._conclude())


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


__all__ = ["GatedOutputs", "Gatekeeper", "PrefillError", "is_decode_failure"]
