"""What the HTTP engine adapters share (docs/protocols.md section 1): one request to one worker,
its errors mapped for the client, its answer (one JSON object or server-sent events) turned
into ``Annotated[LLMEngineOutput]`` items.

:class:`HttpEngine` is the skeleton of :class:`~trio_disagg.engines.VllmEngine`,
:class:`~trio_disagg.engines.SglangEngine` and :class:`~trio_disagg.engines.TrtllmEngine`:
each says what to send (:meth:`HttpEngine._prepare`) and how to read the answer; the
skeleton owns the connection, the context, ``started()`` and the error mapping. Every worker
response is read inside ``async with client.stream(...)``, so it is always closed, and
closing it is what aborts the request on the worker (vLLM and SGLang abort a request when
its connection closes).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, Protocol
from urllib.parse import urlsplit

import attrs
import cattrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client, on trio natively)
import orjson
import trio
from cattrs.errors import AttributeValidationNote, IterableValidationNote

from .._context import RequestContext
from .._engine import CancelWindow, HandoffStyle
from .._errors import InvalidPrefillHandoff, WorkerError
from .._protocols import (
    Annotated,
    CompletionUsage,
    FinishKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    PromptTokensDetails,
    describe_value,
    make_strict_converter,
)
from ._wire import HttpxWorkerClient, TransportError, WorkerClient

Item = Annotated[LLMEngineOutput]
SendChannel = trio.MemorySendChannel[Annotated[LLMEngineOutput]]
Role = Literal["prefill", "decode"]


class Response(Protocol):
    """What an engine reads of a worker's answer (:class:`~trio_disagg.engines.WorkerResponse`)."""

    status_code: int

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def read(self) -> bytes: ...

    async def aread(self, limit: int | None = None) -> bytes: ...

    async def aclose(self) -> None: ...


#: What HTTP engines accept as ``client``: the project's :class:`WorkerClient` (the
#: default, and the fast one), or an :class:`httpx.AsyncClient` of the caller's own.
Client = WorkerClient | httpx.AsyncClient

#: Seconds a stopped prefill gets for an answer the worker may already have sent before
#: its response is closed (B10, B1): longer than a loaded event loop's lag, short next to
#: a prefill's compute. (An answer that is still unread after that, on a loop lagging
#: this much, is left to the worker's lease.)
PREFILL_STOP_GRACE = 0.5
#: Seconds to wait for the end of a streamed body after its ``[DONE]``, to keep the
#: connection (a worker ends the body at once; one that does not loses its connection).
BODY_END_GRACE = 0.05
ERROR_BODY_LIMIT = 64 * 1024  # bytes of a worker's error answer read for its message
JSON_BODY_LIMIT = 16 * 1024 * 1024  # bytes of a non-streamed answer
MESSAGE_LIMIT = 1000  # characters of a worker's message passed on
#: Seconds a worker's error answer may take to be read and closed after the caller was
#: cancelled (its deadline expired in the meantime): the worker's error still wins.
ERROR_CLOSE_GRACE = 0.5

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


#: Validates handoffs (B7): JSON exactly as typed, unknown keys ignored (and passed on);
#: a field typed ``typing.Annotated[T, Must(...)]`` must also meet that condition.
handoff_converter = make_strict_converter()


@attrs.frozen
class Must:
    """A condition a handoff field's value must meet besides its type (B7): the metadata
    of a ``typing.Annotated[T, Must(...)]`` field of a handoff class. Once the value is a
    ``T`` (a mistyped one is refused as such first), ``holds(value)`` must be true, or
    the field is refused as ``"must be <what>, got <value>"``."""

    holds: Callable[[Any], bool]
    what: str


def _is_checked(type_: Any) -> bool:
    return (typing.get_origin(type_) is typing.Annotated
            and any(isinstance(meta, Must) for meta in type_.__metadata__))


def _checked_structure_factory(type_: Any, conv: cattrs.Converter) -> Any:
    base_type = typing.get_args(type_)[0]
    base = conv.get_structure_hook(base_type)
    checks = [meta for meta in type_.__metadata__ if isinstance(meta, Must)]

    def structure(value: Any, _: Any) -> Any:
        value = base(value, base_type)
        for check in checks:
            if not check.holds(value):
                raise ValueError(f"must be {check.what}, got {describe_value(value)}")
        return value

    return structure


