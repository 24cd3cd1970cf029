"""The router's edge, as a client sees it: API keys (401), content types (415), admission
control (503 with Retry-After), the prompt-size limit (400 ``prompt_too_long``) and the
client's ``fault`` field, all answered before any worker is called
(docs/router.md, "Securing and limiting the router")."""

from __future__ import annotations

import argparse
import gzip
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import openai
import pytest
import trio
from e2e_support import MODEL, PROMPT, in_thread, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_relay_adversary import MODEL as ADVERSARY_MODEL
from test_relay_adversary import Relayed, Worker, bare, event

from trio_disagg import (
    Annotated,
    DisaggRouter,
    LLMEngineOutput,
    PreprocessedRequest,
    RequestContext,
    TransferKeeper,
    WorkerPool,
)
from trio_disagg._cli import API_KEY_ENV, StartupError, api_key_of, build_parser
from trio_disagg.engines import LatencyModel, WorkerClient, mock_cluster
from trio_disagg.engines import _http as engines_http
from trio_disagg.engines._requests import check_worker_url
from trio_disagg.server import OpenAIApp, _edge, create_app, serve

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GOOD = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
KEY = "sk-edge-test-key"


class Recorded:
    """An engine wrapper recording the requests it was given; with a ``gate``, it waits
    for the gate before the wrapped engine sees the request."""

    def __init__(self, engine: Any, gate: trio.Event | None = None) -> None:
        self.engine = engine
        self.name: str = engine.name
        self.handoff_style = engine.handoff_style
        self.bootstrap_host = engine.bootstrap_host
        self.bootstrap_port = engine.bootstrap_port
        self.gate = gate
        self.requests: list[PreprocessedRequest] = []

    async def generate(  # noqa: ASYNC128 (the wrapped engine calls task_status.started())
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Annotated[LLMEngineOutput]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self.requests.append(request)
        if self.gate is not None:
            await self.gate.wait()
        await self.engine.generate(request, context, send_channel, task_status=task_status)


@attrs.define(eq=False)
class Edge:
    url: str
    app: OpenAIApp
    keeper: TransferKeeper
    prefill: Recorded
    decode: Recorded

    def http(self, **headers: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=10.0, headers=headers)

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=10.0)

    @property
    def calls(self) -> int:
        """Requests either engine was given."""
        return len(self.prefill.requests) + len(self.decode.requests)

    async def exchange(self, request: bytes) -> bytes:
        """Send ``request``'s raw bytes on a connection of its own; return all the server
        wrote before it closed the connection."""
        port = int(self.url.rsplit(":", 1)[1])
        answer = b""
        with trio.fail_after(5):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(request)
                while data := await stream.receive_some():
                    answer += data
        return answer

    async def refused(self) -> dict[str, float]:
        """``trio_disagg_http_refused_total`` by reason, as /metrics shows it."""
        headers = {"authorization": f"Bearer {KEY}"}
        async with self.http(**headers) as http:
            text = (await http.get("/metrics")).text
        return {sample.labels["reason"]: sample.value
                for family in text_string_to_metric_families(text)
                if family.name == "trio_disagg_http_refused"
                for sample in family.samples if sample.name.endswith("_total")}


@asynccontextmanager
async def edge_server(*, gate: trio.Event | None = None, latency: LatencyModel | None = None,
                      **options: Any) -> AsyncIterator[Edge]:
    """The embedded default (in-process mock engines, the prefill one gated by ``gate``;
    no latency unless ``latency``) behind the HTTP server, the app built with
    ``options``."""
    cluster = mock_cluster(latency=latency or LatencyModel.zero())
    prefill = Recorded(cluster.prefill[0], gate)
    decode = Recorded(cluster.decode[0])
    async with TransferKeeper(drain_window=5.0) as keeper:
        router = DisaggRouter(WorkerPool([prefill]), WorkerPool([decode]), keeper)
        app = create_app(router, models=[MODEL], **options)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve, app, host="127.0.0.1", port=0,
                                               shutdown_trigger=stop.wait,
                                               graceful_timeout=5.0))
            yield Edge(f"http://127.0.0.1:{port}", app, keeper, prefill, decode)
            if gate is not None:
                gate.set()
            stop.set()


