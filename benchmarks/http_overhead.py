"""P4 and P5 (docs/design.md, docs/performance.md): the HTTP router's cost per token beside a
pass-through proxy and the Rust ``vllm-router``, its added latency, and the time from a
client's disconnect to the decode worker's abort.

Run it with ``uv run --group bench python benchmarks/http_overhead.py [--quick]`` (the
``bench`` dependency group installs the two anchors; without them the anchors' rows are
skipped and said so). ``--help`` lists the sizes.

Every server is a process of its own, so that each one's CPU time is read on its own (its
CPU-time clock, in nanoseconds; ``/proc`` where there is none): the mock vLLM workers
(``python -m trio_disagg mock-worker``), the router
(``python -m trio_disagg serve --backend vllm``), the pass-through proxy anchor
(``benchmarks/anchors/passthrough_proxy.py``: FastAPI on uvicorn with uvloop and httptools,
one httpx client, the decode's bytes relayed unparsed) and the Rust ``vllm-router``
(``--vllm-pd-disaggregation --kv-connector nixl``); and, as the floor, the bare relay
(``benchmarks/anchors/bare_relay.py``: the router's own HTTP server and worker client
relaying as the proxy does, with nothing of the router on them). The load generator is this process:
raw trio sockets, one connection per request, the response parsed by httptools and its
server-sent events counted, so that the client costs as little as it can.

- **P4a**: S streams x T tokens, all at once, zero-latency workers; each target in turn,
  alternated, after a warm-up. Tokens/s, and the CPU per token of the target's process
  (router, bare relay, proxy or vllm-router; the workers' own beside), as ratios to the
  proxy's. Then the same at a short length, to split each one's CPU into a part per
  request and a part per token.
- **P4b**: S streams paced by the decode worker at ``--itl`` seconds per token. Tokens
  delivered per second against the direct connection's, the added inter-token latency
  (p99 of the gaps between a stream's events, target minus direct), and CPU per token.
- **P4c**: one request at a time, alternated: time to first token added over the proxy.
- **P5**: streams through the paced router, closed one at a time mid-stream; the decode
  worker stamps each abort (``GET /stats``), the client each close (both
  ``time.monotonic()``, one clock on Linux): p50 / p99 of the difference.

Nothing is asserted on the timings. The script exits non-zero only if a request failed,
a stream lost tokens, or an abort was never seen.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import io
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import attrs
import httptools
import orjson
import trio

MODEL = "trio-disagg-mock"
PROMPT = "Explain why structured concurrency makes cancellation of a request tractable."
#: Tokens a stream in the short P4a runs that split its CPU into per request and per token.
SHORT_TOKENS = 16
HERE = Path(__file__).resolve().parent
PROXY = HERE / "anchors" / "passthrough_proxy.py"
BARE_RELAY = HERE / "anchors" / "bare_relay.py"
EVENT = b"data: "
DONE = b"data: [DONE]"
TARGETS = {"P4a_cpu": 0.33, "P4b_delivered": 0.95, "P4b_itl_ms": 5.0, "P4b_cpu": 0.5,
           "P4c_ttft_ms": 0.5, "P5_ms": 50.0}


class RunFailed(Exception):
    """A request failed or a stream lost tokens: the run is invalid."""


# --- processes ---------------------------------------------------------------------------


_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, never one given before: servers started at once
    bind theirs only later."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def _libc_clock_getcpuclockid() -> Callable[[int], int | None] | None:
    """``clock_getcpuclockid(3)``, if this platform's C library has it."""
    try:
        function = ctypes.CDLL(None).clock_getcpuclockid
    except (OSError, AttributeError):
        return None

    def clock_of(pid: int) -> int | None:
        clock = ctypes.c_int()
        return clock.value if function(pid, ctypes.byref(clock)) == 0 else None

    return clock_of


