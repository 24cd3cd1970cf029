"""The disaggregated router: one nursery per request, one handoff owner per request, deadlines."""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
from collections.abc import Mapping
from functools import partial
from typing import Any

import attrs
import trio
from trio_util import AsyncValue

from ._context import RequestContext
from ._engine import DecodeEngine, PrefillEngine
from ._errors import (
    DeadlineExceeded,
    NoWorkerAvailable,
    PrefillCancelled,
    PrefillDeadlineExceeded,
    PrefillError,
    RouterClosed,
    WorkerError,
)
from ._estimate import estimate_prompt_tokens
from ._gate import Gatekeeper
from ._handoff import BootstrapOwner, DecodeOnlyOwner, HandoffOwner, HandoffState, owner_for
from ._health import RetryPolicy, retry_reason
from ._keeper import CLEANUP, PrefillTask, TransferKeeper
from ._pool import E, Worker, WorkerPool
from ._prefill import (
    Handoff,
    PrefillCompletion,
    Terminal,
    classify_first_output,
    consume_prefill_stream,
    is_bootstrap_params,
)
from ._protocols import (
    Annotated,
    BootstrapInfo,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    PromptTokensDetails,
)
from ._tracker import RequestTracker

logger = logging.getLogger("trio_disagg.router")

Item = Annotated[LLMEngineOutput]

#: Items an engine may run ahead of the gatekeeper, and the gatekeeper of the client.
CHANNEL_BUFFER = 16
#: Seconds (at most; 10% of the prefill deadline if less) to read a prefill answer that
#: was already on its way when the prefill deadline expired, so its KV is consumed (B1).
LATE_ANSWER_GRACE = 1.0
#: The routing decisions :attr:`RouterCounters.decisions` counts: with a prefill leg and
#: a KV transfer, or on one decode worker alone (conditional disaggregation).
DISAGGREGATED = "disaggregated"
DECODE_ONLY = "decode_only"


def _positive_seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and value > 0):  # also refuses NaN
        raise ValueError(f"the {attribute.name} deadline must be > 0 seconds, got {value!r}")


