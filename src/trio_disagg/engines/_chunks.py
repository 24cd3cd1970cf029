"""Reading a worker's OpenAI answers and server-sent events (docs/protocols.md section 1):
chunks into outputs, a read's chunks into one :class:`Burst`, finish reasons and usage, and
the worker's error objects. The per-token part of the relay (docs/performance.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import orjson

from .._protocols import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PromptTokensDetails,
    RawChoice,
    RawChoices,
)
from ._burst import Burst
from ._raw import NOT_PLAIN, Run, RunReader, Template, learn_template, utf8_text
from ._sse import normalise_line_ends, sse_data, stream_start

MESSAGE_LIMIT = 1000  # characters of a worker's message passed on
#: Templates learned in a row that carry nothing (but the chunk that taught each) after
#: which a stream is parsed: its chunks differ from each other outside their text.
UNUSED_LIMIT = 4

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

    Args:
        finish_table: the worker's finish reason names and what each means
            (:data:`FINISH`, or TensorRT-LLM's).
    """

    __slots__ = ("finish_table",)

    def __init__(self, finish_table: Mapping[str, FinishReason] = FINISH) -> None:
        self.finish_table = finish_table

    def output(self, answer: Mapping[str, Any], *, final: bool) -> LLMEngineOutput | None:
        """The output of a whole answer (``final``) or of a chunk; None for a chunk with
        nothing in it (a role-only delta, a usage chunk)."""
        return openai_output(answer, final=final, finish_table=self.finish_table)

    def add(self, chunk: Mapping[str, Any], burst: Burst) -> LLMEngineOutput | None:
        """A streamed chunk: its output if it carries the finish, else None, its output
        (if it has one) gone into ``burst`` (:func:`openai_chunk`)."""
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

    def usage(self, chunk: Mapping[str, Any]) -> CompletionUsage | None:
        """The usage of a chunk that follows the finish (OpenAI's usage chunk)."""
        return parse_usage(chunk)


