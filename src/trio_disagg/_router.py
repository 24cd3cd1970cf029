"""The disaggregated router: one nursery per request, one handoff owner per request, deadlines.

:class:`DisaggRouter` orchestrates a request: it routes it, starts its prefill leg in the
keeper (``_prefill_leg``), dispatches its decode leg (``_decode_leg``) and hands the
caller the decode's stream, read through the gatekeeper. Staged KV no decode took is consumed by
``_cleanup`` (B1); the data types it hands out are in ``_router_types``, and importable
from here too.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from functools import partial
from typing import Any

import trio
from trio_util import AsyncValue

from ._arguments import check_router_arguments, check_stream_arguments
from ._context import RequestContext
from ._copy import routed_copy
from ._decode_leg import StreamHooks, abandon_when_cancelled, accepted_decode
from ._engine import DecodeEngine, PrefillEngine
from ._errors import DeadlineExceeded, NoWorkerAvailable, RouterClosed, WorkerError
from ._estimate import estimate_prompt_tokens
from ._gate import GatedOutputs, Gatekeeper
from ._handoff import BootstrapOwner, DecodeOnlyOwner, HandoffOwner, owner_for
from ._health import RetryPolicy
from ._keeper import PrefillTask, TransferKeeper
from ._pool import E, Worker, WorkerPool
from ._prefill import PrefillCompletion, Terminal
from ._prefill_leg import LATE_ANSWER_GRACE as LATE_ANSWER_GRACE
from ._prefill_leg import prefill_leg
from ._protocols import (
    Annotated,
    BootstrapInfo,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
)
from ._pull import open_pull_slot, reader_may_pull
from ._router_types import DECODE_ONLY as DECODE_ONLY
from ._router_types import DISAGGREGATED as DISAGGREGATED
from ._router_types import Deadlines as Deadlines
from ._router_types import Item as Item
from ._router_types import RequestStream as RequestStream
from ._router_types import RouterCounters as RouterCounters

#: Items a decode leg may run ahead of its reader (one item per socket read of an HTTP
#: engine: a burst of tokens). Four reads ahead keep the client's writer busy (P4a and
#: P4b measured the same at 4 and 16) and hold 12 items fewer per slow reader (P3).
CHANNEL_BUFFER = 4


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
    estimated (an image) is disaggregated, and so is a stream that asks for vLLM's
    ``continuous_usage_stats`` (the prompt count in every chunk: only a prefill reports
    it before the first token). :attr:`RouterCounters.decisions` counts both.

    Args:
        prefill: the prefill workers.
        decode: the decode workers.
        keeper: an open :class:`TransferKeeper` that outlives every request.
        deadlines: the bounded waits (B2).
        retry: how a leg that failed before the first byte is tried again on another
            worker (B9); default :class:`RetryPolicy` (two attempts per leg).
        channel_buffer: how many items a decode leg may run ahead of its reader (who
            reads through the gatekeeper). Smaller costs less memory per slow reader
            (P3: about 0.3 KiB an item); larger lets a worker's burst reach the client in
            one write (P4).
        disagg_min_prompt_tokens: the estimated prompt length, in tokens, from which a
            request is disaggregated; shorter ones go to a decode worker alone. None (the
            default): every request is disaggregated.

    Attributes:
        prefill: the prefill pool; its ``workers`` carry each worker's load and health.
        decode: the decode pool.
        keeper: the keeper the prefill legs, kept decode legs and cleanups run in.
        deadlines: as given, or the defaults; read when a request uses them.
        retry: as given, or the default.
        counters: what became of the requests, their prefills and KV (B5, B9):
            :class:`RouterCounters`, for ``/metrics`` and tests.

    Raises:
        ValueError: a negative ``channel_buffer`` or ``disagg_min_prompt_tokens``.
        TypeError: an argument of another type than its own (a list of engines where a
            :class:`WorkerPool` goes, no keeper, a ``channel_buffer`` that is neither an
            int nor ``math.inf``, a prefill engine whose ``handoff_style`` is not a
            :class:`HandoffStyle`...): said when the router is made, not in a request.
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
        check_router_arguments(prefill, decode, keeper, deadlines, retry, channel_buffer,
                               disagg_min_prompt_tokens)
        self.disagg_min_prompt_tokens = disagg_min_prompt_tokens
        self.channel_buffer = channel_buffer
        self.prefill = prefill
        self.decode = decode
        self.keeper = keeper
        self.deadlines = deadlines if deadlines is not None else Deadlines()
        self.retry = retry if retry is not None else RetryPolicy()
        self.counters = RouterCounters()
        self._in_flight = 0
        # Set at 0, for the tasks in wait_idle; flipped only at 0, not on every request.
        self._idle = AsyncValue(True)
        self._closing = False
        self._rooms: set[int] = set()

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished (B5): counted from :meth:`stream`'s call
        until its stream ends: its last item read, its ``outputs`` closed, its prefill
        failed (G5, G6), or its nursery cancelled (at once for a request that failed
        before its decode accepted it, or that needs no decode leg). A prefill the keeper still
        drains after its request ended is the keeper's, not counted here."""
        return self._in_flight

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
        await self._idle.wait_value(True)

    def _admit(self) -> None:
        if self._closing:
            raise RouterClosed("the router is shutting down")
        self.counters.requests_total += 1
        self._in_flight += 1
        if self._in_flight == 1:
            self._idle.value = False

    def _release(self) -> None:
        self._in_flight -= 1
        if not self._in_flight:
            self._idle.value = True

    async def stream(
        self,
        nursery: trio.Nursery,
        request: PreprocessedRequest,
        context: RequestContext,
    ) -> RequestStream:
        """Start ``request`` and return its output stream.

        The decode leg runs in ``nursery`` (the request's: the caller cancels it when the
        client goes away); the gatekeeper, in the reader's task. Returns once the decode
        worker accepted (at once for a terminal prefill): errors before it are raised here.

        Args:
            nursery: the request's nursery; it must not outlive the keeper.
            request: the request; not modified (the stream says how it was routed).
            context: the client's context; stopping it stops the decode leg (C4), never
                the prefill (C5), and never a decode leg before it fetched its KV (G9).

        Returns:
            A :class:`RequestStream`: read its ``outputs`` to the end, or close them.

        Raises:
            RouterClosed: the router is shutting down (B3).
            NoWorkerAvailable: no healthy prefill or decode worker.
            PrefillError: the prefill failed (S1, S2, S8, S9, T3, T4, G1), with its
                worker's message; an :class:`InvalidPrefillHandoff` for a handoff that
                failed validation (B7); a :class:`PrefillDeadlineExceeded` if it ran out
                of time.
            DeadlineExceeded: the decode worker did not accept within ``handoff`` seconds.
            WorkerError: the decode worker refused, or (503) the prefill has no bootstrap port.
            TypeError: an argument of another type than its own, before any work.
            ValueError: ``request`` has a ``prefill_result`` or ``bootstrap_info`` (ours).
            RuntimeError: the keeper is not open (B3: close the router first); ``nursery``
                is closed, or the decode engine ended without ``started()`` (trio's).
            Exception: what a decode engine raised before ``started()`` that is no
                :class:`WorkerError` (a bug), as raised. (After either, staged KV is
                consumed as for a client that left, B1, B6.)

        Each is raised bare, never inside an exception group. On cancellation (the client
        went away) the prefill runs on in the keeper, or is cancelled inside its engine's
        cancel window (B10); staged KV no decode took is consumed there (B1, G9).
        """
        check_stream_arguments(nursery, request, context)
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
            A prompt that cannot be estimated (an image) is disaggregated (True), and so is
            a stream that asks for vLLM's ``continuous_usage_stats``: its every chunk
            carries the prompt count, which only a prefill reports before the first token.
        """
        if self.disagg_min_prompt_tokens is None or _running_usage(request.body):
            return True
        tokens = estimate_prompt_tokens(request.body)
        return tokens is None or tokens >= self.disagg_min_prompt_tokens

    def _route(self, request: PreprocessedRequest, context: RequestContext) -> HandoffOwner:
        """Choose the workers (S12) and make the request's handoff owner."""
        if not self.disaggregates(request):
            decode_worker = _select(self.decode, "decode", request,
                                    request.routing.decode_worker)
            self.counters.decisions[DECODE_ONLY] += 1
            routed = routed_copy(request, request.routing.prefill_worker, decode_worker.name,
                                 request.prefill_result, request.bootstrap_info)
            owner: HandoffOwner = DecodeOnlyOwner(self, routed, context, None, decode_worker)
            owner.reserve_decode()  # counted from its choice (S12), as below
            return owner
        prefill_worker = _select(self.prefill, "prefill", request,
                                 request.routing.prefill_worker)
        engine = prefill_worker.engine
        strategy = owner_for(engine.handoff_style)
        # S12: a sequential handoff reaches its decode worker only once the prefill staged
        # the KV, and is placed then (_place_decode), when the pool's load counts the
        # decodes placed before it: chosen now, a burst that arrives while the prefills
        # run would all see the same idle pool and land on one worker. Now the pool is
        # only checked, so that no KV is staged for a decode pool that has no worker.
        placed_now = strategy is BootstrapOwner or request.routing.decode_worker is not None
        decode_name = request.routing.decode_worker
        if placed_now:
            decode_worker = _select(self.decode, "decode", request, decode_name)
            decode_name = decode_worker.name
        else:
            # A stand-in until then, named nowhere: not to the prefill worker, nor to the
            # decode policy as if the request had asked for it.
            decode_worker = _available(self.decode, "decode")
        info = request.bootstrap_info
        if strategy is BootstrapOwner:
            if engine.bootstrap_host is None or engine.bootstrap_port is None:
                raise WorkerError(f"prefill worker {engine.name} has no bootstrap port", status=503)
            while (room := secrets.randbits(63)) in self._rooms:
                pass
            info = BootstrapInfo(host=engine.bootstrap_host, port=engine.bootstrap_port,
                                 room=room)
        # One copy with all the router adds, not one per addition (P4a).
        request = routed_copy(request, prefill_worker.name, decode_name,
                              request.prefill_result, info)
        self.counters.decisions[DISAGGREGATED] += 1
        owner = strategy(self, request, context, prefill_worker, decode_worker)
        owner.decode_placed = placed_now
        if placed_now:
            # Counted from its choice: a burst routed in one scheduler batch would
            # otherwise all choose before any decode leg leased its worker.
            owner.reserve_decode()
        return owner

    def _place_decode(self, owner: HandoffOwner) -> Worker[DecodeEngine]:
        """The decode worker of a sequential handoff, chosen now that its KV is staged
        (S12). The policy is given the request as it was routed on arrival: what differs
        from then is the pool's load.

        Raises:
            NoWorkerAvailable: every decode worker failed its health probe meanwhile
                (the staged KV is then consumed as for any decode that was not sent, B1).
        """
        return _select(self.decode, "decode", owner.request, None)

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
                partial(prefill_leg, self, owner, owner.prefill_context, self._rooms),
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
                owner.release_decode()  # no decode leg started, if none holds its lease
        owner.close_request(client_left=True)
        return self._stopped(owner)

    async def _dispatch(
        self, nursery: trio.Nursery, owner: HandoffOwner, decode_request: PreprocessedRequest
    ) -> RequestStream:
        decode_context = RequestContext(decode_request.request_id, owner.context.metadata)
        hooks = StreamHooks(self, owner, decode_context)
        gate = hooks.gate = Gatekeeper(
            owner.prefill_task,
            owner.context,
            idle_timeout=self.deadlines.decode_idle,
            terminal_hold_timeout=self.deadlines.terminal_hold,
            # A leg that is part of the KV transfer hears of the client's stop or kill
            # only once it fetched its KV (its first output): never abort a transfer (G9).
            on_first_output=hooks.first_output,
        )
        slot = None
        if not owner.holds_transfer:
            owner.context.link_child(decode_context)  # C4
            if reader_may_pull(owner.decode_worker.engine):
                # Its reader may read its worker in its own task (one task a token).
                slot = open_pull_slot(decode_context, self.deadlines.decode_idle)
        handoff_deadline = trio.current_time() + self.deadlines.handoff
        with trio.move_on_at(handoff_deadline) as handoff_scope:
            decode_receive = await accepted_decode(
                self, nursery, owner, gate, decode_request, decode_context, handoff_deadline)
        if handoff_scope.cancelled_caught:
            raise DeadlineExceeded("handoff", self.deadlines.handoff)
        try:
            await owner.tracker.enter_decode()  # S11: waits for the drain to have started
        except BaseException:
            decode_receive.close()
            if slot is not None:
                slot.release()
            raise
        # A kept leg is ended by its owner, never by a stop it would obey before it
        # fetched its KV (that would leave the KV to a worker timeout): see forward_ended().
        leg_context = None if owner.holds_transfer else decode_context
        outputs = owner.outputs = gate.outputs(decode_receive, leg_context, hooks.stream_ended)
        if owner.decode_crash is not None:  # (it crashed before its reader existed)
            outputs.decode_crashed(owner.decode_crash)
        elif not owner.decode_leg_exited:
            outputs.follow_leg()
        if owner.decode_leg_ended:  # a short stream, whole in the channel already
            outputs.decode_ended()
        if owner.holds_transfer:
            # The client's stop or kill ends its stream at once (a stop with a cancelled
            # finish, C3); the kept leg goes on to fetch its KV (G9). (Not when the
            # gatekeeper itself stopped the client.)
            def on_stop(killed: bool) -> None:
                if not (owner.first_output_seen or gate.failure is not None):
                    outputs.stop(killed)

            owner.context.on_stop(on_stop)
            # The leg lives in the keeper: this task is the request nursery's hand on it.
            # (A leg in the nursery abandons the stream itself when cancelled.)
            nursery.start_soon(abandon_when_cancelled, outputs, owner.context, on_stop)
        return self._request_stream(owner, outputs, gate)

    def _request_stream(
        self,
        owner: HandoffOwner,
        outputs: trio.MemoryReceiveChannel[Item] | GatedOutputs,
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


def _select(
    pool: WorkerPool[E], role: str, request: PreprocessedRequest, pinned: str | None
) -> Worker[E]:
    """``pool.select()``, its :class:`NoWorkerAvailable` naming the pool's role."""
    try:
        return pool.select(request, pinned=pinned)
    except NoWorkerAvailable as exc:
        raise NoWorkerAvailable(f"no {role} worker available: {exc}") from None


def _available(pool: WorkerPool[E], role: str) -> Worker[E]:
    """``pool.available()``, its :class:`NoWorkerAvailable` naming the pool's role."""
    try:
        return pool.available()
    except NoWorkerAvailable as exc:
        raise NoWorkerAvailable(f"no {role} worker available: {exc}") from None


def _running_usage(body: Mapping[str, Any]) -> bool:
    """Whether ``body`` asks for the usage so far in every chunk (vLLM's
    ``stream_options``: ``include_usage`` and ``continuous_usage_stats``)."""
    options = body.get("stream_options")
    return (isinstance(options, Mapping) and options.get("include_usage") is True
            and options.get("continuous_usage_stats") is True)
