"""The TensorRT-LLM adapter against the mock TensorRT-LLM workers over real sockets
(docs/protocols.md sections 1, 4 and 5): the context-first handoff with ``ctx_request_id``
bookkeeping and a KV pull by ``ctx_request_id``, the terminal context (S7), the refusal of
a context without a usable ``ctx_request_id`` before any generation request (S9), errors
before and after the first token, a context leg never aborted after its handoff, and end
to end with the official ``openai`` client through the router's HTTP server.

stop_generating (G4) and the client disconnects (G9, B1, B5), which the sequential
handoff protocols share, are in ``test_protocol_router``.

Everything runs on 127.0.0.1 with port 0 and the real clock (but the one test of the
adapter alone, over an httpx mock transport); every wait is bounded.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import orjson
import pytest
import trio
from e2e_support import (
    FAST,
    MODEL,
    PROMPT,
    PROMPT_TOKENS,
    expected_cached,
    in_thread,
    served,
    wait_until,
    warm,
)
from openai.types import Completion
from protocol_support import (
    Cluster,
    Item,
    completion,
    metric_samples,
    open_cluster,
    refusal,
    run,
    tokens,
)

from trio_disagg import (
    CancelWindow,
    Deadlines,
    Engine,
    FinishKind,
    HandoffStyle,
    NoDisaggregatedParams,
    PrefillDeadlineExceeded,
    PrefillError,
    PrefillResult,
    PreprocessedRequest,
    RequestContext,
    WorkerError,
    cancel_window_of,
)
from trio_disagg.engines import (
    PROMPT_TOKEN_IDS_KEY,
    Client,
    LatencyModel,
    TrtllmEngine,
    context_body,
    generation_body,
    trtllm_engines,
    worker_client,
)
from trio_disagg.server import error_for_exception
from trio_disagg.workers import MockTrtllmWorker, create_mock_worker, serve_worker

#: A long lease (kv_transfer_timeout): every test checks the KV is freed without waiting.
KV_TTL = 120.0


@asynccontextmanager
async def trtllm_cluster(
    *,
    latency: LatencyModel = FAST,
    deadlines: Deadlines | None = None,
    prefill_model: str | None = None,
    prefill_url: str | None = None,
    wrap_decode: Callable[[TrtllmEngine], Any] | None = None,
    cancel_window: CancelWindow | None = None,
    disagg_request_ids: bool = True,
) -> AsyncIterator[Cluster[MockTrtllmWorker]]:
    prefill = MockTrtllmWorker("prefill", fault_injection=True, latency=latency,
                               kv_ttl=KV_TTL, model=prefill_model,
                               disagg_request_ids=disagg_request_ids)
    decode = MockTrtllmWorker("decode", fault_injection=True, latency=latency,
                              disagg_request_ids=disagg_request_ids)

    def engines(prefill_url: str, decode_url: str, client: Client
                ) -> tuple[Sequence[Engine], Sequence[Engine]]:
        return trtllm_engines([prefill_url], [decode_url], client=client,
                              cancel_window=cancel_window)

    async with open_cluster(prefill, decode, worker_client(), engines, deadlines=deadlines,
                            prefill_url=prefill_url, wrap_decode=wrap_decode) as cluster:
        yield cluster


# --- the wire: what the adapter sends -----------------------------------------------------


def test_context_and_generation_bodies_follow_protocols_section_4() -> None:
    body = {"model": MODEL, "prompt": "a b c", "stream": True,
            "stream_options": {"include_usage": False}, "max_tokens": 9}
    assert context_body(body, 42) == {
        "model": MODEL, "prompt": "a b c", "stream": False, "stream_options": None,
        "max_tokens": 9,
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 42}}
    assert body["stream"] is True  # the client's body is untouched
    handoff = {"request_type": "context_only", "ctx_request_id": 5, "first_gen_tokens": [7],
               "encoded_opaque_state": "xyz", "disagg_request_id": 42,
               PROMPT_TOKEN_IDS_KEY: [1, 2, 3]}
    request = PreprocessedRequest(request_id="r", model=MODEL, body=body, max_tokens=9,
                                  prefill_result=PrefillResult(disaggregated_params=handoff))
    wire = generation_body(request)
    assert wire["disaggregated_params"] == {
        "request_type": "generation_only", "ctx_request_id": 5, "first_gen_tokens": [7],
        "encoded_opaque_state": "xyz", "disagg_request_id": 42}
    assert wire["prompt"] == [1, 2, 3]  # the context's prompt_token_ids
    # the usage once, at the end: trtllm-serve releases whose StreamOptions default
    # continuous_usage_stats to true would put it in every chunk (off the fast path)
    assert wire["stream"] is True and wire["stream_options"] == {
        "include_usage": True, "continuous_usage_stats": False}
    chat = attrs.evolve(request, body={"model": MODEL, "messages": [{"role": "user",
                                                                     "content": "a b c"}]})
    chat_wire = generation_body(chat)
    assert chat_wire["prompt_token_ids"] == [1, 2, 3] and "prompt" not in chat_wire
    assert "max_completion_tokens" not in chat_wire  # no budget invented (B8)
    assert "max_tokens" not in chat_wire
    assert "disaggregated_params" not in generation_body(attrs.evolve(
        request, body={**body, "disaggregated_params": {"x": 1}}, prefill_result=None))
    engines = trtllm_engines(["http://c:1"], ["http://g:1"], client=httpx.AsyncClient())
    assert [e.handoff_style for e in engines[0] + engines[1]] == [
        HandoffStyle.CONTEXT_FIRST, HandoffStyle.SEQUENTIAL]
    with pytest.raises(ValueError, match="unique"):
        trtllm_engines(["http://c:1", "http://c:1/"], [], client=httpx.AsyncClient())


@pytest.mark.parametrize("draw", ["lowest", "highest"])
async def test_disagg_request_id_is_never_a_local_request_id(
        draw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorRT-LLM keeps [MIN_GLOBAL_ID, 2^63) for the disaggregated service's
    ``disagg_request_id`` and numbers a worker's own requests below it
    (NVIDIA/TensorRT-LLM, tensorrt_llm/llmapi/disagg_utils.py: 2^40; 2^41 when global ids
    came in): however the random draw falls, the context request's id is in both
    versions' global range, never one of a worker's local ids."""
    lowest = draw == "lowest"
    monkeypatch.setattr(secrets, "randbits", lambda bits: 0 if lowest else (1 << bits) - 1)
    monkeypatch.setattr(secrets, "randbelow", lambda below: 0 if lowest else below - 1)
    sent: list[dict[str, Any]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        await trio.lowlevel.checkpoint()
        sent.append(orjson.loads(request.content))
        return httpx.Response(400, json={"object": "error", "message": "enough",
                                         "type": "BadRequestError", "code": 400})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        engine = TrtllmEngine("http://context:8000", "prefill", client=client)
        send, _ = trio.open_memory_channel[Item](4)
        with trio.fail_after(5), pytest.raises(WorkerError, match="enough"):
            await engine.generate(completion("id"), RequestContext("id"), send)
    (body,) = sent
    disagg_id = body["disaggregated_params"]["disagg_request_id"]
    assert type(disagg_id) is int and 1 << 41 <= disagg_id < 1 << 63


def test_B10_a_context_may_be_cancelled_before_its_handoff_only() -> None:
    """A context aborted before it answered stages nothing; after, its KV is committed."""
    client = httpx.AsyncClient()
    contexts, _ = trtllm_engines(["http://c:1"], ["http://g:1"], client=client)
    assert contexts[0].cancel_window is CancelWindow.BEFORE_HANDOFF
    assert cancel_window_of(contexts[0]) is CancelWindow.BEFORE_HANDOFF
    contexts, _ = trtllm_engines(["http://c:1"], ["http://g:1"], client=client,
                                 cancel_window=CancelWindow.NEVER)
    assert contexts[0].cancel_window is CancelWindow.NEVER
    assert TrtllmEngine("http://c:1", "prefill", client=client,
                        cancel_window=CancelWindow.ANYTIME).cancel_window is CancelWindow.ANYTIME
    assert TrtllmEngine.default_cancel_window is CancelWindow.BEFORE_HANDOFF


# --- the context-first handoff ------------------------------------------------------------


async def test_context_first_handoff_with_cached_tokens_from_the_context() -> None:
    async with trtllm_cluster() as cluster:
        warm(cluster.prefill.prefix, {"prompt": PROMPT})  # its prompt was computed before
        request = completion("req-ctx", max_tokens=5, stream_options={"include_usage": False},
                             return_token_ids=True)
        stream, items = await run(cluster, request)
        assert stream.style == "context_first"
        assert all(not item.is_error for item in items)
        assert len(tokens(items)) == 5 and all(tokens(items))
        last = items[-1].data
        assert last is not None and last.finish_reason is not None
        assert last.finish_reason.kind is FinishKind.LENGTH
        assert last.completion_usage is not None
        assert (last.completion_usage.prompt_tokens,
                last.completion_usage.completion_tokens) == (PROMPT_TOKENS, 5)
        cached = expected_cached({"prompt": PROMPT}, warm=True)
        assert 0 < cached < PROMPT_TOKENS
        details = stream.prompt_tokens_details
        assert details is not None and details.cached_tokens == cached
        # what each server received: docs/protocols.md section 4, one X-Request-Id
        (seen_context,) = cluster.prefill.seen
        (seen_generation,) = cluster.decode.seen
        assert seen_context.request_id == "req-ctx" == seen_generation.request_id
        disagg_id = seen_context.body["disaggregated_params"]["disagg_request_id"]
        assert type(disagg_id) is int and 1 << 41 <= disagg_id < 1 << 63
        assert seen_context.body == context_body(request.body, disagg_id)
        params = seen_generation.body["disaggregated_params"]
        assert params["request_type"] == "generation_only"
        assert params["ctx_request_id"] == 1 and params["disagg_request_id"] == disagg_id
        assert isinstance(params["encoded_opaque_state"], str)
        assert PROMPT_TOKEN_IDS_KEY not in params
        prompt = seen_generation.body["prompt"]
        assert len(prompt) == PROMPT_TOKENS and all(type(t) is int for t in prompt)
        first = items[0].data
        assert first is not None and first.token_ids == params["first_gen_tokens"]
        await cluster.settled()
        # the generation server pulled the KV by ctx_request_id over loopback
        counters = cluster.prefill.kv.counters()
        assert (counters.staged_blocks, counters.freed_blocks, counters.served) == (3, 3, 1)
        assert cluster.prefill.stats.kv_transfers == 1 == cluster.decode.stats.kv_pulls
        async with httpx.AsyncClient() as http:
            response = await http.get(cluster.prefill_url + "/metrics")
        samples = metric_samples(response.text)
        assert samples["trio_disagg_mock_kv_held_blocks"] == 0
        assert samples["trio_disagg_mock_kv_served_requests_total"] == 1


async def test_servers_from_before_disagg_request_id_are_served_without_it() -> None:
    """``trtllm-serve`` releases whose ``DisaggregatedParams`` has no ``disagg_request_id``
    forbid unknown fields (``OpenAIBaseModel``: ``extra="forbid"``) and refuse a context
    request that carries one (400, pydantic's ``extra_forbidden``). The engine sends that
    request again without it, and every later one: the client never sees the refusal,
    and the generation request carries no field its server does not know."""
    async with trtllm_cluster(disagg_request_ids=False) as cluster:
        for rid in ("old-1", "old-2"):
            stream, items = await run(cluster, completion(rid, max_tokens=3))
            assert stream.style == "context_first"
            assert all(not item.is_error for item in items)
            assert len(tokens(items)) == 3
        refused, *sent = cluster.prefill.seen
        assert refused.body["disaggregated_params"]["disagg_request_id"] >= 1 << 41
        assert [seen.body["disaggregated_params"] for seen in sent] == [
            {"request_type": "context_only"}] * 2  # learned once, for the engine
        for seen in cluster.decode.seen:
            params = seen.body["disaggregated_params"]
            assert "disagg_request_id" not in params
            assert params["request_type"] == "generation_only"
        await cluster.settled()
        assert cluster.prefill.kv.counters().served == 2


@pytest.mark.parametrize("refusal_body", [
    pytest.param({"error": "[{'type': 'extra_forbidden', 'loc': ('body', "
                           "'disaggregated_params', 'disagg_request_id'), 'msg': 'Extra "
                           "inputs are not permitted', 'input': 4398046511104}]"},
                 id="trtllm-serve-400"),
    pytest.param({"detail": [{"type": "extra_forbidden",
                              "loc": ["body", "disaggregated_params", "disagg_request_id"],
                              "msg": "Extra inputs are not permitted", "input": 1}]},
                 id="fastapi-422"),
])
async def test_a_refusal_of_disagg_request_id_is_learned_once(
        refusal_body: dict[str, Any]) -> None:
    """Over an httpx mock transport, as such a server answers: 400 ``{"error": str(exc)}``
    from ``trtllm-serve``'s validation handler, or FastAPI's own 422 ``{"detail":
    [...]}``. Any other 4xx is the client's, as before."""
    status = 400 if "error" in refusal_body else 422
    sent: list[dict[str, Any]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        await trio.lowlevel.checkpoint()
        body = orjson.loads(request.content)
        sent.append(body)
        if "disagg_request_id" in body["disaggregated_params"]:
            return httpx.Response(status, json=refusal_body)
        if body["prompt"] == "bad":
            return httpx.Response(400, json={"error": "prompt is bad"})
        return httpx.Response(200, json={
            "id": "cmpl-c", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": " x", "finish_reason": "length",
                         "disaggregated_params": {
                             "request_type": "context_only", "first_gen_tokens": [7],
                             "ctx_request_id": 3, "encoded_opaque_state": "c3RhdGU=",
                             "draft_tokens": None}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "prompt_token_ids": [1, 2, 3]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        engine = TrtllmEngine("http://context:8000", "prefill", client=client)
        for rid in ("a", "b"):
            send, receive = trio.open_memory_channel[Item](4)
            with trio.fail_after(5):
                async with trio.open_nursery() as nursery:
                    await nursery.start(engine.generate, completion(rid),
                                        RequestContext(rid), send)
                    with receive:
                        (item,) = [item async for item in receive]
            assert item.data is not None
            params = item.data.disaggregated_params
            assert isinstance(params, dict) and params["ctx_request_id"] == 3
            assert "disagg_request_id" not in params  # none sent, none to invent
        send, _ = trio.open_memory_channel[Item](4)
        bad = completion("c")
        bad = attrs.evolve(bad, body={**bad.body, "prompt": "bad"})
        with trio.fail_after(5), pytest.raises(WorkerError, match="prompt is bad") as error:
            await engine.generate(bad, RequestContext("c"), send)
        assert error.value.status == 400
    assert ["disagg_request_id" in body["disaggregated_params"] for body in sent] == [
        True, False, False, False]


async def test_chat_handoff_sends_the_prompt_token_ids() -> None:
    async with trtllm_cluster() as cluster:
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                "max_completion_tokens": 4}
        stream, items = await run(cluster, PreprocessedRequest(
            request_id="chat-1", model=MODEL, body=body, max_tokens=4))
        assert len(tokens(items)) == 4 and all(tokens(items))
        (seen_generation,) = cluster.decode.seen
        assert seen_generation.path == "/v1/chat/completions"
        assert seen_generation.body["messages"] == body["messages"]
        assert len(seen_generation.body["prompt_token_ids"]) == PROMPT_TOKENS
        details = stream.prompt_tokens_details
        assert details is not None and details.cached_tokens == expected_cached(body)
        await cluster.settled()


@pytest.mark.parametrize(("fault", "kind"), [
    ("eos_first_token", FinishKind.STOP),
    ("prefill_cancelled_finish", FinishKind.CANCELLED),
    ("prefill_error_finish", FinishKind.ERROR),
])
async def test_S7_terminal_context_is_the_answer(fault: str, kind: FinishKind) -> None:
    async with trtllm_cluster() as cluster:
        stream, items = await run(cluster, completion("term", fault=fault))
        assert stream.style == "terminal"
        (item,) = items
        assert item.data is not None and item.data.finish_reason is not None
        assert item.data.finish_reason.kind is kind
        assert item.data.disaggregated_params is None  # removed before the client sees it
        assert not cluster.decode.seen  # no generation request
        await cluster.settled()
        assert cluster.prefill.kv.counters().staged_blocks == 0


@pytest.mark.parametrize("hook", ["null", "missing"])
async def test_S9_context_without_a_usable_ctx_request_id_sends_no_generation_request(
        hook: str) -> None:
    async with trtllm_cluster() as cluster:
        error = await refusal(cluster, completion("s9", mock_ctx_request_id=hook))
        assert isinstance(error, NoDisaggregatedParams)
        assert "no usable ctx_request_id" in str(error)
        assert error_for_exception(error).status == 502
        assert not cluster.decode.seen  # S9: refused before any generation request
        (seen_context,) = cluster.prefill.seen
        assert seen_context.body["disaggregated_params"]["request_type"] == "context_only"
        await cluster.settled()
        assert cluster.router.counters.staged_kv_cleanups == 0


# --- errors before the first byte ---------------------------------------------------------


@pytest.mark.parametrize("status", [400, 429])
async def test_context_4xx_is_passed_through(status: int) -> None:
    async with trtllm_cluster() as cluster:
        error = await refusal(cluster, completion("rej", fault=f"prefill_reject:{status}"))
        assert isinstance(error, PrefillError)
        cause = error.__cause__
        assert isinstance(cause, WorkerError) and cause.status == status
        assert str(cause).startswith(cluster.prefill.name + " refused request 'rej'")
        client_error = error_for_exception(error)
        assert (client_error.status, client_error.message) == (status, str(cause))
        assert not cluster.decode.seen
        await cluster.settled()


async def test_context_unknown_model_404_is_passed_through() -> None:
    async with trtllm_cluster(prefill_model=MODEL) as cluster:
        request = completion("model-1")
        request.body["model"] = "no-such-model"
        error = await refusal(cluster, request)
        assert isinstance(error, PrefillError) and isinstance(error.__cause__, WorkerError)
        assert error.__cause__.status == 404
        assert str(error.__cause__) == "The model `no-such-model` does not exist."


@pytest.mark.parametrize(("fault", "status"), [
    ("prefill_reject:500", 502), ("prefill_reject:503", 503),  # a 503: busy, not broken
    ("prefill_fail_before_handoff", 502), ("prefill_fail_after_handoff", 502)])
async def test_context_5xx_is_a_502_or_503_with_the_workers_message(
        fault: str, status: int) -> None:
    async with trtllm_cluster() as cluster:
        error = await refusal(cluster, completion("p5", fault=fault))
        assert isinstance(error, PrefillError)
        cause = error.__cause__
        assert isinstance(cause, WorkerError) and cause.status == 502
        assert cluster.prefill_url in str(cause)
        assert fault.partition(":")[0] in str(cause)  # the worker's own message
        assert error_for_exception(error).status == status
        await cluster.settled()
        assert cluster.prefill.kv.counters().held_blocks == 0


async def test_context_unreachable_is_502() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: the connection is refused
        async with trtllm_cluster(prefill_url=f"http://127.0.0.1:{port}") as cluster:
            error = await refusal(cluster, completion("gone"))
            assert isinstance(error, PrefillError)
            assert isinstance(error.__cause__, WorkerError)
            assert error.__cause__.status == 502
            assert "ConnectError" in str(error.__cause__)


async def test_context_reset_is_a_prefill_error() -> None:
    async with trtllm_cluster() as cluster:
        error = await refusal(cluster, completion("reset", fault="prefill_reset"))
        assert isinstance(error, PrefillError)
        assert "failed mid-stream" in str(error) and cluster.prefill_url in str(error)
        await cluster.settled()


async def test_B2_context_deadline_closes_the_context_connection() -> None:
    async with trtllm_cluster(deadlines=Deadlines(prefill=0.3)) as cluster:
        error = await refusal(cluster, completion("stall", fault="prefill_stall"))
        assert isinstance(error, PrefillDeadlineExceeded)
        # before the context answered, its own deadline closes the connection
        await wait_until(lambda: cluster.prefill.stats.aborted == 1)
        await cluster.settled()
        assert cluster.prefill.kv.counters().aborted == 1


async def test_B1_generation_reject_then_b1_consumes_the_kv() -> None:
    async with trtllm_cluster() as cluster:
        error = await refusal(cluster, completion("drej", fault="decode_reject:503"))
        assert isinstance(error, WorkerError) and error.status == 502
        assert cluster.decode_url in str(error)
        await cluster.settled()  # B1: a minimal generation request pulled the KV
        assert cluster.router.counters.staged_kv_cleanups == 1
        counters = cluster.prefill.kv.counters()
        assert (counters.served, counters.stranded_blocks) == (1, 0)


# --- the context leg is never aborted after its handoff -----------------------------------


async def test_context_leg_is_never_aborted_after_its_handoff() -> None:
    """A stop before the context server answers closes the connection (nothing is
    committed yet); a stop once it answers does not: its KV is committed, and closing would
    not free it, so the answer is read to its end."""
    answer = {"id": "cmpl-1", "object": "text_completion", "model": MODEL,
              "choices": [{"index": 0, "text": " x", "finish_reason": "length",
                           "disaggregated_params": {"request_type": "context_only",
                                                    "ctx_request_id": 7}}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
              "prompt_token_ids": [1, 2, 3]}
    answering = trio.Event()
    computing = trio.Event()
    release = trio.Event()
    read_to_the_end: list[bool] = []

    class Body:
        """The answer's body, sent once the test releases it (the headers went first)."""

        def __init__(self) -> None:
            self.sent = False

        def __aiter__(self) -> Body:
            return self

        async def __anext__(self) -> bytes:
            if self.sent:
                read_to_the_end.append(True)
                raise StopAsyncIteration
            answering.set()
            await release.wait()
            self.sent = True
            return orjson.dumps(answer)

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.headers["x-request-id"] == "before":
            computing.set()
            await trio.sleep_forever()  # still computing when stopped
        return httpx.Response(200, headers={"content-type": "application/json"},
                              content=Body())

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        engine = TrtllmEngine("http://context:8000", "prefill", client=client)
        results: dict[str, list[Item]] = {}
        for rid in ("before", "after"):
            context = RequestContext(rid)
            send, receive = trio.open_memory_channel[Item](4)
            with trio.fail_after(5):
                async with trio.open_nursery() as nursery:
                    if rid == "before":
                        nursery.start_soon(partial(engine.generate, completion(rid), context,
                                                   send))
                        await computing.wait()
                    else:
                        await nursery.start(engine.generate, completion(rid), context, send)
                        await answering.wait()
                    context.stop_generating()
                    release.set()
                    with receive:
                        results[rid] = [item async for item in receive]
    (stopped,) = results["before"]
    assert stopped.data is not None and stopped.data.finish_reason is not None
    assert stopped.data.finish_reason.kind is FinishKind.CANCELLED
    (handoff,) = results["after"]
    assert read_to_the_end == [True]
    assert handoff.data is not None and handoff.data.finish_reason is not None
    assert handoff.data.finish_reason.kind is FinishKind.LENGTH
    params = handoff.data.disaggregated_params
    assert isinstance(params, dict)
    assert params["ctx_request_id"] == 7 and params[PROMPT_TOKEN_IDS_KEY] == [1, 2, 3]
    assert type(params["disagg_request_id"]) is int  # the one sent, as the server omitted it


# --- generation failures after acceptance -------------------------------------------------


async def test_G4_generation_failure_before_the_first_token() -> None:
    async with trtllm_cluster() as cluster:
        _, items = await run(cluster, completion("dfb", fault="decode_fail_before_first_token"))
        (item,) = items
        assert item.is_error
        message = item.error_message() or ""
        assert message.startswith(f"decode worker {cluster.decode_url} reported an error")
        await cluster.settled()
        counters = cluster.prefill.kv.counters()  # it told the context server to free it
        assert (counters.aborted, counters.freed_blocks, counters.served) == (1, 3, 0)


async def test_G4_generation_error_after_the_first_token() -> None:
    async with trtllm_cluster() as cluster:
        _, items = await run(cluster, completion("dea", max_tokens=6, fault="decode_error_at:2"))
        assert [item.is_error for item in items] == [False, False, True]
        assert "decode_error_at" in (items[-1].error_message() or "")
        await cluster.settled()


async def test_generation_reset_mid_stream_is_an_error_item() -> None:
    async with trtllm_cluster() as cluster:
        _, items = await run(cluster, completion("drs", max_tokens=6, fault="decode_reset_at:3"))
        assert [item.is_error for item in items] == [False, False, False, True]
        assert "mid-stream" in (items[-1].error_message() or "")
        await cluster.settled()


async def test_generation_server_death_mid_stream_is_an_error_item() -> None:
    async with trtllm_cluster() as cluster:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                stream = await cluster.router.stream(
                    nursery, completion("death", max_tokens=8, fault="decode_stall_at:2"),
                    RequestContext("death"))
                with stream.outputs:
                    items = [await stream.outputs.receive() for _ in range(2)]
                    cluster.decode_scope.cancel()  # the generation server dies
                    items.extend([item async for item in stream.outputs])
        assert [item.is_error for item in items] == [False, False, True]
        assert cluster.decode_url in (items[-1].error_message() or "")
        with trio.fail_after(5):
            await cluster.keeper.wait_idle()
        assert cluster.prefill.kv.counters().held_blocks == 0  # pulled before it died


# stop_generating and the client disconnects (G4, G9, B1) are in test_protocol_router.py.


# --- concurrency --------------------------------------------------------------------------


async def test_twenty_concurrent_requests_get_twenty_ctx_request_ids() -> None:
    async with trtllm_cluster() as cluster:
        results: dict[int, list[Item]] = {}

        async def one(i: int) -> None:
            _, results[i] = await run(cluster, completion(f"c-{i}", max_tokens=8))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(one, i)
        assert all(len(tokens(items)) == 8 for items in results.values())
        assert all(not any(item.is_error for item in items) for items in results.values())
        ids = {seen.body["disaggregated_params"]["ctx_request_id"] for seen in cluster.decode.seen}
        assert ids == set(range(1, 21))
        await cluster.settled()
        counters = cluster.prefill.kv.counters()
        assert (counters.served, counters.staged_blocks, counters.freed_blocks) == (20, 60, 60)


# --- the mock workers on their own --------------------------------------------------------


async def test_mock_trtllm_workers_context_answers_and_lease() -> None:
    context = create_mock_worker("prefill", "trtllm", fault_injection=True,
                                 latency=LatencyModel.zero(), kv_ttl=0.2,
                                 model=MODEL)
    generation = create_mock_worker("decode", "trtllm", fault_injection=True,
                                    latency=LatencyModel.zero())
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_worker, context))
        gen_port = await nursery.start(partial(serve_worker, generation))
        url = f"http://127.0.0.1:{port}"
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            models = (await client.get("/v1/models")).json()
            assert models["data"][0]["owned_by"] == "tensorrt_llm"
            bad = await client.post("/v1/completions", content=b"{nope")
            assert bad.status_code == 400 and bad.json()["object"] == "error"
            answer = (await client.post("/v1/completions", json=context_body(body, 99),
                                        headers={"x-request-id": "lease"})).json()
            params = answer["choices"][0]["disaggregated_params"]
            assert (params["request_type"], params["ctx_request_id"],
                    params["disagg_request_id"]) == ("context_only", 1, 99)
            assert len(params["first_gen_tokens"]) == 1
            assert answer["choices"][0]["finish_reason"] == "length"
            assert len(answer["prompt_token_ids"]) == PROMPT_TOKENS
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == \
                expected_cached({"prompt": PROMPT})
            assert context.kv.counters().held_blocks == 3
            gen_url = f"http://127.0.0.1:{gen_port}/v1/completions"
            wrong = await client.post(gen_url, json=context_body(body, 1))
            assert wrong.status_code == 400  # a generation server takes no context request
            # nobody pulls: the 0.2 s lease expires, the blocks are stranded
            await wait_until(lambda: context.kv.counters().held_blocks == 0)
            samples = metric_samples((await client.get("/metrics")).text)
            assert samples["trio_disagg_mock_kv_held_blocks"] == 0
            assert samples["trio_disagg_mock_kv_stranded_blocks_total"] == 3
            late = await client.post(gen_url, json={
                **body, "prompt": answer["prompt_token_ids"],
                "disaggregated_params": {**params, "request_type": "generation_only"}})
            assert late.status_code == 500 and "expired" in late.json()["message"]
            forged = await client.post(gen_url, json={
                **body, "disaggregated_params": {"request_type": "generation_only",
                                                 "ctx_request_id": 1,
                                                 "encoded_opaque_state": "not base64!"}})
            assert forged.status_code == 500 and "encoded_opaque_state" in forged.text
        nursery.cancel_scope.cancel()


# --- end to end: the openai client, the router's HTTP server, the mock TRT-LLM servers ----


async def test_e2e_S7_terminal_context_and_S9_refusal() -> None:
    async with served("trtllm") as server:
        client = server.openai()
        answer: Completion = await in_thread(lambda: client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=7, extra_body={"fault": "eos_first_token"}))
        assert answer.choices[0].finish_reason == "stop" and answer.choices[0].text
        async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as http:
            refused = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "stream": True,
                "mock_ctx_request_id": "null"})
            assert refused.status_code == 502
            assert "no usable ctx_request_id" in refused.json()["error"]["message"]
        assert not server.cluster.decode.seen  # no generation request for either
        await server.cluster.settled()
