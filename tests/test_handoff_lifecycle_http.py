"""The life of a handoff at the HTTP level: the router's own server on a real port in front
of one protocol's mock workers, driven with ``httpx``, for the cases where a leg or the
KV it stands for could outlive its purpose: an answer at the prefill deadline (B1), a
decode that refuses before joining its room, a generation leg queued past the client, a
prefill that fails after the client left (B6), a decode that lost the KV, an invalid
handoff (B7), and a client that leaves inside the prefill's cancel window (B10).

Every test ends the same way (:func:`assert_clean`): nothing in flight on the router or in
its keeper, no generation request open on either worker (their ``/stats``), no KV block
held and none stranded on the prefill worker.

Some of these are the behaviour the router's rewrite brings; they fail against a router
that does not do it yet.

Everything runs on 127.0.0.1 with port 0 and the real clock; every wait is bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import orjson
import pytest
import trio
import trio.testing
from e2e_support import FAST, MODEL, PROMPT, PROMPT_TOKENS, ProtocolName, wait_until
from lifecycle_support import (
    KV_TTL,
    assert_clean,
    body,
    client_leaves,
    error_of,
    eventually,
    post,
    routed,
    worker_stats,
)

from trio_disagg import CancelWindow, Deadlines
from trio_disagg.workers import MockWorker, create_mock_worker, serve_worker

# --- B1: an answer at the prefill deadline ------------------------------------------------

PREFILL_DEADLINE = 0.5


@pytest.mark.parametrize("offset", [-0.2, -0.02, -0.002, 0.002, 0.02])
async def test_B1_answer_at_the_prefill_deadline_strands_nothing(offset: float) -> None:
    """The prefill answers ``offset`` seconds from the router's prefill deadline (as the
    worker measures it, from receipt: a little later on the router's clock). Late: 504;
    near the edge: success or 504; either way the staged KV is pulled by the request's
    decode or by a one-token cleanup decode, or was never staged (the prefill was
    aborted): nothing is left to the lease."""
    latency = attrs.evolve(FAST, ttft_per_prompt_token=(PREFILL_DEADLINE + offset)
                           / PROMPT_TOKENS)
    async with routed("vllm", prefill_latency=latency,
                      deadlines=Deadlines(prefill=PREFILL_DEADLINE)) as r:
        response = await post(r, "edge")
        if offset > 0:
            assert response.status_code == 504, response.text
        elif offset <= -0.1:
            assert response.status_code == 200, response.text
        else:
            assert response.status_code in (200, 504), response.text
        await assert_clean(r)
        counters = r.prefill.kv.counters()
        decodes = list(r.decode.seen)
        if response.status_code == 200:
            assert len(response.json()["choices"][0]["text"].split()) == 3
            (decode,) = decodes
            assert decode.body["max_tokens"] == 3
            assert counters.served == 1
        else:
            assert error_of(response)["code"] == "prefill_deadline_exceeded"
            assert len(decodes) <= 1
            for decode in decodes:  # B1: one token (the vLLM adapter streams every decode)
                assert decode.body["max_tokens"] == 1
            if counters.staged_blocks:  # pulled by the cleanup decode, or freed by an abort
                assert (counters.served, len(decodes)) in ((1, 1), (0, 0)), counters
                assert counters.served + counters.aborted == 1, counters


# --- B6: nothing waits for what cannot come ------------------------------------------------


async def test_B6_sglang_decode_refusing_before_the_room_ends_the_prefill_at_once() -> None:
    """The decode refuses (400) before joining the room: the client gets the 400, the
    prefill leg is ended at once (its worker sees the request aborted, long before its
    300 s bootstrap wait), and no cleanup decode is sent into the room."""
    async with routed("sglang") as r:
        response = await post(r, "refused", fault="decode_reject:400")
        assert response.status_code == 400, response.text
        assert "decode_reject" in error_of(response)["message"]
        await eventually("the prefill leg ended", lambda: r.prefill.stats.open == 0,
                         seconds=2.0, state=lambda: (r.prefill.stats, list(r.decode.seen)))
        decode = (await worker_stats(r, r.cluster.decode_url))["stats"]
        assert (decode["requests"], decode["failed"]) == (1, 1), "a decode joined the room"
        assert [seen.request_id.rpartition(".")[0] for seen in r.decode.seen] == ["refused"]
        prefill = (await worker_stats(r, r.cluster.prefill_url))["stats"]
        assert prefill["aborted"] == 1
        await assert_clean(r)
        assert r.cluster.router.counters.staged_kv_cleanups == 0
        counters = r.prefill.kv.counters()
        assert (counters.served, counters.stranded_blocks) == (0, 0)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
async def test_B6_trtllm_generation_leg_queued_past_the_client_is_kept_until_it_fetched_the_kv(
    stream: bool,
) -> None:
    """The generation leg waits 1.2 s in its worker's queue before it fetches the context's
    KV; the client leaves while it is queued. The generation leg is kept until it fetched
    the KV (a TRT-LLM generation server aborted before its fetch leaves the KV to the
    context's transfer timeout), then ends; no cleanup request is sent."""
    async with routed("trtllm") as r:
        async def queued() -> None:
            await wait_until(lambda: r.decode.stats.running == 1)
            await trio.testing.wait_all_tasks_blocked()  # accepted: the leg waits in its queue

        await client_leaves(r, "queued", queued, stream=stream,
                            fault="decode_queue:1.2")
        assert r.decode.stats.kv_pulls == 0  # still queued when the client left
        await eventually("the generation leg fetched the KV",
                         lambda: r.decode.stats.kv_pulls == 1, seconds=3.0,
                         state=lambda: (r.decode.stats, r.prefill.kv.counters()))
        await eventually("the generation leg ended", lambda: r.decode.stats.open == 0,
                         seconds=1.0, state=lambda: r.decode.stats)
        await assert_clean(r)
        assert [seen.request_id.rpartition(".")[0] for seen in r.decode.seen] == ["queued"]
        assert r.cluster.router.counters.staged_kv_cleanups == 0
        counters = r.prefill.kv.counters()
        assert (counters.served, counters.aborted) == (1, 0)


async def test_B6_sglang_prefill_failing_after_the_client_left_ends_the_decode_leg_at_once(
) -> None:
    """The client leaves while the prefill computes; the prefill then fails before staging
    any KV. The decode leg, waiting in the room for KV that cannot come, ends within a
    second of the failure: not at the decode-idle deadline, nor at its bootstrap wait."""
    slow = attrs.evolve(FAST, ttft_per_prompt_token=0.01)  # 0.45 s
    async with routed("sglang", prefill_latency=slow,
                      deadlines=Deadlines(decode_idle=30.0)) as r:
        async def both_legs_running() -> None:
            await wait_until(lambda: r.prefill.stats.running == 1
                             and r.decode.stats.running == 1)

        await client_leaves(r, "left", both_legs_running, stream=True,
                            fault="prefill_fail_before_handoff")
        assert r.prefill.stats.failed == 0  # the client left first
        await wait_until(lambda: r.prefill.stats.failed == 1, seconds=3.0)
        await eventually("the decode leg ended", lambda: r.decode.stats.open == 0,
                         seconds=1.0, state=lambda: r.decode.stats)
        await assert_clean(r)
        assert [seen.request_id.rpartition(".")[0] for seen in r.decode.seen] == ["left"]
        counters = r.prefill.kv.counters()
        assert (counters.staged_blocks, counters.stranded_blocks) == (0, 0)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
async def test_B1_vllm_decode_reporting_the_kv_lost_is_502_with_no_cleanup_decode(
    stream: bool,
) -> None:
    """The decode worker's KV pull fails and it answers 500 "KV transfer failed" before
    any byte: the client gets 502, and no cleanup decode is sent for that handoff (its KV
    is gone: there is nothing to consume)."""
    async with routed("vllm") as r:
        response = await post(r, "lost", stream=stream, fault="decode_kv_lost")
        assert response.status_code == 502, response.text
        assert "KV transfer failed" in error_of(response)["message"]
        await assert_clean(r)
        decode = (await worker_stats(r, r.cluster.decode_url))["stats"]
        assert (decode["requests"], decode["failed"]) == (1, 1)
        assert len(r.decode.seen) == 1
        assert r.cluster.router.counters.staged_kv_cleanups == 0
        counters = r.prefill.kv.counters()
        assert (counters.served, counters.aborted) == (0, 1)


# --- B7: a prefill answer is validated before it is used as a handoff ----------------------


@pytest.mark.parametrize(("protocol", "fault", "field"), [
    ("trtllm", "prefill_bad_handoff:choices", "choices"),
    ("trtllm", 'prefill_bad_handoff:ctx_request_id=""', "ctx_request_id"),
    ("trtllm", "prefill_bad_handoff:ctx_request_id=abc", "ctx_request_id"),
    ("trtllm", "prefill_bad_handoff:ctx_request_id=1.5", "ctx_request_id"),
    ("vllm", "prefill_bad_handoff:remote_block_ids", "remote_block_ids"),
    ("vllm", "prefill_bad_handoff:choices", "choices"),
    ("vllm", "prefill_bad_handoff:do_remote_decode=true", "do_remote_decode"),
    ("vllm", "prefill_bad_handoff:remote_block_ids=[]", "remote_block_ids"),
    ("trtllm", "prefill_bad_handoff:ctx_request_id=-3", "ctx_request_id"),
], ids=["trtllm-two-choices", "trtllm-ctx-empty", "trtllm-ctx-abc", "trtllm-ctx-float",
        "vllm-no-block-ids", "vllm-two-choices", "vllm-do-remote-decode", "vllm-empty-block-ids",
        "trtllm-ctx-negative"])
async def test_B7_invalid_prefill_handoff_is_502_and_no_decode_request(
    protocol: ProtocolName, fault: str, field: str,
) -> None:
    async with routed(protocol) as r:
        response = await post(r, "invalid", fault=fault)
        assert response.status_code == 502, response.text
        error = error_of(response)
        assert error["code"] == "invalid_prefill_handoff", error
        assert field in error["message"], error
        assert error["param"].endswith(field), error
        assert r.decode.stats.requests == 0 and not r.decode.seen
        await assert_clean(r)


# --- B10: a client leaving inside the prefill's cancel window -----------------------------


@pytest.mark.parametrize(("protocol", "window"), [
    ("vllm", CancelWindow.ANYTIME),
    ("trtllm", CancelWindow.BEFORE_HANDOFF),
])
async def test_B10_client_leaving_during_the_prefill_cancels_it_inside_the_window(
    protocol: ProtocolName, window: CancelWindow,
) -> None:
    """A long prefill (1.8 s) whose window allows it is cancelled when the client leaves
    during it: its worker sees the request aborted (the compute is saved), nothing was
    staged, and no decode (nor cleanup decode) is sent."""
    slow = attrs.evolve(FAST, ttft_per_prompt_token=0.04)  # 1.8 s
    async with routed(protocol, prefill_latency=slow, cancel_window=window) as r:
        async def prefill_running() -> None:
            await wait_until(lambda: r.prefill.stats.running == 1)

        await client_leaves(r, "b10", prefill_running, stream=True)
        await eventually("the prefill was aborted",
                         lambda: r.prefill.stats.prefills_aborted == 1, seconds=1.0,
                         state=lambda: r.prefill.stats)
        prefill = (await worker_stats(r, r.cluster.prefill_url))["stats"]
        assert (prefill["prefills_aborted"], prefill["prefills_completed"]) == (1, 0)
        assert prefill["aborted"] == 1
        await assert_clean(r)
        assert not r.decode.seen
        counters = r.prefill.kv.counters()
        assert (counters.staged_blocks, counters.aborted) == (0, 1)


@pytest.mark.parametrize(("protocol", "window"), [
    ("vllm", CancelWindow.ANYTIME),
    ("trtllm", CancelWindow.BEFORE_HANDOFF),
])
@pytest.mark.parametrize("attempt", range(3))
async def test_B10_B1_client_leaving_as_the_prefill_answers_strands_nothing(
    protocol: ProtocolName, window: CancelWindow, attempt: int,
) -> None:
    """The client leaves right as its prefill worker finished and sent its answer: the
    router's stop (the window allows one) must not drop that answer unread, or its KV
    would wait for the lease. The answer is read and a cleanup decode consumes the KV
    (B1)."""
    slow = attrs.evolve(FAST, ttft_per_prompt_token=0.004)  # 0.18 s
    async with routed(protocol, prefill_latency=slow, cancel_window=window) as r:
        async def prefill_answered() -> None:
            await wait_until(lambda: r.prefill.stats.prefills_completed == 1)

        await client_leaves(r, f"edge-{attempt}", prefill_answered, stream=True)
        await assert_clean(r)
        counters = r.prefill.kv.counters()
        assert counters.staged_blocks == counters.freed_blocks > 0, counters
        # The KV went to exactly one decode: pulled by the request's decode or a cleanup
        # (served), or released because the decode that was pulling it was aborted when
        # its client left right after the dispatch (aborted). Never left to the lease.
        assert (counters.served, counters.aborted, counters.expired) in [(1, 0, 0), (0, 1, 0)], \
            counters


# --- the mock workers' faults these cases need ---------------------------------------------


@asynccontextmanager
async def pair(protocol: ProtocolName) -> AsyncIterator[tuple[MockWorker, MockWorker,
                                                                httpx.AsyncClient]]:
    """A prefill and a decode mock worker, served, without a router."""
    prefill = create_mock_worker("prefill", protocol, fault_injection=True,
                                 latency=FAST, kv_ttl=KV_TTL)
    decode = create_mock_worker("decode", protocol, fault_injection=True, latency=FAST)
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_worker, prefill))
        await nursery.start(partial(serve_worker, decode))
        async with httpx.AsyncClient(timeout=5.0) as http:
            yield prefill, decode, http
        nursery.cancel_scope.cancel()


