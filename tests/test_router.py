"""The DisaggRouter on in-process mock engines: handoff styles, faults, B1-B5, S11, S12."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from e2e_support import wait_until
from engine_support import StandIn, run_to_its_end

from trio_disagg import (
    Annotated,
    BootstrapInfo,
    CancelWindow,
    DeadlineExceeded,
    Deadlines,
    DisaggRouter,
    FinishKind,
    HandoffStyle,
    LLMEngineOutput,
    Phase,
    PrefillDeadlineExceeded,
    PrefillError,
    PrefillResult,
    PreprocessedRequest,
    RequestContext,
    RequestStream,
    RouterClosed,
    RoutingHints,
    SessionAffinity,
    TransferKeeper,
    WorkerError,
    WorkerPool,
)
from trio_disagg.engines import LatencyModel, MockCluster, MockDecodeEngine, mock_cluster

SEQ = HandoffStyle.SEQUENTIAL
BOOT = HandoffStyle.BOOTSTRAP
STYLES = [SEQ, BOOT]
LATENCY = LatencyModel(
    ttft_per_prompt_token=0.01, inter_token_latency=0.1, kv_transfer_per_token=0.001
)
Item = Annotated[LLMEngineOutput]


def make_request(
    request_id: str = "req-1",
    *,
    fault: str | None = None,
    max_tokens: int = 4,
    words: int = 10,
    session: str | None = None,
) -> PreprocessedRequest:
    body: dict[str, Any] = {"model": "mock", "prompt": " ".join(["w"] * words),
                            "max_tokens": max_tokens}
    if fault is not None:
        body["fault"] = fault
    return PreprocessedRequest(
        request_id=request_id, model="mock", body=body, max_tokens=max_tokens,
        routing=RoutingHints(session_id=session),
    )


@attrs.define
class Harness:
    cluster: MockCluster
    keeper: TransferKeeper
    router: DisaggRouter

    async def run(self, request: PreprocessedRequest) -> tuple[RequestStream, list[Item]]:
        """Send ``request`` and read its stream to the end; a routing error is raised bare."""
        try:
            async with trio.open_nursery() as nursery:
                stream = await self.router.stream(
                    nursery, request, RequestContext(request.request_id)
                )
                items = [item async for item in stream.outputs]
        except* (PrefillError, DeadlineExceeded, WorkerError, RouterClosed) as group:
            raise leaf(group)  # noqa: B904 (keeps its own __cause__)
        return stream, items

    async def settle(self) -> None:
        """Wait until nothing is in flight anywhere."""
        with trio.fail_after(600):
            await self.router.wait_idle()
            await self.keeper.wait_idle()

    def assert_clean(self) -> None:
        """B5: no request, drain, lease or KV block outlives its purpose."""
        counters = self.cluster.counters()
        assert self.router.in_flight == 0
        assert self.keeper.in_flight == 0
        assert self.router.prefill.outstanding == 0
        assert self.router.decode.outstanding == 0
        assert counters.held_blocks == 0, counters
        assert counters.stranded_blocks == 0, counters


def harness_for(
    keeper: TransferKeeper,
    style: HandoffStyle = SEQ,
    *,
    deadlines: Deadlines | None = None,
    cluster: MockCluster | None = None,
    **cluster_args: Any,
) -> Harness:
    cluster = cluster or mock_cluster(style=style, latency=LATENCY, **cluster_args)
    router = DisaggRouter(
        WorkerPool(cluster.prefill), WorkerPool(cluster.decode), keeper,
        deadlines=deadlines or Deadlines(prefill=5, handoff=5, decode_idle=5, terminal_hold=5,
                                         transfer=30),
    )
    return Harness(cluster, keeper, router)


def leaf(group: BaseExceptionGroup[Exception]) -> Exception:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    assert isinstance(exc, Exception)
    return exc


def tokens_of(items: list[Item]) -> list[int]:
    return [t for item in items if item.data is not None for t in item.data.token_ids]


def finish_of(item: Item) -> FinishKind | None:
    if item.data is None or item.data.finish_reason is None:
        return None
    return item.data.finish_reason.kind


# --- the three handoff styles ------------------------------------------------------------


async def test_sequential_handoff_streams_decode_tokens(autojump_clock: trio.abc.Clock) -> None:
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ)
        stream, items = await h.run(make_request(max_tokens=4))
        assert stream.style == "sequential"
        assert len(tokens_of(items)) == 4
        assert finish_of(items[-1]) is FinishKind.LENGTH
        assert stream.tracker.phase is Phase.DONE
        assert stream.tracker.prefill_complete_at is not None
        assert stream.prompt_tokens_details is not None  # from the prefill (S4, S10)
        await h.settle()
        h.assert_clean()
        assert h.cluster.counters().served == 1


async def test_S5_bootstrap_handoff_dispatches_prefill_and_decode_together(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, BOOT)
        request = make_request(max_tokens=4)
        start = trio.current_time()
        stream, items = await h.run(request)
        assert stream.style == "bootstrap"
        assert request.bootstrap_info is None  # the caller's request is not modified
        assert stream.bootstrap_info is not None
        assert 0 <= stream.bootstrap_info.room < 2**63
        assert len(tokens_of(items)) == 4
        assert finish_of(items[-1]) is FinishKind.LENGTH
        # Decode started while the prefill computed: no serial prefill + decode.
        assert trio.current_time() - start < 10 * 0.01 + 4 * 0.1 + 0.2
        await h.settle()
        h.assert_clean()


async def test_S5_bootstrap_rooms_are_unique_per_request(autojump_clock: trio.abc.Clock) -> None:
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, BOOT)
        rooms: set[int] = set()

        async def run(request: PreprocessedRequest) -> None:
            stream, _ = await h.run(request)
            assert stream.bootstrap_info is not None
            rooms.add(stream.bootstrap_info.room)

        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(run, make_request(f"r{i}"))
        assert len(rooms) == 50
        await h.settle()
        h.assert_clean()


@pytest.mark.parametrize(
    ("fault", "kind"),
    [("eos_first_token", FinishKind.EOS), ("prefill_error_finish", FinishKind.ERROR),
     ("prefill_cancelled_finish", FinishKind.CANCELLED)],
)
async def test_S7_terminal_prefill_answers_without_decode(
    autojump_clock: trio.abc.Clock, fault: str, kind: FinishKind
) -> None:
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ)
        stream, items = await h.run(make_request(fault=fault))
        assert stream.style == "terminal"
        assert stream.decode_worker is None
        assert len(items) == 1
        assert finish_of(items[0]) is kind
        assert items[0].data is not None and items[0].data.disaggregated_params is None
        await h.settle()
        h.assert_clean()
        assert h.cluster.counters().staged_blocks == 0


@pytest.mark.parametrize(
    ("fault", "kind"),
    [("eos_first_token", FinishKind.EOS), ("prefill_error_finish", FinishKind.ERROR),
     ("prefill_cancelled_finish", FinishKind.CANCELLED)],
)
async def test_S7_terminal_prefill_in_the_bootstrap_style_ends_the_stream_at_once(
    autojump_clock: trio.abc.Clock, fault: str, kind: FinishKind
) -> None:
    """The decode was dispatched alongside the prefill, but the prefill answered by itself
    and staged nothing: its answer ends the stream at once, not a decode-idle deadline."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, BOOT, deadlines=Deadlines(decode_idle=600))
        start = trio.current_time()
        stream, items = await h.run(make_request(fault=fault))
        assert trio.current_time() - start < 5
        assert stream.style == "bootstrap"
        assert [finish_of(item) for item in items] == [kind]
        await h.settle()
        h.assert_clean()


# --- faults --------------------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("fault", ["prefill_fail_before_handoff", "prefill_fail_after_handoff",
                                   "prefill_reset"])
async def test_prefill_failure_reaches_the_client(
    autojump_clock: trio.abc.Clock, style: HandoffStyle, fault: str
) -> None:
    """Before the stream (raised by ``stream()``) or after it started (one error item
    last): never a false success (S1, T4, G1, G5, G6)."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        try:
            _, items = await h.run(make_request(fault=fault))
        except PrefillError:
            pass
        else:
            assert items[-1].is_error, items[-1]
            assert all(finish_of(item) is None for item in items[:-1])
        await h.settle()
        h.assert_clean()


async def test_prefill_rejection_keeps_the_worker_status(autojump_clock: trio.abc.Clock) -> None:
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ)
        with pytest.raises(PrefillError) as info:
            await h.run(make_request(fault="prefill_reject:429"))
        assert isinstance(info.value.__cause__, WorkerError)
        assert info.value.__cause__.status == 429
        await h.settle()
        h.assert_clean()


@pytest.mark.parametrize("style", STYLES)
async def test_G4_decode_error_at_token_k(autojump_clock: trio.abc.Clock, style: HandoffStyle
                                          ) -> None:
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        _, items = await h.run(make_request(fault="decode_error_at:3", max_tokens=8))
        assert len(tokens_of(items)) == 3
        assert items[-1].is_error
        await h.settle()
        h.assert_clean()


@pytest.mark.parametrize("style", STYLES)
async def test_G4_decode_fails_before_first_token(autojump_clock: trio.abc.Clock,
                                                  style: HandoffStyle) -> None:
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        _, items = await h.run(make_request(fault="decode_fail_before_first_token"))
        assert tokens_of(items) == []
        assert items[-1].is_error
        await h.settle()
        h.assert_clean()


@pytest.mark.parametrize("style", STYLES)
async def test_B1_B6_decode_rejection_is_raised_and_nothing_is_left(
    autojump_clock: trio.abc.Clock, style: HandoffStyle
) -> None:
    """A decode worker that refuses the request: the error reaches the caller. Sequential:
    the staged KV is consumed by the keeper's cleanup decode (B1), not left for the TTL.
    Bootstrap: no decode will join the room, so its prefill is ended at once (B6), and no
    cleanup decode is sent into it."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style, decode=2)
        start = trio.current_time()
        with pytest.raises(WorkerError):
            await h.run(make_request(fault="decode_reject:503"))
        await h.settle()
        assert trio.current_time() - start < 1  # never the bootstrap timeout
        h.assert_clean()
        counters = h.router.counters
        if style is SEQ:
            assert (counters.staged_kv_cleanups, counters.prefills_released) == (1, 0)
        else:
            assert (counters.staged_kv_cleanups, counters.prefills_released) == (0, 1)


