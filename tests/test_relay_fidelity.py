"""The faithful relay (B8) against chunks as real workers write them, end to end: a socket
worker (``test_relay_adversary.Worker``) sends the bytes, the router relays them on a real
port, and the ``openai`` client (and raw HTTP where the client hides a field) reads them.
Each case is one a worker of the three protocols sends and the relay once got wrong."""

from __future__ import annotations

from typing import Any

import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import openai
import orjson
import pytest
import trio
from e2e_support import in_thread, served
from test_relay_adversary import MODEL, Worker, event, running

MESSAGES: Any = [{"role": "user", "content": "hi"}]


def chunk(chat: bool, choice: dict[str, Any]) -> bytes:
    return event(orjson.dumps({
        "id": "w", "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 7, "model": "worker", "choices": [choice]}))


def sglang_chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    """A chat chunk as SGLang writes it (pydantic's ``model_dump_json``: every delta field,
    ``"role": null`` after the first chunk)."""
    return event(orjson.dumps({
        "id": "w", "object": "chat.completion.chunk", "created": 7, "model": "worker",
        "choices": [{"index": 0, "delta": {"role": None, "content": None,
                                           "reasoning_content": None, "tool_calls": None,
                                           **delta},
                     "logprobs": None, "finish_reason": finish, "matched_stop": None}],
        "usage": None}))


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10.0)


async def test_B8_a_first_delta_whose_role_is_null_reaches_the_client_as_the_assistants(
) -> None:
    # SGLang sends its role in a first chunk with empty content, which carries nothing
    # and is not relayed; its later deltas say "role": null. The client's first chunk must
    # still say "assistant" (as SGLang's own first chunk did), or the openai client's
    # stream helper builds a message whose role is None.
    worker = Worker()
    worker.pieces = [sglang_chunk({"role": "assistant", "content": ""}),
                     sglang_chunk({"content": "Hel"}), sglang_chunk({"content": "lo"}),
                     sglang_chunk({"content": ""}, "stop"), event(b"[DONE]")]
    async with running(worker) as url:
        client = client_of(url)

        def streamed() -> tuple[list[Any], Any]:
            parts = list(client.chat.completions.create(
                model=MODEL, messages=MESSAGES, stream=True))
            with client.chat.completions.stream(model=MODEL, messages=MESSAGES) as stream:
                for _ in stream:
                    pass
                return parts, stream.get_final_completion()

        with trio.fail_after(20):
            parts, final = await trio.to_thread.run_sync(streamed)
    assert [part.choices[0].delta.role for part in parts] == ["assistant", None, None]
    assert [part.choices[0].delta.content for part in parts] == ["Hel", "lo", ""]
    assert parts[0].choices[0].model_extra == {"matched_stop": None}  # the rest as sent
    assert final.choices[0].message.role == "assistant"
    assert final.choices[0].message.content == "Hello"


def logprobs_of(chat: bool, token: str, offset: int) -> dict[str, Any]:
    raw = list(token.encode())
    if chat:
        return {"content": [{"token": token, "logprob": -0.25, "bytes": raw,
                             "top_logprobs": [{"token": token, "logprob": -0.25,
                                               "bytes": raw}]}]}
    return {"tokens": [token], "token_logprobs": [-0.25], "top_logprobs": [{token: -0.25}],
            "text_offset": [offset]}


def text_choice(chat: bool, text: str, logprobs: Any, finish: str | None = None
                ) -> dict[str, Any]:
    body = {"delta": {"content": text}} if chat else {"text": text}
    return {"index": 0, **body, "logprobs": logprobs, "finish_reason": finish}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_B8_a_chunk_with_logprobs_and_no_text_is_a_token_of_the_counted_usage(
    chat: bool, stream: bool
) -> None:
    # vLLM holds back the text of a token that ends inside a UTF-8 character: its chunk
    # has an empty text and the token's logprobs (token "bytes:\xe2"). A decode that
    # sends no usage has its completion tokens counted by the router: that chunk is one.
    worker = Worker()
    tokens = ["a", "bytes:\\xe2\\x82", "\u20ac", "b"]
    texts = ["a", "", "\u20ac", "b"]
    choices = [text_choice(chat, text, logprobs_of(chat, token, offset))
               for offset, (token, text) in enumerate(zip(tokens, texts, strict=True))]
    choices[-1]["finish_reason"] = "length"
    worker.pieces = [*(chunk(chat, choice) for choice in choices), event(b"[DONE]")]
    async with running(worker) as url:
        client = client_of(url)
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 4}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})

        def ask() -> Any:
            if chat:
                answer = client.chat.completions.create(messages=MESSAGES, **body)
            else:
                answer = client.completions.create(prompt="hi", **body)
            return list(answer)[-1] if stream else answer

        with trio.fail_after(20):
            answer = await trio.to_thread.run_sync(ask)
    assert answer.usage is not None
    assert (answer.usage.completion_tokens, answer.usage.total_tokens) == (
        4, answer.usage.prompt_tokens + 4)


