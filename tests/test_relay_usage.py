"""B8 end to end: vLLM's ``stream_options.continuous_usage_stats``, answered by the router.

The official ``openai`` client, through the router's HTTP server, to each protocol's mock
workers over real sockets. With ``include_usage`` and ``continuous_usage_stats`` every
chunk carries the usage so far (the prefill's prompt and cached counts, the completion
tokens counted 1, 2, 3...), then the final usage chunk; without ``include_usage`` no
chunk carries one (as vLLM); without the option, nothing changed. The option is never
forwarded to a worker: the router answers it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import openai
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
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletionChunk

pytestmark = pytest.mark.parametrize("protocol", PROTOCOLS)

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


# vLLM's option is not in the client's types: a vLLM user sends it in ``extra_body``.
def completions(client: openai.OpenAI, options: dict[str, Any]) -> list[Completion]:
    return list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, stream=True,
        extra_body={"stream_options": options}))


def chats(client: openai.OpenAI, options: dict[str, Any]) -> list[ChatCompletionChunk]:
    return list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, stream=True,
        extra_body={"stream_options": options}))


def check_running(usages: list[CompletionUsage | None], cached: int) -> None:
    """Each chunk's usage: the prefill's counts, 1, 2, 3... completion tokens."""
    assert usages and all(usage is not None for usage in usages)
    counts = []
    for usage in usages:
        assert usage is not None
        assert usage.prompt_tokens == PROMPT_TOKENS
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == cached
        counts.append(usage.completion_tokens)
    assert counts == list(range(1, len(counts) + 1))


async def test_B8_continuous_usage_stats_on_streamed_completions(
    protocol: ProtocolName,
) -> None:
    async with served(protocol) as server:
        client = server.openai()
        chunks = await in_thread(lambda: completions(client, CONTINUOUS))
        *content, final = chunks
        assert final.choices == [] and final.usage is not None
        assert final.usage.completion_tokens == 5
        check_running([chunk.usage for chunk in content], expected_cached({"prompt": PROMPT}))
        assert content[-1].usage == final.usage  # the finish chunk's: the final usage
        assert "".join(chunk.choices[0].text for chunk in content)
        for seen in (server.cluster.prefill.seen, server.cluster.decode.seen):
            body = seen[0].body
            options = body.get("stream_options") or {}
            # the router answers it: asked of no worker (TensorRT-LLM's is told no, as
            # its releases differ on the default)
            assert options.get("continuous_usage_stats", False) is False
        await server.cluster.settled()


async def test_B8_continuous_usage_stats_on_streamed_chat(protocol: ProtocolName) -> None:
    async with served(protocol) as server:
        client = server.openai()
        chunks = await in_thread(lambda: chats(client, CONTINUOUS))
        *content, final = chunks
        assert final.choices == [] and final.usage is not None
        assert final.usage.completion_tokens == 5
        assert content[0].choices[0].delta.role == "assistant"
        cached = expected_cached({"messages": MESSAGES})
        check_running([chunk.usage for chunk in content], cached)
        assert content[-1].usage == final.usage
        assert content[-1].choices[0].finish_reason == "length"
        await server.cluster.settled()


async def test_B8_continuous_usage_stats_without_include_usage_adds_none(
    protocol: ProtocolName,
) -> None:
    async with served(protocol) as server:
        client = server.openai()
        for options in ({"continuous_usage_stats": True},
                        {"include_usage": False, "continuous_usage_stats": True}):
            chunks = await in_thread(partial(completions, client, options))
            assert all(chunk.usage is None for chunk in chunks)
            assert all(chunk.choices for chunk in chunks)  # no usage chunk either
        plain = await in_thread(lambda: chats(client, {"include_usage": True}))
        *content, final = plain  # the option's absence: as before
        assert all(chunk.usage is None for chunk in content)
        assert final.choices == [] and final.usage is not None
        await server.cluster.settled()