class SseReader:
    """Reads a worker's server-sent events one socket read at a time (the relay's hot path,
    docs/performance.md): :meth:`feed` splits what a read brought into its events at once,
    parses each chunk (orjson) and reads it through the response's :class:`ChunkParser`.

    The common chunk is not parsed at all (the fast path, :attr:`raw_choices`): once a
    plain content chunk was parsed (one choice, ``index`` 0, non-empty text or chat
    ``delta.content`` written first, a null ``finish_reason``, no ``token_ids``, no
    ``usage``), its bytes around the text are the stream's template
    (:func:`._raw.learn_template`); a later chunk that is the template around another
    plain text (UTF-8 without a quote, a backslash or a control character: a JSON string
    as it is, so the chunk is valid JSON) goes into the burst as a
    :class:`~trio_disagg.RawChoice` of its choice's bytes, for the server to relay as
    sent (B8), with no parse. Anything else (the first chunk, a finish, usage, an error
    object, a second choice, logprobs that change, a text with an escape or a control
    character or not UTF-8) is parsed as before, and a
    parsed plain content chunk learns the template again (a ``created`` that ticks over
    costs one parsed chunk). A read that brought only such chunks is checked at once
    (:class:`._raw.RunReader`) and goes into the burst as one
    :class:`~trio_disagg.RawChoices`.

    Attributes:
        burst: the outputs of the reads fed so far that are not sent yet (the caller
            takes them, one item per read).
        final: the output that carries the finish, once a chunk brought it; a usage chunk
            after it (OpenAI's ``include_usage``) completes its usage.
        done: ``[DONE]`` came.
    """

    __slots__ = ("_fresh", "_held", "_parser", "_pending", "_runs", "_template", "_unused",
                 "burst", "done", "final")

    #: Take the fast path (False: every chunk is parsed, as a check of the fast path).
    raw_choices: ClassVar[bool] = True

    def __init__(self, parser: ChunkParser) -> None:
        self._parser = parser
        self._pending = b""  # the start of an event the next read completes
        self._held: list[bytes] = []  # reads after it without a line end
        self._fresh = True  # no byte of the stream read yet
        #: Templates learned in a row that carried no chunk but the one that taught them.
        self._unused = 0
        #: The learned bytes of the stream's common chunk.
        self._template: Template | None = None
        #: Reads a whole read's chunks as one run of the template, when they are.
        self._runs: RunReader | None = None
        self.burst = Burst()
        self.final: LLMEngineOutput | None = None
        self.done = False

    def feed(self, part: bytes) -> str | None:
        """Read the events ``part`` completes (with what earlier reads left).

        Returns:
            What is wrong with the stream, in words for an error naming the worker (a
            malformed chunk, a chunk that is not an object, an error event), else None.
            Reading stops at the first such chunk, and at ``[DONE]``.
        """
        if self._fresh:  # a byte order mark the stream starts with is no event's
            if (start := stream_start(self._pending + part)) is None:
                self._pending += part
                return None
            part, self._pending, self._fresh = start, b"", False
        if self._pending:
            if b"\n" not in part and b"\r" not in part:
                # No line end came: no event is complete (nor after a CR: _data_of). Held
                # as it is, for a long event in many reads to cost time linear in bytes.
                self._held.append(part)
                return None
            if self._held:
                part, self._held = b"".join([self._pending, *self._held, part]), []
            else:
                part = self._pending + part
        runs = self._runs
        if runs is not None and (whole := runs.whole(part)) is not None:
            # The common read: common chunks only, found with one split (no list of
            # events, no slices of each).
            texts, text, end = whole
            self._pending = part[end:]
            self.burst.add_run(RawChoices(runs.head, texts, runs.tail), text)
            self._unused = 0
            return None
        chunks = self._data_of(part)
        # Each turn reads one chunk or more from ``begin`` (no copy of what is left). A run
        # is tried at the start and after a chunk that taught a new template; the chunks
        # of a run that failed are read one by one with no other try: a read costs time
        # linear in its chunks, whatever they are (docs/performance.md).
        begin, end = 0, len(chunks)
        while begin < end:
            runs = self._runs
            if (runs is not None and (count := runs.leading(chunks, begin))
                    and (found := runs.texts(chunks[begin:begin + count])) is not None):
                # Common chunks, read at once (docs/performance.md); those with an
                # escaped text between them, one by one (they teach nothing).
                problem, begin = self._runs_of(runs, chunks, begin, begin + count, found)
                if problem is not None:
                    return problem
                continue
            problem, begin = self._one_by_one(chunks, begin, end)
            if problem is not None:
                return problem
        return None

    def _runs_of(self, runs: RunReader, chunks: list[bytes], begin: int, end: int,
                 found: list[Run]) -> tuple[str | None, int]:
        """Read ``chunks[begin:end]``, the template's, as ``found`` says: each run at
        once, each chunk between two runs on its own. Returns what is wrong (as
        :meth:`feed`) and where to go on."""
        at = begin
        for run in found:
            if begin + run.start > at:
                problem, at = self._one_by_one(chunks, at, begin + run.start)
                if problem is not None or at < begin + run.start or self.final is not None:
                    return problem, at  # (a finish can be the template's: no run after)
            self.burst.add_run(RawChoices(runs.head, run.texts, runs.tail), run.text)
            self._unused = 0
            at = begin + run.stop
        if at < end:
            return self._one_by_one(chunks, at, end)
        return None, end

    def _one_by_one(self, chunks: list[bytes], begin: int, end: int
                    ) -> tuple[str | None, int]:
        """Read ``chunks[begin:end]`` one at a time; return what is wrong (as
        :meth:`feed`) and where to go on: after a chunk that taught the stream a new
        template if the chunk after it has the template's prefix and suffix (for
        :meth:`feed` to read as a run), else ``end`` (the end of the chunks, once
        reading stopped)."""
        parser, burst = self._parser, self.burst
        # The burst's lists, until the caller takes the burst (after this read); its run
        # is made a list only when a choice joins it (not for a finish, usage or [DONE]).
        add, append, append_text = parser.add, burst.choices.append, burst.texts.append
        template = self._template
        if template is not None:
            prefix, suffix, start, tail = template
            at, after = len(prefix), len(suffix)
        for index in range(begin, end):
            data = chunks[index]
            if (template is not None and data.startswith(prefix) and data.endswith(suffix)
                    and (text := data[at:len(data) - after])
                    and len(text.translate(None, NOT_PLAIN)) == len(text)
                    and (plain := utf8_text(text)) is not None):
                # The common chunk: the template around a plain text (no escape). No parse.
                if burst.run is not None:
                    burst.spread()
                append(RawChoice(data[start:len(data) - tail]))
                self._unused = 0
                append_text(plain)
                continue
            if data == b"[DONE]":
                self.done = True
                return None, len(chunks)
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                return f"sent a malformed chunk: {data[:200]!r}", len(chunks)
            if type(chunk) is not dict:
                return f"sent a chunk that is not an object: {data[:200]!r}", len(chunks)
            if "error" in chunk or chunk.get("object") == "error":  # is_error_object, inline
                return f"reported an error: {error_text(chunk)}", len(chunks)
            if self.final is None:
                known = len(burst.choices)
                self.final = add(chunk, burst)
                if self.final is not None:  # nothing after the finish is relayed
                    self._template = template = None
                    self._runs = None
                elif (len(burst.choices) > known and self.raw_choices
                        # a chunk of the template (its text escaped) would teach it again
                        and not (template is not None and data.startswith(prefix)
                                 and data.endswith(suffix))
                        and (learned := self._learn(data, chunk)) is not None):
                    template = learned
                    prefix, suffix, start, tail = template
                    at, after = len(prefix), len(suffix)
                    following = index + 1
                    if (following < end and chunks[following].startswith(prefix)
                            and chunks[following].endswith(suffix)):
                        return None, following  # the chunks after it may be a run
            elif (usage := parser.usage(chunk)) is not None:
                self.final.completion_usage = usage
        return None, end

    def _learn(self, data: bytes, chunk: dict[str, Any]) -> Template | None:
        """Learn the template of ``data`` (parsed as ``chunk``, its choice the last the
        burst got), if it is a common chunk: the chunk then goes into the burst as a run
        of one, which the rest of its read, of the same template, joins (no choice made
        of each: docs/performance.md). None if it is not one."""
        if self._unused >= UNUSED_LIMIT:  # (logprobs, an id per chunk: no two alike)
            self._template = self._runs = None
            return None
        learned = learn_template(data, chunk)
        if learned is None:
            return None
        self._unused += 1
        self._template = learned
        self._runs = runs = RunReader(learned)
        burst = self.burst
        text = data[len(learned.prefix):len(data) - len(learned.suffix)]
        if (burst.choices[-1] is chunk["choices"][0]
                and len(text.translate(None, NOT_PLAIN)) == len(text)
                and (plain := utf8_text(text)) is not None):
            burst.choices.pop()
            burst.texts.pop()
            burst.add_run(RawChoices(runs.head, [text], runs.tail), plain)
        return learned

    def _data_of(self, part: bytes) -> list[bytes]:
        """The data of each event ``part`` completes; what is left of it waits for the
        next read."""
        if part[:6] == b"data: " and b"\r" not in part:
            # The common stream: every event is one data line. Split the complete events
            # (up to the last blank line: an event is complete there, whatever part of
            # the next one came with it) on the boundary between two, and check by
            # counting line ends that no event was anything else (a comment, a second
            # line): one split and one count in C, no copy per event.
            end = part.rfind(b"\n\n") + 2
            if end < 2:
                self._pending = part
                return []
            payloads = part[6:end - 2].split(b"\n\ndata: ")
            if part.count(b"\n", 0, end) == 2 * len(payloads):
                self._pending = part[end:]
                return payloads
        part, held = normalise_line_ends(part) if b"\r" in part else (part, b"")
        events = part.split(b"\n\n")
        # An event whose blank line a held CR ended is read now (the CR then reads as an
        # empty line: nothing), not with the next read.
        if not held or events[-1][-1:] != b"\n":
            held = events.pop() + held
        self._pending = held
        return [data for event in events if (data := sse_data(event)) is not None]


