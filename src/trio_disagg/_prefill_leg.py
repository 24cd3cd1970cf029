"""The prefill leg the keeper runs: dispatch, the first output within the prefill deadline,
retries on another worker (B9), the drain, and what the handoff's owner hears of it
(S1-S10, T4, B1, B2, B6, B10)."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import trio

from ._context import RequestContext
from ._crash import worker_refusal
from ._engine import DecodeEngine, HandoffStyle, PrefillEngine
from ._errors import PrefillCancelled, PrefillDeadlineExceeded, PrefillError, WorkerError
from ._handoff import HandoffOwner, HandoffState
from ._health import retry_reason
from ._pool import Worker
from ._prefill import (
    Handoff,
    PrefillCompletion,
    classify_first_output,
    consume_prefill_stream,
    is_bootstrap_params,
)
from ._protocols import LLMEngineOutput, PreprocessedRequest
from ._router_types import Item

if TYPE_CHECKING:
    from ._router import DisaggRouter

logger = logging.getLogger("trio_disagg.router")

#: Outputs a sequential prefill's stream may hold: it answers with one, or a few (its
#: handoff, a usage); an engine that sends more is cut at the prefill deadline.
SEQUENTIAL_PREFILL_OUTPUTS = 64

#: Seconds (at most; 10% of the prefill deadline if less) to read a prefill answer that
#: was already on its way when the prefill deadline expired, so its KV is consumed (B1).
LATE_ANSWER_GRACE = 1.0


async def prefill_leg(
    router: DisaggRouter, owner: HandoffOwner, context: RequestContext, rooms: set[int]
) -> PrefillCompletion:
    """The whole prefill leg, run by the keeper on its own ``context`` (C5): dispatch,
    classify, drain; ``owner`` hears how it ended, and the bootstrap room, if any, leaves
    ``rooms`` (the router's rooms in use) however it ends.

    Raises:
        PrefillError: the prefill failed; a :class:`PrefillCancelled` when the router ended
            it (B6, B10), a :class:`PrefillDeadlineExceeded` when it ran out of time (B2).
    """
    # One scope for the transfer deadline (B2) and the router's stop (B6, B10), told
    # apart by the owner's flag (P3: a scope less per request).
    scope = owner.prefill_scope
    scope.deadline = min(scope.deadline, trio.current_time() + router.deadlines.transfer)
    try:
        with scope:
            completion = await _run_prefill(router, owner, context)
    except PrefillError as error:
        owner.prefill_failed()
        if owner.prefill_stopped:  # the router stopped it (B6, B10)
            raise _cancelled(owner) from error
        raise
    except BaseException:
        owner.prefill_failed()
        raise
    finally:
        if owner.request.bootstrap_info is not None:
            rooms.discard(owner.request.bootstrap_info.room)
        # Nothing stops an ended prefill: let go of its context (and the engine's stop
        # callbacks on it) for the rest of the stream (P3).
        owner.prefill_context = None
    if scope.cancelled_caught and owner.prefill_stopped:
        owner.prefill_failed()
        raise _cancelled(owner)
    if scope.cancelled_caught:
        context.kill()
        owner.prefill_failed()
        raise PrefillDeadlineExceeded("transfer", router.deadlines.transfer)
    owner.prefill_done(completion)
    if owner.state is HandoffState.RELEASED:  # stopped, and it answered "cancelled"
        raise _cancelled(owner)
    return completion


async def _run_prefill(
    router: DisaggRouter, owner: HandoffOwner, context: RequestContext
) -> PrefillCompletion:
    """Dispatch the prefill and classify its stream (S1-S10, T4); a prefill worker that
    refused before it answered anything (a transport failure, a 5xx) is replaced by
    another, up to the retry policy's attempts, all within the prefill deadline (B9).
    """
    deadline = trio.current_time() + router.deadlines.prefill
    tried: list[Worker[DecodeEngine]] = []
    while True:
        tried.append(owner.prefill_leg_worker)
        try:
            return await _prefill_attempt(router, owner, context, deadline)
        except _Retryable as retryable:
            error, reason = retryable.error, retryable.reason
        delay = router.retry.delay(len(tried) + 1)
        if (len(tried) >= router.retry.max_attempts or trio.current_time() + delay >= deadline
                or not _may_replace_prefill(router, owner, tried)):
            raise error from error.__cause__
        await trio.sleep(delay)  # backoff with jitter (B9)
        worker = _prefill_replacement(router, owner, tried)  # the pool may have changed
        if worker is None:
            raise error from error.__cause__
        router.counters.count_retry("prefill", reason)
        logger.info("prefill of %s: %s on %s, trying %s (B9)", owner.request.request_id,
                    reason, owner.prefill_leg_worker.name, worker.name)
        owner.switch_prefill_worker(worker)


def _prefill_replacement(
    router: DisaggRouter, owner: HandoffOwner, tried: list[Worker[DecodeEngine]]
) -> Worker[PrefillEngine] | None:
    """The worker a refused prefill is tried again on (B9), or None: no healthy worker
    of the same handoff style left, or the request ended, or the router stopped the
    prefill (B6, B10), or the prefill pairs with a decode in a bootstrap room."""
    if not _prefill_retry_allowed(owner):
        return None
    return router.prefill.alternative(owner.request, _excluded(router, owner, tried))


def _may_replace_prefill(
    router: DisaggRouter, owner: HandoffOwner, tried: list[Worker[DecodeEngine]]
) -> bool:
    """Whether :func:`_prefill_replacement` would find a worker now, choosing none."""
    return (_prefill_retry_allowed(owner)
            and router.prefill.has_alternative(_excluded(router, owner, tried)))


def _prefill_retry_allowed(owner: HandoffOwner) -> bool:
    return not (not owner.request_open or owner.state is not HandoffState.PENDING
                or owner.prefill_scope.cancel_called or owner.context.is_stopped
                or owner.request.bootstrap_info is not None)


def _excluded(router: DisaggRouter, owner: HandoffOwner,
              tried: list[Worker[DecodeEngine]]) -> list[Worker[DecodeEngine]]:
    """The workers a retry may not go to: those tried, and those of another handoff
    style (the request was prepared for this one)."""
    style = owner.prefill_leg_worker.engine.handoff_style
    return [*tried, *(worker for worker in router.prefill.workers
                      if worker.engine.handoff_style is not style)]


async def _prefill_attempt(
    router: DisaggRouter, owner: HandoffOwner, context: RequestContext, deadline: float
) -> PrefillCompletion:
    """One prefill attempt on ``owner.prefill_worker``, within ``deadline`` (on the trio
    clock): a bootstrap prefill (:func:`_read_while_running`) or a sequential one
    (:func:`_read_answer`).

    Raises:
        _Retryable: the worker refused before it answered anything (B9).
        PrefillError: the prefill failed, or missed its deadline.
    """
    worker = owner.prefill_leg_worker
    attempt = (_read_while_running if worker.engine.handoff_style is HandoffStyle.BOOTSTRAP
               else _read_answer)
    with router.prefill.lease(worker):
        refusal: list[WorkerError] = []
        try:
            completion = await attempt(router, owner, context, deadline, refusal)
        except PrefillError as error:
            router.prefill.record_failure(worker, error.__cause__ or error)
            reason = retry_reason(refusal[0]) if refusal else None
            if reason is not None:
                raise _Retryable(error, reason) from None
            raise
        if completion is None:
            router.prefill.record_failure(worker)
            raise PrefillDeadlineExceeded("prefill", router.deadlines.prefill)
        router.prefill.record_success(worker)
        return completion


async def _read_answer(
    router: DisaggRouter,
    owner: HandoffOwner,
    context: RequestContext,
    deadline: float,
    refusal: list[WorkerError],
) -> PrefillCompletion | None:
    """A sequential prefill: run the engine in this task to its answer, then classify
    it (S1-S10); None if the answer missed ``deadline``.

    A sequential prefill's stream is its answer (one output, or a few), and the decode
    is dispatched only once all of it is read (S6), so ``deadline`` bounds the whole
    stream, and the channel buffers it (up to :data:`SEQUENTIAL_PREFILL_OUTPUTS`): no
    second task reads it meanwhile (docs/performance.md, P3). An answer that ends within
    a short grace after the deadline is still read; then the engine is cancelled.
    However the prefill fails, a handoff that had arrived is consumed (B1).

    Raises:
        PrefillError: the worker refused (``refusal`` holds its
            :class:`~trio_disagg.WorkerError`), the stream failed (S1, S2, S8, S9, T4),
            or it sent more outputs than a prefill answers with.
    """
    worker = owner.prefill_leg_worker
    # Annotated, not subscripted: the subscript is a lookup on every request (P4a).
    send: trio.MemorySendChannel[Item]
    receive: trio.MemoryReceiveChannel[Item]
    send, receive = trio.open_memory_channel(SEQUENTIAL_PREFILL_OUTPUTS)
    first: Item | None = None
    refused: WorkerError | None = None
    with receive:
        try:
            try:
                with trio.move_on_at(deadline + _late_grace(router)) as bound, send:
                    await worker.engine.generate(owner.request, context, send)
            except Exception as exc:
                refused = worker_refusal(exc)  # also from inside the engine's own nursery
                if refused is None:
                    raise
            finally:
                # (blocked sending one more, if the grace's end cut it)
                flooded = receive.statistics().current_buffer_used >= SEQUENTIAL_PREFILL_OUTPUTS
                first = _first_arrived(receive)
            if bound.cancelled_caught and flooded:
                raise PrefillError(_naming(worker, RuntimeError(
                    f"sent more than {SEQUENTIAL_PREFILL_OUTPUTS} outputs for one prefill")))
            if trio.current_time() >= deadline:  # late (a refusal too), or cut at the grace
                _stage_arrived(owner, first)
                return None
            if refused is not None:
                if first is None:  # refused, answering nothing (B9)
                    refusal.append(refused)
                raise PrefillError(_naming(worker, refused)) from refused
            return await consume_prefill_stream(receive, tracker=owner.tracker, first=first)
        except BaseException:
            # Stopped (B6, B10), out of time (B2), refused or crashed after it answered, a
            # failed stream (T4): the handoff that arrived is consumed all the same.
            _stage_arrived(owner, first)
            raise


def _first_arrived(receive: trio.MemoryReceiveChannel[Item]) -> Item | None:
    """The first buffered output, if one arrived."""
    try:
        return receive.receive_nowait()
    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
        return None


async def _read_while_running(
    router: DisaggRouter,
    owner: HandoffOwner,
    context: RequestContext,
    deadline: float,
    refusal: list[WorkerError],
) -> PrefillCompletion | None:
    """A bootstrap prefill: its first output (the handoff) comes at once and its answer
    only once its KV reached the decode, so the engine runs in a task of its own while
    this one reads; None if the first output missed ``deadline``.

    ``deadline`` bounds the wait for the first output, and a second prefill deadline
    from then bounds the answer: a stalled bootstrap prefill is a prefill deadline too.
    The engine runs outside both, so an answer already on its way when the first
    expires can still be read, and its staged KV consumed (B1).

    Raises:
        PrefillError: as :func:`_read_answer`.
    """
    worker = owner.prefill_leg_worker
    send, receive = trio.open_memory_channel[Item](router.channel_buffer)
    first: Item | None = None
    completion: PrefillCompletion | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_run_engine, worker.engine, owner.request, context,
                               send, refusal)
            first = await _first_prefill_output(router, owner, receive, refusal, deadline)
            if first is not None and _is_bootstrap(first):
                with trio.move_on_after(router.deadlines.prefill):
                    completion = await consume_prefill_stream(
                        receive, tracker=owner.tracker, first=first)
            elif first is not None:  # the first output was the answer: nothing to bound
                completion = await consume_prefill_stream(
                    receive, tracker=owner.tracker, first=first)
            if completion is None:
                nursery.cancel_scope.cancel()
    except* PrefillError as group:
        leaf = _single(group)  # keep the cause: a worker's 4xx reaches the client
        raise leaf from leaf.__cause__
    finally:
        if owner.prefill_scope.cancel_called:
            _stage_arrived(owner, first if first is not None else _first_arrived(receive))
    return completion


async def _first_prefill_output(
    router: DisaggRouter,
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
    with trio.move_on_after(_late_grace(router)):
        with contextlib.suppress(PrefillError):
            late = await _receive_first(worker, receive, refusal)
            completion = await consume_prefill_stream(receive, first=late)
            if isinstance(completion, Handoff) and not completion.bootstrap:
                owner.prefill_staged(completion.result)
    return None


def _late_grace(router: DisaggRouter) -> float:
    """Seconds to read an answer already on its way when the prefill deadline expired."""
    return min(LATE_ANSWER_GRACE, 0.1 * router.deadlines.prefill)


def _stage_arrived(owner: HandoffOwner, first: Item | None) -> None:
    """A prefill that will not be handed to a decode (the router ended it, B6, B10; it
    failed or missed its deadline, B2, T4): a handoff that had arrived as its ``first``
    output is still consumed (B1). Never raises (it runs in ``finally`` blocks)."""
    if first is None:
        return
    try:
        completion = classify_first_output(first)
    except PrefillError:
        return
    if isinstance(completion, Handoff) and not completion.bootstrap:
        owner.prefill_staged(completion.result)


class _Retryable(Exception):
    """A prefill attempt failed in a way B9 lets the router retry: ``error`` to raise if
    it does not, ``reason`` for the ``retries_total`` metric."""

    def __init__(self, error: PrefillError, reason: str) -> None:
        super().__init__(reason)
        self.error = error
        self.reason = reason


def _is_bootstrap(item: Item) -> bool:
    data = getattr(item, "data", None)  # (not an engine output: classified as such)
    return (isinstance(data, LLMEngineOutput)
            and is_bootstrap_params(data.disaggregated_params))


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
    except Exception as exc:
        refused = worker_refusal(exc)  # also from inside the engine's own nursery
        if refused is None:
            raise
        refusal.append(refused)


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
