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

from collections.abc import Mapping
from contextlib import suppress
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Protocol

import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client, on trio natively)
import orjson
import trio

from .._context import RequestContext
from .._engine import CancelWindow, HandoffStyle
from .._errors import InvalidPrefillHandoff, WorkerError
from .._protocols import Annotated, LLMEngineOutput, PreprocessedRequest
from .._pull import PullSlot
from ._chunks import ChunkParser, choices_beyond_one
from ._handoffs import needs_handoff
from ._headers import CREDENTIAL_STATUSES, credentials_refused, refusal_retry_after
from ._httpx import HttpxWorkerClient
from ._models import ModelListing
from ._pulled import SseSource
from ._reader import SseReader
from ._requests import check_worker_url, request_headers
from ._stopper import SendChannel, Stopper, send_quietly
from ._transport import TransportError
from ._wire import WorkerClient
from ._worker_errors import (
    REPORTED_ERROR,
    error_message,
    error_text,
    excerpt,
    is_error_object,
    reports_lost_kv,
)

Item = Annotated[LLMEngineOutput]
Role = Literal["prefill", "decode"]


class Response(Protocol):
    """What an engine reads of a worker's answer (:class:`~trio_disagg.engines.WorkerResponse`)."""

    status_code: int

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def at_end(self) -> bool: ...

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
#: Seconds a worker's error answer may take to be read and closed after the caller was
#: cancelled (its deadline expired in the meantime): the worker's error still wins.
ERROR_CLOSE_GRACE = 0.5

