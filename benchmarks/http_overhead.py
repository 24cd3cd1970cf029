"""P4 and P5 (docs/design.md): the HTTP router against a direct connection to the decode worker,
and the time from a client's disconnect to the decode worker's abort.

Run it with ``uv run python benchmarks/http_overhead.py [--quick]`` (see ``--help`` for
the sizes).

The servers run in a subprocess (this script with ``--serve``): one trio process holding
two clusters on loopback ports, each a mock vLLM prefill worker, a mock vLLM decode worker
and the router's OpenAI HTTP server (``create_app`` + ``serve``) driving them through
:class:`~trio_disagg.engines.VllmEngine`. The "fast" cluster's workers have zero latency
(P4); the "slow" one's produce a token every ``--itl`` seconds (P5). The load generator
is this process: httpx on trio, one client (connection pool) per simulated user, reading
the server-sent events as raw bytes and counting tokens by events, so its own CPU time
(and its GIL) is not the servers'. On a 2-core machine that is one core each.

P4, side by side, alternated (the order flips each repetition), after a warm-up each:

- direct: S concurrent streamed ``/v1/completions`` requests of T tokens sent straight to
  the decode worker, with no ``kv_transfer_params``: the worker computes its own prefill
  (in zero time) and streams. The baseline: what a client gets with no router at all.
- router: the same requests through the router: a prefill request to the prefill worker,
  the decode request with the prefill's ``kv_transfer_params``, the decode worker's KV pull
  from the prefill worker over loopback, then the stream relayed token by token.

It prints the median tokens/s of each and the ratio router / direct (target >= 0.8x),
with what explains it: the server process's CPU time per token (``/proc``; router and
workers together), the load generator's CPU share (near 100% would mean the client, not
the server, set the pace), and the reads each stream's body took (how many tokens the
server put in one write). Then the time to first token (request sent to first token
read): its p50 under that load, and its p50 unloaded (one request at a time, alternated),
router minus direct (target <= 2 ms added, judged unloaded: under load the time to first
token of a stream is mostly its wait behind the other streams' tokens, which is the
throughput above), next to the cost of one bare loopback HTTP exchange on the machine.

P5: R rounds of S streams through the slow cluster's router, every one mid-stream. They
are then closed one at a time, ``--spacing`` seconds apart while the others keep
streaming; each client stamps ``time.monotonic()`` just before closing its connection.
The decode worker stamps each aborted request when its abort is done (``GET /stats`` of
the mock worker, its ``aborts``); on Linux both stamps are ``CLOCK_MONOTONIC``, one clock
for the host. It prints the p50 / p99 / max of the difference (target <= 50 ms p99;
nearest rank, so with fewer than 100 requests the p99 is the max).

Nothing is asserted on the timings. The script exits non-zero only if a request failed, a
stream lost tokens or an abort was never seen.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import AsyncExitStack
from functools import partial
from typing import cast

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client, on trio natively)
import orjson
import trio

import trio_disagg as td
from trio_disagg.engines import LatencyModel, vllm_client, vllm_engines
from trio_disagg.server import create_app, serve
from trio_disagg.workers import serve_mock_worker

MODEL = "trio-disagg-mock"
PROMPT = "Explain why structured concurrency makes cancellation of a request tractable."
TPUT_TARGET = 0.8
TTFT_TARGET_MS = 2.0
ABORT_TARGET_MS = 50.0
DONE = b"data: [DONE]\n\n"
EVENT = b"data: "
SCRIPT = os.path.abspath(__file__)


# --- the servers (the subprocess) ------------------------------------------------------------


async def start_workers(nursery: trio.Nursery, latency: LatencyModel) -> dict[str, int]:
    """A prefill and a decode mock vLLM worker; their ports."""
    prefill = await nursery.start(partial(
        serve_mock_worker, "prefill", "vllm", "127.0.0.1", 0, latency=latency, kv_ttl=60.0))
    decode = await nursery.start(partial(
        serve_mock_worker, "decode", "vllm", "127.0.0.1", 0, latency=latency))
    return {"prefill": prefill, "decode": decode}


async def start_router(nursery: trio.Nursery, client: httpx.AsyncClient,
                       keeper: td.TransferKeeper, workers: dict[str, int],
                       stop: trio.Event) -> int:
    """The router's HTTP server over ``workers`` (VllmEngine adapters); its port."""
    prefill, decode = vllm_engines([f"http://127.0.0.1:{workers['prefill']}"],
                                   [f"http://127.0.0.1:{workers['decode']}"], client=client)
    router = td.DisaggRouter(td.WorkerPool(prefill), td.WorkerPool(decode), keeper)
    app = create_app(router, models=[MODEL])
    port: int = await nursery.start(partial(serve, app, host="127.0.0.1", port=0,
                                            shutdown_trigger=stop.wait, graceful_timeout=2.0))
    return port


