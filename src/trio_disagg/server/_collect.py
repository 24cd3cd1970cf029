"""A worker's streamed choices collected into one answer, for a client that did not stream
(B8, docs/router.md "A client that does not stream still gets a streamed decode")."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .._protocols import ChunkChoice
from ._openai_responses import TEXT_FIELDS

if TYPE_CHECKING:
    from .._router import DisaggRouter

#: Keys of a choice the collector handles itself; any other key's lists are concatenated
#: and any other value is the last one the worker sent.
_CHOICE_KEYS = frozenset({"index", "delta", "message", "text", "logprobs", "finish_reason"})

#: Keys of a chat delta the collector handles itself (``role`` is the answer's own,
#: ``"assistant"``); any other key is collected by :func:`_merge_fragment`.
_DELTA_KEYS = frozenset({"role", "tool_calls", *TEXT_FIELDS})


#: Keys of a tool call's delta (and of its ``function``) the collector merges itself;
#: any other key is collected as :func:`_merge` says (B8).
_CALL_KEYS = frozenset({"index", "id", "type", "function"})
_FUNCTION_KEYS = frozenset({"name", "arguments"})

EMPTY: Mapping[str, Any] = MappingProxyType({})


def _merge(collected: dict[str, Any], key: str, value: Any) -> None:
    """Lists are concatenated (into a list of the collector's own, so a long answer costs
    linear time); any other value replaces an earlier one unless it is null (a list after
    a string's fragments too: a value of another kind is the last sent)."""
    if isinstance(value, list):
        earlier = collected.get(key)
        if type(earlier) is list:
            earlier.extend(value)
        else:
            collected[key] = list(value)
    elif value is not None or key not in collected:
        collected[key] = value


def _merge_fragment(collected: dict[str, Any], key: str, value: Any) -> None:
    """A delta field the collector does not know: a string is a fragment, concatenated
    to the one before it (what a client rebuilding the stream gets, as for
    ``content``); lists and anything else as :func:`_merge`."""
    if isinstance(value, str):
        earlier = collected.get(key)
        if isinstance(earlier, _Fragments):
            earlier.append(value)
        else:
            collected[key] = _Fragments((value,))
    else:
        _merge(collected, key, value)


class _Fragments(list[str]):
    """The string fragments of one delta field, joined when the answer is made (a long
    answer costs linear time)."""

    __slots__ = ()


class ChoiceCollector:
    """Collects a worker's streamed choices into one non-streamed choice (B8).

    Chat: ``message`` with ``content`` (concatenated; null if the worker sent no content
    but tool calls, reasoning or a refusal), ``reasoning_content`` / ``reasoning`` /
    ``refusal`` (concatenated, only if sent), ``tool_calls`` (merged by ``index``: ``id``,
    ``type`` and ``function.name`` from the first delta that has them,
    ``function.arguments`` concatenated; a call's or its function's other fields as a
    choice's other keys). Completions:
    ``text`` concatenated. Both: ``logprobs`` lists concatenated key by key (chat
    ``content``; completions ``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``), ``finish_reason`` as the worker sent it, ``stop_reason`` and any
    other key as sent last (lists concatenated). A chat delta's other fields (one a
    newer worker adds) go in the ``message``: a string concatenated (a fragment, as
    ``content``), a list concatenated, anything else as last sent. A ``message`` (the
    prefill's own whole answer, S7) is collected as a delta. The top-level fields the
    worker's chunks carried beside their choices (a :class:`~trio_disagg.ChunkChoice`)
    are :attr:`fields`, collected as a choice's other keys are.

    Args:
        chat: a ``chat.completion`` rather than a ``text_completion``.
        whole_message: the fields the worker's own whole chat answer carries in its
            ``message`` even when it generated nothing for them, with that value
            (``HttpEngine.whole_message``: vLLM's ``tool_calls: []``); a field the
            stream filled keeps what it sent.
    """

    __slots__ = ("_chat", "_extra", "_logprobs", "_message", "_texts", "_tool_calls",
                 "_whole_message", "fields")

    def __init__(self, *, chat: bool, whole_message: Mapping[str, Any] = EMPTY) -> None:
        self._chat = chat
        self._whole_message = whole_message
        self._texts: dict[str, list[str]] = {}
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._logprobs: dict[str, Any] | None = None
        self._extra: dict[str, Any] = {}
        self._message: dict[str, Any] = {}  # a delta's other fields
        #: The worker's top-level fields to relay beside the answer's choice (B8).
        self.fields: dict[str, Any] = {}

    def add_text(self, text: str) -> None:
        """Text of an output that carries no choice (an in-process engine)."""
        self._texts.setdefault("text" if not self._chat else "content", []).append(text)

    def add(self, choice: Mapping[str, Any]) -> None:
        """One choice of the worker, as it sent it."""
        if self._chat:
            part = choice.get("delta")
            if part is None:
                part = choice.get("message")
            if isinstance(part, Mapping):
                self._add_delta(part)
        else:
            text = choice.get("text")
            if isinstance(text, str):
                self._texts.setdefault("text", []).append(text)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, Mapping):
            self._add_logprobs(logprobs)
        extra = self._extra
        for key, value in choice.items():
            if key not in _CHOICE_KEYS:
                _merge(extra, key, value)
        if type(choice) is ChunkChoice:
            fields = self.fields
            for key, value in choice.fields.items():
                _merge(fields, key, value)

    def _add_delta(self, part: Mapping[str, Any]) -> None:
        texts = self._texts
        for name in TEXT_FIELDS:
            value = part.get(name)
            if isinstance(value, str):
                texts.setdefault(name, []).append(value)
        calls = part.get("tool_calls")
        if isinstance(calls, list):
            self._add_tool_calls(calls)
        if len(part) > 1 or "content" not in part:  # (the common delta: its content only)
            message = self._message
            for key, value in part.items():
                if key not in _DELTA_KEYS:
                    _merge_fragment(message, key, value)

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
            if not call.keys() <= _CALL_KEYS:  # (the common call: none other)
                for key, value in call.items():
                    if key not in _CALL_KEYS:
                        _merge(entry, key, value)
            function = call.get("function")
            if isinstance(function, Mapping):
                target = entry["function"]
                if target["name"] is None and function.get("name") is not None:
                    target["name"] = function["name"]
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    target["arguments"] += arguments
                if not function.keys() <= _FUNCTION_KEYS:
                    for key, value in function.items():
                        if key not in _FUNCTION_KEYS:
                            _merge(target, key, value)

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
            for name in TEXT_FIELDS[1:]:
                if name in texts:
                    message[name] = "".join(texts[name])
            if not message["content"] and (tool_calls or any(
                    message.get(name) for name in TEXT_FIELDS[1:])):
                # only tool calls, reasoning or a refusal: no content, as the worker's own
                # whole answer (vLLM's, OpenAI's) says it, not an empty string
                message["content"] = None
            if tool_calls:
                message["tool_calls"] = tool_calls
            for key, value in self._message.items():
                message[key] = "".join(value) if type(value) is _Fragments else value
            for key, value in self._whole_message.items():
                if message.get(key) is None:
                    message[key] = list(value) if type(value) is list else value
            choice["message"] = message
        else:
            choice["text"] = "".join(texts.get("text", ()))
        choice["logprobs"] = self._logprobs
        choice["finish_reason"] = finish_reason
        choice.update(self._extra)
        return choice


def whole_messages(router: DisaggRouter) -> dict[str, Mapping[str, Any]]:
    """The fields each worker's own whole chat answer carries in its ``message`` (its
    adapter's ``whole_message``), by worker name; an in-process engine, whose outputs
    carry no choice to collect, has none."""
    found: dict[str, Mapping[str, Any]] = {}
    for pool in (router.prefill, router.decode):
        for worker in pool.workers:
            fields = getattr(worker.engine, "whole_message", None)
            if isinstance(fields, Mapping) and fields:
                found[worker.name] = fields
    return found
