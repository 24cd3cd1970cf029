"""The per-request writer: one event sequence over a request's outputs, two sinks.

:func:`write_response` reads ``stream.outputs`` (the gatekeeper's channel), keeps the
counting (tokens, usage, TTFT and ITL) and decides how the response ends: success with
its finish reason, or failure (an error item, a failed finish, a worker's ``abort``, a
channel that ended with no terminal). A sink turns that sequence into bytes:
:class:`SseSink` as server-sent events (the relay's per-token hot path,
docs/performance.md), :class:`JsonSink` as one JSON answer for a client that did not
stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
import trio

from .._gate import GatedOutputs
from .._protocols import (
    Annotated,
    ChunkChoice,
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    RawChoices,
)
from .._router import RequestStream
from .._router_types import DECODE_ONLY, StreamOutputs
from ._collect import EMPTY, ChoiceCollector
from ._metrics import outcome_of
from ._openai_errors import ApiError, error_for_exception
from ._openai_responses import (
    DONE_EVENT,
    OPENAI_FINISH,
    USAGE_NULL_END,
    ChunkEncoder,
    choice_tokens,
    completion_response,
    counted_tokens,
    failure_error,
    has_content,
    usage_dict,
    worker_aborted,
)
from ._responder import Responder

logger = logging.getLogger("trio_disagg.server")

Item = Annotated[LLMEngineOutput]
Choice = Mapping[str, Any]


class SseSink:
    """Server-sent events, exactly one ``[DONE]`` (B4).

    Outputs already waiting in the channel go out in one write (``batched``). The response
    starts with the first token, not before: a request that fails before producing anything
    (a bootstrap prefill that failed, a decode that never started) gets a real HTTP status
    and error body (docs/protocols.md section 1), not a 200 with an error event. A worker's
    own choice is relayed as sent, in this response's envelope (B8); an output without one
    (an in-process engine) is encoded from its text.
    """

    __slots__ = ("encoder", "include_usage", "parts", "responder")

    #: Read what is already in the channel without a checkpoint, and write it at once.
    batched = True

    def __init__(self, responder: Responder, encoder: ChunkEncoder, include_usage: bool) -> None:
        self.responder = responder
        self.encoder = encoder
        self.include_usage = include_usage
        #: Events not written yet.
        self.parts: list[bytes] = []

    def text(self, text: str) -> None:
        self.parts.append(self.encoder.token(text))

    def choices(self, choices: Sequence[Choice]) -> None:
        """Each of a burst's worker choices as its own event (B8)."""
        self.parts += self.encoder.choices(choices)

    async def flush(self) -> None:
        responder = self.responder
        if not responder.started:
            await responder.start_stream()
        parts = self.parts
        await responder.body(b"".join(parts))
        parts.clear()

    def cut(self, text: str | None, choice: Choice | None) -> None:
        """What came with a finish that did not complete: sent before the error event."""
        if choice is not None:
            if has_content(choice):
                cut = {**choice, "finish_reason": None}
                self.parts.append(self.encoder.choice(
                    ChunkChoice(cut, choice.fields) if type(choice) is ChunkChoice else cut))
        elif text:
            self.parts.append(self.encoder.token(text))

    async def succeed(
        self, text: str | None, choice: Choice | None, name: str, usage: dict[str, Any]
    ) -> None:
        parts = self.parts
        encoder = self.encoder
        if choice is not None:
            parts.append(encoder.choice(choice, name))
        else:
            parts.append(encoder.final(text, name))
        if self.include_usage:
            parts.append(encoder.usage(usage))
        parts.append(DONE_EVENT)
        await self._finish()

    async def fail(self, failure: ApiError) -> None:
        if not self.responder.started and not self.parts:
            await self.responder.error(failure)  # nothing sent yet: a real status
            return
        self.parts.append(failure.to_event())
        self.parts.append(DONE_EVENT)
        await self._finish()

    async def _finish(self) -> None:
        responder = self.responder
        if not responder.started:
            await responder.start_stream()
        await responder.finish(b"".join(self.parts))


