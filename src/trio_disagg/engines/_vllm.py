"""The vLLM engine adapter: prefill and decode workers over HTTP (PROTOCOLS.md section 2).

vLLM's disaggregated serving with a NixlConnector-style KV connector is *sequential*: the
router sends the prefill worker the client's request cut down to one token, with
``kv_transfer_params: {"do_remote_decode": true, ...}``; the prefill computes the prompt's
KV, keeps its blocks and answers with ``kv_transfer_params`` saying where they are; the
router then sends the decode worker the client's request plus those ``kv_transfer_params``
verbatim, and the decode worker pulls the blocks before it produces tokens.

:class:`VllmEngine` implements :class:`~trio_disagg.Engine` for either role over one
shared :class:`httpx.AsyncClient` (httpx runs on trio natively). Every worker response is
read inside ``async with client.stream(...)``, so it is always closed, and closing it is
what aborts the request on the worker: vLLM aborts a request when its connection closes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import aclosing
from typing import Any, Literal

import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client, on trio natively)
import orjson
import trio
from httpx_sse import EventSource

from .._context import RequestContext
from .._engine import HandoffStyle
from .._errors import WorkerError
from .._protocols import (
    Annotated,
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    PromptTokensDetails,
    TraceLink,
)

Item = Annotated[LLMEngineOutput]
SendChannel = trio.MemorySendChannel[Annotated[LLMEngineOutput]]
Role = Literal["prefill", "decode"]

#: Connections to all workers together (``max_connections``), and idle ones kept
#: (``max_keepalive_connections``). An idle connection is dropped after 4 s, before vLLM's
#: own 5 s keep-alive timeout (uvicorn's) closes it under a request.
DEFAULT_LIMITS = httpx.Limits(
    max_connections=1024, max_keepalive_connections=256, keepalive_expiry=4.0
)
#: Seconds: to connect; between two reads (a prefill answers only when done, and a decode
#: may pause; the router's deadlines are the real bounds); to write the body; to wait for
#: a free connection of the pool.
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=300.0, write=30.0, pool=30.0)

#: The ``kv_transfer_params`` of every prefill request (PROTOCOLS.md section 2).
PREFILL_KV_TRANSFER_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

_ERROR_BODY_LIMIT = 64 * 1024  # bytes of a worker's error answer read for its message
_JSON_BODY_LIMIT = 16 * 1024 * 1024  # bytes of a non-streamed answer
_MESSAGE_LIMIT = 1000  # characters of a worker's message passed on

_FINISH: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED,
    "cancelled": FinishReason.CANCELLED,
    "eos": FinishReason.EOS,
    "content_filter": FinishReason.CONTENT_FILTER,
    # vLLM's tool-call parsers end a turn this way: a complete answer.
    "tool_calls": FinishReason.STOP,
    "function_call": FinishReason.STOP,
}


def vllm_client(
    *, limits: httpx.Limits | None = None, timeout: httpx.Timeout | None = None
) -> httpx.AsyncClient:
    """A new :class:`httpx.AsyncClient` for :class:`VllmEngine`\\ s to share.

    Its pool is bounded by ``limits`` (default :data:`DEFAULT_LIMITS`); its timeouts are
    ``timeout`` (default :data:`DEFAULT_TIMEOUT`). Environment proxies are ignored: worker
    traffic stays inside the cluster. The caller owns it: ``async with`` it, or
    ``await client.aclose()``.
    """
    return httpx.AsyncClient(
        limits=limits if limits is not None else DEFAULT_LIMITS,
        timeout=timeout if timeout is not None else DEFAULT_TIMEOUT,
        trust_env=False,
    )


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill request for a client's body (PROTOCOLS.md section 2).

    The client's body with ``stream: false``, ``max_tokens: 1`` (and
    ``max_completion_tokens: 1`` if the body has it), ``stream_options`` and
    ``min_tokens`` removed, and :data:`PREFILL_KV_TRANSFER_PARAMS`.
    """
    wire = dict(body)
    wire["stream"] = False
    wire["max_tokens"] = 1
    if "max_completion_tokens" in wire:
        wire["max_completion_tokens"] = 1
    wire.pop("stream_options", None)
    wire.pop("min_tokens", None)
    wire["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return wire


def decode_body(request: PreprocessedRequest) -> dict[str, Any]:
    """The decode request for ``request`` (PROTOCOLS.md section 2).

    The client's original body plus the prefill's ``kv_transfer_params`` verbatim (from
    ``request.prefill_result.disaggregated_params``), with two changes, both invisible to
    the client:

    - the decode worker is always asked to stream (``stream: true``,
      ``stream_options.include_usage: true``), whatever the client asked: the adapter
      then produces one output per token either way, a worker dying mid-answer is seen
      as such, and the server layer collects the outputs into one JSON answer for a
      client that did not stream;
    - a body that names no budget (``max_tokens`` / ``max_completion_tokens``) gets the
      router's resolved ``request.max_tokens``, so the worker's default never overrides
      the router's.
    """
    wire = dict(request.body)
    wire["stream"] = True
    options = wire.get("stream_options")
    options = dict(options) if isinstance(options, Mapping) else {}
    options["include_usage"] = True
    wire["stream_options"] = options
    if (
        request.max_tokens is not None
        and "max_tokens" not in wire
        and "max_completion_tokens" not in wire
    ):
        key = "max_completion_tokens" if "messages" in wire else "max_tokens"
        wire[key] = request.max_tokens
    if request.prefill_result is not None:
        wire["kv_transfer_params"] = request.prefill_result.disaggregated_params
    else:
        wire.pop("kv_transfer_params", None)
    return wire


def endpoint_for(body: Mapping[str, Any]) -> str:
    """``/v1/chat/completions`` if the body has ``messages``, else ``/v1/completions``."""
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


class _Stopper:
    """Connects a request's context to the cancel scope around its worker response: a stop
    or a kill cancels :attr:`scope`, which closes the response, which aborts the request
    on the worker. After a stop, :meth:`send_cancelled` sends the ``cancelled`` finish
    unless a kill comes first."""

    __slots__ = ("_context", "_kill_scope", "scope")

    def __init__(self, context: RequestContext) -> None:
        self.scope = trio.CancelScope()
        self._kill_scope: trio.CancelScope | None = None
        self._context = context
        context.on_stop(self)

    def __call__(self, killed: bool) -> None:
        self.scope.cancel()
        if killed and self._kill_scope is not None:
            self._kill_scope.cancel()

    async def send_cancelled(self, send: SendChannel) -> None:
        self._kill_scope = trio.CancelScope()
        if self._context.is_killed:
            self._kill_scope.cancel()
        with self._kill_scope:
            await send.send(Annotated(data=LLMEngineOutput(finish_reason=FinishReason.CANCELLED)))


class VllmEngine:
    """A vLLM worker, prefill or decode, as an :class:`~trio_disagg.Engine`
    (PROTOCOLS.md sections 1 and 2).

    **Prefill** (``role="prefill"``): ``POST`` :func:`prefill_body` to
    ``/v1/chat/completions`` if the body has ``messages``, else ``/v1/completions``, not
    streamed. vLLM answers only once the prefill is done; the answer becomes ONE output:
    the token's text (and ``token_ids`` if the worker sent them), its finish reason, the
    usage with ``prompt_tokens_details.cached_tokens`` (the router reports this one to
    the client, S4/S10), and ``disaggregated_params`` = the answer's
    ``kv_transfer_params``. A prefill that ended on its first token (``finish_reason``
    ``stop``, ``kv_transfer_params`` null) is thus an output with finish ``STOP`` and no
    ``disaggregated_params``: the router's terminal case, no decode (S7).

    **Decode** (``role="decode"``): ``POST`` :func:`decode_body` (always streamed) and
    turn each server-sent event into an output: its text, ``token_ids`` if present, and
    on the last one the finish reason with the usage of the final usage chunk. Worker
    finish reasons map as ``stop``/``tool_calls`` -> ``STOP``, ``length`` -> ``LENGTH``,
    ``abort`` -> ``CANCELLED``, ``content_filter``, ``eos``, and ``error`` -> an error
    finish; any other string -> ``STOP``.

    Every request carries ``X-Request-Id: request.request_id``. ``task_status.started()``
    is called once the worker answered 2xx headers.

    Errors:

    - Before ``started()`` a worker's 4xx raises :class:`~trio_disagg.WorkerError` with
      that status and the worker's own message (the client sees both); a 5xx, another
      status, or a transport failure (refused, reset, timed out) raises it with status
      502 and a message naming the worker and what it said.
    - After ``started()`` failures are sent as ONE error item, then the stream ends: a
      worker's error event (``data: {"error": ...}``), a transport failure or connection
      reset, a malformed answer, or a stream that ends without a finish reason (the
      worker died). Nothing is raised.

    Cancellation: ``context.stop_generating()`` closes the worker response (vLLM aborts
    the request) and ends the stream with one ``cancelled`` item; ``context.kill()``
    closes it and ends the stream at once; a closed receiver or a cancelled caller closes
    it too. The router runs the prefill leg in its transfer keeper on a context of its
    own (C5), so a client that goes away never closes a prefill connection early (which
    would abort the prefill and lose its KV): only the prefill's own deadline or a kill
    of its own context does.

    Args:
        url: the worker's base URL, such as ``http://10.0.0.5:8100`` (no ``/v1``).
        role: ``"prefill"`` or ``"decode"``.
        client: the shared client (see :func:`vllm_client`); the engine never closes it.
        name: unique within its pool; default ``url``.

    Raises:
        ValueError: ``url`` is not an ``http://`` or ``https://`` URL, or ``role`` is
            neither role.
    """

    def __init__(
        self, url: str, role: Role, *, client: httpx.AsyncClient, name: str | None = None
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"a vLLM worker URL must be http(s)://host[:port], got {url!r}")
        self.url = url.rstrip("/")
        self.role: Role = role
        self.client = client
        self.name = name if name is not None else self.url
        self.handoff_style = HandoffStyle.SEQUENTIAL
        self.bootstrap_host: str | None = None
        self.bootstrap_port: int | None = None

    def __repr__(self) -> str:
        return f"<VllmEngine {self.role} {self.url}>"

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
            WorkerError: before ``started()`` only: the worker's 4xx (that status), or a
                5xx / transport failure (502).
        """
        with send_channel:
            prefill = self.role == "prefill"
            body = prefill_body(request.body) if prefill else decode_body(request)
            # The server accepts any printable id: send its UTF-8 bytes, never fail on it.
            headers = {b"x-request-id": request.request_id.encode(),
                       b"content-type": b"application/json"}
            if not prefill:
                headers[b"accept"] = b"text/event-stream"
            url = self.url + endpoint_for(body)
            stopper = _Stopper(context)
            started = False
            try:
                with stopper.scope:
                    async with self.client.stream(
                        "POST", url, content=orjson.dumps(body), headers=headers
                    ) as response:
                        if not 200 <= response.status_code < 300:
                            raise await self._status_error(response)
                        task_status.started()
                        started = True
                        if prefill:
                            await self._relay_json(response, request, send_channel)
                        else:
                            await self._relay_stream(response, request, send_channel)
            except httpx.HTTPError as exc:
                if not started:
                    raise WorkerError(
                        f"{self.role} worker {self.url} failed: {_describe(exc)}",
                        status=502, worker=self.name,
                    ) from exc
                await _send_quietly(send_channel, Annotated.from_error(
                    f"{self.role} worker {self.url} failed mid-stream: {_describe(exc)}"))
                return
            except trio.BrokenResourceError:
                # The receiver is gone: the response is closed (an abort on the worker).
                # send() raised before its checkpoint completed.
                await trio.lowlevel.checkpoint()
                return
            if stopper.scope.cancelled_caught:
                if not started:
                    task_status.started()  # accepted and at once stopped
                try:
                    await stopper.send_cancelled(send_channel)
                except trio.BrokenResourceError:
                    await trio.lowlevel.checkpoint()

    # --- answers ---------------------------------------------------------------------------

    async def _status_error(self, response: httpx.Response) -> WorkerError:
        status = response.status_code
        data = await _read_limited(response, _ERROR_BODY_LIMIT)
        message = _error_message(data, status)
        if 400 <= status < 500:
            return WorkerError(message, status=status, worker=self.name)
        return WorkerError(
            f"{self.role} worker {self.url} answered {status}: {message}",
            status=502, worker=self.name,
        )

    async def _relay_json(
        self, response: httpx.Response, request: PreprocessedRequest, send: SendChannel
    ) -> None:
        """One non-streamed answer -> one output, or one error item."""
        data = await _read_limited(response, _JSON_BODY_LIMIT)
        if len(data) >= _JSON_BODY_LIMIT:
            await send.send(self._error(f"answered more than {_JSON_BODY_LIMIT} bytes"))
            return
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError:
            await send.send(self._error(f"answered malformed JSON: {_excerpt(data)}"))
            return
        if not isinstance(answer, dict):
            await send.send(self._error(f"answered {type(answer).__name__}, not an object"))
            return
        if "error" in answer or answer.get("object") == "error":
            await send.send(self._error(f"reported an error: {_error_text(answer)}"))
            return
        output = _output(answer, final=True)
        if output is None or output.finish_reason is None:
            await send.send(self._error(f"answered without a choice or a finish_reason: "
                                        f"{_excerpt(data)}"))
            return
        if self.role == "prefill":
            output.disaggregated_params = answer.get("kv_transfer_params")
            output.worker_trace_link = TraceLink(
                worker_id=self.name, request_id=request.request_id,
                trace_id=answer.get("id") if isinstance(answer.get("id"), str) else None,
            )
        await send.send(Annotated(data=output))

    async def _relay_stream(
        self, response: httpx.Response, request: PreprocessedRequest, send: SendChannel
    ) -> None:
        """Server-sent events -> outputs; the finish is held until the usage chunk."""
        content_type = response.headers.get("content-type", "")
        if not content_type.startswith("text/event-stream"):
            if content_type.startswith("application/json"):
                await self._relay_json(response, request, send)  # a worker that won't stream
            else:
                await send.send(self._error(f"answered content-type {content_type!r}"))
            return
        final: LLMEngineOutput | None = None  # the finish, waiting for its usage chunk
        done = False
        try:
            async with aclosing(EventSource(response).aiter_sse()) as events:
                async for event in events:
                    text = event.data
                    if text == "[DONE]":
                        done = True
                        break
                    if not text:
                        continue
                    try:
                        chunk = orjson.loads(text)
                    except orjson.JSONDecodeError:
                        await send.send(self._error(f"sent a malformed chunk: {text[:200]!r}"))
                        return
                    if not isinstance(chunk, dict):
                        await send.send(self._error(f"sent a chunk that is not an object: "
                                                    f"{text[:200]!r}"))
                        return
                    if "error" in chunk or chunk.get("object") == "error":
                        await send.send(self._error(f"reported an error: {_error_text(chunk)}"))
                        return
                    if final is not None:
                        usage = _usage(chunk)
                        if usage is not None:
                            final.completion_usage = usage
                        continue
                    output = _output(chunk, final=False)
                    if output is None:
                        continue
                    if output.finish_reason is not None:
                        final = output
                        continue
                    await send.send(Annotated(data=output))
        except httpx.HTTPError as exc:
            if final is None:
                await send.send(self._error(f"failed mid-stream: {_describe(exc)}"))
                return
            # The answer was complete; only the usage chunk or [DONE] was lost.
        if final is None:
            how = "sent [DONE]" if done else "closed the stream"
            await send.send(self._error(
                f"{how} without a finish_reason (the worker died mid-stream?)"))
            return
        await send.send(Annotated(data=final))

    def _error(self, what: str) -> Item:
        """An error item naming this worker: ``"decode worker URL <what>"``."""
        return Annotated.from_error(f"{self.role} worker {self.url} {what}")


def vllm_engines(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    client: httpx.AsyncClient | None = None,
) -> tuple[list[VllmEngine], list[VllmEngine]]:
    """Make the prefill and decode engines of a vLLM deployment, sharing one client.

    Args:
        prefill_urls: the prefill workers' base URLs (``http://host:port``).
        decode_urls: the decode workers' base URLs.
        client: the client to share; default a new :func:`vllm_client`, reachable as
            ``engine.client`` of every engine returned. Whoever made it closes it
            (``await client.aclose()``) once the router is done.

    Returns:
        ``(prefill_engines, decode_engines)``, for two
        :class:`~trio_disagg.WorkerPool`\\ s.

    Raises:
        ValueError: a malformed URL, or the same URL twice in one role.
    """
    for role, urls in (("prefill", prefill_urls), ("decode", decode_urls)):
        stripped = [url.rstrip("/") for url in urls]
        if len(set(stripped)) != len(stripped):
            raise ValueError(f"{role} URLs must be unique, got {list(urls)}")
    shared = client if client is not None else vllm_client()
    prefill = [VllmEngine(url, "prefill", client=shared) for url in prefill_urls]
    decode = [VllmEngine(url, "decode", client=shared) for url in decode_urls]
    return prefill, decode


# --- wire helpers ----------------------------------------------------------------------------


async def _send_quietly(send: SendChannel, item: Item) -> None:
    try:
        await send.send(item)
    except trio.BrokenResourceError:
        await trio.lowlevel.checkpoint()


async def _read_limited(response: httpx.Response, limit: int) -> bytes:
    """Up to ``limit`` bytes of the body (a few more if the last chunk overshoots)."""
    parts: list[bytes] = []
    size = 0
    async for part in response.aiter_bytes():
        parts.append(part)
        size += len(part)
        if size >= limit:
            break
    return b"".join(parts)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def _excerpt(data: bytes) -> str:
    return repr(data[:200].decode("utf-8", "replace"))


def _error_text(answer: Mapping[str, Any]) -> str:
    """The message of an OpenAI (``{"error": {...}}``), vLLM (``{"object": "error",
    "message"}``) or FastAPI (``{"detail"}``) error object."""
    error = answer.get("error")
    if isinstance(error, Mapping):
        message = error.get("message")
        if isinstance(message, str) and message:
            return message[:_MESSAGE_LIMIT]
    elif isinstance(error, str) and error:
        return error[:_MESSAGE_LIMIT]
    for key in ("message", "detail"):
        value = answer.get(key)
        if isinstance(value, str) and value:
            return value[:_MESSAGE_LIMIT]
    return orjson.dumps(answer).decode()[:_MESSAGE_LIMIT]


def _error_message(data: bytes, status: int) -> str:
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        text = data.decode("utf-8", "replace").strip()
        return text[:_MESSAGE_LIMIT] if text else f"HTTP {status}"
    if isinstance(answer, Mapping):
        return _error_text(answer)
    return f"HTTP {status}"


def _count(value: Any) -> int:
    return value if type(value) is int else 0


def _usage(answer: Mapping[str, Any]) -> CompletionUsage | None:
    usage = answer.get("usage")
    if not isinstance(usage, Mapping):
        return None
    details = usage.get("prompt_tokens_details")
    prompt_details = None
    if isinstance(details, Mapping):
        cached = details.get("cached_tokens")
        prompt_details = PromptTokensDetails(
            cached_tokens=cached if type(cached) is int else None
        )
    prompt = _count(usage.get("prompt_tokens"))
    completion = _count(usage.get("completion_tokens"))
    total = _count(usage.get("total_tokens")) or prompt + completion
    return CompletionUsage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=total,
        prompt_tokens_details=prompt_details,
    )


def _finish(value: Any) -> FinishReason | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value == "error":
            return FinishReason.error("the worker ended the request with finish_reason error")
        return _FINISH.get(value, FinishReason.STOP)
    if isinstance(value, Mapping) and isinstance(value.get("error"), str):
        return FinishReason.error(value["error"])
    return FinishReason.error(f"malformed finish_reason {value!r:.60}")


def _output(answer: Mapping[str, Any], *, final: bool) -> LLMEngineOutput | None:
    """The output of a completion answer or chunk (``final``: a whole answer, whose usage
    is taken too); None for a chunk with nothing in it (a role-only delta, a usage chunk)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    choice = choices[0]
    text: Any
    if "text" in choice:
        text = choice["text"]
    else:
        part = choice.get("delta") if "delta" in choice else choice.get("message")
        text = part.get("content") if isinstance(part, Mapping) else None
    if not isinstance(text, str):
        text = None
    ids = choice.get("token_ids")
    token_ids = ids if isinstance(ids, list) and all(type(i) is int for i in ids) else []
    finish = _finish(choice.get("finish_reason"))
    usage = _usage(answer)
    if not text and not token_ids and finish is None and not final:
        return None
    index = choice.get("index")
    return LLMEngineOutput(
        token_ids=token_ids, text=text or None, finish_reason=finish,
        completion_usage=usage, index=index if type(index) is int and index else None,
    )
