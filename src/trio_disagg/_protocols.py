"""The engine protocol types and their JSON wire form.

These mirror Dynamo's ``LLMEngineOutput``, ``FinishReason``, ``Annotated<T>`` and friends
(docs/semantics.md, "Vocabulary"). They are plain attrs classes so the per-token hot path costs a
slotted object and nothing more; :data:`converter` turns them into and out of JSON-ready
Python values, and :func:`from_wire` raises :class:`~trio_disagg.WireFormatError` with a
readable message on bad input.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar, get_origin

import attrs
import cattrs
import cattrs.gen
import orjson

# The worker's choice kept as bytes (the relay's fast path) and its text, beside the output;
# a choice with its chunk's other top-level fields.
from ._choices import ChunkChoice as ChunkChoice
from ._choices import RawChoice as RawChoice
from ._choices import RawChoices as RawChoices
from ._errors import WireFormatError

# The strict converter lives in _strict_json; its names stay importable from here.
from ._strict_json import describe_value as describe_value
from ._strict_json import make_strict_converter as make_strict_converter
from ._strict_json import strict_object
from ._strict_json import wire_problems as wire_problems

T = TypeVar("T")

#: Any JSON value as the stdlib ``json`` / ``orjson`` produce it.
JSON = Any


class FinishKind(enum.Enum):
    """Why a stream ended; the wire form is the value (``"abort"`` is read as ``CANCELLED``).

    ``ERROR`` and ``CANCELLED`` are failures (G4, T4); ``LENGTH`` on a prefill's first
    output is a handoff, any other kind there a terminal answer (S7).
    """

    EOS = "eos"
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    CONTENT_FILTER = "content_filter"
    ERROR = "error"


@attrs.frozen(slots=True)
class FinishReason:
    """A finish reason: one of :class:`FinishKind`, with a message for ``ERROR``.

    Use the constants (``FinishReason.EOS``, ``FinishReason.LENGTH``, ...) and
    :meth:`error` rather than the constructor. Wire forms: ``"eos"``, ``"stop"``,
    ``"length"``, ``"cancelled"`` (alias ``"abort"``), ``"content_filter"`` and
    ``{"error": "message"}``.
    """

    kind: FinishKind
    message: str | None = None

    EOS: ClassVar[FinishReason]
    STOP: ClassVar[FinishReason]
    LENGTH: ClassVar[FinishReason]
    CANCELLED: ClassVar[FinishReason]
    CONTENT_FILTER: ClassVar[FinishReason]

    @classmethod
    def error(cls, message: str) -> FinishReason:
        """An ``error`` finish carrying the worker's message.

        Args:
            message: what failed, in the worker's words.
        """
        return cls(FinishKind.ERROR, message)

    @property
    def is_failure(self) -> bool:
        """True for ``error`` and ``cancelled``: the request did not complete (G4, T4)."""
        return self.kind is FinishKind.ERROR or self.kind is FinishKind.CANCELLED

    def __str__(self) -> str:
        if self.kind is FinishKind.ERROR:
            return f"error: {self.message}"
        return str(self.kind.value)


FinishReason.EOS = FinishReason(FinishKind.EOS)
FinishReason.STOP = FinishReason(FinishKind.STOP)
FinishReason.LENGTH = FinishReason(FinishKind.LENGTH)
FinishReason.CANCELLED = FinishReason(FinishKind.CANCELLED)
FinishReason.CONTENT_FILTER = FinishReason(FinishKind.CONTENT_FILTER)

_FINISH_BY_WIRE: dict[str, FinishReason] = {
    "eos": FinishReason.EOS,
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.CANCELLED,
    "abort": FinishReason.CANCELLED,
    "content_filter": FinishReason.CONTENT_FILTER,
}


@attrs.define(slots=True, kw_only=True)
class PromptTokensDetails:
    """OpenAI's ``usage.prompt_tokens_details``.

    Attributes:
        cached_tokens: prompt tokens served from a prefix cache, in tokens; the router
            reports the prefill's count, not the decode's (S4).
        audio_tokens: audio prompt tokens, in tokens, if the worker reported them.
    """

    cached_tokens: int | None = None
    audio_tokens: int | None = None


@attrs.define(slots=True, kw_only=True)
class CompletionUsage:
    """OpenAI's ``usage`` object. All counts are tokens.

    Attributes:
        prompt_tokens: tokens in the prompt.
        completion_tokens: tokens generated.
        total_tokens: their sum, as the worker reported it.
        prompt_tokens_details: cached prompt tokens, if reported (S4).
        extra: the other fields of the worker's usage object, as it sent them (OpenAI's
            ``completion_tokens_details``, SGLang's ``reasoning_tokens``, one a newer
            worker adds), for the router to relay (B8); None if it sent none.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    extra: dict[str, Any] | None = None


