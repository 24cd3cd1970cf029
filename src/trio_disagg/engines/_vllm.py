"""The vLLM engine adapter: prefill and decode workers over HTTP (docs/protocols.md section 2).

vLLM's disaggregated serving with a NixlConnector-style KV connector is *sequential*: the
router sends the prefill worker the client's request cut down to one token, with
``kv_transfer_params: {"do_remote_decode": true, ...}``; the prefill computes the prompt's
KV, keeps its blocks and answers with ``kv_transfer_params`` saying where they are; the
router then sends the decode worker the client's request plus those ``kv_transfer_params``
verbatim, and the decode worker pulls the blocks before it produces tokens.

:class:`VllmEngine` implements :class:`~trio_disagg.Engine` for either role over one
shared :class:`~trio_disagg.engines.WorkerClient`, on the skeleton shared by
every HTTP adapter (:class:`~trio_disagg.engines._http.HttpEngine`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, NewType

import attrs

from .._engine import CancelWindow
from .._protocols import LLMEngineOutput, PreprocessedRequest, TraceLink
from ._chunks import (
    ChunkParser,
)
from ._handoffs import (
    NON_EMPTY,
    Must,
    NonNegativeInt,
    choices_problem,
    handoff_converter,
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
from ._wire import WorkerClient

__all__ = [
    "PREFILL_KV_TRANSFER_PARAMS", "KvTransferParams",
    "VllmEngine",
    "decode_body", "endpoint_for", "prefill_body", "vllm_client", "vllm_engines",
]

#: The ``kv_transfer_params`` of every prefill request (docs/protocols.md section 2).
PREFILL_KV_TRANSFER_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


#: A prefill's ``remote_block_ids``: the block ids to pull, as one list (vLLM's
#: NixlConnector before the hybrid KV cache manager) or as one list per KV cache group
#: (``[[4, 5], [9]]``: the connector's ``BlockIds``, a tuple of lists, on later builds).
BlockIds = NewType("BlockIds", list)  # type: ignore[type-arg]

_FLAT_BLOCK_IDS = Annotated[list[NonNegativeInt], NON_EMPTY]
_GROUPED_BLOCK_IDS = Annotated[list[list[NonNegativeInt]],
                               Must(lambda groups: any(groups), "a list with a block")]


def _structure_block_ids(value: Any, _: Any) -> list[Any]:
    """``value`` as :data:`BlockIds`: a list of lists is a list per KV cache group (each a
    list of non-negative integers, one group at least with a block), anything else one
    non-empty list of non-negative integers."""
    if type(value) is list and value and all(type(group) is list for group in value):
        grouped: list[Any] = handoff_converter.structure(value, _GROUPED_BLOCK_IDS)
        return grouped
    flat: list[Any] = handoff_converter.structure(value, _FLAT_BLOCK_IDS)
    return flat


handoff_converter.register_structure_hook(BlockIds, _structure_block_ids)


@attrs.frozen(kw_only=True)
class KvTransferParams:
    """The fields of a prefill's ``kv_transfer_params`` a decode worker needs to pull the
    KV (B7), and their types; ``do_remote_decode``, ``remote_request_id`` and
    ``tp_size`` may be left out. Only for validation: the worker's object goes to the
    decode as sent, with any other field it has.

    The direction must be the prefill's answer's: ``do_remote_prefill`` true (the decode
    pulls the KV) and ``do_remote_decode``, if present, false (``true`` would make the
    decode worker act as a prefill and strand the KV staged here); ``remote_block_ids``
    (the blocks to pull) must be a non-empty list of non-negative integers, or a list of
    such lists, one per KV cache group, with a block in one of them at least
    (:data:`BlockIds`); ``remote_port`` a port, 1-65535."""

    do_remote_prefill: Annotated[bool, Must(lambda value: value is True, "true")]
    do_remote_decode: Annotated[bool, Must(lambda value: value is False, "false")] = False
    remote_engine_id: str
    remote_block_ids: BlockIds
    remote_host: str
    remote_port: Annotated[int, Must(lambda value: 0 < value < 65536, "a port in 1-65535")]
    remote_request_id: str = ""
    tp_size: int = 1


@attrs.frozen(kw_only=True)
class _PrefillAnswer:
    kv_transfer_params: KvTransferParams


def vllm_client(**options: Any) -> WorkerClient:
    """A new :class:`~trio_disagg.engines.WorkerClient` for :class:`VllmEngine`\\ s to
    share: :func:`~trio_disagg.engines.worker_client`, whose keywords ``options`` are
    (connection bounds in connections, timeouts in seconds, ``headers`` such as the
    workers' API key). The caller owns it: ``async with`` it, or ``await
    client.aclose()``.

    Raises:
        ValueError: ``max_connections`` < 1 or ``max_idle_per_worker`` < 0, or a header
            that could inject another (a CR, LF or NUL).
        TypeError: a keyword :class:`~trio_disagg.engines.WorkerClient` does not take.
    """
    return worker_client(**options)


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill request for a client's body (docs/protocols.md section 2).

    The client's body with ``stream: false``, ``max_tokens: 1`` (and
    ``max_completion_tokens: 1`` if the body has it), ``stream_options`` removed,
    ``min_tokens`` capped at 1, ``tool_choice: "required"`` made the first tool's name
    (:func:`_prefill_tool_choice`), and :data:`PREFILL_KV_TRANSFER_PARAMS`.

    ``min_tokens`` is capped, not removed: vLLM refuses ``min_tokens > max_tokens``, but
    a client's ``min_tokens >= 1`` must still keep the prefill's one token from ending
    the request on EOS (which would make it terminal, S7, and answer the client an empty
    completion it asked not to get).
    """
    wire = dict(body)
    wire["stream"] = False
    wire["max_tokens"] = 1
    if "max_completion_tokens" in wire:
        wire["max_completion_tokens"] = 1
    wire.pop("stream_options", None)
    min_tokens = wire.get("min_tokens")
    if type(min_tokens) is int and min_tokens > 1:
        wire["min_tokens"] = 1
    if wire.get("tool_choice") == "required":
        wire["tool_choice"] = _prefill_tool_choice(wire.get("tools"))
    wire["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return wire


def _prefill_tool_choice(tools: Any) -> Any:
    """What a prefill asks for ``tool_choice: "required"``: the first tool by name.

    vLLM parses a non-streamed answer to ``"required"`` as a JSON list of calls, and the
    prefill's one token is none: the request would fail once its KV is staged, with no
    handoff to free it (vllm-project/vllm#38911). A named tool is not parsed, keeps
    the tools in the prompt (the KV is the same) and, like ``"required"``, cannot end
    on its first token; the token is the prefill's, the decode makes the answer under
    the client's own ``"required"``. Without a named tool to take, ``"required"`` is
    left for vLLM to refuse as it would.
    """
    if isinstance(tools, list) and tools and isinstance(tools[0], Mapping):
        function = tools[0].get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if tools[0].get("type") == "function" and isinstance(name, str):
            return {"type": "function", "function": {"name": name}}
    return "required"


def decode_body(request: PreprocessedRequest) -> dict[str, Any]:
    """The decode request for ``request`` (docs/protocols.md section 2).

    The client's original body plus the prefill's ``kv_transfer_params`` verbatim (from
    ``request.prefill_result.disaggregated_params``), with two changes, both invisible to
    the client (:func:`~trio_disagg.engines.streaming_body`):

    - the decode worker is always asked to stream (``stream: true``,
      ``stream_options.include_usage: true``), whatever the client asked: the adapter
      then reads the answer as it comes (one output per socket read) either way, a
      worker dying mid-answer is seen as such, and the server layer collects the outputs
      into one JSON answer for a client that did not stream;
    - ``prompt_logprobs`` and ``echo`` are dropped: they concern the prompt, which only
      the prefill computed (the server refuses them before routing; this is the second
      line of defence).

    Nothing else is added (B8): a body that names no budget (``max_tokens`` /
    ``max_completion_tokens``) goes without one.
    """
    wire = streaming_body(request)
    if request.prefill_result is not None:
        wire["kv_transfer_params"] = request.prefill_result.disaggregated_params
    else:
        wire.pop("kv_transfer_params", None)
    return wire


class VllmEngine(HttpEngine):
    """A vLLM worker, prefill or decode, as an :class:`~trio_disagg.Engine`
    (docs/protocols.md sections 1 and 2).

    **Prefill** (``role="prefill"``): ``POST`` :func:`prefill_body` to
    ``/v1/chat/completions`` if the body has ``messages``, else ``/v1/completions``, not
    streamed. vLLM answers only once the prefill is done; the answer becomes ONE output:
    the token's text (and ``token_ids`` if the worker sent them), its finish reason, the
    usage with ``prompt_tokens_details.cached_tokens`` (the router reports this one to
    the client, S4/S10), and ``disaggregated_params`` = the answer's
    ``kv_transfer_params``. A prefill that ended on its first token (``finish_reason``
    ``stop``, ``kv_transfer_params`` null) is thus an output with finish ``STOP`` and no
    ``disaggregated_params``: the router's terminal case, no decode (S7). Any other
    answer is a handoff and is validated first (B7): it must hold exactly one choice, and
    its ``kv_transfer_params`` must be an object with the fields of
    :class:`KvTransferParams`, well typed and in range; if not, the
    answer becomes ONE error item carrying an :class:`~trio_disagg.InvalidPrefillHandoff`
    whose ``field`` names the culprit (``"kv_transfer_params.remote_port"``), and no
    decode request is ever built from it.

    **Decode** (``role="decode"``): ``POST`` :func:`decode_body` (always streamed) and
    turn each server-sent event into an output: its text, ``token_ids`` if present, and
    on the last one the finish reason with the usage of the final usage chunk. Worker
    finish reasons map as ``stop``/``tool_calls``/``function_call`` -> ``STOP``,
    ``length`` -> ``LENGTH``, ``abort``/``cancelled`` -> ``CANCELLED``, ``eos`` -> ``EOS``,
    ``content_filter`` -> ``CONTENT_FILTER``, ``error`` (or ``{"error": message}``) -> an
    error finish; any other string -> ``STOP``.

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
      worker died). The item carries a :class:`~trio_disagg.WorkerError` (502). Nothing
      is raised.

    Cancellation: ``context.stop_generating()`` closes the worker response (vLLM aborts
    the request) and ends the stream with one ``cancelled`` item; ``context.kill()``
    closes it and ends the stream at once; a closed receiver or a cancelled caller closes
    it too. The router runs the prefill leg in its transfer keeper on a context of its
    own (C5), so a client that goes away never closes a prefill connection early by
    accident: only the prefill's own deadline, a kill of its own context, or the router
    ending a prefill inside its cancel window (B10, a stop: once the answer started it
    is read to its end, and its KV consumed, B1) does.

    ``cancel_window`` is ``ANYTIME`` (B10): vLLM frees a request's blocks when its
    connection closes, so a prefill may be cancelled until it answers without stranding
    KV; once it answered, the KV waits for a decode, which the router sends (B1).

    Args:
        url: the worker's base URL, such as ``http://10.0.0.5:8100`` (no ``/v1``).
        role: ``"prefill"`` or ``"decode"``.
        client: the shared client (see :func:`vllm_client`), or an
            :class:`httpx.AsyncClient` of the caller's own; the engine never closes it.
        name: unique within its pool; default ``url``.
        cancel_window: overrides ``ANYTIME`` for this engine.

    Raises:
        ValueError: ``url`` is not an ``http://`` or ``https://`` URL, or ``role`` is
            neither role.
        TypeError: ``cancel_window`` is not a :class:`~trio_disagg.CancelWindow`.
    """

    protocol: ClassVar[str] = "vLLM"
    whole_message: ClassVar[Mapping[str, Any]] = MappingProxyType({"tool_calls": []})
    default_cancel_window: ClassVar[CancelWindow] = CancelWindow.ANYTIME

    def _prepare(self, request: PreprocessedRequest) -> tuple[str, dict[str, Any]]:
        body = prefill_body(request.body) if self.role == "prefill" else decode_body(request)
        return endpoint_for(body), body

    def _handoff_problem(self, answer: Mapping[str, Any]) -> tuple[str, str] | None:
        return choices_problem(answer) or handoff_problem(answer, _PrefillAnswer)

    def _answer_output(
        self,
        answer: Mapping[str, Any],
        request: PreprocessedRequest,
        body: Mapping[str, Any],
        parser: ChunkParser,
    ) -> LLMEngineOutput | None:
        output = super()._answer_output(answer, request, body, parser)
        if output is not None and self.role == "prefill":
            output.disaggregated_params = answer.get("kv_transfer_params")
            output.worker_trace_link = TraceLink(
                worker_id=self.name, request_id=request.request_id,
                trace_id=answer.get("id") if isinstance(answer.get("id"), str) else None,
            )
        return output


def vllm_engines(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    client: Client | None = None,
    cancel_window: CancelWindow | None = None,
) -> tuple[list[VllmEngine], list[VllmEngine]]:
    """Make the prefill and decode engines of a vLLM deployment, sharing one client.

    Args:
        prefill_urls: the prefill workers' base URLs (``http://host:port``).
        decode_urls: the decode workers' base URLs.
        client: the client to share; default a new :func:`vllm_client`, reachable as
            ``engine.client`` of every engine returned. Whoever made it closes it
            (``await client.aclose()``) once the router is done.
        cancel_window: the prefill engines' cancel window (B10), if not ``ANYTIME``.

    Returns:
        ``(prefill_engines, decode_engines)``, for two
        :class:`~trio_disagg.WorkerPool`\\ s.

    Raises:
        ValueError: a malformed URL, or the same URL twice in one role.
    """
    check_unique("prefill", list(prefill_urls))
    check_unique("decode", list(decode_urls))
    for url in [*prefill_urls, *decode_urls]:
        check_worker_url(url, VllmEngine.protocol)  # before a client is made
    shared = client if client is not None else vllm_client()
    prefill = [VllmEngine(url, "prefill", client=shared, cancel_window=cancel_window)
               for url in prefill_urls]
    decode = [VllmEngine(url, "decode", client=shared) for url in decode_urls]
    return prefill, decode