handoff_converter.register_structure_hook_factory(_is_checked, _checked_structure_factory)

#: An integer >= 0 (a block id, a request id).
NonNegativeInt = typing.Annotated[int, Must(lambda value: value >= 0, "a non-negative integer")]
#: Says a list must not be empty: ``typing.Annotated[list[int], NON_EMPTY]``.
NON_EMPTY = Must(bool, "a non-empty list")


def choices_problem(answer: Mapping[str, Any]) -> tuple[str, str] | None:
    """``("choices", ...)`` if a prefill answer's ``choices`` is a list of other than one
    choice (B7): one prefill, one KV, so which choice would a decode continue? None if it
    holds one (or is not a list: the handoff's own check says what is wrong then)."""
    choices = answer.get("choices")
    if isinstance(choices, list) and len(choices) != 1:
        return "choices", f"must hold exactly one choice, got {len(choices)}"
    return None


def handoff_problem(value: Any, cls: type[Any]) -> tuple[str, str] | None:
    """What is wrong with ``value`` as a ``cls`` (an attrs class of handoff fields),
    structured through :data:`handoff_converter`; None if nothing is.

    Returns:
        ``(field, problem)`` for the first offending field, ``field`` a path into
        ``value`` such as ``"choices[0].disaggregated_params.ctx_request_id"`` and
        ``problem`` such as ``"must be an integer, got str 'abc'"`` or ``"is missing"``.
    """
    try:
        handoff_converter.structure(value, cls)
    except Exception as exc:  # cattrs raises ClassValidationError, TypeError, ...
        return _first_problem(exc, "")
    return None


def _first_problem(exc: BaseException, path: str) -> tuple[str, str]:
    if isinstance(exc, cattrs.BaseValidationError) and exc.exceptions:
        inner = exc.exceptions[0]  # cattrs keeps them in field order
        for note in getattr(inner, "__notes__", ()):
            if isinstance(note, AttributeValidationNote):
                path = f"{path}.{note.name}" if path else note.name
                break
            if isinstance(note, IterableValidationNote):
                path = f"{path}[{note.index}]"
                break
        return _first_problem(inner, path)
    if isinstance(exc, KeyError):
        return path, "is missing"
    text = str(exc) or type(exc).__name__
    if text.startswith("expected "):  # the strict converter's "expected an integer, got ..."
        text = "must be " + text.removeprefix("expected ")
    return path, text


def needs_handoff(output: LLMEngineOutput) -> bool:
    """True for a prefill output that is not terminal (S7): no finish reason, or
    ``length``, so the decode needs its handoff."""
    finish = output.finish_reason
    return finish is None or finish.kind is FinishKind.LENGTH


def worker_client(**options: Any) -> WorkerClient:
    """A new :class:`~trio_disagg.engines.WorkerClient` for HTTP engines to share; the
    keywords ``options`` are its own (connection bounds in connections, timeouts in
    seconds; by default no read timeout of the client's own, since the router's deadlines
    bound every wait without a cancel scope per token).

    Environment proxies are not consulted: worker traffic stays inside the cluster. The
    caller owns the client: ``async with`` it, or ``await client.aclose()``.

    Raises:
        ValueError: ``max_connections`` < 1 or ``max_idle_per_worker`` < 0.
        TypeError: a keyword :class:`~trio_disagg.engines.WorkerClient` does not take.
    """
    return WorkerClient(**options)


def endpoint_for(body: Mapping[str, Any]) -> str:
    """``/v1/chat/completions`` if the body has ``messages``, else ``/v1/completions``."""
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


#: Body fields about the prompt, never sent to a decode (B8): the prompt's log
#: probabilities (``prompt_logprobs``) and the prompt echoed back (``echo``) are the
#: prefill's to compute. A decode that received the KV never ran the prompt, so it would
#: answer them wrongly or not at all; the server refuses them (400) before routing, and
#: the decode body builders drop them as a second line of defence.
PROMPT_ONLY_FIELDS = ("prompt_logprobs", "echo")


