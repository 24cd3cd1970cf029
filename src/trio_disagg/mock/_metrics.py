"""The mock workers' ``/metrics``: their KV block accounting and request counters as
Prometheus families (``trio_disagg_mock_*``, docs/protocols.md section 5)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ._kv import KVCounters

if TYPE_CHECKING:
    from ._worker import MockWorker


def _family(
    kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, role: str,
    value: float,
) -> Metric:
    family = kind(f"trio_disagg_mock_{name}", doc, labels=["role"])
    family.add_metric([role], value)
    return family


def kv_metric_families(kv: KVCounters, role: str) -> Iterator[Metric]:
    """A prefill worker's KV block accounting as Prometheus families
    (``trio_disagg_mock_kv_*``, docs/protocols.md section 5)."""
    yield _family(GaugeMetricFamily, "kv_held_blocks",
                  "KV blocks held for a decode (staged or in transfer).", role, kv.held_blocks)
    yield _family(GaugeMetricFamily, "kv_held_requests", "Requests holding KV blocks.", role,
                  kv.held)
    yield _family(CounterMetricFamily, "kv_staged_blocks", "KV blocks ever staged.", role,
                  kv.staged_blocks)
    yield _family(CounterMetricFamily, "kv_freed_blocks",
                  "KV blocks freed by a pull or a release.", role, kv.freed_blocks)
    yield _family(CounterMetricFamily, "kv_stranded_blocks",
                  "KV blocks whose lease or bootstrap wait expired before any decode "
                  "pulled them.", role, kv.stranded_blocks)
    yield _family(CounterMetricFamily, "kv_served_requests",
                  "Requests whose KV a decode pulled.", role, kv.served)
    yield _family(CounterMetricFamily, "kv_aborted_requests",
                  "Requests whose KV was released unused, or aborted before staging.", role,
                  kv.aborted)
    yield _family(CounterMetricFamily, "kv_expired_requests",
                  "Requests whose KV was stranded.", role, kv.expired)


class KVCollector:
    """Exposes in-process mock engines' KV counters (read at scrape time, when due leases
    expire) in a Prometheus registry: the embedded default's ``/metrics`` then shows the
    same ``trio_disagg_mock_kv_*`` families as a mock worker's.

    Args:
        read: returns the counters, e.g. ``MockCluster.counters``.
        role: the ``role`` label.
    """

    def __init__(self, read: Callable[[], KVCounters], role: str = "prefill") -> None:
        self._read = read
        self._role = role

    def collect(self) -> Iterator[Metric]:
        yield from kv_metric_families(self._read(), self._role)


class WorkerCollector:
    """Reads the worker's counters at scrape time (the KV pool expires due leases then)."""

    def __init__(self, worker: MockWorker) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        worker = self._worker
        stats = worker.stats
        role = worker.role
        yield from kv_metric_families(worker.kv.counters(), role)
        for name, doc, value in [
            ("requests_running", "Generation requests being served.", stats.running),
            ("requests_open", "Generation requests not over yet.", stats.open),
            *worker.extra_gauges(),
        ]:
            yield _family(GaugeMetricFamily, name, doc, role, value)
        for name, doc, value in [
            ("requests", "Generation requests received.", stats.requests),
            ("requests_completed", "Generation requests answered in full.", stats.completed),
            ("requests_failed", "Generation requests answered with an error.", stats.failed),
            ("requests_aborted",
             "Generation requests aborted because their connection closed.", stats.aborted),
            ("kv_transfers", "KV transfers served to decode workers.", stats.kv_transfers),
            ("kv_pulls", "KV transfers received from prefill workers.", stats.kv_pulls),
            ("kv_pull_failures", "KV pulls that failed.", stats.kv_pull_failures),
            ("kv_releases", "Releases sent for KV never pulled.", stats.kv_releases),
            ("prefills_completed", "Prefill computations run to their end.",
             stats.prefills_completed),
            ("prefills_aborted", "Prefill requests aborted before their computation ended.",
             stats.prefills_aborted),
        ]:
            yield _family(CounterMetricFamily, name, doc, role, value)


