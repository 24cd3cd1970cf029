"""An engine that stands in for another in a test: it answers to the same name, handoff
style and bootstrap address, and its ``generate`` decides what to do with the one it
wraps (run it first, count its cancellations, hold its stream...)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import trio

from trio_disagg import (
    Annotated,
    HandoffStyle,
    LLMEngineOutput,
    PreprocessedRequest,
    RequestContext,
)


class StandIn:
    """The attributes a :class:`~trio_disagg.PrefillEngine` has besides ``generate``,
    taken from ``engine``; a subclass adds ``generate``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name: str = engine.name
        self.handoff_style: HandoffStyle = engine.handoff_style
        self.bootstrap_host: str | None = engine.bootstrap_host
        self.bootstrap_port: int | None = engine.bootstrap_port


async def run_to_its_end(
    engine: Any,
    request: PreprocessedRequest,
    context: RequestContext,
    started: trio.TaskStatus[None] | None = None,
) -> list[Annotated[LLMEngineOutput]]:
    """What ``engine.generate`` sends for ``request``, read to its end (a mock decode that
    pulls the KV, a mock prefill that stages it); ``started.started()`` is called once
    the engine started, if given."""
    send, receive = trio.open_memory_channel[Annotated[LLMEngineOutput]](math.inf)
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(engine.generate, request, context, send))
        if started is not None:
            started.started()
        with receive:
            items = [item async for item in receive]
    return items