class HttpEngine(ModelListing):
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
    #: The fields the worker's own whole chat answer carries in its ``message`` even when
    #: it generated nothing for them, with that value: the router's answer to a client
    #: that did not stream, collected from the decode's stream, carries them too (B8;
    #: vLLM's ``tool_calls: []``, which an OpenAI client reads as a list, not None).
    whole_message: ClassVar[Mapping[str, Any]] = MappingProxyType({})

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
        #: A decode stream's reader may read the worker in its own task (_pull.py): not
        #: through httpx, whose body iterator a cancelled read (the reader's own timeout)
        #: ends, and whose response it closes.
        self.reader_pulls = self._transport is client
        self.name = name if name is not None else self.url
        self.handoff_style = (self.prefill_handoff_style if role == "prefill"
                              else HandoffStyle.SEQUENTIAL)
        self.cancel_window = (self.default_cancel_window if cancel_window is None
                              else cancel_window)
        self.bootstrap_host: str | None = None
        self.bootstrap_port: int | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.role} {self.url}>"

    @property
    def _keeps_answer(self) -> bool:
        """A prefill whose answer stages its KV (every style but the bootstrap one, whose
        KV goes to the decode in its room): a stop must not drop an answer on its way."""
        return self.role == "prefill" and self.handoff_style is not HandoffStyle.BOOTSTRAP

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
        if self._keeps_answer:
            # The prefill answers: its KV is staged. A stop from here on (the router
            # ending a prefill it no longer needs, B10) must not drop the answer, whose KV
            # the router then consumes (B1); only a kill still closes the response. (A
            # bootstrap prefill's KV goes to the decode in its room, not to the answer.)
            stopper.disarm()
        if body.get("stream") is True:
            await self._relay_any(response, request, body, parser, send,
                                  stopper.pull if self.reader_pulls else None)
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
            headers = request_headers(request.request_id, streams=body.get("stream") is True)
            # A prefill's answer may be on its way when a stop comes: give it a moment.
            stopper = Stopper(context, stop_grace=PREFILL_STOP_GRACE if self._keeps_answer
                              else 0.0)
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
            raise WorkerError(f"{self.role} worker {self.url} health check answered {status}",
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
        if status in CREDENTIAL_STATUSES:  # a 4xx, so no retry and no ejection either
            message = credentials_refused(self.role, self.url, status, message)
        lost = self.role == "decode" and reports_lost_kv(message)
        wait = refusal_retry_after(status, response.headers)
        if 400 <= status < 500:
            return WorkerError(message, status=status, worker=self.name, worker_status=status,
                               handoff_lost=lost, retry_after=wait)
        return WorkerError(f"{self.role} worker {self.url} answered {status}: {message}",
                           status=502, worker=self.name, worker_status=status,
                           handoff_lost=lost, retry_after=wait)

    def _error(self, what: str) -> Item:
        """An error item naming this worker: ``"decode worker URL <what>"``.

        It carries a :class:`~trio_disagg.WorkerError` (status 502, this worker) so that
        the server can map the failure by its type; on the wire only the message goes.
        A decode worker's own error saying its handoff's KV could not be used is
        ``handoff_lost`` (the KV is gone: a B1 cleanup has nothing left to consume)."""
        lost = self.role == "decode" and reports_lost_kv(what, reported=True)
        return Annotated.from_exception(WorkerError(
            f"{self.role} worker {self.url} {what}", status=502, worker=self.name,
            handoff_lost=lost))

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
            return self._error(f"{REPORTED_ERROR}{error_text(answer)}"), data
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
        item: Item
        if isinstance(answer, Annotated):
            item = answer
        elif (output := self._answer_output(answer, request, body, parser)) is None:
            item = self._error(f"answered without a choice or a finish_reason: {excerpt(data)}")
        elif self.role == "prefill" and needs_handoff(output) and (
                problem := self._handoff_problem(answer)) is not None:
            # B7: checked at the edge, so that nothing downstream builds a decode request
            # from it; the answer itself is passed on as the worker sent it.
            item = self._invalid_handoff(*problem)
        elif (beyond := choices_beyond_one(answer)) is not None:
            # B8, as for a chunk: not its first choice with the others dropped (S7 too)
            item = self._error(beyond)
        else:
            item = Annotated(data=output)
        await send.send(item)

    async def _relay_any(
        self,
        response: Response,
        request: PreprocessedRequest,
        body: Mapping[str, Any],
        parser: ChunkParser,
        send: SendChannel,
        slot: PullSlot | None,
    ) -> None:
        content_type = response.headers.get("content-type", "")
        if content_type.startswith("text/event-stream"):
            await self._relay_stream(response, parser, send, slot)
        elif content_type.startswith("application/json"):
            await self._relay_json(response, request, body, parser, send)  # won't stream
        else:
            await send.send(self._error(f"answered content-type {content_type!r}"))

    async def _relay_stream(
        self, response: Response, parser: ChunkParser, send: SendChannel,
        slot: PullSlot | None,
    ) -> None:
        """Server-sent events -> outputs, the finish held until the usage chunk: what one
        socket read brought is one item (a :class:`~._burst.Burst`: one trip through the
        gate and one write, docs/performance.md). With a ``slot`` the stream's reader
        reads the worker in its own task (:class:`~._pulled.SseSource`) while this leg
        waits: one task a token."""
        source = SseSource(response, SseReader(parser), self._error, describe, slot)
        if slot is not None and slot.offer(source):
            try:
                await slot.wait_released()
            finally:
                slot.withdraw()  # a stop: the reader reads the channel for the rest
                if (read := source.pull_nowait()) is not None:  # (read before the stop)
                    with suppress(trio.WouldBlock, trio.BrokenResourceError):
                        send.send_nowait(read)
            if source.crash is not None:
                raise source.crash  # reading crashed in the reader's task: this leg's (B4)
        else:
            while (item := await source.pull()) is not None:
                try:
                    send.send_nowait(item)
                    sent = True
                except trio.WouldBlock:
                    sent = False
                if not sent:  # awaited outside the except: no exception kept alive
                    await send.send(item)
        if source.finished and source.reader.done and source.reader.final is not None:
            await _read_body_end(response)


async def _read_body_end(response: Response) -> None:
    """Read the end of a streamed body that sent ``[DONE]`` (it follows at once), for its
    connection to go back to the pool; the answer is complete: a failure changes nothing."""
    if response.at_end:  # it came with the [DONE]: no wait, no cancel scope
        return
    with trio.move_on_after(BODY_END_GRACE):
        try:
            while await response.read():
                pass
        except TransportError:
            pass


# --- wire helpers ----------------------------------------------------------------------------


def describe(exc: BaseException) -> str:
    """``"ConnectError: [Errno 111] ..."``, or the exception's type name alone."""
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


