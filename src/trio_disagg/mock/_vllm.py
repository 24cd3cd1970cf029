"""A mock vLLM worker over HTTP: prefill or decode, NixlConnector-style (docs/protocols.md
sections 2 and 5).

A plain ASGI 3 application; :func:`~trio_disagg.workers.serve_worker` serves it with
hypercorn's trio worker. It reuses the in-process mock engines' pieces (latency model,
fault injection, KV block accounting, pseudo-text) and the mock workers' shared base
(:class:`~trio_disagg.workers.MockWorker`), so the HTTP workers and the in-process engines
behave alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from types import MappingProxyType
from typing import Any, ClassVar, Unpack

import attrs
import orjson

from ._answers import OpenAIFormat, usage_dict
from ._asgi import Exchange
from ._core import TERMINAL_FINISH, Prefill
from ._faults import Fault, FaultKind
from ._kv import StagedKV
from ._kvwire import RemoteKV
from ._options import WorkerOptions
from ._sinks import PrefillAnswers
from ._text import WORDS, prompt_token_ids
from ._wire_faults import REMOVED, MockFault, MockFaultKind
from ._worker import MockWorker, Role, Work

__all__ = ["MockVllmWorker", "parse_remote_kv"]


def parse_remote_kv(params: Mapping[str, Any]) -> RemoteKV | str:
    """Where a decode pulls its KV from, by the prefill's ``kv_transfer_params``; or why
    they cannot be used."""
    host, port = params.get("remote_host"), params.get("remote_port")
    key, engine = params.get("remote_request_id"), params.get("remote_engine_id")
    blocks = params.get("remote_block_ids")
    if (isinstance(blocks, list) and blocks
            and all(isinstance(group, list) for group in blocks)):
        # One list per KV cache group (vLLM's hybrid KV cache manager): the mock stages
        # one group, its blocks the flat list's.
        blocks = [block for group in blocks for block in group]
    if not isinstance(host, str) or not host or type(port) is not int:
        return f"kv_transfer_params need remote_host and remote_port, got {host!r}:{port!r}"
    if not isinstance(key, str) or not isinstance(engine, str):
        return (f"kv_transfer_params need remote_request_id and remote_engine_id strings, "
                f"got {key!r} and {engine!r}")
    if not isinstance(blocks, list) or not all(type(b) is int for b in blocks):
        return f"remote_block_ids must be a list of integers, got {blocks!r:.60}"
    return RemoteKV(host=host, port=port, key=key, engine_id=engine, block_ids=tuple(blocks))


class MockVllmWorker(MockWorker):
    """A mock vLLM worker (prefill or decode) as an ASGI 3 application.

    Endpoints, as vLLM's OpenAI server: ``POST /v1/completions`` and
    ``POST /v1/chat/completions`` (streamed as ``data: {chunk}\\n\\n ... data: [DONE]\\n\\n``
    or not), ``GET /v1/models``, ``GET /health``, and ``GET /metrics`` (Prometheus text,
    a registry per worker: held, stranded and freed KV blocks; served, aborted and
    expired requests; requests received, running, completed, failed, aborted). Not from
    vLLM: ``GET /stats``, JSON for tests and benchmarks, ``{"stats": {...}, "aborts":
    [{"request_id", "at"}, ...]}``: :attr:`stats` and :attr:`aborts`.

    A generation request is served one of three ways, by its ``kv_transfer_params``:

    - ``do_remote_decode: true`` (a prefill request, docs/protocols.md section 2): compute
      the prefill (``latency.time_to_first_token(prompt tokens)``), stage the prompt's KV
      blocks in :attr:`kv`, and answer one token, ``finish_reason: "length"``, ``usage``
      with ``prompt_tokens_details.cached_tokens`` (its prefix-cache hit), and
      ``kv_transfer_params: {"do_remote_prefill": true, "do_remote_decode": false,
      "remote_block_ids", "remote_engine_id": name, "remote_request_id",
      "remote_host", "remote_port", "tp_size": 1}`` (``remote_block_ids`` a list of ids,
      or with ``block_id_groups`` a list of one list per KV cache group: one group, as
      vLLM's NixlConnector with the hybrid KV cache manager sends it for a model with
      full attention only). The blocks are held until a decode
      pulls them, a decode releases them, or their lease of ``kv_ttl`` seconds expires
      (then they count as stranded). A chat prefill with ``tool_choice: "required"``
      fails as vLLM's does (its one token is no JSON list of calls): 400, its KV staged
      and left to its lease.
    - ``do_remote_prefill: true`` (a decode request): pull the KV from
      ``remote_host:remote_port`` over HTTP (``GET /kv/{remote_request_id}``, checking
      every byte; ``remote_block_ids`` in either form), then generate. A failed pull
      is a decode error: an error event and ``[DONE]`` in a stream (whose headers went
      out when the request was accepted), a 500 answer otherwise. ``cached_tokens`` is
      then the whole prompt, as a real decode worker reports it.
    - neither: compute the prefill locally, then generate.

    Generation: ``max_tokens`` (or ``max_completion_tokens``, else
    ``default_max_tokens``) tokens of pseudo-words fixed by ``seed`` and the
    ``X-Request-Id`` (so a prefill's token equals its decode's first token),
    ``latency.inter_token_latency`` seconds apart, ``finish_reason: "length"``; a usage
    chunk if ``stream_options.include_usage``; if the body asks ``return_token_ids``,
    ``token_ids`` in each choice and, as vLLM 0.10.2 on, the prompt's token ids
    (:func:`~._text.prompt_token_ids`) as ``prompt_token_ids``: a chat's at the top level of
    its role-only first chunk and of its whole answer, a completion's in its first
    choice. ``min_tokens`` holds ``eos_first_token``'s EOS off until
    that many tokens went out (a prefill given ``min_tokens >= 1`` hands off as usual).

    Choices beyond text (B8), on every protocol's OpenAI endpoints (the shared OpenAI
    answer format): a chat with ``tools`` (``tool_choice`` not ``"none"``)
    answers one call of the first tool, ``id`` ``"call_<X-Request-Id>"``, its arguments
    ``{"arg0": "word", ...}`` one fragment per token, no content, finish
    ``tool_calls``; a chat's ``logprobs: true`` (``top_logprobs: k``) or a completion's
    ``logprobs: k`` gets seeded log probabilities per token; a chat's
    ``"mock_reasoning_tokens": N`` (:data:`~trio_disagg.workers.REASONING_HOOK`, a body
    field of the mock only) sends its first N tokens as ``reasoning_content``.

    KV pull protocol (between mock workers, :class:`~trio_disagg.workers.MockWorker`):
    ``GET /kv/{remote_request_id}``; ``POST /kv/{remote_request_id}/release`` frees KV
    still waiting for its pull: a decode aborted before its pull sends it, as vLLM's
    decode tells its prefill.

    Aborting on connection close, as vLLM: a generation request whose client disconnects
    is cancelled at once; a prefill aborted before it answered releases what it staged;
    a decode aborted before its pull tells the prefill to release the KV.

    Faults come from the body's ``"fault"`` (see :class:`~trio_disagg.mock.FaultKind`),
    honoured only with ``fault_injection`` (else the field is ignored), or from
    ``fault_plan``; a worker acts on the faults of its ``role``. Over HTTP:
    ``*_reject[:STATUS]`` answers that status; ``prefill_fail_before_handoff`` and
    ``prefill_fail_after_handoff`` answer 500 (after the handoff: the staged KV is
    released first); ``prefill_error_finish`` / ``prefill_cancelled_finish`` /
    ``eos_first_token`` answer ``finish_reason`` ``error`` / ``abort`` / ``stop`` with
    ``kv_transfer_params: null``; ``prefill_reset`` and ``decode_reset_at:K`` end the
    response half-way (the connection closes without a complete answer); ``*_stall``
    waits until the client disconnects; ``decode_fail_before_first_token`` releases the
    KV and fails; ``decode_error_at:K`` fails after K tokens. Mock-only faults
    (``trio_disagg.mock._wire_faults``): ``decode_kv_lost`` releases the KV and answers
    500 ``"KV transfer failed: ..."`` before any byte, streamed or not;
    ``decode_queue:SECONDS`` waits, accepted, before the pull;
    ``decode_accept_delay:SECONDS`` waits before accepting, its handoff untouched;
    ``prefill_bad_handoff:FIELD[=VALUE]`` answers ``kv_transfer_params`` without
    ``FIELD`` (or with that JSON value), or two choices (``choices``), staging nothing.
    Answer faults (a decode's, mixing with one other fault): ``decode_finish:REASON``
    makes the final ``finish_reason`` ``REASON``; ``decode_stop_reason:VALUE`` puts
    ``"stop_reason": VALUE`` (JSON) in the final choice; ``decode_no_usage`` leaves the
    usage chunk out even when ``stream_options.include_usage`` asks for it.

    Args:
        role: ``"prefill"`` or ``"decode"``: which faults it acts on, and its name.
        block_id_groups: a prefill's handoffs give ``remote_block_ids`` per KV cache
            group (``[[0, 1, 2]]``), as vLLM's NixlConnector does on builds with the
            hybrid KV cache manager; default one flat list (``[0, 1, 2]``), as earlier.
        name: the ``remote_engine_id`` of its handoffs; default ``"{role}@host:port"``
            once served.
        model: the only model name accepted (others get 404 as from vLLM); None accepts
            any, and ``/v1/models`` lists ``"mock-model"``.
        latency: the :class:`~trio_disagg.mock.LatencyModel`; default
            ``LatencyModel()``; :meth:`LatencyModel.zero` for benchmarks.
        seed: fixes the tokens (with the request id).
        block_size: tokens per KV block (and per prefix-cache block).
        kv_ttl: seconds staged KV waits for its decode before it is stranded.
        kv_bytes_per_token: bytes of KV per prompt token moved by a pull.
        default_max_tokens: tokens to generate when the body names no budget.
        fault_plan: faults for requests whose body names none.
        fault_injection: honour a request body's ``"fault"`` (a test tool: off, a client
            cannot break the worker).
        http_client: the client for KV pulls and releases: a
            :class:`~trio_disagg.engines.WorkerClient`, or an :class:`httpx.AsyncClient`
            of the caller's own (its pool makes a crowd of pulls sent at once wait for
            each other); :func:`serve_worker` provides a ``WorkerClient``; else one is
            made on first use.
        max_body_bytes: the largest request body accepted (413 above).
        history: how many recent generation requests :attr:`seen` keeps, and how many
            recent aborts :attr:`aborts` keeps.
        prefix_cache_blocks: the bound of the worker's prefix cache (:attr:`prefix`), in
            blocks; 0: none.
        api_key: the key a request must send as ``Authorization: Bearer <key>`` to a
            protected path (:meth:`protects`: vLLM's ``/v1/*``, everything but
            ``/health*`` and ``/metrics*`` on SGLang), else 401 ``{"error":
            "Unauthorized"}``, as the real worker started with ``--api-key``; None (the
            default): none. Not for TensorRT-LLM, whose ``trtllm-serve`` takes none.

    Raises:
        ValueError: a bad role or setting, or an API key for a TensorRT-LLM worker.
    """

    protocol: ClassVar[str] = "vllm"
    owned_by: ClassVar[str] = "vllm"
    whole_message: ClassVar[Mapping[str, Any]] = MappingProxyType({"tool_calls": []})

    def __init__(self, role: Role, *, block_id_groups: bool = False,
                 **options: Unpack[WorkerOptions]) -> None:
        super().__init__(role, **options)
        self.block_id_groups = block_id_groups

    def _work(self, exchange: Exchange, body: dict[str, Any], path: str,
              fault: Fault | None, mock: MockFault | None = None) -> Work:
        params = body.get("kv_transfer_params")
        params = params if isinstance(params, Mapping) else {}
        if params.get("do_remote_decode") is True:
            return partial(self._prefill, exchange, body, path, fault, mock)
        # Every vLLM answer has kv_transfer_params, null unless it is a handoff.
        fmt = self.openai_format(exchange, body, path, top={"kv_transfer_params": None},
                                 prompt_ids=self._prompt_ids(body))
        source = parse_remote_kv(params) if params.get("do_remote_prefill") is True else None
        options = body.get("stream_options")
        include_usage = body.get("stream") is True and isinstance(options, Mapping) and (
            options.get("include_usage") is True)
        return partial(self._decode, exchange, body, fmt, fault, source,
                       include_usage=include_usage, mock=mock)

    async def _prefill(self, exchange: Exchange, body: Mapping[str, Any], path: str,
                       fault: Fault | None, mock: MockFault | None = None) -> None:
        """A prefill request (``do_remote_decode``): stage the KV and answer the handoff
        (``prefill_bad_handoff``: a broken one, staging nothing)."""
        fmt = self.openai_format(exchange, body, path, top={"kv_transfer_params": None},
                                 prompt_ids=self._prompt_ids(body))
        forced = "messages" in body and body.get("tool_choice") == "required"
        await self._run_prefill(self.prefill_run(exchange, body, fault),
                                _PrefillSink(self, exchange, fmt, mock, forced))

    def _prompt_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids a body asks for with ``return_token_ids``, else None."""
        return prompt_token_ids(self.seed, body) if body.get("return_token_ids") is True else None

    def _handoff(self, fmt: OpenAIFormat, run: Prefill, entry: StagedKV) -> bytes:
        """The prefill's answer: one token and ``kv_transfer_params`` naming ``entry``."""
        blocks = list(entry.block_ids)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [blocks] if self.block_id_groups else blocks,
            "remote_engine_id": self.name,
            "remote_request_id": entry.key,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
        }
        return fmt.answer(text=WORDS[run.token], token_ids=[run.token], finish="length",
                          usage=usage_dict(run.prompt_tokens, 1, run.cached),
                          top={"kv_transfer_params": params})

    def _bad_handoff(self, fmt: OpenAIFormat, mock: MockFault, token: int,
                     usage: dict[str, Any], request_id: str) -> bytes:
        """A prefill answer whose handoff is broken as ``mock`` says (nothing staged), and
        otherwise well formed (its block ids name no staged block)."""
        params: dict[str, Any] = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [0],
            "remote_engine_id": self.name, "remote_request_id": request_id,
            "remote_host": self.host, "remote_port": self.port, "tp_size": 1,
        }
        if mock.field != "choices":
            if mock.value is REMOVED:
                params.pop(mock.field, None)
            else:
                params[mock.field] = mock.value
        answer = orjson.loads(fmt.answer(text=WORDS[token], token_ids=[token],
                                         finish="length", usage=usage,
                                         top={"kv_transfer_params": params}))
        if mock.field == "choices":
            answer["choices"].append({**answer["choices"][0], "index": 1})
        return orjson.dumps(answer)


