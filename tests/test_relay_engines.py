"""B8, the faithful relay, on the engine side: the HTTP adapters hand the server each
worker choice as the worker sent it (tool calls, reasoning, logprobs, ``stop_reason``),
the bodies they send invent nothing and never ask a decode about the prompt, and the
mock workers send those fields as the real workers do.

Everything runs on 127.0.0.1 with port 0 (or an in-memory transport) and the real clock;
every wait is bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import orjson
import pytest
import trio
from e2e_support import PROTOCOLS, ProtocolName, cluster_factory
from protocol_support import completion, run, tokens

from trio_disagg import (
    BootstrapInfo,
    FinishReason,
    LLMEngineOutput,
    PrefillResult,
    PreprocessedRequest,
    RequestContext,
)
from trio_disagg._cleanup import _one_token_body
from trio_disagg.engines import (
    LatencyModel,
    SglangEngine,
    TrtllmEngine,
    VllmEngine,
    context_body,
    decode_body,
    generation_body,
    prefill_body,
    sglang_body,
    streaming_body,
)
from trio_disagg.engines._chunks import openai_output
from trio_disagg.workers import Role, create_mock_worker, serve_worker

MODEL = "mock-model"
CHAT = [{"role": "user", "content": "hi"}]

# --- the adapters: each choice as sent -----------------------------------------------------

TOOL_DELTA = {"index": 0, "delta": {"tool_calls": [{
    "index": 0, "id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": ""}}]},
    "logprobs": None, "finish_reason": None}
ARGS_DELTA = {"index": 0, "delta": {"tool_calls": [{
    "index": 0, "function": {"arguments": "{\"city\": "}}]},
    "logprobs": None, "finish_reason": None}
REASONING_DELTA = {"index": 0, "delta": {"reasoning_content": " because"},
                   "logprobs": None, "finish_reason": None}
LOGPROBS_ONLY = {"index": 0, "delta": {}, "logprobs": {"content": [
    {"token": "", "logprob": -0.5, "bytes": [], "top_logprobs": []}]},
    "finish_reason": None}
FINAL_STOP_REASON = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                     "stop_reason": 128009}
FINAL_TOOL_CALLS = {"index": 0, "delta": {}, "logprobs": None,
                    "finish_reason": "tool_calls", "stop_reason": None}
ROLE_ONLY = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}


def chunk(choice: dict[str, Any]) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1,
            "model": MODEL, "choices": [choice]}


@pytest.mark.parametrize("choice", [TOOL_DELTA, ARGS_DELTA, REASONING_DELTA, LOGPROBS_ONLY,
                                    FINAL_STOP_REASON, FINAL_TOOL_CALLS],
                         ids=["tool-call", "tool-args", "reasoning", "logprobs-only",
                              "stop-reason", "finish-tool-calls"])
def test_a_chunk_choice_is_kept_as_sent(choice: dict[str, Any]) -> None:
    sent = orjson.loads(orjson.dumps(choice))
    output = openai_output(chunk(sent), final=False)
    assert output is not None  # carries more than text: never skipped
    assert output.choices == [choice]  # untouched
    assert output.text is None  # the internal text is the content alone, as before


def test_finish_chunks_keep_their_choice_and_the_internal_finish() -> None:
    """The server relays the choice; the gatekeeper still reads the mapped finish."""
    stop = openai_output(chunk(FINAL_STOP_REASON), final=False)
    tools = openai_output(chunk(FINAL_TOOL_CALLS), final=False)
    assert stop is not None and stop.finish_reason == FinishReason.STOP
    assert stop.choices is not None and stop.choices[-1]["stop_reason"] == 128009
    assert tools is not None and tools.finish_reason == FinishReason.STOP
    assert tools.choices is not None and tools.choices[-1]["finish_reason"] == "tool_calls"
    abort = openai_output(chunk({**FINAL_TOOL_CALLS, "finish_reason": "abort"}), final=False)
    assert abort is not None and abort.finish_reason == FinishReason.CANCELLED  # an error
    assert abort.choices is not None
    # a role-only delta and a usage chunk still carry nothing
    assert openai_output(chunk(ROLE_ONLY), final=False) is None
    usage = {**chunk(ROLE_ONLY), "choices": [], "usage": {"prompt_tokens": 1}}
    assert openai_output(usage, final=False) is None


def test_a_whole_answer_keeps_its_choice() -> None:
    choice = {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": "{}"}}]},
        "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}
    answer = {"id": "x", "object": "chat.completion", "choices": [choice],
              "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    output = openai_output(answer, final=True)
    assert output is not None and output.choices == [choice]
    assert output.finish_reason == FinishReason.STOP and output.text is None
    completion = {"id": "y", "object": "text_completion", "choices": [
        {"index": 0, "text": " a", "logprobs": {"tokens": [" a"], "token_logprobs": [-1.0],
                                                "top_logprobs": [{" a": -1.0}],
                                                "text_offset": [0]},
         "finish_reason": "length"}]}
    output = openai_output(completion, final=True)
    assert output is not None and output.text == " a"
    assert output.choices == [completion["choices"][0]]


def sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


async def relay(engine_cls: Any, body: dict[str, Any], content: bytes, **request: Any
                ) -> list[LLMEngineOutput]:
    """The outputs a decode engine makes of a worker's SSE answer ``content``."""
    async def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=content,
                              headers={"content-type": "text/event-stream"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    engine = engine_cls("http://w:1", "decode", client=client)
    req = PreprocessedRequest(request_id="r", model=MODEL, body=body, **request)
    send, receive = trio.open_memory_channel[Any](100)
    with trio.fail_after(5):
        async with client, trio.open_nursery() as nursery:
            await nursery.start(engine.generate, req, RequestContext("r"), send)
            outputs = [item async for item in receive]
    assert all(not item.is_error for item in outputs)
    return [item.data for item in outputs]


@pytest.mark.parametrize("engine_cls", [VllmEngine, TrtllmEngine, SglangEngine])
async def test_adapters_relay_each_choice_as_sent(engine_cls: Any) -> None:
    usage = {**chunk(ROLE_ONLY), "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    content = sse(chunk(ROLE_ONLY), chunk(TOOL_DELTA), chunk(ARGS_DELTA),
                  chunk(REASONING_DELTA), chunk(LOGPROBS_ONLY), chunk(FINAL_STOP_REASON),
                  usage)
    extra: dict[str, Any] = {}
    if engine_cls is SglangEngine:
        extra["bootstrap_info"] = BootstrapInfo(host="h", port=8998, room=5)
    outputs = await relay(engine_cls, {"model": MODEL, "messages": CHAT}, content, **extra)
    assert [c for o in outputs for c in o.choices or []] == [
        TOOL_DELTA, ARGS_DELTA, REASONING_DELTA, LOGPROBS_ONLY, FINAL_STOP_REASON]
    assert outputs[-1].finish_reason is not None
    assert outputs[-1].completion_usage is not None
    assert outputs[-1].completion_usage.completion_tokens == 4


# --- the bodies: nothing invented, nothing about the prompt to a decode ---------------------


def test_min_tokens_capped_at_one_in_prefill_bodies() -> None:
    for sent, capped in ((5, 1), (1, 1), (0, 0)):
        wire = prefill_body({"model": MODEL, "prompt": "x", "max_tokens": 9,
                             "min_tokens": sent})
        assert wire["min_tokens"] == capped and wire["max_tokens"] == 1
    assert "min_tokens" not in prefill_body({"model": MODEL, "prompt": "x"})
    # TRT-LLM's context and SGLang's prefill keep the client's budget, which the
    # client's min_tokens fits: both go as sent
    body = {"model": MODEL, "prompt": "x", "max_tokens": 9, "min_tokens": 5}
    wire = context_body(body, 1)
    assert (wire["min_tokens"], wire["max_tokens"]) == (5, 9)
    info = BootstrapInfo(host="h", port=8998, room=1)
    request = PreprocessedRequest(request_id="r", model=MODEL, body=body, max_tokens=9,
                                  bootstrap_info=info)
    _, wire = sglang_body(request, decode=False)
    assert (wire["min_tokens"], wire["max_tokens"]) == (5, 9)


def decode_bodies(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The decode bodies of every protocol for ``body``, the router's budget 16."""
    result = PrefillResult(disaggregated_params={"ctx_request_id": 1, "remote_host": "h"})
    request = PreprocessedRequest(request_id="r", model=MODEL, body=body, max_tokens=16,
                                  prefill_result=result,
                                  bootstrap_info=BootstrapInfo(host="h", port=1, room=2))
    return [decode_body(request), generation_body(request), sglang_body(request)[1],
            streaming_body(request)]


@pytest.mark.parametrize("body", [{"model": MODEL, "prompt": "a b"},
                                  {"model": MODEL, "messages": CHAT}], ids=["prompt", "chat"])
def test_no_budget_injected_in_decode_bodies(body: dict[str, Any]) -> None:
    for wire in decode_bodies(body):
        assert "max_tokens" not in wire and "max_completion_tokens" not in wire
        assert wire["stream"] is True and wire["stream_options"]["include_usage"] is True
        # the usage once, at the end (TensorRT-LLM's is told so: its default varies)
        assert wire["stream_options"].get("continuous_usage_stats", False) is False
    native = PreprocessedRequest(request_id="r", model=MODEL, max_tokens=16,
                                 body={"text": "a b", "sampling_params": {"top_k": 1}},
                                 bootstrap_info=BootstrapInfo(host="h", port=1, room=2))
    assert sglang_body(native)[1]["sampling_params"] == {"top_k": 1}
    # the client's own budget goes as sent
    for wire in decode_bodies({**body, "max_tokens": 7}):
        assert wire["max_tokens"] == 7 and "max_completion_tokens" not in wire
    # the B1 cleanup decode sets its one token itself, and still gets just that
    minimal = _one_token_body({**body, "min_tokens": 3, "stream": True, "echo": True})
    request = PreprocessedRequest(request_id="r", model=MODEL, body=minimal, max_tokens=1,
                                  prefill_result=PrefillResult(disaggregated_params={}))
    wire = decode_body(request)
    assert wire["max_tokens"] == 1 and "min_tokens" not in wire and "echo" not in wire
    assert "max_completion_tokens" not in wire


@pytest.mark.parametrize("body", [
    {"model": MODEL, "prompt": "a b", "echo": True, "logprobs": 2},
    {"model": MODEL, "prompt": "a b", "prompt_logprobs": 1, "echo": False},
    {"model": MODEL, "messages": CHAT, "prompt_logprobs": 0, "logprobs": True}],
    ids=["echo", "prompt_logprobs", "chat"])
def test_prompt_fields_never_reach_a_decode(body: dict[str, Any]) -> None:
    for wire in decode_bodies(body):
        assert "echo" not in wire and "prompt_logprobs" not in wire
        assert wire.get("logprobs") == body.get("logprobs")  # about the answer: kept
    assert "echo" in body or "prompt_logprobs" in body  # the client's body is untouched


# --- the mock workers send the fields -------------------------------------------------------

PROTOCOL_NAMES = list(PROTOCOLS)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}},
         {"type": "function", "function": {"name": "other", "parameters": {}}}]


