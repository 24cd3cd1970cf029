"""Reading a worker's server-sent events one socket read at a time (the relay's hot path,
docs/performance.md): each chunk read through the response's :class:`._chunks.ChunkParser`,
the common chunk carried as its bytes (:mod:`._raw`)."""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from .._protocols import LLMEngineOutput, RawChoice, RawChoices
from ._burst import Burst
from ._chunks import ChunkParser, choices_beyond_one
from ._raw import NOT_PLAIN, Run, RunReader, Template, Whole, learn_template, utf8_text
from ._sse import normalise_line_ends, sse_data, stream_start
from ._worker_errors import REPORTED_ERROR, error_text

#: Templates learned in a row that carry nothing (but the chunk that taught each) after
#: which a stream is parsed: its chunks differ from each other outside their text.
UNUSED_LIMIT = 4

#: Bytes of one event the reader holds while its end has not come: what a whole answer
#: may be (``JSON_BODY_LIMIT``). A worker that sends more without a blank line is wrong.
EVENT_BYTES_LIMIT = 16 * 1024 * 1024


def chunk_problem(chunk: dict[str, Any]) -> str | None:
    """What is wrong with a parsed chunk, in words for an error naming the worker: an
    error object, or more than one choice (:func:`._chunks.choices_beyond_one`)."""
    if "error" in chunk or chunk.get("object") == "error":  # is_error_object, inline
        return f"{REPORTED_ERROR}{error_text(chunk)}"
    return choices_beyond_one(chunk)


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
    :class:`~trio_disagg.RawChoices`. A chunk with top-level fields to relay (B8, its
    choice a :class:`~trio_disagg.ChunkChoice`) teaches no template, and one whose fields
    wait for the next choice (:attr:`._chunks.ChunkParser.pending`) drops the template
    until a parsed chunk took them.

    Attributes:
        burst: the outputs of the reads fed so far that are not sent yet (the caller
            takes them, one item per read).
        final: the output that carries the finish, once a chunk brought it; a usage chunk
            after it (OpenAI's ``include_usage``) completes its usage.
        done: ``[DONE]`` came, or the usage chunk after the finish (the last event before
            it: the answer is complete).
    """

    __slots__ = ("_fresh", "_held", "_held_bytes", "_last", "_parser", "_pending", "_runs",
                 "_template", "_unused", "burst", "done", "final")

    #: Take the fast path (False: every chunk is parsed, as a check of the fast path).
    raw_choices: ClassVar[bool] = True

    def __init__(self, parser: ChunkParser) -> None:
        self._parser = parser
        self._pending = b""  # the start of an event the next read completes
        self._held: list[bytes] = []  # reads after it that did not end it
        self._held_bytes = 0  # their length
        self._last = b""  # the last bytes held (a line end split between two reads)
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
            A chunk with more than one choice is wrong too (the router asks for one).
            Reading stops at the first such chunk, and at ``[DONE]``.
        """
        if self._fresh:  # a byte order mark the stream starts with is no event's
            if (start := stream_start(self._pending + part)) is None:
                self._pending += part
                return None
            part, self._pending, self._fresh = start, b"", False
        if self._pending:
            if not self._ends_an_event(part):
                # Held as it is, for a long event in many reads to cost time linear in its
                # bytes (not a copy of all before it at each read), and bounded.
                self._held.append(part)
                self._held_bytes += len(part)
                if len(self._pending) + self._held_bytes > EVENT_BYTES_LIMIT:
                    return f"sent an event of more than {EVENT_BYTES_LIMIT} bytes"
                return None
            if self._held:
                part, self._held = b"".join([self._pending, *self._held, part]), []
                self._held_bytes = 0
            else:
                part = self._pending + part
        runs = self._runs
        if runs is not None and (whole := runs.whole(part)) is not None:
            # The common read: common chunks (and at its end a finish, a usage chunk,
            # [DONE]), found with one split (no list of events, no slices of each).
            texts, text, run_end, tail, end = whole
            self._pending = part[end:]
            self.burst.add_run(RawChoices(runs.head, texts, runs.tail), text)
            self._unused = 0
            return self._read_chunks(part[run_end:], tail) if tail else None
        return self._read_chunks(part, self._data_of(part))

    def _read_chunks(self, part: bytes, chunks: list[bytes]) -> str | None:
        """Read ``chunks``, the data of the events of ``part``, as :meth:`feed` says."""
        # Each turn reads one chunk or more from ``begin`` (no copy of what is left). A run
        # is tried at the start and after a chunk that taught a new template; the chunks
        # of a run that failed are read one by one with no other try: a read costs time
        # linear in its chunks, whatever they are (docs/performance.md).
        begin, end = 0, len(chunks)
        tried = False  # the rest of the read tried as a whole once a template was learned
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
            learned = self._runs
            problem, begin = self._one_by_one(chunks, begin, end)
            if problem is not None:
                return problem
            runs = self._runs
            if (begin < end and runs is not learned and runs is not None and not tried
                    and part[:6] == b"data: " and b"\r" not in part):
                # A chunk taught the stream its template (a stream's first read, often a
                # long one): the rest of the read as a later read is read (one split and
                # one comparison, not each chunk's ends), once a read, so that a read
                # that teaches again and again stays linear. (Where chunk ``begin``'s
                # event starts: each chunk before it, its "data: " and blank line; what
                # is left of the read is already pending.)
                tried = True
                rest = part[sum(map(len, chunks[:begin])) + 8 * begin:]
                if (whole := runs.whole(rest)) is not None:
                    return self._take_whole(runs, rest, whole)
        return None

    def _take_whole(self, runs: RunReader, part: bytes, whole: Whole) -> str | None:
        """Take what :meth:`RunReader.whole` found in ``part``: its common chunks as one
        run, then the events after them one by one (as :meth:`feed` says)."""
        texts, text, run_end, tail, _ = whole
        self.burst.add_run(RawChoices(runs.head, texts, runs.tail), text)
        self._unused = 0
        return self._read_chunks(part[run_end:], tail) if tail else None

    def _ends_an_event(self, part: bytes) -> bool:
        """Whether ``part`` may end the pending event: a blank line in it, or one its
        first line end makes with the line end the bytes before it ended with (LF, CR or
        CRLF, split between two reads)."""
        before = (self._last if self._held else self._pending)[-3:]
        if b"\r" in part or b"\r" in before:  # (rare: CR line ends, normalised first)
            window = (before + part).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            ends = b"\n\n" in window
        else:  # no copy of the read: one search, and the two bytes around the seam
            ends = b"\n\n" in part or (before[-1:] == b"\n" and part[:1] == b"\n")
        if not ends:
            self._last = part[-3:] if len(part) >= 3 else (before + part)[-3:]
        return ends

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
            if (problem := chunk_problem(chunk)) is not None:
                return problem, len(chunks)
            if self.final is None:
                known = len(burst.choices)
                self.final = add(chunk, burst)
                if self.final is not None or parser.pending is not None:
                    # nothing after a finish is relayed; waiting fields need a parsed chunk
                    self._template = self._runs = template = None
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
            elif self._late(chunk, self.final):
                return None, len(chunks)  # the usage chunk: the answer is complete
        return None, end

    def _late(self, chunk: dict[str, Any], final: LLMEngineOutput) -> bool:
        """Read ``chunk``, one after the finish (:meth:`._chunks.ChunkParser.late`); True
        if it is the usage chunk, OpenAI's last before ``[DONE]``: the answer is
        complete, whether the worker then ends its body or not (B8)."""
        self._parser.late(chunk, final)
        if chunk.get("usage") is None:
            return False
        self.done = True
        return True

    def _learn(self, data: bytes, chunk: dict[str, Any]) -> Template | None:
        """Learn the template of ``data`` (parsed as ``chunk``, its choice the last the
        burst got), if it is a common chunk: the chunk then goes into the burst as a run
        of one, which the rest of its read, of the same template, joins (no choice made
        of each: docs/performance.md). None if it is not one."""
        if self._unused >= UNUSED_LIMIT:  # (logprobs, an id per chunk: no two alike)
            self._template = self._runs = None
            return None
        if not chunk.keys() <= self._parser.kept:
            return None  # its fields would not go with the chunks of its template
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
