"""P2 and P3 (docs/design.md): orchestrated requests/s, and concurrent streams per process.

Run it with ``uv run python benchmarks/orchestration.py [--quick]`` (see ``--help`` for
the sizes and ``--only p2|p3``).

P2, requests/s with zero-latency mock engines (1 prefill output + 16 decode tokens per
request, N requests at concurrency C), measured side by side with two bare trio skeletons
that do the equivalent per request without the library:

- skeleton, the P2 baseline: what a naive disaggregated router needs, and nothing else.
  Per request a nursery; a prefill task sends its one output (the handoff) through a
  channel to the request; then a decode task sends 16 tokens through a channel to a
  forwarding task, which sends them through another channel to the client. Three tasks
  and three channels with the router's buffer size, no context, tracker, keeper,
  gatekeeper, deadline, worker selection or KV accounting: a fair lower bound of the work.
- minimal: one producer task sends the prefill output and the 16 tokens through one
  channel to the client (a nursery and a channel per request). A floor, for context.

Every variant builds its output objects per token, as an engine does. The variants
alternate, in an order that rotates with each repetition, after a warm-up; the script
prints the median of each and the ratio router / skeleton (target >= 0.5x).

P3, concurrent in-flight streams in one process: S streams of 40 tokens on mock engines
at 10 ms per token. Each client reads its first token, then waits until every stream has
one: a slow reader, whose decode leg runs ahead until both channel buffers are full and
then waits. Once every stream is in flight and every decode leg is blocked (the same state
at any S), the memory is measured against a baseline taken before the streams started:
the RSS delta (``/proc/self/statm``) and, in a second, smaller run (tracing is slow and
inflates the RSS), the traced allocations (:mod:`tracemalloc`), each divided by S. The
traced run lists where the memory goes, by the innermost trio_disagg line that asked for
it. The script also reports how much of it is the unread tokens the slow reader leaves in
the buffers. Then the clients read the rest, and every stream must complete with all its
tokens. Target: 10,000 streams at < 20 KiB each.

Nothing is asserted on the timings; the script exits non-zero only if a stream is lost or
a counter does not return to 0.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import linecache
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio
import trio.testing

import trio_disagg as td
from trio_disagg.mock import LatencyModel, mock_cluster

Item = td.Annotated[td.LLMEngineOutput]
P2_TARGET = 0.5
P3_TARGET_KIB = 20.0
FRAMES = 6  # traceback depth of the tracemalloc run: enough to reach a trio_disagg frame
TOKENS = 16
#: The channel buffer of the skeletons: the router's own (its CHANNEL_BUFFER), as read from
#: a stream's ``outputs`` during the warm-up.
BUFFER = 16
PROMPT = " ".join(["word"] * 32)
HANDOFF = {"remote_engine_id": "prefill-0", "remote_block_ids": [0, 1],
           "remote_host": "inproc", "remote_port": 0, "do_remote_prefill": True}

# --- P2: requests/s --------------------------------------------------------------------

_ids = itertools.count()


def make_request(max_tokens: int) -> td.PreprocessedRequest:
    request_id = f"req-{next(_ids)}"
    body = {"model": "mock", "prompt": PROMPT, "max_tokens": max_tokens}
    return td.PreprocessedRequest(request_id=request_id, model="mock", body=body,
                                  max_tokens=max_tokens, stream=True)


def token(i: int) -> Item:
    return td.Annotated(data=td.LLMEngineOutput(token_ids=[i], text=" tok"))


def last_token(i: int) -> Item:
    return td.Annotated(data=td.LLMEngineOutput(token_ids=[i], text=" tok",
                                                finish_reason=td.FinishReason.LENGTH))


def prefill_output() -> Item:
    return td.Annotated(data=td.LLMEngineOutput(
        token_ids=[0], finish_reason=td.FinishReason.LENGTH, disaggregated_params=HANDOFF))


async def send_tokens(send: trio.MemorySendChannel[Item]) -> None:
    async with send:
        for i in range(TOKENS - 1):
            await send.send(token(i))
        await send.send(last_token(TOKENS - 1))


async def send_prefill(send: trio.MemorySendChannel[Item]) -> None:
    async with send:
        await send.send(prefill_output())


async def relay(receive: trio.MemoryReceiveChannel[Item],
                send: trio.MemorySendChannel[Item]) -> None:
    async with receive, send:
        async for item in receive:
            await send.send(item)


async def skeleton_request() -> int:
    """The naive router's structure: prefill task + channel, then decode task + channel ->
    forwarding task + channel -> this task (the client)."""
    count = 0
    async with trio.open_nursery() as nursery:
        prefill_send, prefill_receive = trio.open_memory_channel[Item](BUFFER)
        nursery.start_soon(send_prefill, prefill_send)
        async with prefill_receive:
            handoff = await prefill_receive.receive()  # the handoff
        assert handoff.data is not None and handoff.data.disaggregated_params is not None
        decode_send, decode_receive = trio.open_memory_channel[Item](BUFFER)
        out_send, out_receive = trio.open_memory_channel[Item](BUFFER)
        nursery.start_soon(send_tokens, decode_send)
        nursery.start_soon(relay, decode_receive, out_send)
        async with out_receive:
            async for _ in out_receive:
                count += 1
    return count


async def minimal_producer(send: trio.MemorySendChannel[Item]) -> None:
    async with send:
        await send.send(prefill_output())
        for i in range(TOKENS - 1):
            await send.send(token(i))
        await send.send(last_token(TOKENS - 1))


async def minimal_request() -> int:
    """A nursery and one channel: one producer sends the prefill output and the tokens."""
    count = 0
    async with trio.open_nursery() as nursery:
        send, receive = trio.open_memory_channel[Item](BUFFER)
        nursery.start_soon(minimal_producer, send)
        async with receive:
            async for item in receive:
                if item.data is not None and item.data.disaggregated_params is None:
                    count += 1
    return count


def router_request(router: td.DisaggRouter) -> Callable[[], Awaitable[int]]:
    async def one() -> int:
        global BUFFER
        request = make_request(TOKENS)
        count = 0
        async with trio.open_nursery() as nursery:
            stream = await router.stream(nursery, request, td.RequestContext(request.request_id))
            BUFFER = int(stream.outputs.statistics().max_buffer_size)
            async with stream.outputs:
                async for item in stream.outputs:
                    if item.data is not None and item.data.token_ids:
                        count += 1
        return count

    return one


async def run_requests(one: Callable[[], Awaitable[int]], requests: int,
                       concurrency: int) -> float:
    """Run ``requests`` requests, ``concurrency`` at a time; return requests/s."""
    remaining = iter(range(requests))
    tokens: list[int] = []

    async def client() -> None:
        for _ in remaining:
            tokens.append(await one())

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    elapsed = time.perf_counter() - start
    assert tokens == [TOKENS] * requests, "a request lost tokens"
    return requests / elapsed


async def measure_p2(requests: int, concurrency: int, repeat: int) -> float:
    print(f"P2 orchestrated requests/s: {requests} requests per run at concurrency "
          f"{concurrency}, 1 prefill output + {TOKENS} tokens each, zero-latency mock "
          f"engines; {repeat} runs per variant, alternated; median")
    async with td.TransferKeeper(drain_window=0) as keeper:
        cluster = mock_cluster(latency=LatencyModel.zero(), default_max_tokens=TOKENS)
        router = td.DisaggRouter(td.WorkerPool(cluster.prefill),
                                 td.WorkerPool(cluster.decode), keeper)
        variants: dict[str, Callable[[], Awaitable[int]]] = {
            "router": router_request(router),
            "skeleton": skeleton_request,
            "minimal": minimal_request,
        }
        names = list(variants)
        samples: dict[str, list[float]] = {name: [] for name in names}
        for name in names:  # warm-up, not recorded; the router's first, for BUFFER
            await run_requests(variants[name], max(concurrency, requests // 10), concurrency)
        for rep in range(repeat):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                gc.collect()
                samples[name].append(await run_requests(variants[name], requests, concurrency))
        await keeper.wait_idle()
        counters = cluster.counters()
        assert router.in_flight == 0 and counters.held_blocks == 0, counters
    medians = {name: statistics.median(samples[name]) for name in names}
    labels = {
        "router": "DisaggRouter + mock engines",
        "skeleton": "bare skeleton, 3 tasks + 3 channels",
        "minimal": "bare minimal, 1 task + 1 channel",
    }
    for name in names:
        print(f"  {labels[name]:<38} {medians[name]:>9,.0f} req/s  "
              f"{medians[name] / medians['skeleton']:>5.2f}x  "
              f"({1e6 / medians[name]:>6.1f} us/request)")
    ratio = medians["router"] / medians["skeleton"]
    print(f"P2 target router / skeleton >= {P2_TARGET}x: "
          f"{'met' if ratio >= P2_TARGET else 'NOT met'} ({ratio:.2f}x; "
          f"{medians['router'] / medians['minimal']:.2f}x of the minimal floor)")
    return ratio


# --- P3: concurrent streams ------------------------------------------------------------

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SRC = str(Path(td.__file__).resolve().parent)
HERE = str(Path(__file__).resolve())


def rss_bytes() -> int | None:
    try:
        fields = Path("/proc/self/statm").read_text().split()
    except OSError:
        return None
    return int(fields[1]) * PAGE


class GCTimer:
    """Adds up the time the cyclic garbage collector runs (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections += 1

    def __enter__(self) -> GCTimer:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


class Streams:
    """S clients, each holding its stream open until every stream is in flight."""

    def __init__(self, router: td.DisaggRouter, count: int, tokens: int) -> None:
        self.router = router
        self.count = count
        self.tokens = tokens
        self.in_flight = 0
        self.completed = 0
        self.failed: list[str] = []
        self.all_in_flight = trio.Event()
        self.release = trio.Event()
        self.outputs: list[td.GatedOutputs | trio.MemoryReceiveChannel[Item]] = []

    async def client(self) -> None:
        request = make_request(self.tokens)
        tokens = 0
        last: Item | None = None
        try:
            async with trio.open_nursery() as nursery:
                stream = await self.router.stream(nursery, request,
                                                  td.RequestContext(request.request_id))
                self.outputs.append(stream.outputs)
                async with stream.outputs:
                    last = await stream.outputs.receive()  # the first token
                    tokens += len(last.data.token_ids) if last.data is not None else 0
                    self.in_flight += 1
                    if self.in_flight == self.count:
                        self.all_in_flight.set()
                    await self.release.wait()  # a slow reader
                    async for last in stream.outputs:
                        tokens += len(last.data.token_ids) if last.data is not None else 0
        except Exception as exc:  # reported, not raised: one lost stream must not hide others
            self.failed.append(f"{request.request_id}: {exc!r}")
            return
        finish = last.data.finish_reason if last is not None and last.data else None
        if tokens == self.tokens and finish is not None and finish.kind is td.FinishKind.LENGTH:
            self.completed += 1
        else:
            self.failed.append(f"{request.request_id}: {tokens} tokens, finish {finish}")


def call_site(traceback: tracemalloc.Traceback) -> str:
    """Who asked for an allocation: the innermost frame in trio_disagg, else in this script
    (the benchmark's client), else trio's own bookkeeping."""
    for frame in reversed(traceback):  # innermost first
        if frame.filename.startswith(SRC):
            where = Path(frame.filename).relative_to(Path(SRC).parent)
            code = linecache.getline(frame.filename, frame.lineno).strip()
            return f"{where}:{frame.lineno}  {code[:60]}"
        if frame.filename == HERE:
            return "the benchmark's client task and its request objects"
    return "trio internals, no trio_disagg frame (run queue, deadlines, ...)"


def breakdown(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, count: int,
              top: int) -> float:
    """Print the traced memory per stream by call site; return the bytes per stream."""
    sites: dict[str, int] = {}
    for stat in after.compare_to(before, "traceback"):
        site = call_site(stat.traceback)
        sites[site] = sites.get(site, 0) + stat.size_diff
    used = sum(sites.values())
    print(f"  tracemalloc: {used / 2**20:.1f} MiB traced for {count:,} streams in flight = "
          f"{used / count / 1024:.1f} KiB/stream; by call site (B/stream):")
    for site, size in sorted(sites.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {size / count:>7,.0f}  {site}")
    return used / count


async def token_bytes(count: int = 1000) -> float:
    """Traced bytes per decode output, as a mock decode engine builds and buffers them."""
    engine = mock_cluster(latency=LatencyModel.zero()).decode[0]
    request = make_request(count)
    send, receive = trio.open_memory_channel[Item](count)
    gc.collect()
    tracemalloc.start(1)
    base = tracemalloc.get_traced_memory()[0]
    # The buffer holds every output, so the engine runs to its end without blocking.
    await engine.generate(request, td.RequestContext("size"), send)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    buffered = receive.statistics().current_buffer_used
    receive.close()
    return used / buffered


@attrs.frozen
class P3Result:
    per_stream: float  # bytes
    unread: int  # tokens produced and not yet read, per stream, when measured
    ok: bool


async def p3_run(count: int, tokens: int, trace: bool, top: int,
                 freeze: bool = False, channel_buffer: int | None = None) -> P3Result:
    """Start ``count`` streams, measure memory once all are in flight with every decode leg
    blocked on a full channel, then read them all to the end."""
    latency = LatencyModel(inter_token_latency=0.01)
    async with td.TransferKeeper(drain_window=0) as keeper:
        cluster = mock_cluster(latency=latency, default_max_tokens=tokens)
        router = td.DisaggRouter(td.WorkerPool(cluster.prefill),
                                 td.WorkerPool(cluster.decode), keeper)
        if channel_buffer is not None:
            router = td.DisaggRouter(router.prefill, router.decode, keeper,
                                     channel_buffer=channel_buffer)
        warm = Streams(router, 8, 2)  # warm-up: imports, caches, code paths
        warm.release.set()
        async with trio.open_nursery() as nursery:
            for _ in range(warm.count):
                nursery.start_soon(warm.client)
        await keeper.wait_idle()
        streams = Streams(router, count, tokens)
        gc.collect()
        if freeze:  # as ``trio-disagg serve`` does once it listens
            gc.freeze()
        if trace:
            tracemalloc.start(FRAMES)
        before_rss = rss_bytes()
        before = tracemalloc.take_snapshot() if trace else None
        with GCTimer() as gc_time:
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(count):
                    nursery.start_soon(streams.client)
                await streams.all_in_flight.wait()
                ramp = time.perf_counter() - start
                # Let every decode leg run ahead until it blocks on a full channel: the
                # steady state of a slow reader, the same at any number of streams.
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                settled = time.perf_counter() - start
                in_client_channels = sum(out.statistics().current_buffer_used
                                         for out in streams.outputs)
                buffer = max(int(out.statistics().max_buffer_size) for out in streams.outputs)
                gc.collect()
                after_rss = rss_bytes()
                after = tracemalloc.take_snapshot() if trace else None
                if trace:
                    tracemalloc.stop()
                running = sum(decode.outstanding for decode in router.decode.workers)
                streams.release.set()
            total = time.perf_counter() - start
        await keeper.wait_idle()
        kv = cluster.counters()
    if freeze:
        gc.unfreeze()
    # Unread per stream: the decode leg's channel buffer (the gatekeeper reads it in the
    # client's task), plus the item the decode engine holds while blocked on its send (or
    # all that is left of a short stream).
    unread = min(tokens - 1, buffer + 1)
    if before is not None and after is not None:
        per_stream = breakdown(before, after, count, top)
    else:
        assert before_rss is not None and after_rss is not None
        per_stream = (after_rss - before_rss) / count
        print(f"  RSS: +{(after_rss - before_rss) / 2**20:.1f} MiB for {count:,} streams in "
              f"flight = {per_stream / 1024:.1f} KiB/stream")
    print(f"    all {count:,} in flight after {ramp:.2f} s; every decode leg blocked on a "
          f"full channel after {settled:.2f} s ({running:,} decode legs running, "
          f"{in_client_channels / count:.0f} tokens in each client channel, {unread} unread "
          f"in all); all read to the end after {total:.2f} s, {gc_time.seconds:.2f} s of it "
          f"in {gc_time.collections:,} GC runs; completed {streams.completed:,}/{count:,}; "
          f"KV held {kv.held_blocks}, stranded {kv.stranded_blocks}; router in flight "
          f"{router.in_flight}")
    for failure in streams.failed[:5]:
        print(f"    lost: {failure}")
    ok = (streams.completed == count and not streams.failed and kv.held_blocks == 0
          and router.in_flight == 0)
    return P3Result(per_stream, unread, ok)


def measure_p3(count: int, tokens: int, trace_count: int, top: int,
               gc_threshold: int | None, gc_freeze: bool = False,
               channel_buffer: int | None = None) -> bool:
    print(f"P3 concurrent streams: {count:,} streams of {tokens} tokens at 10 ms/token on mock "
          "engines; memory measured once all are in flight, each client a slow reader")
    saved = gc.get_threshold()
    if gc_threshold is not None:
        gc.set_threshold(gc_threshold, *saved[1:])
        print(f"  (GC generation-0 threshold set to {gc_threshold}; Python's default is 700)")
    if gc_freeze:
        print("  (gc.freeze() after the warm-up, as serve does once it listens)")
    try:
        main = (trio.run(p3_run, count, tokens, False, top, gc_freeze, channel_buffer)
                if rss_bytes() is not None else None)
        if main is None:
            print("  (no /proc/self/statm here: RSS not measured)")
        traced = None
        if trace_count:
            print(f"  tracemalloc run with {trace_count:,} streams (tracing is slow):")
            traced = trio.run(p3_run, trace_count, tokens, True, top, gc_freeze,
                              channel_buffer)
    finally:
        gc.set_threshold(*saved)
    result = main or traced
    if result is None:
        return True
    ok = all(r.ok for r in (main, traced) if r is not None)
    item = trio.run(token_bytes)
    own = result.per_stream - result.unread * item
    met = result.per_stream / 1024 < P3_TARGET_KIB and ok
    print(f"  a decode output takes {item:.0f} B traced: the {result.unread} unread tokens of a "
          f"stream are ~{result.unread * item / 1024:.1f} KiB of it; the stream itself "
          f"~{own / 1024:.1f} KiB")
    print(f"P3 target {count:,} streams, all completed, < {P3_TARGET_KIB:g} KiB each: "
          f"{'met' if met else 'NOT met'} ({result.per_stream / 1024:.1f} KiB/stream "
          f"({'RSS' if main is not None else 'tracemalloc'}) with the slow reader's unread "
          f"tokens, ~{own / 1024:.1f} KiB without; {'all' if ok else 'NOT all'} completed)")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=5_000, help="P2: requests per run")
    parser.add_argument("--concurrency", type=int, default=64, help="P2: concurrent requests")
    parser.add_argument("--repeat", type=int, default=5, help="P2: runs per variant")
    parser.add_argument("--streams", type=int, default=10_000, help="P3: concurrent streams")
    parser.add_argument("--stream-tokens", type=int, default=40,
                        help="P3: tokens per stream; above 35 the decode legs are still "
                        "running when measured")
    parser.add_argument("--trace-streams", type=int, default=200,
                        help="P3: streams in the tracemalloc run, which shows where the "
                        "memory goes (0: skip it)")
    parser.add_argument("--top", type=int, default=16,
                        help="P3: call sites to list in the tracemalloc breakdown")
    parser.add_argument("--gc-threshold", type=int, default=None,
                        help="P3: the GC's generation-0 threshold (default: Python's, 700)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="P3: gc.freeze() after the warm-up; with --gc-threshold 50000 "
                        "this is what `trio-disagg serve` does once it listens")
    parser.add_argument("--channel-buffer", type=int, default=None,
                        help="P3: the router's channel_buffer (default: its own, 4)")
    parser.add_argument("--only", choices=["p2", "p3"], help="run only one of the two")
    parser.add_argument("--quick", action="store_true",
                        help="a short run (a few seconds) that only checks the script works; "
                        "overrides the sizes")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.concurrency, args.repeat = 300, 32, 2
        args.streams, args.trace_streams = 300, 30
    if min(args.requests, args.concurrency, args.repeat, args.streams) < 1 or \
            args.stream_tokens < 2 or args.trace_streams < 0:
        parser.error("sizes must be >= 1, --stream-tokens >= 2, --trace-streams >= 0")
    ok = True
    if args.only != "p3":
        trio.run(measure_p2, args.requests, args.concurrency, args.repeat)
    if args.only != "p2":
        ok = measure_p3(args.streams, args.stream_tokens, args.trace_streams, args.top,
                        args.gc_threshold, args.gc_freeze, args.channel_buffer)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
