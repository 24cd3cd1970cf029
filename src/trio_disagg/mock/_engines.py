"""In-process mock prefill and decode engines (docs/protocols.md section 5).

They implement :class:`~trio_disagg.Engine` over trio memory channels, with the latency,
KV lifetime and failure behaviour of the real workers where it matters to the router:
a vLLM-like sequential handoff or an SGLang-like bootstrap room, KV blocks held on the
prefill side until a decode pulls them or their lease expires, a decode that really pulls
before it produces tokens, and faults injected per request.
"""

from __future__ import annotations

import trio

from .._context import RequestContext
from .._engine import HandoffStyle
from .._errors import WorkerError
from .._protocols import (
    Annotated,
    BootstrapInfo,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    TraceLink,
)
from ._channel import (
    Item,
    SendChannel,
    Stopper,
    TaskStatus,
    Usage,
    cancelled_item,
    check_seconds,
    pick_fault,
    usage,
)
from ._core import Handover, Prefill, abort, hand_over
from ._faults import FaultKind, FaultPlan
from ._kv import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BOOTSTRAP_TIMEOUT,
    DEFAULT_KV_TTL,
    BootstrapRoom,
    KVBlockPool,
    KVCounters,
    KVTransferError,
    StagedKV,
)
from ._latency import LatencyModel
from ._prefix import DEFAULT_PREFIX_CACHE_BLOCKS, PrefixCache
from ._registry import KVRegistry
from ._text import WORDS, TokenStream, count_prompt_tokens

#: ``remote_host`` of an in-process handoff.
INPROC_HOST = "inproc"

_TERMINAL_FIRST = frozenset({
    FaultKind.PREFILL_FAIL_BEFORE_HANDOFF, FaultKind.PREFILL_ERROR_FINISH,
    FaultKind.PREFILL_CANCELLED_FINISH, FaultKind.EOS_FIRST_TOKEN, FaultKind.PREFILL_RESET,
})