@pytest.mark.parametrize("last", [{}, {"content": ""}], ids=["empty-delta", "empty-content"])
async def test_B8_a_collected_answer_without_content_has_null_content(
    last: dict[str, Any]
) -> None:
    # A worker that streamed only reasoning (cut by its budget before the answer), only a
    # refusal or only tool calls answers a client that did not stream with
    # "content": null, as vLLM and OpenAI do, not an empty string the worker never sent.
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"reasoning_content": "think"}, "reasoning_content"),
        ({"reasoning": "think"}, "reasoning"),
        ({"refusal": "no"}, "refusal"),
        ({"tool_calls": [call]}, "tool_calls"),
    ]
    worker = Worker()
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        for delta, field in cases:
            worker.pieces = [
                chunk(True, {"index": 0, "delta": {"role": "assistant", "content": ""}}),
                chunk(True, {"index": 0, "delta": delta, "finish_reason": None}),
                chunk(True, {"index": 0, "delta": last, "finish_reason": "length"}),
                event(b"[DONE]")]
            with trio.fail_after(20):
                response = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": MESSAGES})
            assert response.status_code == 200, response.text
            message = response.json()["choices"][0]["message"]
            assert message["content"] is None, (field, message)
            assert field in message


TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_B8_a_chat_whose_tool_choice_is_required_is_answered_with_its_tool_call(
    stream: bool
) -> None:
    # vLLM answers a non-streamed tool_choice "required" by parsing its output as a JSON
    # list of calls: the prefill's one token is none, and the prefill failed (400, or 500
    # on recent builds) with its KV staged and nothing to free it (vllm-project/vllm
    # #38911). Through the router the client gets the call the decode makes, and no KV
    # is left behind.
    async with served("vllm") as server:
        client = server.openai()
        options: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                   "tool_choice": "required", "max_tokens": 5}

        def ask() -> tuple[list[Any], Any]:
            if stream:
                chunks = list(client.chat.completions.create(stream=True, **options))
                calls = [call for chunk in chunks for choice in chunk.choices
                         for call in choice.delta.tool_calls or []]
                return calls, chunks[-1].choices[0].finish_reason
            answer = client.chat.completions.create(**options)
            return answer.choices[0].message.tool_calls or [], answer.choices[0].finish_reason

        with trio.fail_after(20):
            calls, finish = await in_thread(ask)
        assert calls and calls[0].function is not None
        assert calls[0].function.name == "lookup"
        assert finish == "tool_calls"
        await server.cluster.settled()  # no KV staged and left


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_B8_a_chat_asking_return_token_ids_gets_the_prompt_token_ids(
    stream: bool
) -> None:
    # vLLM (0.10.2 on) answers a chat's "return_token_ids": true with the prompt's token
    # ids at the top level of its first chunk (the role-only one) and each chunk's own
    # "token_ids" in its choice; the router forwards the option, and relays the choices.
    worker = Worker()
    first = orjson.dumps({
        "id": "w", "object": "chat.completion.chunk", "created": 7, "model": "worker",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}],
        "prompt_token_ids": [1, 2, 3]})
    worker.pieces = [event(first),
                     chunk(True, {"index": 0, "delta": {"content": "a"}, "token_ids": [7],
                                  "finish_reason": None}),
                     chunk(True, {"index": 0, "delta": {"content": "b"}, "token_ids": [8],
                                  "finish_reason": "length"}),
                     event(b"[DONE]")]
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        with trio.fail_after(20):
            response = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": stream,
                "return_token_ids": True})
    assert response.status_code == 200, response.text
    if stream:
        chunks = [orjson.loads(line.removeprefix(b"data: "))
                  for line in response.content.split(b"\n\n")
                  if line.startswith(b"data: {")]
        assert [c["choices"][0]["token_ids"] for c in chunks] == [[7], [8]]
        assert chunks[0].get("prompt_token_ids") == [1, 2, 3]
    else:
        answer = response.json()
        assert answer["choices"][0]["token_ids"] == [7, 8]
        assert answer.get("prompt_token_ids") == [1, 2, 3]


def raw_chunks(content: bytes) -> list[dict[str, Any]]:
    """The chunks of a streamed answer's bytes, as a client that reads them gets them."""
    return [orjson.loads(line.removeprefix(b"data: ")) for line in content.split(b"\n\n")
            if line.startswith(b"data: {")]