async def test_decode_reset_mid_stream_is_not_a_success(autojump_clock: trio.abc.Clock) -> None:
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ)
        _, items = await h.run(make_request(fault="decode_reset_at:2", max_tokens=8))
        # The stream ends without a terminal; the server turns that into an error (B4).
        assert len(tokens_of(items)) == 2
        assert all(finish_of(item) is None for item in items)
        await h.settle()
        h.assert_clean()


# --- B1: staged KV is never stranded ---------------------------------------------------------


class SlowAcceptDecode:
    """A decode worker that takes ``accept_delay`` seconds to accept a request."""

    def __init__(self, inner: MockDecodeEngine, accept_delay: float) -> None:
        self.inner = inner
        self.accept_delay = accept_delay
        self.name = inner.name
        self.handoff_style = inner.handoff_style
        self.bootstrap_host = inner.bootstrap_host
        self.bootstrap_port = inner.bootstrap_port

    async def generate(  # noqa: ASYNC114
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await trio.sleep(self.accept_delay)
        await self.inner.generate(request, context, send_channel,
                                  task_status=self.accepting(task_status))

    def accepting(self, task_status: trio.TaskStatus[None]) -> trio.TaskStatus[None]:
        """What the inner engine reports its acceptance to."""
        return task_status


@pytest.mark.parametrize("offset", [-0.01, -1e-6, 0.0, 1e-6, 0.01, 0.2])
async def test_B1_prefill_answering_at_its_deadline_strands_nothing(
    autojump_clock: trio.abc.Clock, offset: float
) -> None:
    """A prefill that answers just before, at or just after the prefill deadline: the
    client gets its answer or a PrefillDeadlineExceeded, and the staged KV is consumed by
    the request's decode or a cleanup decode, never left held (B1, B2)."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ, kv_ttl=1000.0)
        stream, _ = await h.run(make_request("probe"))
        tracker = stream.tracker
        assert tracker.prefill_complete_at is not None and tracker.created_at is not None
        answer_after = tracker.prefill_complete_at - tracker.created_at
        await h.settle()
        h.router.deadlines = Deadlines(prefill=answer_after + offset, handoff=5,
                                       decode_idle=5, terminal_hold=5, transfer=30)
        try:
            _, items = await h.run(make_request("edge"))
        except PrefillDeadlineExceeded:
            assert offset <= 0  # only a deadline at or before the answer can expire
        else:
            assert offset >= 0 and finish_of(items[-1]) is FinishKind.LENGTH
        await h.settle()
        h.assert_clean()


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("phase", ["prefill", "handoff", "stream"])
async def test_B1_disconnect_at_every_phase_leaves_no_held_blocks(
    autojump_clock: trio.abc.Clock, style: HandoffStyle, phase: str
) -> None:
    """The client goes away during the prefill, between the handoff and the decode's
    acceptance, or mid-stream: every block is freed at once, not by its TTL (B1, G9)."""
    cluster = mock_cluster(style=style, latency=LATENCY, kv_ttl=1000.0)
    cluster.decode[0] = SlowAcceptDecode(cluster.decode[0], 1.0)  # type: ignore[call-overload]
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style, cluster=cluster)
        prefill_time = 100 * 0.01  # 100 prompt words
        cut = {"prefill": prefill_time / 2, "handoff": prefill_time + 0.5,
               "stream": prefill_time + 1.0 + 0.35}[phase]
        start = trio.current_time()
        with trio.move_on_after(cut) as client:
            await h.run(make_request(words=100, max_tokens=20))
        assert client.cancelled_caught
        await h.settle()
        h.assert_clean()
        # Well before the 1000 s lease: the blocks were freed, not expired.
        assert trio.current_time() - start < 60
        counters = h.cluster.counters()
        assert counters.staged_blocks == counters.freed_blocks


async def test_B1_cleanup_decode_is_minimal(autojump_clock: trio.abc.Clock) -> None:
    seen: list[PreprocessedRequest] = []
    cluster = mock_cluster(style=SEQ, latency=LATENCY)
    inner = cluster.decode[0]

    class Recording(SlowAcceptDecode):
        async def generate(  # noqa: ASYNC114
            self, request: PreprocessedRequest, context: RequestContext,
            send_channel: trio.MemorySendChannel[Item], *,
            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
        ) -> None:
            seen.append(request)
            await super().generate(request, context, send_channel, task_status=task_status)

    cluster.decode[0] = Recording(inner, 1.0)  # type: ignore[call-overload]
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ, cluster=cluster)
        with trio.move_on_after(10 * 0.01 + 0.5):
            await h.run(make_request(max_tokens=50))
        await h.settle()
        h.assert_clean()
    cleanup = seen[-1]
    assert cleanup.max_tokens == 1
    assert cleanup.stream is False
    assert cleanup.body["max_tokens"] == 1
    assert cleanup.prefill_result is not None
    assert h.router.counters.staged_kv_cleanups == 1


# --- B10: cancel windows ----------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("window", list(CancelWindow))
async def test_B10_client_leaving_during_the_prefill(
    autojump_clock: trio.abc.Clock, style: HandoffStyle, window: CancelWindow
) -> None:
    """The client leaves while the prefill computes (and, bootstrap, before the slow decode
    accepted). Inside a cancel window the prefill is cancelled, its compute saved, and
    nothing is staged; with ``NEVER`` the keeper drains it and its KV is consumed (B1, G9).
    Either way nothing is held or stranded."""
    cluster = mock_cluster(style=style, latency=LATENCY, kv_ttl=1000.0)
    cluster.decode[0] = SlowAcceptDecode(cluster.decode[0], 1.0)  # type: ignore[call-overload]
    async with TransferKeeper() as keeper:
        router = DisaggRouter(
            WorkerPool(cluster.prefill, cancel_windows={"prefill-0": window}),
            WorkerPool(cluster.decode), keeper,
        )
        h = Harness(cluster, keeper, router)
        start = trio.current_time()
        with trio.move_on_after(0.05):  # the prefill takes 10 x 0.01 s
            await h.run(make_request(words=10))
        await h.settle()
        h.assert_clean()
        counters, kv = router.counters, cluster.counters()
        if window is CancelWindow.NEVER:
            assert (counters.prefills_drained, counters.prefills_cancelled) == (1, 0)
            assert kv.served == 1  # pulled: by a B1 cleanup, or the decode that joined
        else:
            assert (counters.prefills_drained, counters.prefills_cancelled) == (0, 1)
            assert (kv.staged_blocks, kv.served) == (0, 0)  # never computed to the end
            assert trio.current_time() - start < 0.1  # no prefill ran on


class DeafPrefill(StandIn):
    """A prefill worker that does not hear a stop: its answer comes as if none came (as
    one already on its way when the router stopped the prefill)."""

    async def generate(  # noqa: ASYNC114
        self, request: PreprocessedRequest, context: RequestContext,
        send_channel: trio.MemorySendChannel[Item], *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await self.engine.generate(request, RequestContext(request.request_id), send_channel,
                                   task_status=task_status)


async def test_B10_B1_a_stopped_prefill_that_answers_anyway_counts_as_drained(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The client left inside the cancel window and the router stopped the prefill, but
    its answer came all the same (within the stop's grace): its KV was staged and a
    cleanup decode consumed it (B1). The prefill ran to its end: it counts as drained,
    not cancelled (``trio_disagg_prefills_abandoned_total``)."""
    cluster = mock_cluster(latency=LATENCY, kv_ttl=1000.0)
    cluster.prefill[0] = DeafPrefill(cluster.prefill[0])  # type: ignore[call-overload]
    async with TransferKeeper() as keeper:
        router = DisaggRouter(
            WorkerPool(cluster.prefill,
                       cancel_windows={"prefill-0": CancelWindow.BEFORE_HANDOFF}),
            WorkerPool(cluster.decode), keeper,
        )
        h = Harness(cluster, keeper, router)
        with trio.move_on_after(0.05):  # the prefill takes 10 x 0.01 s
            await h.run(make_request(words=10))
        await h.settle()
        h.assert_clean()
    counters = router.counters
    assert (counters.prefills_drained, counters.prefills_cancelled) == (1, 0)
    assert counters.staged_kv_cleanups == 1 and cluster.counters().served == 1


class FailingCleanupDecode(StandIn):
    """A decode worker that serves a one-token request (the router's B1 cleanup) as the
    mock does, pulling the KV, but ends its stream with an error item instead of the
    finish (a worker that reports the cleanup failed after it accepted)."""

    async def generate(  # noqa: ASYNC114
        self, request: PreprocessedRequest, context: RequestContext,
        send_channel: trio.MemorySendChannel[Item], *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        if request.max_tokens != 1:
            await self.engine.generate(request, context, send_channel,
                                       task_status=task_status)
            return
        with send_channel:
            task_status.started()
            await run_to_its_end(self.engine, request, context)
            await send_channel.send(Annotated.from_error("KV transfer failed"))


async def test_B1_a_cleanup_decode_that_ends_with_an_error_is_a_failed_cleanup(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture,
) -> None:
    """A B1 cleanup decode whose worker accepted, then ended its stream with an error, did
    not consume the KV as far as the router can tell: it counts (and logs) as a failed
    cleanup, not as a success."""
    cluster = mock_cluster(latency=LATENCY, kv_ttl=1000.0)
    cluster.decode[0] = FailingCleanupDecode(cluster.decode[0])  # type: ignore[call-overload]
    async with TransferKeeper() as keeper:
        router = DisaggRouter(
            WorkerPool(cluster.prefill, cancel_windows={"prefill-0": CancelWindow.NEVER}),
            WorkerPool(cluster.decode), keeper,
        )
        h = Harness(cluster, keeper, router)
        with trio.move_on_after(0.05):  # the client leaves while the prefill computes
            await h.run(make_request(words=10))
        await h.settle()
    counters = router.counters
    assert (counters.staged_kv_cleanups, counters.staged_kv_cleanup_failures) == (1, 1)
    assert "KV transfer failed" in caplog.text


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("window", list(CancelWindow))
async def test_B10_client_leaving_after_the_handoff_is_never_cancelled(
    autojump_clock: trio.abc.Clock, style: HandoffStyle, window: CancelWindow
) -> None:
    """Once the handoff happened (sequential: the prefill answered; bootstrap: the decode
    joined the room), no window allows a cancellation: the KV is consumed by a cleanup
    decode (B1), or its transfer completes (G9)."""
    cluster = mock_cluster(style=style, latency=LATENCY, kv_ttl=1000.0)
    cluster.decode[0] = SlowAcceptDecode(cluster.decode[0], 0.2)  # type: ignore[call-overload]
    async with TransferKeeper() as keeper:
        router = DisaggRouter(
            WorkerPool(cluster.prefill, cancel_windows={"prefill-0": window}),
            WorkerPool(cluster.decode), keeper,
        )
        h = Harness(cluster, keeper, router)
        # Sequential: the handoff came at 0.1 s, the decode accepts at 0.3 s. Bootstrap: the
        # decode joined at 0.2 s and the prefill answers after its transfer.
        with trio.move_on_after(0.25 if style is SEQ else 0.21):
            await h.run(make_request(words=10, max_tokens=20))
        await h.settle()
        h.assert_clean()
        assert router.counters.prefills_cancelled == 0
        assert router.counters.staged_kv_cleanups == (1 if style is SEQ else 0)
        assert cluster.counters().served == 1


@pytest.mark.parametrize(
    ("style", "fault", "error"),
    [(SEQ, "prefill_fail_before_handoff", PrefillError),
     (SEQ, "prefill_stall", PrefillDeadlineExceeded),
     (SEQ, "decode_reject:503", WorkerError),
     (BOOT, "decode_reject:503", WorkerError)],
)
async def test_stream_raises_its_documented_exceptions_bare(
    autojump_clock: trio.abc.Clock, style: HandoffStyle, fault: str, error: type[Exception]
) -> None:
    """A caller's ``except PrefillError`` (or ``WorkerError``, ...) around ``router.stream``
    works: the exception is raised as itself, never inside an exception group."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style, deadlines=Deadlines(prefill=1))
        caught: Exception | None = None
        async with trio.open_nursery() as nursery:
            try:
                await h.router.stream(nursery, make_request(fault=fault), RequestContext("r"))
            except error as exc:
                caught = exc
        assert isinstance(caught, error), caught
        await h.settle()
        h.assert_clean()


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("action", ["stop_generating", "kill"])
async def test_C3_a_client_stopping_its_context_ends_its_request_at_once(
    autojump_clock: trio.abc.Clock, style: HandoffStyle, action: str
) -> None:
    """A library caller that stops or kills its context while the prefill still runs
    (here, stalls) gets its stream ended at once, not at the prefill deadline. What
    belongs to the KV transfer goes on in the keeper (C5, G9), and the prefill is then
    treated as the prefill of a client that left (B10; NEVER here: drained until its
    deadline)."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style, deadlines=Deadlines(prefill=5, handoff=5))
        context = RequestContext("r")
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            with trio.fail_after(1):
                async def stop_soon() -> None:
                    await trio.sleep(0.2)
                    getattr(context, action)()

                nursery.start_soon(stop_soon)
                stream = await h.router.stream(
                    nursery, make_request(fault="prefill_stall"), context)
                items = [item async for item in stream.outputs]
        assert trio.current_time() - start < 0.5
        # A stop before a decode took the request ends with one cancelled finish (C3); a
        # bootstrap stream, whose decode leg is kept for the transfer, just ends.
        assert [finish_of(item) for item in items] in (
            [], [] if action == "kill" else [FinishKind.CANCELLED])
        if style is SEQ and action == "stop_generating":
            assert len(items) == 1
        await h.settle()
        h.assert_clean()


# --- B2: every wait has a deadline -----------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
async def test_B2_prefill_deadline(autojump_clock: trio.abc.Clock, style: HandoffStyle) -> None:
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style, deadlines=Deadlines(prefill=2, handoff=5, decode_idle=5,
                                                           terminal_hold=5))
        start = trio.current_time()
        try:
            _, items = await h.run(make_request(fault="prefill_stall"))
        except PrefillDeadlineExceeded as exc:
            assert exc.what == "prefill"
        else:
            assert items[-1].is_error
            assert "prefill deadline of 2 s exceeded" in (items[-1].error_message() or "")
        assert trio.current_time() - start == pytest.approx(2, abs=0.5)
        await h.settle()
        h.assert_clean()


async def test_B2_handoff_deadline(autojump_clock: trio.abc.Clock) -> None:
    cluster = mock_cluster(style=SEQ, latency=LATENCY)
    cluster.decode[0] = SlowAcceptDecode(cluster.decode[0], 10.0)  # type: ignore[call-overload]
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, cluster=cluster, deadlines=Deadlines(handoff=2, decode_idle=30))
        with pytest.raises(DeadlineExceeded, match="handoff deadline of 2 s"):
            await h.run(make_request())
        await h.settle()
        h.assert_clean()