class MockPrefillEngine:
    """An in-process prefill worker with KV block accounting.

    Each request: ``started()`` at once (the worker accepted it), then prefill compute
    for ``latency.time_to_first_token(prompt tokens)`` seconds (of the prompt tokens its
    prefix cache missed), then the handoff:

    * ``HandoffStyle.SEQUENTIAL`` (vLLM; ``CONTEXT_FIRST``, TensorRT-LLM's, is served
      the same way): the KV is staged in :attr:`kv` under the request
      id and ONE output is sent: one token, ``finish_reason`` length, usage with
      ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens`` (the prompt's
      leading whole blocks found in :attr:`prefix`, this engine's prefix cache), and
      ``disaggregated_params`` = ``{"remote_engine_id": name, "remote_request_id",
      "remote_block_ids", "remote_host": "inproc", "remote_port": 0,
      "do_remote_prefill": True, "do_remote_decode": False, "tp_size": 1}``. The stream
      then ends; the blocks stay held until a :class:`MockDecodeEngine` pulls them or
      their lease of ``kv_ttl`` seconds expires (they are then counted as stranded).
    * ``HandoffStyle.BOOTSTRAP`` (SGLang): the request must carry ``bootstrap_info``
      naming this engine's :attr:`bootstrap_host` and :attr:`bootstrap_port`. The first
      output, sent at once, has no token, ``disaggregated_params`` = the bootstrap triple,
      and the usage. After the compute the KV is staged in the bootstrap room, the engine
      waits up to ``bootstrap_timeout`` seconds for the decode to join (else the KV is
      stranded and an error item ends the stream), waits for the decode to pull it, and
      ends the stream with one token and ``finish_reason`` length. If the decode leaves
      the room before pulling, the KV is freed and an error item ends the stream.

    Staged KV whose handoff output was never delivered (the engine was stopped, killed or
    cancelled, or the receiver closed the channel before it took the output) is released
    at once; so is KV staged in a room the engine leaves.

    Cancellation: ``context.stop_generating()`` ends the stream with one ``cancelled``
    item; ``context.kill()`` ends it at once; a closed receiver
    (:exc:`trio.BrokenResourceError`) or a cancelled caller ends it silently. Each of these
    before the handoff output was delivered counts as aborted in :meth:`counters`.

    Faults come from the request body's ``"fault"`` (see :class:`FaultKind`), else from
    ``fault_plan``.

    Args:
        registry: links this engine to the decode engines; the engine registers its
            :attr:`kv` pool there under ``name`` (and its bootstrap address).
        name: unique in ``registry``; the ``remote_engine_id`` of its handoffs.
        style: the handoff style (:attr:`handoff_style`).
        latency: the :class:`LatencyModel`; default ``LatencyModel()``.
        seed: fixes the tokens (with the request id).
        block_size: tokens per KV block (and per prefix-cache block).
        kv_ttl: seconds staged KV waits for its decode (sequential style).
        bootstrap_timeout: seconds to wait for the decode to join a bootstrap room.
        bootstrap_host: for the bootstrap style, the host the router puts in
            ``bootstrap_info``.
        bootstrap_port: for the bootstrap style; default: the next port of ``registry``
            from 8998.
        fault_plan: faults for requests whose body names none.
        prefix_cache_blocks: the bound of :attr:`prefix`, in blocks (0: no prefix cache).

    Raises:
        ValueError: a duplicate name or bootstrap address, or a bad setting.
    """

    def __init__(
        self,
        registry: KVRegistry,
        name: str = "prefill-0",
        *,
        style: HandoffStyle = HandoffStyle.SEQUENTIAL,
        latency: LatencyModel | None = None,
        seed: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_ttl: float = DEFAULT_KV_TTL,
        bootstrap_timeout: float = DEFAULT_BOOTSTRAP_TIMEOUT,
        bootstrap_host: str = INPROC_HOST,
        bootstrap_port: int | None = None,
        fault_plan: FaultPlan | None = None,
        prefix_cache_blocks: int = DEFAULT_PREFIX_CACHE_BLOCKS,
    ) -> None:
        self.name = name
        self.handoff_style = style
        #: The engine's prefix cache: the prompt prefixes it computed, by block.
        self.prefix = PrefixCache(block_size, prefix_cache_blocks)
        self.registry = registry
        self.latency = latency if latency is not None else LatencyModel()
        self.seed = seed
        self.bootstrap_timeout = check_seconds("bootstrap_timeout", bootstrap_timeout)
        self.fault_plan = fault_plan
        #: The engine's KV blocks (see :class:`KVBlockPool`).
        self.kv = KVBlockPool(name, block_size=block_size, ttl=kv_ttl)
        self.bootstrap_host: str | None = None
        self.bootstrap_port: int | None = None
        if style is HandoffStyle.BOOTSTRAP:
            if bootstrap_port is None:
                bootstrap_port = registry.allocate_bootstrap_port()
            registry.add(self.kv, bootstrap_address=(bootstrap_host, bootstrap_port))
            self.bootstrap_host = bootstrap_host
            self.bootstrap_port = bootstrap_port
        else:
            registry.add(self.kv)

    def __repr__(self) -> str:
        return f"<MockPrefillEngine {self.name!r} {self.handoff_style.value}>"

    def counters(self) -> KVCounters:
        """This engine's KV counters, after expiring leases that are due."""
        return self.kv.counters()

    async def generate(self, request: PreprocessedRequest, context: RequestContext,
                       send_channel: SendChannel, *,
                       task_status: TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the prefill leg of ``request``; see the class docstring.

        Raises:
            WorkerError: before ``started()``: a malformed ``"fault"`` (status 400), a
                ``prefill_reject`` fault (its status), or for the bootstrap style a
                request without ``bootstrap_info`` for this engine (400). Once started,
                failures are sent as error items and nothing is raised.
        """
        with send_channel:
            fault = pick_fault(request, "prefill", self.fault_plan, self.name)
            info = self._check_bootstrap(request)
            stopper = Stopper(context)
            task_status.started()
            run = Prefill(worker=self.name, request_id=request.request_id, seed=self.seed,
                          latency=self.latency, pool=self.kv, body=request.body,
                          prompt_tokens=count_prompt_tokens(request.body), fault=fault,
                          prefix=self.prefix)
            sink = _PrefillSink(self, request, send_channel)
            try:
                with stopper.scope:
                    if info is None:
                        await run.run(sink)
                    else:
                        await self._bootstrap(run, info, sink)
                    return
                await stopper.send_cancelled(send_channel, cancelled_item())
            except trio.BrokenResourceError:
                # the receiver is gone: an abort. send() only half-checkpointed before raising.
                await trio.lowlevel.checkpoint()

    def _check_bootstrap(self, request: PreprocessedRequest) -> BootstrapInfo | None:
        """The request's bootstrap triple (bootstrap style), or None (sequential).

        Raises:
            WorkerError: a bootstrap engine's request without its triple (400).
        """
        if self.handoff_style is not HandoffStyle.BOOTSTRAP:
            return None
        info = request.bootstrap_info
        if info is None:
            raise WorkerError(f"{self.name} is a bootstrap prefill engine: the request "
                              f"needs bootstrap_info", status=400, worker=self.name)
        if (info.host, info.port) != (self.bootstrap_host, self.bootstrap_port):
            raise WorkerError(f"{self.name} bootstraps at {self.bootstrap_host}:"
                              f"{self.bootstrap_port}, not {info.host}:{info.port}",
                              status=400, worker=self.name)
        return info

    async def _bootstrap(self, run: Prefill, info: BootstrapInfo, sink: _PrefillSink) -> None:
        """The bootstrap style: the first output at once, then the KV through the room."""
        room: BootstrapRoom | None = None
        problem = ""
        try:
            candidate = self.kv.room(info.room)
            candidate.enter("prefill")
            room = candidate
        except KVTransferError as exc:
            problem = f"{self.name}: {exc}"
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            if room is None:
                run.answered = True
                await sink.send(Annotated.from_error(problem))
                return
            await self._meet(run, room, info, sink)
        finally:
            if not run.answered:
                abort(self.kv, run.entry)
            if room is not None:
                room.leave("prefill")

    async def _meet(self, run: Prefill, room: BootstrapRoom, info: BootstrapInfo,
                    sink: _PrefillSink) -> None:
        kind = run.kind
        if kind is FaultKind.PREFILL_STALL:
            await trio.sleep_forever()
        if kind in _TERMINAL_FIRST:
            assert kind is not None
            await run.compute()
            await sink.first_output(run, kind)
            run.answered = True
            return
        await sink.send(self._bootstrap_output(sink.request, info, run))
        await run.compute()
        run.entry = entry = self.kv.stage(run.request_id, run.prompt_tokens, lease=False)
        outcome = await hand_over(self.kv, room, entry, self.bootstrap_timeout)
        run.answered = True
        if outcome is Handover.NOT_JOINED:
            await sink.fail(run, f"{self.name}: no decode joined bootstrap room {info.room} "
                                 f"within {self.bootstrap_timeout:g} s; its "
                                 f"{entry.num_blocks} KV blocks were dropped")
        elif outcome is not Handover.PULLED:
            await sink.fail(run, f"{self.name}: the decode left bootstrap room {info.room} "
                                 f"before the KV transfer completed")
        elif kind is FaultKind.PREFILL_FAIL_AFTER_HANDOFF:
            await sink.fail(run, run.message())
        else:
            await sink.send(Annotated(data=LLMEngineOutput(
                token_ids=[run.token], text=WORDS[run.token],
                finish_reason=FinishReason.LENGTH)))

    # --- outputs -----------------------------------------------------------------------

    @staticmethod
    def _spent(run: Prefill, completion_tokens: int) -> Usage:
        """The usage of a prefill output (``prompt_tokens_details.cached_tokens``: the
        run's prefix-cache hit)."""
        return usage(run.prompt_tokens, completion_tokens, run.cached)

    def _trace(self, request: PreprocessedRequest) -> TraceLink:
        return TraceLink(worker_id=self.name, request_id=request.request_id)

    def _handoff_output(self, request: PreprocessedRequest, entry: StagedKV,
                        run: Prefill) -> Item:
        token = TokenStream(self.seed, request.request_id).next_id()
        params = {
            "remote_engine_id": self.name,
            "remote_request_id": entry.key,
            "remote_block_ids": list(entry.block_ids),
            "remote_host": INPROC_HOST,
            "remote_port": 0,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "tp_size": 1,
        }
        return Annotated(data=LLMEngineOutput(
            token_ids=[token], text=WORDS[token], finish_reason=FinishReason.LENGTH,
            disaggregated_params=params,
            completion_usage=self._spent(run, 1),
            worker_trace_link=self._trace(request)))

    def _bootstrap_output(self, request: PreprocessedRequest, info: BootstrapInfo,
                          run: Prefill) -> Item:
        return Annotated(data=LLMEngineOutput(
            disaggregated_params=info.as_params(),
            completion_usage=self._spent(run, 0),
            worker_trace_link=self._trace(request)))

    def _terminal_output(self, run: Prefill, request: PreprocessedRequest,
                         kind: FaultKind) -> Item:
        """The first output of a prefill that ends the request (S7)."""
        spent = self._spent(run, 1 if kind is FaultKind.EOS_FIRST_TOKEN else 0)
        if kind is FaultKind.EOS_FIRST_TOKEN:
            output = LLMEngineOutput(token_ids=[run.token], text=WORDS[run.token],
                                     finish_reason=FinishReason.EOS, completion_usage=spent)
        elif kind is FaultKind.PREFILL_ERROR_FINISH:
            output = LLMEngineOutput(finish_reason=FinishReason.error(run.message()),
                                     completion_usage=spent)
        else:
            output = LLMEngineOutput(finish_reason=FinishReason.CANCELLED,
                                     completion_usage=spent)
        output.worker_trace_link = self._trace(request)
        return Annotated(data=output)


class _PrefillSink:
    """A prefill engine's outputs for one request, on its channel (the core's
    :class:`~._core.PrefillSink`)."""

    __slots__ = ("engine", "request", "send")

    def __init__(self, engine: MockPrefillEngine, request: PreprocessedRequest,
                 send: SendChannel) -> None:
        self.engine = engine
        self.request = request
        self.send = send.send

    def computed(self, run: Prefill) -> None:
        pass

    async def reset(self, run: Prefill) -> None:
        await trio.lowlevel.checkpoint()  # the stream ends with no output at all

    async def fail(self, run: Prefill, message: str) -> None:
        await self.send(Annotated.from_error(message))

    async def terminal(self, run: Prefill, kind: FaultKind) -> None:
        await self.send(self.engine._terminal_output(run, self.request, kind))

    async def first_output(self, run: Prefill, kind: FaultKind) -> None:
        """One of :data:`_TERMINAL_FIRST`'s outputs."""
        if kind is FaultKind.PREFILL_RESET:
            await self.reset(run)
        elif kind is FaultKind.PREFILL_FAIL_BEFORE_HANDOFF:
            await self.fail(run, run.message())
        else:
            await self.terminal(run, kind)

    async def before_stage(self, run: Prefill) -> bool:
        return False

    def stage_key(self, run: Prefill) -> str:
        return run.request_id

    async def handoff(self, run: Prefill, entry: StagedKV) -> None:
        await self.send(self.engine._handoff_output(self.request, entry, run))
        run.answered = True  # delivered: the KV now waits for a decode or its lease
        if run.kind is FaultKind.PREFILL_FAIL_AFTER_HANDOFF:
            run.release(entry)  # the request failed: the worker frees its KV
            await self.fail(run, run.message())
