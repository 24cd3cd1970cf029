"""The SGLang adapter against the mock SGLang workers over real sockets (docs/protocols.md
sections 1, 3 and 5): the bootstrap handoff (S5) with prefill and decode dispatched at once
and meeting in a room on the prefill's bootstrap port, the drain of the prefill by the
transfer keeper (T1-T4), the gatekeeper's late-failure rules for real (G1-G9), client
disconnects before the first token that never strand KV (B1, B5), distinct rooms under
concurrency, and end to end with the official ``openai`` client through the router's HTTP
server.

stop_generating (G4) and the disconnect mid-stream (G9), which every protocol shares, are
in ``test_protocol_router``.

Everything runs on 127.0.0.1 with port 0 and the real clock; every wait is bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import orjson
import pytest
import trio
import trio.testing
from e2e_support import (
    FAST,
    MODEL,
    PROMPT,
    PROMPT_TOKENS,
    SLOW_TOKENS,
    expected_cached,
    served,
    wait_until,
    warm,
)
from engine_support import StandIn
from protocol_support import (
    Cluster,
    Item,
    completion,
    gating,
    metric_samples,
    open_cluster,
    run,
    texts,
    tokens,
)

from trio_disagg import (
    BootstrapInfo,
    CancelWindow,
    Deadlines,
    Engine,
    FinishKind,
    HandoffStyle,
    PrefillError,
    PreprocessedRequest,
    RequestContext,
    TrioDisaggError,
    WorkerError,
    cancel_window_of,
)
from trio_disagg.engines import (
    DEFAULT_BOOTSTRAP_PORT,
    Client,
    LatencyModel,
    SglangEngine,
    sglang_body,
    sglang_engines,
    worker_client,
)
from trio_disagg.server import error_for_exception
from trio_disagg.workers import (
    MockSglangWorker,
    create_mock_worker,
    serve_mock_worker,
    serve_worker,
)


class HeldPrefill(StandIn):
    """A prefill engine whose outputs after the first (the bootstrap handoff) are read to
    the end, then held until :attr:`release` is set: the prefill outcome arrives when the
    test says, e.g. after the decode's last token."""

    def __init__(self, engine: SglangEngine) -> None:
        super().__init__(engine)
        self.held = trio.Event()
        self.release = trio.Event()

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        inner_send, inner_receive = trio.open_memory_channel[Item](16)
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(self.engine.generate, request, context, inner_send))
            task_status.started()
            with send_channel, inner_receive:
                await send_channel.send(await inner_receive.receive())
                rest = [item async for item in inner_receive]
                self.held.set()
                await self.release.wait()
                for item in rest:
                    await send_channel.send(item)


@asynccontextmanager
async def sglang_cluster(
    *,
    latency: LatencyModel = FAST,
    deadlines: Deadlines | None = None,
    prefill_model: str | None = None,
    wrap_prefill: Callable[[SglangEngine], Any] | None = None,
    wrap_decode: Callable[[SglangEngine], Any] | None = None,
    cancel_window: CancelWindow | None = None,
    incremental_streaming_output: bool = False,
) -> AsyncIterator[Cluster[MockSglangWorker]]:
    prefill = create_mock_worker("prefill", "sglang", fault_injection=True,
                                 latency=latency, model=prefill_model,
                                 bootstrap_port=0)
    decode = MockSglangWorker("decode", fault_injection=True, latency=latency,
                              incremental_streaming_output=incremental_streaming_output)

    def engines(prefill_url: str, decode_url: str, client: Client
                ) -> tuple[Sequence[Engine], Sequence[Engine]]:
        # the prefill's bootstrap port is known once it is served
        return sglang_engines([f"{prefill_url},{prefill.bootstrap_port}"], [decode_url],
                              client=client, cancel_window=cancel_window)

    async with open_cluster(prefill, decode, worker_client(), engines, deadlines=deadlines,
                            wrap_prefill=wrap_prefill, wrap_decode=wrap_decode) as cluster:
        yield cluster


async def prefill_failure(cluster: Cluster[Any], request: PreprocessedRequest
                          ) -> tuple[TrioDisaggError, list[Item]]:
    """How a failed prefill reaches the caller: raised by ``router.stream`` (G1: the decode
    dispatch was still pending), or as the one error item ending the stream (G6; the
    gate's failure is the prefill's error). Both become the same client error."""
    error: TrioDisaggError | None = None
    items: list[Item] = []
    with trio.fail_after(10):
        try:
            async with trio.open_nursery() as nursery:
                stream = await cluster.router.stream(nursery, request,
                                                     RequestContext(request.request_id))
                with stream.outputs:
                    items = [item async for item in stream.outputs]
                assert items and items[-1].is_error, "the stream did not end with an error"
                assert stream.gate is not None
                assert isinstance(stream.gate.failure, TrioDisaggError)
                error = stream.gate.failure
        except* TrioDisaggError as group:
            (error,) = group.exceptions  # type: ignore[assignment]
    assert error is not None
    return error, items


