"""The ``trio-disagg`` command: serve, demo, mock-worker."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from functools import partial

import attrs
import httpx
import trio

from ._demo import ADAPTERS, DEMO_BACKENDS, demo_backends, run_demo
from ._engine import Engine, HandoffStyle
from ._keeper import TransferKeeper
from ._pool import LeastOutstanding, RoundRobin, SelectionPolicy, SessionAffinity, WorkerPool
from ._router import Deadlines, DisaggRouter
from .engines import LatencyModel, mock_cluster, vllm_client
from .server import create_app, serve
from .workers import PROTOCOLS, create_mock_worker, serve_worker

POLICIES: dict[str, Callable[[], SelectionPolicy]] = {
    "round-robin": RoundRobin,
    "least-outstanding": LeastOutstanding,
    "session-affinity": SessionAffinity,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-disagg",
        description="Disaggregated (prefill/decode) LLM serving on trio.",
    )
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="default WARNING; ERROR for the demo, whose injected faults "
                             "would otherwise log a warning each")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve_cmd = commands.add_parser(
        "serve", help="run the OpenAI-compatible router",
        description="Run the router. With no --prefill/--decode it runs the embedded "
                    "default: in-process mock prefill and decode engines.")
    serve_cmd.add_argument("--host", default="127.0.0.1")
    serve_cmd.add_argument("--port", type=int, default=8000)
    serve_cmd.add_argument("--backend", default="mock",
                           choices=["mock", "vllm", "sglang", "trtllm"])
    serve_cmd.add_argument("--prefill", action="append", default=[], metavar="URL",
                           help="a prefill worker (repeat for several); for sglang "
                                "URL or URL,BOOTSTRAP_PORT")
    serve_cmd.add_argument("--decode", action="append", default=[], metavar="URL",
                           help="a decode worker (repeat for several)")
    serve_cmd.add_argument("--model", default="trio-disagg-mock",
                           help="the model name clients must ask for")
    serve_cmd.add_argument("--policy", default="least-outstanding", choices=sorted(POLICIES),
                           help="worker selection for both pools")
    serve_cmd.add_argument("--mock-style", default="sequential",
                           choices=["sequential", "bootstrap"],
                           help="handoff style of the embedded mock prefill engines")
    serve_cmd.add_argument("--drain-window", type=float, default=30.0,
                           help="seconds in-flight streams and transfers get on shutdown")
    for name, default in attrs_defaults(Deadlines()).items():
        serve_cmd.add_argument(f"--{name.replace('_', '-')}-deadline", type=float,
                               default=default, dest=f"deadline_{name}",
                               help=f"seconds (default {default:g}; SEMANTICS.md B2)")

    worker_cmd = commands.add_parser(
        "mock-worker", help="run one mock prefill or decode worker over HTTP",
        description="A mock worker speaking a real worker's wire protocol (PROTOCOLS.md "
                    "section 5): KV block accounting with a lease, a real KV pull over "
                    "loopback, abort on connection close, faults from the request body's "
                    "\"fault\" field, and GET /metrics.")
    worker_cmd.add_argument("--role", required=True, choices=["prefill", "decode"])
    worker_cmd.add_argument("--protocol", default="vllm", choices=sorted(PROTOCOLS))
    worker_cmd.add_argument("--host", default="127.0.0.1")
    worker_cmd.add_argument("--port", type=int, default=0, help="0 picks a free port")
    worker_cmd.add_argument("--model", help="the only model accepted (default: any)")
    worker_cmd.add_argument("--seed", type=int, default=0)
    worker_cmd.add_argument("--ttft-per-token", type=float, default=0.0002,
                            help="seconds of prefill compute per prompt token")
    worker_cmd.add_argument("--itl", type=float, default=0.02,
                            help="seconds between decoded tokens")
    worker_cmd.add_argument("--kv-transfer-per-token", type=float, default=0.00002,
                            help="seconds per prompt token to move the KV")
    worker_cmd.add_argument("--kv-ttl", type=float, default=30.0,
                            help="seconds staged KV waits for its decode")
    worker_cmd.add_argument("--bootstrap-port", type=int,
                            help="sglang prefill only: the bootstrap port (default 8998; "
                                 "0 picks a free one)")
    worker_cmd.add_argument("--bootstrap-timeout", type=float, default=300.0,
                            help="sglang only: seconds either side of a bootstrap room "
                                 "waits for the other")

    demo_cmd = commands.add_parser(
        "demo", help="run the whole router on mock workers with a mixed workload",
        description="Start the router on mock workers, drive real OpenAI requests through "
                    "it (client disconnects and injected faults included), print a table "
                    "per scenario, and exit non-zero if an invariant was broken.")
    demo_cmd.add_argument("--requests", type=int, default=200)
    demo_cmd.add_argument("--concurrency", type=int, default=32)
    demo_cmd.add_argument("--seed", type=int, default=0)
    demo_cmd.add_argument("--backend", default="all",
                          choices=["all", *DEMO_BACKENDS])
    return parser


def attrs_defaults(instance: Deadlines) -> dict[str, float]:
    return {field.name: getattr(instance, field.name) for field in attrs.fields(Deadlines)}


async def serve_command(args: argparse.Namespace) -> None:
    """Run the router until SIGINT or SIGTERM, then shut down gracefully (B3)."""
    deadlines = Deadlines(**{name: getattr(args, f"deadline_{name}")
                             for name in attrs_defaults(Deadlines())})
    policy = POLICIES[args.policy]
    client = vllm_client()
    prefill, decode = engines_for(args, client)  # exits on bad arguments, before any nursery
    async with client, TransferKeeper(drain_window=args.drain_window) as keeper:
        router = DisaggRouter(WorkerPool(prefill, policy=policy()),
                              WorkerPool(decode, policy=policy()), keeper, deadlines=deadlines)
        app = create_app(router, models=[args.model])
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

            async def shutdown_trigger() -> None:
                async for signum in signals:
                    logging.getLogger("trio_disagg").warning(
                        "%s: shutting down gracefully", signal.Signals(signum).name)
                    return

            async with trio.open_nursery() as nursery:
                port = await nursery.start(partial(
                    serve, app, host=args.host, port=args.port,
                    shutdown_trigger=shutdown_trigger, graceful_timeout=args.drain_window))
                print(f"trio-disagg: serving {args.model!r} on http://{args.host}:{port}/v1 "
                      f"({args.backend}: {len(prefill)} prefill, {len(decode)} decode)",
                      flush=True)


def engines_for(
    args: argparse.Namespace, client: httpx.AsyncClient
) -> tuple[list[Engine], list[Engine]]:
    """The engines ``serve`` routes to: in-process mocks, or adapters over HTTP."""
    if args.backend == "mock":
        if args.prefill or args.decode:
            raise SystemExit("--prefill/--decode need --backend vllm, sglang or trtllm")
        style = HandoffStyle(args.mock_style)
        cluster = mock_cluster(1, 1, style=style, latency=LatencyModel())
        return list(cluster.prefill), list(cluster.decode)
    if not args.prefill or not args.decode:
        raise SystemExit(f"--backend {args.backend} needs at least one --prefill and --decode")
    adapter = ADAPTERS.get(args.backend)
    if adapter is None:
        raise SystemExit(f"--backend {args.backend} is not available yet")
    try:
        prefill, decode = adapter(args.prefill, args.decode, client=client)
    except ValueError as exc:
        raise SystemExit(f"trio-disagg serve: {exc}") from None
    return list(prefill), list(decode)


async def mock_worker_command(args: argparse.Namespace) -> None:
    """Run one mock worker until SIGINT or SIGTERM."""
    latency = LatencyModel(ttft_per_prompt_token=args.ttft_per_token,
                           inter_token_latency=args.itl,
                           kv_transfer_per_token=args.kv_transfer_per_token)
    sglang_prefill = (args.protocol, args.role) == ("sglang", "prefill")
    if args.bootstrap_port is not None and not sglang_prefill:
        raise SystemExit("--bootstrap-port is for --protocol sglang --role prefill only")
    if sglang_prefill and args.bootstrap_port is None:
        args.bootstrap_port = 8998  # SGLang's default
    try:
        app = create_mock_worker(
            args.role, args.protocol, model=args.model, latency=latency, seed=args.seed,
            kv_ttl=args.kv_ttl, bootstrap_port=args.bootstrap_port,
            bootstrap_timeout=args.bootstrap_timeout)
    except ValueError as exc:
        raise SystemExit(f"trio-disagg mock-worker: {exc}") from None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

        async def shutdown_trigger() -> None:
            async for _ in signals:
                return

        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(
                serve_worker, app, host=args.host, port=args.port,
                shutdown_trigger=shutdown_trigger))
            bootstrap = getattr(app, "bootstrap_port", None)
            extra = f", bootstrap port {bootstrap}" if bootstrap is not None else ""
            print(f"trio-disagg: mock {args.protocol} {args.role} worker on "
                  f"http://{args.host}:{port}{extra}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = args.log_level or ("ERROR" if args.command == "demo" else "WARNING")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        trio.run(serve_command, args)
        return 0
    if args.command == "mock-worker":
        trio.run(mock_worker_command, args)
        return 0
    if args.command == "demo":
        names = DEMO_BACKENDS if args.backend == "all" else (args.backend,)
        backends = demo_backends(names, args.seed)
        return trio.run(partial(run_demo, backends, requests=args.requests,
                                concurrency=args.concurrency, seed=args.seed))
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
