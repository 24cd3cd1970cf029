"""The OpenAI-compatible server end to end: the project's HTTP server on 127.0.0.1
(hypercorn where a test says so), the official ``openai`` client and raw httpx, the
in-process mock engines, the real clock.

docs/protocols.md section 1 (SSE framing, errors, cached_tokens, X-Request-Id), rules
B1-B5 in docs/semantics.md through HTTP, and the disconnect listener's regression test.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar, cast

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import openai
import orjson
import pytest
import trio
from engine_support import StandIn
from hypercorn.config import Config as HyperConfig
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from trio_disagg import (
    Annotated,
    Deadlines,
    DisaggRouter,
    GatedOutputs,
    HandoffStyle,
    InvalidPrefillHandoff,
    LLMEngineOutput,
    PrefillDeadlineExceeded,
    PrefillError,
    PreprocessedRequest,
    RequestContext,
    RequestStream,
    TransferKeeper,
    WorkerPool,
)
from trio_disagg.engines import (
    LatencyModel,
    MockCluster,
    count_prompt_tokens,
    mock_cluster,
)
from trio_disagg.server import OpenAIApp, create_app, serve, wait_for_signals
from trio_disagg.server._request import fresh_request_id

MODEL = "mock-model"
PROMPT = " ".join(f"word{i}" for i in range(45))  # 45 tokens: a partial prefix-cache hit
T = TypeVar("T")
Item = Annotated[LLMEngineOutput]


class Watched(StandIn):
    """An engine wrapper recording the requests it saw and the cancellations it took."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.requests: list[PreprocessedRequest] = []
        self.cancelled = 0
        self.was_cancelled = trio.Event()
        self.saw_request = trio.Event()

    async def generate(  # noqa: ASYNC128 (the wrapped engine calls task_status.started())
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Annotated[LLMEngineOutput]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self.requests.append(request)
        self.saw_request.set()
        try:
            await self.engine.generate(request, context, send_channel, task_status=task_status)
        except trio.Cancelled:
            self.cancelled += 1
            self.was_cancelled.set()
            raise


@attrs.define(eq=False)
class Server:
    url: str
    app: OpenAIApp
    router: DisaggRouter
    keeper: TransferKeeper
    cluster: MockCluster
    prefill: Watched
    decode: Watched
    stop: trio.Event

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=10.0)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=10.0)

    async def settled(self) -> None:
        """B5: wait until no request is handled, in flight or draining; then no KV block
        may be staged."""
        with trio.fail_after(5):
            await self.app.wait_idle()
            await self.router.wait_idle()
            await self.keeper.wait_idle()
        assert self.app.in_flight == self.router.in_flight == self.keeper.in_flight == 0
        assert self.cluster.counters().held_blocks == 0


@asynccontextmanager
async def running(
    *,
    latency: LatencyModel | None = None,
    deadlines: Deadlines | None = None,
    graceful_timeout: float = 5.0,
    failure_threshold: int = 1000,
    style: HandoffStyle = HandoffStyle.SEQUENTIAL,
    decode_engine: Callable[[Any], Watched] = Watched,
    config: Any = None,
    **app_options: Any,
) -> AsyncIterator[Server]:
    cluster = mock_cluster(latency=latency if latency is not None else LatencyModel.zero(),
                           style=style)
    prefill = Watched(cluster.prefill[0])
    decode = decode_engine(cluster.decode[0])
    async with TransferKeeper(drain_window=5.0) as keeper:
        router = DisaggRouter(
            WorkerPool([prefill], failure_threshold=failure_threshold),
            WorkerPool([decode], failure_threshold=failure_threshold),
            keeper, deadlines=deadlines,
        )
        app_options.setdefault("fault_injection", True)  # the tests inject faults
        app = create_app(router, models=[MODEL, "other-model"], **app_options)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(
                serve, app, host="127.0.0.1", port=0, shutdown_trigger=stop.wait,
                graceful_timeout=graceful_timeout, config=config,
            ))
            yield Server(f"http://127.0.0.1:{port}", app, router, keeper, cluster,
                         prefill, decode, stop)
            stop.set()


async def in_thread(fn: Callable[[], T]) -> T:
    with trio.fail_after(10):
        return await trio.to_thread.run_sync(fn)


def events(body: bytes) -> list[bytes]:
    """Split a server-sent-event body, checking the framing on the way."""
    assert body.endswith(b"\n\n"), body[-50:]
    chunks = body[:-2].split(b"\n\n")
    for chunk in chunks:
        assert chunk.startswith(b"data: "), chunk
        assert b"\n" not in chunk, chunk
    return [chunk[len(b"data: "):] for chunk in chunks]


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def expected_cached(body: dict[str, Any], *, warm: bool = False) -> int:
    """The prefill engine's prefix-cache hit for ``body``: 0 for a prompt it never computed;
    once ``warm``, the prompt's whole KV blocks, leaving at least one token to compute."""
    block_size = mock_cluster().prefill[0].kv.block_size
    return (count_prompt_tokens(body) - 1) // block_size * block_size if warm else 0


# --- the happy paths --------------------------------------------------------------------


async def test_completion_not_streamed_with_usage_from_the_prefill() -> None:
    async with running() as server:
        client = server.openai()
        prefill = server.cluster.prefill[0].prefix  # its prompt was computed before
        prefill.insert(prefill.hashes({"prompt": PROMPT}))
        raw = await in_thread(lambda: client.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=7))
        completion: Completion = raw.parse()
        assert raw.http_response.status_code == 200
        assert raw.headers["content-type"] == "application/json"
        assert completion.object == "text_completion"
        assert completion.model == MODEL
        (choice,) = completion.choices
        assert choice.finish_reason == "length"
        assert choice.text
        usage = completion.usage
        assert usage is not None
        assert usage.completion_tokens == 7
        assert usage.prompt_tokens == 45
        assert usage.total_tokens == 52
        cached = expected_cached({"prompt": PROMPT}, warm=True)
        assert 0 < cached != 45  # the decode worker reports 45: this must be the prefill's
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == cached
        request_id = raw.headers["x-request-id"]
        assert completion.id == f"cmpl-{request_id}"
        assert uuid.UUID(request_id).version == 4
        await server.settled()