async def wait_for_eof_on_stdin() -> None:
    stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stream:
        while await stream.receive_some():
            pass


class _NoBanner(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Running on")


async def serve_main(itl: float) -> None:
    """``--serve``: start both clusters, print their ports as one JSON line, and serve
    until stdin closes (the parent is done, or gone)."""
    logging.getLogger("hypercorn.error").addFilter(_NoBanner())
    latencies = {
        "fast": LatencyModel.zero(),
        "slow": LatencyModel(ttft_per_prompt_token=0.0, inter_token_latency=itl,
                             kv_transfer_per_token=0.0),
    }
    stop = trio.Event()
    async with (
        vllm_client() as client,
        td.TransferKeeper(drain_window=5.0) as keeper,
        trio.open_nursery() as workers,
    ):
        ports = {name: await start_workers(workers, latency)
                 for name, latency in latencies.items()}
        async with trio.open_nursery() as routers:
            for cluster in ports.values():
                cluster["router"] = await start_router(routers, client, keeper, cluster, stop)
            print(json.dumps(ports), flush=True)
            await wait_for_eof_on_stdin()
            stop.set()  # the routers shut down gracefully ...
        workers.cancel_scope.cancel()  # ... then the workers stop


# --- the client (this process) ---------------------------------------------------------------


class StreamFailed(Exception):
    """A request failed, or its stream lost tokens: the run is invalid."""


@attrs.define
class Stream:
    """What one streamed request saw: its time to first token (seconds), its tokens, and
    how many reads its body took (how well the server coalesced its writes)."""

    ttft: float
    tokens: int
    reads: int


def body_bytes(tokens: int) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": tokens,
                         "stream": True})


