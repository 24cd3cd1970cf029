"""The outputs of one socket read of a worker's stream gathered into one item (the relay's
hot path, docs/performance.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._protocols import CompletionUsage, LLMEngineOutput, RawChoices


class Burst:
    """The non-terminal outputs of one socket read, gathered into one item (the relay's hot
    path, docs/performance.md): one channel send, one trip through the gatekeeper and one
    write to the client per burst, not per token.

    Their token ids and text are joined; each worker choice is kept, in order, to be
    relayed as its own chunk (B8); the last usage reported wins. All are of one choice
    index (the router asks a worker for ``n`` = 1). A choice the fast path carried as
    bytes (a :class:`~trio_disagg.RawChoice`, :class:`SseReader`) adds its text too,
    taken from those bytes.
    """

    __slots__ = ("choices", "index", "run", "texts", "token_ids", "usage")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.choices: list[Mapping[str, Any]] = []
        #: A read's run of common chunks, while ``choices`` is empty (the fast path).
        self.run: RawChoices | None = None
        self.usage: CompletionUsage | None = None
        self.index: int | None = None

    def add_run(self, run: RawChoices, text: str) -> None:
        """Add a run of common chunks (:class:`~trio_disagg.RawChoices`) and its text: the
        burst's run grows by it when it is of the same template (the chunk that taught the
        template, then the rest of its read); any other mix is made a list."""
        held = self.run
        if held is None and not self.choices:
            self.run = run
        elif held is not None and held.head == run.head and held.tail == run.tail:
            held.texts += run.texts  # (in place: the burst's own, until taken)
        else:
            self.spread()
            self.choices += run
        self.texts.append(text)

    def spread(self) -> None:
        """Make the run a list of choices before a choice is added to it."""
        if self.run is not None:
            self.choices += self.run
            self.run = None

    def add_parts(self, choice: Mapping[str, Any], text: str | None, token_ids: list[int],
                  usage: CompletionUsage | None) -> None:
        """Add one chunk, as :func:`openai_chunk` read it."""
        if self.run is not None:
            self.spread()
        self.choices.append(choice)
        if text:
            self.texts.append(text)
        if token_ids:
            self.token_ids += token_ids
        if usage is not None:
            self.usage = usage

    def add(self, output: LLMEngineOutput) -> None:
        """Add one output without a finish reason."""
        if self.run is not None:
            self.spread()
        if output.choices:
            self.choices += output.choices
        if output.text:
            self.texts.append(output.text)
        if output.token_ids:
            self.token_ids += output.token_ids
        if output.completion_usage is not None:
            self.usage = output.completion_usage
        if output.index is not None:
            self.index = output.index

    def take(self) -> LLMEngineOutput | None:
        """The one output of what was added since the last call, or None if nothing was."""
        texts, choices, run = self.texts, self.choices, self.run
        if run is not None:  # a run is the read's only choices
            output = LLMEngineOutput(
                token_ids=self.token_ids, text="".join(texts), completion_usage=self.usage,
                index=self.index, choices=run)
            self.run = None
        elif not texts and not choices and not self.token_ids:
            return None
        else:
            output = LLMEngineOutput(
                token_ids=self.token_ids, text="".join(texts) if texts else None,
                completion_usage=self.usage, index=self.index, choices=choices or None)
            self.choices = []
        self.token_ids, self.texts = [], []
        self.usage = None
        return output
