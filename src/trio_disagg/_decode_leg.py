"""The decode leg: its dispatch until a decode worker accepted the request, with retries on
another worker (B9), and the leg itself, in the request's nursery or, when it is part of
the KV transfer, in the keeper (G9)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import trio

from ._context import RequestContext
from ._crash import crash_message, leaves, worker_refusal
from ._engine import DecodeEngine
from ._errors import RouterClosed, WorkerError
from ._gate import GatedOutputs, Gatekeeper
from ._handoff import HandoffOwner, HandoffState
from ._health import retry_reason
from ._pool import Worker
from ._protocols import PreprocessedRequest
from ._router_types import Item

if TYPE_CHECKING:
    from ._router import DisaggRouter

logger = logging.getLogger("trio_disagg.router")


async def accepted_decode(
    router: DisaggRouter,
    nursery: trio.Nursery,
    owner: HandoffOwner,
    gate: Gatekeeper,
    decode_request: PreprocessedRequest,
    decode_context: RequestContext,
    deadline: float,
) -> trio.MemoryReceiveChannel[Item]:
    """Dispatch the decode leg until a decode worker accepted it, and return its stream.

    A worker that refused (a 5xx) or could not be reached is replaced by another with the
    same handoff, the KV still staged (B9), up to ``router.retry``'s attempts; the backoff
    ends before ``deadline`` (the handoff deadline's end, on the trio clock). The leg runs
    in ``nursery`` (:func:`decode_leg`), or in the keeper when it is part of the KV
    transfer (:func:`kept_decode_leg`), ``gate`` racing it against the prefill (G1).

    Raises:
        WorkerError: the last decode worker refused, and no retry is allowed.
        PrefillError: the prefill failed first (G1).
    """
    start = kept_decode_leg if owner.holds_transfer else decode_leg
    tried: list[Worker[DecodeEngine]] = []
    try:
        while True:
            tried.append(owner.decode_worker)
            # Annotated, not subscripted: the subscript is a lookup per request (P4a).
            decode_send: trio.MemorySendChannel[Item]
            decode_receive: trio.MemoryReceiveChannel[Item]
            decode_send, decode_receive = trio.open_memory_channel(router.channel_buffer)
            try:
                await gate.dispatch(nursery, start, router, owner, decode_request,
                                    decode_context, decode_send)
                return decode_receive
            except WorkerError as exc:
                decode_receive.close()
                error, reason = exc, retry_reason(exc)
                delay = router.retry.delay(len(tried) + 1)
                if (reason is None or len(tried) >= router.retry.max_attempts
                        or trio.current_time() + delay >= deadline
                        or not _may_replace_decode(router, owner, tried)):
                    raise
            except BaseException:
                # Nobody will read the decode stream: a decode leg that did start gets
                # BrokenResourceError on its next send, not blocking on a full channel.
                decode_receive.close()
                raise
            await trio.sleep(delay)  # backoff with jitter (B9)
            worker = _decode_replacement(router, owner, tried)  # the pool may have changed
            if worker is None:
                raise error
            router.counters.count_retry("decode", reason)
            logger.info("decode of %s: %s on %s, trying %s (B9)", owner.request.request_id,
                        reason, owner.decode_worker.name, worker.name)
            owner.switch_decode_worker(worker)
            decode_request = attrs.evolve(decode_request, routing=owner.request.routing)
    except BaseException:
        gate._on_first_output = None  # no stream: its hook (which holds the gate) goes
        raise


def _decode_replacement(
    router: DisaggRouter, owner: HandoffOwner, tried: list[Worker[DecodeEngine]]
) -> Worker[DecodeEngine] | None:
    """The worker a refused decode is tried again on with the same handoff (B9), or
    None: the KV is not staged any more (a decode took it, or its worker reported it
    lost), the decode leg is part of the KV transfer (TensorRT-LLM, SGLang), the
    request ended, or no healthy decode worker is left. (A decode-only request has no
    KV: it may always be tried on another worker before one accepted it.)"""
    if not _decode_retry_allowed(owner):
        return None
    return router.decode.alternative(owner.request, tried)


def _may_replace_decode(
    router: DisaggRouter, owner: HandoffOwner, tried: list[Worker[DecodeEngine]]
) -> bool:
    """Whether :func:`_decode_replacement` would find a worker now, choosing none."""
    return _decode_retry_allowed(owner) and router.decode.has_alternative(tried)


def _decode_retry_allowed(owner: HandoffOwner) -> bool:
    return not (owner.holds_transfer or not owner.request_open or owner.context.is_stopped
                or (owner.disaggregated and owner.state is not HandoffState.STAGED))


async def kept_decode_leg(  # noqa: ASYNC128 (reports started() itself)
    router: DisaggRouter,
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
    leg = router.keeper.spawn_leg(
        decode_leg, router, owner, request, context, send_channel,
        name=request.request_id,
    )
    leg.bound(router.deadlines.handoff)  # accepted within the handoff deadline, waited or not
    owner.attach_leg(leg)
    await leg.wait_started()
    task_status.started()


async def decode_leg(  # noqa: ASYNC128 (the engine calls task_status.started())
    router: DisaggRouter,
    owner: HandoffOwner,
    request: PreprocessedRequest,
    context: RequestContext,
    send_channel: trio.MemorySendChannel[Item],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One decode leg with the handoff; tells ``owner`` whether its worker accepted.

    An engine that raises after its worker accepted breaks its contract (one error item,
    never an exception): its stream ends with one error item naming the crash, as a
    decode failure (G4), not with a silent end that reads as a success (B4), nor with
    an exception into the request's nursery. A ``trio.Cancelled`` that no cancellation
    of this leg asked for is such a crash too."""
    worker = owner.decode_worker
    status = _Accepted(owner, task_status)
    del task_status  # held by ``status`` until started() only (see _Accepted)
    owner.release_decode()  # the lease counts it from here (S12)
    with router.decode.lease(worker), send_channel:
        try:
            await worker.engine.generate(request, context, send_channel, task_status=status)
        except Exception as exc:
            if not status.accepted:
                refusal = worker_refusal(exc)  # also from inside the engine's own nursery
                if refusal is not None:
                    router.decode.record_failure(worker, refusal)
                owner.decode_not_accepted(refusal or exc)
                if refusal is not None and refusal is not exc:
                    raise refusal from refusal.__cause__  # bare (B9 and stream() need it)
                raise
            if not _reader_gone(exc):  # (else it meant to return quietly)
                router.decode.record_failure(worker, exc)
                _report_crash(worker, owner, request, exc)
        except BaseException as exc:
            if status.accepted and _stray_cancellation(exc):
                router.decode.record_failure(worker, exc)
                _report_crash(worker, owner, request, exc)  # G4, B4: not an end
                return  # noqa: ASYNC104 (not a cancellation of this task: a crash)
            if not status.accepted:
                owner.decode_not_accepted(exc)
            raise
        else:
            router.decode.record_success(worker)
        finally:
            _leg_exited(router, owner, worker, request, accepted=status.accepted)


def _leg_exited(router: DisaggRouter, owner: HandoffOwner, worker: Worker[DecodeEngine],
                request: PreprocessedRequest, *, accepted: bool) -> None:
    """What the end of a decode leg's task tells its owner and its stream's reader. A leg
    its worker refused fed no stream: the leg that replaces it (B9) owns the stream."""
    if not accepted:
        return
    if owner.leg is not None and owner.leg.scope.cancel_called:
        owner.decode_cancelled()
    if trio.current_effective_deadline() != -math.inf:  # ended on its own
        owner.decode_leg_ended = True
        if owner.outputs is not None:
            owner.outputs.decode_ended()
    elif owner.outputs is not None and not owner.holds_transfer:
        # The request's nursery was cancelled (the client went away): its stream
        # ends now, whether or not its reader closes it.
        owner.outputs.abandon()
    elif owner.outputs is not None:  # a kept leg cancelled with its reader there
        owner.outputs.decode_crashed(_cut_short(router, worker, request))
    owner.decode_leg_exited = True
    if owner.outputs is not None:
        owner.outputs.leg_exited()


def _stray_cancellation(exc: BaseException) -> bool:
    """``exc`` is a ``trio.Cancelled`` (bare, or with crashes in a group) that no
    cancellation of this task asked for: the engine raised one it kept from elsewhere.
    That is a crash, as any other exception would be; a real cancellation, or a
    ``KeyboardInterrupt`` or ``SystemExit``, goes on."""
    if trio.current_effective_deadline() == -math.inf:
        return False  # (this task is cancelled: the Cancelled may be ours)
    found = leaves(exc)
    return (any(isinstance(leaf, trio.Cancelled) for leaf in found)
            and all(isinstance(leaf, trio.Cancelled | Exception) for leaf in found))


def _reader_gone(exc: Exception) -> bool:
    """``exc`` says only that nobody reads the stream any more."""
    return all(isinstance(leaf, trio.BrokenResourceError) for leaf in leaves(exc))


def _cut_short(router: DisaggRouter, worker: Worker[DecodeEngine],
               request: PreprocessedRequest) -> Exception:
    """Why a decode leg kept in the keeper was cancelled before its stream ended, for a
    reader still there (B4: an error, not an end that reads as complete): the keeper's
    shutdown (B3), or another cut."""
    if router.keeper.closing:
        return RouterClosed(f"the transfer keeper shut down before the decode stream of "
                            f"{request.request_id} on {worker.name} ended (B3)")
    return WorkerError(f"the decode leg of {request.request_id} on {worker.name} was "
                       f"cancelled before its stream ended", worker=worker.name)


def _report_crash(
    worker: Worker[DecodeEngine], owner: HandoffOwner, request: PreprocessedRequest,
    exc: BaseException,
) -> None:
    """End a crashed decode leg's stream with one error item of the gatekeeper's (G4),
    logged with its traceback. (Through the gate, not the leg's channel: the engine
    closed its end, and a second end held open for this would cost every stream its
    memory, P3.)"""
    logger.warning("decode leg %s on %s crashed after its worker accepted",
                   request.request_id, worker.name, exc_info=exc)
    error = WorkerError(f"decode worker {worker.name} crashed: {crash_message(exc)}",
                        worker=worker.name)
    error.__cause__ = exc
    if owner.outputs is not None:
        owner.outputs.decode_crashed(error)
    else:  # its reader is not made yet: the router hands it the crash (_dispatch)
        owner.decode_crash = error


class _Accepted:
    """A decode leg's ``task_status`` that tells the handoff's owner when the decode worker
    accepted the request.

    trio's task status keeps the nursery ``nursery.start()`` made for the dispatch (its
    cancel scope and sets, about 1.3 KiB) as long as it lives: it is let go once used,
    not kept for the whole stream (P3: memory per stream)."""

    __slots__ = ("accepted", "owner", "task_status")

    def __init__(self, owner: HandoffOwner, task_status: trio.TaskStatus[None]) -> None:
        self.owner = owner
        self.task_status: trio.TaskStatus[None] | None = task_status
        self.accepted = False

    def started(self, value: None = None) -> None:
        task_status, self.task_status = self.task_status, None
        if task_status is None:
            raise RuntimeError("called 'started' twice on the same task status")
        self.accepted = True
        self.owner.decode_accepted()
        task_status.started(value)


class StreamHooks:
    """What the gatekeeper calls back for one request's decode stream: its first output
    (the TTFT; for a leg kept for the transfer, the end of the transfer's protection, G9)
    and its end. One small object rather than two closures (P3: memory per stream)."""

    __slots__ = ("decode_context", "gate", "owner", "router")

    def __init__(self, router: DisaggRouter, owner: HandoffOwner,
                 decode_context: RequestContext) -> None:
        self.router = router
        self.owner = owner
        self.decode_context = decode_context
        self.gate: Gatekeeper | None = None  # set once made, with these hooks

    def first_output(self) -> None:
        owner = self.owner
        owner.tracker.record_decode_first_token()  # the TTFT, with or without a server
        if owner.holds_transfer:
            owner.decode_first_output()
            owner.context.link_child(self.decode_context)  # C4

    def stream_ended(self) -> None:
        owner, router, gate = self.owner, self.router, self.gate
        owner.tracker.finish()
        router._release()
        owner.forward_ended(router.deadlines.decode_idle,
                            failed=gate is not None and gate.failure is not None)


async def abandon_when_cancelled(outputs: GatedOutputs, context: RequestContext,
                                 on_stop: Callable[[bool], None]) -> None:
    """The request nursery's hand on a decode leg kept in the keeper (G9): wait for the
    stream's end; if the request's nursery is cancelled first (the client
    went away), end the stream even if its reader never closes it. Then the client's stop
    has no stream to end: ``on_stop`` goes (it holds the request: a reference cycle)."""
    try:
        await outputs.wait_ended()
    except BaseException:
        outputs.abandon()
        raise
    finally:
        context._forget_on_stop(on_stop)