class ContinuousSseSink(SseSink):
    """:class:`SseSink` for ``stream_options.continuous_usage_stats`` (vLLM's option, B8):
    every chunk carries the usage so far instead of ``"usage": null``, then the final
    usage chunk goes out as for ``include_usage``. Only a request that asks for it takes
    this sink: the relay's path for the others is :class:`SseSink`'s, unchanged.

    A chunk's usage is what the final usage would be had the response ended with it:
    ``prompt_tokens`` and ``cached_tokens`` the prefill's (docs/protocols.md section 1;
    the decode worker's prompt count only when no prefill reported one), and
    ``completion_tokens`` the router's running count, counted as the final usage counts
    when the worker reports none (a chunk's ``token_ids``, else one per chunk with
    content). The chunk with the finish reason carries the final usage itself (its
    completion count the worker's, if it reported one), as vLLM's last chunk does.
    A worker's own per-chunk usage is not relayed: the option is not forwarded
    (:func:`~trio_disagg.engines.streaming_body`).
    """

    __slots__ = ("count", "stream", "tally")

    def __init__(self, responder: Responder, encoder: ChunkEncoder,
                 stream: RequestStream) -> None:
        super().__init__(responder, encoder, True)
        self.stream = stream
        #: The response's tally, set by :func:`write_response`.
        self.tally: _Tally | None = None
        #: Completion tokens (tokens) in the chunks sent so far.
        self.count = 0

    def text(self, text: str) -> None:
        tally = self.tally
        self.count = tally.tokens if tally is not None else self.count + 1
        self.parts.append(self._stamp(self.encoder.token(text), self.count))

    def choices(self, choices: Sequence[Choice]) -> None:
        """Each of a burst's worker choices as its own event (B8), each with the count
        of the tokens up to and with its own."""
        events = b"".join(self.encoder.choices(choices)).split(b"\n\n")
        events.pop()  # (after the last event's end)
        # A run's choices are one token each (no choice object made of each).
        counts = ([1] * len(choices) if type(choices) is RawChoices
                  else list(map(choice_tokens, choices)))
        count, parts, stamp = self.count, self.parts, self._stamp
        for tokens, event in zip(counts, events, strict=True):
            count += tokens
            parts.append(stamp(event + b"\n\n", count))
        self.count = count

    def cut(self, text: str | None, choice: Choice | None) -> None:
        sent = len(self.parts)
        super().cut(text, choice)
        if len(self.parts) > sent and self.tally is not None:
            self.parts[-1] = self._stamp(self.parts[-1], self.tally.tokens)

    async def succeed(
        self, text: str | None, choice: Choice | None, name: str, usage: dict[str, Any]
    ) -> None:
        encoder = self.encoder
        event = encoder.choice(choice, name) if choice is not None else encoder.final(text, name)
        end = b',"usage":' + orjson.dumps(usage) + b"}\n\n"
        self.parts += (event[:-len(USAGE_NULL_END)] + end, encoder.usage(usage), DONE_EVENT)
        await self._finish()

    def _stamp(self, event: bytes, count: int) -> bytes:
        """``event`` (a chunk that ends with ``"usage":null``) with the usage so far."""
        stream = self.stream
        prompt = stream.prompt_tokens
        reported = self.tally.usage if self.tally is not None else None
        if prompt is None and reported is not None and reported.prompt_tokens:
            prompt = reported.prompt_tokens  # no prefill count (yet): the decode's
        usage = usage_dict(None, count, _cached(stream), prompt)
        return event[:-len(USAGE_NULL_END)] + b',"usage":' + orjson.dumps(usage) + b"}\n\n"