def _error(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"]
    return error


# --- the prompt-size limit ----------------------------------------------------------------


async def test_a_600_kb_prompt_over_a_100_kb_limit_is_400_and_no_worker_is_called() -> None:
    big = "word " * 120_000  # 600 KB
    async with edge_server(max_prompt_bytes=100_000) as server:
        with server.openai() as client, pytest.raises(openai.BadRequestError) as caught:
            await in_thread(lambda: client.completions.create(
                model=MODEL, prompt=big, max_tokens=3))
        assert caught.value.status_code == 400
        assert caught.value.code == "prompt_too_long"
        assert caught.value.param == "prompt"
        async with server.http() as http:
            response = await http.post(CHAT, json={
                "model": MODEL, "max_tokens": 3,
                "messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": big}]})
            assert response.status_code == 400
            error = _error(response)
            assert (error["code"], error["param"]) == ("prompt_too_long", "messages")
            assert "100000 bytes" in error["message"]
            assert server.calls == 0  # refused before any worker was called
            # Under the limit, the same server answers.
            ok = await http.post(COMPLETIONS, json={**GOOD, "prompt": "word " * 1000})
            assert ok.status_code == 200, ok.text
        assert len(server.prefill.requests) == 1


# --- content types --------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    None, "application/jsonx",
])
async def test_a_body_that_is_not_application_json_is_415(content_type: str | None) -> None:
    """A cross-site form post (text/plain or a form: no CORS preflight) is never served."""
    body = httpx.Request("POST", "http://x", json=GOOD).content
    headers = {} if content_type is None else {"content-type": content_type}
    async with edge_server() as server, server.http() as http:
        request = http.build_request("POST", COMPLETIONS, content=body, headers=headers)
        assert request.headers.get("content-type") == content_type
        response = await http.send(request)
        assert response.status_code == 415, response.text
        error = _error(response)
        assert (error["code"], error["param"]) == ("unsupported_media_type", "Content-Type")
        assert error["type"] == "invalid_request_error"
        # A large refused body is read and thrown away: the client gets the answer.
        big = b"x" * 500_000
        response = await http.post(CHAT, content=big, headers={"content-type": "text/plain"})
        assert response.status_code == 415
        assert server.calls == 0
        assert (await server.refused())["unsupported_media_type"] == 2
        # The same body as JSON, parameters and case aside, is served.
        response = await http.post(COMPLETIONS, content=body,
                                   headers={"content-type": "Application/JSON; charset=utf-8"})
        assert response.status_code == 200, response.text


async def test_a_gzip_body_is_415_naming_the_content_encoding() -> None:
    """A client (or a proxy) that compresses its body gets a 415 that says so, not a 400
    about invalid UTF-8 in its JSON; ``identity`` is no compression and is served."""
    body = httpx.Request("POST", "http://x", json=GOOD).content
    async with edge_server() as server, server.http() as http:
        response = await http.post(COMPLETIONS, content=gzip.compress(body), headers={
            "content-type": "application/json", "content-encoding": "gzip"})
        assert response.status_code == 415, response.text
        error = _error(response)
        assert (error["code"], error["param"]) == ("unsupported_media_type",
                                                   "Content-Encoding")
        assert "gzip" in error["message"]
        assert server.calls == 0
        response = await http.post(COMPLETIONS, content=body, headers={
            "content-type": "application/json", "content-encoding": "Identity"})
        assert response.status_code == 200, response.text


# --- the client's fault field ---------------------------------------------------------------


