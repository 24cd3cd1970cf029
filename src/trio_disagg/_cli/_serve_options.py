"""What ``serve``'s options mean: the selection policies, the deadlines, the API key, the
cancel windows and the engines; a bad combination is a :class:`StartupError`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from .._adapters import BACKENDS, adapter
from .._engine import CancelWindow, Engine, HandoffStyle
from .._pool import (
    LeastOutstanding,
    PrefixAffinity,
    RoundRobin,
    SelectionPolicy,
    SessionAffinity,
)
from .._router import Deadlines
from ..mock import LatencyModel, MockCluster, mock_cluster
from ._startup import StartupError

if TYPE_CHECKING:  # the server extra: the parser and these options need none
    from ..engines import Client

POLICIES: dict[str, Callable[[], SelectionPolicy]] = {
    "round-robin": RoundRobin,
    "least-outstanding": LeastOutstanding,
    "session-affinity": SessionAffinity,
    "prefix-affinity": PrefixAffinity,
}

#: The environment variable ``serve`` reads its API key from when ``--api-key`` is not
#: given: a key there stays out of process listings.
API_KEY_ENV = "TRIO_DISAGG_API_KEY"
#: The environment variable ``serve`` reads the workers' API key from when
#: ``--worker-api-key`` is not given.
WORKER_API_KEY_ENV = "TRIO_DISAGG_WORKER_API_KEY"


#: The model name ``serve`` accepts when no ``--model`` is given.
DEFAULT_MODEL = "trio-disagg-mock"


def models_of(args: argparse.Namespace) -> list[str]:
    """The ``--model`` names, each once, in order; :data:`DEFAULT_MODEL` if none."""
    return list(dict.fromkeys(args.model)) if args.model else [DEFAULT_MODEL]


def deadline_defaults() -> dict[str, float]:
    """Each :class:`Deadlines` field's default, in seconds: one ``--NAME-deadline`` option
    each."""
    defaults = Deadlines()
    return {field.name: getattr(defaults, field.name) for field in attrs.fields(Deadlines)}


def deadlines_of(args: argparse.Namespace) -> Deadlines:
    """The ``--NAME-deadline`` options as :class:`Deadlines`."""
    return Deadlines(**{name: getattr(args, f"deadline_{name}")
                        for name in deadline_defaults()})


def _unsendable(where: str, key: str) -> StartupError | None:
    """Why ``key`` can never arrive in an ``Authorization`` header, naming ``where`` it
    came from and never the key; None if it can. A key read from a file or a secret
    often ends with the file's newline."""
    if any(char in key for char in "\r\n\0"):
        return StartupError(f"{where} has a CR, LF or NUL: it cannot go in a header (a "
                            "file's trailing newline?)")
    if key != key.strip():
        return StartupError(f"{where} begins or ends with whitespace, which no HTTP header "
                            "keeps: no request would ever match it")
    return None


def api_key_of(args: argparse.Namespace) -> str | None:
    """``--api-key``, else :data:`API_KEY_ENV`, else None (no key).

    Raises:
        StartupError: the key given is empty or blank (an unset variable expanded to
            nothing must not silently turn authentication off), or no client could send
            it: a CR, LF or NUL, or whitespace around it (every request would be refused
            401). The message names where the key came from, never the key.
    """
    key: str | None = args.api_key
    where = "--api-key"
    if key is None:
        key = os.environ.get(API_KEY_ENV)
        where = API_KEY_ENV
    if key is not None and not key.strip():
        raise StartupError(f"{where} is {'empty' if not key else 'blank'}; give a key, or "
                           "unset it to serve without one")
    if key is not None and (problem := _unsendable(where, key)) is not None:
        raise problem
    if args.protect_metrics and key is None:
        raise StartupError(f"--protect-metrics needs an API key (--api-key or {API_KEY_ENV})")
    return key


def worker_api_key_of(args: argparse.Namespace) -> str | None:
    """``--worker-api-key``, else :data:`WORKER_API_KEY_ENV`, else None: the key the router
    sends every worker as ``Authorization: Bearer <key>`` (workers started with
    ``--api-key``).

    Raises:
        StartupError: the key given is empty or blank, has a CR, LF or NUL (it could
            not be sent) or whitespace around it or a non-ASCII character (no worker
            would match it), or ``--worker-api-key`` with the embedded mocks. The message
            names where the key came from, never the key.
    """
    key: str | None = args.worker_api_key
    where = "--worker-api-key"
    if key is not None and args.backend == "mock":
        raise StartupError("--worker-api-key is for workers over HTTP: it needs --backend "
                           "vllm, sglang or trtllm")
    if key is None:
        key = os.environ.get(WORKER_API_KEY_ENV)
        where = WORKER_API_KEY_ENV
    if key is None:
        return None
    if not key.strip():
        raise StartupError(f"{where} is {'empty' if not key else 'blank'}; give the workers' "
                           "key, or unset it to send none")
    if (problem := _unsendable(where, key)) is not None:
        raise problem
    if not key.isascii():
        raise StartupError(f"{where} has a non-ASCII character: vLLM and SGLang read the "
                           "header as Latin-1, so no worker would ever match it")
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
    counters ``/metrics`` then shows), or adapters over HTTP.

    Raises:
        StartupError: workers given for the mocks, a pool missing for a real backend, a
            bootstrap port for another backend than SGLang, or a worker URL (or SGLang
            bootstrap port) the adapter refuses.
    """
    if args.backend == "mock":
        if args.prefill or args.decode:
            raise StartupError("--prefill/--decode need --backend vllm, sglang or trtllm")
        style = HandoffStyle(args.mock_style or "sequential")
        cluster = mock_cluster(1, 1, style=style, latency=LatencyModel())
        return list(cluster.prefill), list(cluster.decode), cluster
    if args.mock_style is not None:
        raise StartupError("--mock-style is the embedded mocks' handoff style: it needs "
                           "--backend mock (a real backend's style is its protocol's)")
    if not args.prefill or not args.decode:
        raise StartupError(f"--backend {args.backend} needs at least one --prefill and "
                           "--decode")
    if args.backend not in BACKENDS:
        raise StartupError(f"--backend {args.backend} is not available yet")
    ported = [spec for spec in args.prefill if "," in spec]
    if ported and args.backend != "sglang":
        raise StartupError(f"--prefill {ported[0]!r}: a bootstrap port is SGLang's; "
                           f"--backend {args.backend} takes a worker's URL alone")
    try:
        prefill, decode = adapter(args.backend)(args.prefill, args.decode, client=client)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return list(prefill), list(decode), None