def top_field(answer: Any, name: str) -> Any:
    """A top-level field of an ``openai`` answer or chunk, typed or not."""
    value = getattr(answer, name, None)
    return value if value is not None else (answer.model_extra or {}).get(name)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_B8_a_top_level_field_the_router_does_not_own_reaches_the_client(
    chat: bool, stream: bool
) -> None:
    # A worker's chunk may carry fields beside its choices that describe the answer
    # (system_fingerprint, service_tier) or that a newer worker adds: the client gets
    # them on the chunk they came with, or at the top level of its whole answer.
    def with_top(choice: dict[str, Any], **top: Any) -> bytes:
        return event(orjson.dumps({
            "id": "w", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 7, "model": "worker", "choices": [choice], **top}))

    worker = Worker()
    worker.pieces = [
        with_top(text_choice(chat, "a", None), system_fingerprint="fp_7",
                 x_future={"k": [1]}),
        chunk(chat, text_choice(chat, "b", None)),
        with_top(text_choice(chat, "", None, "length"), service_tier="flex"),
        event(b"[DONE]")]
    async with running(worker) as url:
        client = client_of(url)

        def ask() -> Any:
            body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "stream": stream}
            if chat:
                answer = client.chat.completions.create(messages=MESSAGES, **body)
            else:
                answer = client.completions.create(prompt="hi", **body)
            return list(answer) if stream else answer

        with trio.fail_after(20):
            answer = await trio.to_thread.run_sync(ask)
    if stream:
        assert [top_field(part, "system_fingerprint") for part in answer] == [
            "fp_7", None, None]
        assert [top_field(part, "x_future") for part in answer] == [{"k": [1]}, None, None]
        assert [top_field(part, "service_tier") for part in answer] == [None, None, "flex"]
    else:
        assert top_field(answer, "system_fingerprint") == "fp_7"
        assert top_field(answer, "x_future") == {"k": [1]}
        assert top_field(answer, "service_tier") == "flex"
        assert answer.id.startswith("chatcmpl-" if chat else "cmpl-")  # the router's own


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_B8_a_decodes_plumbing_does_not_reach_the_client(
    protocol: str, stream: bool
) -> None:
    # What a worker writes for the disaggregation or about its own request is not the
    # client's: a kv_transfer_params beside a decode's choices (as a Dynamo-style vLLM
    # worker may write it), SGLang's sglext chunk after the finish (its
    # cached_tokens_details would count the KV the prefill sent as cached).
    worker = Worker()
    if protocol == "vllm":
        params = {"do_remote_prefill": False, "remote_host": "10.0.0.9"}
        worker.pieces = [
            event(orjson.dumps({"id": "w", "object": "chat.completion.chunk", "created": 7,
                                "model": "worker", "choices": [
                                    {"index": 0, "delta": {"content": "Hel"}}],
                                "kv_transfer_params": params})),
            chunk(True, {"index": 0, "delta": {"content": "lo"}, "finish_reason": "length",
                         "kv_transfer_params": None}),
            event(b"[DONE]")]
    else:
        sglext = {"cached_tokens_details": {"device": 3, "host": 0}}
        worker.pieces = [
            sglang_chunk({"role": "assistant", "content": ""}),
            sglang_chunk({"content": "Hel"}), sglang_chunk({"content": "lo"}, "length"),
            event(orjson.dumps({"id": "w", "object": "chat.completion.chunk", "created": 7,
                                "model": "worker", "choices": [], "usage": None,
                                "sglext": sglext})),
            event(b"[DONE]")]
    async with running(worker, protocol) as url, httpx.AsyncClient(
            base_url=url, timeout=10.0) as http:
        with trio.fail_after(20):
            response = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": stream})
    assert response.status_code == 200, response.text
    plumbing = {"kv_transfer_params", "sglext"}
    if stream:
        chunks = raw_chunks(response.content)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"]) == "Hello"
        assert not any(plumbing & c.keys() for c in chunks), chunks
    else:
        answer = response.json()
        assert answer["choices"][0]["message"]["content"] == "Hello"
        assert not plumbing & answer.keys(), answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_B8_a_delta_field_the_router_does_not_know_reaches_the_client(
    stream: bool
) -> None:
    # A newer worker may add a field to its deltas, or to its choice, in a chunk with no
    # text: that chunk is relayed as sent, and a client that did not stream gets each
    # field in its answer as one rebuilding the stream would: a string concatenated
    # (a fragment, as content), a list concatenated, anything else as last sent.
    worker = Worker()
    deltas: list[dict[str, Any]] = [
        {"role": "assistant", "content": ""},
        {"content": "Hel", "x_note": "fr", "x_marks": [1], "x_state": {"v": 1}},
        {"content": "lo", "x_note": "ag"},
        {"content": "", "x_marks": [2], "x_state": {"v": 2}},
    ]
    worker.pieces = [
        *(chunk(True, {"index": 0, "delta": delta, "finish_reason": None})
          for delta in deltas),
        chunk(True, {"index": 0, "delta": {}, "x_choice": "seen", "finish_reason": None}),
        chunk(True, {"index": 0, "delta": {}, "finish_reason": "length"}),
        event(b"[DONE]")]
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        with trio.fail_after(20):
            response = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": stream})
    assert response.status_code == 200, response.text
    if stream:
        choices = [c["choices"][0] for c in raw_chunks(response.content)]
        assert [choice["delta"] for choice in choices[:3]] == [
            {"role": "assistant", **deltas[1]}, deltas[2], deltas[3]]
        assert choices[3]["x_choice"] == "seen"  # a chunk with nothing else: relayed
        assert choices[-1]["finish_reason"] == "length"
    else:
        choice = response.json()["choices"][0]
        message = choice["message"]
        assert message["content"] == "Hello"
        assert (message["x_note"], message["x_marks"], message["x_state"]) == (
            "frag", [1, 2], {"v": 2})
        assert choice["x_choice"] == "seen"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_B8_the_mock_vllm_gives_the_prompt_token_ids_a_client_asks_for(
    chat: bool
) -> None:
    # The mock vLLM answers return_token_ids as vLLM 0.10.2 on does: a chat's prompt ids
    # at the top level of its role-only first chunk and of its whole answer, a
    # completion's in its first choice. Through the router, streamed or not, the client
    # gets the same ids, one per prompt token.
    async with served("vllm") as server:
        client = server.openai()
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 3,
                                "extra_body": {"return_token_ids": True}}

        def ask() -> tuple[Any, Any, list[Any]]:
            if chat:
                whole = client.chat.completions.create(messages=MESSAGES, **body)
                parts = list(client.chat.completions.create(
                    messages=MESSAGES, stream=True, **body))
                return whole, top_field(whole, "prompt_token_ids"), [
                    top_field(part, "prompt_token_ids") for part in parts]
            whole = client.completions.create(prompt="a b c", **body)
            parts = list(client.completions.create(prompt="a b c", stream=True, **body))
            return whole, whole.choices[0].model_extra.get("prompt_token_ids"), [
                (part.choices[0].model_extra or {}).get("prompt_token_ids")
                for part in parts]

        with trio.fail_after(20):
            whole, whole_ids, streamed_ids = await in_thread(ask)
        assert isinstance(whole_ids, list)
        assert all(type(token) is int for token in whole_ids)
        assert len(whole_ids) == whole.usage.prompt_tokens > 0
        assert streamed_ids == [whole_ids, None, None]  # on the first chunk only
        await server.cluster.settled()