@asynccontextmanager
async def worker(protocol: str, role: Role = "decode") -> AsyncIterator[str]:
    """A mock ``protocol`` worker served on a free port (an SGLang prefill's bootstrap
    port too, not SGLang's 8998, which another process may hold), no latency; its URL."""
    app = create_mock_worker(role, protocol, fault_injection=True, latency=LatencyModel.zero(),
                             bootstrap_port=0 if (protocol, role) == ("sglang", "prefill")
                             else None)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_worker, app))
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


async def ask(url: str, body: dict[str, Any], rid: str = "rq") -> Any:
    """The worker's answer: its chunks (streamed, without ``[DONE]``) or its JSON."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with trio.fail_after(10):
        async with httpx.AsyncClient() as client:
            response = await client.post(url + path, json={"model": MODEL, **body},
                                         headers={"x-request-id": rid})
    assert response.status_code == 200, response.text
    if body.get("stream") is not True:
        return response.json()
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [orjson.loads(event) for event in events[:-1]]


def choices(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [chunk["choices"][0] for chunk in chunks if chunk["choices"]]


@pytest.mark.parametrize("protocol", PROTOCOL_NAMES)
async def test_mock_decode_streams_one_tool_call(protocol: str) -> None:
    async with worker(protocol) as url:
        body = {"messages": CHAT, "tools": TOOLS, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}
        chunks = await ask(url, body, "tc-1")
        answer = await ask(url, {**body, "stream": False}, "tc-1")
        plain = await ask(url, {**body, "tool_choice": "none", "stream": False}, "tc-1")
    sent = choices(chunks)
    assert sent[0]["delta"] == {"role": "assistant", "content": ""}
    assert sent[1]["delta"] == {"tool_calls": [{
        "index": 0, "id": "call_tc-1", "type": "function",
        "function": {"name": "get_weather", "arguments": ""}}]}
    fragments = sent[2:]
    assert len(fragments) == 4  # one per token
    assert all(set(c["delta"]) == {"tool_calls"} for c in sent[1:])  # no content
    assert all(c["delta"]["tool_calls"][0]["index"] == 0 for c in fragments)
    arguments = "".join(c["delta"]["tool_calls"][0]["function"]["arguments"]
                        for c in fragments)
    words = orjson.loads(arguments)
    assert list(words) == ["arg0", "arg1", "arg2", "arg3"]
    assert all(isinstance(w, str) and w for w in words.values())
    assert [c["finish_reason"] for c in sent[1:]] == [None] * 4 + ["tool_calls"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    # answered whole: the same call, complete
    (choice,) = answer["choices"]
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{
        "id": "call_tc-1", "type": "function",
        "function": {"name": "get_weather", "arguments": arguments}}]
    assert choice["finish_reason"] == "tool_calls"
    # tool_choice "none": plain content, as before, and no call: the worker's empty value
    # (vLLM's and TensorRT-LLM's [], SGLang's null)
    message = plain["choices"][0]["message"]
    assert message["tool_calls"] == (None if protocol == "sglang" else [])
    assert message["content"].split() == list(words.values())
    assert plain["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("protocol", PROTOCOL_NAMES)
async def test_mock_chat_logprobs(protocol: str) -> None:
    async with worker(protocol) as url:
        body = {"messages": CHAT, "logprobs": True, "top_logprobs": 2, "max_tokens": 3,
                "stream": True}
        chunks = await ask(url, body, "lp-1")
        again = await ask(url, body, "lp-1")
        answer = await ask(url, {**body, "stream": False}, "lp-1")
    assert choices(chunks) == choices(again)  # fixed by the seed and the request id
    tokens = choices(chunks)[1:]
    assert len(tokens) == 3
    entries = []
    for choice in tokens:
        (entry,) = choice["logprobs"]["content"]
        assert entry["token"] == choice["delta"]["content"]
        assert entry["bytes"] == list(entry["token"].encode())
        assert isinstance(entry["logprob"], float) and entry["logprob"] < 0
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert set(entry["top_logprobs"][1]) == {"token", "logprob", "bytes"}
        entries.append(entry)
    assert answer["choices"][0]["logprobs"] == {"content": entries}
    assert answer["choices"][0]["message"]["content"] == "".join(e["token"] for e in entries)


@pytest.mark.parametrize("protocol", PROTOCOL_NAMES)
async def test_mock_completion_logprobs(protocol: str) -> None:
    async with worker(protocol) as url:
        body = {"prompt": "a b c", "logprobs": 3, "max_tokens": 3, "stream": True}
        chunks = await ask(url, body, "lp-2")
        answer = await ask(url, {**body, "stream": False}, "lp-2")
    offset = 0
    whole: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                   "text_offset": []}
    for choice in choices(chunks):
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [choice["text"]]
        assert logprobs["text_offset"] == [offset]
        (top,) = logprobs["top_logprobs"]
        assert len(top) == 3 and top[choice["text"]] == logprobs["token_logprobs"][0]
        offset += len(choice["text"])
        for key, value in logprobs.items():
            whole[key] += value
    assert len(whole["tokens"]) == 3
    assert answer["choices"][0]["logprobs"] == whole


@pytest.mark.parametrize("protocol", PROTOCOL_NAMES)
async def test_mock_reasoning_tokens(protocol: str) -> None:
    async with worker(protocol) as url:
        body = {"messages": CHAT, "mock_reasoning_tokens": 2, "max_tokens": 5,
                "stream": True}
        chunks = await ask(url, body, "rs-1")
        answer = await ask(url, {**body, "stream": False}, "rs-1")
        with_tools = await ask(url, {**body, "tools": TOOLS}, "rs-1")
    deltas = [c["delta"] for c in choices(chunks)[1:]]
    assert [set(d) for d in deltas] == [{"reasoning_content"}] * 2 + [{"content"}] * 3
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == "".join(d["reasoning_content"] for d in deltas[:2])
    assert message["content"] == "".join(d["content"] for d in deltas[2:])
    # reasoning first, then the tool call with the rest
    deltas = [c["delta"] for c in choices(with_tools)[1:]]
    assert [set(d) for d in deltas] == [{"reasoning_content"}] * 2 + [{"tool_calls"}] * 4
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[2:])
    assert list(orjson.loads(arguments)) == ["arg0", "arg1", "arg2"]


@pytest.mark.parametrize("protocol", PROTOCOL_NAMES)
async def test_mock_decode_answer_faults(protocol: str) -> None:
    body = {"messages": CHAT, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    async with worker(protocol) as url:
        filtered = await ask(url, {**body, "fault": "decode_finish:content_filter"})
        stopped = await ask(url, {**body, "fault": ["decode_stop_reason:128009",
                                                    "decode_no_usage"]})
        named = await ask(url, {**body, "stream": False,
                                "fault": 'decode_stop_reason:"</s>",decode_error_at:9'})
        async with worker(protocol, "prefill") as prefill_url:
            if protocol == "vllm":  # a prefill ignores them
                prefill = await ask(prefill_url, {
                    **body, "stream": False, "fault": "decode_finish:content_filter",
                    "kv_transfer_params": {"do_remote_decode": True}})
                assert prefill["choices"][0]["finish_reason"] == "length"
        async with httpx.AsyncClient() as client:
            bad = await client.post(url + "/v1/chat/completions", json={
                "model": MODEL, **body, "fault": "decode_finish"})
    assert bad.status_code == 400 and "decode_finish" in bad.text
    assert [c["finish_reason"] for c in choices(filtered)] == [None] * 3 + ["content_filter"]
    assert "usage" in filtered[-1]
    final = choices(stopped)[-1]
    assert final["finish_reason"] == "length" and final["stop_reason"] == 128009
    assert all(c["stop_reason"] is None for c in choices(stopped)[1:-1])
    assert all(not c.get("usage") for c in stopped)  # no usage chunk
    assert named["choices"][0]["stop_reason"] == "</s>"


@pytest.mark.parametrize("protocol", PROTOCOL_NAMES)
async def test_mock_min_tokens_holds_off_eos(protocol: str) -> None:
    body = {"prompt": "a b c", "max_tokens": 16, "fault": "eos_first_token",
            "stream": True}
    async with worker(protocol) as url:
        first = await ask(url, body, "mt-1")
        held = await ask(url, {**body, "min_tokens": 10}, "mt-1")
        budget = await ask(url, {**body, "min_tokens": 10, "max_tokens": 6}, "mt-1")
    assert [c["finish_reason"] for c in choices(first)] == ["stop"]
    assert [c["finish_reason"] for c in choices(held)] == [None] * 10 + ["stop"]
    assert [c["finish_reason"] for c in choices(budget)] == [None] * 5 + ["length"]


@pytest.mark.parametrize("protocol", ["vllm", "trtllm"])
async def test_a_prefill_given_min_tokens_does_not_end_on_eos(protocol: str) -> None:
    """A sequential prefill with min_tokens 1 hands off instead of ending the request."""
    body: dict[str, Any] = {"prompt": "a b c", "max_tokens": 1, "fault": "eos_first_token"}
    if protocol == "vllm":
        body["kv_transfer_params"] = {"do_remote_decode": True}
    else:
        body["disaggregated_params"] = {"request_type": "context_only"}
    async with worker(protocol, "prefill") as url:
        terminal = await ask(url, body, "mp-1")
        handoff = await ask(url, {**body, "min_tokens": 1}, "mp-2")
    assert terminal["choices"][0]["finish_reason"] == "stop"
    assert handoff["choices"][0]["finish_reason"] == "length"
    if protocol == "vllm":
        assert terminal["kv_transfer_params"] is None
        assert handoff["kv_transfer_params"]["do_remote_prefill"] is True
    else:
        assert type(handoff["choices"][0]["disaggregated_params"]["ctx_request_id"]) is int


@pytest.mark.parametrize("protocol", PROTOCOL_NAMES)
async def test_through_the_router_min_tokens_and_choices(protocol: ProtocolName) -> None:
    """End to end on the engine side: a client min_tokens keeps EOS from making the
    prefill terminal, and the decode's tool call reaches the router's outputs as sent."""
    async with cluster_factory(protocol)() as cluster:
        request = completion("rt-eos", max_tokens=6, min_tokens=2, fault="eos_first_token")
        _, items = await run(cluster, request)
        assert not any(item.is_error for item in items)
        assert len(tokens(items)) >= 2  # not ended on the prefill's token
        body = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "max_tokens": 3}
        chat = PreprocessedRequest(request_id="rt-tool", model=MODEL, body=body,
                                   max_tokens=3)
        _, items = await run(cluster, chat)
        await cluster.settled()
    outputs = [item.data for item in items if item.data is not None]
    assert all(o.choices for o in outputs)
    sent = [c for o in outputs for c in o.choices or []]
    assert sent[0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert sent[-1]["finish_reason"] == "tool_calls"
    assert outputs[-1].finish_reason == FinishReason.STOP
    arguments = "".join(c["delta"]["tool_calls"][0]["function"]["arguments"]
                        for c in sent[1:])
    assert list(orjson.loads(arguments)) == ["arg0", "arg1", "arg2"]
