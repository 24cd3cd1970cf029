"""Serving a mock worker over HTTP/1.1, with the project's own server (docs/protocols.md
section 5)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Literal, Unpack, overload

import trio

from .. import _http11
from .._http11 import serve_http
from ._kvwire import kv_client
from ._options import WorkerOptions
from ._sglang import MockSglangWorker
from ._trtllm import MockTrtllmWorker
from ._vllm import MockVllmWorker
from ._worker import MockWorker, Role

#: The wire protocols mock workers exist for (docs/protocols.md sections 2, 3 and 4).
PROTOCOLS = ("vllm", "sglang", "trtllm")
#: Seconds an idle keep-alive connection stays open: vLLM's (uvicorn's) default.
KEEP_ALIVE_TIMEOUT = _http11.KEEP_ALIVE_TIMEOUT


def _advertised(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host.strip("[]")


class MockWorkerOptions(WorkerOptions, total=False):
    """The settings of :func:`create_mock_worker`, as keywords; each defaults as in
    :class:`~trio_disagg.mock.MockWorker` (``bootstrap_port`` and ``bootstrap_timeout``
    as in :class:`~trio_disagg.mock.MockSglangWorker`)."""

    bootstrap_port: int | None
    bootstrap_timeout: float


@overload
def create_mock_worker(
    role: Role, protocol: Literal["vllm"] = "vllm", **options: Unpack[MockWorkerOptions]
) -> MockVllmWorker: ...
@overload
def create_mock_worker(
    role: Role, protocol: Literal["sglang"], **options: Unpack[MockWorkerOptions]
) -> MockSglangWorker: ...
@overload
def create_mock_worker(
    role: Role, protocol: Literal["trtllm"], **options: Unpack[MockWorkerOptions]
) -> MockTrtllmWorker: ...
@overload
def create_mock_worker(
    role: Role, protocol: str, **options: Unpack[MockWorkerOptions]
) -> MockWorker: ...
def create_mock_worker(
    role: Role, protocol: str = "vllm", **options: Unpack[MockWorkerOptions]
) -> MockWorker:
    """Make a mock worker's ASGI app (docs/protocols.md section 5).

    Args:
        role: ``"prefill"`` or ``"decode"``.
        protocol: ``"vllm"`` (:class:`MockVllmWorker`), ``"sglang"``
            (:class:`MockSglangWorker`) or ``"trtllm"`` (:class:`MockTrtllmWorker`).
        bootstrap_port: SGLang prefill workers only: the bootstrap port (0: any free
            one); default 8998, SGLang's.
        bootstrap_timeout: SGLang only: seconds either side of a bootstrap room waits for
            the other.
        others: see :class:`~trio_disagg.mock.MockWorker`.

    Returns:
        The worker app, not yet serving: pass it to :func:`serve_worker`, or to any ASGI
        server on trio (then :meth:`MockWorker.advertise` its address yourself).

    Raises:
        ValueError: an unknown ``protocol``, a ``bootstrap_port`` for anything but an
            SGLang prefill worker, or a bad setting.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"no mock worker for protocol {protocol!r}; known: "
                         f"{', '.join(PROTOCOLS)}")
    common: dict[str, Any] = dict(options)
    bootstrap = {key: common.pop(key) for key in ("bootstrap_port", "bootstrap_timeout")
                 if key in common}
    if bootstrap.get("bootstrap_port") is not None and (protocol, role) != ("sglang",
                                                                           "prefill"):
        raise ValueError("bootstrap_port is for SGLang prefill workers only")
    if protocol == "sglang":
        return MockSglangWorker(role, **bootstrap, **common)
    if protocol == "trtllm":
        return MockTrtllmWorker(role, **common)
    return MockVllmWorker(role, **common)


