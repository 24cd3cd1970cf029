"""One owner per request for its handoff: what becomes of the staged KV or the bootstrap room
however the request ends (rules B1, B6, B10 in docs/semantics.md).

A request's handoff is decided in one place, :class:`HandoffOwner`, by synchronous methods
that the request side and the prefill leg (in the keeper) call as facts arrive: the prefill
staged KV, answered by itself, failed; a decode worker accepted, refused, produced its first
output; the request side gave up. Each decision is made without awaiting, so the two sides
never race for it, and exactly one of them acts: a B1 cleanup is started once, a prefill is
cancelled once. What differs between the handoff styles is a strategy:

- :class:`SequentialOwner` (vLLM): the KV is staged when the prefill answers; a decode
  accepted with it takes it (and a decode aborted before its pull tells the prefill worker
  to free it); otherwise a one-token cleanup decode consumes it (B1).
- :class:`ContextFirstOwner` (TensorRT-LLM): the same, but a generation leg aborted before
  it fetched the context's KV leaves that KV to the worker's transfer timeout, so the leg
  is part of the transfer until its first output: it runs in the keeper and a client that
  leaves (or stops its context) lets it fetch the KV first.
- :class:`BootstrapOwner` (SGLang): prefill and decode meet in a bootstrap room; the decode
  leg is part of the transfer from its dispatch. A room no decode will ever join (the
  decode refused, the request ended before dispatching one) has its prefill ended at once,
  never left to the bootstrap timeout; a failed or terminal prefill ends the decode leg.
- :class:`DecodeOnlyOwner` (conditional disaggregation): a short prompt goes to one
  decode worker as an ordinary request, which computes its own prefill: no prefill leg,
  no KV to account for.
"""

from __future__ import annotations

import enum
import logging
import math
from typing import TYPE_CHECKING, ClassVar

import attrs
import trio

from ._cleanup import start_cleanup
from ._context import RequestContext
from ._copy import routed_copy
from ._engine import CancelWindow, DecodeEngine, HandoffStyle, PrefillEngine
from ._errors import WorkerError
from ._gated import GatedOutputs
from ._keeper import PrefillTask, TransferLeg
from ._pool import Worker
from ._prefill import PrefillCompletion, Terminal
from ._protocols import PrefillResult, PreprocessedRequest
from ._tracker import RequestTracker

if TYPE_CHECKING:
    from ._router import DisaggRouter

logger = logging.getLogger("trio_disagg.router")

#: Seconds a prefill the router stopped (B6, B10) gets to end before it is cancelled.
PREFILL_STOP_GRACE = 2.0


class HandoffState(enum.Enum):
    """Where a request's handoff stands (:attr:`HandoffOwner.state`): PENDING, then
    STAGED or DISPATCHED, and one of the settled states, CONSUMED, RELEASED, TERMINAL or
    FAILED (B1, B6, B10). Once settled, the KV is accounted for."""

    #: The prefill runs; no KV is staged that a decode could take.
    PENDING = "pending"
    #: KV is staged (sequential styles: the prefill answered), and no decode took it yet.
    STAGED = "staged"
    #: A decode worker accepted the request with the handoff: the KV is its to take.
    DISPATCHED = "dispatched"
    #: A decode took the KV: the request's own, or a one-token cleanup decode (B1); or the
    #: decode worker took the request and failed it (the KV is then its worker's).
    CONSUMED = "consumed"
    #: The prefill was ended before any decode took its KV (B6, B10): nothing staged.
    RELEASED = "released"
    #: The prefill answered the request by itself (S7): nothing staged.
    TERMINAL = "terminal"
    #: The prefill failed: nothing usable staged.
    FAILED = "failed"


_SETTLED = frozenset({HandoffState.CONSUMED, HandoffState.RELEASED, HandoffState.TERMINAL,
                      HandoffState.FAILED})


