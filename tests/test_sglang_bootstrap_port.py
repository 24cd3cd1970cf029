"""An SGLang prefill worker given without its bootstrap port (``--prefill URL``, or
``URL,none`` as SGLang's router writes it): the router asks the worker for it, as SGLang's
router does (``GET /server_info``, ``disaggregation_bootstrap_port``), and a port it cannot
learn is the operator's to fix, never a client's 400 (docs/protocols.md section 3).

Mock workers and the router's HTTP server on 127.0.0.1 with port 0; every wait bounded.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import pytest
import trio
from e2e_support import MODEL, PROMPT, banner_port

from trio_disagg import DisaggRouter, HealthMonitor, TransferKeeper, WorkerError, WorkerPool
from trio_disagg._cli import StartupError, build_parser, cancel_windows
from trio_disagg._cli._serve_options import engines_for
from trio_disagg.engines import SglangEngine, parse_prefill_spec, sglang_engines, worker_client
from trio_disagg.server import create_app, serve
from trio_disagg.workers import MockSglangWorker, MockWorker, create_mock_worker, serve_worker

BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}


# --- the spec: URL, URL,PORT or URL,none ---------------------------------------------------


def test_a_prefill_spec_gives_its_port_or_leaves_it_to_the_worker() -> None:
    assert parse_prefill_spec("http://p:30000") == ("http://p:30000", None)
    assert parse_prefill_spec("http://p:30000,none") == ("http://p:30000", None)
    assert parse_prefill_spec("http://p:30000, None ") == ("http://p:30000", None)
    assert parse_prefill_spec("http://p:30000, 9100") == ("http://p:30000", 9100)
    for bad in ("http://p:1,x", "http://p:1,0", "http://p:1,65536", ",8998", "http://p:1,"):
        with pytest.raises(ValueError, match=r"1-65535|URL"):
            parse_prefill_spec(bad)


async def test_serve_takes_an_sglang_prefill_with_or_without_its_port() -> None:
    argv = ["serve", "--backend", "sglang", "--prefill", "http://h:30000",
            "--prefill", "http://h:30001", "none", "--prefill", "http://g:30000", "9000",
            "--decode", "http://h:30002"]  # SGLang's router's form: URL BOOTSTRAP_PORT
    assert build_parser().parse_args(argv).prefill == [
        "http://h:30000", "http://h:30001,none", "http://g:30000,9000"]
    async with worker_client() as client:
        prefill, decode, _ = engines_for(build_parser().parse_args(argv), client)
        assert [(e.bootstrap_host, e.bootstrap_port) for e in prefill] == [
            ("h", None), ("h", None), ("g", 9000)]  # two on one host: each its own port
        assert decode[0].bootstrap_port is None
        # --cancel-window names the worker by its URL, whatever follows the comma
        assert set(cancel_windows(["http://h:30001,none=never"],
                                  [e.name for e in prefill])) == {"http://h:30001"}
        for bad, says in (("http://h:1,abc", "or none"), ("http://h:1,0", "1-65535"),
                          ("http://h:1,8998", "same host and port")):
            with pytest.raises(StartupError, match=says):
                engines_for(build_parser().parse_args(
                    [*argv[:4], bad, "--prefill", "http://h:2,8998", *argv[-2:]]), client)
        vllm = [*argv[:2], "vllm", "--prefill", "http://h:1", "8100", *argv[-2:]]
        with pytest.raises(StartupError, match="a bootstrap port is SGLang's"):
            engines_for(build_parser().parse_args(vllm), client)
    for words in (["http://h:1", "8998", "9000"], ["http://h:1,8998", "9000"], []):
        with pytest.raises(SystemExit):  # one URL, and at most one port
            build_parser().parse_args([*argv[:3], "--prefill", *words])


# --- the engine asks the worker ------------------------------------------------------------


@asynccontextmanager
async def workers(prefill: MockWorker, decode: MockWorker) -> AsyncIterator[tuple[str, str]]:
    async with trio.open_nursery() as nursery:
        ports = [await nursery.start(partial(serve_worker, app)) for app in (prefill, decode)]
        yield f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"
        nursery.cancel_scope.cancel()


def sglang_pair(*, swapped: bool = False) -> tuple[MockSglangWorker, MockSglangWorker]:
    """A mock prefill on a bootstrap port of its own (not SGLang's 8998), and a decode;
    ``swapped``: a decode worker in the prefill's place."""
    prefill = (MockSglangWorker("decode", model=MODEL) if swapped else
               MockSglangWorker("prefill", model=MODEL, bootstrap_port=0))
    return prefill, MockSglangWorker("decode", model=MODEL)


@asynccontextmanager
async def routed(prefill_spec: str, decode_url: str, *, probed: bool = True
                 ) -> AsyncIterator[tuple[httpx.AsyncClient, SglangEngine]]:
    """The router over the SGLang adapter, served with its health probes (as ``serve``
    runs it) or without; a client of its HTTP server, and the prefill engine."""
    async with worker_client() as client, TransferKeeper(drain_window=5.0) as keeper:
        (prefill,), decode = sglang_engines([prefill_spec], [decode_url], client=client)
        router = DisaggRouter(WorkerPool([prefill]), WorkerPool(decode), keeper)
        health = HealthMonitor([*router.prefill.workers, *router.decode.workers],
                               interval=60.0, timeout=5.0) if probed else None
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(
                serve, create_app(router, models=[MODEL]), host="127.0.0.1", port=0,
                shutdown_trigger=stop.wait, graceful_timeout=5.0, health=health))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                         timeout=10.0) as http:
                yield http, prefill
            stop.set()


