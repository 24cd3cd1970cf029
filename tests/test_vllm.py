"""The vLLM adapter against the mock vLLM workers over real sockets (docs/protocols.md sections
1, 2 and 5): the sequential handoff, the terminal first token (S7), errors before and
after the first token, worker death, cached_tokens from the prefill (S4, S10),
concurrency, and end to end with the official ``openai`` client through the router's HTTP
server.

stop_generating (G4) and the client disconnects (G9, B1, B5), which the sequential
handoff protocols share, are in ``test_protocol_router``.

Everything runs on 127.0.0.1 with port 0 and the real clock; every wait is bounded.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
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
    in_thread,
    served,
    wait_until,
    warm,
)
from protocol_support import (
    Cluster,
    Item,
    completion,
    metric_samples,
    open_cluster,
    refusal,
    run,
    texts,
    tokens,
)

from trio_disagg import (
    CancelWindow,
    Deadlines,
    Engine,
    FinishKind,
    PrefillDeadlineExceeded,
    PrefillError,
    PrefillResult,
    PreprocessedRequest,
    RequestContext,
    WorkerError,
    cancel_window_of,
)
from trio_disagg._cleanup import start_cleanup
from trio_disagg.engines import (
    PREFILL_KV_TRANSFER_PARAMS,
    Client,
    LatencyModel,
    VllmEngine,
    WorkerClient,
    decode_body,
    prefill_body,
    vllm_client,
    vllm_engines,
)
from trio_disagg.server import error_for_exception
from trio_disagg.workers import (
    MockVllmWorker,
    create_mock_worker,
    serve_mock_worker,
    serve_worker,
)

#: A long TTL: every test checks the KV is freed without waiting for it.
KV_TTL = 120.0


@asynccontextmanager
async def vllm_cluster(
    *,
    latency: LatencyModel = FAST,
    deadlines: Deadlines | None = None,
    prefill_model: str | None = None,
    prefill_url: str | None = None,
    wrap_decode: Callable[[VllmEngine], Any] | None = None,
    cancel_window: CancelWindow | None = None,
    block_id_groups: bool = False,
    client: Client | None = None,
) -> AsyncIterator[Cluster[MockVllmWorker]]:
    prefill = MockVllmWorker("prefill", fault_injection=True, latency=latency, kv_ttl=KV_TTL,
                             model=prefill_model, block_id_groups=block_id_groups)
    decode = create_mock_worker("decode", fault_injection=True, latency=latency)

    def engines(prefill_url: str, decode_url: str, client: Client
                ) -> tuple[Sequence[Engine], Sequence[Engine]]:
        return vllm_engines([prefill_url], [decode_url], client=client,
                            cancel_window=cancel_window)

    async with open_cluster(prefill, decode, client or vllm_client(), engines,
                            deadlines=deadlines,
                            prefill_url=prefill_url, wrap_decode=wrap_decode) as cluster:
        yield cluster


# --- the wire: what the adapter sends -----------------------------------------------------


def test_prefill_and_decode_bodies_follow_protocols_section_2() -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": False, "continuous_usage_stats": True},
            "min_tokens": 3, "max_completion_tokens": 9, "temperature": 0.5}
    wire = prefill_body(body)
    assert wire == {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
                    "min_tokens": 1,  # capped, not removed: EOS may not end the prefill
                    "temperature": 0.5, "kv_transfer_params": dict(PREFILL_KV_TRANSFER_PARAMS)}
    assert body["stream"] is True and "min_tokens" in body  # the client's body is untouched
    params = {"do_remote_prefill": True, "remote_request_id": "x", "tp_size": 1}
    request = PreprocessedRequest(request_id="r", model=MODEL, body=body, max_tokens=9,
                                  prefill_result=PrefillResult(disaggregated_params=params))
    decode = decode_body(request)
    assert decode["kv_transfer_params"] is params  # verbatim
    assert decode["stream"] is True
    # continuous_usage_stats is the router's to answer (B8, docs/protocols.md section 1)
    assert decode["stream_options"] == {"include_usage": True}
    assert decode["min_tokens"] == 3 and decode["max_completion_tokens"] == 9
    bare = PreprocessedRequest(request_id="r", model=MODEL,
                               body={"model": MODEL, "prompt": "x"}, max_tokens=16)
    # B8: no budget invented; what the client sent, plus the handoff and the streaming
    assert decode_body(bare) == {"model": MODEL, "prompt": "x", "stream": True,
                                 "stream_options": {"include_usage": True}}


def test_B10_a_vllm_prefill_may_be_cancelled_anytime() -> None:
    """vLLM frees a request's blocks when its connection closes."""
    client = httpx.AsyncClient()
    prefill, _ = vllm_engines(["http://p:1"], ["http://d:1"], client=client)
    assert prefill[0].cancel_window is CancelWindow.ANYTIME
    assert cancel_window_of(prefill[0]) is CancelWindow.ANYTIME
    prefill, _ = vllm_engines(["http://p:1"], [], client=client,
                              cancel_window=CancelWindow.BEFORE_HANDOFF)
    assert prefill[0].cancel_window is CancelWindow.BEFORE_HANDOFF
    engine = VllmEngine("http://p:1", "prefill", client=client, cancel_window=CancelWindow.NEVER)
    assert engine.cancel_window is CancelWindow.NEVER
    with pytest.raises(TypeError, match="CancelWindow"):
        VllmEngine("http://p:1", "prefill", client=client,
                   cancel_window="anytime")  # type: ignore[arg-type]


