"""B5, B6 (with B1, C5, G4, G5, G8, G9): a client disconnect, or a stop or kill of its
context, at every task step of one request.

For each handoff style of the in-process mocks, and for a request that succeeds, fails in
its prefill (before or after the handoff) or fails in its decode (before or after its first
token): run the request once undisturbed and count N, the trio task steps until the client
is done; then for each k in 0..N run it again and cancel the request's nursery (what a
client disconnect does) just before the k-th step. Each time, the client's outcome must be
one the rules allow, and once the router and the keeper are idle nothing is left: no
request or drain in flight, no worker lease, no bootstrap room, no KV block held or (after
the lease) stranded; and what was left when the client went ended promptly (B6), not at a
deadline or a timeout. The same again with the client's context stopped or killed at
step k instead (C5, G9): the client reads on, and the prefill, on its own context, must
not fail because of it. With two decode workers (S12, B9), the decode placed once the
prefill staged its KV on another worker than the one the request was checked against on
arrival, and refused there: no pool counts the request twice at any step (a placement's
reservation and its leg's lease, or a retry's), nor at all once it is over.

The scheduler's random tie-breaking is seeded before each run, so a run cancelled at step
k mostly follows the undisturbed run up to that step (timers that expire in the same
instant are still ordered by object ids, which vary), and each seed gives other
interleavings. Every case is checked and the failures are reported together, grouped by
what went wrong, with the task steps around k. The number of distinct interleavings
covered (distinct sequences of stepped task names) is printed at the end of the module,
even without ``-s``.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import attrs
import pytest
import trio
import trio.lowlevel

from trio_disagg import (
    Annotated,
    DeadlineExceeded,
    Deadlines,
    DisaggRouter,
    FinishKind,
    HandoffStyle,
    LLMEngineOutput,
    PrefillError,
    PreprocessedRequest,
    RequestContext,
    TransferKeeper,
    WorkerError,
    WorkerPool,
)
from trio_disagg.engines import FaultPlan, LatencyModel, mock_cluster

Item = Annotated[LLMEngineOutput]
W = TypeVar("W")

SEQ = HandoffStyle.SEQUENTIAL
BOOT = HandoffStyle.BOOTSTRAP
CTX = HandoffStyle.CONTEXT_FIRST
#: Small non-zero delays: the prefill, the KV pull and each token take scheduler steps
#: of their own (10 prompt words: 10 ms of prefill, 1 ms of transfer, 10 ms a token).
LATENCY = LatencyModel(
    ttft_per_prompt_token=0.001, inter_token_latency=0.01, kv_transfer_per_token=0.0001
)
WORDS = 10
MAX_TOKENS = 2
KV_TTL = 20.0
BOOTSTRAP_TIMEOUT = 10.0
DEADLINES = Deadlines(prefill=5, handoff=5, decode_idle=5, terminal_hold=5, transfer=30)
#: Virtual seconds the router and the keeper get to become idle after the client is done.
SETTLE = 120.0
#: B6: the undisturbed request takes about 0.05 s; once the client is done, whatever is
#: left must end in well under a second, not at a deadline (5 s) or a timeout (10 s).
PROMPT = 1.0
#: Each seed gives its own undisturbed run (its N) and its own cancel points.
SCHEDULER_SEEDS = (5, 6, 7)

PREFILL_FAULT = "prefill_fail_after_handoff"
DECODE_FAULT = "decode_error_at:1"
SUCCESS_KINDS = frozenset({FinishKind.EOS, FinishKind.STOP, FinishKind.LENGTH,
                           FinishKind.CONTENT_FILTER})

#: (test id, distinct interleavings, runs, N per seed, distinct end paths) of each test.
SUMMARY: list[tuple[str, int, int, str, int]] = []


@pytest.fixture(scope="module", autouse=True)
def interleavings_summary(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print how many distinct interleavings the module covered, past pytest's capture."""
    yield
    if not SUMMARY:
        return
    lines = [f"  {name}: N={n}, {runs} runs, {distinct} distinct interleavings, "
             f"{paths} distinct end paths"
             for name, distinct, runs, n, paths in SUMMARY]
    total = sum(entry[1] for entry in SUMMARY)
    lines.append(f"covered {total} distinct interleavings")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    suspended = (capture.global_and_fixture_disabled() if capture is not None
                 else contextlib.nullcontext())
    with suspended:
        print("\n" + "\n".join(lines))


