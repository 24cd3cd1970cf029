"""``trio-disagg mock-worker``: one mock prefill or decode worker over HTTP."""

from __future__ import annotations

import argparse
import os
from collections.abc import Awaitable, Callable
from functools import partial

import trio

from .._protocols import DEFAULT_BOOTSTRAP_PORT
from ..mock import DEFAULT_BOOTSTRAP_TIMEOUT, LatencyModel, create_mock_worker, serve_worker
from ._signals import run_until_signalled
from ._startup import StartupError, display_address, first_os_error

#: The environment variable a vLLM worker reads its API key from without ``--api-key``.
VLLM_API_KEY_ENV = "VLLM_API_KEY"


def mock_api_key_of(args: argparse.Namespace) -> str | None:
    """``--api-key``, else for ``--protocol vllm`` :data:`VLLM_API_KEY_ENV` as vLLM reads
    it (empty: no key), else None.

    Raises:
        StartupError: ``--api-key`` is empty or blank, or given for TensorRT-LLM.
    """
    key: str | None = args.api_key
    if key is None:
        return (os.environ.get(VLLM_API_KEY_ENV) or None) if args.protocol == "vllm" else None
    if not key.strip():
        raise StartupError(f"--api-key is {'empty' if not key else 'blank'}; give a key, or "
                           "leave it out to serve without one")
    return key


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
    if args.bootstrap_timeout is not None and args.protocol != "sglang":
        raise StartupError("--bootstrap-timeout is for --protocol sglang only (its "
                           "bootstrap rooms' timeout)")
    if args.bootstrap_timeout is None:
        args.bootstrap_timeout = DEFAULT_BOOTSTRAP_TIMEOUT  # SGLang's default
    if sglang_prefill and args.bootstrap_port is None:
        args.bootstrap_port = DEFAULT_BOOTSTRAP_PORT  # SGLang's default
    try:
        app = create_mock_worker(
            args.role, args.protocol, model=args.model, latency=latency, seed=args.seed,
            kv_ttl=args.kv_ttl, bootstrap_port=args.bootstrap_port,
            bootstrap_timeout=args.bootstrap_timeout, fault_injection=args.fault_injection,
            api_key=mock_api_key_of(args))
    except ValueError as exc:
        raise StartupError(str(exc)) from None

    async def body(shutdown_trigger: Callable[[], Awaitable[None]]) -> None:
        async with trio.open_nursery() as nursery:
            try:
                port = await nursery.start(partial(
                    serve_worker, app, host=args.host, port=args.port,
                    shutdown_trigger=shutdown_trigger))
            except* OSError as group:
                where = display_address(args.host, args.port)
                if args.bootstrap_port is not None:
                    where += f" (bootstrap port {args.bootstrap_port})"
                raise StartupError(f"cannot listen on {where}: {first_os_error(group)}") from None
            bootstrap = getattr(app, "bootstrap_port", None)
            extra = f", bootstrap port {bootstrap}" if bootstrap is not None else ""
            print(f"trio-disagg: mock {args.protocol} {args.role} worker on "
                  f"http://{display_address(args.host, port)}{extra}", flush=True)

    return await run_until_signalled("mock-worker", body)
