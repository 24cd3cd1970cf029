"""Running the app under hypercorn's trio worker, with a graceful shutdown (B3)."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial
from urllib.parse import urlsplit

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from .._health import HealthMonitor
from ._app import ENDING_WINDOW, OpenAIApp

logger = logging.getLogger("trio_disagg.server")

#: Seconds hypercorn waits beyond the app's own shutdown (the graceful window and the
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
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
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
    app: OpenAIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    graceful_timeout: float = 30.0,
    config: Config | None = None,
    health: HealthMonitor | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` over HTTP with hypercorn's trio worker until shut down.

    Run it inside the :class:`~trio_disagg.TransferKeeper` the app's router uses::

        async with TransferKeeper() as keeper:
            router = DisaggRouter(prefill, decode, keeper)
            app = create_app(router, models=["my-model"])
            await serve(app, port=8000, shutdown_trigger=wait_for_sigterm)

    Graceful shutdown (rule B3 in docs/semantics.md): when ``shutdown_trigger`` returns, the
    router is closed (new requests get 503), hypercorn stops listening and closes idle connections,
    requests in flight get up to ``graceful_timeout`` seconds to finish, then the app
    cancels whatever is left (:meth:`OpenAIApp.shutdown`), each request with a clean ending
    (a 503 ``server_shutting_down``, or an error event and ``[DONE]``: B4), and logs how
    many; their prefill legs run on in the keeper. Then :func:`serve` returns. Leaving the
    keeper then gives in-flight transfers its own drain window. Hypercorn's own graceful
    timeout is set a little longer, as a backstop.

    Cancelling :func:`serve` itself is a hard stop.

    Args:
        app: from :func:`create_app`.
        host: the address to listen on; an IPv6 literal is fine.
        port: the TCP port; 0 picks a free one (see ``task_status``).
        shutdown_trigger: an async callable returning when the server should shut down
            gracefully; None serves until cancelled.
        graceful_timeout: seconds in-flight requests get to finish on shutdown.
        config: a hypercorn :class:`~hypercorn.config.Config` for everything else (TLS,
            timeouts, logging); its ``bind`` and ``graceful_timeout`` are overwritten.
        health: probes of the router's workers to run while serving: its first round
            ends before the server listens (so ``GET /health`` is right from the first
            request), and it stops when the server does.
        task_status: with ``nursery.start(serve, ...)``, reports the bound TCP port once
            the server listens.

    Raises:
        OSError: the address could not be bound.
    """
    if not graceful_timeout >= 0 or math.isnan(graceful_timeout):
        raise ValueError(f"graceful_timeout must be >= 0 seconds, got {graceful_timeout}")
    config = config if config is not None else Config()
    config.bind = [_bind(host, port)]
    config.graceful_timeout = graceful_timeout + ENDING_WINDOW + _BACKSTOP
    router = app.router

    trigger: Callable[[], Awaitable[None]] | None = None
    if shutdown_trigger is not None:
        user_trigger = shutdown_trigger

        async def trigger() -> None:
            await user_trigger()
            logger.info(
                "shutting down: closing the router, %d request(s) in flight, "
                "graceful timeout %g s", router.in_flight, graceful_timeout,
            )
            router.close()
            # The app's shutdown runs beside hypercorn's: it ends what is left when the
            # window is over, before hypercorn's longer graceful timeout closes connections.
            nursery.start_soon(app.shutdown, graceful_timeout)

    async with trio.open_nursery() as nursery:
        probes = trio.CancelScope()
        if health is not None:
            await nursery.start(_run_in, probes, health.run)
        binds: list[str] = await nursery.start(
            _then_cancel, probes,
            partial(hypercorn_serve, app, config, shutdown_trigger=trigger),  # type: ignore[arg-type]
        )
        task_status.started(_port_of(binds[0]))
    if shutdown_trigger is not None and router.in_flight:
        logger.warning("server stopped with %d request(s) still in flight", router.in_flight)
