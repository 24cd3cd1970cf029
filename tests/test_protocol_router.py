"""The router against each protocol's mock workers over real sockets, for what the
protocols share: ``stop_generating`` closes the decode response (G4), and client
disconnects never abort the prefill and never strand KV (G9, B1, B5).

vLLM and TensorRT-LLM hand off sequentially (the prefill, or context, finishes before the
decode, or generation, request is sent), so every disconnect case applies to both. SGLang
dispatches both legs at once and meets in a bootstrap room: it shares only the cases after
the first token here; its disconnects during the prefill and while the decode dispatch is
pending stay in ``test_sglang``. What only one protocol does stays in its own module.

Everything runs on 127.0.0.1 with port 0 and the real clock; every wait is bounded.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
from e2e_support import FAST, PROTOCOLS, SLOW_TOKENS, ProtocolName, cluster_factory, wait_until
from protocol_support import Cluster, completion, gating, refusal

from trio_disagg import CancelWindow, FinishKind, RequestContext, WorkerError

#: The sequential-handoff protocols (docs/protocols.md sections 2 and 4).
SEQUENTIAL: tuple[ProtocolName, ...] = ("vllm", "trtllm")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_G4_stop_generating_closes_the_decode_response(protocol: ProtocolName) -> None:
    cluster: Cluster[Any]
    async with cluster_factory(protocol)(latency=SLOW_TOKENS) as cluster:
        context = RequestContext("stop-1")
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                stream = await cluster.router.stream(
                    nursery, completion("stop-1", max_tokens=200), context)
                with stream.outputs:
                    first = await stream.outputs.receive()
                    context.stop_generating()
                    rest = [item async for item in stream.outputs]
        assert first.data is not None and first.data.text
        last = rest[-1]
        assert last.data is not None and last.data.finish_reason is not None
        assert last.data.finish_reason.kind is FinishKind.CANCELLED
        # every protocol's decode worker aborts the request when its response is closed
        await wait_until(lambda: cluster.decode.stats.aborted == 1)
        await cluster.settled()
        assert cluster.prefill.stats.aborted == 0


# --- client disconnects: never strand KV (G9, B1, B10) -------------------------------------


@pytest.mark.parametrize("protocol", SEQUENTIAL)
@pytest.mark.parametrize("window", [CancelWindow.NEVER, None], ids=["never", "engine-window"])
async def test_G9_B1_B10_disconnect_during_the_prefill(
    protocol: ProtocolName, window: CancelWindow | None
) -> None:
    """Outside a cancel window the prefill runs to its end and a cleanup decode pulls its
    KV (G9, B1); inside the engine's own window (vLLM anytime, TRT-LLM before_handoff) it
    is cancelled at once and nothing is ever staged (B10)."""
    # 1.35 s: longer than the grace a stopped prefill gets for an answer on its way
    slow_prefill = attrs.evolve(FAST, ttft_per_prompt_token=0.03)
    cluster: Cluster[Any]
    async with cluster_factory(protocol)(latency=slow_prefill, cancel_window=window) as cluster:
        with trio.move_on_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cluster.router.stream, nursery, completion("dp"),
                                   RequestContext("dp"))
                await wait_until(lambda: cluster.prefill.stats.running == 1)
                nursery.cancel_scope.cancel()  # the client goes away
        await cluster.settled()  # within 5 s; the TTL (TRT-LLM: the lease) is 120 s
        counters = cluster.prefill.kv.counters()
        router = cluster.router.counters
        if window is CancelWindow.NEVER:
            assert cluster.prefill.stats.aborted == 0 and cluster.prefill.stats.completed == 1
            assert (counters.served, counters.aborted, counters.stranded_blocks) == (1, 0, 0)
            assert router.staged_kv_cleanups == 1  # B1 pulled it
        else:
            assert cluster.prefill.stats.prefills_aborted == 1  # its compute saved
            assert (counters.staged_blocks, counters.stranded_blocks) == (0, 0)
            assert (router.prefills_cancelled, router.staged_kv_cleanups) == (1, 0)
            assert not cluster.decode.seen


@pytest.mark.parametrize("protocol", SEQUENTIAL)
async def test_B1_disconnect_at_the_handoff(protocol: ProtocolName) -> None:
    gated, wrap = gating()
    cluster: Cluster[Any]
    async with cluster_factory(protocol)(wrap_decode=wrap) as cluster:
        (gate,) = gated
        with trio.move_on_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cluster.router.stream, nursery, completion("dh"),
                                   RequestContext("dh"))
                with trio.fail_after(5):
                    await gate.entered.wait()  # the handoff is ready, the decode not accepted
                assert cluster.prefill.kv.counters().held_blocks == 3
                nursery.cancel_scope.cancel()
        gate.gate.set()
        await cluster.settled()
        assert cluster.prefill.stats.aborted == 0
        counters = cluster.prefill.kv.counters()
        assert (counters.served, counters.aborted, counters.stranded_blocks) == (1, 0, 0)
        if protocol == "trtllm":
            # The generation leg is part of the transfer until it fetched the KV: it was
            # kept, and it pulled the KV itself (B6).
            assert (cluster.router.counters.staged_kv_cleanups, gate.calls) == (0, 1)
        else:
            # vLLM: the cancelled decode never reached the worker; a cleanup pulled it (B1)
            assert (cluster.router.counters.staged_kv_cleanups, gate.calls) == (1, 2)


@pytest.mark.parametrize("protocol", SEQUENTIAL)
async def test_G9_disconnect_during_the_kv_pull(protocol: ProtocolName) -> None:
    # The prefill worker keys the staged KV differently: vLLM by the request id, TRT-LLM by
    # the ctx_request_id it assigned to the context (the first one is "1").
    kv_key = {"vllm": "dk", "trtllm": "1"}[protocol]
    slow_pull = attrs.evolve(FAST, kv_transfer_per_token=0.02)  # 0.9 s
    cluster: Cluster[Any]
    async with cluster_factory(protocol)(latency=slow_pull) as cluster:
        kv = cluster.prefill.kv
        with trio.move_on_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cluster.router.stream, nursery, completion("dk"),
                                   RequestContext("dk"))
                # claimed by the decode's pull, not yet transferred
                await wait_until(lambda: kv.counters().held_blocks == 3
                                 and kv.lookup(kv_key) is None)
                nursery.cancel_scope.cancel()
        await cluster.settled()
        await wait_until(lambda: cluster.decode.stats.aborted == 1)
        assert cluster.prefill.stats.aborted == 0 and cluster.prefill.stats.completed == 1
        counters = kv.counters()
        if protocol == "trtllm":
            # The generation leg was kept until it fetched the KV, then it ended (B6).
            assert (counters.served, counters.aborted, counters.stranded_blocks) == (1, 0, 0)
        else:
            # vLLM: the interrupted transfer freed the blocks at once
            assert (counters.served, counters.aborted, counters.stranded_blocks) == (0, 1, 0)
        assert cluster.router.counters.staged_kv_cleanups == 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_G9_disconnect_mid_stream(protocol: ProtocolName) -> None:
    cluster: Cluster[Any]
    async with cluster_factory(protocol)(latency=SLOW_TOKENS) as cluster:
        with trio.move_on_after(10):
            async with trio.open_nursery() as nursery:
                stream = await cluster.router.stream(
                    nursery, completion("ds", max_tokens=200), RequestContext("ds"))
                with stream.outputs:
                    for _ in range(3):
                        await stream.outputs.receive()
                nursery.cancel_scope.cancel()
        await wait_until(lambda: cluster.decode.stats.aborted == 1)
        await cluster.settled()
        assert cluster.prefill.stats.aborted == 0 and cluster.prefill.stats.completed == 1
        counters = cluster.prefill.kv.counters()
        assert (counters.served, counters.aborted) == (1, 0)


@pytest.mark.parametrize("protocol", SEQUENTIAL)
@pytest.mark.parametrize("status", [400, 500, 502, 503])
async def test_B1_a_decode_refusal_leaves_no_kv_staged(protocol: ProtocolName, status: int) -> None:
    """A decode worker that refuses the request (whatever its status) never used the KV:
    a cleanup decode consumes it at once rather than leaving it to the lease (B1). Only a
    refusal that says the KV itself was lost gets none (see the decode_kv_lost tests)."""
    cluster: Cluster[Any]
    async with cluster_factory(protocol)() as cluster:
        error = await refusal(cluster, completion("dr", fault=f"decode_reject:{status}"))
        assert isinstance(error, WorkerError)
        await cluster.settled()
        counters = cluster.prefill.kv.counters()
        assert (counters.served, counters.stranded_blocks) == (1, 0)
        assert cluster.router.counters.staged_kv_cleanups == 1


@pytest.mark.parametrize("protocol", SEQUENTIAL)
async def test_B1_the_cleanup_decode_has_an_id_of_its_own(protocol: ProtocolName) -> None:
    """A decode worker may still run the request's id when the cleanup decode reaches it:
    an aborted decode leg the worker has not yet seen end (its disconnect is noticed
    later). vLLM, as the mocks, refuses an id already running with a 400, so a cleanup
    decode sent with the request's own id failed and left the KV to the lease (seen in the
    demo: "B1 cleanup decode for demo-0-37.589daf1c26 failed: ... already running")."""
    cluster: Cluster[Any]
    async with cluster_factory(protocol)() as cluster:
        cluster.decode.running_ids.add("dr")  # the aborted decode leg, still running there
        error = await refusal(cluster, completion("dr", fault="decode_reject:503"))
        assert isinstance(error, WorkerError)
        await cluster.settled()
        counters = cluster.prefill.kv.counters()
        assert (counters.served, counters.stranded_blocks, counters.held_blocks) == (1, 0, 0)
        assert cluster.router.counters.staged_kv_cleanup_failures == 0