class AcceptsThenTheLoopIsBusy(SlowAcceptDecode):
    """Accepts ``accept_delay`` seconds in, then the event loop is busy for half a
    second before the router's task runs again."""

    def __init__(self, inner: MockDecodeEngine, accept_delay: float,
                 clock: trio.testing.MockClock) -> None:
        super().__init__(inner, accept_delay)
        self.clock = clock

    def accepting(self, task_status: trio.TaskStatus[None]) -> trio.TaskStatus[None]:
        clock = self.clock

        class Busy(trio.TaskStatus[None]):
            def started(self, value: None = None) -> None:
                task_status.started(value)
                clock.jump(0.5)  # no task runs meanwhile

        return Busy()


async def test_B2_a_decode_accepted_before_the_handoff_deadline_streams_if_seen_after_it(
        autojump_clock: trio.testing.MockClock) -> None:
    """The decode accepts just inside the handoff deadline, and the router's task runs
    again only after it: the request streams to its end (the deadline bounds the
    acceptance, not when the router gets to see it)."""
    cluster = mock_cluster(style=SEQ, latency=LATENCY)
    cluster.decode[0] = AcceptsThenTheLoopIsBusy(  # type: ignore[call-overload]
        cluster.decode[0], 1.999, autojump_clock)
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, cluster=cluster, deadlines=Deadlines(handoff=2, decode_idle=30))
        _, items = await h.run(make_request())
        assert finish_of(items[-1]) is FinishKind.LENGTH
        await h.settle()
        h.assert_clean()


@pytest.mark.parametrize("fault", ["decode_stall", "decode_stall_at:2"])
async def test_B2_decode_idle_deadline(autojump_clock: trio.abc.Clock, fault: str) -> None:
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, deadlines=Deadlines(decode_idle=3))
        _, items = await h.run(make_request(fault=fault, max_tokens=8))
        assert items[-1].is_error
        assert "decode idle deadline of 3 s exceeded" in (items[-1].error_message() or "")
        await h.settle()
        h.assert_clean()


async def test_B2_terminal_hold_deadline(autojump_clock: trio.abc.Clock) -> None:
    """The decode finished, but the bootstrap prefill never ends: the success terminal is
    not held forever."""
    cluster = mock_cluster(style=BOOT, latency=LatencyModel.zero())
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, cluster=cluster, deadlines=Deadlines(terminal_hold=2,
                                                                     transfer=10))
        stall = trio.Event()
        inner = cluster.prefill[0]

        class NeverEnding:
            name, handoff_style = inner.name, inner.handoff_style
            bootstrap_host, bootstrap_port = inner.bootstrap_host, inner.bootstrap_port

            async def generate(  # noqa: ASYNC114
                self, request: PreprocessedRequest, context: RequestContext,
                send_channel: trio.MemorySendChannel[Item], *,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
            ) -> None:
                relay_send, relay_receive = trio.open_memory_channel[Item](math.inf)
                async with trio.open_nursery() as nursery:
                    await nursery.start(inner.generate, request, context, relay_send)
                    task_status.started()
                    with send_channel:
                        async for item in relay_receive:
                            if finish_of(item) is None:
                                await send_channel.send(item)
                        await stall.wait()  # the prefill stream never ends

        h.router.prefill.workers[0].engine = NeverEnding()
        _, items = await h.run(make_request())
        assert items[-1].is_error
        assert "terminal hold deadline of 2 s exceeded" in (items[-1].error_message() or "")
        await h.settle()  # the transfer deadline ends the stuck prefill
        assert h.keeper.in_flight == 0


