"""A mock SGLang worker over HTTP: prefill or decode, meeting in bootstrap rooms
(docs/protocols.md sections 3 and 5).

The router sends the same body, with ``bootstrap_host``, ``bootstrap_port`` and
``bootstrap_room``, to a prefill worker and a decode worker at the same time. The prefill
worker listens on a second port, its *bootstrap port*, for decode workers; the decode
worker joins the room there over loopback and receives the KV; either may arrive first,
and each side waits at most ``bootstrap_timeout`` seconds (SGLang's 300 s by default) for
the other.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, ClassVar
from urllib.parse import quote, unquote

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client, on trio natively)
import orjson
import trio

from .._protocols import DEFAULT_BOOTSTRAP_PORT
from ._asgi import DONE_EVENT, Exchange, Receive, Scope, Send, run_until_disconnect
from ._faults import Fault, FaultKind, FaultPlan
from ._kv import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BOOTSTRAP_TIMEOUT,
    DEFAULT_KV_TTL,
    BootstrapRoom,
    KVState,
    KVTransferError,
    StagedKV,
)
from ._latency import LatencyModel
from ._text import (
    WORDS,
    TokenStream,
    cached_prompt_tokens,
    count_prompt_tokens,
    resolve_max_tokens,
)
from ._wire_faults import MockFault
from ._worker import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    OPENAI_PATHS,
    PULL_TIMEOUT,
    RELEASE_TIMEOUT,
    AnswerFormat,
    KVSource,
    MockWorker,
    Refusal,
    Role,
    Work,
    answer_message,
    header,
    kv_bytes,
    logger,
    query_param,
    send_octets,
    url_host,
    usage_dict,
)

__all__ = ["BOOTSTRAP_KEYS", "MAX_ROOM", "BootstrapJoin", "MockSglangWorker", "NativeFormat"]

#: The keys the router adds to both legs' bodies (docs/protocols.md section 3).
BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
#: The largest bootstrap room, 2**63 - 1.
MAX_ROOM = (1 << 63) - 1
#: SGLang's native generation endpoint.
GENERATE_PATH = "/generate"

_PATHS = OPENAI_PATHS | {GENERATE_PATH}
_TERMINAL_FINISH = {
    FaultKind.PREFILL_ERROR_FINISH: "error",
    FaultKind.PREFILL_CANCELLED_FINISH: "abort",
}


class NativeFormat(AnswerFormat):
    """SGLang's native ``/generate`` answers: ``{"text", "output_ids", "meta_info"}``;
    streamed, each event carries the text and ids so far (SGLang's default, not
    incremental) and ``meta_info`` with the finish and the token counts (``prompt_tokens``,
    ``completion_tokens``, ``cached_tokens``)."""

    __slots__ = ("_ids", "_rid", "_text", "_usage")

    def __init__(self, rid: str) -> None:
        self._rid = rid
        self._text = ""
        self._ids: list[int] = []
        self._usage: Callable[[int], dict[str, Any]] = lambda n: usage_dict(0, n, 0)

    def bind_usage(self, usage: Callable[[int], dict[str, Any]]) -> None:
        self._usage = usage

    def _meta(self, finish: str | None, usage: Mapping[str, Any]) -> dict[str, Any]:
        completion = usage.get("completion_tokens", 0)
        reason: dict[str, Any] | None = None
        if finish == "length":
            reason = {"type": "length", "length": completion}
        elif finish == "stop":
            reason = {"type": "stop", "matched": self._ids[-1] if self._ids else None}
        elif finish is not None:  # error, abort
            reason = {"type": "abort", "message": f"the request finished with {finish}"}
        details = usage.get("prompt_tokens_details") or {}
        return {"id": self._rid, "finish_reason": reason,
                "prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": completion,
                "cached_tokens": details.get("cached_tokens", 0)}

    def token(self, text: str, token: int | None, finish: str | None) -> bytes:
        self._text += text
        if token is not None:
            self._ids.append(token)
        return b"data: " + orjson.dumps({
            "text": self._text, "output_ids": self._ids, "index": 0,
            "meta_info": self._meta(finish, self._usage(len(self._ids)))}) + b"\n\n"

    def answer(self, *, text: str, token_ids: list[int], finish: str,
               usage: dict[str, Any], top: Mapping[str, Any] | None = None,
               choice: Mapping[str, Any] | None = None) -> bytes:
        self._ids = list(token_ids)
        return orjson.dumps({"text": text, "output_ids": token_ids, "index": 0,
                             "meta_info": self._meta(finish, usage)})


def bootstrap_triple(body: Mapping[str, Any]) -> tuple[str, int, int] | str | None:
    """The body's ``(bootstrap_host, bootstrap_port, bootstrap_room)``; None if it has
    none; a message if they are malformed. A null ``bootstrap_port`` means SGLang's
    default, 8998."""
    host, port, room = (body.get(key) for key in BOOTSTRAP_KEYS)
    if host is None and room is None:
        return None
    if isinstance(host, list) or isinstance(room, list):
        return "batched bootstrap rooms (lists) are not supported by this mock worker"
    if port is None:
        port = DEFAULT_BOOTSTRAP_PORT
    if not isinstance(host, str) or not host:
        return f"bootstrap_host must be a host name, got {host!r:.60}"
    if type(port) is not int or not 0 < port < 65536:
        return f"bootstrap_port must be a TCP port, got {port!r:.60}"
    if type(room) is not int or not 0 <= room <= MAX_ROOM:
        return f"bootstrap_room must be an integer in [0, 2**63 - 1], got {room!r:.60}"
    return host, port, room


@attrs.frozen(kw_only=True)
class BootstrapJoin(KVSource):
    """A decode's way to its KV: join bootstrap room ``room`` on the prefill worker's
    bootstrap port (``GET /bootstrap/{room}?timeout=T`` waits up to ``timeout`` seconds for
    the prefill's KV, then transfers it) and leave it unused (``POST
    /bootstrap/{room}/leave``)."""

    host: str
    port: int
    room: int
    timeout: float

    @property
    def where(self) -> str:  # type: ignore[override]
        return f"{self.host}:{self.port}"

    def url(self, suffix: str = "") -> str:
        return f"http://{url_host(self.host.strip('[]'))}:{self.port}/bootstrap/{self.room}{suffix}"

    async def pull(self, worker: MockWorker, request_id: str) -> str | None:
        size = worker.kv.block_size * worker.kv_bytes_per_token
        read = None if math.isinf(self.timeout) else self.timeout + PULL_TIMEOUT
        try:
            response = await worker.client().get(
                self.url(), params={"timeout": f"{self.timeout:g}"},
                headers={b"x-request-id": request_id.encode("latin-1")},
                timeout=httpx.Timeout(PULL_TIMEOUT, read=read))
        except httpx.HTTPError as exc:
            worker.stats.kv_pull_failures += 1
            return (f"joining bootstrap room {self.room} at {self.where} failed: "
                    f"{type(exc).__name__}: {exc}")
        if response.status_code != 200:
            worker.stats.kv_pull_failures += 1
            return (f"bootstrap room {self.room} at {self.where} answered "
                    f"{response.status_code}: {answer_message(response)}")
        engine = unquote(response.headers.get("x-kv-engine-id", ""))
        key = unquote(response.headers.get("x-kv-key", ""))
        try:
            blocks = [int(b) for b in response.headers.get("x-kv-block-ids", "").split(",") if b]
        except ValueError:
            blocks = []
        expected = kv_bytes(engine, key, blocks, size)
        if not blocks or response.content != expected:
            worker.stats.kv_pull_failures += 1
            return (f"the KV of bootstrap room {self.room} from {self.where} was corrupt: "
                    f"{len(response.content)} bytes, expected {len(expected)}")
        worker.stats.kv_pulls += 1
        return None

    async def release(self, worker: MockWorker, request_id: str) -> None:
        worker.stats.kv_releases += 1
        try:
            await worker.client().post(
                self.url("/leave"), headers={b"x-request-id": request_id.encode("latin-1")},
                timeout=RELEASE_TIMEOUT)
        except httpx.HTTPError as exc:
            logger.warning("%s could not leave bootstrap room %d on %s: %r", worker.name,
                           self.room, self.where, exc)


async def _first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return as soon as one of ``waits`` returns."""
    async with trio.open_nursery() as nursery:
        async def run(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        for wait in waits:
            nursery.start_soon(run, wait)


class MockSglangWorker(MockWorker):
    """A mock SGLang worker (prefill or decode) as an ASGI 3 application
    (docs/protocols.md sections 3 and 5).

    Endpoints, as SGLang's server: ``POST /v1/completions``, ``POST /v1/chat/completions``
    (OpenAI answers and chunks) and ``POST /generate`` (native: ``text`` or ``input_ids``,
    ``sampling_params.max_new_tokens``, answers ``{"text", "output_ids", "meta_info"}``,
    streamed as cumulative events), streamed or not; ``GET /get_server_info``
    (``disaggregation_mode``, ``disaggregation_bootstrap_port``); ``GET /v1/models``,
    ``GET /health``, ``GET /metrics`` (with ``trio_disagg_mock_bootstrap_rooms_open``),
    ``GET /stats``. Errors are SGLang's ``{"object": "error", "message", ...}``.

    **Prefill** (``role="prefill"``): a request must carry ``bootstrap_host``,
    ``bootstrap_port`` (this worker's) and ``bootstrap_room`` (else 400); ``n > 1`` and
    batched rooms are refused (400: every request and every sample needs its own room),
    and so is a room that already has a prefill request. The worker enters the room,
    starts a streamed answer at once, computes the prefill
    (``latency.time_to_first_token``), stages the KV in the room (held, no lease: the
    room has its own timeout), waits up to ``bootstrap_timeout`` seconds for a decode to
    join (else the KV is stranded and it fails), waits for the transfer, then answers:
    no token, ``finish_reason: "length"`` (SGLang's ``FINISH_LENGTH(length=0)``), usage
    with ``prompt_tokens_details.cached_tokens`` (a deterministic prefix-cache hit;
    ``meta_info.cached_tokens`` on ``/generate``). A decode that leaves the room before
    the transfer completed (even before the prefill arrived) makes it fail at once, its
    KV freed.

    **Bootstrap port** (the prefill's second listener, ``bootstrap_port``): ``GET
    /bootstrap/{room}?timeout=T`` is a decode joining: it waits up to ``T`` seconds for the
    prefill's KV (504 if it never comes), waits ``latency.kv_transfer_time`` seconds, and
    sends the blocks' bytes (headers ``x-kv-engine-id``, ``x-kv-key``, ``x-kv-block-ids``),
    which frees them (the request is *served*); a decode that disconnects first leaves
    the room and frees them. ``POST /bootstrap/{room}/leave`` is a decode aborted before
    it joined.

    **Decode** (``role="decode"``): with the bootstrap triple, the answer's headers go out
    at once (streamed), then the worker joins the room over loopback (waiting up to its
    own ``bootstrap_timeout``), checks every byte, and generates (a failed join or pull is
    a decode error); aborted before that, it leaves the room. Without the triple it
    computes the prefill itself.

    Aborting on connection close, as SGLang: a prefill aborted before it answered frees
    its KV and leaves the room; a decode aborted before its transfer leaves the room.

    Faults: as :class:`~trio_disagg.workers.MockVllmWorker`; ``prefill_fail_before_handoff``
    fails before staging (the decode waits for a KV that never comes, until its timeout
    or until the router stops it), ``prefill_fail_after_handoff`` after the transfer,
    ``prefill_error_finish`` / ``prefill_cancelled_finish`` answer ``finish_reason``
    ``error`` / ``abort`` without staging, ``eos_first_token`` finishes ``stop`` on both
    legs (the decode receives the prefill's first token with the KV).

    Args:
        role: ``"prefill"`` or ``"decode"``.
        bootstrap_port: a prefill worker's bootstrap port (0: any free one); default
            8998, SGLang's. Not for a decode worker.
        bootstrap_timeout: seconds either side waits for the other (SGLang's 300 s).
        others: as :class:`~trio_disagg.workers.MockWorker`.

    Raises:
        ValueError: a bad role or setting.
    """

    protocol: ClassVar[str] = "sglang"
    owned_by: ClassVar[str] = "sglang"
    flat_errors: ClassVar[bool] = True

    def __init__(
        self,
        role: Role,
        *,
        bootstrap_port: int | None = None,
        bootstrap_timeout: float = DEFAULT_BOOTSTRAP_TIMEOUT,
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
        super().__init__(
            role, name=name, model=model, latency=latency, seed=seed, block_size=block_size,
            kv_ttl=kv_ttl, kv_bytes_per_token=kv_bytes_per_token,
            default_max_tokens=default_max_tokens, fault_plan=fault_plan,
            http_client=http_client, max_body_bytes=max_body_bytes, history=history)
        if not bootstrap_timeout > 0:
            raise ValueError(f"bootstrap_timeout must be > 0 seconds, got {bootstrap_timeout!r}")
        if bootstrap_port is not None:
            if role != "prefill":
                raise ValueError("only a prefill worker listens on a bootstrap port")
            if type(bootstrap_port) is not int or not 0 <= bootstrap_port < 65536:
                raise ValueError(f"bootstrap_port must be a TCP port, got {bootstrap_port!r}")
        self.bootstrap_timeout = bootstrap_timeout
        self._listen: int | None = None
        if role == "prefill":
            self._listen = DEFAULT_BOOTSTRAP_PORT if bootstrap_port is None else bootstrap_port
        #: The bound bootstrap port of a prefill worker, once served.
        self.bootstrap_port: int | None = None
        self._prefill_rooms: set[int] = set()  # rooms a prefill request of ours is in
        self._joins: set[int] = set()  # rooms a decode is joined to (a GET in progress)
        self._gone: dict[int, float] = {}  # rooms a decode left before any prefill came
        self._gone_order: deque[tuple[float, int]] = deque()

    @property
    def extra_listen_port(self) -> int | None:
        return self._listen

    def advertise(self, host: str, port: int, extra_port: int | None = None) -> None:
        super().advertise(host, port, extra_port)
        if self.role == "prefill":
            self.bootstrap_port = extra_port

    def extra_gauges(self) -> list[tuple[str, str, float]]:
        return [("bootstrap_rooms_open", "Bootstrap rooms with a side still in them.",
                 self.kv.open_rooms)]

    def generation_paths(self) -> frozenset[str]:
        return _PATHS

    # --- routing ---------------------------------------------------------------------------

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if (self.bootstrap_port is not None and server is not None
                and server[1] == self.bootstrap_port):
            await self._bootstrap_route(scope, receive, send)
            return
        if scope["path"] in ("/get_server_info", "/server_info") and scope["method"] == "GET":
            await self.exchange(send).respond(200, orjson.dumps({
                "disaggregation_mode": self.role,
                "disaggregation_bootstrap_port": self.bootstrap_port,
                "model_path": self.model if self.model is not None else "mock-model",
                "version": "trio-disagg-mock",
            }))
            return
        await super()._route(scope, receive, send)

    def _check_body(self, body: dict[str, Any], path: str) -> tuple[int, str] | None:
        if path == GENERATE_PATH:
            if body.get("text") is None and body.get("input_ids") is None:
                return 400, "Either text or input_ids should be provided."
            return None
        return super()._check_body(body, path)

    def _max_tokens(self, body: Mapping[str, Any]) -> int:
        params = body.get("sampling_params")
        if isinstance(params, Mapping):
            return resolve_max_tokens(None, params, self.default_max_tokens)
        return super()._max_tokens(body)

    def _min_tokens(self, body: Mapping[str, Any]) -> int:
        params = body.get("sampling_params")
        if isinstance(params, Mapping):
            value = params.get("min_new_tokens")
            return value if type(value) is int and value > 0 else 0
        return super()._min_tokens(body)

    def _format(self, exchange: Exchange, body: Mapping[str, Any], path: str
                ) -> tuple[AnswerFormat, bool]:
        """The answer format, and whether a stream carries usage."""
        if path == GENERATE_PATH:
            return NativeFormat(exchange.request_id or ""), True
        options = body.get("stream_options")
        include_usage = isinstance(options, Mapping) and options.get("include_usage") is True
        return self.openai_format(exchange, body, path), include_usage

    def _work(self, exchange: Exchange, body: dict[str, Any], path: str,
              fault: Fault | None, mock: MockFault | None = None) -> Work:
        triple = bootstrap_triple(body)
        if isinstance(triple, str):
            raise Refusal(400, f"{self.name}: {triple}")
        n = body.get("n")
        if triple is not None and type(n) is int and n > 1:
            raise Refusal(400, f"{self.name}: n={n} would share bootstrap room {triple[2]}; "
                               f"every request and every sample needs its own room")
        fmt, include_usage = self._format(exchange, body, path)
        if self.role == "prefill":
            if triple is None:
                raise Refusal(400, f"{self.name} is a prefill worker: the request needs "
                                   f"{', '.join(BOOTSTRAP_KEYS)}")
            if triple[1] != self.bootstrap_port:
                raise Refusal(400, f"{self.name} bootstraps at port {self.bootstrap_port}, "
                                   f"not {triple[1]}")
            return partial(self._prefill, exchange, body, fmt, include_usage, fault, triple[2])
        source = None
        if triple is not None:
            source = BootstrapJoin(host=triple[0], port=triple[1], room=triple[2],
                                   timeout=self.bootstrap_timeout)
        return partial(self._decode, exchange, body, fmt, fault, source,
                       include_usage=include_usage, eos_with_handoff=True, mock=mock)

    # --- the prefill -----------------------------------------------------------------------

    async def _prefill(self, exchange: Exchange, body: Mapping[str, Any], fmt: AnswerFormat,
                       include_usage: bool, fault: Fault | None, room_id: int) -> None:
        """A prefill request: meet the decode in the room, hand the KV over, answer."""
        kind = fault.kind if fault is not None else None
        request_id = exchange.request_id or ""
        stream = body.get("stream") is True
        prompt_tokens = count_prompt_tokens(body)
        kv = self.kv
        cached = cached_prompt_tokens(self.seed, body, prompt_tokens, kv.block_size)

        def usage(n: int) -> dict[str, Any]:
            return usage_dict(prompt_tokens, n, cached)

        try:
            room = kv.room(room_id)
            room.enter("prefill")
        except KVTransferError as exc:
            exchange.failed = True
            await exchange.error(f"{self.name}: {exc}", 400)
            return
        self._prefill_rooms.add(room_id)
        entry: StagedKV | None = None
        answered = False
        computed = False
        try:
            if self._take_gone(room_id):
                answered = True
                await self._fail(exchange, f"{self.name}: the decode left bootstrap room "
                                           f"{room_id} before the prefill arrived")
                return
            if stream:
                await exchange.start_stream()  # accepted: headers now, as SGLang sends them
            if kind is FaultKind.PREFILL_STALL:
                await trio.sleep_forever()
            if (delay := self.latency.time_to_first_token(prompt_tokens)) > 0:
                await trio.sleep(delay)
            computed = True
            self.stats.prefills_completed += 1
            if kind is FaultKind.PREFILL_RESET:
                answered = True
                await self._reset(exchange, stream)
                return
            if kind is FaultKind.PREFILL_FAIL_BEFORE_HANDOFF:
                answered = True
                await self._fail(exchange, f"{self.name}: injected fault {kind.value} on "
                                           f"request {request_id!r}")
                return
            if kind in _TERMINAL_FINISH:
                assert kind is not None
                answered = True
                await self._answer(exchange, fmt, stream=stream, include_usage=include_usage,
                                   token=None, finish=_TERMINAL_FINISH[kind], usage=usage(0))
                return
            entry = kv.stage(request_id, prompt_tokens, lease=False)
            room.put(entry)
            with trio.move_on_after(self.bootstrap_timeout):
                await _first_of(room.wait_joined, room.wait_finished)
            if self._take_gone(room_id):  # it gave up without joining
                kv.release(entry)
                answered = True
                await self._fail(exchange, f"{self.name}: the decode left bootstrap room "
                                           f"{room_id} before it joined")
                return
            if not room.joined:
                kv.strand(entry)
                answered = True
                await self._fail(exchange, f"{self.name}: no decode joined bootstrap room "
                                           f"{room_id} within {self.bootstrap_timeout:g} s; "
                                           f"its {entry.num_blocks} KV blocks were dropped")
                return
            await room.wait_finished()
            if not room.pulled:
                kv.release(entry)  # normally already released by the decode's leaving
                answered = True
                await self._fail(exchange, f"{self.name}: the decode left bootstrap room "
                                           f"{room_id} before the KV transfer completed")
                return
            answered = True
            if kind is FaultKind.PREFILL_FAIL_AFTER_HANDOFF:
                await self._fail(exchange, f"{self.name}: injected fault {kind.value} on "
                                           f"request {request_id!r} (after the KV transfer)")
                return
            eos = self.ends_on_first_token(body, fault)
            token = TokenStream(self.seed, request_id).next_id() if eos else None
            await self._answer(exchange, fmt, stream=stream, include_usage=include_usage,
                               token=token, finish="stop" if eos else "length",
                               usage=usage(1 if eos else 0))
        finally:
            self._prefill_rooms.discard(room_id)
            if not answered and (entry is None or entry.state is not KVState.HELD
                                 or not kv.release(entry)):
                kv.note_aborted()  # aborted: one abort, whatever was staged is freed
            if not computed and not answered:
                self.stats.prefills_aborted += 1
            room.leave("prefill")

    async def _answer(self, exchange: Exchange, fmt: AnswerFormat, *, stream: bool,
                      include_usage: bool, token: int | None, finish: str,
                      usage: dict[str, Any]) -> None:
        """The prefill's whole answer: one chunk (or none) and its finish."""
        text = WORDS[token] if token is not None else ""
        ids = [token] if token is not None else []
        if not stream:
            await exchange.respond(200, fmt.answer(text=text, token_ids=ids, finish=finish,
                                                   usage=usage))
            return
        fmt.bind_usage(lambda n: usage)
        parts = [fmt.start(), fmt.token(text, token, finish)]
        if include_usage:
            parts.append(fmt.usage(usage))
        parts.append(DONE_EVENT)
        await exchange.finish(b"".join(parts))

    # --- the bootstrap port ----------------------------------------------------------------

    async def _bootstrap_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        path = scope["path"]
        exchange = self.exchange(send, header(scope, b"x-request-id"))
        if path == "/health" and method == "GET":
            await exchange.respond(200, b"", b"text/plain")
            return
        parts = path.split("/")
        if (len(parts) in (3, 4) and parts[1] == "bootstrap" and parts[2].isdigit()
                and int(parts[2]) <= MAX_ROOM):
            room_id = int(parts[2])
            if len(parts) == 3 and method == "GET":
                await self._join(scope, receive, exchange, room_id)
                return
            if len(parts) == 4 and parts[3] == "leave" and method == "POST":
                left = self._leave(room_id)
                await exchange.respond(200, orjson.dumps({"left": left}))
                return
        await exchange.error(f"Not found on the bootstrap port: {method} {path}", 404)

    async def _join(self, scope: Scope, receive: Receive, exchange: Exchange,
                    room_id: int) -> None:
        """A decode joins ``room_id`` and receives its KV (see the class docstring)."""
        text = query_param(scope, "timeout")
        try:
            timeout = float(text) if text else self.bootstrap_timeout
        except ValueError:
            timeout = math.nan
        if not timeout > 0:
            await exchange.error(f"timeout must be a number of seconds > 0, got {text!r}", 400)
            return
        room = self.kv.room(room_id)
        try:
            room.enter("decode")
        except KVTransferError as exc:
            await exchange.error(f"{self.name}: {exc}", 400)
            return
        self._joins.add(room_id)
        size = self.kv.block_size * self.kv_bytes_per_token
        pulled = False

        async def transfer() -> None:
            nonlocal pulled
            with trio.move_on_after(timeout):
                await room.wait_staged()
            entry = room.entry
            if entry is None:
                await exchange.error(f"{self.name}: the prefill never staged KV in bootstrap "
                                     f"room {room_id} within {timeout:g} s", 504)
                return
            try:
                self.kv.claim_entry(entry)
            except KVTransferError as exc:
                await exchange.error(f"{self.name}: {exc}", 410)
                return
            if (delay := self.latency.kv_transfer_time(entry.num_tokens)) > 0:
                await trio.sleep(delay)
            await send_octets(exchange, kv_bytes(self.name, entry.key, entry.block_ids, size), [
                (b"x-kv-engine-id", quote(self.name).encode()),
                (b"x-kv-key", quote(entry.key).encode()),
                (b"x-kv-block-ids", ",".join(map(str, entry.block_ids)).encode()),
            ])
            self.kv.complete(entry)
            self.stats.kv_transfers += 1
            room.finish(pulled=True)
            pulled = True

        try:
            await run_until_disconnect(receive, exchange, transfer)
        finally:
            self._joins.discard(room_id)
            if not pulled and room_id not in self._prefill_rooms:
                self._mark_gone(room_id)
            room.leave("decode")  # frees KV it did not pull; wakes a waiting prefill

    def _leave(self, room_id: int) -> bool:
        """A decode that never joined (or whose join is over) gives up ``room_id``; its
        prefill, now or later, fails at once."""
        if room_id in self._joins:
            return False  # its join's connection closing lets go
        self._mark_gone(room_id)
        room: BootstrapRoom = self.kv.room(room_id)
        room.leave("decode")
        return True

    def _prune_gone(self) -> None:
        now = trio.current_time()
        order = self._gone_order
        while order and order[0][0] <= now:
            expiry, room_id = order.popleft()
            if self._gone.get(room_id) == expiry:
                del self._gone[room_id]

    def _mark_gone(self, room_id: int) -> None:
        self._prune_gone()
        expiry = trio.current_time() + min(self.bootstrap_timeout, 3600.0)
        self._gone[room_id] = expiry
        self._gone_order.append((expiry, room_id))

    def _take_gone(self, room_id: int) -> bool:
        self._prune_gone()
        return self._gone.pop(room_id, None) is not None
