"""The abandonment matrix (B1, B5, B6, B10): for each protocol's mock workers behind the
router's own HTTP server, every way a request can end before, or while, its decode takes
the KV, and what became of that KV.

Each cell drives one ending with ``httpx`` (a client that leaves is a real client closing
its connection: a cancel scope around a streamed request), then checks:

- what the client saw: nothing for a client that left, else the status the rules give
  (504 for a deadline, the decode's 400 for its refusal, 502 for a prefill failure);
- the end state (:func:`~lifecycle_support.assert_clean`): nothing in flight on the router
  or in its keeper, no request open on either worker, no KV block held and none stranded,
  reached within :data:`SETTLE` seconds of the client's outcome. Every timeout a
  leftover leg could wait for is far longer (the router's other deadlines 30 s, the KV
  lease 120 s, SGLang's bootstrap wait 300 s): a leg kept past the moment it became
  useless fails the cell instead of passing late;
- the KV's fate (:data:`FATES`), read from the router's counters and the workers'
  ``/stats``.

The prefill engines' cancel windows are the adapters' own (B10): vLLM ``anytime``, SGLang
and TensorRT-LLM ``before_handoff``; TensorRT-LLM hands off context first.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from e2e_support import FAST, PROTOCOLS, SLOW_TOKENS, ProtocolName, wait_until
from lifecycle_support import (
    Routed,
    assert_clean,
    body,
    error_of,
    post,
    routed,
    worker_stats,
)

from trio_disagg import CancelWindow, Deadlines

ENDINGS = (
    "client-gone-during-prefill",
    "client-gone-at-handoff",
    "client-gone-decode-queued",
    "client-gone-mid-stream",
    "prefill-deadline",
    "handoff-deadline",
    "decode-refused",
    "prefill-failed-before-decode",
    "prefill-failed-after-decode-started",
)

#: The cancel window each protocol's adapter declares (B10).
WINDOWS = {"vllm": CancelWindow.ANYTIME, "sglang": CancelWindow.BEFORE_HANDOFF,
           "trtllm": CancelWindow.BEFORE_HANDOFF}

#: The router's deadlines in every cell: none of them is waited for.
LONG = Deadlines(prefill=30.0, handoff=30.0, decode_idle=30.0, terminal_hold=30.0,
                 transfer=300.0)
#: The one deadline a deadline cell is about.
SHORT = 0.5
#: Seconds from the client's outcome to the clean end state, at most.
SETTLE = 1.5
#: Seconds (beyond :data:`SHORT`) a client waits for its answer.
ANSWER = 2.0

#: A prefill long enough for a client to leave during it (45 tokens: 0.675 s).
SLOW_PREFILL = attrs.evolve(FAST, ttft_per_prompt_token=0.015)
#: A decode slow to accept (the dispatch is pending), and the deadline cell's: longer
#: than the handoff deadline.
ACCEPT_DELAY = 0.5
LATE_ACCEPT = 3.0
#: A decode accepted, then queued before it fetches the KV.
QUEUED = 0.8


class Fate(enum.Enum):
    """What became of the prefill's KV (or room)."""

    DECODE = "pulled by the request's decode"
    CLEANUP = "pulled by a B1 cleanup decode"
    DECODE_RELEASED = "freed unpulled by the request's decode, aborted before its pull"
    CANCELLED = "prefill cancelled in its window (B10), its KV never handed over"
    RELEASED = "prefill ended: no decode will join its room (B6)"
    ABORTED = "prefill aborted at the deadline, nothing staged"
    NEVER_STAGED = "never staged: the prefill failed first"
    FREED_BY_PREFILL = "staged, then freed by the prefill worker as it failed"


#: cell id -> what becomes of the KV.
FATES: dict[str, Fate] = {
    # vLLM: sequential; aborting a prefill frees its blocks; a decode aborted before its
    # pull tells the prefill worker to free the KV.
    "vllm-client-gone-during-prefill": Fate.CANCELLED,
    "vllm-client-gone-at-handoff": Fate.CLEANUP,
    "vllm-client-gone-decode-queued": Fate.DECODE_RELEASED,
    "vllm-client-gone-mid-stream": Fate.DECODE,
    "vllm-prefill-deadline": Fate.ABORTED,
    "vllm-handoff-deadline": Fate.CLEANUP,
    "vllm-decode-refused": Fate.CLEANUP,
    "vllm-prefill-failed-before-decode": Fate.NEVER_STAGED,
    "vllm-prefill-failed-after-decode-started": Fate.FREED_BY_PREFILL,
    # SGLang: prefill and decode meet in a bootstrap room; the decode leg is part of the
    # transfer from its dispatch.
    "sglang-client-gone-during-prefill": Fate.DECODE,
    "sglang-client-gone-at-handoff": Fate.CANCELLED,
    "sglang-client-gone-decode-queued": Fate.DECODE,
    "sglang-client-gone-mid-stream": Fate.DECODE,
    "sglang-prefill-deadline": Fate.ABORTED,
    "sglang-handoff-deadline": Fate.RELEASED,
    "sglang-decode-refused": Fate.RELEASED,
    "sglang-prefill-failed-before-decode": Fate.NEVER_STAGED,
    "sglang-prefill-failed-after-decode-started": Fate.DECODE,
    # TensorRT-LLM: context first; the generation leg is part of the transfer until its
    # first output (aborted before its fetch, it would leave the KV to a timeout).
    "trtllm-client-gone-during-prefill": Fate.CANCELLED,
    "trtllm-client-gone-at-handoff": Fate.DECODE,
    "trtllm-client-gone-decode-queued": Fate.DECODE,
    "trtllm-client-gone-mid-stream": Fate.DECODE,
    "trtllm-prefill-deadline": Fate.ABORTED,
    "trtllm-handoff-deadline": Fate.CLEANUP,
    "trtllm-decode-refused": Fate.CLEANUP,
    "trtllm-prefill-failed-before-decode": Fate.NEVER_STAGED,
    "trtllm-prefill-failed-after-decode-started": Fate.FREED_BY_PREFILL,
}

