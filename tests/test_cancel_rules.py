"""The client's context and the prefill leg: C5 and G9 while the prefill still runs, and
the G1 tie between a prefill failure and a decode refusal.

The prefill engine is wrapped in a recording engine that keeps the context it was given
and every stop or kill that context saw.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from trio_disagg import (
    Annotated,
    DeadlineExceeded,
    Deadlines,
    DisaggRouter,
    Gatekeeper,
    HandoffStyle,
    LLMEngineOutput,
    PrefillError,
    PrefillTask,
    PreprocessedRequest,
    RequestContext,
    TransferKeeper,
    WorkerError,
    WorkerPool,
)
from trio_disagg.engines import LatencyModel, MockCluster, MockPrefillEngine, mock_cluster
from trio_disagg.mock._pacing import sleep as mock_sleep

Item = Annotated[LLMEngineOutput]

SEQ = HandoffStyle.SEQUENTIAL
BOOT = HandoffStyle.BOOTSTRAP
STYLES = [SEQ, BOOT]
ACTIONS = ["stop_generating", "kill"]
WORDS = 100
#: 100 prompt words: 1 s of prefill, 1 s of KV transfer, then 0.1 s a token.
LATENCY = LatencyModel(
    ttft_per_prompt_token=0.01, inter_token_latency=0.1, kv_transfer_per_token=0.01
)
PREFILL_TIME = WORDS * 0.01
TRANSFER_TIME = WORDS * 0.01
KV_TTL = 100.0
DEADLINES = Deadlines(prefill=20, handoff=20, decode_idle=20, terminal_hold=20, transfer=60)
LOST = "prefill connection lost"


class RecordingPrefill:
    """Forwards to a mock prefill engine; records the context of each request and each
    stop or kill that context saw (``True`` for a kill)."""

    def __init__(self, inner: MockPrefillEngine) -> None:
        self.inner = inner
        self.name = inner.name
        self.handoff_style = inner.handoff_style
        self.bootstrap_host = inner.bootstrap_host
        self.bootstrap_port = inner.bootstrap_port
        self.contexts: list[RequestContext] = []
        self.stops: list[bool] = []
        self.returned = 0  # generate() calls that returned without raising

    def __getattr__(self, name: str) -> Any:  # anything else an engine may declare
        return getattr(self.inner, name)

    async def generate(  # noqa: ASYNC114 (the inner engine calls started())
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self.contexts.append(context)
        context.on_stop(self.stops.append)
        await self.inner.generate(request, context, send_channel, task_status=task_status)
        self.returned += 1


@attrs.define
class Setup:
    cluster: MockCluster
    prefill: RecordingPrefill
    keeper: TransferKeeper
    router: DisaggRouter


def setup(keeper: TransferKeeper, style: HandoffStyle) -> Setup:
    cluster = mock_cluster(style=style, latency=LATENCY, kv_ttl=KV_TTL)
    prefill = RecordingPrefill(cluster.prefill[0])
    router = DisaggRouter(WorkerPool([prefill]), WorkerPool(cluster.decode), keeper,
                          deadlines=DEADLINES)
    return Setup(cluster, prefill, keeper, router)


def make_request(request_id: str = "req-1", *, fault: str | None = None,
                 max_tokens: int = 3) -> PreprocessedRequest:
    body: dict[str, Any] = {"model": "mock", "prompt": " ".join(["w"] * WORDS),
                            "max_tokens": max_tokens}
    if fault is not None:
        body["fault"] = fault
    return PreprocessedRequest(request_id=request_id, model="mock", body=body,
                               max_tokens=max_tokens)


def leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def run_and_act(s: Setup, context: RequestContext, action: str, at: float
                      ) -> PrefillTask[Any] | None:
    """Send one request on ``context`` and read its stream; ``at`` seconds after it
    started, call ``context.<action>()`` (the prefill must still be running then).
    Returns the request's prefill task, if ``router.stream`` returned."""
    prefill: PrefillTask[Any] | None = None

    async def act() -> None:
        await trio.sleep(at)
        assert len(s.prefill.contexts) == 1 and s.prefill.returned == 0, \
            "the prefill is not running at the time of the action"
        getattr(context, action)()

    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(act)
                stream = await s.router.stream(nursery, make_request(), context)
                prefill = stream.prefill
                with stream.outputs:
                    async for _ in stream.outputs:
                        pass
    except* (PrefillError, WorkerError, DeadlineExceeded):
        pass  # any outcome: these tests are about the prefill
    with trio.fail_after(120):
        await s.router.wait_idle()
        await s.keeper.wait_idle()
    assert s.router.in_flight == 0
    assert s.keeper.in_flight == 0
    return prefill


# --- C5 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("style", STYLES, ids=lambda s: s.value)
async def test_C5_client_stop_or_kill_while_the_prefill_runs_never_reaches_the_prefill(
    autojump_clock: trio.testing.MockClock, style: HandoffStyle, action: str,
) -> None:
    """Half way through the prefill the client's context is stopped or killed: the
    prefill engine runs on a context of its own (the client's id, not linked to it) that
    is never stopped or killed, it finishes its work, and its KV is consumed: nothing is
    held or stranded."""
    async with TransferKeeper() as keeper:
        s = setup(keeper, style)
        context = RequestContext("req-1", {"session_id": "s-1"})
        await run_and_act(s, context, action, PREFILL_TIME / 2)
        assert len(s.prefill.contexts) == 1
        prefill_context = s.prefill.contexts[0]
        assert prefill_context is not context
        assert prefill_context.id == context.id
        assert prefill_context.metadata == context.metadata
        assert s.prefill.stops == [], "the prefill's context was stopped or killed"
        assert not prefill_context.is_stopped
        assert not prefill_context.is_killed
        assert s.prefill.returned == 1, "the prefill engine did not finish"
        await trio.sleep(KV_TTL + 1)  # past the lease: KV nobody consumed is stranded now
        counters = s.cluster.counters()
        assert counters.staged_blocks > 0, counters
        assert counters.held_blocks == 0, counters
        assert counters.stranded_blocks == 0, counters
        assert counters.freed_blocks == counters.staged_blocks, counters


