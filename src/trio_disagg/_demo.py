"""``trio-disagg demo``: the main job in one command.

For each backend it starts mock prefill and decode workers, the router and its OpenAI HTTP
server on loopback ports, drives a seeded mixed workload through it with the official
``openai`` client (plain requests, long prompts, client disconnects at every phase, every
injected fault), prints a table per scenario, and checks the invariants: the right outcome
per scenario, zero staged KV blocks left or stranded, zero keeper drains left, no request
past its deadline.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TextIO

import attrs
import httpx
import openai
import trio
from prometheus_client.parser import text_string_to_metric_families

from ._adapters import BACKENDS, DEMO_BACKENDS, adapter
from ._demo_workload import (
    Outcome,
    Result,
    Scenario,
    check_outcomes,
    default_scenarios,
    format_table,
    plan,
    run_request,
)
from ._engine import Engine, HandoffStyle
from ._keeper import TransferKeeper
from ._pool import LeastOutstanding, RoundRobin, WorkerPool
from ._router import Deadlines, DisaggRouter
from .engines import WorkerClient, worker_client
from .mock import KVCounters, LatencyModel, Role, create_mock_worker, mock_cluster, serve_worker
from .server import create_app, serve

MODEL = "trio-disagg-mock"

#: Fast enough for a laptop run, slow enough that the phases are real: a 600-word prompt
#: prefills in 0.3 s, tokens come every 4 ms.
DEMO_LATENCY = LatencyModel(
    ttft_per_prompt_token=0.0005, inter_token_latency=0.004, kv_transfer_per_token=0.00002
)
#: Short enough that the stall scenarios end in seconds, long enough that a 2-core machine
#: running 64 clients, the router and its workers in one process never hits them by accident.
DEMO_DEADLINES = Deadlines(prefill=2.5, handoff=3.0, decode_idle=3.0, terminal_hold=3.0,
                           transfer=8.0)
#: How long the demo waits after its last request for the keeper to be idle: past the
#: transfer deadline, which bounds a stalled bootstrap prefill.
SETTLE_WINDOW = DEMO_DEADLINES.transfer + 4.0


@attrs.define
class Backend:
    """One deployment the demo drives: its workers and how to read their KV counters.

    Attributes:
        name: shown in the table (``mock-sequential``, ``vllm``, ...).
        terminal: whether its prefill can answer alone (S7 scenarios apply).
        prefill, decode: the engines the router uses.
        kv_counters: reads the prefill workers' KV counters (held, stranded, ...).
    """

    name: str
    terminal: bool
    prefill: list[Engine]
    decode: list[Engine]
    kv_counters: Callable[[], Awaitable[KVCounters]]


#: Starts a backend's workers in the given nursery (which outlives the run) and returns it.
BackendFactory = Callable[[trio.Nursery], Awaitable[Backend]]


def in_process_backend(name: str, style: HandoffStyle, seed: int) -> Backend:
    """Mock engines in this process: two prefill and two decode workers."""
    cluster = mock_cluster(2, 2, style=style, latency=DEMO_LATENCY, seed=seed, kv_ttl=30.0)

    async def counters() -> KVCounters:
        return cluster.counters()

    return Backend(name, True, list(cluster.prefill), list(cluster.decode), counters)


async def http_backend(protocol: str, seed: int, nursery: trio.Nursery) -> Backend:
    """Two prefill and two decode mock workers speaking ``protocol`` on loopback ports,
    and the adapter engines that drive them over HTTP. The KV counters are read from each
    prefill worker's ``GET /metrics``, as an operator would."""
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    prefill_specs: list[str] = []
    roles: tuple[Role, ...] = ("prefill", "decode")
    for role in roles:
        for _ in range(2):
            # An SGLang prefill worker also listens on a bootstrap port: any free one.
            sglang_prefill = (protocol, role) == ("sglang", "prefill")
            app = create_mock_worker(role, protocol, latency=DEMO_LATENCY, seed=seed,
                                     kv_ttl=30.0, bootstrap_port=0 if sglang_prefill else None,
                                     fault_injection=True)  # the demo's faults are its own
            port = await nursery.start(partial(serve_worker, app, host="127.0.0.1", port=0))
            url = f"http://127.0.0.1:{port}"
            urls[role].append(url)
            if role == "prefill":
                bound = getattr(app, "bootstrap_port", None)
                prefill_specs.append(url if bound is None else f"{url},{bound}")
    client = worker_client()  # the engines' worker legs
    http = httpx.AsyncClient(trust_env=False)  # the demo's own reads of /metrics
    nursery.start_soon(_close_at_cancel, client, http)
    prefill, decode = adapter(protocol)(prefill_specs, urls["decode"], client=client)

    async def counters() -> KVCounters:
        total = KVCounters()
        for url in urls["prefill"]:
            response = await http.get(f"{url}/metrics")
            response.raise_for_status()
            total += _kv_from_metrics(response.text)
        return total

    return Backend(protocol, True, list(prefill), list(decode), counters)