@attrs.define(eq=False)
class HandoffOwner:
    """Owns one request's handoff from dispatch to its end (a strategy per handoff style;
    rules B1, B6, B10 in docs/semantics.md).

    The router makes one per request (:attr:`RequestStream.handoff
    <trio_disagg.RequestStream.handoff>`) and drives it: its methods are facts the
    prefill leg and the request side report, each synchronous (nothing awaits between a
    fact and its decision) and none raising. Read it; do not call them yourself.

    Attributes:
        state: the :class:`HandoffState`.
        request: the routed request (with ``bootstrap_info`` in the bootstrap style; in
            the sequential styles with ``prefill_result`` once the KV is staged and a
            decode is sent it).
        window: the prefill engine's cancel window (B10).
        prefill_scope: the prefill leg's scope, its deadline the transfer deadline (B2);
            the owner cancels it to end the leg on purpose (B6, B10).
        leg: the decode leg kept in the keeper for the transfer, once spawned.
        task: the prefill leg's task in the keeper, once started.
    """

    #: The style's name, as :attr:`~trio_disagg.RequestStream.style` reports it.
    style: ClassVar[str]
    #: The decode leg is part of the KV transfer until its first output: it runs in the
    #: keeper, and the client's context reaches it only after that output (G9, B6).
    holds_transfer: ClassVar[bool] = False
    #: The request has a prefill leg (every style but :class:`DecodeOnlyOwner`).
    disaggregated: ClassVar[bool] = True

    router: DisaggRouter
    request: PreprocessedRequest
    context: RequestContext
    #: None for a request served by its decode worker alone (:class:`DecodeOnlyOwner`).
    prefill_worker: Worker[PrefillEngine] | None
    decode_worker: Worker[DecodeEngine]
    #: ``decode_worker`` is the pool's choice, not a stand-in until the router chooses
    #: it when the handoff is ready (S12: sequential styles, no worker pinned); until
    #: then ``request.routing.decode_worker`` is the client's (None).
    decode_placed: bool = True
    #: The decode worker counted as outstanding from its placement until the decode leg
    #: leases it (S12): placements made before any leg starts see each other.
    decode_reserved: Worker[DecodeEngine] | None = None
    tracker: RequestTracker = attrs.Factory(RequestTracker)
    state: HandoffState = HandoffState.PENDING
    window: CancelWindow = CancelWindow.NEVER
    prefill_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    #: The owner ended the prefill on purpose (B6, B10), whatever the state became after.
    prefill_stopped: bool = False
    #: Why (``"window"``, B10, or why no decode will come, B6), until the prefill leg's
    #: end is known and counted: a prefill whose answer was on its way ran to its end.
    stop_reason: str | None = None
    leg: TransferLeg | None = None
    task: PrefillTask[PrefillCompletion] | None = None
    #: The prefill leg's own context (C5), while the leg runs.
    prefill_context: RequestContext | None = None
    #: The request side may still dispatch a decode (it has not given up, nor succeeded).
    request_open: bool = True
    #: KV staged and not yet taken (sequential styles).
    staged: PrefillResult | None = None
    #: The handoff the decode leg was sent (sequential styles).
    handoff: PrefillResult | None = None
    #: The decode leg's first output reached the gatekeeper (its KV was fetched).
    first_output_seen: bool = False
    #: Why the decode leg ended before its worker accepted, if it did while the request
    #: was still open: decided on again when the request closes (the leg may end before
    #: or after that, whichever the scheduler runs first).
    refusal: BaseException | None = None
    #: The client's end of the decode stream, once a decode accepted the request.
    outputs: GatedOutputs | None = None
    #: The decode leg ended on its own (its whole stream is in its channel).
    decode_leg_ended: bool = False
    #: The decode leg's task is over, however it ended (its crash reported, if any).
    decode_leg_exited: bool = False
    #: What a decode engine raised after its worker accepted, until the stream's
    #: reader exists to end with it (G4; see ``decode_leg``).
    decode_crash: Exception | None = None

    def __attrs_post_init__(self) -> None:
        if self.prefill_worker is not None:
            self.window = self.prefill_worker.cancel_window

    @property
    def prefill_leg_worker(self) -> Worker[PrefillEngine]:
        """The prefill worker, for the prefill leg (which only a disaggregated request
        has)."""
        assert self.prefill_worker is not None, "a decode-only request has no prefill leg"
        return self.prefill_worker

    @property
    def prefill_task(self) -> PrefillTask[PrefillCompletion]:
        """The prefill leg's task (started right after the owner is made)."""
        assert self.task is not None
        return self.task

    async def decode_request(self) -> PreprocessedRequest | Terminal:
        """What to send the decode worker, once that can be known: the request with the
        prefill's handoff (from then on :attr:`request`), its decode worker chosen now if
        it was not on arrival (S12); or the prefill's own answer (S7), and then no decode.

        Raises:
            PrefillError: the prefill failed.
            NoWorkerAvailable: the decode worker was to be chosen now (S12), and every
                decode worker failed its health probe meanwhile.

        Cancelling the wait does not affect the prefill leg (T1).
        """
        completion = await self.prefill_task.result()
        if isinstance(completion, Terminal):
            return completion
        request, decode_name = self.request, self.request.routing.decode_worker
        if not self.decode_placed:  # S12: chosen now, with the pool's load of the moment
            self.decode_worker = self.router._place_decode(self)
            self.decode_placed = True
            # Counted until its decode leg leases it: requests whose prefills end in the
            # same scheduler batch are placed before any of their legs starts.
            self.reserve_decode()
            decode_name = self.decode_worker.name
        # The owner's request becomes the decode's (one copy, not two per request).
        self.request = routed_copy(request, request.routing.prefill_worker, decode_name,
                                   completion.result, request.bootstrap_info)
        return self.request

    def switch_prefill_worker(self, worker: Worker[PrefillEngine]) -> None:
        """The prefill is tried again on ``worker`` (B9): the first attempt was refused
        before it answered, so it staged nothing."""
        assert self.state is HandoffState.PENDING and self.request.bootstrap_info is None
        self.prefill_worker = worker
        self.window = worker.cancel_window
        self.request = attrs.evolve(self.request, routing=attrs.evolve(
            self.request.routing, prefill_worker=worker.name))

    def switch_decode_worker(self, worker: Worker[DecodeEngine]) -> None:
        """The decode is tried again on ``worker`` with the same handoff (B9): the first
        decode worker did not accept it, so the KV is still staged."""
        self.decode_worker = worker
        self.request = attrs.evolve(self.request, routing=attrs.evolve(
            self.request.routing, decode_worker=worker.name))
        self.reserve_decode()  # counted from its choice, as the first was (S12)

    def reserve_decode(self) -> None:
        """Count the placed decode worker as outstanding until a decode leg leases it, or
        the request ends without one (:meth:`release_decode`)."""
        self.release_decode()
        self.decode_reserved = self.decode_worker
        self.decode_worker.outstanding += 1

    def release_decode(self) -> None:
        """End :meth:`reserve_decode`'s count, if it has not ended yet."""
        if self.decode_reserved is not None:
            self.decode_reserved.outstanding -= 1
            self.decode_reserved = None

    # --- facts, reported by the prefill leg -------------------------------------------

    def prefill_done(self, completion: PrefillCompletion) -> None:
        """The prefill leg succeeded with ``completion``."""
        if isinstance(completion, Terminal):
            self.prefill_answered()
        else:
            self.prefill_staged(completion.result)

    def prefill_staged(self, result: PrefillResult) -> None:
        """The prefill staged KV for a decode (sequential styles), possibly after the
        request already ended (a late answer at the prefill deadline, a client gone), or
        just as the router ended the prefill (its answer was already on its way)."""
        if self.state not in (HandoffState.PENDING, HandoffState.RELEASED):
            return
        self._count_stopped_prefill(ran_to_end=True)  # its KV is consumed below (B1)
        self.state = HandoffState.STAGED
        self.staged = self.handoff = result
        if not self.request_open:
            self._consume()

    def prefill_answered(self) -> None:
        """The prefill answered the request by itself (S7): nothing to hand off."""
        if self.state is HandoffState.PENDING:
            self.state = HandoffState.TERMINAL
        self._count_stopped_prefill(ran_to_end=False)  # (a stopped one's answer)
        self._end_decode_leg()

    def prefill_failed(self) -> None:
        """The prefill failed, or was ended on purpose: a paired decode leg waits for KV
        that will never come, so it ends now (B6)."""
        if self.state in (HandoffState.PENDING, HandoffState.DISPATCHED):
            self.state = HandoffState.FAILED  # (STAGED stays: a late answer's KV, B1)
        self._count_stopped_prefill(ran_to_end=False)
        self._end_decode_leg()

    # --- facts, reported by the request side ------------------------------------------

    def decode_accepted(self) -> None:
        """A decode worker accepted the request with the handoff."""
        if self.state in (HandoffState.PENDING, HandoffState.STAGED):
            self.state = HandoffState.DISPATCHED  # bootstrap: the decode joined the room
            self.staged = None
        if self.leg is not None:
            # From here the gatekeeper bounds the leg's stream; with nobody left to read
            # it, the leg gets one idle period to pull its KV and reach its first send.
            self.leg.scope.deadline = math.inf
            if not self.request_open:
                self.leg.bound(self.router.deadlines.decode_idle)

    def decode_first_output(self) -> None:
        """The decode leg's first output arrived: it has fetched its KV."""
        self.first_output_seen = True

    def decode_cancelled(self) -> None:
        """The router cancelled a kept decode leg after its worker accepted (nobody read
        it, or it stalled past a deadline)."""

    def attach_leg(self, leg: TransferLeg) -> None:
        """The decode leg kept in the keeper for this handoff."""
        self.leg = leg
        if self.state in (HandoffState.FAILED, HandoffState.TERMINAL, HandoffState.RELEASED):
            leg.scope.cancel()  # the prefill already ended: no KV will come (B6)

    def decode_not_accepted(self, error: BaseException) -> None:
        """A decode leg with the handoff ended before its worker accepted the request: the
        worker refused it (a :class:`~trio_disagg.WorkerError`), or the dispatch was
        cancelled or crashed."""

    def close_request(self, *, client_left: bool) -> None:
        """The request side ended without a decode taking the handoff (``client_left``:
        its client went away; else a deadline, a refusal, a failed prefill): decide what
        becomes of the KV."""
        self.release_decode()  # no decode leg will lease the worker chosen for it
        if not self.request_open:
            return
        self.request_open = False
        refusal, self.refusal = self.refusal, None  # (its traceback holds this owner)
        if refusal is not None:
            self.decode_not_accepted(refusal)  # now with nobody left to decide
        if self.state not in _SETTLED and self.state is not HandoffState.DISPATCHED:
            self._abandon(client_left=client_left)

    # --- what a style decides -----------------------------------------------------------

    def _abandon(self, *, client_left: bool) -> None:
        raise NotImplementedError

    def _consume(self) -> None:
        """B1: a one-token cleanup decode consumes the staged KV."""
        result, self.staged = self.staged, None
        assert result is not None
        self.state = HandoffState.CONSUMED
        start_cleanup(self.router, attrs.evolve(self.request, prefill_result=result))

    def _cancel_prefill(self, *, why: str) -> None:
        """End the prefill leg (and a paired decode leg) now: its KV will never be taken,
        so nothing is stranded by ending it (B6, B10)."""
        self.state = HandoffState.RELEASED
        self.prefill_stopped = True
        self.stop_reason = why  # counted once the leg ends: its answer may be on its way
        logger.debug("prefill of %s ended: %s", self.request.request_id, why)
        # A stop, not a cancellation: an engine stops a prefill it may still abort, and
        # reads to its end an answer already on its way (whose KV is then consumed, B1).
        # The scope is the bound for an engine that ignores the stop.
        if self.prefill_context is not None:
            self.prefill_context.stop_generating()
        self.prefill_scope.deadline = min(self.prefill_scope.deadline,
                                          trio.current_time() + PREFILL_STOP_GRACE)
        self._end_decode_leg()

    def _count_stopped_prefill(self, *, ran_to_end: bool) -> None:
        """Count a prefill the owner ended, now that its leg ended: cancelled or released
        as the owner asked, or drained if it staged its KV all the same (``ran_to_end``:
        its answer was on its way; the KV is consumed, B1)."""
        why, self.stop_reason = self.stop_reason, None
        if why is None:
            return
        counters = self.router.counters
        if ran_to_end:
            counters.prefills_drained += 1
        elif why == "window":
            counters.prefills_cancelled += 1
        else:
            counters.prefills_released += 1

    def _end_decode_leg(self) -> None:
        if self.leg is not None:
            self.leg.scope.cancel()

    def forward_ended(self, grace: float, *, failed: bool) -> None:
        """The request's stream ended (its last item read, its reader gone, its prefill
        failed): nobody reads the decode leg any more. A kept leg
        past its first output is no longer part of the transfer, and one whose stream the
        gatekeeper failed (``failed``: a prefill failure, a deadline) is of no use: both
        end now. One that has not fetched its KV yet when its client left gets ``grace``
        seconds to reach its first send, then it is cancelled (G9). Either way the KV it
        leaves is the owner's to decide on (:meth:`decode_cancelled`)."""
        if self.leg is None:
            return
        if self.first_output_seen or failed:
            self.leg.scope.cancel()
        else:
            self.leg.bound(grace)