@attrs.frozen(slots=True, kw_only=True)
class TraceLink:
    """Where a worker served a request, for tracing across the handoff.

    Attributes:
        worker_id: the worker's id.
        request_id: the worker's own id for the request, if it has one.
        trace_id: the distributed trace id, if any.
    """

    worker_id: str
    request_id: str | None = None
    trace_id: str | None = None


@attrs.define(slots=True, kw_only=True)
class LLMEngineOutput:
    """One item of an engine's stream, wrapped in an :class:`Annotated`.

    Attributes:
        token_ids: the token ids this item produced (not cumulative).
        text: their detokenized text, if the engine has it.
        finish_reason: set on the stream's last item: why it ended.
        disaggregated_params: a prefill worker's handoff payload (any JSON value): what
            the decode worker needs to find the KV (S10); the SGLang bootstrap triple
            for the bootstrap style (S5).
        completion_usage: token counts, usually on the first (prefill) or last item.
        worker_trace_link: where the worker served the request.
        index: the choice index for ``n > 1``.
    """

    token_ids: list[int] = attrs.Factory(list)
    text: str | None = None
    finish_reason: FinishReason | None = None
    disaggregated_params: JSON | None = None
    completion_usage: CompletionUsage | None = None
    worker_trace_link: TraceLink | None = None
    index: int | None = None
    #: The worker's own OpenAI choice objects behind this item, as it sent them, in order,
    #: when an HTTP adapter read them: one per streamed chunk (its ``choices[0]`` with its
    #: ``delta``), several when one socket read brought several chunks (one item per
    #: burst, docs/performance.md), or a whole answer's one (with its ``message`` or
    #: ``text``). The server relays each as sent (B8). A choice the relay's fast path
    #: carried as bytes is a :class:`RawChoice` (a mapping that parses itself when read);
    #: the others are dicts. A read that brought only common chunks is one
    #: :class:`RawChoices` (a sequence of such choices, kept as their shared bytes and
    #: their texts); otherwise a list. A choice whose chunk had top-level fields the
    #: router relays (B8) is a :class:`ChunkChoice`. In process only: never on the wire.
    choices: Sequence[Mapping[str, Any]] | None = attrs.field(
        default=None, eq=False, repr=False)

    @classmethod
    def length(cls) -> LLMEngineOutput:
        """An empty output that finished on ``length``: a prefill's usual last output."""
        return cls(finish_reason=FinishReason.LENGTH)


@attrs.define(slots=True, kw_only=True)
class Annotated(Generic[T]):
    """Dynamo's envelope around a stream item.

    It *is an error* when ``event == "error"``; the message is then in ``error`` (or in
    ``comment``, as Dynamo's older producers put it). An engine that fails after it
    started sends ONE error item and ends its stream (S2, G4, T4).

    Attributes:
        data: the item (an :class:`LLMEngineOutput` in an engine's stream), None on an
            error.
        id: the request id, if the producer set one.
        event: ``"error"`` for an error item; None otherwise.
        comment: free text; older producers put the error message here.
        error: the error message of an error item.
    """

    data: T | None = None
    id: str | None = None
    event: str | None = None
    comment: list[str] | None = None
    error: str | None = None
    #: The typed failure behind an error item, when the producer had one (a
    #: :class:`~trio_disagg.PrefillError`, a :class:`~trio_disagg.DeadlineExceeded`, ...).
    #: In process only: never on the wire.
    exception: BaseException | None = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def from_data(cls, data: T) -> Annotated[T]:
        """An item carrying ``data``."""
        return cls(data=data)

    @classmethod
    def from_error(cls, message: str) -> Annotated[T]:
        """An error item whose message is ``message``."""
        return cls(event="error", error=message)

    @classmethod
    def from_exception(cls, exc: BaseException) -> Annotated[T]:
        """An error item carrying ``exc`` in :attr:`exception`, so the server can answer
        from its type (a 4xx :class:`~trio_disagg.WorkerError` stays a 4xx); its message
        is ``str(exc)``, or the exception's type name if that is empty."""
        return cls(event="error", error=str(exc) or type(exc).__name__, exception=exc)

    @property
    def is_error(self) -> bool:
        """True for an error item (``event == "error"``)."""
        return self.event == "error"

    def error_message(self) -> str | None:
        """The error text if this item is an error, else None."""
        if self.event != "error":
            return None
        if self.error:
            return self.error
        if self.comment:
            return "; ".join(self.comment)
        return "unknown error"


