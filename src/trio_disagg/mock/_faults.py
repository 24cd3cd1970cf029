"""Fault injection for the mock workers: the fault kinds, their wire strings, per-worker plans.

A request asks for a fault with ``"fault"`` in its body: one string such as
``"prefill_stall"`` or ``"decode_error_at:3"``, a comma-separated string, or a list of
strings (at most one prefill fault and one decode fault). Each worker acts on the faults
of its own role and ignores the others, so the same body can go to both legs.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import attrs

from ._text import seeded_unit


class _HasRole(Protocol):
    @property
    def role(self) -> str: ...


F = TypeVar("F", bound=_HasRole)


class WireRole:
    """A fault kind's role, read from its wire string (an enum mixin)."""

    value: str

    @property
    def role(self) -> str:
        """``"prefill"`` or ``"decode"``: which worker acts on it."""
        return "decode" if self.value.startswith("decode_") else "prefill"


class FaultKind(WireRole, enum.Enum):
    """What to break. The value is the wire string (before an optional ``:ARG``)."""

    #: The prefill's first (and only) output is an error item; nothing is staged.
    PREFILL_FAIL_BEFORE_HANDOFF = "prefill_fail_before_handoff"
    #: The prefill stages KV and sends its handoff, then an error item. Sequential: the
    #: staged KV is released at once. Bootstrap: after the decode joined and pulled.
    PREFILL_FAIL_AFTER_HANDOFF = "prefill_fail_after_handoff"
    #: The prefill's first output has ``finish_reason`` error (terminal, S7).
    PREFILL_ERROR_FINISH = "prefill_error_finish"
    #: The prefill's first output has ``finish_reason`` cancelled (terminal, S7).
    PREFILL_CANCELLED_FINISH = "prefill_cancelled_finish"
    #: The prefill never produces anything until stopped, killed or cancelled.
    PREFILL_STALL = "prefill_stall"
    #: The prefill stream ends with no output at all (S1); an HTTP worker resets.
    PREFILL_RESET = "prefill_reset"
    #: The prefill refuses the request: ``WorkerError`` before ``started()``
    #: (``:STATUS``, default 503; an HTTP worker answers with that status;
    #: ``:STATUS:SECONDS`` adds ``Retry-After: SECONDS``).
    PREFILL_REJECT = "prefill_reject"
    #: The first token is EOS: the prefill answers with one token, ``finish_reason`` eos,
    #: no ``disaggregated_params``, nothing staged. (A decode doing its own prefill, with
    #: no handoff, honours it too.)
    EOS_FIRST_TOKEN = "eos_first_token"
    #: The decode ends with an error item before its first token; KV it was sent for is
    #: released at once.
    DECODE_FAIL_BEFORE_FIRST_TOKEN = "decode_fail_before_first_token"
    #: ``:K``: the decode sends K tokens, then an error item.
    DECODE_ERROR_AT = "decode_error_at"
    #: The decode stays queued, before it pulls the KV, until stopped, killed or
    #: cancelled (then it releases the KV at once).
    DECODE_STALL = "decode_stall"
    #: ``:K``: the decode sends K tokens, then stalls until stopped, killed or cancelled.
    DECODE_STALL_AT = "decode_stall_at"
    #: ``:K``: the decode sends K tokens, then its stream ends with no terminal item
    #: (a worker that died; an HTTP worker resets the connection).
    DECODE_RESET_AT = "decode_reset_at"
    #: The decode refuses the request: ``WorkerError`` before ``started()``
    #: (``:STATUS``, default 503; ``:STATUS:SECONDS`` adds ``Retry-After: SECONDS``). It
    #: never hears of the KV, which waits for its TTL.
    DECODE_REJECT = "decode_reject"


_NEEDS_INDEX = frozenset({FaultKind.DECODE_ERROR_AT, FaultKind.DECODE_STALL_AT,
                          FaultKind.DECODE_RESET_AT})
_TAKES_STATUS = frozenset({FaultKind.PREFILL_REJECT, FaultKind.DECODE_REJECT})
_BY_NAME = {kind.value: kind for kind in FaultKind}


def _fault_names() -> str:
    return ", ".join(kind.value + (":K" if kind in _NEEDS_INDEX else "")
                     + ("[:STATUS[:SECONDS]]" if kind in _TAKES_STATUS else "")
                     for kind in FaultKind)


@attrs.frozen(slots=True)
class Fault:
    """One injected fault. ``str(fault)`` is its wire string (``"decode_error_at:3"``),
    which :func:`parse_fault` reads back.

    Attributes:
        kind: what to break.
        at: for the ``*_at`` kinds, the number of tokens sent before the fault.
        status: for the ``*_reject`` kinds, the HTTP-like status of the refusal.
        retry_after: for the ``*_reject`` kinds, the seconds the refusal asks the client
            to wait (an HTTP worker's ``Retry-After``), or None.
    """

    kind: FaultKind
    at: int | None = None
    status: int | None = None
    retry_after: int | None = None

    @property
    def role(self) -> str:
        """``"prefill"`` or ``"decode"``: the worker that acts on it (its kind's role)."""
        return self.kind.role

    def __str__(self) -> str:
        if self.at is not None:
            return f"{self.kind.value}:{self.at}"
        if self.retry_after is not None:
            return f"{self.kind.value}:{self.status}:{self.retry_after}"
        if self.status is not None:
            return f"{self.kind.value}:{self.status}"
        return self.kind.value


