"""Worker selection (rule S12 in docs/semantics.md; docs/design.md "Beyond one machine")."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import trio

from trio_disagg import (
    Annotated,
    CancelWindow,
    LeastOutstanding,
    LLMEngineOutput,
    NoWorkerAvailable,
    PrefillError,
    PreprocessedRequest,
    RequestContext,
    RoundRobin,
    RoutingHints,
    SessionAffinity,
    WorkerError,
    WorkerPool,
    cancel_window_of,
)


@attrs.define
class NullEngine:
    """A decode engine with only what the DecodeEngine protocol asks for."""

    name: str

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Annotated[LLMEngineOutput]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        send_channel.close()


def request(session: str | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r", model="m", routing=RoutingHints(session_id=session)
    )


def pool(n: int, **kwargs: object) -> WorkerPool[NullEngine]:
    return WorkerPool([NullEngine(f"w{i}") for i in range(n)], **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [({"policy": "round_robin"}, TypeError, "policy must be a SelectionPolicy"),
     ({"failure_threshold": 0}, ValueError, "failure_threshold must be >= 1"),
     ({"failure_threshold": 2.5}, TypeError, "failure_threshold must be an int"),
     ({"cooldown": -1}, ValueError, "cooldown must be a finite number of seconds >= 0"),
     ({"cooldown": math.nan}, ValueError, "cooldown must be a finite number"),
     ({"cancel_windows": {"w": "anytime"}}, TypeError,
      r"cancel_windows\['w'\] must be a trio_disagg.CancelWindow")],
    ids=["policy str", "threshold 0", "threshold float", "cooldown -1", "cooldown nan",
         "window str"])
def test_B10_S12_a_pool_refuses_settings_it_could_not_use(
    settings: dict[str, Any], error: type[Exception], match: str
) -> None:
    """Each was accepted: a str policy failed every request with an AttributeError; a
    threshold below 1 or a negative or NaN cooldown left the circuit breaker without a
    meaning; and a cancel window given as its string value was kept as a str, which no
    window compares equal to, so the prefill was never cancelled (B10), in silence.
    Each is refused when the pool is made."""
    with pytest.raises(error, match=match):
        WorkerPool([NullEngine("w")], **settings)


@attrs.define
class WindowedEngine(NullEngine):
    """An engine that declares its own cancel window (B10), as a string by mistake."""

    cancel_window: object = "before_handoff"


def test_B10_an_engine_whose_cancel_window_is_not_one_is_refused() -> None:
    """It was read as ``never`` in silence: the prefill the engine said may be cancelled
    before the handoff was drained instead. Refused when the pool is made, naming it."""
    with pytest.raises(TypeError, match=r"engine 'p'.*cancel_window.*'before_handoff'"):
        WorkerPool([WindowedEngine("p")])
    assert cancel_window_of(NullEngine("q")) is CancelWindow.NEVER  # none declared
    engine = WindowedEngine("r", CancelWindow.ANYTIME)
    assert WorkerPool([engine]).workers[0].cancel_window is CancelWindow.ANYTIME


async def test_S12_round_robin_visits_each_worker_in_turn() -> None:
    workers = pool(3, policy=RoundRobin())
    picks = [workers.select(request()).name for _ in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]


async def test_S12_least_outstanding_prefers_the_idle_worker() -> None:
    workers = pool(3, policy=LeastOutstanding())
    busy = workers.workers[0]
    with workers.lease(busy), workers.lease(workers.workers[1]):
        assert workers.select(request()).name == "w2"
        assert busy.outstanding == 1
    assert busy.outstanding == 0


async def test_S12_session_affinity_is_stable_across_replicas() -> None:
    # Two router replicas with the same worker list, no shared state.
    replica_a = pool(5, policy=SessionAffinity())
    replica_b = pool(5, policy=SessionAffinity())
    sessions = [f"session-{i}" for i in range(200)]
    picks_a = [replica_a.select(request(s)).name for s in sessions]
    picks_b = [replica_b.select(request(s)).name for s in sessions]
    assert picks_a == picks_b
    assert len(set(picks_a)) == 5  # spread over every worker


async def test_S12_session_affinity_moves_only_the_removed_workers_sessions() -> None:
    full = pool(5, policy=SessionAffinity())
    smaller = WorkerPool([w.engine for w in full.workers[:4]], policy=SessionAffinity())
    for i in range(200):
        before = full.select(request(f"s{i}")).name
        after = smaller.select(request(f"s{i}")).name
        if before != "w4":
            assert after == before


async def test_S12_pinned_worker_is_used_when_healthy() -> None:
    workers = pool(3, policy=RoundRobin())
    assert workers.select(request(), pinned="w2").name == "w2"
    assert workers.select(request(), pinned="nope").name == "w0"


async def test_unhealthy_worker_is_skipped_for_the_cooldown(autojump_clock: trio.abc.Clock) -> None:
    workers = pool(2, policy=RoundRobin(), failure_threshold=2, cooldown=5.0)
    bad = workers.workers[0]
    workers.record_failure(bad)
    assert {workers.select(request()).name for _ in range(4)} == {"w0", "w1"}
    workers.record_failure(bad)  # second in a row: cooling down
    assert {workers.select(request()).name for _ in range(4)} == {"w1"}
    await trio.sleep(5.0)
    assert {workers.select(request()).name for _ in range(4)} == {"w0", "w1"}


async def test_success_resets_consecutive_failures() -> None:
    workers = pool(1, failure_threshold=2)
    worker = workers.workers[0]
    workers.record_failure(worker)
    workers.record_success(worker)
    workers.record_failure(worker)
    assert workers.select(request()).name == "w0"
    assert worker.failures_total == 2


async def test_panic_routing_when_every_worker_cools_down() -> None:
    """A burst of failures cannot turn the whole pool into refusals."""
    workers = pool(2, policy=RoundRobin(), failure_threshold=1)
    for worker in workers.workers:
        workers.record_failure(worker)
    assert workers.healthy() == []
    assert {workers.select(request()).name for _ in range(4)} == {"w0", "w1"}


async def test_a_refused_bad_request_is_not_a_worker_failure() -> None:
    workers = pool(1, failure_threshold=1)
    worker = workers.workers[0]
    workers.record_failure(worker, _refusal(400))
    assert workers.healthy() == [worker]
    workers.record_failure(worker, _refusal(429))  # too busy: as a 503
    assert workers.healthy() == []


def _refusal(status: int) -> Exception:
    error = PrefillError("prefill worker refused")
    error.__cause__ = WorkerError("refused", status=status)
    return error


async def test_no_worker_available_only_for_an_empty_pool() -> None:
    with pytest.raises(NoWorkerAvailable, match="no workers"):
        pool(0).select(request())


def test_duplicate_worker_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        WorkerPool([NullEngine("a"), NullEngine("a")])


async def test_B9_asking_for_an_alternative_gives_no_half_open_trial(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``has_alternative`` answers without choosing: a half-open worker's one trial is
    left for the retry that ``alternative`` then chooses it for."""
    workers = pool(2, cooldown=10.0, failure_threshold=1)
    tried, ejected = workers.workers
    workers.record_failure(ejected, WorkerError("down", status=502, worker="w1"))
    assert not workers.has_alternative([tried])  # ejected, cooling down
    await trio.sleep(10.0)  # half-open
    assert workers.has_alternative([tried]) and workers.has_alternative([tried])
    assert workers.alternative(request(), [tried]) is ejected  # its trial
    assert not workers.has_alternative([tried])  # one trial at a time
    assert workers.alternative(request(), [tried]) is None


def test_an_engine_without_the_protocol_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="str name and a generate method"):
        WorkerPool([object()])  # type: ignore[type-var]
    with pytest.raises(TypeError, match="str name"):
        WorkerPool([NullEngine(None)])  # type: ignore[arg-type]
