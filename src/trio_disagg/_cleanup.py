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
from ._keeper import CLEANUP
from ._protocols import Annotated, LLMEngineOutput, PreprocessedRequest

if TYPE_CHECKING:
    from ._router import DisaggRouter

logger = logging.getLogger("trio_disagg.router")


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
    logged (T2)."""
    router.counters.staged_kv_cleanups += 1
    minimal = attrs.evolve(request, body=_one_token_body(request.body), max_tokens=1,
                           stream=False)
    try:
        worker = router.decode.select(minimal)
        send, receive = trio.open_memory_channel[Annotated[LLMEngineOutput]](1)
        with trio.fail_after(router.deadlines.handoff + router.deadlines.decode_idle), \
                router.decode.lease(worker):
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.engine.generate, minimal,
                                    RequestContext(request.request_id), send)
                with receive:
                    async for _ in receive:
                        pass
    except Exception as exc:  # logged, never raised into the keeper (T2)
        router.counters.staged_kv_cleanup_failures += 1
        logger.warning("B1 cleanup decode for %s failed: %r", request.request_id, exc)


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