def streaming_body(request: PreprocessedRequest, *, decode: bool = True) -> dict[str, Any]:
    """The client's body, made to stream: ``stream: true`` and
    ``stream_options.include_usage: true``; for a decode leg (``decode``), without
    :data:`PROMPT_ONLY_FIELDS`.

    No budget is invented (B8): a body without ``max_tokens`` / ``max_completion_tokens``
    goes without one, and the worker's own default applies, as it would for the client
    talking to the worker directly. (``request.max_tokens`` is the router's reckoning of
    the budget, for its own accounting only.)

    The decode legs always stream, whatever the client asked: the adapter then produces
    one output per token either way, a worker dying mid-answer is seen as such, and the
    server layer collects the outputs into one JSON answer for a client that did not
    stream.
    """
    wire = dict(request.body)
    wire["stream"] = True
    options = wire.get("stream_options")
    options = dict(options) if isinstance(options, Mapping) else {}
    options["include_usage"] = True
    wire["stream_options"] = options
    if decode:
        for key in PROMPT_ONLY_FIELDS:
            wire.pop(key, None)
    return wire


def check_worker_url(url: str, protocol: str) -> str:
    """``url`` without a trailing slash.

    Raises:
        ValueError: ``url`` is not an ``http://`` or ``https://`` URL with a host, has a
            port that is not 1 to 65535, or has a query or a fragment (the adapter
            appends the endpoint's path to it).
    """
    problem = f"a {protocol} worker URL must be http(s)://host[:port], got {url!r}"
    try:
        parsed = urlsplit(url)
        port = parsed.port  # raises on a port that is not a number, or out of range
    except ValueError as exc:
        detail = ": the port must be 1 to 65535" if "range" in str(exc) else ""
        raise ValueError(problem + detail) from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(problem)
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{problem}: the port must be 1 to 65535")
    if parsed.query or parsed.fragment or "?" in url or "#" in url:
        raise ValueError(f"{problem}: no query or fragment")
    return url.rstrip("/")


def check_unique(role: str, urls: list[str]) -> None:
    """Raises ValueError if a URL appears twice (trailing slashes ignored)."""
    stripped = [url.rstrip("/") for url in urls]
    if len(set(stripped)) != len(stripped):
        raise ValueError(f"{role} URLs must be unique, got {urls}")


