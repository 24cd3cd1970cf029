"""Decode placement (S12) with the library alone: a sequential handoff's decode worker is
chosen once the prefill staged the KV. What the request and the policies see before
that, a burst's spread, and a decode pool that lost every worker meanwhile."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import pytest
import trio
import trio.testing
from engine_support import StandIn

from trio_disagg import (
    Annotated,
    DeadlineExceeded,
    Deadlines,
    DisaggRouter,
    FinishKind,
    HandoffStyle,
    LeastOutstanding,
    LLMEngineOutput,
    NoWorkerAvailable,
    PrefixAffinity,
    PreprocessedRequest,
    RequestContext,
    RouterClosed,
    RoutingHints,
    SelectionPolicy,
    TransferKeeper,
    WorkerPool,
)
from trio_disagg.engines import LatencyModel, mock_cluster

W = TypeVar("W")
Item = Annotated[LLMEngineOutput]
LATENCY = LatencyModel(ttft_per_prompt_token=0.01, inter_token_latency=0.01,
                       kv_transfer_per_token=0.001)
DEADLINES = Deadlines(prefill=5, handoff=5, decode_idle=5, terminal_hold=5, transfer=30)


def make_request(request_id: str, *, fault: str | None = None) -> PreprocessedRequest:
    body: dict[str, Any] = {"model": "mock", "prompt": " ".join(["w"] * 10),
                            "max_tokens": 4}
    if fault is not None:
        body["fault"] = fault
    return PreprocessedRequest(request_id=request_id, model="mock", body=body,
                               max_tokens=4, routing=RoutingHints())


class Recording(LeastOutstanding):
    """The default policy, recording the decode worker each request it is asked about
    already names, and whether it carries a handoff."""

    def __init__(self) -> None:
        self.named: list[tuple[str | None, bool]] = []

    def choose(self, workers: Sequence[W], request: PreprocessedRequest) -> W:
        self.named.append((request.routing.decode_worker, request.prefill_result is not None))
        return super().choose(workers, request)  # type: ignore[type-var]


class RoutingSeen(StandIn):
    """A prefill engine that records the routing of each request it is sent."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.routings: list[RoutingHints] = []

    async def generate(self, request: PreprocessedRequest, *args: Any, **kwargs: Any) -> None:
        self.routings.append(request.routing)
        await self.engine.generate(request, *args, **kwargs)


async def read(router: DisaggRouter, request: PreprocessedRequest) -> tuple[Any, list[Item]]:
    async with trio.open_nursery() as nursery:
        stream = await router.stream(nursery, request, RequestContext(request.request_id))
        with stream.outputs:
            items = [item async for item in stream.outputs]
    return stream, items


@pytest.mark.parametrize("style", [HandoffStyle.SEQUENTIAL, HandoffStyle.CONTEXT_FIRST])
async def test_S12_no_decode_worker_is_named_before_the_decode_is_placed(
    autojump_clock: trio.abc.Clock, style: HandoffStyle,
) -> None:
    """Until the prefill staged the KV no decode worker is chosen, so none is named: not
    to the prefill worker, not to the decode policy when it chooses, not in a stream the
    prefill answered by itself (S7); the one chosen is named from then on. The policy
    chooses from the request as routed on arrival: only the pool's load has changed."""
    cluster = mock_cluster(decode=2, style=style, latency=LATENCY)
    prefill = RoutingSeen(cluster.prefill[0])
    policy = Recording()
    async with TransferKeeper() as keeper:
        router = DisaggRouter(WorkerPool([prefill]), WorkerPool(cluster.decode, policy=policy),
                              keeper, deadlines=DEADLINES)
        stream, items = await read(router, make_request("placed"))
        terminal, _ = await read(router, make_request("answered", fault="eos_first_token"))
    assert [routing.decode_worker for routing in prefill.routings] == [None, None]
    # Asked once, for the request that reached a decode, as it was routed on arrival.
    assert policy.named == [(None, False)]
    assert stream.decode_worker in ("decode-0", "decode-1")
    assert stream.handoff.request.routing.decode_worker == stream.decode_worker
    assert items[-1].data is not None and items[-1].data.finish_reason is not None
    assert items[-1].data.finish_reason.kind is FinishKind.LENGTH
    assert terminal.decode_worker is None
    assert terminal.handoff.request.routing.decode_worker is None


@pytest.mark.parametrize(("policy", "split"), [
    (LeastOutstanding, [10, 10]),
    # One prompt: its first-ranked worker up to 1.25 times the average load, then the
    # next (the bound counts the decodes placed before, not those of the moment).
    (PrefixAffinity, [7, 13]),
], ids=["least-outstanding", "prefix-affinity"])
async def test_S12_a_burst_is_spread_and_every_count_returns_to_zero(
    autojump_clock: trio.abc.Clock, policy: type[SelectionPolicy], split: list[int],
) -> None:
    """20 sequential requests at once over 2 decode workers, placed as their KV is
    staged: spread as the policy's load bound says, and nothing counted once over."""
    cluster = mock_cluster(decode=2, latency=LATENCY)
    async with TransferKeeper() as keeper:
        router = DisaggRouter(WorkerPool(cluster.prefill),
                              WorkerPool(cluster.decode, policy=policy()),
                              keeper, deadlines=DEADLINES)
        placed: list[str | None] = []

        async def one(i: int) -> None:
            stream, _ = await read(router, make_request(f"burst-{i}"))
            placed.append(stream.decode_worker)

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, i)
        await keeper.wait_idle()
        assert sorted(placed.count(name) for name in ("decode-0", "decode-1")) == split
        assert router.decode.outstanding == 0 and router.prefill.outstanding == 0


