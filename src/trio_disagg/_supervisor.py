"""``serve --workers N``: N router processes on one port, started and stopped together.

The parent (this module) starts N ``python -m trio_disagg serve ... --supervised``
processes. Each listens on the same port with ``SO_REUSEPORT`` (the kernel spreads new
connections over them) and writes its metrics to a directory shared by all
(prometheus-client's multiprocess mode, ``PROMETHEUS_MULTIPROC_DIR``), so ``/metrics``
on any of them shows the aggregate. The router keeps no state a request needs from an
earlier one (session affinity is a consistent hash), so any process may serve any
request.

The parent forwards SIGINT and SIGTERM to every process: the first signal shuts each down
gracefully (B3), a second one stops each at once. Each process runs in a session of its
own, so a terminal's Ctrl-C reaches it only once, through the parent. When a process
exits with an error the parent stops the others (SIGTERM) and exits with that process's
code. A parent that dies without a word (SIGKILL) closes its end of a pipe each process
watches (:func:`end_with_supervisor`), and each then shuts down as on a SIGTERM.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence

import trio

logger = logging.getLogger("trio_disagg")

#: The hidden ``serve`` option the parent starts each process with.
SUPERVISED_FLAG = "--supervised"
#: The environment variable naming prometheus-client's multiprocess directory.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: In each process's environment, the file descriptor of the read end of a pipe whose
#: write end only the supervisor holds (:func:`end_with_supervisor`).
LIFELINE_FD_ENV = "TRIO_DISAGG_SUPERVISOR_FD"
#: How a process of ``serve`` announces that it listens: the parent prints one such line,
#: with every pid, once all did.
READY_PREFIX = b"trio-disagg: serving "
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SupervisorError(Exception):
    """A process could not be started (out of processes, memory or descriptors)."""


async def reserve_port(host: str, port: int) -> tuple[trio.socket.SocketType, int]:
    """Bind (without listening) a socket with ``SO_REUSEPORT`` on ``host``:``port``, to
    learn the port 0 stands for and keep it while the processes bind it too. A socket
    that does not listen is given no connection.

    Raises:
        OSError: the address could not be bound (in use by a process without
            ``SO_REUSEPORT``, or not an address of this host).
    """
    family, kind, proto, _, address = (await trio.socket.getaddrinfo(
        host, port, type=trio.socket.SOCK_STREAM, flags=trio.socket.AI_PASSIVE))[0]
    sock = trio.socket.socket(family, kind, proto)
    try:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEPORT, 1)
        if family == trio.socket.AF_INET6:
            sock.setsockopt(trio.socket.IPPROTO_IPV6, trio.socket.IPV6_V6ONLY, 1)
        await sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock, sock.getsockname()[1]


def exit_code(returncode: int) -> int:
    """A child's exit status as a shell reports it (128 + N for death by signal N)."""
    return 128 - returncode if returncode < 0 else returncode


async def supervise(argv: Sequence[str], *, workers: int, host: str, port: int) -> int:
    """Run ``trio-disagg`` ``argv`` (a ``serve`` command line) in ``workers`` processes on
    one port until they all exited; forward SIGINT and SIGTERM to them.

    Args:
        argv: the command line's arguments, ``serve`` and its options; the port, one
            worker and :data:`SUPERVISED_FLAG` are appended.
        workers: how many processes (>= 2).
        host: the address they listen on.
        port: the TCP port; 0 picks a free one, the same for all.

    Returns:
        0 if every process exited with 0; else the exit code of the first that did not
        (2: it could not start; 130 or 143: stopped at once by a second signal).

    Raises:
        OSError: the address could not be reserved.
        SupervisorError: a process could not be started (the ones started are killed).
    """
    sock, port = await reserve_port(host, port)
    metrics_dir = tempfile.mkdtemp(prefix="trio-disagg-metrics-")
    # The lifeline: nothing is ever written; the processes see its end when this process
    # ends, however it ends. (Not the kernel's parent-death signal: that one follows the
    # thread that forked, and trio forks in a worker thread that ends after 10 s idle.)
    lifeline, held = os.pipe()
    env = {**os.environ, MULTIPROC_DIR_ENV: metrics_dir, LIFELINE_FD_ENV: str(lifeline)}
    command = [sys.executable, "-m", "trio_disagg", *argv,
               "--port", str(port), "--workers", "1", SUPERVISED_FLAG]
    processes: list[trio.Process] = []
    try:
        with sock, trio.open_signal_receiver(*SIGNALS) as signals:
            try:
                for index in range(workers):
                    try:
                        processes.append(await trio.lowlevel.open_process(
                            command, stdout=subprocess.PIPE, env=env,
                            start_new_session=True, pass_fds=(lifeline,)))
                    except OSError as exc:  # out of processes, memory or descriptors
                        raise SupervisorError(
                            f"--workers {workers}: could not start process {index + 1} of "
                            f"{workers}: {exc.strerror or exc}") from exc
            except BaseException:
                for process in processes:
                    process.kill()
                with trio.CancelScope(shield=True), trio.move_on_after(5):  # reap them
                    for process in processes:
                        await process.wait()
                raise
            os.close(lifeline)  # the processes hold it now
            lifeline = -1
            return await _watch(processes, signals, metrics_dir)
    finally:
        for fd in (lifeline, held):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(metrics_dir, ignore_errors=True)


