"""Workers started with an API key (vLLM, SGLang ``--api-key``): the mock workers refuse
requests without it as the real ones do, and ``trio-disagg serve --worker-api-key`` (or
``$TRIO_DISAGG_WORKER_API_KEY``) sends it; without it, or with a wrong one, the client gets
a 502 that says so. Real sockets: mock workers served on loopback, the router as the
``serve`` command."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import orjson
import pytest
import trio
from e2e_support import banner_port

from trio_disagg._cli import StartupError, worker_api_key_of
from trio_disagg._cli._mock_worker import mock_api_key_of
from trio_disagg.mock import MockSglangWorker, MockWorker, create_mock_worker, serve_worker
from trio_disagg.server import REUSE_PORT_SUPPORTED

COMMAND = [sys.executable, "-m", "trio_disagg"]
KEY = "sk-worker-7f3a"
MODEL = "trio-disagg-mock"  # serve's default --model; the mocks accept any
UNAUTHORIZED = {"error": "Unauthorized"}  # vLLM's and SGLang's 401 body


@asynccontextmanager
async def keyed_workers(protocol: str, key: str | None = KEY
                        ) -> AsyncIterator[tuple[MockWorker, MockWorker]]:
    """A prefill and a decode mock worker of ``protocol`` started with ``key``."""
    bootstrap = 0 if protocol == "sglang" else None
    prefill = create_mock_worker("prefill", protocol, api_key=key, bootstrap_port=bootstrap)
    decode = create_mock_worker("decode", protocol, api_key=key)
    async with trio.open_nursery() as nursery:
        for app in (prefill, decode):
            await nursery.start(partial(serve_worker, app))
        yield prefill, decode
        nursery.cancel_scope.cancel()


def url(worker: MockWorker) -> str:
    return f"http://{worker.host}:{worker.port}"


def serve_argv(protocol: str, prefill: MockWorker, decode: MockWorker, *extra: str,
               log_level: str = "WARNING") -> list[str]:
    spec = url(prefill)
    if isinstance(prefill, MockSglangWorker):
        spec += f",{prefill.bootstrap_port}"
    return [*COMMAND, "--log-level", log_level, "serve", "--port", "0", "--backend",
            protocol, "--prefill", spec, "--decode", url(decode), *extra]


@asynccontextmanager
async def router(argv: list[str], env: dict[str, str] | None = None
                 ) -> AsyncIterator[tuple[httpx.AsyncClient, bytearray]]:
    """The ``serve`` command running ``argv``: an HTTP client to it, and its stderr so
    far (complete once this exits)."""
    environ = {key: value for key, value in os.environ.items()
               if key not in ("TRIO_DISAGG_WORKER_API_KEY", "TRIO_DISAGG_API_KEY")}
    stderr = bytearray()
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(partial(
            trio.run_process, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**environ, **(env or {})}, check=False))
        assert process.stderr is not None
        nursery.start_soon(_collect, process.stderr, stderr)
        port = await banner_port(process)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as http:
            yield http, stderr
        process.terminate()
        await process.wait()


async def _collect(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
    async for data in stream:
        into += data


REQUESTS = [
    ("/v1/completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 4}),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                              "messages": [{"role": "user", "content": "hello"}]}),
]


async def ask_all(http: httpx.AsyncClient) -> list[httpx.Response]:
    """Every request of :data:`REQUESTS`, streamed and not, each on a new connection (so
    that ``--workers N`` spreads them)."""
    answers = []
    for path, body in REQUESTS:
        for stream in (False, True):
            answers.append(await http.post(path, json={**body, "stream": stream},
                                           headers={"connection": "close"}))
    return answers


async def probes(http: httpx.AsyncClient) -> float:
    """Health probes of the router's prefill worker so far."""
    metrics = (await http.get("/metrics")).text
    match = re.search(r'^trio_disagg_worker_probe_seconds_count\{role="prefill",[^}]*\} (\S+)$',
                      metrics, flags=re.MULTILINE)
    assert match, metrics
    return float(match.group(1))


# --- the mock workers refuse what the real ones refuse -----------------------------------


