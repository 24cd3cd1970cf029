"""B8, differentially: the router is transparent to an app pointed at it instead of at its
decode worker.

Each request goes (a) through the router and (b) straight to the decode worker that
served it (the same ``X-Request-Id``, so the mock decodes the same tokens), with raw
``httpx`` and the official ``openai`` client. What the client sees must be the same once
the fields the router owns (docs/router.md, "What the router relays, and what it owns")
are set aside: the envelope around the choices (``id``, ``object``, ``created``,
``model``, the other top-level fields), ``usage``'s cached tokens, the stream's first
``delta.role`` and the worker's role-only first chunk, which the router folds into it. A
delta's null field counts as absent, as it does to an OpenAI client.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import openai
import orjson
import pytest
from e2e_support import MODEL, PROTOCOLS, ProtocolName, Served, in_thread, served

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather like in Paris?"}]
TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}
_serial = itertools.count()

#: What real apps send, beyond the plain request: each body is sent streamed and not.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat", CHAT, {"messages": MESSAGES, "max_tokens": 5}),
    ("completion", COMPLETIONS, {"prompt": "Once upon a time", "max_tokens": 5}),
    ("max_completion_tokens", CHAT, {"messages": MESSAGES, "max_completion_tokens": 3}),
    ("no budget", CHAT, {"messages": MESSAGES}),
    ("max_tokens 1", CHAT, {"messages": MESSAGES, "max_tokens": 1}),
    ("stop and sampling", CHAT, {
        "messages": MESSAGES, "max_tokens": 4, "stop": ["\n", "END"], "seed": 7,
        "temperature": 0.3, "top_p": 0.9, "presence_penalty": 0.5, "logit_bias": {"50": -100},
        "user": "u-1", "n": 1}),
    ("stop string", COMPLETIONS, {"prompt": "a", "max_tokens": 3, "stop": "."}),
    ("explicit nulls", CHAT, {"messages": MESSAGES, "max_tokens": 3, **dict.fromkeys([
        "stop", "temperature", "top_p", "seed", "user", "response_format", "tools",
        "tool_choice", "logprobs", "top_logprobs", "logit_bias", "n"])}),
    ("chat logprobs", CHAT, {"messages": MESSAGES, "max_tokens": 3, "logprobs": True,
                             "top_logprobs": 2}),
    ("completion logprobs", COMPLETIONS, {"prompt": "x", "max_tokens": 3, "logprobs": 2}),
    ("json_object", CHAT, {"messages": MESSAGES, "max_tokens": 3,
                           "response_format": {"type": "json_object"}}),
    ("json_schema", CHAT, {"messages": MESSAGES, "max_tokens": 3, "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}}),
    ("tools auto", CHAT, {"messages": MESSAGES, "max_tokens": 3, "tools": [TOOL],
                          "tool_choice": "auto", "parallel_tool_calls": False}),
    ("tools none", CHAT, {"messages": MESSAGES, "max_tokens": 3, "tools": [TOOL],
                          "tool_choice": "none"}),
    ("tools required", CHAT, {"messages": MESSAGES, "max_tokens": 3, "tools": [TOOL],
                              "tool_choice": "required"}),
    ("tools named", CHAT, {"messages": MESSAGES, "max_tokens": 3, "tools": [TOOL],
                           "tool_choice": {"type": "function",
                                           "function": {"name": "get_weather"}}}),
    ("vLLM extras", CHAT, {
        "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "min_tokens": 2,
        "skip_special_tokens": False, "priority": 0, "guided_json": {"type": "object"},
        "structured_outputs": {"json": {"type": "object"}}, "return_token_ids": True}),
    ("SGLang extras", CHAT, {
        "messages": MESSAGES, "max_tokens": 3, "top_k": 5, "min_p": 0.1,
        "repetition_penalty": 1.1, "separate_reasoning": True, "no_stop_trim": True,
        "regex": "[a-z ]+", "chat_template_kwargs": {"enable_thinking": False}}),
    ("reasoning", CHAT, {"messages": MESSAGES, "max_tokens": 4,
                         "mock_reasoning_tokens": 2}),
    ("empty content", CHAT, {"messages": [{"role": "user", "content": ""}],
                             "max_tokens": 2}),
    ("content parts", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Look:"}, {"type": "text", "text": "héllo 👋🏽 世界"}]}],
        "max_tokens": 2}),
    ("a conversation", CHAT, {"max_tokens": 2, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}),
    # a role of the model's chat template (Llama 3's ipython): vLLM and TensorRT-LLM take
    # any role, and a worker that does not refuses it itself
    ("a template's own role", CHAT, {"max_tokens": 2, "messages": [
        *MESSAGES, {"role": "ipython", "content": '{"temperature": 21}'}]}),
    ("long prompt", COMPLETIONS, {"prompt": "word " * 4000, "max_tokens": 2}),
    ("token ids", COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 2}),
]


# --- the two answers, and what a client sees of them ------------------------------------


def events(response: httpx.Response) -> list[Any]:
    """A stream's events, parsed (``"[DONE]"`` kept as the string)."""
    data = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    return [item if item == "[DONE]" else orjson.loads(item) for item in data]


