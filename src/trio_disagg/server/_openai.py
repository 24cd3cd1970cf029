"""The OpenAI wire format at the edge: request validation, errors and response chunks.

Request bodies are structured into attrs classes by a strict cattrs converter (no coercion:
``"3"`` is not an integer, ``true`` is not a number), the same idea as
:data:`trio_disagg.converter`. Unknown keys are allowed and kept: the client's whole body
goes to the workers. Every problem becomes an :class:`ApiError`, which renders as OpenAI's
``{"error": {"message", "type", "param", "code"}}``.

Response chunks are built by :class:`ChunkEncoder` from prebuilt byte strings, so a token
costs one ``orjson.dumps`` of its text (docs/design.md P4), and a worker's own choice, relayed
as sent (B8), one ``orjson.dumps`` of that choice. :class:`ChoiceCollector` collects a
worker's streamed choices into one answer for a client that did not stream.
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
    InvalidPrefillHandoff,
    NoWorkerAvailable,
    PrefillDeadlineExceeded,
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


def _worker_rejection(exc: BaseException) -> WorkerError | None:
    """The worker's 4xx behind ``exc``: ``exc`` itself if it is a WorkerError, else its
    ``__cause__``; None if neither is a WorkerError with a 4xx status."""
    worker = exc if isinstance(exc, WorkerError) else exc.__cause__
    if isinstance(worker, WorkerError) and 400 <= worker.status < 500:
        return worker
    return None


@attrs.frozen
class ErrorMapping:
    """One row of :data:`ERROR_TABLE`: how an exception type reaches the client.

    Attributes:
        exception: the exception type the row is for (its subclasses too).
        status: the HTTP status; None for the worker's own 4xx status (the exception's,
            or its ``__cause__``'s), and then the row applies only when there is one and
            the message is the worker's.
        type: OpenAI's ``error.type``.
        code: OpenAI's ``error.code``.
        param: the name of the exception's attribute that names the offending field,
            which becomes ``error.param``; None for no ``param``.
        fallback_message: the message when the exception has none.
    """

    exception: type[BaseException]
    status: int | None
    type: str
    code: str
    param: str | None = None
    fallback_message: str | None = None

    def error_for(self, exc: BaseException) -> ApiError | None:
        """The client's error for ``exc`` if this row applies to it, else None."""
        if not isinstance(exc, self.exception):
            return None
        status = self.status
        message = str(exc)
        if status is None:
            worker = _worker_rejection(exc)
            if worker is None:
                return None
            status, message = worker.status, str(worker)
        param = getattr(exc, self.param, None) if self.param is not None else None
        return ApiError(status, message or self.fallback_message or type(exc).__name__,
                        type=self.type, param=param, code=self.code)


#: How each exception of the router (or an engine) reaches the client, most specific
#: first: :func:`error_for_exception` uses the first row that applies. An exception that
#: no row takes is a bug: 500 ``internal_error``.
ERROR_TABLE: tuple[ErrorMapping, ...] = (
    ErrorMapping(RouterClosed, 503, "service_unavailable_error", "router_closed",
                 fallback_message="the router is shutting down"),
    ErrorMapping(NoWorkerAvailable, 503, "service_unavailable_error", "no_worker_available",
                 fallback_message="no worker available"),
    # Before DeadlineExceeded and PrefillError: it is both (B2).
    ErrorMapping(PrefillDeadlineExceeded, 504, "timeout_error", "prefill_deadline_exceeded"),
    # The message says which wait ran out ("handoff deadline of 30 s exceeded").
    ErrorMapping(DeadlineExceeded, 504, "timeout_error", "deadline_exceeded"),
    # B7: the client learns which field of the prefill's answer was wrong.
    ErrorMapping(InvalidPrefillHandoff, 502, "upstream_error", "invalid_prefill_handoff",
                 param="field"),
    # A prefill worker's 4xx is the client's fault: passed through as sent.
    ErrorMapping(PrefillError, None, "invalid_request_error", "prefill_rejected"),
    ErrorMapping(PrefillError, 502, "upstream_error", "prefill_failed"),
    ErrorMapping(WorkerError, None, "invalid_request_error", "worker_error"),
    # A worker's 5xx or transport failure is a bad gateway, never a 500 of ours.
    ErrorMapping(WorkerError, 502, "upstream_error", "worker_error"),
)


