"""Prometheus metrics of the server, in a registry of its own per app.

Histograms and the requests counter are updated by the request handlers; everything the
router already counts (in-flight requests, keeper drains, per-worker outstanding requests
and failures, staged-KV cleanups) is read live at scrape time by a custom collector, so the
hot path pays nothing for it and the numbers can never drift.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from .._health import EJECTION_REASONS, RETRY_REASONS, HealthState
from .._keeper import CLEANUP, DECODE_LEG, PREFILL_DRAIN, TransferKeeper
from .._router import DisaggRouter, RouterCounters
from ._multiprocess import MultiprocessMirror
from ._openai_errors import ApiError

#: Every request outcome the ``trio_disagg_requests_total`` counter uses.
OUTCOMES = (
    "success",          # a complete answer (finish reason stop, length, content_filter)
    "invalid_request",  # 4xx: rejected at the edge, or by a worker
    "unavailable",      # 503: router closed or no worker
    "timeout",          # 504, or a deadline error event
    "upstream_error",   # 502, or an error event (a worker failed or died)
    "internal_error",   # 500: a bug; should never happen
    "disconnected",     # the client went away first
)

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
_ITL_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)


class ServerMetrics:
    """The metrics of one app.

    Attributes:
        registry: a :class:`prometheus_client.CollectorRegistry` of this app alone.
        requests: ``trio_disagg_requests_total{endpoint, outcome}``; see :data:`OUTCOMES`.
        ttft: ``trio_disagg_time_to_first_token_seconds``: request admitted to first token
            forwarded to the client.
        itl: ``trio_disagg_inter_token_latency_seconds``: between two forwarded outputs
            (tokens a worker sent together, in one socket read, are one output: one
            observation, as vLLM observes one per engine step).
        prefill_time: ``trio_disagg_prefill_time_seconds``: request admitted to the
            prefill's first valid output.
        kv_transfer: ``trio_disagg_kv_transfer_latency_seconds``: prefill complete to the
            decode's first token, an upper bound on the KV transfer time.

    Args:
        router: whose live counters the collector reads at scrape time.
        http_in_flight: reads the number of generation requests the server is handling
            (``trio_disagg_http_requests_in_flight``), if given.
    """

    def __init__(
        self, router: DisaggRouter, *, http_in_flight: Callable[[], int] | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "trio_disagg_requests", "Generation requests by endpoint and outcome.",
            ["endpoint", "outcome"], registry=registry,
        )
        self._requests_by: dict[tuple[str, str], Counter] = {}  # its children, once looked up
        self.ttft = Histogram(
            "trio_disagg_time_to_first_token_seconds",
            "Seconds from admission to the first token forwarded to the client.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.itl = Histogram(
            "trio_disagg_inter_token_latency_seconds",
            "Seconds between two outputs forwarded to the client.",
            buckets=_ITL_BUCKETS, registry=registry,
        )
        self.prefill_time = Histogram(
            "trio_disagg_prefill_time_seconds",
            "Seconds from admission to the prefill worker's first valid output.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.kv_transfer = Histogram(
            "trio_disagg_kv_transfer_latency_seconds",
            "Seconds from prefill complete to the decode's first token "
            "(an upper bound on the KV transfer time).",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )
        #: The collectors read at scrape time (what :meth:`enable_multiprocess` copies).
        self.collectors: list[Collector] = []
        #: Set by :meth:`enable_multiprocess`.
        self.multiprocess: MultiprocessMirror | None = None
        self.add_collector(RouterCollector(router, http_in_flight=http_in_flight))


    def count_request(self, endpoint: str, outcome: str) -> None:
        """One more ``trio_disagg_requests_total{endpoint, outcome}``: the labelled child
        looked up once per pair, not on every request (its lookup takes a lock, P4a)."""
        counter = self._requests_by.get((endpoint, outcome))
        if counter is None:
            counter = self._requests_by[endpoint, outcome] = self.requests.labels(
                endpoint, outcome)
        counter.inc()

    def add_collector(self, collector: Collector) -> None:
        """Register a collector read at scrape time (e.g. the embedded mocks'
        ``KVCollector``); with :meth:`enable_multiprocess` its values are aggregated too."""
        self.registry.register(collector)
        self.collectors.append(collector)

    def enable_multiprocess(self, path: str) -> MultiprocessMirror:
        """Serve every process's metrics from now on (``serve --workers N``): prometheus-
        client's multiprocess mode, whose directory ``path`` must have been in
        ``PROMETHEUS_MULTIPROC_DIR`` before prometheus-client was imported. The
        collectors' values are copied into it by the returned mirror: run its
        :meth:`~MultiprocessMirror.run` beside the server."""
        self.multiprocess = MultiprocessMirror(self.collectors, path)
        self.multiprocess.sync()
        return self.multiprocess

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type (every process's, after
        :meth:`enable_multiprocess`)."""
        if self.multiprocess is not None:
            return self.multiprocess.render(), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RouterCollector(Collector):
    """Reads a router's live values at scrape time.

    Families: ``trio_disagg_requests_in_flight``, ``trio_disagg_router_admitted_total``,
    ``trio_disagg_router_closing``, ``trio_disagg_keeper_drains_in_flight``,
    ``trio_disagg_keeper_drains_started_total`` / ``_failed_total`` / ``_cancelled_total``,
    ``trio_disagg_keeper_tasks_in_flight{kind}``, ``trio_disagg_keeper_tasks_started_total{kind}``
    (kinds: prefill drain, decode leg, B1 cleanup),
    ``trio_disagg_prefills_abandoned_total{outcome}`` (drained, cancelled, released),
    ``trio_disagg_disagg_decisions_total{decision}`` (disaggregated, decode_only),
    ``trio_disagg_staged_kv_cleanups_total``, ``trio_disagg_staged_kv_cleanup_failures_total``,
    and per worker (labels ``role``, ``worker``): ``trio_disagg_worker_outstanding``,
    ``trio_disagg_worker_healthy``, ``trio_disagg_worker_served_total``,
    ``trio_disagg_worker_failures_total``, ``trio_disagg_worker_state{state}``,
    ``trio_disagg_worker_ejections_total{reason}``, ``trio_disagg_worker_probe_latency_seconds``
    and ``trio_disagg_worker_probe_seconds``; ``trio_disagg_retries_total{leg, reason}``
    (rule B9); with ``http_in_flight``, also
    ``trio_disagg_http_requests_in_flight``.
    """

    def __init__(
        self, router: DisaggRouter, *, http_in_flight: Callable[[], int] | None = None
    ) -> None:
        self.router = router
        self.http_in_flight = http_in_flight

    def collect(self) -> Iterator[Metric]:
        router = self.router
        if self.http_in_flight is not None:
            yield GaugeMetricFamily(
                "trio_disagg_http_requests_in_flight",
                "Generation requests the server is handling (until their nursery closed).",
                value=self.http_in_flight(),
            )
        yield from _router_families(router)
        yield from _keeper_families(router.keeper)
        yield from _counter_families(router.counters)
        try:
            now = trio.current_time()
        except RuntimeError:  # scraped outside a trio run
            now = float("inf")
        yield from _worker_families(router, now)
        yield from _health_families(router, now)


