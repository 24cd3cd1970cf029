"""The in-process mock engines: handoff styles, KV lifetime, faults, cancellation, determinism.

docs/protocols.md sections 2, 3 and 5. Every test runs on trio's autojump clock, so latencies
are exact and nothing waits for real.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from trio_disagg import (
    Annotated,
    BootstrapInfo,
    Engine,
    FinishKind,
    FinishReason,
    HandoffStyle,
    LLMEngineOutput,
    PrefillResult,
    PreprocessedRequest,
    RequestContext,
    WorkerError,
)
from trio_disagg.engines import (
    DEFAULT_BOOTSTRAP_PORT,
    Fault,
    FaultKind,
    FaultPlan,
    KVBlockPool,
    KVCounters,
    KVRegistry,
    KVTransferError,
    LatencyModel,
    MockDecodeEngine,
    MockPrefillEngine,
    count_prompt_tokens,
    mock_cluster,
    parse_fault,
    parse_faults,
    resolve_max_tokens,
)

Item = Annotated[LLMEngineOutput]

#: 40 words: 40 prompt tokens, 3 blocks of 16.
PROMPT = " ".join(f"w{i}" for i in range(40))
PROMPT_TOKENS = 40
BLOCKS = 3
LATENCY = LatencyModel(ttft_per_prompt_token=0.01, inter_token_latency=0.5,
                       kv_transfer_per_token=0.1)


def request(rid: str = "r-1", *, prompt: str = PROMPT, max_tokens: int | None = 4,
            fault: Any = None, **fields: Any) -> PreprocessedRequest:
    body: dict[str, Any] = {"model": "mock", "prompt": prompt}
    if fault is not None:
        body["fault"] = fault
    return PreprocessedRequest(request_id=rid, model="mock", body=body, max_tokens=max_tokens,
                               **fields)


def after_prefill(req: PreprocessedRequest, handoff: Item) -> PreprocessedRequest:
    """The decode request the router builds from the prefill's handoff output."""
    assert handoff.data is not None and handoff.data.completion_usage is not None
    usage = handoff.data.completion_usage
    return attrs.evolve(req, prefill_result=PrefillResult(
        disaggregated_params=handoff.data.disaggregated_params,
        prompt_tokens_details=usage.prompt_tokens_details))


async def run_leg(engine: Engine, req: PreprocessedRequest,
                  context: RequestContext | None = None) -> list[Item]:
    """Dispatch one leg with ``nursery.start`` and collect its whole stream."""
    leg = Leg(engine, req, context=context)
    async with trio.open_nursery() as nursery:
        await leg.start(nursery)
    return leg.items


async def refused(engine: Engine, req: PreprocessedRequest) -> WorkerError:
    """Dispatch one leg that must refuse the request before ``started()``."""
    send, receive = trio.open_memory_channel[Item](math.inf)
    async with trio.open_nursery() as nursery:
        with pytest.raises(WorkerError) as info:
            await nursery.start(engine.generate, req, RequestContext(req.request_id), send)
    with pytest.raises(trio.EndOfChannel):  # the engine closed its channel
        receive.receive_nowait()
    return info.value


class Leg:
    """A leg running in the background, its items collected as they come."""

    def __init__(self, engine: Engine, req: PreprocessedRequest, *, buffer: float = math.inf,
                 context: RequestContext | None = None) -> None:
        self.engine = engine
        self.request = req
        self.context = context if context is not None else RequestContext(req.request_id)
        self.items: list[Item] = []
        self.ended = trio.Event()
        self.ended_at: float | None = None
        self.send, self.receive = trio.open_memory_channel[Item](buffer)

    async def start(self, nursery: trio.Nursery, *, read: bool = True) -> None:
        await nursery.start(self.engine.generate, self.request, self.context, self.send)
        if read:
            nursery.start_soon(self.read)

    async def read(self) -> None:
        with self.receive:
            async for item in self.receive:
                self.items.append(item)
        self.ended_at = trio.current_time()
        self.ended.set()


def tokens_of(items: list[Item]) -> list[int]:
    return [t for item in items if item.data is not None for t in item.data.token_ids]


def finish_of(item: Item) -> FinishReason | None:
    assert item.data is not None, item
    return item.data.finish_reason


def cluster(style: HandoffStyle = HandoffStyle.SEQUENTIAL, **settings: Any
            ) -> tuple[MockPrefillEngine, MockDecodeEngine]:
    registry = KVRegistry()
    prefill = MockPrefillEngine(registry, style=style, latency=settings.pop("latency", LATENCY),
                                **settings)
    decode = MockDecodeEngine(registry, latency=prefill.latency,
                              bootstrap_timeout=prefill.bootstrap_timeout)
    return prefill, decode


