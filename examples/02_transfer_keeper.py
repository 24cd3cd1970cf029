"""Tutorial 2: the transfer keeper owns the prefill drain.

Run it with ``uv run python examples/02_transfer_keeper.py``.

After the prefill worker has sent its first output (the handoff), its stream stays open
while the KV cache moves to the decode worker: reading that stream to its end is the
*drain*. If the drain were a child of the request's nursery, a client that disconnects
would abort a KV transfer halfway, leaving the decode worker waiting for blocks that never
come and the prefill worker holding blocks nobody frees.

So the drain belongs to a :class:`~trio_disagg.TransferKeeper`: a nursery opened once for
the service's lifetime, *outside* every request. The request only observes the drain
through a :class:`~trio_disagg.PrefillTask` (rules T1-T3, G9):

1. The client goes away mid-transfer: the request is cancelled, the drain completes, and
   the KV lease (a teardown guard) is released when the drain ends, not when the client
   left (T1, G9, S5).
2. A drain that fails after its client has gone logs the error from inside, so the
   evidence survives (T2). The failure here is a later output with ``finish=cancelled``,
   which fails the drain (T4).
3. A drain still stuck when the keeper shuts down is cancelled after the drain window;
   waiting on it raises ``PrefillError`` "did not complete" (T3, B3).

Each time, ``keeper.in_flight`` goes back to 0 (B5).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import trio

import trio_disagg as td

Item = td.Annotated[td.LLMEngineOutput]
BOOTSTRAP = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 42}
CHUNK = td.Annotated.from_data(td.LLMEngineOutput())  # "still transferring"
DONE = td.Annotated.from_data(td.LLMEngineOutput.length())  # the prefill leg's last output
ABORTED = td.Annotated.from_data(td.LLMEngineOutput(finish_reason=td.FinishReason.CANCELLED))
T0 = 0.0


def now() -> str:
    return f"{(trio.current_time() - T0) * 1000:4.0f} ms"


def handoff(request_id: str) -> Item:
    """An SGLang-style first prefill output: a bootstrap handoff (S5)."""
    output = td.LLMEngineOutput(token_ids=[1], disaggregated_params=BOOTSTRAP)
    return td.Annotated(data=output, id=request_id)


async def fake_prefill_worker(
    send: trio.MemorySendChannel[Item], outputs: list[Item], delay: float
) -> None:
    """Stands in for a prefill worker: the first output at once, the rest one every
    ``delay`` s while the KV cache moves. It is another process in real life, so here it
    runs in the service's ``workers`` nursery, not in the request."""
    async with send:
        try:
            await send.send(outputs[0])
            for item in outputs[1:]:
                await trio.sleep(delay)
                await send.send(item)
        except trio.BrokenResourceError:
            print(f"  {now()}  prefill worker: the router stopped reading; transfer aborted")


@contextmanager
def kv_lease(request_id: str) -> Iterator[None]:
    """A teardown guard: the KV blocks staged for this request, held while the drain runs."""
    print(f"  {now()}  KV lease for {request_id} taken")
    try:
        yield
    finally:
        print(f"  {now()}  KV lease for {request_id} released")


async def start_prefill(
    keeper: td.TransferKeeper, workers: trio.Nursery, request_id: str, rest: list[Item]
) -> td.PrefillTask[td.Handoff]:
    """Read a bootstrap prefill's first output here, in the request, and hand the rest of
    the stream to the keeper (S5), under the request's name (its logs and task names)."""
    send, receive = trio.open_memory_channel[Item](0)
    workers.start_soon(fake_prefill_worker, send, [handoff(request_id), *rest], 0.02)
    completion = await td.consume_prefill_stream(
        receive, keeper=keeper, name=request_id, guard=kv_lease(request_id)
    )
    assert isinstance(completion, td.Handoff) and completion.drain is not None
    print(f"  {now()}  handoff received (bootstrap={completion.bootstrap}); "
          f"the keeper drains the rest")
    return completion.drain


async def client_leaves_mid_transfer(keeper: td.TransferKeeper, workers: trio.Nursery) -> None:
    print("1. The client disconnects 30 ms into a 100 ms KV transfer (T1, G9).")
    # The client's disconnect, as the server's disconnect listener would do it: cancel the
    # request. Here the request is the body of this `with` block.
    with trio.move_on_after(0.03) as request:
        drain = await start_prefill(keeper, workers, "req-1", [CHUNK, CHUNK, CHUNK, CHUNK, DONE])
        await drain.result()  # the request observes the drain (tutorial 3: the gatekeeper)
    print(f"  {now()}  client gone, request cancelled={request.cancelled_caught}; "
          f"the drain is {drain!r}, keeper.in_flight={keeper.in_flight}")
    await drain.wait_done()  # ...but the keeper owns it, so it runs on to the end
    print(f"  {now()}  {drain!r}, keeper.in_flight={keeper.in_flight}\n")


async def failed_drain_logs_from_inside(
    keeper: td.TransferKeeper, workers: trio.Nursery
) -> None:
    print("2. The prefill worker aborts after its client has gone (T2, T4).")
    with trio.move_on_after(0.01):  # the client leaves right after the handoff
        drain = await start_prefill(keeper, workers, "req-2", [CHUNK, ABORTED])
        await drain.result()
    print(f"  {now()}  client gone; nobody is waiting on {drain.name} any more")
    await drain.wait_done()
    print(f"  {now()}  {drain!r}: {drain.error}; keeper.in_flight={keeper.in_flight}")
    print("           the [log] line was written by the keeper itself, from inside the "
          "drain:\n           the evidence survives the client.\n")


async def stuck_drain_at_shutdown(workers: trio.Nursery) -> None:
    print("3. Shutdown with a drain whose prefill worker never finishes (T3, B3).")
    async with td.TransferKeeper(drain_window=0.05) as keeper:
        drain = await start_prefill(keeper, workers, "req-3", [CHUNK] * 1000)
        print(f"  {now()}  shutting down with a drain window of 50 ms, keeper.in_flight="
              f"{keeper.in_flight}")
    print(f"  {now()}  keeper closed: in_flight={keeper.in_flight}, "
          f"cancelled_total={keeper.cancelled_total}")
    try:
        await drain.result()
    except td.PrefillError as exc:
        print(f"  {now()}  waiting on it raises PrefillError: {exc}")


async def main() -> None:
    global T0
    T0 = trio.current_time()
    # The keeper logs to the "trio_disagg.keeper" logger; show its warnings inline.
    logging.basicConfig(stream=sys.stdout, format="  [log] %(name)s: %(message)s")
    async with trio.open_nursery() as workers:  # the fake prefill workers live here
        # The keeper is opened once, for the life of the service, outside every request.
        async with td.TransferKeeper(drain_window=1.0) as keeper:
            await client_leaves_mid_transfer(keeper, workers)
            await failed_drain_logs_from_inside(keeper, workers)
        await stuck_drain_at_shutdown(workers)


# tests/test_examples.py runs this file and checks that its output contains each line
# that starts with `# expect: `.
# expect: <PrefillTask 'req-1' succeeded>, keeper.in_flight=0
# expect: prefill drain req-2 failed: Prefill backend cancelled
# expect: waiting on it raises PrefillError: Prefill background task did not complete
# expect: keeper closed: in_flight=0

if __name__ == "__main__":
    trio.run(main)
