"""P1 (docs/design.md): the per-token cost of the gatekeeper pipeline against bare trio.

Run it with ``uv run python benchmarks/gate_overhead.py [--tokens N] [--repeat R] [--quick]``.

Four pipelines move the same pre-built ``Annotated[LLMEngineOutput]`` items (N - 1 tokens
and one ``eos`` terminal), with the same channel buffer size on both hops:

- bare: producer -> channel -> plain forwarding task (``async for``) -> channel -> consumer.
  This is the P1 baseline.
- bare, receive_nowait first: the same hop with the one trick the gatekeeper uses, taking
  an item that is already there without a schedule point. It isolates the gatekeeper's
  own cost from that trick, which makes the gatekeeper *faster* than the plain hop when
  the channels have buffers.
- Gatekeeper, prefill succeeded: producer -> channel -> ``Gatekeeper.forward`` -> channel
  -> consumer, the prefill already succeeded (the hot path, G7).
- Gatekeeper, prefill pending: the same, but the prefill stays pending until the producer
  reaches the terminal, so every token takes the "prefill pending" path (G3) and the
  terminal is held (G5).

The variants are measured side by side in one run, in an order that rotates with each
repetition, after one warm-up run each. The script prints the median ns/token of each and
its ratio to bare. The P1 target is Gatekeeper / bare <= 1.2x. Nothing is asserted:
timings are reported, never tested.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial

import trio

import trio_disagg as td

Item = td.Annotated[td.LLMEngineOutput]
Variant = Callable[[list[Item], int], Awaitable[int]]
Hop = Callable[[trio.MemoryReceiveChannel[Item], trio.MemorySendChannel[Item]], Awaitable[None]]
TARGET = 1.2


def build_items(tokens: int) -> list[Item]:
    items = [
        td.Annotated.from_data(td.LLMEngineOutput(token_ids=[i], text="x"))
        for i in range(tokens - 1)
    ]
    items.append(td.Annotated.from_data(td.LLMEngineOutput(finish_reason=td.FinishReason.EOS)))
    return items


async def produce(
    send: trio.MemorySendChannel[Item], items: list[Item], before_terminal: trio.Event | None
) -> None:
    async with send:
        last = len(items) - 1
        for index, item in enumerate(items):
            if index == last and before_terminal is not None:
                before_terminal.set()  # the prefill succeeds as the terminal is reached
            await send.send(item)


async def consume(receive: trio.MemoryReceiveChannel[Item], counted: list[int]) -> None:
    count = 0
    async with receive:
        async for _ in receive:
            count += 1
    counted.append(count)


async def forward(
    receive: trio.MemoryReceiveChannel[Item], send: trio.MemorySendChannel[Item]
) -> None:
    """The bare hop: move items from one channel to the other, nothing else."""
    async with send, receive:
        async for item in receive:
            await send.send(item)


async def forward_nowait(
    receive: trio.MemoryReceiveChannel[Item], send: trio.MemorySendChannel[Item]
) -> None:
    """A bare hop with the gatekeeper's one trick: take a buffered item without a
    schedule point (``receive_nowait``), and block only when the buffer is empty."""
    async with send, receive:
        while True:
            try:
                item = receive.receive_nowait()
            except trio.WouldBlock:
                try:
                    item = await receive.receive()
                except trio.EndOfChannel:
                    break
            except trio.EndOfChannel:
                break
            await send.send(item)


async def run_bare(hop: Hop, items: list[Item], buffer: int) -> int:
    send1, receive1 = trio.open_memory_channel[Item](buffer)
    send2, receive2 = trio.open_memory_channel[Item](buffer)
    counted: list[int] = []
    start = time.perf_counter_ns()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce, send1, items, None)
        nursery.start_soon(hop, receive1, send2)
        nursery.start_soon(consume, receive2, counted)
    elapsed = time.perf_counter_ns() - start
    assert counted == [len(items)], counted
    return elapsed


async def run_gate(keeper: td.TransferKeeper, pending: bool, items: list[Item], buffer: int) -> int:
    release = trio.Event()
    if not pending:
        release.set()
    prefill = keeper.start(release.wait, name="bench")
    if not pending:
        await prefill.wait()
    gate = td.Gatekeeper(prefill, td.RequestContext("bench"))
    send1, receive1 = trio.open_memory_channel[Item](buffer)
    send2, receive2 = trio.open_memory_channel[Item](buffer)
    counted: list[int] = []
    start = time.perf_counter_ns()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce, send1, items, release if pending else None)
        nursery.start_soon(gate.forward, receive1, send2)
        nursery.start_soon(consume, receive2, counted)
    elapsed = time.perf_counter_ns() - start
    assert counted == [len(items)], counted
    assert gate.failure is None and prefill.succeeded
    return elapsed


VARIANTS = {
    "bare": "bare 2-hop, plain forwarding task",
    "nowait": "bare 2-hop, receive_nowait first",
    "gate": "Gatekeeper, prefill succeeded",
    "pending": "Gatekeeper, prefill pending",
}


async def measure(tokens: int, repeat: int, buffers: list[int]) -> None:
    items = build_items(tokens)
    print(f"P1 gate overhead: {tokens} tokens per run, {repeat} runs per variant, "
          "variants alternated; median ns/token and ratio to the plain bare pipeline")
    worst = 0.0
    async with td.TransferKeeper(drain_window=0) as keeper:
        for buffer in buffers:
            variants: dict[str, Variant] = {
                "bare": partial(run_bare, forward),
                "nowait": partial(run_bare, forward_nowait),
                "gate": partial(run_gate, keeper, False),
                "pending": partial(run_gate, keeper, True),
            }
            names = list(variants)
            samples: dict[str, list[float]] = {name: [] for name in names}
            for name in names:  # warm-up, not recorded
                await variants[name](items, buffer)
            for rep in range(repeat):
                shift = rep % len(names)
                for name in names[shift:] + names[:shift]:
                    gc.collect()
                    elapsed = await variants[name](items, buffer)
                    samples[name].append(elapsed / tokens)
            medians = {name: statistics.median(samples[name]) for name in names}
            bare = medians["bare"]
            print(f"channel buffer {buffer}:")
            for name in names:
                print(f"  {VARIANTS[name]:<36} {medians[name]:>8.0f} ns/token  "
                      f"{medians[name] / bare:>5.2f}x")
            worst = max(worst, medians["gate"] / bare, medians["pending"] / bare)
            print(f"  (Gatekeeper vs the receive_nowait bare hop: "
                  f"{medians['gate'] / medians['nowait']:.2f}x succeeded, "
                  f"{medians['pending'] / medians['nowait']:.2f}x pending)")
    verdict = "met" if worst <= TARGET else "NOT met"
    print(f"P1 target Gatekeeper / bare <= {TARGET}x: {verdict} (worst {worst:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=10_000, help="tokens per run")
    parser.add_argument("--repeat", type=int, default=9, help="repetitions per variant")
    parser.add_argument("--buffers", type=int, nargs="+", default=[0, 64],
                        help="channel buffer sizes to measure (both hops)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run (~1 s) that only checks the script works; "
                        "overrides --tokens and --repeat")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeat = 1_000, 3
    if args.tokens < 2 or args.repeat < 1 or any(buffer < 0 for buffer in args.buffers):
        parser.error("need --tokens >= 2, --repeat >= 1 and buffers >= 0")
    trio.run(measure, args.tokens, args.repeat, args.buffers)


if __name__ == "__main__":
    main()
