"""The TensorRT-LLM engine adapter: context (prefill) and generation (decode) servers of
``trtllm-serve`` over HTTP (docs/protocols.md section 4).

TensorRT-LLM's disaggregated serving is *sequential*, context first: the router sends the
context server the client's body, not streamed, with ``disaggregated_params:
{"request_type": "context_only", "disagg_request_id": <int>}``; the context server answers
once the prompt's KV is committed, with ``choices[0].disaggregated_params``
(``ctx_request_id``, ``first_gen_tokens``, ``encoded_opaque_state``, ...) and
``prompt_token_ids``. A context that already finished the request (its ``finish_reason``
is not ``length`` / ``not_finished``) is the final answer (rule S7 in docs/semantics.md); a
non-terminal one is validated as a handoff (B7: one choice, a usable ``ctx_request_id``, S9, and the
other fields well typed) and refused before any generation request if invalid.
Otherwise the generation server gets the client's body with those
``disaggregated_params`` (``request_type: "generation_only"``) and the prompt replaced by
``prompt_token_ids``.

:class:`TrtllmEngine` implements :class:`~trio_disagg.Engine` for either role on the skeleton
shared by every HTTP adapter (:class:`~trio_disagg.engines._http.HttpEngine`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Annotated, Any, ClassVar

import attrs
import trio

from .._context import RequestContext
from .._engine import CancelWindow, HandoffStyle
from .._errors import WorkerError
from .._protocols import ChunkChoice, FinishReason, LLMEngineOutput, PreprocessedRequest, TraceLink
from ._chunks import (
    FINISH,
    ChunkParser,
    first_choice,
)
from ._fields import PLUMBING, with_fields
from ._handoffs import (
    NON_EMPTY,
    Must,
    NonNegativeInt,
    choices_problem,
    handoff_problem,
)
from ._http import (
    Client,
    HttpEngine,
)
from ._requests import (
    check_unique,
    check_worker_url,
    endpoint_for,
    streaming_body,
    worker_client,
)
from ._stopper import SendChannel

logger = logging.getLogger("trio_disagg.engines")

__all__ = [
    "DISAGG_REQUEST_ID_MIN", "PROMPT_TOKEN_IDS_KEY", "TRTLLM_FINISH", "TRTLLM_WITHHELD",
    "ContextParams", "TrtllmEngine", "context_body", "context_problem", "generation_body",
    "new_disagg_request_id", "refuses_disagg_request_id", "trtllm_engines",
]

#: The key under which the handoff payload (the context's ``disaggregated_params``)
#: carries the context's ``prompt_token_ids`` to the generation request; it is taken out
#: again there (TensorRT-LLM's ``DisaggregatedParams`` accepts no unknown field).
PROMPT_TOKEN_IDS_KEY = "prompt_token_ids"

#: Top-level fields of a TensorRT-LLM answer that are the disaggregation's plumbing, never
#: relayed to the client (B8): the context's ``prompt_token_ids`` (and its base64 form,
#: ``prompt_token_ids_b64``) are the prompt's tokens for the generation server, sent
#: whether the client asked for them or not.
TRTLLM_WITHHELD = PLUMBING | {"prompt_token_ids", "prompt_token_ids_b64"}

#: The lowest ``disagg_request_id`` the adapter draws. TensorRT-LLM keeps
#: [``MIN_GLOBAL_ID``, 2^63) for the disaggregated service's ids and numbers a worker's own
#: requests below it (``tensorrt_llm/llmapi/disagg_utils.py``: 2^40, and 2^41 in the
#: release that brought global ids in): an id drawn from [2^41, 2^63) is never one of a
#: worker's local request ids, whichever release serves it.
DISAGG_REQUEST_ID_MIN = 1 << 41


def new_disagg_request_id() -> int:
    """A random ``disagg_request_id`` for a context request: uniform in
    [:data:`DISAGG_REQUEST_ID_MIN`, 2^63), a positive int64 outside TensorRT-LLM's local
    request ids."""
    return DISAGG_REQUEST_ID_MIN + secrets.randbelow((1 << 63) - DISAGG_REQUEST_ID_MIN)


#: TensorRT-LLM's finish reasons: ``not_finished`` means a handoff is needed, like
#: ``length``; ``timeout`` is a failure.
TRTLLM_FINISH: Mapping[str, FinishReason] = {
    **FINISH,
    "not_finished": FinishReason.LENGTH,
    "timeout": FinishReason.error("the worker timed the request out"),
}


@attrs.frozen(kw_only=True)
class ContextParams:
    """The fields of a context's ``choices[0].disaggregated_params`` a generation request
    needs (B7), with their types (TensorRT-LLM's ``DisaggregatedParams``).

    Only ``ctx_request_id`` is required, and must be a non-negative integer (not a
    boolean, a string or a float); the others may be left out, or be null but for
    ``request_type``, which if present must be ``"context_only"`` (a context's answer; a
    ``"generation_only"`` one would hand the generation a generation's params), and
    ``first_gen_tokens``, which if not null must be a non-empty list of integers (the
    token the context produced). Only for validation: the worker's object goes on as
    sent, with any other field it has.
    """

    ctx_request_id: NonNegativeInt
    request_type: Annotated[str, Must(lambda value: value == "context_only",
                                      "'context_only'")] = "context_only"
    first_gen_tokens: Annotated[list[int], NON_EMPTY] | None = None
    encoded_opaque_state: str | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None


@attrs.frozen(kw_only=True)
class _ContextChoice:
    disaggregated_params: ContextParams


@attrs.frozen(kw_only=True)
class _ContextAnswer:
    choices: list[_ContextChoice]
    prompt_token_ids: list[int] | None = None  # the generation's prompt, if given


def context_problem(answer: Mapping[str, Any]) -> tuple[str, str] | None:
    """What is wrong with a non-terminal context answer as a handoff (B7), as
    :func:`~trio_disagg.engines._http.handoff_problem` says it: not exactly one choice,
    a :class:`ContextParams` field missing, mistyped or out of range, or
    ``prompt_token_ids`` not a list of integers. None if nothing is."""
    problem = choices_problem(answer) or handoff_problem(answer, _ContextAnswer)
    if problem is not None and problem[0].endswith(".ctx_request_id"):
        field, what = problem
        return field, f"{what} (no usable ctx_request_id for a non-terminal handoff)"
    return problem


def context_body(body: Mapping[str, Any], disagg_request_id: int | None) -> dict[str, Any]:
    """The context request for a client's body (docs/protocols.md section 4).

    The client's body with ``stream: false``, ``stream_options: null`` and
    ``disaggregated_params: {"request_type": "context_only", "disagg_request_id":
    disagg_request_id}`` (without ``disagg_request_id`` if it is None: for the releases
    that do not know the field, :func:`refuses_disagg_request_id`). Its budget and
    ``min_tokens`` go as the client sent them (a context server computes one token
    whatever the budget, so the client's ``min_tokens``, which fits the client's budget,
    is valid there, and keeps that token from ending the request on EOS).
    """
    wire = dict(body)
    wire["stream"] = False
    wire["stream_options"] = None
    params: dict[str, Any] = {"request_type": "context_only"}
    if disagg_request_id is not None:
        params["disagg_request_id"] = disagg_request_id
    wire["disaggregated_params"] = params
    return wire


def refuses_disagg_request_id(error: WorkerError) -> bool:
    """Whether a context server's refusal says it does not know
    ``disaggregated_params.disagg_request_id``: the ``trtllm-serve`` releases from before
    the field forbid unknown fields (``extra="forbid"``), and their request validation
    answers 400 ``{"error": "[{'type': 'extra_forbidden', 'loc': ('body',
    'disaggregated_params', 'disagg_request_id'), ...}]"}`` (FastAPI's own handler: 422
    ``{"detail": [...]}``)."""
    message = str(error)
    return (error.worker_status in (400, 422) and "disagg_request_id" in message
            and ("extra_forbidden" in message or "Extra inputs are not permitted" in message))


def generation_body(request: PreprocessedRequest) -> dict[str, Any]:
    """The generation request for ``request`` (docs/protocols.md section 4).

    The client's body, always streamed (:func:`~trio_disagg.engines.streaming_body`;
    without ``prompt_logprobs`` and ``echo``, which concern the prompt only the context
    computed; no budget added), with
    ``disaggregated_params`` = the context's (``request.prefill_result``), ``request_type``
    set to ``"generation_only"``, and the prompt replaced by the context's
    ``prompt_token_ids`` (``prompt`` for a completion, ``prompt_token_ids`` beside the
    messages for a chat, as ``trtllm-serve``'s disaggregated server does). Without a
    prefill result: the client's body without ``disaggregated_params``. Either way its
    ``stream_options`` say ``continuous_usage_stats: false``: the ``trtllm-serve``
    releases whose ``StreamOptions`` default it to true would send the usage in every
    chunk, which the router neither relays nor needs (it answers that option itself).

    Raises:
        WorkerError: status 502: the handoff is not an object.
    """
    wire = streaming_body(request)
    wire["stream_options"]["continuous_usage_stats"] = False
    result = request.prefill_result
    if result is None:
        wire.pop("disaggregated_params", None)
        return wire
    params = result.disaggregated_params
    if not isinstance(params, Mapping):
        raise WorkerError(f"the context's disaggregated_params must be an object, got "
                          f"{params!r:.60}", status=502)
    handoff = {key: value for key, value in params.items() if key != PROMPT_TOKEN_IDS_KEY}
    handoff["request_type"] = "generation_only"
    wire["disaggregated_params"] = handoff
    ids = params.get(PROMPT_TOKEN_IDS_KEY)
    if isinstance(ids, list) and ids:
        if "messages" in wire:
            wire["prompt_token_ids"] = ids
        else:
            wire["prompt"] = ids
    return wire


class TrtllmEngine(HttpEngine):
    """A TensorRT-LLM server, context or generation, as an :class:`~trio_disagg.Engine`
    (docs/protocols.md sections 1 and 4).

    A context engine's ``handoff_style`` is ``CONTEXT_FIRST`` (a generation engine's is
    ``SEQUENTIAL``): the handoff is sequential, but a generation leg aborted before it
    fetched the context's KV leaves that KV to the context server's transfer timeout, so
    the router keeps the generation leg as part of the transfer until its first output
    (B6). Its ``cancel_window`` is ``BEFORE_HANDOFF`` (B10): a context aborted before it
    answered stages nothing, but once it answered its KV is committed, and an abort would
    not free it.

    **Context** (``role="prefill"``): ``POST`` :func:`context_body` with a fresh random
    ``disagg_request_id`` (:func:`new_disagg_request_id`), not streamed, to
    ``/v1/chat/completions`` if the body has ``messages``, else ``/v1/completions``. The
    answer becomes ONE output: the token's text, its finish reason (``not_finished`` ->
    ``LENGTH``), the usage (its ``cached_tokens`` is the one the router reports, S4/S10),
    and
    ``disaggregated_params`` = ``choices[0].disaggregated_params`` as the server sent it,
    with ``request_type: "context_only"`` if it had none and the ``disagg_request_id``
    sent (if one was) if it had none, plus the answer's ``prompt_token_ids`` under
    :data:`PROMPT_TOKEN_IDS_KEY`; the choice kept for the relay (B8) goes without its
    ``disaggregated_params``, which are for the generation server, not the client. A
    terminal context (finish not ``length`` / ``not_finished``) is the final answer with
    no generation request (S7). A
    non-terminal one is validated as a handoff first (B7, :func:`context_problem`):
    exactly one choice, its ``disaggregated_params`` an object with the fields of
    :class:`ContextParams` well typed (a null or missing ``ctx_request_id`` is S9's
    refusal), ``prompt_token_ids`` a list of integers if given. An invalid one becomes
    ONE error item carrying an :class:`~trio_disagg.InvalidPrefillHandoff` whose
    ``field`` names the culprit (``"choices[0].disaggregated_params.ctx_request_id"``,
    ``"choices"``); the router's classification raises it, and no generation request is
    built. Once the context server started answering, a stop no longer closes
    the connection (only a kill does): aborting a context after its KV is committed
    would not free the KV, so the answer is always read to its end. A server of the
    releases from before ``disagg_request_id`` refuses the field (their models forbid
    unknown ones): the engine then sends that request again without it, and every later
    one (:attr:`disagg_request_ids`), and the generation request carries none either.

    **Generation** (``role="decode"``): ``POST`` :func:`generation_body` (streamed) and
    relay the events as :class:`~trio_disagg.engines.VllmEngine` does.

    Errors and cancellation: as :class:`~trio_disagg.engines.VllmEngine`, but for the
    context answer above.

    Args:
        url: the server's base URL (``http://host:port``, no ``/v1``).
        role: ``"prefill"`` (context) or ``"decode"`` (generation).
        client: the shared client (see :func:`~trio_disagg.engines.worker_client`), or
            an :class:`httpx.AsyncClient` of the caller's own; the engine never closes it.
        name: unique within its pool; default ``url``.
        cancel_window: overrides ``BEFORE_HANDOFF`` for this engine.

    Raises:
        ValueError: a malformed URL or a bad role.
        TypeError: ``cancel_window`` is not a :class:`~trio_disagg.CancelWindow`.
    """

    protocol: ClassVar[str] = "TensorRT-LLM"
    whole_message: ClassVar[Mapping[str, Any]] = MappingProxyType(
        {"reasoning_content": None, "tool_calls": []})
    default_cancel_window: ClassVar[CancelWindow] = CancelWindow.BEFORE_HANDOFF
    prefill_handoff_style: ClassVar[HandoffStyle] = HandoffStyle.CONTEXT_FIRST
    #: Whether context requests carry a ``disagg_request_id``: until the server refused
    #: the field (:func:`refuses_disagg_request_id`), then never again for this engine.
    disagg_request_ids: bool = True

    async def generate(  # noqa: ASYNC114 (started by the router)
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: SendChannel,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve one leg of ``request`` on the server, as :class:`HttpEngine`'s; a context
        request the server refused for its ``disagg_request_id`` (a release from before
        the field, :func:`refuses_disagg_request_id`) is sent again at once without it,
        as is every later one of this engine.

        Raises:
            WorkerError: before ``started()`` only, as :class:`HttpEngine`'s.
        """
        if self.role != "prefill" or not self.disagg_request_ids:
            await super().generate(request, context, send_channel, task_status=task_status)
            return
        with send_channel:
            try:
                await super().generate(request, context, send_channel.clone(),
                                       task_status=task_status)
                return
            except WorkerError as error:
                if not refuses_disagg_request_id(error):
                    raise
            if self.disagg_request_ids:
                self.disagg_request_ids = False
                logger.warning("context server %s does not take disagg_request_id (a "
                               "TensorRT-LLM release from before it): sent without it from "
                               "now on", self.url)
            await super().generate(request, context, send_channel.clone(),
                                   task_status=task_status)

    def _prepare(self, request: PreprocessedRequest) -> tuple[str, dict[str, Any]]:
        if self.role == "prefill":
            body = context_body(request.body, new_disagg_request_id()
                                if self.disagg_request_ids else None)
        else:
            body = generation_body(request)
        return endpoint_for(body), body

    def _parser(self, request: PreprocessedRequest, path: str) -> ChunkParser:
        return ChunkParser(TRTLLM_FINISH, TRTLLM_WITHHELD)

    def _handoff_problem(self, answer: Mapping[str, Any]) -> tuple[str, str] | None:
        return context_problem(answer)

    def _answer_output(
        self,
        answer: Mapping[str, Any],
        request: PreprocessedRequest,
        body: Mapping[str, Any],
        parser: ChunkParser,
    ) -> LLMEngineOutput | None:
        output = super()._answer_output(answer, request, body, parser)
        if output is None or self.role != "prefill":
            return output
        choice = first_choice(answer)
        params = choice.get("disaggregated_params") if choice is not None else None
        if output.choices and "disaggregated_params" in (sent := output.choices[0]):
            # The handoff is for the generation server, not the client: a terminal
            # context's choice reaches the client (S7), so it goes without it.
            kept = {key: value for key, value in sent.items() if key != "disaggregated_params"}
            output.choices = [with_fields(kept, sent.fields) if type(sent) is ChunkChoice
                              else kept]
        if isinstance(params, Mapping):
            handoff = dict(params)
            handoff.setdefault("request_type", "context_only")
            sent_id = body["disaggregated_params"].get("disagg_request_id")
            if handoff.get("disagg_request_id") is None and sent_id is not None:
                handoff["disagg_request_id"] = sent_id
            ids = answer.get("prompt_token_ids")
            if isinstance(ids, list):
                handoff[PROMPT_TOKEN_IDS_KEY] = ids
            output.disaggregated_params = handoff
        output.worker_trace_link = TraceLink(
            worker_id=self.name, request_id=request.request_id,
            trace_id=answer.get("id") if isinstance(answer.get("id"), str) else None,
        )
        return output


