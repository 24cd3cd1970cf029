"""The in-process face's plumbing (docs/protocols.md section 5): how a mock engine meets
its request's context (stop, kill) and its output channel, its usage objects, and the
faults it refuses a request for before it starts."""

from __future__ import annotations

import trio

from .._context import RequestContext
from .._errors import WorkerError
from .._protocols import (
    Annotated,
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    PromptTokensDetails,
)
from ._faults import Fault, FaultKind, FaultPlan, fault_for


class Stopper:
    """Connects one request's context to its cancel scope (one object and one scope per
    request, nothing per token): a stop or a kill cancels :attr:`scope`; after a stop,
    :meth:`send_cancelled` sends the ``cancelled`` finish unless a kill comes first."""

    __slots__ = ("_kill_scope", "_killed", "scope")

    def __init__(self, context: RequestContext) -> None:
        self.scope = trio.CancelScope()
        self._kill_scope: trio.CancelScope | None = None
        # The context is not kept: it holds this object (its callback), and a cycle
        # between them would outlive the request until a full garbage collection.
        self._killed = False
        context.on_stop(self)

    def __call__(self, killed: bool) -> None:
        self._killed = self._killed or killed
        self.scope.cancel()
        if killed and self._kill_scope is not None:
            self._kill_scope.cancel()

    async def send_cancelled(self, send: SendChannel, item: Item) -> None:
        """Send the ``cancelled`` finish of a stopped request; a kill (before or during
        the send) drops it."""
        self._kill_scope = trio.CancelScope()
        if self._killed:
            self._kill_scope.cancel()
        with self._kill_scope:
            await send.send(item)


def check_seconds(name: str, value: float) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
    return value


#: One output of an engine's stream, and the channel an engine sends them on.
Item = Annotated[LLMEngineOutput]
SendChannel = trio.MemorySendChannel[Item]
#: The usage an output carries.
Usage = CompletionUsage
#: What ``nursery.start`` hands an engine's ``generate``.
TaskStatus = trio.TaskStatus[None]


def pick_fault(request: PreprocessedRequest, role: str, plan: FaultPlan | None,
                worker: str) -> Fault | None:
    try:
        fault = fault_for(request.body, role, request.request_id, plan)
    except ValueError as exc:
        raise WorkerError(f"{worker}: {exc}", status=400, worker=worker) from None
    if fault is not None and fault.kind in (FaultKind.PREFILL_REJECT, FaultKind.DECODE_REJECT):
        raise WorkerError(f"{worker} refused request {request.request_id!r} "
                          f"(injected fault {fault})", status=fault.status or 503,
                          worker=worker, retry_after=fault.retry_after)
    return fault


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None
           ) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=(None if cached_tokens is None
                               else PromptTokensDetails(cached_tokens=cached_tokens)))


def cancelled_item(usage: CompletionUsage | None = None) -> Item:
    return Annotated(data=LLMEngineOutput(finish_reason=FinishReason.CANCELLED,
                                          completion_usage=usage))