def error_for_exception(exc: BaseException) -> ApiError:
    """Map an exception of the router (or an engine) to the error the client sees.

    The first row of :data:`ERROR_TABLE` that applies decides:

    - :class:`~trio_disagg.RouterClosed`: 503, code ``router_closed``.
    - :class:`~trio_disagg.NoWorkerAvailable`: 503, code ``no_worker_available``.
    - :class:`~trio_disagg.PrefillDeadlineExceeded`: 504, code
      ``prefill_deadline_exceeded``.
    - any other :class:`~trio_disagg.DeadlineExceeded`: 504, code ``deadline_exceeded``;
      the message names the wait that ran out.
    - :class:`~trio_disagg.InvalidPrefillHandoff`: 502, code ``invalid_prefill_handoff``,
      ``param`` the offending field of the prefill's answer (B7).
    - :class:`~trio_disagg.PrefillError` whose ``__cause__`` is a
      :class:`~trio_disagg.WorkerError` with a 4xx status: that status and the worker's
      message, code ``prefill_rejected``.
    - any other :class:`~trio_disagg.PrefillError`: 502 with the worker's message, code
      ``prefill_failed``.
    - :class:`~trio_disagg.WorkerError`: its status if that is a 4xx, else 502; code
      ``worker_error``.
    - anything else: 500, code ``internal_error`` (a bug; the caller logs it).

    Args:
        exc: the exception. An exception group is mapped by its first leaf: the router
            raises bare exceptions, so a group is a defensive path only.

    Returns:
        The :class:`ApiError` to answer with.
    """
    exc = _leaf(exc)
    for row in ERROR_TABLE:
        error = row.error_for(exc)
        if error is not None:
            return error
    return ApiError(500, "internal server error", type="internal_error", code="internal_error")


# --- the edge's own refusals: answered before any worker is called -----------------------
# (docs/router.md, "Securing and limiting the router"; the table there lists them all.)


def invalid_api_key(given: bool) -> ApiError:
    """401 ``invalid_api_key``: a ``/v1/*`` request without the right bearer key.

    Args:
        given: whether the request carried a bearer key at all (it changes the message).
    """
    message = ("Incorrect API key provided." if given else
               "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
    return ApiError(401, message, type="invalid_request_error", code="invalid_api_key")


def unsupported_media_type(content_type: str | None) -> ApiError:
    """415 ``unsupported_media_type``: a POST body that is not ``application/json``."""
    got = repr(content_type) if content_type is not None else "none"
    return ApiError(415, f"the request body must be sent as Content-Type: application/json, "
                    f"got {got}", param="Content-Type", code="unsupported_media_type")


def server_overloaded(message: str) -> ApiError:
    """503 ``server_overloaded``: admission control refused the request (sent with a
    ``Retry-After`` header)."""
    return ApiError(503, message, type="service_unavailable_error", code="server_overloaded")


def prompt_too_long(param: str, size: int, limit: int) -> ApiError:
    """400 ``prompt_too_long``: the prompt (``param``) is ``size`` bytes, over ``limit``."""
    return ApiError(400, f"{param}: {size} bytes as JSON, over the limit of {limit} bytes",
                    param=param, code="prompt_too_long")


def request_too_large(limit: int) -> ApiError:
    """413 ``request_too_large``: the body is over ``limit`` bytes."""
    return ApiError(413, f"request body too large (the limit is {limit} bytes)",
                    code="request_too_large")


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
    echo: bool | None = None
    tools: list[dict[str, Any]] | None = None


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
    """Chat-only checks: at least one message, known roles, ``top_logprobs`` only with
    ``logprobs``, each tool a function with a name.

    Raises:
        ApiError: 400 naming the offending message.
    """
    if not request.messages:
        raise ApiError(400, "messages must contain at least one message",
                       param="messages", code="invalid_value")
    if request.top_logprobs is not None:
        if not 0 <= request.top_logprobs <= 20:
            raise ApiError(400, f"top_logprobs must be between 0 and 20, got "
                           f"{request.top_logprobs}", param="top_logprobs",
                           code="invalid_value")
        if not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                           code="invalid_value")
    for index, tool in enumerate(request.tools or ()):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise ApiError(400, f"tools[{index}] must be {{\"type\": \"function\", "
                           f"\"function\": {{\"name\": ...}}}}", param=f"tools[{index}]",
                           code="invalid_value")
    for index, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            raise ApiError(
                400, f"messages[{index}].role: unknown role {message.role!r} "
                f"(expected one of {', '.join(sorted(CHAT_ROLES))})",
                param=f"messages[{index}].role", code="invalid_value",
            )