def _kv_from_metrics(text: str) -> KVCounters:
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }

    def read(name: str) -> int:
        return int(values.get(f"trio_disagg_mock_{name}", 0))

    return KVCounters(
        held_blocks=read("kv_held_blocks"),
        held=read("kv_held_requests"),
        staged_blocks=read("kv_staged_blocks_total"),
        freed_blocks=read("kv_freed_blocks_total"),
        stranded_blocks=read("kv_stranded_blocks_total"),
        served=read("kv_served_requests_total"),
        aborted=read("kv_aborted_requests_total"),
        expired=read("kv_expired_requests_total"),
    )


async def _close_at_cancel(client: WorkerClient, http: httpx.AsyncClient) -> None:
    try:
        await trio.sleep_forever()
    finally:
        with trio.move_on_after(1, shield=True):
            await client.aclose()
            await http.aclose()


@attrs.define
class BackendReport:
    backend: str
    results: list[Result]
    wall: float
    kv: KVCounters
    drains_left: int
    requests_left: int
    broken: list[str]


async def drive_backend(
    backend: Backend,
    *,
    requests: int,
    concurrency: int,
    seed: int,
    out: TextIO,
) -> BackendReport:
    """Run the workload against one backend behind a real HTTP router; check invariants."""
    scenarios = default_scenarios(backend.name, terminal=backend.terminal)
    workload = plan(scenarios, requests, seed)
    results: list[Result] = []
    stop = trio.Event()
    async with TransferKeeper(drain_window=5.0) as keeper:
        router = DisaggRouter(
            WorkerPool(backend.prefill, policy=RoundRobin()),
            WorkerPool(backend.decode, policy=LeastOutstanding()),
            keeper,
            deadlines=DEMO_DEADLINES,
        )
        app = create_app(router, models=[MODEL], fault_injection=True)  # faults: on purpose
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                partial(serve, app, host="127.0.0.1", port=0, shutdown_trigger=stop.wait)
            )
            client = demo_client(f"http://127.0.0.1:{port}/v1")
            start = time.perf_counter()
            with client:
                async with trio.open_nursery() as clients:
                    clients.start_soon(_progress, backend.name, results, len(workload), out)
                    limiter = trio.CapacityLimiter(concurrency)
                    for index, scenario in enumerate(workload):
                        clients.start_soon(
                            _one, client, scenario, index, seed, results, limiter
                        )
            wall = time.perf_counter() - start
            # Disconnected requests may still be cleaning up (B1): give them a moment.
            with trio.move_on_after(SETTLE_WINDOW):
                await router.wait_idle()
                await keeper.wait_idle()
            requests_left, drains_left = router.in_flight, keeper.in_flight
            stop.set()
    kv = await backend.kv_counters()
    broken = check_outcomes(results)
    if kv.held_blocks:
        broken.append(f"{kv.held_blocks} staged KV blocks still held after the run (B1, B5)")
    if kv.stranded_blocks:
        broken.append(f"{kv.stranded_blocks} KV blocks stranded until their lease expired (B1)")
    if drains_left:
        broken.append(f"{drains_left} keeper drains still running after the run (B5)")
    if requests_left:
        broken.append(f"{requests_left} requests still in flight after the run (B5)")
    broken += _past_deadline(results)
    return BackendReport(backend.name, results, wall, kv, drains_left, requests_left, broken)


