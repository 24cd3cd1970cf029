"""The ``trio-disagg`` command: serve, demo, mock-worker."""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import logging
import math
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import cast

import attrs
import trio

from ._adapters import ADAPTERS, DEMO_BACKENDS
from ._engine import CancelWindow, Engine, HandoffStyle
from ._health import HealthMonitor, RetryPolicy
from ._keeper import TransferKeeper
from ._pool import (
    LeastOutstanding,
    PrefixAffinity,
    RoundRobin,
    SelectionPolicy,
    SessionAffinity,
    WorkerPool,
)
from ._router import Deadlines, DisaggRouter
from ._supervisor import MULTIPROC_DIR_ENV, SUPERVISED_FLAG, supervise
from .engines import Client, vllm_client
from .mock import (
    PROTOCOLS,
    KVCollector,
    LatencyModel,
    MockCluster,
    create_mock_worker,
    mock_cluster,
    serve_worker,
)
from .server import REUSE_PORT_SUPPORTED, create_app, serve

POLICIES: dict[str, Callable[[], SelectionPolicy]] = {
    "round-robin": RoundRobin,
    "least-outstanding": LeastOutstanding,
    "session-affinity": SessionAffinity,
    "prefix-affinity": PrefixAffinity,
}

#: The exit code of a command that could not start (argparse's).
EXIT_STARTUP = 2
#: The environment variable ``serve`` reads its API key from when ``--api-key`` is not
#: given: a key there stays out of process listings.
API_KEY_ENV = "TRIO_DISAGG_API_KEY"
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
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


logger = logging.getLogger("trio_disagg")


class StartupError(Exception):
    """A command could not start: one line on stderr, exit code 2 (:data:`EXIT_STARTUP`)."""


