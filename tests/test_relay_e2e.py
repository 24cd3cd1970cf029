"""B8 end to end: what a worker sends reaches the client as sent, for every protocol.

The official ``openai`` client, through the router's HTTP server, to the protocol's mock
workers over real sockets: tool calls, reasoning, logprobs, finish reasons and
``stop_reason`` as the decode worker sent them; ``min_tokens`` not cut short by the
prefill; no token budget invented; usage from the prefill when the decode sends none;
``prompt_logprobs`` and ``echo`` refused; an ``abort`` is an error.
"""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest
from e2e_support import (
    MESSAGES,
    MODEL,
    PROMPT,
    PROMPT_TOKENS,
    PROTOCOLS,
    ProtocolName,
    expected_cached,
    in_thread,
    served,
)
from openai.types.chat import ChatCompletion, ChatCompletionChunk

pytestmark = pytest.mark.parametrize("protocol", PROTOCOLS)

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def chat_stream(client: openai.OpenAI, **options: Any) -> list[ChatCompletionChunk]:
    return list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, **options))


async def test_B8_a_plain_chat_stream_as_each_worker_writes_it(protocol: ProtocolName) -> None:
    """A plain chat stream (the relay's fast path): the first delta is the assistant's,
    the others as the worker wrote them (SGLang's ``"role": null`` and its null fields
    included)."""
    async with served(protocol) as server:
        client = server.openai()
        chunks = await in_thread(lambda: chat_stream(client, max_tokens=12))
        deltas = [choice.delta for chunk in chunks for choice in chunk.choices]
        assert deltas[0].role == "assistant"
        assert all(delta.role is None for delta in deltas[1:])
        text = "".join(delta.content or "" for delta in deltas)
        answer: ChatCompletion = await in_thread(lambda: client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12))
        assert text and answer.choices[0].message.content
        assert answer.choices[0].message.role == "assistant"
        if protocol == "sglang":  # its later deltas carry their null fields, as sent
            assert deltas[1].model_extra == {"reasoning_content": None}
        await server.cluster.settled()


async def test_B8_tool_calls_reach_the_client_as_sent(protocol: ProtocolName) -> None:
    async with served(protocol) as server:
        client = server.openai()
        chunks = await in_thread(lambda: chat_stream(client, tools=TOOLS, max_tokens=5))
        deltas = [call for chunk in chunks for choice in chunk.choices
                  for call in (choice.delta.tool_calls or [])]
        head = deltas[0]
        assert (head.index, head.type) == (0, "function")
        assert head.id and head.function is not None and head.function.name == "lookup"
        arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
        assert isinstance(orjson.loads(arguments), dict)  # the fragments, joined as sent
        assert not any(choice.delta.content for chunk in chunks for choice in chunk.choices)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        answer: ChatCompletion = await in_thread(lambda: client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=5))
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls"
        assert message.content is None
        (call,) = message.tool_calls or []
        assert call.type == "function" and call.id
        assert call.function.name == "lookup"
        assert isinstance(orjson.loads(call.function.arguments), dict)
        await server.cluster.settled()


async def test_B8_reasoning_content_is_passed_through(protocol: ProtocolName) -> None:
    async with served(protocol) as server:
        client = server.openai()
        extra = {"mock_reasoning_tokens": 2}
        chunks = await in_thread(lambda: chat_stream(client, max_tokens=5, extra_body=extra))
        reasoning = [getattr(choice.delta, "reasoning_content", None)
                     for chunk in chunks for choice in chunk.choices]
        assert len([text for text in reasoning if text]) == 2
        answer: ChatCompletion = await in_thread(lambda: client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=extra))
        assert getattr(answer.choices[0].message, "reasoning_content", None)
        assert answer.choices[0].message.content


async def test_B8_logprobs_per_token(protocol: ProtocolName) -> None:
    async with served(protocol) as server:
        client = server.openai()
        chunks = await in_thread(lambda: chat_stream(
            client, max_tokens=4, logprobs=True, top_logprobs=2))
        entries = [entry for chunk in chunks for choice in chunk.choices
                   if choice.logprobs is not None for entry in choice.logprobs.content or []]
        assert len(entries) == 4
        assert all(len(entry.top_logprobs) == 2 for entry in entries)
        answer: ChatCompletion = await in_thread(lambda: client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2))
        logprobs = answer.choices[0].logprobs
        assert logprobs is not None and len(logprobs.content or []) == 4
        completion = await in_thread(lambda: client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=2))
        completion_logprobs = completion.choices[0].logprobs
        assert completion_logprobs is not None
        assert len(completion_logprobs.tokens or []) == 3
        assert len(completion_logprobs.top_logprobs or []) == 3


