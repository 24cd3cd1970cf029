"""A worker's OpenAI choice object as :class:`~trio_disagg.LLMEngineOutput` carries it:
a dict, or a :class:`RawChoice` of the bytes the worker sent (the relay's fast path,
docs/performance.md), which parses itself when read; a run of common choices is one
:class:`RawChoices`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import orjson


class RawChoice(Mapping[str, Any]):
    """One OpenAI choice object as a worker sent it, kept as its JSON bytes: the relay's
    fast path (docs/performance.md) carries these from the worker's chunk to the client
    without parsing or re-encoding them (B8).

    It is a read-only mapping: any mapping access parses the bytes, once (orjson), so a
    consumer that needs the choice's fields (a non-streamed answer's collector, an
    in-process user) reads it as it would the dict.

    It stands for a streamed choice with ``index`` 0, a null ``finish_reason``, no
    ``token_ids`` and non-empty ``text`` or ``delta.content``: the server writes its
    bytes as they are into a chunk of its own envelope (but for the role a first chat
    delta gets) and counts it as one completion token, without reading it. The HTTP
    adapters make one only of such a choice (engines ``SseReader``); an engine of your
    own that makes one keeps to the same.

    Args:
        raw: the JSON bytes of one choice object, ``{`` to ``}``.

    Raises:
        orjson.JSONDecodeError: on the first mapping access, if ``raw`` is not JSON.
    """

    __slots__ = ("_parsed", "raw")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self._parsed: dict[str, Any] | None = None

    def _parse(self) -> dict[str, Any]:
        parsed = self._parsed
        if parsed is None:
            parsed = self._parsed = orjson.loads(self.raw)
        return parsed

    def __getitem__(self, key: str) -> Any:
        return self._parse()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._parse())

    def __len__(self) -> int:
        return len(self._parse())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RawChoice):
            return self.raw == other.raw or self._parse() == other._parse()
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]  # a mapping: unhashable, as a dict

    def __repr__(self) -> str:
        return f"RawChoice({self.raw!r})"


class RawChoices(Sequence[Mapping[str, Any]]):
    """Consecutive streamed choices of one worker that differ only in their text, kept as
    the bytes they share and the bytes of each text: the relay's fast path for a socket
    read that brought only common chunks (docs/performance.md). Choice ``i`` is the
    :class:`RawChoice` of ``head + texts[i] + tail``; the server writes the run with one
    join and counts it as ``len(run)`` completion tokens, without making those objects.

    Each choice stands for what a :class:`RawChoice` does (``index`` 0, a null
    ``finish_reason``, no ``token_ids``, a non-empty text); each text is a JSON string's
    bytes as they are (UTF-8 with no quote, backslash or control character), so the
    bytes of every choice are valid JSON.

    Args:
        head: the bytes of a choice up to and with the opening quote of its text.
        texts: each choice's text, in order (at least one).
        tail: the bytes of a choice from the closing quote of its text to its ``}``.
    """

    __slots__ = ("head", "tail", "texts")

    def __init__(self, head: bytes, texts: list[bytes], tail: bytes) -> None:
        self.head = head
        self.texts = texts
        self.tail = tail

    def __len__(self) -> int:
        return len(self.texts)

    @overload
    def __getitem__(self, index: int) -> RawChoice: ...

    @overload
    def __getitem__(self, index: slice) -> list[RawChoice]: ...

    def __getitem__(self, index: int | slice) -> RawChoice | list[RawChoice]:
        head, tail = self.head, self.tail
        if isinstance(index, slice):
            return [RawChoice(head + text + tail) for text in self.texts[index]]
        return RawChoice(head + self.texts[index] + tail)

    def __iter__(self) -> Iterator[RawChoice]:
        head, tail = self.head, self.tail
        return (RawChoice(head + text + tail) for text in self.texts)

    def __eq__(self, other: object) -> bool:
        # Equal to the list of its choices it stands for (``choices`` was a list), and to
        # another run of the same choices.
        if isinstance(other, RawChoices):
            if (self.head, self.texts, self.tail) == (other.head, other.texts, other.tail):
                return True
            return list(self) == list(other)
        if isinstance(other, list):
            return list(self) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a sequence of mappings: unhashable

    def __repr__(self) -> str:
        return f"RawChoices({self.head!r}, {self.texts!r}, {self.tail!r})"


#: The router's envelope of every chunk and answer (B8): its own ``id``, ``object``,
#: ``created`` and ``model``, the choices it writes one by one, and the ``usage`` it
#: corrects from the prefill (S4). Never a :class:`ChunkChoice`'s field.
ENVELOPE = frozenset({"id", "object", "created", "model", "choices", "usage"})


class ChunkChoice(dict[str, Any]):
    """A worker's choice (a dict, as it sent it) with the other top-level fields of the
    chunk or answer it came in: those the router relays beside the choice (B8), such as
    vLLM's ``prompt_token_ids`` or a ``system_fingerprint``.

    The router owns the envelope (``id``, ``object``, ``created``, ``model``,
    ``choices``, ``usage``) and withholds a worker's own plumbing (vLLM's
    ``kv_transfer_params``, ...: docs/router.md, "What the router relays, and what it
    owns"); whatever else a worker put beside the choices travels here, in
    :attr:`fields`, for the server to write beside this choice: in the same streamed
    chunk, or at the top level of a collected answer. A field that came in a chunk
    without a choice worth relaying (a role-only first delta) travels with the next
    choice. Anything that reads a choice reads it as the dict it is.

    Args:
        choice: the worker's choice object.
        fields: the chunk's fields to relay, in the order sent (those of the router's
            ``ENVELOPE`` left out).
    """

    __slots__ = ("fields",)

    def __init__(self, choice: Mapping[str, Any], fields: dict[str, Any]) -> None:
        super().__init__(choice)
        # A field named as one of the router's own (an in-process engine's ChunkChoice)
        # is not relayed: the envelope is the router's.
        self.fields = (fields if fields.keys().isdisjoint(ENVELOPE)
                       else {key: value for key, value in fields.items()
                             if key not in ENVELOPE})

    def __repr__(self) -> str:
        return f"ChunkChoice({dict.__repr__(self)}, fields={self.fields!r})"