async def test_a_body_fault_is_ignored_on_the_embedded_default() -> None:
    body = {**GOOD, "fault": "prefill_fail_before_handoff"}
    async with edge_server() as server, server.http() as http:
        response = await http.post(COMPLETIONS, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "length"
        assert all("fault" not in r.body for r in server.prefill.requests + server.decode.requests)
    async with edge_server(fault_injection=True) as server, server.http() as http:
        response = await http.post(COMPLETIONS, json=body)
        assert server.prefill.requests[0].body["fault"] == "prefill_fail_before_handoff"
        assert response.status_code == 502, response.text  # the mock engine honoured it


@pytest.mark.parametrize("fault_injection", [False, True])
async def test_a_body_fault_is_ignored_by_a_vllm_backend(fault_injection: bool) -> None:
    """``serve --backend vllm`` in front of mock vLLM workers: the workers never see a
    client's ``fault`` unless the router was started with fault injection."""
    from test_vllm import vllm_cluster  # its own test module

    async with vllm_cluster() as cluster:
        app = create_app(cluster.router, models=[MODEL], fault_injection=fault_injection)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve, app, host="127.0.0.1", port=0,
                                               shutdown_trigger=stop.wait,
                                               graceful_timeout=5.0))
            async with httpx.AsyncClient(timeout=10.0) as http:
                response = await http.post(
                    f"http://127.0.0.1:{port}{COMPLETIONS}",
                    json={**GOOD, "fault": "prefill_fail_before_handoff"})
            stop.set()
        seen = [r.body for r in (*cluster.prefill.seen, *cluster.decode.seen)]
        assert seen
        if fault_injection:
            assert any(body.get("fault") == "prefill_fail_before_handoff" for body in seen)
        else:
            assert response.status_code == 200, response.text
            assert all("fault" not in body for body in seen)
        await cluster.settled()


# --- API keys -------------------------------------------------------------------------------


async def test_api_key_wrong_or_missing_is_401_right_is_200() -> None:
    async with edge_server(api_key=KEY) as server:
        with server.openai("sk-wrong") as client, \
                pytest.raises(openai.AuthenticationError) as caught:
            await in_thread(lambda: client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=3))
        assert caught.value.status_code == 401
        assert caught.value.code == "invalid_api_key"
        with server.openai(KEY) as client:
            answer = await in_thread(lambda: client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=3))
            assert answer.choices[0].finish_reason == "length"
            assert [m.id for m in await in_thread(lambda: client.models.list())] == [MODEL]
        async with server.http() as http:
            for method, path in [("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/v1/models"),
                                 ("GET", "/v1/embeddings")]:
                response = await http.request(method, path, json=GOOD)
                assert response.status_code == 401, (path, response.text)
                error = _error(response)
                assert (error["type"], error["code"]) == ("invalid_request_error",
                                                          "invalid_api_key")
                assert response.headers["www-authenticate"].startswith("Bearer")
            for header in ["Basic " + KEY, "Bearer", KEY, f"Bearer {KEY}x"]:
                response = await http.get("/v1/models", headers={"authorization": header})
                assert response.status_code == 401, header
            # /health and /metrics stay open
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/metrics")).status_code == 200
        assert len(server.prefill.requests) == 1  # only the request with the right key
        assert (await server.refused())["unauthorized"] == 9