async def test_completion_default_max_tokens_is_16() -> None:
    async with running() as server:
        client = server.openai()
        completion = await in_thread(lambda: client.completions.create(
            model=MODEL, prompt="hello there"))
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 16
        assert server.decode.requests[0].max_tokens == 16
        # the client's body reaches the workers unchanged
        assert "max_tokens" not in server.decode.requests[0].body
        tokens = await in_thread(lambda: client.completions.create(
            model=MODEL, prompt=[5, 6, 7, 8], max_tokens=2))
        assert tokens.usage is not None
        assert tokens.usage.prompt_tokens == 4


async def test_B8_a_chat_min_tokens_is_not_bounded_by_a_budget_nobody_named() -> None:
    # A chat request without max_tokens has no budget of 16 (that is the legacy
    # completions default): its min_tokens of 20 is the worker's to honour, not a 400
    # "between 0 and max_tokens (16)" about a field the client never sent. Only the
    # operator's --max-tokens-limit bounds it.
    async with running() as server:
        client = server.openai()
        chat = await in_thread(lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}],
            extra_body={"min_tokens": 20}))
        assert chat.choices[0].finish_reason == "length"
        (decode,) = server.decode.requests
        assert decode.body["min_tokens"] == 20 and "max_tokens" not in decode.body
        with pytest.raises(openai.BadRequestError) as refused:
            await in_thread(lambda: client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}],
                extra_body={"min_tokens": 40000}))
        assert refused.value.code == "invalid_value"
        assert "32768" in refused.value.message
        # a completion's default budget of 16 is its worker's too (OpenAI, vLLM)
        with pytest.raises(openai.BadRequestError):
            await in_thread(lambda: client.completions.create(
                model=MODEL, prompt="hello", extra_body={"min_tokens": 20}))
        assert len(server.decode.requests) == 1


@pytest.mark.parametrize("style", list(HandoffStyle), ids=lambda style: style.value)
async def test_completion_streamed_with_usage_chunk(style: HandoffStyle) -> None:
    async with running(style=style) as server:
        client = server.openai()

        def call() -> list[Completion]:
            return list(client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=6, stream=True,
                stream_options={"include_usage": True}))

        chunks = await in_thread(call)
        *token_chunks, usage_chunk = chunks
        assert len(token_chunks) == 6
        assert all(chunk.choices[0].finish_reason is None for chunk in token_chunks[:-1])
        assert token_chunks[-1].choices[0].finish_reason == "length"
        assert all(chunk.usage is None for chunk in token_chunks)
        assert usage_chunk.choices == []
        usage = usage_chunk.usage
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (45, 6, 51)
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == expected_cached({"prompt": PROMPT})
        assert len({chunk.id for chunk in chunks}) == 1
        await server.settled()


async def test_B8_continuous_usage_stats_from_in_process_engines() -> None:
    """vLLM's running usage for outputs that carry text, not a worker's choice."""
    async with running() as server:
        client = server.openai()
        chunks = await in_thread(lambda: list(client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, stream=True,
            extra_body={"stream_options": {"include_usage": True,
                                           "continuous_usage_stats": True}})))
        *token_chunks, usage_chunk = chunks
        running_usage = [chunk.usage for chunk in token_chunks]
        assert [(u.prompt_tokens, u.completion_tokens, u.total_tokens)
                for u in running_usage if u is not None] == [(45, n, 45 + n) for n in (1, 2, 3, 4)]
        assert running_usage[-1] == usage_chunk.usage and usage_chunk.choices == []
        await server.settled()


async def test_chat_completion_not_streamed() -> None:
    async with running() as server:
        client = server.openai()
        messages: Any = [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "say something"}]
        chat: ChatCompletion = await in_thread(lambda: client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=5))
        assert chat.object == "chat.completion"
        (choice,) = chat.choices
        assert choice.message.role == "assistant"
        assert choice.message.content
        assert choice.finish_reason == "length"
        assert chat.usage is not None
        assert chat.usage.completion_tokens == 5
        assert server.decode.requests[0].max_tokens == 5


async def test_chat_completion_streamed() -> None:
    async with running() as server:
        client = server.openai()

        def call() -> list[ChatCompletionChunk]:
            return list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi there"}],
                max_tokens=4, stream=True, stream_options={"include_usage": True}))

        *chunks, usage_chunk = await in_thread(call)
        assert len(chunks) == 4
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        assert text
        assert chunks[-1].choices[0].finish_reason == "length"
        assert usage_chunk.usage is not None
        assert usage_chunk.usage.completion_tokens == 4


async def test_sse_framing_is_exact() -> None:
    async with running() as server, server.http() as http:
        response = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "one two three", "max_tokens": 5, "stream": True})
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        # docs/protocols.md section 1: no proxy in front buffers the stream
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        data = events(response.content)
        assert data[-1] == b"[DONE]"
        assert data.count(b"[DONE]") == 1
        chunks = [orjson.loads(item) for item in data[:-1]]
        assert len(chunks) == 5
        for chunk in chunks:
            assert set(chunk) == {"id", "object", "created", "model", "choices"}
            (choice,) = chunk["choices"]
            assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
            assert choice["index"] == 0
            assert choice["logprobs"] is None
        assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None] * 4 + [
            "length"]


async def test_request_id_round_trip_and_session_id() -> None:
    async with running() as server, server.http() as http:
        response = await http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={"X-Request-Id": "client-id-42", "X-Session-Id": "session-7"},
        )
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "client-id-42"
        assert response.json()["id"] == "cmpl-client-id-42"
        # the workers' id: the client's, then one of this router request's own (B8)
        worker_id = server.decode.requests[-1].request_id
        assert worker_id.startswith("client-id-42.") and len(worker_id) > 13
        assert server.prefill.requests[-1].request_id == worker_id
        assert server.decode.requests[-1].routing.session_id == "session-7"

        response = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "user": "alice", "stream": True})
        fresh = response.headers["x-request-id"]
        assert uuid.UUID(fresh).version == 4
        assert server.prefill.requests[-1].request_id.rpartition(".")[0] == fresh
        assert server.decode.requests[-1].request_id.rpartition(".")[0] == fresh
        assert server.decode.requests[-1].routing.session_id == "alice"