def _router_families(router: DisaggRouter) -> Iterator[Metric]:
    counters = router.counters
    yield GaugeMetricFamily(
        "trio_disagg_requests_in_flight", "Requests admitted by the router and not finished.",
        value=router.in_flight,
    )
    yield CounterMetricFamily(
        "trio_disagg_router_admitted", "Requests the router admitted.",
        value=counters.requests_total,
    )
    yield GaugeMetricFamily(
        "trio_disagg_router_closing", "1 once the router stopped admitting requests.",
        value=1 if router.closing else 0,
    )


def _keeper_families(keeper: TransferKeeper) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "trio_disagg_keeper_drains_in_flight",
        "Keeper tasks running (prefill drains, kept decode legs, B1 cleanups).",
        value=keeper.in_flight,
    )
    yield CounterMetricFamily(
        "trio_disagg_keeper_drains_started",
        "Keeper tasks started (prefill drains, kept decode legs, B1 cleanups).",
        value=keeper.started_total,
    )
    yield CounterMetricFamily(
        "trio_disagg_keeper_drains_failed",
        "Keeper prefill drains and B1 cleanups that failed.",
        value=keeper.failed_total,
    )
    yield CounterMetricFamily(
        "trio_disagg_keeper_drains_cancelled",
        "Keeper prefill drains and B1 cleanups cancelled before completing.",
        value=keeper.cancelled_total,
    )
    by_kind = keeper.in_flight_by_kind()
    tasks = GaugeMetricFamily(
        "trio_disagg_keeper_tasks_in_flight",
        "Keeper tasks running, by kind: prefill drains, decode legs kept for a KV "
        "transfer, B1 cleanups.", labels=["kind"],
    )
    started = CounterMetricFamily(
        "trio_disagg_keeper_tasks_started", "Keeper tasks started, by kind.",
        labels=["kind"],
    )
    for kind in (PREFILL_DRAIN, DECODE_LEG, CLEANUP):
        tasks.add_metric([kind], by_kind[kind])
        started.add_metric([kind], keeper.started_by_kind[kind])
    yield tasks
    yield started