def url(worker: MockWorker, path: str = "/v1/completions") -> str:
    return f"http://{worker.host}:{worker.port}{path}"


async def vllm_handoff(prefill: MockWorker, http: httpx.AsyncClient, rid: str,
                       fault: str | None = None) -> dict[str, Any]:
    wire = body(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    if fault is not None:
        wire["fault"] = fault
    answer: dict[str, Any] = (await http.post(url(prefill), json=wire,
                                              headers={"x-request-id": rid})).json()
    return answer


async def test_mock_decode_kv_lost_answers_500_before_any_byte_and_frees_the_kv() -> None:
    async with pair("vllm") as (prefill, decode, http):
        with trio.fail_after(10):
            answer = await vllm_handoff(prefill, http, "lost")
            assert prefill.kv.counters().held_blocks == 3
            response = await http.post(url(decode), json=body(
                stream=True, fault="decode_kv_lost",
                kv_transfer_params=answer["kv_transfer_params"]),
                headers={"x-request-id": "lost"})
        assert response.status_code == 500
        assert response.headers["content-type"].startswith("application/json")
        assert response.json()["error"]["message"].startswith("KV transfer failed: ")
        counters = prefill.kv.counters()
        assert (counters.held_blocks, counters.aborted, counters.served) == (0, 1, 0)
        assert decode.stats.kv_pull_failures == 1
        await wait_until(lambda: decode.stats.open == 0)  # the exchange ends after its answer


async def test_mock_decode_queue_waits_before_the_pull_and_trtllm_keeps_unpulled_kv() -> None:
    async with pair("trtllm") as (prefill, decode, http):
        context = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                   "disaggregated_params": {"request_type": "context_only"}}
        with trio.fail_after(10):
            answer = (await http.post(url(prefill), json=context)).json()
            params = {**answer["choices"][0]["disaggregated_params"],
                      "request_type": "generation_only"}
            generation = {"model": MODEL, "prompt": answer["prompt_token_ids"],
                          "max_tokens": 3, "stream": True, "disaggregated_params": params,
                          "fault": "decode_queue:30"}
            async with http.stream("POST", url(decode), json=generation) as response:
                assert response.status_code == 200  # accepted: queued
                await wait_until(lambda: decode.stats.running == 1)
            await wait_until(lambda: decode.stats.open == 0)
        assert decode.stats.aborted == 1 and decode.stats.kv_pulls == 0
        # TRT-LLM's generation server aborted before its fetch does not free the KV
        assert prefill.kv.counters().held_blocks == 3
        assert decode.stats.kv_releases == 0


