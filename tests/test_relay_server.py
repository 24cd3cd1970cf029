"""The faithful relay through the HTTP server (B8).

A chunk the worker sends reaches the client as sent, except what the router owns: the
response ``id``, ``model`` as the client named it, ``usage`` (prompt and cached tokens from
the prefill; completion tokens the worker's, or counted) and the terminal the gatekeeper
holds. The decode engines here are the in-process mock decode (it pulls the KV, so nothing
stays staged) followed by a script of outputs that carry the worker's own OpenAI choice,
as an HTTP adapter reads it (``LLMEngineOutput.choices``). Real hypercorn on 127.0.0.1, the
official ``openai`` client and raw httpx.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import openai
import orjson
import pytest
import trio
from engine_support import StandIn, run_to_its_end
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from trio_disagg import (
    Annotated,
    CompletionUsage,
    DisaggRouter,
    FinishKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    PromptTokensDetails,
    RequestContext,
    TransferKeeper,
    WorkerPool,
)
from trio_disagg.engines import (
    LatencyModel,
    MockCluster,
    count_prompt_tokens,
    mock_cluster,
)
from trio_disagg.server import OpenAIApp, create_app, serve

MODEL = "mock-model"
PROMPT = " ".join(f"word{i}" for i in range(45))
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES: Any = [{"role": "user", "content": PROMPT}]
T = TypeVar("T")
Item = Annotated[LLMEngineOutput]
Choice = dict[str, Any]


def out(choice: Choice, finish: FinishReason | None = None,
        usage: CompletionUsage | None = None) -> Item:
    """An output as an HTTP adapter makes it from a chunk: no token ids (the worker sent
    none), the text of the content, the finish reason parsed, the choice as sent."""
    part = choice.get("delta") or choice.get("message") or {}
    text = choice.get("text", part.get("content"))
    return Annotated(data=LLMEngineOutput(
        text=text or None, finish_reason=finish, completion_usage=usage, choices=[choice]))


class Scripted(StandIn):
    """A decode engine: the mock decode runs first (it pulls the KV; its tokens are
    thrown away), then :attr:`script` is sent as the worker's stream."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.script: list[Item] | None = None
        self.requests: list[PreprocessedRequest] = []

    async def generate(  # noqa: ASYNC128 (the wrapped engine calls task_status.started())
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self.requests.append(request)
        with send_channel:
            mock = await run_to_its_end(self.engine, request, context, task_status)
            for item in (mock if self.script is None else self.script):
                await send_channel.send(item)


class AnswersWith(StandIn):
    """A prefill engine wrapper: the mock prefill's terminal answer (S7) gets ``choice``,
    as an HTTP adapter reads a non-streamed answer's ``choices[0]``."""

    def __init__(self, engine: Any, choice: Choice) -> None:
        super().__init__(engine)
        self.choice = choice

    async def generate(  # noqa: ASYNC128 (the wrapped engine calls task_status.started())
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        inner_send, inner_receive = trio.open_memory_channel[Item](math.inf)
        with send_channel:
            async with trio.open_nursery() as nursery:
                await nursery.start(partial(self.engine.generate, request, context,
                                            inner_send))
                task_status.started()
                with inner_receive:
                    async for item in inner_receive:
                        data = item.data
                        if data is not None and data.finish_reason is not None and (
                            data.finish_reason.kind is not FinishKind.LENGTH
                        ):
                            data = attrs.evolve(data, choices=[self.choice])
                            item = attrs.evolve(item, data=data)
                        await send_channel.send(item)


@attrs.define(eq=False)
class Server:
    url: str
    app: OpenAIApp
    router: DisaggRouter
    keeper: TransferKeeper
    cluster: MockCluster
    decode: Scripted

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=10.0)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=10.0)

    async def settled(self) -> None:
        with trio.fail_after(5):
            await self.app.wait_idle()
            await self.router.wait_idle()
            await self.keeper.wait_idle()
        assert self.cluster.counters().held_blocks == 0