# --- the sequential handoff ---------------------------------------------------------------


async def test_sequential_handoff_with_cached_tokens_from_the_prefill() -> None:
    async with vllm_cluster() as cluster:
        warm(cluster.prefill.prefix, {"prompt": PROMPT})  # its prompt was computed before
        request = completion("req-seq", max_tokens=5, min_tokens=2,
                             stream_options={"include_usage": False})
        stream, items = await run(cluster, request)
        assert stream.style == "sequential"
        assert all(not item.is_error for item in items)
        assert len(tokens(items)) == 5 and all(tokens(items))
        last = items[-1].data
        assert last is not None and last.finish_reason is not None
        assert last.finish_reason.kind is FinishKind.LENGTH
        assert last.completion_usage is not None
        assert (last.completion_usage.prompt_tokens,
                last.completion_usage.completion_tokens) == (PROMPT_TOKENS, 5)
        # S4/S10: the client's cached_tokens is the prefill's, not the decode's (45)
        cached = expected_cached({"prompt": PROMPT}, warm=True)
        assert 0 < cached < PROMPT_TOKENS
        details = stream.prompt_tokens_details
        assert details is not None and details.cached_tokens == cached
        # what each worker received: docs/protocols.md section 2, one X-Request-Id
        (seen_prefill,) = cluster.prefill.seen
        (seen_decode,) = cluster.decode.seen
        assert seen_prefill.path == "/v1/completions" == seen_decode.path
        assert seen_prefill.request_id == "req-seq" == seen_decode.request_id
        assert seen_prefill.body == prefill_body(request.body)
        assert "stream_options" not in seen_prefill.body
        assert seen_prefill.body["min_tokens"] == 1  # capped: vLLM refuses min > max
        params = seen_decode.body["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_request_id"] == "req-seq"
        assert params["remote_engine_id"] == cluster.prefill.name
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1",
                                                                  cluster.prefill.port)
        assert params["remote_block_ids"] == [0, 1, 2] and params["tp_size"] == 1
        assert seen_decode.body["min_tokens"] == 2 and seen_decode.body["max_tokens"] == 5
        await cluster.settled()
        # the decode really pulled the blocks over loopback, which freed them
        counters = cluster.prefill.kv.counters()
        assert (counters.staged_blocks, counters.freed_blocks, counters.served) == (3, 3, 1)
        assert cluster.prefill.stats.kv_transfers == 1 == cluster.decode.stats.kv_pulls
        async with httpx.AsyncClient() as http:
            response = await http.get(cluster.prefill_url + "/metrics")
        samples = metric_samples(response.text)
        assert samples["trio_disagg_mock_kv_held_blocks"] == 0
        assert samples["trio_disagg_mock_kv_served_requests_total"] == 1
        assert samples["trio_disagg_mock_requests_aborted_total"] == 0


