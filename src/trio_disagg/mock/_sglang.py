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

from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any, ClassVar, Unpack

import attrs
import orjson

from .._asgi import Receive, Scope, Send
from .._protocols import DEFAULT_BOOTSTRAP_PORT
from ._answers import AnswerFormat, usage_dict
from ._asgi import DONE_EVENT, Exchange, Refusal
from ._bootstrap import BOOTSTRAP_KEYS, MAX_ROOM, BootstrapJoin, BootstrapPort, bootstrap_triple
from ._core import Handover, Prefill, hand_over
from ._faults import Fault, FaultKind
from ._kv import (
    DEFAULT_BOOTSTRAP_TIMEOUT,
    BootstrapRoom,
    KVTransferError,
    StagedKV,
)
from ._options import WorkerOptions
from ._sinks import PrefillAnswers
from ._text import WORDS, resolve_max_tokens
from ._wire_faults import MockFault
from ._worker import OPENAI_PATHS, MockWorker, Role, Work

__all__ = ["BOOTSTRAP_KEYS", "MAX_ROOM", "BootstrapJoin", "MockSglangWorker", "NativeFormat"]

#: SGLang's native generation endpoint.
GENERATE_PATH = "/generate"

_PATHS = OPENAI_PATHS | {GENERATE_PATH}
_TERMINAL_FINISH = {
    FaultKind.PREFILL_ERROR_FINISH: "error",
    FaultKind.PREFILL_CANCELLED_FINISH: "abort",
}


class NativeFormat(AnswerFormat):
    """SGLang's native ``/generate`` answers: ``{"text", "output_ids", "meta_info"}``;
    streamed, each event carries the text and ids so far (SGLang's default) or, with
    ``incremental`` (SGLang's ``--incremental-streaming-output``), only its new ones, and
    ``meta_info`` with the finish and the token counts (``prompt_tokens``,
    ``completion_tokens``: all so far, ``cached_tokens``)."""

    __slots__ = ("_ids", "_incremental", "_rid", "_text", "_usage")

    def __init__(self, rid: str, *, incremental: bool = False) -> None:
        self._rid = rid
        self._incremental = incremental
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
        meta = self._meta(finish, self._usage(len(self._ids)))
        if self._incremental:
            event = {"text": text, "output_ids": [token] if token is not None else [],
                     "index": 0, "meta_info": meta}
        else:
            event = {"text": self._text, "output_ids": self._ids, "index": 0,
                     "meta_info": meta}
        return b"data: " + orjson.dumps(event) + b"\n\n"

    def answer(self, *, text: str, token_ids: list[int], finish: str,
               usage: dict[str, Any], top: Mapping[str, Any] | None = None,
               choice: Mapping[str, Any] | None = None) -> bytes:
        self._ids = list(token_ids)
        return orjson.dumps({"text": text, "output_ids": token_ids, "index": 0,
                             "meta_info": self._meta(finish, usage)})