@asynccontextmanager
async def running(*, prefill: Callable[[Any], Any] = lambda engine: engine
                  ) -> AsyncIterator[Server]:
    cluster = mock_cluster(latency=LatencyModel.zero())
    decode = Scripted(cluster.decode[0])
    async with TransferKeeper(drain_window=5.0) as keeper:
        router = DisaggRouter(WorkerPool([prefill(cluster.prefill[0])]),
                              WorkerPool([decode]), keeper)
        app = create_app(router, models=[MODEL], fault_injection=True)  # tests inject faults
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(
                serve, app, host="127.0.0.1", port=0, shutdown_trigger=stop.wait))
            yield Server(f"http://127.0.0.1:{port}", app, router, keeper, cluster, decode)
            stop.set()


async def in_thread(fn: Callable[[], T]) -> T:
    with trio.fail_after(10):
        return await trio.to_thread.run_sync(fn)


def events(body: bytes) -> list[Any]:
    """The JSON of each server-sent event, then ``"[DONE]"``."""
    assert body.endswith(b"\n\n"), body[-50:]
    chunks = [chunk.removeprefix(b"data: ") for chunk in body[:-2].split(b"\n\n")]
    assert chunks[-1] == b"[DONE]" and chunks.count(b"[DONE]") == 1
    return [orjson.loads(chunk) for chunk in chunks[:-1]] + ["[DONE]"]


def expected_cached(body: dict[str, Any], *, warm: bool = False) -> int:
    """The prefill engine's prefix-cache hit for ``body``: 0 for a prompt it never computed;
    once ``warm``, the prompt's whole KV blocks, leaving at least one token to compute."""
    block_size = mock_cluster().prefill[0].kv.block_size
    return (count_prompt_tokens(body) - 1) // block_size * block_size if warm else 0


def relayed(sent: Mapping[str, Any], *, first: bool = False) -> dict[str, Any]:
    """What the client must get for a chat choice the worker sent: the same, with index 0
    and, in the first chunk, the role."""
    choice = {**sent, "index": 0}
    if first and "role" not in choice["delta"]:
        choice["delta"] = {"role": "assistant", **choice["delta"]}
    return choice


# --- the scripts ----------------------------------------------------------------------------

WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
TOOL_CHOICES: list[Choice] = [
    {"index": 0, "delta": {"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": ""}}]},
     "logprobs": None, "finish_reason": None},
    {"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '{"city": "Paris", '}}]},
     "logprobs": None, "finish_reason": None},
    {"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '"unit": "celsius"}'}}]},
     "logprobs": None, "finish_reason": None},
    {"index": 0, "delta": {"tool_calls": [
        {"index": 1, "id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": "{}"}}]},
     "logprobs": None, "finish_reason": None},
    {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls",
     "stop_reason": None},
]


def tool_script() -> list[Item]:
    *tokens, last = TOOL_CHOICES
    return [out(choice) for choice in tokens] + [out(last, FinishReason.STOP)]


REASONING_CHOICES: list[Choice] = [
    {"index": 0, "delta": {"reasoning_content": "The user "}, "finish_reason": None},
    {"index": 0, "delta": {"reasoning_content": "greets me."}, "finish_reason": None},
    {"index": 0, "delta": {"content": "Hello"}, "finish_reason": None},
    {"index": 0, "delta": {"content": " there"}, "finish_reason": "stop", "stop_reason": None},
]


def chat_logprob(token: str, value: float) -> dict[str, Any]:
    return {"token": token, "logprob": value, "bytes": list(token.encode()),
            "top_logprobs": [{"token": token, "logprob": value, "bytes": list(token.encode())}]}


LOGPROB_CHOICES: list[Choice] = [
    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
     "finish_reason": None},
    {"index": 0, "delta": {"content": "Hi"},
     "logprobs": {"content": [chat_logprob("Hi", -0.25)]}, "finish_reason": None},
    {"index": 0, "delta": {"content": "!"},
     "logprobs": {"content": [chat_logprob("!", -1.5)]}, "finish_reason": "length"},
]

COMPLETION_LOGPROB_CHOICES: list[Choice] = [
    {"index": 0, "text": " a", "logprobs": {
        "tokens": [" a"], "token_logprobs": [-0.5], "top_logprobs": [{" a": -0.5, " b": -2.0}],
        "text_offset": [0]}, "finish_reason": None, "stop_reason": None},
    {"index": 0, "text": " b", "logprobs": {
        "tokens": [" b"], "token_logprobs": [-0.75], "top_logprobs": [{" b": -0.75}],
        "text_offset": [2]}, "finish_reason": None, "stop_reason": None},
    {"index": 0, "text": "", "logprobs": {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []},
     "finish_reason": "stop", "stop_reason": "###"},
]