@pytest.mark.parametrize(("protocol", "protected", "open_"), [
    ("vllm", ["/v1/completions", "/v1/chat/completions", "/v1/models"],
     ["/health", "/metrics"]),
    ("sglang", ["/v1/completions", "/generate", "/get_server_info", "/v1/models"],
     ["/health", "/metrics"]),
])
async def test_a_keyed_mock_worker_answers_401_like_the_real_one(
    protocol: str, protected: list[str], open_: list[str]
) -> None:
    with trio.fail_after(20):
        async with keyed_workers(protocol) as (prefill, _), httpx.AsyncClient(
                base_url=url(prefill)) as http:
            for path in protected:
                method = "GET" if path in ("/v1/models", "/get_server_info") else "POST"
                for headers in ({}, {"authorization": "Bearer wrong"},
                                {"authorization": KEY}, {"authorization": f"Bearer {KEY}x"}):
                    answer = await http.request(method, path, json={}, headers=headers)
                    assert answer.status_code == 401, (path, headers, answer.text)
                    assert answer.json() == UNAUTHORIZED
                answer = await http.request(method, path, json={},
                                            headers={"authorization": f"Bearer {KEY}"})
                assert answer.status_code != 401, (path, answer.text)
            for path in open_:
                assert (await http.get(path)).status_code == 200, path
            assert prefill.stats.requests == len(protected) - 1 - (protocol == "sglang")
    assert repr(prefill.api_key) == "<ApiKey>"


def test_a_mock_key_is_refused_for_trtllm_and_when_blank() -> None:
    with pytest.raises(ValueError, match="a trtllm worker takes no API key"):
        create_mock_worker("decode", "trtllm", api_key=KEY)
    for blank in ("", "  "):
        with pytest.raises(ValueError, match="api_key must be a non-empty string"):
            create_mock_worker("decode", "vllm", api_key=blank)
    with pytest.raises(ValueError, match="has a CR, LF or NUL") as caught:
        create_mock_worker("decode", "sglang", api_key="k\r\nx")
    assert "k\r\nx" not in str(caught.value)


def test_mock_worker_key_from_the_flag_or_vllms_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def of(protocol: str, key: str | None) -> str | None:
        return mock_api_key_of(argparse.Namespace(protocol=protocol, api_key=key))

    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert of("vllm", None) == "from-env"
    assert of("vllm", "flag") == "flag"  # the flag wins, as in vLLM
    assert of("sglang", None) is None  # SGLang reads no variable
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert of("vllm", None) is None  # empty: no key, as vLLM reads it
    with pytest.raises(StartupError, match="--api-key is blank"):
        of("vllm", " ")
    with pytest.raises(StartupError, match="--api-key is empty"):
        of("vllm", "")


# --- serve: the key from the flag or the variable ----------------------------------------


def test_serve_worker_key_from_the_flag_or_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def of(key: str | None, backend: str = "vllm") -> str | None:
        return worker_api_key_of(argparse.Namespace(worker_api_key=key, backend=backend))

    monkeypatch.delenv("TRIO_DISAGG_WORKER_API_KEY", raising=False)
    assert of(None) is None
    assert of("flag") == "flag"
    monkeypatch.setenv("TRIO_DISAGG_WORKER_API_KEY", "from-env")
    assert of(None) == "from-env"
    assert of("flag") == "flag"
    with pytest.raises(StartupError, match=r"^--worker-api-key is blank"):
        of(" ")
    with pytest.raises(StartupError, match=r"^--worker-api-key is empty"):
        of("")
    with pytest.raises(StartupError, match="--worker-api-key has a CR, LF or NUL") as caught:
        of("secret\nx")
    assert "secret" not in str(caught.value)
    with pytest.raises(StartupError, match="--worker-api-key begins or ends with whitespace"):
        of("secret ")  # the worker's server strips it: every request would be a 401
    with pytest.raises(StartupError, match="it needs --backend vllm, sglang or trtllm"):
        of("flag", backend="mock")
    monkeypatch.setenv("TRIO_DISAGG_WORKER_API_KEY", "")
    with pytest.raises(StartupError, match=r"^TRIO_DISAGG_WORKER_API_KEY is empty"):
        of(None)


async def test_serve_refuses_a_blank_worker_key_in_one_line() -> None:
    with trio.fail_after(30):
        done = await trio.run_process(
            [*COMMAND, "serve", "--backend", "vllm", "--prefill", "http://127.0.0.1:1",
             "--decode", "http://127.0.0.1:2"], capture_stdout=True, capture_stderr=True,
            env={**os.environ, "TRIO_DISAGG_WORKER_API_KEY": "  "}, check=False)
    (line,) = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2
    assert line == ("trio-disagg serve: error: TRIO_DISAGG_WORKER_API_KEY is blank; give "
                    "the workers' key, or unset it to send none")


# --- end to end: the router in front of keyed workers ------------------------------------


def _text(answer: httpx.Response) -> str:
    if answer.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix(b"data: ") for line in answer.content.split(b"\n\n")
                  if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", answer.content
        chunks: list[dict[str, Any]] = [orjson.loads(event) for event in events[:-1]]
        return "".join(choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                       for chunk in chunks for choice in chunk["choices"])
    (choice,) = answer.json()["choices"]
    return str(choice.get("text") or choice["message"]["content"])


