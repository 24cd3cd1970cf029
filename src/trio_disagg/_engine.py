"""The ``Engine`` protocol: how the router sees a prefill or decode worker."""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

import trio

from ._context import RequestContext
from ._protocols import Annotated, LLMEngineOutput, PreprocessedRequest


class HandoffStyle(enum.Enum):
    """How a prefill worker hands KV to a decode worker (rules S5-S7 in docs/semantics.md)."""

    #: vLLM and TRT-LLM style; prefill first, its ``disaggregated_params`` go into the decode
    #: request.
    SEQUENTIAL = "sequential"
    #: SGLang style; the router picks a bootstrap room and dispatches prefill and decode
    #: together.
    BOOTSTRAP = "bootstrap"
    #: TRT-LLM style: sequential, but a generation leg aborted before it fetched the
    #: context's KV leaves that KV to the worker's transfer timeout, so the generation leg
    #: is part of the KV transfer until its first output (like a bootstrap decode leg).
    CONTEXT_FIRST = "context_first"


class CancelWindow(enum.Enum):
    """When a prefill engine's prefill may be cancelled without stranding KV (rule B10 in
    docs/semantics.md). A client that leaves inside the window cancels the prefill (and its
    paired legs, B6) instead of letting the keeper drain it; outside it the keeper drains and the
    staged KV is consumed (B1).
    """

    #: Never: the prefill always runs to its end (the default for an engine that
    #: declares nothing).
    NEVER = "never"
    #: Until the KV is committed to a decode: the prefill's handoff has not arrived
    #: (sequential, context first) or no decode joined its room (bootstrap). TensorRT-LLM:
    #: a context aborted after it committed its KV waits for its transfer timeout.
    BEFORE_HANDOFF = "before_handoff"
    #: Until the prefill finished: aborting it frees its blocks (vLLM). The router cancels
    #: a prefill only while no decode has taken its handoff (a prefill that answered has
    #: nothing left to cancel), so today it treats this as ``BEFORE_HANDOFF``.
    ANYTIME = "anytime"


def cancel_window_of(engine: object) -> CancelWindow:
    """The engine's ``cancel_window`` attribute, or :attr:`CancelWindow.NEVER` if it has
    none (the attribute is optional in the :class:`Engine` protocol)."""
    window = getattr(engine, "cancel_window", CancelWindow.NEVER)
    return window if isinstance(window, CancelWindow) else CancelWindow.NEVER


@runtime_checkable
class Engine(Protocol):
    """A prefill or decode worker, as the router drives it.

    ``generate`` is dispatched with ``await nursery.start(engine.generate, request, context,
    send_channel)``, which returns once the worker accepted the request. It then sends
    ``Annotated[LLMEngineOutput]`` items into ``send_channel`` and closes it when the stream
    ends. It honours ``context``: on ``stop_generating()`` it ends the stream with a
    ``cancelled`` finish; on ``kill()`` it stops at once. Worker failures are sent as error
    items, or raised as :class:`~trio_disagg.WorkerError` before ``started()``.

    Attributes:
        name: unique within its pool; shown in metrics and logs.
        handoff_style: for prefill engines, how they hand off.
        bootstrap_host, bootstrap_port: for BOOTSTRAP prefill engines, where the decode
            worker meets them (docs/protocols.md section 3).
        cancel_window: optional, for prefill engines: a :class:`CancelWindow` (read with
            :func:`cancel_window_of`; :attr:`CancelWindow.NEVER` if absent).
    """

    name: str
    handoff_style: HandoffStyle
    bootstrap_host: str | None
    bootstrap_port: int | None

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Annotated[LLMEngineOutput]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None: ...
