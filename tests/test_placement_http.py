"""Worker placement (S12) seen from a fleet: a burst of streamed requests through the
router's HTTP server, with the official ``openai`` client, onto one prefill and two decode
mock workers over real sockets.

A sequential handoff (vLLM, TensorRT-LLM) reaches its decode worker only once the prefill
staged the KV; the least-outstanding policy must then see the decodes the requests before
it were given, not the load of the moment the request arrived, or a burst that arrives
while the prefills run lands on one decode worker and leaves the other idle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import attrs
import openai
import pytest
import trio
from e2e_support import FAST, MODEL, PROMPT, ProtocolName, in_thread, wait_until

from trio_disagg import DisaggRouter, TransferKeeper, WorkerPool
from trio_disagg.engines import trtllm_engines, vllm_engines
from trio_disagg.server import create_app, serve
from trio_disagg.workers import MockWorker, create_mock_worker, serve_worker

#: Prefills slow enough that the whole burst arrives before the first KV is staged;
#: decodes long enough that none ends before the last one is placed.
LATENCY = attrs.evolve(FAST, ttft_per_prompt_token=0.004, inter_token_latency=0.01)
BURST = 8


@attrs.define(eq=False)
class Fleet:
    url: str
    router: DisaggRouter
    decodes: list[MockWorker]


@asynccontextmanager
async def fleet(protocol: ProtocolName) -> AsyncIterator[Fleet]:
    prefill = create_mock_worker("prefill", protocol, latency=LATENCY)
    decodes = [create_mock_worker("decode", protocol, latency=LATENCY) for _ in range(2)]
    async with trio.open_nursery() as nursery:
        ports = [await nursery.start(partial(serve_worker, app))
                 for app in (prefill, *decodes)]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        make = vllm_engines if protocol == "vllm" else trtllm_engines
        prefill_engines, decode_engines = make(urls[:1], urls[1:])
        async with TransferKeeper(drain_window=5.0) as keeper:
            router = DisaggRouter(WorkerPool(prefill_engines), WorkerPool(decode_engines),
                                  keeper)
            app = create_app(router, models=[MODEL])
            stop = trio.Event()
            async with trio.open_nursery() as server:
                port = await server.start(partial(serve, app, host="127.0.0.1", port=0,
                                                  shutdown_trigger=stop.wait,
                                                  graceful_timeout=5.0))
                yield Fleet(f"http://127.0.0.1:{port}", router, decodes)
                stop.set()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("protocol", ["vllm", "trtllm"])
async def test_S12_a_burst_is_spread_over_the_decode_workers(protocol: ProtocolName) -> None:
    async with fleet(protocol) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused",
                               max_retries=0, timeout=20.0)
        finishes: list[str | None] = []
        limiter = trio.CapacityLimiter(BURST)

        async def one() -> None:
            def read() -> str | None:
                chunks = list(client.completions.create(
                    model=MODEL, prompt=PROMPT, max_tokens=40, stream=True))
                return chunks[-1].choices[0].finish_reason

            finishes.append(await in_thread(read, limiter))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for _ in range(BURST):
                    nursery.start_soon(one)
            await wait_until(lambda: all(d.stats.running == 0 for d in served.decodes))
            await served.router.wait_idle()
        client.close()
    assert finishes == ["length"] * BURST
    served_by = sorted(decode.stats.completed for decode in served.decodes)
    assert sum(served_by) == BURST
    # least outstanding: four each, give or take the order the prefills finish in
    assert served_by[0] >= BURST // 2 - 1, served_by
    assert served.router.decode.outstanding == 0  # every placement was counted once
