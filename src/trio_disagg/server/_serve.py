"""Running the app, on the project's HTTP/1.1 server (or hypercorn's trio worker, given a
hypercorn config), with a graceful shutdown (B3)."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import trio

from .._health import HealthMonitor
from .._http11 import KEEP_ALIVE_TIMEOUT, serve_http
from ._app import OpenAIApp
from ._responder import ENDING_WINDOW

if TYPE_CHECKING:
    from hypercorn.config import Config

logger = logging.getLogger("trio_disagg.server")

#: Seconds the server waits beyond the app's own shutdown (the graceful window and the
#: ending window) before it cancels what is left and closes the connections: a backstop.
_BACKSTOP = 1.0


async def wait_for_signals(*signums: int) -> int:
    """Return once one of ``signums`` arrives (for :func:`serve`'s ``shutdown_trigger``).

    The handlers are installed when this is first awaited and removed when it returns;
    meanwhile, for instance, SIGINT no longer raises :exc:`KeyboardInterrupt`. Call it from
    the main thread::

        trigger = partial(wait_for_signals, signal.SIGTERM, signal.SIGINT)
        await serve(app, shutdown_trigger=trigger)

    Returns:
        The signal number that arrived.

    Raises:
        ValueError: no signal given (or the caller is not in the main thread).
    """
    if not signums:
        raise ValueError("wait_for_signals needs at least one signal number")
    with trio.open_signal_receiver(*signums) as receiver:
        async for signum in receiver:
            logger.info("received signal %d", signum)
            return signum
    raise AssertionError("unreachable: a signal receiver never ends")  # pragma: no cover


async def _run_in(  # noqa: ASYNC128 (fn reports started())
    scope: trio.CancelScope,
    fn: Callable[..., Awaitable[object]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await fn(task_status=task_status)


async def _then_cancel(  # noqa: ASYNC128 (fn reports started())
    scope: trio.CancelScope,
    fn: Callable[..., Awaitable[object]],
    *,
    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``fn`` (the server), then cancel ``scope`` (the health probes), however it
    ends."""
    try:
        await fn(task_status=task_status)
    finally:
        scope.cancel()


def _bind(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"  # IPv6
    return f"{host}:{port}"


def _port_of(bind: str) -> int:
    port = urlsplit(bind).port
    if port is None:
        raise RuntimeError(f"hypercorn reported a bind without a port: {bind!r}")
    return port


async def serve(
    app: OpenAIApp, *, host: str = "127.0.0.1", port: int = 8000,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    graceful_timeout: float = 30.0, config: Config | None = None,
    health: HealthMonitor | None = None, reuse_port: bool = False,
    max_connections: int | None = None, keep_alive_timeout: float | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` over HTTP/1.1 until shut down.

    The server is the project's own (trio sockets and the httptools parser, built for the
    relay's per-token cost, docs/performance.md); with a hypercorn ``config``, hypercorn's
    trio worker (TLS, HTTP/2). Run it in the :class:`~trio_disagg.TransferKeeper` the
    app's router uses::

        async with TransferKeeper() as keeper:
            router = DisaggRouter(prefill, decode, keeper)
            app = create_app(router, models=["my-model"])
            await serve(app, shutdown_trigger=partial(wait_for_signals, signal.SIGTERM))

    Graceful shutdown (B3, docs/router.md): once ``shutdown_trigger`` returns, the router
    closes (new requests get 503), the server stops listening, requests in flight get
    ``graceful_timeout`` seconds, then the app cancels the rest, each with a clean ending
    (B4; their prefill legs run on in the keeper). Cancelling it is a hard stop.

    Args:
        app: from :func:`create_app`.
        host: the address to listen on; an IPv6 literal is fine.
        port: the TCP port; 0 picks a free one (see ``task_status``).
        shutdown_trigger: returns when the server should shut down; None: never.
        graceful_timeout: seconds in-flight requests get to finish on shutdown.
        config: a hypercorn ``Config`` to serve with (its ``bind`` and
            ``graceful_timeout`` overwritten).
        health: probes of the router's workers, run while the server runs; their first
            round ends before it listens (``GET /health`` is right from the start).
        reuse_port: share the port (``SO_REUSEPORT``: ``serve --workers N``); not with
            ``config``.
        max_connections: client connections open at once (past it the one idle the
            longest makes room); None: half the file descriptors left. Not with ``config``.
        keep_alive_timeout: seconds an idle client connection is kept; None: 5 (with
            ``config``, its own). Above a load balancer's own idle timeout (60 s for AWS
            ALB), or it may answer some requests 502 (docs/deploy.md).
        task_status: with ``nursery.start(serve, ...)``: the bound TCP port, once listening.

    Raises:
        OSError: the address could not be bound (or ``reuse_port`` without SO_REUSEPORT).
        ValueError: a negative ``graceful_timeout``, ``max_connections`` < 1, a
            ``keep_alive_timeout`` <= 0, or ``reuse_port`` or ``max_connections`` with
            ``config``.
    """
    own = _listening(graceful_timeout, reuse_port, max_connections, keep_alive_timeout, config)
    async with trio.open_nursery() as nursery:
        trigger = None if shutdown_trigger is None else partial(
            _shut_down, app, shutdown_trigger, graceful_timeout, nursery)
        bound = await _start_server(nursery, health, app, host, port, trigger,
                                    graceful_timeout + ENDING_WINDOW + _BACKSTOP,
                                    own, config)
        task_status.started(bound)
    if shutdown_trigger is not None and app.router.in_flight:
        logger.warning("server stopped with %d request(s) in flight", app.router.in_flight)


def _listening(graceful_timeout: float, reuse_port: bool, max_connections: int | None,
               keep_alive_timeout: float | None, config: Config | None) -> dict[str, Any]:
    """The project's server's own arguments of :func:`serve`, checked (a hypercorn
    ``config`` takes ``keep_alive_timeout``)."""
    if reuse_port and config is not None:
        raise ValueError("reuse_port needs the project's server, not a hypercorn config")
    if max_connections is not None and config is not None:
        raise ValueError("max_connections needs the project's server, not a hypercorn config")
    if max_connections is not None and not max_connections >= 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    if not graceful_timeout >= 0 or math.isnan(graceful_timeout):
        raise ValueError(f"graceful_timeout must be >= 0 seconds, got {graceful_timeout}")
    if keep_alive_timeout is not None and not keep_alive_timeout > 0:
        raise ValueError(f"keep_alive_timeout must be > 0 seconds, got {keep_alive_timeout}")
    if keep_alive_timeout is not None and config is not None:
        config.keep_alive_timeout = keep_alive_timeout
    return {"reuse_port": reuse_port, "max_connections": max_connections,
            "keep_alive_timeout": keep_alive_timeout or KEEP_ALIVE_TIMEOUT}


async def _shut_down(app: OpenAIApp, user_trigger: Callable[[], Awaitable[object]],
                     graceful_timeout: float, nursery: trio.Nursery) -> None:
    """The server's shutdown trigger: once ``user_trigger`` returns, close the router and
    start the app's shutdown beside the server's."""
    await user_trigger()
    router = app.router
    logger.info(
        "shutting down: closing the router, %d request(s) in flight, "
        "graceful timeout %g s", router.in_flight, graceful_timeout,
    )
    router.close()
    # The app's shutdown runs beside the server's: it ends what is left when the
    # window is over, before the server's longer backstop closes connections.
    nursery.start_soon(app.shutdown, graceful_timeout)


async def _start_server(
    nursery: trio.Nursery, health: HealthMonitor | None, app: OpenAIApp, host: str,
    port: int, trigger: Callable[[], Awaitable[None]] | None, backstop: float,
    listening: dict[str, Any], config: Config | None,
) -> int:
    """Start ``health``'s probes, then the server, in ``nursery`` (the probes end with the
    server); its port. ``listening``: the project's server's own arguments."""
    probes = trio.CancelScope()
    if health is not None:
        await nursery.start(_run_in, probes, health.run)
    if config is None:
        bound: int = await nursery.start(_then_cancel, probes, partial(
            serve_http, app, host=host, port=port, shutdown_trigger=trigger,
            shutdown_timeout=backstop, **listening))
        return bound
    from hypercorn.trio import serve as hypercorn_serve

    config.bind = [_bind(host, port)]
    config.graceful_timeout = backstop
    binds: list[str] = await nursery.start(
        _then_cancel, probes,
        partial(hypercorn_serve, app, config, shutdown_trigger=trigger),  # type: ignore[arg-type]
    )
    return _port_of(binds[0])
