"""OpenAI's responses: finish reasons, usage, streamed chunks and whole answers.

Response chunks are built by :class:`ChunkEncoder` from prebuilt byte strings, so a token
costs one ``orjson.dumps`` of its text (docs/design.md P4), and a worker's own choice, relayed
as sent (B8), one ``orjson.dumps`` of that choice, or none when it came as its bytes (a
:class:`~trio_disagg.RawChoice`). :class:`._collect.ChoiceCollector` collects a
worker's streamed choices into one answer for a client that did not stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from .._protocols import (
    ChunkChoice,
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
        usage: the last usage a worker reported, if any; its completion count wins, and
            its fields the router does not own (:attr:`~trio_disagg.CompletionUsage.extra`)
            are added as sent.
        completion_tokens: tokens counted on the stream, used when ``usage`` has none.
        cached_tokens: the **prefill** worker's ``cached_tokens`` (docs/protocols.md section 1);
            the decode worker's is ignored. None (the worker counted none):
            ``prompt_tokens_details`` is null.
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
    answer = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # (null as the worker's own: a prefill that counts no cache hits, vLLM's without
        # --enable-prompt-tokens-details, is not reported as one that found none, B8)
        "prompt_tokens_details": (None if cached_tokens is None
                                  else {"cached_tokens": cached_tokens}),
    }
    if usage is not None and usage.extra:
        answer.update(usage.extra)  # the worker's own fields, as sent (B8)
    return answer


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

    __slots__ = ("_between", "_chat", "_choice_end", "_choices_head", "_end", "_fields_end",
                 "_first", "_head", "_mid", "_null_end", "_usage_head")

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
        self._fields_end = usage_null + b"}\n\n"  # after a worker's fields (B8)
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

        A :class:`~trio_disagg.ChunkChoice`'s :attr:`~trio_disagg.ChunkChoice.fields`
        go at the top level of its chunk, after ``choices`` and before ``usage``.

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
        fields = choice.fields if type(choice) is ChunkChoice else None
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
        body = self._choices_head + _dumps(choice if fixed is None else fixed)
        if not fields:  # (none, or an in-process engine's ChunkChoice without one)
            return body + self._choice_end
        # the worker's other top-level fields, after the choices, before the usage
        return body + b"]," + _dumps(fields)[1:-1] + self._fields_end

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
    call with the ``index`` a streamed tool call carries. An empty ``tool_calls`` (vLLM's
    whole answer has one when no tool was called) is left out, as the worker's own
    stream leaves it: a client reads a delta's ``[]`` as a list, not as None."""
    if not isinstance(message, Mapping):
        return {}
    delta = dict(message)
    calls = delta.get("tool_calls")
    if calls == []:
        del delta["tool_calls"]
    elif isinstance(calls, list):
        delta["tool_calls"] = [
            {"index": position, **call}
            if isinstance(call, Mapping) and "index" not in call else call
            for position, call in enumerate(calls)
        ]
    return delta


#: The fields of a chat delta that carry text, concatenated when a non-streamed answer is
#: collected (``content`` is always in the answer; the others only if the worker sent them).
TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")


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
    return bool(part.get("tool_calls")) or any(part.get(name) for name in TEXT_FIELDS)


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


def completion_response(
    *, chat: bool, response_id: str, model: str, created: int, text: str,
    finish_reason: str, usage: dict[str, Any], choice: dict[str, Any] | None = None,
    fields: Mapping[str, Any] | None = None,
) -> bytes:
    """The JSON of a non-streamed ``text_completion`` or ``chat.completion``: ``choice``
    (a :class:`~._collect.ChoiceCollector`'s) if given, else one made of ``text`` and
    ``finish_reason``; ``fields``, the worker's top-level fields the router relays (B8),
    after the router's own."""
    if choice is None and chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    elif choice is None:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    answer = {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }
    if fields:
        answer.update(fields)
    return _dumps(answer)
