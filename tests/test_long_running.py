"""B5 over many requests: a router left up serves request after request, of every handoff
style, fault and client behaviour, and keeps nothing per request once the requests are
over: no table, counter or object grows with the requests served, only with those in
flight.

Two rounds of the same mix on one keeper and one router per handoff style: after each,
once every lease and timeout has run out, nothing is in flight, held or open, and the
second round leaves no more objects behind than the first. The same over HTTP: mock vLLM
workers, whose decode streams their readers read themselves (a pulled leg), behind the
router's own server, and the library router over those engines.
"""

from __future__ import annotations

import gc
import logging
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx  # noqa: ASYNC127 (the clients of the router's server)
import pytest
import trio
from e2e_support import MODEL, PROMPT, PROTOCOLS, ProtocolName, served

from trio_disagg import (
    Deadlines,
    DisaggRouter,
    HandoffStyle,
    PreprocessedRequest,
    RequestContext,
    RoutingHints,
    SessionAffinity,
    TransferKeeper,
    TrioDisaggError,
    WorkerPool,
)
from trio_disagg.mock import LatencyModel, MockCluster, mock_cluster

LATENCY = LatencyModel(ttft_per_prompt_token=0.0005, inter_token_latency=0.002,
                       kv_transfer_per_token=0.0001)
#: No fault, then one of each kind the mocks inject (the stalls end at a deadline).
FAULTS = [None, None, None, "prefill_fail_before_handoff", "prefill_fail_after_handoff",
          "prefill_error_finish", "prefill_cancelled_finish", "prefill_stall", "prefill_reset",
          "prefill_reject", "eos_first_token", "decode_fail_before_first_token",
          "decode_error_at:1", "decode_stall", "decode_stall_at:1", "decode_reset_at:1",
          "decode_reject"]
#: What the client does: read to the end, leave, close its stream early, stop or kill.
ACTIONS = ["read", "read", "leave", "close", "stop", "kill"]
REQUESTS = 60  # per router and round


async def client(router: DisaggRouter, rng: random.Random, n: int,
                 faults: list[str | None] = FAULTS) -> None:
    body = {"model": "m", "prompt": f"prompt {n} " + "w " * rng.randint(1, 40),
            "max_tokens": 3, "fault": rng.choice(faults)}
    request = PreprocessedRequest(request_id=f"r{n}", model="m", body=body, max_tokens=3,
                                  stream=True, routing=RoutingHints(session_id=f"s{n}"))
    context = RequestContext(request.request_id)
    action, when = rng.choice(ACTIONS), rng.random() * 0.03
    with trio.move_on_after(when if action == "leave" else math.inf):
        try:
            async with trio.open_nursery() as nursery:
                if action in ("stop", "kill"):
                    nursery.start_soon(_stop_later, context, when, action == "kill")
                stream = await router.stream(nursery, request, context)
                async with stream.outputs:
                    async for _ in stream.outputs:
                        if action == "close":
                            break
                nursery.cancel_scope.cancel()
        except* TrioDisaggError:
            pass


async def _stop_later(context: RequestContext, when: float, kill: bool) -> None:
    await trio.sleep(when)
    context.kill() if kill else context.stop_generating()


def leftovers(keeper: TransferKeeper, routers: list[tuple[MockCluster, DisaggRouter]]
              ) -> list[object]:
    """Whatever is still in flight, held or open, by name; empty when nothing is."""
    found: list[object] = [("keeper", keeper.in_flight)] if keeper.in_flight else []
    for cluster, router in routers:
        kv = cluster.counters()
        rooms = sum(engine.kv.open_rooms for engine in cluster.prefill)
        for name, value in [("in flight", router.in_flight), ("held blocks", kv.held_blocks),
                            ("prefill outstanding", router.prefill.outstanding),
                            ("decode outstanding", router.decode.outstanding),
                            ("rooms", rooms)]:
            if value:
                found.append((router.prefill.workers[0].engine.handoff_style, name, value))
    return found