def script_of(choices: list[Choice], finish: FinishReason = FinishReason.STOP,
              usage: CompletionUsage | None = None) -> list[Item]:
    *tokens, last = choices
    return [out(choice) for choice in tokens] + [out(last, finish, usage)]


# --- streamed --------------------------------------------------------------------------------


async def test_streamed_tool_calls_are_relayed_as_sent() -> None:
    async with running() as server:
        server.decode.script = tool_script()
        client = server.openai()

        def stream() -> list[ChatCompletionChunk]:
            return list(client.chat.completions.create(
                model=MODEL, messages=MESSAGES, stream=True, tools=[{
                    "type": "function", "function": {"name": "get_weather",
                                                     "parameters": {}}}]))

        chunks = await in_thread(stream)
        assert [chunk.model for chunk in chunks] == [MODEL] * len(chunks)
        assert len({chunk.id for chunk in chunks}) == 1
        raw = [chunk.choices[0].model_dump(exclude_unset=True) for chunk in chunks]
        assert raw == [relayed(choice, first=i == 0) for i, choice in enumerate(TOOL_CHOICES)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        calls: dict[int, dict[str, str]] = {}
        for chunk in chunks:
            for call in chunk.choices[0].delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                assert call.function is not None
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        assert calls == {0: {"name": "get_weather", "arguments": WEATHER_ARGS},
                         1: {"name": "get_time", "arguments": "{}"}}
        await server.settled()


async def test_streamed_chunks_are_byte_for_byte_the_workers_choice_in_the_envelope() -> None:
    """The router's envelope around the worker's choice: its id, the client's model, index
    0 (the worker said 3), the role added to the first delta; every other byte as sent."""
    sent: list[Choice] = [
        {"index": 3, "delta": {"content": "A", "reasoning_content": None},
         "logprobs": None, "finish_reason": None, "token_ids": None},
        {"index": 3, "delta": {"content": "B"}, "logprobs": None, "finish_reason": "stop",
         "stop_reason": 128009},
    ]
    async with running() as server, server.http() as http:
        server.decode.script = script_of(sent)
        response = await http.post(CHAT, json={
            "model": MODEL, "messages": MESSAGES, "stream": True,
            "stream_options": {"include_usage": True}})
        assert response.status_code == 200
        first, last, usage, done = events(response.content)
        assert done == "[DONE]"
        rid, created = first["id"], first["created"]
        head = (b'data: {"id":' + orjson.dumps(rid) + b',"object":"chat.completion.chunk",'
                b'"created":' + str(created).encode() + b',"model":"mock-model","choices":[')
        expected = (
            head + orjson.dumps({**sent[0], "index": 0,
                                 "delta": {"role": "assistant", **sent[0]["delta"]}})
            + b'],"usage":null}\n\n'
            + head + orjson.dumps({**sent[1], "index": 0}) + b'],"usage":null}\n\n'
        )
        assert response.content.startswith(expected)
        assert last["choices"][0]["stop_reason"] == 128009
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2
        await server.settled()


async def test_streamed_reasoning_and_chat_logprobs() -> None:
    async with running() as server, server.http() as http:
        server.decode.script = script_of(REASONING_CHOICES)
        response = await http.post(CHAT, json={"model": MODEL, "messages": MESSAGES,
                                               "stream": True})
        *chunks, _ = events(response.content)
        assert [chunk["choices"][0] for chunk in chunks] == [
            relayed(choice, first=i == 0) for i, choice in enumerate(REASONING_CHOICES)]
        server.decode.script = script_of(LOGPROB_CHOICES, FinishReason.LENGTH)
        response = await http.post(CHAT, json={"model": MODEL, "messages": MESSAGES,
                                               "stream": True, "logprobs": True,
                                               "top_logprobs": 1})
        *chunks, _ = events(response.content)
        assert [chunk["choices"][0] for chunk in chunks] == [
            relayed(choice) for choice in LOGPROB_CHOICES]
        await server.settled()


async def test_streamed_completion_logprobs_and_stop_reason() -> None:
    async with running() as server:
        server.decode.script = script_of(COMPLETION_LOGPROB_CHOICES)
        client = server.openai()

        def stream() -> list[Completion]:
            return list(client.completions.create(
                model=MODEL, prompt=PROMPT, stream=True, logprobs=2))

        chunks = await in_thread(stream)
        assert [chunk.choices[0].model_dump(exclude_unset=True) for chunk in chunks] == (
            COMPLETION_LOGPROB_CHOICES)
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert chunks[-1].choices[0].model_extra == {"stop_reason": "###"}
        await server.settled()


async def test_content_filter_is_relayed_as_the_worker_said() -> None:
    filtered = {"violence": {"filtered": True, "severity": "medium"}}
    choices: list[Choice] = [
        {"index": 0, "delta": {"content": "I can"}, "finish_reason": None},
        {"index": 0, "delta": {}, "finish_reason": "content_filter",
         "content_filter_results": filtered},
    ]
    async with running() as server:
        client = server.openai()
        server.decode.script = script_of(choices, FinishReason.CONTENT_FILTER)

        def stream() -> list[ChatCompletionChunk]:
            return list(client.chat.completions.create(
                model=MODEL, messages=MESSAGES, stream=True))

        chunks = await in_thread(stream)
        assert chunks[-1].choices[0].finish_reason == "content_filter"
        assert chunks[-1].choices[0].delta.content is None  # the worker sent no content
        assert chunks[-1].choices[0].model_extra == {"content_filter_results": filtered}
        server.decode.script = script_of(choices, FinishReason.CONTENT_FILTER)
        answer: ChatCompletion = await in_thread(lambda: client.chat.completions.create(
            model=MODEL, messages=MESSAGES))
        assert answer.choices[0].finish_reason == "content_filter"
        assert answer.choices[0].message.content == "I can"
        assert answer.choices[0].model_extra == {"content_filter_results": filtered}
        await server.settled()


# --- not streamed: the decode streamed, the server collects --------------------------------


async def test_collected_tool_calls() -> None:
    async with running() as server:
        server.decode.script = tool_script()
        client = server.openai()
        answer: ChatCompletion = await in_thread(lambda: client.chat.completions.create(
            model=MODEL, messages=MESSAGES))
        (choice,) = answer.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert choice.message.role == "assistant"
        calls = choice.message.tool_calls
        assert calls is not None
        assert all(call.type == "function" for call in calls)
        assert [(call.id, call.type, call.function.name, call.function.arguments)
                for call in calls if call.type == "function"] == [
            ("call_1", "function", "get_weather", WEATHER_ARGS),
            ("call_2", "function", "get_time", "{}")]
        assert choice.model_extra == {"stop_reason": None}
        await server.settled()


async def test_collected_reasoning_and_chat_logprobs() -> None:
    async with running() as server, server.http() as http:
        server.decode.script = script_of(REASONING_CHOICES)
        body = (await http.post(CHAT, json={"model": MODEL, "messages": MESSAGES})).json()
        (choice,) = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": "Hello there",
                                     "reasoning_content": "The user greets me."}
        assert choice["finish_reason"] == "stop"
        assert choice["logprobs"] is None
        server.decode.script = script_of(LOGPROB_CHOICES, FinishReason.LENGTH)
        body = (await http.post(CHAT, json={"model": MODEL, "messages": MESSAGES,
                                            "logprobs": True})).json()
        (choice,) = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": "Hi!"}
        assert choice["logprobs"] == {"content": [chat_logprob("Hi", -0.25),
                                                  chat_logprob("!", -1.5)]}
        assert choice["finish_reason"] == "length"
        await server.settled()


