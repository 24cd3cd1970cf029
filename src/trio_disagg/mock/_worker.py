"""What the mock HTTP workers share (docs/protocols.md section 5): the ASGI routing of a
worker, generation requests (body checks, faults, abort on close, counters), the decode on
the simulator's core, and the KV pull's prefill side (``GET /kv/{key}``).

Each protocol (:mod:`._vllm`, :mod:`._sglang`, :mod:`._trtllm`) subclasses
:class:`MockWorker` and says how one generation request is served (:meth:`MockWorker._work`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import attrs
import orjson
import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.exposition import generate_latest

from .._asgi import JSON_TYPE, BodyTooLarge, Receive, Scope, Send, header, lifespan, read_body
from ..engines import Client, HttpxWorkerClient, WorkerClient
from ._answers import REASONING_HOOK, AnswerFormat, OpenAIFormat, choice_shape
from ._asgi import Exchange, Refusal, run_until_disconnect
from ._auth import UNAUTHORIZED, api_key_of
from ._core import RELEASE_TIMEOUT, Decode, Prefill, PrefillSink
from ._faults import Fault, FaultKind, FaultPlan, fault_for
from ._kv import DEFAULT_BLOCK_SIZE, DEFAULT_KV_TTL, KVBlockPool
from ._kvwire import DEFAULT_KV_BYTES_PER_TOKEN, KVSource, kv_client, serve_kv
from ._latency import LatencyModel
from ._metrics import WorkerCollector
from ._options import SeenRequest, WorkerStats
from ._prefix import DEFAULT_PREFIX_CACHE_BLOCKS, PrefixCache
from ._sinks import Bound, DecodeSink
from ._text import count_prompt_tokens, resolve_max_tokens
from ._wire_faults import MockFault, MockFaultKind, split_mock_faults

logger = logging.getLogger("trio_disagg.workers")

Role = Literal["prefill", "decode"]  #: A mock worker's role: what requests it serves.
Work = Callable[[], Awaitable[None]]

#: The OpenAI generation endpoints every mock worker serves.
OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

_BATCH = 32  # SSE chunks per write when there is no inter-token latency
REJECTS = frozenset({FaultKind.PREFILL_REJECT, FaultKind.DECODE_REJECT})


# --- the worker ----------------------------------------------------------------------------


class MockWorker:
    """The base of the mock workers: an ASGI 3 application (prefill or decode).

    Endpoints: the protocol's generation endpoints (``POST /v1/completions`` and
    ``POST /v1/chat/completions`` at least), ``GET /kv/{key}`` and
    ``POST /kv/{key}/release`` (the KV pull between mock workers), ``GET /v1/models``,
    ``GET /health``, and ``GET /metrics`` (Prometheus text, a registry per worker: held,
    stranded and freed KV blocks; served, aborted and expired requests; requests
    received, running, completed, failed, aborted). Not from the real workers:
    ``GET /stats``, JSON for tests and benchmarks, ``{"stats": {...}, "aborts":
    [{"request_id", "at"}, ...]}``: :attr:`stats` and :attr:`aborts`.

    A generation request is read, checked (400 for malformed JSON or missing fields, 404
    for another model than ``model``, 400 for an ``X-Request-Id`` already running, as
    vLLM), recorded in :attr:`seen`, given its fault (the
    body's ``"fault"`` if the worker was made with ``fault_injection``, else
    ``fault_plan``; ``*_reject[:STATUS]`` answers that status),
    then served by the protocol's :meth:`_work`, cancelled at once if the client closes
    the connection (abort on close, as vLLM and SGLang do).

    KV pull protocol (between mock workers): ``GET /kv/{key}`` claims the KV staged under
    ``key`` (404 if it is gone: expired, pulled, released, never staged), waits
    ``latency.kv_transfer_time(prompt tokens)`` seconds, and sends the blocks' bytes
    (:func:`kv_block_bytes`, ``block_size * kv_bytes_per_token`` bytes per block), then
    frees them (the request is *served*). If the puller disconnects first, the KV is
    released. ``POST /kv/{key}/release`` frees KV still waiting for its pull.

    Its arguments are those of :class:`MockVllmWorker`, which every protocol takes
    (:class:`MockSglangWorker` adds ``bootstrap_port`` and ``bootstrap_timeout``); make
    one with :func:`create_mock_worker` and serve it with :func:`serve_worker`. A bad
    role or setting raises :class:`ValueError`.
    """

    #: The protocol's name (``"vllm"``, ``"sglang"``, ``"trtllm"``).
    protocol: ClassVar[str] = "mock"
    #: ``owned_by`` in ``/v1/models``.
    owned_by: ClassVar[str] = "mock"
    #: The context length ``/v1/models`` reports (vLLM's ``max_model_len``); a worker may
    #: be given its own.
    max_model_len: int = 8192
    #: Errors as ``{"object": "error", ...}`` (SGLang, TRT-LLM) rather than
    #: ``{"error": {...}}`` (vLLM).
    flat_errors: ClassVar[bool] = False
    #: Whether a decode request aborted before its KV pull tells the prefill side to free
    #: the KV (vLLM, SGLang); TRT-LLM's generation server does not: the context's KV
    #: waits for its transfer timeout.
    releases_unpulled_kv: ClassVar[bool] = True
    #: Whether the real worker can be started with an API key (vLLM, SGLang: ``--api-key``).
    takes_api_key: ClassVar[bool] = True
    #: The fields the real worker's whole chat answer carries in its ``message`` even when
    #: it generated nothing for them (vLLM's and TensorRT-LLM's ``tool_calls: []``).
    whole_message: ClassVar[Mapping[str, Any]] = MappingProxyType({})

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
        fault_injection: bool = False,
        http_client: Client | None = None,
        max_body_bytes: int = 4 * 1024 * 1024,
        history: int = 256,
        prefix_cache_blocks: int = DEFAULT_PREFIX_CACHE_BLOCKS,
        api_key: str | None = None,
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
        self.model, self.seed = model, seed
        self.latency = latency if latency is not None else LatencyModel()
        #: The worker's KV blocks (a prefill worker's staged KV).
        self.kv = KVBlockPool(self.name, block_size=block_size, ttl=kv_ttl)
        #: The worker's prefix cache: the prompt prefixes it computed, by block.
        self.prefix = PrefixCache(block_size, prefix_cache_blocks)
        self.kv_bytes_per_token, self.default_max_tokens = kv_bytes_per_token, default_max_tokens
        self.fault_plan = fault_plan
        #: Whether a request body's ``"fault"`` is honoured (else ignored).
        self.fault_injection = fault_injection
        self.http_client, self.max_body_bytes = http_client, max_body_bytes
        self.api_key = api_key_of(api_key, self.protocol, self.takes_api_key)
        #: What it did (see :class:`WorkerStats`).
        self.stats = WorkerStats()
        #: The most recent generation requests received, oldest first.
        self.seen: deque[SeenRequest] = deque(maxlen=history)
        #: The most recent aborts, oldest first: ``(X-Request-Id, time.monotonic())`` as
        #: each aborted request (its connection closed first) finished its cleanup. On
        #: Linux ``time.monotonic()`` is ``CLOCK_MONOTONIC``, one clock for every process
        #: of the host, so a client can compare its own stamps with these (benchmark P5).
        self.aborts: deque[tuple[str, float]] = deque(maxlen=history)
        #: The ``X-Request-Id`` of each generation request running now: a second one is
        #: refused (400), as vLLM refuses a request whose id is already running.
        self.running_ids: set[str] = set()
        #: Where decode workers pull this worker's KV from (set by :meth:`advertise`).
        self.host = "127.0.0.1"
        self.port = 0
        self.registry = CollectorRegistry()
        self.registry.register(WorkerCollector(self))
        self._created = int(time.time())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.role} {self.name!r} at {self.host}:{self.port}>"

    @property
    def extra_listen_port(self) -> int | None:
        """The port of a second listener the worker wants (SGLang's bootstrap port), 0 for
        any free one, or None; :func:`~trio_disagg.mock.serve_worker` binds it."""
        return None

    def advertise(self, host: str, port: int, extra_port: int | None = None) -> None:
        """Set the worker's own address, put in the handoffs it answers (``extra_port``:
        the bound port of :attr:`extra_listen_port`); an unnamed worker is named
        ``"{role}@host:port"``. :func:`serve_worker` calls it once listening; call it
        yourself when serving the app another way.

        Args:
            host: the host decode workers reach this worker at (not a wildcard address).
            port: its bound HTTP port.
            extra_port: the bound port of its second listener, if it has one.
        """
        self.host = host
        self.port = port
        if not self._named:
            self.name = f"{self.role}@{host}:{port}"
            self.kv.name = self.name

    def client(self) -> WorkerClient | HttpxWorkerClient:
        """The HTTP client of the worker's KV pulls and releases: ``http_client``, else
        a :class:`~trio_disagg.engines.WorkerClient` made on first use, which is then the
        caller's to close (``await app.http_client.aclose()``). :func:`serve_worker`
        provides one and closes it, so an app it serves never makes its own."""
        client = self.http_client
        if client is None:
            client = self.http_client = kv_client()
        return client if isinstance(client, WorkerClient) else HttpxWorkerClient(client)

    def extra_gauges(self) -> list[tuple[str, str, float]]:
        """More ``(name, doc, value)`` gauges for ``/metrics``."""
        return []

    def exchange(self, send: Send, request_id: str | None = None) -> Exchange:
        return Exchange(send, request_id, flat=self.flat_errors)

    # --- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await lifespan(receive, send)
            return
        if kind != "http":
            await trio.lowlevel.checkpoint()
            return
        method = scope["method"]
        path = scope["path"]
        if (self.api_key is not None and method != "OPTIONS" and self.protects(scope)
                and not self.api_key.admits(scope)):
            await self.exchange(send).respond(401, UNAUTHORIZED)
            return
        try:
            await self._route(scope, receive, send)
        except Exception:  # a bug: log it; hypercorn closes the connection
            logger.exception("mock %s %s worker %s failed on %s %s", self.protocol, self.role,
                             self.name, method, path)
            raise

    def generation_paths(self) -> frozenset[str]:
        """The paths of generation requests."""
        return OPENAI_PATHS

    def protects(self, scope: Scope) -> bool:
        """Whether a request needs the worker's API key, if it has one: vLLM's ``/v1/*``
        (``/health`` and ``/metrics`` stay open, and the mock's own ``/kv/`` and
        ``/stats``, which stand for no HTTP endpoint of the real worker)."""
        return str(scope["path"]).startswith("/v1")

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        path = scope["path"]
        if path in self.generation_paths():
            if method != "POST":
                await self.exchange(send).error(f"Method {method} not allowed", 405)
                return
            await self._generate(scope, receive, send)
        elif path.startswith("/kv/"):
            await serve_kv(self, scope, receive, send)
        elif path == "/v1/models" and method == "GET":
            await self.exchange(send).respond(200, self._models())
        elif path == "/health" and method == "GET":
            await self.exchange(send).respond(200, b"", b"text/plain")
        elif path == "/metrics" and method == "GET":
            await self.exchange(send).respond(200, generate_latest(self.registry),
                                              CONTENT_TYPE_LATEST.encode())
        elif path == "/stats" and method == "GET":
            await self.exchange(send).respond(200, self._stats_json())
        else:
            await self.exchange(send).error(f"Not found: {method} {path}", 404)

    def _stats_json(self) -> bytes:
        return orjson.dumps({
            "stats": attrs.asdict(self.stats),
            "kv": attrs.asdict(self.kv.counters()),
            "aborts": [{"request_id": rid, "at": at} for rid, at in self.aborts],
        })

    def _note_abort(self, request_id: str) -> None:
        self.stats.aborted += 1
        self.aborts.append((request_id, time.monotonic()))

    def _models(self) -> bytes:
        model = self.model if self.model is not None else "mock-model"
        return orjson.dumps({"object": "list", "data": [{
            "id": model, "object": "model", "created": self._created,
            "owned_by": self.owned_by, "root": model, "parent": None,
            "max_model_len": self.max_model_len,
        }]})

    # --- generation ------------------------------------------------------------------------

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.stats.requests += 1
        self.stats.open += 1
        try:
            await self._generate_open(scope, receive, send)
        finally:
            self.stats.open -= 1

    async def _generate_open(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = self.stats
        path = scope["path"]
        request_id = header(scope, b"x-request-id", strip=True) or uuid.uuid4().hex
        exchange = self.exchange(send, request_id)
        try:
            data = await read_body(receive, self.max_body_bytes)
        except BodyTooLarge as exc:
            stats.failed += 1
            await exchange.error(str(exc), 413)
            return
        if data is None:
            self._note_abort(request_id)
            return
        body, problem, status = self._parse(data, path)
        if body is None:
            stats.failed += 1
            await exchange.error(problem, status)
            return
        self.seen.append(SeenRequest(path=path, request_id=request_id, body=body))
        if "fault" in body and not self.fault_injection:
            # A client may not break the worker: only a worker started with fault
            # injection honours a body's faults.
            body = {key: value for key, value in body.items() if key != "fault"}
        try:
            mock, fault_body = split_mock_faults(body, self.role)
            fault = fault_for(fault_body, self.role, request_id, self.fault_plan)
            if mock is not None and fault is not None and fault.role == mock.role:
                raise ValueError(f"at most one {mock.role} fault per request; got "
                                 f"{fault} and {mock.kind.value}")
            if fault is not None and fault.kind in REJECTS:
                raise Refusal(fault.status or 503, f"{self.name} refused request "
                              f"{request_id!r} (injected fault {fault})", fault.retry_after)
            if request_id in self.running_ids:  # vLLM's AsyncLLM.add_request: a 400
                raise ValueError(f"Request id {request_id} already running.")
            work = self._work(exchange, body, path, fault, mock)
        except ValueError as exc:
            stats.failed += 1
            await exchange.error(str(exc), 400)
            return
        except Refusal as refusal:
            stats.failed += 1
            wait = refusal.retry_after
            await exchange.error(refusal.message, refusal.status, extra=[] if wait is None
                                 else [(b"retry-after", str(wait).encode())])
            return
        stats.running += 1
        self.running_ids.add(request_id)
        try:
            await run_until_disconnect(receive, exchange, work)
        finally:
            self.running_ids.discard(request_id)
            stats.running -= 1
            if exchange.disconnected:
                self._note_abort(request_id)
            elif exchange.failed:
                stats.failed += 1
            elif exchange.finished:
                stats.completed += 1

    def _work(self, exchange: Exchange, body: dict[str, Any], path: str,
              fault: Fault | None, mock: MockFault | None = None) -> Work:
        """How to serve one generation request (run until done or the client goes away);
        ``mock``: its mock-only fault (:mod:`._faults`), for this worker's role.

        Raises:
            Refusal: answer with that status instead.
            ValueError: answer 400 with the message.
        """
        raise NotImplementedError

    def _parse(self, data: bytes, path: str) -> tuple[dict[str, Any] | None, str, int]:
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            return None, f"malformed JSON: {exc}", 400
        if not isinstance(body, dict):
            return None, "the request body must be a JSON object", 400
        problem = self._check_body(body, path)
        if problem is not None:
            return None, problem[1], problem[0]
        return body, "", 200

    def _check_body(self, body: dict[str, Any], path: str) -> tuple[int, str] | None:
        """``(status, message)`` if the body cannot be served, else None."""
        if path == "/v1/chat/completions" and not isinstance(body.get("messages"), list):
            return 400, "'messages' is required and must be a list"
        if path == "/v1/completions" and "prompt" not in body:
            return 400, "'prompt' is required"
        if self.model is not None and body.get("model") != self.model:
            return 404, f"The model `{body.get('model')}` does not exist."
        hook = body.get(REASONING_HOOK)
        if hook is not None and (type(hook) is not int or hook < 0):
            return 400, f"'{REASONING_HOOK}' must be a non-negative integer, got {hook!r:.40}"
        return None

    def _max_tokens(self, body: Mapping[str, Any]) -> int:
        """The completion budget of a body, in tokens."""
        return resolve_max_tokens(None, body, self.default_max_tokens)

    def _min_tokens(self, body: Mapping[str, Any]) -> int:
        """The tokens a body asks before EOS may end it (``min_tokens``), at least 0."""
        value = body.get("min_tokens")
        return value if type(value) is int and value > 0 else 0

    def ends_on_first_token(self, body: Mapping[str, Any], fault: Fault | None) -> bool:
        """Whether a prefill's first token ends the request on EOS (``eos_first_token``):
        not when the body asks ``min_tokens >= 1`` (EOS may not come before them)."""
        return (fault is not None and fault.kind is FaultKind.EOS_FIRST_TOKEN
                and self._min_tokens(body) == 0)

    def openai_format(self, exchange: Exchange, body: Mapping[str, Any], path: str,
                      top: Mapping[str, Any] | None = None, *, sglang: bool = False,
                      prompt_ids: list[int] | None = None) -> OpenAIFormat:
        chat = path == "/v1/chat/completions"
        request_id = exchange.request_id or ""
        shape = choice_shape(body, chat=chat, decode=self.role == "decode",
                             request_id=request_id)
        return OpenAIFormat(
            chat=chat, response_id=("chatcmpl-" if chat else "cmpl-") + request_id,
            model=body.get("model"), with_ids=body.get("return_token_ids") is True, top=top,
            shape=shape, seed=self.seed, request_id=request_id, sglang=sglang,
            prompt_ids=prompt_ids, whole_message=self.whole_message)

    async def _decode(self, exchange: Exchange, body: Mapping[str, Any], fmt: AnswerFormat,
                      fault: Fault | None, source: KVSource | str | None, *,
                      include_usage: bool, eos_with_handoff: bool = False,
                      mock: MockFault | None = None) -> None:
        """A decode request on the simulator's core (:class:`~._core.Decode`): pull the KV
        from ``source`` first (a string: why the handoff cannot be used, a decode error),
        or with no source compute the prefill here; then generate.

        A streamed answer's headers go out at once (the request was accepted). A failed
        pull is a decode error: an error event and ``[DONE]`` in a stream, a 500 answer
        otherwise. KV not pulled (aborted, failed before the first token) is released.
        ``eos_with_handoff``: honour ``eos_first_token`` after a handoff too (SGLang's
        decode receives the prefill's first token with the KV). ``eos_first_token``
        ends the tokens on EOS after ``min_tokens`` of them (the first with none), as a
        stop; past the budget it is a ``length`` finish as usual. ``mock``:
        ``decode_kv_lost`` lets go of the KV and answers 500 before any byte;
        ``decode_queue:SECONDS`` waits that long, accepted, before the pull;
        ``decode_accept_delay:SECONDS`` waits that long before accepting. A worker
        that does not :attr:`releases_unpulled_kv` leaves KV it never pulled to the
        prefill side's lease.
        """
        request_id = exchange.request_id or ""
        mock_kind = mock.kind if mock is not None else None
        if mock is not None and mock_kind is MockFaultKind.DECODE_ACCEPT_DELAY:
            # not accepted yet, its handoff not looked at: aborted now, it lets go of nothing
            await trio.sleep(mock.seconds)
        bound = Bound(source, self, request_id) if isinstance(source, KVSource) else None
        if mock_kind is MockFaultKind.DECODE_KV_LOST and bound is not None:
            self.stats.kv_pull_failures += 1  # the failed transfer lets go of the KV
            with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
                await bound.release()
            await self._fail(exchange, f"KV transfer failed: {self.name} lost the KV of "
                                       f"request {request_id!r} from {bound.source.where} "
                                       f"(injected fault {MockFaultKind.DECODE_KV_LOST.value})")
            return
        run = Decode(
            worker=self.name, request_id=request_id, seed=self.seed, latency=self.latency,
            body=body, prompt_tokens=count_prompt_tokens(body),
            max_tokens=self._max_tokens(body), fault=fault, min_tokens=self._min_tokens(body),
            eos_with_handoff=eos_with_handoff, release_unpulled=self.releases_unpulled_kv,
            prefix=self.prefix,
            queue_seconds=(mock.seconds if mock is not None
                           and mock_kind is MockFaultKind.DECODE_QUEUE else None))
        sink = DecodeSink(self, exchange, fmt, run, stream=body.get("stream") is True,
                           include_usage=include_usage)
        await run.run(bound if bound is not None else source
                      if isinstance(source, str) else None, sink)

    async def _run_prefill(self, run: Prefill, sink: PrefillSink) -> None:
        """A prefill request on the simulator's core (:class:`~._core.Prefill`), counted
        in :attr:`stats`."""
        try:
            await run.run(sink)
        finally:
            if not run.computed and not run.answered:
                self.stats.prefills_aborted += 1

    def prefill_run(self, exchange: Exchange, body: Mapping[str, Any],
                    fault: Fault | None) -> Prefill:
        """The core's :class:`~._core.Prefill` for one prefill request."""
        return Prefill(worker=self.name, request_id=exchange.request_id or "", seed=self.seed,
                       latency=self.latency, pool=self.kv, body=body,
                       prompt_tokens=count_prompt_tokens(body), fault=fault,
                       min_tokens=self._min_tokens(body), prefix=self.prefix)

    async def _reset(self, exchange: Exchange, stream: bool) -> None:
        """End the response half-way: the connection closes without a complete answer."""
        exchange.failed = True
        if not exchange.started:
            await exchange.start(200, JSON_TYPE)
        if not stream:
            await exchange.body(b'{"id":"cmpl-')
        else:
            await trio.lowlevel.checkpoint()

    async def _fail(self, exchange: Exchange, message: str) -> None:
        exchange.failed = True
        await exchange.error(message, 500)