def excerpt(data: bytes) -> str:
    return repr(data[:200].decode("utf-8", "replace"))


def is_error_object(answer: Mapping[str, Any]) -> bool:
    """An OpenAI (``{"error": ...}``) or vLLM / SGLang / TRT-LLM (``{"object": "error"}``)
    error object."""
    return "error" in answer or answer.get("object") == "error"


def error_text(answer: Mapping[str, Any]) -> str:
    """The message of an OpenAI (``{"error": {...}}``), vLLM / SGLang / TRT-LLM
    (``{"object": "error", "message"}``) or FastAPI (``{"detail"}``) error object."""
    error = answer.get("error")
    if isinstance(error, Mapping):
        message = error.get("message")
        if isinstance(message, str) and message:
            return message[:MESSAGE_LIMIT]
    elif isinstance(error, str) and error:
        return error[:MESSAGE_LIMIT]
    for key in ("message", "detail"):
        value = answer.get(key)
        if isinstance(value, str) and value:
            return value[:MESSAGE_LIMIT]
    return orjson.dumps(answer).decode()[:MESSAGE_LIMIT]


def error_message(data: bytes, status: int) -> str:
    """The message of an error answer's body (JSON or text)."""
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        text = data.decode("utf-8", "replace").strip()
        return text[:MESSAGE_LIMIT] if text else f"HTTP {status}"
    if isinstance(answer, Mapping):
        return error_text(answer)
    return f"HTTP {status}"


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
    return result


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


#: Choice keys that carry no content of their own (a role-only delta carries nothing).
_BARE_DELTA_KEYS = frozenset({"role", "content"})


def _carries_more(choice: Mapping[str, Any]) -> bool:
    """Whether a chunk's choice carries something besides text (B8): a delta field other
    than ``role`` / ``content`` (``tool_calls``, ``reasoning_content``, ...), ``logprobs``
    or a ``stop_reason``."""
    if choice.get("logprobs") or choice.get("stop_reason") is not None:
        return True
    delta = choice.get("delta")
    if isinstance(delta, Mapping):
        return any(key not in _BARE_DELTA_KEYS and value not in (None, "", [], {})
                   for key, value in delta.items())
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