def bootstrap_request(prefill: MockPrefillEngine, rid: str = "r-1", *, room: int = 7,
                      **fields: Any) -> PreprocessedRequest:
    assert prefill.bootstrap_host is not None and prefill.bootstrap_port is not None
    info = BootstrapInfo(host=prefill.bootstrap_host, port=prefill.bootstrap_port, room=room)
    return request(rid, bootstrap_info=info, **fields)


# --- the Engine contract ----------------------------------------------------------------


def test_mock_engines_are_engines() -> None:
    registry = KVRegistry()
    prefill: Engine = MockPrefillEngine(registry)
    decode: Engine = MockDecodeEngine(registry)
    assert isinstance(prefill, Engine) and isinstance(decode, Engine)
    assert prefill.handoff_style is HandoffStyle.SEQUENTIAL
    assert prefill.bootstrap_host is None and prefill.bootstrap_port is None
    boot = MockPrefillEngine(registry, "boot-0", style=HandoffStyle.BOOTSTRAP)
    assert (boot.bootstrap_host, boot.bootstrap_port) == ("inproc", DEFAULT_BOOTSTRAP_PORT)
    boot1 = MockPrefillEngine(registry, "boot-1", style=HandoffStyle.BOOTSTRAP)
    assert boot1.bootstrap_port == DEFAULT_BOOTSTRAP_PORT + 1
    with pytest.raises(ValueError, match="already registered"):
        MockPrefillEngine(registry, "boot-0")


def test_mock_cluster_builds_linked_engines() -> None:
    c = mock_cluster(2, 3, style=HandoffStyle.BOOTSTRAP, latency=LatencyModel.zero())
    assert [e.name for e in c.prefill] == ["prefill-0", "prefill-1"]
    assert [e.name for e in c.decode] == ["decode-0", "decode-1", "decode-2"]
    assert all(e.registry is c.registry for e in c.prefill)
    assert all(e.registry is c.registry for e in c.decode)
    assert c.counters() == KVCounters()


def test_latency_model_validates_and_has_zero() -> None:
    assert LatencyModel.zero().is_zero
    assert not LatencyModel().is_zero
    assert LATENCY.time_to_first_token(40) == pytest.approx(0.4)
    assert LATENCY.kv_transfer_time(40) == pytest.approx(4.0)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="inter_token_latency"):
            LatencyModel(inter_token_latency=bad)


# --- sequential (vLLM) handoff ----------------------------------------------------------


