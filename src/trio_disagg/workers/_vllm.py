"""A mock vLLM worker over HTTP: prefill or decode, NixlConnector-style (PROTOCOLS.md
sections 2 and 5).

A plain ASGI 3 application; :func:`~trio_disagg.workers.serve_worker` serves it with
hypercorn's trio worker. It reuses the in-process mock engines' pieces (latency model,
fault injection, KV block accounting, pseudo-text), so the HTTP workers and the in-process
engines behave alike.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any, Literal
from urllib.parse import quote, unquote_to_bytes

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client, on trio natively)
import orjson
import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from ..engines._faults import Fault, FaultKind, FaultPlan, fault_for
from ..engines._kv import DEFAULT_BLOCK_SIZE, DEFAULT_KV_TTL, KVBlockPool, KVTransferError
from ..engines._latency import LatencyModel
from ..engines._text import (
    WORDS,
    TokenStream,
    cached_prompt_tokens,
    count_prompt_tokens,
    resolve_max_tokens,
)
from ._asgi import (
    DONE_EVENT,
    JSON_TYPE,
    Exchange,
    Receive,
    Scope,
    Send,
    read_body,
    run_until_disconnect,
)

logger = logging.getLogger("trio_disagg.workers")

Role = Literal["prefill", "decode"]

#: Bytes of KV per prompt token moved by a pull: a 16-token block is 256 bytes.
DEFAULT_KV_BYTES_PER_TOKEN = 16
#: Seconds a decode worker spends, at most, telling a prefill worker to free KV.
RELEASE_TIMEOUT = 2.0
#: Seconds a decode worker's KV pull may take before it fails.
PULL_TIMEOUT = 30.0

_OCTETS = b"application/octet-stream"
_CHUNK = 64 * 1024  # bytes per body message of a KV transfer
_BATCH = 32  # SSE chunks per write when there is no inter-token latency
_REJECTS = frozenset({FaultKind.PREFILL_REJECT, FaultKind.DECODE_REJECT})
_PREFILL_FIRST_FINISH = {
    FaultKind.EOS_FIRST_TOKEN: "stop",
    FaultKind.PREFILL_ERROR_FINISH: "error",
    FaultKind.PREFILL_CANCELLED_FINISH: "abort",
}


def kv_block_bytes(engine_id: str, key: str, block_id: int, size: int) -> bytes:
    """The bytes of one KV block as the mock prefill worker sends them: a pattern fixed by
    the engine id, the transfer key and the block id, so the decode can check them."""
    digest = hashlib.blake2b(f"{engine_id}\x00{key}\x00{block_id}".encode(),
                             digest_size=32).digest()
    return (digest * (size // 32 + 1))[:size]


@attrs.define(kw_only=True)
class WorkerStats:
    """What one mock worker did, beyond its KV pool's counters. Counts of requests.

    Attributes:
        requests: generation requests received (``/v1/completions``,
            ``/v1/chat/completions``), valid or not.
        running: generation requests being served now.
        completed: answered in full (a whole JSON answer, or a stream to ``[DONE]``).
        failed: answered with an error status or error event, or reset on purpose.
        aborted: aborted because the client closed the connection first, as vLLM does.
        kv_transfers: KV pulls served to decode workers (``GET /kv/...``), in full.
        kv_pulls: KV pulls this worker made from a prefill worker, successfully.
        kv_pull_failures: KV pulls that failed (gone, refused, corrupt, unreachable).
        kv_releases: releases sent to a prefill worker for KV never pulled.
    """

    requests: int = 0
    running: int = 0
    completed: int = 0
    failed: int = 0
    aborted: int = 0
    kv_transfers: int = 0
    kv_pulls: int = 0
    kv_pull_failures: int = 0
    kv_releases: int = 0


@attrs.frozen(kw_only=True)
class SeenRequest:
    """A generation request as the worker received it (for tests and demos)."""

    path: str
    request_id: str
    body: Mapping[str, Any]


@attrs.frozen(kw_only=True)
class _RemoteKV:
    """Where a decode pulls its KV from: the prefill's ``kv_transfer_params``."""

    host: str
    port: int
    key: str
    engine_id: str
    block_ids: tuple[int, ...]

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> _RemoteKV | str:
        host, port = params.get("remote_host"), params.get("remote_port")
        key, engine = params.get("remote_request_id"), params.get("remote_engine_id")
        blocks = params.get("remote_block_ids")
        if not isinstance(host, str) or not host or type(port) is not int:
            return f"kv_transfer_params need remote_host and remote_port, got {host!r}:{port!r}"
        if not isinstance(key, str) or not isinstance(engine, str):
            return (f"kv_transfer_params need remote_request_id and remote_engine_id strings, "
                    f"got {key!r} and {engine!r}")
        if not isinstance(blocks, list) or not all(type(b) is int for b in blocks):
            return f"remote_block_ids must be a list of integers, got {blocks!r:.60}"
        return cls(host=host, port=port, key=key, engine_id=engine, block_ids=tuple(blocks))

    def url(self, suffix: str = "") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/kv/{quote(self.key, safe='')}{suffix}"


