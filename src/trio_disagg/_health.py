"""Worker health: a circuit breaker per worker, fed by its requests' outcomes (passive) and
by probes of its health endpoint (active); and the bounded retry policy of rule B9 in
docs/semantics.md. See docs/router.md "Worker health" and "Retries".

The core knows nothing of HTTP: a probe is an engine's ``check_health()``
(:class:`HealthProbe`), which an HTTP adapter implements with its worker's health endpoint.
An engine without one (the in-process mock engines) is never probed, and is healthy unless
its own requests fail.
"""

from __future__ import annotations

import enum
import logging
import math
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs
import trio

from ._errors import NoDisaggregatedParams, PrefillCancelled, WorkerError

if TYPE_CHECKING:
    from ._engine import DecodeEngine
    from ._pool import Worker

logger = logging.getLogger("trio_disagg.health")


class HealthState(enum.Enum):
    """Where a worker's circuit breaker stands (:meth:`WorkerHealth.state`)."""

    #: Selected as usual.
    HEALTHY = "healthy"
    #: Its requests failed ``failure_threshold`` times in a row: skipped until its
    #: cool-down is over (the breaker is open).
    EJECTED = "ejected"
    #: Its cool-down is over: selected for one trial request at a time, whose result
    #: decides (a success closes the breaker, a fault opens it for another cool-down).
    HALF_OPEN = "half_open"
    #: Its last health probe failed: skipped until a probe succeeds.
    DOWN = "down"


#: Why a worker was taken out of selection, for ``trio_disagg_worker_ejections_total``.
EJECTION_REASONS = ("passive", "probe")
#: Why a leg was tried again (B9), for ``trio_disagg_retries_total``.
RETRY_REASONS = ("transport_error", "server_error", "too_many_requests")
#: A worker too busy for the request (HTTP 429): it refused before doing anything, as with
#: a 503, and another worker may serve it; not a bad request, which fails everywhere.
TOO_MANY_REQUESTS = 429


@runtime_checkable
class HealthProbe(Protocol):
    """An engine that can probe its worker (an HTTP adapter: ``GET /health``)."""

    async def check_health(self) -> None:
        """Probe the worker once; return if it is healthy.

        It need not bound itself: the :class:`HealthMonitor` cancels a probe after its
        ``timeout`` seconds, which counts as a failed probe, so the probe must leave
        nothing behind when cancelled (an HTTP adapter closes its connection).

        Raises:
            Exception: any, if it is not (the adapter's :class:`~trio_disagg.WorkerError`).
        """
        ...