def seen_as(response: httpx.Response, stream: bool) -> Any:
    """What a client sees of an answer, the router's own fields set aside."""
    if response.status_code != 200:
        return response.status_code, response.json()
    if not stream:
        answer = response.json()
        return 200, answer["choices"], _counts(answer["usage"])
    seen: list[Any] = []
    for event in events(response):
        if not isinstance(event, dict) or "choices" not in event:
            seen.append(event)  # [DONE], an error event
        elif not event["choices"]:
            seen.append(("usage", _counts(event["usage"])))
        else:
            seen.extend(_choice(choice) for choice in event["choices"])
    return 200, [choice for choice in seen if choice is not None]


def _counts(usage: dict[str, Any]) -> tuple[int, int, int]:
    # cached_tokens is the prefill's (owned): the decode's own says nothing of the prompt
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def _choice(choice: dict[str, Any]) -> dict[str, Any] | None:
    delta = choice.get("delta")
    if delta is None:
        return choice
    # a null field is an absent one to an OpenAI client (the prefill's whole answer as a
    # delta has the message's null content, S7)
    delta = {key: value for key, value in delta.items() if key != "role" and value is not None}
    if (delta in ({}, {"content": ""}) and choice.get("finish_reason") is None
            and choice.get("logprobs") is None):
        return None  # a role-only chunk: the router sets the role on the first delta
    return {**choice, "delta": delta}


async def both(server: Served, client: httpx.AsyncClient, path: str, body: dict[str, Any],
               ) -> tuple[httpx.Response, httpx.Response]:
    """``body`` through the router, then straight to the worker that served it."""
    rid = f"transparent-{next(_serial)}"
    routed = await client.post(server.url + path, json=body, headers={"x-request-id": rid})
    await server.cluster.settled()  # the worker's own id is free again
    workers = (server.cluster.decode, server.cluster.prefill)  # a terminal prefill: the
    ids = [seen.request_id for worker in workers for seen in worker.seen  # prefill's
           if seen.request_id.startswith(rid + ".")
           and not seen.request_id.endswith("-cleanup")]
    direct = await client.post(server.cluster.decode_url + path, json=body,
                               headers={"x-request-id": ids[0] if ids else rid})
    return routed, direct


async def differences(server: Served, cases: list[tuple[str, str, dict[str, Any]]]
                      ) -> list[str]:
    found: list[str] = []
    async with httpx.AsyncClient(timeout=20.0, trust_env=False) as client:
        for (name, path, fields), stream in itertools.product(cases, (False, True)):
            body = {"model": MODEL, **fields, "stream": stream}
            if stream and (path == CHAT or name.startswith("completion")):
                body["stream_options"] = {"include_usage": True}
            routed, direct = await both(server, client, path, body)
            if seen_as(routed, stream) != seen_as(direct, stream):
                found.append(f"{name} (stream={stream}):\n  router: {routed.text[:600]}"
                             f"\n  direct: {direct.text[:600]}")
            if stream and routed.status_code == 200 and path == CHAT:
                first = next(e for e in events(routed) if isinstance(e, dict))
                assert first["choices"][0]["delta"]["role"] == "assistant", name
    return found


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_B8_what_an_app_sends_gets_what_the_worker_would_answer(
        protocol: ProtocolName) -> None:
    """Every case, streamed and not, through the router and straight to the decode worker:
    the same choices (content, tool calls, reasoning, logprobs, token ids, finish and stop
    reasons), the same token counts, the same usage chunk."""
    async with served(protocol) as server:
        found = await differences(server, CASES)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("protocol", ["vllm", "trtllm"])