@contextlib.contextmanager
def seeded_scheduler(seed: int) -> Iterator[None]:
    """Fix trio's random choice of which runnable task goes first (it keeps no public
    knob: this is the module-level generator its run loop reads), then restore it."""
    rng = getattr(trio._core._run, "_r", None)
    if not isinstance(rng, random.Random):  # another trio: unseeded, still valid
        yield
        return
    state = rng.getstate()
    rng.seed(seed)
    try:
        yield
    finally:
        rng.setstate(state)


class Steps(trio.abc.Instrument):
    """Counts task steps and names them; just before step ``cancel_at`` cancels
    ``target`` (``how="disconnect"``), or calls ``context.stop_generating()`` or
    ``context.kill()`` (``how`` names it). All are synchronous, so fine in here."""

    def __init__(self, cancel_at: int | None = None, how: str = "disconnect") -> None:
        self.pools: tuple[WorkerPool[Any], ...] = ()
        self.most_outstanding = 0  # the most any pool counted at once (one request: 1)
        self.cancel_at = cancel_at
        self.how = how
        self.target: trio.CancelScope | None = None
        self.context: RequestContext | None = None
        self.names: list[str] = []
        self.client_steps: int | None = None  # steps until the client was done
        self.fired = False

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if len(self.names) == self.cancel_at and not self.fired:
            if self.how in ("stop_generating", "kill") and self.context is not None:
                getattr(self.context, self.how)()
                self.fired = True
            elif self.how == "disconnect" and self.target is not None:
                self.target.cancel()
                self.fired = True
        self.names.append(task.name)

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        for pool in self.pools:
            self.most_outstanding = max(self.most_outstanding, pool.outstanding)


@attrs.define
class Outcome:
    items: list[Item]
    raised: BaseException | None
    cancelled: bool  # the client was cancelled while its request ran
    stopped: bool = False  # the client's context was stopped (or killed)
    killed: bool = False  # ... killed

    def describe(self) -> str:
        parts = [_describe(item) for item in self.items]
        if self.raised is not None:
            parts.append(f"raised {type(self.raised).__name__}")
        if self.cancelled:
            parts.append("cancelled")
        if self.stopped:
            parts.append("(context stopped or killed)")
        return " ".join(parts) or "nothing"


def _describe(item: Item) -> str:
    if item.is_error:
        return "error"
    data = item.data
    if data is None:
        return "empty"
    if data.finish_reason is not None:
        return f"finish:{data.finish_reason.kind.value}"
    return "token"


def _is_terminal(item: Item) -> bool:
    return item.is_error or (item.data is not None and item.data.finish_reason is not None)


def _is_success(item: Item) -> bool:
    return (not item.is_error and item.data is not None
            and item.data.finish_reason is not None
            and item.data.finish_reason.kind in SUCCESS_KINDS)


def check_outcome(outcome: Outcome, fault: str | None) -> str | None:
    """Why the client's outcome is not one the rules allow, or None."""
    items = outcome.items
    terminals = [i for i, item in enumerate(items) if _is_terminal(item)]
    if terminals and terminals[0] != len(items) - 1:
        return f"items after a terminal (G8): {outcome.describe()}"
    if outcome.raised is not None and not isinstance(
            outcome.raised, PrefillError | WorkerError | DeadlineExceeded):
        return f"unexpected exception {outcome.raised!r}"
    if outcome.raised is not None and items:
        return f"raised after items were streamed: {outcome.describe()}"
    success = bool(terminals) and _is_success(items[-1])
    failure = outcome.raised is not None or (bool(terminals) and not success)
    tokens = sum(len(item.data.token_ids) for item in items if item.data is not None)
    if outcome.stopped:
        # C3: the producers were asked to stop; whatever they sent stays valid, and a
        # stream cut short by the stop ends with a terminal (a cancelled finish), one cut
        # short by a kill with a terminal or nothing more.
        if not outcome.killed and not terminals and outcome.raised is None:
            return f"a stopped stream ended with no terminal (C3): {outcome.describe()}"
        if success and fault is not None and fault.startswith("prefill"):
            return f"a success although the {fault} fault failed the request: " \
                   f"{outcome.describe()}"
        return None
    if fault is None:
        if failure:
            return f"a request with no fault failed: {outcome.describe()}"
        if success and tokens != MAX_TOKENS:
            return f"success with {tokens} tokens, not {MAX_TOKENS}: {outcome.describe()}"
        if not success and not outcome.cancelled:
            return f"the stream ended with no terminal (B4): {outcome.describe()}"
        return None
    if success:
        return f"a success although the {fault} fault failed the request: " \
               f"{outcome.describe()}"
    if not failure and not outcome.cancelled:
        return f"the {fault} fault reached the client as no error: {outcome.describe()}"
    if fault == DECODE_FAULT and outcome.raised is not None:
        return f"a decode failure after the first token was raised: {outcome.describe()}"
    return None


