"""The faithful relay (B8) against chunks as real workers write them, end to end: a socket
worker (``test_relay_adversary.Worker``) sends the bytes, the router relays them on a real
port, and the ``openai`` client (and raw HTTP where the client hides a field) reads them.
Each case is one a worker of the three protocols sends and the relay once got wrong."""

from __future__ import annotations

from typing import Any

import openai
import orjson
import trio
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
