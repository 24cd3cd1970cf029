"""OpenAI's responses: finish reasons, usage, streamed chunks and whole answers.

Response chunks are built by :class:`ChunkEncoder` from prebuilt byte strings, so a token
costs one ``orjson.dumps`` of its text (docs/design.md P4), and a worker's own choice, relayed
as sent (B8), one ``orjson.dumps`` of that choice, or none when it came as its bytes (a
:class:`~trio_disagg.RawChoice`). :class:`ChoiceCollector` collects a
worker's streamed choices into one answer for a client that did not stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from .._protocols import (
    CompletionUsage,
    FinishKind,
    FinishReason,
    RawChoice,
    RawChoices,
)
from ._openai_errors import ApiError

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
#: How a chat choice whose delta has no role starts, as a worker's common chunk writes it,
#: and the same with the role the first delta of a response gets.
_CONTENT_START = b'{"index":0,"delta":{"content":"'
_ROLE_START = b'{"index":0,"delta":{"role":"assistant","content":"'


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

    __slots__ = ("_between", "_chat", "_choice_end", "_choices_head", "_end", "_first", "_head",
                 "_mid", "_null_end", "_usage_head")

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
        self._between = self._choice_end + self._choices_head  # between two choice chunks
        self._usage_head = head + b',"choices":[]'
        self._mid = b',"logprobs":null,"finish_reason":'
        self._end = b"}" + self._choice_end
        self._null_end = self._mid + b"null" + self._end
        # The next chat chunk is the first (it gets the role); only chat reads it.
        self._first = chat

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
        envelope: one ``orjson.dumps`` of the choice, or its own bytes for a
        :class:`~trio_disagg.RawChoice` that needs nothing set.

        What the router owns is set on the way: ``index`` 0 (one choice per response), and
        for chat ``"role": "assistant"`` in the first delta if it has none (or a null one,
        as SGLang writes every delta after its first, role-only, chunk), and a
        ``message`` (the prefill's own whole answer, S7) sent as the ``delta``.

        Args:
            choice: the worker's choice (``delta``, ``message`` or ``text``, ``logprobs``,
                ``finish_reason``, ``stop_reason``, ...).
            finish_reason: the OpenAI finish reason to set when the choice has none (a
                terminal whose reason the adapter knew but the choice did not carry).
        """
        if type(choice) is RawChoice:
            if finish_reason is None:
                # Its index is 0 and it has no finish (the reader checked its bytes).
                if not self._first:
                    return self._choices_head + choice.raw + self._choice_end
                # a first chat delta: its role (read it if it may have one of its own)
                if choice.raw.startswith(_CONTENT_START) and b'"role"' not in choice.raw:
                    self._first = False
                    return (self._choices_head + _ROLE_START
                            + choice.raw[len(_CONTENT_START):] + self._choice_end)
            choice = dict(choice)  # read it
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
                if delta.get("role") is None:  # none, or SGLang's "role": null
                    fixed = dict(choice) if fixed is None else fixed
                    fixed["delta"] = {"role": "assistant", **delta}
                    fixed["delta"]["role"] = "assistant"
        return (self._choices_head + _dumps(choice if fixed is None else fixed)
                + self._choice_end)

    def choices(self, choices: Sequence[Mapping[str, Any]]) -> list[bytes]:
        """A chunk for each choice (:meth:`choice`), without a call per
        :class:`~trio_disagg.RawChoice` once the role went out, and a run
        (:class:`~trio_disagg.RawChoices`) in one join (the relay's per-token path,
        docs/performance.md)."""
        if self._first:
            return list(map(self.choice, choices))
        if type(choices) is RawChoices:
            head, tail = self._choices_head + choices.head, choices.tail + self._choice_end
            return [head + (tail + head).join(choices.texts) + tail]
        raws = [choice.raw for choice in choices if type(choice) is RawChoice]
        if len(raws) == len(choices):  # the common burst: one join
            return [self._choices_head + self._between.join(raws) + self._choice_end]
        head, end = self._choices_head, self._choice_end
        return [head + choice.raw + end if type(choice) is RawChoice else self.choice(choice)
                for choice in choices]

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The final usage chunk (``choices`` empty)."""
        return self._usage_head + b',"usage":' + _dumps(usage) + b"}\n\n"


DONE_EVENT = b"data: [DONE]\n\n"
#: How every chunk of a response with ``include_usage`` ends (:class:`ChunkEncoder`).
USAGE_NULL_END = b',"usage":null}\n\n'


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
    and sent no token ids: its log probabilities' entries if it has some (one per token,
    with a text or not: vLLM holds back the text of a token that ends inside a UTF-8
    character), else one for a chunk that carries part of the answer (a streamed chunk is
    one token), else none. A :class:`~trio_disagg.RawChoice` is one, unread: the reader
    made it only of a choice with text."""
    if type(choice) is RawChoice:
        return 1
    logprobs = choice.get("logprobs")
    if logprobs and isinstance(logprobs, Mapping):  # completions' tokens, chat's content
        entries = logprobs.get("tokens", logprobs.get("content"))
        if type(entries) is list and entries:
            return len(entries)
    return 1 if has_content(choice) else 0


def choice_tokens(choice: Mapping[str, Any]) -> int:
    """Completion tokens (tokens) one streamed choice of a worker stands for: its
    ``token_ids`` if it sent them, else :func:`counted_tokens` (the final usage's count
    when the worker reports none)."""
    if type(choice) is not RawChoice:
        ids = choice.get("token_ids")
        if type(ids) is list:
            return len(ids)
    return counted_tokens(choice)


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

    Chat: ``message`` with ``content`` (concatenated; null if the worker sent no content
    but tool calls, reasoning or a refusal), ``reasoning_content`` / ``reasoning`` /
    ``refusal`` (concatenated, only if sent), ``tool_calls`` (merged by ``index``: ``id``,
    ``type`` and ``function.name`` from the first delta that has them,
    ``function.arguments`` concatenated). Completions:
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
            message["content"] = "".join(texts.get("content", ()))
            for name in _TEXT_FIELDS[1:]:
                if name in texts:
                    message[name] = "".join(texts[name])
            if not message["content"] and (tool_calls or any(
                    message.get(name) for name in _TEXT_FIELDS[1:])):
                # only tool calls, reasoning or a refusal: no content, as the worker's own
                # whole answer (vLLM's, OpenAI's) says it, not an empty string
                message["content"] = None
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
