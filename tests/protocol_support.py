"""What the router-level protocol tests share: a protocol's mock workers and router wired
together over real sockets (:class:`Cluster`, :func:`open_cluster`, the common part of
``vllm_cluster``, ``sglang_cluster`` and ``trtllm_cluster``), a decode engine held at a
gate (:class:`Gated`), and the helpers that build, route and read requests.

Everything runs on 127.0.0.1 with port 0 and the real clock; every wait is bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Generic, TypeVar

import attrs
import trio
from e2e_support import MODEL, PROMPT, wait_until
from prometheus_client.parser import text_string_to_metric_families

from trio_disagg import (
    Annotated,
    Deadlines,
    DisaggRouter,
    Engine,
    HandoffStyle,
    LLMEngineOutput,
    PreprocessedRequest,
    RequestContext,
    RequestStream,
    TransferKeeper,
    TrioDisaggError,
    WorkerPool,
)
from trio_disagg.engines import Client
from trio_disagg.workers import MockWorker, serve_worker

Item = Annotated[LLMEngineOutput]
W = TypeVar("W", bound=MockWorker)

#: Builds a protocol's prefill and decode engines from the two workers' URLs.
EngineFactory = Callable[[str, str, Client],
                         tuple[Sequence[Engine], Sequence[Engine]]]


class Gated:
    """A decode engine whose first request waits at the gate before reaching the worker:
    the window between the handoff and the decode worker's acceptance (for SGLang: the
    decode dispatch is pending while the prefill runs)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = engine.name
        self.handoff_style: HandoffStyle = engine.handoff_style
        self.bootstrap_host: str | None = None
        self.bootstrap_port: int | None = None
        self.entered = trio.Event()
        self.gate = trio.Event()
        self.calls = 0

    async def generate(  # noqa: ASYNC128 (the wrapped engine calls task_status.started())
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            await self.gate.wait()
        await self.engine.generate(request, context, send_channel, task_status=task_status)


def gating() -> tuple[list[Gated], Callable[[Any], Gated]]:
    """A ``wrap_decode`` for the cluster factories, and the list its one :class:`Gated`
    lands in."""
    gated: list[Gated] = []

    def wrap(engine: Engine) -> Gated:
        gated.append(Gated(engine))
        return gated[0]

    return gated, wrap


@attrs.define(eq=False)
class Cluster(Generic[W]):
    prefill: W
    decode: W
    prefill_url: str
    decode_url: str
    client: Client
    keeper: TransferKeeper
    router: DisaggRouter
    decode_scope: trio.CancelScope  # cancelling it kills the decode worker

    async def settled(self) -> None:
        """B5: no request, drain or worker request left; no KV block held, no bootstrap
        room open (rooms are SGLang's: always none for the other protocols)."""
        with trio.fail_after(5):
            await self.router.wait_idle()
            await self.keeper.wait_idle()
            await wait_until(lambda: self.prefill.stats.running == 0
                             and self.decode.stats.running == 0
                             and self.prefill.kv.counters().held_blocks == 0
                             and self.prefill.kv.open_rooms == 0)
        assert self.router.in_flight == self.keeper.in_flight == 0


async def _serve_in(scope: trio.CancelScope, app: MockWorker, *,
                    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    with scope:
        await serve_worker(app, task_status=task_status)


@asynccontextmanager
async def open_cluster(
    prefill: W,
    decode: W,
    client: Client,
    engines: EngineFactory,
    *,
    deadlines: Deadlines | None = None,
    prefill_url: str | None = None,
    wrap_prefill: Callable[[Any], Any] | None = None,
    wrap_decode: Callable[[Any], Any] | None = None,
) -> AsyncIterator[Cluster[W]]:
    """Serve ``prefill`` and ``decode`` on ports of their own (the decode one in a scope
    that kills it), build the engines with ``engines`` over ``client`` (``prefill_url``
    replaces the prefill worker's URL; ``wrap_*`` wrap the engines) and route with them."""
    decode_scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        prefill_port = await nursery.start(partial(serve_worker, prefill))
        decode_port = await nursery.start(partial(_serve_in, decode_scope, decode))
        urls = (prefill_url or f"http://127.0.0.1:{prefill_port}",
                f"http://127.0.0.1:{decode_port}")
        async with client:
            prefill_engines, decode_engines = engines(urls[0], urls[1], client)
            prefill_engine: Any = prefill_engines[0]
            decode_engine: Any = decode_engines[0]
            if wrap_prefill is not None:
                prefill_engine = wrap_prefill(prefill_engines[0])
            if wrap_decode is not None:
                decode_engine = wrap_decode(decode_engines[0])
            async with TransferKeeper(drain_window=5.0) as keeper:
                router = DisaggRouter(
                    WorkerPool([prefill_engine], failure_threshold=1000),
                    WorkerPool([decode_engine], failure_threshold=1000),
                    keeper, deadlines=deadlines,
                )
                yield Cluster(prefill, decode, urls[0], urls[1], client, keeper, router,
                              decode_scope)
        nursery.cancel_scope.cancel()


def completion(rid: str, *, max_tokens: int = 5, **fields: Any) -> PreprocessedRequest:
    body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens}
    body.update(fields)
    return PreprocessedRequest(request_id=rid, model=MODEL, body=body, max_tokens=max_tokens,
                               stream=body.get("stream") is True)


async def run(cluster: Cluster[Any], request: PreprocessedRequest
              ) -> tuple[RequestStream, list[Item]]:
    """Route ``request`` and read its whole stream."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            stream = await cluster.router.stream(nursery, request,
                                                 RequestContext(request.request_id))
            with stream.outputs:
                items = [item async for item in stream.outputs]
    return stream, items


async def refusal(cluster: Cluster[Any], request: PreprocessedRequest) -> TrioDisaggError:
    """The error ``router.stream`` raises for ``request``."""
    error: TrioDisaggError | None = None
    with trio.fail_after(10):
        try:
            async with trio.open_nursery() as nursery:
                await cluster.router.stream(nursery, request,
                                            RequestContext(request.request_id))
        except* TrioDisaggError as group:
            (error,) = group.exceptions  # type: ignore[assignment]
    assert error is not None, "the request was not refused"
    return error


def texts(items: list[Item]) -> list[str]:
    return [item.data.text or "" for item in items if item.data is not None]


def tokens(items: list[Item]) -> list[str]:
    """The text of each chunk the decode worker streamed (one token each from the mock
    workers): an item is what one socket read brought, so it may carry several, its
    ``choices``."""
    found: list[str] = []
    for item in items:
        data = item.data
        if data is None:
            continue
        if not data.choices:
            found.append(data.text or "")
            continue
        for choice in data.choices:
            text = choice.get("text")
            if text is None:
                part = choice.get("delta") or choice.get("message") or {}
                text = part.get("content")
            found.append(text or "")
    return found


def metric_samples(text: str) -> dict[str, float]:
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples}