class MockSglangWorker(MockWorker):
    """A mock SGLang worker (prefill or decode) as an ASGI 3 application
    (docs/protocols.md sections 3 and 5).

    Endpoints, as SGLang's server: ``POST /v1/completions``, ``POST /v1/chat/completions``
    (OpenAI answers and chunks) and ``POST /generate`` (native: ``text`` or ``input_ids``,
    ``sampling_params.max_new_tokens``, answers ``{"text", "output_ids", "meta_info"}``,
    streamed as cumulative events, or incremental ones with
    ``incremental_streaming_output``), streamed or not; ``GET /server_info`` and ``GET
    /get_server_info`` (``disaggregation_mode``, ``disaggregation_bootstrap_port``: a
    prefill worker's own, 8998 for a decode worker, as SGLang's); ``GET /v1/models``,
    ``GET /health``, ``GET /metrics`` (with ``trio_disagg_mock_bootstrap_rooms_open``),
    ``GET /stats``. Errors are SGLang's ``{"object": "error", "message", ...}``.

    **Prefill** (``role="prefill"``): a request must carry ``bootstrap_host``,
    ``bootstrap_port`` and ``bootstrap_room`` (else 400; a port not this worker's is the
    router's mistake: 500, where SGLang's decode would fail to join); ``n > 1`` and
    batched rooms are refused (400: every request and every sample needs its own room),
    and so is a room that already has a prefill request. The worker enters the room,
    starts a streamed answer at once, computes the prefill
    (``latency.time_to_first_token``), stages the KV in the room (held, no lease: the
    room has its own timeout), waits up to ``bootstrap_timeout`` seconds for a decode to
    join (else the KV is stranded and it fails), waits for the transfer, then answers:
    no token, ``finish_reason: "length"`` (SGLang's ``FINISH_LENGTH(length=0)``), usage
    with ``prompt_tokens_details.cached_tokens`` (its prefix-cache hit;
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
        incremental_streaming_output: ``/generate`` streams each event's new text and ids
            only, as SGLang's ``--incremental-streaming-output``; default the text and
            ids so far.
        others: as :class:`~trio_disagg.workers.MockWorker`.

    Raises:
        ValueError: a bad role or setting.
    """

    protocol: ClassVar[str] = "sglang"
    owned_by: ClassVar[str] = "sglang"
    whole_message: ClassVar[Mapping[str, Any]] = MappingProxyType(
        {"reasoning_content": None, "tool_calls": None})
    flat_errors: ClassVar[bool] = True

    def __init__(self, role: Role, *, bootstrap_port: int | None = None,
                 bootstrap_timeout: float = DEFAULT_BOOTSTRAP_TIMEOUT,
                 incremental_streaming_output: bool = False,
                 **options: Unpack[WorkerOptions]) -> None:
        super().__init__(role, **options)
        self.incremental_streaming_output = incremental_streaming_output
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
        #: The bootstrap port's endpoints (a prefill worker's).
        self.rooms = BootstrapPort(self)

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

    def protects(self, scope: Scope) -> bool:
        """SGLang's ``--api-key`` protects every path but ``/health*`` and ``/metrics*``
        (and the mock's own ``/kv/`` and ``/stats``); its bootstrap port takes no key."""
        server = scope.get("server")
        if self.bootstrap_port is not None and server is not None and (
                server[1] == self.bootstrap_port):
            return False
        path = str(scope["path"])
        return not path.startswith(("/health", "/metrics", "/kv/", "/stats"))

    # --- routing ---------------------------------------------------------------------------

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if (self.bootstrap_port is not None and server is not None
                and server[1] == self.bootstrap_port):
            await self.rooms.route(scope, receive, send)
            return
        if scope["path"] in ("/get_server_info", "/server_info") and scope["method"] == "GET":
            # as SGLang's: its server arguments, the bootstrap port given whatever the role
            await self.exchange(send).respond(200, orjson.dumps({
                "disaggregation_mode": self.role,
                "disaggregation_bootstrap_port": self.bootstrap_port if self.role == "prefill"
                else DEFAULT_BOOTSTRAP_PORT,
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
            return NativeFormat(exchange.request_id or "",
                                incremental=self.incremental_streaming_output), True
        options = body.get("stream_options")
        include_usage = isinstance(options, Mapping) and options.get("include_usage") is True
        return self.openai_format(exchange, body, path, sglang=True), include_usage

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
            if triple[1] != self.bootstrap_port:  # the router's mistake, not the client's
                raise Refusal(500, f"{self.name} bootstraps at port {self.bootstrap_port}, "
                                   f"not {triple[1]}: no decode could join its rooms")
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
        stream = body.get("stream") is True
        try:
            room = self.kv.room(room_id)
            room.enter("prefill")
        except KVTransferError as exc:
            exchange.failed = True
            await exchange.error(f"{self.name}: {exc}", 400)
            return
        self._prefill_rooms.add(room_id)
        run = self.prefill_run(exchange, body, fault)
        run.lease = False  # the room has its own timeout
        run.eos_ends_prefill = False  # the decode receives the EOS with the KV
        sink = _PrefillSink(self, exchange, fmt, room, room_id, stream=stream,
                            include_usage=include_usage)
        try:
            if self.rooms.take_gone(room_id):
                run.answered = True
                await self._fail(exchange, f"{self.name}: the decode left bootstrap room "
                                           f"{room_id} before the prefill arrived")
                return
            if stream:
                await exchange.start_stream()  # accepted: headers now, as SGLang sends them
            await run.run(sink)
        finally:
            self._prefill_rooms.discard(room_id)
            run.abort()  # aborted: one abort, whatever was staged is freed
            if not run.computed and not run.answered:
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


@attrs.define
class _PrefillSink(PrefillAnswers):
    """An SGLang prefill's answers (the core's :class:`~._core.PrefillSink`): its handoff
    is the hand-over in its bootstrap room, then an answer with no token (or EOS)."""

    worker: MockSglangWorker
    exchange: Exchange
    fmt: AnswerFormat
    room: BootstrapRoom
    room_id: int
    stream: bool
    include_usage: bool

    async def terminal(self, run: Prefill, kind: FaultKind) -> None:
        run.answered = True
        await self._answer(run, token=None, finish=_TERMINAL_FINISH[kind])

    async def handoff(self, run: Prefill, entry: StagedKV) -> None:
        worker = self.worker
        room_id = self.room_id
        outcome = await hand_over(worker.kv, self.room, entry, worker.bootstrap_timeout,
                                  gone=lambda: worker.rooms.take_gone(room_id))
        run.answered = True
        if outcome is Handover.GONE:  # it gave up without joining
            await self.fail(run, f"{worker.name}: the decode left bootstrap room {room_id} "
                                 f"before it joined")
        elif outcome is Handover.NOT_JOINED:
            await self.fail(run, f"{worker.name}: no decode joined bootstrap room {room_id} "
                                 f"within {worker.bootstrap_timeout:g} s; its "
                                 f"{entry.num_blocks} KV blocks were dropped")
        elif outcome is Handover.LEFT:
            await self.fail(run, f"{worker.name}: the decode left bootstrap room {room_id} "
                                 f"before the KV transfer completed")
        elif run.kind is FaultKind.PREFILL_FAIL_AFTER_HANDOFF:
            await self.fail(run, run.message("after the KV transfer"))
        else:
            eos = run.kind is FaultKind.EOS_FIRST_TOKEN and run.min_tokens == 0
            await self._answer(run, token=run.token if eos else None,
                               finish="stop" if eos else "length")

    async def _answer(self, run: Prefill, *, token: int | None, finish: str) -> None:
        await self.worker._answer(
            self.exchange, self.fmt, stream=self.stream, include_usage=self.include_usage,
            token=token, finish=finish,
            usage=usage_dict(run.prompt_tokens, 0 if token is None else 1, run.cached))