# --- the wire: what the adapter sends -----------------------------------------------------


def test_one_body_with_the_bootstrap_triple_for_both_legs() -> None:
    prefill, decode = sglang_engines(["http://10.0.0.5:30000,8998", "http://10.0.0.6:30000,9000"],
                                     ["http://10.0.0.7:30001"], client=httpx.AsyncClient())
    assert [(e.bootstrap_host, e.bootstrap_port) for e in prefill] == [
        ("10.0.0.5", 8998), ("10.0.0.6", 9000)]
    assert all(e.handoff_style is HandoffStyle.BOOTSTRAP for e in prefill + decode)
    assert decode[0].bootstrap_port is None

    info = BootstrapInfo(host="10.0.0.5", port=8998, room=(1 << 63) - 1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "stream_options": {"continuous_usage_stats": True}}
    request = PreprocessedRequest(request_id="r", model=MODEL, body=body, max_tokens=9,
                                  bootstrap_info=info)
    path, wire = sglang_body(request)
    assert path == "/v1/chat/completions"
    assert wire == {**body, "stream": True,  # no budget invented (B8)
                    # continuous_usage_stats: the router's to answer (B8)
                    "stream_options": {"include_usage": True},
                    "bootstrap_host": "10.0.0.5", "bootstrap_port": 8998,
                    "bootstrap_room": (1 << 63) - 1}
    assert "bootstrap_room" not in body  # the client's body is untouched
    native = attrs.evolve(request, body={"text": "hello", "sampling_params": {"top_k": 2}})
    path, wire = sglang_body(native)
    assert path == "/generate"
    assert wire["sampling_params"] == {"top_k": 2}  # no budget invented (B8)
    assert wire["stream"] is True and wire["bootstrap_room"] == info.room
    # one room per request and per sample: never shared between samples
    for shared in ({"prompt": "x", "n": 2}, {"text": ["a", "b"]}, {"input_ids": [[1], [2]]}):
        with pytest.raises(WorkerError, match="room") as refused:
            sglang_body(attrs.evolve(request, body=shared))
        assert refused.value.status == 400
    with pytest.raises(WorkerError, match="bootstrap room") as missing:
        sglang_body(attrs.evolve(request, bootstrap_info=None))
    assert missing.value.status == 400


def test_B10_an_sglang_prefill_may_be_cancelled_before_a_decode_joined_its_room() -> None:
    client = httpx.AsyncClient()
    prefill, _ = sglang_engines(["http://p:1"], ["http://d:1"], client=client)
    assert prefill[0].cancel_window is CancelWindow.BEFORE_HANDOFF
    assert cancel_window_of(prefill[0]) is CancelWindow.BEFORE_HANDOFF
    prefill, _ = sglang_engines(["http://p:1,9000"], [], client=client,
                                cancel_window=CancelWindow.NEVER)
    assert prefill[0].cancel_window is CancelWindow.NEVER
    engine = SglangEngine("http://p:1", "prefill", client=client,
                          cancel_window=CancelWindow.ANYTIME)
    assert engine.cancel_window is CancelWindow.ANYTIME


# --- the bootstrap handoff -----------------------------------------------------------------


