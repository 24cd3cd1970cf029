"""Signals of a long-running command: the first one shuts down gracefully, a second one at
once (B3)."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager

import trio

SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)

logger = logging.getLogger("trio_disagg")


@contextmanager
def ignoring_signals(signums: Sequence[int]) -> Iterator[None]:
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
    with (ignoring_signals(SHUTDOWN_SIGNALS),
          trio.open_signal_receiver(*SHUTDOWN_SIGNALS) as signals):
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