async def test_B8_a_top_level_field_goes_with_the_usage_so_far() -> None:
    # With vLLM's continuous_usage_stats every chunk carries the usage so far: a chunk
    # with a worker's field carries both, each chunk still valid JSON.
    worker = Worker()
    first = orjson.dumps({
        "id": "w", "object": "chat.completion.chunk", "created": 7, "model": "worker",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        "prompt_token_ids": [1, 2, 3]})
    last = orjson.dumps({
        "id": "w", "object": "chat.completion.chunk", "created": 7, "model": "worker",
        "choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "length"}],
        "service_tier": "flex"})
    worker.pieces = [event(first), chunk(True, {"index": 0, "delta": {"content": "a"}}),
                     event(last), event(b"[DONE]")]
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        with trio.fail_after(20):
            response = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert response.status_code == 200, response.text
    chunks = raw_chunks(response.content)
    assert [c.get("prompt_token_ids") for c in chunks] == [[1, 2, 3], None, None]
    assert [c.get("service_tier") for c in chunks] == [None, "flex", None]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 2]
    assert chunks[-1]["choices"] == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_B8_a_field_of_the_usage_chunk_goes_with_the_finish(stream: bool) -> None:
    # The usage chunk after the finish is answered by the router's own; a field the
    # worker put beside that usage reaches the client on the chunk with the finish.
    worker = Worker()
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    worker.pieces = [
        chunk(True, {"index": 0, "delta": {"content": "a"}}),
        chunk(True, {"index": 0, "delta": {"content": "b"}, "finish_reason": "length"}),
        event(orjson.dumps({"id": "w", "object": "chat.completion.chunk", "created": 7,
                            "model": "worker", "choices": [], "usage": usage,
                            "x_late": "u"})),
        event(b"[DONE]")]
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        with trio.fail_after(20):
            response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = raw_chunks(response.content)
        assert [c.get("x_late") for c in chunks] == [None, "u", None]
        assert chunks[1]["choices"][0]["finish_reason"] == "length"
        assert chunks[2]["choices"] == [] and chunks[2]["usage"]["completion_tokens"] == 2
    else:
        answer = response.json()
        assert answer["x_late"] == "u"
        assert answer["usage"]["completion_tokens"] == 2
