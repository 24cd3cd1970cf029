"""B8, the faithful relay, on the engine side: the HTTP adapters hand the server each
worker choice as the worker sent it (tool calls, reasoning, logprobs, ``stop_reason``),
the bodies they send invent nothing and never ask a decode about the prompt, and the
mock workers send those fields as the real workers do.

Everything runs on 127.0.0.1 with port 0 (or an in-memory transport) and the real clock;
every wait is bounded.
"""

from __future__ import annotations

from typing import Any

import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import orjson
import pytest
import trio

from trio_disagg import (
    BootstrapInfo,
    FinishReason,
    LLMEngineOutput,
    PrefillResult,
    PreprocessedRequest,
    RequestContext,
)
from trio_disagg._router import _one_token_body
from trio_disagg.engines import (
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
from trio_disagg.engines._http import openai_output

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
    assert output.choice is not None and output.choice == choice  # untouched
    assert output.text is None  # the internal text is the content alone, as before


def test_finish_chunks_keep_their_choice_and_the_internal_finish() -> None:
    """The server relays the choice; the gatekeeper still reads the mapped finish."""
    stop = openai_output(chunk(FINAL_STOP_REASON), final=False)
    tools = openai_output(chunk(FINAL_TOOL_CALLS), final=False)
    assert stop is not None and stop.finish_reason == FinishReason.STOP
    assert stop.choice is not None and stop.choice["stop_reason"] == 128009
    assert tools is not None and tools.finish_reason == FinishReason.STOP
    assert tools.choice is not None and tools.choice["finish_reason"] == "tool_calls"
    abort = openai_output(chunk({**FINAL_TOOL_CALLS, "finish_reason": "abort"}), final=False)
    assert abort is not None and abort.finish_reason == FinishReason.CANCELLED  # an error
    assert abort.choice is not None
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
    assert output is not None and output.choice == choice
    assert output.finish_reason == FinishReason.STOP and output.text is None
    completion = {"id": "y", "object": "text_completion", "choices": [
        {"index": 0, "text": " a", "logprobs": {"tokens": [" a"], "token_logprobs": [-1.0],
                                                "top_logprobs": [{" a": -1.0}],
                                                "text_offset": [0]},
         "finish_reason": "length"}]}
    output = openai_output(completion, final=True)
    assert output is not None and output.text == " a"
    assert output.choice == completion["choices"][0]


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
    assert [o.choice for o in outputs] == [TOOL_DELTA, ARGS_DELTA, REASONING_DELTA,
                                           LOGPROBS_ONLY, FINAL_STOP_REASON]
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
        assert wire["stream"] is True and wire["stream_options"] == {"include_usage": True}
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