async def test_S5_bootstrap_handoff_with_cached_tokens_from_the_prefill() -> None:
    async with sglang_cluster() as cluster:
        warm(cluster.prefill.prefix, {"prompt": PROMPT})  # its prompt was computed before
        request = completion("req-bs", max_tokens=5)
        stream, items = await run(cluster, request)
        assert stream.style == "bootstrap"
        assert all(not item.is_error for item in items)
        assert len(tokens(items)) == 5 and all(tokens(items))
        last = items[-1].data
        assert last is not None and last.finish_reason is not None
        assert last.finish_reason.kind is FinishKind.LENGTH
        assert last.completion_usage is not None
        assert (last.completion_usage.prompt_tokens,
                last.completion_usage.completion_tokens) == (PROMPT_TOKENS, 5)
        # S4/S10: the client's cached_tokens is the prefill's (drained by the keeper),
        # not the decode's (45)
        cached = expected_cached({"prompt": PROMPT}, warm=True)
        assert 0 < cached < PROMPT_TOKENS
        details = stream.prompt_tokens_details
        assert details is not None and details.cached_tokens == cached
        # docs/protocols.md section 3: the same body, with the triple, to both at once
        (seen_prefill,) = cluster.prefill.seen
        (seen_decode,) = cluster.decode.seen
        assert seen_prefill.body == seen_decode.body
        assert seen_prefill.request_id == "req-bs" == seen_decode.request_id
        assert seen_prefill.path == "/v1/completions" == seen_decode.path
        body = seen_decode.body
        assert stream.bootstrap_info is not None
        assert (body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]) == (
            "127.0.0.1", cluster.prefill.bootstrap_port, stream.bootstrap_info.room)
        assert 0 <= body["bootstrap_room"] < 1 << 63
        await cluster.settled()
        # the decode joined the room on the bootstrap port and received the blocks
        counters = cluster.prefill.kv.counters()
        assert (counters.staged_blocks, counters.freed_blocks, counters.served) == (3, 3, 1)
        assert cluster.prefill.stats.kv_transfers == 1 == cluster.decode.stats.kv_pulls
        assert cluster.prefill.stats.completed == 1  # the keeper drained the prefill
        async with httpx.AsyncClient() as http:
            response = await http.get(cluster.prefill_url + "/metrics")
        samples = metric_samples(response.text)
        assert samples["trio_disagg_mock_kv_held_blocks"] == 0
        assert samples["trio_disagg_mock_bootstrap_rooms_open"] == 0
        assert samples["trio_disagg_mock_kv_served_requests_total"] == 1


async def test_S5_chat_handoff() -> None:
    async with sglang_cluster() as cluster:
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                "max_completion_tokens": 4}
        stream, items = await run(cluster, PreprocessedRequest(
            request_id="chat-1", model=MODEL, body=body, max_tokens=4))
        assert stream.style == "bootstrap"
        assert len(tokens(items)) == 4 and all(tokens(items))
        assert cluster.prefill.seen[0].path == "/v1/chat/completions"
        assert cluster.decode.seen[0].path == "/v1/chat/completions"
        details = stream.prompt_tokens_details
        assert details is not None and details.cached_tokens == expected_cached(body)
        await cluster.settled()


async def test_S5_native_generate_handoff() -> None:
    async with sglang_cluster() as cluster:
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        stream, items = await run(cluster, PreprocessedRequest(
            request_id="native-1", model=MODEL, body=body, max_tokens=16))
        assert [item.is_error for item in items] == [False] * 4
        assert all(texts(items)) and all(len(i.data.token_ids) == 1 for i in items if i.data)
        last = items[-1].data
        assert last is not None and last.finish_reason is not None
        assert last.finish_reason.kind is FinishKind.LENGTH
        assert last.completion_usage is not None
        assert last.completion_usage.completion_tokens == 4
        assert cluster.prefill.seen[0].path == "/generate" == cluster.decode.seen[0].path
        details = stream.prompt_tokens_details
        assert details is not None and details.cached_tokens == expected_cached(body)
        await cluster.settled()


def _generate_event(text: str, ids: list[int], completion_tokens: int,
                    finish: dict[str, Any] | None = None) -> bytes:
    """One event of SGLang's streamed ``/generate``, as its tokenizer manager writes it."""
    meta = {"id": "rid", "finish_reason": finish, "prompt_tokens": 3,
            "completion_tokens": completion_tokens, "cached_tokens": 0}
    return b"data: " + orjson.dumps({"text": text, "output_ids": ids,
                                     "meta_info": meta}) + b"\n\n"


#: The same three tokens, `` the the end``, streamed by SGLang's ``/generate`` as its
#: tokenizer manager writes them (sgl-project/sglang, tokenizer_manager_components/
#: output_processor.py): the text and ids so far in each event (the default), or with
#: ``--incremental-streaming-output`` only the new ones, ``completion_tokens`` counting
#: all so far either way.
GENERATE_EVENTS = {
    "cumulative": [_generate_event(" the", [279], 1), _generate_event(" the the", [279, 279], 2),
                   _generate_event(" the the end", [279, 279, 835], 3,
                                   {"type": "length", "length": 3})],
    "incremental": [_generate_event(" the", [279], 1), _generate_event(" the", [279], 2),
                    _generate_event(" end", [835], 3, {"type": "length", "length": 3})],
}


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
async def test_native_generate_text_is_whole_whether_cumulative_or_incremental(
        mode: str) -> None:
    """A repeated token is a new token, not a cumulative event that brought none: the
    client gets `` the the end`` and three token ids, however the server streams."""
    body = b"".join(GENERATE_EVENTS[mode]) + b"data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        await trio.lowlevel.checkpoint()
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    request = PreprocessedRequest(
        request_id="gen", model=MODEL, body={"text": "a b c"}, max_tokens=3,
        bootstrap_info=BootstrapInfo(host="prefill", port=8998, room=7))
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        engine = SglangEngine("http://decode:30000", "decode", client=client)
        send, receive = trio.open_memory_channel[Item](8)
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.generate, request, RequestContext("gen"), send)
                with receive:
                    items = [item async for item in receive]
    assert not any(item.is_error for item in items)
    outputs = [item.data for item in items if item.data is not None]
    assert "".join(output.text or "" for output in outputs) == " the the end"
    assert [t for output in outputs for t in output.token_ids] == [279, 279, 835]