async def test_handoff_with_block_ids_per_kv_cache_group() -> None:
    """A prefill that gives its ``remote_block_ids`` per KV cache group, as vLLM's
    NixlConnector with the hybrid KV cache manager does (``[[0, 1, 2]]``), hands off as
    one with a flat list: the decode gets them as sent, pulls the KV, and answers."""
    async with vllm_cluster(block_id_groups=True) as cluster:
        request = completion("req-groups", max_tokens=4)
        stream, items = await run(cluster, request)
        assert stream.style == "sequential"
        assert all(not item.is_error for item in items)
        assert len(tokens(items)) == 4 and all(tokens(items))
        (seen_decode,) = cluster.decode.seen
        assert seen_decode.body["kv_transfer_params"]["remote_block_ids"] == [[0, 1, 2]]
        await cluster.settled()
        counters = cluster.prefill.kv.counters()
        assert (counters.staged_blocks, counters.freed_blocks, counters.served) == (3, 3, 1)
        assert cluster.decode.stats.kv_pulls == 1


async def test_chat_handoff() -> None:
    async with vllm_cluster() as cluster:
        body = {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": PROMPT}],
                "max_completion_tokens": 4}
        stream, items = await run(cluster, PreprocessedRequest(
            request_id="chat-1", model=MODEL, body=body, max_tokens=4))
        assert stream.style == "sequential"
        assert len(tokens(items)) == 4 and all(tokens(items))
        (seen_prefill,) = cluster.prefill.seen
        assert seen_prefill.path == "/v1/chat/completions"
        assert (seen_prefill.body["max_tokens"], seen_prefill.body["max_completion_tokens"]) \
            == (1, 1)
        assert cluster.decode.seen[0].path == "/v1/chat/completions"
        details = stream.prompt_tokens_details
        assert details is not None and details.cached_tokens == expected_cached(body)
        await cluster.settled()


async def test_s7_terminal_on_the_first_token() -> None:
    async with vllm_cluster() as cluster:
        stream, items = await run(cluster, completion("eos-1", fault="eos_first_token"))
        assert stream.style == "terminal"
        (item,) = items
        assert item.data is not None and item.data.finish_reason is not None
        assert item.data.finish_reason.kind is FinishKind.STOP
        assert item.data.disaggregated_params is None
        assert item.data.text
        assert not cluster.decode.seen  # no decode dispatched
        await cluster.settled()
        assert cluster.prefill.kv.counters().staged_blocks == 0


# --- errors before the first byte ---------------------------------------------------------


@pytest.mark.parametrize("status", [400, 429])
async def test_prefill_4xx_is_passed_through(status: int) -> None:
    async with vllm_cluster() as cluster:
        error = await refusal(cluster, completion("rej", fault=f"prefill_reject:{status}"))
        assert isinstance(error, PrefillError)
        cause = error.__cause__
        assert isinstance(cause, WorkerError)
        assert cause.status == status
        assert str(cause).startswith(cluster.prefill.name + " refused request 'rej'")
        client_error = error_for_exception(error)
        assert (client_error.status, client_error.message) == (status, str(cause))
        assert not cluster.decode.seen
        await cluster.settled()


async def test_prefill_unknown_model_404_is_passed_through() -> None:
    async with vllm_cluster(prefill_model=MODEL) as cluster:
        request = completion("model-1")
        request.body["model"] = "no-such-model"
        error = await refusal(cluster, request)
        assert isinstance(error, PrefillError) and isinstance(error.__cause__, WorkerError)
        assert error.__cause__.status == 404
        assert str(error.__cause__) == "The model `no-such-model` does not exist."


