"""The ``trio-disagg`` command: ``demo`` and ``serve`` as a user runs them."""

from __future__ import annotations

import argparse
import io
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from importlib.metadata import version
from pathlib import Path

import attrs
import httpx
import openai
import pytest
import trio
from e2e_support import banner_port

from trio_disagg import DisaggRouter, TransferKeeper, WorkerPool
from trio_disagg._cli import StartupError, cancel_windows
from trio_disagg._cli._arg_types import positive_seconds, seconds
from trio_disagg._demo import Backend, demo_client, in_process_backend, run_demo
from trio_disagg._engine import CancelWindow, HandoffStyle
from trio_disagg._http11 import KEEP_ALIVE_TIMEOUT
from trio_disagg.engines import KVCounters, mock_cluster
from trio_disagg.server import create_app, serve

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


async def test_the_demo_ignores_an_http_proxy_of_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once: behind a corporate proxy (``HTTP_PROXY`` set, loopback not in ``NO_PROXY``)
    every request of ``trio-disagg demo`` went to the proxy and failed ("Connection
    error"): its openai client reads the router on this host directly."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    cluster = mock_cluster()
    with trio.fail_after(30):
        async with TransferKeeper() as keeper, trio.open_nursery() as nursery:
            router = DisaggRouter(WorkerPool(cluster.prefill), WorkerPool(cluster.decode),
                                  keeper)
            port = await nursery.start(partial(serve, create_app(router, models=["m"]),
                                               host="127.0.0.1", port=0))
            with demo_client(f"http://127.0.0.1:{port}/v1") as client:
                listed = await trio.to_thread.run_sync(client.models.list)
            nursery.cancel_scope.cancel()
    assert [model.id for model in listed] == ["m"]


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
            # The embedded mocks' KV accounting is on /metrics too (docs/protocols.md
            # section 5, B5).
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(base_url.removesuffix("/v1") + "/metrics")).text
            assert 'trio_disagg_mock_kv_held_blocks{role="prefill"} 0.0' in metrics
            assert 'trio_disagg_mock_kv_served_requests_total{role="prefill"} 1.0' in metrics
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0


# --- signals: the first shuts down gracefully, a second at once, never a traceback -------


async def _read_into(
    stream: trio.abc.ReceiveStream, into: bytearray, seen: bytes = b"",
    event: trio.Event | None = None,
) -> None:
    """Collect ``stream`` into ``into``; set ``event`` once ``seen`` is in it."""
    async for data in stream:
        into += data
        if event is not None and seen in into:
            event.set()


SERVE = ["serve", "--port", "0", "--drain-window", "30"]
MOCK_DECODE = ["mock-worker", "--role", "decode", "--port", "0", "--itl", "0.02"]


@pytest.mark.parametrize(("argv", "path", "first", "second"), [
    (SERVE, "/v1/completions", signal.SIGTERM, signal.SIGTERM),
    (SERVE, "/v1/completions", signal.SIGTERM, signal.SIGINT),
    (MOCK_DECODE, "/v1/completions", signal.SIGINT, signal.SIGINT),
    (MOCK_DECODE, "/v1/completions", signal.SIGINT, signal.SIGTERM),
], ids=["serve-term-term", "serve-term-int", "worker-int-int", "worker-int-term"])
async def test_a_second_signal_stops_at_once_with_one_line(
    argv: list[str], path: str, first: signal.Signals, second: signal.Signals
) -> None:
    """Regression: a second signal during the graceful shutdown was a KeyboardInterrupt
    traceback (SIGINT) or a death by the signal (SIGTERM). It now stops at once: one line
    on stderr, exit code 128 + the signal; a stream in flight still gets an ending."""
    stderr = bytearray()
    body = bytearray()
    streaming = trio.Event()
    graceful = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(partial(
                trio.run_process, [*COMMAND, "--log-level", "WARNING", *argv],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False,
            ))
            assert process.stderr is not None
            nursery.start_soon(_read_into, process.stderr, stderr,
                               b"shutting down gracefully", graceful)
            port = await banner_port(process)

            async def stream() -> None:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                             timeout=30) as http:
                    try:
                        async with http.stream("POST", path, json={
                                "model": "trio-disagg-mock", "prompt": "hello there",
                                "max_tokens": 20000, "stream": True}) as response:
                            async for data in response.aiter_raw():
                                body.extend(data)
                                streaming.set()
                    except httpx.HTTPError:
                        streaming.set()

            nursery.start_soon(stream)
            await streaming.wait()
            process.send_signal(first)
            await graceful.wait()
            assert process.returncode is None  # the stream holds the graceful shutdown
            process.send_signal(second)
            with trio.fail_after(5):  # at once, not after the 30 s drain window
                returncode = await process.wait()
    text = stderr.decode()
    assert returncode == 128 + second, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    last = text.strip().splitlines()[-1]
    assert last.startswith(f"trio-disagg {argv[0]}: {second.name} again: stopped at once"), text
    if argv is SERVE:  # the router's own stream ends cleanly even when forced (B4)
        assert body.endswith(b"data: [DONE]\n\n"), bytes(body[-200:])
        assert b'"code":"server_shutting_down"' in body