async def test_native_generate_from_a_decode_that_streams_incrementally() -> None:
    """The mock decode with ``incremental_streaming_output`` (SGLang's
    ``--incremental-streaming-output``) gives the client the same tokens as without."""
    answers = []
    for incremental in (False, True):
        async with sglang_cluster(incremental_streaming_output=incremental) as cluster:
            body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6}}
            _, items = await run(cluster, PreprocessedRequest(
                request_id="native-inc", model=MODEL, body=body, max_tokens=6))
            assert not any(item.is_error for item in items)
            outputs = [item.data for item in items if item.data is not None]
            answers.append(("".join(output.text or "" for output in outputs),
                            [t for output in outputs for t in output.token_ids]))
            await cluster.settled()
    cumulative, incremental_answer = answers
    assert len(cumulative[1]) == 6 and incremental_answer == cumulative


async def test_S5_eos_on_the_first_token_ends_both_legs() -> None:
    """SGLang's decode receives the prefill's first token with the KV: an EOS there ends the
    request after one token, on both legs (the prefill's ``stop`` is no failure: T4)."""
    async with sglang_cluster() as cluster:
        stream, items = await run(cluster, completion("eos", max_tokens=9,
                                                      fault="eos_first_token"))
        assert stream.style == "bootstrap"
        (item,) = items
        assert item.data is not None and item.data.text
        assert item.data.finish_reason is not None
        assert item.data.finish_reason.kind is FinishKind.STOP
        assert stream.prefill.succeeded
        await cluster.settled()
        assert cluster.prefill.kv.counters().served == 1


async def test_serve_mock_worker_picks_a_free_bootstrap_port_with_port_0() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_mock_worker, "prefill", "sglang"))
        async with httpx.AsyncClient(timeout=5.0) as client:
            info = (await client.get(f"http://127.0.0.1:{port}/get_server_info")).json()
            boot = info["disaggregation_bootstrap_port"]
            assert isinstance(boot, int) and boot not in (0, port, DEFAULT_BOOTSTRAP_PORT)
            health = await client.get(f"http://127.0.0.1:{boot}/health")
            assert health.status_code == 200
        nursery.cancel_scope.cancel()
    with pytest.raises(ValueError, match="SGLang prefill"):
        create_mock_worker("prefill", "vllm", bootstrap_port=0)
    with pytest.raises(ValueError, match="SGLang prefill"):
        create_mock_worker("decode", "sglang", bootstrap_port=0)


async def test_G3_G5_tokens_flow_while_the_prefill_is_pending_and_the_terminal_waits() -> None:
    held: list[HeldPrefill] = []

    def wrap(engine: SglangEngine) -> HeldPrefill:
        held.append(HeldPrefill(engine))
        return held[0]

    async with sglang_cluster(wrap_prefill=wrap) as cluster:
        (prefill,) = held
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                stream = await cluster.router.stream(nursery, completion("g3", max_tokens=3),
                                                     RequestContext("g3"))
                with stream.outputs:
                    first = [await stream.outputs.receive() for _ in range(2)]  # G3
                    await wait_until(lambda: prefill.held.is_set()
                                     and cluster.decode.stats.completed == 1)
                    assert not stream.prefill.done
                    with trio.move_on_after(0.2) as waited:
                        await stream.outputs.receive()
                    assert waited.cancelled_caught  # G5: the success terminal is held
                    prefill.release.set()
                    rest = [item async for item in stream.outputs]
        assert all(item.data is not None and item.data.finish_reason is None for item in first)
        (terminal,) = rest
        assert terminal.data is not None and terminal.data.finish_reason is not None
        assert terminal.data.finish_reason.kind is FinishKind.LENGTH
        assert stream.prefill.succeeded
        await cluster.settled()


# --- prefill failures: before the bootstrap, after it, after the decode's last token ------


