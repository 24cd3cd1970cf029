"""What the protocol tests share: the request every test sends, the mock workers' prefix-cache
hit for it, bounded waits, and end to end serving: :func:`served` starts a protocol's mock
workers, the router and its HTTP server (the router's real ``serve``) on 127.0.0.1 with
port 0, for the official ``openai`` client or plain ``httpx``.

The clusters themselves (``vllm_cluster``, ``sglang_cluster``, ``trtllm_cluster``) stay in
their protocol's test module; :func:`served` imports that module when it is first asked
for the protocol, so the protocol modules can import this one.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any, Literal, Protocol, TypeVar

import attrs
import openai
import trio

from trio_disagg.engines import LatencyModel, PrefixCache, count_prompt_tokens
from trio_disagg.server import OpenAIApp, create_app, serve
from trio_disagg.workers import MockWorker

T = TypeVar("T")

#: The protocols with mock workers, and each one's test module and cluster factory.
ProtocolName = Literal["vllm", "sglang", "trtllm"]
PROTOCOLS: tuple[ProtocolName, ...] = ("vllm", "sglang", "trtllm")

MODEL = "mock-model"
PROMPT = " ".join(f"word{i}" for i in range(45))  # 45 tokens: 3 blocks, a partial cache hit
PROMPT_TOKENS = 45
#: A chat of that prompt.
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]
FAST = LatencyModel(ttft_per_prompt_token=0.0001, inter_token_latency=0.0005,
                    kv_transfer_per_token=0.0001)
#: Tokens slow enough for a client to hang up mid-stream.
SLOW_TOKENS = attrs.evolve(FAST, inter_token_latency=0.02)


def expected_cached(body: dict[str, Any], *, warm: bool = False) -> int:
    """The prefill worker's prefix-cache hit for ``body`` (16-token blocks): 0 the first
    time the worker sees the prompt; once ``warm`` (the worker computed the same prompt
    before), its whole blocks, leaving at least one token to compute."""
    return (count_prompt_tokens(body) - 1) // 16 * 16 if warm else 0


def warm(cache: PrefixCache, body: dict[str, Any]) -> None:
    """Put ``body``'s prompt in a worker's prefix cache, as a prefill of it would."""
    cache.insert(cache.hashes(body))


async def wait_until(predicate: Callable[[], bool], *, seconds: float = 5.0) -> None:
    with trio.fail_after(seconds):
        for _ in range(100_000):
            if predicate():
                return
            await trio.sleep(0.002)


async def banner_port(process: trio.Process) -> int:
    """The port in the first line a ``trio-disagg`` command prints (its banner)."""
    assert process.stdout is not None
    banner = b""
    while b"\n" not in banner:
        data = await process.stdout.receive_some()
        assert data, "the command exited before it printed its banner"
        banner += data
    match = re.search(rb"http://127\.0\.0\.1:(\d+)", banner)
    assert match, banner
    return int(match.group(1))


async def in_thread(fn: Callable[[], T], limiter: trio.CapacityLimiter | None = None) -> T:
    """Run a blocking ``openai`` call in a worker thread, bounded."""
    with trio.fail_after(20):
        return await trio.to_thread.run_sync(fn, limiter=limiter)


class Cluster(Protocol):
    """What every protocol module's ``Cluster`` offers the end to end tests."""

    @property
    def prefill(self) -> MockWorker: ...

    @property
    def decode(self) -> MockWorker: ...

    @property
    def prefill_url(self) -> str: ...

    @property
    def decode_url(self) -> str: ...

    async def settled(self) -> None:
        """B5: nothing left in flight, no KV held (and the protocol's own extras)."""


@attrs.define(eq=False)
class Served:
    url: str
    app: OpenAIApp
    cluster: Cluster

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=20.0)


def cluster_factory(protocol: ProtocolName) -> Callable[..., AbstractAsyncContextManager[Any]]:
    """``vllm_cluster`` from ``test_vllm``, and so on (imported here, on first use)."""
    module = importlib.import_module(f"test_{protocol}")
    factory: Callable[..., AbstractAsyncContextManager[Any]] = getattr(
        module, f"{protocol}_cluster")
    return factory


@asynccontextmanager
async def served(protocol: ProtocolName, **options: Any) -> AsyncIterator[Served]:
    """``protocol``'s mock workers and router (``options`` go to its cluster factory),
    served over HTTP by the router's own server."""
    async with cluster_factory(protocol)(**options) as cluster:
        app = create_app(cluster.router, models=[MODEL], fault_injection=True)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve, app, host="127.0.0.1", port=0,
                                               shutdown_trigger=stop.wait,
                                               graceful_timeout=5.0))
            yield Served(f"http://127.0.0.1:{port}", app, cluster)
            stop.set()