async def test_one_sigint_is_a_graceful_shutdown_and_exit_0() -> None:
    stderr = bytearray()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(partial(
                trio.run_process, [*COMMAND, *MOCK_DECODE],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False,
            ))
            assert process.stderr is not None
            nursery.start_soon(_read_into, process.stderr, stderr)
            await banner_port(process)
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0
    assert "Traceback" not in stderr.decode()


# --- startup errors: one line and exit code 2 -------------------------------------------


@pytest.mark.parametrize("argv", [
    ["serve", "--port", "99999"],
    ["serve", "--drain-window", "-1"],
    ["serve", "--drain-window", "inf"],
    ["serve", "--decode-idle-deadline", "nan"],
    ["serve", "--prefill-deadline", "0"],
    ["serve", "--max-connections", "0"],
    ["serve", "--workers", "100000"],  # once: processes started until memory ran out
    ["mock-worker", "--role", "prefill", "--port", "-1"],
    ["mock-worker", "--role", "decode", "--itl", "-0.5"],
    ["mock-worker", "--role", "prefill", "--kv-ttl", "nan"],
], ids=lambda argv: " ".join(argv))
async def test_bad_numbers_are_refused_before_anything_starts(argv: list[str]) -> None:
    with trio.fail_after(30):
        done = await trio.run_process([*COMMAND, *argv], capture_stdout=True,
                                      capture_stderr=True, check=False)
    text = done.stderr.decode()
    assert done.returncode == 2, text
    assert "Traceback" not in text
    assert text.strip().splitlines()[-1].startswith(f"trio-disagg {argv[0]}: error: argument")
    assert done.stdout == b""  # nothing started