@attrs.frozen(slots=True, kw_only=True)
class PrefillResult:
    """What a prefill hands to the decode request (S10), and what the router reports
    from it: the prompt's token count and its cached tokens (the decode sees the whole
    prompt as cached after the transfer, S4).

    Attributes:
        disaggregated_params: the prefill's handoff payload, as it sent it.
        prompt_tokens_details: the prefill's cached tokens, if it reported them.
        prompt_tokens: the prompt's length in tokens, if the prefill reported it.
    """

    disaggregated_params: JSON
    prompt_tokens_details: PromptTokensDetails | None = None
    prompt_tokens: int | None = None


#: SGLang's default bootstrap port: where a prefill worker lets decode workers join its
#: bootstrap rooms when ``bootstrap_port`` is null or not set (docs/protocols.md section 3).
DEFAULT_BOOTSTRAP_PORT = 8998


@attrs.frozen(slots=True, kw_only=True)
class BootstrapInfo:
    """SGLang's bootstrap triple (docs/protocols.md section 3): where a decode worker
    meets its prefill, chosen by the router before both legs are dispatched (S5).

    Attributes:
        host: the prefill worker's bootstrap host.
        port: its bootstrap port (TCP).
        room: a number unique among the requests in flight, in [0, 2**63 - 1].
    """

    host: str
    port: int
    room: int

    def as_params(self) -> dict[str, Any]:
        """The triple as ``disaggregated_params``: ``bootstrap_host``,
        ``bootstrap_port`` and ``bootstrap_room``."""
        return {"bootstrap_host": self.host, "bootstrap_port": self.port,
                "bootstrap_room": self.room}


@attrs.define(slots=True, kw_only=True)
class RoutingHints:
    """What worker selection may use (S12).

    Attributes:
        session_id: for :class:`~trio_disagg.SessionAffinity`.
        prefill_worker, decode_worker: a worker name to use if it is healthy; the router
            fills both in with the workers it chose.
    """

    session_id: str | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None


def _budget(_: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    """A completion budget of no tokens, or fewer, is a caller's mistake: the engines would
    still produce one token and call it a success."""
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"{attribute.name} must be None or an integer >= 1, got {value!r}")


def _of_type(expected: type) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """A validator: a field of the wrong type would be accepted and fail far away (a
    request id an engine cannot put in its handoff strands the KV it staged)."""
    what = "a string" if expected is str else f"a {expected.__name__}"

    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        # bool is an int, never a str or a dict; a bool field wants exactly bool
        if not isinstance(value, expected) or (expected is bool) is not (type(value) is bool):
            raise TypeError(f"{attribute.name} must be {what}, got "
                            f"{type(value).__name__} {value!r}")
    return check


_a_string = _of_type(str)


