"""The HTTP adapters by protocol name, and the demo's backends: what the command line
offers. Free of the ``openai`` client, so that ``trio-disagg serve`` needs only the
``server`` extra."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._engine import Engine
from .engines import sglang_engines, trtllm_engines, vllm_engines

#: The HTTP adapters by protocol name: ``(prefill specs, decode URLs, client=)`` to engines.
ADAPTERS: dict[str, Callable[..., tuple[Sequence[Engine], Sequence[Engine]]]] = {
    "vllm": vllm_engines,
    "sglang": sglang_engines,
    "trtllm": trtllm_engines,
}

#: Every backend the demo knows, in the order ``--backend all`` runs them.
DEMO_BACKENDS = ("mock-sequential", "mock-bootstrap", *ADAPTERS)