async def test_B8_a_request_served_by_a_decode_worker_alone_is_relayed_alike(
        protocol: ProtocolName) -> None:
    """Conditional disaggregation (``--disagg-min-prompt-tokens``): a request served by
    the decode worker alone, with no prefill, gets what that worker answers too."""
    async with served(protocol) as server:
        server.app.router.disagg_min_prompt_tokens = 1 << 30  # every prompt is short
        found = await differences(server, CASES)
        assert server.cluster.prefill.stats.requests == 0
    assert not found, "\n".join(found)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_B8_a_whole_answer_from_the_prefill_is_the_workers_too(
        protocol: ProtocolName) -> None:
    """EOS on the first token: the prefill's own answer is the client's (S7), streamed to a
    client that asked for a stream; the same as the worker answers it on its own."""
    eos = [(name, path, {**fields, "fault": "eos_first_token"}) for name, path, fields in (
        ("chat", CHAT, {"messages": MESSAGES, "max_tokens": 3}),
        ("completion", COMPLETIONS, {"prompt": "x", "max_tokens": 3, "logprobs": 1}),
        ("logprobs", CHAT, {"messages": MESSAGES, "max_tokens": 3, "logprobs": True}),
        ("reasoning", CHAT, {"messages": MESSAGES, "max_tokens": 3,
                             "mock_reasoning_tokens": 1}))]
    async with served(protocol) as server:
        found = await differences(server, eos)
    assert not found, "\n".join(found)


# --- the openai client ------------------------------------------------------------------


def _clients(server: Served) -> tuple[openai.OpenAI, openai.OpenAI]:
    return server.openai(), openai.OpenAI(
        base_url=server.cluster.decode_url + "/v1", api_key="unused", max_retries=0,
        timeout=20.0)


def _stream_helper(client: openai.OpenAI, rid: str) -> tuple[str, str | None, list[str]]:
    """The ``openai`` stream helper's final completion and its content events."""
    with client.chat.completions.stream(
            model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"x-request-id": rid},
            extra_body={"fault": "decode_finish:stop"}) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    message = final.choices[0].message
    return message.content or "", final.choices[0].finish_reason, [d for d in deltas if d]


async def test_B8_the_openai_stream_helper_assembles_the_same_completion() -> None:
    async with served("vllm") as server:
        router, direct = _clients(server)
        routed = await in_thread(lambda: _stream_helper(router, "helper-1"))
        await server.cluster.settled()
        rid = server.cluster.decode.seen[-1].request_id
        alone = await in_thread(lambda: _stream_helper(direct, rid))
    assert routed == alone and routed[0] == "".join(routed[2])


async def _openai_error(call: Callable[[], Any]) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        await in_thread(call)
    return caught.value


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_B8_a_worker_refusal_reaches_the_openai_client_as_the_worker_sent_it(
        protocol: ProtocolName) -> None:
    """A parameter the worker refuses: its status and message, not a 502 or a 500."""
    async with served(protocol) as server:
        router, direct = _clients(server)
        bad: dict[str, Any] = {"mock_reasoning_tokens": -1}
        for client in (router, direct):
            error = await _openai_error(partial(
                client.chat.completions.create, model=MODEL, messages=MESSAGES,
                max_tokens=2, extra_body=bad))
            assert isinstance(error, openai.BadRequestError)
            assert "'mock_reasoning_tokens' must be a non-negative integer" in error.message
        error = await _openai_error(lambda: router.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2,
            extra_body={"fault": "decode_reject:422"}))
        assert isinstance(error, openai.UnprocessableEntityError)
        await server.cluster.settled()