async def test_S12_B1_no_decode_worker_left_when_the_kv_is_staged(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Every decode worker fails its probe while the prefill runs: the client gets
    NoWorkerAvailable (bare) once the KV is staged, the staged KV is consumed by the B1
    cleanup once a decode worker is back, and nothing stays counted."""
    cluster = mock_cluster(decode=2, latency=LATENCY)
    async with TransferKeeper() as keeper:
        router = DisaggRouter(WorkerPool(cluster.prefill), WorkerPool(cluster.decode),
                              keeper, deadlines=DEADLINES)
        async with trio.open_nursery() as nursery:
            await trio.testing.wait_all_tasks_blocked()
            request = make_request("orphan")
            started = trio.Event()
            raised: list[Exception] = []

            async def client() -> None:
                started.set()
                try:
                    async with trio.open_nursery() as streams:
                        await router.stream(streams, request, RequestContext("orphan"))
                except* NoWorkerAvailable as group:  # the router's own: one, bare
                    raised.extend(group.exceptions)

            nursery.start_soon(client)
            await started.wait()
            await trio.testing.wait_all_tasks_blocked()  # the prefill runs
            assert keeper.in_flight == 1
            for worker in router.decode.workers:
                worker.health.probe_result(False, 0.0)
        assert [str(exc) for exc in raised] == [
            "no decode worker available: every worker failed its health probe"]
        assert router.counters.staged_kv_cleanups == 1
        assert router.decode.outstanding == 0
        router.decode.workers[1].health.probe_result(True, 0.0)
        await keeper.wait_idle()
    assert router.counters.staged_kv_cleanup_failures == 0
    counters = cluster.counters()
    assert counters.held_blocks == 0 and counters.stranded_blocks == 0, counters
    assert router.decode.outstanding == 0 and router.in_flight == 0


class Silent:
    """A decode engine that takes requests and never accepts them (until cancelled);
    a B1 cleanup decode (one token, not streamed) it passes to ``engine``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name: str = engine.name

    async def generate(self, request: PreprocessedRequest, *args: Any, **kwargs: Any) -> None:
        if request.max_tokens != 1:  # not a cleanup decode
            await trio.sleep_forever()
        await self.engine.generate(request, *args, **kwargs)


@pytest.mark.parametrize("style", [HandoffStyle.SEQUENTIAL, HandoffStyle.CONTEXT_FIRST])
async def test_S12_B2_a_placed_decode_not_accepted_by_the_handoff_deadline(
    autojump_clock: trio.abc.Clock, style: HandoffStyle,
) -> None:
    """The decode placed once the KV is staged is never accepted: the client gets
    DeadlineExceeded, the staged KV is consumed (B1), and neither the reservation nor a
    lease outlives the request."""
    cluster = mock_cluster(decode=2, style=style, latency=LATENCY)
    decodes = [Silent(engine) for engine in cluster.decode]
    async with TransferKeeper() as keeper:
        router = DisaggRouter(WorkerPool(cluster.prefill), WorkerPool(decodes), keeper,
                              deadlines=DEADLINES)
        raised: list[Exception] = []
        try:
            async with trio.open_nursery() as nursery:
                await router.stream(nursery, make_request("silent"), RequestContext("s"))
        except* DeadlineExceeded as group:
            raised.extend(group.exceptions)
        assert len(raised) == 1
        await keeper.wait_idle()
    assert router.counters.staged_kv_cleanups == 1
    assert router.counters.staged_kv_cleanup_failures == 0
    counters = cluster.counters()
    assert counters.held_blocks == 0 and counters.stranded_blocks == 0, counters
    assert router.decode.outstanding == 0 and router.in_flight == 0


async def test_S12_B3_a_request_placed_after_the_router_closed(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The router closes while a request's prefill runs: the request is still placed and
    served, a new one is refused, and nothing stays counted."""
    cluster = mock_cluster(decode=2, latency=LATENCY)
    async with TransferKeeper() as keeper:
        router = DisaggRouter(WorkerPool(cluster.prefill), WorkerPool(cluster.decode),
                              keeper, deadlines=DEADLINES)
        served: list[Any] = []

        async def client() -> None:
            served.append(await read(router, make_request("in-flight")))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client)
            await trio.testing.wait_all_tasks_blocked()  # its prefill runs
            assert keeper.in_flight == 1 and router.decode.outstanding == 0
            router.close()
            with pytest.raises(RouterClosed):
                await router.stream(nursery, make_request("late"), RequestContext("late"))
        await router.wait_idle()
        await keeper.wait_idle()
    [(stream, items)] = served
    assert stream.decode_worker in ("decode-0", "decode-1")
    assert items[-1].data is not None and items[-1].data.finish_reason is not None
    assert items[-1].data.finish_reason.kind is FinishKind.LENGTH
    assert router.decode.outstanding == 0 and router.prefill.outstanding == 0
