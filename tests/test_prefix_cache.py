"""The mock prefill workers' prefix cache (docs/protocols.md section 5), and the hit rate
prefix-affinity placement gets from it against round-robin (rule S12 in docs/semantics.md;
docs/router.md "Worker selection"; benchmarks/placement.py measures it at scale)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio

import trio_disagg as td
from trio_disagg.mock import LatencyModel, MockPrefillEngine, PrefixCache, mock_cluster

LATENCY = LatencyModel(ttft_per_prompt_token=0.001, inter_token_latency=0.001,
                       kv_transfer_per_token=0.0)
COMMON = " ".join(f"common{i}" for i in range(40))  # 40 tokens: 2 whole 16-token blocks


async def prefill(engine: MockPrefillEngine, request_id: str, prompt: str
                  ) -> tuple[int, float]:
    """One prefill on ``engine``: the ``cached_tokens`` it reports, and the seconds (of the
    autojump clock) until its handoff output."""
    request = td.PreprocessedRequest(request_id=request_id, model="m",
                                     body={"model": "m", "prompt": prompt})
    send, receive = trio.open_memory_channel[td.Annotated[td.LLMEngineOutput]](4)
    start = trio.current_time()
    await engine.generate(request, td.RequestContext(request_id), send)
    elapsed = trio.current_time() - start
    item = receive.receive_nowait()
    assert item.data is not None and item.data.disaggregated_params is not None
    usage = item.data.completion_usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached, elapsed


async def test_a_prompt_prefix_is_cached_on_the_worker_that_computed_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    cluster = mock_cluster(prefill=2, latency=LATENCY)
    first, other = cluster.prefill
    assert await prefill(first, "a", COMMON + " alpha beta") == pytest.approx((0, 0.042))
    # The shared 40 tokens, rounded down to whole blocks: 32 cached, 10 computed.
    assert await prefill(first, "b", COMMON + " gamma delta") == pytest.approx((32, 0.010))
    # Another worker never computed it.
    assert (await prefill(other, "c", COMMON + " gamma delta"))[0] == 0
    # The same 48-token prompt (3 whole blocks) again: at least one token is computed.
    whole = " ".join(f"x{i}" for i in range(48))
    assert (await prefill(other, "d", whole))[0] == 0
    assert await prefill(other, "e", whole) == pytest.approx((32, 0.016))
    assert (first.prefix.lookups, first.prefix.cached_tokens) == (2, 32)
    assert first.prefix.hit_rate == pytest.approx(32 / 84)


def test_the_cache_is_bounded_and_least_recently_used() -> None:
    cache = PrefixCache(block_size=2, capacity_blocks=4)
    a = cache.hashes({"prompt": "a1 a2 a3 a4 a5"})
    b = cache.hashes({"prompt": "b1 b2 b3 b4 b5"})
    assert len(a) == len(b) == 2  # whole blocks only
    cache.insert(a)
    cache.insert(b)
    assert cache.lookup(a, 5) == 4 and len(cache) == 4
    cache.insert(cache.hashes({"prompt": "c1 c2 c3"}))  # one block more: b's tail goes
    assert (cache.peek(a, 5), cache.peek(b, 5), len(cache)) == (4, 2, 4)
    # A chat and a completion with the same words share their blocks.
    chat = {"messages": [{"role": "system", "content": "a1 a2"},
                         {"role": "user", "content": "a3 a4 a5"}]}
    assert cache.hashes(chat) == a
    assert PrefixCache(2, 0).hashes({"prompt": "a1 a2 a3"}) == []  # disabled
    with pytest.raises(ValueError, match="prefix_cache_blocks"):
        PrefixCache(16, -1)


def workload(seed: int) -> list[dict[str, Any]]:
    """32 chat requests over 4 system prompts of 64 tokens (4 blocks each)."""
    rng = random.Random(seed)
    systems = [" ".join(f"s{p}w{i}" for i in range(64)) for p in range(4)]
    return [{"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": rng.choice(systems)},
        {"role": "user", "content": " ".join(f"u{n}w{i}" for i in range(rng.randint(5, 20)))}]}
        for n in range(32)]


async def hit_rate(policy: td.SelectionPolicy, bodies: list[dict[str, Any]]
                   ) -> tuple[float, dict[str, set[str]]]:
    """The reported cached / prompt tokens of ``bodies`` sent one after the other, and
    which prefill workers each system prompt reached."""
    # 8 blocks per worker: room for 2 of the 4 system prompts (and some user blocks).
    cluster = mock_cluster(prefill=4, latency=LATENCY, default_max_tokens=2,
                           prefix_cache_blocks=8)
    cached = prompt = 0
    placed: dict[str, set[str]] = {}
    async with td.TransferKeeper() as keeper:
        router = td.DisaggRouter(td.WorkerPool(cluster.prefill, policy=policy),
                                 td.WorkerPool(cluster.decode), keeper)
        for i, body in enumerate(bodies):
            request = td.PreprocessedRequest(request_id=f"r{i}", model="m", body=body,
                                             max_tokens=2)
            async with trio.open_nursery() as nursery:
                stream = await router.stream(nursery, request, td.RequestContext(f"r{i}"))
                async with stream.outputs:
                    items = [item async for item in stream.outputs]
            assert sum(len(item.data.token_ids) for item in items if item.data) == 2
            details = stream.prompt_tokens_details
            assert details is not None and details.cached_tokens is not None
            assert stream.prompt_tokens is not None and stream.prefill_worker is not None
            cached += details.cached_tokens
            prompt += stream.prompt_tokens
            placed.setdefault(body["messages"][0]["content"], set()).add(stream.prefill_worker)
        await keeper.wait_idle()
    assert cluster.counters().held_blocks == 0
    return cached / prompt, placed


async def test_S12_prefix_affinity_beats_round_robin_on_the_prefix_cache_hit_rate(
    autojump_clock: trio.abc.Clock,
) -> None:
    bodies = workload(seed=7)
    round_robin, spread = await hit_rate(td.RoundRobin(), bodies)
    affinity, placed = await hit_rate(td.PrefixAffinity(), bodies)
    assert all(len(workers) == 1 for workers in placed.values())  # one worker per prompt
    assert all(len(workers) > 1 for workers in spread.values())
    assert affinity > round_robin
    assert affinity > 0.5  # every request after each prompt's first hits its 64 tokens