@pytest.mark.parametrize(("protocol", "workers"), [
    pytest.param("vllm", 2, marks=pytest.mark.skipif(
        not REUSE_PORT_SUPPORTED, reason="--workers needs SO_REUSEPORT")),
    ("sglang", 1),
    ("trtllm", 1),
], ids=["vllm-workers-2", "sglang", "trtllm"])
async def test_with_the_workers_key_completions_and_chat_succeed(
    protocol: str, workers: int
) -> None:
    """The key from ``$TRIO_DISAGG_WORKER_API_KEY``, in every process of ``--workers N``;
    never on ``/metrics`` nor in the logs. TensorRT-LLM workers take no key: the header
    they get anyway changes nothing."""
    key = None if protocol == "trtllm" else KEY
    with trio.fail_after(60):
        async with keyed_workers(protocol, key) as (prefill, decode):
            argv = serve_argv(protocol, prefill, decode, "--workers", str(workers),
                              log_level="DEBUG")
            async with router(argv, env={"TRIO_DISAGG_WORKER_API_KEY": KEY}) as (http,
                                                                                 stderr):
                answers = await ask_all(http)
                metrics = (await http.get("/metrics")).text
            assert decode.stats.completed == len(answers)
            assert prefill.stats.requests == len(answers)
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert _text(answer)
    assert KEY not in metrics
    assert KEY not in stderr.decode()


async def test_without_the_workers_key_or_with_a_wrong_one_the_client_gets_a_502() -> None:
    """A 401 from a worker is the fleet's configuration, not the client's key (S2): a 502
    that names the 401 and the likely cause. Not a sick worker either: its health probes
    (an open ``/health``) pass, so it stays in rotation and the router stays ready."""
    results: dict[str, tuple[list[httpx.Response], int, str]] = {}

    async def run(name: str, extra: list[str], prefill: MockWorker,
                  decode: MockWorker) -> None:
        async with router(serve_argv("vllm", prefill, decode, *extra,
                                     "--health-interval", "0.05")) as (http, stderr):
            answers = await ask_all(http)
            probed = await probes(http)
            for _ in range(10_000):  # two more rounds of probes (bounded by fail_after)
                if await probes(http) >= probed + 2:
                    break
                await trio.sleep(0.01)
            metrics = (await http.get("/metrics")).text
            for role, worker in (("prefill", prefill), ("decode", decode)):
                assert (f'trio_disagg_worker_state{{role="{role}",state="healthy",'
                        f'worker="{url(worker)}"}} 1.0') in metrics
            answers += await ask_all(http)  # the workers were not ejected: 502, not 503
            ready = (await http.get("/health")).status_code
        results[name] = (answers, ready, stderr.decode())

    with trio.fail_after(60):
        async with keyed_workers("vllm") as (prefill, decode):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "none", [], prefill, decode)
                nursery.start_soon(run, "wrong", ["--worker-api-key", "sk-wrong"],
                                   prefill, decode)
            assert prefill.stats.requests == decode.stats.requests == 0  # all refused
    for name, (answers, ready, stderr) in results.items():
        assert ready == 200, name
        assert "sk-wrong" not in stderr
        for answer in answers:
            assert answer.status_code == 502, (name, answer.text)
            error = answer.json()["error"]
            assert error["code"] == "prefill_failed", (name, error)
            assert f"prefill worker {url(prefill)} answered 401 (Unauthorized)" in (
                error["message"]), error
            assert "a missing or wrong worker API key?" in error["message"]
            assert "sk-wrong" not in error["message"]


def test_a_non_ascii_worker_key_is_refused_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM and SGLang read a header as Latin-1 (Starlette) and compare it with their key:
    a key with a non-ASCII character, sent as UTF-8, would never match, and every request
    would get a 502 naming a wrong key that is right. The official clients cannot send such
    a key either (httpx encodes headers as ASCII). Refused at startup, as a CR or LF is,
    by the router and by the mock worker (which accepted it, unlike the real ones)."""
    monkeypatch.delenv("TRIO_DISAGG_WORKER_API_KEY", raising=False)
    for key in ("s3cr3t-\u00fc", "key \u20ac"):
        with pytest.raises(StartupError, match="--worker-api-key has a non-ASCII") as caught:
            worker_api_key_of(argparse.Namespace(worker_api_key=key, backend="vllm"))
        assert key not in str(caught.value)
        for protocol in ("vllm", "sglang"):
            with pytest.raises(ValueError, match="api_key has a non-ASCII") as refused:
                create_mock_worker("decode", protocol, api_key=key)
            assert key not in str(refused.value)
    assert worker_api_key_of(argparse.Namespace(worker_api_key="with space ~!", backend="vllm"))
