"""The HTTP face's sinks on the simulator's core (docs/protocols.md section 5): a decode's
answer as server-sent chunks or one JSON answer, what every protocol's prefill answer
shares, and an HTTP KV source bound to its request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from ._answers import AnswerFormat, usage_dict
from ._asgi import DONE_EVENT, Exchange
from ._core import Decode, Prefill, fault_message
from ._faults import FaultKind
from ._kvwire import KVSource
from ._text import WORDS

if TYPE_CHECKING:
    from ._worker import MockWorker

_BATCH = 32  # SSE chunks per write when there is no inter-token latency


@attrs.frozen
class Bound:
    """An HTTP :class:`~._kvwire.KVSource` bound to its worker and request, as the core's
    :class:`~._core.KVSource`."""

    source: KVSource
    worker: MockWorker
    request_id: str

    async def pull(self) -> str | None:
        return await self.source.pull(self.worker, self.request_id)

    async def release(self) -> None:
        await self.source.release(self.worker, self.request_id)


@attrs.define(eq=False)
class DecodeSink:
    """A decode's answer over HTTP (the core's :class:`~._core.DecodeSink`): server-sent
    chunks, written as they come when tokens have a latency and else in batches of
    ``_BATCH`` (32); or one whole answer."""

    worker: MockWorker
    exchange: Exchange
    fmt: AnswerFormat
    run: Decode
    stream: bool = attrs.field(kw_only=True)
    include_usage: bool = attrs.field(kw_only=True)
    parts: list[bytes] = attrs.field(factory=list, init=False)  # chunks not yet written
    texts: list[str] = attrs.field(factory=list, init=False)  # a whole answer's text
    ids: list[int] = attrs.field(factory=list, init=False)  # and its token ids
    started: bool = attrs.field(default=False, init=False)  # the format was bound

    @property
    def itl(self) -> float:
        return self.run.latency.inter_token_latency

    def usage(self, count: int) -> dict[str, Any]:
        run = self.run
        return usage_dict(run.prompt_tokens, count, run.cached or 0)

    def _begin(self) -> None:
        if self.started:
            return
        self.started = True
        self.fmt.bind_usage(self.usage)
        if self.stream and (first := self.fmt.start()):
            self.parts.append(first)

    async def accept(self) -> None:
        if self.stream:
            await self.exchange.start_stream()  # accepted: headers now, as the workers do

    async def fail(self, message: str, *, lost_kv: bool = False) -> None:
        # (a lost handoff is told by its wording, "KV transfer failed: ...", on the wire)
        await self.worker._fail(self.exchange, message)

    async def token(self, token: int, finish: str | None, count: int) -> None:
        self._begin()
        if not self.stream:
            self.texts.append(WORDS[token])
            self.ids.append(token)
            return
        self.parts.append(self.fmt.token(WORDS[token], token, finish))
        if self.itl > 0 or len(self.parts) >= _BATCH:
            await self.exchange.body(b"".join(self.parts))
            self.parts = []

    async def end(self, count: int, finish: str) -> None:
        self._begin()
        if not self.stream:
            await self.exchange.respond(200, self.fmt.answer(
                text="".join(self.texts), token_ids=self.ids, finish=finish,
                usage=self.usage(count)))
            return
        parts = self.parts
        if count == 0:
            parts.append(self.fmt.token("", None, "length"))
        if self.include_usage and (tail := self.fmt.usage(self.usage(count))):
            parts.append(tail)
        parts.append(DONE_EVENT)
        await self.exchange.finish(b"".join(parts))

    async def at_fault(self, kind: FaultKind, count: int) -> None:
        self._begin()
        if self.parts:
            await self.exchange.body(b"".join(self.parts))
            self.parts = []
        if kind is FaultKind.DECODE_ERROR_AT:
            await self.fail(fault_message(self.worker.name, kind, self.run.request_id))
        elif kind is FaultKind.DECODE_RESET_AT:
            # the connection closes with the answer half-way
            await self.worker._reset(self.exchange, self.stream)


class PrefillAnswers:
    """What every protocol's prefill answers share (the core's
    :class:`~._core.PrefillSink`): the counters, a cut or failed answer (each commits
    before it is sent), no answer of its own before staging, the KV staged under the
    request id. A protocol adds its final answers and its handoff."""

    worker: MockWorker
    exchange: Exchange
    stream: bool = False

    def computed(self, run: Prefill) -> None:
        self.worker.stats.prefills_completed += 1

    async def reset(self, run: Prefill) -> None:
        run.answered = True
        await self.worker._reset(self.exchange, self.stream)  # then the connection closes

    async def fail(self, run: Prefill, message: str) -> None:
        run.answered = True
        await self.worker._fail(self.exchange, message)

    async def before_stage(self, run: Prefill) -> bool:
        return False

    def stage_key(self, run: Prefill) -> str:
        return run.request_id
