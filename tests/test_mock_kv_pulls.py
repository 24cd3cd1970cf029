"""The mock vLLM decode worker's KV pulls under load: a crowd of decodes arriving at once on
kept connections, half of whose clients stop, kill or leave their requests, pull their KV
side by side; the healthy streams' TTFT and inter-token gaps stay those of an unloaded
worker (a real decode worker does not slow its requests when others are aborted).

Real sockets, the real clock: every wait is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import random
import time

import attrs
import trio
from e2e_support import FAST, PROMPT
from protocol_support import completion
from test_vllm import vllm_cluster

from trio_disagg import Deadlines, DisaggRouter, RequestContext, TrioDisaggError

#: Tokens paced as a small model's.
LATENCY = attrs.evolve(FAST, inter_token_latency=0.005)
#: The decode-idle deadline: a stream that waits longer for its next output (its first
#: included) fails; generous, so that a machine loaded by other work fails no stream.
IDLE = 2.0
CROWD = 96  # requests at once, every other one cancelled by its client


async def healthy(router: DisaggRouter, n: str, gaps: list[float]) -> None:
    """One request read to its end; the longest wait for an output goes to ``gaps``."""
    request = completion(f"h{n}", max_tokens=8, stream=True, prompt=f"{PROMPT} {n}")
    async with trio.open_nursery() as nursery:
        stream = await router.stream(nursery, request, RequestContext(request.request_id))
        last, longest, count = time.monotonic(), 0.0, 0
        with stream.outputs:
            async for item in stream.outputs:
                assert item.error is None, item.error
                now = time.monotonic()
                last, longest, count = now, max(longest, now - last), count + 1
    assert count >= 1
    gaps.append(longest)


async def cancelled(router: DisaggRouter, n: str, rng: random.Random) -> None:
    """One request its client stops, kills or leaves within 30 ms of sending it."""
    request = completion(f"c{n}", max_tokens=8, stream=True, prompt=f"{PROMPT} {n}")
    context = RequestContext(request.request_id)
    action, when = rng.choice(["stop", "kill", "leave"]), rng.random() * 0.03
    with trio.move_on_after(when if action == "leave" else 10):
        try:
            async with trio.open_nursery() as nursery:
                async def cancel_later() -> None:
                    await trio.sleep(when)
                    context.kill() if action == "kill" else context.stop_generating()

                if action != "leave":
                    nursery.start_soon(cancel_later)
                stream = await router.stream(nursery, request, context)
                with stream.outputs:
                    async for _ in stream.outputs:
                        pass
        except* TrioDisaggError:
            pass  # a stopped request may end in an error of its own: not what is tested


async def test_healthy_streams_keep_their_pace_while_other_clients_cancel() -> None:
    """96 requests at once, every other one stopped, killed or left by its client within
    30 ms, twice: every healthy stream ends whole, and the second crowd, whose KV pulls
    find the decode worker's connections to the prefill worker kept, waits no longer for
    its outputs (TTFT included) than the first, which opened them (before, the pulls of
    the second queued behind each other into the decode-idle deadline)."""
    rng = random.Random(14)
    worst: list[float] = []
    with trio.fail_after(10):
        async with vllm_cluster(latency=LATENCY, deadlines=Deadlines(decode_idle=IDLE)) as cluster:
            for round_ in range(2):
                gaps: list[float] = []
                async with trio.open_nursery() as nursery:
                    for n in range(CROWD):
                        if n % 2:
                            nursery.start_soon(cancelled, cluster.router, f"{round_}-{n}", rng)
                        else:
                            nursery.start_soon(healthy, cluster.router, f"{round_}-{n}", gaps)
                assert len(gaps) == CROWD // 2
                worst.append(max(gaps))
    # (compared with the first crowd's, under the same load: a loaded machine slows both)
    cold, warm = worst
    assert warm < 1.5 * cold, worst