def end_with_supervisor() -> None:
    """In one of ``serve --workers N``'s processes: send itself SIGTERM once its supervisor
    is gone, so that a supervisor killed with SIGKILL (by an operator, or by the
    out-of-memory killer) leaves no router process behind: each shuts down gracefully, as
    on a SIGTERM the supervisor forwards (B3). A supervisor already gone is noticed at
    once. It watches the pipe the supervisor started it with (:data:`LIFELINE_FD_ENV`),
    whose write end the kernel closes when the supervisor dies, however it dies; it does
    nothing in a process started otherwise.

    Call it inside ``trio.run``, and handle SIGTERM from the next checkpoint on (``serve``
    does): the watch is a system task, which the run cancels when it ends.
    """
    text = os.environ.get(LIFELINE_FD_ENV)
    if text is None or not text.isdigit():
        return
    fd = int(text)
    try:
        os.set_inheritable(fd, False)  # nothing this process starts keeps its supervisor
    except OSError:  # not open: started by hand with a stale environment, nothing to watch
        return
    trio.lowlevel.spawn_system_task(_end_when_closed, fd, name="trio_disagg.supervisor lifeline")


async def _end_when_closed(fd: int) -> None:
    """Send this process SIGTERM once ``fd``, the lifeline, reads its end (nothing else is
    ever written to it)."""
    try:
        await trio.lowlevel.wait_readable(fd)
    except (OSError, trio.ClosedResourceError):  # not a descriptor epoll can watch
        logger.warning("cannot watch the supervisor's pipe (fd %d): this process will not "
                       "stop by itself if its supervisor dies", fd)
        return
    os.kill(os.getpid(), signal.SIGTERM)


def _mark_dead(pid: int, metrics_dir: str) -> None:
    """Take a process that exited out of the aggregate's live gauges."""
    # The server extra: imported here, so that the command line's parser needs none.
    from prometheus_client.multiprocess import mark_process_dead

    mark_process_dead(pid, metrics_dir)  # type: ignore[no-untyped-call]


async def _watch(processes: list[trio.Process], signals: AsyncIterator[int],
                 metrics_dir: str) -> int:
    failures: list[int] = []
    ready: list[int] = []
    stopping = False

    def stop_all(signum: int) -> None:
        for process in processes:
            if process.returncode is None:
                process.send_signal(signum)

    async def relay(process: trio.Process) -> None:
        """Pass the process's output on; count it ready once it announced it listens."""
        assert process.stdout is not None
        pending = b""
        async with process.stdout:
            while chunk := await process.stdout.receive_some():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not line.startswith(READY_PREFIX):
                        sys.stdout.buffer.write(line + b"\n")
                        continue
                    # One line once all listen, as one process prints it, with every pid.
                    ready.append(process.pid)
                    if len(ready) == len(processes):
                        pids = ", ".join(map(str, ready))
                        sys.stdout.buffer.write(re.sub(
                            rb", pid \d+\)$", f"; {len(ready)} processes, pids {pids})".encode(),
                            line) + b"\n")
                sys.stdout.buffer.flush()

    async def wait(process: trio.Process) -> None:
        nonlocal stopping
        code = exit_code(await process.wait())
        # Its live gauges leave the aggregate; its counters stay.
        _mark_dead(process.pid, metrics_dir)
        if code != 0:
            failures.append(code)
            if not stopping:  # a process failed on its own: stop the others
                logger.error("worker process %d exited with code %d: stopping the others",
                             process.pid, code)
                stopping = True
                stop_all(signal.SIGTERM)

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as children:
            for process in processes:
                children.start_soon(relay, process)
                children.start_soon(wait, process)

            async def forward() -> None:
                nonlocal stopping
                async for signum in signals:
                    stopping = True
                    stop_all(signum)

            nursery.start_soon(forward)
        nursery.cancel_scope.cancel()  # every process exited: stop forwarding
    return failures[0] if failures else 0
