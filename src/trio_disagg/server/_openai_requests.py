"""OpenAI's request bodies at the edge, structured and validated.

Request bodies are structured into attrs classes by a strict cattrs converter (no coercion:
``"3"`` is not an integer, ``true`` is not a number), the same idea as
:data:`trio_disagg.converter`. Unknown keys are allowed and kept: the client's whole body
goes to the workers. Every problem becomes an :class:`ApiError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NewType

import attrs
import cattrs
import cattrs.cols
import cattrs.gen
import orjson

from .._protocols import (
    describe_value,
    make_strict_converter,
    wire_problems,
)
from ._openai_errors import ApiError

#: A completions ``prompt``: a string or a list of token ids (a batch of one is unwrapped).
Prompt = NewType("Prompt", object)
#: ``stop``: a string or a list of strings.
Stop = NewType("Stop", object)
#: A chat message's ``content``: a string or a list of content parts (objects with a type).
Content = NewType("Content", object)
#: A chat's ``tool_choice``: a string (``"none"``, ``"auto"``, ``"required"``) or an object
#: (a named tool).
ToolChoice = NewType("ToolChoice", object)

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
    """One message of a chat completion request. Its ``role`` is any string: a chat
    template may define roles of its own (Llama 3's ``ipython``), which vLLM and
    TensorRT-LLM take; a worker that does not refuses the request itself (B8)."""

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
    tool_choice: ToolChoice | None = None


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(token) is int for token in value)


def _is_batch(value: Any) -> bool:
    """Several prompts in one request (vLLM answers each with a choice of its own)."""
    return isinstance(value, list) and len(value) > 1 and all(
        isinstance(item, str) or (_is_token_list(item) and item) for item in value)


def _structure_prompt(value: Any, _: type) -> Any:
    if isinstance(value, str) or (_is_token_list(value) and value):
        return value
    if isinstance(value, list) and len(value) == 1:
        (only,) = value
        if isinstance(only, str) or (_is_token_list(only) and only):
            return value
    if _is_batch(value):
        return value  # well typed; refused by check_completion, as n > 1 is
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


def _structure_tool_choice(value: Any, _: type) -> Any:
    if isinstance(value, str | Mapping):
        return value
    raise TypeError(f"expected a string or an object, got {describe_value(value)}")


def _make_converter() -> cattrs.Converter:
    conv = make_strict_converter()
    conv.register_structure_hook(Prompt, _structure_prompt)
    conv.register_structure_hook(Stop, _structure_stop)
    conv.register_structure_hook(Content, _structure_content)
    conv.register_structure_hook(ToolChoice, _structure_tool_choice)
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
        ApiError: 400 ``invalid_json`` for malformed JSON (or an empty body), or JSON
            nested deeper than :data:`MAX_DEPTH` levels (orjson reads 1024, but writes
            only 255: the body could not be sent on to a worker).
    """
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON in request body: {exc}", code="invalid_json") from None
    # (two counts in C: a body with fewer brackets than that cannot be nested that deep)
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH and _too_deep(body):
        raise ApiError(400, f"request body nested deeper than {MAX_DEPTH} levels",
                       code="invalid_json")
    return body


#: The deepest nesting of a request body the router takes: the adapters write it again
#: (orjson writes 255 levels), some a level or two deeper than the client did.
MAX_DEPTH = 200
#: The deepest nesting orjson writes.
_WRITTEN_DEPTH = 255


def _too_deep(body: Any) -> bool:
    """Whether ``body`` nests deeper than :data:`MAX_DEPTH`: written by orjson (in C, as
    fast as the body was read) inside enough lists to take it past what orjson writes."""
    wrapped = body
    for _ in range(_WRITTEN_DEPTH - MAX_DEPTH):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except orjson.JSONEncodeError:
        return True
    return False


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
    """Chat-only checks: at least one message, ``top_logprobs`` only with ``logprobs``,
    each tool a function with a name, a ``tool_choice`` that calls a tool (``"required"``
    or a named one) only with tools. A message's role is the worker's to judge (any
    string passes: :class:`ChatMessage`).

    Raises:
        ApiError: 400 naming the offending field.
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
    choice: object = request.tool_choice
    if not request.tools and (choice == "required" or isinstance(choice, Mapping)):
        # (As OpenAI. A prefill asked to call a tool it does not have fails once its KV
        # is staged, leaving the KV to its worker's lease: refused before any worker.)
        raise ApiError(400, "tool_choice that calls a tool needs tools: none was given",
                       param="tool_choice", code="invalid_value")


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
    """Completions-only checks: a non-empty prompt, and only one (a batch of several is
    refused as ``n`` > 1 is: one choice per response), token ids not negative,
    ``logprobs`` between 0 and 20 (the bound chat's ``top_logprobs`` has, vLLM's default
    ``max_logprobs``), no ``best_of`` > 1.

    Raises:
        ApiError: 400.
    """
    if isinstance(request.prompt, str) and not request.prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if _is_batch(request.prompt):
        raise ApiError(400, "batched prompts (a list of several prompts) are not supported: "
                       "one choice per response; send one request per prompt",
                       param="prompt", code="unsupported_value")
    prompt = request.prompt
    ids = prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], list) else prompt
    # A list of token ids here is all ints (typed already): min() scans it in C.
    if isinstance(ids, list) and ids and type(ids[0]) is int and min(ids) < 0:
        raise ApiError(400, "prompt: a token id must not be negative", param="prompt",
                       code="invalid_value")
    if request.logprobs is not None and not 0 <= request.logprobs <= 20:
        raise ApiError(400, f"logprobs must be between 0 and 20, got {request.logprobs}",
                       param="logprobs", code="invalid_value")
    if request.best_of is not None and request.best_of != 1:
        raise ApiError(400, f"best_of other than 1 is not supported (got {request.best_of})",
                       param="best_of", code="unsupported_value")