_CPU_CLOCK_OF = _libc_clock_getcpuclockid()


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` so far, all its threads (also those that ended).

    Read from the process's CPU-time clock (``clock_getcpuclockid``: nanoseconds) where
    there is one: ``/proc``'s user + system times count clock ticks (10 ms), a step of
    0.6 us a token in a P4a run of 64 x 256 tokens, as much as the differences measured.
    NaN where neither is readable."""
    if _CPU_CLOCK_OF is not None and (clock := _CPU_CLOCK_OF(pid)) is not None:
        try:
            return time.clock_gettime(clock)
        except OSError:
            pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return math.nan
    fields = stat[stat.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@attrs.define
class Server:
    name: str
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu(self) -> float:
        return cpu_seconds(self.process.pid)

    def log_tail(self, size: int = 2000) -> str:
        """The last ``size`` characters the process wrote to its stderr."""
        stderr = self.process.stderr
        if not isinstance(stderr, io.BufferedRandom):
            return ""
        stderr.seek(0)
        return stderr.read().decode(errors="replace")[-size:]


class Servers:
    """The processes of one run, stopped (SIGTERM, then SIGKILL) when it ends."""

    def __init__(self) -> None:
        self.all: list[Server] = []

    async def start(self, name: str, argv: list[str], port: int) -> Server:
        return (await self.start_all([(name, argv, port)]))[0]

    async def start_all(self, specs: Sequence[tuple[str, list[str], int]]) -> list[Server]:
        """Start the servers ``(name, argv, port)`` at once (each imports its stack in a
        process of its own), then wait until each listens."""
        servers = [Server(name, port, spawn(argv)) for name, argv, port in specs]
        self.all.extend(servers)
        for server in servers:
            await self._listening(server)
        return servers

    async def _listening(self, server: Server) -> None:
        process = server.process
        with trio.move_on_after(60):
            while process.poll() is None:
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
                except OSError:
                    await trio.sleep(0.05)
                    continue
                await stream.aclose()
                return
        error = server.log_tail() if process.poll() is not None else "(still starting)"
        raise RunFailed(f"{server.name} did not start listening on port {server.port}: "
                        f"{error}")

    def stop(self) -> None:
        for server in self.all:
            if server.process.poll() is None:
                server.process.terminate()
        deadline = time.monotonic() + 10
        for server in self.all:
            try:
                server.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()


def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    """Start a server process; its stderr goes to a temporary file (read if it fails to
    start), so a chatty one never blocks on a full pipe."""
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=tempfile.TemporaryFile())


def trio_disagg(*args: str) -> list[str]:
    return [sys.executable, "-m", "trio_disagg", *args]


def mock_worker(role: str, port: int, itl: float) -> list[str]:
    return trio_disagg("mock-worker", "--role", role, "--protocol", "vllm", "--host",
                       "127.0.0.1", "--port", str(port), "--itl", str(itl),
                       "--ttft-per-token", "0", "--kv-transfer-per-token", "0",
                       "--kv-ttl", "60")


def vllm_router_command() -> str | None:
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def has_proxy() -> bool:
    return all(importlib.util.find_spec(name) is not None
               for name in ("fastapi", "uvicorn", "uvloop", "httptools"))


@attrs.define
class Cluster:
    """A prefill and a decode worker, and the targets in front of them."""

    workers: list[Server]
    targets: dict[str, Server]  # name -> the process a client sends to


def router_command(python: str, prefill: Server, decode: Server, port: int) -> list[str]:
    """``serve --backend vllm`` with ``python``'s trio-disagg (another build, for an A/B),
    its admission limits off where it has them (the anchors have none)."""
    argv = [python, "-m", "trio_disagg", "serve", "--backend", "vllm", "--prefill",
            prefill.url, "--decode", decode.url, "--model", MODEL, "--host", "127.0.0.1",
            "--port", str(port)]
    usage = subprocess.run([python, "-m", "trio_disagg", "serve", "--help"],
                           capture_output=True, text=True, check=False).stdout
    if "--max-in-flight" in usage:
        argv += ["--max-in-flight", "0", "--max-keeper-tasks", "0"]
    return argv


async def start_cluster(servers: Servers, itl: float, anchors: Sequence[str],
                        router_python: str = sys.executable) -> Cluster:
    prefill, decode = await servers.start_all([
        ("prefill worker", mock_worker("prefill", p := free_port(), itl), p),
        ("decode worker", mock_worker("decode", p := free_port(), itl), p)])
    specs = [("router", router_command(router_python, prefill, decode, p := free_port()), p)]
    if "proxy" in anchors:
        specs.append(("proxy", [sys.executable, str(PROXY), "--port", str(p := free_port()),
                                "--prefill", prefill.url, "--decode", decode.url], p))
    if "bare relay" in anchors:
        specs.append(("bare relay", [
            sys.executable, str(BARE_RELAY), "--port", str(p := free_port()),
            "--prefill", prefill.url, "--decode", decode.url], p))
    command = vllm_router_command()
    if "vllm-router" in anchors and command is not None:
        specs.append(("vllm-router", [
            command, "--vllm-pd-disaggregation", "--kv-connector", "nixl",
            "--prefill", prefill.url, "--decode", decode.url, "--host", "127.0.0.1",
            "--port", str(p := free_port()), "--policy", "round_robin", "--log-level",
            "warning", "--prometheus-port", str(free_port())], p))
    targets = {"direct": decode}
    targets.update((server.name, server) for server in await servers.start_all(specs))
    return Cluster([prefill, decode], targets)


# --- the load generator --------------------------------------------------------------------


class _Body:
    """Counts the events of one streamed answer as httptools hands its body over."""

    def __init__(self) -> None:
        self.status = 0
        self.events = 0
        self.tail = b""
        self.complete = False
        self.parser = httptools.HttpResponseParser(self)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        joined = self.tail + body
        self.events += joined.count(EVENT) - self.tail.count(EVENT)
        self.tail = joined[-64:]

    def on_message_complete(self) -> None:
        self.complete = True


@attrs.define
class Stream:
    ttft: float  # seconds from sending to the first event
    tokens: int
    gaps: list[float]  # seconds between events (0 within one read)


def request_bytes(tokens: int, *, host: str = "x") -> bytes:
    body = orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": tokens,
                         "stream": True, "ignore_eos": True})
    return (b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % (host.encode(), len(body))
            + body)


async def one_stream(port: int, request: bytes, tokens: int, *,
                     close_after: Callable[[int], bool] | None = None) -> Stream:
    """Send one streamed completion; read it to its end (or until ``close_after`` says
    so), counting token events."""
    body = _Body()
    gaps: list[float] = []
    start = time.perf_counter()
    first = last = math.nan
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(request)
        while not body.complete:
            data = await stream.receive_some(65536)
            if not data:
                break
            before = body.events
            body.parser.feed_data(data)
            if body.events > before:
                now = time.perf_counter()
                if math.isnan(first):
                    first = now
                else:
                    gaps.append(now - last)
                gaps.extend([0.0] * (body.events - before - 1))
                last = now
            if close_after is not None and close_after(body.events):
                return Stream(first - start, body.events, gaps)
    got = body.events - 1  # then [DONE]
    if body.status != 200 or got != tokens or DONE not in body.tail:
        raise RunFailed(f"HTTP {body.status}, {got} token events of {tokens}, ending "
                        f"{body.tail[-80:]!r}")
    return Stream(first - start, got, gaps)


@attrs.define
class LoadRun:
    wall: float
    streams: list[Stream]
    cpu: dict[str, float]  # seconds, per process name

    @property
    def tokens(self) -> int:
        return sum(stream.tokens for stream in self.streams)


async def load(cluster: Cluster, target: str, streams: int, tokens: int) -> LoadRun:
    server = cluster.targets[target]
    request = request_bytes(tokens)
    watched = {target: server, **{w.name: w for w in cluster.workers}}
    before = {name: proc.cpu() for name, proc in watched.items()}
    results: list[Stream] = []

    async def one() -> None:
        results.append(await one_stream(server.port, request, tokens))

    start = time.perf_counter()
    try:
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(one)
    except* RunFailed as failed:
        raise RunFailed(f"a stream through {target} failed: {failed.exceptions[0]}; its "
                        f"log ends: {server.log_tail() or '(nothing)'}") from None
    wall = time.perf_counter() - start
    return LoadRun(wall, results, {name: proc.cpu() - before[name]
                                   for name, proc in watched.items()})


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else math.nan


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def alternated(names: Sequence[str], rep: int) -> Sequence[str]:
    return names if rep % 2 == 0 else names[::-1]


async def runs(cluster: Cluster, names: list[str], streams: int, tokens: int,
               repeat: int, idle: dict[str, list[LoadRun]] | None = None
               ) -> dict[str, list[LoadRun]]:
    """``repeat`` measured runs of each target, alternated, after one warm-up each.

    With ``idle`` (a dict to fill), each measured run comes right after a run of its own
    target, which goes into ``idle``: a paced run lasts seconds, so a target waits through
    the others' runs for longer than its workers keep an idle connection, and a proxy's
    connection pool costs it less just after that wait than in the steady state of a
    proxy under load, where it never waits (docs/performance.md, P4b).
    """
    for name in names:
        await load(cluster, name, streams, tokens)  # warm-up: connections, caches
    done: dict[str, list[LoadRun]] = {name: [] for name in names}
    for rep in range(repeat):
        for name in alternated(names, rep):
            if idle is not None:
                idle.setdefault(name, []).append(await load(cluster, name, streams, tokens))
            done[name].append(await load(cluster, name, streams, tokens))
    return done


def us_per_token(runs_: list[LoadRun], process: str) -> float:
    return statistics.median(run.cpu[process] / run.tokens for run in runs_) * 1e6


def tokens_per_second(runs_: list[LoadRun]) -> float:
    return statistics.median(run.tokens / run.wall for run in runs_)


# --- the measures ---------------------------------------------------------------------------


def p4a(done: dict[str, list[LoadRun]], streams: int, tokens: int) -> None:
    names = [name for name in ("direct", "router", "bare relay", "proxy", "vllm-router")
             if name in done]
    print(f"P4a: {streams} streams x {tokens} tokens, zero-latency mock vLLM workers; "
          "medians of the runs")
    print(f"  {'target':<13} {'tokens/s':>9} {'CPU/token':>10} {'vs proxy':>9}   "
          "workers' CPU/token (prefill, decode)")
    proxy = us_per_token(done["proxy"], "proxy") if "proxy" in done else math.nan
    for name in names:
        runs_ = done[name]
        if name == "direct":  # no process between the client and the decode worker
            own_text, ratio_text = f"{'-':>10}", f"{'-':>9}"
        else:
            own = us_per_token(runs_, name)
            own_text, ratio_text = f"{own:>7.1f} us", f"{own / proxy:>8.3f}x"
        print(f"  {name:<13} {tokens_per_second(runs_):>9,.0f} {own_text} {ratio_text}   "
              f"{us_per_token(runs_, 'prefill worker'):.1f} us, "
              f"{us_per_token(runs_, 'decode worker'):.1f} us")
    if "proxy" in done:
        cpu = us_per_token(done["router"], "router") / proxy
        rate = tokens_per_second(done["router"]) / tokens_per_second(done["proxy"])
        print(f"  router CPU per token / proxy's: {cpu:.3f}x (target <= "
              f"{TARGETS['P4a_cpu']}x): {verdict(cpu <= TARGETS['P4a_cpu'])}; tokens/s "
              f"router / proxy: {rate:.2f}x (target >= 1): {verdict(rate >= 1)}")
    else:
        print("  (no proxy anchor: `uv sync --group bench` installs it)")


def p4a_split(long: dict[str, list[LoadRun]], short: dict[str, list[LoadRun]],
              tokens: int, short_tokens: int) -> None:
    """CPU per request and per token of each process between the client and the
    workers, from the same load at two stream lengths: what a longer stream adds is the
    per-token cost, the rest is per request."""
    print(f"P4a split: CPU per request and per token, from the runs at {tokens} and "
          f"{short_tokens} tokens a stream")
    for name in short:
        if name == "direct":
            continue
        per_stream = {n: statistics.median(run.cpu[name] / len(run.streams)
                                           for run in runs_)
                      for n, runs_ in ((tokens, long[name]), (short_tokens, short[name]))}
        per_token = (per_stream[tokens] - per_stream[short_tokens]) / (tokens - short_tokens)
        per_request = per_stream[short_tokens] - short_tokens * per_token
        print(f"  {name:<13} {per_request * 1e6:>7,.0f} us a request, "
              f"{per_token * 1e6:>5.2f} us a token")


def p4b(done: dict[str, list[LoadRun]], streams: int, tokens: int, itl: float,
        after_idle: dict[str, list[LoadRun]]) -> None:
    names = [name for name in ("direct", "router", "proxy") if name in done]
    print(f"P4b: {streams} streams x {tokens} tokens paced at {itl * 1e3:g} ms per token")
    offered = streams / itl
    itl_p99 = {name: percentile([g for run in done[name] for s in run.streams
                                 for g in s.gaps], 99) * 1e3 for name in names}
    for name in names:
        rate = tokens_per_second(done[name])
        own = "" if name == "direct" else f", CPU/token {us_per_token(done[name], name):.1f} us"
        print(f"  {name:<8} delivered {rate:>7,.0f} tokens/s ({rate / offered:.2f} of "
              f"offered), ITL p99 {itl_p99[name]:.2f} ms{own}")
    delivered = tokens_per_second(done["router"]) / tokens_per_second(done["direct"])
    added = itl_p99["router"] - itl_p99["direct"]
    print(f"  delivered router / direct: {delivered:.3f}x (target >= "
          f"{TARGETS['P4b_delivered']}x): {verdict(delivered >= TARGETS['P4b_delivered'])}; "
          f"added ITL p99 {added:+.2f} ms (target <= {TARGETS['P4b_itl_ms']:g} ms): "
          f"{verdict(added <= TARGETS['P4b_itl_ms'])}")
    if "proxy" in done:
        cpu = us_per_token(done["router"], "router") / us_per_token(done["proxy"], "proxy")
        print(f"  router CPU per token / proxy's, each run right after one of its own "
              f"target (a proxy under steady load): {cpu:.3f}x (target <= "
              f"{TARGETS['P4b_cpu']}x): {verdict(cpu <= TARGETS['P4b_cpu'])}")
        if "proxy" in after_idle and "router" in after_idle:
            router, proxy = (us_per_token(after_idle[name], name) for name in ("router",
                                                                               "proxy"))
            idle = router / proxy
            print(f"  ... each run right after the other targets' (its workers had closed "
                  f"its idle connections): router {router:.1f} us, proxy {proxy:.1f} us a "
                  f"token, {idle:.3f}x (target <= {TARGETS['P4b_cpu']}x): "
                  f"{verdict(idle <= TARGETS['P4b_cpu'])}")


async def p4c(cluster: Cluster, samples: int, tokens: int) -> None:
    names = [name for name in ("direct", "router", "proxy", "vllm-router")
             if name in cluster.targets]
    request = request_bytes(tokens)
    ttft: dict[str, list[float]] = {name: [] for name in names}
    for i in range(samples + 3):
        for name in alternated(names, i):
            stream = await one_stream(cluster.targets[name].port, request, tokens)
            if i >= 3:  # warm-up rounds
                ttft[name].append(stream.ttft * 1e3)
    print(f"P4c: one request at a time, {samples} per target, alternated; time to first "
          "token p50 / p99")
    for name in names:
        print(f"  {name:<13} {percentile(ttft[name], 50):6.2f} / "
              f"{percentile(ttft[name], 99):6.2f} ms")
    anchor = "proxy" if "proxy" in ttft else "direct"
    added = percentile(ttft["router"], 50) - percentile(ttft[anchor], 50)
    print(f"  TTFT p50 added by the router over the {anchor}: {added:+.2f} ms (target <= "
          f"+{TARGETS['P4c_ttft_ms']:g} ms over the proxy): "
          f"{verdict(added <= TARGETS['P4c_ttft_ms'])}")


async def p5(cluster: Cluster, streams: int, spacing: float) -> None:
    """Streams mid-way through the paced router, closed one at a time."""
    router = cluster.targets["router"]
    decode = cluster.workers[1]
    ready = trio.Semaphore(0)
    turns = [trio.Event() for _ in range(streams)]
    closed_at: dict[str, float] = {}

    async def one(i: int) -> None:
        rid = f"p5-{i}-{time.monotonic_ns()}"
        body = orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 30_000,
                             "stream": True})
        request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                   b"application/json\r\nx-request-id: %s\r\ncontent-length: %d\r\n\r\n"
                   % (rid.encode(), len(body)) + body)
        seen = False

        def close_after(events: int) -> bool:
            nonlocal seen
            if events >= 3 and not seen:
                seen = True
                ready.release()
            if turns[i].is_set():
                closed_at[rid] = time.monotonic()
                return True
            return False

        await one_stream(router.port, request, 30_000, close_after=close_after)

    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(one, i)
        for _ in range(streams):
            await ready.acquire()
        for turn in turns:
            turn.set()  # that client closes at its next read, at most one ITL later
            await trio.sleep(spacing)
    aborted: dict[str, float] = {}
    with trio.move_on_after(20):
        while len(aborted) < len(closed_at):
            stats = await get_json(decode.port, "/stats")
            # The worker's id is the client's, a dot, and the router's own for the request.
            aborted = {client: float(cast(float, entry["at"])) for entry in stats["aborts"]
                       if (client := str(entry["request_id"]).rpartition(".")[0]) in closed_at}
            await trio.sleep(0.05)
    if len(aborted) < len(closed_at):
        raise RunFailed(f"the decode worker never aborted {len(closed_at) - len(aborted)} "
                        "request(s)")
    latencies = [(aborted[rid] - closed_at[rid]) * 1e3 for rid in closed_at]
    p99 = percentile(latencies, 99)
    print(f"P5: {streams} streams through the paced router, closed one at a time "
          f"{spacing * 1e3:g} ms apart: client close -> decode worker abort p50 "
          f"{percentile(latencies, 50):.2f} ms, p99 {p99:.2f} ms (target <= "
          f"{TARGETS['P5_ms']:g} ms): {verdict(p99 <= TARGETS['P5_ms'])}")


async def get_json(port: int, path: str) -> dict[str, list[dict[str, object]]]:
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(b"GET %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
                              % path.encode())
        data = b""
        while part := await stream.receive_some(65536):
            data += part
    head, _, body = data.partition(b"\r\n\r\n")
    if b"chunked" in head.lower():
        body = dechunk(body)
    answer: dict[str, list[dict[str, object]]] = orjson.loads(body)
    return answer


def dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return bytes(out)


def cores() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return f"{usable or os.cpu_count()} CPU core(s) usable"


async def run(args: argparse.Namespace) -> int:
    anchors = ["bare relay"]
    if has_proxy():
        anchors.append("proxy")
    if vllm_router_command() is not None:
        anchors.append("vllm-router")
    print("trio-disagg HTTP router benchmarks: P4a-c and P5 (docs/performance.md)")
    print(f"machine: {cores()}; every server a process of its own, CPU read from its "
          f"CPU-time clock; anchors: {', '.join(anchors) or 'none (uv sync --group bench)'}")
    servers = Servers()
    try:
        with trio.fail_after(args.timeout):
            fast = await start_cluster(servers, 0.0, anchors, args.router_python)
            done = await runs(fast, list(fast.targets), args.streams, args.tokens,
                              args.repeat)
            p4a(done, args.streams, args.tokens)
            short_tokens = min(SHORT_TOKENS, args.tokens // 4)
            if short_tokens >= 1:
                short = await runs(fast, [n for n in fast.targets if n != "direct"],
                                   args.streams, short_tokens, args.repeat)
                p4a_split(done, short, args.tokens, short_tokens)
            await p4c(fast, args.samples, 4)
            paced = await start_cluster(servers, args.itl, [a for a in anchors
                                                             if a == "proxy"],
                                        args.router_python)
            after_idle: dict[str, list[LoadRun]] = {}
            done = await runs(paced, list(paced.targets), args.paced_streams,
                              args.paced_tokens, args.repeat // 2 + 1, after_idle)
            p4b(done, args.paced_streams, args.paced_tokens, args.itl, after_idle)
            await p5(paced, args.abort_streams, args.spacing)
    except RunFailed as exc:
        print(f"FAILED: {exc}")
        return 1
    finally:
        servers.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=64, help="P4a concurrent streams")
    parser.add_argument("--tokens", type=int, default=256, help="P4a tokens per stream")
    parser.add_argument("--repeat", type=int, default=5,
                        help="P4a runs per target (P4b: half as many, plus one: an odd "
                        "count, whose median is one run's)")
    parser.add_argument("--samples", type=int, default=100,
                        help="P4c requests per target, one at a time")
    parser.add_argument("--itl", type=float, default=0.02,
                        help="P4b and P5 seconds between tokens")
    parser.add_argument("--paced-streams", type=int, default=64, help="P4b streams")
    parser.add_argument("--paced-tokens", type=int, default=100, help="P4b tokens per stream")
    parser.add_argument("--abort-streams", type=int, default=32, help="P5 streams")
    parser.add_argument("--spacing", type=float, default=0.02,
                        help="P5 seconds between two closes")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds the whole run may take before it fails")
    parser.add_argument("--router-python", default=sys.executable, metavar="PYTHON",
                        help="the interpreter whose trio-disagg runs the router (another "
                        "build's, to compare it with the same workers and anchors)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run that only checks the script works")
    args = parser.parse_args(argv)
    if args.quick:  # CPU figures are then a few clock ticks: they show the script works
        args.streams, args.tokens, args.repeat, args.samples = 8, 32, 1, 5
        args.paced_streams, args.paced_tokens, args.abort_streams = 8, 10, 4
        args.timeout = min(args.timeout, 100.0)
    if min(args.streams, args.tokens, args.repeat, args.samples, args.paced_streams,
           args.paced_tokens, args.abort_streams) < 1 or args.itl <= 0 or args.spacing < 0:
        parser.error("sizes must be >= 1, --itl > 0 and --spacing >= 0")
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