class JsonSink:
    """One JSON answer, or an error response.

    Outputs that carry the worker's own choice are collected by a :class:`ChoiceCollector`
    (B8), with the fields the worker's whole chat answer carries (``whole_message``); the
    text of outputs without one (the in-process engines) makes the answer.
    """

    __slots__ = ("chat", "collector", "created", "model", "parts", "responder",
                 "response_id", "texts", "whole_message")

    #: Await each output: one answer at the end, nothing to batch.
    batched = False

    def __init__(
        self, responder: Responder, *, chat: bool, response_id: str, model: str, created: int,
        whole_message: Mapping[str, Any] = EMPTY,
    ) -> None:
        self.responder = responder
        self.whole_message = whole_message
        self.chat = chat
        self.response_id = response_id
        self.model = model
        self.created = created
        self.parts: list[bytes] = []  # always empty: nothing is written before the end
        self.texts: list[str] = []
        self.collector: ChoiceCollector | None = None

    def text(self, text: str) -> None:
        self.texts.append(text)

    def choice(self, choice: Choice) -> None:
        collector = self.collector
        if collector is None:
            collector = self.collector = ChoiceCollector(
                chat=self.chat, whole_message=self.whole_message)
        if self.texts:  # text of outputs without a choice came first: in order
            collector.add_text("".join(self.texts))
            self.texts.clear()
        collector.add(choice)

    def choices(self, choices: Sequence[Choice]) -> None:
        for choice in choices:
            self.choice(choice)

    async def flush(self) -> None:
        await trio.lowlevel.checkpoint()  # never called: ``parts`` stays empty

    def cut(self, text: str | None, choice: Choice | None) -> None:
        """Nothing: a request that did not complete is answered with its error."""

    async def succeed(
        self, text: str | None, choice: Choice | None, name: str, usage: dict[str, Any]
    ) -> None:
        if choice is not None:
            self.choice(choice)
        elif text:
            self.texts.append(text)
        answer = None
        collector = self.collector
        if collector is not None:
            if self.texts:
                collector.add_text("".join(self.texts))
            sent = choice.get("finish_reason") if choice is not None else None
            answer = collector.choice(name if sent is None else sent)
        body = completion_response(
            chat=self.chat, response_id=self.response_id, model=self.model,
            created=self.created, text="".join(self.texts), finish_reason=name, usage=usage,
            choice=answer, fields=collector.fields if collector is not None else None,
        )
        await self.responder.respond(200, body)

    async def fail(self, failure: ApiError) -> None:
        await self.responder.error(failure)


async def write_response(
    stream: RequestStream,
    sink: SseSink | JsonSink,
    first_token: Callable[[], None],
    observe_itl: Callable[[float], None] | None,
) -> str:
    """Answer one request from ``stream.outputs`` through ``sink`` (B4, B8); return its
    ``requests_total`` outcome. ``first_token`` is called with the first output,
    ``observe_itl`` (if given) with the seconds since the output before, for each later one
    (an output may carry a burst of tokens: one observation).
    A worker's ``abort`` is an error, never a success; so is a worker's choice or field
    that cannot be written again (:data:`UNWRITABLE`)."""
    try:
        return await _write_response(stream, sink, first_token, observe_itl)
    except orjson.JSONEncodeError as exc:
        failure = ApiError(502, f"{UNWRITABLE} ({exc})", type="upstream_error",
                           code="worker_error")
    return await _fail(sink, failure)


#: Why a worker's answer that orjson read cannot be relayed: orjson reads JSON nested up
#: to 1024 levels but writes only 255 (or an in-process engine's value is not JSON).
UNWRITABLE = ("a worker sent a choice or field the router cannot relay: JSON nested "
              "deeper than 255 levels, or a value that is not JSON")


async def _write_response(
    stream: RequestStream,
    sink: SseSink | JsonSink,
    first_token: Callable[[], None],
    observe_itl: Callable[[float], None] | None,
) -> str:
    """:func:`write_response`, but for a choice or field it cannot write."""
    parts, on_text, on_choices = sink.parts, sink.text, sink.choices
    tally = _Tally(first_token, observe_itl)
    if type(sink) is ContinuousSseSink:
        sink.tally = tally
    with stream.outputs as outputs:
        # Read what is already waiting without a checkpoint, to write it at once.
        ready = _poll(outputs) if sink.batched else None
        while True:
            try:
                next_item = ready() if ready is not None else None
                if next_item is None:  # nothing waiting: awaited outside an except clause
                    if parts:  # what was already waiting goes out in one write
                        await sink.flush()
                    next_item = await outputs.receive()
            except trio.EndOfChannel:  # no terminal at all
                return await _fail(sink, failure_of(None))
            item = next_item
            if item.event == "error":
                break
            data = item.data
            if data is None:
                continue
            tally.add(data)
            choices = data.choices
            if type(choices) is RawChoices and data.finish_reason is None:
                on_choices(choices)  # a run of common chunks, the usual burst: never empty
                continue
            choice = None
            if choices:
                if data.finish_reason is not None:
                    *choices, choice = choices  # the last one ends the response
                if choices:
                    on_choices(choices)  # the worker's own choices, as sent (B8)
            finish = data.finish_reason
            if finish is None:
                if not choices and data.text:  # an in-process engine: its text
                    on_text(data.text)
                continue
            name = OPENAI_FINISH.get(finish.kind)
            if name is None or worker_aborted(choice):  # the request did not complete
                sink.cut(data.text, choice)
                break
            await sink.succeed(data.text, choice, name, usage_dict(
                tally.usage, tally.tokens, _cached(stream, tally.usage), stream.prompt_tokens))
            return "success"
    return await _fail(sink, failure_of(item))