async def test_B8_what_would_be_several_choices_is_refused_alike_before_any_worker() -> None:
    """``n`` > 1, ``best_of`` > 1 and a batch of prompts would each be several choices
    from the worker: the router refuses them alike (one choice per response), a 400
    ``unsupported_value`` naming the field, and no worker hears of them."""
    async with served("vllm") as server:
        client = server.openai()
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("n", partial(client.chat.completions.create, model=MODEL, messages=MESSAGES,
                          max_tokens=2, n=2)),
            ("best_of", partial(client.completions.create, model=MODEL, prompt="a",
                                max_tokens=2, best_of=2)),
            ("prompt", partial(client.completions.create, model=MODEL, prompt=["a", "b"],
                               max_tokens=2)),
            ("prompt", partial(client.completions.create, model=MODEL,
                               prompt=[[1, 2], [3]], max_tokens=2))]
        for param, call in calls:
            error = await _openai_error(call)
            assert isinstance(error, openai.BadRequestError), param
            assert (error.param, error.code) == (param, "unsupported_value"), error.body
        assert server.cluster.prefill.stats.requests == 0
        assert server.cluster.decode.stats.requests == 0


async def test_B8_the_openai_client_retries_a_bad_gateway_and_gives_up_as_usual() -> None:
    """A worker's 5xx is the router's 502: the client's own retries run as against the
    worker (``max_retries`` + 1 attempts), then it raises ``InternalServerError``."""
    async with served("vllm") as server:
        client = server.openai().with_options(max_retries=2)
        before = server.cluster.prefill.stats.requests
        error = await _openai_error(lambda: client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2,
            extra_body={"fault": "prefill_reject:500"}))
        assert isinstance(error, openai.InternalServerError) and error.status_code == 502
        assert "answered 500" in error.message
        assert server.cluster.prefill.stats.requests - before == 3
        await server.cluster.settled()


async def test_B8_with_raw_response_shows_the_request_id_the_answer_carries() -> None:
    async with served("vllm") as server:
        client = server.openai()
        raw = await in_thread(lambda: client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=2,
            extra_headers={"x-request-id": "raw-1"}))
        answer = raw.parse()
        assert raw.headers["x-request-id"] == raw.request_id == answer._request_id == "raw-1"
        assert answer.id == "chatcmpl-raw-1" and answer.model == MODEL
        await server.cluster.settled()


def _close_after(client: openai.OpenAI, chunks: int) -> int:
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=500,
                                            stream=True)
    read = 0
    for _ in stream:
        read += 1
        if read == chunks:
            break
    stream.close()
    return read


async def test_B8_an_app_that_closes_a_stream_early_ends_the_workers_request() -> None:
    async with served("vllm") as server:
        aborted = server.cluster.decode.stats.aborted
        assert await in_thread(lambda: _close_after(server.openai(), 2)) == 2
        await server.cluster.settled()  # nothing left running, no KV held (B5)
        assert server.cluster.decode.stats.aborted == aborted + 1


async def test_B8_an_openai_timeout_ends_the_workers_request() -> None:
    async with served("vllm") as server:
        client = server.openai().with_options(timeout=0.3, max_retries=0)
        with pytest.raises(openai.APITimeoutError):
            await in_thread(lambda: client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=500,
                extra_body={"fault": "decode_stall"}))
        await server.cluster.settled()
        assert server.cluster.decode.stats.running == 0


@pytest.mark.parametrize(("protocol", "no_calls"), [("vllm", []), ("sglang", None),
                                                    ("trtllm", [])])
async def test_B8_a_whole_chat_answer_without_tool_calls_has_the_workers_empty_value(
        protocol: ProtocolName, no_calls: list[Any] | None) -> None:
    """vLLM's and TensorRT-LLM's whole chat answer carry ``tool_calls: []`` when no tool
    was called (SGLang's a null): an app that iterates ``message.tool_calls`` works
    against the router as against the worker. The router's answer is collected from a
    stream that never says so: the adapter knows it (``whole_message``)."""
    async with served(protocol) as server:
        router, direct = _clients(server)
        for client in (router, direct):
            answer = await in_thread(partial(
                client.chat.completions.create, model=MODEL, messages=MESSAGES,
                max_tokens=3))
            assert answer.choices[0].message.content
            assert answer.choices[0].message.tool_calls == no_calls
        await server.cluster.settled()
