"""The checks of what a caller hands :class:`~trio_disagg.DisaggRouter`: a wrong type or
value is the caller's mistake, said at once with a TypeError or ValueError that names the
argument, never an AttributeError from inside a request (docs/semantics.md B2, B5)."""

from __future__ import annotations

import math
from typing import Any

import trio

from ._context import RequestContext
from ._engine import HandoffStyle
from ._health import RetryPolicy
from ._keeper import TransferKeeper
from ._pool import WorkerPool
from ._protocols import PreprocessedRequest
from ._router_types import Deadlines


def check_router_arguments(
    prefill: object, decode: object, keeper: object, deadlines: object, retry: object,
    channel_buffer: object, disagg_min_prompt_tokens: object,
) -> None:
    """What :class:`~trio_disagg.DisaggRouter` is made with.

    Raises:
        TypeError: an argument of another type than its own; a prefill engine whose
            ``handoff_style`` is not a :class:`~trio_disagg.HandoffStyle`.
        ValueError: a negative ``channel_buffer`` or ``disagg_min_prompt_tokens``.
    """
    _count("channel_buffer", channel_buffer, "items", also=math.inf)
    _count("disagg_min_prompt_tokens", disagg_min_prompt_tokens, "tokens", also=None)
    _types(prefill=(prefill, WorkerPool), decode=(decode, WorkerPool),
           keeper=(keeper, TransferKeeper), deadlines=(deadlines, Deadlines, None),
           retry=(retry, RetryPolicy, None))
    assert isinstance(prefill, WorkerPool)
    for worker in prefill.workers:
        style = getattr(worker.engine, "handoff_style", None)
        if not isinstance(style, HandoffStyle):  # (a str would read as SEQUENTIAL)
            raise TypeError(f"prefill engine {worker.name}: handoff_style must be a "
                            f"trio_disagg.HandoffStyle, got {style!r}")


def check_stream_arguments(nursery: object, request: object, context: object) -> None:
    """A wrong type is the caller's mistake: say so before a prefill runs for nothing (a
    missing nursery would otherwise be found only at the decode's dispatch).

    Raises:
        TypeError: ``nursery``, ``request`` or ``context`` of another type.
        ValueError: ``request`` carries a ``prefill_result`` or a ``bootstrap_info``
            already: the router fills them in (S5, S10), and a stale one would reach the
            decode worker as its handoff (a request routed before, passed again).
    """
    if (type(request) is PreprocessedRequest and type(nursery) is trio.Nursery
            and type(context) is RequestContext and request.prefill_result is None
            and request.bootstrap_info is None):
        return  # the usual call, checked at the cost of five lookups (once a request)
    _types(nursery=(nursery, trio.Nursery), request=(request, PreprocessedRequest),
           context=(context, RequestContext))
    assert isinstance(request, PreprocessedRequest)
    for name in ("prefill_result", "bootstrap_info"):
        if getattr(request, name) is not None:
            raise ValueError(f"request {request.request_id!r} carries a {name} already: "
                             f"the router fills it in; pass the request as received")


def _types(**arguments: tuple[Any, ...]) -> None:
    """Each argument, ``name=(value, type, ...)``, is an instance of one of its types
    (None: it may be None)."""
    for name, (value, *expected) in arguments.items():
        if not any(value is None if kind is None else isinstance(value, kind)
                   for kind in expected):
            names = " or ".join("None" if kind is None else
                                f"a {kind.__module__.split('.')[0]}.{kind.__name__}"
                                for kind in expected)
            raise TypeError(f"{name} must be {names}, got {type(value).__name__}")


def _count(name: str, value: object, unit: str, *, also: float | None) -> None:
    """``value`` is an int (not a bool) >= 0, or ``also`` (``math.inf``, or None)."""
    if value is also or (also is not None and value == also):
        return
    if not isinstance(value, int) or isinstance(value, bool):
        allowed = "None or an int" if also is None else "an int or math.inf"
        raise TypeError(f"{name} must be {allowed} ({unit}), got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 {unit}, got {value}")
