"""``trio-disagg serve --workers N``: N router processes on one port, one ``/metrics``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio
from e2e_support import banner_port

from trio_disagg._supervisor import reserve_port, supervise
from trio_disagg.server import REUSE_PORT_SUPPORTED

COMMAND = [sys.executable, "-m", "trio_disagg"]
REQUESTS = 12

pytestmark = pytest.mark.skipif(not REUSE_PORT_SUPPORTED, reason="needs SO_REUSEPORT")


async def test_two_processes_serve_one_port_with_one_metrics_and_stop_on_sigterm() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(partial(
                trio.run_process, [*COMMAND, "serve", "--workers", "2", "--port", "0"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False,
            ))
            port = await banner_port(process)  # printed once both processes listen
            base_url = f"http://127.0.0.1:{port}/v1"

            def ask() -> str:
                # A client (a connection) per request: the kernel spreads connections.
                with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
                    answer = client.completions.create(
                        model="trio-disagg-mock", prompt="hello there", max_tokens=3)
                return answer.choices[0].finish_reason

            for _ in range(REQUESTS):
                assert await trio.to_thread.run_sync(ask) == "length"
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            # Every request is counted once, whichever process served it.
            assert ('trio_disagg_requests_total{endpoint="completions",outcome="success"} '
                    f"{float(REQUESTS)}") in metrics
            # The per-process gauges of both processes are on the one page.
            pids = set(re.findall(r'trio_disagg_router_closing\{pid="(\d+)"\} 0\.0', metrics))
            assert len(pids) == 2, metrics
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
            assert process.stderr is not None
            stderr = b"".join([data async for data in process.stderr]).decode()
    # Each process shut down gracefully, once (the signal reached it from the parent only).
    assert stderr.count("SIGTERM: shutting down gracefully") == 2, stderr
    assert "Traceback" not in stderr and "stopped at once" not in stderr, stderr


async def test_a_port_in_use_is_one_line_and_exit_2() -> None:
    with trio.socket.socket() as taken:
        await taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with trio.fail_after(20):
            result = await trio.run_process(
                [*COMMAND, "serve", "--workers", "2", "--port", str(port)],
                capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 2
    lines = result.stderr.decode().strip().splitlines()
    assert lines == [f"trio-disagg serve: error: cannot listen on 127.0.0.1:{port}: "
                     "Address already in use"], lines


@pytest.mark.skipif(not REUSE_PORT_SUPPORTED, reason="--workers needs SO_REUSEPORT")
async def test_a_process_that_cannot_be_started_is_a_startup_error_naming_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second process cannot be started (out of processes, memory or descriptors):
    a startup error naming --workers, not 'cannot listen on' the address, which was
    fine; and the first process is stopped, not left running."""
    import argparse
    import errno

    from trio_disagg._cli import StartupError
    from trio_disagg._cli._serve import supervised_serve

    started: list[trio.Process] = []
    real_open_process = trio.lowlevel.open_process

    async def open_process(command: list[str], **options: object) -> trio.Process:
        if started:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        started.append(await real_open_process(
            [sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE))
        return started[0]

    monkeypatch.setattr(trio.lowlevel, "open_process", open_process)
    args = argparse.Namespace(argv=["serve"], workers=3, host="127.0.0.1", port=0)
    with trio.fail_after(10), pytest.raises(StartupError) as raised:
        await supervised_serve(args)
    message = str(raised.value)
    assert message.startswith("--workers 3: could not start process 2 of 3:"), message
    assert "Resource temporarily unavailable" in message
    assert started[0].returncode is not None


async def test_a_supervisor_killed_at_once_leaves_no_process_behind() -> None:
    """SIGKILL (an operator's, or the out-of-memory killer's) gives the supervisor no
    chance to stop its processes: the pipe each of them watches closes with it, and each
    shuts down as on a SIGTERM, rather than serving on as an orphan nobody watches."""
    if not hasattr(os, "pidfd_open"):
        pytest.skip("the test waits for the processes with pidfds (Linux)")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(partial(
                trio.run_process, [*COMMAND, "serve", "--workers", "2", "--port", "0"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False,
            ))
            port = await banner_port(process)
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            pids = {int(pid) for pid in re.findall(
                r'trio_disagg_router_closing\{pid="(\d+)"\}', metrics)}
            assert len(pids) == 2, metrics
            handles = [os.pidfd_open(pid) for pid in pids]
            process.kill()
            await process.wait()
            try:
                for handle in handles:  # readable once that process has exited
                    await trio.lowlevel.wait_readable(handle)
            finally:
                for handle in handles:
                    os.close(handle)


async def test_processes_serve_on_once_the_thread_that_started_them_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """trio starts a process from one of its worker threads, and such a thread ends after
    10 s without work: the processes must not take its end for their supervisor's death
    (with the kernel's parent-death signal, which follows the thread that forked, every
    ``serve --workers N`` shut itself down 10 s after it started). Here each process is
    started from a thread of its own, which ends once both serve."""
    real_run_sync = trio.to_thread.run_sync
    release = threading.Event()
    threads: list[threading.Thread] = []

    async def run_sync(fn: Callable[..., Any], *args: Any, **options: Any) -> Any:
        if getattr(fn, "func", None) is not subprocess.Popen:
            return await real_run_sync(fn, *args, **options)
        started = threading.Event()
        result: list[Any] = []

        def spawn_then_wait() -> None:
            try:
                result.append(fn(*args))
            except OSError as exc:  # (what Popen raises: open_process's error)
                result.append(exc)
            started.set()
            release.wait(30)  # (the thread's end)

        thread = threading.Thread(target=spawn_then_wait)
        thread.start()
        threads.append(thread)
        await real_run_sync(started.wait)
        if isinstance(result[0], OSError):
            raise result[0]
        return result[0]

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)
    codes: list[int] = []
    sock, port = await reserve_port("127.0.0.1", 0)
    with sock, trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            over = trio.Event()

            async def supervisor() -> None:
                codes.append(await supervise(["serve"], workers=2, host="127.0.0.1",
                                             port=port))
                over.set()

            nursery.start_soon(supervisor)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                pids: set[int] = set()
                while len(pids) < 2:  # both processes serve
                    try:
                        metrics = (await http.get("/metrics")).text
                    except httpx.TransportError:
                        metrics = ""
                    pids = {int(pid) for pid in re.findall(
                        r'trio_disagg_router_closing\{pid="(\d+)"\} 0\.0', metrics)}
                    await trio.sleep(0.05)
                release.set()
                for thread in threads:
                    await real_run_sync(thread.join)
                for _ in range(5):  # they serve on
                    assert (await http.get("/livez")).status_code == 200
                    await trio.sleep(0.1)
            assert not over.is_set(), "the processes ended with the thread that started them"
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
    assert codes == [0]
