"""``/metrics`` aggregated over the processes of ``serve --workers N``.

prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the
supervisor for each process it starts) keeps the value of every ``Counter``, ``Gauge`` and
``Histogram`` in a memory-mapped file per process, and a ``MultiProcessCollector`` reads
them all when any process is scraped. The server's own counters and histograms are such
metrics already. What the router counts itself and a collector reads at scrape time
(:class:`~trio_disagg.server.RouterCollector`) lives in one process's memory, so
:class:`MultiprocessMirror` copies it into multiprocess metrics: at start, every
``interval`` seconds, on each scrape of this process and when it stops. The aggregate is
then at most ``interval`` seconds behind for the other processes' collector values.

How each family is aggregated:

- counters: summed over every process that ever ran (a counter keeps what a process that
  exited counted);
- gauges named ``*_in_flight`` or ``*_outstanding``: summed over the live processes;
- every other gauge (a state, the router closing, a worker's health as one process sees
  it, the last probe's seconds) and a summary's ``_count`` and ``_sum``: one sample per
  live process, labelled ``pid``.
"""

from __future__ import annotations

from collections.abc import Iterable

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

#: The environment variable naming prometheus-client's multiprocess directory.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Suffixes of the gauge families summed over the live processes.
SUMMED_GAUGES = ("_in_flight", "_outstanding")


class MultiprocessMirror:
    """Copies collectors' scrape-time values into prometheus-client multiprocess metrics,
    and renders the aggregate of every process (see the module's docstring).

    Args:
        sources: the collectors to copy (the router's, the embedded mocks' KV counters).
        path: the multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``, which must have
            been set before prometheus-client was imported).
    """

    def __init__(self, sources: Iterable[Collector], path: str) -> None:
        self.sources = list(sources)
        self.path = path
        self._counters: dict[str, Counter] = {}
        self._gauges: dict[str, Gauge] = {}
        self._copied: dict[tuple[str, tuple[str, ...]], float] = {}

    def sync(self) -> None:
        """Copy the sources' current values (a counter by the increase since the last
        copy)."""
        for source in self.sources:
            for family in source.collect():
                self._copy(family)

    def _copy(self, family: Metric) -> None:
        if family.type == "counter":
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue  # a _created sample: not aggregated
                names = tuple(sample.labels)
                counter = self._counters.get(family.name)
                if counter is None:
                    counter = self._counters[family.name] = Counter(
                        family.name, family.documentation, names, registry=None)
                values = tuple(sample.labels.values())
                key = (family.name, values)
                increase = sample.value - self._copied.get(key, 0.0)
                if increase > 0:
                    (counter.labels(*values) if names else counter).inc(increase)
                    self._copied[key] = sample.value
            return
        summed = family.type == "gauge" and family.name.endswith(SUMMED_GAUGES)
        for sample in family.samples:
            names = tuple(sample.labels)
            gauge = self._gauges.get(sample.name)
            if gauge is None:
                gauge = self._gauges[sample.name] = Gauge(
                    sample.name, family.documentation, names, registry=None,
                    multiprocess_mode="livesum" if summed else "liveall")
            (gauge.labels(*sample.labels.values()) if names else gauge).set(sample.value)

    def render(self) -> bytes:
        """The Prometheus text exposition of every process's metrics, this process's
        copied first."""
        self.sync()
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.path)  # type: ignore[no-untyped-call]
        return generate_latest(registry)

    async def run(self, interval: float = 1.0) -> None:
        """Copy every ``interval`` seconds until cancelled, and once more then (the last
        counts of a process that stops)."""
        try:
            while True:
                self.sync()
                await trio.sleep(interval)
        finally:
            self.sync()