def make_request(fault: str | None) -> PreprocessedRequest:
    body: dict[str, Any] = {"model": "mock", "prompt": " ".join(["w"] * WORDS),
                            "max_tokens": MAX_TOKENS}
    if fault is not None:
        body["fault"] = fault
    return PreprocessedRequest(request_id="req-1", model="mock", body=body,
                               max_tokens=MAX_TOKENS)


def _leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def client(router: DisaggRouter, request: PreprocessedRequest, steps: Steps) -> Outcome:
    """The client: reads its stream to the end; ``steps`` may cancel its nursery."""
    items: list[Item] = []
    raised: BaseException | None = None
    cancelled = False
    context = steps.context = RequestContext(request.request_id)
    try:
        async with trio.open_nursery() as nursery:
            steps.target = nursery.cancel_scope
            stream = await router.stream(nursery, request, context)
            with stream.outputs:
                async for item in stream.outputs:
                    items.append(item)
        cancelled = nursery.cancel_scope.cancelled_caught
    except* Exception as group:  # judged by check_outcome
        raised = _leaf(group)
        cancelled = steps.fired and steps.how == "disconnect"
    return Outcome(items, raised, cancelled, stopped=steps.fired and steps.how != "disconnect",
                   killed=steps.fired and steps.how == "kill")


@attrs.define
class Run:
    outcome: Outcome
    steps: Steps
    problems: list[str]
    end: str  # the outcome and the end state, to tell end paths apart


class LastWorker:
    """A decode policy that places on the last candidate: never the worker a sequential
    request was checked against on arrival (the pool's first, S12)."""

    def choose(self, workers: Sequence[W], request: PreprocessedRequest) -> W:
        return workers[-1]


@attrs.frozen
class Fleet:
    """Two decode workers for the late placement (S12): the request is placed on the
    last, which refuses it with ``rejects`` (B9 then moves a sequential decode to the
    first; the other styles' decode legs are part of the transfer and are not moved)."""

    decodes: int = 1
    rejects: bool = False


