"""Worker pools and worker selection (rule S12 in docs/semantics.md; docs/design.md "Beyond
one machine")."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

import trio

from ._engine import CancelWindow, DecodeEngine, cancel_window_of
from ._errors import NoWorkerAvailable, WorkerError
from ._protocols import PreprocessedRequest

#: The engine type of a pool: a prefill pool holds PrefillEngines, a decode pool
#: DecodeEngines (covariant: a pool of PrefillEngines is a pool of DecodeEngines too).
E = TypeVar("E", bound=DecodeEngine, covariant=True)


class Worker(Generic[E]):
    """One engine in a pool, with the counters selection and metrics need.

    Attributes:
        engine: the engine itself.
        outstanding: requests dispatched to it and not yet finished (rule B5 in docs/semantics.md).
        consecutive_failures: failures since its last success.
        unhealthy_until: ``trio.current_time()`` before which it is skipped.
        served_total, failures_total: lifetime counts.
        cancel_window: when the router may cancel a prefill on this worker (B10): the
            engine's own ``cancel_window`` unless the pool overrides it.
    """

    __slots__ = (
        "cancel_window",
        "consecutive_failures",
        "engine",
        "failures_total",
        "outstanding",
        "served_total",
        "unhealthy_until",
    )

    def __init__(self, engine: E, cancel_window: CancelWindow | None = None) -> None:
        self.engine = engine
        self.cancel_window = (cancel_window if cancel_window is not None
                              else cancel_window_of(engine))
        self.outstanding = 0
        self.consecutive_failures = 0
        self.unhealthy_until = -math.inf
        self.served_total = 0
        self.failures_total = 0

    @property
    def name(self) -> str:
        return self.engine.name

    def __repr__(self) -> str:
        return f"<Worker {self.name!r} outstanding={self.outstanding}>"


#: Any worker, of either pool: what a :class:`SelectionPolicy` chooses among.
W = TypeVar("W", bound="Worker[DecodeEngine]")


class SelectionPolicy(Protocol):
    """Chooses one of the healthy workers for a request."""

    def choose(self, workers: Sequence[W], request: PreprocessedRequest) -> W: ...


class RoundRobin:
    """Each worker in turn."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers: Sequence[W], request: PreprocessedRequest) -> W:
        return workers[next(self._counter) % len(workers)]


class LeastOutstanding:
    """The worker with the fewest outstanding requests (first one on a tie)."""

    def choose(self, workers: Sequence[W], request: PreprocessedRequest) -> W:
        return min(workers, key=lambda worker: worker.outstanding)


class SessionAffinity:
    """A consistent hash of the session id over the workers.

    Rendezvous (highest random weight) hashing: every router replica with the same worker
    list picks the same worker for a session with no shared state, and removing a worker
    moves only its own sessions. Requests without a session id go to ``fallback``.
    """

    def __init__(self, fallback: SelectionPolicy | None = None) -> None:
        self.fallback = fallback if fallback is not None else LeastOutstanding()

    def choose(self, workers: Sequence[W], request: PreprocessedRequest) -> W:
        session = request.routing.session_id
        if session is None:
            return self.fallback.choose(workers, request)
        return max(workers, key=lambda worker: _weight(session, worker.name))


def _weight(session: str, worker: str) -> bytes:
    return hashlib.blake2b(f"{session}\x00{worker}".encode(), digest_size=8).digest()


class WorkerPool(Generic[E]):
    """The workers of one role (prefill or decode) and how to pick among them.

    A worker that fails ``failure_threshold`` times in a row is skipped for ``cooldown``
    seconds; a success resets its count.

    Args:
        engines: the workers; names must be unique.
        policy: how to choose among healthy workers (default :class:`LeastOutstanding`).
        failure_threshold: consecutive failures that make a worker unhealthy.
        cooldown: seconds an unhealthy worker is skipped.
        cancel_windows: per worker name, a cancel window that overrides the engine's own
            (B10); for the prefill pool.

    Raises:
        ValueError: on duplicate worker names, or a cancel window for no such worker.
    """

    def __init__(
        self,
        engines: Sequence[E],
        *,
        policy: SelectionPolicy | None = None,
        failure_threshold: int = 3,
        cooldown: float = 5.0,
        cancel_windows: Mapping[str, CancelWindow] | None = None,
    ) -> None:
        windows = dict(cancel_windows or {})
        self.workers = [Worker(engine, windows.pop(engine.name, None)) for engine in engines]
        names = [worker.name for worker in self.workers]
        if len(set(names)) != len(names):
            raise ValueError(f"worker names must be unique, got {names}")
        if windows:
            raise ValueError(f"cancel windows for unknown workers: {sorted(windows)}")
        self._by_name = {worker.name: worker for worker in self.workers}
        self.policy: SelectionPolicy = policy if policy is not None else LeastOutstanding()
        self.failure_threshold = failure_threshold
        self.cooldown = cooldown

    def __len__(self) -> int:
        return len(self.workers)

    def healthy(self) -> list[Worker[E]]:
        now = trio.current_time()
        return [worker for worker in self.workers if worker.unhealthy_until <= now]

    def select(self, request: PreprocessedRequest, *, pinned: str | None = None) -> Worker[E]:
        """Choose a worker for ``request``.

        Workers cooling down are skipped, but never all of them: when every worker is
        cooling down the policy chooses among all of them ("panic routing", as Envoy does
        below its panic threshold), so a burst of failures cannot turn the whole service
        into 503s; the health endpoint still reports the pool as unhealthy.

        Args:
            request: the request; session affinity reads ``request.routing.session_id``.
            pinned: a worker name the request asked for; used if healthy.

        Raises:
            NoWorkerAvailable: the pool is empty.
        """
        if not self.workers:
            raise NoWorkerAvailable("no workers configured")
        if pinned is not None:
            worker = self._by_name.get(pinned)
            if worker is not None and worker.unhealthy_until <= trio.current_time():
                return worker
        candidates = self.healthy() or self.workers
        return self.policy.choose(candidates, request)

    @contextmanager
    def lease(self, worker: W) -> Iterator[W]:
        """Count ``worker`` as having one more outstanding request for the block."""
        worker.outstanding += 1
        try:
            yield worker
        finally:
            worker.outstanding -= 1

    def record_success(self, worker: Worker[DecodeEngine]) -> None:
        """Count a success of ``worker``; it ends a cool-down (the worker answered)."""
        worker.consecutive_failures = 0
        worker.unhealthy_until = -math.inf
        worker.served_total += 1

    def record_failure(
        self, worker: Worker[DecodeEngine], error: BaseException | None = None
    ) -> None:
        """Count a failure of ``worker``, or a success if ``error`` is the worker refusing
        a bad request (a 4xx): that is the client's fault, not the worker's."""
        if _client_error(error):
            self.record_success(worker)
            return
        worker.consecutive_failures += 1
        worker.failures_total += 1
        if worker.consecutive_failures >= self.failure_threshold:
            worker.unhealthy_until = trio.current_time() + self.cooldown

    @property
    def outstanding(self) -> int:
        return sum(worker.outstanding for worker in self.workers)


def _client_error(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, WorkerError):
            return 400 <= error.status < 500
        error = error.__cause__
    return False
