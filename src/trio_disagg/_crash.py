"""How a crashed keeper task is reported: one readable line, never the repr of nested
exception groups (rules T2, T3 in docs/semantics.md)."""

from __future__ import annotations

import trio

from ._errors import PrefillError, WorkerError


def first_leaf(group: BaseExceptionGroup[PrefillError]) -> PrefillError:
    """The first :class:`PrefillError` of a group made only of them."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    assert isinstance(exc, PrefillError)
    return exc


def leaves(exc: BaseException) -> list[BaseException]:
    """The leaf exceptions of ``exc``: itself, or every exception inside its groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


def crash_message(exc: BaseException) -> str:
    """What crashed a drain, in one readable line (never the repr of nested groups).

    The leaves that caused the crash are named with their type and message; those that
    are only its consequences (a :class:`PrefillError` such as "no output" for a stream
    whose engine crashed, a cancellation) are left out when a cause is there.
    """
    found = leaves(exc)
    causes = [leaf for leaf in found
              if not isinstance(leaf, (PrefillError, trio.Cancelled))] or found
    named = (f"{type(leaf).__name__}: {leaf}" if str(leaf) else type(leaf).__name__
             for leaf in causes)
    return "; ".join(dict.fromkeys(named))


def worker_refusal(exc: BaseException) -> WorkerError | None:
    """The :class:`WorkerError` that ``exc`` is, bare or as the one exception of a group
    (an engine that refuses inside a nursery of its own raises it in one); else None."""
    found = leaves(exc)
    if len(found) == 1 and isinstance(found[0], WorkerError):
        return found[0]
    return None