def test_a_fresh_request_id_is_a_random_uuid4_in_its_text_form() -> None:
    """The id the router makes for a request that brought none is what
    ``str(uuid.uuid4())`` would be: RFC 4122 version 4, its canonical text, never twice."""
    ids = [fresh_request_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    for made in ids:
        parsed = uuid.UUID(made)
        assert (parsed.version, parsed.variant) == (4, uuid.RFC_4122)
        assert str(parsed) == made


async def test_a_non_ascii_request_id_comes_back_as_the_client_sent_it() -> None:
    """An X-Request-Id in UTF-8 reaches the workers and comes back in the answer's header
    and id with the same bytes (it used to come back encoded twice: ``Ã©`` for ``é``);
    bytes that are not UTF-8 are a 400."""
    sent = "trace-é-✓"
    async with running() as server, server.http() as http:
        response = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={b"X-Request-Id": sent.encode()})
        assert response.status_code == 200, response.text
        assert dict(response.headers.raw)[b"x-request-id"] == sent.encode()
        assert response.json()["id"] == f"cmpl-{sent}"
        assert server.prefill.requests[-1].request_id.rpartition(".")[0] == sent
        assert server.decode.requests[-1].request_id.rpartition(".")[0] == sent

        response = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={b"X-Request-Id": b"latin-1 \xe9"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "X-Request-Id"


async def test_models_health_metrics() -> None:
    async with running() as server, server.http() as http:
        models = (await http.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [model["id"] for model in models["data"]] == [MODEL, "other-model"]
        assert (await http.get(f"/v1/models/{MODEL}")).json() == models["data"][0]
        health = await http.get("/health")
        assert health.status_code == 200
        assert health.json()["status"] == "ok"

        response = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "a b c", "max_tokens": 3, "stream": True})
        assert response.status_code == 200
        await server.settled()
        response = await http.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        samples = metric_samples(response.text)
        assert samples[("trio_disagg_requests_total",
                        (("endpoint", "completions"), ("outcome", "success")))] == 1
        for name in ("time_to_first_token", "prefill_time", "kv_transfer_latency"):
            assert samples[(f"trio_disagg_{name}_seconds_count", ())] == 1
        assert samples[("trio_disagg_inter_token_latency_seconds_count", ())] == 2
        assert samples[("trio_disagg_requests_in_flight", ())] == 0
        assert samples[("trio_disagg_http_requests_in_flight", ())] == 0
        assert samples[("trio_disagg_keeper_drains_in_flight", ())] == 0
        assert samples[("trio_disagg_keeper_drains_started_total", ())] == 1
        assert samples[("trio_disagg_staged_kv_cleanups_total", ())] == 0
        for role in ("prefill", "decode"):
            labels = (("role", role), ("worker", f"{role}-0"))
            assert samples[("trio_disagg_worker_outstanding", labels)] == 0
            assert samples[("trio_disagg_worker_failures_total", labels)] == 0
            assert samples[("trio_disagg_worker_served_total", labels)] == 1
            assert samples[("trio_disagg_worker_healthy", labels)] == 1


async def test_many_concurrent_streams() -> None:
    async with running() as server, server.http() as http:
        bodies: list[bytes] = []

        async def one(i: int) -> None:
            response = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": f"prompt {i}", "max_tokens": 20, "stream": True})
            assert response.status_code == 200
            bodies.append(response.content)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in range(32):
                    nursery.start_soon(one, i)
        for body in bodies:
            data = events(body)
            assert data[-1] == b"[DONE]"
            assert len(data) == 21
        await server.settled()


# --- bad input: a 4xx OpenAI error, and the server keeps serving ---------------------------

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
CHAT_GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class Chunks:
    """A request body sent in ``count`` chunks of ``size`` bytes (chunked encoding)."""

    def __init__(self, count: int, size: int) -> None:
        self.left = count
        self.size = size

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> bytes:
        await trio.lowlevel.checkpoint()
        if not self.left:
            raise StopAsyncIteration
        self.left -= 1
        return b" " * self.size


def _with(base: dict[str, Any], **changes: Any) -> bytes:
    body = dict(base)
    for key, value in changes.items():
        if value is _DROP:
            del body[key]
        else:
            body[key] = value
    return orjson.dumps(body)


_DROP = object()

