"""The OpenAI wire format at the edge: request validation, errors and response chunks.

Request bodies are structured into attrs classes by a strict cattrs converter (no coercion:
``"3"`` is not an integer, ``true`` is not a number), the same idea as
:data:`trio_disagg.converter`. Unknown keys are allowed and kept: the client's whole body
goes to the workers. Every problem becomes an :class:`ApiError`, which renders as OpenAI's
``{"error": {"message", "type", "param", "code"}}``.

Response chunks are built by :class:`ChunkEncoder` from prebuilt byte strings, so a token
costs one ``orjson.dumps`` of its text (DESIGN.md P4).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NewType

import attrs
import cattrs
import cattrs.cols
import cattrs.gen
import orjson

from .._errors import (
    DeadlineExceeded,
    NoWorkerAvailable,
    PrefillError,
    RouterClosed,
    WorkerError,
)
from .._protocols import (
    CompletionUsage,
    FinishKind,
    FinishReason,
    describe_value,
    make_strict_converter,
    wire_problems,
)

logger = logging.getLogger("trio_disagg.server")

# --- errors -----------------------------------------------------------------------------


class ApiError(Exception):
    """An error to show the client as OpenAI's error object.

    Attributes:
        status: the HTTP status (4xx or 5xx).
        message: a readable explanation.
        type: OpenAI's ``error.type`` (``invalid_request_error``, ``upstream_error``, ...).
        param: the offending request field, if one is to blame.
        code: a short machine-readable code, or None.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, code={self.code!r})"

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready ``{"error": {...}}`` object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_json(self) -> bytes:
        """The error object as JSON bytes."""
        return orjson.dumps(self.to_dict())

    def to_event(self) -> bytes:
        """The error as one server-sent event, ``data: {"error": ...}\\n\\n``."""
        return b"data: " + self.to_json() + b"\n\n"


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def error_for_exception(exc: BaseException) -> ApiError:
    """Map an exception of the router (or an engine) to the error the client sees.

    - :class:`~trio_disagg.RouterClosed`: 503, code ``router_closed``.
    - :class:`~trio_disagg.NoWorkerAvailable`: 503, code ``no_worker_available``.
    - :class:`~trio_disagg.DeadlineExceeded` (also a
      :class:`~trio_disagg.PrefillDeadlineExceeded`): 504, code ``deadline_exceeded``.
    - :class:`~trio_disagg.PrefillError` whose ``__cause__`` is a
      :class:`~trio_disagg.WorkerError` with a 4xx status: that status and the worker's
      message, code ``prefill_rejected``.
    - any other :class:`~trio_disagg.PrefillError`: 502 with the worker's message, code
      ``prefill_failed``.
    - :class:`~trio_disagg.WorkerError`: its status (502 if that is not 4xx or 5xx),
      code ``worker_error``.
    - anything else: 500, code ``internal_error`` (a bug; the caller logs it).

    An exception group is mapped by its first leaf.
    """
    exc = _leaf(exc)
    if isinstance(exc, RouterClosed):
        return ApiError(503, str(exc) or "the router is shutting down",
                        type="service_unavailable_error", code="router_closed")
    if isinstance(exc, NoWorkerAvailable):
        return ApiError(503, str(exc) or "no worker available",
                        type="service_unavailable_error", code="no_worker_available")
    if isinstance(exc, DeadlineExceeded):
        return ApiError(504, str(exc), type="timeout_error", code="deadline_exceeded")
    if isinstance(exc, PrefillError):
        cause = exc.__cause__
        if isinstance(cause, WorkerError) and 400 <= cause.status < 500:
            return ApiError(cause.status, str(cause), code="prefill_rejected")
        return ApiError(502, str(exc), type="upstream_error", code="prefill_failed")
    if isinstance(exc, WorkerError):
        status = exc.status if 400 <= exc.status < 600 else 502
        kind = "invalid_request_error" if status < 500 else "upstream_error"
        return ApiError(status, str(exc), type=kind, code="worker_error")
    return ApiError(500, "internal server error", type="internal_error", code="internal_error")