class _Tally:
    """What a response counts as its outputs pass: completion tokens (the outputs' ids, or
    one per worker chunk with content when it sent none), the last usage a worker
    reported, and the time to the first output and between two outputs."""

    __slots__ = ("first_token", "last", "now", "observe_itl", "tokens", "usage")

    def __init__(self, first_token: Callable[[], None],
                 observe_itl: Callable[[float], None] | None) -> None:
        self.first_token = first_token
        self.observe_itl = observe_itl
        self.now = trio.lowlevel.current_clock().current_time  # one lookup per response
        self.last: float | None = None
        self.tokens = 0
        self.usage: CompletionUsage | None = None

    def add(self, data: LLMEngineOutput) -> None:
        now = self.now()
        if self.last is None:
            self.first_token()
        elif self.observe_itl is not None:
            self.observe_itl(now - self.last)
        self.last = now
        self.tokens += len(data.token_ids)
        if data.completion_usage is not None:
            self.usage = data.completion_usage
        choices = data.choices
        if data.token_ids:
            return
        if type(choices) is RawChoices:  # (no call of its __len__: the usual burst)
            self.tokens += len(choices.texts)
        elif choices:
            self.tokens += sum(map(counted_tokens, choices))


async def _fail(sink: SseSink | JsonSink, failure: ApiError) -> str:
    # A decode leg cancelled with this request ends its channel first: the request's own
    # cancellation then decides the ending (client gone, shutdown), not the leg.
    await trio.lowlevel.checkpoint_if_cancelled()
    if failure.status == 500:
        logger.error("request stream failed: %s", failure.message)
    await sink.fail(failure)
    return outcome_of(failure)


def failure_of(item: Item | None) -> ApiError:
    """Why a stream failed, from the item that ended it.

    An item that carries its exception (the gatekeeper's own errors, an engine's typed
    failure) is answered from the exception's type; one that carries none (a worker's
    error envelope or error finish, as it sent it) from its message and finish reason.

    Args:
        item: the error item, or the item with a failed finish reason; None if the stream
            ended with no terminal at all.

    Returns:
        The :class:`ApiError` to answer with.
    """
    if item is None:
        return failure_error(None)
    if item.exception is not None:
        return error_for_exception(item.exception)
    data = item.data
    if data is not None and data.choices and worker_aborted(data.choices[-1]):
        return failure_error(FinishReason.CANCELLED)  # an abort is an error (B8)
    finish = data.finish_reason if data is not None else None
    return failure_error(finish, item.error_message())


def _cached(stream: RequestStream, usage: CompletionUsage | None = None) -> int | None:
    """The ``cached_tokens`` to report: the prefill worker's (S4), or, for a request its
    decode worker served alone (no prefill, no KV transfer), the decode's own ``usage``
    (B8: it computed the prompt, so its cache hit is the request's)."""
    if stream.style == DECODE_ONLY:
        details = usage.prompt_tokens_details if usage is not None else None
    else:
        details = stream.prompt_tokens_details
    return details.cached_tokens if details is not None else None


def _poll(outputs: StreamOutputs) -> Callable[[], Item | None]:
    """What returns the next item if one is waiting, else None, without a schedule point
    (and, from a gatekeeper's stream, without an exception: once per output).

    The function it returns raises ``trio.EndOfChannel`` once the channel ended.
    """
    if type(outputs) is GatedOutputs:
        return outputs.receive_ready

    def ready() -> Item | None:
        try:
            return outputs.receive_nowait()
        except trio.WouldBlock:
            return None

    return ready
