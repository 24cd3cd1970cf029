"""B8 end to end: a client's ``X-Request-Id`` comes back as sent, and two requests in flight
with the same one (a retrying client) both complete.

vLLM refuses a request whose id is already running (``vllm-project/vllm#10583``,
``#27723``), and the mock workers do the same, so the router must give each of its
requests an id of its own at the workers (docs/protocols.md section 1).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
import trio
from e2e_support import MODEL, PROMPT, PROTOCOLS, ProtocolName, in_thread, served, wait_until

from trio_disagg.mock import LatencyModel

pytestmark = pytest.mark.parametrize("protocol", PROTOCOLS)

#: Decodes that last long enough (100 tokens, 5 ms apart) for the second to start while the
#: first runs (checked, not assumed: the test waits until both run at the decode worker).
PACED = LatencyModel(ttft_per_prompt_token=0.0001, inter_token_latency=0.005,
                     kv_transfer_per_token=0.00001)
TOKENS = 100


def stream(client: openai.OpenAI, request_id: str) -> tuple[str | None, list[Any]]:
    """The answer's ``X-Request-Id`` header and its chunks."""
    answer = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Request-Id": request_id})
    return answer.response.headers.get("x-request-id"), list(answer)


async def test_B8_two_streams_with_one_x_request_id_both_complete(
    protocol: ProtocolName,
) -> None:
    async with served(protocol, latency=PACED) as server:
        client = server.openai()
        decode = server.cluster.decode
        answers: list[tuple[str | None, list[Any]]] = []

        async def one() -> None:
            answers.append(await in_thread(lambda: stream(client, "retry-7")))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            await wait_until(lambda: len(decode.running_ids) == 1)
            nursery.start_soon(one)
            await wait_until(lambda: len(decode.running_ids) == 2)  # both decodes run
        for header, chunks in answers:
            assert header == "retry-7"  # the client's own id, echoed
            *content, final = chunks
            assert {chunk.id for chunk in chunks} == {"cmpl-retry-7"}
            assert content[-1].choices[0].finish_reason == "length"
            assert final.usage is not None and final.usage.completion_tokens == TOKENS
        ids = [seen.request_id for seen in decode.seen]
        assert len(set(ids)) == 2 and all(rid.startswith("retry-7.") for rid in ids)
        # each request's prefill and decode share its id (the workers' logs correlate)
        assert sorted(seen.request_id for seen in server.cluster.prefill.seen) == sorted(ids)
        await server.cluster.settled()
