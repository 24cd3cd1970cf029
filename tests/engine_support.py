"""An engine that stands in for another in a test: it answers to the same name, handoff
style and bootstrap address, and its ``generate`` decides what to do with the one it
wraps (run it first, count its cancellations, hold its stream...)."""

from __future__ import annotations

from typing import Any

from trio_disagg import HandoffStyle


class StandIn:
    """The attributes a :class:`~trio_disagg.PrefillEngine` has besides ``generate``,
    taken from ``engine``; a subclass adds ``generate``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name: str = engine.name
        self.handoff_style: HandoffStyle = engine.handoff_style
        self.bootstrap_host: str | None = engine.bootstrap_host
        self.bootstrap_port: int | None = engine.bootstrap_port