#: Request fields about the prompt, which only the prefill computed: a decode never sees
#: the prompt's logprobs, and echoing the prompt is the prefill's to do. The value each
#: may keep (anything else is refused, B8).
PROMPT_ONLY_FIELDS: dict[str, object] = {"prompt_logprobs": None, "echo": False}


def check_prompt_fields(body: Mapping[str, Any]) -> None:
    """Refuse what concerns the prompt (B8): ``prompt_logprobs`` (any value but null) and
    ``echo: true``. They are never sent to a decode worker, which did not compute the
    prompt.

    Raises:
        ApiError: 400 ``invalid_request_error``, code ``unsupported_parameter``, ``param``
            the field.
    """
    for name, allowed in PROMPT_ONLY_FIELDS.items():
        value = body.get(name)
        if value is not None and value is not allowed:
            raise ApiError(
                400, f"{name} is not supported: it concerns the prompt, which this "
                f"disaggregated server's decode workers never computed (got {name}="
                f"{orjson.dumps(value).decode()[:40]})",
                param=name, code="unsupported_parameter",
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
    """The error for a stream that did not complete, from what the worker sent: an error
    finish, a cancelled finish, an error item (``message``), or a stream that ended with
    no finish reason at all. An error item that carries its exception is mapped by
    :func:`error_for_exception` instead.

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
    usage: CompletionUsage | None,
    completion_tokens: int,
    cached_tokens: int | None,
    prompt_tokens: int | None = None,
) -> dict[str, Any]:
    """OpenAI's ``usage`` object.

    Args:
        usage: the last usage a worker reported, if any; its completion count wins.
        completion_tokens: tokens counted on the stream, used when ``usage`` has none.
        cached_tokens: the **prefill** worker's ``cached_tokens`` (docs/protocols.md section 1);
            the decode worker's is ignored.
        prompt_tokens: the **prefill** worker's prompt token count, if it reported one;
            else the decode worker's.
    """
    if prompt_tokens is None:
        prompt_tokens = usage.prompt_tokens if usage is not None else 0
    prompt = prompt_tokens
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

    __slots__ = ("_chat", "_choice_end", "_choices_head", "_end", "_first", "_head", "_mid",
                 "_null_end", "_usage_head")

    def __init__(
        self, *, chat: bool, response_id: str, model: str, created: int, include_usage: bool
    ) -> None:
        kind = b"chat.completion.chunk" if chat else b"text_completion"
        head = (
            b'data: {"id":' + _dumps(response_id) + b',"object":"' + kind
            + b'","created":' + str(created).encode() + b',"model":' + _dumps(model)
        )
        usage_null = b',"usage":null' if include_usage else b""
        self._chat = chat
        self._head = head + b',"choices":[{"index":0,'
        self._choices_head = head + b',"choices":['
        self._choice_end = b"]" + usage_null + b"}\n\n"
        self._usage_head = head + b',"choices":[]'
        self._mid = b',"logprobs":null,"finish_reason":'
        self._end = b"}" + self._choice_end
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

    def choice(self, choice: Mapping[str, Any], finish_reason: str | None = None) -> bytes:
        """A chunk carrying the worker's own choice as it sent it (B8), in this response's
        envelope: one ``orjson.dumps`` of the choice.

        What the router owns is set on the way: ``index`` 0 (one choice per response), and
        for chat ``"role": "assistant"`` in the first delta if it has none, and a
        ``message`` (the prefill's own whole answer, S7) sent as the ``delta``.

        Args:
            choice: the worker's choice (``delta``, ``message`` or ``text``, ``logprobs``,
                ``finish_reason``, ``stop_reason``, ...).
            finish_reason: the OpenAI finish reason to set when the choice has none (a
                terminal whose reason the adapter knew but the choice did not carry).
        """
        fixed: dict[str, Any] | None = None
        if choice.get("index") != 0:
            fixed = dict(choice)
            fixed["index"] = 0
        if finish_reason is not None and choice.get("finish_reason") is None:
            fixed = dict(choice) if fixed is None else fixed
            fixed["finish_reason"] = finish_reason
        if self._chat:
            delta = choice.get("delta")
            if delta is None and "message" in choice:
                fixed = dict(choice) if fixed is None else fixed
                fixed["delta"] = delta = _message_delta(fixed.pop("message"))
            if self._first:
                self._first = False
                if not isinstance(delta, Mapping):
                    delta = {}
                if "role" not in delta:
                    fixed = dict(choice) if fixed is None else fixed
                    fixed["delta"] = {"role": "assistant", **delta}
        return (self._choices_head + _dumps(choice if fixed is None else fixed)
                + self._choice_end)

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The final usage chunk (``choices`` empty)."""
        return self._usage_head + b',"usage":' + _dumps(usage) + b"}\n\n"


DONE_EVENT = b"data: [DONE]\n\n"


def _message_delta(message: Any) -> dict[str, Any]:
    """A whole answer's ``message`` as a streamed ``delta``: the same fields, each tool
    call with the ``index`` a streamed tool call carries."""
    if not isinstance(message, Mapping):
        return {}
    delta = dict(message)
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        delta["tool_calls"] = [
            {"index": position, **call}
            if isinstance(call, Mapping) and "index" not in call else call
            for position, call in enumerate(calls)
        ]
    return delta


#: The fields of a chat delta that carry text, concatenated when a non-streamed answer is
#: collected (``content`` is always in the answer; the others only if the worker sent them).
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")

#: Keys of a choice the collector handles itself; any other key's lists are concatenated
#: and any other value is the last one the worker sent.
_CHOICE_KEYS = frozenset({"index", "delta", "message", "text", "logprobs", "finish_reason"})


def has_content(choice: Mapping[str, Any]) -> bool:
    """True if a worker's choice carries part of the answer (text, content, reasoning, a
    tool call): an output to count as a token when the worker sent no token ids."""
    text = choice.get("text")
    if text:
        return True
    part = choice.get("delta")
    if part is None:
        part = choice.get("message")
    if not isinstance(part, Mapping):
        return False
    return bool(part.get("tool_calls")) or any(part.get(name) for name in _TEXT_FIELDS)


def counted_tokens(choice: Mapping[str, Any]) -> int:
    """Tokens a worker's choice adds to the count used when the worker reports no usage
    and sent no token ids: one for a chunk that carries part of the answer (a streamed
    chunk is one token), else none."""
    return 1 if has_content(choice) else 0


def worker_aborted(choice: Mapping[str, Any] | None) -> bool:
    """True if the worker's own choice ends with ``finish_reason: "abort"``: the request
    did not complete, whatever the adapter made of it (B8: an abort is an error)."""
    return choice is not None and choice.get("finish_reason") == "abort"


def _merge(collected: dict[str, Any], key: str, value: Any) -> None:
    """Lists are concatenated (into a list of the collector's own, so a long answer costs
    linear time); any other value replaces an earlier one unless it is null."""
    if isinstance(value, list):
        earlier = collected.get(key)
        if isinstance(earlier, list):
            earlier.extend(value)
        else:
            collected[key] = list(value)
    elif value is not None or key not in collected:
        collected[key] = value


class ChoiceCollector:
    """Collects a worker's streamed choices into one non-streamed choice (B8).

    Chat: ``message`` with ``content`` (concatenated; null if the worker sent only tool
    calls), ``reasoning_content`` / ``reasoning`` / ``refusal`` (concatenated, only if
    sent), ``tool_calls`` (merged by ``index``: ``id``, ``type`` and ``function.name``
    from the first delta that has them, ``function.arguments`` concatenated). Completions:
    ``text`` concatenated. Both: ``logprobs`` lists concatenated key by key (chat
    ``content``; completions ``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``), ``finish_reason`` as the worker sent it, ``stop_reason`` and any
    other key as sent last (lists concatenated). A ``message`` (the prefill's own whole
    answer, S7) is collected as a delta.

    Args:
        chat: a ``chat.completion`` rather than a ``text_completion``.
    """

    __slots__ = ("_chat", "_extra", "_logprobs", "_texts", "_tool_calls")

    def __init__(self, *, chat: bool) -> None:
        self._chat = chat
        self._texts: dict[str, list[str]] = {}
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._logprobs: dict[str, Any] | None = None
        self._extra: dict[str, Any] = {}

    def add_text(self, text: str) -> None:
        """Text of an output that carries no choice (an in-process engine)."""
        self._texts.setdefault("text" if not self._chat else "content", []).append(text)

    def add(self, choice: Mapping[str, Any]) -> None:
        """One choice of the worker, as it sent it."""
        texts = self._texts
        if self._chat:
            part = choice.get("delta")
            if part is None:
                part = choice.get("message")
            if isinstance(part, Mapping):
                for name in _TEXT_FIELDS:
                    value = part.get(name)
                    if isinstance(value, str):
                        texts.setdefault(name, []).append(value)
                calls = part.get("tool_calls")
                if isinstance(calls, list):
                    self._add_tool_calls(calls)
        else:
            text = choice.get("text")
            if isinstance(text, str):
                texts.setdefault("text", []).append(text)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, Mapping):
            self._add_logprobs(logprobs)
        extra = self._extra
        for key, value in choice.items():
            if key not in _CHOICE_KEYS:
                _merge(extra, key, value)

    def _add_tool_calls(self, calls: list[Any]) -> None:
        merged = self._tool_calls
        for position, call in enumerate(calls):
            if not isinstance(call, Mapping):
                continue
            index = call.get("index")
            if type(index) is not int:
                index = position
            entry = merged.get(index)
            if entry is None:
                entry = merged[index] = {"id": None, "type": None,
                                         "function": {"name": None, "arguments": ""}}
            if entry["id"] is None and call.get("id") is not None:
                entry["id"] = call["id"]
            if entry["type"] is None and call.get("type") is not None:
                entry["type"] = call["type"]
            function = call.get("function")
            if isinstance(function, Mapping):
                target = entry["function"]
                if target["name"] is None and function.get("name") is not None:
                    target["name"] = function["name"]
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    target["arguments"] += arguments

    def _add_logprobs(self, logprobs: Mapping[str, Any]) -> None:
        if self._logprobs is None:
            self._logprobs = {}
        collected = self._logprobs
        for key, value in logprobs.items():
            _merge(collected, key, value)

    def choice(self, finish_reason: Any) -> dict[str, Any]:
        """The collected choice, ending with ``finish_reason`` (the worker's, as sent)."""
        texts = self._texts
        choice: dict[str, Any] = {"index": 0}
        if self._chat:
            message: dict[str, Any] = {"role": "assistant"}
            tool_calls = [self._tool_calls[index] for index in sorted(self._tool_calls)]
            content = texts.get("content")
            message["content"] = (
                "".join(content) if content is not None else None if tool_calls else ""
            )
            for name in _TEXT_FIELDS[1:]:
                if name in texts:
                    message[name] = "".join(texts[name])
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice["message"] = message
        else:
            choice["text"] = "".join(texts.get("text", ()))
        choice["logprobs"] = self._logprobs
        choice["finish_reason"] = finish_reason
        choice.update(self._extra)
        return choice


def completion_response(
    *, chat: bool, response_id: str, model: str, created: int, text: str,
    finish_reason: str, usage: dict[str, Any], choice: dict[str, Any] | None = None,
) -> bytes:
    """The JSON of a non-streamed ``text_completion`` or ``chat.completion``: ``choice``
    (a :class:`ChoiceCollector`'s) if given, else one made of ``text`` and
    ``finish_reason``."""
    if choice is None and chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    elif choice is None:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _dumps({
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    })
