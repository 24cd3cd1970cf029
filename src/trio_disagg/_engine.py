"""The engine protocols: how the router sees a decode worker (:class:`DecodeEngine`) and a
prefill worker (:class:`PrefillEngine`)."""

from __future__ import annotations

import enum
from typing import Any, Protocol, runtime_checkable

import trio

from ._context import RequestContext
from ._errors import WorkerError
from ._protocols import Annotated, FinishKind, LLMEngineOutput, PreprocessedRequest


class HandoffStyle(enum.Enum):
    """How a prefill worker hands KV to a decode worker (rules S5-S7 in docs/semantics.md)."""

    #: vLLM and TRT-LLM style; prefill first, its ``disaggregated_params`` go into the decode
    #: request.
    SEQUENTIAL = "sequential"
    #: SGLang style; the router picks a bootstrap room and dispatches prefill and decode
    #: together.
    BOOTSTRAP = "bootstrap"
    #: TRT-LLM style: sequential, but a generation leg aborted before it fetched the
    #: context's KV leaves that KV to the worker's transfer timeout, so the generation leg
    #: is part of the KV transfer until its first output (like a bootstrap decode leg).
    CONTEXT_FIRST = "context_first"


class CancelWindow(enum.Enum):
    """When a prefill engine's prefill may be cancelled without stranding KV (rule B10 in
    docs/semantics.md). A client that leaves inside the window cancels the prefill (and its
    paired legs, B6) instead of letting the keeper drain it; outside it the keeper drains and the
    staged KV is consumed (B1).
    """

    #: Never: the prefill always runs to its end (the default for an engine that
    #: declares nothing).
    NEVER = "never"
    #: Until the KV is committed to a decode: the prefill's handoff has not arrived
    #: (sequential, context first) or no decode joined its room (bootstrap). TensorRT-LLM:
    #: a context aborted after it committed its KV waits for its transfer timeout.
    BEFORE_HANDOFF = "before_handoff"
    #: Until the prefill finished: aborting it frees its blocks (vLLM). The router cancels
    #: a prefill only while no decode has taken its handoff (a prefill that answered has
    #: nothing left to cancel), so today it treats this as ``BEFORE_HANDOFF``.
    ANYTIME = "anytime"


def cancel_window_of(engine: object) -> CancelWindow:
    """The cancel window a prefill engine declares (rule B10 in docs/semantics.md).

    Args:
        engine: any engine; ``cancel_window`` is optional on a :class:`PrefillEngine`.

    Returns:
        Its ``cancel_window`` attribute, or :attr:`CancelWindow.NEVER` if it has none.

    Raises:
        TypeError: it declares one that is not a :class:`CancelWindow` (its string value,
            say): read as ``never``, it would turn B10 off in silence.
    """
    window = getattr(engine, "cancel_window", CancelWindow.NEVER)
    if not isinstance(window, CancelWindow):
        raise TypeError(f"engine {getattr(engine, 'name', engine)!r} declares a "
                        f"cancel_window that is not a trio_disagg.CancelWindow: {window!r}")
    return window


def not_an_engine_output(item: object) -> str | None:
    """What is wrong with ``item`` as an engine's output, or None if it is one: an
    ``Annotated`` whose ``data`` is None or an :class:`LLMEngineOutput`. The reader of
    an engine's stream fails the stream with this text rather than crash on the item."""
    if isinstance(item, Annotated):
        if item.data is None or isinstance(item.data, LLMEngineOutput):
            return None
        return (f"sent an Annotated whose data is {_a(type(item.data).__name__)}, not an "
                f"Annotated[LLMEngineOutput]")
    return f"sent {_a(type(item).__name__)}, not an Annotated[LLMEngineOutput]"


def decode_output(item: object) -> Annotated[LLMEngineOutput]:
    """``item``, if it is what a decode engine sends (G4, B4).

    Raises:
        WorkerError: it is not: the stream ends with this error, not with an
            ``AttributeError`` in the reader's task.
    """
    if type(item) is Annotated and type(item.data) is LLMEngineOutput:
        return item  # the usual output, checked inline (once per output)
    breach = not_an_engine_output(item)
    if breach is not None:
        raise WorkerError(f"the decode engine {breach}")
    return item  # type: ignore[return-value]


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