# --- requests ---------------------------------------------------------------------------

#: A completions ``prompt``: a string or a list of token ids (a batch of one is unwrapped).
Prompt = NewType("Prompt", object)
#: ``stop``: a string or a list of strings.
Stop = NewType("Stop", object)
#: A chat message's ``content``: a string or a list of content parts (objects with a type).
Content = NewType("Content", object)

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@attrs.define(slots=True, kw_only=True)
class StreamOptions:
    """OpenAI's ``stream_options``."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


@attrs.define(slots=True, kw_only=True)
class _SamplingFields:
    """The fields both endpoints share; types are checked, values partly (see validate)."""

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: Stop | None = None
    seed: int | None = None
    user: str | None = None
    min_tokens: int | None = None
    max_tokens: int | None = None


@attrs.define(slots=True, kw_only=True)
class CompletionRequest(_SamplingFields):
    """The body of ``POST /v1/completions`` (the fields this server checks)."""

    prompt: Prompt
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None


@attrs.define(slots=True, kw_only=True)
class ChatMessage:
    """One message of a chat completion request."""

    role: str
    content: Content | None = None
    name: str | None = None


@attrs.define(slots=True, kw_only=True)
class ChatCompletionRequest(_SamplingFields):
    """The body of ``POST /v1/chat/completions`` (the fields this server checks)."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(token) is int for token in value)


def _structure_prompt(value: Any, _: type) -> Any:
    if isinstance(value, str) or (_is_token_list(value) and value):
        return value
    if isinstance(value, list) and len(value) == 1:
        (only,) = value
        if isinstance(only, str) or (_is_token_list(only) and only):
            return value
    if isinstance(value, list) and len(value) > 1 and all(
        isinstance(item, str) or _is_token_list(item) for item in value
    ):
        raise ValueError("batched prompts (a list of several prompts) are not supported")
    raise TypeError(f"expected a string or a list of token ids, got {describe_value(value)}")


def _structure_stop(value: Any, _: type) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise TypeError(f"expected a string or a list of strings, got {describe_value(value)}")


def _structure_content(value: Any, _: type) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for index, part in enumerate(value):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise TypeError(
                    f"content part {index}: expected an object with a string 'type', "
                    f"got {describe_value(part)}"
                )
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise TypeError(f"content part {index}: a text part needs a string 'text'")
        return value
    raise TypeError(f"expected a string or a list of content parts, got {describe_value(value)}")


def _make_converter() -> cattrs.Converter:
    conv = make_strict_converter()
    conv.register_structure_hook(Prompt, _structure_prompt)
    conv.register_structure_hook(Stop, _structure_stop)
    conv.register_structure_hook(Content, _structure_content)
    return conv


#: The strict converter for request bodies.
request_converter = _make_converter()


def structure_body(body: Any, cls: type[Any]) -> Any:
    """Structure a parsed JSON body into ``cls`` with the strict converter.

    Raises:
        ApiError: 400 ``invalid_request_error`` naming the first offending field in
            ``param`` (``messages[0].role``) and every problem in the message.
    """
    try:
        return request_converter.structure(body, cls)
    except Exception as exc:
        if not isinstance(exc, cattrs.BaseValidationError):
            raise ApiError(400, f"invalid request body: {exc}", code="invalid_type") from None
        problems = wire_problems(exc)
        param: str | None = None
        details: list[str] = []
        for problem in problems:
            message, _, path = problem.rpartition(" @ ")
            field = path.removeprefix("$").removeprefix(".")
            if param is None and field:
                param = field
            details.append(f"{field}: {message}" if field else problem)
        missing = problems and problems[0].startswith("required field missing")
        raise ApiError(
            400,
            "invalid request body: " + "; ".join(details),
            param=param,
            code="missing_required_parameter" if missing else "invalid_type",
        ) from None


