"""The relay's fast path on bytes (docs/performance.md): a worker's common chunk, whose
choice the router relays as sent (B8) without parsing it, recognised by its bytes."""

from __future__ import annotations

import re
from bisect import bisect_right
from itertools import accumulate, takewhile
from operator import add, itemgetter
from typing import Any, NamedTuple

import orjson

_TEXT_START = b'{"index":0,"text":"'
_DELTA_START = b'{"index":0,"delta":{'
_CONTENT_KEY = b'"content":"'
_BACKSLASH = 0x5C
#: The bytes a JSON string cannot hold as they are: a quote, a backslash, a control.
NOT_PLAIN = bytes(range(0x20)) + b'"\\'


class Template(NamedTuple):
    """The bytes a stream's common chunks share, learned from one of them (its text's
    bytes excepted): a chunk is ``prefix + text + suffix``."""

    #: Up to and with the opening quote of the choice's ``text`` or ``delta.content``.
    prefix: bytes
    #: From the closing quote of that string to the end of the chunk.
    suffix: bytes
    #: Where the choice (its ``{``) starts in the chunk.
    start: int
    #: Bytes after the choice's ``}``: ``]}`` or ``],"usage":null}``.
    tail: int


def utf8_text(text: bytes) -> str | None:
    """``text`` decoded, if it is valid UTF-8 (orjson refuses a chunk that is not); else
    None. For a plain JSON string's bytes (no escape), that is the string's value."""
    try:
        return text.decode()
    except UnicodeDecodeError:
        return None


def learn_template(data: bytes, chunk: dict[str, Any]) -> Template | None:
    """The template of ``data``, a chunk parsed as ``chunk``, if it is a common one: one
    choice, ``index`` 0 written first, then its non-empty ``text`` (completions) or
    ``delta.content`` (chat, first in the delta or after other fields, as SGLang's
    ``"role":null``; with no ``text``: a chunk's text is its ``text`` if it has one), a
    null ``finish_reason``, no ``token_ids``, nothing after the choices but a
    null ``usage``, and no ``usage`` at all unless null.

    The chunk's bytes hold no line feed (a chunk whose data lines were joined with one is
    parsed: its choice could not go in one ``data:`` line, nor its events be rebuilt).

    A later chunk that starts with the template's prefix and ends with its suffix, with a
    plain text between them (UTF-8 without a quote, a backslash or a control character,
    :data:`NOT_PLAIN`: a JSON string as it is), is then this chunk with another text:
    the string the prefix opens ends where the suffix starts, and every other byte,
    hence every other field, is this chunk's (checked here by parsing the choice's
    bytes with another text: a key written twice, whose last value JSON keeps, cannot
    make the text or the index another than the bytes say). Such a chunk is valid JSON,
    and never an error object, a finish, a usage chunk or a second choice.
    """
    choice = _common_choice(chunk)
    start = data.find(b'"choices":[')
    if choice is None or start < 0:
        return None
    start += 11
    # The choice with another text: where the bytes put the text, if it is its text.
    probe = "a" * (len(data) + 1)  # longer than any string the chunk's bytes hold
    found = _text_at(data, start, choice, probe)
    if found is None:
        return None  # another order of fields: parsed
    text_at, expected = found
    end = data.find(b'"', text_at)
    if end <= text_at or data[end - 1] == _BACKSLASH:
        return None  # an empty text, or one with a quote: the next chunk learns
    if data.find(b"\n") >= 0:
        # (data lines joined; in the envelope, a later line without "data:" would pass)
        return None
    if data.endswith(b"}]}"):
        tail = 2
    elif data.endswith(b'}],"usage":null}'):
        tail = 15
    else:
        return None
    # The choice's bytes with the probe for their text must be the choice with the probe
    # for its text: then they are this chunk's one choice, and the string the template
    # opens is the text the choice has, whatever text a later chunk puts there (not one
    # that a second "text" or "content" key after it overrides).
    try:
        same = orjson.loads(
            data[start:text_at] + probe.encode() + data[end:len(data) - tail]) == expected
    except orjson.JSONDecodeError:  # a "choices" key found before the chunk's own
        same = False
    if not same:
        return None  # the bytes are not this chunk's one choice: no template
    return Template(data[:text_at], data[end:], start, tail)


def _text_at(data: bytes, start: int, choice: dict[str, Any], probe: str
             ) -> tuple[int, dict[str, Any]] | None:
    """Where the text of ``data``'s choice (starting at ``start``) would start, and the
    choice with ``probe`` for its text; None if the bytes do not start it as a common
    chunk does."""
    if data.startswith(_TEXT_START, start):
        return start + len(_TEXT_START), {**choice, "text": probe}
    if (data.startswith(_DELTA_START, start) and type(delta := choice.get("delta")) is dict
            and "text" not in choice  # (a chunk's text is its choice's "text" if it has one)
            and (key := data.find(_CONTENT_KEY, start + len(_DELTA_START))) >= 0):
        # The delta's content, first (vLLM) or after other fields (SGLang's
        # ``"role":null``); a "content" key found elsewhere fails the caller's check.
        return key + len(_CONTENT_KEY), {**choice, "delta": {**delta, "content": probe}}
    return None


