"""How a long-running command fails to start: one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from typing import cast

import trio

#: The exit code of a command that could not start (argparse's).
EXIT_STARTUP = 2


class StartupError(Exception):
    """A command could not start: one line on stderr, exit code 2 (:data:`EXIT_STARTUP`)."""


def display_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def first_os_error(group: BaseExceptionGroup[OSError]) -> str:
    """The reason of the first :class:`OSError` in ``group`` (a failed bind), in words."""
    exc = group.exceptions[0]
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc.strerror or str(exc)


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