BAD_INPUTS: list[tuple[str, str, bytes, int, str | None, str | None]] = [
    # (method, path, body, status, param, code)
    ("POST", COMPLETIONS, b'{"model": "mock-model", "prompt": ', 400, None, "invalid_json"),
    ("POST", COMPLETIONS, b"", 400, None, "invalid_json"),
    ("POST", COMPLETIONS, b"[1, 2]", 400, None, "invalid_type"),
    ("POST", COMPLETIONS, b"[" * 3000, 400, None, "invalid_json"),
    ("POST", COMPLETIONS, b"\xff\xfe{}", 400, None, "invalid_json"),
    ("POST", COMPLETIONS, b'{"model": "mock-model", "prompt": "x", "max_tokens": 1e400}', 400,
     None, "invalid_json"),
    ("POST", COMPLETIONS, b'{"model": "mock-model", "prompt": "x", "max_tokens": '
     b"99999999999999999999999}", 400, "max_tokens", "invalid_type"),
    ("POST", COMPLETIONS, _with(GOOD, max_tokens="5"), 400, "max_tokens", "invalid_type"),
    ("POST", COMPLETIONS, _with(GOOD, max_tokens=2.5), 400, "max_tokens", "invalid_type"),
    ("POST", COMPLETIONS, _with(GOOD, max_tokens=True), 400, "max_tokens", "invalid_type"),
    ("POST", COMPLETIONS, _with(GOOD, model=_DROP), 400, "model",
     "missing_required_parameter"),
    ("POST", COMPLETIONS, _with(GOOD, prompt=_DROP), 400, "prompt",
     "missing_required_parameter"),
    ("POST", COMPLETIONS, _with(GOOD, prompt=17), 400, "prompt", "invalid_type"),
    ("POST", COMPLETIONS, _with(GOOD, prompt=["a", "b"]), 400, "prompt", "unsupported_value"),
    ("POST", COMPLETIONS, _with(GOOD, prompt=[[1], [2]]), 400, "prompt", "unsupported_value"),
    ("POST", COMPLETIONS, _with(GOOD, prompt=["a", 2]), 400, "prompt", "invalid_type"),
    ("POST", COMPLETIONS, _with(GOOD, prompt=""), 400, "prompt", "invalid_value"),
    ("POST", COMPLETIONS, _with(GOOD, model="gpt-17"), 404, "model", "model_not_found"),
    ("POST", COMPLETIONS, _with(GOOD, model=None), 400, "model", "invalid_type"),
    ("POST", COMPLETIONS, _with(GOOD, max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("POST", COMPLETIONS, _with(GOOD, max_tokens=-3), 400, "max_tokens", "invalid_value"),
    ("POST", COMPLETIONS, _with(GOOD, max_tokens=10**12), 400, "max_tokens", "invalid_value"),
    ("POST", COMPLETIONS, _with(GOOD, n=2), 400, "n", "unsupported_value"),
    ("POST", COMPLETIONS, _with(GOOD, n=0), 400, "n", "invalid_value"),
    ("POST", COMPLETIONS, _with(GOOD, best_of=3), 400, "best_of", "unsupported_value"),
    ("POST", COMPLETIONS, _with(GOOD, stream="yes"), 400, "stream", "invalid_type"),
    ("POST", COMPLETIONS, _with(GOOD, stream_options={"include_usage": True}), 400,
     "stream_options", "invalid_value"),
    ("POST", COMPLETIONS, _with(GOOD, stream=True, stream_options={"include_usage": 1}), 400,
     "stream_options.include_usage", "invalid_type"),
    ("POST", COMPLETIONS, _with(GOOD, temperature="hot"), 400, "temperature",
     "invalid_type"),
    ("POST", COMPLETIONS, _with(GOOD, temperature=9), 400, "temperature", "invalid_value"),
    ("POST", COMPLETIONS, _with(GOOD, stop=[1]), 400, "stop", "invalid_type"),
    ("POST", COMPLETIONS, _with(GOOD, min_tokens=9), 400, "min_tokens", "invalid_value"),
    ("POST", COMPLETIONS, _with(GOOD, logprobs=-1), 400, "logprobs", "invalid_value"),
    ("POST", COMPLETIONS, _with(GOOD, logprobs=21), 400, "logprobs", "invalid_value"),
    ("POST", COMPLETIONS, _with(GOOD, prompt=[5, -1]), 400, "prompt", "invalid_value"),
    ("POST", COMPLETIONS, _with(GOOD, prompt=[[-7]]), 400, "prompt", "invalid_value"),
    ("POST", CHAT, _with(CHAT_GOOD, messages=_DROP), 400, "messages",
     "missing_required_parameter"),
    ("POST", CHAT, _with(CHAT_GOOD, messages=[]), 400, "messages", "invalid_value"),
    ("POST", CHAT, _with(CHAT_GOOD, messages="hi"), 400, "messages", "invalid_type"),
    ("POST", CHAT, _with(CHAT_GOOD, messages=[{"role": 7, "content": "x"}]), 400,
     "messages[0].role", "invalid_type"),
    ("POST", CHAT, _with(CHAT_GOOD, messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content", "invalid_type"),
    ("POST", CHAT, _with(CHAT_GOOD, messages=[{"content": "x"}]), 400, "messages[0].role",
     "missing_required_parameter"),
    ("POST", CHAT, _with(CHAT_GOOD, max_completion_tokens=100000), 400,
     "max_completion_tokens", "invalid_value"),
    ("POST", CHAT, _with(CHAT_GOOD, model="nope"), 404, "model", "model_not_found"),
    ("POST", CHAT, _with(CHAT_GOOD, tools=5), 400, "tools", "invalid_type"),
    ("POST", CHAT, _with(CHAT_GOOD, tools=[{"type": "x"}]), 400, "tools[0]", "invalid_value"),
    # A tool_choice that forces a call with no tool to call: a prefill would fail once
    # its KV is staged (vLLM's "required"), leaving it to its lease (B8).
    ("POST", CHAT, _with(CHAT_GOOD, tool_choice="required"), 400, "tool_choice",
     "invalid_value"),
    ("POST", CHAT, _with(CHAT_GOOD, tools=[], tool_choice="required"), 400, "tool_choice",
     "invalid_value"),
    ("POST", CHAT, _with(CHAT_GOOD, tool_choice={"type": "function",
                                                 "function": {"name": "f"}}), 400,
     "tool_choice", "invalid_value"),
    ("POST", CHAT, _with(CHAT_GOOD, tool_choice=5), 400, "tool_choice", "invalid_type"),
    ("POST", CHAT, _with(CHAT_GOOD, top_logprobs=2), 400, "top_logprobs", "invalid_value"),
    ("POST", CHAT, _with(CHAT_GOOD, logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "invalid_value"),
    ("GET", "/v1/models/nope", b"", 404, "model", "model_not_found"),
    ("POST", "/v1/embeddings", orjson.dumps(GOOD), 404, None, "unknown_url"),
    ("GET", COMPLETIONS, b"", 405, None, "method_not_allowed"),
    ("POST", "/health", b"", 405, None, "method_not_allowed"),
    ("DELETE", "/v1/models", b"", 405, None, "method_not_allowed"),
]


async def test_bad_input_is_a_4xx_openai_error_and_the_server_keeps_serving() -> None:
    async with running(max_body_bytes=4096) as server, server.http() as http:
        for method, path, body, status, param, code in BAD_INPUTS:
            response = await http.request(method, path, content=body,
                                          headers={"content-type": "application/json"})
            assert response.status_code == status, (path, body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert (error["param"], error["code"]) == (param, code), (body, error)
            assert error["message"]
            assert error["type"] == "invalid_request_error"

        # An oversized body, with a content-length and chunked.
        big = orjson.dumps({**GOOD, "prompt": "x " * 5000})
        json_type = {"content-type": "application/json"}
        response = await http.post(COMPLETIONS, content=big, headers=json_type)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"

        response = await http.post(COMPLETIONS, content=Chunks(10, 1000), headers=json_type)
        assert response.status_code == 413

        too_long = {"X-Request-Id": "r" * 300}
        response = await http.post(COMPLETIONS, json=GOOD, headers=too_long)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "X-Request-Id"
        assert uuid.UUID(response.headers["x-request-id"]).version == 4

        # errors carry the request id too
        response = await http.post(COMPLETIONS, json={**GOOD, "n": 2},
                                   headers={"X-Request-Id": "bad-one"})
        assert response.headers["x-request-id"] == "bad-one"

        # ... and the server still serves, with no 500 anywhere.
        response = await http.post(COMPLETIONS, json=GOOD)
        assert response.status_code == 200
        assert response.json()["choices"][0]["finish_reason"] == "length"
        samples = metric_samples((await http.get("/metrics")).text)
        outcomes = {labels: value for (name, labels), value in samples.items()
                    if name == "trio_disagg_requests_total"}
        assert not any(dict(labels)["outcome"] == "internal_error" for labels in outcomes)
        # only the good request reached the workers
        assert len(server.prefill.requests) == len(server.decode.requests) == 1


async def test_the_openai_client_sees_typed_errors() -> None:
    async with running() as server:
        client = server.openai()
        with pytest.raises(openai.NotFoundError) as not_found:
            await in_thread(lambda: client.completions.create(model="nope", prompt="x"))
        assert not_found.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as bad:
            await in_thread(lambda: client.completions.create(model=MODEL, prompt="x", n=3))
        assert bad.value.param == "n"


# --- worker failures ----------------------------------------------------------------------


WORKER_FAULTS: list[tuple[str, int, str, str | None]] = [
    # (fault, status, error code, a piece of the message)
    ("prefill_reject:429", 429, "prefill_rejected", "refused request"),
    # A worker's 503 is the client's (busy, try again later), like the HTTP engines make
    # it; any other 5xx is a bad gateway.
    ("prefill_reject:503", 503, "worker_unavailable", "refused request"),
    ("prefill_reject:500", 502, "prefill_failed", "refused request"),
    ("prefill_fail_before_handoff", 502, "prefill_failed", "prefill_fail_before_handoff"),
    ("prefill_reset", 502, "prefill_failed", "no output"),
    ("prefill_error_finish", 502, "generation_failed", "prefill_error_finish"),
    ("prefill_cancelled_finish", 502, "cancelled", None),
    ("decode_reject:503", 503, "worker_unavailable", "refused request"),
    ("decode_reject:502", 502, "worker_error", "refused request"),
    ("decode_reject:429", 429, "worker_error", "refused request"),
    # A worker refusing the router's credentials is a bad gateway, never the client's
    # 401/403 (S2).
    ("prefill_reject:401", 502, "prefill_failed", "refused request"),
    ("decode_reject:403", 502, "worker_error", "refused request"),
    ("decode_fail_before_first_token", 502, "generation_failed", "decode_fail_before"),
    ("decode_error_at:3", 502, "generation_failed", "decode_error_at"),
    ("decode_reset_at:3", 502, "incomplete_stream", None),
]


async def test_S2_a_worker_refusing_the_routers_credentials_is_no_401_to_the_client() -> None:
    # A worker started with an API key the router does not send answers 401: passed
    # through, the client's openai SDK would say *its* key is wrong
    # (AuthenticationError) and never retry. It is the fleet's fault: a 502.
    async with running() as server:
        client = server.openai()
        for fault in ("prefill_reject:401", "decode_reject:401", "prefill_reject:403"):
            with pytest.raises(openai.InternalServerError) as failed:
                await in_thread(partial(
                    client.chat.completions.create, model=MODEL,
                    messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                    extra_body={"fault": fault}))
            assert failed.value.status_code == 502
            assert "refused request" in failed.value.message
            await server.settled()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_worker_failures_reach_the_client(stream: bool) -> None:
    async with running() as server, server.http() as http:
        for fault, status, code, text in WORKER_FAULTS:
            response = await http.post(COMPLETIONS, json={
                **GOOD, "max_tokens": 6, "fault": fault, "stream": stream})
            # A stream starts with its first token: a failure before it gets a real status.
            after_first_token = fault.startswith(("decode_error_at", "decode_reset_at"))
            if stream and after_first_token:
                # The stream started: an error event, then exactly one [DONE] (B4).
                assert response.status_code == 200, fault
                data = events(response.content)
                assert data[-1] == b"[DONE]" and data.count(b"[DONE]") == 1, fault
                error = orjson.loads(data[-2])["error"]
                assert all(b"finish_reason" in item for item in data[:-2]), fault
                assert all(orjson.loads(item)["choices"][0]["finish_reason"] is None
                           for item in data[:-2]), fault
            else:
                assert response.status_code == status, (fault, response.text)
                assert response.headers["content-type"] == "application/json"
                error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == code, (fault, error)
            if text is not None:
                assert text in error["message"], (fault, error)
            await server.settled()  # B5 after every fault: no drain, no staged block left
        samples = metric_samples((await http.get("/metrics")).text)
        assert samples[("trio_disagg_staged_kv_cleanups_total", ())] >= 1  # decode_reject
        response = await http.post(COMPLETIONS, json=GOOD)
        assert response.status_code == 200


async def test_eos_on_the_first_token_is_a_terminal_answer() -> None:
    async with running() as server, server.http() as http:
        response = await http.post(COMPLETIONS, json={**GOOD, "fault": "eos_first_token"})
        assert response.status_code == 200
        (choice,) = response.json()["choices"]
        assert choice["finish_reason"] == "stop"
        assert choice["text"]
        assert server.decode.requests == []
        response = await http.post(COMPLETIONS, json={
            **GOOD, "fault": "eos_first_token", "stream": True})
        data = events(response.content)
        assert len(data) == 2
        assert orjson.loads(data[0])["choices"][0]["finish_reason"] == "stop"
        assert data[1] == b"[DONE]"


async def test_a_prefill_deadline_is_a_504() -> None:
    async with running(deadlines=Deadlines(prefill=0.2)) as server, server.http() as http:
        response = await http.post(COMPLETIONS, json={**GOOD, "fault": "prefill_stall"})
        assert response.status_code == 504
        error = response.json()["error"]
        assert error["code"] == "prefill_deadline_exceeded"
        assert error["type"] == "timeout_error"
        assert "prefill deadline of 0.2 s exceeded" in error["message"]
        await server.settled()


def terminal_replaced_by(server: Server, error: BaseException) -> None:
    """Make the router's streams end as the gatekeeper ends them in G5: the success
    terminal replaced by one error item carrying ``error``. Nothing else knows of the
    error (the prefill and the gatekeeper succeeded): the server has only the item."""
    real_stream = server.router.stream

    async def relay(outputs: GatedOutputs | trio.MemoryReceiveChannel[Item],
                    send: trio.MemorySendChannel[Item]) -> None:
        with outputs, send:
            async for item in outputs:
                if item.is_error or (item.data is not None and item.data.finish_reason):
                    await send.send(Annotated[LLMEngineOutput].from_exception(error))
                    return
                await send.send(item)

    async def stream(nursery: trio.Nursery, request: PreprocessedRequest,
                     context: RequestContext) -> RequestStream:
        inner = await real_stream(nursery, request, context)
        send, receive = trio.open_memory_channel[Item](math.inf)
        nursery.start_soon(relay, inner.outputs, send)
        return attrs.evolve(inner, outputs=receive)

    server.router.stream = stream  # type: ignore[method-assign]


LATE_FAILURES: list[tuple[BaseException, int, str]] = [
    (PrefillError("prefill-0: the KV transfer failed after the handoff"), 502,
     "prefill_failed"),
    (PrefillDeadlineExceeded("transfer", 300), 504, "prefill_deadline_exceeded"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("error", "status", "code"), LATE_FAILURES,
                         ids=[type(row[0]).__name__ for row in LATE_FAILURES])
async def test_G5_a_late_prefill_failure_is_answered_from_the_items_exception(
    stream: bool, error: BaseException, status: int, code: str
) -> None:
    """The error item that replaces the held terminal carries the prefill's exception:
    the status and code come from its type, not from the item's text (which would make
    any late failure a 502 ``generation_failed``)."""
    async with running() as server, server.http() as http:
        terminal_replaced_by(server, error)
        response = await http.post(COMPLETIONS, json={**GOOD, "stream": stream})
        if stream:
            # The tokens went first: an error event after them, then one [DONE] (B4).
            assert response.status_code == 200
            data = events(response.content)
            assert data[-1] == b"[DONE]" and data.count(b"[DONE]") == 1
            assert len(data) > 2
            body = orjson.loads(data[-2])
        else:
            assert response.status_code == status, response.text
            body = response.json()
        assert body["error"]["code"] == code
        assert body["error"]["message"] == str(error)
        await server.settled()


async def test_G6_a_prefill_deadline_while_streaming_is_a_504_prefill_deadline_exceeded(
) -> None:
    """Bootstrap style: the decode is accepted and waits in the room while the prefill
    stalls; the prefill deadline fails the stream through the gatekeeper's error item
    (G6), before the first token, so the client gets a real 504."""
    async with (
        running(style=HandoffStyle.BOOTSTRAP, deadlines=Deadlines(prefill=0.2)) as server,
        server.http() as http,
    ):
        response = await http.post(COMPLETIONS, json={
            **GOOD, "fault": "prefill_stall", "stream": True})
        assert response.status_code == 504, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("timeout_error", "prefill_deadline_exceeded")
        assert "prefill deadline of 0.2 s exceeded" in error["message"]
        await server.settled()
        samples = metric_samples((await http.get("/metrics")).text)
        assert samples[("trio_disagg_requests_total",
                        (("endpoint", "completions"), ("outcome", "timeout")))] == 1


class InvalidHandoffPrefill:
    """A prefill engine whose answer failed validation as a handoff (B7): its first output
    is an error item carrying an :class:`InvalidPrefillHandoff`."""

    handoff_style = HandoffStyle.SEQUENTIAL
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None

    def __init__(self, name: str, field: str) -> None:
        self.name = name
        self.field = field

    async def generate(  # noqa: ASYNC114 (accepts at once)
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        with send_channel:
            await send_channel.send(Annotated[LLMEngineOutput].from_exception(
                InvalidPrefillHandoff(f"{self.name}: {self.field} is not an integer",
                                      field=self.field)))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_B7_an_invalid_prefill_handoff_is_a_502_naming_the_field(stream: bool) -> None:
    field = "choices[0].disaggregated_params.ctx_request_id"
    async with running() as server, server.http() as http:
        server.router.prefill.workers[0].engine = InvalidHandoffPrefill("prefill-0", field)
        response = await http.post(COMPLETIONS, json={**GOOD, "stream": stream})
        assert response.status_code == 502, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("upstream_error", "invalid_prefill_handoff")
        assert error["param"] == field
        assert f"{field} is not an integer" in error["message"]
        assert server.decode.requests == []  # no decode request for it (B7)
        await server.settled()


class CrashingPrefill:
    """A broken prefill engine: it raises after it started, which the contract forbids."""

    handoff_style = HandoffStyle.SEQUENTIAL
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None

    def __init__(self, name: str) -> None:
        self.name = name

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Annotated[LLMEngineOutput]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with send_channel:
            task_status.started()
            await trio.lowlevel.checkpoint()
            raise RuntimeError("engine crash")


async def test_T3_a_crashing_prefill_engine_reads_as_one_message() -> None:
    """The openai client sees one 502 that names the crash, not the repr of the
    exception groups it travelled in."""
    async with running() as server:
        server.router.prefill.workers[0].engine = CrashingPrefill("prefill-0")
        client = server.openai()
        with pytest.raises(openai.APIStatusError) as info:
            await in_thread(lambda: client.completions.create(model=MODEL, prompt="x",
                                                              max_tokens=3))
        assert info.value.status_code == 502
        assert info.value.message.endswith("crashed: RuntimeError: engine crash")
        assert "ExceptionGroup" not in info.value.message
        await server.settled()


# --- client disconnects -------------------------------------------------------------------


@pytest.mark.parametrize("hypercorn", [False, True], ids=["own-server", "hypercorn"])
async def test_disconnect_mid_stream_cancels_the_request_nursery(hypercorn: bool) -> None:
    """Regression: a server never cancels the app; the disconnect listener must: the
    project's server calls it back (ON_DISCONNECT), hypercorn sends ``http.disconnect``
    to a listening task."""
    latency = LatencyModel(ttft_per_prompt_token=0.0, inter_token_latency=0.005,
                           kv_transfer_per_token=0.0)
    config = HyperConfig() if hypercorn else None
    async with running(latency=latency, config=config) as server, server.http() as http:
        with trio.fail_after(10):
            async with http.stream("POST", COMPLETIONS, json={
                **GOOD, "max_tokens": 5000, "stream": True}) as response:
                assert response.status_code == 200
                received = 0
                async for _ in response.aiter_raw():
                    received += 1
                    if received == 3:
                        break
            # the response is closed unread: httpx drops the connection
            await server.decode.was_cancelled.wait()
        assert server.prefill.cancelled == 0  # the prefill is the keeper's, never cancelled
        await server.settled()  # in_flight, keeper drains and staged KV all back to 0
        assert server.cluster.counters().served == 1
        samples = metric_samples((await http.get("/metrics")).text)
        assert samples[("trio_disagg_requests_total",
                        (("endpoint", "completions"), ("outcome", "disconnected")))] == 1
        response = await http.post(COMPLETIONS, json=GOOD)
        assert response.status_code == 200


async def test_disconnect_during_prefill_leaves_the_transfer_to_the_keeper() -> None:
    """G9 and B1 through HTTP: the prefill finishes and its staged KV is consumed."""
    latency = LatencyModel(ttft_per_prompt_token=0.005, inter_token_latency=0.0,
                           kv_transfer_per_token=0.0)  # 45 tokens: 0.225 s of prefill
    async with running(latency=latency) as server, server.http() as http:
        async with trio.open_nursery() as client:  # the client leaves once the prefill runs
            client.start_soon(partial(http.post, COMPLETIONS,
                                      json={**GOOD, "prompt": PROMPT, "stream": True}))
            with trio.fail_after(5):
                await server.prefill.saw_request.wait()
            client.cancel_scope.cancel()
        assert server.prefill.requests and not server.decode.requests
        await server.settled()
        assert server.prefill.cancelled == 0
        assert server.router.counters.staged_kv_cleanups == 1
        (cleanup,) = server.decode.requests
        assert cleanup.max_tokens == 1 and not cleanup.stream
        counters = server.cluster.counters()
        assert counters.served == 1 and counters.stranded_blocks == 0


async def test_no_healthy_worker_is_reported_but_still_tried() -> None:
    """Panic routing: with every worker cooling down the router still tries them, and
    /health says the pool is unhealthy."""
    async with running(failure_threshold=1) as server, server.http() as http:
        response = await http.post(COMPLETIONS, json={**GOOD, "fault": "prefill_reject:500"})
        assert response.status_code == 502
        health = await http.get("/health")
        assert health.status_code == 503
        assert health.json()["prefill_workers_healthy"] == 0
        response = await http.post(COMPLETIONS, json=GOOD)
        assert response.status_code == 200  # the success ends the cool-down
        health = await http.get("/health")
        assert health.status_code == 200
        await server.settled()


# --- shutdown -----------------------------------------------------------------------------


async def test_closed_router_answers_503() -> None:
    async with running() as server, server.http() as http:
        server.router.close()
        response = await http.post(COMPLETIONS, json=GOOD)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "router_closed"
        assert response.headers["retry-after"] == "1"  # try again, elsewhere
        health = await http.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "closing"


async def test_graceful_shutdown_finishes_streams_in_flight() -> None:
    """B3: the stream in flight is finished, and from the shutdown's start a new client
    (a request, a readiness probe of /health) has its connection refused, at once, as
    docs/deploy.md tells a load balancer: the router listens no more. (The doc said they
    got 503 ``closing``: only a request on a connection already open can.)"""
    latency = LatencyModel(ttft_per_prompt_token=0.0, inter_token_latency=0.01,
                           kv_transfer_per_token=0.0)
    cluster = mock_cluster(latency=latency)
    async with TransferKeeper(drain_window=5.0) as keeper:
        router = DisaggRouter(WorkerPool(cluster.prefill), WorkerPool(cluster.decode), keeper)
        app = create_app(router, models=[MODEL])
        stop = trio.Event()
        body = b""
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(partial(
                    serve, app, port=0, shutdown_trigger=stop.wait, graceful_timeout=5.0))
                http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}")
                async with http, http.stream("POST", COMPLETIONS, json={
                        **GOOD, "max_tokens": 30, "stream": True}) as response:
                    async for chunk in response.aiter_raw():
                        body += chunk
                        if not stop.is_set():
                            stop.set()  # shut down while the stream is in flight
                            # Probes until the listener is gone (it goes at once).
                            while await _health_status(port) is not None:
                                pass
                            assert router.closing
                            assert router.in_flight == 1  # the stream goes on
            # serve returned: the stream was finished first, and the router is closed
            assert router.in_flight == 0
            data = events(body)
            assert len(data) == 31 and data[-1] == b"[DONE]"
            assert await _health_status(port) is None


async def _health_status(port: int) -> int | None:
    """The status of ``GET /health`` on a new connection; None if it is refused."""
    async with httpx.AsyncClient() as other:
        try:
            return (await other.get(f"http://127.0.0.1:{port}/health")).status_code
        except httpx.ConnectError:
            return None


@pytest.mark.parametrize(("options", "message"), [
    ({"max_connections": 0}, "max_connections must be >= 1, got 0"),
    ({"max_connections": 8, "config": HyperConfig()}, "max_connections needs the project's"),
    ({"reuse_port": True, "config": HyperConfig()}, "reuse_port needs the project's"),
    ({"graceful_timeout": -1.0}, "graceful_timeout must be >= 0 seconds"),
    ({"keep_alive_timeout": 0.0}, "keep_alive_timeout must be > 0 seconds, got 0.0"),
], ids=["no connections", "max with hypercorn", "reuse_port with hypercorn", "negative",
        "no keep-alive"])
async def test_serve_refuses_bad_arguments_before_it_listens(
    options: dict[str, Any], message: str,
) -> None:
    cluster = mock_cluster(latency=LatencyModel.zero())
    async with TransferKeeper() as keeper:
        router = DisaggRouter(WorkerPool(cluster.prefill), WorkerPool(cluster.decode), keeper)
        with pytest.raises(ValueError, match=message):
            await serve(create_app(router, models=[MODEL]), port=0, **options)


async def test_a_signal_shuts_the_server_down() -> None:
    cluster = mock_cluster(latency=LatencyModel.zero())
    async with TransferKeeper(drain_window=1.0) as keeper:
        router = DisaggRouter(WorkerPool(cluster.prefill), WorkerPool(cluster.decode), keeper)
        app = create_app(router, models=[MODEL])
        installed = trio.Event()
        received: list[int] = []

        async def trigger() -> None:
            installed.set()  # wait_for_signals installs its handler before it first blocks
            received.append(await wait_for_signals(signal.SIGUSR1))

        # a guard: a signal that came too early must not kill the test run
        with trio.open_signal_receiver(signal.SIGUSR1), trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(partial(serve, app, port=0, shutdown_trigger=trigger))
                await installed.wait()
                os.kill(os.getpid(), signal.SIGUSR1)
        assert received == [signal.SIGUSR1]
        assert router.closing


# --- a crash in one request never stops the server ------------------------------------------


class CrashesAfterItsAnswer(Watched):
    """A buggy decode engine: once its whole answer is out, it sends an item that is not an
    :class:`Annotated` (or, if the gate already closed the channel, crashes on the send)."""

    async def generate(  # noqa: ASYNC128 (the wrapped engine calls task_status.started())
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Annotated[LLMEngineOutput]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self.requests.append(request)
        inner_send, inner_receive = trio.open_memory_channel[Annotated[LLMEngineOutput]](
            math.inf)
        with send_channel:
            async with trio.open_nursery() as nursery:
                await nursery.start(partial(
                    self.engine.generate, request, context, inner_send))
                task_status.started()
                with inner_receive:
                    async for item in inner_receive:
                        await send_channel.send(item)
                await cast(Any, send_channel).send("not an Annotated item")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_task_crashing_as_the_answer_goes_out_never_stops_the_server(
    stream: bool,
) -> None:
    """Regression: the decode task crashed while ``http.response.start`` was being sent;
    the responder believed the response started, sent a body with no start, and the h11
    ``LocalProtocolError`` escaped into hypercorn and killed the server."""
    async with running(decode_engine=CrashesAfterItsAnswer) as server, server.http() as http:
        with trio.fail_after(20):
            for _ in range(25):
                response = await http.post(COMPLETIONS, json={**GOOD, "stream": stream})
                if response.status_code == 500:  # the crash came first: a real status
                    assert response.json()["error"]["code"] == "internal_error"
                elif stream:
                    assert response.status_code == 200
                    data = events(response.content)
                    assert data[-1] == b"[DONE]" and data.count(b"[DONE]") == 1
                else:
                    assert response.status_code == 200, response.text
                    assert response.json()["choices"][0]["finish_reason"] == "length"
            assert (await http.get("/health")).status_code == 200
        await server.settled()
    # leaving ``running`` returned from serve(): nothing escaped into hypercorn


async def test_an_exception_at_the_app_boundary_is_a_500_or_an_error_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing a handler raises reaches the server: a 500 if nothing was sent, else an
    error event and [DONE] (B4), and the server keeps serving."""

    class Broken:
        def observe(self, value: float) -> None:
            raise RuntimeError("a bug in a metric")

    latency = LatencyModel(ttft_per_prompt_token=0.0, inter_token_latency=0.05,
                           kv_transfer_per_token=0.0)
    async with running(latency=latency) as server, server.http() as http:
        with monkeypatch.context() as patch:
            patch.setattr(server.app.metrics, "render", lambda: 1 / 0)
            response = await http.get("/metrics")
        assert response.status_code == 500
        assert response.json()["error"]["code"] == "internal_error"

        monkeypatch.setattr(server.app.metrics, "itl", Broken())  # raises at the 2nd token
        with trio.fail_after(10):
            response = await http.post(COMPLETIONS, json={**GOOD, "stream": True})
        assert response.status_code == 200
        data = events(response.content)
        assert data[-1] == b"[DONE]" and data.count(b"[DONE]") == 1
        assert orjson.loads(data[-2])["error"]["code"] == "internal_error"
        assert (await http.get("/metrics")).status_code == 200
        await server.settled()


# --- shutdown past the graceful window --------------------------------------------------------


class ArrivalsCounted(Watched):
    """Sets ``second`` when the second request reaches the engine."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.second = trio.Event()

    async def generate(  # noqa: ASYNC128 (the wrapped engine calls task_status.started())
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Annotated[LLMEngineOutput]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        if len(self.requests) == 1:
            self.second.set()
        await super().generate(request, context, send_channel, task_status=task_status)


async def test_shutdown_past_the_window_ends_each_request_cleanly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """B3, B4: requests still running when the graceful window is over are cancelled, each
    with a clean ending (a 503, or an error event then [DONE]), and the count is logged."""
    caplog.set_level(logging.WARNING, logger="trio_disagg.server")
    latency = LatencyModel(ttft_per_prompt_token=0.0, inter_token_latency=0.05,
                           kv_transfer_per_token=0.0)
    long = {**GOOD, "max_tokens": 2000}
    bodies: dict[str, bytes] = {}
    statuses: dict[str, int] = {}
    retry_after: list[str | None] = []
    with trio.fail_after(15):
        async with running(latency=latency, graceful_timeout=0.3,
                           decode_engine=ArrivalsCounted) as server, server.http() as http:
            decode = cast(ArrivalsCounted, server.decode)
            streaming = trio.Event()

            async def streamed() -> None:
                async with http.stream("POST", COMPLETIONS,
                                       json={**long, "stream": True}) as response:
                    statuses["sse"] = response.status_code
                    body = b""
                    async for chunk in response.aiter_raw():
                        body += chunk
                        streaming.set()
                    bodies["sse"] = body

            async def collected() -> None:
                response = await http.post(COMPLETIONS, json=long)
                statuses["json"] = response.status_code
                retry_after.append(response.headers.get("retry-after"))
                bodies["json"] = response.content

            async with trio.open_nursery() as nursery:
                nursery.start_soon(streamed)
                nursery.start_soon(collected)
                await streaming.wait()
                await decode.second.wait()
                server.stop.set()
            await server.settled()

    # Both ended by the app at the end of its window (B4), each with its error, not cut by
    # hypercorn's own (longer) graceful timeout.
    assert statuses == {"sse": 200, "json": 503}
    assert retry_after == ["1"]
    data = events(bodies["sse"])
    assert data[-1] == b"[DONE]" and data.count(b"[DONE]") == 1
    error = orjson.loads(data[-2])["error"]
    assert error["code"] == "server_shutting_down"
    assert error["type"] == "service_unavailable_error"
    assert len(data) > 3  # it streamed tokens before
    assert orjson.loads(data[0])["choices"][0]["finish_reason"] is None
    error = orjson.loads(bodies["json"])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "server_shutting_down"
    messages = [record.getMessage() for record in caplog.records]
    assert "cancelled 2 request(s) still in flight after the 0.3 s window" in messages