@attrs.define(kw_only=True)
class Deadlines:
    """Every bounded wait of a request, in seconds (rule B2 in docs/semantics.md).

    Attributes:
        prefill: from the prefill's dispatch until its first output, the handoff,
            retries on other workers included (B9). A bootstrap prefill's answer, which
            comes after the KV transfer, then gets as long again, counted from that first
            output. On expiry the request fails with a
            :class:`~trio_disagg.PrefillDeadlineExceeded`; an answer already on its way
            is still read, within ``min(1 s, 10% of it)``, so its staged KV is consumed
            (B1).
        handoff: handoff ready until the decode worker accepted the request.
        decode_idle: the longest gap between two decode outputs.
        terminal_hold: how long a success terminal waits for the prefill outcome.
        transfer: the whole prefill leg in the keeper, including a bootstrap drain. (A
            B1 cleanup decode is bounded by ``handoff`` + ``decode_idle``.)

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

    The caller reads ``outputs`` to its end. The decode leg and the gatekeeper that feed
    it run in the nursery the caller gave :meth:`DisaggRouter.stream`; cancelling that
    nursery (the client went away) closes ``outputs`` and stops the decode leg, while the
    prefill leg (``prefill``) stays the keeper's: it runs on, or is cancelled inside its
    engine's cancel window, and staged KV that no decode took is consumed (B1, B10, G9).
    Closing ``outputs`` early ends the forwarding as a client that left does; the prefill
    leg is not affected (G9).

    Attributes:
        outputs: the client's stream of items; the last one is a terminal, an error,
            or the channel ends (B4 is the server's job). A ``"stopped"`` request's holds
            one ``cancelled`` finish (C3), or nothing if the context was killed.
        tracker: the request's phases and timestamps.
        style: which handoff style served it (``"sequential"``, ``"context_first"``,
            ``"bootstrap"``), ``"decode_only"`` (a short prompt served by its decode worker
            alone: conditional disaggregation), ``"terminal"`` (the prefill answered, S7)
            or ``"stopped"`` (the client stopped or killed its context before a decode
            took the request).
        prefill: the prefill drain, owned by the keeper (a decode-only request's has
            already succeeded, with no value).
        gate: the gatekeeper, or None when no decode leg runs (``"terminal"`` and
            ``"stopped"``).
        prefill_worker: the name of the chosen prefill worker (the routing decision);
            None for a decode-only request.
        decode_worker: the name of the chosen decode worker; None when no decode leg runs
            (``"terminal"`` and ``"stopped"``).
        bootstrap_info: the bootstrap room chosen (bootstrap style).
        handoff: the request's handoff owner (its ``state`` says what became of the KV).
    """

    outputs: trio.MemoryReceiveChannel[Item]
    tracker: RequestTracker
    style: str
    prefill: PrefillTask[PrefillCompletion]
    gate: Gatekeeper | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    bootstrap_info: BootstrapInfo | None = None
    handoff: HandoffOwner | None = None

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's token count as the prefill worker reported it, once the prefill
        succeeded (the client's ``usage.prompt_tokens``, B8)."""
        completion = self.prefill.value
        if isinstance(completion, Handoff):
            return completion.result.prompt_tokens
        if isinstance(completion, Terminal) and completion.output.data is not None:
            usage = completion.output.data.completion_usage
            return usage.prompt_tokens if usage is not None and usage.prompt_tokens else None
        return None

    @property
    def prompt_tokens_details(self) -> PromptTokensDetails | None:
        """The prefill worker's ``prompt_tokens_details`` (its ``cached_tokens`` is the one
        to report: docs/protocols.md section 1), once the prefill succeeded."""
        completion = self.prefill.value
        if isinstance(completion, Handoff):
            return completion.result.prompt_tokens_details
        if isinstance(completion, Terminal) and completion.output.data is not None:
            usage = completion.output.data.completion_usage
            return usage.prompt_tokens_details if usage is not None else None
        return None


@attrs.define(kw_only=True)
class RouterCounters:
    """Lifetime counters for metrics (rules B5, B6, B10 in docs/semantics.md).

    Attributes:
        requests_total: requests admitted.
        staged_kv_cleanups: one-token cleanup decodes started for staged KV (B1).
        staged_kv_cleanup_failures: those that failed (the worker's lease reclaims it).
        prefills_cancelled: prefills cancelled because their client left inside the
            engine's cancel window (B10).
        prefills_released: prefills ended because no decode would ever take their KV: a
            bootstrap room no decode will join (B6).
        prefills_drained: prefills whose request ended first and that the keeper ran to
            their end (C5, T1), their KV then consumed (B1) or transferred (G9).
    """

    requests_total: int = 0
    staged_kv_cleanups: int = 0
    staged_kv_cleanup_failures: int = 0
    prefills_cancelled: int = 0
    prefills_released: int = 0
    prefills_drained: int = 0
    #: Legs tried again on another worker (B9), by ``(leg, reason)``: leg ``prefill`` or
    #: ``decode``, reason ``transport_error`` or ``server_error``.
    retries: dict[tuple[str, str], int] = attrs.Factory(dict)
    #: Requests by routing decision: :data:`DISAGGREGATED` or :data:`DECODE_ONLY`.
    decisions: dict[str, int] = attrs.Factory(lambda: {DISAGGREGATED: 0, DECODE_ONLY: 0})

    def count_retry(self, leg: str, reason: str) -> None:
        """Count one retry in :attr:`retries` (B9).

        Args:
            leg: ``"prefill"`` or ``"decode"``.
            reason: ``"transport_error"`` or ``"server_error"``
                (``retry_reason`` in the health module).
        """
        self.retries[leg, reason] = self.retries.get((leg, reason), 0) + 1


class _Accepted:
    """A decode leg's ``task_status`` that tells the handoff's owner when the decode worker
    accepted the request."""

    __slots__ = ("accepted", "owner", "task_status")

    def __init__(self, owner: HandoffOwner, task_status: trio.TaskStatus[None]) -> None:
        self.owner = owner
        self.task_status = task_status
        self.accepted = False

    def started(self, value: None = None) -> None:
        self.accepted = True
        self.owner.decode_accepted()
        self.task_status.started(value)


class DisaggRouter:
    """Routes requests through a prefill worker and a decode worker.

    Each request runs in a nursery its caller owns (:meth:`stream`); the prefill leg runs
    on a context of its own (C5) inside the :class:`TransferKeeper`, so a client that goes
    away never aborts a KV transfer (G9). One owner per request decides what becomes of
    its staged KV or bootstrap room however the request ends (B1, B6, B10); the handoff
    style of the prefill worker picks its strategy:

    - ``SEQUENTIAL`` (vLLM): await the classified prefill (S1-S10); a terminal prefill
      answers the client with no decode (S7); otherwise dispatch decode with the
      :class:`PrefillResult`.
    - ``CONTEXT_FIRST`` (TensorRT-LLM): the same, with the generation leg kept in the
      keeper until it fetched the KV (its first output).
    - ``BOOTSTRAP`` (SGLang): pick a unique 63-bit bootstrap room, dispatch prefill and
      decode together; the keeper drains the prefill and the gatekeeper watches it (G1-G9).

    If the request ends before a decode accepted the handoff, the keeper still consumes
    the staged KV with a minimal decode (one token, not streamed, B1), or ends a prefill
    that no decode will ever read (B6); a client that leaves inside the prefill engine's
    cancel window cancels its prefill (B10).

    Conditional disaggregation: with ``disagg_min_prompt_tokens``, a request whose prompt
    is estimated shorter than that (:func:`~trio_disagg._estimate.estimate_prompt_tokens`:
    one token per 4 bytes of UTF-8 text, token ids exactly) is sent to one decode worker
    as an ordinary request, with no prefill leg and no KV transfer: its decode worker
    computes the prefill itself (vLLM and TensorRT-LLM decode workers do, given no
    handoff; SGLang's do not, in their disaggregation mode). A prompt that cannot be
    estimated (an image) is disaggregated. :attr:`RouterCounters.decisions` counts both.

    Args:
        prefill: the prefill workers.
        decode: the decode workers.
        keeper: an open :class:`TransferKeeper` that outlives every request.
        deadlines: the bounded waits (B2).
        retry: how a leg that failed before the first byte is tried again on another
            worker (B9); default :class:`RetryPolicy` (two attempts per leg).
        channel_buffer: how many items a decode leg may run ahead of the gatekeeper, and
            the gatekeeper of the client. Smaller costs less memory per slow reader
            (P3: about 0.3 KiB an item); larger lets a worker's burst reach the client in
            one write (P4).
        disagg_min_prompt_tokens: the estimated prompt length, in tokens, from which a
            request is disaggregated; shorter ones go to a decode worker alone. None (the
            default): every request is disaggregated.

    Raises:
        ValueError: a negative ``channel_buffer`` or ``disagg_min_prompt_tokens``.
    """

    def __init__(
        self,
        prefill: WorkerPool[PrefillEngine],
        decode: WorkerPool[DecodeEngine],
        keeper: TransferKeeper,
        *,
        deadlines: Deadlines | None = None,
        retry: RetryPolicy | None = None,
        channel_buffer: int = CHANNEL_BUFFER,
        disagg_min_prompt_tokens: int | None = None,
    ) -> None:
        if channel_buffer < 0:
            raise ValueError(f"channel_buffer must be >= 0 items, got {channel_buffer}")
        if disagg_min_prompt_tokens is not None and disagg_min_prompt_tokens < 0:
            raise ValueError(f"disagg_min_prompt_tokens must be >= 0 tokens, got "
                             f"{disagg_min_prompt_tokens}")
        self.disagg_min_prompt_tokens = disagg_min_prompt_tokens
        self.channel_buffer = channel_buffer
        self.prefill = prefill
        self.decode = decode
        self.keeper = keeper
        self.deadlines = deadlines if deadlines is not None else Deadlines()
        self.retry = retry if retry is not None else RetryPolicy()
        self.counters = RouterCounters()
        self._in_flight = AsyncValue(0)  # tasks wait for it to be 0 (wait_idle)
        self._closing = False
        self._rooms: set[int] = set()

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished (B5): counted from :meth:`stream`'s call
        until its gatekeeper stops forwarding (at once for a request that failed before
        its decode accepted it, or that needs no decode leg). A prefill the keeper still
        drains after its request ended is the keeper's, not counted here."""
        return self._in_flight.value

    @property
    def closing(self) -> bool:
        """True once :meth:`close` was called: :meth:`stream` raises
        :class:`~trio_disagg.RouterClosed` (B3)."""
        return self._closing

    def close(self) -> None:
        """Stop admitting requests; those in flight go on (B3).

        Synchronous and idempotent: later calls to :meth:`stream` raise
        :class:`~trio_disagg.RouterClosed`. Nothing is cancelled; pair it with
        :meth:`wait_idle` (and the keeper's ``wait_idle``) for a graceful drain.
        """
        self._closing = True

    async def wait_idle(self) -> None:
        """Return once no request is in flight (:attr:`in_flight` is 0); at once if none is.

        It does not stop admission (call :meth:`close` first for a drain) and does not
        wait for prefill legs the keeper still runs (``keeper.wait_idle()`` does).
        Cancelling it leaves nothing behind.
        """
        await self._in_flight.wait_value(0)

    def _admit(self) -> None:
        if self._closing:
            raise RouterClosed("the router is shutting down")
        self.counters.requests_total += 1
        self._in_flight.value += 1

    def _release(self) -> None:
        self._in_flight.value -= 1

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
            request: the request; it is not modified (the routing decision is in the
                returned stream).
            context: the client's context; stopping it stops the decode leg (C4), never
                the prefill (C5), and never a decode leg before it fetched its KV (G9).

        Returns:
            A :class:`RequestStream` whose ``outputs`` the caller reads to the end.

        Raises:
            RouterClosed: the router is shutting down (B3).
            NoWorkerAvailable: no healthy prefill or decode worker.
            PrefillError: the prefill failed (S1, S2, S8, S9, T3, T4, G1), with its
                worker's message; an :class:`InvalidPrefillHandoff` for a handoff that
                failed validation (B7); a :class:`PrefillDeadlineExceeded` if it ran out
                of time.
            DeadlineExceeded: the decode worker did not accept within ``handoff`` seconds.
            WorkerError: the decode worker refused the request.

        Each is raised bare, never inside an exception group. On cancellation (the client
        went away) the prefill runs on in the keeper, or is cancelled inside its engine's
        cancel window (B10); staged KV no decode took is consumed there (B1, G9).
        """
        self._admit()
        owner: HandoffOwner | None = None
        try:
            owner = self._route(request, context)
            if owner.disaggregated:
                self._start_prefill(owner)
            else:
                self._skip_prefill(owner)
            stream = await self._open(nursery, owner)
        except BaseException as exc:
            if owner is not None:
                owner.close_request(client_left=isinstance(exc, trio.Cancelled))
            self._release()
            raise
        if stream.gate is None:  # a terminal prefill: nothing more runs
            self._release()
        return stream

    def disaggregates(self, request: PreprocessedRequest) -> bool:
        """Whether ``request`` gets a prefill leg: always, unless its prompt is estimated
        shorter than ``disagg_min_prompt_tokens`` (conditional disaggregation).

        Args:
            request: the request; only its body's prompt is read (one token per 4 bytes
                of UTF-8 text, token ids counted exactly).

        Returns:
            True for a prefill leg and a KV transfer; False for one decode worker alone.
            A prompt that cannot be estimated (an image) is disaggregated (True).
        """
        if self.disagg_min_prompt_tokens is None:
            return True
        tokens = estimate_prompt_tokens(request.body)
        return tokens is None or tokens >= self.disagg_min_prompt_tokens

    def _route(self, request: PreprocessedRequest, context: RequestContext) -> HandoffOwner:
        """Choose the workers (S12) and make the request's handoff owner."""
        if not self.disaggregates(request):
            decode_worker = _select(self.decode, "decode", request,
                                    request.routing.decode_worker)
            self.counters.decisions[DECODE_ONLY] += 1
            routing = attrs.evolve(request.routing, decode_worker=decode_worker.name)
            return DecodeOnlyOwner(self, attrs.evolve(request, routing=routing), context,
                                   None, decode_worker)
        prefill_worker = _select(self.prefill, "prefill", request,
                                 request.routing.prefill_worker)
        decode_worker = _select(self.decode, "decode", request, request.routing.decode_worker)
        routing = attrs.evolve(request.routing, prefill_worker=prefill_worker.name,
                               decode_worker=decode_worker.name)
        request = attrs.evolve(request, routing=routing)
        engine = prefill_worker.engine
        strategy = owner_for(engine.handoff_style)
        if strategy is BootstrapOwner:
            if engine.bootstrap_host is None or engine.bootstrap_port is None:
                raise WorkerError(f"prefill worker {engine.name} has no bootstrap address")
            while (room := secrets.randbits(63)) in self._rooms:
                pass
            info = BootstrapInfo(host=engine.bootstrap_host, port=engine.bootstrap_port,
                                 room=room)
            request = attrs.evolve(request, bootstrap_info=info)
        self.counters.decisions[DISAGGREGATED] += 1
        return strategy(self, request, context, prefill_worker, decode_worker)

    def _skip_prefill(self, owner: HandoffOwner) -> None:
        """A decode-only request: its prefill is the decode worker's, so the gatekeeper
        watches a prefill that already succeeded, with nothing to hand off."""
        done: PrefillTask[PrefillCompletion] = PrefillTask(owner.request.request_id)
        done._finish(None, None)
        owner.task = done

    def _start_prefill(self, owner: HandoffOwner) -> None:
        """Start the prefill leg in the keeper, on a context of its own (C5)."""
        room = owner.request.bootstrap_info
        if room is not None:
            self._rooms.add(room.room)  # released by the prefill leg, however it ends
        permit = owner.tracker.enter_prefill()
        owner.prefill_context = owner.context.detached_copy()
        try:
            owner.task = self.keeper.start(
                partial(self._prefill_leg, owner, owner.prefill_context),
                name=owner.request.request_id, permit=permit,
            )
        except BaseException:
            if room is not None:
                self._rooms.discard(room.room)
            raise

    async def _open(self, nursery: trio.Nursery, owner: HandoffOwner) -> RequestStream:
        """Wait for what the decode needs and dispatch it; a client that stops or kills
        its context meanwhile ends the request at once, as one that left does (B10, B1):
        the keeper keeps what is part of a KV transfer."""
        with trio.CancelScope() as wait:
            def on_stop(killed: bool) -> None:
                wait.cancel()

            owner.context.on_stop(on_stop)
            try:
                decode_request = await owner.decode_request()
                if isinstance(decode_request, Terminal):  # S7
                    return self._terminal(owner, decode_request)
                return await self._dispatch(nursery, owner, decode_request)
            finally:
                # Once dispatched, the stream's own scopes answer a stop: the wait's scope
                # need not live as long as the request (P3: memory per stream).
                owner.context._forget_on_stop(on_stop)
        owner.close_request(client_left=True)
        return self._stopped(owner)

    async def _dispatch(
        self, nursery: trio.Nursery, owner: HandoffOwner, decode_request: PreprocessedRequest
    ) -> RequestStream:
        decode_context = RequestContext(decode_request.request_id, owner.context.metadata)

        def first_output() -> None:
            owner.decode_first_output()
            owner.context.link_child(decode_context)  # C4

        gate = Gatekeeper(
            owner.prefill_task,
            owner.context,
            idle_timeout=self.deadlines.decode_idle,
            terminal_hold_timeout=self.deadlines.terminal_hold,
            # A leg that is part of the KV transfer hears of the client's stop or kill
            # only once it fetched its KV (its first output): never abort a transfer (G9).
            on_first_output=first_output if owner.holds_transfer else None,
        )
        if not owner.holds_transfer:
            owner.context.link_child(decode_context)  # C4
        handoff_deadline = trio.current_time() + self.deadlines.handoff
        with trio.move_on_at(handoff_deadline) as handoff_scope:
            decode_receive = await self._accepted_decode(
                nursery, owner, gate, decode_request, decode_context, handoff_deadline)
        if handoff_scope.cancelled_caught:
            raise DeadlineExceeded("handoff", self.deadlines.handoff)
        try:
            await owner.tracker.enter_decode()  # S11: waits for the drain to have started
        except BaseException:
            decode_receive.close()
            raise
        out_send, out_receive = trio.open_memory_channel[Item](self.channel_buffer)
        forward: trio.CancelScope | None = None  # only a kept leg needs one (P3: memory)
        if owner.holds_transfer:
            # The client's stop or kill ends its stream at once; the kept leg goes on to
            # fetch its KV (G9). (Not when the gatekeeper itself stopped the client.)
            scope = forward = trio.CancelScope()
            owner.context.on_stop(lambda killed: None if owner.first_output_seen
                                  or gate.failure is not None else scope.cancel())
        nursery.start_soon(self._forward, owner, gate, decode_receive, out_send,
                           decode_context, forward)
        return self._request_stream(owner, out_receive, gate)

    async def _accepted_decode(
        self,
        nursery: trio.Nursery,
        owner: HandoffOwner,
        gate: Gatekeeper,
        decode_request: PreprocessedRequest,
        decode_context: RequestContext,
        deadline: float,
    ) -> trio.MemoryReceiveChannel[Item]:
        """Dispatch the decode leg until a decode worker accepted it, and return its
        stream. A worker that refused (a 5xx) or could not be reached is replaced by
        another with the same handoff, the KV still staged (B9), up to the retry policy's
        attempts; the backoff ends before ``deadline`` (the handoff deadline's end)."""
        start = self._kept_decode_leg if owner.holds_transfer else self._decode_leg
        tried: list[Worker[DecodeEngine]] = []
        while True:
            tried.append(owner.decode_worker)
            decode_send, decode_receive = trio.open_memory_channel[Item](self.channel_buffer)
            try:
                await gate.dispatch(nursery, start, owner, decode_request, decode_context,
                                    decode_send)
                return decode_receive
            except WorkerError as exc:
                decode_receive.close()
                error, reason = exc, retry_reason(exc)
                delay = self.retry.delay(len(tried) + 1)
                if (reason is None or len(tried) >= self.retry.max_attempts
                        or trio.current_time() + delay >= deadline
                        or self._decode_replacement(owner, tried) is None):
                    raise
            except BaseException:
                # Nobody will read the decode stream: a decode leg that did start gets
                # BrokenResourceError on its next send instead of blocking on a full channel.
                decode_receive.close()
                raise
            await trio.sleep(delay)  # backoff with jitter (B9)
            worker = self._decode_replacement(owner, tried)  # the pool may have changed
            if worker is None:
                raise error
            self.counters.count_retry("decode", reason)
            logger.info("decode of %s: %s on %s, trying %s (B9)", owner.request.request_id,
                        reason, owner.decode_worker.name, worker.name)
            owner.switch_decode_worker(worker)
            decode_request = attrs.evolve(decode_request, routing=owner.request.routing)

    def _decode_replacement(self, owner: HandoffOwner, tried: list[Worker[DecodeEngine]]
                            ) -> Worker[DecodeEngine] | None:
        """The worker a refused decode is tried again on with the same handoff (B9), or
        None: the KV is not staged any more (a decode took it, or its worker reported it
        lost), the decode leg is part of the KV transfer (TensorRT-LLM, SGLang), the
        request ended, or no healthy decode worker is left. (A decode-only request has no
        KV: it may always be tried on another worker before one accepted it.)"""
        if (owner.holds_transfer or not owner.request_open or owner.context.is_stopped
                or (owner.disaggregated and owner.state is not HandoffState.STAGED)):
            return None
        return self.decode.alternative(owner.request, tried)

    def _request_stream(
        self,
        owner: HandoffOwner,
        outputs: trio.MemoryReceiveChannel[Item],
        gate: Gatekeeper | None,
        style: str | None = None,
    ) -> RequestStream:
        request = owner.request
        return RequestStream(
            outputs=outputs,
            tracker=owner.tracker,
            style=style or owner.style,
            prefill=owner.prefill_task,
            gate=gate,
            prefill_worker=None if owner.prefill_worker is None else owner.prefill_worker.name,
            decode_worker=None if gate is None else owner.decode_worker.name,
            bootstrap_info=request.bootstrap_info,
            handoff=owner,
        )

    def _stopped(self, owner: HandoffOwner) -> RequestStream:
        """The stream of a request whose client stopped (one ``cancelled`` finish, C3) or
        killed (nothing) its context before a decode was handed the request."""
        send, receive = trio.open_memory_channel[Item](1)
        with send:
            if not owner.context.is_killed:
                send.send_nowait(Annotated(data=LLMEngineOutput(
                    finish_reason=FinishReason.CANCELLED)))
        owner.tracker.finish()
        return self._request_stream(owner, receive, None, "stopped")

    def _terminal(self, owner: HandoffOwner, completion: Terminal) -> RequestStream:
        send, receive = trio.open_memory_channel[Item](1)
        with send:
            send.send_nowait(completion.output)
        owner.tracker.finish()
        return self._request_stream(owner, receive, None, "terminal")

    async def _forward(
        self,
        owner: HandoffOwner,
        gate: Gatekeeper,
        decode_receive: trio.MemoryReceiveChannel[Item],
        out_send: trio.MemorySendChannel[Item],
        decode_context: RequestContext,
        scope: trio.CancelScope | None,
    ) -> None:
        # A kept leg is ended by its owner, never by a stop it would obey before it fetched
        # its KV (that would leave the KV to a worker timeout): see forward_ended().
        leg_context = None if owner.holds_transfer else decode_context
        try:
            if scope is None:
                await gate.forward(decode_receive, out_send, leg_context)
            else:
                with scope:
                    await gate.forward(decode_receive, out_send, leg_context)
        finally:
            owner.tracker.finish()
            self._release()
            owner.forward_ended(self.deadlines.decode_idle, failed=gate.failure is not None)

    async def _kept_decode_leg(  # noqa: ASYNC128 (reports started() itself)
        self,
        owner: HandoffOwner,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Dispatch a decode leg that is part of the KV transfer in the keeper, and wait
        for its worker to accept.

        Cancelling the wait (the client left, or G1) does not cancel the dispatch: a
        decode half-dispatched might or might not have joined the room or queued for the
        KV, and then nobody could say whether the KV still needs consuming (B1, B6). The
        owner hears the leg's outcome from the leg itself.
        """
        leg = self.keeper.spawn_leg(
            self._decode_leg, owner, request, context, send_channel,
            name=request.request_id,
        )
        leg.bound(self.deadlines.handoff)  # accepted within the handoff deadline, waited or not
        owner.attach_leg(leg)
        await leg.wait_started()
        task_status.started()

    async def _decode_leg(  # noqa: ASYNC128 (the engine calls task_status.started())
        self,
        owner: HandoffOwner,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """One decode leg with the handoff; tells ``owner`` whether its worker accepted."""
        worker = owner.decode_worker
        status = _Accepted(owner, task_status)
        with self.decode.lease(worker):
            try:
                await worker.engine.generate(request, context, send_channel, task_status=status)
            except BaseException as exc:
                if not status.accepted:
                    owner.decode_not_accepted(exc)
                if isinstance(exc, WorkerError):
                    self.decode.record_failure(worker, exc)
                raise
            else:
                self.decode.record_success(worker)
            finally:
                if status.accepted and owner.leg is not None and owner.leg.scope.cancel_called:
                    owner.decode_cancelled()

    async def _prefill_leg(self, owner: HandoffOwner, context: RequestContext) -> PrefillCompletion:
        """The whole prefill leg, run by the keeper: dispatch, classify, drain; the owner
        hears how it ended."""
        try:
            with trio.move_on_after(self.deadlines.transfer) as transfer_scope:
                with owner.prefill_scope:
                    completion = await self._run_prefill(owner, context)
        except PrefillError as error:
            owner.prefill_failed()
            if owner.state is HandoffState.RELEASED:  # the router stopped it (B6, B10)
                raise _cancelled(owner) from error
            raise
        except BaseException:
            owner.prefill_failed()
            raise
        finally:
            if owner.request.bootstrap_info is not None:
                self._rooms.discard(owner.request.bootstrap_info.room)
        if owner.prefill_scope.cancelled_caught:
            owner.prefill_failed()
            raise _cancelled(owner)
        if transfer_scope.cancelled_caught:
            context.kill()
            owner.prefill_failed()
            raise PrefillDeadlineExceeded("transfer", self.deadlines.transfer)
        owner.prefill_done(completion)
        if owner.state is HandoffState.RELEASED:  # stopped, and it answered "cancelled"
            raise _cancelled(owner)
        return completion

    async def _run_prefill(
        self, owner: HandoffOwner, context: RequestContext
    ) -> PrefillCompletion:
        """Dispatch the prefill and classify its stream (S1-S10, T4); a prefill worker that
        refused before it answered anything (a transport failure, a 5xx) is replaced by
        another, up to the retry policy's attempts, all within the prefill deadline (B9).
        """
        deadline = trio.current_time() + self.deadlines.prefill
        tried: list[Worker[DecodeEngine]] = []
        while True:
            tried.append(owner.prefill_leg_worker)
            try:
                return await self._prefill_attempt(owner, context, deadline)
            except _Retryable as retryable:
                error, reason = retryable.error, retryable.reason
            delay = self.retry.delay(len(tried) + 1)
            if (len(tried) >= self.retry.max_attempts or trio.current_time() + delay >= deadline
                    or self._prefill_replacement(owner, tried) is None):
                raise error from error.__cause__
            await trio.sleep(delay)  # backoff with jitter (B9)
            worker = self._prefill_replacement(owner, tried)  # the pool may have changed
            if worker is None:
                raise error from error.__cause__
            self.counters.count_retry("prefill", reason)
            logger.info("prefill of %s: %s on %s, trying %s (B9)", owner.request.request_id,
                        reason, owner.prefill_leg_worker.name, worker.name)
            owner.switch_prefill_worker(worker)

    def _prefill_replacement(self, owner: HandoffOwner, tried: list[Worker[DecodeEngine]]
                             ) -> Worker[PrefillEngine] | None:
        """The worker a refused prefill is tried again on (B9), or None: no healthy worker
        of the same handoff style left, or the request ended, or the router stopped the
        prefill (B6, B10), or the prefill pairs with a decode in a bootstrap room."""
        if (not owner.request_open or owner.state is not HandoffState.PENDING
                or owner.prefill_scope.cancel_called or owner.context.is_stopped
                or owner.request.bootstrap_info is not None):
            return None
        style = owner.prefill_leg_worker.engine.handoff_style
        other_styles = [worker for worker in self.prefill.workers
                        if worker.engine.handoff_style is not style]
        return self.prefill.alternative(owner.request, [*tried, *other_styles])

    async def _prefill_attempt(
        self, owner: HandoffOwner, context: RequestContext, deadline: float
    ) -> PrefillCompletion:
        """One prefill attempt on ``owner.prefill_worker``.

        ``deadline`` bounds the wait for the first output (the handoff), and for a
        bootstrap prefill also its answer (which comes after the KV transfer). The engine
        runs outside it, so an answer already on its way when the deadline expires can
        still be read, and its staged KV consumed (B1).

        Raises:
            _Retryable: the worker refused before it answered anything (B9).
        """
        worker = owner.prefill_leg_worker
        with self.prefill.lease(worker):
            send, receive = trio.open_memory_channel[Item](self.channel_buffer)
            refusal: list[WorkerError] = []
            first: Item | None = None
            completion: PrefillCompletion | None = None
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_run_engine, worker.engine, owner.request, context,
                                       send, refusal)
                    first = await self._first_prefill_output(owner, receive, refusal, deadline)
                    # A bootstrap prefill answers once its KV reached the decode, and an
                    # adapter may hand off the room before that: its deadline bounds the
                    # answer, so a stalled bootstrap prefill is a prefill deadline too.
                    bootstrap = first is not None and _is_bootstrap(first)
                    with trio.move_on_after(self.deadlines.prefill if bootstrap else math.inf):
                        if first is not None:
                            completion = await consume_prefill_stream(
                                receive, tracker=owner.tracker, first=first
                            )
                    if completion is None:
                        nursery.cancel_scope.cancel()
            except* PrefillError as group:
                leaf = _single(group)  # keep the cause: a worker's 4xx reaches the client
                self.prefill.record_failure(worker, leaf.__cause__ or leaf)
                reason = retry_reason(refusal[0]) if refusal and first is None else None
                if reason is not None:
                    raise _Retryable(leaf, reason) from None
                raise leaf from leaf.__cause__
            finally:
                if owner.prefill_scope.cancel_called:
                    self._stage_arrived(owner, first, receive)
            if completion is None:
                self.prefill.record_failure(worker)
                raise PrefillDeadlineExceeded("prefill", self.deadlines.prefill)
            self.prefill.record_success(worker)
            return completion

    async def _first_prefill_output(
        self,
        owner: HandoffOwner,
        receive: trio.MemoryReceiveChannel[Item],
        refusal: list[WorkerError],
        deadline: float,
    ) -> Item | None:
        """The prefill's first output, or None if the prefill deadline (``deadline``, on
        the trio clock) expired first.

        An answer already on its way when the deadline expires is read within a short
        grace; if it staged KV, the owner has it consumed (B1) instead of leaving it to
        the worker's lease.
        """
        worker = owner.prefill_leg_worker
        with trio.move_on_at(deadline):
            return await _receive_first(worker, receive, refusal)
        with trio.move_on_after(min(LATE_ANSWER_GRACE, 0.1 * self.deadlines.prefill)):
            with contextlib.suppress(PrefillError):
                late = await _receive_first(worker, receive, refusal)
                completion = await consume_prefill_stream(receive, first=late)
                if isinstance(completion, Handoff) and not completion.bootstrap:
                    owner.prefill_staged(completion.result)
        return None

    def _stage_arrived(
        self, owner: HandoffOwner, first: Item | None, receive: trio.MemoryReceiveChannel[Item]
    ) -> None:
        """The router ended the prefill (B6, B10): a handoff that had already arrived is
        still consumed (B1). Never raises (it runs in a ``finally``)."""
        if first is None:
            try:
                first = receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
        try:
            completion = classify_first_output(first)
        except PrefillError:
            return
        if isinstance(completion, Handoff) and not completion.bootstrap:
            owner.prefill_staged(completion.result)

    def _start_cleanup(self, request: PreprocessedRequest) -> None:
        """Start :meth:`_consume_staged_kv` in the keeper; never raises (the owner calls it
        from ``finally`` blocks)."""
        try:
            self.keeper.start(
                partial(self._consume_staged_kv, request),
                name=request.request_id, kind=CLEANUP,
            )
        except RuntimeError:  # the keeper is closing: the worker's lease reclaims the KV
            self.counters.staged_kv_cleanup_failures += 1
            logger.warning("B1 cleanup for %s not started: the keeper is closed",
                           request.request_id)

    async def _consume_staged_kv(self, request: PreprocessedRequest) -> None:
        """B1: a minimal decode (one token, not streamed) that consumes the staged KV."""
        self.counters.staged_kv_cleanups += 1
        minimal = attrs.evolve(request, body=_one_token_body(request.body), max_tokens=1,
                               stream=False)
        try:
            worker = self.decode.select(minimal)
            send, receive = trio.open_memory_channel[Item](1)
            with trio.fail_after(self.deadlines.handoff + self.deadlines.decode_idle), \
                    self.decode.lease(worker):
                async with trio.open_nursery() as nursery:
                    await nursery.start(worker.engine.generate, minimal,
                                        RequestContext(request.request_id), send)
                    with receive:
                        async for _ in receive:
                            pass
        except Exception as exc:  # logged, never raised into the keeper (T2)
            self.counters.staged_kv_cleanup_failures += 1
            logger.warning("B1 cleanup decode for %s failed: %r", request.request_id, exc)


def _select(
    pool: WorkerPool[E], role: str, request: PreprocessedRequest, pinned: str | None
) -> Worker[E]:
    """``pool.select()``, its :class:`NoWorkerAvailable` naming the pool's role."""
    try:
        return pool.select(request, pinned=pinned)
    except NoWorkerAvailable as exc:
        raise NoWorkerAvailable(f"no {role} worker available: {exc}") from None