@pytest.mark.parametrize(("field", "value"), [("prompt_logprobs", 1), ("echo", True)])
async def test_B8_prompt_only_fields_are_refused(
    protocol: ProtocolName, field: str, value: Any
) -> None:
    async with served(protocol) as server:
        client = server.openai()
        with pytest.raises(openai.BadRequestError) as refused:
            await in_thread(lambda: client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={field: value}))
        error = refused.value.body
        assert isinstance(error, dict)
        assert (error["code"], error["param"]) == ("unsupported_parameter", field)
        assert not server.cluster.prefill.seen and not server.cluster.decode.seen


async def test_B8_min_tokens_is_not_cut_short_by_the_prefill(protocol: ProtocolName) -> None:
    async with served(protocol) as server:
        client = server.openai()
        answer = await in_thread(lambda: client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=20,
            extra_body={"min_tokens": 10, "fault": "eos_first_token"}))
        assert answer.usage is not None and answer.usage.completion_tokens >= 10
        assert server.cluster.decode.seen  # the prefill did not end the request
        await server.cluster.settled()


async def test_B8_no_token_budget_is_invented(protocol: ProtocolName) -> None:
    async with served(protocol) as server:
        client = server.openai()
        await in_thread(lambda: client.chat.completions.create(
            model=MODEL, messages=MESSAGES))
        (decode,) = server.cluster.decode.seen
        body = decode.body
        if "sampling_params" in body:  # SGLang's native endpoint
            body = body["sampling_params"]
        assert not {"max_tokens", "max_completion_tokens", "max_new_tokens"} & set(body)
        await server.cluster.settled()


async def test_B8_usage_from_the_prefill_when_the_decode_sends_none(
    protocol: ProtocolName,
) -> None:
    async with served(protocol) as server:
        client = server.openai()
        chunks = await in_thread(lambda: list(client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"fault": "decode_no_usage"})))
        usage = chunks[-1].usage
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (PROMPT_TOKENS, 6)
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == expected_cached({"prompt": PROMPT})


async def test_B8_finish_reasons_and_stop_reason_keep_their_value(
    protocol: ProtocolName,
) -> None:
    async with served(protocol) as server:
        client = server.openai()
        filtered = await in_thread(lambda: client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3,
            extra_body={"fault": "decode_finish:content_filter"}))
        assert filtered.choices[0].finish_reason == "content_filter"
        stopped = await in_thread(lambda: client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3,
            extra_body={"fault": "decode_stop_reason:42"}))
        assert getattr(stopped.choices[0], "stop_reason", None) == 42
        with pytest.raises(openai.APIStatusError) as aborted:
            await in_thread(lambda: client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=3,
                extra_body={"fault": "decode_finish:abort"}))
        assert aborted.value.status_code == 502  # an abort is an error, never a success
        await server.cluster.settled()


async def test_S7_a_terminal_prefill_reaches_the_client_without_its_handoff_fields(
    protocol: ProtocolName,
) -> None:
    # The prefill that ends the request on its first token answers the client itself
    # (S7); what it wrote for a decode (TRT-LLM's choice-level disaggregated_params with
    # the router's disagg_request_id and its top-level prompt_token_ids, vLLM's top-level
    # kv_transfer_params) is plumbing, not answer (B8).
    plumbing = {"disaggregated_params", "kv_transfer_params", "bootstrap_room",
                "prompt_token_ids", "prompt_token_ids_b64", "sglext"}
    async with served(protocol) as server:
        client = server.openai()
        eos: Any = {"fault": "eos_first_token"}
        chat = await in_thread(lambda: client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=eos))
        text = await in_thread(lambda: client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, extra_body=eos))
        chunks = await in_thread(lambda: chat_stream(client, max_tokens=5, extra_body=eos))
        if protocol != "sglang":  # SGLang's decode joins the room at once, then ends
            assert not server.cluster.decode.seen  # answered by the prefill alone
        assert chat.choices[0].finish_reason == text.choices[0].finish_reason == "stop"
        assert chunks[-1].choices[0].finish_reason == "stop"
        for choice in (chat.choices[0], text.choices[0], chunks[-1].choices[0]):
            assert not plumbing & set(choice.model_extra or {})
        for answer in (chat, text, *chunks):
            assert not plumbing & set(answer.model_extra or {}), answer
        await server.cluster.settled()
