"""Worker pools and worker selection (rule S12 in docs/semantics.md; docs/design.md "Beyond
one machine")."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

import trio

from ._checks import check_pool_arguments
from ._engine import CancelWindow, DecodeEngine, cancel_window_of
from ._errors import NoWorkerAvailable
from ._health import HealthProbe, HealthState, WorkerHealth, worker_fault
from ._protocols import PreprocessedRequest

#: The engine type of a pool: a prefill pool holds PrefillEngines, a decode pool
#: DecodeEngines (covariant: a pool of PrefillEngines is a pool of DecodeEngines too).
E = TypeVar("E", bound=DecodeEngine, covariant=True)


class Worker(Generic[E]):
    """One engine in a pool, with the counters selection and metrics need.

    A :class:`WorkerPool` makes its workers from its engines; read them, the pool and the
    router update them.

    Args:
        engine: the engine.
        cancel_window: overrides the engine's own ``cancel_window`` (B10); None: the
            engine's (:attr:`~trio_disagg.CancelWindow.NEVER` if it has none).

    Attributes:
        engine: the engine itself.
        outstanding: requests dispatched to it and not yet finished (rule B5 in docs/semantics.md).
        health: its circuit breaker and probe results (docs/router.md "Worker health").
        served_total, failures_total: lifetime counts (failures: its own faults only).
        cancel_window: when the router may cancel a prefill on this worker (B10): the
            engine's own ``cancel_window`` unless the pool overrides it.
    """

    __slots__ = (
        "cancel_window",
        "engine",
        "failures_total",
        "health",
        "outstanding",
        "served_total",
    )

    def __init__(self, engine: E, cancel_window: CancelWindow | None = None) -> None:
        self.engine = engine
        self.cancel_window = (cancel_window if cancel_window is not None
                              else cancel_window_of(engine))
        self.outstanding = 0
        self.health = WorkerHealth(probed=isinstance(engine, HealthProbe))
        self.served_total = 0
        self.failures_total = 0

    @property
    def name(self) -> str:
        """The engine's ``name``: unique in its pool, the label of its metrics."""
        return self.engine.name

    @property
    def state(self) -> HealthState:
        """Its health state now (:meth:`WorkerHealth.state` at ``trio.current_time()``).

        Raises:
            RuntimeError: called outside a trio run.
        """
        return self.health.state(trio.current_time())

    def __repr__(self) -> str:
        return f"<Worker {self.name!r} outstanding={self.outstanding}>"


#: Any worker, of either pool: what a :class:`SelectionPolicy` chooses among.
W = TypeVar("W", bound="Worker[DecodeEngine]")


class _Lease(Generic[W]):
    """:meth:`WorkerPool.lease`: a slotted context manager, not a generator, as every
    request in flight holds one (docs/design.md P3)."""

    __slots__ = ("worker",)

    def __init__(self, worker: W) -> None:
        self.worker = worker

    def __enter__(self) -> W:
        self.worker.outstanding += 1
        return self.worker

    def __exit__(self, *exc: object) -> None:
        self.worker.outstanding -= 1


class SelectionPolicy(Protocol):
    """Chooses one of the healthy workers for a request (rule S12 in docs/semantics.md).

    A policy is synchronous and must not block: the pool calls it for every request, and
    has already filtered out the workers that cannot take one (ejected, down, or
    half-open with a trial in flight; or, in panic routing, the workers whose probe did
    not fail).
    """

    def choose(self, workers: Sequence[W], request: PreprocessedRequest) -> W:
        """Choose one of ``workers`` for ``request``.

        Args:
            workers: the candidates, never empty, in the pool's order.
            request: the request (its ``routing`` and ``body`` may inform the choice).

        Returns:
            One of ``workers``.
        """
        ...