class _Retryable(Exception):
    """A prefill attempt failed in a way B9 lets the router retry: ``error`` to raise if
    it does not, ``reason`` for the ``retries_total`` metric."""

    def __init__(self, error: PrefillError, reason: str) -> None:
        super().__init__(reason)
        self.error = error
        self.reason = reason


def _is_bootstrap(item: Item) -> bool:
    return item.data is not None and is_bootstrap_params(item.data.disaggregated_params)


def _cancelled(owner: HandoffOwner) -> PrefillCancelled:
    return PrefillCancelled(f"prefill of {owner.request.request_id} ended by the router: "
                            "no decode will take its KV")


async def _run_engine(
    engine: DecodeEngine,
    request: PreprocessedRequest,
    context: RequestContext,
    send: trio.MemorySendChannel[Item],
    refusal: list[WorkerError],
) -> None:
    """Run a prefill engine outside any deadline; a refusal (raised before it started) is
    kept for the reader, who sees the channel end."""
    try:
        with send:
            await engine.generate(request, context, send)
    except WorkerError as exc:
        refusal.append(exc)


async def _receive_first(
    worker: Worker[DecodeEngine],
    receive: trio.MemoryReceiveChannel[Item],
    refusal: list[WorkerError],
) -> Item:
    """The first output of a prefill stream.

    Raises:
        PrefillError: the stream ended with none: the worker refused the request, or
            returned nothing (S1).
    """
    try:
        return await receive.receive()
    except trio.EndOfChannel:
        if refusal:
            raise PrefillError(_naming(worker, refusal[0])) from refusal[0]
        raise PrefillError("Prefill returned no output (stream ended)") from None


def _one_token_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's body cut to one token, not streamed, for a B1 cleanup decode: what
    shapes the prompt stays (its KV must match), what shapes the answer goes."""
    minimal = {key: value for key, value in body.items() if key not in _ANSWER_FIELDS}
    minimal["max_tokens"] = 1
    if "max_completion_tokens" in body:
        minimal["max_completion_tokens"] = 1
    minimal["stream"] = False
    return minimal


#: Body fields that shape only the answer, dropped from a B1 cleanup decode.
_ANSWER_FIELDS = frozenset({"stream_options", "fault", "min_tokens", "n", "best_of",
                            "logprobs", "top_logprobs", "echo", "prompt_logprobs"})


def _naming(worker: Worker[DecodeEngine], exc: BaseException) -> str:
    """The error's message, naming the prefill worker once (adapters' messages often do)."""
    text = str(exc)
    return text if worker.name in text else f"prefill worker {worker.name} failed: {text}"


def _single(group: BaseExceptionGroup[Any]) -> Any:
    """The first leaf exception of a group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