async def test_a_refused_client_that_withholds_its_body_still_gets_its_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The body of a refused request is read only for a bounded time: a client that sends
    its headers and then nothing gets its 401 and the connection closed."""
    monkeypatch.setattr(_edge, "DISCARD_WINDOW", 0.2)
    async with edge_server(api_key=KEY) as server:
        answer = await server.exchange(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                                       b"content-type: application/json\r\n"
                                       b"content-length: 100\r\n\r\n{")
        assert answer.startswith(b"HTTP/1.1 401"), answer[:100]
        assert b"invalid_api_key" in answer
        assert server.calls == 0


@pytest.mark.parametrize("expect", [b"100-continue", b"100-Continue"])
async def test_a_refused_client_waiting_for_100_continue_gets_its_answer_instead(
    expect: bytes,
) -> None:
    """A client that sent ``Expect: 100-continue`` is not asked for a body the router
    will not read: its 401 comes first, and the connection closes."""
    async with edge_server(api_key=KEY) as server:
        await refused_before_100_continue(server, expect, 100, b"401", b"invalid_api_key")


async def refused_before_100_continue(server: Any, expect: bytes, length: int,
                                      status: bytes, code: bytes) -> None:
    """A POST with ``Expect`` and ``length`` bytes declared (none sent) gets ``status``
    with ``code`` at once, no ``100 Continue``, and its connection closes."""
    answer = await server.exchange(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                                   b"content-type: application/json\r\n"
                                   b"expect: " + expect + b"\r\n"
                                   b"content-length: %d\r\n\r\n" % length)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:100]
    assert b"100 Continue" not in answer
    assert b"connection: close" in answer.lower()
    assert code in answer
    assert server.calls == 0


async def test_a_body_declared_too_large_is_refused_before_100_continue() -> None:
    """curl sends ``Expect: 100-continue`` with a body over 1 MiB: one declared over
    ``max_body_bytes`` gets its 413 at once, not a ``100 Continue`` that asks the client
    to upload what the router will throw away; the connection then closes."""
    async with edge_server(max_body_bytes=1000) as server:
        await refused_before_100_continue(server, b"100-continue", 1001, b"413",
                                          b"request_too_large")


async def test_protect_metrics_closes_health_and_metrics_too() -> None:
    async with edge_server(api_key=KEY, protect_metrics=True) as server:
        async with server.http() as http:
            for path in ["/health", "/metrics"]:
                assert (await http.get(path)).status_code == 401
        async with server.http(authorization=f"Bearer {KEY}") as http:
            for path in ["/health", "/metrics"]:
                assert (await http.get(path)).status_code == 200


async def test_protect_metrics_leaves_the_liveness_probe_open() -> None:
    """A Kubernetes liveness probe carries no key: with ``--protect-metrics`` its 401 would
    have the replica restarted forever (docs/deploy.md), so ``/livez`` stays open."""
    async with (edge_server(api_key=KEY, protect_metrics=True) as server,
                server.http() as http):
        assert (await http.get("/livez")).status_code == 200
        assert (await http.get("/health")).status_code == 401


def test_an_empty_api_key_is_refused() -> None:
    cluster = mock_cluster()
    router = DisaggRouter(WorkerPool(cluster.prefill), WorkerPool(cluster.decode),
                          TransferKeeper())
    with pytest.raises(ValueError, match="API key"):
        create_app(router, models=[MODEL], api_key=" ")
    with pytest.raises(ValueError, match="protect_metrics"):
        create_app(router, models=[MODEL], protect_metrics=True)
    for name in ["max_in_flight", "max_keeper_tasks", "max_prompt_bytes"]:
        limits: dict[str, Any] = {name: 0}
        with pytest.raises(ValueError, match=name):
            create_app(router, models=[MODEL], **limits)


# --- admission control ------------------------------------------------------------------------


async def test_max_in_flight_2_gives_the_third_request_503_with_retry_after() -> None:
    gate = trio.Event()
    async with edge_server(max_in_flight=2, gate=gate) as server, server.http() as http:
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await http.post(COMPLETIONS, json=GOOD))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            nursery.start_soon(ask)
            await wait_until(lambda: len(server.prefill.requests) == 2)
            assert server.app.edge.in_flight == 2
            third = await http.post(COMPLETIONS, json=GOOD)
            assert third.status_code == 503, third.text
            assert third.headers["retry-after"] == "1"
            error = _error(third)
            assert (error["type"], error["code"]) == ("service_unavailable_error",
                                                      "server_overloaded")
            assert len(server.prefill.requests) == 2  # the third never reached a worker
            gate.set()
        assert [answer.status_code for answer in answers] == [200, 200]
        await wait_until(lambda: server.app.edge.in_flight == 0)
        assert (await http.post(COMPLETIONS, json=GOOD)).status_code == 200
        assert (await server.refused())["max_in_flight"] == 1


class HoldsItsEnd(Worker):
    """A :class:`Worker` that sends its stream, ``[DONE]`` included, but the end of its
    chunked body only once :attr:`released` is set: the router's decode leg, the answer
    complete, waits for it (a leg slow to wind down)."""

    def __init__(self) -> None:
        super().__init__()
        self.released = trio.Event()

    async def end(self, stream: trio.SocketStream) -> None:
        await self.released.wait()
        await super().end(stream)


async def test_a_request_whose_answer_is_complete_no_longer_counts_against_max_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends its next request as soon as it read the last answer's
    ``[DONE]`` is never refused at ``max_in_flight=1`` while that request's decode leg
    winds down: a request counts until its answer is complete."""
    monkeypatch.setattr(engines_http, "BODY_END_GRACE", 30.0)  # (the leg waits for the end)
    worker = HoldsItsEnd()
    worker.pieces = [event(bare(False, "hi")), event(bare(False, "!", finish_reason="stop")),
                     event(b"[DONE]")]
    cluster = mock_cluster(latency=LatencyModel.zero())
    async with trio.open_nursery() as nursery, WorkerClient() as client:
        listeners = await nursery.start(partial(trio.serve_tcp, worker.handle, 0,
                                                host="127.0.0.1"))
        # (the mock decode pulls the prefill's KV first; the socket worker answers)
        decode = Relayed(cluster.decode[0],
                         f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}", client)
        async with TransferKeeper(drain_window=5.0) as keeper:
            router = DisaggRouter(WorkerPool([cluster.prefill[0]]), WorkerPool([decode]),
                                  keeper)
            app = create_app(router, models=[ADVERSARY_MODEL], max_in_flight=1, linger=30.0)
            port = await nursery.start(partial(serve, app, host="127.0.0.1", port=0))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                         timeout=10.0) as http:
                for at in range(3):
                    # (each on a connection of its own: a kept one would wait for the
                    # request before it to end, leg and all)
                    answer = await http.post(COMPLETIONS, headers={"connection": "close"},
                                             json={"model": ADVERSARY_MODEL, "prompt": "hi",
                                                   "stream": True})
                    assert answer.status_code == 200, answer.text
                    assert answer.text.endswith("data: [DONE]\n\n")
                    assert app.edge.in_flight == 0
                    assert app.in_flight == at + 1  # its decode leg is still winding down
                worker.released.set()
                await wait_until(lambda: app.in_flight == 0)
            nursery.cancel_scope.cancel()


