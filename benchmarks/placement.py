"""Prefix-aware prefill placement: the prefix-cache hit rate of ``prefix-affinity`` against
``round-robin`` on the same seeded workload (issue 11; docs/router.md "Worker selection").

Run it with ``uv run python benchmarks/placement.py [--quick]`` (see ``--help`` for the
sizes).

The workload: ``--system-prompts`` distinct system prompts of ``--system-tokens`` tokens
each, shared by ``--requests`` chat requests whose user messages all differ (20 to 80
tokens), each request's system prompt drawn at random; all fixed by ``--seed``. It runs
through :class:`~trio_disagg.DisaggRouter` over ``--workers`` in-process mock prefill
engines (and 2 decode engines), ``--concurrency`` requests at a time, once with the
prefill pool's policy :class:`~trio_disagg.RoundRobin` and once with
:class:`~trio_disagg.PrefixAffinity`. The mock prefill engines model a prefix cache per
worker (docs/protocols.md section 5): a request's ``cached_tokens`` are its leading
prompt tokens whose KV blocks that worker already computed, and its prefill compute time
covers only the others. Each worker's cache holds ``--prefix-cache-blocks`` blocks of 16
tokens (default 128: 2,048 tokens, less than the 3,200 of the 8 system prompts, as a GPU's
KV cache is shared with the running requests' KV): the regime where placement matters.
With room for every prompt on every worker (``--prefix-cache-blocks 4096``), round-robin
catches up once each worker has missed each prompt once.

For each policy the script prints the hit rate (cached prompt tokens / prompt tokens, from
the ``cached_tokens`` the prefill workers reported to the router), the modelled prefill
compute time (``ttft_per_prompt_token`` x uncached tokens, summed), the modelled makespan
of the run, and how many requests each prefill worker got; then the ratios. Time is the
mock clock's (trio's ``MockClock`` with autojump): the figures are the latency model's,
not this machine's, and repeat exactly. Nothing is asserted on them; the script exits
non-zero only if a request fails or loses tokens.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from typing import Any

import attrs
import trio
import trio.testing

import trio_disagg as td
from trio_disagg.mock import LatencyModel, mock_cluster

MODEL = "mock"
TOKENS = 4  # decoded tokens per request: the decode is not what this measures
LATENCY = LatencyModel(ttft_per_prompt_token=0.0002, inter_token_latency=0.01,
                       kv_transfer_per_token=0.00002)


def words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(100_000)}" for _ in range(count))


def workload(seed: int, requests: int, system_prompts: int, system_tokens: int
             ) -> list[dict[str, Any]]:
    """The chat bodies, fixed by ``seed``."""
    rng = random.Random(seed)
    systems = [words(rng, system_tokens) for _ in range(system_prompts)]
    return [{"model": MODEL, "max_tokens": TOKENS, "messages": [
        {"role": "system", "content": rng.choice(systems)},
        {"role": "user", "content": words(rng, rng.randint(20, 80))}]}
        for _ in range(requests)]


@attrs.define
class Result:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    makespan: float = 0.0
    per_worker: Counter[str] = attrs.field(factory=Counter)
    failed: list[str] = attrs.field(factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def compute(self) -> float:
        """Modelled prefill compute, in seconds: the uncached prompt tokens' TTFT."""
        return LATENCY.time_to_first_token(self.prompt_tokens - self.cached_tokens)


