"""``trio-disagg serve``: the router in one process, or in N on one port (``--workers``)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
from collections.abc import Awaitable, Callable

import trio

from .._health import HealthMonitor, RetryPolicy
from .._http11 import descriptors_left
from .._keeper import TransferKeeper
from .._pool import WorkerPool
from .._router import DisaggRouter
from .._supervisor import MULTIPROC_DIR_ENV, SupervisorError, end_with_supervisor, supervise
from ..engines import bearer, vllm_client
from ..mock import KVCollector, MockCluster
from ..server import REUSE_PORT_SUPPORTED, OpenAIApp, create_app, serve
from ._serve_options import (
    POLICIES,
    api_key_of,
    cancel_windows,
    deadlines_of,
    engines_for,
    models_of,
    worker_api_key_of,
)
from ._signals import SHUTDOWN_SIGNALS, ignoring_signals, run_until_signalled
from ._startup import StartupError, display_address, first_os_error

logger = logging.getLogger("trio_disagg")

#: The cyclic garbage collector's generation-0 threshold ``serve`` sets once it listens
#: (Python's default is 700). Thousands of streams in flight keep ~250 container objects
#: each alive, and at 700 allocations per young collection tokens buffered for a few
#: milliseconds get promoted and trigger full collections of the whole heap: in the P3
#: benchmark (docs/performance.md) those took most of the run. Only cyclic garbage waits
#: longer; objects freed by their reference count are freed at once, as before.
SERVE_GC_THRESHOLD = 50_000


def tune_gc_for_serving() -> None:
    """What ``serve`` does once it listens: move the start-up objects (modules, classes,
    the app) out of the collector's sight with :func:`gc.freeze`, so no full collection
    walks them again, and raise the young threshold to :data:`SERVE_GC_THRESHOLD`."""
    gc.freeze()
    gc.set_threshold(SERVE_GC_THRESHOLD, *gc.get_threshold()[1:])


async def serve_command(args: argparse.Namespace) -> int:
    """Run the router until SIGINT or SIGTERM, then shut down gracefully (B3); a second
    signal stops it at once. Returns the exit code.

    Raises:
        StartupError: bad arguments, or the address could not be bound.
    """
    deadlines = deadlines_of(args)
    policy = POLICIES[args.policy]
    api_key = api_key_of(args)
    worker_key = worker_api_key_of(args)  # each of --workers N reads it again
    client = vllm_client(headers=bearer(worker_key) if worker_key is not None else None)
    prefill, decode, cluster = engines_for(args, client)  # refuses bad arguments first
    windows = cancel_windows(args.cancel_window, [engine.name for engine in prefill])
    if args.disagg_min_prompt_tokens is not None and args.backend == "sglang":
        raise StartupError("--disagg-min-prompt-tokens: an SGLang decode worker in "
                           "disaggregation mode cannot serve a request without its prefill")
    check_max_connections(args.max_connections)
    if args.workers > 1:
        await client.aclose()  # each process makes its own
        return await supervised_serve(args)
    metrics_dir = os.environ.get(MULTIPROC_DIR_ENV) if args.supervised else None
    if args.supervised:
        end_with_supervisor()  # no process left behind by a supervisor killed at once

    async def body(shutdown_trigger: Callable[[], Awaitable[None]]) -> None:
        async with client, TransferKeeper(drain_window=args.drain_window) as keeper:
            router = DisaggRouter(WorkerPool(prefill, policy=policy(), cancel_windows=windows),
                                  WorkerPool(decode, policy=policy()), keeper,
                                  deadlines=deadlines,
                                  retry=RetryPolicy(max_attempts=args.max_attempts),
                                  disagg_min_prompt_tokens=args.disagg_min_prompt_tokens)
            await serve_router(args, router, api_key=api_key, cluster=cluster,
                               shutdown_trigger=shutdown_trigger, metrics_dir=metrics_dir)

    return await run_until_signalled("serve", body)


def check_max_connections(bound: int | None) -> None:
    """Refuse a ``--max-connections`` that leaves no file descriptor for the workers: its
    idle clients could take every one, and then accept() and every connection to a worker
    (health probes included) would fail.

    Raises:
        StartupError: ``bound`` is at least the descriptors the process may still open.
    """
    left, limit = descriptors_left()
    if bound is not None and bound >= left:
        raise StartupError(
            f"--max-connections {bound} leaves no file descriptor for the connections to "
            f"the workers: this process may open {left} more (ulimit -n {limit}); raise "
            f"ulimit -n, or give fewer (default: half of those left)")


async def serve_router(
    args: argparse.Namespace,
    router: DisaggRouter,
    *,
    api_key: str | None,
    cluster: MockCluster | None,
    shutdown_trigger: Callable[[], Awaitable[None]],
    metrics_dir: str | None,
) -> None:
    """Serve ``router`` over HTTP until ``shutdown_trigger`` returns and the drain is over;
    announce the address on stdout once it listens. A shutdown before it listens (during
    the first round of health probes) ends the start-up at once: nothing is announced,
    and the port is never opened.

    Raises:
        StartupError: the app refused an option, or the address could not be bound.
    """
    health = HealthMonitor([*router.prefill.workers, *router.decode.workers],
                           interval=args.health_interval, timeout=args.health_timeout)
    app = router_app(args, router, api_key=api_key, cluster=cluster)
    async with trio.open_nursery() as nursery:
        mirror = trio.CancelScope()
        checking = trio.CancelScope()  # the check of the model names: never past the end
        if metrics_dir:  # one of serve --workers N: /metrics shows them all
            copier = app.metrics.enable_multiprocess(metrics_dir)
            nursery.start_soon(_run_in, mirror, copier.run)

        async def serving(task_status: trio.TaskStatus[int]) -> None:
            try:
                await serve(app, host=args.host, port=args.port,
                            shutdown_trigger=shutdown_trigger,
                            graceful_timeout=args.drain_window, health=health,
                            reuse_port=args.supervised,
                            max_connections=args.max_connections,
                            keep_alive_timeout=args.keep_alive_timeout,
                            task_status=task_status)
            finally:
                mirror.cancel()  # the last copy of the metrics, then it ends
                checking.cancel()

        starting = trio.CancelScope()  # a shutdown before it listens ends the start-up
        nursery.start_soon(_cancel_at, shutdown_trigger, starting)
        port: int | None = None
        with starting:
            try:
                port = await nursery.start(serving)
            except* OSError as group:
                raise StartupError(f"cannot listen on {display_address(args.host, args.port)}"
                                   f": {first_os_error(group)}") from None
        if port is not None:
            tune_gc_for_serving()  # after start-up: see SERVE_GC_THRESHOLD
            _announce(args, router, port)
            nursery.start_soon(_check_models, app, checking)


async def _check_models(app: OpenAIApp, scope: trio.CancelScope | None = None) -> None:
    """Warn of a served name the workers do not list in their ``/v1/models``: vLLM, SGLang
    and TensorRT-LLM refuse a request for it 404 (``--model`` forgotten, or not the
    workers' ``--served-model-name``)."""
    with scope or trio.CancelScope():
        unlisted = await app.model_cards.unlisted()
    if scope is not None and scope.cancelled_caught:
        return
    for role, names in unlisted.items():
        logger.warning("the %s workers do not list %s (--model) in their /v1/models: a "
                       "worker that serves only what it lists refuses requests for %s; "
                       "give --model the names the workers serve", role,
                       ", ".join(map(repr, names)), "it" if len(names) == 1 else "them")


def _announce(args: argparse.Namespace, router: DisaggRouter, port: int) -> None:
    """The line on stdout that says the router listens, and where."""
    pid = f", pid {os.getpid()}" if args.supervised else ""
    names = ", ".join(repr(model) for model in models_of(args))
    print(f"trio-disagg: serving {names} on "
          f"http://{display_address(args.host, port)}/v1 "
          f"({args.backend}: {len(router.prefill)} prefill, "
          f"{len(router.decode)} decode{pid})", flush=True)


async def _cancel_at(trigger: Callable[[], Awaitable[None]], scope: trio.CancelScope) -> None:
    """Cancel ``scope`` (the start-up) once ``trigger`` returns; once it is over, nothing."""
    await trigger()
    scope.cancel()


def router_app(
    args: argparse.Namespace, router: DisaggRouter, *, api_key: str | None,
    cluster: MockCluster | None,
) -> OpenAIApp:
    """The HTTP app over ``router`` with ``serve``'s limits; its ``/metrics`` shows the
    embedded mocks' KV blocks too, if ``cluster`` is theirs.

    Raises:
        StartupError: the app refused an option.
    """
    try:
        app = create_app(
            router, models=models_of(args), max_body_bytes=args.max_body_bytes,
            max_prompt_bytes=args.max_prompt_bytes, max_tokens_limit=args.max_tokens_limit,
            default_max_tokens=min(16, args.max_tokens_limit), api_key=api_key,
            protect_metrics=args.protect_metrics, max_in_flight=args.max_in_flight,
            max_keeper_tasks=args.max_keeper_tasks, fault_injection=args.fault_injection)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    if cluster is not None:  # the embedded mocks' KV blocks (docs/protocols.md section 5)
        app.metrics.add_collector(KVCollector(cluster.counters))
    return app


async def _run_in(scope: trio.CancelScope, fn: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await fn()


async def supervised_serve(args: argparse.Namespace) -> int:
    """``serve --workers N`` (N >= 2): run the command line in N processes on one port
    (:mod:`trio_disagg._supervisor`). Returns the exit code.

    Raises:
        StartupError: no ``SO_REUSEPORT`` here, the address could not be reserved, or a
            process could not be started.
    """
    if not REUSE_PORT_SUPPORTED:
        raise StartupError("--workers needs SO_REUSEPORT, which this platform lacks")
    try:
        with ignoring_signals(SHUTDOWN_SIGNALS):
            return await supervise(args.argv, workers=args.workers, host=args.host,
                                   port=args.port)
    except SupervisorError as exc:
        raise StartupError(str(exc)) from None
    except OSError as exc:
        raise StartupError(f"cannot listen on {display_address(args.host, args.port)}: "
                           f"{exc.strerror or exc}") from None
