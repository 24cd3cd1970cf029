"""The ``trio-disagg`` command: ``demo`` and ``serve`` as a user runs them."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
from functools import partial

import attrs
import openai
import trio

from trio_disagg._demo import Backend, in_process_backend, run_demo
from trio_disagg._engine import HandoffStyle
from trio_disagg.engines import KVCounters

COMMAND = [sys.executable, "-m", "trio_disagg._cli"]


async def test_demo_small_workload_exits_0() -> None:
    """The main job, end to end: every scenario of every backend (in-process mocks, and
    mock vLLM, SGLang and TensorRT-LLM workers over HTTP) through the HTTP router."""
    with trio.fail_after(120):
        done = await trio.run_process(
            [*COMMAND, "demo", "--requests", "40", "--concurrency", "8", "--seed", "3"],
            capture_stdout=True, capture_stderr=True, check=False,
        )
    out = done.stdout.decode()
    assert done.returncode == 0, out + done.stderr.decode()
    for backend in ("mock-sequential", "mock-bootstrap"):
        assert f"== {backend}: 40 requests" in out
        assert f"{backend}/disconnect at handoff" in out
        assert f"{backend}/prefill fails after handoff" in out
    assert out.count("staged KV blocks left: 0, stranded: 0") == 5
    assert "keeper drains left: 0" in out
    assert out.rstrip().endswith("no request past its deadlines.")


async def test_demo_names_a_broken_invariant_and_exits_1() -> None:
    """A backend whose workers still hold KV after the run fails the demo, by name."""
    real = in_process_backend("leaky", HandoffStyle.SEQUENTIAL, seed=0)

    async def leaking() -> KVCounters:
        counters = await real.kv_counters()
        return attrs.evolve(counters, held_blocks=counters.held_blocks + 7)

    async def start_leaky(nursery: trio.Nursery) -> Backend:
        return Backend("leaky", True, real.prefill, real.decode, leaking)

    out = io.StringIO()
    with trio.fail_after(120):
        status = await run_demo([start_leaky], requests=20, concurrency=8, seed=1, out=out)
    assert status == 1
    assert "leaky: 7 staged KV blocks still held after the run (B1, B5)" in out.getvalue()


async def test_serve_embedded_default_answers_and_stops_on_sigterm() -> None:
    """``trio-disagg serve`` with no workers runs in-process mocks; SIGTERM exits 0 (B3)."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(partial(
                trio.run_process, [*COMMAND, "serve", "--port", "0"],
                stdout=subprocess.PIPE, check=False,
            ))
            assert process.stdout is not None
            banner = b""
            while b"\n" not in banner:
                banner += await process.stdout.receive_some()
            match = re.search(rb"http://127\.0\.0\.1:(\d+)/v1", banner)
            assert match, banner
            base_url = f"http://127.0.0.1:{int(match.group(1))}/v1"

            def ask() -> str:
                with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
                    answer = client.completions.create(
                        model="trio-disagg-mock", prompt="hello there", max_tokens=5)
                return answer.choices[0].finish_reason

            assert await trio.to_thread.run_sync(ask) == "length"
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
