"""Worker placement (S12) seen from a fleet: a burst of streamed requests through the
router's HTTP server, with the official ``openai`` client, onto one prefill and two decode
mock workers over real sockets.

A sequential handoff (vLLM, TensorRT-LLM) reaches its decode worker only once the prefill
staged the KV; the least-outstanding policy must then see the decodes the requests before
it were given, not the load of the moment the request arrived, or a burst that arrives
while the prefills run lands on one decode worker and leaves the other idle. A bootstrap
handoff (SGLang) chooses its decode worker on arrival: the requests of a burst routed in
one scheduler batch must see each other's choices, not only the decode legs that started.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial

import attrs
import openai
import pytest
import trio
from e2e_support import FAST, MODEL, PROMPT, ProtocolName, in_thread, wait_until
from protocol_support import completion

from trio_disagg import (
    DisaggRouter,
    Engine,
    FinishKind,
    RequestContext,
    TransferKeeper,
    WorkerPool,
)
from trio_disagg.engines import sglang_engines, trtllm_engines, vllm_engines
from trio_disagg.server import create_app, serve
from trio_disagg.workers import MockSglangWorker, MockWorker, create_mock_worker, serve_worker

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
    prefill = create_mock_worker("prefill", protocol, latency=LATENCY,
                                 bootstrap_port=0 if protocol == "sglang" else None)
    decodes = [create_mock_worker("decode", protocol, latency=LATENCY) for _ in range(2)]
    async with trio.open_nursery() as nursery:
        ports = [await nursery.start(partial(serve_worker, app))
                 for app in (prefill, *decodes)]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        prefill_engines: Sequence[Engine]
        decode_engines: Sequence[Engine]
        if protocol == "sglang":  # the prefill's bootstrap port is known once it serves
            assert isinstance(prefill, MockSglangWorker)
            prefill_engines, decode_engines = sglang_engines(
                [f"{urls[0]},{prefill.bootstrap_port}"], urls[1:])
        elif protocol == "trtllm":
            prefill_engines, decode_engines = trtllm_engines(urls[:1], urls[1:])
        else:
            prefill_engines, decode_engines = vllm_engines(urls[:1], urls[1:])
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


@pytest.mark.parametrize("protocol", ["vllm", "trtllm", "sglang"])
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


@pytest.mark.parametrize("protocol", ["vllm", "trtllm", "sglang"])
async def test_S12_requests_routed_in_one_batch_see_each_others_decode_choice(
    protocol: ProtocolName,
) -> None:
    """Requests routed together (a burst read in one scheduler batch) are each counted on
    their decode worker as it is chosen, before any of their decode legs starts."""
    async with fleet(protocol) as served:
        finishes: list[FinishKind | None] = []

        async def one(i: int) -> None:
            async with trio.open_nursery() as nursery:
                stream = await served.router.stream(
                    nursery, completion(f"batch-{i}", max_tokens=40), RequestContext(f"b{i}"))
                with stream.outputs:
                    items = [item async for item in stream.outputs]
            last = items[-1].data
            finishes.append(None if last is None or last.finish_reason is None
                            else last.finish_reason.kind)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(BURST):
                    nursery.start_soon(one, i)
            await served.router.wait_idle()
    assert finishes == [FinishKind.LENGTH] * BURST
    served_by = sorted(decode.stats.completed for decode in served.decodes)
    assert sum(served_by) == BURST and served_by[0] >= BURST // 2 - 1, served_by
    assert served.router.decode.outstanding == 0