class WorkerHealth:
    """One worker's circuit breaker and probe results.

    Each :class:`~trio_disagg.Worker` has one (``worker.health``); its pool feeds it the
    outcomes of requests and a :class:`HealthMonitor` the probes'. Times are
    ``trio.current_time()`` values, durations seconds. Its methods are synchronous.

    Args:
        probed: the worker's engine is a :class:`HealthProbe`.

    Attributes:
        probed: the worker's engine is a :class:`HealthProbe`, so probes decide ``DOWN``.
        probe_ok: the last probe's verdict (True before the first one).
        consecutive_faults: the worker's own faults since its last success.
        ejected: the breaker is open or half-open (no success since it opened).
        ejected_until: ``trio.current_time()`` at which an open breaker turns half-open.
        trial_until: while half-open, ``trio.current_time()`` before which no other trial
            request is given it (one trial at a time; a trial whose result never comes,
            its request cancelled, frees the next one after a cool-down).
        ejections: times taken out of selection, by reason (:data:`EJECTION_REASONS`).
        probes_total, probe_failures_total: probes run, and those that failed.
        probe_seconds_total: their summed latency, in seconds.
        last_probe_seconds: the last probe's latency in seconds (None before one).
        probe_failure: why the last probe failed, as its probe said; None if it passed
            (or said nothing).
    """

    __slots__ = ("consecutive_faults", "ejected", "ejected_until", "ejections",
                 "last_probe_seconds", "probe_failure", "probe_failures_total", "probe_ok",
                 "probe_seconds_total", "probed", "probes_total", "trial_until")

    def __init__(self, *, probed: bool = False) -> None:
        self.probed = probed
        self.probe_ok = True
        self.consecutive_faults = 0
        self.ejected = False
        self.ejected_until = -math.inf
        self.trial_until = -math.inf
        self.ejections = dict.fromkeys(EJECTION_REASONS, 0)
        self.probes_total = 0
        self.probe_failures_total = 0
        self.probe_seconds_total = 0.0
        self.last_probe_seconds: float | None = None
        self.probe_failure: str | None = None

    def state(self, now: float) -> HealthState:
        """The breaker's state at ``now`` (``trio.current_time()``): ``DOWN`` while the
        last probe failed, whatever the breaker says; else ``HEALTHY``, ``EJECTED`` in
        the cool-down, or ``HALF_OPEN`` after it."""
        if not self.probe_ok:
            return HealthState.DOWN
        if not self.ejected:
            return HealthState.HEALTHY
        return HealthState.EJECTED if now < self.ejected_until else HealthState.HALF_OPEN

    def selectable(self, now: float) -> bool:
        """Healthy or half-open: it counts towards its pool's readiness."""
        return self.state(now) in (HealthState.HEALTHY, HealthState.HALF_OPEN)

    def choosable(self, now: float) -> bool:
        """Selection may give it a request now: healthy, or half-open with no trial
        request in flight."""
        state = self.state(now)
        return state is HealthState.HEALTHY or (
            state is HealthState.HALF_OPEN and now >= self.trial_until)

    def chosen(self, now: float, *, cooldown: float) -> None:
        """Selection gave it a request: if half-open, that is its trial, and no other is
        given it for ``cooldown`` seconds unless the trial's result comes first."""
        if self.ejected and now >= self.ejected_until:
            self.trial_until = now + cooldown

    def success(self) -> None:
        """The worker answered: its breaker closes."""
        self.consecutive_faults = 0
        self.ejected = False
        self.ejected_until = self.trial_until = -math.inf

    def fault(self, now: float, *, threshold: int, cooldown: float) -> None:
        """One fault of the worker's own: the breaker opens for ``cooldown`` seconds after
        ``threshold`` in a row, or at once when it was half-open (the trial failed).
        A fault while the breaker is open and cooling down only counts.

        Args:
            now: ``trio.current_time()``.
            threshold: consecutive faults that open a closed breaker.
            cooldown: seconds the breaker stays open.
        """
        self.consecutive_faults += 1
        half_open = self.ejected and now >= self.ejected_until
        if half_open or (not self.ejected and self.consecutive_faults >= threshold):
            self.ejected = True
            self.ejected_until = now + cooldown
            self.trial_until = -math.inf
            self.ejections["passive"] += 1

    def probe_result(self, ok: bool, seconds: float, failure: str | None = None) -> None:
        """A probe ended: ``ok`` or not (``failure`` says why), after ``seconds``. A failed
        probe takes the worker out of selection until a probe succeeds; a successful one
        does not end a passive ejection (a worker whose health endpoint answers may still
        fail its requests)."""
        self.probe_failure = None if ok else failure
        self.probes_total += 1
        self.probe_seconds_total += seconds
        self.last_probe_seconds = seconds
        if not ok:
            self.probe_failures_total += 1
            if self.probe_ok:
                self.ejections["probe"] += 1
        self.probe_ok = ok


def worker_fault(error: BaseException | None) -> bool | None:
    """Whether ``error`` is the worker's own fault (True: a 429, too busy, counts as a
    5xx does), the worker refusing a bad request, which shows it is alive (False: any
    other 4xx), or neither (None: the router refused the worker's answer as a handoff (S8,
    S9, B7), or ended the prefill on purpose).

    ``None`` as the error (a deadline with no answer) is the worker's fault. The cause
    chain is followed to the :class:`~trio_disagg.WorkerError` an adapter raised.
    """
    while error is not None:
        if isinstance(error, NoDisaggregatedParams | PrefillCancelled):
            return None
        if isinstance(error, WorkerError):
            return not 400 <= error.status < 500 or error.status == TOO_MANY_REQUESTS
        error = error.__cause__
    return True


def retry_reason(error: BaseException) -> str | None:
    """The ``reason`` label of a retry after ``error``, or None if ``error`` must not be
    retried (B9): only a :class:`~trio_disagg.WorkerError` of a worker that could not be
    reached (``transport_error``: status 502 and no ``worker_status``), failed with a
    5xx (``server_error``) or was too busy (``too_many_requests``: a 429), and whose KV
    was not reported lost, may be retried; any other 4xx never is."""
    if not isinstance(error, WorkerError) or error.handoff_lost:
        return None
    if error.status == TOO_MANY_REQUESTS:
        return "too_many_requests"
    if 400 <= error.status < 500:
        return None
    if error.worker_status is None and error.status == 502:  # an adapter's "never answered"
        return "transport_error"
    return "server_error"


