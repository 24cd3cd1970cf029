"""B8: the usage is the router's only where it must be. Its prompt and cached counts are
the prefill's and its completion count the decode's (or counted); any other field of the
decode worker's usage object (OpenAI's ``completion_tokens_details``, SGLang's
``reasoning_tokens``, one a newer worker adds) describes the completion the decode made,
and reaches the client as the worker sent it, streamed or not.

A socket worker (tests/test_relay_adversary.py) answers the decode through the vLLM
or the SGLang adapter; the mock prefill counts the prompt. Read with the ``openai`` client.
"""

from __future__ import annotations

import contextlib
from typing import Any

import openai
import orjson
import pytest
import trio
from test_relay_adversary import MODEL, Worker, bare, event, running
from test_relay_hostile import WholeAnswer, prefill_worker

DETAILS = {"reasoning_tokens": 2, "accepted_prediction_tokens": 0}


def with_detailed_usage(chat: bool) -> list[bytes]:
    usage = {"prompt_tokens": 99, "completion_tokens": 3, "total_tokens": 102,
             "prompt_tokens_details": {"cached_tokens": 99},
             "completion_tokens_details": DETAILS, "reasoning_tokens": 2}
    return [event(bare(chat, "a")), event(bare(chat, " b")),
            event(bare(chat, " c", finish_reason="stop")),
            event(orjson.dumps({"id": "w", "choices": [], "usage": usage})),
            event(b"[DONE]")]


def ask(client: openai.OpenAI, chat: bool, stream: bool) -> Any:
    """One answer, or a streamed one's last chunk (with ``include_usage``)."""
    options: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
    create: Any = client.chat.completions.create if chat else client.completions.create
    if chat:
        options["messages"] = [{"role": "user", "content": "one two three"}]
    else:
        options.update(prompt="one two three", max_tokens=3)
    answer = create(model=MODEL, stream=stream, **options)
    return list(answer)[-1] if stream else answer


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_B8_the_decodes_usage_fields_the_router_does_not_own_reach_the_client(
    protocol: str,
) -> None:
    worker = Worker()
    async with running(worker, protocol) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=10.0)
        seen = []
        with trio.fail_after(20):
            for chat in (False, True):
                worker.pieces = with_detailed_usage(chat)
                for stream in (False, True):
                    seen.append(await trio.to_thread.run_sync(ask, client, chat, stream))
    for answer in seen:
        usage = answer.usage
        assert usage is not None
        assert usage.completion_tokens == 3
        assert usage.prompt_tokens != 99  # the prefill's count, not the decode's
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens != 99
        assert usage.completion_tokens_details is not None
        assert usage.completion_tokens_details.model_dump(exclude_none=True) == DETAILS
        assert (usage.model_extra or {}).get("reasoning_tokens") == 2


async def test_B8_a_prefill_that_counts_no_cache_hits_is_not_reported_as_one_that_found_none(
) -> None:
    # vLLM without --enable-prompt-tokens-details answers "prompt_tokens_details": null:
    # it did not count cache hits. The client gets that null, not a cached_tokens of 0
    # the worker never said (here a prefill that ended the request on its token, S7).
    answer = {"id": "w", "object": "chat.completion", "created": 7, "model": "worker",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5,
                        "prompt_tokens_details": None}}
    async with prefill_worker(WholeAnswer(answer)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=10.0)
        with trio.fail_after(20):
            seen = [await trio.to_thread.run_sync(ask, client, True, stream)
                    for stream in (False, True)]
    for got in seen:
        assert got.usage is not None
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (4, 1)
        assert got.usage.prompt_tokens_details is None


class NoEnd(Worker):
    """:class:`Worker` that sends its pieces and then neither ``[DONE]`` nor the end of
    its body: it keeps the connection open until the router closes it."""

    async def end(self, stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            while await stream.receive_some(1 << 16):
                pass  # until the router closes the connection


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_B8_an_answer_complete_with_its_usage_chunk_is_a_success_without_done(
    chat: bool,
) -> None:
    # OpenAI's usage chunk is a stream's last event before [DONE]: once the finish and
    # the usage came, the answer is complete. A worker (or a proxy before it) that then
    # neither sends [DONE] nor ends its body does not turn it into a deadline error.
    worker = NoEnd()
    worker.pieces = with_detailed_usage(chat)[:-1]  # no [DONE]
    async with running(worker) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=4.0)
        with trio.fail_after(5):  # well within the decode's idle deadline
            seen = [await trio.to_thread.run_sync(ask, client, chat, stream)
                    for stream in (False, True)]
    whole = seen[0]
    text = whole.choices[0].message.content if chat else whole.choices[0].text
    assert text == "a b c"
    assert whole.choices[0].finish_reason == "stop"
    for answer in seen:
        assert answer.usage is not None and answer.usage.completion_tokens == 3
