"""``trio-disagg serve --workers N``: N router processes on one port, one ``/metrics``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from functools import partial

import httpx
import openai
import pytest
import trio
from e2e_support import banner_port

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
    chance to stop its processes: the kernel tells each of them (Linux), and each shuts
    down as on a SIGTERM, rather than serving on as an orphan nobody watches."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the kernel's parent-death signal is Linux's")
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