class SequentialOwner(HandoffOwner):
    """vLLM: prefill first; its answer's handoff goes into the decode request."""

    style = "sequential"

    def decode_not_accepted(self, error: BaseException) -> None:
        if self.state is not HandoffState.STAGED:
            return
        if isinstance(error, WorkerError) and error.handoff_lost:
            # The worker reported the KV unusable ("KV transfer failed"): the same handoff
            # sent again would fail the same way. Any other refusal left the KV staged.
            self.state = HandoffState.CONSUMED
            self.staged = None
        elif not self.request_open:
            self._consume()  # B1, for a leg the request had left to the keeper
        else:
            self.refusal = error  # the request decides when it closes

    def _abandon(self, *, client_left: bool) -> None:
        if self.state is HandoffState.STAGED:
            if self.leg is not None and not self.leg.settled.is_set():
                return  # a kept leg is still dispatching: its outcome decides
            self._consume()  # B1
        elif client_left and self.window is not CancelWindow.NEVER:
            self._cancel_prefill(why="window")  # B10
        else:
            # The keeper drains the prefill; prefill_staged() consumes its KV (B1).
            self.router.counters.prefills_drained += 1


class ContextFirstOwner(SequentialOwner):
    """TensorRT-LLM: sequential, with the generation leg kept for the transfer."""

    style = "context_first"
    holds_transfer = True

    def decode_cancelled(self) -> None:
        # A generation leg aborted before it fetched the context's KV leaves that KV to
        # the worker's transfer timeout: consume it (B1).
        if self.state is HandoffState.DISPATCHED and not self.first_output_seen:
            self.state = HandoffState.STAGED
            self.staged = self.handoff
            self._consume()