@pytest.mark.parametrize(("fault", "status"), [
    ("prefill_reject:500", 502), ("prefill_reject:503", 503),  # a 503: busy, not broken
    ("prefill_fail_before_handoff", 502), ("prefill_fail_after_handoff", 502)])
async def test_prefill_5xx_is_a_502_or_503_with_the_workers_message(
        fault: str, status: int) -> None:
    async with vllm_cluster() as cluster:
        error = await refusal(cluster, completion("p5", fault=fault))
        assert isinstance(error, PrefillError)
        cause = error.__cause__
        assert isinstance(cause, WorkerError) and cause.status == 502
        assert cluster.prefill_url in str(cause)
        assert fault.partition(":")[0] in str(cause)  # the worker's own message
        assert error_for_exception(error).status == status
        await cluster.settled()
        assert cluster.prefill.kv.counters().held_blocks == 0


async def test_prefill_unreachable_is_502() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: the connection is refused
        async with vllm_cluster(prefill_url=f"http://127.0.0.1:{port}") as cluster:
            error = await refusal(cluster, completion("gone"))
            assert isinstance(error, PrefillError)
            assert isinstance(error.__cause__, WorkerError)
            assert error.__cause__.status == 502
            assert f"127.0.0.1:{port}" in str(error.__cause__)
            assert "ConnectError" in str(error.__cause__)


async def test_prefill_reset_is_a_prefill_error() -> None:
    async with vllm_cluster() as cluster:
        error = await refusal(cluster, completion("reset", fault="prefill_reset"))
        assert isinstance(error, PrefillError)
        assert "failed mid-stream" in str(error) and cluster.prefill_url in str(error)
        assert error_for_exception(error).status == 502
        await cluster.settled()


async def test_prefill_deadline_closes_the_prefill_connection() -> None:
    async with vllm_cluster(deadlines=Deadlines(prefill=0.3)) as cluster:
        error = await refusal(cluster, completion("stall", fault="prefill_stall"))
        assert isinstance(error, PrefillDeadlineExceeded)
        # its own deadline is the one thing that closes a prefill connection early
        await wait_until(lambda: cluster.prefill.stats.aborted == 1)
        await cluster.settled()
        assert cluster.prefill.kv.counters().aborted == 1


@pytest.mark.parametrize(("status", "expected"), [(400, 400), (503, 502)])
async def test_a_workers_error_survives_a_deadline_expiring_while_its_answer_closes(
        autojump_clock: trio.testing.MockClock, status: int, expected: int) -> None:
    """The worker answers an error status; the caller's deadline expires while the
    adapter closes that answer (closing is a checkpoint). The caller still gets the
    worker's error, not a Cancelled that its deadline scope swallows (which the client
    would see as a 504). The clock is virtual: the close takes 1 s, the deadline is 0.5 s
    after the request, so it expires during the close, every run."""
    closes: list[float] = []

    class SlowClose(httpx.AsyncByteStream):
        def __init__(self) -> None:
            self.parts = [b'{"object": "error", "message": "bad prompt", "code": 400}']

        def __aiter__(self) -> SlowClose:
            return self

        async def __anext__(self) -> bytes:
            await trio.lowlevel.checkpoint()
            if not self.parts:
                raise StopAsyncIteration
            return self.parts.pop()

        async def aclose(self) -> None:
            closes.append(trio.current_time())
            await trio.sleep(1)

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers={"content-type": "application/json"},
                              stream=SlowClose())

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        engine = VllmEngine("http://prefill:8000", "prefill", client=client)
        send, receive = trio.open_memory_channel[Item](1)
        with receive, pytest.raises(WorkerError) as caught:
            with trio.move_on_after(0.5):
                await engine.generate(completion("late"), RequestContext("late"), send)
    assert caught.value.status == expected and "bad prompt" in str(caught.value)
    assert closes == [0.0]  # the deadline had not expired when the close began
    assert trio.current_time() <= 2.0  # the close is bounded; the clock jumped past 0.5