@attrs.define
class _PrefillSink(PrefillAnswers):
    """A vLLM prefill's answers (the core's :class:`~._core.PrefillSink`). Its error
    answers and its final answers (S7) commit before they are sent; its handoff once
    sent."""

    worker: MockVllmWorker
    exchange: Exchange
    fmt: OpenAIFormat
    mock: MockFault | None
    #: A chat with ``tool_choice: "required"``: vLLM parses its whole answer as a JSON
    #: list of calls, and a one-token answer is none.
    forced_tools: bool = False

    async def terminal(self, run: Prefill, kind: FaultKind) -> None:
        run.answered = True
        eos = kind is FaultKind.EOS_FIRST_TOKEN
        token = run.token
        await self.exchange.respond(200, self.fmt.answer(
            text=WORDS[token] if eos else "", token_ids=[token] if eos else [],
            finish=TERMINAL_FINISH[kind],
            usage=usage_dict(run.prompt_tokens, 1 if eos else 0, run.cached)))

    async def before_stage(self, run: Prefill) -> bool:
        mock = self.mock
        if mock is None or mock.kind is not MockFaultKind.PREFILL_BAD_HANDOFF:
            return False
        run.answered = True  # nothing staged for a handoff nobody can use
        await self.exchange.respond(200, self.worker._bad_handoff(
            self.fmt, mock, run.token, usage_dict(run.prompt_tokens, 1, run.cached),
            run.request_id))
        return True

    async def handoff(self, run: Prefill, entry: StagedKV) -> None:
        if self.forced_tools:
            # As vLLM: the parse of the one token fails once the KV is staged, and the
            # error answer names no KV to free: it waits for its lease (vLLM #38911).
            run.answered = True
            await self.exchange.error(
                "1 validation error for list[FunctionDefinition]: Invalid JSON: EOF while "
                "parsing a list at line 1 column 1", 400)
            return
        if run.kind is FaultKind.PREFILL_FAIL_AFTER_HANDOFF:
            run.release(entry)  # the request failed: the worker frees its KV
            await self.fail(run, run.message("after staging its KV"))
            return
        await self.exchange.respond(200, self.worker._handoff(self.fmt, run, entry))
