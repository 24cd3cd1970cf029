"""The command line: ``trio-disagg [--log-level L] COMMAND``, one function per command's
options (and per group of ``serve``'s)."""

from __future__ import annotations

import argparse
import importlib.metadata
from typing import TypeAlias

from .._adapters import BACKENDS, DEMO_BACKENDS
from .._extras import install_hint, missing
from .._supervisor import SUPERVISED_FLAG
from ._arg_types import (
    DefaultsFormatter,
    limit,
    listen_host,
    model_name,
    port_number,
    positive_int,
    positive_seconds,
    process_count,
    seconds,
)
from ._serve_options import (
    API_KEY_ENV,
    DEFAULT_MODEL,
    POLICIES,
    WORKER_API_KEY_ENV,
    deadline_defaults,
)

#: What ``add_subparsers`` returns: where each command adds its parser.
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class PrefillSpec(argparse.Action):
    """``--prefill URL``, ``--prefill URL,BOOTSTRAP_PORT`` or, as SGLang's router takes
    it, ``--prefill URL BOOTSTRAP_PORT``: appended as one spec, ``URL[,BOOTSTRAP_PORT]``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        words = [str(word) for word in values] if isinstance(values, list) else [str(values)]
        if len(words) > 2 or (len(words) == 2 and "," in words[0]):
            parser.error(f"{option_string} takes a URL and at most one bootstrap port, got "
                         f"{' '.join(words)!r}")
        setattr(namespace, self.dest, [*getattr(namespace, self.dest), ",".join(words)])

def build_parser() -> argparse.ArgumentParser:
    """The parser of ``trio-disagg`` and its commands: ``serve``, ``mock-worker``, ``demo``."""
    parser = argparse.ArgumentParser(
        prog="trio-disagg",
        description="Disaggregated (prefill/decode) LLM serving on trio.",
        epilog=f"serve and mock-worker need the 'server' extra{_state('server')}; demo "
               f"needs the 'demo' extra{_state('demo')}.",
    )
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="default WARNING; ERROR for the demo, whose injected faults "
                             "would otherwise log a warning each")
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {importlib.metadata.version('trio-disagg')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_command(commands)
    add_mock_worker_command(commands)
    add_demo_command(commands)
    return parser


def _state(extra: str) -> str:
    """Whether ``extra`` is installed, for the help: empty if it is, else how to."""
    return "" if missing(extra) is None else f" (not installed: {install_hint(extra)})"


def _needs(extra: str) -> str:
    """``needs the 'server' extra``, and how to install it if it is not."""
    return f"needs the '{extra}' extra{_state(extra)}"


def add_serve_command(commands: Commands) -> None:
    """``serve``: the router's options, in the order ``--help`` lists them."""
    serve_cmd = commands.add_parser(
        "serve", help=f"run the OpenAI-compatible router ({_needs('server')})",
        formatter_class=DefaultsFormatter,
        description="Run the router. With no --prefill/--decode it runs the embedded "
                    "default: in-process mock prefill and decode engines. "
                    "docs/router.md, 'Securing and limiting the router', explains the "
                    f"limits, the API key and fault injection. It {_needs('server')}.")
    _add_serve_routing_options(serve_cmd)
    _add_serve_process_options(serve_cmd)
    _add_serve_failure_options(serve_cmd)
    _add_serve_limits(serve_cmd)


def _add_serve_routing_options(serve_cmd: argparse.ArgumentParser) -> None:
    """Where the router listens, the workers it routes to and how it picks them."""
    serve_cmd.add_argument("--host", type=listen_host, default="127.0.0.1",
                           help="the address to listen on (an IPv6 one as :: or [::1])")
    serve_cmd.add_argument("--port", type=port_number, default=8000,
                           help="the TCP port; 0 picks a free one")
    serve_cmd.add_argument("--backend", default="mock",
                           choices=["mock", "vllm", "sglang", "trtllm"],
                           help="the workers' protocol; mock: in-process mock engines")
    serve_cmd.add_argument("--prefill", action=PrefillSpec, nargs="+", default=[],
                           metavar=("URL", "BOOTSTRAP_PORT"),
                           help="a prefill worker, http(s)://host[:port] (repeat for "
                                "several); for sglang URL,BOOTSTRAP_PORT, or URL "
                                "BOOTSTRAP_PORT as SGLang's router takes it: without a port "
                                "(or with none) the worker's own is asked of it (default: "
                                "none; required with --backend vllm, sglang or trtllm)")
    serve_cmd.add_argument("--decode", action="append", default=[], metavar="URL",
                           help="a decode worker (repeat for several) (default: none; "
                                "required with --backend vllm, sglang or trtllm)")
    serve_cmd.add_argument("--worker-api-key", metavar="KEY",
                           help="send every worker 'Authorization: Bearer KEY': the key the "
                                "workers were started with (vLLM, SGLang --api-key) "
                                f"(default: ${WORKER_API_KEY_ENV} if set, else none; prefer "
                                "the variable: it stays out of process listings)")
    serve_cmd.add_argument("--model", action="append", type=model_name, metavar="MODEL",
                           help="a model name clients may ask for (repeat for several: every "
                                "name the workers serve, such as vLLM's --served-model-name "
                                f"aliases; others get 404) (default: {DEFAULT_MODEL})")
    serve_cmd.add_argument("--policy", default="least-outstanding", choices=sorted(POLICIES),
                           help="worker selection for both pools")
    serve_cmd.add_argument("--mock-style", choices=["sequential", "bootstrap"],
                           help="handoff style of the embedded mock prefill engines, with "
                                "--backend mock only (default: sequential)")
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