async def serve_worker(
    app: MockWorker,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a mock worker app over HTTP/1.1 until shut down.

    The app is told its address (:meth:`MockWorker.advertise`) before
    ``task_status.started()``, so the handoffs it answers name the right
    ``remote_host`` / ``remote_port``. It gets an HTTP client for its KV pulls, closed when
    this returns. A worker that wants a second listener (an SGLang prefill worker's
    bootstrap port, :attr:`MockWorker.extra_listen_port`) gets it on the same host; its
    bound port is then the app's ``bootstrap_port``.

    Args:
        app: from :func:`create_mock_worker` (or a :class:`MockWorker` subclass).
        host: the address to listen on.
        port: the TCP port; 0 picks a free one (reported through ``task_status``).
        advertise_host: the host decode workers pull KV from; default ``host``, or
            ``127.0.0.1`` when ``host`` is a wildcard address.
        shutdown_trigger: an async callable returning when the worker should stop
            gracefully; None serves until cancelled.
        task_status: with ``nursery.start``, reports the bound TCP port once listening.

    Raises:
        OSError: the address could not be bound.

    When ``shutdown_trigger`` returns, the worker stops accepting connections, closes
    idle ones, and gives the responses in progress 1 s to end before they are cancelled.
    Cancelling it stops the worker at once: its connections close, so requests in flight
    abort as on a real worker that dies. Either way, the KV-pull client it made is closed
    (within 1 s, shielded).
    """
    extra = app.extra_listen_port
    owned = app.http_client is None
    if owned:
        app.http_client = kv_client()
    try:
        async with trio.open_nursery() as nursery:
            bound, extra_bound = await _listen(nursery, app, host, port, extra,
                                               shutdown_trigger)
            app.advertise(advertise_host or _advertised(host), bound, extra_bound)
            task_status.started(bound)
    finally:
        if owned and app.http_client is not None:
            client, app.http_client = app.http_client, None
            with trio.move_on_after(1.0, shield=True):
                await client.aclose()


async def _listen(
    nursery: trio.Nursery, app: MockWorker, host: str, port: int, extra: int | None,
    shutdown_trigger: Callable[[], Awaitable[object]] | None,
) -> tuple[int, int | None]:
    """Serve ``app`` on ``port`` (and ``extra``, a second listener) in ``nursery`` with the
    project's HTTP/1.1 server, the router's too; one shutdown trigger for both. Returns
    the bound ports."""
    stopping: Callable[[], Awaitable[object]] | None = None
    if shutdown_trigger is not None:
        stop = trio.Event()
        stopping = stop.wait

        async def relay_trigger(trigger: Callable[[], Awaitable[object]]) -> None:
            await trigger()
            stop.set()

        nursery.start_soon(relay_trigger, shutdown_trigger)
    serve = partial(serve_http, app, host=host, shutdown_trigger=stopping,
                    shutdown_timeout=1.0, head_with_body=False)
    bound: int = await nursery.start(partial(serve, port=port))
    extra_bound: int | None = None
    if extra is not None:
        extra_bound = await nursery.start(partial(serve, port=extra))
    return bound, extra_bound


async def serve_mock_worker(role: Role, protocol: str = "vllm", host: str = "127.0.0.1",
                            port: int = 0, *, advertise_host: str | None = None,
                            shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
                            task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
                            **options: Unpack[MockWorkerOptions]) -> None:
    """Run one mock worker (``trio-disagg mock-worker``) until shut down or cancelled.

    :func:`create_mock_worker` then :func:`serve_worker`: docs/protocols.md section 5.

    Args:
        role: ``"prefill"`` or ``"decode"``.
        protocol: ``"vllm"``, ``"sglang"`` or ``"trtllm"`` (docs/protocols.md sections 2-4).
        host, port: where to listen; port 0 picks a free one.
        advertise_host: the host decode workers pull KV from (see :func:`serve_worker`).
        shutdown_trigger: returns when the worker should stop gracefully.
        task_status: reports the bound TCP port (the HTTP one).
        options: the worker's settings, as for :class:`~trio_disagg.mock.MockWorker`
            (``name``, ``model``, ``latency``, ``seed``, ``block_size``, ``kv_ttl``,
            ``kv_bytes_per_token``, ``default_max_tokens``, ``fault_plan``,
            ``prefix_cache_blocks``, and ``fault_injection``: honour a request body's
            ``"fault"``, off by default).
            ``bootstrap_port``, SGLang prefill workers only: the port decode workers join
            bootstrap rooms on; default 8998 (SGLang's) if ``port`` is fixed, any free
            port if ``port`` is 0 (the bound one is reported by ``GET /get_server_info``).
            ``bootstrap_timeout``, SGLang only: seconds either side of a bootstrap room
            waits for the other (SGLang's 300 s).

    Raises:
        ValueError: an unknown protocol or a bad setting.
        OSError: the address could not be bound.
    """
    if (options.get("bootstrap_port") is None and protocol == "sglang"
            and role == "prefill" and port == 0):
        options["bootstrap_port"] = 0
    app = create_mock_worker(role, protocol, **options)
    await serve_worker(app, host=host, port=port, advertise_host=advertise_host,
                       shutdown_trigger=shutdown_trigger, task_status=task_status)
