"""The ``trio-disagg`` command's entry point.

The command line is the router, the mock workers and the demo: it needs the ``server``
extra (and ``demo`` for the demo). Without it the command says which extra to install, in
one line, and exits with code 2, rather than printing an import traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ._extras import extra_for, install_hint

#: The exit code of a command that could not start (as the command line's own).
EXIT_STARTUP = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trio-disagg`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    try:
        from . import _cli

        return _cli.main(argv)
    except ModuleNotFoundError as exc:
        extra = extra_for(exc.name)
        if extra is None:
            raise
        print(f"trio-disagg: error: this command needs the '{extra}' extra ({exc.name} is "
              f"not installed): {install_hint(extra)}", file=sys.stderr, flush=True)
        return EXIT_STARTUP