async def test_a_prefill_without_its_port_is_asked_for_it_and_serves() -> None:
    """Once: the port was taken to be 8998, the mock prefill (bootstrapping elsewhere)
    refused every request, and the client got that 400 as ``prefill_rejected``."""
    prefill, decode = sglang_pair()
    with trio.fail_after(10):
        async with workers(prefill, decode) as (prefill_url, decode_url):
            assert prefill.bootstrap_port not in (None, 8998)
            async with routed(prefill_url, decode_url) as (http, engine):
                assert engine.bootstrap_port == prefill.bootstrap_port
                answer = await http.post("/v1/completions", json=BODY)
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["completion_tokens"] == 3
                assert decode.stats.completed == 1


@pytest.mark.parametrize("old_sglang", [False, True])
async def test_learn_bootstrap_port_asks_server_info_then_get_server_info(
        old_sglang: bool) -> None:
    """An SGLang older than ``/server_info`` answers 404 there: ``/get_server_info``."""
    prefill, decode = sglang_pair()
    seen: list[str] = []
    real_route = prefill._route

    async def route(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["path"])
        if old_sglang and scope["path"] == "/server_info":
            scope = {**scope, "path": "/nowhere"}
        await real_route(scope, receive, send)

    prefill._route = route  # type: ignore[method-assign]
    with trio.fail_after(10):
        async with workers(prefill, decode) as (prefill_url, _), worker_client() as client:
            engine = SglangEngine(prefill_url, "prefill", client=client)
            assert engine.bootstrap_port is None
            assert await engine.learn_bootstrap_port() == prefill.bootstrap_port
            assert engine.bootstrap_port == prefill.bootstrap_port
    assert [path for path in seen if "server_info" in path] == (
        ["/server_info", "/get_server_info"] if old_sglang else ["/server_info"])


async def test_a_learned_port_is_asked_again_after_the_worker_failed_its_probe() -> None:
    """A prefill worker that fails its health probe may come back restarted on another
    bootstrap port: the port it told is forgotten, and asked again; a port given is kept."""
    prefill, decode = sglang_pair()
    down = False
    real_route = prefill._route

    async def route(scope: Any, receive: Any, send: Any) -> None:
        if down and scope["path"] == "/health":
            scope = {**scope, "path": "/nowhere"}  # 404
        await real_route(scope, receive, send)

    prefill._route = route  # type: ignore[method-assign]
    with trio.fail_after(10):
        async with workers(prefill, decode) as (prefill_url, _), worker_client() as client:
            learned = SglangEngine(prefill_url, "prefill", client=client)
            given = SglangEngine(prefill_url, "prefill", client=client, bootstrap_port=9000)
            await learned.check_health()
            assert prefill.bootstrap_port is not None
            assert learned.bootstrap_port == prefill.bootstrap_port
            down = True
            for engine in (learned, given):
                with pytest.raises(WorkerError, match="answered 404"):
                    await engine.check_health()
            assert repr(learned).endswith("bootstrap port unknown>")  # forgotten
            assert given.bootstrap_port == 9000
            down = False
            prefill.bootstrap_port += 1  # what its /server_info now says: restarted
            await learned.check_health()
            assert learned.bootstrap_port == prefill.bootstrap_port


# --- a port that cannot be learned: the operator's to fix, never a client's 400 -----------


@pytest.mark.parametrize(("role", "says"), [
    ("decode", "is not an SGLang prefill worker: its /server_info gives disaggregation_mode "
               "'decode'"),
    ("vllm", "its bootstrap port is unknown: GET /get_server_info answered 404; give it in "
             "the worker's spec, URL,BOOTSTRAP_PORT"),
])
async def test_a_port_that_cannot_be_learned_is_a_503_that_says_why(
        role: str, says: str, caplog: pytest.LogCaptureFixture) -> None:
    """A decode worker given as a prefill one, or a worker that is no SGLang: its probe
    fails (logged), the router routes nothing to it, and the client's 503 says why."""
    prefill: MockWorker
    prefill, decode = sglang_pair(swapped=True)
    if role == "vllm":
        prefill = create_mock_worker("prefill", "vllm", model=MODEL)
    with trio.fail_after(10):
        async with (workers(prefill, decode) as (prefill_url, decode_url),
                    routed(prefill_url, decode_url) as (http, engine)):
            answer = await http.post("/v1/completions", json=BODY)
            assert engine.bootstrap_port is None
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "no_worker_available"
    assert says in error["message"]
    assert answer.headers["retry-after"]
    warned = [r.getMessage() for r in caplog.records if "failed its health probe" in
              r.getMessage()]
    assert len(warned) == 1 and says in warned[0] and prefill_url in warned[0]
    assert (prefill.stats.requests, decode.stats.requests) == (0, 0)


