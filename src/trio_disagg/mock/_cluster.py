"""A cluster of in-process mock engines on one registry (docs/protocols.md section 5)."""

from __future__ import annotations

from typing import TypedDict, Unpack

import attrs

from .._engine import HandoffStyle
from ._decode_engine import MockDecodeEngine
from ._engines import MockPrefillEngine
from ._faults import FaultPlan
from ._kv import DEFAULT_KV_TTL, KVCounters
from ._latency import LatencyModel
from ._registry import KVRegistry


@attrs.define(eq=False)
class MockCluster:
    """In-process mock engines sharing one :class:`KVRegistry`: what :func:`mock_cluster`
    returns.

    It owns no task and needs no closing: the engines do their work inside their
    ``generate`` calls. Put ``prefill`` and ``decode`` in two
    :class:`~trio_disagg.WorkerPool`\\ s for a :class:`~trio_disagg.DisaggRouter`.

    Attributes:
        registry: links the engines: a decode engine finds the prefill engine whose KV it
            pulls, or whose bootstrap room it joins, there.
        prefill: the prefill engines (:class:`MockPrefillEngine`).
        decode: the decode engines (:class:`MockDecodeEngine`).
    """

    registry: KVRegistry
    prefill: list[MockPrefillEngine]
    decode: list[MockDecodeEngine]

    def counters(self) -> KVCounters:
        """The sum of the prefill engines' KV counters (after expiring what is due), for
        checking that every staged block was pulled or released (rule B1). Outside a trio
        run it reads them without expiring anything.

        Returns:
            A new :class:`KVCounters`; later changes do not show in it.
        """
        return self.registry.counters()


class EngineOptions(TypedDict, total=False):
    """The settings both in-process engines take, as keywords; each defaults as in
    :class:`MockPrefillEngine` and :class:`MockDecodeEngine`."""

    latency: LatencyModel | None
    seed: int
    block_size: int
    bootstrap_timeout: float
    fault_plan: FaultPlan | None
    prefix_cache_blocks: int


def mock_cluster(prefill: int = 1, decode: int = 1, *,
                 style: HandoffStyle = HandoffStyle.SEQUENTIAL, kv_ttl: float = DEFAULT_KV_TTL,
                 default_max_tokens: int = 16, **options: Unpack[EngineOptions]) -> MockCluster:
    """Make ``prefill`` prefill engines (``prefill-0``, ...) and ``decode`` decode engines
    (``decode-0``, ...) on one new registry, all with the same settings.

    Args:
        prefill: the number of prefill engines.
        decode: the number of decode engines.
        style: the prefill engines' handoff style.
        kv_ttl: as for :class:`MockPrefillEngine`.
        default_max_tokens: as for :class:`MockDecodeEngine`.
        options: as for both engines: ``latency`` (one :class:`LatencyModel` shared by
            all, default ``LatencyModel()``), ``seed``, ``block_size``,
            ``bootstrap_timeout``, ``fault_plan`` and ``prefix_cache_blocks``.

    Returns:
        The :class:`MockCluster`.

    Raises:
        ValueError: a negative or non-integer number of engines, or a bad setting (see
            the engines).
        TypeError: ``latency`` is not a :class:`LatencyModel` (or None).
    """
    for role, count in (("prefill", prefill), ("decode", decode)):
        # range() of a negative count is silently empty: a cluster short of engines.
        if type(count) is not int or count < 0:
            raise ValueError(f"{role} must be an integer >= 0 engines, got {count!r}")
    latency = options.get("latency")
    if latency is None:
        options["latency"] = LatencyModel()
    elif not isinstance(latency, LatencyModel):  # else it fails inside the first request
        raise TypeError(f"latency must be a LatencyModel or None, got "
                        f"{type(latency).__name__}")
    registry = KVRegistry()
    prefills = [MockPrefillEngine(registry, f"prefill-{i}", style=style, kv_ttl=kv_ttl,
                                  **options) for i in range(prefill)]
    decodes = [MockDecodeEngine(registry, f"decode-{i}", default_max_tokens=default_max_tokens,
                                style=style, **options) for i in range(decode)]
    return MockCluster(registry, prefills, decodes)