async def test_keeper_work_at_its_bound_refuses_new_requests_and_finishes_its_own() -> None:
    """With ``max_keeper_tasks=1``, a request whose prefill drain is in the keeper makes
    the next one 503; the drain itself is never refused or dropped."""
    gate = trio.Event()
    async with edge_server(max_keeper_tasks=1, gate=gate) as server, server.http() as http:
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await http.post(COMPLETIONS, json=GOOD))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await wait_until(lambda: server.keeper.in_flight == 1
                             and len(server.prefill.requests) == 1)
            refused = await http.post(COMPLETIONS, json=GOOD)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert _error(refused)["code"] == "server_overloaded"
            assert "KV transfers" in _error(refused)["message"]
            gate.set()
        assert [answer.status_code for answer in answers] == [200]
        assert server.keeper.started_total == 1
        assert (await server.refused())["max_keeper_tasks"] == 1


async def test_a_burst_that_arrives_at_once_is_held_to_the_keeper_bound() -> None:
    """Six requests at once with ``max_keeper_tasks=2``: the requests admitted and not yet
    routed count as the prefill drains they are about to start, so two are served and
    four get 503 at once; not six prefill drains because none had started when each
    was admitted."""
    gate = trio.Event()
    async with edge_server(max_keeper_tasks=2, gate=gate) as server, server.http() as http:
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await http.post(COMPLETIONS, json=GOOD))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for _ in range(6):
                    nursery.start_soon(ask)
                # the prefills wait at the gate: only the refusals can be answered now
                await wait_until(lambda: len(answers) == 4)
                assert server.keeper.in_flight <= 2
                gate.set()
        statuses = sorted(answer.status_code for answer in answers)
        assert statuses == [200, 200, 503, 503, 503, 503], [a.text for a in answers]
        for refused in (answer for answer in answers if answer.status_code == 503):
            assert refused.headers["retry-after"] == "1"
            assert _error(refused)["code"] == "server_overloaded"
        assert server.keeper.started_total == 2
        assert (await server.refused())["max_keeper_tasks"] == 4