async def run_once(style: HandoffStyle, fault: str | None, cancel_at: int | None,
                   seed: int, how: str = "disconnect", fleet: Fleet = Fleet()) -> Run:
    cluster = mock_cluster(decode=fleet.decodes, style=style, latency=LATENCY, kv_ttl=KV_TTL,
                           bootstrap_timeout=BOOTSTRAP_TIMEOUT)
    if fleet.rejects:
        cluster.decode[-1].fault_plan = FaultPlan(faults=["decode_reject"])
    problems: list[str] = []
    steps = Steps(cancel_at, how)
    async with TransferKeeper() as keeper:
        router = DisaggRouter(
            WorkerPool(cluster.prefill),
            WorkerPool(cluster.decode, policy=LastWorker() if fleet.decodes > 1 else None),
            keeper, deadlines=DEADLINES)
        steps.pools = (router.prefill, router.decode)
        with seeded_scheduler(seed):
            trio.lowlevel.add_instrument(steps)
            try:
                outcome = await client(router, make_request(fault), steps)
                steps.client_steps = len(steps.names)
                done_at = trio.current_time()
                try:
                    with trio.fail_after(SETTLE):
                        await router.wait_idle()
                        await keeper.wait_idle()
                        await router.wait_idle()
                except trio.TooSlowError:
                    problems.append(f"not idle {SETTLE:g} s after the client was done: "
                                    f"router.in_flight={router.in_flight}, "
                                    f"keeper.in_flight={keeper.in_flight}")
                else:
                    if (late := trio.current_time() - done_at) > PROMPT:
                        problems.append(f"idle only {late:.3g} s after the client was done "
                                        f"(B6: a leg waited for a deadline or a timeout)")
            finally:
                trio.lowlevel.remove_instrument(steps)
        # A refused kept decode leg is not moved (B9): the client sees the refusal.
        refused = "decode_reject" if fleet.rejects and style is not SEQ else None
        if (why := check_outcome(outcome, fault or refused)) is not None:
            problems.append(why)
        if router.in_flight:
            problems.append(f"router.in_flight == {router.in_flight}")
        if keeper.in_flight:
            problems.append(f"keeper.in_flight == {keeper.in_flight}")
        if keeper.cancelled_total:
            problems.append("the prefill drain was cancelled (T1, G9: the mocks declare no "
                            "cancel window, so the prefill runs to its end)")
        if fault is None and keeper.failed_total:
            problems.append("the prefill failed although nothing was injected (G9)")
        if steps.most_outstanding > 1:
            problems.append(f"one request counted {steps.most_outstanding} times on a pool "
                            f"at once (a reservation and a lease, or two reservations)")
        if router.prefill.outstanding or router.decode.outstanding:
            problems.append(f"worker leases outstanding: prefill "
                            f"{router.prefill.outstanding}, decode {router.decode.outstanding}")
        await trio.sleep(KV_TTL + 1)  # past the lease: KV nobody consumed is stranded now
        counters = cluster.counters()
        if counters.held_blocks:
            problems.append(f"held_blocks == {counters.held_blocks}: {counters}")
        if counters.stranded_blocks:
            problems.append(f"stranded_blocks == {counters.stranded_blocks}: {counters}")
        rooms = sum(engine.kv.open_rooms for engine in cluster.prefill)
        if rooms:
            problems.append(f"{rooms} bootstrap room(s) still open")
        end = (f"{outcome.describe()} | served={counters.served} aborted={counters.aborted} "
               f"expired={counters.expired} | {'; '.join(problems)}")
    return Run(outcome, steps, problems, end)


FAULTS = [None, "prefill_fail_before_handoff", PREFILL_FAULT,
          "decode_fail_before_first_token", DECODE_FAULT]


STYLE_IDS = {SEQ: "sequential", BOOT: "bootstrap", CTX: "context_first"}
STYLES = [SEQ, CTX, BOOT]


def _fault_id(fault: str | None) -> str:
    return (fault or "no_fault").replace(":", "_")


@pytest.mark.parametrize("fault", FAULTS, ids=_fault_id)
@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS.get)
async def test_B5_B6_client_cancelled_at_every_step(
    autojump_clock: trio.abc.Clock, request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture, style: HandoffStyle, fault: str | None,
) -> None:
    """Cancel the client (its request's nursery) just before each task step k of the
    request, k = 0..N: its outcome is one the rules allow (a complete success where no
    fault, an error item or a refusal where a fault, or cancelled and nothing wrong
    seen), nothing is left in flight, leased, held or stranded, and what was left ended
    promptly (B5, B6, B1, T1, G9)."""
    caplog.set_level(logging.ERROR, logger="trio_disagg")  # one warning per failed drain
    await every_step(request.node.name, style, fault, "disconnect")


@pytest.mark.parametrize("fault", FAULTS, ids=_fault_id)
@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS.get)
@pytest.mark.parametrize("action", ["stop_generating", "kill"])
async def test_C5_G9_client_context_stopped_at_every_step(
    autojump_clock: trio.abc.Clock, request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture, action: str, style: HandoffStyle, fault: str | None,
) -> None:
    """Stop or kill the client's context just before each task step k: the client reads
    on to the end of its stream, the prefill is never stopped (C5) and, with no fault
    injected, never fails (G9: its transfer completes), and the end state is as clean as
    after a disconnect (B5, B6)."""
    caplog.set_level(logging.ERROR, logger="trio_disagg")
    await every_step(request.node.name, style, fault, action)