@pytest.fixture
def quiet() -> Iterator[None]:
    """No log records: pytest keeps every one it captures, which would count as growth."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.usefixtures("quiet")
async def test_nothing_grows_with_the_requests_served(autojump_clock: trio.abc.Clock) -> None:
    rng = random.Random(13)
    deadlines = Deadlines(prefill=1, handoff=1, decode_idle=1, terminal_hold=1, transfer=5)
    counts = []
    async with TransferKeeper() as keeper:
        routers = []
        for style in HandoffStyle:
            cluster = mock_cluster(2, 2, style=style, latency=LATENCY, kv_ttl=3.0,
                                   bootstrap_timeout=3.0)
            routers.append((cluster, DisaggRouter(
                WorkerPool(cluster.prefill, policy=SessionAffinity()),
                WorkerPool(cluster.decode), keeper, deadlines=deadlines)))
        for round_ in range(3):  # a first round warms up (imports, caches, the pacer)
            async with trio.open_nursery() as nursery:
                for n in range(REQUESTS):
                    for _, router in routers:
                        nursery.start_soon(client, router, rng, round_ * REQUESTS + n)
            await keeper.wait_idle()
            await trio.sleep(30)  # past every lease, bootstrap timeout and cool-down
            assert leftovers(keeper, routers) == []
            if round_:
                gc.collect()
                counts.append(len(gc.get_objects()))  # (containers: what tables are made of)
    # 180 requests a round: one object per request left behind would show 180.
    assert counts[1] - counts[0] < 18, counts


# --- over HTTP: the pulled decode path ------------------------------------------------------

#: The request's objects, none of which may outlive it.
PER_REQUEST = {"RequestContext", "PullSlot", "SseSource", "WorkerResponse", "GatedOutputs",
               "Gatekeeper", "SseReader"}
#: What an HTTP client does (read to the end, leave mid-stream, or ask for no stream), the
#: decode worker's fault (a stall runs into the decode-idle deadline), and what the client
#: sees: its events (4 tokens and [DONE]), its completion tokens, or an error event.
HTTP_MIX = [("read", None, "5"), ("read", None, "5"), ("leave", None, "left"),
            ("json", None, "4"), ("read", "decode_stall_at:1", "error"),
            ("read", "decode_reset_at:1", "error"), ("read", "decode_error_at:1", "error")]
#: The library's clients' faults over HTTP (none that waits for a deadline).
LIBRARY_FAULTS: list[str | None] = [None, None, "decode_reset_at:1", "decode_error_at:1",
                                    "prefill_reset"]


async def http_client(client: httpx.AsyncClient, url: str, n: int) -> None:
    """One request of the mix; its client sees what it should."""
    action, fault, expected = HTTP_MIX[n % len(HTTP_MIX)]
    assert await http_request(client, url, n, action, fault) == expected, (action, fault)


async def http_request(client: httpx.AsyncClient, url: str, n: int, action: str,
                       fault: str | None) -> str:
    body: dict[str, object] = {"model": MODEL, "prompt": f"{PROMPT} {n}", "max_tokens": 4,
                               "stream": action != "json"}
    if fault is not None:
        body["fault"] = fault
    if action == "json":
        return str((await client.post(url, json=body)).json()["usage"]["completion_tokens"])
    async with client.stream("POST", url, json=body) as response:
        events = []
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events.append(line)
                if action == "leave":
                    return "left"
    return "error" if any('"error"' in event for event in events) else str(len(events))


def request_objects() -> dict[str, int]:
    gc.collect()
    found = [type(o).__name__ for o in gc.get_objects() if type(o).__name__ in PER_REQUEST]
    return {name: found.count(name) for name in set(found)}


def task_names() -> list[str]:
    """The tasks running, but the servers' connections' (a keep-alive connection's is
    left to its server: the router's pool is checked on its own) and the mock workers'
    token pacer (started with the first request)."""
    names: list[str] = []
    root = trio.lowlevel.current_root_task()
    assert root is not None
    tasks = [root]
    while tasks:
        task = tasks.pop()
        if not task.name.endswith(("Server.handle", "mock pacer")):
            names.append(task.name)
        tasks += [child for nursery in task.child_nurseries for child in nursery.child_tasks]
    return sorted(names)


@pytest.mark.usefixtures("quiet")
async def test_nothing_grows_with_the_requests_served_over_http() -> None:
    """B5 with the decode worker read by the stream's reader: completed, left mid-stream,
    stalled into the decode-idle deadline, reset, failed, stopped, killed and closed
    requests leave no request object, task or half-read connection behind."""
    deadlines = Deadlines(prefill=2, handoff=2, decode_idle=0.25, terminal_hold=2, transfer=5)
    with trio.fail_after(20):
        async with served("vllm", deadlines=deadlines) as server:
            cluster: Any = server.cluster  # test_vllm's, with its router and worker client
            tasks = task_names()
            async with httpx.AsyncClient(timeout=10) as http, trio.open_nursery() as nursery:
                for n in range(35):
                    nursery.start_soon(http_client, http, server.url + "/v1/completions", n)
            rng = random.Random(14)
            async with trio.open_nursery() as nursery:  # the library's, stop and kill too
                for n in range(30):
                    nursery.start_soon(client, cluster.router, rng, n, LIBRARY_FAULTS)
            await cluster.settled()
            assert request_objects() == {}
            # Every connection back in the pool is idle: none kept half-read.
            assert cluster.client.connections_open == cluster.client.connections_idle
            assert task_names() == tasks



@contextmanager
def cyclic_garbage() -> Iterator[list[str]]:
    """The project's objects a garbage collection finds unreachable (in a reference cycle,
    or held by one) among those made in the block, by type; the collector is off in it."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept to look at
    found: list[str] = []
    try:
        yield found
        gc.collect()
        found += sorted({type(o).__qualname__ for o in gc.garbage
                         if type(o).__module__.startswith("trio_disagg.")})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.usefixtures("quiet")