def _common_choice(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """The one choice of ``chunk`` if it may be a common chunk's: a dict with ``index`` 0
    (not overridden by a second ``index`` key: the server sets it), a null
    ``finish_reason`` and no ``token_ids``, in a chunk with no ``usage`` unless null."""
    choices = chunk.get("choices")
    if type(choices) is not list or len(choices) != 1 or chunk.get("usage") is not None:
        return None
    choice = choices[0]
    if (type(choice) is not dict or choice.get("finish_reason") is not None
            or choice.get("token_ids") is not None or choice.get("index") != 0):
        return None
    return choice


class RunReader:
    """Reads the chunks of one socket read as runs of a template's common chunk, in C
    loops (the relay's fast path for a burst, docs/performance.md): three slices and two
    comparisons per chunk, and one check of all texts at once, instead of a few Python
    steps per chunk.

    Args:
        template: the stream's learned template (:func:`learn_template`).
    """

    __slots__ = ("_between", "_event_end", "_event_start", "_prefix_of", "_suffix_of",
                 "_text_of", "head", "prefix", "suffix", "tail")

    def __init__(self, template: Template) -> None:
        prefix, suffix, start, tail = template
        self.prefix = prefix
        self.suffix = suffix
        #: The bytes of a read of common events (``data: <chunk>``, a blank line) before
        #: the first text, between two texts, and after the last.
        self._event_start = b"data: " + prefix
        self._between = suffix + b"\n\ndata: " + prefix
        self._event_end = suffix + b"\n\n"
        #: A choice's bytes up to its text, and from its text to its ``}``.
        self.head = prefix[start:]
        self.tail = suffix[:len(suffix) - tail]
        at, after = len(prefix), len(suffix)
        self._prefix_of = itemgetter(slice(0, at))
        self._text_of = itemgetter(slice(at, -after))
        self._suffix_of = itemgetter(slice(-after, None))

    def whole(self, part: bytes) -> Whole | None:
        """If the events of ``part`` (a read, with what the read before left) are common
        chunks, each one ``data:`` line and a blank line, and then at most
        :data:`_TAIL` events of another kind (the stream's finish, its usage chunk,
        ``[DONE]``): the common chunks as a :class:`Whole`. Else None.

        Each event's text is taken at the template's offsets, and the read checked at
        once against the events those texts make (one join, one comparison); then the
        texts as :meth:`texts` checks them. C calls only, none per event but a slice (the
        relay's common read: docs/performance.md). The events after them are the
        caller's to read one by one.
        """
        end = part.rfind(b"\n\n") + 2
        if end < 2 or not part.startswith(self._event_start) or b"\r" in part[end:]:
            return None  # (an event ended by CR line ends is for the general path)
        pieces = part[6:end - 2].split(b"\n\ndata: ")
        texts = list(map(self._text_of, pieces))
        rebuilt = self._event_start + self._between.join(texts) + self._event_end
        if len(rebuilt) == end and part.startswith(rebuilt):
            run_end, tail = end, _NO_TAIL  # (the common read: common chunks only)
        elif (found := self._before_tail(part, pieces, texts, end)) is not None:
            texts, run_end, tail = found
        else:
            return None
        joined = b"\n".join(texts)
        if not _all_plain(texts, joined) or (text := _decoded(texts, joined)) is None:
            return None
        return texts, text, run_end, tail, end

    def _before_tail(self, part: bytes, pieces: list[bytes], texts: list[bytes], end: int
                     ) -> tuple[list[bytes], int, list[bytes]] | None:
        """For :meth:`whole`, a read whose last events (at most :data:`_TAIL`, each one
        ``data:`` line) lack the template's ends: the texts of the common chunks before
        them (of ``texts``, one per piece), where those end, and the data of the events
        after. None if it is not that."""
        prefix, suffix = self.prefix, self.suffix
        tail: list[bytes] = []
        while len(pieces) > 1 and len(tail) < _TAIL and not (
                pieces[-1].startswith(prefix) and pieces[-1].endswith(suffix)):
            tail.append(pieces.pop())
        if not tail or not (pieces[-1].startswith(prefix) and pieces[-1].endswith(suffix)):
            return None
        tail.reverse()
        del texts[len(pieces):]  # (the caller's list, of no more use to it)
        rebuilt = self._event_start + self._between.join(texts) + self._event_end
        run_end = len(rebuilt)
        if (not part.startswith(rebuilt) or b"\r" in part[run_end:]
                or part.count(b"\n", run_end, end) != 2 * len(tail)):
            return None  # (an event of the tail has a line of its own: a comment, ...)
        return texts, run_end, tail

    def leading(self, chunks: list[bytes], begin: int = 0) -> int:
        """How many chunks, from ``chunks[begin]`` on, have the template's prefix and
        suffix (in time linear in that count plus at most 64: not in ``begin``, nor in
        the chunks left)."""
        count, end = 0, len(chunks)
        while True:
            # A block at a time: the prefixes of all the chunks left, at each run, were
            # n * n for a read whose chunks change their suffix now and then.
            start = begin + count
            block = chunks[start:start + _BLOCK]
            found = len(list(takewhile(self.prefix.__eq__, map(self._prefix_of, block))))
            if found:
                found = len(list(takewhile(self.suffix.__eq__, map(
                    self._suffix_of, block if found == len(block) else block[:found]))))
            count += found
            if found < _BLOCK or start + _BLOCK >= end:
                return count

    def texts(self, chunks: list[bytes]) -> list[Run] | None:
        """The runs among ``chunks`` (each with the template's prefix and suffix,
        :meth:`leading`) whose texts are plain (non-empty, :data:`NOT_PLAIN`-free, UTF-8
        on their own), in order: all of them in one run, the common case. A chunk whose
        text has a quote or a backslash (an escape: a newline, a quote in the text) or is
        empty falls between two runs, for the caller to read on its own. None if a text
        has a control character or bytes that are not UTF-8 (a malformed chunk: the
        caller reads them all one by one, and reports it)."""
        texts = list(map(self._text_of, chunks))
        count = len(texts)
        # A control character between two texts: each must be plain and valid UTF-8 on
        # its own, not only all of them together (a character split between two chunks
        # makes two chunks that are not JSON).
        joined = b"\n".join(texts)
        if _all_plain(texts, joined):
            text = _decoded(texts, joined)
            return None if text is None else [Run(0, count, texts, text)]
        if len(joined.translate(None, _CONTROL)) != len(joined) - count + 1:
            return None
        try:
            parts = joined.decode().split("\n")  # each text's, by the separators
        except UnicodeDecodeError:
            return None
        # The texts to read on their own: those with an escape, found by the position of
        # each quote or backslash among the texts' ends, and the empty ones.
        ends = list(map(add, accumulate(map(len, texts)), range(count)))
        odd = {bisect_right(ends, found.start()) for found in _ESCAPE.finditer(joined)}
        at = -1
        while (at := _index(texts, b"", at + 1)) >= 0:
            odd.add(at)
        runs = []
        start = 0
        for stop in [*sorted(odd), count]:
            if stop > start:
                runs.append(Run(start, stop, texts[start:stop], "".join(parts[start:stop])))
            start = stop + 1
        return runs


#: What :meth:`RunReader.whole` finds in a read (a plain tuple: one a read): the common
#: chunks' text bytes and all of them as one string, where their events end, the data of
#: the events after them, and where the read's complete events end.
Whole = tuple[list[bytes], str, int, list[bytes], int]


class Run(NamedTuple):
    """Chunks ``start`` to ``stop`` (not included) of those given to
    :meth:`RunReader.texts`: their text bytes and all of them as one string."""

    start: int
    stop: int
    texts: list[bytes]
    text: str


#: Events of another kind :meth:`RunReader.whole` takes after a read's common chunks.
_TAIL = 4
#: The events after a read's common chunks when there are none (never changed).
_NO_TAIL: list[bytes] = []
#: Chunks :meth:`RunReader.leading` looks at at once (a read's burst is most often fewer).
_BLOCK = 64
#: Control characters: none may be in a JSON string as it is.
_CONTROL = bytes(range(0x20))
#: A quote or a backslash: a text with one is escaped in JSON, and read on its own.
_ESCAPE = re.compile(rb'["\\]')


def _all_plain(texts: list[bytes], joined: bytes) -> bool:
    """Whether each of ``texts`` (``joined`` with a line feed between two) is plain, free
    of :data:`NOT_PLAIN` bytes, and not empty (an empty text: also a chunk shorter than
    the template's)."""
    return (len(joined.translate(None, NOT_PLAIN)) == len(joined) - len(texts) + 1
            and b"" not in texts)


def _decoded(texts: list[bytes], joined: bytes) -> str | None:
    """``texts`` as one string, if each is valid UTF-8 on its own (the line feeds in
    ``joined`` between two: none may end inside a character); else None."""
    try:
        text = joined.decode()
    except UnicodeDecodeError:
        return None
    return text.replace("\n", "") if len(texts) > 1 else text


def _index(items: list[bytes], value: bytes, start: int) -> int:
    """``items.index(value, start)``, or -1."""
    try:
        return items.index(value, start)
    except ValueError:
        return -1