@pytest.mark.parametrize("status", [400, 429])
async def test_G1_G6_prefill_4xx_is_passed_through(status: int) -> None:
    async with sglang_cluster() as cluster:
        error, _ = await prefill_failure(cluster, completion("rej",
                                                             fault=f"prefill_reject:{status}"))
        assert isinstance(error, PrefillError)
        cause = error.__cause__
        assert isinstance(cause, WorkerError) and cause.status == status
        assert str(cause).startswith(cluster.prefill.name + " refused request 'rej'")
        client_error = error_for_exception(error)
        assert (client_error.status, client_error.message) == (status, str(cause))
        await cluster.settled()  # the decode waiting in the room was stopped at once
        assert cluster.decode.stats.completed == 0


async def test_prefill_unknown_model_404_is_passed_through() -> None:
    async with sglang_cluster(prefill_model=MODEL) as cluster:
        request = completion("model-1")
        request.body["model"] = "no-such-model"
        error, _ = await prefill_failure(cluster, request)
        assert isinstance(error, PrefillError) and isinstance(error.__cause__, WorkerError)
        assert error.__cause__.status == 404
        assert str(error.__cause__) == "The model `no-such-model` does not exist."
        await cluster.settled()


@pytest.mark.parametrize(("fault", "status"), [
    ("prefill_reject:500", 502), ("prefill_reject:503", 503),
    ("prefill_fail_before_handoff", 502), ("prefill_reset", 502)])
async def test_G6_prefill_failure_before_the_bootstrap_stops_the_waiting_decode(
        fault: str, status: int) -> None:
    """The decode waits in the room for KV that never comes (SGLang: until its 300 s
    timeout); the gatekeeper stops it at once and the client gets a 502 (the worker's 503
    for a worker too busy)."""
    async with sglang_cluster() as cluster:
        with trio.fail_after(5):  # not the decode's bootstrap timeout
            error, items = await prefill_failure(cluster, completion("p5", fault=fault))
            assert isinstance(error, PrefillError)
            assert cluster.prefill_url in str(error.__cause__ or error)
            assert error_for_exception(error).status == status
            assert not any(item.data is not None and item.data.text for item in items)
            await cluster.settled()
        assert cluster.decode.stats.completed == 0
        assert cluster.prefill.kv.counters().staged_blocks == 0


async def test_G6_prefill_failure_after_the_bootstrap_ends_the_stream_with_its_error() -> None:
    async with sglang_cluster(latency=SLOW_TOKENS) as cluster:
        error, items = await prefill_failure(
            cluster, completion("late", max_tokens=50, fault="prefill_fail_after_handoff"))
        assert isinstance(error, PrefillError)
        assert "prefill_fail_after_handoff" in str(error) and "after the KV transfer" in str(error)
        assert items[-1].error_message() == str(error)
        assert not any(item.data is not None and item.data.finish_reason is not None
                       for item in items)  # never a success terminal
        await wait_until(lambda: cluster.decode.stats.aborted == 1)  # the decode was stopped
        await cluster.settled()
        assert cluster.prefill.kv.counters().served == 1  # the transfer itself completed


async def test_G5_prefill_failure_after_the_decodes_last_token_replaces_the_terminal() -> None:
    held: list[HeldPrefill] = []

    def wrap(engine: SglangEngine) -> HeldPrefill:
        held.append(HeldPrefill(engine))
        return held[0]

    async with sglang_cluster(wrap_prefill=wrap) as cluster:
        (prefill,) = held
        request = completion("g5", max_tokens=3, fault="prefill_fail_after_handoff")
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                stream = await cluster.router.stream(nursery, request, RequestContext("g5"))
                with stream.outputs:
                    tokens = [await stream.outputs.receive() for _ in range(2)]
                    # the decode worker sent its last token and [DONE]; the prefill's error
                    # is read but not yet delivered
                    await wait_until(lambda: prefill.held.is_set()
                                     and cluster.decode.stats.completed == 1)
                    prefill.release.set()
                    rest = [item async for item in stream.outputs]
        assert all(item.data is not None and item.data.text for item in tokens)
        (error_item,) = rest  # G5: one error instead of the success terminal
        assert error_item.is_error
        assert "prefill_fail_after_handoff" in (error_item.error_message() or "")
        assert stream.gate is not None and isinstance(stream.gate.failure, PrefillError)
        await cluster.settled()


@pytest.mark.parametrize(("fault", "words"), [
    ("prefill_error_finish", "finish_reason error"),
    ("prefill_cancelled_finish", "cancelled before completing the handoff"),
])
async def test_T4_a_failed_finish_after_the_handoff_is_a_prefill_error(
        fault: str, words: str) -> None:
    async with sglang_cluster() as cluster:
        error, _ = await prefill_failure(cluster, completion("t4", fault=fault))
        assert isinstance(error, PrefillError) and words in str(error)
        assert error_for_exception(error).status == 502
        await cluster.settled()