async def test_collected_completion_logprobs_and_stop_reason() -> None:
    async with running() as server:
        server.decode.script = script_of(COMPLETION_LOGPROB_CHOICES)
        client = server.openai()
        answer: Completion = await in_thread(lambda: client.completions.create(
            model=MODEL, prompt=PROMPT, logprobs=2))
        (choice,) = answer.choices
        assert choice.text == " a b"
        assert choice.finish_reason == "stop"
        assert choice.model_extra == {"stop_reason": "###"}
        assert choice.logprobs is not None
        assert choice.logprobs.model_dump() == {
            "tokens": [" a", " b"], "token_logprobs": [-0.5, -0.75],
            "top_logprobs": [{" a": -0.5, " b": -2.0}, {" b": -0.75}], "text_offset": [0, 2]}
        await server.settled()


# --- usage -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_usage_counted_when_the_decode_sent_none(stream: bool) -> None:
    """The worker sent no token ids and no usage: one token per chunk with content; the
    cached tokens are still the prefill's."""
    body = {"model": MODEL, "messages": MESSAGES}
    async with running() as server, server.http() as http:
        server.decode.script = script_of(REASONING_CHOICES)
        if stream:
            response = await http.post(CHAT, json={
                **body, "stream": True, "stream_options": {"include_usage": True}})
            usage = events(response.content)[-2]["usage"]
        else:
            usage = (await http.post(CHAT, json=body)).json()["usage"]
        assert usage["completion_tokens"] == 4
        assert usage["total_tokens"] == usage["prompt_tokens"] + 4
        assert usage["prompt_tokens_details"] == {"cached_tokens": expected_cached(body)}
        await server.settled()