def _request_id(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    _a_string(_, attribute, value)
    if not value:
        raise ValueError(f"{attribute.name} must not be empty")


@attrs.define(slots=True, kw_only=True)
class PreprocessedRequest:
    """What the router needs of one client request.

    Raises:
        ValueError: ``max_tokens`` is not None and not an integer of at least 1, or
            ``request_id`` is empty.
        TypeError: ``request_id`` or ``model`` is not a string, ``body`` not a dict, or
            ``stream`` not a bool.

    Attributes:
        request_id: unique among the requests in flight; the contexts share it.
        model: the model name the client asked for.
        body: the client's OpenAI request body as received; adapters build their wire
            request from it, and the router adds nothing to it (B8).
        max_tokens: the resolved completion budget, in tokens (at least 1); None if
            unbounded.
        stream: whether the client streams.
        routing: the :class:`RoutingHints`.
        prefill_result: the handoff, filled in for the decode leg after a sequential
            prefill (S10).
        bootstrap_info: the bootstrap room, filled in for both legs in the bootstrap
            (SGLang) style (S5).
    """

    request_id: str = attrs.field(validator=_request_id)
    model: str = attrs.field(validator=_a_string)
    body: dict[str, Any] = attrs.field(factory=dict, validator=_of_type(dict))
    max_tokens: int | None = attrs.field(default=None, validator=_budget)
    stream: bool = attrs.field(default=False, validator=_of_type(bool))
    routing: RoutingHints = attrs.Factory(RoutingHints)
    prefill_result: PrefillResult | None = None
    bootstrap_info: BootstrapInfo | None = None


# --- wire form -------------------------------------------------------------------------


def _unstructure_finish(reason: FinishReason) -> JSON:
    if reason.kind is FinishKind.ERROR:
        return {"error": reason.message}
    return reason.kind.value


def _structure_finish(value: Any, _: type) -> FinishReason:
    if isinstance(value, str):
        try:
            return _FINISH_BY_WIRE[value]
        except KeyError:
            raise ValueError(f"unknown finish_reason {value!r}") from None
    if isinstance(value, Mapping) and len(value) == 1 and isinstance(value.get("error"), str):
        return FinishReason.error(value["error"])
    raise ValueError(f"finish_reason must be a string or {{'error': str}}, got {value!r}")


def _is_annotated(cls: Any) -> bool:
    return cls is Annotated or get_origin(cls) is Annotated


def _make_converter() -> cattrs.Converter:
    conv = make_strict_converter()
    conv.register_unstructure_hook(FinishReason, _unstructure_finish)
    conv.register_structure_hook(FinishReason, _structure_finish)
    conv.register_structure_hook(
        FinishReason | None, lambda v, t: None if v is None else _structure_finish(v, t)
    )
    # An item's exception and an output's worker choice live in process only (made
    # lazily, so that they see the hooks above).
    conv.register_unstructure_hook_factory(
        _is_annotated,
        lambda cls, c: cattrs.gen.make_dict_unstructure_fn(
            cls, c, _cattrs_omit_if_default=True, exception=cattrs.gen.override(omit=True)),
    )
    conv.register_structure_hook_factory(
        _is_annotated,
        lambda cls, c: strict_object(cattrs.gen.make_dict_structure_fn(
            cls, c, exception=cattrs.gen.override(omit=True))),
    )
    conv.register_unstructure_hook_factory(
        lambda cls: cls is LLMEngineOutput,
        lambda cls, c: cattrs.gen.make_dict_unstructure_fn(
            cls, c, _cattrs_omit_if_default=True, choices=cattrs.gen.override(omit=True)),
    )
    conv.register_structure_hook_factory(
        lambda cls: cls is LLMEngineOutput,
        lambda cls, c: strict_object(cattrs.gen.make_dict_structure_fn(
            cls, c, choices=cattrs.gen.override(omit=True))),
    )
    return conv


#: The cattrs converter between the protocol types (:class:`LLMEngineOutput`,
#: :class:`Annotated`, ...) and their wire form; :func:`to_wire` and :func:`from_wire`
#: use it.
converter = _make_converter()


def to_wire(value: Any) -> Any:
    """Turn a protocol object into JSON-ready Python values (omitting defaults; the
    in-process-only fields, ``Annotated.exception`` and ``LLMEngineOutput.choices``, are
    never written)."""
    return converter.unstructure(value)


def from_wire(value: Any, cls: type[T]) -> T:
    """Build ``cls`` from JSON-ready Python values, exactly as typed: ``"3"`` is not an
    integer, unknown keys are ignored.

    Args:
        value: what a JSON parser produced.
        cls: the protocol class (``Annotated[LLMEngineOutput]``, ...).

    Returns:
        The ``cls`` instance.

    Raises:
        WireFormatError: if ``value`` does not have the shape of ``cls``; the message
            names each offending path (``$.finish_reason: unknown finish_reason 'x'``).
    """
    try:
        return converter.structure(value, cls)
    except Exception as exc:  # cattrs raises ClassValidationError, TypeError, ValueError...
        if isinstance(exc, cattrs.BaseValidationError):
            details = "; ".join(wire_problems(exc))
        else:
            details = str(exc)
        name = getattr(cls, "__name__", str(cls))
        raise WireFormatError(f"invalid {name}: {details}") from None


def dumps(value: Any) -> bytes:
    """Serialize a protocol object to JSON bytes."""
    return orjson.dumps(to_wire(value))


def loads(data: bytes | str, cls: type[T]) -> T:
    """Parse JSON bytes into ``cls``.

    Raises:
        WireFormatError: on malformed JSON or a value of the wrong shape.
    """
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise WireFormatError(f"malformed JSON: {exc}") from None
    return from_wire(value, cls)