def _add_serve_process_options(serve_cmd: argparse.ArgumentParser) -> None:
    """How many router processes, and how long their shutdown drains."""
    serve_cmd.add_argument("--workers", type=process_count, default=1, metavar="N",
                           help="router processes sharing the port (SO_REUSEPORT; Linux "
                                "spreads connections over them); /metrics shows all of them; "
                                "at most 4 per core (docs/deploy.md)")
    serve_cmd.add_argument(SUPERVISED_FLAG, action="store_true", help=argparse.SUPPRESS)
    serve_cmd.add_argument("--drain-window", type=seconds, default=30.0, metavar="SECONDS",
                           help="seconds in-flight streams and transfers get on shutdown")


def _add_serve_failure_options(serve_cmd: argparse.ArgumentParser) -> None:
    """How the router notices failing workers: health probes, retries and deadlines."""
    serve_cmd.add_argument("--health-interval", type=positive_seconds, default=5.0,
                           metavar="SECONDS",
                           help="seconds between two probes of each worker's GET /health "
                                "(default 5; the embedded mocks are not probed)")
    serve_cmd.add_argument("--health-timeout", type=positive_seconds, default=2.0,
                           metavar="SECONDS",
                           help="seconds a health probe may take (default 2)")
    serve_cmd.add_argument("--max-attempts", type=positive_int, default=2,
                           help="attempts per leg, on another worker each, for a leg that "
                                "failed before the first byte (default 2; 1: no retry; "
                                "rule B9 in docs/semantics.md)")
    for name, default in deadline_defaults().items():
        serve_cmd.add_argument(f"--{name.replace('_', '-')}-deadline", type=positive_seconds,
                               default=default, dest=f"deadline_{name}", metavar="SECONDS",
                               help=f"seconds (default: {default:g}; rule B2 in "
                                    "docs/semantics.md)")


def _add_serve_limits(serve_cmd: argparse.ArgumentParser) -> None:
    """The limits and the API key, checked before any worker is called."""
    limits = serve_cmd.add_argument_group(
        "limits and security", "Checked before any worker is called (docs/router.md, "
        "'Securing and limiting the router').")
    limits.add_argument("--api-key", metavar="KEY",
                        help=f"every /v1/* request must send 'Authorization: Bearer KEY', "
                             f"else 401 (default: ${API_KEY_ENV} if set, else no key; "
                             f"prefer the variable: it stays out of process listings)")
    limits.add_argument("--protect-metrics", action="store_true",
                        help="with an API key, /health and /metrics need it too (/livez, the "
                             "liveness probe, stays open)")
    limits.add_argument("--max-body-bytes", type=positive_int, default=2 * 1024 * 1024,
                        metavar="BYTES", help="the largest request body; larger: 413")
    limits.add_argument("--max-prompt-bytes", type=positive_int, default=1024 * 1024,
                        metavar="BYTES",
                        help="the largest prompt (a chat's messages, a completion's prompt, "
                             "as JSON); larger: 400 prompt_too_long")
    limits.add_argument("--max-tokens-limit", type=positive_int, default=32768, metavar="N",
                        help="the largest max_tokens / max_completion_tokens a request may "
                             "ask for; larger: 400 invalid_value (raise it for a "
                             "long-context model)")
    limits.add_argument("--max-in-flight", type=limit, default=1024, metavar="N",
                        help="generation requests handled at once; past it: 503 with "
                             "Retry-After at once (0: no limit)")
    limits.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                        help="client connections open at once (per process with --workers); "
                             "past it the one idle the longest is closed to make room "
                             "(default: half of the file descriptors left)")
    limits.add_argument("--keep-alive-timeout", type=positive_seconds, default=5.0,
                        metavar="SECONDS",
                        help="seconds an idle client connection is kept open (default 5); "
                             "set it above the idle timeout of a load balancer in front "
                             "(60 s for AWS ALB), or it may answer some requests 502")
    limits.add_argument("--max-keeper-tasks", type=limit, default=4096, metavar="N",
                        help="KV transfers and cleanups in flight (prefill drains, decode "
                             "legs kept for a transfer, cleanup decodes) at which new "
                             "requests get 503; a transfer already started always runs "
                             "(0: no limit)")
    limits.add_argument("--fault-injection", action="store_true",
                        help="pass a client's \"fault\" body field on to the workers "
                             "(testing only; else it is removed from every request)")


