"""The disaggregated router: one nursery per request, three handoff styles, deadlines."""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
from functools import partial
from typing import Any

import attrs
import trio

from ._context import RequestContext
from ._engine import HandoffStyle
from ._errors import (
    DeadlineExceeded,
    PrefillDeadlineExceeded,
    PrefillError,
    RouterClosed,
    WorkerError,
)
from ._gate import Gatekeeper
from ._keeper import PrefillTask, TransferKeeper, TransferLeg
from ._pool import Worker, WorkerPool
from ._prefill import (
    Handoff,
    PrefillCompletion,
    Terminal,
    classify_first_output,
    consume_prefill_stream,
)
from ._protocols import (
    Annotated,
    BootstrapInfo,
    LLMEngineOutput,
    PreprocessedRequest,
    PromptTokensDetails,
)
from ._tracker import RequestTracker

logger = logging.getLogger("trio_disagg.router")

Item = Annotated[LLMEngineOutput]

#: Items an engine may run ahead of the gatekeeper, and the gatekeeper of the client.
CHANNEL_BUFFER = 16


def _positive_seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and value > 0):  # also refuses NaN
        raise ValueError(f"the {attribute.name} deadline must be > 0 seconds, got {value!r}")


@attrs.define(kw_only=True)
class Deadlines:
    """Every bounded wait of a request, in seconds (SEMANTICS.md B2).

    Attributes:
        prefill: prefill dispatch until its handoff is classified.
        handoff: handoff ready until the decode worker accepted the request.
        decode_idle: the longest gap between two decode outputs.
        terminal_hold: how long a success terminal waits for the prefill outcome.
        transfer: the whole prefill leg in the keeper, including a bootstrap drain
            and a B1 cleanup decode.

    Raises:
        ValueError: a deadline that is not a positive number of seconds (``inf`` is
            allowed: no deadline).
    """

    prefill: float = attrs.field(default=60.0, validator=_positive_seconds)
    handoff: float = attrs.field(default=30.0, validator=_positive_seconds)
    decode_idle: float = attrs.field(default=60.0, validator=_positive_seconds)
    terminal_hold: float = attrs.field(default=60.0, validator=_positive_seconds)
    transfer: float = attrs.field(default=300.0, validator=_positive_seconds)


@attrs.define(eq=False)
class RequestStream:
    """A request in flight: what :meth:`DisaggRouter.stream` returns.

    Attributes:
        outputs: the client's stream of items; the last one is a terminal, an error,
            or the channel ends (B4 is the server's job).
        tracker: the request's phases and timestamps.
        style: which handoff style served it (``"sequential"``, ``"bootstrap"``,
            ``"terminal"``).
        prefill: the prefill drain, owned by the keeper.
        gate: the gatekeeper, or None for a terminal prefill.
        prefill_worker, decode_worker: names of the chosen workers.
    """

    outputs: trio.MemoryReceiveChannel[Item]
    tracker: RequestTracker
    style: str
    prefill: PrefillTask[PrefillCompletion]
    gate: Gatekeeper | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None

    @property
    def prompt_tokens_details(self) -> PromptTokensDetails | None:
        """The prefill worker's ``prompt_tokens_details`` (its ``cached_tokens`` is the one
        to report: PROTOCOLS.md section 1), once the prefill succeeded."""
        completion = self.prefill.value
        if isinstance(completion, Handoff):
            return completion.result.prompt_tokens_details
        if isinstance(completion, Terminal) and completion.output.data is not None:
            usage = completion.output.data.completion_usage
            return usage.prompt_tokens_details if usage is not None else None
        return None


class _HandoffSlot:
    """Decides who consumes the staged KV: the request's decode leg, or the keeper (B1).

    The request marks the slot dispatched once its decode leg was accepted. If the request
    ends first (client gone, deadline, decode refused), it abandons the slot, and the
    keeper dispatches a minimal decode so the KV is consumed, never stranded: the prefill
    leg does, if the handoff arrives after the request ended; the request's own cleanup
    does (through the keeper), if the handoff had already arrived. Both sides decide
    without awaiting, so exactly one of them does it.
    """

    __slots__ = ("abandoned", "completion", "dispatched")

    def __init__(self) -> None:
        self.completion: PrefillCompletion | None = None  # offered by the prefill leg
        self.dispatched = False  # the request's decode leg was accepted
        self.abandoned = False  # the request ended before that


