"""Tutorial 6: a prefill that fails after the decode's last token, over real HTTP (G3, G5).

Run it with ``uv run python examples/06_bootstrap_late_failure.py`` (with pip, it needs
``pip install 'trio-disagg[demo]'``: the HTTP router and the openai client).

SGLang's disaggregated serving is *concurrent*. The router picks a bootstrap room and sends
the same request, with that room, to a prefill worker and a decode worker at once:

    openai client --HTTP--> trio-disagg server --HTTP--> SGLang prefill worker
                                              \\--HTTP--> SGLang decode worker
                                        (the decode joins the room on the prefill's
                                         bootstrap port and pulls the KV from there)

The prefill worker answers only once the KV went to the decode, and the decode streams
tokens from then on. So the decode can be done, last token and all, before the router
knows whether the prefill succeeded. A router that passes the decode's stream straight
through tells the client "success" even when the prefill worker then reports a failure;
trio-disagg's gatekeeper lets every token through at once (G3) but holds the *final* chunk,
the one with ``finish_reason``, until the prefill's outcome is known (G5). If the prefill
failed, the client gets an error event in its place, then ``[DONE]``.

The workers are trio-disagg's mock SGLang workers (``trio-disagg mock-worker --protocol
sglang``): real HTTP servers with a bootstrap port, rooms, a real KV pull over loopback and
``GET /metrics`` (docs: "Run against SGLang workers"). With real timing, a prefill failure
can land anywhere: before the decode's first token (the client gets a 502), between two
tokens (an error event mid-stream, G6), or after the last one (G5). To show the last case
every time, the router's prefill engine is wrapped (``HeldPrefill`` below, as
tests/test_sglang.py does): the prefill worker's answer is read as it comes, then handed to
the router only when this script says, after the decode's last token.

1. A prefill that succeeds: the tokens flow while its outcome is unknown, the final chunk
   waits for it, then arrives with ``finish_reason=length``.
2. A prefill that fails after the KV transfer, seen on the wire: the same tokens, then
   ``data: {"error": ...}`` instead of the final chunk, then ``data: [DONE]``.
3. The same failure through the openai client: the tokens, then ``openai.APIError``, never
   a completion that looks successful.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import orjson
import trio

import trio_disagg as td

try:  # the core alone (pip install trio-disagg) has no HTTP stack
    import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client, on trio natively)
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from trio_disagg.engines import SglangEngine, sglang_engines, worker_client
    from trio_disagg.mock import LatencyModel, serve_mock_worker
    from trio_disagg.server import create_app, serve
except ImportError as missing:
    sys.exit(f"this tutorial needs the HTTP router and the openai client ({missing.name} is "
             "not installed): pip install 'trio-disagg[demo]'")

MODEL = "tutorial-model"
# 0.5 ms of prefill per prompt token, 10 ms per decoded token: the whole tutorial takes
# about a second.
LATENCY = LatencyModel(ttft_per_prompt_token=0.0005, inter_token_latency=0.01,
                       kv_transfer_per_token=0.00002)
PROMPT = ("Why does each request get a nursery of its own, and why does a detached keeper, "
          "not the request, own the prefill drain? Answer with the rules of the gatekeeper "
          "and the transfer keeper, one sentence each.")  # 37 prompt tokens: 3 KV blocks of 16
MAX_TOKENS = 4  # three chunks that flow at once, and the final one, which carries the finish
HOLD = 0.2  # seconds we watch the client receive nothing while the final chunk is held

Item = td.Annotated[td.LLMEngineOutput]


class HeldPrefill:
    """The SGLang prefill engine, with its outcome held back until :attr:`release` is set.

    Its first output, the bootstrap handoff ("room picked, prefill accepted"), goes to the
    router at once, as usual: the router then streams the decode's tokens. The rest, the
    prefill worker's answer (success, or the failure injected by ``"fault"``), is read
    from the worker as it comes, then held: :attr:`answered` is set once it is in, and it
    reaches the router when :attr:`release` is set. It stands for a prefill whose answer
    comes late; nothing else changes.
    """

    def __init__(self, engine: SglangEngine) -> None:
        self.engine = engine
        self.name = engine.name
        self.handoff_style = engine.handoff_style
        self.bootstrap_host: str | None = engine.bootstrap_host
        self.bootstrap_port: int | None = engine.bootstrap_port
        self.answered = trio.Event()
        self.release = trio.Event()

    def rearm(self) -> None:
        """Fresh events for the next request."""
        self.answered = trio.Event()
        self.release = trio.Event()

    async def generate(
        self,
        request: td.PreprocessedRequest,
        context: td.RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        answered, release = self.answered, self.release
        inner_send, inner_receive = trio.open_memory_channel[Item](16)
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(self.engine.generate, request, context, inner_send))
            task_status.started()  # the prefill worker accepted the request
            with send_channel, inner_receive:
                await send_channel.send(await inner_receive.receive())  # the handoff
                answer = [item async for item in inner_receive]  # the worker's answer
                answered.set()
                await release.wait()
                for item in answer:
                    await send_channel.send(item)


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


# --- what the clients do ----------------------------------------------------------------


def openai_stream(client: openai.OpenAI, request_id: str, fault: str | None,
                  report: Callable[[str], None]) -> str:
    """Plain synchronous openai code (run in a thread): stream a completion, report each
    chunk's text as it arrives, and say how the stream ended."""
    extra: dict[str, Any] = {"fault": fault} if fault else {}  # read by the mock workers
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True, extra_body=extra,
        extra_headers={"X-Request-Id": request_id})
    text, finish = "", None
    try:
        for chunk in stream:
            if chunk.choices:
                report(repr(chunk.choices[0].text))
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
    except openai.APIError as exc:  # an error event in the stream
        return f"raised {type(exc).__name__}: {exc.message}"
    return f"completion {text!r}, finish_reason={finish}"