class BootstrapOwner(HandoffOwner):
    """SGLang: prefill and decode dispatched together into one bootstrap room."""

    style = "bootstrap"
    holds_transfer = True

    async def decode_request(self) -> PreprocessedRequest | Terminal:
        """The request with its room: the decode is dispatched with the prefill."""
        return self.request

    def prefill_done(self, completion: PrefillCompletion) -> None:
        if isinstance(completion, Terminal):
            self.prefill_answered()
        else:
            if self.state in (HandoffState.PENDING, HandoffState.DISPATCHED):
                # A bootstrap prefill answers once its KV reached the decode.
                self.state = HandoffState.CONSUMED
            self._count_stopped_prefill(ran_to_end=False)  # its leg reports it ended

    def decode_not_accepted(self, error: BaseException) -> None:
        # A decode that was not accepted never joined the room, and no other will: end the
        # prefill waiting in it at once instead of leaving it to the bootstrap timeout (B6).
        # While the request is open it sees the refusal first, then closes (G1).
        if self.request_open:
            self.refusal = error
        elif self.state is HandoffState.PENDING:
            self._cancel_prefill(why="no decode will join its room")

    def _abandon(self, *, client_left: bool) -> None:
        leg = self.leg
        if leg is None or (leg.settled.is_set() and not leg.started):
            self._cancel_prefill(why="no decode will join its room")  # B6
        elif not leg.settled.is_set() and not client_left:
            pass  # the dispatch, bounded by the handoff deadline, decides
        elif not leg.settled.is_set() and self.window is not CancelWindow.NEVER:
            # No decode joined yet: ending both legs strands nothing (B10, B6).
            self._cancel_prefill(why="window")
        else:
            self.router.counters.prefills_drained += 1  # the transfer completes (G9)

    def decode_cancelled(self) -> None:
        # The decode left the room before its KV arrived: no decode will take it (B6).
        if not self.first_output_seen and self.state is HandoffState.DISPATCHED:
            self._cancel_prefill(why="no decode will join its room")


class DecodeOnlyOwner(HandoffOwner):
    """Conditional disaggregation: a prompt shorter than the router's
    ``disagg_min_prompt_tokens`` is sent to one decode worker with no handoff, and that
    worker computes its prefill itself. Nothing is staged, so nothing is left to consume
    however the request ends, and a decode worker that refused it before accepting may be
    replaced by another as freely as a prefill is retried (B9)."""

    style = "decode_only"
    disaggregated = False

    async def decode_request(self) -> PreprocessedRequest | Terminal:
        """The request as the client sent it: no prefill, no handoff."""
        return self.request

    def _abandon(self, *, client_left: bool) -> None:
        pass  # no prefill leg, no KV: nothing to decide


def owner_for(style: HandoffStyle) -> type[HandoffOwner]:
    """The strategy for a prefill engine's handoff style."""
    if style is HandoffStyle.BOOTSTRAP:
        return BootstrapOwner
    if style is HandoffStyle.CONTEXT_FIRST:
        return ContextFirstOwner
    return SequentialOwner