# --- argument types: bad values are refused before anything starts ----------------------


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (0 picks a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be 0 to 65535, got {value}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"seconds must be a finite number, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A finite, non-negative number of seconds."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"seconds must be >= 0, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds, > 0 (a deadline, a lease)."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"seconds must be > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1 (a request count, a concurrency)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def limit(text: str) -> int | None:
    """A whole number >= 0, where 0 is no limit (None)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: no limit), got {value}")
    return value or None


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(group: BaseExceptionGroup[OSError]) -> str:
    exc = group.exceptions[0]
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc.strerror or str(exc)


# --- signals: the first one shuts down gracefully, a second one at once -------------------


@contextmanager
def _ignoring(signums: Sequence[int]) -> Iterator[None]:
    """Ignore ``signums`` in this block: a signal the receiver inside had not consumed when
    it closed is re-delivered to this (ignoring) handler, not to Python's default ones."""
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


async def run_until_signalled(
    command: str, body: Callable[[Callable[[], Awaitable[None]]], Awaitable[None]]
) -> int:
    """Run ``body(shutdown_trigger)`` with SIGINT and SIGTERM handled for its whole life.

    The first signal makes ``shutdown_trigger`` return: a graceful shutdown, exit code 0
    once ``body`` returned. A second one cancels ``body`` at once (a forced shutdown):
    one line on stderr, exit code 128 + the signal number (130 for SIGINT, 143 for
    SIGTERM). The signals are consumed until ``body`` has returned, so Python's default
    handlers (KeyboardInterrupt, death by SIGTERM) never fire meanwhile.

    Returns:
        The exit code.
    """
    graceful = trio.Event()
    forced: list[int] = []
    with _ignoring(SHUTDOWN_SIGNALS), trio.open_signal_receiver(*SHUTDOWN_SIGNALS) as signals:
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as body_scope:

                async def watch() -> None:
                    async for signum in signals:
                        name = signal.Signals(signum).name
                        if not graceful.is_set():
                            logger.warning("%s: shutting down gracefully (send it again to "
                                           "stop at once)", name)
                            graceful.set()
                        elif not forced:
                            forced.append(signum)
                            body_scope.cancel()

                nursery.start_soon(watch)
                await body(graceful.wait)
            nursery.cancel_scope.cancel()  # stop watching: the body is over
    if forced:
        name = signal.Signals(forced[0]).name
        print(f"trio-disagg {command}: {name} again: stopped at once, requests in flight "
              "were cancelled", file=sys.stderr, flush=True)
        return 128 + forced[0]
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-disagg",
        description="Disaggregated (prefill/decode) LLM serving on trio.",
    )
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="default WARNING; ERROR for the demo, whose injected faults "
                             "would otherwise log a warning each")
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {importlib.metadata.version('trio-disagg')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve_cmd = commands.add_parser(
        "serve", help="run the OpenAI-compatible router", formatter_class=DefaultsFormatter,
        description="Run the router. With no --prefill/--decode it runs the embedded "
                    "default: in-process mock prefill and decode engines. "
                    "docs/router.md, 'Securing and limiting the router', explains the "
                    "limits, the API key and fault injection.")
    serve_cmd.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve_cmd.add_argument("--port", type=port_number, default=8000,
                           help="the TCP port; 0 picks a free one")
    serve_cmd.add_argument("--backend", default="mock",
                           choices=["mock", "vllm", "sglang", "trtllm"],
                           help="the workers' protocol; mock: in-process mock engines")
    serve_cmd.add_argument("--prefill", action="append", default=[], metavar="URL",
                           help="a prefill worker, http(s)://host[:port] (repeat for "
                                "several); for sglang URL or URL,BOOTSTRAP_PORT (default: "
                                "none; required with --backend vllm, sglang or trtllm)")
    serve_cmd.add_argument("--decode", action="append", default=[], metavar="URL",
                           help="a decode worker (repeat for several) (default: none; "
                                "required with --backend vllm, sglang or trtllm)")
    serve_cmd.add_argument("--model", default="trio-disagg-mock",
                           help="the model name clients must ask for")
    serve_cmd.add_argument("--policy", default="least-outstanding", choices=sorted(POLICIES),
                           help="worker selection for both pools")
    serve_cmd.add_argument("--mock-style", default="sequential",
                           choices=["sequential", "bootstrap"],
                           help="handoff style of the embedded mock prefill engines")
    serve_cmd.add_argument(
        "--cancel-window", action="append", default=[], metavar="[WORKER=]WINDOW",
        help="when a prefill may be cancelled after its client left: never, "
             "before_handoff or anytime (B10); WORKER is a --prefill URL, else every "
             "prefill worker (default: what each engine declares: vLLM anytime, SGLang "
             "and TensorRT-LLM before_handoff, the embedded mocks never)")
    serve_cmd.add_argument("--disagg-min-prompt-tokens", type=limit, default="0", metavar="N",
                           help="a prompt estimated shorter than N tokens (UTF-8 bytes / 4; "
                                "token ids exactly) goes to one decode worker alone, with no "
                                "prefill and no KV transfer (0: every request is "
                                "disaggregated; not with --backend sglang)")
    serve_cmd.add_argument("--workers", type=positive_int, default=1, metavar="N",
                           help="router processes sharing the port (SO_REUSEPORT; Linux "
                                "spreads connections over them); /metrics shows all of them "
                                "(docs/deploy.md)")
    serve_cmd.add_argument(SUPERVISED_FLAG, action="store_true", help=argparse.SUPPRESS)
    serve_cmd.add_argument("--drain-window", type=seconds, default=30.0, metavar="SECONDS",
                           help="seconds in-flight streams and transfers get on shutdown")
    serve_cmd.add_argument("--health-interval", type=positive_seconds, default=5.0,
                           help="seconds between two probes of each worker's GET /health "
                                "(default 5; the embedded mocks are not probed)")
    serve_cmd.add_argument("--health-timeout", type=positive_seconds, default=2.0,
                           help="seconds a health probe may take (default 2)")
    serve_cmd.add_argument("--max-attempts", type=positive_int, default=2,
                           help="attempts per leg, on another worker each, for a leg that "
                                "failed before the first byte (default 2; 1: no retry; "
                                "rule B9 in docs/semantics.md)")
    for name, default in attrs_defaults(Deadlines()).items():
        serve_cmd.add_argument(f"--{name.replace('_', '-')}-deadline", type=positive_seconds,
                               default=default, dest=f"deadline_{name}", metavar="SECONDS",
                               help=f"seconds (default: {default:g}; rule B2 in "
                                    "docs/semantics.md)")
    limits = serve_cmd.add_argument_group(
        "limits and security", "Checked before any worker is called (docs/router.md, "
        "'Securing and limiting the router').")
    limits.add_argument("--api-key", metavar="KEY",
                        help=f"every /v1/* request must send 'Authorization: Bearer KEY', "
                             f"else 401 (default: ${API_KEY_ENV} if set, else no key; "
                             f"prefer the variable: it stays out of process listings)")
    limits.add_argument("--protect-metrics", action="store_true",
                        help="with an API key, /health and /metrics need it too")
    limits.add_argument("--max-body-bytes", type=positive_int, default=2 * 1024 * 1024,
                        metavar="BYTES", help="the largest request body; larger: 413")
    limits.add_argument("--max-prompt-bytes", type=positive_int, default=1024 * 1024,
                        metavar="BYTES",
                        help="the largest prompt (a chat's messages, a completion's prompt, "
                             "as JSON); larger: 400 prompt_too_long")
    limits.add_argument("--max-in-flight", type=limit, default=1024, metavar="N",
                        help="generation requests handled at once; past it: 503 with "
                             "Retry-After at once (0: no limit)")
    limits.add_argument("--max-keeper-tasks", type=limit, default=4096, metavar="N",
                        help="KV transfers and cleanups in flight (prefill drains, decode "
                             "legs kept for a transfer, cleanup decodes) at which new "
                             "requests get 503; a transfer already started always runs "
                             "(0: no limit)")
    limits.add_argument("--fault-injection", action="store_true",
                        help="pass a client's \"fault\" body field on to the workers "
                             "(testing only; else it is removed from every request)")

    worker_cmd = commands.add_parser(
        "mock-worker", help="run one mock prefill or decode worker over HTTP",
        description="A mock worker speaking a real worker's wire protocol (docs/protocols.md "
                    "section 5): KV block accounting with a lease, a real KV pull over "
                    "loopback, abort on connection close, faults from the request body's "
                    "\"fault\" field (with --fault-injection), and GET /metrics.")
    worker_cmd.add_argument("--role", required=True, choices=["prefill", "decode"])
    worker_cmd.add_argument("--protocol", default="vllm", choices=sorted(PROTOCOLS))
    worker_cmd.add_argument("--host", default="127.0.0.1")
    worker_cmd.add_argument("--port", type=port_number, default=0, help="0 picks a free port")
    worker_cmd.add_argument("--model", help="the only model accepted (default: any)")
    worker_cmd.add_argument("--seed", type=int, default=0)
    worker_cmd.add_argument("--ttft-per-token", type=seconds, default=0.0002,
                            help="seconds of prefill compute per prompt token")
    worker_cmd.add_argument("--itl", type=seconds, default=0.02,
                            help="seconds between decoded tokens")
    worker_cmd.add_argument("--kv-transfer-per-token", type=seconds, default=0.00002,
                            help="seconds per prompt token to move the KV")
    worker_cmd.add_argument("--kv-ttl", type=positive_seconds, default=30.0,
                            help="seconds staged KV waits for its decode")
    worker_cmd.add_argument("--bootstrap-port", type=port_number,
                            help="sglang prefill only: the bootstrap port (default 8998; "
                                 "0 picks a free one)")
    worker_cmd.add_argument("--bootstrap-timeout", type=positive_seconds, default=300.0,
                            help="sglang only: seconds either side of a bootstrap room "
                                 "waits for the other")
    worker_cmd.add_argument("--fault-injection", action="store_true",
                            help="honour a request body's \"fault\" field (a test tool; "
                                 "default: the field is ignored)")

    demo_cmd = commands.add_parser(
        "demo", help="run the whole router on mock workers with a mixed workload",
        description="Start the router on mock workers, drive real OpenAI requests through "
                    "it (client disconnects and injected faults included), print a table "
                    "per scenario, and exit non-zero if an invariant was broken.")
    demo_cmd.add_argument("--requests", type=positive_int, default=200,
                          help="requests per backend (at least one per scenario)")
    demo_cmd.add_argument("--concurrency", type=positive_int, default=32,
                          help="clients sending at once")
    demo_cmd.add_argument("--seed", type=int, default=0)
    demo_cmd.add_argument("--backend", default="all",
                          choices=["all", *DEMO_BACKENDS])
    return parser


def attrs_defaults(instance: Deadlines) -> dict[str, float]:
    return {field.name: getattr(instance, field.name) for field in attrs.fields(Deadlines)}


async def serve_command(args: argparse.Namespace) -> int:
    """Run the router until SIGINT or SIGTERM, then shut down gracefully (B3); a second
    signal stops it at once. Returns the exit code.

    Raises:
        StartupError: bad arguments, or the address could not be bound.
    """
    deadlines = Deadlines(**{name: getattr(args, f"deadline_{name}")
                             for name in attrs_defaults(Deadlines())})
    policy = POLICIES[args.policy]
    api_key = api_key_of(args)
    client = vllm_client()
    prefill, decode, cluster = engines_for(args, client)  # refuses bad arguments first
    windows = cancel_windows(args.cancel_window, [engine.name for engine in prefill])
    if args.disagg_min_prompt_tokens is not None and args.backend == "sglang":
        raise StartupError("--disagg-min-prompt-tokens: an SGLang decode worker in "
                           "disaggregation mode cannot serve a request without its prefill")
    if args.workers > 1:
        await client.aclose()  # each process makes its own
        return await supervised_serve(args)
    metrics_dir = os.environ.get(MULTIPROC_DIR_ENV) if args.supervised else None

    async def body(shutdown_trigger: Callable[[], Awaitable[None]]) -> None:
        async with client, TransferKeeper(drain_window=args.drain_window) as keeper:
            router = DisaggRouter(WorkerPool(prefill, policy=policy(), cancel_windows=windows),
                                  WorkerPool(decode, policy=policy()), keeper,
                                  deadlines=deadlines,
                                  retry=RetryPolicy(max_attempts=args.max_attempts),
                                  disagg_min_prompt_tokens=args.disagg_min_prompt_tokens)
            health = HealthMonitor([*router.prefill.workers, *router.decode.workers],
                                   interval=args.health_interval, timeout=args.health_timeout)
            try:
                app = create_app(
                    router, models=[args.model], max_body_bytes=args.max_body_bytes,
                    max_prompt_bytes=args.max_prompt_bytes, api_key=api_key,
                    protect_metrics=args.protect_metrics, max_in_flight=args.max_in_flight,
                    max_keeper_tasks=args.max_keeper_tasks,
                    fault_injection=args.fault_injection)
            except ValueError as exc:
                raise StartupError(str(exc)) from None
            if cluster is not None:  # the embedded mocks' KV blocks (docs/protocols.md section 5)
                app.metrics.add_collector(KVCollector(cluster.counters))
            async with trio.open_nursery() as nursery:
                mirror = trio.CancelScope()
                if metrics_dir:  # one of serve --workers N: /metrics shows them all
                    copier = app.metrics.enable_multiprocess(metrics_dir)
                    nursery.start_soon(_run_in, mirror, copier.run)

                async def serving(task_status: trio.TaskStatus[int]) -> None:
                    try:
                        await serve(app, host=args.host, port=args.port,
                                    shutdown_trigger=shutdown_trigger,
                                    graceful_timeout=args.drain_window, health=health,
                                    reuse_port=args.supervised, task_status=task_status)
                    finally:
                        mirror.cancel()  # the last copy of the metrics, then it ends

                try:
                    port = await nursery.start(serving)
                except* OSError as group:
                    raise StartupError(f"cannot listen on {_address(args.host, args.port)}: "
                                       f"{_reason(group)}") from None
                tune_gc_for_serving()  # after start-up: see SERVE_GC_THRESHOLD
                pid = f", pid {os.getpid()}" if args.supervised else ""
                print(f"trio-disagg: serving {args.model!r} on "
                      f"http://{_address(args.host, port)}/v1 "
                      f"({args.backend}: {len(prefill)} prefill, {len(decode)} decode{pid})",
                      flush=True)

    return await run_until_signalled("serve", body)


async def _run_in(scope: trio.CancelScope, fn: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await fn()


async def supervised_serve(args: argparse.Namespace) -> int:
    """``serve --workers N`` (N >= 2): run the command line in N processes on one port
    (:mod:`trio_disagg._supervisor`). Returns the exit code.

    Raises:
        StartupError: no ``SO_REUSEPORT`` here, or the address could not be reserved.
    """
    if not REUSE_PORT_SUPPORTED:
        raise StartupError("--workers needs SO_REUSEPORT, which this platform lacks")
    try:
        with _ignoring(SHUTDOWN_SIGNALS):
            return await supervise(args.argv, workers=args.workers, host=args.host,
                                   port=args.port)
    except OSError as exc:
        raise StartupError(f"cannot listen on {_address(args.host, args.port)}: "
                           f"{exc.strerror or exc}") from None


def api_key_of(args: argparse.Namespace) -> str | None:
    """``--api-key``, else :data:`API_KEY_ENV`, else None (no key).

    Raises:
        StartupError: the key given is empty or blank (an unset variable expanded to
            nothing must not silently turn authentication off).
    """
    key: str | None = args.api_key
    where = "--api-key"
    if key is None:
        key = os.environ.get(API_KEY_ENV)
        where = API_KEY_ENV
    if key is not None and not key.strip():
        raise StartupError(f"{where} is empty; give a key, or unset it to serve without one")
    if args.protect_metrics and key is None:
        raise StartupError(f"--protect-metrics needs an API key (--api-key or {API_KEY_ENV})")
    return key


def cancel_windows(specs: Sequence[str], workers: Sequence[str]) -> dict[str, CancelWindow]:
    """``--cancel-window`` values as a window per prefill worker name: a worker's own
    value wins over the one for every worker.

    Raises:
        StartupError: an unknown window, a worker that is not a prefill worker, an empty
            worker name, or two different windows for the same worker (or for all).
    """
    windows: dict[str, CancelWindow] = {}
    every: CancelWindow | None = None
    for spec in specs:
        worker, equals, name = spec.rpartition("=")
        try:
            window = CancelWindow(name)
        except ValueError:
            raise StartupError(f"--cancel-window {spec!r}: the window must be one of "
                               f"{', '.join(w.value for w in CancelWindow)}") from None
        if equals and not worker:
            raise StartupError(f"--cancel-window {spec!r}: name the worker before '=', "
                               "or give the window alone for every prefill worker")
        if not worker:
            if every is not None and every is not window:
                raise StartupError(f"--cancel-window given twice for every prefill worker: "
                                   f"{every.value} and {window.value}")
            every = window
            continue
        target = worker.split(",")[0].rstrip("/")  # an SGLang spec's bootstrap port too
        if target not in workers:
            raise StartupError(f"--cancel-window {spec!r}: {target!r} is not a "
                               f"prefill worker ({', '.join(workers)})")
        if windows.get(target, window) is not window:
            raise StartupError(f"--cancel-window given twice for {target}: "
                               f"{windows[target].value} and {window.value}")
        windows[target] = window
    if every is not None:
        windows = {worker: windows.get(worker, every) for worker in workers}
    return windows


def engines_for(
    args: argparse.Namespace, client: Client
) -> tuple[list[Engine], list[Engine], MockCluster | None]:
    """The engines ``serve`` routes to: in-process mocks (and their cluster, whose KV
    counters ``/metrics`` then shows), or adapters over HTTP."""
    if args.backend == "mock":
        if args.prefill or args.decode:
            raise StartupError("--prefill/--decode need --backend vllm, sglang or trtllm")
        style = HandoffStyle(args.mock_style)
        cluster = mock_cluster(1, 1, style=style, latency=LatencyModel())
        return list(cluster.prefill), list(cluster.decode), cluster
    if not args.prefill or not args.decode:
        raise StartupError(f"--backend {args.backend} needs at least one --prefill and "
                           "--decode")
    adapter = ADAPTERS.get(args.backend)
    if adapter is None:
        raise StartupError(f"--backend {args.backend} is not available yet")
    try:
        prefill, decode = adapter(args.prefill, args.decode, client=client)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return list(prefill), list(decode), None


async def mock_worker_command(args: argparse.Namespace) -> int:
    """Run one mock worker until SIGINT or SIGTERM; a second signal stops it at once.
    Returns the exit code.

    Raises:
        StartupError: bad arguments, or the address could not be bound.
    """
    latency = LatencyModel(ttft_per_prompt_token=args.ttft_per_token,
                           inter_token_latency=args.itl,
                           kv_transfer_per_token=args.kv_transfer_per_token)
    sglang_prefill = (args.protocol, args.role) == ("sglang", "prefill")
    if args.bootstrap_port is not None and not sglang_prefill:
        raise StartupError("--bootstrap-port is for --protocol sglang --role prefill only")
    if sglang_prefill and args.bootstrap_port is None:
        args.bootstrap_port = 8998  # SGLang's default
    try:
        app = create_mock_worker(
            args.role, args.protocol, model=args.model, latency=latency, seed=args.seed,
            kv_ttl=args.kv_ttl, bootstrap_port=args.bootstrap_port,
            bootstrap_timeout=args.bootstrap_timeout, fault_injection=args.fault_injection)
    except ValueError as exc:
        raise StartupError(str(exc)) from None

    async def body(shutdown_trigger: Callable[[], Awaitable[None]]) -> None:
        async with trio.open_nursery() as nursery:
            try:
                port = await nursery.start(partial(
                    serve_worker, app, host=args.host, port=args.port,
                    shutdown_trigger=shutdown_trigger))
            except* OSError as group:
                where = _address(args.host, args.port)
                if args.bootstrap_port is not None:
                    where += f" (bootstrap port {args.bootstrap_port})"
                raise StartupError(f"cannot listen on {where}: {_reason(group)}") from None
            bootstrap = getattr(app, "bootstrap_port", None)
            extra = f", bootstrap port {bootstrap}" if bootstrap is not None else ""
            print(f"trio-disagg: mock {args.protocol} {args.role} worker on "
                  f"http://{_address(args.host, port)}{extra}", flush=True)

    return await run_until_signalled("mock-worker", body)


def run_command(
    command: str, main: Callable[[argparse.Namespace], Awaitable[int]], args: argparse.Namespace
) -> int:
    """Run a long-running command; a :class:`StartupError` becomes one line on stderr and
    exit code 2, however deep in exception groups it is."""
    failure: StartupError | None = None
    try:
        return trio.run(main, args)
    except* StartupError as group:
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        failure = cast(StartupError, leaf)
    print(f"trio-disagg {command}: error: {failure}", file=sys.stderr, flush=True)
    return EXIT_STARTUP


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # serve --workers runs it again
    level = args.log_level or ("ERROR" if args.command == "demo" else "WARNING")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # hypercorn prints its own lines with its own handler: not a second time through ours.
    logging.getLogger("hypercorn").propagate = False
    if args.command == "serve":
        return run_command("serve", serve_command, args)
    if args.command == "mock-worker":
        return run_command("mock-worker", mock_worker_command, args)
    if args.command == "demo":
        from ._demo import demo_backends, run_demo  # the demo extra: the openai client

        names = DEMO_BACKENDS if args.backend == "all" else (args.backend,)
        backends = demo_backends(names, args.seed)
        return trio.run(partial(run_demo, backends, requests=args.requests,
                                concurrency=args.concurrency, seed=args.seed))
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
