"""The README's code runs as written: its Python example, and every command of its console
blocks, as a user would run them (the ``trio-disagg`` script that ``uv run`` runs, on a
real port, with the real ``openai`` client)."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import httpx
import openai
import trio
from e2e_support import banner_port

from trio_disagg.workers import create_mock_worker, serve_worker

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "README.md").read_text()
#: The command ``uv run trio-disagg`` runs: the script the project installs.
SCRIPT = str(Path(sys.executable).parent / "trio-disagg")


def _commands() -> list[list[str]]:
    """Each ``$ `` line of the README's console blocks, continuations joined, comments cut."""
    commands = []
    for block in re.findall(r"```console\n(.*?)```", TEXT, flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("$ "):
                commands.append(shlex.split(line[2:], comments=True))
    return commands


COMMANDS = _commands()
DEMO = ["uv", "run", "trio-disagg", "demo"]
PYTEST = ["uv", "run", "pytest"]
SERVE_MOCKS = ["uv", "run", "trio-disagg", "serve", "--port", "8000"]


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_every_readme_command_is_run_here() -> None:
    """The README's commands are exactly the ones the tests below run: a command added to
    the README needs a test here."""
    serve_vllm = [c for c in COMMANDS if "--backend" in c]
    assert serve_vllm and _flag(serve_vllm[0], "--backend") == "vllm"
    expected = [DEMO, PYTEST, SERVE_MOCKS, serve_vllm[0]]
    assert expected == COMMANDS


def test_readme_python_example_runs() -> None:
    """The library example streams the eight tokens it asked for, the last one a length
    finish."""
    (block,) = re.findall(r"```python\n(.*?)```", TEXT, flags=re.DOTALL)
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                          timeout=60, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 8 and all(line.startswith("LLMEngineOutput(") for line in lines)
    assert all("finish_reason=None" in line for line in lines[:-1])
    assert "finish_reason=FinishReason(kind=<FinishKind.LENGTH" in lines[-1]
    assert "completion_tokens=8" in lines[-1]


async def test_readme_demo_command() -> None:
    """``trio-disagg demo``, with the README's ``--requests`` and ``--backend`` to keep it
    short (tests/test_cli.py runs every backend): a table, the invariants, exit code 0."""
    with trio.fail_after(120):
        done = await trio.run_process(
            [SCRIPT, *DEMO[3:], "--requests", "14", "--backend", "mock-sequential"],
            capture_stdout=True, capture_stderr=True, check=False)
    out = done.stdout.decode()
    assert done.returncode == 0, out + done.stderr.decode()
    assert "== mock-sequential: 15 requests" in out  # at least one per scenario
    assert "staged KV blocks left: 0, stranded: 0" in out
    assert out.rstrip().endswith("no request past its deadlines.")


def test_readme_pytest_command_finds_the_suite() -> None:
    """``uv run pytest`` (collected only: this test is part of what it runs)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only",
                           "-p", "no:cacheprovider"], capture_output=True, text=True,
                          timeout=120, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert "tests/test_readme.py::test_readme_pytest_command_finds_the_suite" in done.stdout
    match = re.search(r"(\d+) tests collected", done.stdout)
    assert match and int(match.group(1)) > 500, done.stdout[-500:]


def test_readme_serve_help_lists_every_flag_the_readme_names() -> None:
    """"``trio-disagg serve --help`` lists everything": every flag the README names."""
    done = subprocess.run([SCRIPT, "serve", "--help"], capture_output=True, text=True,
                          timeout=60, check=True)
    router = TEXT[TEXT.index("## The router"):TEXT.index("## The library")]
    flags = set(re.findall(r"--[a-z][a-z-]+", router))
    assert {"--drain-window", "--prefill-deadline", "--backend"} <= flags
    assert not {flag for flag in flags if flag not in done.stdout}


async def serving(argv: list[str], check: Callable[[str], Awaitable[None]]) -> None:
    """Run ``trio-disagg`` with ``argv`` (its ``--port`` made 0: any free one), ``check``
    its base URL, then SIGTERM it: a graceful exit, code 0."""
    argv = [("0" if previous == "--port" else arg)
            for previous, arg in zip(["", *argv[:-1]], argv, strict=True)]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process = await nursery.start(partial(
                trio.run_process, [SCRIPT, *argv], stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, check=False))
            port = await banner_port(process)
            try:
                await check(f"http://127.0.0.1:{port}")
            finally:
                process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0


def _ask(base_url: str, model: str) -> tuple[str, str | None, str | None]:
    """A completion and a streamed chat completion through the official client."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                           timeout=20)
    completion = client.completions.create(model=model, prompt="hello", max_tokens=4)
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        stream=True))
    finish = [chunk.choices[0].finish_reason for chunk in chunks
              if chunk.choices and chunk.choices[0].finish_reason][-1]
    return completion.choices[0].text, completion.choices[0].finish_reason, finish


async def _check_router(base_url: str, model: str) -> None:
    text, finish, chat_finish = await trio.to_thread.run_sync(_ask, base_url, model)
    assert text and finish == "length" and chat_finish == "length"
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        assert (await http.get("/health")).status_code == 200
        models = (await http.get("/v1/models")).json()
        assert [entry["id"] for entry in models["data"]] == [model]
        metrics = await http.get("/metrics")
        assert metrics.status_code == 200 and "trio_disagg" in metrics.text


async def test_readme_serve_embedded_mocks() -> None:
    """``trio-disagg serve --port 8000``: the embedded in-process mocks answer the
    ``openai`` client; SIGTERM shuts it down gracefully."""
    await serving(SERVE_MOCKS[3:], partial(_check_router, model="trio-disagg-mock"))


async def test_readme_serve_in_front_of_vllm_workers() -> None:
    """``trio-disagg serve --backend vllm --prefill URL --decode URL --model my-model``,
    its URLs made those of two mock vLLM workers on loopback ports."""
    (command,) = [c for c in COMMANDS if "--backend" in c]
    async with trio.open_nursery() as nursery:
        urls = {}
        for role in ("prefill", "decode"):
            port = await nursery.start(partial(
                serve_worker, create_mock_worker(role, "vllm"), host="127.0.0.1", port=0))
            urls[f"--{role}"] = f"http://127.0.0.1:{port}"
        argv = [urls.get(previous, arg) for previous, arg in zip(["", *command[:-1]],
                                                                 command, strict=True)]
        await serving([*argv[3:], "--port", "0"],
                      partial(_check_router, model=_flag(command, "--model")))
        nursery.cancel_scope.cancel()
