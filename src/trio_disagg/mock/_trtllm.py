"""A mock TensorRT-LLM worker over HTTP: a context (prefill) or generation (decode) server
of ``trtllm-serve`` in disaggregated mode (docs/protocols.md sections 4 and 5).

The router sends the context server the client's body with ``disaggregated_params:
{"request_type": "context_only", "disagg_request_id"}``; the context server computes the
prompt's KV, keeps it under a fresh ``ctx_request_id`` and answers with
``choices[0].disaggregated_params`` and ``prompt_token_ids``; the router then sends the
generation server the client's body with those ``disaggregated_params`` (``request_type:
"generation_only"``) and the prompt replaced by ``prompt_token_ids``; the generation server
pulls the KV by ``ctx_request_id`` over loopback before it produces tokens.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from functools import partial
from types import MappingProxyType
from typing import Any, ClassVar, Unpack

import attrs
import orjson

from ._answers import OpenAIFormat, usage_dict
from ._asgi import Exchange, Refusal
from ._core import Prefill
from ._faults import Fault, FaultKind
from ._kv import StagedKV
from ._kvwire import RemoteKV
from ._options import WorkerOptions
from ._sinks import PrefillAnswers
from ._text import WORDS, prompt_token_ids
from ._wire_faults import REMOVED, MockFault, MockFaultKind
from ._worker import MockWorker, Role, Work

__all__ = ["CTX_REQUEST_ID_HOOK", "EARLY_PARAMS", "MockTrtllmWorker", "decode_opaque_state",
           "encode_opaque_state"]

#: A body field of this mock only (a test hook, like ``"fault"``): ``"null"`` makes a
#: context answer ``ctx_request_id: null``, ``"missing"`` leaves it out, both without
#: staging any KV (the refusals of rule S9 in docs/semantics.md).
CTX_REQUEST_ID_HOOK = "mock_ctx_request_id"

#: The fields of ``disaggregated_params`` in ``trtllm-serve`` releases from before
#: ``disagg_request_id``, whose models forbid any other (``extra="forbid"``).
EARLY_PARAMS = frozenset({"request_type", "first_gen_tokens", "ctx_request_id",
                          "encoded_opaque_state", "draft_tokens"})

_TERMINAL_FINISH = {
    FaultKind.EOS_FIRST_TOKEN: "stop",
    FaultKind.PREFILL_ERROR_FINISH: "error",
    FaultKind.PREFILL_CANCELLED_FINISH: "cancelled",
}


def encode_opaque_state(host: str, port: int, engine_id: str, block_ids: list[int]) -> str:
    """The mock's ``encoded_opaque_state``: where the generation server pulls the KV from
    (base64 of a JSON object; in TRT-LLM it is the context's communicator state)."""
    return base64.b64encode(orjson.dumps({
        "host": host, "port": port, "engine_id": engine_id, "block_ids": block_ids,
    })).decode()


def decode_opaque_state(ctx_request_id: Any, state: Any) -> RemoteKV | str:
    """Where a generation request pulls its KV from, by its ``ctx_request_id`` and
    ``encoded_opaque_state``; or why they cannot be used."""
    if type(ctx_request_id) is not int:
        return (f"a generation_only request needs an integer ctx_request_id, got "
                f"{ctx_request_id!r:.60}")
    try:
        fields = orjson.loads(base64.b64decode(state, validate=True))
    except (TypeError, ValueError, binascii.Error, orjson.JSONDecodeError):
        return f"encoded_opaque_state is not this mock's: {state!r:.60}"
    if not isinstance(fields, dict):
        return f"encoded_opaque_state is not this mock's: {state!r:.60}"
    host, port = fields.get("host"), fields.get("port")
    engine, blocks = fields.get("engine_id"), fields.get("block_ids")
    if (not isinstance(host, str) or type(port) is not int or not isinstance(engine, str)
            or not isinstance(blocks, list) or not all(type(b) is int for b in blocks)):
        return f"encoded_opaque_state is not this mock's: {fields!r:.80}"
    return RemoteKV(host=host, port=port, key=str(ctx_request_id), engine_id=engine,
                    block_ids=tuple(blocks))


class MockTrtllmWorker(MockWorker):
    """A mock TensorRT-LLM worker (context or generation server) as an ASGI 3 application
    (docs/protocols.md sections 4 and 5).

    Endpoints, as ``trtllm-serve``: ``POST /v1/completions`` and
    ``POST /v1/chat/completions`` (streamed or not), ``GET /v1/models``, ``GET /health``,
    ``GET /metrics``, ``GET /stats``, and the mock KV pull ``GET /kv/{ctx_request_id}``
    (see :class:`~trio_disagg.workers.MockWorker`). Errors are TRT-LLM's
    ``{"object": "error", "message", ...}``.

    A generation request is served by its ``disaggregated_params.request_type``:

    - ``"context_only"`` (``role="prefill"``; an integer ``disagg_request_id`` if any):
      compute the prefill (``latency.time_to_first_token``), stage the KV under a fresh
      integer ``ctx_request_id`` (held until the generation server pulls it, or its lease
      of ``kv_ttl`` seconds, TRT-LLM's ``kv_transfer_timeout_ms``, expires), and answer one
      token (not streamed), ``finish_reason: "length"``, ``usage`` with
      ``prompt_tokens_details.cached_tokens``, ``prompt_token_ids`` and
      ``choices[0].disaggregated_params: {"request_type": "context_only",
      "first_gen_tokens", "ctx_request_id", "encoded_opaque_state" (where the KV is),
      "draft_tokens": null, "disagg_request_id"}``. A context that ends on its first
      token (``eos_first_token``, ``prefill_error_finish``, ``prefill_cancelled_finish``)
      answers ``finish_reason`` ``stop`` / ``error`` / ``cancelled`` with
      ``ctx_request_id: null`` and stages nothing: the final answer (S7).
    - ``"generation_only"`` (``role="decode"``): pull the KV by ``ctx_request_id`` from
      the context server named in ``encoded_opaque_state`` (``GET /kv/{ctx_request_id}``,
      checking every byte), then generate (a failed pull is a decode error). Aborted
      before the pull, it does not free the KV, as TRT-LLM's generation server: the
      context's KV waits for its lease (B6: a router keeps a generation leg
      until it fetched its KV).
    - none: compute the prefill locally, then generate.

    Aborting on connection close: a context request aborted before it answered stages
    nothing (counted aborted). Once it answered, its KV is committed: closing the
    connection does not free it, only the generation server's pull does, or the lease
    (TRT-LLM's ``kv_transfer_timeout_ms``) expiring, which strands it; a router must never
    abort a context leg after its handoff.

    Faults: as :class:`~trio_disagg.workers.MockVllmWorker` (mock-only ones included:
    ``decode_kv_lost``, ``decode_queue:SECONDS``, ``decode_accept_delay:SECONDS``,
    ``prefill_bad_handoff:FIELD[=VALUE]``
    with the fields of ``choices[0].disaggregated_params``, or ``choices`` for two
    choices). The body field
    ``"mock_ctx_request_id"`` (:data:`CTX_REQUEST_ID_HOOK`, ``"null"`` or ``"missing"``)
    makes a non-terminal context answer without a usable ``ctx_request_id``, staging
    nothing (the refusals of S9).

    Args: as :class:`~trio_disagg.workers.MockWorker`; ``kv_ttl`` is the context
    server's ``kv_transfer_timeout``; no ``api_key`` (``trtllm-serve`` has no
    ``--api-key``: a ValueError). ``disagg_request_ids=False`` makes a server of the
    releases from before ``disagg_request_id``: ``disaggregated_params`` with any field
    but :data:`EARLY_PARAMS` is refused as their request validation refuses it (400
    ``{"error": "[{'type': 'extra_forbidden', 'loc': ('body', 'disaggregated_params',
    'disagg_request_id'), ...}]"}``), and a context's answer has no
    ``disagg_request_id``.
    """

    protocol: ClassVar[str] = "trtllm"
    owned_by: ClassVar[str] = "tensorrt_llm"
    whole_message: ClassVar[Mapping[str, Any]] = MappingProxyType(
        {"reasoning_content": None, "tool_calls": []})
    flat_errors: ClassVar[bool] = True
    releases_unpulled_kv: ClassVar[bool] = False
    takes_api_key: ClassVar[bool] = False

    _last_ctx_id = 0

    def __init__(self, role: Role, *, disagg_request_ids: bool = True,
                 **options: Unpack[WorkerOptions]) -> None:
        super().__init__(role, **options)
        self.disagg_request_ids = disagg_request_ids

    def _next_ctx_id(self) -> int:
        """A fresh ``ctx_request_id`` (1, 2, ... per worker)."""
        self._last_ctx_id += 1
        return self._last_ctx_id

    def _work(self, exchange: Exchange, body: dict[str, Any], path: str,
              fault: Fault | None, mock: MockFault | None = None) -> Work:
        params = body.get("disaggregated_params")
        if params is not None and not isinstance(params, Mapping):
            raise Refusal(400, f"disaggregated_params must be an object, got {params!r:.60}")
        request_type = params.get("request_type") if params is not None else None
        if params is not None and not self.disagg_request_ids:
            for key, value in params.items():
                if key not in EARLY_PARAMS:
                    return partial(_extra_forbidden, exchange, key, value)
        options = body.get("stream_options")
        include_usage = body.get("stream") is True and isinstance(options, Mapping) and (
            options.get("include_usage") is True)
        fmt = self.openai_format(exchange, body, path)
        if request_type == "context_only":
            assert params is not None
            if self.role != "prefill":
                raise Refusal(400, f"{self.name} is a generation server: it takes no "
                                   f"context_only request")
            disagg_id = params.get("disagg_request_id")
            if disagg_id is not None and type(disagg_id) is not int:
                raise Refusal(400, f"disagg_request_id must be an integer, got "
                                   f"{disagg_id!r:.60}")
            return partial(self._context, exchange, body, path, fault, disagg_id, mock)
        if request_type == "generation_only":
            assert params is not None
            if self.role != "decode":
                raise Refusal(400, f"{self.name} is a context server: it takes no "
                                   f"generation_only request")
            source = decode_opaque_state(params.get("ctx_request_id"),
                                         params.get("encoded_opaque_state"))
            return partial(self._decode, exchange, body, fmt, fault, source,
                           include_usage=include_usage, mock=mock)
        if request_type is not None:
            raise Refusal(400, f"unknown request_type {request_type!r:.60}")
        return partial(self._decode, exchange, body, fmt, fault, None,
                       include_usage=include_usage, mock=mock)

    async def _context(self, exchange: Exchange, body: Mapping[str, Any], path: str,
                       fault: Fault | None, disagg_id: int | None,
                       mock: MockFault | None = None) -> None:
        """A context request: stage the KV under a fresh ``ctx_request_id``, answer
        (``prefill_bad_handoff``: a broken handoff, staging nothing)."""
        sink = _ContextSink(self, exchange, self.openai_format(exchange, body, path), body,
                            disagg_id, mock)
        await self._run_prefill(self.prefill_run(exchange, body, fault), sink)


async def _extra_forbidden(exchange: Exchange, field: str, value: Any) -> None:
    """A request refused as ``trtllm-serve``'s validation handler answers a field its
    ``disaggregated_params`` does not know: 400 with pydantic's error as a string."""
    exchange.failed = True
    error = [{"type": "extra_forbidden", "loc": ("body", "disaggregated_params", field),
              "msg": "Extra inputs are not permitted", "input": value}]
    await exchange.respond(400, orjson.dumps({"error": str(error)}))


@attrs.define
class _ContextSink(PrefillAnswers):
    """A context server's answers (the core's :class:`~._core.PrefillSink`): each commits
    before it is sent; a handoff's KV, once answered, is freed only by its pull or its
    lease."""

    worker: MockTrtllmWorker
    exchange: Exchange
    fmt: OpenAIFormat
    body: Mapping[str, Any]
    disagg_id: int | None
    mock: MockFault | None
    ctx_id: int = 0  # the context's ctx_request_id, once staged

    def _params(self, run: Prefill) -> dict[str, Any]:
        params = {"request_type": "context_only", "first_gen_tokens": [run.token],
                  "ctx_request_id": None, "encoded_opaque_state": None,
                  "draft_tokens": None, "disagg_request_id": self.disagg_id}
        if not self.worker.disagg_request_ids:
            del params["disagg_request_id"]
        return params

    def _answer(self, run: Prefill, params: dict[str, Any], *, finish: str = "length",
                eos: bool = True) -> bytes:
        token = run.token
        return self.fmt.answer(
            text=WORDS[token] if eos else "", token_ids=[token] if eos else [],
            finish=finish, usage=usage_dict(run.prompt_tokens, 1 if eos else 0, run.cached),
            top={"prompt_token_ids": prompt_token_ids(run.seed, self.body)},
            choice={"disaggregated_params": params})

    async def terminal(self, run: Prefill, kind: FaultKind) -> None:
        run.answered = True  # S7: the context is the final answer
        await self.exchange.respond(200, self._answer(
            run, self._params(run), finish=_TERMINAL_FINISH[kind],
            eos=kind is FaultKind.EOS_FIRST_TOKEN))

    async def before_stage(self, run: Prefill) -> bool:
        params = self._params(run)
        hook = self.body.get(CTX_REQUEST_ID_HOOK)
        if hook in ("null", "missing"):  # S9 test hooks: nothing usable, nothing staged
            if hook == "missing":
                del params["ctx_request_id"]
            run.answered = True
            await self.exchange.respond(200, self._answer(run, params))
            return True
        mock = self.mock
        if mock is None or mock.kind is not MockFaultKind.PREFILL_BAD_HANDOFF:
            return False
        run.answered = True  # nothing staged for a handoff nobody can use
        params["ctx_request_id"] = self.worker._next_ctx_id()
        params["encoded_opaque_state"] = encode_opaque_state(
            self.worker.host, self.worker.port, self.worker.name, [])
        answer = orjson.loads(self._answer(run, params))
        if mock.field == "choices":
            answer["choices"].append({**answer["choices"][0], "index": 1})
        elif mock.value is REMOVED:
            params.pop(mock.field, None)
        else:
            params[mock.field] = mock.value
        answer["choices"][0]["disaggregated_params"] = params
        await self.exchange.respond(200, orjson.dumps(answer))
        return True

    def stage_key(self, run: Prefill) -> str:
        self.ctx_id = self.worker._next_ctx_id()
        return str(self.ctx_id)

    async def handoff(self, run: Prefill, entry: StagedKV) -> None:
        if run.kind is FaultKind.PREFILL_FAIL_AFTER_HANDOFF:
            run.release(entry)  # the request failed: the worker frees its KV
            await self.fail(run, run.message("after staging its KV"))
            return
        worker = self.worker
        params = self._params(run)
        params["ctx_request_id"] = self.ctx_id
        params["encoded_opaque_state"] = encode_opaque_state(
            worker.host, worker.port, worker.name, list(entry.block_ids))
        run.answered = True  # committed: from here on an abort does not free the KV
        await self.exchange.respond(200, self._answer(run, params))