async def test_a_served_request_is_freed_at_once_not_by_the_garbage_collector(
        protocol: ProtocolName) -> None:
    """P3, P4a: a request streamed to its end, or answered whole, over HTTP leaves no
    reference cycle behind: its objects (the server's connection and its parser, the
    worker responses and theirs, the contexts, the gate, the handoff owner) are freed by
    their reference counts as it ends, not kept until a garbage collection walks them."""
    with trio.fail_after(20):
        async with served(protocol) as server:
            cluster: Any = server.cluster
            url = server.url + "/v1/completions"
            async with httpx.AsyncClient(timeout=10) as http:
                for n in range(2):  # warm-up: imports, caches, the pacer
                    await http_request(http, url, n, "read", None)
                with cyclic_garbage() as cyclic:
                    for n in range(6):
                        await http_request(http, url, n, ("read", "json")[n % 2], None)
                    await cluster.settled()
    assert cyclic == []


@pytest.mark.parametrize("style", list(HandoffStyle))
async def test_a_library_request_is_freed_at_once_not_by_the_garbage_collector(
        style: HandoffStyle) -> None:
    """The same for the library's router over the in-process mock engines, in each
    handoff style (a decode leg kept in the keeper too, G9)."""
    async with TransferKeeper() as keeper:
        cluster = mock_cluster(1, 1, style=style)
        router = DisaggRouter(WorkerPool(cluster.prefill), WorkerPool(cluster.decode), keeper)
        for n in range(2):  # warm-up
            await read_to_the_end(router, n)
        with cyclic_garbage() as cyclic:
            for n in range(6):
                await read_to_the_end(router, n)
            await keeper.wait_idle()
    assert cyclic == []


async def read_to_the_end(router: DisaggRouter, n: int) -> None:
    request = PreprocessedRequest(request_id=f"r{n}", model="m", max_tokens=3, stream=True,
                                  body={"model": "m", "prompt": f"{PROMPT} {n}", "max_tokens": 3})
    async with trio.open_nursery() as nursery:
        stream = await router.stream(nursery, request, RequestContext(request.request_id))
        async with stream.outputs:
            assert [item async for item in stream.outputs]


class SlowToAccept:
    """A decode engine that takes a second to accept a request (then as ``inner``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, *args: Any, **kwargs: Any) -> None:
        await trio.sleep(1)
        await self.inner.generate(*args, **kwargs)


@pytest.mark.parametrize("style", list(HandoffStyle))
@pytest.mark.parametrize("action", ["leave", "stop", "leave at the acceptance"])
async def test_a_request_whose_client_goes_before_its_first_token_is_freed_at_once(
        autojump_clock: trio.abc.Clock, style: HandoffStyle, action: str) -> None:
    """The same for a client that leaves (its nursery cancelled) or stops its context once
    its stream is open, before it read anything, or leaves while the decode worker has
    not accepted yet: the gate's first-output hook and the owner's cancelled dispatch
    (each holds the request) go once they are of no use."""
    async with TransferKeeper() as keeper:
        cluster = mock_cluster(1, 1, style=style, latency=LATENCY)
        if action == "leave at the acceptance":
            cluster.decode[0] = SlowToAccept(cluster.decode[0])  # type: ignore[call-overload]
        router = DisaggRouter(WorkerPool(cluster.prefill), WorkerPool(cluster.decode), keeper)
        for n in range(2):  # warm-up
            await go_before_the_first_token(router, n, action)
        with cyclic_garbage() as cyclic:
            for n in range(3):
                await go_before_the_first_token(router, n, action)
            await keeper.wait_idle()
            await trio.sleep(10)  # past the kept legs' grace (G9)
    assert cyclic == []


async def go_before_the_first_token(router: DisaggRouter, n: int, action: str) -> None:
    request = PreprocessedRequest(request_id=f"r{n}", model="m", max_tokens=3, stream=True,
                                  body={"model": "m", "prompt": f"{PROMPT} {n}", "max_tokens": 3})
    context = RequestContext(request.request_id)
    async with trio.open_nursery() as nursery:
        if action == "leave at the acceptance":
            nursery.cancel_scope.deadline = trio.current_time() + 0.5
        stream = await router.stream(nursery, request, context)
        async with stream.outputs:
            if action == "leave":
                nursery.cancel_scope.cancel()
            else:
                context.stop_generating()
                assert [item async for item in stream.outputs]