class RoundRobin:
    """Each worker in turn: the ``n``-th request goes to ``workers[n % len(workers)]``
    of the candidates it was offered (one counter over all requests, so a candidate list
    that changes shifts the turn)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers: Sequence[W], request: PreprocessedRequest) -> W:
        return workers[next(self._counter) % len(workers)]


class LeastOutstanding:
    """The worker with the fewest outstanding requests (first one on a tie); the pool's
    default. ``outstanding`` counts requests dispatched and not yet finished, including a
    prefill the keeper still drains."""

    def choose(self, workers: Sequence[W], request: PreprocessedRequest) -> W:
        return min(workers, key=lambda worker: worker.outstanding)


class SessionAffinity:
    """A consistent hash of the session id over the workers.

    Rendezvous (highest random weight) hashing: every router replica with the same worker
    list picks the same worker for a session with no shared state, and removing a worker
    moves only its own sessions. Requests without a session id go to ``fallback``.

    The session id is ``request.routing.session_id`` (the server sets it from the
    ``X-Session-Id`` header, else the body's ``user``). Load is not considered: a busy
    session stays on its worker while that worker can take requests.

    Args:
        fallback: for requests without a session id (default :class:`LeastOutstanding`).
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


#: Characters of a prompt's beginning that :class:`PrefixAffinity` hashes.
PREFIX_CHARS = 256
#: How far above the average load :class:`PrefixAffinity` lets a worker go.
LOAD_FACTOR = 1.25


class PrefixAffinity:
    """Requests whose prompts begin alike go to the same worker, within a bound on its
    load: consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam,
    2018).

    The key is the prompt's beginning (:func:`prompt_prefix`): a chat's leading system
    (or developer) messages, else its first ``prefix_chars`` characters; a completion's
    first ``prefix_chars`` characters. Requests sharing a system prompt then reach the
    worker that already holds its KV in its prefix cache. The workers are ranked for the
    key by rendezvous hashing, as :class:`SessionAffinity` ranks them for a session (every
    replica with the same workers ranks them alike, with no shared state; removing a
    worker moves only its own keys), and the first one in that order whose load stays
    within the bound gets the request: a worker that would have more than
    ``ceil(load_factor * (outstanding requests of all + 1) / workers)`` requests in flight
    is skipped for the next. One hot system prompt therefore spills over to its
    next-ranked workers instead of queueing on one. A request with no prompt to key on
    goes to ``fallback``.

    Args:
        prefix_chars: the characters of the prompt that make the key (>= 1).
        load_factor: the bound, as a multiple of the average load (>= 1; 1.25: a worker
            may carry a quarter more than the average).
        fallback: for requests without a prompt (default :class:`LeastOutstanding`).

    Raises:
        ValueError: ``prefix_chars`` < 1 or ``load_factor`` < 1 (or NaN).
    """

    def __init__(
        self,
        *,
        prefix_chars: int = PREFIX_CHARS,
        load_factor: float = LOAD_FACTOR,
        fallback: SelectionPolicy | None = None,
    ) -> None:
        if prefix_chars < 1:
            raise ValueError(f"prefix_chars must be >= 1, got {prefix_chars}")
        if not load_factor >= 1:  # also refuses NaN
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.prefix_chars = prefix_chars
        self.load_factor = load_factor
        self.fallback = fallback if fallback is not None else LeastOutstanding()

    def choose(self, workers: Sequence[W], request: PreprocessedRequest) -> W:
        prefix = prompt_prefix(request.body, self.prefix_chars)
        if prefix is None:
            return self.fallback.choose(workers, request)
        load = sum(worker.outstanding for worker in workers) + 1  # with this request
        bound = math.ceil(self.load_factor * load / len(workers))
        ranked = sorted(workers, key=lambda worker: _weight(prefix, worker.name),
                        reverse=True)
        for worker in ranked:
            if worker.outstanding + 1 <= bound:
                return worker
        return ranked[0]  # unreachable: the least loaded is at most the average


def prompt_prefix(body: Mapping[str, object], chars: int = PREFIX_CHARS) -> str | None:
    """The beginning of a request's prompt, :class:`PrefixAffinity`'s key; None if the
    body has no prompt.

    A chat's leading ``system`` and ``developer`` messages (the part requests share),
    else all its messages, as ``role`` and text; a completion's ``prompt`` (the first
    of a batch; token ids as their decimal text). Cut to ``chars`` characters.

    Args:
        body: the client's request body (OpenAI completions or chat completions).
        chars: the length of the key, in characters.

    Returns:
        The key, or None when ``body`` has neither ``messages`` nor a ``prompt`` to key
        on (an empty list, a prompt of another type).
    """
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        leading = []
        for message in messages:
            if not isinstance(message, Mapping) or message.get("role") not in (
                    "system", "developer"):
                break
            leading.append(message)
        parts = [f"{message.get('role')}\x00{_content_text(message.get('content'))}"
                 for message in (leading or messages) if isinstance(message, Mapping)]
        return "\x01".join(parts)[:chars]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(type(item) is int for item in prompt):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return prompt[:chars]
    if isinstance(prompt, list) and prompt:
        return " ".join(map(str, prompt))[:chars]
    return None


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "".join(part["text"] for part in content
                       if isinstance(part, Mapping) and isinstance(part.get("text"), str))
    return ""


class WorkerPool(Generic[E]):
    """The workers of one role (prefill or decode) and how to pick among them.

    Each worker has a circuit breaker (docs/router.md "Worker health"): one that fails
    ``failure_threshold`` times in a row by its own fault (a transport failure, a 5xx, no
    answer in time) is ejected for ``cooldown`` seconds, then half-open: given one trial
    request at a time, whose result closes the breaker or ejects it again (a trial whose
    result never comes frees the next one after another ``cooldown``). A worker's 4xx counts as a
    success (it answered), and an answer the router refused as a handoff (S8, S9, B7) as
    nothing. A worker whose health probe failed (:class:`~trio_disagg.HealthMonitor`) is
    skipped until a probe succeeds.

    Args:
        engines: the workers; names must be unique.
        policy: how to choose among healthy workers (default :class:`LeastOutstanding`).
        failure_threshold: consecutive faults that eject a worker.
        cooldown: seconds an ejected worker is skipped before it is half-open.
        cancel_windows: per worker name, a cancel window that overrides the engine's own
            (B10); for the prefill pool.

    Raises:
        ValueError: on duplicate worker names, a cancel window for no such worker, a
            ``failure_threshold`` < 1, or a negative or infinite ``cooldown``.
        TypeError: an engine without a ``str`` ``name`` or a ``generate`` method; a
            ``policy`` without ``choose``, a cancel window that is no
            :class:`~trio_disagg.CancelWindow`.
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
        for engine in engines:
            if not (isinstance(getattr(engine, "name", None), str)
                    and callable(getattr(engine, "generate", None))):
                raise TypeError(f"a worker's engine needs a str name and a generate method "
                                f"(the PrefillEngine / DecodeEngine protocol), got {engine!r}")
        windows = dict(cancel_windows or {})
        check_pool_arguments(policy, failure_threshold, cooldown, windows)
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
        """The workers that count towards readiness: healthy or half-open (not ejected in
        their cool-down, not ``DOWN``). Call it inside a trio run (it reads the clock)."""
        now = trio.current_time()
        return [worker for worker in self.workers if worker.health.selectable(now)]

    def _choose(self, candidates: Sequence[Worker[E]], request: PreprocessedRequest
                ) -> Worker[E]:
        worker = self.policy.choose(candidates, request)
        worker.health.chosen(trio.current_time(), cooldown=self.cooldown)
        return worker

    def _choosable(self, tried: Collection[Worker[DecodeEngine]] = ()) -> list[Worker[E]]:
        now = trio.current_time()
        return [worker for worker in self.workers
                if worker.health.choosable(now) and worker not in tried]

    def select(self, request: PreprocessedRequest, *, pinned: str | None = None) -> Worker[E]:
        """Choose a worker for ``request``.

        Ejected workers are skipped, but never all of them: when every worker that has
        not failed its health probe is ejected, the policy chooses among those ("panic
        routing", as Envoy does below its panic threshold), so a burst of failures cannot
        turn the whole service into 503s; the health endpoint still reports the pool as
        unhealthy. Workers whose probe failed are never chosen.

        Args:
            request: the request; session affinity reads ``request.routing.session_id``.
            pinned: a worker name the request asked for; used if it may take a request
                now (healthy, or half-open with no trial in flight), else ignored.

        Returns:
            The chosen worker; if half-open, this request is its trial. The caller
            counts its outcome with :meth:`record_success` or :meth:`record_failure`.

        Raises:
            NoWorkerAvailable: the pool is empty, or every worker failed its probe.
        """
        if not self.workers:
            raise NoWorkerAvailable("no workers configured")
        if pinned is not None:
            worker = self._by_name.get(pinned)
            now = trio.current_time()
            if worker is not None and worker.health.choosable(now):
                worker.health.chosen(now, cooldown=self.cooldown)
                return worker
        return self._choose(self._candidates(), request)

    def available(self) -> Worker[E]:
        """A worker :meth:`select` could choose now, without choosing it: the policy is
        not asked and a half-open worker's trial is not given. The router checks the
        decode pool with it when a sequential request arrives, and chooses its decode
        worker only once the prefill staged the KV (rule S12 in docs/semantics.md).

        Returns:
            The first worker that may take a request now (in panic routing, the first
            whose probe did not fail).

        Raises:
            NoWorkerAvailable: the pool is empty, or every worker failed its probe.
        """
        if not self.workers:
            raise NoWorkerAvailable("no workers configured")
        now = trio.current_time()
        for worker in self.workers:  # no list: it is asked once per request
            if worker.health.choosable(now):
                return worker
        return self._candidates()[0]  # panic routing, or none: its error

    def _candidates(self) -> list[Worker[E]]:
        """What the policy chooses among (panic routing included); never empty."""
        candidates = self._choosable() or [
            worker for worker in self.workers if worker.health.probe_ok]
        if not candidates:  # the first failure's reason: the operator's fix, often
            why = next((f" ({worker.name}: {worker.health.probe_failure})" for worker in
                        self.workers if worker.health.probe_failure is not None), "")
            raise NoWorkerAvailable(f"every worker failed its health probe{why}")
        return candidates

    def alternative(
        self, request: PreprocessedRequest, tried: Collection[Worker[DecodeEngine]]
    ) -> Worker[E] | None:
        """A healthy worker not in ``tried``, for a retry (rule B9 in docs/semantics.md);
        None if there is none (no panic routing: a retry on an ejected worker is futile).

        Args:
            request: the request, for the policy.
            tried: the workers the leg already failed on.

        Returns:
            A worker chosen by the policy among those that may take a request now and are
            not in ``tried``, or None.
        """
        candidates = self._choosable(tried)
        return self._choose(candidates, request) if candidates else None

    def has_alternative(self, tried: Collection[Worker[DecodeEngine]]) -> bool:
        """Whether :meth:`alternative` would find a worker now, without choosing one: a
        half-open worker's trial goes to the retry itself, not to the check before its
        backoff (which gave it away, so that the retry found no worker)."""
        now = trio.current_time()
        return any(worker.health.choosable(now) and worker not in tried
                   for worker in self.workers)

    def lease(self, worker: W) -> _Lease[W]:
        """Count ``worker`` as having one more outstanding request for the block.

        ``with pool.lease(worker):`` adds one to ``worker.outstanding`` on entry and takes
        it away on exit, however the block ends (cancellation included). Synchronous: no
        checkpoint.
        """
        return _Lease(worker)

    def record_success(self, worker: Worker[DecodeEngine]) -> None:
        """Count a success of ``worker``: it closes its breaker (the worker answered) and
        adds one to ``served_total``."""
        worker.health.success()
        worker.served_total += 1

    def record_failure(
        self, worker: Worker[DecodeEngine], error: BaseException | None = None
    ) -> None:
        """Count a failure of ``worker`` with ``error`` (None: no answer in time).

        Only the worker's own faults count against it: a transport failure, a 5xx, a
        stream that ended with nothing. A 4xx is the worker refusing a bad request, so a
        success; an answer the router refused as a handoff (S8, S9, B7) or a prefill it
        ended on purpose (B6, B10) counts as neither (``worker_fault``).
        A fault adds one to ``failures_total`` and may eject the worker for ``cooldown``
        seconds (``failure_threshold`` in a row, or a failed half-open trial).

        Args:
            worker: the worker the leg ran on.
            error: what the leg raised or ended with (its cause chain is followed to a
                :class:`~trio_disagg.WorkerError`); None when the worker gave no answer
                in time.
        """
        fault = worker_fault(error)
        if fault is None:
            return
        if not fault:
            self.record_success(worker)
            return
        worker.failures_total += 1
        worker.health.fault(trio.current_time(), threshold=self.failure_threshold,
                            cooldown=self.cooldown)

    @property
    def outstanding(self) -> int:
        """Requests outstanding over all the pool's workers (B5)."""
        return sum(worker.outstanding for worker in self.workers)