async def test_decode_reject_then_b1_consumes_the_kv() -> None:
    async with vllm_cluster() as cluster:
        error = await refusal(cluster, completion("drej", fault="decode_reject:503"))
        assert isinstance(error, WorkerError) and error.status == 502
        assert cluster.decode_url in str(error)
        await cluster.settled()  # B1: a minimal decode pulled the staged KV
        assert cluster.router.counters.staged_kv_cleanups == 1
        counters = cluster.prefill.kv.counters()
        assert (counters.served, counters.stranded_blocks) == (1, 0)


# --- decode failures after acceptance -----------------------------------------------------


def assert_worker_error(item: Item, url: str) -> None:
    """A failure after the worker accepted is an error item carrying a typed 502
    :class:`WorkerError` naming the worker, for the server to map; its message is the
    item's."""
    error = item.exception
    assert isinstance(error, WorkerError)
    assert (error.status, error.worker, str(error)) == (502, url, item.error_message())


async def test_decode_failure_before_the_first_token() -> None:
    async with vllm_cluster() as cluster:
        _, items = await run(cluster, completion("dfb", fault="decode_fail_before_first_token"))
        (item,) = items
        assert item.is_error
        message = item.error_message() or ""
        assert message.startswith(f"decode worker {cluster.decode_url} reported an error")
        assert "decode_fail_before_first_token" in message
        assert_worker_error(item, cluster.decode_url)
        await cluster.settled()
        counters = cluster.prefill.kv.counters()  # the decode told the prefill to free it
        assert (counters.aborted, counters.freed_blocks, counters.served) == (1, 3, 0)


async def test_decode_error_after_the_first_token() -> None:
    async with vllm_cluster() as cluster:
        _, items = await run(cluster, completion("dea", max_tokens=6, fault="decode_error_at:2"))
        assert len(items) == 3
        assert [item.is_error for item in items] == [False, False, True]
        assert "decode_error_at" in (items[-1].error_message() or "")
        assert_worker_error(items[-1], cluster.decode_url)
        await cluster.settled()


async def test_decode_reset_mid_stream_is_an_error_item() -> None:
    async with vllm_cluster() as cluster:
        _, items = await run(cluster, completion("drs", max_tokens=6, fault="decode_reset_at:3"))
        assert [item.is_error for item in items] == [False, False, False, True]
        message = items[-1].error_message() or ""
        assert message.startswith(f"decode worker {cluster.decode_url}")
        assert "mid-stream" in message
        assert_worker_error(items[-1], cluster.decode_url)
        await cluster.settled()


async def test_decode_worker_death_mid_stream_is_an_error_item() -> None:
    async with vllm_cluster() as cluster:
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


async def test_B1_a_cleanup_no_decode_worker_took_is_one_clear_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The only decode worker is dead: the request gets the decode's refusal, and the B1
    cleanup, which finds no worker until its deadline, says so in one line that names
    what it tried and what becomes of the KV (not "failed: TooSlowError()")."""
    async with vllm_cluster(deadlines=Deadlines(handoff=0.3, decode_idle=0.3)) as cluster:
        cluster.decode_scope.cancel()  # the decode worker dies before the request
        error = await refusal(cluster, completion("gone"))
        assert isinstance(error, WorkerError) and cluster.decode_url in str(error)
        with trio.fail_after(5):
            await cluster.keeper.wait_idle()
    assert cluster.router.counters.staged_kv_cleanup_failures == 1
    lines = [record.getMessage() for record in caplog.records
             if record.getMessage().startswith("B1 cleanup decode for gone")]
    assert lines == [
        f"B1 cleanup decode for gone: no decode worker took the staged KV within 0.6 s "
        f"(the handoff and decode idle deadlines; tried: {cluster.decode_url}); the "
        f"prefill worker's own lease frees it"], lines


async def test_B1_a_cleanup_that_finds_the_kv_gone_already_is_not_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A B1 cleanup decode whose worker finds no KV to take (a decode aborted before its
    pull let go of it, or its lease ran out: here a decode already took it): the KV is
    gone, which is what the cleanup is for. One info line says so; no failure is counted
    and nothing is logged as a warning."""
    caplog.set_level(logging.INFO, logger="trio_disagg.router")
    async with vllm_cluster() as cluster:
        await run(cluster, completion("taken"))  # its decode pulls the KV
        (seen,) = [seen for seen in cluster.decode.seen if seen.request_id == "taken"]
        handoff = PrefillResult(disaggregated_params=seen.body["kv_transfer_params"])
        start_cleanup(cluster.router, attrs.evolve(completion("taken"),
                                                   prefill_result=handoff))
        with trio.fail_after(5):
            await cluster.keeper.wait_idle()
        await cluster.settled()
    counters = cluster.router.counters
    assert counters.staged_kv_cleanups == 1 and counters.staged_kv_cleanup_failures == 0
    lines = [record for record in caplog.records
             if record.getMessage().startswith("B1 cleanup decode for taken")]
    assert [record.levelno for record in lines] == [logging.INFO], lines
    assert "the KV was gone already" in lines[0].getMessage()