@pytest.mark.parametrize("listed_as", ["prefill", "decode"])
async def test_a_worker_in_the_other_role_fails_its_probe_even_with_its_port_given(
        listed_as: str, caplog: pytest.LogCaptureFixture) -> None:
    """Once: a decode worker listed as a prefill one with a bootstrap port
    (``--prefill URL,PORT``) was never asked its mode and passed its probes: every request
    was sent to it and failed with a KV transfer error (a 200 with nothing generated when
    a real prefill's bootstrap server listened on that port); a prefill worker listed as
    a decode one passed too, and every request was a 502. Now the probe reads the mode,
    whatever the role and the port, and no request reaches either worker."""
    prefill, decode = sglang_pair(swapped=listed_as == "prefill")
    if listed_as == "decode":  # the prefill worker listed again, as the decode worker
        decode = MockSglangWorker("prefill", model=MODEL, bootstrap_port=0)
    with trio.fail_after(10):
        async with workers(prefill, decode) as (prefill_url, decode_url):
            spec = f"{prefill_url},{prefill.bootstrap_port or 9000}"
            async with routed(spec, decode_url) as (http, _):
                answer = await http.post("/v1/completions", json=BODY)
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    wrong = "decode" if listed_as == "prefill" else "prefill"
    says = (f"{listed_as} worker {prefill_url if listed_as == 'prefill' else decode_url} "
            f"is not an SGLang {listed_as} worker: its /server_info gives "
            f"disaggregation_mode '{wrong}'")
    assert (error["code"], says in error["message"]) == ("no_worker_available", True)
    assert any(says in r.getMessage() for r in caplog.records)
    assert (prefill.stats.requests, decode.stats.requests) == (0, 0)


async def test_without_health_probes_an_unknown_port_is_a_503_not_a_guess() -> None:
    """A router run without a HealthMonitor never learns the port: it says so (503), and
    sends nothing to either worker, rather than guess SGLang's default."""
    prefill, decode = sglang_pair()
    with trio.fail_after(10):
        async with (workers(prefill, decode) as (prefill_url, decode_url),
                    routed(f"{prefill_url},none", decode_url, probed=False) as (http, _)):
            answer = await http.post("/v1/completions", json=BODY)
    assert answer.status_code == 503, answer.text
    assert "has no bootstrap port" in answer.json()["error"]["message"]
    assert (prefill.stats.requests, decode.stats.requests) == (0, 0)


async def test_a_wrong_port_given_is_a_bad_gateway_not_the_clients_400() -> None:
    """The port given is not the prefill's: SGLang's decode could never join its room.
    The mock prefill refuses it as the router's mistake (once a 400, passed through to
    the client as ``prefill_rejected``)."""
    prefill, decode = sglang_pair()
    with trio.fail_after(10):
        async with workers(prefill, decode) as (prefill_url, decode_url):
            assert prefill.bootstrap_port is not None
            wrong = prefill.bootstrap_port + 1 if prefill.bootstrap_port < 65535 else 1
            async with routed(f"{prefill_url},{wrong}", decode_url) as (http, _):
                answer = await http.post("/v1/completions", json=BODY)
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["code"] == "prefill_failed"
    assert f"bootstraps at port {prefill.bootstrap_port}, not {wrong}" in error["message"]


# --- the command line ----------------------------------------------------------------------


async def test_trio_disagg_serve_sglang_prefill_url_alone_serves() -> None:
    """``trio-disagg serve --backend sglang --prefill URL``, as an SGLang user writes it
    for SGLang's own router, against a prefill bootstrapping on a port of its own."""
    prefill, decode = sglang_pair()
    with trio.fail_after(30):
        async with (workers(prefill, decode) as (prefill_url, decode_url),
                    trio.open_nursery() as nursery):
            process: trio.Process = await nursery.start(partial(
                trio.run_process,
                [sys.executable, "-m", "trio_disagg._cli", "--log-level", "WARNING",
                 "serve", "--port", "0", "--backend", "sglang", "--model", MODEL,
                 "--prefill", prefill_url, "--decode", decode_url],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False))
            try:
                port = await banner_port(process)
                async with httpx.AsyncClient(timeout=10.0) as http:
                    answer = await http.post(f"http://127.0.0.1:{port}/v1/completions",
                                             json=BODY)
            finally:
                process.terminate()
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "length"
