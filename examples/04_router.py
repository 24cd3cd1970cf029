"""Tutorial 4: the router drives real (mock) workers.

Run it with ``uv run python examples/04_router.py``.

Tutorials 1-3 built the pieces by hand. :class:`~trio_disagg.DisaggRouter` puts them
together: for each request it picks a prefill and a decode worker, runs the prefill leg in
the :class:`~trio_disagg.TransferKeeper`, and the decode leg and the
:class:`~trio_disagg.Gatekeeper` in the request's nursery. The workers here are the
in-process mock engines of :mod:`trio_disagg.mock`, which keep real KV block accounting:
a prefill *stages* KV blocks, a decode *pulls* (frees) them, and blocks nobody pulls are
*stranded* when their lease (TTL) runs out.

1. Sequential handoff (vLLM, TRT-LLM): prefill first, then its handoff goes into the
   decode request, then tokens.
2. Bootstrap handoff (SGLang): the router picks a bootstrap room and dispatches prefill and
   decode together (S5).
3. A terminal prefill: the first token is EOS, so there is nothing to hand off and no
   decode is dispatched (S7).
4. A client that disconnects while its prefill computes: the prefill completes in the
   keeper, and the staged KV is consumed by a minimal decode at once, not left to its 30 s
   lease (B1, G9). (The mock engines declare no cancel window, so it is ``never``: the
   router does not cancel their prefill, B10.)
5. A prefill failure reaches the client as a ``PrefillError`` (S1, T2).
"""

from __future__ import annotations

import logging
import sys

import trio

import trio_disagg as td
from trio_disagg.mock import LatencyModel, MockCluster, mock_cluster

Item = td.Annotated[td.LLMEngineOutput]
# 1 ms of prefill per prompt token, 0.2 ms of KV transfer per token, 10 ms per decoded token.
LATENCY = LatencyModel(ttft_per_prompt_token=0.001, inter_token_latency=0.01,
                       kv_transfer_per_token=0.0002)
PROMPT = " ".join(["word"] * 100)  # 100 prompt tokens: 100 ms of prefill, 7 KV blocks
T0 = 0.0


def now() -> str:
    return f"{(trio.current_time() - T0) * 1000:4.0f} ms"


def restart_clock() -> None:
    global T0
    T0 = trio.current_time()


def make_request(request_id: str, *, fault: str | None = None) -> td.PreprocessedRequest:
    """What the HTTP frontend builds from an OpenAI request body."""
    body: dict[str, object] = {"model": "mock", "prompt": PROMPT, "max_tokens": 5}
    if fault is not None:
        body["fault"] = fault  # the mock workers inject this fault (see FaultKind)
    return td.PreprocessedRequest(request_id=request_id, model="mock", body=body, max_tokens=5,
                                  stream=True)