# --- B3: graceful shutdown ------------------------------------------------------------------


async def test_B3_graceful_shutdown_finishes_in_flight_requests(
    autojump_clock: trio.abc.Clock,
) -> None:
    results: list[list[Item]] = []
    async with TransferKeeper(drain_window=30) as keeper:
        h = harness_for(keeper, SEQ)

        async def client(i: int) -> None:
            results.append((await h.run(make_request(f"r{i}", max_tokens=10)))[1])

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(client, i)
            await trio.sleep(0.5)
            assert h.router.in_flight == 8
            h.router.close()  # stop admitting
            with pytest.raises(RouterClosed):
                await h.run(make_request("late"))
            await h.router.wait_idle()
        assert len(results) == 8
        assert all(finish_of(items[-1]) is FinishKind.LENGTH for items in results)
    h.assert_clean()


async def test_B3_keeper_cancels_drains_left_after_the_window(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with TransferKeeper(drain_window=3) as keeper:
        h = harness_for(keeper, BOOT, deadlines=Deadlines(transfer=1000, decode_idle=1000,
                                                          terminal_hold=1000))
        with trio.move_on_after(0.05):
            await h.run(make_request(fault="prefill_stall"))
        assert keeper.in_flight == 2  # the stalled prefill, and the decode leg in its room
        start = trio.current_time()
    assert trio.current_time() - start == pytest.approx(3)
    assert keeper.in_flight == 0
    assert keeper.cancelled_total == 1


@pytest.mark.parametrize("style", [SEQ, HandoffStyle.CONTEXT_FIRST])
async def test_B3_B1_kv_staged_inside_the_drain_window_is_consumed(
    autojump_clock: trio.abc.Clock, style: HandoffStyle
) -> None:
    """A client leaves during its prefill, then the keeper exits while that prefill still
    computes. The prefill stages its KV well inside the drain window: the B1 cleanup decode
    it calls for is part of that transfer and runs in the window, instead of being refused
    by a closing keeper and leaving the KV to the worker's lease."""
    async with TransferKeeper(drain_window=30) as keeper:
        h = harness_for(keeper, style)
        with trio.move_on_after(0.05):  # the prefill takes longer
            await h.run(make_request())
        assert keeper.in_flight == 1  # the prefill, run on by the keeper (T1)
    assert h.router.counters.staged_kv_cleanups == 1
    assert h.router.counters.staged_kv_cleanup_failures == 0
    assert keeper.cancelled_total == 0
    h.assert_clean()


@pytest.mark.parametrize("style", [HandoffStyle.CONTEXT_FIRST, BOOT])
async def test_B3_B4_a_kept_decode_leg_cut_by_the_keepers_shutdown_ends_with_an_error(
    autojump_clock: trio.abc.Clock, style: HandoffStyle
) -> None:
    """A decode leg that is part of the KV transfer runs in the keeper. When the keeper
    shuts down while a reader outside it still reads that leg's stream, the drain window
    runs out and the leg is cancelled: the reader's stream ended there, after a few
    tokens, as if it were a complete answer. It now ends with one error item, a
    :class:`RouterClosed` (B3, B4)."""
    items: list[Item] = []
    reading = trio.Event()

    async def client(router: DisaggRouter) -> None:
        async with trio.open_nursery() as nursery:
            stream = await router.stream(nursery, make_request(max_tokens=50),
                                         RequestContext("req-1"))
            with stream.outputs:
                async for item in stream.outputs:
                    items.append(item)
                    reading.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as service, TransferKeeper(drain_window=0.5) as keeper:
            h = harness_for(keeper, style)
            service.start_soon(client, h.router)
            await reading.wait()
            h.router.close()
    assert len(items) > 1 and not any(item.is_error for item in items[:-1])
    assert items[-1].is_error and isinstance(items[-1].exception, RouterClosed)
    assert "transfer keeper shut down" in str(items[-1].error_message())
    assert keeper.in_flight == 0 and h.router.in_flight == 0


class BuggyBeforeStarted:
    """A decode engine with a bug: it raises a ValueError before ``started()``."""

    name = "buggy"

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with send_channel:
            raise ValueError("engine bug")


@pytest.mark.parametrize("style", [SEQ, HandoffStyle.CONTEXT_FIRST])
async def test_B1_a_decode_engine_bug_before_it_started_is_raised_and_strands_nothing(
    autojump_clock: trio.abc.Clock, style: HandoffStyle
) -> None:
    """``stream()`` raises what a decode engine raised before ``started()`` when it is no
    refusal (a bug), bare and as it was raised, and the staged KV is consumed by a B1
    cleanup decode, as for a client that left. A cleanup decode sent to that engine too
    crashes as it did, and took no KV: it is tried on another worker, where it gave up
    and left the KV to the worker's lease."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        h.router.decode = WorkerPool([BuggyBeforeStarted(), *h.cluster.decode])
        request = attrs.evolve(make_request(), routing=RoutingHints(decode_worker="buggy"))
        async with trio.open_nursery() as nursery:
            with pytest.raises(ValueError, match="engine bug"):
                await h.router.stream(nursery, request, RequestContext("req-1"))
        await h.settle()
        assert h.router.counters.staged_kv_cleanups == 1
        assert h.cluster.counters().freed_blocks == h.cluster.counters().staged_blocks > 0
    h.assert_clean()


class MisbehavingDecode(StandIn):
    """A decode worker that accepts, pulls the KV and sends ``after`` tokens of the mock
    decode it wraps (None: all of them), then breaks the engine contract as
    :meth:`misbehave` says (a bug in a user's engine)."""

    def __init__(self, engine: Any, after: int | None) -> None:
        super().__init__(engine)
        self.after = after

    async def misbehave(self, send_channel: trio.MemorySendChannel[Item],
                        receive: trio.MemoryReceiveChannel[Item]) -> None:
        """After its tokens: ``send_channel`` is the router's, ``receive`` the rest of
        the wrapped mock decode's outputs."""
        raise NotImplementedError

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with send_channel:
            send, receive = trio.open_memory_channel[Item](math.inf)
            async with trio.open_nursery() as nursery:
                await nursery.start(self.engine.generate, request, context, send)
                task_status.started()
                with receive:
                    if self.after is None:
                        async for item in receive:
                            await send_channel.send(item)
                    for _ in range(self.after or 0):
                        await send_channel.send(await receive.receive())
                    await self.misbehave(send_channel, receive)


class CrashingDecode(MisbehavingDecode):
    """Raises after its tokens (the contract says one error item, never an exception,
    after ``started()``)."""

    def __init__(self, engine: Any, after: int, crash: Callable[[], Exception]) -> None:
        super().__init__(engine, after)
        self.crash = crash

    async def misbehave(self, send_channel: trio.MemorySendChannel[Item],
                        receive: trio.MemoryReceiveChannel[Item]) -> None:
        raise self.crash()


@pytest.mark.parametrize("style", [SEQ, HandoffStyle.CONTEXT_FIRST, BOOT])
@pytest.mark.parametrize(
    "crash", [lambda: ValueError("engine bug"),
              lambda: ExceptionGroup("engine bugs", [KeyError("k")])],
    ids=["ValueError", "KeyError in a group"])
@pytest.mark.parametrize("after", [0, 2])
async def test_G4_B4_a_decode_engine_that_raises_after_it_started_is_an_error_item(
    autojump_clock: trio.abc.Clock, style: HandoffStyle, crash: Callable[[], Exception],
    after: int,
) -> None:
    """A decode engine that raises after ``started()`` ends its stream with one error item
    naming the crash, whatever the handoff style: not a stream that just stops, which
    reads as a (truncated) success (G4, B4), nor an exception group out of the request's
    nursery."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        decode = CrashingDecode(h.cluster.decode[0], after, crash)
        h.router.decode = WorkerPool([decode])
        items: list[Item] = []
        async with trio.open_nursery() as nursery:
            stream = await h.router.stream(nursery, make_request(max_tokens=8),
                                           RequestContext("req-1"))
            with stream.outputs:
                items = [item async for item in stream.outputs]
        assert [item.is_error for item in items] == [False] * after + [True]
        message = items[-1].error_message()
        assert message is not None and "decode-0" in message
        assert ("ValueError: engine bug" in message) or ("KeyError: 'k'" in message)
        await h.settle()
    h.assert_clean()


async def a_stray_cancelled() -> trio.Cancelled:
    """A real ``trio.Cancelled``, caught from a scope that is over: an engine that raises
    it later raises a cancellation nobody asked for (a bug, as raising any other)."""
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as exc:
            caught = exc
            raise
    return caught


class StrayCancelledDecode(StandIn):
    """Sends ``after`` tokens of the mock decode it wraps (run to its end first), then
    raises a ``Cancelled`` of its own, bare or in a group, outside any nursery of its
    own (a nursery would take it for its own cancellation)."""

    def __init__(self, engine: Any, after: int, grouped: bool) -> None:
        super().__init__(engine)
        self.after = after
        self.grouped = grouped

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with send_channel:
            items = await run_to_its_end(self.engine, request, context)
            task_status.started()
            for item in items[:self.after]:
                await send_channel.send(item)
            stray = await a_stray_cancelled()
            if self.grouped:
                raise BaseExceptionGroup("engine tasks", [stray, ValueError("bug")])
            raise stray


@pytest.mark.parametrize("style", [SEQ, HandoffStyle.CONTEXT_FIRST, BOOT])
@pytest.mark.parametrize("grouped", [False, True], ids=["bare", "in a group"])
@pytest.mark.parametrize("after", [0, 2])
async def test_G4_B4_a_decode_engine_that_raises_a_stray_cancelled_is_an_error_item(
    autojump_clock: trio.abc.Clock, style: HandoffStyle, grouped: bool, after: int,
) -> None:
    """A decode engine that raises ``trio.Cancelled`` after ``started()`` when nothing
    cancelled it (it kept one from a scope of its own, and raised it later) crashed: its
    stream ends with one error item naming the crash (G4, B4), not with an end that
    reads as a complete answer of ``after`` tokens, and the request's nursery exits
    cleanly."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        h.router.decode = WorkerPool([StrayCancelledDecode(h.cluster.decode[0], after,
                                                           grouped)])
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                stream = await h.router.stream(nursery, make_request(max_tokens=8),
                                               RequestContext("req-1"))
                with stream.outputs:
                    items = [item async for item in stream.outputs]
        assert [item.is_error for item in items] == [False] * after + [True]
        message = items[-1].error_message()
        assert message is not None and "decode-0 crashed: " in message
        assert ("ValueError: bug" if grouped else "Cancelled") in message
        await h.settle()
    h.assert_clean()


