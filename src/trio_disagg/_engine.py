"""The ``Engine`` protocol: how the router sees a prefill or decode worker."""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

import trio

from ._context import RequestContext
from ._protocols import Annotated, LLMEngineOutput, PreprocessedRequest


class HandoffStyle(enum.Enum):
    """How a prefill worker hands KV to a decode worker (SEMANTICS.md S5-S7)."""

    #: vLLM and TRT-LLM style; prefill first, its ``disaggregated_params`` go into the decode
    #: request.
    SEQUENTIAL = "sequential"
    #: SGLang style; the router picks a bootstrap room and dispatches prefill and decode
    #: together.
    BOOTSTRAP = "bootstrap"


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
            worker meets them (PROTOCOLS.md section 3).
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