@pytest.mark.parametrize("fault", [None, PREFILL_FAULT], ids=_fault_id)
@pytest.mark.parametrize("rejects", [False, True], ids=["placed", "placed_then_refused"])
@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS.get)
@pytest.mark.parametrize("how", ["disconnect", "stop_generating"])
async def test_S12_B9_decode_placed_late_at_every_step(
    autojump_clock: trio.abc.Clock, request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture, how: str, style: HandoffStyle, rejects: bool,
    fault: str | None,
) -> None:
    """Two decode workers, the request placed on the one it was not checked against on
    arrival (S12), which may refuse it (B9: a sequential decode moves to the other, a
    kept one fails): cancelled or stopped before each task step k, the request is counted
    on at most one worker of each pool at a time (its reservation hands over to its
    lease, a retry reserves nothing twice), and none counts it once it is over."""
    caplog.set_level(logging.ERROR, logger="trio_disagg")
    await every_step(request.node.name, style, fault, how, Fleet(decodes=2, rejects=rejects))


async def every_step(name: str, style: HandoffStyle, fault: str | None, how: str,
                     fleet: Fleet = Fleet()) -> None:
    interleavings: set[tuple[str, ...]] = set()
    ends: set[str] = set()
    failures: dict[str, list[tuple[int, int, str]]] = {}  # problems -> (seed, k, where)
    runs = 0
    sizes: list[int] = []
    for seed in SCHEDULER_SEEDS:
        reference = await run_once(style, fault, None, seed, how, fleet)
        runs += 1
        assert not reference.problems, f"undisturbed run (seed {seed}): {reference.problems}"
        assert reference.steps.client_steps is not None
        n = reference.steps.client_steps
        sizes.append(n)
        interleavings.add(tuple(reference.steps.names))
        ends.add(reference.end)
        for k in range(n + 1):
            run = await run_once(style, fault, k, seed, how, fleet)
            runs += 1
            interleavings.add(tuple(run.steps.names))
            ends.add(run.end)
            if run.problems:
                names = run.steps.names
                at = _short(names[k]) if k < len(names) else "(the end)"
                before = ", ".join(_short(name) for name in names[max(0, k - 2):k])
                key = f"{run.outcome.describe()}: {'; '.join(run.problems)}"
                verb = "cancelled" if how == "disconnect" else f"context.{how}()"
                failures.setdefault(key, []).append(
                    (seed, k, f"{verb} before {at}, after [{before}]"))
    SUMMARY.append((name, len(interleavings), runs,
                    "/".join(str(n) for n in sizes), len(ends)))
    if failures:
        count = sum(len(cases) for cases in failures.values())
        lines = [f"{count} of {runs - len(SCHEDULER_SEEDS)} cancel points fail "
                 f"({len(ends)} distinct end paths):"]
        for key, cases in failures.items():
            lines.append(f"- client saw {key}")
            lines.append(f"  at {_ranges(cases)}; e.g. seed={cases[0][0]} k={cases[0][1]}: "
                         f"{cases[0][2]}")
        pytest.fail("\n".join(lines))


def _ranges(cases: list[tuple[int, int, str]]) -> str:
    """``seed=5 k=0-24,30; seed=6 k=...``"""
    by_seed: dict[int, list[int]] = {}
    for seed, k, _ in cases:
        by_seed.setdefault(seed, []).append(k)
    parts = []
    for seed, ks in by_seed.items():
        spans: list[list[int]] = []
        for k in ks:
            if spans and k == spans[-1][-1] + 1:
                spans[-1].append(k)
            else:
                spans.append([k])
        text = [str(span[0]) if len(span) == 1 else f"{span[0]}-{span[-1]}" for span in spans]
        parts.append(f"seed={seed} k={','.join(text)}")
    return "; ".join(parts)


def _short(name: str) -> str:
    return name.removeprefix("trio_disagg.").removeprefix("_router.").removeprefix(
        "mock._engines.")