async def test_G4_decode_failure_while_the_prefill_is_still_running() -> None:
    slow_prefill = attrs.evolve(FAST, ttft_per_prompt_token=0.02)  # 0.9 s
    async with sglang_cluster(latency=slow_prefill) as cluster:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                stream = await cluster.router.stream(
                    nursery, completion("g4", fault="decode_fail_before_first_token"),
                    RequestContext("g4"))
                with stream.outputs:
                    first = await stream.outputs.receive()
                    # G4: it did not wait for the prefill, still computing on its worker
                    assert not stream.prefill.done
                    assert cluster.prefill.stats.prefills_completed == 0
                    rest = [item async for item in stream.outputs]
        assert first.is_error and not rest
        assert "decode_fail_before_first_token" in (first.error_message() or "")
        await cluster.settled()
        # the decode left the room, so the prefill gave its KV back at once
        counters = cluster.prefill.kv.counters()
        assert (counters.served, counters.stranded_blocks, counters.aborted) == (0, 0, 1)
        assert cluster.prefill.stats.aborted == 0


async def test_B6_decode_reject_ends_the_prefill_in_its_room_at_once() -> None:
    """No decode will join a room whose decode refused: the prefill waiting in it is ended
    at once (its connection closed, so the worker aborts it), never left to the bootstrap
    timeout, and no cleanup decode is sent into the room."""
    async with sglang_cluster() as cluster:
        with trio.fail_after(10):
            with pytest.RaisesGroup(WorkerError) as refused:
                async with trio.open_nursery() as nursery:
                    await cluster.router.stream(
                        nursery, completion("drej", fault="decode_reject:503"),
                        RequestContext("drej"))
            error = refused.value.exceptions[0]
            assert isinstance(error, WorkerError) and error.status == 502
            assert cluster.decode_url in str(error)
            await cluster.settled()
        counters = cluster.router.counters
        assert (counters.staged_kv_cleanups, counters.prefills_released) == (0, 1)
        assert cluster.prefill.kv.counters().stranded_blocks == 0
        assert cluster.prefill.stats.aborted == 1
        assert len(cluster.decode.seen) == 1  # only the refused request


# --- decode failures after acceptance -----------------------------------------------------


async def test_G4_decode_failure_before_the_first_token() -> None:
    async with sglang_cluster() as cluster:
        _, items = await run(cluster, completion("dfb", fault="decode_fail_before_first_token"))
        (item,) = items
        assert item.is_error
        message = item.error_message() or ""
        assert message.startswith(f"decode worker {cluster.decode_url} reported an error")
        await cluster.settled()
        counters = cluster.prefill.kv.counters()  # the decode left the room: freed, unused
        assert (counters.served, counters.held_blocks) == (0, 0)


async def test_G4_decode_error_after_the_first_token() -> None:
    async with sglang_cluster() as cluster:
        _, items = await run(cluster, completion("dea", max_tokens=6, fault="decode_error_at:2"))
        assert [item.is_error for item in items] == [False, False, True]
        assert "decode_error_at" in (items[-1].error_message() or "")
        await cluster.settled()
        assert cluster.prefill.kv.counters().served == 1


async def test_decode_reset_mid_stream_is_an_error_item() -> None:
    async with sglang_cluster() as cluster:
        _, items = await run(cluster, completion("drs", max_tokens=6, fault="decode_reset_at:3"))
        assert [item.is_error for item in items] == [False, False, False, True]
        assert "mid-stream" in (items[-1].error_message() or "")
        await cluster.settled()


async def test_decode_worker_death_mid_stream_is_an_error_item() -> None:
    async with sglang_cluster() as cluster:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                stream = await cluster.router.stream(
                    nursery, completion("death", max_tokens=8, fault="decode_stall_at:2"),
                    RequestContext("death"))
                with stream.outputs:
                    items = [await stream.outputs.receive() for _ in range(2)]
                    cluster.decode_scope.cancel()  # the decode worker dies
                    items.extend([item async for item in stream.outputs])
        assert [item.is_error for item in items] == [False, False, True]
        assert cluster.decode_url in (items[-1].error_message() or "")
        with trio.fail_after(5):
            await cluster.keeper.wait_idle()
        assert cluster.prefill.kv.counters().held_blocks == 0  # pulled before it died
        assert cluster.prefill.stats.completed == 1


# stop_generating and the disconnect mid-stream (G4, G9) are in test_protocol_router.py.


# --- client disconnects: never abort the prefill, never strand KV (G9, B1) ----------------