async def one(router: td.DisaggRouter, index: int, body: dict[str, Any],
              result: Result) -> None:
    request = td.PreprocessedRequest(request_id=f"req-{index}", model=MODEL, body=body,
                                     max_tokens=TOKENS, stream=True)
    tokens = 0
    last: td.Annotated[td.LLMEngineOutput] | None = None
    async with trio.open_nursery() as nursery:
        stream = await router.stream(nursery, request, td.RequestContext(request.request_id))
        async with stream.outputs:
            async for last in stream.outputs:
                tokens += len(last.data.token_ids) if last.data is not None else 0
    finish = last.data.finish_reason if last is not None and last.data is not None else None
    details = stream.prompt_tokens_details
    if (tokens != TOKENS or finish is None or finish.kind is not td.FinishKind.LENGTH
            or details is None or details.cached_tokens is None
            or stream.prompt_tokens is None or stream.prefill_worker is None):
        result.failed.append(f"{request.request_id}: {tokens} tokens, finish {finish}")
        return
    result.prompt_tokens += stream.prompt_tokens
    result.cached_tokens += details.cached_tokens
    result.per_worker[stream.prefill_worker] += 1


async def run(policy: td.SelectionPolicy, bodies: list[dict[str, Any]],
              args: argparse.Namespace) -> Result:
    """The workload through a router whose prefill pool uses ``policy``."""
    result = Result()
    cluster = mock_cluster(prefill=args.workers, decode=2, latency=LATENCY,
                           default_max_tokens=TOKENS,
                           prefix_cache_blocks=args.prefix_cache_blocks)
    async with td.TransferKeeper() as keeper:
        router = td.DisaggRouter(td.WorkerPool(cluster.prefill, policy=policy),
                                 td.WorkerPool(cluster.decode), keeper)
        queue = iter(enumerate(bodies))

        async def client() -> None:
            for index, body in queue:
                await one(router, index, body, result)

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(args.concurrency):
                nursery.start_soon(client)
        result.makespan = trio.current_time() - start
        await keeper.wait_idle()
    # The workers' own counters agree with what they reported to the router.
    assert sum(engine.prefix.cached_tokens for engine in cluster.prefill) \
        == result.cached_tokens or result.failed
    assert cluster.counters().held_blocks == 0, cluster.counters()
    return result


async def main(args: argparse.Namespace) -> int:
    bodies = workload(args.seed, args.requests, args.system_prompts, args.system_tokens)
    print(f"placement: {args.requests} chat requests, {args.system_prompts} system prompts "
          f"of {args.system_tokens} tokens + a user message of 20-80 tokens each (seed "
          f"{args.seed}), over {args.workers} mock prefill workers (16-token KV blocks, "
          f"a prefix cache each), concurrency {args.concurrency}; "
          f"{LATENCY.ttft_per_prompt_token * 1e3:g} ms of prefill per uncached token; "
          f"mock clock")
    policies: dict[str, td.SelectionPolicy] = {
        "round-robin": td.RoundRobin(), "prefix-affinity": td.PrefixAffinity()}
    results = {name: await run(policy, bodies, args)
               for name, policy in policies.items()}
    print(f"  {'policy':<16} {'hit rate':>8} {'cached/prompt tokens':>22} "
          f"{'prefill compute':>15} {'makespan':>9}  requests per prefill worker")
    for name, r in results.items():
        spread = " ".join(str(r.per_worker[f"prefill-{i}"]) for i in range(args.workers))
        print(f"  {name:<16} {r.hit_rate:>8.1%} {r.cached_tokens:>10,}/{r.prompt_tokens:<11,} "
              f"{r.compute:>13.2f} s {r.makespan:>7.2f} s  {spread}")
    rr, pa = results["round-robin"], results["prefix-affinity"]
    print(f"prefix-affinity / round-robin: hit rate {pa.hit_rate / rr.hit_rate:.2f}x"
          if rr.hit_rate else "round-robin had no hit", end="")
    print(f", prefill compute {pa.compute / rr.compute:.2f}x, "
          f"makespan {pa.makespan / rr.makespan:.2f}x")
    failed = [f for r in results.values() for f in r.failed]
    for failure in failed[:10]:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failed else 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (64 requests)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prefix-cache-blocks", type=int, default=128,
                        help="each prefill worker's prefix cache, in 16-token blocks")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = 64
    return args


if __name__ == "__main__":
    sys.exit(trio.run(main, parse(), clock=trio.testing.MockClock(autojump_threshold=0)))