def _past_deadline(results: Sequence[Result]) -> list[str]:
    """B2: a request may take its deadlines plus its tokens, never more."""
    d = DEMO_DEADLINES
    broken = []
    for result in results:
        bound = (d.prefill + d.handoff + d.terminal_hold + d.decode_idle
                 + result.scenario.max_tokens * DEMO_LATENCY.inter_token_latency * 4 + 2.0)
        if result.elapsed > bound:
            broken.append(f"{result.scenario.name}: took {result.elapsed:.2f} s, past its "
                          f"deadlines ({bound:.2f} s) (B2)")
    return broken


async def _one(
    client: openai.OpenAI,
    scenario: Scenario,
    index: int,
    seed: int,
    results: list[Result],
    limiter: trio.CapacityLimiter,
) -> None:
    result = await trio.to_thread.run_sync(
        run_request, client, MODEL, scenario, index, seed, limiter=limiter
    )
    results.append(result)


async def _progress(name: str, results: list[Result], total: int, out: TextIO) -> None:
    interactive = out.isatty()
    last_quarter = -1
    while True:
        counts = Counter(r.outcome.value for r in results)
        line = (f"[{name}] {len(results)}/{total} "
                + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        if interactive:
            out.write("\r" + line.ljust(100))
            out.flush()
        elif (quarter := 4 * len(results) // total) > last_quarter:
            last_quarter = quarter
            out.write(line + "\n")
        if len(results) >= total:
            if interactive:
                out.write("\n")
            return
        await trio.sleep(0.25)


async def run_demo(
    backends: Sequence[BackendFactory],
    *,
    requests: int,
    concurrency: int,
    seed: int,
    out: TextIO = sys.stdout,
) -> int:
    """Drive every backend in turn, print the tables, and return the exit status.

    Returns:
        0 if every invariant held, else 1 (each broken one is printed).
    """
    all_broken: list[str] = []
    for factory in backends:
        async with trio.open_nursery() as workers:
            backend = await factory(workers)
            report = await drive_backend(
                backend, requests=requests, concurrency=concurrency, seed=seed,
                out=sys.stderr,
            )
            workers.cancel_scope.cancel()
        out.write(f"\n== {backend.name}: {len(report.results)} requests, concurrency "
                  f"{concurrency}, seed {seed}\n")
        out.write(format_table(report.results, report.wall) + "\n")
        kv = report.kv
        out.write(
            f"staged KV blocks left: {kv.held_blocks}, stranded: {kv.stranded_blocks} "
            f"(staged {kv.staged_blocks}, freed {kv.freed_blocks}); keeper drains left: "
            f"{report.drains_left}; requests in flight: {report.requests_left}\n"
        )
        out.flush()
        all_broken += [f"{backend.name}: {line}" for line in report.broken]
    if all_broken:
        out.write(f"\nFAILED: {len(all_broken)} invariant(s) broken:\n")
        for line in all_broken[:50]:
            out.write(f"  - {line}\n")
        return 1
    out.write("\nOK: every request got its expected outcome; no KV block stranded or left, "
              "no keeper drain left, no request past its deadlines.\n")
    return 0


def demo_client(base_url: str) -> openai.OpenAI:
    """The demo's openai client of the router at ``base_url`` (on this host): no retries,
    and no proxy: an ``HTTP_PROXY`` of the environment would get every request, and the
    demo would fail with "Connection error" behind a corporate proxy."""
    return openai.OpenAI(base_url=base_url, api_key="demo", max_retries=0, timeout=30.0,
                         http_client=openai.DefaultHttpxClient(trust_env=False))


def demo_backends(names: Sequence[str], seed: int) -> list[BackendFactory]:
    """The backends for ``--backend``, by name (see :data:`DEMO_BACKENDS`)."""

    def in_process(name: str, style: HandoffStyle) -> BackendFactory:
        async def start(nursery: trio.Nursery) -> Backend:
            return in_process_backend(name, style, seed)

        return start

    factories: dict[str, BackendFactory] = {
        "mock-sequential": in_process("mock-sequential", HandoffStyle.SEQUENTIAL),
        "mock-bootstrap": in_process("mock-bootstrap", HandoffStyle.BOOTSTRAP),
    }
    for protocol in BACKENDS:
        factories[protocol] = partial(http_backend, protocol, seed)
    return [factories[name] for name in names]


__all__ = ["DEMO_BACKENDS", "Outcome", "demo_backends", "run_demo"]
