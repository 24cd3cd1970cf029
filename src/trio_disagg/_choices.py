"""A worker's OpenAI choice object as :class:`~trio_disagg.LLMEngineOutput` carries it:
a dict, or a :class:`RawChoice` of the bytes the worker sent (the relay's fast path,
docs/performance.md), which parses itself when read."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

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
