"""Tutorial 5: the router's HTTP server in front of vLLM workers, with the openai client.

Run it with ``uv run python examples/05_http_router.py`` (with pip, it needs
``pip install 'trio-disagg[demo]'``: the HTTP router and the openai client).

Tutorial 4 called the router from Python. This is the shape it is deployed in:

    openai client --HTTP--> trio-disagg server --HTTP--> vLLM prefill worker
                            (create_app + serve)  \\--HTTP--> vLLM decode worker

The workers here are trio-disagg's *mock* vLLM workers (``trio-disagg mock-worker``): real
HTTP servers that speak vLLM's disaggregated wire protocol (``kv_transfer_params``, as with
a NixlConnector), keep real KV block accounting with a lease, make the decode worker pull
the KV from the prefill worker over loopback, abort a request when its connection closes
(as vLLM does), and report it all at ``GET /metrics``. Swap their URLs for real
``vllm serve`` instances and nothing else changes (docs: "Run against vLLM workers").

1. A streamed completion: prefill on one worker, KV handed off, tokens from the other.
2. A client that hangs up mid-stream: the decode worker aborts at once; the prefill was
   never aborted, and no KV block is left behind.
3. A client that hangs up while its prefill computes: vLLM frees a request's blocks when
   its connection closes, so its prefill may be cancelled anytime (cancel window
   ``anytime``, B10): the router cancels it, the prefill worker aborts it, and nothing is
   staged. The router's stop gives an answer already on its way half a second to arrive
   (it is read then, and its KV consumed, B1), so the prefill here is longer than that.
   (With the window ``never``, the keeper would run the prefill to its end and have its
   KV consumed at once by a one-token decode, B1: tutorial 4 shows that.)
4. A prefill that fails: the client gets a 502 with the worker's message, before any byte
   of a stream (a real HTTP status, not an error event).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import trio

import trio_disagg as td

try:  # the core alone (pip install trio-disagg) has no HTTP stack
    import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client, on trio natively)
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from trio_disagg.engines import vllm_client, vllm_engines
    from trio_disagg.mock import LatencyModel, serve_mock_worker
    from trio_disagg.server import create_app, serve
except ImportError as missing:
    sys.exit(f"this tutorial needs the HTTP router and the openai client ({missing.name} is "
             "not installed): pip install 'trio-disagg[demo]'")

MODEL = "tutorial-model"
# 1.5 ms of prefill per prompt token, 10 ms per decoded token: slow enough to hang up in
# the middle of a phase, fast enough that the tutorial runs in a couple of seconds.
LATENCY = LatencyModel(ttft_per_prompt_token=0.0015, inter_token_latency=0.01,
                       kv_transfer_per_token=0.00002)
KV_TTL = 30.0  # seconds staged KV waits for its decode: vLLM's lease in recent builds
PROMPT = ("Why does each request get a nursery of its own, and why does a detached keeper, "
          "not the request, own the prefill drain? Answer with the rules of the gatekeeper "
          "and the transfer keeper, one sentence each.")  # 37 prompt tokens: 3 KV blocks of 16
LONG_PROMPT = " ".join(["context"] * 1000)  # 1000 prompt tokens: a 0.5 s prefill


async def metrics(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """A mock worker's ``GET /metrics``, as ``{name: value}`` without the
    ``trio_disagg_mock_`` prefix."""
    response = await http.get(f"{url}/metrics")
    response.raise_for_status()
    return {
        sample.name.removeprefix("trio_disagg_mock_"): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def kv_line(m: dict[str, float]) -> str:
    return (f"KV blocks held={m['kv_held_blocks']:.0f} "
            f"staged={m['kv_staged_blocks_total']:.0f} "
            f"freed={m['kv_freed_blocks_total']:.0f} "
            f"stranded={m['kv_stranded_blocks_total']:.0f}")


T = TypeVar("T")


async def in_thread(fn: Callable[[], T]) -> T:
    """The openai client is synchronous: run it in a worker thread, so the trio loop (and
    with it the router and the workers of this process) keeps running."""
    return await trio.to_thread.run_sync(fn)


# --- what the client does (plain synchronous openai code, run in a thread) ----------------


def stream_completion(client: openai.OpenAI) -> str:
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Request-Id": "tut-1"})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            cached = details.cached_tokens if details is not None else None
            print(f"   usage: {chunk.usage.prompt_tokens} prompt tokens "
                  f"({cached} cached, as the prefill worker reported), "
                  f"{chunk.usage.completion_tokens} completion tokens")
    return f"{text!r}, finish_reason={finish}"


def hang_up_after(client: openai.OpenAI, tokens: int) -> str:
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=500, stream=True,
        extra_headers={"X-Request-Id": "tut-2"})
    text = ""
    for received, chunk in enumerate(stream, start=1):
        text += chunk.choices[0].text
        if received == tokens:
            break
    stream.close()  # closes the HTTP connection, 495 tokens early
    return text


def hang_up_during_prefill(client: openai.OpenAI) -> str:
    # The router sends the response headers with the first token, so a 0.1 s timeout
    # expires during the 1.5 s prefill; the client then closes its connection.
    impatient = client.with_options(timeout=0.1)
    try:
        impatient.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=20,
                                     stream=True, extra_headers={"X-Request-Id": "tut-3"})
    except openai.APITimeoutError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no timeout?"


def failing_prefill(client: openai.OpenAI) -> str:
    try:
        # "fault" is not an OpenAI field: the mock prefill worker reads it from the body
        # and fails this request (see trio_disagg.mock.FaultKind). The router's log names
        # it tut-4.<the router's own id for it>: the id the workers see (protocols 1).
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True,
                                  extra_body={"fault": "prefill_fail_before_handoff"},
                                  extra_headers={"X-Request-Id": "tut-4"})
    except openai.APIStatusError as exc:
        return f"{type(exc).__name__}: HTTP {exc.status_code}\n   error body: {exc.body}"
    return "no error?"


# --- the deployment, and what each step shows ----------------------------------------------


async def main() -> None:
    # The keeper logs a prefill drain that failed (T2) to "trio_disagg.keeper": show the
    # library's log lines inline. (hypercorn logs where each server listens, to stderr.)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("   [log] %(name)s: %(message)s"))
    logging.getLogger("trio_disagg").addHandler(handler)
    async with trio.open_nursery() as workers:
        # Two mock vLLM workers on ports the OS picks, honouring a body's "fault" (a
        # test tool, off by default). From a shell this would be
        #   trio-disagg mock-worker --role prefill --protocol vllm --port 8100 --fault-injection
        #   trio-disagg mock-worker --role decode --protocol vllm --port 8200 --fault-injection
        ports = [
            await workers.start(partial(serve_mock_worker, role, "vllm", "127.0.0.1", 0,
                                        latency=LATENCY, kv_ttl=KV_TTL, fault_injection=True))
            for role in ("prefill", "decode")
        ]
        prefill_url, decode_url = (f"http://127.0.0.1:{port}" for port in ports)
        print(f"mock vLLM workers: prefill {prefill_url}, decode {decode_url}")

        # The router, as `trio-disagg serve --backend vllm --prefill URL --decode URL`
        # builds it: VllmEngine adapters sharing one worker client, a keeper, a router, the
        # OpenAI app, and hypercorn (trio worker) serving it. (`http`, an httpx client, is
        # this script's own, to read the workers' /metrics.)
        async with (vllm_client() as workers_client, httpx.AsyncClient() as http,
                    td.TransferKeeper() as keeper):
            prefill, decode = vllm_engines([prefill_url], [decode_url], client=workers_client)
            # vLLM's cancel window (B10), said explicitly; `serve --cancel-window` sets it
            # from the command line.
            windows = {prefill_url: td.CancelWindow.ANYTIME}
            router = td.DisaggRouter(td.WorkerPool(prefill, cancel_windows=windows),
                                     td.WorkerPool(decode), keeper)
            # Step 4 injects a fault through the body: only a router started with
            # fault injection passes the "fault" field on to the workers.
            app = create_app(router, models=[MODEL], fault_injection=True)
            stop = trio.Event()
            async with trio.open_nursery() as server:
                port = await server.start(partial(serve, app, host="127.0.0.1", port=0,
                                                  shutdown_trigger=stop.wait))
                print(f"router: http://127.0.0.1:{port}/v1\n")
                client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                       api_key="unused", max_retries=0, timeout=10.0)
                with client:
                    await steps(client, http, router, keeper, prefill_url, decode_url)
                stop.set()  # graceful shutdown of the HTTP server
        workers.cancel_scope.cancel()  # stop the workers


async def settled(router: td.DisaggRouter, keeper: td.TransferKeeper) -> None:
    """Wait until no request and no prefill drain is left (bounded)."""
    with trio.fail_after(5):
        await router.wait_idle()
        await keeper.wait_idle()


async def steps(client: openai.OpenAI, http: httpx.AsyncClient, router: td.DisaggRouter,
                keeper: td.TransferKeeper, prefill_url: str, decode_url: str) -> None:
    print("1. A streamed completion.")
    print(f"   got {await in_thread(partial(stream_completion, client))}")
    await settled(router, keeper)
    print(f"   prefill worker: {kv_line(await metrics(http, prefill_url))}")
    print("   the decode worker pulled the staged blocks before its first token, which "
          "freed them.\n")

    print("2. The client hangs up after 3 tokens of 500.")
    text = await in_thread(partial(hang_up_after, client, 3))
    closed = trio.current_time()
    print(f"   got {text!r}, then closed the connection")
    # The router's server sees the connection close and cancels the request's nursery;
    # the decode leg's HTTP response to the decode worker is closed with it, which is
    # how vLLM is told to abort.
    with trio.fail_after(5):
        for _ in range(1000):  # poll the decode worker's /metrics, as a scraper would
            if (await metrics(http, decode_url))["requests_aborted_total"] >= 1:
                break
            await trio.sleep(0.005)
    print(f"   decode worker: aborted requests=1, "
          f"{(trio.current_time() - closed) * 1000:.0f} ms after the client closed")
    await settled(router, keeper)
    m = await metrics(http, prefill_url)
    print(f"   prefill worker: aborted requests={m['requests_aborted_total']:.0f}, "
          f"{kv_line(m)}")
    print(f"   no block waits for its {KV_TTL:.0f} s lease: nothing is held.\n")

    print("3. The client hangs up while its prefill computes (1000 prompt tokens, 1.5 s).")
    start = trio.current_time()
    print(f"   client: {await in_thread(partial(hang_up_during_prefill, client))}")
    await settled(router, keeper)
    # The router closed the prefill's connection; the worker counts the abort once it
    # sees the close, a moment later, in its own process.
    with trio.fail_after(5):
        for _ in range(1000):  # poll its /metrics, as a scraper would
            if (m := await metrics(http, prefill_url))["requests_aborted_total"] >= 1:
                break
            await trio.sleep(0.005)
    print(f"   {(trio.current_time() - start) * 1000:.0f} ms later: prefill worker "
          f"aborted requests={m['requests_aborted_total']:.0f}, {kv_line(m)}")
    print(f"   the router cancelled the prefill inside its cancel window "
          f"(prefills cancelled={router.counters.prefills_cancelled}, "
          f"B1 cleanups={router.counters.staged_kv_cleanups}): the worker stopped "
          "computing, and nothing was staged.\n")

    print("4. The prefill worker fails the request (an injected fault).")
    print(f"   client: {await in_thread(partial(failing_prefill, client))}")
    await settled(router, keeper)
    print(f"   router: in flight={router.in_flight}, keeper drains={keeper.in_flight}")


# tests/test_examples.py runs this file and checks that its output contains each line
# that starts with `# expect: `.
# expect: usage: 37 prompt tokens (0 cached, as the prefill worker reported), 8 completion tokens
# expect: finish_reason=length
# expect: prefill worker: KV blocks held=0 staged=3 freed=3 stranded=0
# expect: decode worker: aborted requests=1,
# expect: prefill worker: aborted requests=0, KV blocks held=0 staged=6 freed=6 stranded=0
# expect: client: APITimeoutError: Request timed out.
# expect: prefill worker aborted requests=1, KV blocks held=0 staged=6 freed=6 stranded=0
# expect: (prefills cancelled=1, B1 cleanups=0): the worker stopped computing
# expect: [log] trio_disagg.keeper: prefill drain tut-4.
# expect: client: InternalServerError: HTTP 502
# expect: 'type': 'upstream_error', 'param': None, 'code': 'prefill_failed'}
# expect: router: in flight=0, keeper drains=0

if __name__ == "__main__":
    trio.run(main)