async def run_openai(send: trio.MemorySendChannel[str], client: openai.OpenAI,
                     request_id: str, fault: str | None) -> None:
    """Run :func:`openai_stream` in a worker thread (the trio loop, with the router and the
    workers of this process, keeps running), passing what it sees into ``send``."""
    async with send:
        def report(event: str) -> None:
            trio.from_thread.run(send.send, event)

        outcome = await trio.to_thread.run_sync(
            partial(openai_stream, client, request_id, fault, report))
        await send.send(outcome)


def wire_event(line: str) -> str:
    """One server-sent event as it came, shortened to what matters here."""
    if line == "data: [DONE]":
        return line
    event = orjson.loads(line.removeprefix("data: "))
    if "error" in event:
        error = event["error"]
        return (f'data: {{"error": {{"type": "{error["type"]}", "code": "{error["code"]}", '
                f'"message": ...}}}}\n'
                f'              message: {error["message"]}')
    choice = event["choices"][0]
    return (f'data: {{..., "choices": [{{"text": {orjson.dumps(choice["text"]).decode()}, '
            f'"finish_reason": {orjson.dumps(choice["finish_reason"]).decode()}}}]}}')


async def run_raw(send: trio.MemorySendChannel[str], http: httpx.AsyncClient, url: str,
                  request_id: str, fault: str) -> None:
    """Stream a completion with a plain HTTP client, passing each event into ``send``."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
            "fault": fault}
    async with send, http.stream("POST", f"{url}/v1/completions", json=body,
                                 headers={"X-Request-Id": request_id}) as response:
        await send.send(f"HTTP {response.status_code}, {response.headers['content-type']}")
        async for line in response.aiter_lines():
            if line:
                await send.send(wire_event(line))


# --- the deployment, and what each step shows ----------------------------------------------


async def main() -> None:
    # The keeper logs a prefill drain that failed (T2) to "trio_disagg.keeper": show the
    # library's log lines inline. (hypercorn logs where each server listens, to stderr.)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("   [log] %(name)s: %(message)s"))
    logging.getLogger("trio_disagg").addHandler(handler)
    async with trio.open_nursery() as workers, httpx.AsyncClient(timeout=10.0) as http:
        # Two mock SGLang workers on ports the OS picks; the prefill also listens on a
        # bootstrap port (0: any free one; SGLang's default is 8998); both honour a body's
        # "fault" (a test tool, off by default). From a shell:
        #   trio-disagg mock-worker --role prefill --protocol sglang --port 30000 --fault-injection
        #   trio-disagg mock-worker --role decode --protocol sglang --port 30001 --fault-injection
        prefill_port = await workers.start(partial(
            serve_mock_worker, "prefill", "sglang", "127.0.0.1", 0, latency=LATENCY,
            bootstrap_port=0, fault_injection=True))
        decode_port = await workers.start(partial(
            serve_mock_worker, "decode", "sglang", "127.0.0.1", 0, latency=LATENCY,
            fault_injection=True))
        prefill_url = f"http://127.0.0.1:{prefill_port}"
        decode_url = f"http://127.0.0.1:{decode_port}"
        # A prefill worker reports its bootstrap port, as SGLang's own server does.
        info = (await http.get(f"{prefill_url}/get_server_info")).json()
        bootstrap_port = info["disaggregation_bootstrap_port"]
        print(f"mock SGLang workers: prefill {prefill_url} (bootstrap port {bootstrap_port}), "
              f"decode {decode_url}")

        # The router, as `trio-disagg serve --backend sglang --prefill URL,BOOTSTRAP_PORT
        # --decode URL` builds it, but for the prefill engine wrapped in HeldPrefill.
        async with worker_client() as client, td.TransferKeeper() as keeper:
            prefill, decode = sglang_engines([f"{prefill_url},{bootstrap_port}"],
                                             [decode_url], client=client)
            held = HeldPrefill(prefill[0])
            router = td.DisaggRouter(td.WorkerPool([held]), td.WorkerPool(decode), keeper)
            # The failures are injected through the body's "fault" field: only a router
            # started with fault injection passes it on to the workers.
            app = create_app(router, models=[MODEL], fault_injection=True)
            stop = trio.Event()
            async with trio.open_nursery() as server:
                port = await server.start(partial(serve, app, host="127.0.0.1", port=0,
                                                  shutdown_trigger=stop.wait))
                url = f"http://127.0.0.1:{port}"
                print(f"router: {url}/v1\n")
                with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                   timeout=10.0) as oai:
                    await steps(oai, http, url, router, keeper, held, prefill_url,
                                decode_url)
                stop.set()  # graceful shutdown of the HTTP server
        workers.cancel_scope.cancel()  # stop the workers


async def late_outcome(client: Callable[[trio.MemorySendChannel[str]], Awaitable[None]],
                       held: HeldPrefill, http: httpx.AsyncClient, decode_url: str,
                       outcome: str) -> None:
    """Run one request whose prefill outcome arrives after the decode's last token, and
    show what the client receives when."""
    held.rearm()
    done_before = (await metrics(http, decode_url))["requests_completed_total"]
    send, receive = trio.open_memory_channel[str](math.inf)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client, send)
        with receive:
            first = await receive.receive()
            if first.startswith("HTTP"):  # the raw client reports the status line first
                print(f"   client <- {first}")
                first = await receive.receive()
            print(f"   client <- {first}")
            for _ in range(MAX_TOKENS - 2):
                print(f"   client <- {await receive.receive()}")
            print(f"   {MAX_TOKENS - 1} tokens reached the client while the prefill's "
                  f"outcome is unknown (G3)")
            with trio.fail_after(5):
                await held.answered.wait()
                for _ in range(1000):  # poll the decode worker's /metrics, as a scraper would
                    m = await metrics(http, decode_url)
                    if m["requests_completed_total"] > done_before:
                        break
                    await trio.sleep(0.005)
            print("   decode worker: done, its last token (finish_reason=length) and "
                  "[DONE] sent to the router")
            print(f"   prefill worker: answered ({outcome}); held back from the router")
            with trio.move_on_after(HOLD) as waited:
                early = await receive.receive()
            if waited.cancelled_caught:
                print(f"   client: nothing more for {HOLD * 1000:.0f} ms: the router holds "
                      f"the final chunk until the prefill's outcome is known (G5)")
            else:
                print(f"   client <- {early}  (the final chunk was not held!)")
            print("   ... the prefill's answer reaches the router:")
            held.release.set()
            async for event in receive:
                print(f"   client <- {event}")


async def steps(oai: openai.OpenAI, http: httpx.AsyncClient, url: str,
                router: td.DisaggRouter, keeper: td.TransferKeeper, held: HeldPrefill,
                prefill_url: str, decode_url: str) -> None:
    print("1. The prefill succeeds, after the decode's last token (openai client).")
    await late_outcome(partial(run_openai, client=oai, request_id="tut6-1", fault=None),
                       held, http, decode_url, "success")
    await settled(router, keeper)
    print("   the success terminal went out once the prefill had succeeded.\n")

    print("2. The prefill fails after the KV transfer, after the decode's last token "
          "(on the wire).")
    await late_outcome(partial(run_raw, http=http, url=url, request_id="tut6-2",
                               fault="prefill_fail_after_handoff"),
                       held, http, decode_url, "failed")
    await settled(router, keeper)
    print("   the final chunk was replaced by one error event, then [DONE]: the stream "
          "ends, but never as a success (B4).\n")

    print("3. The same failure through the openai client.")
    await late_outcome(partial(run_openai, client=oai, request_id="tut6-3",
                               fault="prefill_fail_after_handoff"),
                       held, http, decode_url, "failed")
    await settled(router, keeper)
    print("   the application sees the tokens, then an exception: no false success.\n")

    m = await metrics(http, prefill_url)
    print(f"router: in flight={router.in_flight}, keeper drains in flight={keeper.in_flight}, "
          f"failed={keeper.failed_total}")
    print(f"prefill worker: KV transfers={m['kv_transfers_total']:.0f}, KV blocks "
          f"held={m['kv_held_blocks']:.0f} staged={m['kv_staged_blocks_total']:.0f} "
          f"freed={m['kv_freed_blocks_total']:.0f}, "
          f"rooms open={m['bootstrap_rooms_open']:.0f}")
    print("every KV transfer completed, even those of the failed prefills: the failure is "
          "the prefill's answer, which the router reads to its end (the drain).")


async def settled(router: td.DisaggRouter, keeper: td.TransferKeeper) -> None:
    """Wait until no request and no prefill drain is left (bounded)."""
    with trio.fail_after(5):
        await router.wait_idle()
        await keeper.wait_idle()


# tests/test_examples.py runs this file and checks that its output contains each line
# that starts with `# expect: `.
# expect: 3 tokens reached the client while the prefill's outcome is unknown (G3)
# expect: prefill worker: answered (success); held back from the router
# expect: the router holds the final chunk until the prefill's outcome is known (G5)
# expect: finish_reason=length
# expect: prefill worker: answered (failed); held back from the router
# expect: client <- HTTP 200, text/event-stream
# expect: client <- data: {"error": {"type": "upstream_error", "code": "prefill_failed",
# expect: message: Prefill returned an error in its output stream: prefill worker
# expect: injected fault prefill_fail_after_handoff on request 'tut6-2.
# expect: (after the KV transfer)
# expect: client <- data: [DONE]
# expect: [log] trio_disagg.keeper: prefill drain tut6-3.
# expect: client <- raised APIError: Prefill returned an error in its output stream
# expect: router: in flight=0, keeper drains in flight=0, failed=2
# expect: prefill worker: KV transfers=3, KV blocks held=0 staged=9 freed=9, rooms open=0

if __name__ == "__main__":
    trio.run(main)
