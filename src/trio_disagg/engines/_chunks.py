"""Reading a worker's OpenAI answers and stream chunks (docs/protocols.md section 1): chunks
into outputs or into one :class:`Burst`, finish reasons and usage, and the top-level fields
relayed with a choice (B8). The per-token part of the relay (docs/performance.md), with
:class:`._reader.SseReader`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._protocols import (
    ChunkChoice,
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PromptTokensDetails,
)
from ._burst import Burst
from ._fields import ENVELOPE, PLUMBING, relayed_fields, with_fields

#: Worker finish reasons (OpenAI and engine spellings) and what they mean to the router.
FINISH: Mapping[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED,
    "cancelled": FinishReason.CANCELLED,
    "eos": FinishReason.EOS,
    "content_filter": FinishReason.CONTENT_FILTER,
    # tool-call parsers end a turn this way: a complete answer.
    "tool_calls": FinishReason.STOP,
    "function_call": FinishReason.STOP,
}


class ChunkParser:
    """Turns an OpenAI answer or stream chunk into outputs. One per response; a protocol
    with stateful chunks (SGLang's native cumulative text) subclasses it.

    A chunk's or an answer's top-level fields that are neither the router's envelope nor
    the worker's plumbing (``withheld``) go with its choice, a
    :class:`~trio_disagg.ChunkChoice` (B8); those of a chunk whose choice is not relayed
    (a role-only first delta) go with the next choice.

    Args:
        finish_table: the worker's finish reason names and what each means
            (:data:`FINISH`, or TensorRT-LLM's).
        withheld: the top-level fields the worker's protocol uses for its own plumbing,
            never relayed (:data:`._fields.PLUMBING`, the default, or a protocol's own).
    """

    __slots__ = ("finish_table", "kept", "pending")

    def __init__(self, finish_table: Mapping[str, FinishReason] = FINISH,
                 withheld: frozenset[str] = PLUMBING) -> None:
        self.finish_table = finish_table
        #: The top-level keys that are not relayed: the envelope and ``withheld``.
        self.kept = ENVELOPE | withheld
        #: Fields of a chunk whose choice was not relayed, for the next choice.
        self.pending: dict[str, Any] | None = None

    def output(self, answer: Mapping[str, Any], *, final: bool) -> LLMEngineOutput | None:
        """The output of a whole answer (``final``) or of a chunk; None for a chunk with
        nothing in it (a role-only delta, a usage chunk)."""
        output = openai_output(answer, final=final, finish_table=self.finish_table)
        if output is not None and output.choices and not answer.keys() <= self.kept:
            output.choices = [with_fields(output.choices[0],
                                          relayed_fields(answer, self.kept))]
        return output

    def add(self, chunk: Mapping[str, Any], burst: Burst) -> LLMEngineOutput | None:
        """A streamed chunk: its output if it carries the finish, else None, its output
        (if it has one) gone into ``burst`` (:func:`openai_chunk`)."""
        if self.pending is not None or not chunk.keys() <= self.kept:
            return self._add_fields(chunk, burst)  # a field to relay: not the common chunk
        # The common chunk, read inline (this runs once per token): one dict choice with
        # some text or delta content, no finish, no token ids, no usage.
        choices = chunk.get("choices")
        if (type(choices) is list and choices and type(choice := choices[0]) is dict
                and choice.get("finish_reason") is None):
            if "text" in choice:
                text = choice["text"]
            elif type(delta := choice.get("delta")) is dict:
                text = delta.get("content")
            else:
                text = None
            if (type(text) is str and text and "token_ids" not in choice
                    and chunk.get("usage") is None):
                if burst.run is not None:
                    burst.spread()
                burst.choices.append(choice)
                burst.texts.append(text)
                return None
        return openai_chunk(chunk, burst, self.finish_table)

    def _add_fields(self, chunk: Mapping[str, Any], burst: Burst) -> LLMEngineOutput | None:
        """:meth:`add` for a chunk with fields to relay, or after one whose choice was not
        relayed: its choice, if relayed, carries them all; else they wait."""
        fields = relayed_fields(chunk, self.kept)
        if (pending := self.pending) is not None:
            # Updated in place: a copy per chunk would cost a stream of field-only
            # chunks, each with a key of its own, time quadratic in its length.
            pending.update(fields)
            fields = pending
        known = len(burst.choices)
        final = openai_chunk(chunk, burst, self.finish_table)
        if final is not None and final.choices:
            final.choices = [with_fields(final.choices[0], fields)]
        elif len(burst.choices) > known:  # (its choice is the last: a run was spread)
            burst.choices[-1] = with_fields(burst.choices[-1], fields)
        else:
            self.pending = fields or None
            return final
        self.pending = None
        return final

    def late(self, chunk: Mapping[str, Any], final: LLMEngineOutput) -> None:
        """Read ``chunk``, a chunk after ``final``, the output with the finish (OpenAI's
        usage chunk, which the router answers with its own): its usage completes
        ``final``'s, and its relayed fields go with ``final``'s choice."""
        if (usage := self.usage(chunk)) is not None:
            final.completion_usage = usage
        if final.choices and not chunk.keys() <= self.kept:
            last = final.choices[-1]
            fields = relayed_fields(chunk, self.kept)
            if type(last) is ChunkChoice:
                last.fields.update(fields)  # in place (as pending: linear time)
            else:
                final.choices = [*final.choices[:-1], with_fields(last, fields)]

    def usage(self, chunk: Mapping[str, Any]) -> CompletionUsage | None:
        """The usage of a chunk that follows the finish (OpenAI's usage chunk)."""
        return parse_usage(chunk)


def count(value: Any) -> int:
    """``value`` if it is a non-negative int, else 0 (no count: a worker's negative or
    mistyped token count is not passed on to the client)."""
    return value if type(value) is int and value >= 0 else 0


def make_usage(prompt: int, completion: int, total: int, cached: Any) -> CompletionUsage:
    """A usage with ``cached_tokens`` if it is a non-negative int."""
    return CompletionUsage(
        prompt_tokens=prompt, completion_tokens=completion,
        total_tokens=total or prompt + completion,
        prompt_tokens_details=(PromptTokensDetails(cached_tokens=cached)
                               if type(cached) is int and cached >= 0 else None),
    )


def parse_usage(answer: Mapping[str, Any]) -> CompletionUsage | None:
    """The ``usage`` object of an OpenAI answer or chunk, if it has one."""
    usage = answer.get("usage")
    if usage is None or not isinstance(usage, Mapping):  # None first: no ABC check per chunk
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    result = make_usage(count(usage.get("prompt_tokens")), count(usage.get("completion_tokens")),
                        count(usage.get("total_tokens")), cached)
    if isinstance(details, Mapping) and result.prompt_tokens_details is None:
        result.prompt_tokens_details = PromptTokensDetails()
    if not usage.keys() <= _OWNED_USAGE:
        # (B8: the fields the router does not own, such as completion_tokens_details)
        result.extra = {key: value for key, value in usage.items()
                        if key not in _OWNED_USAGE} or None
    return result


#: The usage fields the router answers itself (docs/router.md, "What the router relays,
#: and what it owns"); any other field of a worker's usage is relayed as sent.
_OWNED_USAGE = frozenset({"prompt_tokens", "completion_tokens", "total_tokens",
                          "prompt_tokens_details"})


def parse_finish(value: Any, table: Mapping[str, FinishReason] = FINISH) -> FinishReason | None:
    """A worker's ``finish_reason``: ``error`` -> an error finish, a name of ``table`` ->
    its reason, any other string -> ``STOP``, ``{"error": msg}`` -> an error finish."""
    if value is None:
        return None
    if isinstance(value, str):
        if value == "error":
            return FinishReason.error("the worker ended the request with finish_reason error")
        return table.get(value, FinishReason.STOP)
    if isinstance(value, Mapping) and isinstance(value.get("error"), str):
        return FinishReason.error(value["error"])
    return FinishReason.error(f"malformed finish_reason {value!r:.60}")


def first_choice(answer: Mapping[str, Any]) -> Mapping[str, Any] | None:
    choices = answer.get("choices")
    if type(choices) is not list or not choices:
        return None
    choice = choices[0]
    return choice if type(choice) is dict or isinstance(choice, Mapping) else None


def choices_beyond_one(answer: Mapping[str, Any]) -> str | None:
    """What is wrong with an answer or a chunk that carries more than one choice, in
    words for an error naming the worker; None if it carries one or none. The router
    asks each worker for one choice (it refuses ``n`` and ``best_of`` > 1): a second is
    the worker's fault, never dropped without a word (B8)."""
    choices = answer.get("choices")
    if type(choices) is list and len(choices) > 1:
        return f"sent {len(choices)} choices in one answer; the router asked for one"
    return None


#: Choice and delta keys that carry nothing of their own (a role-only delta, an empty
#: text): anything else that is not empty is worth a chunk to the client (B8).
_BARE_CHOICE_KEYS = frozenset({"index", "text", "delta", "message", "finish_reason"})
_BARE_DELTA_KEYS = frozenset({"role", "content"})
_EMPTY: tuple[Any, ...] = (None, "", [], {})


def _carries_more(choice: Mapping[str, Any]) -> bool:
    """Whether a chunk's choice carries something besides text (B8): a delta field other
    than ``role`` / ``content`` (``tool_calls``, ``reasoning_content``, ...), or any
    other field of the choice (``logprobs``, a ``stop_reason``, vLLM's
    ``prompt_token_ids``, a field a newer worker adds) that is not empty."""
    for key, value in choice.items():
        if key == "delta":
            if isinstance(value, Mapping) and any(
                    name not in _BARE_DELTA_KEYS and part not in _EMPTY
                    for name, part in value.items()):
                return True
        elif key not in _BARE_CHOICE_KEYS and value not in _EMPTY:
            return True
    return False


def openai_output(
    answer: Mapping[str, Any],
    *,
    final: bool,
    finish_table: Mapping[str, FinishReason] = FINISH,
) -> LLMEngineOutput | None:
    """The output of an OpenAI completion answer or chunk (``final``: a whole answer,
    whose usage is taken too); None for a chunk with nothing in it (a role-only delta, a
    usage chunk).

    The output's :attr:`~trio_disagg.LLMEngineOutput.choices` holds the worker's own
    ``choices[0]``, untouched, for the server to relay as sent (B8); a chunk whose choice
    carries anything besides text (tool calls, reasoning, logprobs, a ``stop_reason``) is
    an output even without text. ``text`` is the choice's text or ``content``, and the
    finish is mapped through ``finish_table`` (``tool_calls`` is a ``STOP``, ``abort``
    a ``CANCELLED``), for the router's own use."""
    choice = first_choice(answer)
    if choice is None:
        return None
    text, token_ids = _text_and_ids(choice)
    finish = parse_finish(choice.get("finish_reason"), finish_table)
    usage = parse_usage(answer)
    if (not text and not token_ids and finish is None and not final
            and not _carries_more(choice)):
        return None
    index = choice.get("index")
    return LLMEngineOutput(
        token_ids=token_ids, text=text or None, finish_reason=finish,
        completion_usage=usage, index=index if type(index) is int and index else None,
        choices=[choice],
    )


def openai_chunk(
    chunk: Mapping[str, Any], burst: Burst, finish_table: Mapping[str, FinishReason] = FINISH
) -> LLMEngineOutput | None:
    """A streamed OpenAI chunk read into ``burst`` (the relay's per-token path): the same
    reading as :func:`openai_output`, without an output object per token.

    Returns:
        The chunk's output if it carries a finish reason (the burst is left alone), else
        None: a chunk with something in it went into ``burst``, one with nothing (a
        role-only delta, a usage chunk) was skipped.
    """
    choice = first_choice(chunk)
    if choice is None:
        return None
    if choice.get("finish_reason") is not None:
        return openai_output(chunk, final=False, finish_table=finish_table)
    text, token_ids = _text_and_ids(choice)
    if text or token_ids or _carries_more(choice):
        burst.add_parts(choice, text, token_ids, parse_usage(chunk))
    return None


def _text_and_ids(choice: Mapping[str, Any]) -> tuple[str | None, list[int]]:
    """A choice's ``text`` (or its ``delta`` / ``message`` ``content``), and its
    ``token_ids`` if it sent a list of ints."""
    text: Any
    if "text" in choice:
        text = choice["text"]
    else:
        part = choice.get("delta") if "delta" in choice else choice.get("message")
        text = part.get("content") if type(part) is dict or isinstance(part, Mapping) else None
    ids = choice.get("token_ids")
    if ids is None or type(ids) is not list or not all(type(i) is int for i in ids):
        ids = []
    return (text if type(text) is str else None), ids