# stop_generating and the client disconnects (G4, G9, B1) are in test_protocol_router.py.


# --- concurrency --------------------------------------------------------------------------


async def test_twenty_concurrent_requests() -> None:
    async with vllm_cluster() as cluster:
        results: dict[int, list[Item]] = {}

        async def one(i: int) -> None:
            _, results[i] = await run(cluster, completion(f"c-{i}", max_tokens=8))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(one, i)
        assert all(len(tokens(items)) == 8 for items in results.values())
        assert all(not any(item.is_error for item in items) for items in results.values())
        await cluster.settled()
        counters = cluster.prefill.kv.counters()
        assert (counters.served, counters.staged_blocks, counters.freed_blocks) == (20, 60, 60)
        assert cluster.prefill.stats.aborted == cluster.decode.stats.aborted == 0


async def test_streamed_requests_give_their_worker_connections_back() -> None:
    """P4: a streamed decode read to its end (the body's end after ``[DONE]``) and a
    prefill answer both return their connection to the pool, so a run of requests one
    after another keeps one connection per worker instead of opening one per request."""
    async with vllm_cluster() as cluster:
        client = cluster.client
        assert isinstance(client, WorkerClient)
        for i in range(3):
            _, items = await run(cluster, completion(f"keep-{i}", max_tokens=4))
            assert len(texts(items)) == 4
            await cluster.settled()
            await wait_until(lambda: client.connections_idle == 2)
            assert client.connections_open == 2  # one to the prefill, one to the decode


# --- the mock workers on their own --------------------------------------------------------


async def test_mock_worker_endpoints_and_ttl() -> None:
    prefill = create_mock_worker("prefill", latency=LatencyModel.zero(), kv_ttl=0.2,
                                 model=MODEL)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_worker, prefill))
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            assert (await client.get("/health")).status_code == 200
            models = (await client.get("/v1/models")).json()
            assert models["data"][0]["id"] == MODEL
            bad = await client.post("/v1/completions", content=b"{nope")
            assert bad.status_code == 400 and "error" in bad.json()
            answer = (await client.post("/v1/completions", json=prefill_body(
                {"model": MODEL, "prompt": PROMPT}), headers={"x-request-id": "ttl"})).json()
            assert answer["choices"][0]["finish_reason"] == "length"
            assert answer["kv_transfer_params"]["remote_port"] == port
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == \
                expected_cached({"prompt": PROMPT})
            assert prefill.kv.counters().held_blocks == 3
            # nobody pulls: the 0.2 s lease expires, the blocks are stranded
            await wait_until(lambda: prefill.kv.counters().held_blocks == 0)
            samples = metric_samples((await client.get("/metrics")).text)
            assert samples["trio_disagg_mock_kv_held_blocks"] == 0
            assert samples["trio_disagg_mock_kv_stranded_blocks_total"] == 3
            assert samples["trio_disagg_mock_kv_expired_requests_total"] == 1
            gone = await client.get("/kv/ttl")
            assert gone.status_code == 404 and "expired" in gone.json()["error"]["message"]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("protocol", ["vllm", "sglang", "trtllm"])