async def test_G9_disconnect_during_prefill_leaves_no_kv() -> None:
    slow_prefill = attrs.evolve(FAST, ttft_per_prompt_token=0.01)  # 0.45 s
    async with sglang_cluster(latency=slow_prefill) as cluster:
        with trio.move_on_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cluster.router.stream, nursery, completion("dp"),
                                   RequestContext("dp"))
                # both legs accepted, the decode waiting in the room
                await wait_until(lambda: cluster.prefill.stats.running == 1
                                 and cluster.decode.stats.running == 1
                                 and cluster.prefill.kv.open_rooms == 1)
                await trio.testing.wait_all_tasks_blocked()  # the router's tasks are waiting
                nursery.cancel_scope.cancel()  # the client goes away
        await cluster.settled()  # within 5 s: SGLang's own timeout is 300 s
        # G9: the router never closed the prefill's connection, and the decode leg, which
        # belongs to the keeper, still pulled the KV: the transfer completed. The decode leg
        # then ended at its first token, which nobody was reading any more.
        assert cluster.prefill.stats.aborted == 0
        assert cluster.decode.stats.aborted == 1
        counters = cluster.prefill.kv.counters()
        assert (counters.held_blocks, counters.stranded_blocks, counters.served) == (0, 0, 1)
        assert cluster.router.keeper.failed_total == 0  # no prefill failure was logged


@pytest.mark.parametrize("window", [CancelWindow.NEVER, None], ids=["never", "engine-window"])
async def test_B1_B10_disconnect_while_the_decode_dispatch_is_pending(
    window: CancelWindow | None,
) -> None:
    """The client leaves while its decode dispatch is pending. Outside a cancel window the
    dispatch belongs to the keeper, not to the client: it goes through and its decode
    consumes the KV (B1, G9); no second decode joins the room, a room is never reused.
    Inside SGLang's own window (before a decode joined) both legs end at once and no
    decode joins (B10, B6). Nothing is stranded either way."""
    gated, wrap = gating()
    async with sglang_cluster(wrap_decode=wrap, cancel_window=window) as cluster:
        (gate,) = gated
        with trio.move_on_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cluster.router.stream, nursery, completion("dh"),
                                   RequestContext("dh"))
                with trio.fail_after(5):
                    await gate.entered.wait()  # the decode not accepted yet
                # the prefill staged its KV in the room and waits for a decode
                await wait_until(lambda: cluster.prefill.kv.counters().held_blocks == 3)
                nursery.cancel_scope.cancel()
        gate.gate.set()
        await cluster.settled()
        stats, counters = cluster.prefill.stats, cluster.prefill.kv.counters()
        assert counters.stranded_blocks == 0
        assert cluster.router.counters.staged_kv_cleanups == 0
        assert gate.calls == 1
        if window is CancelWindow.NEVER:
            assert (stats.aborted, stats.completed, counters.served) == (0, 1, 1)
        else:
            assert (stats.aborted, stats.completed, counters.served) == (1, 0, 0)
            assert cluster.router.counters.prefills_cancelled == 1
            assert not cluster.decode.seen  # the pending dispatch never reached the worker


# --- concurrency --------------------------------------------------------------------------


async def test_fifty_concurrent_requests_get_fifty_rooms() -> None:
    async with sglang_cluster() as cluster:
        results: dict[int, list[Item]] = {}

        async def one(i: int) -> None:
            _, results[i] = await run(cluster, completion(f"c-{i}", max_tokens=8))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(50):
                    nursery.start_soon(one, i)
        assert all(len(tokens(items)) == 8 for items in results.values())
        assert all(not any(item.is_error for item in items) for items in results.values())
        rooms = {seen.body["bootstrap_room"] for seen in cluster.decode.seen}
        assert len(rooms) == 50
        assert rooms == {seen.body["bootstrap_room"] for seen in cluster.prefill.seen}
        await cluster.settled()
        counters = cluster.prefill.kv.counters()
        assert (counters.served, counters.staged_blocks, counters.freed_blocks) == (50, 150, 150)
        assert cluster.prefill.stats.aborted == cluster.decode.stats.aborted == 0


# --- the mock workers on their own --------------------------------------------------------