class _BootstrapDecode:
    """A bootstrap request's decode leg, which runs in the keeper (it is part of the KV
    transfer: G9), and what B1 needs to know of it: whether a decode joined the room."""

    __slots__ = ("decided", "leg")

    def __init__(self) -> None:
        self.leg: TransferLeg | None = None
        self.decided = trio.Event()  # the leg was spawned, or the request ended without one

    def bound(self, grace: float) -> None:
        if self.leg is not None:
            self.leg.bound(grace)

    async def joined(self) -> bool:
        """Whether a decode worker accepted the request (and so joined the room)."""
        await self.decided.wait()
        if self.leg is None:
            return False
        await self.leg.settled.wait()
        return self.leg.started


@attrs.define(kw_only=True)
class RouterCounters:
    """Lifetime counters for metrics (SEMANTICS.md B5)."""

    requests_total: int = 0
    staged_kv_cleanups: int = 0
    staged_kv_cleanup_failures: int = 0


class DisaggRouter:
    """Routes requests through a prefill worker and a decode worker.

    Each request runs in a nursery its caller owns (:meth:`stream`); the prefill leg runs
    on a context of its own (C5) inside the :class:`TransferKeeper`, so a client that goes
    away never aborts a KV transfer (G9). The handoff style follows the prefill worker:

    - ``SEQUENTIAL`` (vLLM, TRT-LLM): await the classified prefill (S1-S10); a terminal
      prefill answers the client with no decode (S7); otherwise dispatch decode with the
      :class:`PrefillResult`.
    - ``BOOTSTRAP`` (SGLang): pick a unique 63-bit bootstrap room, dispatch prefill and
      decode together; the keeper drains the prefill and the gatekeeper watches it (G1-G9).

    If the request ends before its decode leg was accepted, the keeper still dispatches a
    minimal decode (one token, not streamed) so the staged KV is consumed (B1).

    Args:
        prefill: the prefill workers.
        decode: the decode workers.
        keeper: an open :class:`TransferKeeper` that outlives every request.
        deadlines: the bounded waits (B2).
        channel_buffer: how many items a decode leg may run ahead of the gatekeeper, and
            the gatekeeper of the client. Smaller costs less memory per slow reader
            (DESIGN.md P3: about 0.3 KiB an item); larger lets a worker's burst reach the
            client in one write (P4).

    Raises:
        ValueError: a negative ``channel_buffer``.
    """

    def __init__(
        self,
        prefill: WorkerPool,
        decode: WorkerPool,
        keeper: TransferKeeper,
        *,
        deadlines: Deadlines | None = None,
        channel_buffer: int = CHANNEL_BUFFER,
    ) -> None:
        if channel_buffer < 0:
            raise ValueError(f"channel_buffer must be >= 0 items, got {channel_buffer}")
        self.channel_buffer = channel_buffer
        self.prefill = prefill
        self.decode = decode
        self.keeper = keeper
        self.deadlines = deadlines if deadlines is not None else Deadlines()
        self.counters = RouterCounters()
        self._in_flight = 0
        self._idle = trio.Event()
        self._idle.set()
        self._closing = False
        self._rooms: set[int] = set()

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished (B5)."""
        return self._in_flight

    @property
    def closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Stop admitting requests; those in flight go on (B3)."""
        self._closing = True

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        while not self._idle.is_set():
            await self._idle.wait()

    def _admit(self) -> None:
        if self._closing:
            raise RouterClosed("the router is shutting down")
        self.counters.requests_total += 1
        self._in_flight += 1
        if self._in_flight == 1:
            self._idle = trio.Event()

    def _release(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    def _new_room(self) -> int:
        while (room := secrets.randbits(63)) in self._rooms:
            pass
        self._rooms.add(room)
        return room

    async def stream(
        self,
        nursery: trio.Nursery,
        request: PreprocessedRequest,
        context: RequestContext,
    ) -> RequestStream:
        """Start ``request`` and return its output stream.

        The decode leg and the gatekeeper run in ``nursery``: the request's nursery, which
        the caller cancels when the client goes away. Returns once the decode worker
        accepted the request (or at once for a terminal prefill), so errors before the
        first byte are raised here.

        Args:
            nursery: the request's nursery; it must not outlive the keeper.
            request: the request; ``routing`` and ``bootstrap_info`` are filled in (S12).
            context: the client's context; stopping it stops the decode leg (C4), never
                the prefill (C5).

        Returns:
            A :class:`RequestStream` whose ``outputs`` the caller reads to the end.

        Raises:
            RouterClosed: the router is shutting down (B3).
            NoWorkerAvailable: no healthy prefill or decode worker.
            PrefillError: the prefill failed (S1, S2, S8, S9, T3, T4, G1), with its
                worker's message; a :class:`PrefillDeadlineExceeded` if it ran out of time.
            DeadlineExceeded: the decode worker did not accept within ``handoff`` seconds.
            WorkerError: the decode worker refused the request.

        On cancellation (the client went away) the prefill runs on in the keeper and, if
        the decode leg was not yet accepted, its KV is consumed there (B1, G9).
        """
        self._admit()
        owned = True  # until the forwarding task takes over the in-flight count
        room: int | None = None  # bound before anything can raise: the finally reads it
        try:
            prefill_worker = self.prefill.select(request, pinned=request.routing.prefill_worker)
            request.routing.prefill_worker = prefill_worker.name  # S12
            decode_worker = self.decode.select(request, pinned=request.routing.decode_worker)
            request.routing.decode_worker = decode_worker.name
            tracker = RequestTracker()
            slot = _HandoffSlot()
            bootstrap_decode = _BootstrapDecode()
            engine = prefill_worker.engine
            bootstrap = engine.handoff_style is HandoffStyle.BOOTSTRAP
            if bootstrap:
                if engine.bootstrap_host is None or engine.bootstrap_port is None:
                    raise WorkerError(f"prefill worker {engine.name} has no bootstrap address")
                room = self._new_room()
                request.bootstrap_info = BootstrapInfo(
                    host=engine.bootstrap_host, port=engine.bootstrap_port, room=room
                )
            permit = tracker.enter_prefill()
            prefill_context = context.detached_copy()  # C5

            async def prefill_leg() -> PrefillCompletion:
                return await self._prefill_leg(
                    prefill_worker, request, prefill_context, tracker, slot, room,
                    bootstrap_decode,
                )

            task = self.keeper.start(prefill_leg, name=request.request_id, permit=permit)
            try:
                if bootstrap:
                    decode_request = request
                    style = "bootstrap"
                else:
                    completion = await task.result()
                    if isinstance(completion, Terminal):  # S7
                        owned = False
                        return self._terminal(completion, tracker, task, prefill_worker)
                    assert isinstance(completion, Handoff)
                    decode_request = attrs.evolve(request, prefill_result=completion.result)
                    style = "sequential"
                gate = Gatekeeper(
                    task,
                    context,
                    idle_timeout=self.deadlines.decode_idle,
                    terminal_hold_timeout=self.deadlines.terminal_hold,
                )
                decode_context = RequestContext(request.request_id, context.metadata)
                context.link_child(decode_context)  # C4
                decode_send, decode_receive = trio.open_memory_channel[Item](self.channel_buffer)
                # A bootstrap decode leg is part of the KV transfer: it runs in the keeper,
                # so a client that leaves cannot abort the transfer (G9). It ends at its
                # first send after the client left, once the KV is pulled.
                leg = bootstrap_decode if bootstrap else None
                try:
                    with trio.move_on_after(self.deadlines.handoff) as handoff_scope:
                        await gate.dispatch(
                            nursery,
                            self._decode_leg if leg is None else self._detached_decode_leg,
                            decode_worker,
                            decode_request,
                            decode_context,
                            decode_send,
                            *(() if leg is None else (leg,)),
                        )
                    if handoff_scope.cancelled_caught:
                        raise DeadlineExceeded("handoff", self.deadlines.handoff)
                    slot.dispatched = True
                    await tracker.enter_decode()  # S11: waits for the drain to have started
                except BaseException:
                    # Nobody will read the decode stream: a decode leg that did start gets
                    # BrokenResourceError on its next send instead of blocking on a full
                    # channel.
                    decode_receive.close()
                    bootstrap_decode.bound(self.deadlines.decode_idle)
                    raise
                out_send, out_receive = trio.open_memory_channel[Item](self.channel_buffer)
                nursery.start_soon(
                    self._forward, gate, decode_receive, out_send, decode_context, tracker, leg
                )
                owned = False
                return RequestStream(
                    outputs=out_receive,
                    tracker=tracker,
                    style=style,
                    prefill=task,
                    gate=gate,
                    prefill_worker=prefill_worker.name,
                    decode_worker=decode_worker.name,
                )
            finally:
                bootstrap_decode.decided.set()  # no-op once a decode leg was spawned
                if not slot.dispatched:
                    slot.abandoned = True
                    if isinstance(slot.completion, Handoff) and not bootstrap:
                        # The KV was staged before the request ended: consume it (B1).
                        staged = attrs.evolve(request, prefill_result=slot.completion.result)
                        self._start_cleanup(staged)
        finally:
            if owned:
                self._release()
            if room is not None and owned:
                self._rooms.discard(room)

    def _terminal(
        self,
        completion: Terminal,
        tracker: RequestTracker,
        task: PrefillTask[PrefillCompletion],
        prefill_worker: Worker,
    ) -> RequestStream:
        send, receive = trio.open_memory_channel[Item](1)
        with send:
            send.send_nowait(completion.output)
        tracker.finish()
        self._release()
        return RequestStream(
            outputs=receive,
            tracker=tracker,
            style="terminal",
            prefill=task,
            prefill_worker=prefill_worker.name,
        )

    async def _forward(
        self,
        gate: Gatekeeper,
        decode_receive: trio.MemoryReceiveChannel[Item],
        out_send: trio.MemorySendChannel[Item],
        decode_context: RequestContext,
        tracker: RequestTracker,
        leg: _BootstrapDecode | None,
    ) -> None:
        try:
            await gate.forward(decode_receive, out_send, decode_context)
        finally:
            tracker.finish()
            self._release()
            if leg is not None:
                # Nobody reads the detached decode leg any more: it gets one idle period
                # to finish its KV pull and reach its first send, then it is cancelled.
                leg.bound(self.deadlines.decode_idle)

    async def _detached_decode_leg(  # noqa: ASYNC128 (reports started() itself)
        self,
        worker: Worker,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        holder: _BootstrapDecode,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Dispatch a bootstrap decode leg in the keeper and wait for its worker to accept.

        Cancelling the wait (the client left, or G1) does not cancel the dispatch: a decode
        half-dispatched might or might not have joined the room, and then nobody could say
        whether the KV still needs consuming (B1).
        """
        leg = self.keeper.spawn_leg(
            self._decode_leg, worker, request, context, send_channel,
            name=f"decode {request.request_id}",
        )
        leg.bound(self.deadlines.handoff)  # accepted within the handoff deadline, waited or not
        holder.leg = leg
        holder.decided.set()
        await leg.wait_started()
        leg.scope.deadline = math.inf  # its stream is bounded by the gatekeeper from here
        task_status.started()

    async def _decode_leg(  # noqa: ASYNC128 (the engine calls task_status.started())
        self,
        worker: Worker,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with self.decode.lease(worker):
            try:
                await worker.engine.generate(
                    request, context, send_channel, task_status=task_status
                )
            except WorkerError as exc:
                self.decode.record_failure(worker, exc)
                raise
            self.decode.record_success(worker)

    async def _prefill_leg(
        self,
        worker: Worker,
        request: PreprocessedRequest,
        context: RequestContext,
        tracker: RequestTracker,
        slot: _HandoffSlot,
        room: int | None,
        bootstrap_decode: _BootstrapDecode,
    ) -> PrefillCompletion:
        """The whole prefill leg, run by the keeper: dispatch, classify, drain, and B1."""
        try:
            with trio.move_on_after(self.deadlines.transfer) as transfer_scope:
                async with trio.open_nursery() as nursery:
                    if room is not None:
                        # Decode is dispatched concurrently: B1 may be needed while the
                        # prefill still waits for the decode worker to join the room.
                        nursery.start_soon(self._consume_if_no_decode, bootstrap_decode,
                                           request)
                    completion = await self._run_prefill(worker, request, context, tracker)
                    slot.completion = completion
                    if room is None and isinstance(completion, Handoff) and slot.abandoned:
                        # The request ended before its handoff arrived (B1).
                        staged = attrs.evolve(request, prefill_result=completion.result)
                        await self._consume_staged_kv(staged)
        except* PrefillError as group:
            leaf = _single(group)  # one typed error for the PrefillTask, its cause kept
            raise leaf from leaf.__cause__
        finally:
            if room is not None:
                self._rooms.discard(room)
        if transfer_scope.cancelled_caught:
            context.kill()
            raise PrefillDeadlineExceeded("transfer", self.deadlines.transfer)
        return completion

    async def _run_prefill(
        self,
        worker: Worker,
        request: PreprocessedRequest,
        context: RequestContext,
        tracker: RequestTracker,
    ) -> PrefillCompletion:
        with self.prefill.lease(worker):
            send, receive = trio.open_memory_channel[Item](self.channel_buffer)
            try:
                async with trio.open_nursery() as nursery:
                    # The prefill deadline bounds the dispatch and the wait for the first
                    # output (the handoff) only. The engine itself runs outside it, so an
                    # answer already on its way when the deadline expires can still be
                    # read, and its staged KV consumed (B1). The rest of the stream (a
                    # bootstrap prefill answers after the transfer) is bounded by the
                    # transfer deadline of the whole leg.
                    first: Item | None = None
                    with trio.move_on_after(self.deadlines.prefill) as scope:
                        try:
                            await nursery.start(
                                worker.engine.generate, request, context, send
                            )
                        except WorkerError as exc:
                            raise PrefillError(_naming(worker, exc)) from exc
                        with contextlib.suppress(trio.EndOfChannel):  # S1, reported below
                            first = await receive.receive()
                    if scope.cancelled_caught:
                        await self._consume_late_handoff(request, receive)
                        nursery.cancel_scope.cancel()
                    else:
                        completion = await consume_prefill_stream(
                            receive, tracker=tracker, first=first
                        )
            except* PrefillError as group:
                leaf = _single(group)  # keep the cause: a worker's 4xx reaches the client
                self.prefill.record_failure(worker, leaf)
                raise leaf from leaf.__cause__
            except* WorkerError as group:
                self.prefill.record_failure(worker, _single(group))
                raise PrefillError(_naming(worker, _single(group))) from _single(group)
            if scope.cancelled_caught:
                self.prefill.record_failure(worker)
                raise PrefillDeadlineExceeded("prefill", self.deadlines.prefill)
            self.prefill.record_success(worker)
            return completion

    async def _consume_late_handoff(
        self, request: PreprocessedRequest, receive: trio.MemoryReceiveChannel[Item]
    ) -> None:
        """The prefill deadline expired: if the worker's answer was already on its way (it
        finished, and staged KV for a decode), read it within a short grace and consume
        that KV (B1) instead of leaving it to the worker's lease."""
        with trio.move_on_after(min(1.0, 0.1 * self.deadlines.prefill)):
            with contextlib.suppress(trio.EndOfChannel, trio.ClosedResourceError):
                late = await receive.receive()
                try:
                    completion = classify_first_output(late)
                except PrefillError:
                    return
                if isinstance(completion, Handoff) and not completion.bootstrap:
                    self._start_cleanup(
                        attrs.evolve(request, prefill_result=completion.result)
                    )

    async def _consume_if_no_decode(
        self, bootstrap_decode: _BootstrapDecode, request: PreprocessedRequest
    ) -> None:
        """B1 for the bootstrap style, alongside the prefill: if no decode worker accepted
        the request (it ended before dispatching one, or the decode refused), a minimal
        decode joins the room instead. Never when one did: a room is never reused."""
        if not await bootstrap_decode.joined():
            await self._consume_staged_kv(request)

    def _start_cleanup(self, request: PreprocessedRequest) -> None:
        """Start :meth:`_consume_staged_kv` in the keeper; never raises (it runs in a
        ``finally``)."""
        try:
            self.keeper.start(
                partial(self._consume_staged_kv, request),
                name=f"B1 cleanup {request.request_id}",
            )
        except RuntimeError:  # the keeper is closing: the worker's lease reclaims the KV
            self.counters.staged_kv_cleanup_failures += 1
            logger.warning("B1 cleanup for %s not started: the keeper is closed",
                           request.request_id)

    async def _consume_staged_kv(self, request: PreprocessedRequest) -> None:
        """B1: a minimal decode (one token, not streamed) that consumes the staged KV."""
        self.counters.staged_kv_cleanups += 1
        body = dict(request.body)
        body["max_tokens"] = 1
        body["stream"] = False
        body.pop("stream_options", None)
        body.pop("fault", None)
        minimal = attrs.evolve(request, body=body, max_tokens=1, stream=False)
        try:
            worker = self.decode.select(minimal)
            context = RequestContext(request.request_id)
            send, receive = trio.open_memory_channel[Item](1)
            with trio.fail_after(self.deadlines.handoff + self.deadlines.decode_idle):
                async with trio.open_nursery() as nursery:
                    await nursery.start(self._decode_leg, worker, minimal, context, send)
                    with receive:
                        async for _ in receive:
                            pass
        except Exception as exc:  # logged, never raised into the keeper (T2)
            self.counters.staged_kv_cleanup_failures += 1
            logger.warning("B1 cleanup decode for %s failed: %r", request.request_id, exc)


def _naming(worker: Worker, exc: BaseException) -> str:
    """The error's message, naming the prefill worker once (adapters' messages often do)."""
    text = str(exc)
    return text if worker.name in text else f"prefill worker {worker.name} failed: {text}"


def _single(group: BaseExceptionGroup[Any]) -> Any:
    """The first leaf exception of a group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