def trtllm_engines(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    client: Client | None = None,
    cancel_window: CancelWindow | None = None,
) -> tuple[list[TrtllmEngine], list[TrtllmEngine]]:
    """Make the context and generation engines of a TensorRT-LLM deployment, sharing one
    client.

    Args:
        prefill_urls: the context servers' base URLs (``http://host:port``).
        decode_urls: the generation servers' base URLs.
        client: the client to share; default a new
            :func:`~trio_disagg.engines.worker_client`, reachable as ``engine.client`` of
            every engine returned. Whoever made it closes it once the router is done.
        cancel_window: the context engines' cancel window (B10), if not
            ``BEFORE_HANDOFF``.

    Returns:
        ``(prefill_engines, decode_engines)``, for two
        :class:`~trio_disagg.WorkerPool`\\ s.

    Raises:
        ValueError: a malformed URL, or the same URL twice in one role.
    """
    check_unique("prefill", list(prefill_urls))
    check_unique("decode", list(decode_urls))
    for url in [*prefill_urls, *decode_urls]:
        check_worker_url(url, TrtllmEngine.protocol)  # before a client is made
    shared = client if client is not None else worker_client()
    prefill = [TrtllmEngine(url, "prefill", client=shared, cancel_window=cancel_window)
               for url in prefill_urls]
    decode = [TrtllmEngine(url, "decode", client=shared) for url in decode_urls]
    return prefill, decode
