"""End to end, for every protocol (vLLM, SGLang, TensorRT-LLM): the official ``openai``
client (and plain ``httpx``) through the router's HTTP server to the protocol's mock
workers over real sockets: completions and chat, streamed and not, with cached_tokens
from the prefill (S4, S10); errors before the first byte (a real status) and after it (an
error event, then ``[DONE]``); a client disconnect that aborts the decode leg only and
strands no KV (G9, B5).

What only one protocol does end to end stays in its own module (SGLang's late prefill
failure, G5; TensorRT-LLM's terminal context and refusal, S7 and S9; vLLM's ``/stats``).
Everything runs on 127.0.0.1 with port 0 and the real clock; every wait is bounded.
"""

from __future__ import annotations

from typing import Any

import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import orjson
import pytest
from e2e_support import (
    MODEL,
    PROMPT,
    PROMPT_TOKENS,
    PROTOCOLS,
    SLOW_TOKENS,
    ProtocolName,
    expected_cached,
    in_thread,
    served,
    wait_until,
)
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

pytestmark = pytest.mark.parametrize("protocol", PROTOCOLS)


async def test_completions_streamed_and_not(protocol: ProtocolName) -> None:
    async with served(protocol) as server:
        client = server.openai()
        cached = expected_cached({"prompt": PROMPT})  # a new worker: 0
        raw = await in_thread(lambda: client.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=7, extra_headers={"X-Request-Id": "e2e-1"}))
        answer: Completion = raw.parse()
        assert raw.headers["x-request-id"] == "e2e-1"
        assert answer.choices[0].finish_reason == "length" and answer.choices[0].text
        assert answer.usage is not None
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (PROMPT_TOKENS, 7)
        assert answer.usage.prompt_tokens_details is not None
        assert answer.usage.prompt_tokens_details.cached_tokens == cached
        cluster = server.cluster
        worker_id = cluster.decode.seen[-1].request_id  # the client's, then the router's
        assert worker_id.startswith("e2e-1.") and cluster.prefill.seen[-1].request_id == worker_id

        def stream() -> list[Completion]:
            return list(client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=6, stream=True,
                stream_options={"include_usage": True}))

        *chunks, usage_chunk = await in_thread(stream)
        assert "".join(chunk.choices[0].text for chunk in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert usage_chunk.usage is not None and usage_chunk.usage.completion_tokens == 6
        assert usage_chunk.usage.prompt_tokens_details is not None
        # the same prompt again: the prefill worker's prefix cache holds its 2 whole blocks
        warm_hit = expected_cached({"prompt": PROMPT}, warm=True)
        assert (cached, warm_hit) == (0, 32)
        assert usage_chunk.usage.prompt_tokens_details.cached_tokens == warm_hit
        await cluster.settled()


async def test_chat_streamed_and_not(protocol: ProtocolName) -> None:
    async with served(protocol) as server:
        client = server.openai()
        messages: Any = [{"role": "user", "content": PROMPT}]
        chat: ChatCompletion = await in_thread(lambda: client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=5))
        assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
        assert chat.usage is not None and chat.usage.completion_tokens == 5

        def stream() -> list[ChatCompletionChunk]:
            return list(client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, stream=True))

        chunks = await in_thread(stream)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        await server.cluster.settled()


async def test_errors(protocol: ProtocolName) -> None:
    async with served(protocol) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as http:
            rejected = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "fault": "prefill_reject:429"})
            assert rejected.status_code == 429
            assert "refused request" in rejected.json()["error"]["message"]
            assert "retry-after" not in rejected.headers
            # A worker's Retry-After reaches the client (the openai SDK waits that long),
            # bounded to 60 s; a worker's 503 is the client's 503, not a bad gateway.
            rejected = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "fault": "prefill_reject:429:7"})
            assert (rejected.status_code, rejected.headers["retry-after"]) == (429, "7")
            busy = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "fault": "decode_reject:503:3600"})
            assert (busy.status_code, busy.headers["retry-after"]) == (503, "60")
            assert busy.json()["error"]["code"] == "worker_unavailable"
            failed = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "fault": "prefill_reject:500"})
            assert failed.status_code == 502
            before = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "stream": True,
                "fault": "prefill_fail_before_handoff"})
            assert before.status_code == 502  # before the first byte: a real status
            assert "prefill_fail_before_handoff" in before.json()["error"]["message"]
            streamed = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True,
                "fault": "decode_reset_at:2"})
            assert streamed.status_code == 200
            events = streamed.content.split(b"\n\n")
            assert events[-2:] == [b"data: [DONE]", b""]
            error = orjson.loads(events[-3].removeprefix(b"data: "))
            assert server.cluster.decode_url in error["error"]["message"]
            # n > 1 is refused at the edge for every protocol: the server relays one
            # choice per response (docs/router.md), and SGLang needs a bootstrap room
            # per sample besides.
            too_many = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "n": 2})
            assert too_many.status_code == 400
            assert too_many.json()["error"]["param"] == "n"
        await server.cluster.settled()


async def test_client_disconnect_aborts_the_decode_only(protocol: ProtocolName) -> None:
    async with served(protocol, latency=SLOW_TOKENS) as server:
        cluster = server.cluster
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "stream": True}
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=10.0) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # the first token: hang up
        await wait_until(lambda: cluster.decode.stats.aborted == 1)
        await cluster.settled()
        assert cluster.prefill.stats.aborted == 0
        assert cluster.prefill.kv.counters().served == 1