def parse_fault(text: str) -> Fault:
    """Parse one fault string such as ``"prefill_stall"`` or ``"decode_error_at:3"``.

    Args:
        text: ``KIND``, ``KIND:K`` (a token count, for the ``*_at`` kinds) or
            ``KIND[:STATUS[:SECONDS]]`` (an HTTP status 400-599, for the ``*_reject``
            kinds, 503 if omitted, and the whole seconds of a ``Retry-After``);
            surrounding blanks are ignored.

    Returns:
        The :class:`Fault`.

    Raises:
        ValueError: an unknown kind, a missing or malformed ``:ARG``; the message lists
            the known kinds.
    """
    name, sep, arg = text.strip().partition(":")
    kind = _BY_NAME.get(name)
    if kind is None:
        raise ValueError(f"unknown fault {text!r}; known faults: {_fault_names()}")
    if kind in _NEEDS_INDEX:
        if not sep or not arg.isdigit():
            raise ValueError(f"fault {name!r} needs a token count, as in '{name}:3'; "
                             f"got {text!r}")
        return Fault(kind, at=int(arg))
    if kind in _TAKES_STATUS:
        if not sep:
            return Fault(kind, status=503)
        status, sep, wait = arg.partition(":")
        if not status.isdigit() or not 400 <= int(status) <= 599:
            raise ValueError(f"fault {name!r} takes an HTTP status 400-599, as in "
                             f"'{name}:429'; got {text!r}")
        if sep and not (wait.isascii() and wait.isdigit()):
            raise ValueError(f"fault {name!r} takes whole seconds after the status, as in "
                             f"'{name}:503:5'; got {text!r}")
        return Fault(kind, status=int(status), retry_after=int(wait) if sep else None)
    if sep:
        raise ValueError(f"fault {name!r} takes no argument; got {text!r}")
    return Fault(kind)


def parse_faults(value: Any) -> tuple[Fault, ...]:
    """Parse a body's ``"fault"`` value: None, a string (comma-separated allowed) or a
    list of strings.

    Returns:
        The faults, in order, at most one per role (empty for None or an empty string).

    Raises:
        ValueError: a malformed value, an unknown fault, or two faults for one role.
    """
    if value is None:
        return ()
    if isinstance(value, str):
        texts: list[Any] = [t for t in value.split(",") if t.strip()]
    elif isinstance(value, list):
        texts = value
    else:
        raise ValueError(f"fault must be a string or a list of strings, got "
                         f"{type(value).__name__}")
    faults: list[Fault] = []
    for text in texts:
        if not isinstance(text, str):
            raise ValueError(f"fault must be a string, got {type(text).__name__} {text!r}")
        faults.append(parse_fault(text))
    one_per_role(faults)
    return tuple(faults)


def one_per_role(faults: Iterable[F]) -> dict[str, F]:
    """``faults`` by role.

    Raises:
        ValueError: two faults for one role.
    """
    seen: dict[str, F] = {}
    for fault in faults:
        if fault.role in seen:
            raise ValueError(f"at most one {fault.role} fault per request; got "
                             f"{seen[fault.role]} and {fault}")
        seen[fault.role] = fault
    return seen


def _to_faults(values: Sequence[Fault | str]) -> tuple[Fault, ...]:
    return tuple(v if isinstance(v, Fault) else parse_fault(v) for v in values)


def _rate(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {value!r}")


@attrs.frozen(slots=True, kw_only=True)
class FaultPlan:
    """A worker's own faults, for requests whose body names none.

    A fraction ``rate`` of requests, chosen by a hash of the request id and ``seed`` (so
    runs repeat), gets one of ``faults``, also chosen by that hash.

    Args:
        faults: the faults to inject (:class:`Fault` objects or fault strings).
        rate: the fraction of requests to break, in [0, 1].
        seed: varies the choice of requests.

    Raises:
        ValueError: a bad fault string or rate.
    """

    faults: tuple[Fault, ...] = attrs.field(converter=_to_faults)
    rate: float = attrs.field(default=1.0, validator=_rate)
    seed: int = 0

    def pick(self, request_id: str) -> Fault | None:
        """The fault for ``request_id``, or None: the same answer for the same
        ``request_id`` and ``seed``, every time.

        Args:
            request_id: the request's id (``X-Request-Id``, or the engine request's id).

        Returns:
            One of :attr:`faults` for a fraction ``rate`` of request ids; None for the
            others, and always with no faults or ``rate`` 0.
        """
        if not self.faults or self.rate == 0.0:
            return None
        unit = seeded_unit(self.seed, "fault", request_id)
        if unit >= self.rate:
            return None
        return self.faults[min(int(unit / self.rate * len(self.faults)), len(self.faults) - 1)]


def fault_for(body: Mapping[str, Any], role: str, request_id: str,
              plan: FaultPlan | None) -> Fault | None:
    """The fault a worker of ``role`` must inject for one request.

    A decode worker also gets ``eos_first_token`` when the request has no decode fault
    (it applies it only when it computes the prefill itself). The body's ``"fault"``
    wins when present (even empty: then no fault); otherwise the
    worker's ``plan``, if any.

    Raises:
        ValueError: the body's ``"fault"`` is malformed (see :func:`parse_faults`).
    """
    if "fault" in body:
        faults: tuple[Fault, ...] = parse_faults(body["fault"])
    elif plan is not None:
        picked = plan.pick(request_id)
        faults = (picked,) if picked is not None else ()
    else:
        return None
    for fault in faults:
        if fault.role == role:
            return fault
    if role == "decode":  # a decode doing its own prefill (no handoff) honours this one
        for fault in faults:
            if fault.kind is FaultKind.EOS_FIRST_TOKEN:
                return fault
    return None
