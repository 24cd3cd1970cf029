"""The command line's argument types (bad values are refused before anything starts) and
its help formatter."""

from __future__ import annotations

import argparse
import os


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (0 picks a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be 0 to 65535, got {value}")
    return value


#: The longest duration a flag takes, in seconds (a day): a deadline, a timeout or a
#: window longer than that is a typo (``1e300``), not a setting; a timer that never fires
#: would hold a request, a connection or a shutdown for ever.
LONGEST_SECONDS = 86400.0
#: The shortest positive duration a flag takes, in seconds (1 ms): a deadline or a
#: timeout shorter than that runs out before anything could happen.
SHORTEST_SECONDS = 0.001


def _seconds_in(text: str, low: float, what: str) -> float:
    """``text`` as seconds from ``low`` to :data:`LONGEST_SECONDS` (argparse names the
    flag in front of the message)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not low <= value <= LONGEST_SECONDS:  # NaN and infinities too
        raise argparse.ArgumentTypeError(
            f"must be {what} to {LONGEST_SECONDS:g} seconds (a day), got {text!r}")
    return value


def seconds(text: str) -> float:
    """A number of seconds from 0 to :data:`LONGEST_SECONDS` (a drain window, a mock
    latency)."""
    return _seconds_in(text, 0.0, "0")


def positive_seconds(text: str) -> float:
    """A number of seconds from :data:`SHORTEST_SECONDS` to :data:`LONGEST_SECONDS` (a
    deadline, a timeout, an interval, a lease)."""
    return _seconds_in(text, SHORTEST_SECONDS, f"{SHORTEST_SECONDS:g}")


def positive_int(text: str) -> int:
    """A whole number >= 1 (a request count, a concurrency)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def listen_host(text: str) -> str:
    """An address to listen on: a name or an IP address; an IPv6 address may be written
    in brackets, as in a URL (``[::1]``)."""
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not host.strip():
        raise argparse.ArgumentTypeError(f"an address to listen on is needed, got {text!r}")
    if "/" in host or "[" in host or "]" in host:
        raise argparse.ArgumentTypeError(
            f"an address such as 127.0.0.1, 0.0.0.0, :: or [::1], not a URL: got {text!r}")
    return host


def model_name(text: str) -> str:
    """A model name: not empty, not blank (a client could never name it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"a model name must not be {'empty' if not text else 'blank'}, got {text!r}")
    return text


#: ``serve --workers`` at most this many processes per core: one process uses one core.
PROCESSES_PER_CORE = 4


def process_count(text: str) -> int:
    """A number of router processes: 1 to :data:`PROCESSES_PER_CORE` per core of this
    host (a typo such as 1000 would start processes until memory runs out)."""
    value = positive_int(text)
    cores = os.cpu_count() or 1
    most = PROCESSES_PER_CORE * cores
    if value > most:
        raise argparse.ArgumentTypeError(
            f"must be at most {most} ({PROCESSES_PER_CORE} per core; this host has "
            f"{cores}: one process uses one core), got {value}")
    return value


def limit(text: str) -> int | None:
    """A whole number >= 0, where 0 is no limit (None)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {value}")
    return value or None


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it (or the
    option is required)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("(default" in text or action.default is argparse.SUPPRESS
                or not action.option_strings or action.required):
            return text
        return f"{text} (default: %(default)s)".lstrip()