async def test_mock_worker_ignores_a_body_fault_without_fault_injection(protocol: str) -> None:
    # A client may not break a mock worker: the body's "fault" counts only on a worker
    # started with fault injection (``trio-disagg mock-worker --fault-injection``).
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "fault": "decode_reject:429"}
    async with trio.open_nursery() as nursery:
        plain, injecting = [
            await nursery.start(partial(serve_mock_worker, "decode", protocol,
                                        latency=LatencyModel.zero(), fault_injection=flag))
            for flag in (False, True)]
        async with httpx.AsyncClient(timeout=5.0) as client:
            ignored = await client.post(f"http://127.0.0.1:{plain}/v1/completions", json=body)
            assert ignored.status_code == 200, ignored.text
            answer = ignored.json()
            assert answer["choices"][0]["finish_reason"] == "length"
            assert answer["usage"]["completion_tokens"] == 3
            honoured = await client.post(f"http://127.0.0.1:{injecting}/v1/completions",
                                         json=body)
            assert honoured.status_code == 429
            assert "decode_reject" in honoured.text
        nursery.cancel_scope.cancel()


# --- end to end: the openai client, the router's HTTP server, the mock vLLM workers -------


async def test_stats_endpoint_stamps_each_abort_on_the_shared_monotonic_clock() -> None:
    """``GET /stats`` (not from vLLM; benchmark P5 reads it): the worker's counters, and
    each aborted request with the ``time.monotonic()`` of its abort, comparable with the
    client's own stamps (one clock per host)."""
    async with served("vllm", latency=SLOW_TOKENS) as server:
        cluster = server.cluster
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "stream": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as http:
            async with http.stream("POST", "/v1/completions", json=body,
                                   headers={"x-request-id": "abort-me"}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break
                closed_at = time.monotonic()
            await wait_until(lambda: cluster.decode.stats.aborted == 1)
            decode = (await http.get(cluster.decode_url + "/stats")).json()
            prefill = (await http.get(cluster.prefill_url + "/stats")).json()
        (abort,) = decode["aborts"]
        worker_id = abort["request_id"]  # the client's id, then the router's own (B8)
        assert worker_id.rpartition(".")[0] == "abort-me"
        assert closed_at <= abort["at"] <= time.monotonic()
        assert list(cluster.decode.aborts) == [(worker_id, abort["at"])]
        assert decode["stats"]["aborted"] == 1 and decode["stats"]["running"] == 0
        assert prefill["aborts"] == [] and prefill["stats"]["completed"] == 1
        await cluster.settled()


async def test_e2e_fifty_concurrent_streams() -> None:
    async with served("vllm") as server:
        client = server.openai()
        limiter = trio.CapacityLimiter(50)
        counts: list[int] = []

        def stream(i: int) -> int:
            chunks = list(client.completions.create(
                model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=10, stream=True))
            assert chunks[-1].choices[0].finish_reason == "length"
            return sum(1 for chunk in chunks if chunk.choices[0].text)

        async def one(i: int) -> None:
            counts.append(await in_thread(partial(stream, i), limiter))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(50):
                    nursery.start_soon(one, i)
        assert counts == [10] * 50
        await server.cluster.settled()
        assert server.cluster.prefill.kv.counters().served == 50


async def test_a_non_ascii_request_id_reaches_both_workers() -> None:
    async with vllm_cluster() as cluster:
        _, items = await run(cluster, completion("réq-ü", max_tokens=2))
        assert len(texts(items)) == 2
        assert cluster.prefill.seen[0].request_id.encode("latin-1") == "réq-ü".encode()
        assert cluster.decode.seen[0].request_id == cluster.prefill.seen[0].request_id
        await cluster.settled()
