"""Faults only the mock HTTP workers inject: wire-level misbehaviour the in-process engines
have no counterpart for (a decode answering an error status before its stream, a decode
queued for a while before its KV pull, a decode slow to accept, a prefill answer that is
not a usable handoff).

They ride in the same body field as the engines' faults (``"fault"``: one string, a
comma-separated string, or a list of strings) and are taken out before the rest is parsed
by :func:`~trio_disagg.engines.fault_for`, so the two kinds mix in one body; at most one
fault per role in all.

Wire strings:

- ``decode_kv_lost``: the decode's KV pull fails. The decode lets go of the KV (it tells
  the prefill side to free it, as a failed transfer does) and answers ``500`` with
  ``"KV transfer failed: ..."`` before any byte of its answer, streamed or not.
- ``decode_queue:SECONDS``: the decode request is accepted (a streamed answer's headers go
  out) and then waits ``SECONDS`` in the worker's queue before it pulls the KV. Aborted
  while queued, it pulls nothing.
- ``decode_accept_delay:SECONDS``: the decode request is held ``SECONDS`` before the worker
  accepts it (no byte of its answer, not even a streamed answer's headers, goes out
  before): a decode dispatch that is still pending. It has not looked at its handoff yet,
  so aborted meanwhile it lets go of nothing (it neither joins a room nor releases KV).
- ``prefill_bad_handoff:FIELD``, ``prefill_bad_handoff:FIELD=VALUE``: the prefill answers
  a handoff that is not usable, and stages no KV for it: ``FIELD`` removed from the
  handoff, or set to ``VALUE`` (JSON, else the raw text: ``ctx_request_id=1.5``,
  ``ctx_request_id=""``, ``ctx_request_id=abc``). ``prefill_bad_handoff:choices``
  answers two choices instead of one.

Answer faults (:class:`AnswerFaults`) change only the fields of the decode's OpenAI answer,
for the relay to carry as sent (B8). They mix with each other and with one other decode
fault (at most one of each kind); the prefill ignores them:

- ``decode_finish:REASON``: the final choice's ``finish_reason`` is ``REASON`` (such as
  ``content_filter``), whatever ended the tokens.
- ``decode_stop_reason:VALUE``: the final choice has ``"stop_reason": VALUE`` (JSON, such as
  ``128009`` or ``"</s>"``; else the raw text), as vLLM says which stop ended it.
- ``decode_no_usage``: the stream has no usage chunk, even when
  ``stream_options.include_usage`` asks for one.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any

import attrs
import orjson

from ._faults import WireRole, one_per_role

__all__ = ["REMOVED", "AnswerFaults", "MockFault", "MockFaultKind", "answer_faults",
           "parse_mock_fault", "split_mock_faults"]


class _Removed(enum.Enum):
    REMOVED = "removed"


#: The :attr:`MockFault.value` of a ``prefill_bad_handoff`` that removes its field.
REMOVED = _Removed.REMOVED


class MockFaultKind(WireRole, enum.Enum):
    """A fault only the mock HTTP workers inject; the value is the wire string."""

    DECODE_KV_LOST = "decode_kv_lost"
    DECODE_QUEUE = "decode_queue"
    DECODE_ACCEPT_DELAY = "decode_accept_delay"
    PREFILL_BAD_HANDOFF = "prefill_bad_handoff"


_BY_NAME = {kind.value: kind for kind in MockFaultKind}


@attrs.frozen(kw_only=True)
class MockFault:
    """One mock-only fault.

    Attributes:
        kind: what to break.
        seconds: ``decode_queue``'s and ``decode_accept_delay``'s wait.
        field: ``prefill_bad_handoff``'s field (``"choices"``: two choices).
        value: ``prefill_bad_handoff``'s value for the field, or :data:`REMOVED`.
    """

    kind: MockFaultKind
    seconds: float = 0.0
    field: str = ""
    value: Any = REMOVED

    @property
    def role(self) -> str:
        return self.kind.role

    def __str__(self) -> str:
        return self.kind.value


def parse_mock_fault(text: str) -> MockFault:
    """Parse one mock-only fault string (see the module docstring).

    Raises:
        ValueError: not a mock-only fault, or a malformed argument.
    """
    name, sep, arg = text.strip().partition(":")
    kind = _BY_NAME.get(name)
    if kind is None:
        raise ValueError(f"unknown mock fault {text!r}")
    if kind is MockFaultKind.DECODE_KV_LOST:
        if sep:
            raise ValueError(f"fault {name!r} takes no argument; got {text!r}")
        return MockFault(kind=kind)
    if kind in (MockFaultKind.DECODE_QUEUE, MockFaultKind.DECODE_ACCEPT_DELAY):
        try:
            seconds = float(arg)
        except ValueError:
            seconds = math.nan
        if not sep or not 0 <= seconds < math.inf:
            raise ValueError(f"fault {name!r} needs a number of seconds, as in "
                             f"'{name}:1.5'; got {text!r}")
        return MockFault(kind=kind, seconds=seconds)
    field, eq, raw = arg.partition("=")
    if not sep or not field:
        raise ValueError(f"fault {name!r} needs a field, as in '{name}:remote_block_ids' "
                         f"or '{name}:ctx_request_id=1.5'; got {text!r}")
    value: Any = REMOVED
    if eq:
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            value = raw
    return MockFault(kind=kind, field=field, value=value)


#: The answer faults' wire names (before ``:ARG``).
DECODE_FINISH = "decode_finish"
DECODE_STOP_REASON = "decode_stop_reason"
DECODE_NO_USAGE = "decode_no_usage"
_ANSWER_NAMES = frozenset({DECODE_FINISH, DECODE_STOP_REASON, DECODE_NO_USAGE})


@attrs.frozen(kw_only=True)
class AnswerFaults:
    """A decode's answer faults (see the module docstring).

    Attributes:
        finish: ``decode_finish``'s reason, or None.
        stop_reason: ``decode_stop_reason``'s value, or :data:`REMOVED` (none asked).
        no_usage: ``decode_no_usage``.
    """

    finish: str | None = None
    stop_reason: Any = REMOVED
    no_usage: bool = False

    def __bool__(self) -> bool:
        return self.finish is not None or self.stop_reason is not REMOVED or self.no_usage


def _fault_texts(value: Any) -> list[Any] | None:
    if isinstance(value, str):
        return [t for t in value.split(",") if t.strip()]
    if isinstance(value, list):
        return value
    return None  # none, or malformed: the engines' parser reports it


def answer_faults(body: Mapping[str, Any]) -> AnswerFaults:
    """The answer faults named in ``body["fault"]`` (none: an empty :class:`AnswerFaults`).

    Raises:
        ValueError: a malformed answer fault, or one kind twice.
    """
    texts = _fault_texts(body.get("fault")) or []
    fields: dict[str, Any] = {}
    for text in texts:
        if not isinstance(text, str):
            continue
        name, sep, arg = text.strip().partition(":")
        if name not in _ANSWER_NAMES:
            continue
        key = {DECODE_FINISH: "finish", DECODE_STOP_REASON: "stop_reason",
               DECODE_NO_USAGE: "no_usage"}[name]
        if key in fields:
            raise ValueError(f"at most one {name} fault per request; got {text!r} too")
        if name == DECODE_NO_USAGE:
            if sep:
                raise ValueError(f"fault {name!r} takes no argument; got {text!r}")
            fields[key] = True
        elif not sep or not arg:
            example = "content_filter" if name == DECODE_FINISH else "128009"
            raise ValueError(f"fault {name!r} needs a value, as in '{name}:{example}'; "
                             f"got {text!r}")
        elif name == DECODE_FINISH:
            fields[key] = arg
        else:
            try:
                fields[key] = orjson.loads(arg)
            except orjson.JSONDecodeError:
                fields[key] = arg
    return AnswerFaults(**fields)


def split_mock_faults(body: Mapping[str, Any], role: str
                      ) -> tuple[MockFault | None, Mapping[str, Any]]:
    """Take the mock-only faults out of ``body["fault"]``.

    Answer faults (:func:`answer_faults`) are checked and taken out too; they count
    against no other fault.

    Returns:
        The mock-only fault for ``role`` (or None), and the body the engines' faults are
        read from (``body`` itself when it names no mock-only fault).

    Raises:
        ValueError: a malformed mock-only fault, or two mock-only faults for one role.
    """
    texts = _fault_texts(body.get("fault"))
    if texts is None:
        return None, body
    answer_faults(body)  # checked here, read where the answer is written
    mine: list[MockFault] = []
    rest: list[Any] = []
    answers = 0
    for text in texts:
        name = text.strip().partition(":")[0] if isinstance(text, str) else None
        if name in _BY_NAME:
            mine.append(parse_mock_fault(text))
        elif name in _ANSWER_NAMES:
            answers += 1
        else:
            rest.append(text)
    if not mine:
        return None, ({**body, "fault": rest} if answers else body)
    return one_per_role(mine).get(role), {**body, "fault": rest}