class AsyncClosingCrashingDecode(StandIn):
    """As :class:`CrashingDecode` after two tokens, but closing its channel with ``async
    with send_channel:`` (trio's usual idiom) inside a nursery of its own: the close and
    the nursery's exit are checkpoints before the exception reaches the router."""

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        send, receive = trio.open_memory_channel[Item](math.inf)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.engine.generate, request, context, send)
            task_status.started()
            async with send_channel:
                with receive:
                    for _ in range(2):
                        await send_channel.send(await receive.receive())
                raise ValueError("engine bug")


async def test_G4_B4_a_decode_engine_that_raises_inside_async_with_send_channel(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A crash after ``started()`` inside ``async with send_channel:`` ends the stream with
    an error item too, not with two tokens and an end that reads as complete (B4)."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ)
        h.router.decode = WorkerPool([AsyncClosingCrashingDecode(h.cluster.decode[0])])
        async with trio.open_nursery() as nursery:
            stream = await h.router.stream(nursery, make_request(max_tokens=8),
                                           RequestContext("req-1"))
            with stream.outputs:
                items = [item async for item in stream.outputs]
        assert [item.is_error for item in items] == [False, False, True]


class GarbageSendingDecode(MisbehavingDecode):
    """Sends ``after`` tokens of the mock decode it wraps, then something that is not an
    ``Annotated[LLMEngineOutput]`` (an engine written against the docs that gets its
    output type wrong), then the rest."""

    def __init__(self, engine: Any, after: int, garbage: object) -> None:
        super().__init__(engine, after)
        self.garbage = garbage

    async def misbehave(self, send_channel: trio.MemorySendChannel[Item],
                        receive: trio.MemoryReceiveChannel[Item]) -> None:
        await send_channel.send(self.garbage)  # type: ignore[arg-type]
        async for item in receive:  # what it would have sent after
            await send_channel.send(item)


@pytest.mark.parametrize("style", [SEQ, HandoffStyle.CONTEXT_FIRST, BOOT])
@pytest.mark.parametrize("garbage", ["a token", {"token_ids": [1]}, None,
                                     Annotated(data={"token_ids": [1]})],
                         ids=["str", "dict", "None", "Annotated of a dict"])
@pytest.mark.parametrize("after", [0, 2])
async def test_G4_B4_a_decode_output_that_is_not_an_engine_output_is_an_error_item(
    autojump_clock: trio.abc.Clock, style: HandoffStyle, garbage: object, after: int,
) -> None:
    """A decode engine that sends something else than an ``Annotated[LLMEngineOutput]``
    ends its stream with one error item that says what it sent (G4, B4): not an
    ``AttributeError`` out of the reader's ``async for``, nor a group out of the request's
    nursery. Nothing is stranded, and nothing stays in flight."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        h.router.decode = WorkerPool([GarbageSendingDecode(h.cluster.decode[0], after,
                                                           garbage)])
        async with trio.open_nursery() as nursery:
            stream = await h.router.stream(nursery, make_request(max_tokens=8),
                                           RequestContext("req-1"))
            with stream.outputs:
                items = [item async for item in stream.outputs]
        assert [item.is_error for item in items] == [False] * after + [True]
        assert isinstance(items[-1].exception, WorkerError)
        message = items[-1].error_message()
        assert message is not None and "Annotated[LLMEngineOutput]" in message
        assert type(garbage).__name__ in message or "data" in message
        await h.settle()
    h.assert_clean()


class GarbagePrefill(StandIn):
    """A prefill engine whose first output is not an ``Annotated[LLMEngineOutput]``."""

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with send_channel:
            task_status.started()
            await send_channel.send({"disaggregated_params": {}})  # type: ignore[arg-type]


@pytest.mark.parametrize("style", [SEQ, HandoffStyle.CONTEXT_FIRST, BOOT])
async def test_S2_a_prefill_output_that_is_not_an_engine_output_is_a_prefill_error(
    autojump_clock: trio.abc.Clock, style: HandoffStyle,
) -> None:
    """A prefill engine whose first output is a dict fails the request with a
    :class:`PrefillError` that says so, whatever the handoff style: raised by
    ``stream()``, or the stream's one error item once a bootstrap decode was dispatched
    with it; not a "crashed: AttributeError" (S2)."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        h.router.prefill = WorkerPool([GarbagePrefill(h.cluster.prefill[0])])
        message = "the prefill engine sent a dict, not an Annotated[LLMEngineOutput]"
        try:
            _, items = await h.run(make_request())
        except PrefillError as exc:
            assert str(exc) == message
        else:
            assert style is BOOT and [item.is_error for item in items] == [True]
            assert items[0].error_message() == message
        await h.settle()
    h.assert_clean()


async def test_T2_a_raising_stop_callback_on_a_client_context_never_reaches_the_keeper(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A client's ``on_stop`` callback that raises (a bug: it must not) is called when the
    gatekeeper stops the client's context for a bootstrap prefill that failed late, from
    inside the keeper's drain. Its exception is logged; it does not crash the keeper's
    nursery, which would cancel every other request's transfer (T1, T2), and the client
    still gets the prefill's error (G5)."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, BOOT)
        results: dict[str, list[Item]] = {}

        async def client(request_id: str, fault: str | None, context: RequestContext) -> None:
            async with trio.open_nursery() as nursery:
                stream = await h.router.stream(
                    nursery, make_request(request_id, fault=fault, max_tokens=30), context)
                with stream.outputs:
                    results[request_id] = [item async for item in stream.outputs]

        buggy = RequestContext("buggy")
        buggy.on_stop(buggy_callback)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client, "bystander", None, RequestContext("bystander"))
            nursery.start_soon(client, "buggy", "prefill_fail_after_handoff", buggy)
        await h.settle()
    assert results["buggy"][-1].is_error
    assert finish_of(results["bystander"][-1]) is FinishKind.LENGTH
    assert keeper.cancelled_total == 0
    assert any("on_stop callback" in r.getMessage() and r.exc_info for r in caplog.records)
    h.assert_clean()


class RefusesInANursery(StandIn):
    """A worker whose first request is refused from inside a nursery of the engine's own,
    as trio code naturally does: the ``WorkerError`` comes out in an exception group.
    Later requests go to the mock engine it wraps."""

    def __init__(self, engine: Any, status: int) -> None:
        super().__init__(engine)
        self.status = status
        self.refused = 0

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        if self.refused:
            await self.engine.generate(request, context, send_channel, task_status=task_status)
            return
        self.refused += 1
        with send_channel:
            async with trio.open_nursery():
                raise WorkerError(f"{self.name} is full", status=self.status,
                                  worker=self.name, worker_status=self.status)


@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize("status", [503, 400])
async def test_B9_S2_a_refusal_raised_inside_the_engines_own_nursery_is_a_refusal(
    autojump_clock: trio.abc.Clock, leg: str, status: int
) -> None:
    """An engine that refuses from inside a nursery of its own raises its ``WorkerError``
    in an exception group. It is the same refusal: a 5xx is tried again on another worker
    (B9), a 4xx is final and keeps its status (S2), and ``stream()`` raises it bare, never
    a group nor a "crashed" prefill."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ, prefill=2, decode=2)
        if leg == "prefill":  # the first worker refuses, the other serves
            prefill = h.cluster.prefill
            h.router.prefill = WorkerPool([RefusesInANursery(prefill[0], status), prefill[1]])
        else:
            decode = h.cluster.decode
            h.router.decode = WorkerPool([RefusesInANursery(decode[0], status), decode[1]])
        if status == 503:
            _, items = await h.run(make_request())
            assert finish_of(items[-1]) is FinishKind.LENGTH
            assert h.router.counters.retries == {(leg, "server_error"): 1}
        else:
            async with trio.open_nursery() as nursery:
                with pytest.raises((PrefillError, WorkerError)) as caught:  # bare
                    await h.router.stream(nursery, make_request(), RequestContext("r"))
            error = caught.value
            if leg == "prefill":
                assert isinstance(error, PrefillError) and "crashed" not in str(error)
                error = error.__cause__  # type: ignore[assignment]
            assert isinstance(error, WorkerError) and error.status == 400
            assert h.router.counters.retries == {}
        await h.settle()
    h.assert_clean()


async def test_B9_B5_a_refused_decode_leg_does_not_end_the_stream_of_its_replacement(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The decode leg a worker refused ended, but it fed no stream: the leg that replaced
    it (B9) owns the stream, which stays in flight (B5: ``wait_idle()`` waits for it) until
    its last item is read, and whose end is the replacement's own."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ, prefill=1, decode=2)
        decode = h.cluster.decode
        h.router.decode = WorkerPool([RefusesInANursery(decode[0], 503), decode[1]])
        async with trio.open_nursery() as nursery:
            stream = await h.router.stream(nursery, make_request(max_tokens=4),
                                           RequestContext("r"))
            assert h.router.counters.retries == {("decode", "server_error"): 1}
            assert h.router.in_flight == 1
            with stream.outputs:
                first = await stream.outputs.receive()
                assert h.router.in_flight == 1
                rest = [item async for item in stream.outputs]
            assert h.router.in_flight == 0
        assert first.data is not None and first.data.token_ids
        assert finish_of(rest[-1]) is FinishKind.LENGTH
        await h.settle()
    h.assert_clean()


@pytest.mark.parametrize("style", [SEQ, HandoffStyle.CONTEXT_FIRST, BOOT])
async def test_S3_a_library_stream_records_its_decode_first_token(
    autojump_clock: trio.abc.Clock, style: HandoffStyle
) -> None:
    """``stream()`` without the HTTP server fills its tracker too: the decode's first
    token is recorded when it reaches the reader through the gate, once, so the TTFT and
    the KV transfer estimate are known to a library user, not only to the server."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        async with trio.open_nursery() as nursery:
            stream = await h.router.stream(nursery, make_request(max_tokens=3),
                                           RequestContext("r"))
            assert stream.tracker.decode_first_token_at is None
            with stream.outputs:
                first = await stream.outputs.receive()
                first_at = trio.current_time()
                assert stream.tracker.decode_first_token_at == first_at
                assert first.data is not None and first.data.token_ids
                async for _ in stream.outputs:
                    pass
        tracker = stream.tracker
        assert tracker.decode_first_token_at == first_at  # the first call won (S3)
        assert tracker.time_to_first_token is not None and tracker.time_to_first_token > 0
        assert tracker.kv_transfer_latency is not None
        await h.settle()
    h.assert_clean()


# --- B5, S11, S12, C4/C5 ----------------------------------------------------------------------


async def client_with_faults(h: Harness, i: int, fault: str | None) -> None:
    """One client of the fault mix; every third one disconnects early."""
    with (
        trio.move_on_after(0.3 if i % 3 == 0 else 100),
        contextlib.suppress(PrefillError, DeadlineExceeded, WorkerError),
    ):
        await h.run(make_request(f"r{i}", fault=fault, words=20))


async def test_B5_counters_back_to_zero_after_a_mix_of_faults(
    autojump_clock: trio.abc.Clock,
) -> None:
    faults = [None, "prefill_fail_before_handoff", "prefill_fail_after_handoff",
              "eos_first_token", "decode_error_at:2", "decode_fail_before_first_token",
              "decode_stall", "prefill_stall", "decode_reset_at:1", None]
    for style in STYLES:
        async with TransferKeeper() as keeper:
            h = harness_for(keeper, style, prefill=2, decode=2,
                            deadlines=Deadlines(prefill=3, decode_idle=3, terminal_hold=3,
                                                handoff=3, transfer=20))

            async with trio.open_nursery() as nursery:
                for i, fault in enumerate(faults * 3):
                    nursery.start_soon(client_with_faults, h, i, fault)
            await h.settle()
            h.assert_clean()


async def test_S11_decode_phase_waits_for_the_drain_to_start(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, BOOT)
        async with trio.open_nursery() as nursery:
            stream = await h.router.stream(nursery, make_request(), RequestContext("req-1"))
            assert stream.tracker.phase is Phase.DECODE  # the permit was released
            async for _ in stream.outputs:
                pass


@pytest.mark.parametrize("style", STYLES)
async def test_B5_the_gate_runs_in_the_readers_task(
    autojump_clock: trio.abc.Clock, style: HandoffStyle
) -> None:
    """No forwarding task per request (P3, P4): the request's nursery holds the decode leg
    when it runs there, or one watcher for a leg the keeper holds; the reader's own reads
    end the request, and so does leaving the nursery on cancellation without closing."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        async with trio.open_nursery() as nursery:
            stream = await h.router.stream(nursery, make_request(), RequestContext("r"))
            assert len(nursery.child_tasks) == 1
            async for _ in stream.outputs:
                pass
            assert h.router.in_flight == 0
        with trio.move_on_after(1) as cut:  # mid-stream, and the reader never closes
            async with trio.open_nursery() as nursery:
                stream = await h.router.stream(nursery, make_request(max_tokens=500),
                                               RequestContext("r2"))
                async for _ in stream.outputs:
                    pass
        assert cut.cancelled_caught
        await h.settle()
        h.assert_clean()


async def test_G6_a_late_prefill_failure_reaches_a_reader_that_was_not_reading(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Bootstrap: the prefill fails after its handoff while the reader is busy elsewhere:
    its reads still end with the prefill's error, not a bare end of stream (the
    request's end must not drop what the gate owes the reader)."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, BOOT)
        async with trio.open_nursery() as nursery:
            stream = await h.router.stream(
                nursery, make_request(fault="prefill_fail_after_handoff", max_tokens=50),
                RequestContext("r"))
            with stream.outputs:
                await stream.prefill.wait_done()  # fails while nobody reads
                await trio.testing.wait_all_tasks_blocked()
                rest = [item async for item in stream.outputs]
        assert stream.prefill.failed
        assert rest and rest[-1].is_error
        assert isinstance(rest[-1].exception, PrefillError)
        await h.settle()
        h.assert_clean()


@pytest.mark.parametrize("style", [SEQ, BOOT, HandoffStyle.CONTEXT_FIRST])
async def test_B5_a_reader_that_breaks_out_without_closing_ends_its_request(
    autojump_clock: trio.abc.Clock, style: HandoffStyle
) -> None:
    """A stream shorter than the channel's buffer, left after its first item without
    closing: the decode leg put all of it in the channel, so the request ends and its
    nursery exits."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                stream = await h.router.stream(nursery, make_request(max_tokens=4),
                                               RequestContext("r"))
                async for _ in stream.outputs:
                    break
        await h.settle()
        h.assert_clean()