def parse_json(data: bytes) -> Any:
    """Parse a request body.

    Raises:
        ApiError: 400 ``invalid_json`` for malformed JSON (or an empty body).
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON in request body: {exc}", code="invalid_json") from None


def _check_range(name: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        raise ApiError(
            400, f"{name} must be between {low:g} and {high:g}, got {value}",
            param=name, code="invalid_value",
        )


def check_common(request: _SamplingFields, max_tokens: int, *, param: str) -> None:
    """Value checks shared by both endpoints, after type checks.

    Args:
        request: the structured body.
        max_tokens: the resolved completion budget, in tokens.
        param: the name of the field the budget came from.

    Raises:
        ApiError: 400 for ``n`` other than 1, ``stream_options`` without ``stream``, a
            sampling parameter or ``min_tokens`` out of range.
    """
    if request.n is not None and request.n != 1:
        if request.n < 1:
            raise ApiError(400, f"n must be at least 1, got {request.n}",
                           param="n", code="invalid_value")
        raise ApiError(400, f"n > 1 is not supported by this server (got n={request.n})",
                       param="n", code="unsupported_value")
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true",
                       param="stream_options", code="invalid_value")
    _check_range("temperature", request.temperature, 0.0, 2.0)
    _check_range("top_p", request.top_p, 0.0, 1.0)
    _check_range("presence_penalty", request.presence_penalty, -2.0, 2.0)
    _check_range("frequency_penalty", request.frequency_penalty, -2.0, 2.0)
    if request.min_tokens is not None and not 0 <= request.min_tokens <= max_tokens:
        raise ApiError(
            400, f"min_tokens must be between 0 and {param} ({max_tokens}), "
            f"got {request.min_tokens}",
            param="min_tokens", code="invalid_value",
        )


def check_max_tokens(name: str, value: int, limit: int) -> None:
    """Raises ApiError 400 unless ``1 <= value <= limit``."""
    if not 1 <= value <= limit:
        raise ApiError(400, f"{name} must be between 1 and {limit}, got {value}",
                       param=name, code="invalid_value")


def check_chat(request: ChatCompletionRequest) -> None:
    """Chat-only checks: at least one message, known roles.

    Raises:
        ApiError: 400 naming the offending message.
    """
    if not request.messages:
        raise ApiError(400, "messages must contain at least one message",
                       param="messages", code="invalid_value")
    for index, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            raise ApiError(
                400, f"messages[{index}].role: unknown role {message.role!r} "
                f"(expected one of {', '.join(sorted(CHAT_ROLES))})",
                param=f"messages[{index}].role", code="invalid_value",
            )


def check_completion(request: CompletionRequest) -> None:
    """Completions-only checks: a non-empty prompt, no ``best_of`` > 1.

    Raises:
        ApiError: 400.
    """
    if isinstance(request.prompt, str) and not request.prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if request.best_of is not None and request.best_of != 1:
        raise ApiError(400, f"best_of other than 1 is not supported (got {request.best_of})",
                       param="best_of", code="unsupported_value")


# --- responses --------------------------------------------------------------------------

#: FinishReason kinds that end a request successfully, and their OpenAI names.
#: ``cancelled`` and ``error`` are failures: they become error responses or events.
OPENAI_FINISH: dict[FinishKind, str] = {
    FinishKind.EOS: "stop",
    FinishKind.STOP: "stop",
    FinishKind.LENGTH: "length",
    FinishKind.CONTENT_FILTER: "content_filter",
}


def failure_error(finish: FinishReason | None, message: str | None = None) -> ApiError:
    """The error for a stream that did not complete: an error finish, a cancelled finish, an
    error item (``message``), or a stream that ended with no finish reason at all.

    Always 502 ``upstream_error``: the worker failed, or died mid-stream.
    """
    if message is not None:
        return ApiError(502, message, type="upstream_error", code="generation_failed")
    if finish is None:
        return ApiError(
            502, "the decode stream ended without a finish reason (the worker died?)",
            type="upstream_error", code="incomplete_stream",
        )
    if finish.kind is FinishKind.CANCELLED:
        return ApiError(502, "the worker cancelled the request before it completed",
                        type="upstream_error", code="cancelled")
    return ApiError(502, finish.message or "the worker failed the request",
                    type="upstream_error", code="generation_failed")


def usage_dict(
    usage: CompletionUsage | None, completion_tokens: int, cached_tokens: int | None
) -> dict[str, Any]:
    """OpenAI's ``usage`` object.

    Args:
        usage: the last usage a worker reported, if any; its counts win.
        completion_tokens: tokens counted on the stream, used when ``usage`` has none.
        cached_tokens: the **prefill** worker's ``cached_tokens`` (PROTOCOLS.md section 1);
            the decode worker's is ignored.
    """
    prompt = usage.prompt_tokens if usage is not None else 0
    completion = (
        usage.completion_tokens if usage is not None and usage.completion_tokens
        else completion_tokens
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached_tokens or 0},
    }


_dumps = orjson.dumps


class ChunkEncoder:
    """Builds the server-sent events of one streamed response.

    The constant parts of a chunk (id, object, created, model) are serialized once; a
    token then costs one ``orjson.dumps`` of its text and a few concatenations.

    Args:
        chat: ``chat.completion.chunk`` (``delta``) rather than ``text_completion`` (``text``).
        response_id: the ``id`` of every chunk.
        model: the model name to report.
        created: Unix time in seconds.
        include_usage: ``stream_options.include_usage``: every chunk gets ``"usage": null``
            and :meth:`usage` builds the final usage chunk.
    """

    __slots__ = ("_chat", "_end", "_first", "_head", "_mid", "_null_end", "_usage_head")

    def __init__(
        self, *, chat: bool, response_id: str, model: str, created: int, include_usage: bool
    ) -> None:
        kind = b"chat.completion.chunk" if chat else b"text_completion"
        head = (
            b'data: {"id":' + _dumps(response_id) + b',"object":"' + kind
            + b'","created":' + str(created).encode() + b',"model":' + _dumps(model)
        )
        self._chat = chat
        self._head = head + b',"choices":[{"index":0,'
        self._usage_head = head + b',"choices":[]'
        self._mid = b',"logprobs":null,"finish_reason":'
        self._end = b"}]" + (b',"usage":null' if include_usage else b"") + b"}\n\n"
        self._null_end = self._mid + b"null" + self._end
        self._first = True

    def token(self, text: str) -> bytes:
        """A chunk carrying ``text`` and no finish reason."""
        if not self._chat:
            return self._head + b'"text":' + _dumps(text) + self._null_end
        if self._first:
            self._first = False
            return (self._head + b'"delta":{"role":"assistant","content":' + _dumps(text)
                    + b"}" + self._null_end)
        return self._head + b'"delta":{"content":' + _dumps(text) + b"}" + self._null_end

    def final(self, text: str | None, finish_reason: str) -> bytes:
        """The last choice chunk: ``text`` (may be empty) and the OpenAI finish reason."""
        if not self._chat:
            body = b'"text":' + _dumps(text or "")
        elif self._first:
            body = b'"delta":{"role":"assistant","content":' + _dumps(text or "") + b"}"
        elif text:
            body = b'"delta":{"content":' + _dumps(text) + b"}"
        else:
            body = b'"delta":{}'
        self._first = False
        return self._head + body + self._mid + _dumps(finish_reason) + self._end

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The final usage chunk (``choices`` empty)."""
        return self._usage_head + b',"usage":' + _dumps(usage) + b"}\n\n"


DONE_EVENT = b"data: [DONE]\n\n"


def completion_response(
    *, chat: bool, response_id: str, model: str, created: int, text: str,
    finish_reason: str, usage: dict[str, Any],
) -> bytes:
    """The JSON of a non-streamed ``text_completion`` or ``chat.completion``."""
    choice: dict[str, Any]
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _dumps({
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    })
