"""B1: a staged KV that no decode took is consumed by a minimal decode (one token, not
streamed) that the keeper runs."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ._context import RequestContext
from ._crash import crash_message, worker_refusal
from ._engine import DecodeEngine
from ._errors import NoWorkerAvailable, WorkerError
from ._health import retry_reason
from ._keeper import CLEANUP
from ._pool import Worker
from ._protocols import Annotated, LLMEngineOutput, PreprocessedRequest

if TYPE_CHECKING:
    from ._router import DisaggRouter

logger = logging.getLogger("trio_disagg.router")

#: What a B1 cleanup decode's request id adds to the request's (docs/protocols.md section 1).
CLEANUP_SUFFIX = "-cleanup"


def start_cleanup(router: DisaggRouter, request: PreprocessedRequest) -> None:
    """Start :func:`consume_staged_kv` for ``request`` (with its ``prefill_result``) in
    ``router``'s keeper; never raises (the handoff's owner calls it from ``finally``
    blocks). A keeper that is closing counts a cleanup failure: the worker's lease then
    reclaims the KV."""
    try:
        router.keeper.start(
            partial(consume_staged_kv, router, request),
            name=request.request_id, kind=CLEANUP,
        )
    except RuntimeError:  # the keeper is closing: the worker's lease reclaims the KV
        router.counters.staged_kv_cleanup_failures += 1
        logger.warning("B1 cleanup for %s not started: the keeper is closed",
                       request.request_id)


async def consume_staged_kv(router: DisaggRouter, request: PreprocessedRequest) -> None:
    """B1: a minimal decode (one token, not streamed) on one of ``router``'s decode
    workers that consumes the staged KV ``request`` hands off, within the handoff and
    decode-idle deadlines. Never raises but on cancellation: a failure is counted and
    logged (T2).

    A decode worker that refuses it before accepting (it could not be reached, or a 5xx:
    B9's kind) is replaced by another healthy one at once; with none left, the same
    workers are tried again after ``router.retry``'s backoff, until the deadline: a decode
    worker that comes back while the KV is staged still consumes it. A 4xx, a refusal that
    reports the KV lost, or a failure after the worker accepted ends the cleanup. (An
    engine that crashed before it accepted took no KV: it counts as a worker that could
    not be reached.) A worker that says the KV was not there to take (a
    :class:`~trio_disagg.WorkerError` with ``handoff_lost``: a decode aborted before its
    pull let go of it, or its lease ran out) ends it too, as done: logged at info, not
    counted as a failure.
    """
    router.counters.staged_kv_cleanups += 1
    # An id of its own: the aborted decode leg may still run the request's id at the
    # worker (its disconnect not yet seen), and vLLM refuses an id already running (400).
    minimal = attrs.evolve(request, request_id=f"{request.request_id}{CLEANUP_SUFFIX}",
                           body=_one_token_body(request.body), max_tokens=1, stream=False)
    tried: list[Worker[DecodeEngine]] = []
    deadline = router.deadlines.handoff + router.deadlines.decode_idle
    try:
        with trio.fail_after(deadline):
            while True:
                worker = router.decode.alternative(minimal, tried) or _any_worker(router,
                                                                                 minimal)
                refusal = None
                if worker is not None:
                    tried.append(worker)
                    refusal = await _cleanup_decode(router, worker, minimal)
                    if refusal is None:
                        return
                    reason = retry_reason(refusal)
                    if reason is None:
                        raise refusal
                    router.counters.count_retry("cleanup", reason)
                    logger.info("B1 cleanup decode for %s: %s on %s, trying again",
                                request.request_id, reason, worker.name)
                if not router.decode.has_alternative(tried):
                    await trio.sleep(router.retry.delay(len(tried) + 1))  # backoff (B9)
    except trio.TooSlowError:  # no worker answered, or none could be reached, in time
        router.counters.staged_kv_cleanup_failures += 1
        names = sorted({worker.name for worker in tried})
        logger.warning(
            "B1 cleanup decode for %s: no decode worker took the staged KV within %g s "
            "(the handoff and decode idle deadlines; tried: %s); the prefill worker's own "
            "lease frees it", request.request_id, deadline,
            ", ".join(names) or "none, every decode worker failed its health probe")
    except Exception as exc:  # logged, never raised into the keeper (T2)
        _ended_by(router, request, exc)


def _ended_by(router: DisaggRouter, request: PreprocessedRequest, exc: Exception) -> None:
    """Log (and count) what ended a cleanup decode that did not take the KV."""
    if isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]  # the leg's own failure, as the log should name it
    if isinstance(exc, WorkerError) and exc.handoff_lost:
        # The worker found no KV to take: it is gone already (a decode that was aborted
        # let go of it, its lease ran out), which is what the cleanup is for.
        logger.info("B1 cleanup decode for %s: the KV was gone already (%s)",
                    request.request_id, exc)
        return
    router.counters.staged_kv_cleanup_failures += 1
    logger.warning("B1 cleanup decode for %s failed: %r", request.request_id, exc)


def _any_worker(router: DisaggRouter, request: PreprocessedRequest
                ) -> Worker[DecodeEngine] | None:
    """A decode worker for another try, tried before or not; None if none may take a
    request now (every one failed its health probe)."""
    try:
        return router.decode.select(request)
    except NoWorkerAvailable:
        return None


async def _cleanup_decode(
    router: DisaggRouter, worker: Worker[DecodeEngine], minimal: PreprocessedRequest
) -> WorkerError | None:
    """One cleanup decode on ``worker``, read to its end; the worker's refusal before it
    accepted (returned, not raised: a retry may follow), else None.

    Raises:
        Exception: what the decode raised after it accepted (the KV may be gone: no retry;
            a crash before it accepted is returned as a refusal).
        WorkerError: the decode accepted, then ended its stream with an error (the worker
            says the KV was not taken: a failed cleanup, logged and counted as one).
    """
    refusal: WorkerError | None = None
    failed: str | None = None
    lost = False  # the worker said the KV was not there to take
    send, receive = trio.open_memory_channel[Annotated[LLMEngineOutput]](1)
    with router.decode.lease(worker):
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(worker.engine.generate, minimal,
                                    RequestContext(minimal.request_id), send)
            except Exception as exc:  # kept out of the nursery: a bare exception
                # A refusal (also from inside the engine's own nursery), or a crash before
                # it accepted, which took no KV either: another worker may take it (B9).
                refusal = worker_refusal(exc) or _crashed_before(worker, exc)
                receive.close()
            else:
                with receive:
                    async for item in receive:
                        failed = _failure_of(item) or failed
                        lost = lost or (isinstance(item.exception, WorkerError)
                                        and item.exception.handoff_lost)
    if refusal is not None:
        router.decode.record_failure(worker, refusal)
    if failed is not None:
        raise WorkerError(f"decode worker {worker.name} failed the cleanup decode: {failed}",
                          worker=worker.name, handoff_lost=lost)
    return refusal


def _crashed_before(worker: Worker[DecodeEngine], exc: Exception) -> WorkerError:
    """A decode engine's crash before it accepted, as the refusal of a worker that
    never answered (B9: tried again on another worker)."""
    error = WorkerError(f"decode worker {worker.name} crashed before it accepted the "
                        f"cleanup decode: {crash_message(exc)}", worker=worker.name)
    error.__cause__ = exc
    return error


def _failure_of(item: Annotated[LLMEngineOutput]) -> str | None:
    """What ``item`` says went wrong (an error, or a failed finish), if anything."""
    finish = item.data.finish_reason if item.data is not None else None
    if item.is_error:
        return item.error_message() or "an error item"
    return str(finish) if finish is not None and finish.is_failure else None


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