async def test_usage_of_the_worker_wins_but_cached_tokens_are_the_prefills() -> None:
    body = {"model": MODEL, "messages": MESSAGES}
    usage = CompletionUsage(prompt_tokens=45, completion_tokens=9, total_tokens=54,
                            prompt_tokens_details=PromptTokensDetails(cached_tokens=45))
    async with running() as server, server.http() as http:
        server.decode.script = script_of(REASONING_CHOICES, usage=usage)
        answer = (await http.post(CHAT, json=body)).json()
        assert answer["usage"] == {
            "prompt_tokens": 45, "completion_tokens": 9, "total_tokens": 54,
            "prompt_tokens_details": {"cached_tokens": expected_cached(body)}}
        await server.settled()


# --- the prefill's own answer (S7) ------------------------------------------------------------


async def test_a_terminal_prefill_answer_with_a_message_is_a_delta_when_streamed() -> None:
    call = {"id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}}
    message: Choice = {"role": "assistant", "content": None, "tool_calls": [call]}
    answer = {"index": 0, "message": message, "logprobs": None,
              "finish_reason": "tool_calls", "stop_reason": None}
    async with (
        running(prefill=lambda engine: AnswersWith(engine, answer)) as server,
        server.http() as http,
    ):
        body = {"model": MODEL, "messages": MESSAGES, "fault": "eos_first_token"}
        response = await http.post(CHAT, json={**body, "stream": True})
        (chunk, _) = events(response.content)
        assert chunk["choices"] == [{
            "index": 0, "delta": {**message, "tool_calls": [{"index": 0, **call}]},
            "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}]
        collected = (await http.post(CHAT, json=body)).json()
        assert collected["choices"][0]["message"] == message
        assert collected["choices"][0]["finish_reason"] == "tool_calls"
        assert server.decode.requests == []
        await server.settled()


# --- refused at the edge ---------------------------------------------------------------------


@pytest.mark.parametrize(("path", "field", "value"), [
    (COMPLETIONS, "prompt_logprobs", 1),
    (COMPLETIONS, "prompt_logprobs", 0),
    (CHAT, "prompt_logprobs", 2),
    (COMPLETIONS, "echo", True),
    (CHAT, "echo", True),
])
async def test_prompt_fields_are_refused(path: str, field: str, value: Any) -> None:
    body: dict[str, Any] = (
        {"model": MODEL, "prompt": PROMPT} if path == COMPLETIONS
        else {"model": MODEL, "messages": MESSAGES})
    async with running() as server, server.http() as http:
        for stream in (False, True):
            response = await http.post(path, json={**body, field: value, "stream": stream})
            assert response.status_code == 400, response.text
            assert response.json()["error"] == {
                "message": response.json()["error"]["message"],
                "type": "invalid_request_error", "param": field,
                "code": "unsupported_parameter"}
            assert field in response.json()["error"]["message"]
        assert server.decode.requests == []
        assert server.cluster.counters().held_blocks == 0
        # null and false are no request at all: served.
        allowed = {**body, field: None if field == "prompt_logprobs" else False}
        assert (await http.post(path, json=allowed)).status_code == 200
        await server.settled()


# --- an abort is an error --------------------------------------------------------------------

ABORT_CHOICES: list[Choice] = [
    TOOL_CHOICES[0],
    {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "abort"},
]


@pytest.mark.parametrize("finish", [FinishReason.CANCELLED, FinishReason.STOP],
                         ids=["adapter-cancelled", "adapter-stop"])
async def test_a_worker_abort_is_an_error(finish: FinishReason) -> None:
    """vLLM's ``finish_reason: "abort"``: the adapter maps it to a cancelled finish (the
    gatekeeper's decode failure); an abort the adapter took for a success is an error all
    the same."""
    async with running() as server, server.http() as http:
        server.decode.script = script_of(ABORT_CHOICES, finish)
        response = await http.post(CHAT, json={"model": MODEL, "messages": MESSAGES})
        assert response.status_code == 502, response.text
        assert response.json()["error"]["code"] == "cancelled"
        server.decode.script = script_of(ABORT_CHOICES, finish)
        response = await http.post(CHAT, json={"model": MODEL, "messages": MESSAGES,
                                               "stream": True})
        assert response.status_code == 200
        tool_chunk, error, done = events(response.content)
        assert tool_chunk["choices"] == [relayed(TOOL_CHOICES[0], first=True)]
        assert error["error"]["code"] == "cancelled"
        assert error["error"]["type"] == "upstream_error"
        assert done == "[DONE]"
        await server.settled()


# --- the in-process engines: unchanged ---------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_the_in_process_path_is_byte_identical(chat: bool) -> None:
    """Outputs without a choice (the mock engines) are encoded as before, to the byte."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "stream": True}
    body.update({"messages": MESSAGES} if chat else {"prompt": PROMPT})
    async with running() as server, server.http() as http:
        response = await http.post(CHAT if chat else COMPLETIONS, json=body)
        chunks = events(response.content)[:-1]
        rid, created = chunks[0]["id"], chunks[0]["created"]
        kind = b"chat.completion.chunk" if chat else b"text_completion"
        head = (b'data: {"id":' + orjson.dumps(rid) + b',"object":"' + kind + b'","created":'
                + str(created).encode() + b',"model":"mock-model","choices":[{"index":0,')
        texts = [chunk["choices"][0]["delta" if chat else "text"] for chunk in chunks]
        if chat:
            texts = [text["content"] for text in texts]
        expected = b""
        for i, text in enumerate(texts):
            if chat:
                role = b'"role":"assistant",' if i == 0 else b""
                part = b'"delta":{' + role + b'"content":' + orjson.dumps(text) + b"}"
            else:
                part = b'"text":' + orjson.dumps(text)
            finish = b'"length"' if i == len(texts) - 1 else b"null"
            expected += head + part + b',"logprobs":null,"finish_reason":' + finish + b"}]}\n\n"
        assert len(texts) == 3 and all(texts)
        assert response.content == expected + b"data: [DONE]\n\n"
        answer = (await http.post(CHAT if chat else COMPLETIONS,
                                  json={**body, "stream": False})).json()
        assert set(answer["choices"][0]) == {"index", "logprobs", "finish_reason",
                                             "message" if chat else "text"}
        if chat:
            assert answer["choices"][0]["message"] == {
                "role": "assistant", "content": answer["choices"][0]["message"]["content"]}
        await server.settled()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_outputs_with_and_without_a_choice_keep_their_order(stream: bool) -> None:
    """An adapter may make an output of its own (no choice) among the worker's: the answer
    keeps the order they came in."""
    def plain(text: str, finish: FinishReason | None = None) -> Item:
        return Annotated(data=LLMEngineOutput(token_ids=[7], text=text, finish_reason=finish))

    async with running() as server, server.http() as http:
        server.decode.script = [
            plain("A"), out({"index": 0, "delta": {"content": "B"}, "finish_reason": None}),
            plain("C"), plain("D", FinishReason.STOP)]
        response = await http.post(CHAT, json={"model": MODEL, "messages": MESSAGES,
                                               "stream": stream})
        if stream:
            chunks = events(response.content)[:-1]
            assert [chunk["choices"][0]["delta"].get("content") for chunk in chunks] == [
                "A", "B", "C", "D"]
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        else:
            (choice,) = response.json()["choices"]
            assert choice["message"] == {"role": "assistant", "content": "ABCD"}
            assert choice["finish_reason"] == "stop"
        await server.settled()