async def test_a_stream_whose_prefill_drain_ended_does_not_count_against_the_keeper_bound(
) -> None:
    """With ``max_keeper_tasks=1``, a request streaming its decode holds no keeper task:
    the next request is served."""
    slow = attrs.evolve(LatencyModel.zero(), inter_token_latency=0.05)
    async with edge_server(max_keeper_tasks=1, latency=slow) as server, server.http() as http:
        with trio.fail_after(10):
            async with http.stream("POST", COMPLETIONS,
                                   json={**GOOD, "max_tokens": 100, "stream": True}) as first:
                lines = first.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # decoding, drain done
                await wait_until(lambda: server.keeper.in_flight == 0)
                second = await http.post(COMPLETIONS, json=GOOD)
                assert second.status_code == 200, second.text


# --- the command line ---------------------------------------------------------------------------

COMMAND = [sys.executable, "-m", "trio_disagg._cli"]


def test_serve_help_shows_every_default() -> None:
    parser = build_parser()
    commands = next(action for action in parser._actions
                    if isinstance(action, argparse._SubParsersAction))
    serve_parser = commands.choices["serve"]
    text = " ".join(serve_parser.format_help().split())
    formatter = serve_parser._get_formatter()
    for action in serve_parser._actions:
        if action.default is argparse.SUPPRESS:
            continue  # --help
        entry = " ".join(formatter._expand_help(action).split())  # as --help prints it
        assert "(default" in entry, (action.option_strings, entry)
    assert "--max-in-flight N generation requests handled at once" in text
    assert "(0: no limit) (default: 1024)" in text
    assert "(default: 1048576)" in text  # --max-prompt-bytes


@pytest.mark.parametrize("url", ["notaurl", "ftp://p0:8100", "http://p0:99999",
                                 "http://p0:0", "http://p0:port", "http://p0:8100/?x=1",
                                 "http://p0:8100#top", "http://"])
def test_a_bad_worker_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="worker URL must be http"):
        check_worker_url(url, "vLLM")
    assert check_worker_url("http://p0:8100/prefix/", "vLLM") == "http://p0:8100/prefix"


@pytest.mark.parametrize("url", ["http://p0:8100/v1", "http://p0:8100/v1/",
                                 "https://gw.example/prefill-0/v1"])
def test_a_worker_url_ending_in_v1_is_refused_naming_it(url: str) -> None:
    """An OpenAI base URL given as a worker's: accepted, every probe went to /v1/health,
    and every request got 503 'every worker failed its health probe'."""
    with pytest.raises(ValueError, match="without /v1"):
        check_worker_url(url, "vLLM")


@pytest.mark.parametrize("url", ["http://admin:hunter2@p0:8100", "http://admin@p0:8100",
                                 "https://:hunter2@p0"])
def test_a_worker_url_with_credentials_is_refused_without_showing_them(url: str) -> None:
    """``http://user:password@host`` was accepted: the credentials were never sent (the
    workers' key goes with --worker-api-key), and the URL, the worker's name, showed them
    on the open /health, in /metrics, in the logs and in every client's error message."""
    with pytest.raises(ValueError, match="no user or password") as refused:
        check_worker_url(url, "vLLM")
    assert "hunter2" not in str(refused.value) and "admin" not in str(refused.value)