@attrs.frozen(kw_only=True)
class RetryPolicy:
    """How a leg that failed before the first byte is tried again (rule B9 in
    docs/semantics.md).

    Attributes:
        max_attempts: attempts per leg in all, the first one included (1: no retry).
        backoff: seconds before the second attempt; each further one doubles it, up to
            ``max_backoff``. The actual wait is drawn uniformly from half to all of it
            (jitter), so requests that failed together do not retry together.
        max_backoff: the longest wait between two attempts, in seconds.

    Raises:
        ValueError: ``max_attempts`` < 1, or a negative or non-finite backoff.
    """

    max_attempts: int = attrs.field(default=2)
    backoff: float = attrs.field(default=0.05)
    max_backoff: float = attrs.field(default=1.0)

    @max_attempts.validator
    def _check_attempts(self, attribute: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {value!r}")

    @backoff.validator
    @max_backoff.validator
    def _check_seconds(self, attribute: attrs.Attribute[float], value: float) -> None:
        if not (isinstance(value, int | float) and 0 <= value < math.inf):
            raise ValueError(f"{attribute.name} must be >= 0 seconds, got {value!r}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt number ``attempt`` (2 for the first retry).

        Args:
            attempt: the attempt about to be made, counting the first as 1.

        Returns:
            A random number of seconds from half to all of ``min(max_backoff, backoff *
            2 ** (attempt - 2))`` (attempts below 2 wait as attempt 2 would).
        """
        full = min(self.max_backoff, self.backoff * 2.0 ** max(0, attempt - 2))
        return full * (0.5 + 0.5 * random.random())  # jitter, not a secret


class HealthMonitor:
    """Probes every probe-able worker of some pools, from start-up and then every
    ``interval`` seconds (docs/router.md "Worker health").

    Run it with ``await nursery.start(monitor.run)``: the first round of probes has ended
    when that returns, so readiness (``GET /health``) is right before the first request.
    Each probe is bounded by ``timeout`` seconds; a probe that fails or runs out of time
    marks its worker ``DOWN`` (skipped by selection), and one that succeeds re-admits it.
    Workers whose engine has no ``check_health()`` are not probed. Probes of one round
    run at once, each in its own task; a round ends when its slowest probe ends.

    Args:
        workers: the workers to watch (``pool.workers`` of each pool).
        interval: seconds between the end of one round and the start of the next.
        timeout: seconds a probe may take.

    Raises:
        ValueError: an interval or timeout that is not a positive number of seconds.
    """

    def __init__(self, workers: Iterable[Worker[DecodeEngine]], *, interval: float = 5.0,
                 timeout: float = 2.0) -> None:
        for name, value in (("interval", interval), ("timeout", timeout)):
            if not (isinstance(value, int | float) and 0 < value < math.inf):
                raise ValueError(f"the health {name} must be > 0 seconds, got {value!r}")
        self.workers = [worker for worker in workers if isinstance(worker.engine, HealthProbe)]
        self.interval = interval
        self.timeout = timeout
        #: Rounds of probes completed.
        self.rounds = 0
        self._round_done = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Probe forever; ``task_status.started()`` after the first round. Never raises
        for a worker's failure; cancel it to stop.

        With no probe-able worker it returns once ``started()`` was called, having probed
        nothing. Cancelled, it stops at once: probes in flight are cancelled (an HTTP
        adapter closes its connection) and recorded as nothing, so no worker's state
        changes.
        """
        await self.probe_all()
        task_status.started()
        if not self.workers:
            return
        while True:
            await trio.sleep(self.interval)
            await self.probe_all()

    async def probe_all(self) -> None:
        """One round: probe every watched worker at once, each bounded by ``timeout``
        seconds, and return when all have ended (a failure is recorded, never raised).
        Cancelled, the probes in flight are cancelled, recorded as nothing, and the round
        is not counted in :attr:`rounds`."""
        async with trio.open_nursery() as nursery:
            for worker in self.workers:
                nursery.start_soon(self._probe, worker)
        self.rounds += 1
        self._round_done.set()
        self._round_done = trio.Event()

    async def wait_rounds(self, count: int) -> None:
        """Return once ``count`` more rounds have completed (for tests and tools); at once
        if ``count`` <= 0. It probes nothing itself: :meth:`run` must be running."""
        target = self.rounds + count
        while self.rounds < target:
            await self._round_done.wait()

    async def _probe(self, worker: Worker[DecodeEngine]) -> None:
        engine = worker.engine
        assert isinstance(engine, HealthProbe)
        health = worker.health
        start = trio.current_time()
        ok = False
        # Named in the warning: an operator must tell a 404 (a wrong URL) from a timeout.
        reason = f"no answer within {self.timeout:g} s"
        with trio.move_on_after(self.timeout):
            try:
                await engine.check_health()
                ok = True
            except Exception as exc:  # any failure is a failed probe, never a crash
                logger.debug("health probe of %s failed: %r", worker.name, exc)
                reason = str(exc) or repr(exc)
        if not ok and health.probe_ok:
            logger.warning("worker %s failed its health probe (%s): skipped until one "
                           "succeeds", worker.name, reason)
        elif ok and not health.probe_ok:
            logger.warning("worker %s passed its health probe: selected again", worker.name)
        health.probe_result(ok, trio.current_time() - start, reason)