async def test_B2_a_reader_that_leaves_on_its_own_timeout_stops_a_stalled_decode(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The reader's own timeout ends its ``with`` block while the decode stalls: the
    decode leg is stopped, so the request's nursery exits, well before the decode-idle
    deadline would have been noticed by anyone."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ)
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            stream = await h.router.stream(
                nursery, make_request(fault="decode_stall_at:3", max_tokens=20),
                RequestContext("r"))
            with trio.move_on_after(2), stream.outputs:
                async for _ in stream.outputs:
                    pass
        assert trio.current_time() - start < 5
        await h.settle()
        h.assert_clean()


class Forwarding(MisbehavingDecode):
    """Forwards the mock decode it wraps and lets the ``BrokenResourceError`` of a reader
    that left escape (the contract says: return)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, None)

    async def misbehave(self, send_channel: trio.MemorySendChannel[Item],
                        receive: trio.MemoryReceiveChannel[Item]) -> None:
        pass


@pytest.mark.parametrize("style", [SEQ, HandoffStyle.CONTEXT_FIRST, BOOT])
async def test_B4_a_decode_engine_that_lets_a_reader_gone_escape_ends_quietly(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, style: HandoffStyle
) -> None:
    """The reader leaves after one token; the engine's next send raises
    ``BrokenResourceError``, which it lets escape. That is not a crash: nothing is logged
    as one, and nothing reaches the request's nursery."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        h.router.decode = WorkerPool([Forwarding(h.cluster.decode[0])])
        async with trio.open_nursery() as nursery:
            stream = await h.router.stream(nursery, make_request(max_tokens=8),
                                           RequestContext("r"))
            with stream.outputs:
                async for _ in stream.outputs:
                    break
        await h.settle()
    assert not [r for r in caplog.records if "crashed" in r.getMessage()]
    h.assert_clean()


class DeafDecode(MisbehavingDecode):
    """Hangs after its tokens without ever looking at its context (it ignores a stop)."""

    def __init__(self, engine: Any, after: int) -> None:
        super().__init__(engine, after)
        self.cancelled = False

    async def misbehave(self, send_channel: trio.MemorySendChannel[Item],
                        receive: trio.MemoryReceiveChannel[Item]) -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled = True
            raise


@pytest.mark.parametrize("reader", ["to the decode-idle deadline", "leaves after 1 item"])
async def test_B2_a_decode_leg_that_ignores_its_stop_ends_with_the_request_nursery(
    autojump_clock: trio.abc.Clock, reader: str
) -> None:
    """A sequential decode leg runs in the request's nursery. When its stream ends early
    (the decode-idle deadline, or a reader that leaves), the reader is done and the leg
    is stopped through its context; one that ignores the stop is the nursery's, and ends
    when its caller ends the request's nursery (the HTTP server: ``linger`` seconds after
    the answer), leaving nothing behind (B2)."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ, deadlines=Deadlines(decode_idle=5))
        decode = DeafDecode(h.cluster.decode[0], after=1 if "leaves" in reader else 2)
        h.router.decode = WorkerPool([decode])
        items: list[Item] = []
        with trio.fail_after(100):  # a guard against the hang, not a timing assertion
            async with trio.open_nursery() as nursery:
                stream = await h.router.stream(nursery, make_request(max_tokens=8),
                                               RequestContext("r"))
                with stream.outputs:
                    async for item in stream.outputs:
                        items.append(item)
                        if reader == "leaves after 1 item":
                            break
                assert not decode.cancelled  # the deaf leg runs on, its reader done
                nursery.cancel_scope.cancel()  # the caller's bound on its request
        assert decode.cancelled
        if reader == "to the decode-idle deadline":
            assert [item.is_error for item in items] == [False, False, True]
            assert "decode idle" in (items[-1].error_message() or "")
        await h.settle()
    h.assert_clean()


@pytest.mark.parametrize("style", [BOOT, HandoffStyle.CONTEXT_FIRST])
async def test_G9_C4_a_stop_after_a_kept_leg_produced_reaches_the_leg_though_unread(
    autojump_clock: trio.abc.Clock, style: HandoffStyle
) -> None:
    """The kept leg's first output waits unread in the channel (it fetched its KV) when
    the client stops its context: the stop reaches the leg (C4), which ends its stream
    with a cancelled finish, and no cleanup decode is made for KV already taken."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        context = RequestContext("r")
        async with trio.open_nursery() as nursery:
            stream = await h.router.stream(nursery, make_request(max_tokens=200), context)
            with stream.outputs:
                await wait_until(lambda: stream.outputs.statistics().current_buffer_used > 0)
                context.stop_generating()
                items = [item async for item in stream.outputs]
        assert tokens_of(items)
        assert finish_of(items[-1]) is FinishKind.CANCELLED
        assert h.router.counters.staged_kv_cleanups == 0
        await h.settle()
        h.assert_clean()


async def test_S12_selection_is_returned_and_the_request_left_as_it_was(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with TransferKeeper() as keeper:
        cluster = mock_cluster(prefill=3, decode=3, style=SEQ, latency=LATENCY)
        router = DisaggRouter(
            WorkerPool(cluster.prefill, policy=SessionAffinity()),
            WorkerPool(cluster.decode, policy=SessionAffinity()), keeper,
        )
        h = Harness(cluster, keeper, router)
        chosen = set()
        for i in range(4):
            request = make_request(f"r{i}", session="user-42")
            stream, _ = await h.run(request)
            assert request.routing.prefill_worker is None  # the decision is the stream's
            assert stream.prefill_worker is not None and stream.decode_worker is not None
            chosen.add((stream.prefill_worker, stream.decode_worker))
        assert len(chosen) == 1  # the same session always lands on the same workers
        await h.settle()
        h.assert_clean()


async def test_C4_C5_client_stop_reaches_decode_but_not_prefill(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, BOOT)
        context = RequestContext("req-1")
        async with trio.open_nursery() as nursery:
            stream = await h.router.stream(nursery, make_request(max_tokens=50), context)
            first = await stream.outputs.receive()
            assert tokens_of([first])
            context.stop_generating()
            rest = [item async for item in stream.outputs]
        assert finish_of(rest[-1]) is FinishKind.CANCELLED  # the decode stopped (C4)
        await h.settle()
        assert stream.prefill.succeeded  # the prefill was not stopped (C5, G9)
        h.assert_clean()


@pytest.mark.parametrize("bad", [-1.0, 0.0, math.nan])
def test_B2_deadlines_must_be_positive_seconds(bad: float) -> None:
    with pytest.raises(ValueError, match="prefill deadline must be > 0 seconds"):
        Deadlines(prefill=bad)


@pytest.mark.parametrize("bad", [True, "30", None])
def test_B2_a_deadline_that_is_not_a_number_of_seconds_is_a_type_error(bad: object) -> None:
    """``True`` is an int to Python, but not a deadline (it read as 1 s)."""
    with pytest.raises(TypeError, match="prefill deadline must be a number of seconds"):
        Deadlines(prefill=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("words", "cleanups"), [(205, 1), (300, 0)])
async def test_B1_B2_an_answer_on_its_way_at_the_prefill_deadline_is_consumed(
    autojump_clock: trio.abc.Clock, words: int, cleanups: int
) -> None:
    """The prefill deadline (2 s) expires while the worker finishes (at 2.05 s it stages
    KV and answers): the router still fails the request on its deadline, but reads the
    late answer within a short grace and consumes its KV (B1), instead of leaving it to
    the lease. An answer later than the grace is cancelled before anything is staged."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ, kv_ttl=1000.0,
                        deadlines=Deadlines(prefill=2, handoff=5, decode_idle=5))
        with pytest.raises(PrefillDeadlineExceeded):
            await h.run(make_request(words=words))
        await h.settle()
        h.assert_clean()  # nothing held, well before the 1000 s lease
        assert h.router.counters.staged_kv_cleanups == cleanups
        assert h.cluster.counters().served == cleanups


class AfterAnswer(StandIn):
    """A sequential prefill worker that answers (sends its handoff, staging KV) and then
    does ``after``: ``"trail"`` keeps its stream open ``trail`` seconds, ignoring a
    stop; ``"worker_error"`` raises a 503 (a contract breach: a refusal after started),
    ``"crash"`` a bug, ``"error_item"`` sends an error item (T4), ``"flood"`` sends
    outputs without end. ``"late_refusal"`` answers nothing, and refuses (503) after
    ``trail`` seconds."""

    def __init__(self, engine: Any, after: str, trail: float = 10.0) -> None:
        super().__init__(engine)
        self.after = after
        self.trail = trail

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with send_channel:
            if self.after == "late_refusal":
                await trio.sleep(self.trail)
                raise WorkerError("prefill worker went away", status=503)
            await self.engine.generate(request, context, send_channel.clone(),
                                       task_status=task_status)
            if self.after == "trail":
                await trio.sleep(self.trail)
            elif self.after == "worker_error":
                raise WorkerError("prefill worker went away", status=503)
            elif self.after == "crash":
                raise RuntimeError("engine bug after the handoff")
            elif self.after == "error_item":
                await send_channel.send(Annotated.from_error("late failure"))
            elif self.after == "flood":
                while True:
                    await send_channel.send(Annotated(data=LLMEngineOutput()))


def after_answer(keeper: TransferKeeper, after: str, style: HandoffStyle = SEQ,
                 window: CancelWindow | None = None, trail: float = 10.0) -> Harness:
    cluster = mock_cluster(style=style, latency=LATENCY, kv_ttl=1000.0)
    cluster.prefill[0] = AfterAnswer(  # type: ignore[call-overload]
        cluster.prefill[0], after, trail)
    windows = {cluster.prefill[0].name: window} if window else None
    router = DisaggRouter(WorkerPool(cluster.prefill, cancel_windows=windows),
                          WorkerPool(cluster.decode), keeper,
                          deadlines=Deadlines(prefill=2, handoff=5, decode_idle=5))
    return Harness(cluster, keeper, router)


@pytest.mark.parametrize(("trail", "outcome"), [(0.5, "answered"), (10.0, "deadline")])
async def test_B1_B2_a_sequential_prefill_deadline_bounds_its_whole_stream(
    autojump_clock: trio.abc.Clock, trail: float, outcome: str
) -> None:
    """The decode needs a sequential prefill's whole stream (S6), so the prefill deadline
    (2 s) bounds all of it, not only its first output: a stream that trails on past the
    deadline fails the request at the deadline (and its grace), and the KV its first
    output staged is consumed (B1), not left to the 1000 s lease."""
    async with TransferKeeper() as keeper:
        h = after_answer(keeper, "trail", trail=trail)
        start = trio.current_time()
        if outcome == "answered":
            _, items = await h.run(make_request())
            assert finish_of(items[-1]) is FinishKind.LENGTH
        else:
            with pytest.raises(PrefillDeadlineExceeded, match="prefill deadline of 2 s"):
                await h.run(make_request())
            assert trio.current_time() - start == pytest.approx(2.2, abs=0.05)
        await h.settle()
        h.assert_clean()  # nothing held, well before the 1000 s lease
        assert h.router.counters.staged_kv_cleanups == (outcome == "deadline")


@pytest.mark.parametrize("after", ["worker_error", "crash", "error_item", "flood"])
@pytest.mark.parametrize("style", [SEQ, HandoffStyle.CONTEXT_FIRST])
async def test_B1_T4_a_sequential_prefill_failing_after_its_answer_strands_nothing(
    autojump_clock: trio.abc.Clock, style: HandoffStyle, after: str
) -> None:
    """Whatever fails a sequential prefill after its handoff arrived (a refusal or a crash
    it should not raise, a later error item, outputs without end), the request gets a
    PrefillError and the KV the handoff staged is consumed (B1), not left to the lease."""
    async with TransferKeeper() as keeper:
        h = after_answer(keeper, after, style)
        with pytest.raises(PrefillError) as caught:
            await h.run(make_request())
        if after == "flood":
            assert "more than 64 outputs" in str(caught.value)
        await h.settle()
        h.assert_clean()
        assert h.router.counters.staged_kv_cleanups == 1


@pytest.mark.parametrize("style", [SEQ, HandoffStyle.CONTEXT_FIRST])
async def test_B10_a_stopped_prefill_that_answered_and_trails_on_is_not_a_failure(
    autojump_clock: trio.abc.Clock, style: HandoffStyle
) -> None:
    """The client leaves inside the cancel window while the handoff waits unread and the
    engine, ignoring the stop, keeps its stream open: the router ended that prefill on
    purpose (B10), so it is neither a failure nor a transfer deadline, and its KV is
    consumed (B1)."""
    async with TransferKeeper() as keeper:
        h = after_answer(keeper, "trail", style, CancelWindow.BEFORE_HANDOFF)
        with trio.move_on_after(0.2):  # the handoff arrives at about 0.1 s
            await h.run(make_request(words=10))
        await h.settle()
        h.assert_clean()
        assert keeper.failed_total == 0
        assert h.router.counters.staged_kv_cleanups == 1


async def test_B2_a_refusal_after_the_prefill_deadline_is_the_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A worker that refuses within the late-answer grace (at 2.05 s; deadline 2 s) is
    late all the same: the prefill deadline, not the refusal, and no retry (B9)."""
    async with TransferKeeper() as keeper:
        h = after_answer(keeper, "late_refusal", trail=2.05)
        with pytest.raises(PrefillDeadlineExceeded):
            await h.run(make_request())
        await h.settle()
        h.assert_clean()


async def test_stream_refuses_arguments_of_the_wrong_type_before_any_work(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A library caller who passed a request id as the context, a dict as the request, or
    no nursery got an AttributeError from deep inside; with no nursery the prefill had
    already run (its KV taken by a cleanup decode). Now a TypeError, bare, before any
    worker is asked."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, SEQ)
        request = make_request("typed")
        cases: list[tuple[Any, Any, Any, str]] = [
            (None, request, RequestContext("typed"), "nursery must be a trio.Nursery"),
            ("nursery", {"request_id": "typed"}, RequestContext("typed"),
             "request must be a trio_disagg.PreprocessedRequest, got dict"),
            ("nursery", request, "typed", "context must be a trio_disagg.RequestContext, got str"),
        ]
        async with trio.open_nursery() as nursery:
            for bad_nursery, bad_request, bad_context, match in cases:
                with pytest.raises(TypeError, match=match):
                    await h.router.stream(nursery if bad_nursery == "nursery" else bad_nursery,
                                          bad_request, bad_context)
        assert h.router.counters.requests_total == 0
        await h.settle()
        assert h.cluster.counters().staged_blocks == 0  # no prefill ran
    h.assert_clean()


@pytest.mark.parametrize("style", [SEQ, HandoffStyle.CONTEXT_FIRST, BOOT])
async def test_S5_S10_a_request_that_carries_a_handoff_already_is_refused(
    autojump_clock: trio.abc.Clock, style: HandoffStyle
) -> None:
    """``prefill_result`` and ``bootstrap_info`` are the router's to fill in. A request
    that carried a ``bootstrap_info`` already (one routed before, passed again) reached a
    sequential decode worker with that stale room beside its real handoff: the mock
    decode looked for the room, failed, and the KV the prefill staged was left to its
    lease. Now a ValueError from ``stream()``, before any prefill runs."""
    handoffs: list[dict[str, Any]] = [
        {"bootstrap_info": BootstrapInfo(host="h", port=1, room=5)},
        {"prefill_result": PrefillResult(disaggregated_params={"kv": 1})},
    ]
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        async with trio.open_nursery() as nursery:
            for handoff in handoffs:
                request = attrs.evolve(make_request(), **handoff)
                name = next(iter(handoff))
                with pytest.raises(ValueError, match=f"carries a {name} already"):
                    await h.router.stream(nursery, request, RequestContext("req-1"))
        assert h.router.counters.requests_total == 0
        await h.settle()
        assert h.cluster.counters().staged_blocks == 0  # no prefill ran
    h.assert_clean()


def test_a_router_refuses_arguments_of_the_wrong_type_when_it_is_made() -> None:
    """A new user's likely slip, the engine lists of ``mock_cluster`` given where
    :class:`WorkerPool`\\ s go, was accepted and failed each request with an
    AttributeError ("'list' object has no attribute 'select'") from inside ``stream()``;
    so did a missing keeper, and a fractional ``channel_buffer`` failed in trio. A prefill
    engine whose ``handoff_style`` was the style's string value was served as a
    sequential one, in silence. Now a TypeError naming the argument, when the router is
    made."""
    cluster = mock_cluster()
    pools: dict[str, Any] = {"prefill": WorkerPool(cluster.prefill),
                             "decode": WorkerPool(cluster.decode),
                             "keeper": TransferKeeper()}
    cases: list[tuple[str, Any, str]] = [
        ("prefill", cluster.prefill, "prefill must be a trio_disagg.WorkerPool, got list"),
        ("decode", cluster.decode, "decode must be a trio_disagg.WorkerPool, got list"),
        ("keeper", None, "keeper must be a trio_disagg.TransferKeeper, got NoneType"),
        ("deadlines", {"prefill": 5}, "deadlines must be a trio_disagg.Deadlines or None"),
        ("retry", 3, "retry must be a trio_disagg.RetryPolicy or None, got int"),
        ("channel_buffer", 1.5, "channel_buffer must be an int or math.inf"),
        ("channel_buffer", "4", "channel_buffer must be an int or math.inf"),
        ("disagg_min_prompt_tokens", "5", "disagg_min_prompt_tokens must be None or an int"),
    ]
    for name, bad, match in cases:
        with pytest.raises(TypeError, match=re.escape(match)):
            DisaggRouter(**{**pools, name: bad})
    with pytest.raises(ValueError, match="channel_buffer must be >= 0 items, got -1"):
        DisaggRouter(**pools, channel_buffer=-1)
    misstyled = mock_cluster().prefill[0]
    misstyled.handoff_style = "bootstrap"  # type: ignore[assignment]  # its value, a str
    with pytest.raises(TypeError, match=re.escape(
            "prefill engine prefill-0: handoff_style must be a trio_disagg.HandoffStyle, "
            "got 'bootstrap'")):
        DisaggRouter(**{**pools, "prefill": WorkerPool([misstyled])})


@pytest.mark.parametrize("style", STYLES)
async def test_B1_stream_into_a_closed_nursery_raises_and_strands_nothing(
    autojump_clock: trio.abc.Clock, style: HandoffStyle
) -> None:
    """A nursery that already exited is trio's RuntimeError, raised bare when the decode
    leg is started in it: after a sequential prefill, whose KV is then consumed as for a
    client that left (B1); a bootstrap prefill, dispatched with it, is ended (B6)."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style)
        async with trio.open_nursery() as closed:
            pass
        with pytest.raises(RuntimeError, match="closed"):
            await h.router.stream(closed, make_request("late"), RequestContext("late"))
        await h.settle()
        counters = h.cluster.counters()
        if style is SEQ:
            assert counters.freed_blocks == counters.staged_blocks > 0
        else:
            assert (counters.staged_blocks, counters.aborted) == (0, 1)
    h.assert_clean()


@pytest.mark.parametrize("style", STYLES)
async def test_B3_stream_over_a_keeper_that_is_not_open_raises_runtime_error_bare(
    autojump_clock: trio.abc.Clock, style: HandoffStyle
) -> None:
    """A router whose keeper was never entered, or has exited, refuses a disaggregated
    request with the keeper's RuntimeError, bare, and keeps nothing in flight."""
    async with TransferKeeper() as exited:
        pass
    for keeper in (exited, TransferKeeper()):
        h = harness_for(keeper, style)
        async with trio.open_nursery() as nursery:
            with pytest.raises(RuntimeError, match="TransferKeeper is not open"):
                await h.router.stream(nursery, make_request("k"), RequestContext("k"))
        h.assert_clean()


def buggy_callback(killed: bool) -> None:
    """An ``on_stop`` callback that raises (a bug: it must not)."""
    raise ZeroDivisionError("the bug")


async def test_B1_a_cleanup_the_in_process_mock_finds_without_kv_is_not_a_failure(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The client leaves while its prefill computes; the prefill then stages its KV,
    answers the handoff and fails, letting go of the KV (prefill_fail_after_handoff). The
    B1 cleanup decode the handoff calls for finds no KV to take, which is what it is for:
    the in-process mock decode says so as the HTTP workers do (a ``handoff_lost``
    WorkerError), and no cleanup failure is counted."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper)
        with trio.move_on_after(0.05):  # the prefill takes 10 x 0.01 s
            await h.run(make_request(words=10, fault="prefill_fail_after_handoff"))
        await h.settle()
        h.assert_clean()
    counters = h.router.counters
    assert counters.staged_kv_cleanups == 1
    assert counters.staged_kv_cleanup_failures == 0


@pytest.mark.parametrize("style", STYLES)
async def test_B2_a_prefill_longer_than_the_decode_idle_deadline_is_bounded_by_its_own(
    autojump_clock: trio.abc.Clock, style: HandoffStyle,
) -> None:
    """A prefill that computes for 3 s, well inside its 30 s deadline, with a decode-idle
    deadline of 1 s. The decode's first output needs the prefill's KV: however early the
    decode was dispatched (bootstrap: at once, into the room), it is not idle while the
    prefill it waits for runs within its own deadline. The request succeeds."""
    async with TransferKeeper() as keeper:
        h = harness_for(keeper, style, deadlines=Deadlines(
            prefill=30, handoff=30, decode_idle=1, terminal_hold=30, transfer=60))
        _, items = await h.run(make_request(words=300, max_tokens=3))  # 300 x 0.01 s
        assert not any(item.is_error for item in items), items[-1]
        last = items[-1].data
        assert last is not None and last.finish_reason is not None
        assert last.finish_reason.kind is FinishKind.LENGTH
        await h.settle()
        h.assert_clean()