async def test_a_bad_worker_url_is_one_line_and_exit_2() -> None:
    with trio.fail_after(30):
        done = await trio.run_process(
            [*COMMAND, "serve", "--port", "0", "--backend", "vllm", "--prefill",
             "http://p0:port", "--decode", "http://127.0.0.1:9"],
            capture_stdout=True, capture_stderr=True, check=False)
    text = done.stderr.decode()
    assert done.returncode == 2, text
    (line,) = text.strip().splitlines()
    assert line == ("trio-disagg serve: error: a vLLM worker URL must be "
                    "http(s)://host[:port], got 'http://p0:port'"), line
    assert done.stdout == b""  # nothing started


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--api-key", ""], {}, "--api-key is empty"),
    ([], {API_KEY_ENV: " "}, f"{API_KEY_ENV} is blank"),
    (["--protect-metrics"], {}, "--protect-metrics needs an API key"),
    # Once: served, and every request refused 401 (no header can carry the newline a
    # secret made from a file often ends with, nor keep the spaces around a key).
    ([], {API_KEY_ENV: "sekrit\n"}, f"^{API_KEY_ENV} has a CR, LF or NUL: .*newline"),
    (["--api-key", " sekrit"], {}, "^--api-key begins or ends with whitespace"),
])
def test_an_empty_or_unsendable_api_key_is_a_startup_error(
    argv: list[str], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(StartupError, match=message) as raised:
        api_key_of(args)
    assert "sekrit" not in str(raised.value)  # the key itself is never shown


@pytest.mark.parametrize("key", ["sekrit\n", " sekrit", "sek\0rit"])
def test_create_app_refuses_an_api_key_no_client_could_send(key: str) -> None:
    cluster = mock_cluster()
    router = DisaggRouter(WorkerPool(cluster.prefill), WorkerPool(cluster.decode),
                          TransferKeeper())
    with pytest.raises(ValueError, match="no client could send it") as raised:
        create_app(router, models=["m"], api_key=key)
    assert "sekrit" not in str(raised.value)


async def test_an_empty_api_key_in_the_environment_is_one_line_and_exit_2() -> None:
    with trio.fail_after(30):
        done = await trio.run_process(
            [*COMMAND, "serve", "--port", "0"], env={**os.environ, API_KEY_ENV: ""},
            capture_stdout=True, capture_stderr=True, check=False)
    text = done.stderr.decode()
    assert done.returncode == 2, text
    (line,) = text.strip().splitlines()
    assert line.startswith(f"trio-disagg serve: error: {API_KEY_ENV} is empty"), line
    assert done.stdout == b""


async def test_serve_takes_its_key_from_the_environment_and_applies_its_limits() -> None:
    """``serve`` as an operator runs it: the key from ``TRIO_DISAGG_API_KEY`` (not on the
    command line), a prompt limit, and a client's ``fault`` ignored on the embedded
    default."""
    env = {**os.environ, API_KEY_ENV: KEY}
    argv = [*COMMAND, "serve", "--port", "0", "--max-prompt-bytes", "1000"]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(partial(
                trio.run_process, argv, env=env, stdout=subprocess.PIPE, check=False))
            assert process.stdout is not None
            banner = b""
            while b"\n" not in banner:
                data = await process.stdout.receive_some()
                assert data, "serve exited before its banner"
                banner += data
            match = re.search(rb"http://127\.0\.0\.1:(\d+)/v1", banner)
            assert match, banner
            url = f"http://127.0.0.1:{int(match.group(1))}"
            model = "trio-disagg-mock"
            async with httpx.AsyncClient(base_url=url, timeout=10.0) as http:
                response = await http.post(COMPLETIONS, json={"model": model, "prompt": "hi"})
                assert response.status_code == 401
                assert (await http.get("/health")).status_code == 200
            with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0,
                               timeout=10.0) as client:
                answer = await in_thread(lambda: client.completions.create(
                    model=model, prompt="hello there", max_tokens=3,
                    extra_body={"fault": "prefill_fail_before_handoff"}))
                assert answer.choices[0].finish_reason == "length"
                with pytest.raises(openai.BadRequestError) as caught:
                    await in_thread(lambda: client.completions.create(
                        model=model, prompt="word " * 400, max_tokens=3))
                assert caught.value.code == "prompt_too_long"
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