class Announced:
    """Wraps an engine to print each request it is asked to serve. Anything with these
    four attributes and a ``generate`` method is an :class:`~trio_disagg.Engine`."""

    def __init__(self, inner: td.Engine) -> None:
        self.inner = inner
        self.name = inner.name
        self.handoff_style = inner.handoff_style
        self.bootstrap_host = inner.bootstrap_host
        self.bootstrap_port = inner.bootstrap_port

    async def generate(
        self,
        request: td.PreprocessedRequest,
        context: td.RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        note = ""
        if request.prefill_result is not None:
            params = request.prefill_result.disaggregated_params
            assert isinstance(params, dict)
            note = f" with the handoff: pull blocks {params['remote_block_ids']}"
        if request.bootstrap_info is not None:
            note = f" in bootstrap room {request.bootstrap_info.room:#x}"
        if request.max_tokens == 1 and not request.stream:
            note += " (max_tokens=1, stream=False)"
        print(f"  {now()}  {self.name} <- {request.request_id}{note}")
        await self.inner.generate(request, context, send_channel, task_status=task_status)


def make_router(keeper: td.TransferKeeper, cluster: MockCluster) -> td.DisaggRouter:
    return td.DisaggRouter(
        td.WorkerPool([Announced(engine) for engine in cluster.prefill]),
        td.WorkerPool([Announced(engine) for engine in cluster.decode]),
        keeper,
        deadlines=td.Deadlines(prefill=5, handoff=5, decode_idle=5, terminal_hold=5),
    )


def kv(cluster: MockCluster) -> str:
    c = cluster.counters()
    return (f"KV blocks held={c.held_blocks} staged={c.staged_blocks} freed={c.freed_blocks} "
            f"stranded={c.stranded_blocks}")


async def run(
    router: td.DisaggRouter, cluster: MockCluster, request: td.PreprocessedRequest
) -> None:
    """One client: send the request, print its stream. This nursery is the request."""
    async with trio.open_nursery() as nursery:
        # Returns once the decode worker accepted the request (or at once for a terminal
        # prefill); the decode leg and the gatekeeper then run in `nursery`.
        stream = await router.stream(nursery, request, td.RequestContext(request.request_id))
        print(f"  {now()}  stream() returned: style={stream.style}, "
              f"{stream.prefill_worker} -> {stream.decode_worker}, {kv(cluster)}")
        async with stream.outputs:
            async for item in stream.outputs:
                assert item.data is not None
                finish = item.data.finish_reason
                end = f", finish={finish}" if finish is not None else ""
                print(f"  {now()}  client <- {item.data.text!r}{end}")


async def sequential(keeper: td.TransferKeeper) -> None:
    print("1. Sequential handoff: prefill, handoff, then decode.")
    cluster = mock_cluster(latency=LATENCY)
    router = make_router(keeper, cluster)
    restart_clock()
    await run(router, cluster, make_request("req-1"))
    await keeper.wait_idle()
    print(f"  {now()}  done: {kv(cluster)}, served={cluster.counters().served}")
    print("   stream() returned after the prefill had staged 7 blocks and handed off; the")
    print("   decode pulled them (20 ms) before its first token, which freed them.\n")


async def bootstrap(keeper: td.TransferKeeper) -> None:
    print("2. Bootstrap handoff: the router picks a room, prefill and decode run together.")
    cluster = mock_cluster(style=td.HandoffStyle.BOOTSTRAP, latency=LATENCY)
    router = make_router(keeper, cluster)
    restart_clock()
    await run(router, cluster, make_request("req-2"))
    await keeper.wait_idle()
    print(f"  {now()}  done: {kv(cluster)}, served={cluster.counters().served}")
    print("   both legs were dispatched at 0 ms, before any KV existed: the decode waited in")
    print("   the room and pulled the KV once staged. The gatekeeper let the last token")
    print("   (the success terminal) through only because the prefill leg, drained in the")
    print("   keeper, had succeeded by then (G5).\n")


async def terminal(keeper: td.TransferKeeper) -> None:
    print("3. Terminal prefill: the first token is EOS, so no decode at all (S7).")
    cluster = mock_cluster(latency=LATENCY)
    router = make_router(keeper, cluster)
    restart_clock()
    await run(router, cluster, make_request("req-3", fault="eos_first_token"))
    await keeper.wait_idle()
    print(f"  {now()}  done: {kv(cluster)}; no decode worker was asked\n")


async def disconnect(keeper: td.TransferKeeper) -> None:
    print("4. The client disconnects 50 ms into its 100 ms prefill (B1, G9).")
    cluster = mock_cluster(latency=LATENCY, kv_ttl=30.0)
    router = make_router(keeper, cluster)
    restart_clock()
    # A disconnect, as the server's disconnect listener does it: cancel the request.
    with trio.move_on_after(0.05):
        await run(router, cluster, make_request("req-4"))
    print(f"  {now()}  client gone; keeper.in_flight={keeper.in_flight} (the prefill runs on), "
          f"{kv(cluster)}")
    # The prefill leg lives in the keeper, not in the request: it runs on, stages its KV,
    # finds nobody to decode it, and sends a minimal decode to consume it (B1).
    await keeper.wait_idle()
    print(f"  {now()}  keeper idle: {kv(cluster)}")
    print(f"           cleanup decodes={router.counters.staged_kv_cleanups}; "
          f"the blocks were freed in ms, not after their 30 s lease\n")


async def prefill_failure(keeper: td.TransferKeeper) -> None:
    print("5. The prefill worker fails before its handoff.")
    cluster = mock_cluster(latency=LATENCY)
    router = make_router(keeper, cluster)
    restart_clock()
    try:
        await run(router, cluster, make_request("req-5", fault="prefill_fail_before_handoff"))
    except* td.PrefillError as group:  # raised by stream(), inside the request's nursery
        print(f"  {now()}  client gets PrefillError: {group.exceptions[0]}")
    await keeper.wait_idle()
    print(f"  {now()}  router in_flight={router.in_flight}, keeper in_flight="
          f"{keeper.in_flight}, {kv(cluster)}")


async def main() -> None:
    # The keeper logs failed drains (T2) to "trio_disagg.keeper"; show them inline.
    logging.basicConfig(stream=sys.stdout, format="  [log] %(name)s: %(message)s")
    # One keeper for the life of the service, outside every request's nursery.
    async with td.TransferKeeper() as keeper:
        await sequential(keeper)
        await bootstrap(keeper)
        await terminal(keeper)
        await disconnect(keeper)
        await prefill_failure(keeper)


# tests/test_examples.py runs this file and checks that its output contains each line
# that starts with `# expect: `.
# expect: stream() returned: style=sequential, prefill-0 -> decode-0, KV blocks held=7 staged=7
# expect: stream() returned: style=bootstrap, prefill-0 -> decode-0, KV blocks held=0 staged=0
# expect: finish=length
# expect: stream() returned: style=terminal, prefill-0 -> None
# expect: finish=eos
# expect: client gone; keeper.in_flight=1 (the prefill runs on)
# expect: (max_tokens=1, stream=False)
# expect: keeper idle: KV blocks held=0 staged=7 freed=7 stranded=0
# expect: cleanup decodes=1
# expect: client gets PrefillError: Prefill returned an error: prefill-0: injected fault
# expect: router in_flight=0, keeper in_flight=0

if __name__ == "__main__":
    trio.run(main)