@pytest.mark.parametrize(("protocol", "fault", "check"), [
    ("vllm", "prefill_bad_handoff:remote_block_ids",
     lambda a: "remote_block_ids" not in a["kv_transfer_params"]),
    ("vllm", "prefill_bad_handoff:choices", lambda a: len(a["choices"]) == 2),
    ("trtllm", "prefill_bad_handoff:choices", lambda a: len(a["choices"]) == 2),
    ("trtllm", 'prefill_bad_handoff:ctx_request_id=""',
     lambda a: a["choices"][0]["disaggregated_params"]["ctx_request_id"] == ""),
    ("trtllm", "prefill_bad_handoff:ctx_request_id=abc",
     lambda a: a["choices"][0]["disaggregated_params"]["ctx_request_id"] == "abc"),
    ("trtllm", "prefill_bad_handoff:ctx_request_id=1.5",
     lambda a: a["choices"][0]["disaggregated_params"]["ctx_request_id"] == 1.5),
])
async def test_mock_prefill_bad_handoff_stages_nothing(
    protocol: ProtocolName, fault: str, check: Callable[[dict[str, Any]], bool],
) -> None:
    async with pair(protocol) as (prefill, _, http):
        if protocol == "vllm":
            wire = body(kv_transfer_params={"do_remote_decode": True}, fault=fault)
        else:
            wire = body(disaggregated_params={"request_type": "context_only"}, fault=fault)
        with trio.fail_after(10):
            response = await http.post(url(prefill), json=wire)
        assert response.status_code == 200
        assert check(orjson.loads(response.content))
        assert prefill.kv.counters().staged_blocks == 0
        assert prefill.stats.prefills_completed == 1


@pytest.mark.parametrize("fault", ["decode_queue", "decode_queue:-1", "decode_kv_lost:1",
                                   "prefill_bad_handoff", "decode_kv_lost,decode_stall"])
async def test_mock_faults_malformed_are_400(fault: str) -> None:
    async with pair("vllm") as (_, decode, http):
        with trio.fail_after(10):
            response = await http.post(url(decode), json=body(fault=fault))
        assert response.status_code == 400
        await wait_until(lambda: decode.stats.open == 0)