async def one_stream(client: httpx.AsyncClient, url: str, body: bytes, request_id: str,
                     tokens: int) -> Stream:
    """Send one streamed completion and read it to its end, counting token events."""
    headers = {"content-type": "application/json", "x-request-id": request_id}
    start = time.perf_counter()
    ttft = math.nan
    events = reads = 0
    tail = b""
    async with client.stream("POST", url, content=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            raise StreamFailed(f"{request_id}: HTTP {response.status_code}: "
                               f"{response.text[:300]}")
        async for chunk in response.aiter_raw():
            reads += 1
            # ``data: `` may straddle two reads: count it in (last 5 bytes + this read).
            events += (tail[-5:] + chunk).count(EVENT)
            tail = (tail + chunk)[-64:]
            if events and math.isnan(ttft):
                ttft = time.perf_counter() - start
    got = events - 1  # every event is a token, then [DONE]
    if got != tokens or not tail.endswith(DONE) or b'"error"' in tail:
        raise StreamFailed(f"{request_id}: {got} token events of {tokens}, ending "
                           f"{tail[-60:]!r}")
    return Stream(ttft, got, reads)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``; NaN
    elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return math.nan
    fields = stat[stat.rindex(b")") + 2:].split()  # after "pid (comm) "; comm may have spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@attrs.define
class LoadRun:
    wall: float
    streams: list[Stream]
    server_cpu: float  # seconds of the server process (router + workers)
    client_cpu: float  # seconds of this process

    @property
    def tokens(self) -> int:
        return sum(stream.tokens for stream in self.streams)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall


async def load(clients: Sequence[httpx.AsyncClient], url: str, tokens: int, tag: str,
               server_pid: int) -> LoadRun:
    """One stream of ``tokens`` tokens per client, all at once; the wall time of them all."""
    body = body_bytes(tokens)
    results: list[Stream] = []

    async def one(i: int) -> None:
        results.append(await one_stream(clients[i], url, body, f"{tag}-{i}", tokens))

    server_cpu, client_cpu = cpu_seconds(server_pid), time.process_time()
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(len(clients)):
            nursery.start_soon(one, i)
    wall = time.perf_counter() - start
    return LoadRun(wall, results, cpu_seconds(server_pid) - server_cpu,
                   time.process_time() - client_cpu)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def alternated(names: list[str], rep: int) -> list[str]:
    return names if rep % 2 == 0 else names[::-1]


async def p4(clients: Sequence[httpx.AsyncClient], ports: dict[str, int], server_pid: int,
             *, tokens: int, repeat: int, samples: int) -> None:
    """The load: one stream per client (a user with its own connection), all at once."""
    streams = len(clients)
    urls = {
        "direct": f"http://127.0.0.1:{ports['decode']}/v1/completions",
        "router": f"http://127.0.0.1:{ports['router']}/v1/completions",
    }
    labels = {"direct": "direct to the decode worker", "router": "through the router"}
    names = list(urls)
    print(f"P4: {streams} concurrent streams x {tokens} tokens, zero-latency mock vLLM "
          f"workers on loopback; {repeat} runs per variant, alternated, after a warm-up "
          "each; medians")
    for name in names:
        await load(clients, urls[name], tokens, f"warm-{name}", server_pid)
    runs: dict[str, list[LoadRun]] = {name: [] for name in names}
    for rep in range(repeat):
        for name in alternated(names, rep):
            runs[name].append(await load(clients, urls[name], tokens, f"p4-{name}-{rep}",
                                         server_pid))
    rate = {name: statistics.median(run.tokens_per_second for run in runs[name])
            for name in names}
    print(f"  {'':<28} {'tokens/s':>9}  {'(min..max)':<16} {'server CPU':>10} "
          f"{'client CPU':>10} {'reads per':>9}  TTFT under load")
    print(f"  {'':<28} {'':>9}  {'':<16} {'per token':>10} {'(of wall)':>10} "
          f"{'stream':>9}  p50 / p99")
    for name in names:
        done = runs[name]
        spread = [run.tokens_per_second for run in done]
        server = statistics.median(run.server_cpu / run.tokens for run in done) * 1e6
        client_share = statistics.median(run.client_cpu / run.wall for run in done)
        reads = statistics.median(s.reads for run in done for s in run.streams)
        ttfts = [s.ttft for run in done for s in run.streams]
        print(f"  {labels[name]:<28} {rate[name]:>9,.0f}  "
              f"{f'({min(spread):,.0f}..{max(spread):,.0f})':<16} {server:>7.0f} us "
              f"{client_share:>10.0%} {reads:>9.0f}  {percentile(ttfts, 50) * 1e3:.0f} / "
              f"{percentile(ttfts, 99) * 1e3:.0f} ms")
    ratio = rate["router"] / rate["direct"]
    print(f"  tokens/s router / direct: {ratio:.2f}x (target >= {TPUT_TARGET}x): "
          f"{verdict(ratio >= TPUT_TARGET)}")
    print("  (server CPU: the one server process, router and workers together; a client CPU "
          "share well under 100% means the load generator was not the bottleneck)")

    # Unloaded: one request at a time, alternated, so the time to first token is the
    # latency each path adds to a request, not a wait behind the other streams' tokens.
    # For scale, one bare exchange: a 1-token answer, not streamed, from the decode worker.
    client = clients[0]
    ttft: dict[str, list[float]] = {name: [] for name in names}
    bare: list[float] = []
    body = body_bytes(tokens)
    one_token = orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    for i in range(samples + 2):
        for name in alternated(names, i):
            stream = await one_stream(client, urls[name], body, f"ttft-{name}-{i}", tokens)
            if i >= 2:  # two rounds of warm-up
                ttft[name].append(stream.ttft)
        start = time.perf_counter()
        response = await client.post(urls["direct"], content=one_token,
                                     headers={"content-type": "application/json"})
        bare.append(time.perf_counter() - start)
        if response.status_code != 200:
            raise StreamFailed(f"a 1-token request answered HTTP {response.status_code}")
    p50 = {name: percentile(ttft[name], 50) * 1e3 for name in names}
    print(f"  time to first token, one request at a time ({samples} per variant, "
          "alternated):")
    for name in names:
        print(f"    {labels[name]:<28} p50 {p50[name]:6.2f} ms, "
              f"p99 {percentile(ttft[name], 99) * 1e3:6.2f} ms")
    added = p50["router"] - p50["direct"]
    print(f"  TTFT p50 added by the router: {added:+.2f} ms (target <= {TTFT_TARGET_MS:g} ms): "
          f"{verdict(added <= TTFT_TARGET_MS)}")
    print(f"  (for scale: one bare loopback HTTP exchange, a 1-token answer from the decode "
          f"worker, takes p50 {percentile(bare, 50) * 1e3:.2f} ms here; before its first "
          "token the router path makes three more: router -> prefill, router -> decode, "
          "decode -> prefill KV pull)")


async def p5(clients: Sequence[httpx.AsyncClient], ports: dict[str, int], *, itl: float,
             spacing: float, rounds: int) -> None:
    """Rounds of one stream per client, all mid-stream, then closed one at a time: how
    long after each close did the decode worker abort its request?"""
    streams = len(clients)
    print(f"P5: {rounds} round(s) of {streams} concurrent streams through the router at "
          f"{itl * 1e3:g} ms per token; once all are mid-stream, they are closed one at a "
          f"time, {spacing * 1e3:g} ms apart")
    latencies: list[float] = []
    for round_ in range(rounds):
        closed_at = await close_streams(clients, ports, spacing, f"p5-{round_}")
        aborted = await aborts_seen(clients[0], ports, closed_at)
        latencies += [(aborted[rid] - closed_at[rid]) * 1e3 for rid in closed_at]
    p99 = percentile(latencies, 99)
    print(f"  client closes its connection -> the decode worker aborted the request: "
          f"p50 {percentile(latencies, 50):.2f} ms, p99 {p99:.2f} ms, "
          f"max {max(latencies):.2f} ms ({len(latencies)} requests)")
    print(f"  P5 target p99 <= {ABORT_TARGET_MS:g} ms: {verdict(p99 <= ABORT_TARGET_MS)}")


async def close_streams(clients: Sequence[httpx.AsyncClient], ports: dict[str, int],
                        spacing: float, tag: str) -> dict[str, float]:
    """Open a stream per client, wait until all are mid-stream, close them one at a time.

    Returns:
        Each request id and the ``time.monotonic()`` just before its client closed it.
    """
    url = f"http://127.0.0.1:{ports['router']}/v1/completions"
    body = body_bytes(30_000)  # far longer than the run
    ready = trio.Semaphore(0)
    turns = [trio.Event() for _ in clients]
    closed_at: dict[str, float] = {}

    async def one(i: int) -> None:
        request_id = f"{tag}-{i}"
        headers = {"content-type": "application/json", "x-request-id": request_id}
        async with clients[i].stream("POST", url, content=body,
                                     headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                raise StreamFailed(f"{request_id}: HTTP {response.status_code}")
            events = 0
            # An async generator (typed as an iterator): closed explicitly below.
            chunks = cast(AsyncGenerator[bytes, None], response.aiter_raw())
            try:
                async for chunk in chunks:
                    if events < 3 <= events + chunk.count(EVENT):
                        ready.release()  # mid-stream
                    events += chunk.count(EVENT)
                    if turns[i].is_set():
                        closed_at[request_id] = time.monotonic()
                        break
                else:
                    raise StreamFailed(f"{request_id}: the stream ended by itself")
            finally:
                await chunks.aclose()
            await response.aclose()  # unfinished, so httpx closes the connection

    async with trio.open_nursery() as nursery:
        for i in range(len(clients)):
            nursery.start_soon(one, i)
        for _ in clients:
            await ready.acquire()
        await trio.sleep(0.1)
        for turn in turns:
            turn.set()  # the client closes at its next read, at most one ITL later
            await trio.sleep(spacing)
    return closed_at


async def aborts_seen(client: httpx.AsyncClient, ports: dict[str, int],
                      closed_at: dict[str, float]) -> dict[str, float]:
    """When the decode worker aborted each request (``GET /stats``, ``time.monotonic()``)."""
    url = f"http://127.0.0.1:{ports['decode']}/stats"
    aborted: dict[str, float] = {}
    with trio.move_on_after(20):
        while True:
            response = await client.get(url)
            response.raise_for_status()
            aborted = {entry["request_id"]: entry["at"] for entry in response.json()["aborts"]
                       if entry["request_id"] in closed_at}
            if len(aborted) == len(closed_at):
                return aborted
            await trio.sleep(0.05)
    missing = sorted(set(closed_at) - set(aborted))
    raise StreamFailed(f"the decode worker never aborted {len(missing)} request(s): "
                       f"{missing[:5]}")


async def read_line(stream: trio.abc.ReceiveStream) -> bytes:
    data = b""
    while b"\n" not in data:
        part = await stream.receive_some()
        if not part:
            raise RuntimeError(f"the server process exited before it was ready: {data!r}")
        data += part
    return data


def cores() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    total = os.cpu_count()
    return f"{usable if usable is not None else total} CPU core(s) usable ({total} in all)"


async def run(args: argparse.Namespace) -> int:
    print("trio-disagg HTTP router benchmarks: P4 and P5 (docs/design.md)")
    print(f"machine: {cores()}; the servers (router + mock workers, one trio process) run "
          "in a subprocess, the load generator (httpx on trio) in this one, so each gets "
          "about one core")
    failed = False
    command = [sys.executable, SCRIPT, "--serve", "--itl", str(args.itl)]
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(partial(
            trio.run_process, command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            check=False))
        assert process.stdin is not None and process.stdout is not None
        try:
            with trio.fail_after(60):
                clusters = json.loads(await read_line(process.stdout))
            async with AsyncExitStack() as stack:
                # A client (a connection pool) per simulated user: httpcore's pool scans
                # all of its connections on every request event, which would make one
                # shared pool the load generator's bottleneck.
                clients = [await stack.enter_async_context(httpx.AsyncClient(
                    timeout=httpx.Timeout(60.0), trust_env=False))
                    for _ in range(max(args.streams, args.abort_streams))]
                with trio.fail_after(args.timeout):
                    await p4(clients[:args.streams], clusters["fast"], process.pid,
                             tokens=args.tokens, repeat=args.repeat, samples=args.samples)
                with trio.fail_after(args.timeout):
                    await p5(clients[:args.abort_streams], clusters["slow"], itl=args.itl,
                             spacing=args.spacing, rounds=args.abort_rounds)
        except* StreamFailed as group:
            for exc in group.exceptions[:5]:
                print(f"FAILED: {exc}")
            failed = True
        finally:
            with trio.move_on_after(10, shield=True) as waiting:
                await process.stdin.aclose()  # the server process shuts down
                await process.wait()
            if waiting.cancelled_caught:
                process.kill()
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=64, help="P4 concurrent streams")
    parser.add_argument("--tokens", type=int, default=256, help="P4 tokens per stream")
    parser.add_argument("--repeat", type=int, default=7, help="P4 runs per variant")
    parser.add_argument("--samples", type=int, default=100,
                        help="P4 unloaded time-to-first-token requests per variant")
    parser.add_argument("--abort-streams", type=int, default=32,
                        help="P5 concurrent streams per round")
    parser.add_argument("--abort-rounds", type=int, default=3, help="P5 rounds")
    parser.add_argument("--itl", type=float, default=0.01,
                        help="P5 seconds between tokens (the slow cluster)")
    parser.add_argument("--spacing", type=float, default=0.02,
                        help="P5 seconds between two closes")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds each of P4 and P5 may take before the run fails")
    parser.add_argument("--quick", action="store_true",
                        help="a short run (a few seconds) that only checks the script works; "
                        "overrides the sizes")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        trio.run(serve_main, args.itl)
        return 0
    if args.quick:
        args.streams, args.tokens, args.repeat, args.samples = 8, 32, 2, 5
        args.abort_streams, args.abort_rounds, args.spacing = 8, 1, 0.01
        args.timeout = min(args.timeout, 60.0)  # fail here, before a test's own timeout
    if min(args.streams, args.tokens, args.repeat, args.samples, args.abort_streams,
           args.abort_rounds) < 1 or \
            args.itl <= 0 or args.spacing < 0:
        parser.error("sizes must be >= 1, --itl > 0 and --spacing >= 0")
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