# --- G9 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["prefill", "transfer"])
@pytest.mark.parametrize("action", ACTIONS)
async def test_G9_bootstrap_client_stop_or_kill_before_the_transfer_completed(
    autojump_clock: trio.testing.MockClock, action: str, phase: str,
) -> None:
    """Bootstrap style: the client's context is stopped or killed while the prefill
    computes, or while the decode pulls the KV. The decode must not leave the room before
    the transfer completed (that would fail the prefill and drop its KV): the prefill
    succeeds, its KV is pulled (served), nothing is held or stranded."""
    at = PREFILL_TIME / 2 if phase == "prefill" else PREFILL_TIME + TRANSFER_TIME / 2
    async with TransferKeeper() as keeper:
        s = setup(keeper, BOOT)
        context = RequestContext("req-1")
        task = await run_and_act(s, context, action, at)
        assert s.prefill.stops == [], "the prefill's context was stopped or killed"
        assert task is not None  # a bootstrap request returns once the decode accepted
        assert task.succeeded, f"the prefill failed: {task.error}"
        await trio.sleep(KV_TTL + 1)
        counters = s.cluster.counters()
        assert counters.served == 1, f"the decode did not pull the KV: {counters}"
        assert counters.held_blocks == 0, counters
        assert counters.stranded_blocks == 0, counters
        assert s.cluster.prefill[0].kv.open_rooms == 0


# --- G1 -----------------------------------------------------------------------------------


async def test_G1_tie_decode_refusal_prefill_looked_at_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The decode worker refuses (WorkerError before started) in the very instant the
    prefill drain fails: the caller gets the prefill's error, not the refusal, and the
    client context is stopped. Repeated, so both scheduling orders of the tie occur.
    (The tie with an accepting decode is in test_gate.py.)"""

    async def prefill_fails_in(seconds: float) -> None:
        await trio.sleep(seconds)
        raise PrefillError(LOST)

    async def refuses_in(  # noqa: ASYNC114, ASYNC128 (a worker that refuses)
        seconds: float, *, task_status: trio.TaskStatus[None]
    ) -> None:
        await trio.sleep(seconds)
        raise WorkerError("decode worker refused", status=503, worker="decode-0")

    async with TransferKeeper() as keeper:
        for _ in range(20):
            task = keeper.start(functools.partial(prefill_fails_in, 1), name="r-1")
            client = RequestContext("r-1")
            gate = Gatekeeper(task, client)
            async with trio.open_nursery() as nursery:
                with trio.fail_after(10), pytest.raises(PrefillError, match=LOST):
                    await gate.dispatch(nursery, refuses_in, 1)
            assert client.is_stopped


class RefusingDecode:
    """A decode worker that refuses each request ``delay`` seconds after it was sent."""

    def __init__(self, name: str, delay: float) -> None:
        self.name = name
        self.delay = delay
        self.handoff_style = BOOT
        self.bootstrap_host: str | None = None
        self.bootstrap_port: int | None = None

    async def generate(  # noqa: ASYNC114, ASYNC128 (a worker that refuses)
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with send_channel:
            # On the mock engines' clock, so that its refusal and a mock prefill's failure
            # due at the same instant are woken together: a tie.
            await mock_sleep(self.delay)
            raise WorkerError(f"{self.name} refused request {request.request_id!r}",
                              status=503, worker=self.name)


async def test_G1_tie_decode_refusal_at_the_router_prefill_error_wins(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Bootstrap style, through the router: the decode worker refuses in the same
    instant (of the clock) as the prefill fails: ``router.stream`` raises the prefill's
    error, not the WorkerError. Repeated, so both scheduling orders occur."""
    outcomes: list[str] = []
    async with TransferKeeper() as keeper:
        cluster = mock_cluster(style=BOOT, latency=LATENCY, kv_ttl=KV_TTL)
        decode = RefusingDecode("decode-0", PREFILL_TIME)
        router = DisaggRouter(WorkerPool(cluster.prefill),
                              WorkerPool([decode], failure_threshold=1000), keeper,
                              deadlines=DEADLINES)
        for i in range(10):
            request = make_request(f"req-{i}", fault="prefill_fail_before_handoff")
            context = RequestContext(request.request_id)
            try:
                with trio.fail_after(30):
                    async with trio.open_nursery() as nursery:
                        await router.stream(nursery, request, context)
                outcomes.append("no error")
            except* Exception as group:
                error = leaf(group)
                stopped = "" if context.is_stopped else " (client context not stopped)"
                outcomes.append(f"{type(error).__name__}{stopped}")
        with trio.fail_after(120):
            await router.wait_idle()
            await keeper.wait_idle()
        assert cluster.counters().held_blocks == 0
    assert dict(Counter(outcomes)) == {"PrefillError": len(outcomes)}
