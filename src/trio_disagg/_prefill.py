"""Classifying a prefill stream: handoff, terminal answer, or error (rules S1-S10, T4 in
docs/semantics.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import attrs
import trio

from ._crash import crash_message
from ._engine import not_an_engine_output
from ._errors import NoDisaggregatedParams, PrefillError
from ._keeper import PrefillTask, TransferKeeper, TransferLeg
from ._protocols import (
    Annotated,
    CompletionUsage,
    FinishKind,
    LLMEngineOutput,
    PrefillResult,
    PromptTokensDetails,
    TraceLink,
)
from ._tracker import RequestTracker

_BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@attrs.frozen(slots=True, kw_only=True)
class Handoff:
    """The prefill staged KV for a decode worker (S10): the decode request needs
    ``result``, set as its ``prefill_result``.

    A :class:`~trio_disagg.Gatekeeper` takes a :class:`Handoff` as it is: it watches the
    ``drain`` if there is one, and otherwise knows the prefill succeeded.

    Attributes:
        result: what the decode request needs (the prefill's ``disaggregated_params``,
            and its ``prompt_tokens`` and ``prompt_tokens_details``, S4).
        worker_link: the prefill worker's trace link, if it sent one.
        bootstrap: True for an SGLang-style bootstrap handoff (S5).
        drain: for a bootstrap handoff whose rest is drained by a keeper
            (:func:`consume_prefill_stream` with ``keeper=``), the drain's task. Its
            value, once the stream ended well, is this handoff completed with the usage
            of the later outputs (S4) and no ``drain``; its error, a late prefill
            failure (T4). None when the whole stream was read before the handoff was
            returned (S6).
    """

    result: PrefillResult
    worker_link: TraceLink | None = None
    bootstrap: bool = False
    drain: PrefillTask[Handoff] | None = None


@attrs.frozen(slots=True, kw_only=True)
class Terminal:
    """The prefill already finished the request (S7): its first output had a finish
    reason other than ``length`` (``eos``, ``stop``, ...), so it staged nothing. No decode
    is dispatched; a :class:`~trio_disagg.Gatekeeper` made from it dispatches nothing and
    forwards ``output`` alone.

    Attributes:
        output: the client's answer, the prefill's first output with
            ``disaggregated_params`` removed.
    """

    output: Annotated[LLMEngineOutput]


#: What a prefill stream comes to: a :class:`Handoff` for a decode, or a
#: :class:`Terminal` answer (S7).
PrefillCompletion = Handoff | Terminal


def is_bootstrap_params(params: Any) -> bool:
    """True if ``params`` is an object with the SGLang bootstrap triple,
    ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` (S5); the values are
    not checked here.

    Args:
        params: a prefill output's ``disaggregated_params`` (any JSON value).
    """
    return isinstance(params, Mapping) and all(key in params for key in _BOOTSTRAP_KEYS)


def _raise_carried(item: Annotated[LLMEngineOutput]) -> None:
    """Raise the :class:`PrefillError` an error item carries, if it carries one: the
    adapter that made it knew what failed (B7: which handoff field), so its own exception
    reaches the router rather than one rebuilt from its message."""
    if isinstance(item.exception, PrefillError):
        raise item.exception


def check_prefill_output(item: Annotated[LLMEngineOutput]) -> None:
    """Check a prefill output after the first one (T4): anything but a failure passes.

    Args:
        item: the output.

    Raises:
        PrefillError: on an error envelope, ``finish_reason = error`` or
            ``finish_reason = cancelled``; the message carries the worker's text. An
            error item that carries a :class:`PrefillError` of its own raises that one.
            Also on anything that is not an ``Annotated[LLMEngineOutput]`` (the engine
            broke its contract), saying what it was.
    """
    _check_engine_output(item)
    if item.event == "error":
        _raise_carried(item)
        raise PrefillError(f"Prefill returned an error in its output stream: "
                           f"{item.error_message()}")
    data = item.data
    if data is None or data.finish_reason is None:
        return
    kind = data.finish_reason.kind
    if kind is FinishKind.ERROR:
        raise PrefillError(f"Prefill backend failed: {data.finish_reason.message}")
    if kind is FinishKind.CANCELLED:
        raise PrefillError("Prefill backend cancelled before completing the handoff")


def _check_engine_output(item: object) -> None:
    """Raise a :class:`PrefillError` saying what ``item`` is if it is not an engine's
    output (S2, T4), rather than an ``AttributeError`` that reads as a crash."""
    breach = not_an_engine_output(item)
    if breach is not None:
        raise PrefillError(f"the prefill engine {breach}")


def classify_first_output(
    first: Annotated[LLMEngineOutput], tracker: RequestTracker | None = None
) -> PrefillCompletion:
    """Classify a prefill's first output (S2, S3, S5, S7-S10).

    Records prefill complete on ``tracker`` for any output that is not an error.

    Args:
        first: the prefill's first output.
        tracker: the request's tracker, if any (S3).

    Returns:
        A :class:`Terminal` if the output has a finish reason other than ``length``
        (S7); else a :class:`Handoff` with the output's ``disaggregated_params`` and
        usage (S4, S10), ``bootstrap`` set for the SGLang triple (S5), and no ``drain``.

    Raises:
        PrefillError: the first output is an error (S2), or not an
            ``Annotated[LLMEngineOutput]`` at all; the tracker is not touched. An
            error item that carries a :class:`PrefillError` of its own (an adapter's
            :class:`~trio_disagg.InvalidPrefillHandoff`, B7) raises that one.
        NoDisaggregatedParams: a handoff is needed but there is nothing usable to hand
            off (S8), or a TRT-LLM context has no usable ``ctx_request_id`` (S9).
    """
    _check_engine_output(first)
    if first.event == "error":
        _raise_carried(first)
        raise PrefillError(f"Prefill returned an error: {first.error_message()}")
    if tracker is not None:
        tracker.record_prefill_complete()
    data = first.data
    finish = data.finish_reason if data is not None else None
    if finish is not None and finish.kind is not FinishKind.LENGTH:
        # S7: eos, stop, cancelled, error or content_filter on the first token: the prefill
        # finished the request and staged nothing to hand off.
        assert data is not None
        answer = attrs.evolve(data, disaggregated_params=None)
        return Terminal(output=attrs.evolve(first, data=answer))
    if data is None:
        raise NoDisaggregatedParams("Prefill output has no data field")
    params = data.disaggregated_params
    if params is None:
        raise NoDisaggregatedParams("Prefill output is missing disaggregated_params")
    _check_context_id(params)
    usage = data.completion_usage
    return Handoff(
        result=PrefillResult(
            disaggregated_params=params,
            prompt_tokens_details=usage.prompt_tokens_details if usage else None,
            prompt_tokens=usage.prompt_tokens if usage and usage.prompt_tokens else None,
        ),
        worker_link=data.worker_trace_link,
        bootstrap=is_bootstrap_params(params),
    )


def _check_context_id(params: Any) -> None:
    """S9: TRT-LLM sends ``ctx_request_id: null`` on a terminal context; a non-terminal one
    without an id cannot be decoded, so it is refused before generation is dispatched.

    Raises:
        NoDisaggregatedParams: ``params`` is a TRT-LLM context with no usable
            ``ctx_request_id``.
    """
    if not isinstance(params, Mapping):
        return
    context_only = params.get("request_type") == "context_only"
    if ("ctx_request_id" in params and params["ctx_request_id"] is None) or (
        context_only and "ctx_request_id" not in params
    ):
        raise NoDisaggregatedParams(
            "Prefill output has no usable ctx_request_id for a non-terminal handoff"
        )


async def drain_prefill_outputs(
    outputs: trio.MemoryReceiveChannel[Annotated[LLMEngineOutput]],
) -> PromptTokensDetails | None:
    """Read a prefill stream to its end, checking every output (S6, T4).

    Args:
        outputs: the rest of the stream, after its first output.

    Returns:
        The first ``prompt_tokens_details`` seen in a usage, if any (S4).

    Raises:
        PrefillError: on the first failed output (T4); the channel is closed either way.

    On cancellation the channel is closed too: a prefill engine still sending gets
    :exc:`trio.BrokenResourceError`. Run it in a :class:`TransferKeeper` when the
    stream is part of a KV transfer (T1).
    """
    usage = await _drain(outputs)
    return usage.prompt_tokens_details if usage is not None else None


async def _drain(
    outputs: trio.MemoryReceiveChannel[Annotated[LLMEngineOutput]],
) -> CompletionUsage | None:
    """:func:`drain_prefill_outputs`, returning the first usage seen that has
    ``prompt_tokens_details`` (else the first usage seen)."""
    first_usage: CompletionUsage | None = None
    with outputs:
        async for item in outputs:
            check_prefill_output(item)
            usage = item.data.completion_usage if item.data is not None else None
            if usage is not None and (first_usage is None
                                      or first_usage.prompt_tokens_details is None):
                first_usage = usage
    return first_usage


async def consume_prefill_stream(
    outputs: trio.MemoryReceiveChannel[Annotated[LLMEngineOutput]],
    *,
    tracker: RequestTracker | None = None,
    keeper: TransferKeeper | None = None,
    name: str | None = None,
    guard: AbstractContextManager[Any] | None = None,
    first: Annotated[LLMEngineOutput] | None = None,
    leg: TransferLeg | None = None,
) -> PrefillCompletion:
    """Read a prefill stream and say what comes next: a decode with the handoff, or
    nothing but the prefill's own answer (S1-S10, T4).

    The first output is classified (:func:`classify_first_output`). For a bootstrap
    handoff (S5) with a ``keeper``, the keeper drains the rest, holding ``guard`` until
    then, and this returns at once, the :class:`Handoff`'s ``drain`` observing it (a
    Gatekeeper takes it as it is). Otherwise the stream is read here to its end (S6),
    ``guard`` held. A later failure is raised here, or logged by the keeper's drain (T2).

    Args:
        outputs: the prefill leg's stream; closed when fully read, and on any error.
        tracker: records prefill complete on the first valid output (S3).
        keeper: drains the rest of a bootstrap stream in the background (T1).
        name: the drain's name in the keeper's logs and task names (the request id);
            default: the first output's ``id``, else the bootstrap room.
        guard: a teardown guard to hold until the stream is fully read.
        first: the first output, if the caller already read it from ``outputs`` (to
            bound that wait by a deadline of its own, B2, and not close the stream).
        leg: the keeper's leg running the engine (:meth:`TransferKeeper.spawn_leg`):
            the stream's end is read as the engine's end, so an engine that refused
            (S1) or raised (T3) fails the prefill, never a clean end (G5).

    Returns:
        A :class:`Handoff` (a bootstrap one given a ``keeper``: with a ``drain``) or a
        :class:`Terminal`.

    Raises:
        PrefillError: no output at all (S1), an error first output (S2), a later
            failed output (S6, T4) when the stream is read here, ``leg``'s failure.
        NoDisaggregatedParams: S8, S9.
        RuntimeError: the keeper is not open.
        TypeError: an argument of another type.

    On cancellation the channel is closed (a prefill engine still sending gets
    :exc:`trio.BrokenResourceError`); with a keeper, a bootstrap drain already started is
    not affected (T1).
    """
    _check_types(outputs, keeper, tracker, leg)
    if first is None:
        first = await _receive_first(outputs, leg)
    completion = _classify_or_close(outputs, first, tracker)
    if isinstance(completion, Handoff) and completion.bootstrap and keeper is not None:
        return _drain_in_keeper(outputs, completion, keeper,
                                name or _task_name(first, completion), guard, leg)
    with guard if guard is not None else contextlib.nullcontext():
        later = await _drain(outputs)
        await _engine_ended(leg)
    if isinstance(completion, Handoff):
        completion = _with_usage(completion, later)
    return completion


def _check_types(outputs: object, keeper: object, tracker: object, leg: object) -> None:
    """A wrong type is the caller's mistake: said before anything is read."""
    for name, value, kind in (("outputs", outputs, trio.abc.ReceiveChannel),
                              ("keeper", keeper, TransferKeeper),
                              ("tracker", tracker, RequestTracker), ("leg", leg, TransferLeg)):
        if not (isinstance(value, kind) or (value is None and name != "outputs")):
            raise TypeError(f"{name} must be a {kind.__name__}"
                            f"{'' if name == 'outputs' else ' or None'}, "
                            f"got {type(value).__name__}")


async def _receive_first(
    outputs: trio.MemoryReceiveChannel[Annotated[LLMEngineOutput]],
    leg: TransferLeg | None,
) -> Annotated[LLMEngineOutput]:
    """The stream's first output; the channel is closed if there is none.

    Raises:
        PrefillError: the stream ended with no output (S1): the refusal or crash of
            ``leg``'s engine, if it had one.
    """
    try:
        return await outputs.receive()
    except trio.EndOfChannel:
        outputs.close()
    except BaseException:
        outputs.close()
        raise
    await _engine_ended(leg)
    raise PrefillError("Prefill returned no output (stream ended)")


async def _engine_ended(leg: TransferLeg | None) -> None:
    """Wait for the engine's ``leg``, if given, whose stream ended.

    Raises:
        PrefillError: the engine refused before it started, or raised after it.
    """
    if leg is None:
        return
    await leg.wait_done()
    if leg.error is not None:
        raise PrefillError(f"prefill engine {leg.name} failed: {leg.error}") from leg.error
    if leg.crash is not None:
        raise PrefillError(f"Prefill background task did not complete: {leg.name} crashed: "
                           f"{crash_message(leg.crash)}") from leg.crash


def _classify_or_close(
    outputs: trio.MemoryReceiveChannel[Annotated[LLMEngineOutput]],
    first: Annotated[LLMEngineOutput],
    tracker: RequestTracker | None,
) -> PrefillCompletion:
    """:func:`classify_first_output`; ``outputs`` is closed if it raises."""
    try:
        return classify_first_output(first, tracker)
    except BaseException:
        outputs.close()
        raise


def _drain_in_keeper(
    outputs: trio.MemoryReceiveChannel[Annotated[LLMEngineOutput]],
    handoff: Handoff,
    keeper: TransferKeeper,
    name: str,
    guard: AbstractContextManager[Any] | None,
    leg: TransferLeg | None,
) -> Handoff:
    """Start draining the rest of a bootstrap stream in ``keeper`` (T1), ``guard`` held
    until the drain ends (and the engine's ``leg``, if given), and return ``handoff``
    with the drain's task.

    Raises:
        RuntimeError: the keeper is not open; the channel is closed.
    """

    async def drain_rest() -> Handoff:
        later = await _drain(outputs)
        await _engine_ended(leg)
        return _with_usage(handoff, later)

    try:
        task = keeper.start(drain_rest, name=name, guard=guard)
    except BaseException:
        outputs.close()
        raise
    return attrs.evolve(handoff, drain=task)


def _with_usage(handoff: Handoff, later: CompletionUsage | None) -> Handoff:
    """The handoff with what later outputs said of the prompt, where the first said
    nothing (S4)."""
    if later is None:
        return handoff
    result = handoff.result
    if result.prompt_tokens_details is None and later.prompt_tokens_details is not None:
        result = attrs.evolve(result, prompt_tokens_details=later.prompt_tokens_details)
    if result.prompt_tokens is None and later.prompt_tokens:
        result = attrs.evolve(result, prompt_tokens=later.prompt_tokens)
    return handoff if result is handoff.result else attrs.evolve(handoff, result=result)


def _task_name(first: Annotated[LLMEngineOutput], handoff: Handoff) -> str:
    """A drain's name when its caller gave none: the output's id, else the room."""
    if first.id:
        return first.id
    return f"room {handoff.result.disaggregated_params['bootstrap_room']}"
