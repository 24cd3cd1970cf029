"""What the HTTP lifecycle tests share (``test_handoff_lifecycle_http``,
``test_abandonment_matrix``): the router's own server on a real port in front of one
protocol's mock workers (:func:`routed`), driven with ``httpx``; a client that hangs up
(:func:`client_leaves`); and the end state every such test checks (:func:`assert_clean`).

Everything runs on 127.0.0.1 with port 0 and the real clock; every wait is bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import trio
from e2e_support import FAST, MODEL, PROMPT, ProtocolName, wait_until
from protocol_support import Cluster, open_cluster

from trio_disagg import CancelWindow, Deadlines, Engine, HandoffStyle
from trio_disagg.engines import (
    Client,
    LatencyModel,
    sglang_engines,
    trtllm_engines,
    vllm_client,
    vllm_engines,
    worker_client,
)
from trio_disagg.server import OpenAIApp, create_app, serve
from trio_disagg.workers import MockWorker, create_mock_worker

#: A long lease: every test checks the KV is freed without waiting for it.
KV_TTL = 120.0
#: SGLang's bootstrap wait: a room left to it would hold its KV for minutes.
BOOTSTRAP_TIMEOUT = 300.0


@attrs.define(eq=False)
class Routed:
    """The router's HTTP server (``http`` is a client of it) and its cluster."""

    http: httpx.AsyncClient
    app: OpenAIApp
    cluster: Cluster[MockWorker]

    @property
    def prefill(self) -> MockWorker:
        return self.cluster.prefill

    @property
    def decode(self) -> MockWorker:
        return self.cluster.decode


@asynccontextmanager
async def routed(
    protocol: ProtocolName,
    *,
    prefill_latency: LatencyModel = FAST,
    decode_latency: LatencyModel = FAST,
    deadlines: Deadlines | None = None,
    cancel_window: CancelWindow | None = None,
) -> AsyncIterator[Routed]:
    """``protocol``'s mock workers, the router in front of them, and its HTTP server.

    ``cancel_window``: the prefill engine's (B10); None keeps the engine's own.
    TensorRT-LLM engines hand off context first (their generation leg is part of the KV
    transfer until it fetched the KV).
    """
    prefill: MockWorker
    decode: MockWorker
    if protocol == "sglang":
        prefill = create_mock_worker("prefill", "sglang", fault_injection=True,
                                     latency=prefill_latency,
                                     bootstrap_port=0, bootstrap_timeout=BOOTSTRAP_TIMEOUT)
        decode = create_mock_worker("decode", "sglang", fault_injection=True,
                                    latency=decode_latency,
                                    bootstrap_timeout=BOOTSTRAP_TIMEOUT)
    else:
        prefill = create_mock_worker("prefill", protocol, fault_injection=True,
                                     latency=prefill_latency,
                                     kv_ttl=KV_TTL)
        decode = create_mock_worker("decode", protocol, fault_injection=True,
                                    latency=decode_latency)

    def engines(prefill_url: str, decode_url: str, client: Client
                ) -> tuple[Sequence[Engine], Sequence[Engine]]:
        if protocol == "vllm":
            return vllm_engines([prefill_url], [decode_url], client=client)
        if protocol == "sglang":
            # the prefill's bootstrap port is known once it is served
            bootstrap_port = getattr(prefill, "bootstrap_port", None)
            return sglang_engines([f"{prefill_url},{bootstrap_port}"], [decode_url],
                                  client=client)
        return trtllm_engines([prefill_url], [decode_url], client=client)

    def style(engine: Any) -> Any:
        if protocol == "trtllm":
            engine.handoff_style = HandoffStyle.CONTEXT_FIRST
        return engine

    def wrap_prefill(engine: Any) -> Any:
        if cancel_window is not None:
            engine.cancel_window = cancel_window
        return style(engine)

    client = vllm_client() if protocol == "vllm" else worker_client()
    async with open_cluster(prefill, decode, client, engines, deadlines=deadlines,
                            wrap_prefill=wrap_prefill, wrap_decode=style) as cluster:
        app = create_app(cluster.router, models=[MODEL], fault_injection=True)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve, app, host="127.0.0.1", port=0,
                                               shutdown_trigger=stop.wait,
                                               graceful_timeout=5.0))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                         timeout=20.0) as http:
                yield Routed(http, app, cluster)
            stop.set()


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, **fields}


async def post(routed: Routed, request_id: str, **fields: Any) -> httpx.Response:
    """One request through the router, read to its end."""
    with trio.fail_after(10):
        return await routed.http.post("/v1/completions", json=body(**fields),
                                      headers={"x-request-id": request_id})


async def client_leaves(routed: Routed, request_id: str, when: Callable[[], Awaitable[None]],
                        **fields: Any) -> None:
    """Send a request and hang up (close the connection) once ``when`` returns, whatever
    the request's state then."""
    async def client() -> None:
        if fields.get("stream") is True:
            async with routed.http.stream("POST", "/v1/completions", json=body(**fields),
                                          headers={"x-request-id": request_id}) as response:
                async for _ in response.aiter_raw():
                    pass
        else:
            await routed.http.post("/v1/completions", json=body(**fields),
                                   headers={"x-request-id": request_id})

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client)
            await when()
            nursery.cancel_scope.cancel()  # the client goes away


async def worker_stats(routed: Routed, url: str) -> dict[str, Any]:
    """A mock worker's ``GET /stats``."""
    with trio.fail_after(5):
        answer: dict[str, Any] = (await routed.http.get(url + "/stats")).json()
    return answer


async def assert_clean(routed: Routed, *, within: float = 5.0) -> None:
    """B5: the router and its keeper have nothing in flight, neither worker has a
    generation request open, and the prefill worker holds no KV block and stranded none,
    within ``within`` seconds.

    Leases are read at scrape time against the clock; none expired here because nothing
    is held any more (held blocks are the only ones a lease can strand later)."""
    cluster = routed.cluster

    def state() -> dict[str, object]:
        return {"router in flight": cluster.router.in_flight,
                "keeper in flight": cluster.keeper.in_flight,
                "prefill": routed.prefill.stats, "decode": routed.decode.stats,
                "kv": routed.prefill.kv.counters(), "rooms": routed.prefill.kv.open_rooms}

    await eventually("nothing in flight, open or held",
                     lambda: cluster.router.in_flight == 0 and cluster.keeper.in_flight == 0
                     and routed.prefill.stats.open == 0 and routed.decode.stats.open == 0
                     and routed.prefill.kv.counters().held_blocks == 0
                     and routed.prefill.kv.open_rooms == 0, seconds=within, state=state)
    with trio.fail_after(5):
        await cluster.router.wait_idle()
        await cluster.keeper.wait_idle()
    for url in (cluster.prefill_url, cluster.decode_url):
        stats = (await worker_stats(routed, url))["stats"]
        assert (stats["open"], stats["running"]) == (0, 0), url
    kv = (await worker_stats(routed, cluster.prefill_url))["kv"]
    assert (kv["held_blocks"], kv["stranded_blocks"], kv["expired"]) == (0, 0, 0)
    assert kv["staged_blocks"] == kv["freed_blocks"]


async def eventually(what: str, predicate: Callable[[], bool], *, seconds: float,
                     state: Callable[[], object] = lambda: None) -> None:
    """Wait up to ``seconds`` for ``predicate``; else fail naming ``what`` (and
    ``state()``, what the test shows of the workers then)."""
    try:
        await wait_until(predicate, seconds=seconds)
    except trio.TooSlowError:
        raise AssertionError(f"not within {seconds:g} s: {what}; state: {state()}") from None


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error
