"""Handoff validation for the HTTP engine adapters (B7): a prefill's handoff is checked field
by field, as typed, before anything downstream builds a decode request from it."""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import cattrs
from cattrs.errors import AttributeValidationNote, IterableValidationNote

from .._protocols import FinishKind, LLMEngineOutput, describe_value, make_strict_converter

#: Validates handoffs (B7): JSON exactly as typed, unknown keys ignored (and passed on);
#: a field typed ``typing.Annotated[T, Must(...)]`` must also meet that condition.
handoff_converter = make_strict_converter()


@attrs.frozen
class Must:
    """A condition a handoff field's value must meet besides its type (B7): the metadata
    of a ``typing.Annotated[T, Must(...)]`` field of a handoff class. Once the value is a
    ``T`` (a mistyped one is refused as such first), ``holds(value)`` must be true, or
    the field is refused as ``"must be <what>, got <value>"``."""

    holds: Callable[[Any], bool]
    what: str


def _is_checked(type_: Any) -> bool:
    return (typing.get_origin(type_) is typing.Annotated
            and any(isinstance(meta, Must) for meta in type_.__metadata__))


def _checked_structure_factory(type_: Any, conv: cattrs.Converter) -> Any:
    base_type = typing.get_args(type_)[0]
    base = conv.get_structure_hook(base_type)
    checks = [meta for meta in type_.__metadata__ if isinstance(meta, Must)]

    def structure(value: Any, _: Any) -> Any:
        value = base(value, base_type)
        for check in checks:
            if not check.holds(value):
                raise ValueError(f"must be {check.what}, got {describe_value(value)}")
        return value

    return structure


handoff_converter.register_structure_hook_factory(_is_checked, _checked_structure_factory)

#: An integer >= 0 (a block id, a request id).
NonNegativeInt = typing.Annotated[int, Must(lambda value: value >= 0, "a non-negative integer")]
#: Says a list must not be empty: ``typing.Annotated[list[int], NON_EMPTY]``.
NON_EMPTY = Must(bool, "a non-empty list")


def choices_problem(answer: Mapping[str, Any]) -> tuple[str, str] | None:
    """``("choices", ...)`` if a prefill answer's ``choices`` is a list of other than one
    choice (B7): one prefill, one KV, so which choice would a decode continue? None if it
    holds one (or is not a list: the handoff's own check says what is wrong then)."""
    choices = answer.get("choices")
    if isinstance(choices, list) and len(choices) != 1:
        return "choices", f"must hold exactly one choice, got {len(choices)}"
    return None


def handoff_problem(value: Any, cls: type[Any]) -> tuple[str, str] | None:
    """What is wrong with ``value`` as a ``cls`` (an attrs class of handoff fields),
    structured through :data:`handoff_converter`; None if nothing is.

    Returns:
        ``(field, problem)`` for the first offending field, ``field`` a path into
        ``value`` such as ``"choices[0].disaggregated_params.ctx_request_id"`` and
        ``problem`` such as ``"must be an integer, got str 'abc'"`` or ``"is missing"``.
    """
    try:
        handoff_converter.structure(value, cls)
    except Exception as exc:  # cattrs raises ClassValidationError, TypeError, ...
        return _first_problem(exc, "")
    return None


def _first_problem(exc: BaseException, path: str) -> tuple[str, str]:
    if isinstance(exc, cattrs.BaseValidationError) and exc.exceptions:
        inner = exc.exceptions[0]  # cattrs keeps them in field order
        for note in getattr(inner, "__notes__", ()):
            if isinstance(note, AttributeValidationNote):
                path = f"{path}.{note.name}" if path else note.name
                break
            if isinstance(note, IterableValidationNote):
                path = f"{path}[{note.index}]"
                break
        return _first_problem(inner, path)
    if isinstance(exc, KeyError):
        return path, "is missing"
    text = str(exc) or type(exc).__name__
    if text.startswith("expected "):  # the strict converter's "expected an integer, got ..."
        text = "must be " + text.removeprefix("expected ")
    return path, text


def needs_handoff(output: LLMEngineOutput) -> bool:
    """True for a prefill output that is not terminal (S7): no finish reason, or
    ``length``, so the decode needs its handoff."""
    finish = output.finish_reason
    return finish is None or finish.kind is FinishKind.LENGTH
