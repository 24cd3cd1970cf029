"""The prefix-affinity policy: a shared system prompt reaches one worker, within a bound
on its load (rule S12 in docs/semantics.md; docs/router.md "Worker selection")."""

from __future__ import annotations

import math
from contextlib import ExitStack
from typing import Any

import pytest
from test_pool import pool

from trio_disagg import PrefixAffinity, PreprocessedRequest
from trio_disagg._pool import prompt_prefix

SYSTEM = "You are a careful assistant for the billing team. " * 8


def chat(system: str, user: str) -> PreprocessedRequest:
    body: dict[str, Any] = {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]}
    return PreprocessedRequest(request_id=user, model="m", body=body)


async def test_S12_requests_sharing_a_system_prompt_go_to_one_worker() -> None:
    workers = pool(4, policy=PrefixAffinity())
    picks = {workers.select(chat(SYSTEM, f"question {i}")).name for i in range(20)}
    assert len(picks) == 1
    # Another router replica with the same workers picks the same one (no shared state).
    replica = pool(4, policy=PrefixAffinity())
    assert replica.select(chat(SYSTEM, "another question")).name in picks
    # Different system prompts spread over the workers.
    spread = {workers.select(chat(f"system prompt number {i}", "hi")).name
              for i in range(40)}
    assert len(spread) == 4


async def test_S12_the_load_bound_spills_a_hot_prefix_over_to_other_workers() -> None:
    workers = pool(4, policy=PrefixAffinity(load_factor=1.25))
    preferred = workers.select(chat(SYSTEM, "first")).name
    with ExitStack() as held:  # 16 requests of one prefix, all in flight at once
        for i in range(16):
            worker = workers.select(chat(SYSTEM, f"q{i}"))
            held.enter_context(workers.lease(worker))
            loads = [w.outstanding for w in workers.workers]
            bound = math.ceil(1.25 * sum(loads) / len(loads))
            assert max(loads) <= bound, loads  # nobody above (1 + eps) x the average
        by_name = {w.name: w.outstanding for w in workers.workers}
        assert by_name[preferred] == max(by_name.values())  # the cache holder got most
        assert sum(1 for load in by_name.values() if load) > 1  # and it spilled over
    # Once the load is gone, the prefix is back on its worker.
    assert workers.select(chat(SYSTEM, "later")).name == preferred


def test_the_key_is_the_system_prompt_or_the_prompt_beginning() -> None:
    assert prompt_prefix(chat("sys", "a").body) == prompt_prefix(chat("sys", "b").body)
    assert prompt_prefix(chat("sys", "a").body) != prompt_prefix(chat("other", "a").body)
    no_system = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    assert prompt_prefix(no_system) == "user\x00x"
    assert prompt_prefix({"prompt": "abc" * 200}) == ("abc" * 200)[:256]
    assert prompt_prefix({"prompt": ["first", "second"]}) == "first"
    assert prompt_prefix({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_prefix({}) is None


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="load_factor"):
        PrefixAffinity(load_factor=0.5)
    with pytest.raises(ValueError, match="load_factor"):
        PrefixAffinity(load_factor=float("nan"))
    with pytest.raises(ValueError, match="prefix_chars"):
        PrefixAffinity(prefix_chars=0)
