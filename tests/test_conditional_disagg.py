"""Conditional disaggregation: a short prompt goes to one decode worker alone."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from e2e_support import MODEL, ProtocolName, expected_cached, in_thread, served, warm

from trio_disagg._estimate import estimate_prompt_tokens
from trio_disagg._pool import RoundRobin, WorkerPool
from trio_disagg._router import DisaggRouter
from trio_disagg.engines import vllm_engines
from trio_disagg.mock import count_prompt_tokens

THRESHOLD = 64
SHORT = "hello there, how are you"  # 24 bytes: 6 tokens estimated
LONG = "the quick brown fox jumps over the lazy dog " * 10  # 440 bytes: 110 estimated


def test_the_estimate_is_utf8_bytes_over_4_and_token_ids_exactly() -> None:
    assert estimate_prompt_tokens({"prompt": SHORT}) == 6
    assert estimate_prompt_tokens({"prompt": "abcde"}) == 2  # rounded up
    assert estimate_prompt_tokens({"prompt": "日本語"}) == 3  # 9 bytes, not 3 characters / 4
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens({"prompt": [[1, 2], [3]]}) == 3
    assert estimate_prompt_tokens({"prompt": ["abcd", "abcd"]}) == 2
    chat = {"messages": [{"role": "user", "content": "abcd" * 4}]}
    assert estimate_prompt_tokens(chat) == 5  # the role counts too: the template's overhead
    parts = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert estimate_prompt_tokens(parts) is None  # an image: not estimated: disaggregated
    assert estimate_prompt_tokens({"prompt": {"not": "a prompt"}}) is None


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="disagg_min_prompt_tokens"):
        DisaggRouter(None, None, None, disagg_min_prompt_tokens=-1)  # type: ignore[arg-type]


async def test_a_short_prompt_reaches_only_the_decode_worker() -> None:
    async with served("vllm") as server:
        cluster = server.cluster
        router = server.app.router
        router.disagg_min_prompt_tokens = THRESHOLD
        client = server.openai()

        short = await in_thread(lambda: client.completions.create(
            model=MODEL, prompt=SHORT, max_tokens=5))
        assert short.choices[0].finish_reason == "length"
        assert short.choices[0].text
        assert short.usage is not None
        assert short.usage.completion_tokens == 5
        # The decode worker computed the prefill itself: the same prompt count.
        assert short.usage.prompt_tokens == count_prompt_tokens({"prompt": SHORT})
        assert cluster.prefill.stats.requests == 0
        assert cluster.decode.stats.requests == 1
        assert cluster.decode.stats.kv_pulls == 0  # no KV transfer

        chunks = await in_thread(lambda: list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": SHORT}], max_tokens=4,
            stream=True)))
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        assert cluster.prefill.stats.requests == 0
        assert cluster.decode.stats.requests == 2

        long = await in_thread(lambda: client.completions.create(
            model=MODEL, prompt=LONG, max_tokens=5))
        assert long.choices[0].finish_reason == "length"
        assert long.usage is not None
        assert long.usage.prompt_tokens == count_prompt_tokens({"prompt": LONG})
        assert cluster.prefill.stats.requests == 1  # disaggregated as before
        assert cluster.decode.stats.kv_pulls == 1

        async with httpx.AsyncClient() as http:
            metrics = (await http.get(server.url + "/metrics")).text
        assert 'trio_disagg_disagg_decisions_total{decision="decode_only"} 2.0' in metrics
        assert 'trio_disagg_disagg_decisions_total{decision="disaggregated"} 1.0' in metrics
        await cluster.settled()


async def test_a_decode_only_request_a_decode_worker_refused_is_retried() -> None:
    """No KV is staged for a decode-only request: a decode worker that cannot be reached
    is replaced by another before any byte (B9), like a prefill."""
    async with served("vllm") as server:
        cluster: Any = server.cluster  # protocol_support's Cluster: its client too
        router = server.app.router
        router.disagg_min_prompt_tokens = THRESHOLD
        live = router.decode.workers[0]
        # A decode worker nobody listens on, chosen first (round robin).
        with trio.socket.socket() as sock:
            await sock.bind(("127.0.0.1", 0))
            dead_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        _, (dead,) = vllm_engines([cluster.prefill_url], [dead_url], client=cluster.client)
        router.decode = WorkerPool([dead, live.engine], policy=RoundRobin(),
                                   failure_threshold=1000)
        live = router.decode.workers[1]
        client = server.openai()
        for _ in range(2):  # round robin: each goes to the dead worker, then the live one
            answer = await in_thread(lambda: client.completions.create(
                model=MODEL, prompt=SHORT, max_tokens=3))
            assert answer.choices[0].finish_reason == "length"
        assert cluster.prefill.stats.requests == 0
        assert live.served_total == 2
        assert router.counters.retries[("decode", "transport_error")] == 2
        await cluster.settled()


def test_serve_defaults_to_disaggregating_every_request_on_every_backend() -> None:
    """Without the flag there is no threshold (None), so nothing refuses SGLang."""
    from trio_disagg._cli import build_parser

    for backend in ["mock", "vllm", "sglang", "trtllm"]:
        args = build_parser().parse_args(["serve", "--backend", backend])
        assert args.disagg_min_prompt_tokens is None


def test_serve_refuses_it_with_sglang(capsys: pytest.CaptureFixture[str]) -> None:
    from trio_disagg._cli import main

    argv = ["serve", "--backend", "sglang", "--prefill", "http://127.0.0.1:1",
            "--decode", "http://127.0.0.1:2", "--disagg-min-prompt-tokens", "64"]
    assert main(argv) == 2
    assert "SGLang decode worker" in capsys.readouterr().err


async def test_a_client_that_leaves_a_decode_only_stream_leaves_nothing_behind() -> None:
    """B5 on the decode-only path: the decode worker's request is aborted, nothing is in
    flight on the router or its keeper, and no prefill ever ran."""
    async with served("vllm") as server:
        cluster = server.cluster
        router = server.app.router
        router.disagg_min_prompt_tokens = THRESHOLD
        body = {"model": MODEL, "prompt": SHORT, "max_tokens": 10000, "stream": True}
        with trio.fail_after(10):
            async with (httpx.AsyncClient(base_url=server.url) as http,
                        http.stream("POST", "/v1/completions", json=body) as response):
                assert response.status_code == 200
                async for _ in response.aiter_raw():
                    break  # the first event: the client leaves
        await cluster.settled()
        assert router.in_flight == 0
        assert cluster.prefill.stats.requests == 0
        assert cluster.decode.stats.aborted == 1


@pytest.mark.parametrize("protocol", ["vllm", "trtllm"])
async def test_a_short_prompt_with_continuous_usage_has_its_prompt_count_on_every_chunk(
    protocol: ProtocolName,
) -> None:
    """vLLM's ``continuous_usage_stats``: every chunk carries the usage so far, the prompt
    count included. The router answers the option from the prefill's count; a prompt sent
    to a decode worker alone has no prefill, and its chunks said ``prompt_tokens: 0`` (and
    a ``total_tokens`` short of it) until the last one."""
    async with served(protocol) as server:
        server.app.router.disagg_min_prompt_tokens = THRESHOLD
        client = server.openai()
        chunks = await in_thread(lambda: list(client.completions.create(
            model=MODEL, prompt=SHORT, max_tokens=3, stream=True,
            extra_body={"stream_options": {"include_usage": True,
                                           "continuous_usage_stats": True}})))
        prompt = count_prompt_tokens({"prompt": SHORT})
        usages = [chunk.usage for chunk in chunks]
        assert [(u.prompt_tokens, u.completion_tokens, u.total_tokens) for u in usages
                if u is not None] == [(prompt, 1, prompt + 1), (prompt, 2, prompt + 2),
                                      (prompt, 3, prompt + 3), (prompt, 3, prompt + 3)]
        await server.cluster.settled()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_B8_a_decode_only_request_reports_the_decode_workers_own_cache_hit(
    stream: bool,
) -> None:
    """No prefill ran and no KV was transferred: the decode worker computed the prompt, so
    its ``cached_tokens`` is a true prefix-cache hit, relayed as the worker counted it
    (not 0: there is no prefill count to correct it from)."""
    async with served("vllm") as server:
        cluster = server.cluster
        server.app.router.disagg_min_prompt_tokens = THRESHOLD * 4
        body = {"prompt": LONG}  # 110 tokens estimated: under the threshold
        warm(cluster.decode.prefix, body)  # the decode worker computed it before
        client = server.openai()

        def ask() -> Any:
            if not stream:
                return client.completions.create(model=MODEL, prompt=LONG, max_tokens=3)
            return list(client.completions.create(
                model=MODEL, prompt=LONG, max_tokens=3, stream=True,
                stream_options={"include_usage": True}))[-1]

        answer = await in_thread(ask)
        assert cluster.prefill.stats.requests == 0
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        assert answer.usage.prompt_tokens_details.cached_tokens == expected_cached(
            body, warm=True) > 0
        await cluster.settled()
