"""A cluster of in-process mock engines on one registry (docs/protocols.md section 5)."""

from __future__ import annotations

import attrs

from .._engine import HandoffStyle
from ._decode_engine import MockDecodeEngine
from ._engines import MockPrefillEngine
from ._faults import FaultPlan
from ._kv import DEFAULT_BLOCK_SIZE, DEFAULT_BOOTSTRAP_TIMEOUT, DEFAULT_KV_TTL, KVCounters
from ._latency import LatencyModel
from ._registry import KVRegistry


@attrs.define(eq=False)
class MockCluster:
    """In-process mock engines sharing one :class:`KVRegistry`.

    Attributes:
        registry: links the engines.
        prefill: the prefill engines.
        decode: the decode engines.
    """

    registry: KVRegistry
    prefill: list[MockPrefillEngine]
    decode: list[MockDecodeEngine]

    def counters(self) -> KVCounters:
        """The sum of the prefill engines' KV counters (after expiring what is due)."""
        return self.registry.counters()


def mock_cluster(
    prefill: int = 1,
    decode: int = 1,
    *,
    style: HandoffStyle = HandoffStyle.SEQUENTIAL,
    latency: LatencyModel | None = None,
    seed: int = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_ttl: float = DEFAULT_KV_TTL,
    bootstrap_timeout: float = DEFAULT_BOOTSTRAP_TIMEOUT,
    default_max_tokens: int = 16,
    fault_plan: FaultPlan | None = None,
) -> MockCluster:
    """Make ``prefill`` prefill engines (``prefill-0``, ...) and ``decode`` decode engines
    (``decode-0``, ...) on one new registry, all with the same settings.

    Args:
        style: the prefill engines' handoff style.
        latency: as for :class:`MockPrefillEngine` and :class:`MockDecodeEngine`; so are
            ``seed``, ``block_size``, ``kv_ttl``, ``bootstrap_timeout``,
            ``default_max_tokens`` and ``fault_plan``.

    Returns:
        The :class:`MockCluster`.
    """
    registry = KVRegistry()
    latency = latency if latency is not None else LatencyModel()
    prefills = [
        MockPrefillEngine(registry, f"prefill-{i}", style=style, latency=latency, seed=seed,
                          block_size=block_size, kv_ttl=kv_ttl,
                          bootstrap_timeout=bootstrap_timeout, fault_plan=fault_plan)
        for i in range(prefill)
    ]
    decodes = [
        MockDecodeEngine(registry, f"decode-{i}", latency=latency, seed=seed,
                         default_max_tokens=default_max_tokens,
                         bootstrap_timeout=bootstrap_timeout, block_size=block_size,
                         fault_plan=fault_plan, style=style)
        for i in range(decode)
    ]
    return MockCluster(registry, prefills, decodes)