async def test_mock_sglang_workers_rooms_and_timeouts() -> None:
    prefill = create_mock_worker("prefill", "sglang", fault_injection=True,
                                 latency=LatencyModel.zero(),
                                 bootstrap_port=0, bootstrap_timeout=0.5, model=MODEL)
    decode = create_mock_worker("decode", "sglang", fault_injection=True,
                                latency=LatencyModel.zero(),
                                bootstrap_timeout=0.5)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_worker, prefill))
        decode_port = await nursery.start(partial(serve_worker, decode))
        url = f"http://127.0.0.1:{port}"
        boot = prefill.bootstrap_port
        assert boot not in (None, 0, port)
        triple = {"bootstrap_host": "127.0.0.1", "bootstrap_port": boot}
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            info = (await client.get("/get_server_info")).json()
            assert (info["disaggregation_mode"], info["disaggregation_bootstrap_port"]) == (
                "prefill", boot)
            assert (await client.get(f"http://127.0.0.1:{boot}/health")).status_code == 200
            on_boot = await client.post(f"http://127.0.0.1:{boot}/v1/completions", json=body)
            assert on_boot.status_code == 404
            bare = await client.post("/v1/completions", json=body)
            assert bare.status_code == 400
            assert bare.json()["object"] == "error"  # SGLang's ErrorResponse
            assert "bootstrap_room" in bare.json()["message"]
            shared = await client.post("/v1/completions", json={
                **body, **triple, "bootstrap_room": 7, "n": 2})
            assert shared.status_code == 400 and "its own room" in shared.json()["message"]
            elsewhere = await client.post("/v1/completions", json={
                **body, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7})
            assert elsewhere.status_code == 500  # the router's mistake, not the client's
            assert f"bootstraps at port {boot}, not 1" in elsewhere.json()["message"]
            # nobody joins: after its bootstrap timeout the prefill drops (strands) the KV;
            # meanwhile a second prefill for the same room is refused
            async with trio.open_nursery() as waits:
                answers: list[httpx.Response] = []

                async def lone_prefill() -> None:
                    answers.append(await client.post(
                        "/v1/completions", json={**body, **triple, "bootstrap_room": 9}))

                waits.start_soon(lone_prefill)
                await wait_until(lambda: prefill.kv.open_rooms == 1)
                again = await client.post("/v1/completions",
                                          json={**body, **triple, "bootstrap_room": 9})
                assert again.status_code == 400 and "own room" in again.json()["message"]
            (lone,) = answers
            assert lone.status_code == 500 and "no decode joined" in lone.json()["message"]
            samples = metric_samples((await client.get("/metrics")).text)
            assert samples["trio_disagg_mock_kv_stranded_blocks_total"] == 3
            assert samples["trio_disagg_mock_bootstrap_rooms_open"] == 0
            # a decode whose prefill never comes fails after its own timeout
            waited = await client.post(f"http://127.0.0.1:{decode_port}/v1/completions",
                                       json={**body, **triple, "bootstrap_room": 11})
            assert waited.status_code == 500
            assert "never staged KV in bootstrap room 11 within 0.5 s" in \
                waited.json()["message"]
            # the decode may come first: a native request, prefill a moment later
            async with trio.open_nursery() as both:
                native: list[httpx.Response] = []

                async def native_decode() -> None:
                    native.append(await client.post(
                        f"http://127.0.0.1:{decode_port}/generate", json={
                            "text": PROMPT, "sampling_params": {"max_new_tokens": 3},
                            **triple, "bootstrap_room": 12}))

                both.start_soon(native_decode)
                await wait_until(lambda: prefill.kv.open_rooms == 1)
                prefill_answer = await client.post("/generate", json={
                    "text": PROMPT, **triple, "bootstrap_room": 12})
            assert prefill_answer.json()["meta_info"]["finish_reason"]["type"] == "length"
            (answer,) = native
            meta = answer.json()["meta_info"]
            assert (meta["completion_tokens"], meta["cached_tokens"]) == (3, PROMPT_TOKENS)
            assert len(answer.json()["output_ids"]) == 3
        nursery.cancel_scope.cancel()


# --- end to end: the openai client, the router's HTTP server, the mock SGLang workers -----


async def test_e2e_G5_late_prefill_failure_is_an_error_event_then_done() -> None:
    held: list[HeldPrefill] = []

    def wrap(engine: SglangEngine) -> HeldPrefill:
        held.append(HeldPrefill(engine))
        return held[0]

    async with served("sglang", wrap_prefill=wrap) as server:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True,
                "fault": "prefill_fail_after_handoff"}
        lines: list[str] = []
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=10.0) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 2:  # two tokens went out; the terminal waits
                    await wait_until(lambda: held[0].held.is_set()
                                     and server.cluster.decode.stats.completed == 1)
                    held[0].release.set()
        assert lines[-1] == "data: [DONE]" and len(lines) == 4
        error = orjson.loads(lines[-2].removeprefix("data: "))
        assert "prefill_fail_after_handoff" in error["error"]["message"]
        assert all('"finish_reason":null' in line for line in lines[:2])
        await server.cluster.settled()