def _counter_families(counters: RouterCounters) -> Iterator[Metric]:
    prefills = CounterMetricFamily(
        "trio_disagg_prefills_abandoned",
        "Prefills whose request ended before a decode took their handoff, by what became "
        "of them: drained (run to their end, KV consumed; also one the router stopped "
        "whose answer came all the same), cancelled (inside the engine's cancel window, "
        "B10), released (no decode would join its room, B6).",
        labels=["outcome"],
    )
    prefills.add_metric(["drained"], counters.prefills_drained)
    prefills.add_metric(["cancelled"], counters.prefills_cancelled)
    prefills.add_metric(["released"], counters.prefills_released)
    yield prefills
    decisions = CounterMetricFamily(
        "trio_disagg_disagg_decisions",
        "Requests by routing decision: disaggregated (a prefill leg and a KV transfer) "
        "or decode_only (a short prompt served by one decode worker alone).",
        labels=["decision"],
    )
    for decision, count in counters.decisions.items():
        decisions.add_metric([decision], count)
    yield decisions
    yield CounterMetricFamily(
        "trio_disagg_staged_kv_cleanups",
        "Minimal decodes dispatched to consume KV staged for a request that ended (B1).",
        value=counters.staged_kv_cleanups,
    )
    yield CounterMetricFamily(
        "trio_disagg_staged_kv_cleanup_failures", "Staged-KV cleanup decodes that failed.",
        value=counters.staged_kv_cleanup_failures,
    )


def _worker_families(router: DisaggRouter, now: float) -> Iterator[Metric]:
    labels = ["role", "worker"]
    outstanding = GaugeMetricFamily(
        "trio_disagg_worker_outstanding", "Requests outstanding on a worker.", labels=labels
    )
    healthy = GaugeMetricFamily(
        "trio_disagg_worker_healthy",
        "1 if selection may choose the worker (healthy or half-open).", labels=labels,
    )
    served = CounterMetricFamily(
        "trio_disagg_worker_served", "Requests a worker completed.", labels=labels
    )
    failures = CounterMetricFamily(
        "trio_disagg_worker_failures", "Requests a worker failed.", labels=labels
    )
    for role, pool in (("prefill", router.prefill), ("decode", router.decode)):
        for worker in pool.workers:
            values = [role, worker.name]
            outstanding.add_metric(values, worker.outstanding)
            healthy.add_metric(values, 1 if worker.health.selectable(now) else 0)
            served.add_metric(values, worker.served_total)
            failures.add_metric(values, worker.failures_total)
    yield outstanding
    yield healthy
    yield served
    yield failures


def _health_families(router: DisaggRouter, now: float) -> Iterator[Metric]:
    """Per worker (labels ``role``, ``worker``): ``trio_disagg_worker_state{state}`` (1 for
    its :class:`~trio_disagg.HealthState`), ``trio_disagg_worker_ejections_total{reason}``,
    and for probed workers ``trio_disagg_worker_probe_latency_seconds`` (the last probe)
    and the summary ``trio_disagg_worker_probe_seconds``; and
    ``trio_disagg_retries_total{leg, reason}`` (B9)."""
    labels = ["role", "worker"]
    state = GaugeMetricFamily(
        "trio_disagg_worker_state",
        "1 for the worker's health state (healthy, ejected, half_open, down), else 0.",
        labels=[*labels, "state"],
    )
    ejections = CounterMetricFamily(
        "trio_disagg_worker_ejections",
        "Times a worker was taken out of selection, by reason: passive (consecutive "
        "faults of its own requests) or probe (a failed health probe).",
        labels=[*labels, "reason"],
    )
    last = GaugeMetricFamily(
        "trio_disagg_worker_probe_latency_seconds",
        "Seconds the worker's last health probe took.", labels=labels,
    )
    probes = SummaryMetricFamily(
        "trio_disagg_worker_probe_seconds", "Health probes of the worker and their seconds.",
        labels=labels,
    )
    for role, pool in (("prefill", router.prefill), ("decode", router.decode)):
        for worker in pool.workers:
            health, values = worker.health, [role, worker.name]
            current = health.state(now)
            for each in HealthState:
                state.add_metric([*values, each.value], 1 if each is current else 0)
            for reason in EJECTION_REASONS:
                ejections.add_metric([*values, reason], health.ejections[reason])
            if health.probed:
                if health.last_probe_seconds is not None:
                    last.add_metric(values, health.last_probe_seconds)
                probes.add_metric(values, health.probes_total, health.probe_seconds_total)
    yield state
    yield ejections
    yield last
    yield probes
    retries = CounterMetricFamily(
        "trio_disagg_retries",
        "Legs tried again on another worker before the first byte (B9), by leg "
        "(prefill, decode, cleanup: a B1 cleanup decode) and reason (transport_error, "
        "server_error, too_many_requests: a 429).",
        labels=["leg", "reason"],
    )
    for leg in ("prefill", "decode", "cleanup"):
        for reason in RETRY_REASONS:
            retries.add_metric([leg, reason], router.counters.retries.get((leg, reason), 0))
    yield retries


def outcome_of(error: ApiError) -> str:
    """The ``requests_total`` outcome of a request answered with ``error``."""
    status = error.status
    if status == 503:
        return "unavailable"
    if status == 504:
        return "timeout"
    if status < 500:
        return "invalid_request"
    if status == 500:
        return "internal_error"
    return "upstream_error"
