"""Checks of what a caller configures a :class:`~trio_disagg.WorkerPool` with: a wrong
type or value is said at once, with a TypeError or ValueError naming it, never found in a
request (an AttributeError there) or silently ignored (a cancel window given as a str)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from ._engine import CancelWindow


def check_pool_arguments(policy: object, failure_threshold: object, cooldown: object,
                         cancel_windows: Mapping[str, object]) -> None:
    """What :class:`~trio_disagg.WorkerPool` is made with, besides its engines.

    Raises:
        TypeError: ``policy`` has no ``choose`` method, a cancel window is not a
            :class:`CancelWindow`, or a number is not one.
        ValueError: ``failure_threshold`` < 1, or ``cooldown`` negative or not finite.
    """
    if policy is not None and not callable(getattr(policy, "choose", None)):
        raise TypeError(f"policy must be a SelectionPolicy (with a choose method), got "
                        f"{type(policy).__name__}")
    if not isinstance(failure_threshold, int) or isinstance(failure_threshold, bool):
        raise TypeError(f"failure_threshold must be an int, got {failure_threshold!r}")
    if failure_threshold < 1:
        raise ValueError(f"failure_threshold must be >= 1 faults, got {failure_threshold}")
    if not isinstance(cooldown, int | float) or isinstance(cooldown, bool):
        raise TypeError(f"cooldown must be a number of seconds, got {cooldown!r}")
    if not (0 <= cooldown < math.inf):  # also refuses NaN
        raise ValueError(f"cooldown must be a finite number of seconds >= 0, got {cooldown}")
    for name, window in cancel_windows.items():
        if not isinstance(window, CancelWindow):
            raise TypeError(f"cancel_windows[{name!r}] must be a trio_disagg.CancelWindow, "
                            f"got {window!r}")
