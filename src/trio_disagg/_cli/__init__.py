"""The ``trio-disagg`` command: serve, demo, mock-worker.

One module per part: the argument types (``_arg_types``), the parser, one function per
command (``_parser``), what ``serve``'s options mean (``_serve_options``), the commands
(``_serve``, ``_mock_worker``; the demo is :mod:`trio_disagg._demo`), the signals
(``_signals``) and how a command fails to start (``_startup``).

The parser and the options need no extra, so that ``trio-disagg --help`` and
``--version`` work on a core install (``pip install trio-disagg``); each command imports
what it needs (the ``server`` extra, the ``demo`` extra) once it runs.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from functools import partial

import trio

from .._adapters import DEMO_BACKENDS
from .._extras import install_hint, missing
from .._supervisor import MULTIPROC_DIR_ENV
from ._parser import build_parser as build_parser
from ._serve_options import API_KEY_ENV as API_KEY_ENV
from ._serve_options import WORKER_API_KEY_ENV as WORKER_API_KEY_ENV
from ._serve_options import api_key_of as api_key_of
from ._serve_options import cancel_windows as cancel_windows
from ._serve_options import worker_api_key_of as worker_api_key_of
from ._startup import EXIT_STARTUP as EXIT_STARTUP
from ._startup import StartupError as StartupError
from ._startup import run_command


def ignore_multiprocess_dir() -> None:
    """Forget a ``PROMETHEUS_MULTIPROC_DIR`` of the environment (with a warning), before
    prometheus-client is imported: a command's metrics are its own process's, and
    ``serve --workers N`` gives its processes a directory of its own. Left set, the
    variable switched prometheus-client to files in that directory: a traceback if it did
    not exist, else files that pile up there (one set per process) and land in the
    metrics of whatever else reads that directory."""
    for name in (MULTIPROC_DIR_ENV, MULTIPROC_DIR_ENV.lower()):
        if os.environ.pop(name, None) is not None:
            logging.getLogger("trio_disagg").warning(
                "%s is set: ignored (the metrics are this process's own; serve --workers N "
                "aggregates its processes itself)", name)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trio-disagg`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # serve --workers runs it again
    level = args.log_level or ("ERROR" if args.command == "demo" else "WARNING")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # hypercorn prints its own lines with its own handler: not a second time through ours.
    logging.getLogger("hypercorn").propagate = False
    if not getattr(args, "supervised", False):
        ignore_multiprocess_dir()
    if args.command == "serve":
        from ._serve import serve_command  # the server extra

        return run_command("serve", serve_command, args)
    if args.command == "mock-worker":
        from ._mock_worker import mock_worker_command  # the server extra

        return run_command("mock-worker", mock_worker_command, args)
    if args.command == "demo":
        module = missing("demo")  # the openai client, and the server extra
        if module is not None:  # the demo extra, even when the server extra is missing too
            print(f"trio-disagg: error: this command needs the 'demo' extra ({module} is "
                  f"not installed): {install_hint('demo')}", file=sys.stderr, flush=True)
            return EXIT_STARTUP
        from .._demo import demo_backends, run_demo

        names = DEMO_BACKENDS if args.backend == "all" else (args.backend,)
        backends = demo_backends(names, args.seed)
        return trio.run(partial(run_demo, backends, requests=args.requests,
                                concurrency=args.concurrency, seed=args.seed))
    raise AssertionError(args.command)