class Stopper:
    """Connects a request's context to the cancel scope around its worker response: a stop
    or a kill cancels :attr:`scope`, which closes the response, which aborts the request
    on the worker. After a stop, :meth:`send_cancelled` sends the ``cancelled`` finish
    unless a kill comes first. :meth:`disarm` makes later stops do nothing (kills still
    close the response).

    With a ``stop_grace`` (seconds), a stop closes the response only if the answer has not
    started within that time: an answer the worker had already sent when the stop came is
    read (then :meth:`disarm` keeps it), so its KV is not left staged for nobody (a
    prefill stopped inside its cancel window, B10, B1).
    """

    __slots__ = ("_context", "_kill_scope", "armed", "scope", "stop_grace")

    def __init__(self, context: RequestContext, *, stop_grace: float = 0.0) -> None:
        self.scope = trio.CancelScope()
        self._kill_scope: trio.CancelScope | None = None
        self._context = context
        self.armed = True
        self.stop_grace = stop_grace
        context.on_stop(self)

    def __call__(self, killed: bool) -> None:
        if killed or (self.armed and not self.stop_grace):
            self.scope.cancel()
        elif self.armed:
            self.scope.deadline = min(self.scope.deadline,
                                      trio.current_time() + self.stop_grace)
        if killed and self._kill_scope is not None:
            self._kill_scope.cancel()

    def disarm(self) -> None:
        """From now on only a kill closes the response (a stop's grace is lifted)."""
        self.armed = False
        if not self.scope.cancel_called:
            self.scope.deadline = math.inf

    async def send_cancelled(self, send: SendChannel) -> None:
        self._kill_scope = trio.CancelScope()
        if self._context.is_killed:
            self._kill_scope.cancel()
        with self._kill_scope:
            await send.send(Annotated(data=LLMEngineOutput(finish_reason=FinishReason.CANCELLED)))


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
        (if it has one) gone into ``burst``."""
        return openai_chunk(chunk, burst, self.finish_table)

    def usage(self, chunk: Mapping[str, Any]) -> CompletionUsage | None:
        """The usage of a chunk that follows the finish (OpenAI's usage chunk)."""
        return parse_usage(chunk)


class Burst:
    """The non-terminal outputs of one socket read, gathered into one item (the relay's hot
    path, docs/performance.md): one channel send, one trip through the gatekeeper and one
    write to the client per burst, not per token.

    Their token ids and text are joined; each worker choice is kept, in order, to be
    relayed as its own chunk (B8); the last usage reported wins. All are of one choice
    index (the router asks a worker for ``n`` = 1).
    """

    __slots__ = ("choices", "index", "texts", "token_ids", "usage")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.choices: list[Mapping[str, Any]] = []
        self.usage: CompletionUsage | None = None
        self.index: int | None = None

    def add_parts(self, choice: Mapping[str, Any], text: str | None, token_ids: list[int],
                  usage: CompletionUsage | None) -> None:
        """Add one chunk, as :func:`openai_chunk` read it."""
        self.choices.append(choice)
        if text:
            self.texts.append(text)
        if token_ids:
            self.token_ids += token_ids
        if usage is not None:
            self.usage = usage

    def add(self, output: LLMEngineOutput) -> None:
        """Add one output without a finish reason."""
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
        texts, choices = self.texts, self.choices
        if not texts and not choices and not self.token_ids:
            return None
        output = LLMEngineOutput(
            token_ids=self.token_ids, text="".join(texts) if texts else None,
            completion_usage=self.usage, index=self.index, choices=choices or None)
        self.token_ids, self.texts, self.choices = [], [], []
        self.usage = None
        return output


class HttpEngine:
    """The skeleton of an HTTP engine adapter (an :class:`~trio_disagg.Engine`).

    ``generate`` POSTs :meth:`_prepare`'s body with ``X-Request-Id: request.request_id``,
    calls ``task_status.started()`` once the worker answered 2xx headers, then
    :meth:`_relay`\\ s the answer. Subclasses set :attr:`protocol`, :meth:`_prepare`, and
    what a whole answer means (:meth:`_answer_output`).

    Errors: before ``started()`` a worker's 4xx raises :class:`~trio_disagg.WorkerError`
    with that status and the worker's own message; a 5xx, another status, or a transport
    failure raises it with status 502 and a message naming the worker. Once the worker
    answered an error status, that error is what is raised, even if the caller's deadline
    expires while the answer is read and closed (within :data:`ERROR_CLOSE_GRACE`). After
    ``started()`` failures are sent as ONE error item and the stream ends: an error answer
    or event, a transport failure, a malformed answer, or a stream that ends without a
    finish reason (the worker died). The item carries a :class:`~trio_disagg.WorkerError`
    (status 502, naming the worker) for the server to map by type. Nothing is raised then.

    Cancellation: ``context.stop_generating()`` closes the worker response (the worker
    aborts the request) and ends the stream with one ``cancelled`` item;
    ``context.kill()`` closes it and ends the stream at once; a closed receiver or a
    cancelled caller closes it too.

    Handoffs (B7): a prefill's whole answer that is not terminal (S7) is validated as a
    handoff (:meth:`_handoff_problem`) before it is sent on; an invalid one becomes ONE
    error item carrying an :class:`~trio_disagg.InvalidPrefillHandoff` that names the
    offending field, and no output with a handoff is sent.

    ``cancel_window`` (B10) is the class's :attr:`default_cancel_window` unless the
    constructor's ``cancel_window`` says otherwise (a deployment whose workers free KV
    differently); ``handoff_style`` is ``SEQUENTIAL`` unless a subclass says otherwise.

    Args:
        url: the worker's base URL (``http://host:port``; a trailing slash is dropped).
        role: ``"prefill"`` or ``"decode"``.
        client: a :class:`~trio_disagg.engines.WorkerClient` (shared by the engines;
            the engine never closes it) or an :class:`httpx.AsyncClient` of the caller's
            own (wrapped in a :class:`~trio_disagg.engines.HttpxWorkerClient`).
        name: unique within its pool; default ``url``.
        cancel_window: overrides :attr:`default_cancel_window` for this engine (B10).

    Raises:
        ValueError: ``url`` is not an ``http(s)://host[:port]`` URL (a port outside 1 to
            65535, a query or a fragment included), or ``role`` is neither role.
        TypeError: ``cancel_window`` is not a :class:`~trio_disagg.CancelWindow`.
    """

    #: The protocol's name, for messages.
    protocol: ClassVar[str] = "HTTP"
    #: When this protocol's prefill may be cancelled without stranding KV (B10); each
    #: adapter sets its own, an instance may override it (``cancel_window=``).
    default_cancel_window: ClassVar[CancelWindow] = CancelWindow.NEVER
    #: How this protocol's prefill hands off (S5-S7); decode engines are SEQUENTIAL.
    prefill_handoff_style: ClassVar[HandoffStyle] = HandoffStyle.SEQUENTIAL
    #: The worker's health endpoint (vLLM, SGLang and TensorRT-LLM all serve
    #: ``GET /health``: docs/protocols.md section 1).
    health_path: ClassVar[str] = "/health"

    def __init__(
        self,
        url: str,
        role: Role,
        *,
        client: Client,
        name: str | None = None,
        cancel_window: CancelWindow | None = None,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        if cancel_window is not None and not isinstance(cancel_window, CancelWindow):
            raise TypeError(f"cancel_window must be a CancelWindow, got {cancel_window!r}")
        self.url = check_worker_url(url, self.protocol)
        self.role: Role = role
        self.client = client
        self._transport = (client if isinstance(client, WorkerClient)
                           else HttpxWorkerClient(client))
        self.name = name if name is not None else self.url
        self.handoff_style = (self.prefill_handoff_style if role == "prefill"
                              else HandoffStyle.SEQUENTIAL)
        self.cancel_window = (self.default_cancel_window if cancel_window is None
                              else cancel_window)
        self.bootstrap_host: str | None = None
        self.bootstrap_port: int | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.role} {self.url}>"

    # --- what subclasses say ---------------------------------------------------------------

    def _prepare(self, request: PreprocessedRequest) -> tuple[str, dict[str, Any]]:
        """The path and body to POST for ``request``.

        Raises:
            WorkerError: the request cannot be sent to this worker (status 400).
        """
        raise NotImplementedError

    def _parser(self, request: PreprocessedRequest, path: str) -> ChunkParser:
        return ChunkParser()

    def _answer_output(
        self,
        answer: Mapping[str, Any],
        request: PreprocessedRequest,
        body: Mapping[str, Any],
        parser: ChunkParser,
    ) -> LLMEngineOutput | None:
        """The output of a whole (non-streamed) answer to ``body``; None if it has no
        finish."""
        output = parser.output(answer, final=True)
        if output is None or output.finish_reason is None:
            return None
        return output

    def _handoff_problem(self, answer: Mapping[str, Any]) -> tuple[str, str] | None:
        """What is wrong with a prefill's non-terminal whole answer as a handoff (B7), as
        :func:`handoff_problem` says it; None if nothing is (the default: no check)."""
        return None

    def _invalid_handoff(self, field: str, problem: str, *, sent: bool = True) -> Item:
        """The ONE error item for an invalid handoff (B7): it carries an
        :class:`~trio_disagg.InvalidPrefillHandoff` naming ``field``, which the router's
        classification raises as is. ``sent``: the worker sent the handoff (else the
        adapter made it from the request)."""
        how = "sent an invalid handoff" if sent else "has an invalid handoff"
        return Annotated.from_exception(InvalidPrefillHandoff(
            f"prefill worker {self.url} {how}: {field} {problem}", field=field))

    async def _relay(
        self,
        response: Response,
        request: PreprocessedRequest,
        path: str,
        body: Mapping[str, Any],
        stopper: Stopper,
        send: SendChannel,
    ) -> None:
        """Read an accepted answer to ``body``: one JSON object if it did not stream, else
        server-sent events (or one JSON object from a worker that will not stream)."""
        parser = self._parser(request, path)
        if self.role == "prefill" and self.handoff_style is not HandoffStyle.BOOTSTRAP:
            # The prefill answers: its KV is staged. A stop from here on (the router
            # ending a prefill it no longer needs, B10) must not drop the answer, whose KV
            # the router then consumes (B1); only a kill still closes the response. (A
            # bootstrap prefill's KV goes to the decode in its room, not to the answer.)
            stopper.disarm()
        if body.get("stream") is True:
            await self._relay_any(response, request, body, parser, send)
        else:
            await self._relay_json(response, request, body, parser, send)

    # --- the skeleton ------------------------------------------------------------------------

    async def generate(  # noqa: ASYNC114 (started by the router)
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: SendChannel,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve one leg of ``request`` on the worker; see the class docstring.

        Raises:
            WorkerError: before ``started()`` only: a request this worker cannot take
                (400), the worker's 4xx (that status), or a 5xx / transport failure (502).
        """
        with send_channel:
            path, body = self._prepare(request)
            # The server accepts any printable id: send its UTF-8 bytes, never fail on it.
            headers = {b"x-request-id": request.request_id.encode(),
                       b"content-type": b"application/json"}
            if body.get("stream") is True:
                headers[b"accept"] = b"text/event-stream"
            # A prefill's answer may be on its way when a stop comes: give it a moment.
            stopper = Stopper(context, stop_grace=(
                PREFILL_STOP_GRACE if self.role == "prefill"
                and self.handoff_style is not HandoffStyle.BOOTSTRAP else 0.0))
            started = False
            refusal: WorkerError | None = None
            try:
                with stopper.scope:
                    async with self._transport.stream(
                        "POST", self.url + path, content=orjson.dumps(body), headers=headers
                    ) as response:
                        if not 200 <= response.status_code < 300:
                            # Raised below, not here: leaving this block with it would
                            # close the response at a checkpoint, where a deadline expiring
                            # now would replace the worker's error with Cancelled.
                            refusal = await self._status_error(response)
                        else:
                            task_status.started()
                            started = True
                            await self._relay(response, request, path, body, stopper,
                                              send_channel)
            except TransportError as exc:
                if not started:
                    raise WorkerError(
                        f"{self.role} worker {self.url} failed: {describe(exc)}",
                        status=502, worker=self.name,
                    ) from exc
                await send_quietly(send_channel, self._error(
                    f"failed mid-stream: {describe(exc)}"))
                return
            except trio.BrokenResourceError:
                # The receiver is gone: the response is closed (an abort on the worker).
                # send() raised before its checkpoint completed.
                await trio.lowlevel.checkpoint()
                return
            if refusal is not None:
                raise refusal
            if stopper.scope.cancelled_caught:
                if not started:
                    task_status.started()  # accepted and at once stopped
                try:
                    await stopper.send_cancelled(send_channel)
                except trio.BrokenResourceError:
                    await trio.lowlevel.checkpoint()

    async def check_health(self) -> None:
        """Probe the worker's health endpoint once (``GET`` :attr:`health_path`), for a
        :class:`~trio_disagg.HealthMonitor`, which bounds it with its timeout.

        Raises:
            WorkerError: the worker could not be reached (``worker_status`` None), or
                answered anything but 2xx (``worker_status`` is that status).
        """
        try:
            async with self._transport.stream("GET", self.url + self.health_path, content=b"",
                                              headers={}) as response:
                status = response.status_code
                await response.aread(ERROR_BODY_LIMIT)
        except TransportError as exc:
            raise WorkerError(f"{self.role} worker {self.url} health check failed: "
                              f"{describe(exc)}", status=502, worker=self.name) from exc
        if not 200 <= status < 300:
            raise WorkerError(
                f"{self.role} worker {self.url} health check answered {status}",
                status=502, worker=self.name, worker_status=status)

    async def _status_error(self, response: Response) -> WorkerError:
        """The error for a worker's non-2xx answer; the answer is read and closed.

        The worker's answer is final, so reading and closing it is shielded from the
        caller's cancellation for at most :data:`ERROR_CLOSE_GRACE` seconds: a deadline
        expiring meanwhile must not turn the worker's error into a Cancelled (the client
        would see a timeout instead of the worker's 4xx or 5xx).
        """
        status = response.status_code
        # Collected part by part, so that the grace may run out after the last part
        # arrived and keep what came.
        data = bytearray()
        with trio.move_on_after(ERROR_CLOSE_GRACE, shield=True):
            try:
                while part := await response.read():
                    data += part
                    if len(data) >= ERROR_BODY_LIMIT:
                        break
            except TransportError:
                pass  # the status says enough
            await response.aclose()
        message = error_message(bytes(data), status)
        lost = self.role == "decode" and reports_lost_kv(message)
        if 400 <= status < 500:
            return WorkerError(message, status=status, worker=self.name, worker_status=status,
                               handoff_lost=lost)
        return WorkerError(
            f"{self.role} worker {self.url} answered {status}: {message}",
            status=502, worker=self.name, worker_status=status, handoff_lost=lost,
        )

    def _error(self, what: str) -> Item:
        """An error item naming this worker: ``"decode worker URL <what>"``.

        It carries a :class:`~trio_disagg.WorkerError` (status 502, this worker) so that
        the server can map the failure by its type; on the wire only the message goes.
        """
        return Annotated.from_exception(WorkerError(
            f"{self.role} worker {self.url} {what}", status=502, worker=self.name))

    async def _read_answer(self, response: Response) -> tuple[dict[str, Any] | Item, bytes]:
        """A whole JSON answer (or the error item saying what is wrong with it), and its
        bytes."""
        data = await response.aread(JSON_BODY_LIMIT)
        if len(data) >= JSON_BODY_LIMIT:
            return self._error(f"answered more than {JSON_BODY_LIMIT} bytes"), data
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError:
            return self._error(f"answered malformed JSON: {excerpt(data)}"), data
        if not isinstance(answer, dict):
            return self._error(f"answered {type(answer).__name__}, not an object"), data
        if is_error_object(answer):
            return self._error(f"reported an error: {error_text(answer)}"), data
        return answer, data

    async def _relay_json(
        self,
        response: Response,
        request: PreprocessedRequest,
        body: Mapping[str, Any],
        parser: ChunkParser,
        send: SendChannel,
    ) -> None:
        """One non-streamed answer -> one output, or one error item."""
        answer, data = await self._read_answer(response)
        if isinstance(answer, Annotated):
            await send.send(answer)
            return
        output = self._answer_output(answer, request, body, parser)
        if output is None:
            await send.send(self._error(
                f"answered without a choice or a finish_reason: {excerpt(data)}"))
            return
        if self.role == "prefill" and needs_handoff(output):
            # B7: checked here, at the edge, so that nothing downstream builds a decode
            # request from it; the answer itself is passed on as the worker sent it.
            problem = self._handoff_problem(answer)
            if problem is not None:
                await send.send(self._invalid_handoff(*problem))
                return
        await send.send(Annotated(data=output))

    async def _relay_any(
        self,
        response: Response,
        request: PreprocessedRequest,
        body: Mapping[str, Any],
        parser: ChunkParser,
        send: SendChannel,
    ) -> None:
        content_type = response.headers.get("content-type", "")
        if content_type.startswith("text/event-stream"):
            await self._relay_stream(response, parser, send)
        elif content_type.startswith("application/json"):
            await self._relay_json(response, request, body, parser, send)  # won't stream
        else:
            await send.send(self._error(f"answered content-type {content_type!r}"))

    async def _relay_stream(
        self, response: Response, parser: ChunkParser, send: SendChannel
    ) -> None:
        """Server-sent events -> outputs; the finish is held until the usage chunk.

        The hot path of the relay (docs/performance.md): what one socket read brought is
        split into its events at once, and the outputs of those events go to the channel
        as one item (a :class:`Burst`), so a burst of tokens costs one channel send, one
        trip through the gatekeeper and one write to the client.
        """
        final: LLMEngineOutput | None = None  # the finish, waiting for its usage chunk
        done = False
        pending = b""  # the start of an event the next read completes
        burst = Burst()  # this read's outputs, sent as one item
        add = parser.add
        try:
            while part := await response.read():
                if pending:
                    part = pending + part
                if b"\r" in part:
                    part, pending_cr = normalise_line_ends(part)
                else:
                    pending_cr = b""
                events = part.split(b"\n\n")
                pending = events.pop() + pending_cr
                error: Item | None = None
                for event in events:
                    if event[:6] == b"data: " and b"\n" not in event:
                        data: bytes | None = event[6:]  # the common case: one data line
                    else:
                        data = sse_data(event)
                    if data is None:
                        continue
                    if data == b"[DONE]":
                        done = True
                        break
                    try:
                        chunk = orjson.loads(data)
                    except orjson.JSONDecodeError:
                        error = self._error(f"sent a malformed chunk: {data[:200]!r}")
                        break
                    if type(chunk) is not dict:
                        error = self._error(f"sent a chunk that is not an object: {data[:200]!r}")
                        break
                    if is_error_object(chunk):
                        error = self._error(f"reported an error: {error_text(chunk)}")
                        break
                    if final is not None:
                        usage = parser.usage(chunk)
                        if usage is not None:
                            final.completion_usage = usage
                        continue
                    final = add(chunk, burst)
                if (output := burst.take()) is not None:
                    item = Annotated(data=output)
                    try:
                        send.send_nowait(item)
                        sent = True
                    except trio.WouldBlock:
                        sent = False
                    if not sent:  # awaited outside the except: no exception kept alive
                        await send.send(item)
                if error is not None:
                    await send.send(error)
                    return
                if done:
                    break
        except TransportError as exc:
            if final is None:
                await send.send(self._error(f"failed mid-stream: {describe(exc)}"))
                return
            # The answer was complete; only the usage chunk or [DONE] was lost.
        if final is None:
            how = "sent [DONE]" if done else "closed the stream"
            await send.send(self._error(
                f"{how} without a finish_reason (the worker died mid-stream?)"))
            return
        # Sent before anything else is awaited: the writer ends the response in the same
        # socket write as the burst before it.
        await send.send(Annotated(data=final))
        if done:
            # The body's end follows [DONE] at once: read it, so that the connection goes
            # back to the pool instead of being closed. The answer is complete already.
            with trio.move_on_after(BODY_END_GRACE):
                try:
                    while await response.read():
                        pass
                except TransportError:
                    pass


# --- wire helpers ----------------------------------------------------------------------------


async def send_quietly(send: SendChannel, item: Item) -> None:
    """Send ``item`` unless the receiver is gone."""
    try:
        await send.send(item)
    except trio.BrokenResourceError:
        await trio.lowlevel.checkpoint()


def normalise_line_ends(data: bytes) -> tuple[bytes, bytes]:
    """``data`` with CRLF and CR line ends made LF (server-sent events allow all three),
    and a trailing CR held back (its LF may come with the next read)."""
    held = b""
    if data.endswith(b"\r"):
        data, held = data[:-1], b"\r"
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n"), held


def sse_data(event: bytes) -> bytes | None:
    """The data of one server-sent event (its ``data:`` lines joined by LF), or None for
    an event without data (a comment, a bare ``event:`` or ``id:``)."""
    lines: list[bytes] = []
    for line in event.split(b"\n"):
        field, colon, value = line.partition(b":")
        if field == b"data":
            lines.append(value[1:] if value[:1] == b" " else value)
        elif not field and not colon:
            continue  # a blank line
    return b"\n".join(lines) if lines else None


def reports_lost_kv(message: str) -> bool:
    """Whether a decode worker's error message says the handoff's KV could not be used:
    the KV transfer failed (vLLM's and the mock workers' "KV transfer failed: ...")."""
    return message.lstrip().lower().startswith("kv transfer failed")


def describe(exc: BaseException) -> str:
    """``"ConnectError: [Errno 111] ..."``, or the exception's type name alone."""
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


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
    """``value`` if it is an int, else 0."""
    return value if type(value) is int else 0


def make_usage(prompt: int, completion: int, total: int, cached: Any) -> CompletionUsage:
    """A usage with ``cached_tokens`` if it is an int."""
    return CompletionUsage(
        prompt_tokens=prompt, completion_tokens=completion,
        total_tokens=total or prompt + completion,
        prompt_tokens_details=(PromptTokensDetails(cached_tokens=cached)
                               if type(cached) is int else None),
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
    choices = chunk.get("choices")
    if type(choices) is list and choices and type(choice := choices[0]) is dict:
        # The common chunk, read inline (this runs once per token): a dict choice with a
        # ``text`` or a ``delta`` dict and no finish.
        if choice.get("finish_reason") is not None:
            return openai_output(chunk, final=False, finish_table=finish_table)
        if "text" in choice:
            text = choice["text"]
        elif type(delta := choice.get("delta")) is dict:
            text = delta.get("content")
        else:
            text = None
        if type(text) is str and text and "token_ids" not in choice:
            usage = chunk.get("usage")
            burst.add_parts(choice, text, [],
                            None if usage is None else parse_usage(chunk))
            return None
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