class _Collector:
    """Reads the worker's counters at scrape time (the KV pool expires due leases then)."""

    def __init__(self, worker: MockVllmWorker) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        worker = self._worker
        kv = worker.kv.counters()
        stats = worker.stats
        labels = ["role"]
        role = [worker.role]

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(f"trio_disagg_mock_{name}", doc, labels=labels)
            family.add_metric(role, value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(f"trio_disagg_mock_{name}", doc, labels=labels)
            family.add_metric(role, value)
            return family

        yield gauge("kv_held_blocks", "KV blocks held for a decode (staged or in transfer).",
                    kv.held_blocks)
        yield gauge("kv_held_requests", "Requests holding KV blocks.", kv.held)
        yield counter("kv_staged_blocks", "KV blocks ever staged.", kv.staged_blocks)
        yield counter("kv_freed_blocks", "KV blocks freed by a pull or a release.",
                      kv.freed_blocks)
        yield counter("kv_stranded_blocks",
                      "KV blocks whose lease expired before any decode pulled them.",
                      kv.stranded_blocks)
        yield counter("kv_served_requests", "Requests whose KV a decode pulled.", kv.served)
        yield counter("kv_aborted_requests",
                      "Requests whose KV was released unused, or aborted before staging.",
                      kv.aborted)
        yield counter("kv_expired_requests", "Requests whose KV was stranded.", kv.expired)
        yield counter("requests", "Generation requests received.", stats.requests)
        yield gauge("requests_running", "Generation requests being served.", stats.running)
        yield counter("requests_completed", "Generation requests answered in full.",
                      stats.completed)
        yield counter("requests_failed", "Generation requests answered with an error.",
                      stats.failed)
        yield counter("requests_aborted",
                      "Generation requests aborted because their connection closed.",
                      stats.aborted)
        yield counter("kv_transfers", "KV pulls served to decode workers.", stats.kv_transfers)
        yield counter("kv_pulls", "KV pulls made from prefill workers.", stats.kv_pulls)
        yield counter("kv_pull_failures", "KV pulls that failed.", stats.kv_pull_failures)
        yield counter("kv_releases", "Releases sent for KV never pulled.", stats.kv_releases)


class MockVllmWorker:
    """A mock vLLM worker (prefill or decode) as an ASGI 3 application.

    Endpoints, as vLLM's OpenAI server: ``POST /v1/completions`` and
    ``POST /v1/chat/completions`` (streamed as ``data: {chunk}\\n\\n ... data: [DONE]\\n\\n``
    or not), ``GET /v1/models``, ``GET /health``, and ``GET /metrics`` (Prometheus text,
    a registry per worker: held, stranded and freed KV blocks; served, aborted and
    expired requests; requests received, running, completed, failed, aborted).

    A generation request is served one of three ways, by its ``kv_transfer_params``:

    - ``do_remote_decode: true`` (a prefill request, PROTOCOLS.md section 2): compute
      the prefill (``latency.time_to_first_token(prompt tokens)``), stage the prompt's KV
      blocks in :attr:`kv`, and answer one token, ``finish_reason: "length"``, ``usage``
      with ``prompt_tokens_details.cached_tokens`` (a deterministic prefix-cache hit), and
      ``kv_transfer_params: {"do_remote_prefill": true, "do_remote_decode": false,
      "remote_block_ids", "remote_engine_id": name, "remote_request_id",
      "remote_host", "remote_port", "tp_size": 1}``. The blocks are held until a decode
      pulls them, a decode releases them, or their lease of ``kv_ttl`` seconds expires
      (then they count as stranded).
    - ``do_remote_prefill: true`` (a decode request): pull the KV from
      ``remote_host:remote_port`` over HTTP (``GET /kv/{remote_request_id}``, checking
      every byte), then generate. A failed pull is a decode error: an error event and
      ``[DONE]`` in a stream (whose headers went out when the request was accepted), a
      500 answer otherwise. ``cached_tokens`` is then the whole prompt, as a real decode
      worker reports it.
    - neither: compute the prefill locally, then generate.

    Generation: ``max_tokens`` (or ``max_completion_tokens``, else
    ``default_max_tokens``) tokens of pseudo-words fixed by ``seed`` and the
    ``X-Request-Id`` (so a prefill's token equals its decode's first token),
    ``latency.inter_token_latency`` seconds apart, ``finish_reason: "length"``; a usage
    chunk if ``stream_options.include_usage``; ``token_ids`` in each choice if the body
    asks ``return_token_ids``.

    KV pull protocol (between mock workers): ``GET /kv/{key}`` claims the KV staged under
    ``key`` (404 if it is gone: expired, pulled, released, never staged), waits
    ``latency.kv_transfer_time(prompt tokens)`` seconds, and sends the blocks'
    bytes (:func:`kv_block_bytes`, ``block_size * kv_bytes_per_token`` bytes per block),
    then frees them (the request is *served*). If the puller disconnects first, the KV is
    released. ``POST /kv/{key}/release`` frees KV still waiting for its pull: a decode
    aborted before its pull sends it, as vLLM's decode tells its prefill.

    Aborting on connection close, as vLLM: a generation request whose client disconnects
    is cancelled at once; a prefill aborted before it answered releases what it staged;
    a decode aborted before its pull tells the prefill to release the KV.

    Faults come from the body's ``"fault"`` (see :class:`~trio_disagg.engines.FaultKind`),
    else from ``fault_plan``; a worker acts on the faults of its ``role``. Over HTTP:
    ``*_reject[:STATUS]`` answers that status; ``prefill_fail_before_handoff`` and
    ``prefill_fail_after_handoff`` answer 500 (after the handoff: the staged KV is
    released first); ``prefill_error_finish`` / ``prefill_cancelled_finish`` /
    ``eos_first_token`` answer ``finish_reason`` ``error`` / ``abort`` / ``stop`` with
    ``kv_transfer_params: null``; ``prefill_reset`` and ``decode_reset_at:K`` end the
    response half-way (the connection closes without a complete answer); ``*_stall``
    waits until the client disconnects; ``decode_fail_before_first_token`` releases the
    KV and fails; ``decode_error_at:K`` fails after K tokens.

    Args:
        role: ``"prefill"`` or ``"decode"``: which faults it acts on, and its name.
        name: the ``remote_engine_id`` of its handoffs; default ``"{role}@host:port"``
            once served.
        model: the only model name accepted (others get 404 as from vLLM); None accepts
            any, and ``/v1/models`` lists ``"mock-model"``.
        latency: the :class:`~trio_disagg.engines.LatencyModel`; default
            ``LatencyModel()``; :meth:`LatencyModel.zero` for benchmarks.
        seed: fixes the tokens (with the request id) and the prefix-cache hits.
        block_size: tokens per KV block.
        kv_ttl: seconds staged KV waits for its decode before it is stranded.
        kv_bytes_per_token: bytes of KV per prompt token moved by a pull.
        default_max_tokens: tokens to generate when the body names no budget.
        fault_plan: faults for requests whose body names none.
        http_client: the client for KV pulls and releases; :func:`serve_worker` provides
            one; else one is made on first use.
        max_body_bytes: the largest request body accepted (413 above).
        history: how many recent generation requests :attr:`seen` keeps.

    Raises:
        ValueError: a bad role or setting.
    """

    def __init__(
        self,
        role: Role,
        *,
        name: str | None = None,
        model: str | None = None,
        latency: LatencyModel | None = None,
        seed: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_ttl: float = DEFAULT_KV_TTL,
        kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
        default_max_tokens: int = 16,
        fault_plan: FaultPlan | None = None,
        http_client: httpx.AsyncClient | None = None,
        max_body_bytes: int = 4 * 1024 * 1024,
        history: int = 256,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        if kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
        if default_max_tokens < 0:
            raise ValueError(f"default_max_tokens must be >= 0, got {default_max_tokens}")
        self.role: Role = role
        self._named = name is not None
        self.name = name if name is not None else f"{role}-worker"
        self.model = model
        self.latency = latency if latency is not None else LatencyModel()
        self.seed = seed
        #: The worker's KV blocks (a prefill worker's staged KV).
        self.kv = KVBlockPool(self.name, block_size=block_size, ttl=kv_ttl)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.default_max_tokens = default_max_tokens
        self.fault_plan = fault_plan
        self.http_client = http_client
        self.max_body_bytes = max_body_bytes
        #: What it did (see :class:`WorkerStats`).
        self.stats = WorkerStats()
        #: The most recent generation requests received, oldest first.
        self.seen: deque[SeenRequest] = deque(maxlen=history)
        #: Where decode workers pull this worker's KV from (set by :meth:`advertise`).
        self.host = "127.0.0.1"
        self.port = 0
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self._created = int(time.time())

    def __repr__(self) -> str:
        return f"<MockVllmWorker {self.role} {self.name!r} at {self.host}:{self.port}>"

    def advertise(self, host: str, port: int) -> None:
        """Set the ``remote_host`` / ``remote_port`` put in handoffs (the worker's own
        address); an unnamed worker is named ``"{role}@host:port"``."""
        self.host = host
        self.port = port
        if not self._named:
            self.name = f"{self.role}@{host}:{port}"
            self.kv.name = self.name

    def _client(self) -> httpx.AsyncClient:
        if self.http_client is None:
            self.http_client = httpx.AsyncClient(timeout=PULL_TIMEOUT, trust_env=False)
        return self.http_client

    # --- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await _lifespan(receive, send)
            return
        if kind != "http":
            await trio.lowlevel.checkpoint()
            return
        method = scope["method"]
        path = scope["path"]
        try:
            if path in ("/v1/completions", "/v1/chat/completions"):
                if method != "POST":
                    await Exchange(send).error(f"Method {method} not allowed", 405)
                    return
                await self._generate(scope, receive, send, chat=path != "/v1/completions")
            elif path.startswith("/kv/"):
                await self._kv(scope, receive, send)
            elif path == "/v1/models" and method == "GET":
                await Exchange(send).respond(200, self._models())
            elif path == "/health" and method == "GET":
                await Exchange(send).respond(200, b"", b"text/plain")
            elif path == "/metrics" and method == "GET":
                await Exchange(send).respond(200, generate_latest(self.registry),
                                             CONTENT_TYPE_LATEST.encode())
            else:
                await Exchange(send).error(f"Not found: {method} {path}", 404)
        except Exception:  # a bug: log it; hypercorn closes the connection
            logger.exception("mock %s worker %s failed on %s %s", self.role, self.name,
                             method, path)
            raise

    def _models(self) -> bytes:
        model = self.model if self.model is not None else "mock-model"
        return orjson.dumps({"object": "list", "data": [{
            "id": model, "object": "model", "created": self._created, "owned_by": "vllm",
            "root": model, "parent": None, "max_model_len": 8192,
        }]})

    # --- generation ------------------------------------------------------------------------

    async def _generate(self, scope: Scope, receive: Receive, send: Send, *,
                        chat: bool) -> None:
        stats = self.stats
        stats.requests += 1
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        exchange = Exchange(send, request_id)
        try:
            data = await read_body(receive, self.max_body_bytes)
        except ValueError as exc:
            stats.failed += 1
            await exchange.error(str(exc), 413)
            return
        if data is None:
            stats.aborted += 1
            return
        body, problem, status = self._parse(data, chat)
        if body is None:
            stats.failed += 1
            await exchange.error(problem, status)
            return
        self.seen.append(SeenRequest(path=scope["path"], request_id=request_id, body=body))
        try:
            fault = fault_for(body, self.role, request_id, self.fault_plan)
        except ValueError as exc:
            stats.failed += 1
            await exchange.error(str(exc), 400)
            return
        if fault is not None and fault.kind in _REJECTS:
            stats.failed += 1
            await exchange.error(f"{self.name} refused request {request_id!r} (injected fault "
                                 f"{fault})", fault.status or 503)
            return
        params = body.get("kv_transfer_params")
        params = params if isinstance(params, Mapping) else {}
        if params.get("do_remote_decode") is True:
            work = partial(self._prefill, exchange, body, chat, fault)
        else:
            remote = params if params.get("do_remote_prefill") is True else None
            work = partial(self._decode, exchange, body, chat, fault, remote)
        stats.running += 1
        try:
            await run_until_disconnect(receive, exchange, work)
        finally:
            stats.running -= 1
            if exchange.disconnected:
                stats.aborted += 1
            elif exchange.failed:
                stats.failed += 1
            elif exchange.finished:
                stats.completed += 1

    def _parse(self, data: bytes, chat: bool) -> tuple[dict[str, Any] | None, str, int]:
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            return None, f"malformed JSON: {exc}", 400
        if not isinstance(body, dict):
            return None, "the request body must be a JSON object", 400
        if chat and not isinstance(body.get("messages"), list):
            return None, "'messages' is required and must be a list", 400
        if not chat and "prompt" not in body:
            return None, "'prompt' is required", 400
        if self.model is not None and body.get("model") != self.model:
            return None, f"The model `{body.get('model')}` does not exist.", 404
        return body, "", 200

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _answer(self, exchange: Exchange, body: Mapping[str, Any], *, chat: bool, text: str,
                token_ids: list[int], finish: str, usage: dict[str, Any],
                kv_transfer_params: Any = None) -> bytes:
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        choice["stop_reason"] = None
        if body.get("return_token_ids") is True:
            choice["token_ids"] = token_ids
        return orjson.dumps({
            "id": ("chatcmpl-" if chat else "cmpl-") + (exchange.request_id or ""),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [choice],
            "usage": usage,
            "kv_transfer_params": kv_transfer_params,
        })

    async def _prefill(self, exchange: Exchange, body: Mapping[str, Any], chat: bool,
                       fault: Fault | None) -> None:
        """A prefill request (``do_remote_decode``): stage the KV and answer the handoff."""
        kind = fault.kind if fault is not None else None
        request_id = exchange.request_id or ""
        prompt_tokens = count_prompt_tokens(body)
        kv = self.kv
        entry = None
        answered = False
        try:
            if kind is FaultKind.PREFILL_STALL:
                await trio.sleep_forever()
            if (delay := self.latency.time_to_first_token(prompt_tokens)) > 0:
                await trio.sleep(delay)
            if kind is FaultKind.PREFILL_RESET:
                answered = True
                exchange.failed = True
                await exchange.start(200, JSON_TYPE)
                await exchange.body(b'{"id":"cmpl-')  # then the connection closes
                return
            if kind is FaultKind.PREFILL_FAIL_BEFORE_HANDOFF:
                answered = True
                await self._fail(exchange, f"{self.name}: injected fault {kind.value} on "
                                           f"request {request_id!r}")
                return
            cached = cached_prompt_tokens(self.seed, body, prompt_tokens, kv.block_size)
            token = TokenStream(self.seed, request_id).next_id()
            if kind in _PREFILL_FIRST_FINISH:
                assert kind is not None
                answered = True
                eos = kind is FaultKind.EOS_FIRST_TOKEN
                await exchange.respond(200, self._answer(
                    exchange, body, chat=chat, text=WORDS[token] if eos else "",
                    token_ids=[token] if eos else [], finish=_PREFILL_FIRST_FINISH[kind],
                    usage=self._usage(prompt_tokens, 1 if eos else 0, cached)))
                return
            entry = kv.stage(request_id, prompt_tokens)
            if kind is FaultKind.PREFILL_FAIL_AFTER_HANDOFF:
                kv.release(entry)  # the request failed: the worker frees its KV
                answered = True
                await self._fail(exchange, f"{self.name}: injected fault {kind.value} on "
                                           f"request {request_id!r} (after staging its KV)")
                return
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": list(entry.block_ids),
                "remote_engine_id": self.name,
                "remote_request_id": entry.key,
                "remote_host": self.host,
                "remote_port": self.port,
                "tp_size": 1,
            }
            payload = self._answer(exchange, body, chat=chat, text=WORDS[token],
                                   token_ids=[token], finish="length",
                                   usage=self._usage(prompt_tokens, 1, cached),
                                   kv_transfer_params=params)
            await exchange.respond(200, payload)
            answered = True
        finally:
            # Aborted (the connection closed) before the answer went out: count one abort,
            # releasing what was staged.
            if not answered and (entry is None or not kv.release(entry)):
                kv.note_aborted()

    async def _decode(self, exchange: Exchange, body: Mapping[str, Any], chat: bool,
                      fault: Fault | None, params: Mapping[str, Any] | None) -> None:
        """A decode request (pull the KV first) or a plain one (compute it here)."""
        kind = fault.kind if fault is not None else None
        fault_at = fault.at if fault is not None and fault.at is not None else -1
        request_id = exchange.request_id or ""
        stream = body.get("stream") is True
        options = body.get("stream_options")
        include_usage = stream and isinstance(options, Mapping) and (
            options.get("include_usage") is True)
        prompt_tokens = count_prompt_tokens(body)
        max_tokens = resolve_max_tokens(None, body, self.default_max_tokens)
        remote = _RemoteKV.parse(params) if params is not None else None
        pending = isinstance(remote, _RemoteKV)  # KV we may still have to release
        try:
            if stream:
                await exchange.start_stream()  # accepted: headers now, as vLLM sends them
            if isinstance(remote, str):
                await self._fail(exchange, f"{self.name}: {remote}")
                return
            if kind is FaultKind.DECODE_STALL:
                await trio.sleep_forever()  # queued: the KV waits, unpulled
            if kind is FaultKind.DECODE_FAIL_BEFORE_FIRST_TOKEN:
                if remote is not None:
                    pending = False
                    with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
                        await self._release(remote, request_id)
                await self._fail(exchange, f"{self.name}: injected fault {kind.value} on "
                                           f"request {request_id!r}")
                return
            eos_first = False
            if remote is not None:
                error = await self._pull(remote, request_id)
                pending = False
                if error is not None:
                    await self._fail(exchange, f"{self.name}: {error}")
                    return
                cached = prompt_tokens  # the decode sees the whole prompt cached
            else:
                if (delay := self.latency.time_to_first_token(prompt_tokens)) > 0:
                    await trio.sleep(delay)
                cached = cached_prompt_tokens(self.seed, body, prompt_tokens,
                                              self.kv.block_size)
                if kind is FaultKind.EOS_FIRST_TOKEN and max_tokens > 0:
                    max_tokens, eos_first = 1, True
            await self._tokens(exchange, body, chat=chat, stream=stream,
                               include_usage=include_usage, max_tokens=max_tokens,
                               eos_first=eos_first, fault_kind=kind, fault_at=fault_at,
                               usage=lambda n: self._usage(prompt_tokens, n, cached))
        finally:
            if pending:  # aborted before the pull: tell the prefill to free the KV
                assert isinstance(remote, _RemoteKV)
                with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
                    await self._release(remote, request_id)

    async def _tokens(self, exchange: Exchange, body: Mapping[str, Any], *, chat: bool,
                      stream: bool, include_usage: bool, max_tokens: int, eos_first: bool,
                      fault_kind: FaultKind | None, fault_at: int,
                      usage: Callable[[int], dict[str, Any]]) -> None:
        request_id = exchange.request_id or ""
        tokens = TokenStream(self.seed, request_id)
        itl = self.latency.inter_token_latency
        with_ids = body.get("return_token_ids") is True
        texts: list[str] = []
        ids: list[int] = []
        encoder = _ChunkEncoder(chat, ("chatcmpl-" if chat else "cmpl-") + request_id,
                                body.get("model"), with_ids)
        parts: list[bytes] = []
        if stream and chat:
            parts.append(encoder.role())
        for i in range(max_tokens):
            if i == fault_at:
                if parts:
                    await exchange.body(b"".join(parts))
                await self._fault_at(exchange, fault_kind, request_id, stream, texts)
                return
            if itl > 0:
                await trio.sleep(itl)
            token = tokens.next_id()
            last = i == max_tokens - 1
            finish = ("stop" if eos_first else "length") if last else None
            if stream:
                parts.append(encoder.token(WORDS[token], token, finish))
                if itl > 0 or len(parts) >= _BATCH:
                    await exchange.body(b"".join(parts))
                    parts = []
            else:
                texts.append(WORDS[token])
                ids.append(token)
        if not stream:
            await exchange.respond(200, self._answer(
                exchange, body, chat=chat, text="".join(texts), token_ids=ids,
                finish="stop" if eos_first and max_tokens else "length",
                usage=usage(max_tokens)))
            return
        if max_tokens == 0:
            parts.append(encoder.token("", None, "length"))
        if include_usage:
            parts.append(encoder.usage(usage(max_tokens)))
        parts.append(DONE_EVENT)
        await exchange.finish(b"".join(parts))

    async def _fault_at(self, exchange: Exchange, kind: FaultKind | None, request_id: str,
                        stream: bool, texts: list[str]) -> None:
        if kind is FaultKind.DECODE_ERROR_AT:
            await self._fail(exchange, f"{self.name}: injected fault {kind.value} on request "
                                       f"{request_id!r}")
        elif kind is FaultKind.DECODE_STALL_AT:
            await trio.sleep_forever()
        else:  # DECODE_RESET_AT: the connection closes with the answer half-way
            exchange.failed = True
            if not stream:
                await exchange.start(200, JSON_TYPE)
                await exchange.body(b'{"id":"cmpl-')

    async def _fail(self, exchange: Exchange, message: str) -> None:
        exchange.failed = True
        await exchange.error(message, 500)

    # --- the KV pull, decode side ------------------------------------------------------------

    async def _pull(self, remote: _RemoteKV, request_id: str) -> str | None:
        """Pull the KV from the prefill worker and check every byte.

        Returns:
            None once pulled, else why it failed. Cancellation closes the pull's
            connection: the prefill then releases the KV.
        """
        size = self.kv.block_size * self.kv_bytes_per_token
        try:
            response = await self._client().get(
                remote.url(), headers={b"x-request-id": request_id.encode("latin-1")},
                timeout=PULL_TIMEOUT)
        except httpx.HTTPError as exc:
            self.stats.kv_pull_failures += 1
            return f"KV pull from {remote.host}:{remote.port} failed: {type(exc).__name__}: {exc}"
        if response.status_code != 200:
            self.stats.kv_pull_failures += 1
            try:
                message = orjson.loads(response.content)["error"]["message"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                message = response.text[:200]
            return (f"KV pull from {remote.host}:{remote.port} answered "
                    f"{response.status_code}: {message}")
        expected = b"".join(kv_block_bytes(remote.engine_id, remote.key, block, size)
                            for block in remote.block_ids)
        if response.content != expected:
            self.stats.kv_pull_failures += 1
            return (f"KV pull from {remote.host}:{remote.port} was corrupt: "
                    f"{len(response.content)} bytes, expected {len(expected)}")
        self.stats.kv_pulls += 1
        return None

    async def _release(self, remote: _RemoteKV, request_id: str) -> None:
        """Tell the prefill worker to free KV this decode will never pull (bounded by the
        caller's shielded scope)."""
        self.stats.kv_releases += 1
        try:
            await self._client().post(remote.url("/release"),
                                      headers={b"x-request-id": request_id.encode("latin-1")},
                                      timeout=RELEASE_TIMEOUT)
        except httpx.HTTPError as exc:
            logger.warning("%s could not release KV %r on %s:%d: %r", self.name, remote.key,
                           remote.host, remote.port, exc)

    # --- the KV pull, prefill side -----------------------------------------------------------

    async def _kv(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = bytes(scope.get("raw_path") or scope["path"].encode()).partition(b"?")[0]
        rest = raw[len(b"/kv/"):]
        method = scope["method"]
        exchange = Exchange(send, _header(scope, b"x-request-id"))
        if rest.endswith(b"/release") and method == "POST":
            key = unquote_to_bytes(rest[:-len(b"/release")]).decode("utf-8", "replace")
            released = self.kv.release_key(key)
            await exchange.respond(200, orjson.dumps({"released": released}))
            return
        if method != "GET" or b"/" in rest:
            await exchange.error(f"Not found: {method} {scope['path']}", 404)
            return
        key = unquote_to_bytes(rest).decode("utf-8", "replace")
        try:
            entry = self.kv.claim(key)
        except KVTransferError as exc:
            await exchange.error(str(exc), 404)
            return
        size = self.kv.block_size * self.kv_bytes_per_token
        done = False

        async def transfer() -> None:
            nonlocal done
            if (delay := self.latency.kv_transfer_time(entry.num_tokens)) > 0:
                await trio.sleep(delay)
            data = b"".join(kv_block_bytes(self.name, entry.key, block, size)
                            for block in entry.block_ids)
            await exchange.start(200, _OCTETS, length=len(data))
            chunks = [data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
            for chunk in chunks[:-1]:
                await exchange.body(chunk)
            await exchange.finish(chunks[-1])
            self.kv.complete(entry)
            self.stats.kv_transfers += 1
            done = True

        try:
            await run_until_disconnect(receive, exchange, transfer)
        finally:
            if not done:
                self.kv.release(entry)  # the puller went away: free the blocks


class _ChunkEncoder:
    """The server-sent events of one streamed answer, OpenAI chunk format."""

    __slots__ = ("_chat", "_head", "_ids", "_usage_head")

    def __init__(self, chat: bool, response_id: str, model: Any, with_ids: bool) -> None:
        kind = b"chat.completion.chunk" if chat else b"text_completion"
        head = (b'data: {"id":' + orjson.dumps(response_id) + b',"object":"' + kind
                + b'","created":' + str(int(time.time())).encode() + b',"model":'
                + orjson.dumps(model))
        self._chat = chat
        self._head = head + b',"choices":[{"index":0,'
        self._usage_head = head + b',"choices":[],"usage":'
        self._ids = with_ids

    def role(self) -> bytes:
        return (self._head + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
                b'"finish_reason":null}]}\n\n')

    def token(self, text: str, token: int | None, finish: str | None) -> bytes:
        if self._chat:
            body = b'"delta":{"content":' + orjson.dumps(text) + b"}"
        else:
            body = b'"text":' + orjson.dumps(text)
        if self._ids:
            body += b',"token_ids":' + (b"[]" if token is None else b"[%d]" % token)
        return (self._head + body + b',"logprobs":null,"finish_reason":'
                + orjson.dumps(finish) + b',"stop_reason":null}]}\n\n')

    def usage(self, usage: dict[str, Any]) -> bytes:
        return self._usage_head + orjson.dumps(usage) + b"}\n\n"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            text = bytes(value).decode("latin-1").strip()
            return text or None
    return None


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return