@runtime_checkable
class DecodeEngine(Protocol):
    """A worker as the router drives it: the whole contract, and all a decode worker needs.

    Every engine has a ``name`` and a ``generate`` method; a decode-only engine has
    nothing else. A prefill engine is a :class:`PrefillEngine`, which adds how it hands
    off. docs/howto-engine.md walks through both with a minimal pair
    (``examples/07_write_an_engine.py``). The rule ids are those of docs/semantics.md.

    **Dispatch.** The router calls ``generate(request, context, send_channel,
    task_status=...)``. A decode leg (and a B1 cleanup decode) is dispatched with
    ``await nursery.start(engine.generate, request, context, send_channel)``: the call
    returns once the engine calls ``task_status.started()``, which it does exactly once,
    as soon as the worker *accepted* the request (the HTTP answer's status arrived, the
    request is queued on the worker, the decode joined its bootstrap room), before the
    first output. A prefill leg is run with the default ``task_status``; call
    ``started()`` there too, it costs nothing. The engine then sends
    ``Annotated[LLMEngineOutput]`` items into ``send_channel`` and closes it when its
    stream ends (``with send_channel:`` around the whole body): the reader's end of the
    stream is the channel's end.

    **A prefill engine** serves the client's request as the router received it: the
    ``body`` is the client's, ``max_tokens`` the client's budget (tokens). Cutting the
    prefill to what a prefill needs (one token, not streamed, plus the worker's handoff
    options) is the engine's job; the router adds nothing to the request (B8). Its FIRST
    output decides what happens (S1-S10):

    - a handoff: ``data.disaggregated_params`` carries what the decode worker needs to
      find the KV (an opaque JSON value), with no finish reason or ``length``. With it,
      ``data.completion_usage`` with ``prompt_tokens`` and
      ``prompt_tokens_details.cached_tokens`` if the worker reported them: they are the
      numbers the client is told, since the decode sees the whole prompt as cached (S4);
    - a terminal answer: a finish reason other than ``length`` (``eos``, ``stop``, ...)
      on the first output ends the request there, with no decode (S7);
    - an error item (S2); a stream that ends with no output is an error too (S1), and
      a non-terminal first output without ``disaggregated_params`` is refused (S8).

    Later outputs are read to the end and checked: an error item, an ``error`` or a
    ``cancelled`` finish fails the prefill (T4). In the sequential styles that happens
    before the decode is dispatched (S6); in the ``BOOTSTRAP`` style the decode runs
    meanwhile, and the gatekeeper replaces its held success terminal with the error (G5).
    A ``BOOTSTRAP`` engine sends its first output (the handoff, with ``disaggregated_params``
    holding ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``, S5) at once,
    and its last one only once its KV reached the decode that joined the room.

    **A decode engine** finds the handoff in the request: in
    ``request.prefill_result.disaggregated_params`` (the prefill's value, as it sent it)
    for ``SEQUENTIAL`` and ``CONTEXT_FIRST`` prefill engines, and in
    ``request.bootstrap_info`` (the host, port and room the router chose) for
    ``BOOTSTRAP`` ones. It fetches the KV, then streams tokens; its last output has a
    finish reason (or the channel just ends). A request with ``max_tokens == 1`` and
    ``stream`` false may be the router's B1 cleanup decode: serve it like any other, the
    point is that it takes (and so frees) the staged KV.

    **Cancellation.** Honour ``context``: after ``context.stop_generating()`` end the
    stream with one item whose finish reason is ``FinishReason.CANCELLED`` (what was
    already sent stays valid); after ``context.kill()`` stop at once and send nothing
    more (C1-C3; ``context.on_stop(callback)`` or ``await context.stopped()`` tell you).
    Honour a cancelled caller as any trio code does: let ``trio.Cancelled`` through, and
    release what the request held on the worker (abort it there). A client's stop or
    kill never reaches a prefill's context (C5): the router stops it only when no decode
    will ever take its KV (a client that left inside the engine's cancel window, B10; a
    bootstrap room no decode will join, B6), cancels it if it ignores that stop for
    ``PREFILL_STOP_GRACE`` seconds, and kills it when the transfer deadline runs out
    (B2). A decode's context is stopped through the client's (C4), or by the gatekeeper.

    **A reader that is gone.** A send that raises :exc:`trio.BrokenResourceError` means
    nobody reads the stream any more (the client left, the gatekeeper ended it): just
    return (abort the request on the worker if it is still running there). Do not treat
    it as an error and do not retry; the router handles the rest (what becomes of the
    staged KV is its handoff owner's decision, B1, B6).

    **Errors.** Raise :class:`~trio_disagg.WorkerError` only *before* ``started()`` (bare,
    or as the one exception of a group from a nursery of the engine's own): the
    worker refused the request (its ``status``; ``handoff_lost=True`` if a decode
    refused because the handoff's KV is unusable, so the router sends no B1 cleanup for
    it). After ``started()`` never raise for a worker failure: send ONE error item,
    ``Annotated.from_exception(exc)`` (keeps the typed exception for the server) or
    ``Annotated.from_error(message)``, and end the stream. (A decode engine that raises
    anyway, a stray ``trio.Cancelled`` included, gets one error item in its place from
    the router, never a stream that reads as complete: G4, B4.)

    Attributes:
        name: unique within its pool; shown in metrics and logs.
    """

    name: str

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Annotated[LLMEngineOutput]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve ``request``, sending its outputs into ``send_channel`` (the contract
        above).

        Args:
            request: the client's request; a decode's carries the handoff
                (``prefill_result`` or ``bootstrap_info``).
            context: this leg's context: stop or kill it as it says (C1-C3).
            send_channel: where the outputs go; close it when the stream ends.
            task_status: ``started()`` once the worker accepted the request.

        Raises:
            WorkerError: the worker refused the request, before ``started()`` only.
        """
        ...


@runtime_checkable
class PrefillEngine(DecodeEngine, Protocol):
    """A prefill worker: a :class:`DecodeEngine` that also says how it hands KV off.

    The router reads these attributes on the engines of its prefill pool only; a
    decode-only engine need not have them. An engine that serves both pools (the
    library's own do) is a :class:`PrefillEngine`.

    **Cancel window** (optional, B10): a ``cancel_window`` attribute, a
    :class:`CancelWindow`, says when the router may cancel the prefill of a client that
    left without stranding KV. An engine without one is :attr:`CancelWindow.NEVER`: the
    keeper runs its prefill to the end and the router consumes the staged KV (B1). It is
    not a protocol member (a protocol cannot make an attribute optional): read it with
    :func:`cancel_window_of`.

    Attributes:
        handoff_style: how the engine hands off (S5-S7): :class:`HandoffStyle`.
        bootstrap_host, bootstrap_port: for ``BOOTSTRAP`` engines, where the decode
            worker meets them (docs/protocols.md section 3); None otherwise (the router
            refuses to route a bootstrap request to an engine without both).
    """

    handoff_style: HandoffStyle
    bootstrap_host: str | None
    bootstrap_port: int | None


#: An engine for either pool: a :class:`PrefillEngine` (which is also a
#: :class:`DecodeEngine`). Kept for code written before the two protocols were split;
#: annotate a decode-only engine with :class:`DecodeEngine`.
Engine = PrefillEngine


@runtime_checkable
class ModelLister(Protocol):
    """An engine that can list the models its worker serves (an HTTP adapter:
    ``GET /v1/models``); the server answers its own ``GET /v1/models`` with them."""

    async def list_models(self) -> list[dict[str, Any]]:
        """The worker's model objects (OpenAI's ``id``, ``object``, ``created``,
        ``owned_by``, and whatever else the worker says of each), as it sent them.

        It need not bound itself: the caller cancels it after its own timeout, and it must
        then leave nothing behind (an HTTP adapter closes its connection).

        Raises:
            Exception: any, if the worker could not say (the adapter's
                :class:`~trio_disagg.WorkerError`).
        """
        ...


def is_decode_failure(item: Annotated[LLMEngineOutput]) -> bool:
    """An error envelope, or ``finish_reason`` error or cancelled (G4)."""
    if item.event == "error":
        return True
    data = item.data
    if data is None or data.finish_reason is None:
        return False
    kind = data.finish_reason.kind
    return kind is FinishKind.ERROR or kind is FinishKind.CANCELLED


def is_terminal(item: Annotated[LLMEngineOutput]) -> bool:
    """An error item, or an item with a finish reason: the last of a stream (G8)."""
    data = item.data
    return item.event == "error" or (data is not None and data.finish_reason is not None)