@pytest.mark.parametrize("argv", [
    ["serve", "--port"],
    ["mock-worker", "--role", "prefill", "--port"],
    ["mock-worker", "--role", "prefill", "--protocol", "sglang", "--port", "0",
     "--bootstrap-port"],
], ids=["serve", "mock-worker", "mock-worker-bootstrap"])
async def test_a_port_in_use_is_one_line_and_exit_2(argv: list[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with trio.fail_after(30):
            done = await trio.run_process(
                [*COMMAND, *argv, str(port), "--host", "127.0.0.1"],
                capture_stdout=True, capture_stderr=True, check=False)
    text = done.stderr.decode()
    assert done.returncode == 2, text
    (line,) = text.strip().splitlines()
    assert line.startswith(f"trio-disagg {argv[0]}: error: cannot listen on 127.0.0.1:"), line
    assert str(port) in line and "in use" in line, line


async def test_demo_refuses_a_zero_concurrency_instead_of_hanging() -> None:
    with trio.fail_after(60):
        done = await trio.run_process([*COMMAND, "demo", "--concurrency", "0"],
                                      capture_stderr=True, check=False)
    assert done.returncode == 2
    assert b"--concurrency: must be >= 1, got 0" in done.stderr


def test_B10_cancel_window_flags_per_worker_and_for_all() -> None:
    workers = ["http://p0:8100", "http://p1:8100"]
    assert cancel_windows([], workers) == {}
    assert cancel_windows(["never"], workers) == dict.fromkeys(workers, CancelWindow.NEVER)
    assert cancel_windows(["anytime", "http://p1:8100/=before_handoff"], workers) == {
        "http://p0:8100": CancelWindow.ANYTIME, "http://p1:8100": CancelWindow.BEFORE_HANDOFF}
    with pytest.raises(StartupError, match="must be one of never, before_handoff, anytime"):
        cancel_windows(["sometimes"], workers)
    with pytest.raises(StartupError, match="'http://p9:8100' is not a prefill worker"):
        cancel_windows(["http://p9:8100=never"], workers)
    assert cancel_windows(["http://p0:8100,8998=never"], workers) == {  # an SGLang spec
        "http://p0:8100": CancelWindow.NEVER}
    with pytest.raises(StartupError, match="given twice for every prefill worker"):
        cancel_windows(["anytime", "never"], workers)
    with pytest.raises(StartupError, match="given twice for http://p1:8100"):
        cancel_windows(["http://p1:8100=anytime", "http://p1:8100/=never"], workers)
    with pytest.raises(StartupError, match="name the worker before '='"):
        cancel_windows(["=never"], workers)


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    from trio_disagg._cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"trio-disagg {version('trio-disagg')}"


@asynccontextmanager
async def serving(*flags: str) -> AsyncIterator[int]:
    """``serve`` with ``flags`` in a process of its own; its port. Terminated after."""
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(partial(
            trio.run_process, [*COMMAND, "--log-level", "WARNING", *SERVE, *flags],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False))
        try:
            yield await banner_port(process)
        finally:
            process.terminate()


async def test_serve_max_tokens_limit_is_a_flag() -> None:
    """A long-context deployment raises (or lowers) the budget a request may ask for."""
    with trio.fail_after(60):
        async with serving("--max-tokens-limit", "8") as port, httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            answers = [await http.post("/v1/completions", json={
                "model": "trio-disagg-mock", "prompt": "hi", "max_tokens": budget})
                for budget in (8, 9)]
    assert answers[0].status_code == 200
    assert answers[1].status_code == 400
    error = answers[1].json()["error"]
    assert (error["param"], error["code"]) == ("max_tokens", "invalid_value")
    assert "between 1 and 8" in error["message"]


async def test_serve_model_may_be_repeated_for_every_name_the_workers_serve() -> None:
    """A worker serving a model under several names (vLLM's ``--served-model-name`` aliases)
    answers an app that uses any of them: so does the router given each (B8); only a name
    given to none is a 404."""
    with trio.fail_after(60):
        async with serving("--model", "llama-3", "--model", "meta/llama-3") as port, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            answers = [await http.post("/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}) for name in ("llama-3", "meta/llama-3", "trio-disagg-mock")]
            listed = (await http.get("/v1/models")).json()
    assert [answer.status_code for answer in answers] == [200, 200, 404]
    assert [answer.json()["model"] for answer in answers[:2]] == ["llama-3", "meta/llama-3"]
    assert answers[2].json()["error"]["code"] == "model_not_found"
    assert [model["id"] for model in listed["data"]] == ["llama-3", "meta/llama-3"]


async def test_serve_max_connections_is_a_flag() -> None:
    """An operator bounds the client connections: at the bound the one idle the longest
    is closed to make room for a client with a request."""
    with trio.fail_after(60):
        async with serving("--max-connections", "2") as port:
            idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                         timeout=30) as http:
                answer = await http.post("/v1/completions", json={
                    "model": "trio-disagg-mock", "prompt": "hi", "max_tokens": 2})
            closed = await idle[0].receive_some(1)
            for stream in idle:
                await stream.aclose()
    assert answer.status_code == 200
    assert closed == b""  # the first idle connection made room


async def test_serve_keep_alive_timeout_is_a_flag() -> None:
    """An operator behind a load balancer keeps idle client connections longer than the
    balancer does (else it may send a request on one the router is closing): the flag
    sets how long an idle connection is kept, here shorter than the default's 5 s."""
    with trio.fail_after(60):
        async with serving("--keep-alive-timeout", "0.3") as port, \
                await trio.open_tcp_stream("127.0.0.1", port) as stream:
            started = trio.current_time()
            await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += await stream.receive_some(65536)
            while await stream.receive_some(65536):
                pass  # the rest of the answer, then the server's close
            idle = trio.current_time() - started
    assert answer.startswith(b"HTTP/1.1 200")
    assert 0.3 <= idle < KEEP_ALIVE_TIMEOUT  # the flag's timeout, not the default's


async def test_mock_style_with_a_real_backend_is_refused() -> None:
    with trio.fail_after(30):
        done = await trio.run_process(
            [*COMMAND, "serve", "--backend", "vllm", "--mock-style", "bootstrap",
             "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"],
            capture_stdout=True, capture_stderr=True, check=False)
    text = done.stderr.decode()
    assert done.returncode == 2, text
    (line,) = text.strip().splitlines()
    assert line.startswith("trio-disagg serve: error: --mock-style"), line
    assert "--backend mock" in line


@pytest.mark.parametrize("argv", [
    ["serve", "--model", ""],
    ["serve", "--model", "m", "--model", "  "],
    ["mock-worker", "--role", "decode", "--model", ""],
], ids=["serve-empty", "serve-blank", "mock-worker-empty"])
def test_an_empty_model_name_is_refused_naming_the_flag(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Once: the mock worker served a model named '' (every real name was a 404), and
    serve's error named no flag."""
    from trio_disagg._cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"trio-disagg {argv[0]}: error: argument --model: "), line


@pytest.mark.parametrize("protocol", ["vllm", "trtllm"])
async def test_mock_worker_bootstrap_timeout_is_refused_but_for_sglang(protocol: str) -> None:
    """Once: accepted and ignored (it is SGLang's room timeout), while --bootstrap-port
    was refused."""
    from trio_disagg._cli import build_parser
    from trio_disagg._cli._mock_worker import mock_worker_command

    args = build_parser().parse_args(["mock-worker", "--role", "decode", "--protocol",
                                      protocol, "--bootstrap-timeout", "5"])
    with pytest.raises(StartupError, match="--bootstrap-timeout is for --protocol sglang"):
        await mock_worker_command(args)


@pytest.mark.parametrize("command", [["serve"], ["mock-worker", "--role", "decode"]])
def test_host_takes_an_ipv6_address_in_brackets_and_refuses_a_url_or_nothing(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Once: '[::1]' (as in a URL) and '' or 'http://0.0.0.0' were looked up as names:
    'cannot listen on [[::1]]:8000: Name or service not known', naming no flag."""
    from trio_disagg._cli import build_parser

    parser = build_parser()
    assert parser.parse_args([*command, "--host", "[::1]"]).host == "::1"
    assert parser.parse_args([*command, "--host", "::"]).host == "::"
    for host in ["", "http://0.0.0.0", "[]"]:
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--host", host])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"trio-disagg {command[0]}: error: argument --host: "), line


@pytest.mark.parametrize("command", ["serve", "mock-worker", "demo"])
def test_help_gives_the_default_of_every_option(command: str) -> None:
    """Once: ``mock-worker --help`` and ``demo --help`` gave no default at all (not even
    that ``--protocol`` is vllm, or that the demo sends 200 requests), while the docs
    send the reader to ``--help`` for them."""
    from trio_disagg._cli import build_parser

    (commands,) = (action for action in build_parser()._actions
                   if isinstance(action, argparse._SubParsersAction))
    parser = commands.choices[command]
    help_text = parser.format_help()
    silent = []
    for action in parser._actions:
        if not action.option_strings or action.required or action.help == argparse.SUPPRESS:
            continue
        if action.default is argparse.SUPPRESS:
            continue
        text = parser.formatter_class(prog=command)._get_help_string(action) or ""
        if not action.help or "default" not in text:  # argparse shows no help for None
            silent.append(action.option_strings[0])
    assert not silent, (silent, help_text)


def _commands() -> dict[str, argparse.ArgumentParser]:
    """The parser of each command of ``trio-disagg``."""
    from trio_disagg._cli import build_parser

    (found,) = [action for action in build_parser()._actions
                if isinstance(action, argparse._SubParsersAction)]
    return dict(found.choices)


#: Every option that takes seconds: (the command line before it, the option, 0 allowed).
DURATION_FLAGS: list[tuple[list[str], argparse.Action, bool]] = [
    (["serve"] if name == "serve" else [name, "--role", "prefill", "--protocol", "sglang"],
     option, option.type is seconds)
    for name, parser in _commands().items() if name != "demo"
    for option in parser._actions if option.type in (seconds, positive_seconds)
]


def test_every_option_of_seconds_is_checked_the_same_way() -> None:
    # serve: the drain window, two health flags, five deadlines, the keep-alive timeout;
    # mock-worker: three latencies, the KV lease, the bootstrap timeout. Each says SECONDS.
    assert len(DURATION_FLAGS) == 14
    assert all(option.metavar == "SECONDS" for _, option, _ in DURATION_FLAGS)


@pytest.mark.parametrize(("command", "option", "zero"), DURATION_FLAGS,
                         ids=[option.option_strings[0] for _, option, _ in DURATION_FLAGS])
def test_an_absurd_duration_is_refused_naming_the_flag(
    command: list[str], option: argparse.Action, zero: bool,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Once: ``--keep-alive-timeout 1e300`` (any duration past a day, or a deadline of
    1e-300 s) was accepted: a timer that never fires (a shutdown that waits for ever), or
    one that fires at once. From 1 ms (0 where 0 means none) to a day, for every one."""
    from trio_disagg._cli import build_parser

    parser = build_parser()
    flag = option.option_strings[0]
    for good in ("86400", "0.001", "0" if zero else "0.5"):
        parsed = parser.parse_args([*command, flag, good])
        assert getattr(parsed, option.dest) == float(good)
    lowest = "0" if zero else "0.001"
    for bad in ("1e300", "86401", "inf", "nan", "-1", "-0.001" if zero else "0.0009"):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args([*command, flag, bad])
        assert exited.value.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line == (f"trio-disagg {command[0]}: error: argument {flag}: must be "
                        f"{lowest} to 86400 seconds (a day), got {bad!r}"), line


@pytest.mark.parametrize(("argv", "exists"), [(SERVE, False), (MOCK_DECODE, True)],
                         ids=["serve-missing-dir", "mock-worker-dir"])
async def test_a_stray_prometheus_multiproc_dir_is_ignored(
    argv: list[str], exists: bool, tmp_path: Path
) -> None:
    """Once: ``PROMETHEUS_MULTIPROC_DIR`` left in the environment (a base image's, a
    gunicorn app's beside it) switched prometheus-client to files in that directory: a
    traceback and exit 1 if it did not exist, else files piling up there, one set per
    process, in the metrics of whatever else reads it. A process's metrics are its own
    (``--workers N`` gives its processes a directory of their own)."""
    shared = tmp_path / "multiproc"
    if exists:
        shared.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)}
    stderr = bytearray()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(partial(
                trio.run_process, [*COMMAND, "--log-level", "WARNING", *argv],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False, env=env))
            assert process.stderr is not None
            nursery.start_soon(_read_into, process.stderr, stderr)
            port = await banner_port(process)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                         timeout=30) as http:
                answer = await http.post("/v1/completions", json={
                    "model": "trio-disagg-mock", "prompt": "hi", "max_tokens": 2})
                metrics = await http.get("/metrics")
            process.terminate()
    assert answer.status_code == 200 and metrics.status_code == 200, stderr.decode()
    assert "PROMETHEUS_MULTIPROC_DIR is set: ignored" in stderr.decode()
    assert "Traceback" not in stderr.decode()
    assert not exists or list(shared.iterdir()) == []


async def test_a_sigterm_during_the_first_health_probes_stops_before_listening() -> None:
    """Once: a SIGTERM while the first round of health probes waited on a worker that
    does not answer (up to --health-timeout) was acknowledged, then the router waited
    for the round, opened its port and announced it, and only then shut down. An
    orchestrator stopping a pod that is still starting now has it gone at once, its port
    never opened."""
    probed = trio.Event()
    held: list[trio.SocketStream] = []

    async def silent_worker(stream: trio.SocketStream) -> None:
        held.append(stream)  # the probe's connection: never answered
        probed.set()
        await trio.sleep_forever()

    stderr = bytearray()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(partial(trio.serve_tcp, silent_worker, 0,
                                                      host="127.0.0.1"))
            worker = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
            process: trio.Process = await nursery.start(partial(
                trio.run_process, [*COMMAND, "serve", "--port", "0", "--backend", "vllm",
                                   "--prefill", worker, "--decode", worker,
                                   "--health-timeout", "60"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False))
            assert process.stdout is not None and process.stderr is not None
            nursery.start_soon(_read_into, process.stderr, stderr)
            await probed.wait()
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(5):  # not the 60 s of the probe's timeout
                returncode = await process.wait()
            stdout = await process.stdout.receive_some()
            nursery.cancel_scope.cancel()
    assert returncode == 0, stderr.decode()
    assert stdout == b""  # never announced: it never listened
    assert "Traceback" not in stderr.decode()