#: What the client sees: None (it left), or the status and the error's code (None: any).
OUTCOMES: dict[str, tuple[int, str | None] | None] = {
    "client-gone-during-prefill": None,
    "client-gone-at-handoff": None,
    "client-gone-decode-queued": None,
    "client-gone-mid-stream": None,
    "prefill-deadline": (504, "prefill_deadline_exceeded"),
    "handoff-deadline": (504, "deadline_exceeded"),
    "decode-refused": (400, None),
    "prefill-failed-before-decode": (502, "prefill_failed"),
    "prefill-failed-after-decode-started": (502, None),
}


@attrs.define
class Client:
    """A streamed request whose client can hang up: what it saw, and whether it ended by
    itself (then it did not leave)."""

    status: int | None = None
    events: list[str] = attrs.Factory(list)
    finished: bool = False


async def client_leaves(r: Routed, request_id: str,
                        when: Callable[[Client], Awaitable[None]], **fields: Any) -> Client:
    """A streamed request whose client closes its connection once ``when`` returns."""
    seen = Client()

    async def client() -> None:
        async with r.http.stream("POST", "/v1/completions", json=body(stream=True, **fields),
                                 headers={"x-request-id": request_id}) as response:
            seen.status = response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen.events.append(line[len("data: "):])
        seen.finished = True

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client)
            await when(seen)
            nursery.cancel_scope.cancel()  # the client goes away
    assert not seen.finished and "[DONE]" not in seen.events, seen
    return seen


async def leave(r: Routed, protocol: ProtocolName, ending: str) -> None:
    """Drive a ``client-gone-*`` ending; check the moment was the one the cell names."""
    prefill, decode = r.prefill.stats, r.decode.stats
    if ending == "client-gone-during-prefill":
        async def during_prefill(_: Client) -> None:
            await wait_until(lambda: prefill.running == 1)
            if protocol == "sglang":  # its decode is dispatched with the prefill
                await wait_until(lambda: decode.running == 1)
                await trio.testing.wait_all_tasks_blocked()  # ... and accepted
            assert prefill.prefills_completed == 0, "the prefill ended first"

        await client_leaves(r, ending, during_prefill)
    elif ending == "client-gone-at-handoff":
        async def at_handoff(seen: Client) -> None:
            # the prefill answered (SGLang: its KV waits in the room); the decode
            # dispatch is pending: its worker holds it before accepting
            await wait_until(lambda: prefill.prefills_completed == 1 and decode.running == 1)
            assert seen.status is None and decode.kv_pulls == 0, seen

        await client_leaves(r, ending, at_handoff, fault=f"decode_accept_delay:{ACCEPT_DELAY}")
    elif ending == "client-gone-decode-queued":
        async def queued(_: Client) -> None:
            await wait_until(lambda: decode.running == 1)
            # its answer's headers went out and reached the router: accepted, and queued
            await trio.testing.wait_all_tasks_blocked()
            assert decode.kv_pulls == 0

        await client_leaves(r, ending, queued, fault=f"decode_queue:{QUEUED}")
    else:
        async def mid_stream(seen: Client) -> None:
            await wait_until(lambda: len(seen.events) >= 3)
            assert decode.kv_pulls == 1

        await client_leaves(r, ending, mid_stream, max_tokens=20)


FAULTS = {
    "prefill-deadline": "prefill_stall",
    "handoff-deadline": f"decode_accept_delay:{LATE_ACCEPT}",
    "decode-refused": "decode_reject:400",
    "prefill-failed-before-decode": "prefill_fail_before_handoff",
    "prefill-failed-after-decode-started": "prefill_fail_after_handoff",
}


