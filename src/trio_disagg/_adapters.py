"""The HTTP adapters by protocol name, and the demo's backends: what the command line
offers. Free of the ``openai`` client, so that ``trio-disagg serve`` needs only the
``server`` extra; and importing it needs no extra at all (the adapters are imported when
asked for), so that ``trio-disagg --help`` works on a core install."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._engine import Engine

#: The HTTP adapters' protocol names (``serve --backend``, ``mock-worker --protocol``).
BACKENDS = ("vllm", "sglang", "trtllm")

#: Every backend the demo knows, in the order ``--backend all`` runs them.
DEMO_BACKENDS = ("mock-sequential", "mock-bootstrap", *BACKENDS)

#: What an adapter is: ``(prefill specs, decode URLs, client=)`` to engines.
Adapter = Callable[..., tuple[Sequence[Engine], Sequence[Engine]]]


def adapter(backend: str) -> Adapter:
    """The HTTP adapter of ``backend`` (one of :data:`BACKENDS`).

    Raises:
        KeyError: ``backend`` is not one of :data:`BACKENDS`.
        ModuleNotFoundError: the ``server`` extra is not installed.
    """
    from . import engines

    adapters: dict[str, Adapter] = {"vllm": engines.vllm_engines,
                                    "sglang": engines.sglang_engines,
                                    "trtllm": engines.trtllm_engines}
    return adapters[backend]
