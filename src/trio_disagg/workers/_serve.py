"""Serving a mock worker with hypercorn's trio worker (PROTOCOLS.md section 5)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from urllib.parse import urlsplit

import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client, on trio natively)
import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from ..engines._faults import FaultPlan
from ..engines._kv import DEFAULT_BLOCK_SIZE, DEFAULT_KV_TTL
from ..engines._latency import LatencyModel
from ._vllm import DEFAULT_KV_BYTES_PER_TOKEN, PULL_TIMEOUT, MockVllmWorker, Role

#: The wire protocols mock workers exist for.
PROTOCOLS = ("vllm",)
#: Seconds an idle keep-alive connection stays open: vLLM's (uvicorn's) default.
KEEP_ALIVE_TIMEOUT = 5.0


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _port_of(bind: str) -> int:
    port = urlsplit(bind).port
    if port is None:
        raise RuntimeError(f"hypercorn reported a bind without a port: {bind!r}")
    return port


def _advertised(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host.strip("[]")


def create_mock_worker(
    role: Role,
    protocol: str = "vllm",
    *,
    name: str | None = None,
    model: str | None = None,
    latency: LatencyModel | None = None,
    seed: int = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_ttl: float = DEFAULT_KV_TTL,
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
    default_max_tokens: int = 16,
    fault_plan: FaultPlan | None = None,
) -> MockVllmWorker:
    """Make a mock worker's ASGI app; see :class:`MockVllmWorker` for the arguments.

    Raises:
        ValueError: an unknown ``protocol`` (only ``"vllm"`` so far) or a bad setting.
    """
    if protocol != "vllm":
        raise ValueError(f"no mock worker for protocol {protocol!r}; known: "
                         f"{', '.join(PROTOCOLS)}")
    return MockVllmWorker(
        role, name=name, model=model, latency=latency, seed=seed, block_size=block_size,
        kv_ttl=kv_ttl, kv_bytes_per_token=kv_bytes_per_token,
        default_max_tokens=default_max_tokens, fault_plan=fault_plan,
    )


async def serve_worker(
    app: MockVllmWorker,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a mock worker app over HTTP with hypercorn's trio worker until shut down.

    The app is told its address (:meth:`MockVllmWorker.advertise`) before
    ``task_status.started()``, so the handoffs it answers name the right
    ``remote_host`` / ``remote_port``. It gets an HTTP client for its KV pulls, closed when
    this returns.

    Args:
        app: from :func:`create_mock_worker` (or :class:`MockVllmWorker`).
        host: the address to listen on.
        port: the TCP port; 0 picks a free one (reported through ``task_status``).
        advertise_host: the host decode workers pull KV from; default ``host``, or
            ``127.0.0.1`` when ``host`` is a wildcard address.
        shutdown_trigger: an async callable returning when the worker should stop
            gracefully; None serves until cancelled.
        task_status: with ``nursery.start``, reports the bound TCP port once listening.

    Raises:
        OSError: the address could not be bound.

    Cancelling it stops the worker at once: its connections close, so requests in flight
    abort as on a real worker that dies.
    """
    config = Config()
    config.bind = [_bind(host, port)]
    config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT
    config.graceful_timeout = 1.0
    owned = app.http_client is None
    if owned:
        app.http_client = httpx.AsyncClient(
            timeout=PULL_TIMEOUT, trust_env=False,
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64,
                                keepalive_expiry=4.0),
        )
    try:
        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(partial(
                hypercorn_serve, app, config, shutdown_trigger=shutdown_trigger,  # type: ignore[arg-type]
                mode="asgi",
            ))
            bound = _port_of(binds[0])
            app.advertise(advertise_host or _advertised(host), bound)
            task_status.started(bound)
    finally:
        if owned and app.http_client is not None:
            client, app.http_client = app.http_client, None
            with trio.move_on_after(1.0, shield=True):
                await client.aclose()


async def serve_mock_worker(
    role: Role,
    protocol: str = "vllm",
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    name: str | None = None,
    model: str | None = None,
    latency: LatencyModel | None = None,
    seed: int = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_ttl: float = DEFAULT_KV_TTL,
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
    default_max_tokens: int = 16,
    fault_plan: FaultPlan | None = None,
    advertise_host: str | None = None,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one mock worker (``trio-disagg mock-worker``) until shut down or cancelled.

    :func:`create_mock_worker` then :func:`serve_worker`: PROTOCOLS.md section 5.

    Args:
        role: ``"prefill"`` or ``"decode"``.
        protocol: ``"vllm"`` (the only one so far).
        host, port: where to listen; port 0 picks a free one.
        name: the worker's engine id; default ``"{role}@host:port"``.
        model: the only model accepted; None accepts any.
        latency: the latency model (seconds); default ``LatencyModel()``.
        seed: fixes the tokens and prefix-cache hits.
        block_size: tokens per KV block.
        kv_ttl: seconds staged KV waits for its decode before it is stranded.
        kv_bytes_per_token: bytes of KV per prompt token a pull moves.
        default_max_tokens: tokens generated when a request names no budget.
        fault_plan: the worker's own faults, for requests whose body names none.
        advertise_host: the host decode workers pull KV from (see :func:`serve_worker`).
        shutdown_trigger: returns when the worker should stop gracefully.
        task_status: reports the bound TCP port.

    Raises:
        ValueError: an unknown protocol or a bad setting.
        OSError: the address could not be bound.
    """
    app = create_mock_worker(
        role, protocol, name=name, model=model, latency=latency, seed=seed,
        block_size=block_size, kv_ttl=kv_ttl, kv_bytes_per_token=kv_bytes_per_token,
        default_max_tokens=default_max_tokens, fault_plan=fault_plan,
    )
    await serve_worker(app, host=host, port=port, advertise_host=advertise_host,
                       shutdown_trigger=shutdown_trigger, task_status=task_status)
