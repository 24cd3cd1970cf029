"""A cattrs converter that takes JSON exactly as typed, and its error messages.

cattrs' defaults coerce (``"3"`` becomes ``3``, a string is a list of characters); the
wire formats of every layer (the engine protocol in :mod:`trio_disagg._protocols`,
request bodies at the HTTP edge, handoff payloads in the adapters) build on this
converter instead, so a value of the wrong type is refused with a readable message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_origin

import attrs
import cattrs
import cattrs.cols
import cattrs.gen


def describe_value(value: Any) -> str:
    """A short description of a JSON value for an error message: ``str '3'``, ``null``."""
    if value is None:
        return "null"
    return f"{type(value).__name__} {value!r:.40}"


def _strict(kind: type, name: str) -> Any:
    # cattrs' defaults coerce ("3" -> 3, 3.7 -> 3); the wire must be typed exactly.
    def structure(value: Any, _: type) -> Any:
        if type(value) is kind or (kind is float and type(value) is int):
            return value
        if kind is int and type(value) is float and value.is_integer() and abs(value) >= 2**63:
            # orjson reads an integer literal past 64 bits as a float: say what was sent.
            raise TypeError(f"expected {name} of at most 64 bits, got one of about {value:g}")
        raise TypeError(f"expected {name}, got {describe_value(value)}")

    return structure


def _strict_list_factory(cls: Any, conv: cattrs.Converter) -> Any:
    # A JSON string is iterable; without this check "abc" would structure as a list.
    base = cattrs.cols.list_structure_factory(cls, conv)

    def structure(value: Any, type_: Any) -> Any:
        if not isinstance(value, list):
            raise TypeError(f"expected a list, got {describe_value(value)}")
        return base(value, type_)

    return structure


def _is_attrs(cls: Any) -> bool:
    return attrs.has(get_origin(cls) or cls)


def _strict_object_factory(cls: Any, conv: cattrs.Converter) -> Any:
    return strict_object(cattrs.gen.make_dict_structure_fn(cls, conv))


def strict_object(base: Any) -> Any:
    """``base``, a cattrs structure function of an attrs class, refusing any value that is
    not a JSON object (a ``TypeError`` naming what it got)."""
    def structure(value: Any, type_: Any) -> Any:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected an object, got {describe_value(value)}")
        return base(value, type_)

    return structure


def make_strict_converter() -> cattrs.Converter:
    """A cattrs converter that takes JSON exactly as typed.

    Numbers, strings and booleans are not coerced (``"3"`` is not an ``int``), a list must
    be a JSON array and an attrs class a JSON object; unknown keys are ignored and ``Any``
    passes through. Add hooks of your own on top. Wire formats of every layer (the engine
    protocol of :mod:`trio_disagg._protocols`, request bodies at the HTTP edge) build on
    it.
    """
    conv = cattrs.Converter(omit_if_default=True, forbid_extra_keys=False)
    conv.register_structure_hook(int, _strict(int, "an integer"))
    conv.register_structure_hook(float, _strict(float, "a number"))
    conv.register_structure_hook(str, _strict(str, "a string"))
    conv.register_structure_hook(bool, _strict(bool, "a boolean"))
    conv.register_structure_hook_factory(cattrs.cols.is_sequence, _strict_list_factory)
    conv.register_structure_hook_factory(_is_attrs, _strict_object_factory)
    conv.register_structure_hook(Any, lambda v, _: v)  # opaque JSON stays as it is
    return conv


def wire_problems(exc: cattrs.BaseValidationError) -> list[str]:
    """Each problem of a cattrs validation error as ``"<what> @ $.path"``."""
    return cattrs.transform_error(exc, path="$", format_exception=_explain)


def _explain(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, KeyError):
        return "required field missing"
    return str(exc) or type(exc).__name__
