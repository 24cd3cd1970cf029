"""The SGLang engine adapter: prefill and decode workers over HTTP, meeting in a bootstrap
room (docs/protocols.md section 3).

SGLang's disaggregated serving is *concurrent*: the router picks a bootstrap room, adds
``bootstrap_host`` (the prefill worker's host), ``bootstrap_port`` (its bootstrap port,
8998 by default) and ``bootstrap_room`` to the body, and sends that same body to the
prefill worker and the decode worker at the same time. The decode worker joins the room on
the prefill worker's bootstrap port and waits for the KV; the prefill worker computes it,
waits for the decode to join, transfers it, and only then answers. The client sees the
decode's stream; the prefill's answer is drained by the router's transfer keeper, and its
failure reaches the client through the gatekeeper (rules S5, T1-T4, G1-G9 in docs/semantics.md).

:class:`SglangEngine` implements :class:`~trio_disagg.Engine` for either role on the skeleton
shared by every HTTP adapter (:class:`~trio_disagg.engines._http.HttpEngine`); the
:class:`~trio_disagg.DisaggRouter` picks the room (``request.bootstrap_info``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar
from urllib.parse import urlsplit

import attrs
import trio

from .._context import RequestContext
from .._engine import CancelWindow, HandoffStyle
from .._errors import WorkerError
from .._protocols import (
    Annotated,
    BootstrapInfo,
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    TraceLink,
)
from ._burst import Burst
from ._chunks import (
    ChunkParser,
    count,
    make_usage,
    parse_finish,
)
from ._fields import PLUMBING
from ._handoffs import (
    handoff_problem,
)
from ._http import (
    Client,
    HttpEngine,
    Response,
    Role,
)
from ._requests import (
    check_unique,
    check_worker_url,
    endpoint_for,
    streaming_body,
    worker_client,
)
from ._sglang_bootstrap import check_mode, fetch_bootstrap_port, parse_prefill_spec
from ._stopper import SendChannel, Stopper, send_quietly

__all__ = [
    "GENERATE_PATH", "SGLANG_WITHHELD", "SglangEngine", "bootstrap_problem", "native_output",
    "parse_prefill_spec", "sglang_body", "sglang_engines",
]

#: SGLang's native generation endpoint.
GENERATE_PATH = "/generate"

#: Top-level fields of an SGLang chunk or answer never relayed to the client (B8): its
#: ``sglext`` describes one worker's own request, not the client's: the decode's
#: ``cached_tokens_details`` counts the KV the prefill sent it as cached (as its
#: ``cached_tokens`` would, S4) and its ``routed_experts`` covers only the tokens it
#: computed.
SGLANG_WITHHELD = PLUMBING | {"sglext"}


@attrs.frozen(kw_only=True)
class _BootstrapParams:
    """The bootstrap triple as the router relies on it (S5, B7)."""

    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int


def bootstrap_problem(info: BootstrapInfo) -> tuple[str, str] | None:
    """What is wrong with ``info`` as the handoff of a bootstrap prefill (B7): its
    ``bootstrap_host`` not a string, its ``bootstrap_port`` or ``bootstrap_room`` not an
    integer; None if nothing is. (``info`` is the router's, built from the prefill
    engine's address: only a broken engine or router gets it wrong, and then no leg may
    use it.)"""
    return handoff_problem(info.as_params(), _BootstrapParams)


def _is_native(body: Mapping[str, Any]) -> bool:
    return "prompt" not in body and "messages" not in body and (
        "text" in body or "input_ids" in body)


def _bootstrap_info(request: PreprocessedRequest) -> BootstrapInfo | None:
    if request.bootstrap_info is not None:
        return request.bootstrap_info
    result = request.prefill_result
    params = result.disaggregated_params if result is not None else None
    if isinstance(params, Mapping):
        host, port, room = (params.get("bootstrap_host"), params.get("bootstrap_port"),
                            params.get("bootstrap_room"))
        if isinstance(host, str) and type(port) is int and type(room) is int:
            return BootstrapInfo(host=host, port=port, room=room)
    return None


def sglang_body(request: PreprocessedRequest, *, decode: bool = True
                ) -> tuple[str, dict[str, Any]]:
    """The path and body of one leg of ``request`` (SGLang's protocol): the decode's
    (``decode``) or the prefill's, which differ only in the fields a decode never gets.

    The client's body with the bootstrap triple of ``request.bootstrap_info``
    (``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``), always streamed
    (:func:`~trio_disagg.engines.streaming_body`: ``stream: true``,
    ``stream_options.include_usage: true``; for the decode without ``prompt_logprobs``
    and ``echo``, which concern the prompt only the prefill computes). No budget is
    invented (B8): a body without one goes without one. ``min_tokens`` goes as sent to
    both legs: they get the client's own budget, which the client's ``min_tokens`` fits.
    A native body (``text`` or ``input_ids``, no ``prompt`` / ``messages``) goes to
    ``POST /generate`` with ``stream: true``; any other to the OpenAI endpoint of its
    kind.

    Raises:
        WorkerError: status 400: the request has no bootstrap room, or would share one
            room between several samples (``n`` > 1, a batch of prompts): every request
            and every sample needs its own room. (The router's HTTP edge already refuses
            ``n`` > 1, so each request is one sample with one room.) Status 502: the
            bootstrap triple is not well typed (:func:`bootstrap_problem`, B7).
    """
    info = _bootstrap_info(request)
    if info is None:
        raise WorkerError("an SGLang request needs the bootstrap room the router picks "
                          "(request.bootstrap_info)", status=400)
    problem = bootstrap_problem(info)
    if problem is not None:
        field, what = problem
        raise WorkerError(f"invalid bootstrap handoff: {field} {what}", status=502)
    body = request.body
    n = body.get("n")
    if type(n) is int and n > 1:
        raise WorkerError(f"n={n} would share bootstrap room {info.room} between samples: "
                          f"every sample needs its own room; send n=1", status=400)
    if _is_native(body):
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list) or (isinstance(ids, list) and ids
                                      and isinstance(ids[0], list)):
            raise WorkerError("a batch of prompts would share one bootstrap room: send one "
                              "prompt per request", status=400)
        wire = dict(body)
        wire["stream"] = True
        path = GENERATE_PATH
    else:
        wire = streaming_body(request, decode=decode)
        path = endpoint_for(wire)
    wire.update(info.as_params())
    return path, wire


def _native_finish(value: Any) -> FinishReason | None:
    """``meta_info.finish_reason``: ``{"type": "length" | "stop" | "abort", ...}``."""
    if value is None or isinstance(value, str):
        return parse_finish(value)
    if not isinstance(value, Mapping):
        return parse_finish(value)
    kind = value.get("type")
    if kind == "length":
        return FinishReason.LENGTH
    if kind == "stop":
        return FinishReason.STOP
    if kind == "abort":
        message = value.get("message")
        return FinishReason.error(message) if isinstance(message, str) and message \
            else FinishReason.CANCELLED
    return parse_finish(value)


def native_output(answer: Mapping[str, Any], text_so_far: str, ids_so_far: list[int]
                  ) -> tuple[LLMEngineOutput, str, list[int]]:
    """The output of a native ``/generate`` answer or event, given the text and ids seen
    so far. Returns the output and the new text and ids so far.

    SGLang streams the text and ids so far in each event by default; with
    ``--incremental-streaming-output`` each event has only its new text and ids. Its
    ``meta_info.completion_tokens`` counts every token so far either way: an event with
    fewer ids than that is incremental, and taken as it is (a repeated token is a new
    one). An event without both is read as cumulative if its text and ids continue what
    came so far, else as incremental.
    """
    meta = answer.get("meta_info")
    meta = meta if isinstance(meta, Mapping) else {}
    text = answer.get("text")
    ids = answer.get("output_ids")
    if not (type(ids) is list and all(type(i) is int for i in ids)):
        ids = None
    total = meta.get("completion_tokens")
    if ids is not None and type(total) is int and len(ids) < total:  # incremental
        delta = text if isinstance(text, str) else ""
        new_ids: list[int] = ids
        text_so_far, ids_so_far = text_so_far + delta, ids_so_far + ids
    else:
        delta = ""
        if isinstance(text, str):
            if text.startswith(text_so_far):
                delta, text_so_far = text[len(text_so_far):], text
            else:
                delta, text_so_far = text, text_so_far + text
        new_ids = []
        if ids is not None:
            if ids[:len(ids_so_far)] == ids_so_far and len(ids) >= len(ids_so_far):
                new_ids, ids_so_far = ids[len(ids_so_far):], list(ids)
            else:
                new_ids, ids_so_far = list(ids), ids_so_far + ids
    finish = _native_finish(meta.get("finish_reason"))
    usage: CompletionUsage | None = None
    if finish is not None:
        usage = make_usage(count(meta.get("prompt_tokens")),
                           count(meta.get("completion_tokens")), 0,
                           meta.get("cached_tokens"))
    return (LLMEngineOutput(token_ids=new_ids, text=delta or None, finish_reason=finish,
                            completion_usage=usage), text_so_far, ids_so_far)


class _NativeParser(ChunkParser):
    """Native ``/generate`` events: cumulative text and ids, usage in ``meta_info``."""

    __slots__ = ("_ids", "_text")

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._ids: list[int] = []

    def output(self, answer: Mapping[str, Any], *, final: bool) -> LLMEngineOutput | None:
        output, self._text, self._ids = native_output(answer, self._text, self._ids)
        if (not output.text and not output.token_ids and output.finish_reason is None
                and not final):
            return None
        return output

    def add(self, chunk: Mapping[str, Any], burst: Burst) -> LLMEngineOutput | None:
        output = self.output(chunk, final=False)
        if output is None or output.finish_reason is not None:
            return output
        burst.add(output)
        return None

    def usage(self, chunk: Mapping[str, Any]) -> CompletionUsage | None:
        return None


class SglangEngine(HttpEngine):
    """An SGLang worker, prefill or decode, as an :class:`~trio_disagg.Engine`
    (docs/protocols.md sections 1 and 3).

    Both roles have ``handoff_style = HandoffStyle.BOOTSTRAP``: the router picks a unique
    63-bit bootstrap room per request (``request.bootstrap_info``, with this prefill
    engine's :attr:`bootstrap_host` and :attr:`bootstrap_port`) and dispatches both legs
    at once. Both ``POST`` :func:`sglang_body` (streamed; the decode's without the
    prompt-only fields) with ``X-Request-Id: request.request_id``;
    ``task_status.started()`` is called once the worker answered 2xx headers.

    **Prefill**: the bootstrap triple is validated first (B7, :func:`bootstrap_problem`):
    if it is not well typed, nothing is sent to the worker and the stream is ONE error
    item carrying an :class:`~trio_disagg.InvalidPrefillHandoff` naming the field
    (``"bootstrap_port"``). Once accepted, the first output carries
    ``disaggregated_params`` = the bootstrap triple (the router's S5 handoff, drained by
    its transfer keeper); then the prefill's events are relayed as the decode's are: its
    answer (SGLang answers only once the KV went to the decode) ends the stream with its
    finish reason and its usage, whose ``prompt_tokens_details.cached_tokens`` the
    router reports to the client (S4).
    A prefill that fails (an error event, ``finish_reason`` ``abort``, a dropped
    connection, a stream without a finish) sends an error item or failed finish (T4);
    the router's gatekeeper then stops the decode leg and the client gets the error
    (G1, G5, G6).

    **Decode**: relay the events as outputs: text, ``token_ids`` if present, the finish
    on the last one with the usage of the usage chunk (OpenAI endpoints) or of
    ``meta_info`` (``/generate``, whose cumulative text and ids are turned into deltas).
    Finish reasons map as for :class:`~trio_disagg.engines.VllmEngine`; ``/generate``'s
    ``{"type": "length" | "stop" | "abort"}`` -> ``LENGTH`` / ``STOP`` / an error finish
    with its message (``CANCELLED`` without one).

    Errors and cancellation: as :class:`~trio_disagg.engines.VllmEngine` (4xx passed
    through before ``started()``, 5xx and transport failures as 502; one error item
    after; a stop or kill closes the response, which aborts the request on the worker).
    A request without a bootstrap room, or sharing one between samples (``n`` > 1, a
    batch), raises :class:`~trio_disagg.WorkerError` (400) before anything is sent.

    ``cancel_window`` is ``BEFORE_HANDOFF`` (B10): until a decode worker joined the room
    the prefill may be cancelled (its paired decode leg ends with it, B6); once one
    joined, the KV transfer is under way and is let finish.

    Args:
        url: the worker's base URL (``http://host:port``, no ``/v1``).
        role: ``"prefill"`` or ``"decode"``.
        client: the shared client (see :func:`~trio_disagg.engines.worker_client`), or
            an :class:`httpx.AsyncClient` of the caller's own; the engine never closes it.
        name: unique within its pool; default ``url``.
        bootstrap_port: a prefill worker's bootstrap port; its :attr:`bootstrap_host` is
            the URL's host. None (the default): asked of the worker, as SGLang's router
            does, by :meth:`check_health` (a :class:`~trio_disagg.HealthMonitor`'s probe)
            or :meth:`learn_bootstrap_port`; until then :attr:`bootstrap_port` is None,
            its probe fails, and the router routes no request to it (503).
        cancel_window: overrides ``BEFORE_HANDOFF`` for this engine.

    Raises:
        ValueError: a malformed URL, a bad role, or a bootstrap port out of 1-65535 or
            given for a decode worker.
        TypeError: ``cancel_window`` is not a :class:`~trio_disagg.CancelWindow`.
    """

    protocol: ClassVar[str] = "SGLang"
    whole_message: ClassVar[Mapping[str, Any]] = MappingProxyType(
        {"reasoning_content": None, "tool_calls": None})
    default_cancel_window: ClassVar[CancelWindow] = CancelWindow.BEFORE_HANDOFF

    def __init__(
        self,
        url: str,
        role: Role,
        *,
        client: Client,
        name: str | None = None,
        bootstrap_port: int | None = None,
        cancel_window: CancelWindow | None = None,
    ) -> None:
        super().__init__(url, role, client=client, name=name, cancel_window=cancel_window)
        self.handoff_style = HandoffStyle.BOOTSTRAP
        if role == "prefill":
            port = bootstrap_port
            if port is not None and (type(port) is not int or not 0 < port < 65536):
                raise ValueError(f"bootstrap_port must be in 1-65535, got {port!r}")
            host = urlsplit(self.url).hostname or ""
            self.bootstrap_host = f"[{host}]" if ":" in host else host
            self.bootstrap_port = port
        self._learns_port = role == "prefill" and bootstrap_port is None
        self._mode_checked = False
        if role != "prefill" and bootstrap_port is not None:
            raise ValueError("only a prefill worker has a bootstrap port")

    def __repr__(self) -> str:
        if self.role == "prefill":
            port = "unknown" if self.bootstrap_port is None else self.bootstrap_port
            return f"<SglangEngine prefill {self.url} bootstrap port {port}>"
        return f"<SglangEngine decode {self.url}>"

    async def learn_bootstrap_port(self) -> int:
        """Ask the prefill worker for its bootstrap port, as SGLang's router does when it
        is not given: ``GET /server_info`` (``/get_server_info`` from an SGLang without
        it), whose ``disaggregation_mode`` must be ``prefill`` and whose
        ``disaggregation_bootstrap_port`` becomes :attr:`bootstrap_port`. It need not
        bound itself: the caller cancels it (the connection is then closed).

        Returns:
            The port, now :attr:`bootstrap_port`.

        Raises:
            WorkerError: status 503, naming the worker and what to do: it could not be
                reached, did not answer with its server information, is not a prefill
                worker, or gave no port in 1-65535. :attr:`bootstrap_port` is unchanged.
            ValueError: this is a decode engine.
        """
        if self.role != "prefill":
            raise ValueError("only a prefill worker has a bootstrap port")
        self.bootstrap_port = await fetch_bootstrap_port(self._transport, self.url,
                                                         self.name)
        return self.bootstrap_port

    async def check_health(self) -> None:
        """Probe the worker's health endpoint once, as every HTTP engine does; a prefill
        worker whose bootstrap port is still unknown is then asked for it
        (:meth:`learn_bootstrap_port`), and passes only once it is known. A port learned
        is forgotten when the health endpoint fails: the worker may come back restarted
        with another, and is asked again. So is its ``disaggregation_mode``, checked after
        the first probe that passes, whatever the role: a worker in another role fails.

        Raises:
            WorkerError: the worker could not be reached or answered anything but 2xx
                (``worker_status``), its bootstrap port could not be learned, or it runs
                in another role (503).
        """
        try:
            await super().check_health()
        except WorkerError:
            self._mode_checked = False
            if self._learns_port:
                self.bootstrap_port = None
            raise
        if self.role == "prefill" and self.bootstrap_port is None:
            await self.learn_bootstrap_port()  # checks the mode too
            self._mode_checked = True
        elif not self._mode_checked:
            self._mode_checked = await check_mode(self._transport, self.url, self.name,
                                                  self.role)

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
            WorkerError: before ``started()`` only, as :class:`HttpEngine`'s.
        """
        info = request.bootstrap_info
        problem = (bootstrap_problem(info) if self.role == "prefill" and info is not None
                   else None)
        if problem is None:
            await super().generate(request, context, send_channel, task_status=task_status)
            return
        # B7: the handoff would be this triple; refused before anything is sent, so no
        # room is opened on the worker (and the decode leg's body refuses it too).
        with send_channel:
            task_status.started()
            await send_quietly(send_channel, self._invalid_handoff(*problem, sent=False))

    def _prepare(self, request: PreprocessedRequest) -> tuple[str, dict[str, Any]]:
        return sglang_body(request, decode=self.role == "decode")

    def _parser(self, request: PreprocessedRequest, path: str) -> ChunkParser:
        return _NativeParser() if path == GENERATE_PATH else ChunkParser(withheld=SGLANG_WITHHELD)

    async def _relay(
        self,
        response: Response,
        request: PreprocessedRequest,
        path: str,
        body: Mapping[str, Any],
        stopper: Stopper,
        send: SendChannel,
    ) -> None:
        if self.role == "prefill":
            params = {key: body[key] for key in
                      ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
            await send.send(Annotated(data=LLMEngineOutput(
                disaggregated_params=params,
                worker_trace_link=TraceLink(worker_id=self.name,
                                            request_id=request.request_id))))
        await super()._relay(response, request, path, body, stopper, send)


def sglang_engines(
    prefill_specs: Sequence[str],
    decode_urls: Sequence[str],
    *,
    client: Client | None = None,
    cancel_window: CancelWindow | None = None,
) -> tuple[list[SglangEngine], list[SglangEngine]]:
    """Make the prefill and decode engines of an SGLang deployment, sharing one client.

    Args:
        prefill_specs: the prefill workers, each ``URL`` or ``URL,BOOTSTRAP_PORT``
            (``http://10.0.0.5:30000,8998``): a port not given (or ``none``) is asked of
            the worker by its engine's health probe (:meth:`SglangEngine.check_health`).
        decode_urls: the decode workers' base URLs.
        client: the client to share; default a new
            :func:`~trio_disagg.engines.worker_client`, reachable as ``engine.client`` of
            every engine returned. Whoever made it closes it once the router is done.
        cancel_window: the prefill engines' cancel window (B10), if not
            ``BEFORE_HANDOFF``.

    Returns:
        ``(prefill_engines, decode_engines)``, for two
        :class:`~trio_disagg.WorkerPool`\\ s.

    Raises:
        ValueError: a malformed URL or bootstrap port, the same URL twice in one role,
            or two prefill workers bootstrapping at the same host and port.
    """
    parsed = [parse_prefill_spec(spec) for spec in prefill_specs]
    check_unique("prefill", [url for url, _ in parsed])
    check_unique("decode", list(decode_urls))
    for url in [url for url, _ in parsed] + list(decode_urls):
        check_worker_url(url, SglangEngine.protocol)  # before a client is made
    addresses = [(urlsplit(url).hostname, port) for url, port in parsed if port is not None]
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"two prefill workers bootstrap at the same host and port: "
                         f"{list(prefill_specs)}")
    shared = client if client is not None else worker_client()
    prefill = [SglangEngine(url, "prefill", client=shared, bootstrap_port=port,
                            cancel_window=cancel_window)
               for url, port in parsed]
    decode = [SglangEngine(url, "decode", client=shared) for url in decode_urls]
    return prefill, decode