def add_mock_worker_command(commands: Commands) -> None:
    """``mock-worker``: one mock worker's role, protocol, address and latency model."""
    worker_cmd = commands.add_parser(
        "mock-worker", help=f"run one mock prefill or decode worker over HTTP "
                            f"({_needs('server')})",
        formatter_class=DefaultsFormatter,
        description="A mock worker speaking a real worker's wire protocol (docs/protocols.md "
                    "section 5): KV block accounting with a lease, a real KV pull over "
                    "loopback, abort on connection close, faults from the request body's "
                    "\"fault\" field (with --fault-injection), and GET /metrics. It "
                    f"{_needs('server')}.")
    worker_cmd.add_argument("--role", required=True, choices=["prefill", "decode"],
                            help="serve prefill requests or decode requests")
    worker_cmd.add_argument("--protocol", default="vllm", choices=sorted(BACKENDS),
                            help="the worker whose wire protocol it speaks")
    worker_cmd.add_argument("--host", type=listen_host, default="127.0.0.1",
                            help="the address to listen on")
    worker_cmd.add_argument("--port", type=port_number, default=0, help="0 picks a free port")
    worker_cmd.add_argument("--model", type=model_name,
                            help="the only model accepted (default: any)")
    worker_cmd.add_argument("--seed", type=int, default=0,
                            help="seeds the made-up text the worker generates")
    worker_cmd.add_argument("--ttft-per-token", type=seconds, metavar="SECONDS", default=0.0002,
                            help="seconds of prefill compute per prompt token")
    worker_cmd.add_argument("--itl", type=seconds, metavar="SECONDS", default=0.02,
                            help="seconds between decoded tokens")
    worker_cmd.add_argument("--kv-transfer-per-token", type=seconds, metavar="SECONDS",
                            default=0.00002,
                            help="seconds per prompt token to move the KV")
    worker_cmd.add_argument("--kv-ttl", type=positive_seconds, metavar="SECONDS", default=30.0,
                            help="seconds staged KV waits for its decode")
    worker_cmd.add_argument("--bootstrap-port", type=port_number,
                            help="sglang prefill only: the bootstrap port (default 8998; "
                                 "0 picks a free one)")
    worker_cmd.add_argument("--bootstrap-timeout", type=positive_seconds, metavar="SECONDS",
                            help="sglang only: seconds either side of a bootstrap room "
                                 "waits for the other (default 300)")
    worker_cmd.add_argument("--fault-injection", action="store_true",
                            help="honour a request body's \"fault\" field (a test tool; "
                                 "without it the field is ignored)")
    worker_cmd.add_argument("--api-key", metavar="KEY",
                            help="vllm and sglang only: requests must send 'Authorization: "
                                 "Bearer KEY' as to the real worker, else 401 (vllm: /v1/*; "
                                 "sglang: all but /health* and /metrics*) (default: "
                                 "$VLLM_API_KEY for vllm, else no key)")


def add_demo_command(commands: Commands) -> None:
    """``demo``: the size, concurrency, seed and backends of the demo's workload."""
    demo_cmd = commands.add_parser(
        "demo", help=f"run the whole router on mock workers with a mixed workload "
                     f"({_needs('demo')})",
        formatter_class=DefaultsFormatter,
        description="Start the router on mock workers, drive real OpenAI requests through "
                    "it (client disconnects and injected faults included), print a table "
                    "per scenario, and exit non-zero if an invariant was broken. It "
                    f"{_needs('demo')} (the openai client).")
    demo_cmd.add_argument("--requests", type=positive_int, default=200,
                          help="requests per backend (at least one per scenario)")
    demo_cmd.add_argument("--concurrency", type=positive_int, default=32,
                          help="clients sending at once")
    demo_cmd.add_argument("--seed", type=int, default=0,
                          help="seeds the workload and the mock workers' text")
    demo_cmd.add_argument("--backend", default="all",
                          choices=["all", *DEMO_BACKENDS],
                          help="the backend to run; all: each in turn")