async def facts(r: Routed) -> dict[str, Any]:
    """The router's counters and both workers' ``/stats``, as the fate is read from them."""
    prefill = await worker_stats(r, r.cluster.prefill_url)
    decode = await worker_stats(r, r.cluster.decode_url)
    counters = r.cluster.router.counters
    return {
        "cleanups": counters.staged_kv_cleanups,
        "cleanup_failures": counters.staged_kv_cleanup_failures,
        "cancelled": counters.prefills_cancelled,
        "released": counters.prefills_released,
        "drained": counters.prefills_drained,
        "kv": prefill["kv"],
        "prefills_aborted": prefill["stats"]["prefills_aborted"],
        "decode_requests": decode["stats"]["requests"],
        "decode_pulls": decode["stats"]["kv_pulls"],
        "decode_releases": decode["stats"]["kv_releases"],
        "decode_max_tokens": [seen.body.get("max_tokens",
                                            seen.body.get("sampling_params", {})
                                            .get("max_new_tokens"))
                              for seen in r.decode.seen],
    }


def fate_of(f: dict[str, Any]) -> Fate | None:
    """What became of the KV, by the counters; None if they tell no consistent story."""
    kv = f["kv"]
    router_ended = f["cancelled"] + f["released"]
    if f["cleanups"]:
        ok = (f["cleanups"] == 1 and not f["cleanup_failures"] and kv["served"] == 1
              and f["decode_pulls"] == 1 and f["decode_max_tokens"][-1:] == [1]
              and not router_ended)
        return Fate.CLEANUP if ok else None
    if kv["served"]:
        ok = kv["served"] == 1 and f["decode_pulls"] == 1 and not router_ended
        return Fate.DECODE if ok else None
    if f["decode_pulls"]:
        return None
    if router_ended:
        if router_ended != 1 or kv["aborted"] != 1:
            return None
        return Fate.CANCELLED if f["cancelled"] else Fate.RELEASED
    if kv["staged_blocks"] == 0:
        if kv["aborted"] == 1 and f["prefills_aborted"] == 1:
            return Fate.ABORTED
        return Fate.NEVER_STAGED if kv["aborted"] == 0 else None
    if kv["aborted"] == 1:
        return Fate.DECODE_RELEASED if f["decode_releases"] == 1 else Fate.FREED_BY_PREFILL
    return None


def cells() -> list[Any]:
    return [pytest.param(protocol, ending, id=f"{protocol}-{ending}")
            for protocol in PROTOCOLS for ending in ENDINGS]


@pytest.mark.parametrize(("protocol", "ending"), cells())
async def test_B1_B6_abandonment_matrix(protocol: ProtocolName, ending: str) -> None:
    deadlines = LONG
    if ending == "prefill-deadline":
        deadlines = attrs.evolve(LONG, prefill=SHORT)
    elif ending == "handoff-deadline":
        deadlines = attrs.evolve(LONG, handoff=SHORT)
    async with routed(
        protocol, deadlines=deadlines, cancel_window=WINDOWS[protocol],
        prefill_latency=SLOW_PREFILL if ending == "client-gone-during-prefill" else FAST,
        decode_latency=SLOW_TOKENS if ending == "client-gone-mid-stream" else FAST,
    ) as r:
        expected = OUTCOMES[ending]
        if expected is None:
            await leave(r, protocol, ending)
        else:
            with trio.fail_after(SHORT + ANSWER):  # an answer the rules give at once
                response = await post(r, ending, fault=FAULTS[ending])
            status, code = expected
            assert response.status_code == status, response.text
            if code is not None:
                assert error_of(response)["code"] == code, response.text
        # B5: nothing outlives its use, long before anything it could wait for expires
        await assert_clean(r, within=SETTLE)
        observed = await facts(r)
        assert fate_of(observed) is FATES[f"{protocol}-{ending}"], observed
        assert observed["cleanup_failures"] == 0
        assert (observed["kv"]["stranded_blocks"], observed["kv"]["expired"]) == (0, 0)


async def test_mock_decode_accept_delay_holds_the_request_and_lets_go_of_nothing() -> None:
    """``decode_accept_delay``: no byte before the delay; aborted meanwhile, the decode
    releases no KV (it never looked at its handoff), so the KV stays for a cleanup."""
    async with routed("vllm", deadlines=attrs.evolve(LONG, handoff=0.3)) as r:
        with trio.fail_after(4):  # the handoff deadline, not the worker's 5 s delay
            response = await post(r, "late", fault="decode_accept_delay:5")
        assert response.status_code == 504
        await assert_clean(r, within=SETTLE)
        decode = (await worker_stats(r, r.cluster.decode_url))["stats"]
        assert (decode["aborted"], decode["kv_releases"]) == (1, 0)
        assert r.cluster.router.counters.staged_kv_cleanups == 1


def test_matrix_covers_every_cell() -> None:
    assert sorted(FATES) == sorted(f"{p}-{e}" for p in PROTOCOLS for e in ENDINGS)