async def test_sequential_handoff_end_to_end(autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster()
    req = request(max_tokens=4)

    first = await run_leg(prefill, req)
    assert trio.current_time() == pytest.approx(0.4)  # ttft: 40 tokens x 10 ms
    assert len(first) == 1
    handoff = first[0]
    assert handoff.data is not None
    assert handoff.data.finish_reason == FinishReason.LENGTH
    assert len(handoff.data.token_ids) == 1
    params = handoff.data.disaggregated_params
    assert params == {
        "remote_engine_id": "prefill-0", "remote_request_id": "r-1",
        "remote_block_ids": [0, 1, 2], "remote_host": "inproc", "remote_port": 0,
        "do_remote_prefill": True, "do_remote_decode": False, "tp_size": 1,
    }
    usage = handoff.data.completion_usage
    assert usage is not None and usage.prompt_tokens == PROMPT_TOKENS
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached % 16 == 0 and 0 <= cached < PROMPT_TOKENS
    assert handoff.data.worker_trace_link is not None
    assert handoff.data.worker_trace_link.worker_id == "prefill-0"
    assert prefill.counters() == KVCounters(held_blocks=BLOCKS, held=1, staged_blocks=BLOCKS)

    start = trio.current_time()
    out = await run_leg(decode, after_prefill(req, handoff))
    # the transfer (40 x 100 ms), then 4 tokens at 500 ms
    assert trio.current_time() - start == pytest.approx(4.0 + 4 * 0.5)
    assert len(out) == 4
    assert [len(item.data.token_ids) for item in out if item.data] == [1, 1, 1, 1]
    assert all(item.data is not None and item.data.text for item in out)
    assert [finish_of(i) for i in out] == [None, None, None, FinishReason.LENGTH]
    assert tokens_of(out)[0] == handoff.data.token_ids[0]  # the same first token
    last = out[-1].data
    assert last is not None and last.completion_usage is not None
    assert last.completion_usage.prompt_tokens == PROMPT_TOKENS
    assert last.completion_usage.completion_tokens == 4
    assert last.completion_usage.total_tokens == PROMPT_TOKENS + 4
    # the decode sees the whole prompt as cached, like a real one: the client's
    # cached_tokens must come from the prefill
    assert last.completion_usage.prompt_tokens_details is not None
    assert last.completion_usage.prompt_tokens_details.cached_tokens == PROMPT_TOKENS
    assert prefill.counters() == KVCounters(staged_blocks=BLOCKS, freed_blocks=BLOCKS, served=1)


async def test_kv_can_be_pulled_once(autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster()
    req = request()
    (handoff,) = await run_leg(prefill, req)
    await run_leg(decode, after_prefill(req, handoff))
    again = await run_leg(decode, after_prefill(req, handoff))
    assert len(again) == 1 and again[0].is_error
    assert "no KV staged under 'r-1' on 'prefill-0'" in (again[0].error_message() or "")


async def test_minimal_decode_request_frees_kv(autojump_clock: trio.testing.MockClock) -> None:
    # B1: a client gone at handoff time; the router sends one token, not streamed.
    prefill, decode = cluster()
    req = request()
    (handoff,) = await run_leg(prefill, req)
    minimal = attrs.evolve(after_prefill(req, handoff), max_tokens=1, stream=False)
    out = await run_leg(decode, minimal)
    assert len(out) == 1 and finish_of(out[0]) == FinishReason.LENGTH
    assert prefill.counters().held_blocks == 0
    assert prefill.counters().served == 1


async def test_kv_lease_expires_and_counts_stranded(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster(kv_ttl=30.0)
    req = request()
    (handoff,) = await run_leg(prefill, req)
    await trio.sleep(29.0)
    assert prefill.counters().held_blocks == BLOCKS
    await trio.sleep(2.0)
    # expiry is lazy: reading the counters strands what is due
    assert prefill.counters() == KVCounters(staged_blocks=BLOCKS, stranded_blocks=BLOCKS,
                                            expired=1)
    out = await run_leg(decode, after_prefill(req, handoff))
    assert len(out) == 1 and out[0].is_error
    assert "expired (lease 30 s)" in (out[0].error_message() or "")
    assert prefill.counters().served == 0


async def test_decode_aborted_before_pull_frees_kv_at_once(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster()
    req = request()
    (handoff,) = await run_leg(prefill, req)
    stalled = attrs.evolve(after_prefill(req, handoff), body={**req.body, "fault": "decode_stall"})
    leg = Leg(decode, stalled)
    async with trio.open_nursery() as nursery:
        await leg.start(nursery)
        await trio.sleep(5.0)
        assert prefill.counters().held_blocks == BLOCKS  # queued, not pulled
        stopped_at = trio.current_time()
        leg.context.stop_generating()
        await leg.ended.wait()
        assert leg.ended_at == stopped_at
    assert [finish_of(i) for i in leg.items] == [FinishReason.CANCELLED]
    assert prefill.counters() == KVCounters(staged_blocks=BLOCKS, freed_blocks=BLOCKS,
                                            aborted=1)


async def test_decode_on_a_stopped_context_frees_kv(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster()
    req = request()
    (handoff,) = await run_leg(prefill, req)
    context = RequestContext("r-1")
    context.stop_generating()
    out = await run_leg(decode, after_prefill(req, handoff), context)
    assert [finish_of(i) for i in out] == [FinishReason.CANCELLED]
    assert prefill.counters().held_blocks == 0 and prefill.counters().aborted == 1


async def test_decode_cancelled_by_its_caller_frees_kv(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster()
    req = request()
    (handoff,) = await run_leg(prefill, req)
    # cancelled mid-transfer
    with trio.move_on_after(1.0):
        await run_leg(decode, after_prefill(req, handoff))
    assert prefill.counters() == KVCounters(staged_blocks=BLOCKS, freed_blocks=BLOCKS,
                                            aborted=1)


async def test_decode_whose_receiver_closed_frees_kv(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster()
    req = request()
    (handoff,) = await run_leg(prefill, req)
    send, receive = trio.open_memory_channel[Item](0)
    receive.close()
    # awaited directly, without nursery.start: the contract allows it
    await decode.generate(after_prefill(req, handoff), RequestContext("r-1"), send)
    assert prefill.counters().held_blocks == 0


async def test_prefill_stopped_while_handing_off_releases_kv(
        autojump_clock: trio.testing.MockClock) -> None:
    # nobody reads the handoff: the KV was never handed to anyone, so it is not stranded
    prefill, _ = cluster()
    leg = Leg(prefill, request(), buffer=0)
    async with trio.open_nursery() as nursery:
        await leg.start(nursery, read=False)
        await trio.sleep(1.0)
        assert prefill.counters().held_blocks == BLOCKS
        leg.context.kill()
    assert prefill.counters() == KVCounters(staged_blocks=BLOCKS, freed_blocks=BLOCKS,
                                            aborted=1)


async def test_prefill_whose_receiver_closed_counts_an_abort(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, _ = cluster()
    send, receive = trio.open_memory_channel[Item](0)
    receive.close()
    await prefill.generate(request(), RequestContext("r-1"), send)
    assert prefill.counters() == KVCounters(staged_blocks=BLOCKS, freed_blocks=BLOCKS,
                                            aborted=1)


async def test_decode_error_when_handoff_names_an_unknown_engine(
        autojump_clock: trio.testing.MockClock) -> None:
    _, decode = cluster()
    bad = request(prefill_result=PrefillResult(disaggregated_params={
        "remote_engine_id": "nope", "remote_request_id": "r-1", "remote_block_ids": [0]}))
    out = await run_leg(decode, bad)
    assert len(out) == 1 and out[0].is_error
    assert "no prefill engine named 'nope'" in (out[0].error_message() or "")
    garbled = request(prefill_result=PrefillResult(disaggregated_params="x"))
    (item,) = await run_leg(decode, garbled)
    assert "must be an object" in (item.error_message() or "")


async def test_decode_checks_block_ids(autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster()
    req = request()
    (handoff,) = await run_leg(prefill, req)
    assert handoff.data is not None and isinstance(handoff.data.disaggregated_params, dict)
    params = {**handoff.data.disaggregated_params, "remote_block_ids": [5, 6, 7]}
    bad = attrs.evolve(req, prefill_result=PrefillResult(disaggregated_params=params))
    (item,) = await run_leg(decode, bad)
    assert "holds blocks [0, 1, 2], not [5, 6, 7]" in (item.error_message() or "")


# --- bootstrap (SGLang) handoff ---------------------------------------------------------


@pytest.mark.parametrize("decode_first", [True, False])
async def test_bootstrap_handoff(autojump_clock: trio.testing.MockClock,
                                 decode_first: bool) -> None:
    prefill, decode = cluster(HandoffStyle.BOOTSTRAP)
    req = bootstrap_request(prefill, max_tokens=3)
    p_leg, d_leg = Leg(prefill, req), Leg(decode, req)
    async with trio.open_nursery() as nursery:
        first, second = (d_leg, p_leg) if decode_first else (p_leg, d_leg)
        await first.start(nursery)
        await trio.sleep(5.0)
        await second.start(nursery)
    # prefill: the bootstrap triple at once, then one token once the transfer is done
    head = p_leg.items[0].data
    assert head is not None and head.finish_reason is None and head.token_ids == []
    assert head.disaggregated_params == {"bootstrap_host": "inproc",
                                         "bootstrap_port": DEFAULT_BOOTSTRAP_PORT,
                                         "bootstrap_room": 7}
    assert head.completion_usage is not None
    assert head.completion_usage.prompt_tokens == PROMPT_TOKENS
    assert len(p_leg.items) == 2 and finish_of(p_leg.items[1]) == FinishReason.LENGTH
    # the transfer (4 s) starts once the KV is computed (0.4 s) and the decode is there;
    # the prefill's stream ends with it
    prefill_start, decode_start = (5.0, 0.0) if decode_first else (0.0, 5.0)
    transfer_start = max(prefill_start + 0.4, decode_start)
    assert p_leg.ended_at == pytest.approx(transfer_start + 4.0)
    assert [finish_of(i) for i in d_leg.items] == [None, None, FinishReason.LENGTH]
    assert d_leg.ended_at == pytest.approx(transfer_start + 4.0 + 3 * 0.5)
    assert tokens_of(d_leg.items)[0] == tokens_of(p_leg.items)[0]
    assert prefill.counters() == KVCounters(staged_blocks=BLOCKS, freed_blocks=BLOCKS, served=1)
    assert prefill.kv.open_rooms == 0


async def test_bootstrap_decode_may_use_params_from_prefill_result(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster(HandoffStyle.BOOTSTRAP)
    req = bootstrap_request(prefill)
    p_leg = Leg(prefill, req)
    async with trio.open_nursery() as nursery:
        await p_leg.start(nursery)
        await trio.sleep(0.1)
        head = p_leg.items[0]
        out = await run_leg(decode, attrs.evolve(after_prefill(req, head),
                                                 bootstrap_info=None))
    assert finish_of(out[-1]) == FinishReason.LENGTH
    assert prefill.counters().served == 1


async def test_bootstrap_prefill_times_out_without_decode(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, _ = cluster(HandoffStyle.BOOTSTRAP, bootstrap_timeout=10.0)
    out = await run_leg(prefill, bootstrap_request(prefill))
    assert trio.current_time() == pytest.approx(0.4 + 10.0)
    assert len(out) == 2 and out[1].is_error
    assert "no decode joined bootstrap room 7 within 10 s" in (out[1].error_message() or "")
    assert prefill.counters() == KVCounters(staged_blocks=BLOCKS, stranded_blocks=BLOCKS,
                                            expired=1)
    assert prefill.kv.open_rooms == 0


async def test_bootstrap_decode_times_out_without_prefill(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster(HandoffStyle.BOOTSTRAP, bootstrap_timeout=10.0)
    out = await run_leg(decode, bootstrap_request(prefill))
    assert trio.current_time() == pytest.approx(10.0)
    assert len(out) == 1 and out[0].is_error
    assert "never staged KV in bootstrap room 7 within 10 s" in (out[0].error_message() or "")
    assert prefill.kv.open_rooms == 0


async def test_bootstrap_room_is_not_reused(autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster(HandoffStyle.BOOTSTRAP, bootstrap_timeout=10.0)
    async with trio.open_nursery() as nursery:
        first = Leg(decode, bootstrap_request(prefill, "r-1"))
        await first.start(nursery)
        out = await run_leg(decode, bootstrap_request(prefill, "r-2"))
        assert len(out) == 1 and out[0].is_error
        assert "already has a decode request" in (out[0].error_message() or "")
        first.context.kill()


async def test_bootstrap_decode_stopped_before_pull_frees_kv(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster(HandoffStyle.BOOTSTRAP)
    req = bootstrap_request(prefill)
    p_leg = Leg(prefill, req)
    d_leg = Leg(decode, attrs.evolve(req, body={**req.body, "fault": "decode_stall"}))
    async with trio.open_nursery() as nursery:
        await p_leg.start(nursery)
        await d_leg.start(nursery)
        await trio.sleep(5.0)
        assert prefill.counters().held_blocks == BLOCKS
        d_leg.context.stop_generating()
    assert [finish_of(i) for i in d_leg.items] == [FinishReason.CANCELLED]
    assert p_leg.ended_at == pytest.approx(5.0)  # the prefill is told at once
    assert p_leg.items[-1].is_error
    assert "left bootstrap room 7 before" in (p_leg.items[-1].error_message() or "")
    assert prefill.counters() == KVCounters(staged_blocks=BLOCKS, freed_blocks=BLOCKS,
                                            aborted=1)
    assert prefill.kv.open_rooms == 0


async def test_bootstrap_prefill_needs_bootstrap_info(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, _ = cluster(HandoffStyle.BOOTSTRAP)
    error = await refused(prefill, request())
    assert "needs bootstrap_info" in str(error) and error.status == 400
    wrong = request(bootstrap_info=BootstrapInfo(host="inproc", port=1, room=1))
    assert "not inproc:1" in str(await refused(prefill, wrong))


# --- faults -------------------------------------------------------------------------------


def test_parse_fault() -> None:
    assert parse_fault("prefill_stall") == Fault(FaultKind.PREFILL_STALL)
    assert parse_fault("decode_error_at:3") == Fault(FaultKind.DECODE_ERROR_AT, at=3)
    assert parse_fault("decode_reject") == Fault(FaultKind.DECODE_REJECT, status=503)
    assert parse_fault("prefill_reject:429").status == 429
    assert parse_fault("decode_reject:503:5") == Fault(FaultKind.DECODE_REJECT, status=503,
                                                       retry_after=5)
    assert str(parse_fault("decode_reject:503:5")) == "decode_reject:503:5"
    with pytest.raises(ValueError, match="whole seconds after the status"):
        parse_fault("decode_reject:503:soon")
    assert str(parse_fault("decode_stall_at:2")) == "decode_stall_at:2"
    assert FaultKind.EOS_FIRST_TOKEN.role == "prefill"
    assert FaultKind.DECODE_STALL.role == "decode"
    with pytest.raises(ValueError, match=r"unknown fault 'boom'; known faults: .*prefill_stall"):
        parse_fault("boom")
    with pytest.raises(ValueError, match="needs a token count"):
        parse_fault("decode_error_at")
    with pytest.raises(ValueError, match="takes no argument"):
        parse_fault("prefill_stall:3")
    with pytest.raises(ValueError, match="HTTP status"):
        parse_fault("decode_reject:200")
    assert parse_faults("prefill_stall, decode_error_at:1") == (
        Fault(FaultKind.PREFILL_STALL), Fault(FaultKind.DECODE_ERROR_AT, at=1))
    assert parse_faults(["eos_first_token"]) == (Fault(FaultKind.EOS_FIRST_TOKEN),)
    assert parse_faults(None) == ()
    with pytest.raises(ValueError, match="at most one decode fault"):
        parse_faults(["decode_stall", "decode_error_at:1"])
    with pytest.raises(ValueError, match="string or a list"):
        parse_faults(3)


async def test_unknown_fault_is_refused_before_started(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster()
    for engine in (prefill, decode):
        error = await refused(engine, request(fault="nope"))
        assert "unknown fault 'nope'" in str(error) and error.status == 400


async def test_reject_faults(autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster()
    error = await refused(prefill, request(fault="prefill_reject:429"))
    assert "refused" in str(error)
    assert error.status == 429 and error.worker == "prefill-0"
    assert error.retry_after is None
    error = await refused(prefill, request(fault="prefill_reject:429:7"))
    assert (error.status, error.retry_after) == (429, 7)
    assert prefill.counters() == KVCounters()
    req = request(fault="decode_reject")
    (handoff,) = await run_leg(prefill, req)
    error = await refused(decode, after_prefill(req, handoff))
    assert error.status == 503 and error.worker == "decode-0"
    # a worker that refused the request never tells the prefill: the lease reclaims it
    assert prefill.counters().held_blocks == BLOCKS


@pytest.mark.parametrize("style", list(HandoffStyle))
@pytest.mark.parametrize(("fault", "expect"), [
    ("prefill_fail_before_handoff", "error item"),
    ("prefill_error_finish", FinishReason.error("x")),
    ("prefill_cancelled_finish", FinishReason.CANCELLED),
    ("eos_first_token", FinishReason.EOS),
    ("prefill_reset", "nothing"),
])
async def test_prefill_faults_before_handoff_stage_nothing(
        autojump_clock: trio.testing.MockClock, style: HandoffStyle, fault: str,
        expect: object) -> None:
    prefill, _ = cluster(style)
    req = bootstrap_request(prefill, fault=fault) if style is HandoffStyle.BOOTSTRAP \
        else request(fault=fault)
    out = await run_leg(prefill, req)
    if expect == "nothing":
        assert out == []
    elif expect == "error item":
        assert len(out) == 1 and out[0].is_error
        assert f"injected fault {fault}" in (out[0].error_message() or "")
    else:
        assert len(out) == 1
        data = out[0].data
        assert data is not None and data.disaggregated_params is None
        assert isinstance(expect, FinishReason)
        assert data.finish_reason is not None and data.finish_reason.kind is expect.kind
        if expect.kind is FinishKind.EOS:
            assert len(data.token_ids) == 1
    assert prefill.counters() == KVCounters()
    assert prefill.kv.open_rooms == 0


async def test_prefill_fail_after_handoff_sequential(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, _ = cluster()
    out = await run_leg(prefill, request(fault="prefill_fail_after_handoff"))
    assert len(out) == 2
    assert out[0].data is not None and out[0].data.disaggregated_params is not None
    assert out[1].is_error
    # the failed request's KV is freed by the worker, not left to its lease
    assert prefill.counters() == KVCounters(staged_blocks=BLOCKS, freed_blocks=BLOCKS,
                                            aborted=1)


async def test_prefill_fail_after_handoff_bootstrap(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster(HandoffStyle.BOOTSTRAP)
    req = bootstrap_request(prefill, fault="prefill_fail_after_handoff", max_tokens=3)
    p_leg, d_leg = Leg(prefill, req), Leg(decode, req)
    async with trio.open_nursery() as nursery:
        await p_leg.start(nursery)
        await d_leg.start(nursery)
    assert len(p_leg.items) == 2 and p_leg.items[1].is_error
    assert p_leg.ended_at == pytest.approx(0.4 + 4.0)  # after the decode joined and pulled
    assert finish_of(d_leg.items[-1]) == FinishReason.LENGTH  # the gatekeeper's job now
    assert prefill.counters().served == 1 and prefill.counters().held_blocks == 0


@pytest.mark.parametrize("kill", [False, True])
async def test_prefill_stall_until_stopped(autojump_clock: trio.testing.MockClock,
                                           kill: bool) -> None:
    prefill, _ = cluster()
    leg = Leg(prefill, request(fault="prefill_stall"))
    async with trio.open_nursery() as nursery:
        await leg.start(nursery)
        await trio.sleep(1000.0)
        assert leg.items == [] and not leg.ended.is_set()
        leg.context.kill() if kill else leg.context.stop_generating()
    assert leg.ended_at == pytest.approx(1000.0)
    assert [finish_of(i) for i in leg.items] == ([] if kill else [FinishReason.CANCELLED])
    assert prefill.counters() == KVCounters(aborted=1)


async def test_decode_error_at(autojump_clock: trio.testing.MockClock) -> None:
    _, decode = cluster()
    out = await run_leg(decode, request(fault="decode_error_at:2", max_tokens=5))
    assert len(out) == 3 and len(tokens_of(out)) == 2 and out[2].is_error
    assert "injected fault decode_error_at" in (out[2].error_message() or "")
    beyond = await run_leg(decode, request(fault="decode_error_at:9", max_tokens=5))
    assert finish_of(beyond[-1]) == FinishReason.LENGTH


async def test_decode_stall_at(autojump_clock: trio.testing.MockClock) -> None:
    _, decode = cluster()
    leg = Leg(decode, request(fault="decode_stall_at:2", max_tokens=5))
    async with trio.open_nursery() as nursery:
        await leg.start(nursery)
        await trio.sleep(100.0)
        assert len(leg.items) == 2 and not leg.ended.is_set()
        leg.context.stop_generating()
    cancelled = leg.items[-1].data
    assert cancelled is not None and cancelled.finish_reason == FinishReason.CANCELLED
    assert cancelled.completion_usage is not None
    assert cancelled.completion_usage.completion_tokens == 2


async def test_decode_reset_at(autojump_clock: trio.testing.MockClock) -> None:
    _, decode = cluster()
    out = await run_leg(decode, request(fault="decode_reset_at:1", max_tokens=5))
    assert len(out) == 1 and finish_of(out[0]) is None  # no terminal item at all


async def test_decode_fail_before_first_token_releases_kv(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster()
    req = request(fault="decode_fail_before_first_token")
    (handoff,) = await run_leg(prefill, req)
    out = await run_leg(decode, after_prefill(req, handoff))
    assert len(out) == 1 and out[0].is_error
    assert prefill.counters() == KVCounters(staged_blocks=BLOCKS, freed_blocks=BLOCKS,
                                            aborted=1)


async def test_fault_plan_is_deterministic(autojump_clock: trio.testing.MockClock) -> None:
    plan = FaultPlan(faults=["prefill_fail_before_handoff"], rate=0.5, seed=3)
    picks = [plan.pick(f"r-{i}") for i in range(200)]
    assert picks == [plan.pick(f"r-{i}") for i in range(200)]
    assert 60 < sum(p is not None for p in picks) < 140
    registry = KVRegistry()
    prefill = MockPrefillEngine(registry, latency=LatencyModel.zero(), fault_plan=plan)
    failed = [i for i in range(20)
              if (await run_leg(prefill, request(f"r-{i}")))[0].is_error]
    assert failed == [i for i in range(20) if picks[i] is not None]
    # a body that names its faults (even none) overrides the plan
    for i in failed:
        (item,) = await run_leg(prefill, request(f"r-{i}", fault=[]))
        assert not item.is_error
    with pytest.raises(ValueError, match="rate"):
        FaultPlan(faults=["prefill_stall"], rate=1.5)


# --- stop, kill ------------------------------------------------------------------------------


async def test_decode_stop_ends_with_cancelled(autojump_clock: trio.testing.MockClock) -> None:
    _, decode = cluster()
    leg = Leg(decode, request(max_tokens=10))
    async with trio.open_nursery() as nursery:
        await leg.start(nursery)
        await trio.sleep(0.4 + 3 * 0.5 + 0.1)  # ttft, three tokens
        leg.context.stop_generating()
    assert len(leg.items) == 4
    assert [finish_of(i) for i in leg.items] == [None, None, None, FinishReason.CANCELLED]
    usage = leg.items[-1].data.completion_usage if leg.items[-1].data else None
    assert usage is not None and usage.completion_tokens == 3


async def test_decode_kill_ends_at_once_even_if_blocked(
        autojump_clock: trio.testing.MockClock) -> None:
    prefill, decode = cluster()
    req = request(max_tokens=10)
    (handoff,) = await run_leg(prefill, req)
    leg = Leg(decode, after_prefill(req, handoff), buffer=0)
    async with trio.open_nursery() as nursery:
        await leg.start(nursery, read=False)  # nobody reads: the first send blocks
        await trio.sleep(100.0)
        leg.context.stop_generating()  # the cancelled item cannot be delivered either
        await trio.sleep(1.0)
        killed_at = trio.current_time()
        leg.context.kill()
    assert trio.current_time() == killed_at
    with leg.receive, pytest.raises(trio.EndOfChannel):  # closed by the engine
        leg.receive.receive_nowait()
    assert prefill.counters().served == 1


async def test_kill_while_streaming_sends_nothing_more(
        autojump_clock: trio.testing.MockClock) -> None:
    _, decode = cluster()
    leg = Leg(decode, request(max_tokens=10))
    async with trio.open_nursery() as nursery:
        await leg.start(nursery)
        await trio.sleep(0.4 + 2 * 0.5 + 0.1)
        leg.context.kill()
    assert len(leg.items) == 2 and all(finish_of(i) is None for i in leg.items)


# --- determinism, text, no handoff -----------------------------------------------------------


async def test_same_seed_same_tokens(autojump_clock: trio.testing.MockClock) -> None:
    async def tokens(seed: int, rid: str) -> tuple[list[int], str]:
        decode = MockDecodeEngine(KVRegistry(), latency=LatencyModel.zero(), seed=seed)
        out = await run_leg(decode, request(rid, max_tokens=16))
        return tokens_of(out), "".join(i.data.text or "" for i in out if i.data)

    first = await tokens(1, "r-1")
    assert first == await tokens(1, "r-1")
    assert first != await tokens(2, "r-1")
    assert first != await tokens(1, "r-2")
    assert len(first[0]) == 16 and len(first[1].split()) == 16


async def test_zero_latency_takes_no_time(autojump_clock: trio.testing.MockClock) -> None:
    c = mock_cluster(latency=LatencyModel.zero())
    req = request(max_tokens=16)
    (handoff,) = await run_leg(c.prefill[0], req)
    out = await run_leg(c.decode[0], after_prefill(req, handoff))
    assert len(out) == 16 and trio.current_time() == 0.0
    assert c.counters() == KVCounters(staged_blocks=BLOCKS, freed_blocks=BLOCKS, served=1)


async def test_decode_without_handoff_computes_the_prefill(
        autojump_clock: trio.testing.MockClock) -> None:
    _, decode = cluster()
    out = await run_leg(decode, request(max_tokens=2))
    assert trio.current_time() == pytest.approx(0.4 + 2 * 0.5)
    assert [finish_of(i) for i in out] == [None, FinishReason.LENGTH]
    eos = await run_leg(decode, request(max_tokens=5, fault="eos_first_token"))
    assert len(eos) == 1 and finish_of(eos[0]) == FinishReason.EOS


async def test_eos_rate_ends_early_at_a_seeded_point(
        autojump_clock: trio.testing.MockClock) -> None:
    decode = MockDecodeEngine(KVRegistry(), latency=LatencyModel.zero(), eos_rate=0.3)
    lengths = []
    for i in range(20):
        out = await run_leg(decode, request(f"r-{i}", max_tokens=50))
        assert finish_of(out[-1]) in (FinishReason.EOS, FinishReason.LENGTH)
        lengths.append(len(out))
    assert min(lengths) < 50
    again = [len(await run_leg(decode, request(f"r-{i}", max_tokens=50))) for i in range(20)]
    assert again == lengths


def test_count_prompt_tokens() -> None:
    assert count_prompt_tokens({"prompt": "a b  c"}) == 3
    assert count_prompt_tokens({"prompt": ""}) == 1
    assert count_prompt_tokens({}) == 1
    assert count_prompt_tokens({"prompt": ["a b", "c"]}) == 3
    assert count_prompt_tokens({"prompt": [1, 2, 3, 4]}) == 4
    assert count_prompt_tokens({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi there"}]},
    ]}) == 4
    assert count_prompt_tokens({"input_ids": [5, 6]}) == 2


def test_resolve_max_tokens() -> None:
    assert resolve_max_tokens(3, {"max_tokens": 9}, 16) == 3
    assert resolve_max_tokens(None, {"max_tokens": 9}, 16) == 9
    assert resolve_max_tokens(None, {"max_completion_tokens": 5, "max_tokens": 9}, 16) == 5
    assert resolve_max_tokens(None, {}, 16) == 16
    assert resolve_max_tokens(-2, {}, 16) == 0


# --- the KV pool on its own --------------------------------------------------------------------


async def test_kv_pool_accounting(autojump_clock: trio.testing.MockClock) -> None:
    pool = KVBlockPool("p", block_size=16, ttl=10.0)
    a = pool.stage("a", 17)
    assert a.block_ids == [0, 1] and a.key == "a"
    twin = pool.stage("a", 1)  # the same request id staged twice gets its own key
    assert twin.key != "a" and twin.block_ids == [2]
    assert pool.release_key(twin.key) and not pool.release_key(twin.key)
    claimed = pool.claim("a", [0, 1])
    with pytest.raises(KVTransferError, match="no KV staged under 'a'"):
        pool.claim("a")
    await trio.sleep(20.0)
    assert pool.held_blocks == 2  # a transfer in progress does not expire
    pool.complete(claimed)
    pool.stage("b", 16)
    await trio.sleep(10.0)
    assert pool.counters() == KVCounters(staged_blocks=4, freed_blocks=3, stranded_blocks=1,
                                         served=1, aborted=1, expired=1)
    with pytest.raises(ValueError, match="block_size"):
        KVBlockPool(block_size=0)


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"prefill": -1}, ValueError, "prefill must be an integer >= 0 engines, got -1"),
        ({"decode": -2}, ValueError, "decode must be an integer >= 0 engines, got -2"),
        ({"decode": 1.5}, ValueError, "decode must be an integer >= 0 engines, got 1.5"),
        ({"latency": "fast"}, TypeError, "latency must be a LatencyModel or None, got str"),
    ],
)
def test_mock_cluster_refuses_bad_settings(
    settings: dict[str, Any], error: type[Exception], match: str
) -> None:
    """``mock_cluster(decode=-1)`` was a cluster with no decode engine, and
    ``latency="fast"`` a cluster whose first request failed deep inside an engine."""
    with pytest.raises(error, match=match):
        mock_cluster(**settings)
