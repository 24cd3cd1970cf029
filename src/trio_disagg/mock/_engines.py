"""In-process mock prefill and decode engines (docs/protocols.md section 5).

They implement :class:`~trio_disagg.Engine` over trio memory channels, with the latency,
KV lifetime and failure behaviour of the real workers where it matters to the router:
a vLLM-like sequential handoff or an SGLang-like bootstrap room, KV blocks held on the
prefill side until a decode pulls them or their lease expires, a decode that really pulls
before it produces tokens, and faults injected per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from .._context import RequestContext
from .._engine import HandoffStyle
from .._errors import WorkerError
from .._protocols import (
    Annotated,
    BootstrapInfo,
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    PromptTokensDetails,
    TraceLink,
)
from ._faults import Fault, FaultKind, FaultPlan, fault_for
from ._kv import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BOOTSTRAP_TIMEOUT,
    DEFAULT_KV_TTL,
    BootstrapRoom,
    KVBlockPool,
    KVCounters,
    KVState,
    KVTransferError,
    StagedKV,
)
from ._latency import LatencyModel
from ._registry import KVRegistry
from ._text import (
    WORDS,
    TokenStream,
    cached_prompt_tokens,
    count_prompt_tokens,
    resolve_max_tokens,
)

Item = Annotated[LLMEngineOutput]
SendChannel = trio.MemorySendChannel[Annotated[LLMEngineOutput]]

#: ``remote_host`` of an in-process handoff.
INPROC_HOST = "inproc"

_TERMINAL_FIRST = frozenset({
    FaultKind.PREFILL_FAIL_BEFORE_HANDOFF, FaultKind.PREFILL_ERROR_FINISH,
    FaultKind.PREFILL_CANCELLED_FINISH, FaultKind.EOS_FIRST_TOKEN, FaultKind.PREFILL_RESET,
})


class _Stopper:
    """Connects one request's context to its cancel scope (one object and one scope per
    request, nothing per token): a stop or a kill cancels :attr:`scope`; after a stop,
    :meth:`send_cancelled` sends the ``cancelled`` finish unless a kill comes first."""

    __slots__ = ("_context", "_kill_scope", "scope")

    def __init__(self, context: RequestContext) -> None:
        self.scope = trio.CancelScope()
        self._kill_scope: trio.CancelScope | None = None
        self._context = context
        context.on_stop(self)

    def __call__(self, killed: bool) -> None:
        self.scope.cancel()
        if killed and self._kill_scope is not None:
            self._kill_scope.cancel()

    async def send_cancelled(self, send: SendChannel, item: Item) -> None:
        """Send the ``cancelled`` finish of a stopped request; a kill (before or during
        the send) drops it."""
        self._kill_scope = trio.CancelScope()
        if self._context.is_killed:
            self._kill_scope.cancel()
        with self._kill_scope:
            await send.send(item)


def _check_seconds(name: str, value: float) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
    return value


def _pick_fault(request: PreprocessedRequest, role: str, plan: FaultPlan | None,
                worker: str) -> Fault | None:
    try:
        fault = fault_for(request.body, role, request.request_id, plan)
    except ValueError as exc:
        raise WorkerError(f"{worker}: {exc}", status=400, worker=worker) from None
    if fault is not None and fault.kind in (FaultKind.PREFILL_REJECT, FaultKind.DECODE_REJECT):
        raise WorkerError(f"{worker} refused request {request.request_id!r} "
                          f"(injected fault {fault})", status=fault.status or 503,
                          worker=worker)
    return fault


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None
           ) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=(None if cached_tokens is None
                               else PromptTokensDetails(cached_tokens=cached_tokens)))


def _cancelled(usage: CompletionUsage | None = None) -> Item:
    return Annotated(data=LLMEngineOutput(finish_reason=FinishReason.CANCELLED,
                                          completion_usage=usage))


class MockPrefillEngine:
    """An in-process prefill worker with KV block accounting.

    Each request: ``started()`` at once (the worker accepted it), then prefill compute
    for ``latency.time_to_first_token(prompt tokens)`` seconds, then the handoff:

    * ``HandoffStyle.SEQUENTIAL`` (vLLM): the KV is staged in :attr:`kv` under the request
      id and ONE output is sent: one token, ``finish_reason`` length, usage with
      ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens`` (a deterministic
      prefix-cache hit), and ``disaggregated_params`` = ``{"remote_engine_id": name,
      "remote_request_id", "remote_block_ids", "remote_host": "inproc", "remote_port": 0,
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
        seed: fixes the tokens (with the request id) and prefix-cache hits.
        block_size: tokens per KV block.
        kv_ttl: seconds staged KV waits for its decode (sequential style).
        bootstrap_timeout: seconds to wait for the decode to join a bootstrap room.
        bootstrap_host: for the bootstrap style, the host the router puts in
            ``bootstrap_info``.
        bootstrap_port: for the bootstrap style; default: the next port of ``registry``
            from 8998.
        fault_plan: faults for requests whose body names none.

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
    ) -> None:
        self.name = name
        self.handoff_style = style
        self.registry = registry
        self.latency = latency if latency is not None else LatencyModel()
        self.seed = seed
        self.bootstrap_timeout = _check_seconds("bootstrap_timeout", bootstrap_timeout)
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

    async def generate(  # noqa: ASYNC114 (started by the router)
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: SendChannel,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve the prefill leg of ``request``; see the class docstring.

        Raises:
            WorkerError: before ``started()``: a malformed ``"fault"`` (status 400), a
                ``prefill_reject`` fault (its status), or for the bootstrap style a
                request without ``bootstrap_info`` for this engine (400). Once started,
                failures are sent as error items and nothing is raised.
        """
        with send_channel:
            fault = _pick_fault(request, "prefill", self.fault_plan, self.name)
            kind = fault.kind if fault is not None else None
            if self.handoff_style is HandoffStyle.BOOTSTRAP:
                info = request.bootstrap_info
                if info is None:
                    raise WorkerError(f"{self.name} is a bootstrap prefill engine: the "
                                      f"request needs bootstrap_info", status=400,
                                      worker=self.name)
                if (info.host, info.port) != (self.bootstrap_host, self.bootstrap_port):
                    raise WorkerError(
                        f"{self.name} bootstraps at {self.bootstrap_host}:"
                        f"{self.bootstrap_port}, not {info.host}:{info.port}",
                        status=400, worker=self.name)
                stopper = _Stopper(context)
                task_status.started()
                await self._bootstrap(request, info, send_channel, kind, stopper)
            else:
                stopper = _Stopper(context)
                task_status.started()
                await self._sequential(request, send_channel, kind, stopper)

    # --- the two styles ----------------------------------------------------------------

    async def _sequential(self, request: PreprocessedRequest, send: SendChannel,
                          kind: FaultKind | None, stopper: _Stopper) -> None:
        kv = self.kv
        prompt_tokens = count_prompt_tokens(request.body)
        entry: StagedKV | None = None
        done = False  # ended on its own: not an abort
        try:
            with stopper.scope:
                await trio.lowlevel.checkpoint_if_cancelled()
                if kind is FaultKind.PREFILL_STALL:
                    await trio.sleep_forever()
                if (delay := self.latency.time_to_first_token(prompt_tokens)) > 0:
                    await trio.sleep(delay)
                if kind in _TERMINAL_FIRST:
                    assert kind is not None
                    await self._send_terminal_first(request, send, kind, prompt_tokens)
                    done = True
                    return
                entry = kv.stage(request.request_id, prompt_tokens)
                await send.send(self._handoff_output(request, entry, prompt_tokens))
                done = True  # delivered: the KV now waits for a decode or its lease
                if kind is FaultKind.PREFILL_FAIL_AFTER_HANDOFF:
                    kv.release(entry)  # the request failed: the worker frees its KV
                    await send.send(self._fault_error(kind, request))
                return
            if not done:
                self._abort(entry)
                done = True
            await stopper.send_cancelled(send, _cancelled())
        except trio.BrokenResourceError:
            # the receiver is gone: an abort. send() only half-checkpointed before raising.
            await trio.lowlevel.checkpoint()
        finally:
            if not done:
                self._abort(entry)

    async def _bootstrap(self, request: PreprocessedRequest, info: BootstrapInfo,
                         send: SendChannel, kind: FaultKind | None, stopper: _Stopper) -> None:
        kv = self.kv
        prompt_tokens = count_prompt_tokens(request.body)
        room: BootstrapRoom | None = None
        problem: str | None = None
        try:
            candidate = kv.room(info.room)
            candidate.enter("prefill")
            room = candidate
        except KVTransferError as exc:
            problem = f"{self.name}: {exc}"
        entry: StagedKV | None = None
        done = False
        try:
            with stopper.scope:
                await trio.lowlevel.checkpoint_if_cancelled()
                if room is None:
                    done = True
                    await send.send(Annotated.from_error(problem or "no bootstrap room"))
                    return
                if kind is FaultKind.PREFILL_STALL:
                    await trio.sleep_forever()
                if kind in _TERMINAL_FIRST:
                    assert kind is not None
                    if (delay := self.latency.time_to_first_token(prompt_tokens)) > 0:
                        await trio.sleep(delay)
                    await self._send_terminal_first(request, send, kind, prompt_tokens)
                    done = True
                    return
                await send.send(self._bootstrap_output(request, info, prompt_tokens))
                if (delay := self.latency.time_to_first_token(prompt_tokens)) > 0:
                    await trio.sleep(delay)
                entry = kv.stage(request.request_id, prompt_tokens, lease=False)
                room.put(entry)
                with trio.move_on_after(self.bootstrap_timeout):
                    await room.wait_joined()
                if not room.joined:
                    kv.strand(entry)
                    done = True
                    await send.send(Annotated.from_error(
                        f"{self.name}: no decode joined bootstrap room {info.room} within "
                        f"{self.bootstrap_timeout:g} s; its {entry.num_blocks} KV blocks "
                        f"were dropped"))
                    return
                await room.wait_finished()
                done = True
                if not room.pulled:
                    kv.release(entry)  # normally already released by the decode
                    await send.send(Annotated.from_error(
                        f"{self.name}: the decode left bootstrap room {info.room} before "
                        f"the KV transfer completed"))
                    return
                if kind is FaultKind.PREFILL_FAIL_AFTER_HANDOFF:
                    await send.send(self._fault_error(kind, request))
                    return
                token = TokenStream(self.seed, request.request_id).next_id()
                await send.send(Annotated(data=LLMEngineOutput(
                    token_ids=[token], text=WORDS[token],
                    finish_reason=FinishReason.LENGTH)))
                return
            if not done:
                self._abort(entry)
                done = True
            await stopper.send_cancelled(send, _cancelled())
        except trio.BrokenResourceError:
            # the receiver is gone: an abort. send() only half-checkpointed before raising.
            await trio.lowlevel.checkpoint()
        finally:
            if not done:
                self._abort(entry)
            if room is not None:
                room.leave("prefill")

    def _abort(self, entry: StagedKV | None) -> None:
        # Count one abort: release the KV if it still waits (a transfer in progress
        # belongs to the decode), or note an abort with nothing staged.
        if entry is None or entry.state is not KVState.HELD or not self.kv.release(entry):
            self.kv.note_aborted()

    # --- outputs -----------------------------------------------------------------------

    def _usage(self, request: PreprocessedRequest, prompt_tokens: int,
               completion_tokens: int) -> CompletionUsage:
        cached = cached_prompt_tokens(self.seed, request.body, prompt_tokens,
                                      self.kv.block_size)
        return _usage(prompt_tokens, completion_tokens, cached)

    def _trace(self, request: PreprocessedRequest) -> TraceLink:
        return TraceLink(worker_id=self.name, request_id=request.request_id)

    def _handoff_output(self, request: PreprocessedRequest, entry: StagedKV,
                        prompt_tokens: int) -> Item:
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
            completion_usage=self._usage(request, prompt_tokens, 1),
            worker_trace_link=self._trace(request)))

    def _bootstrap_output(self, request: PreprocessedRequest, info: BootstrapInfo,
                          prompt_tokens: int) -> Item:
        return Annotated(data=LLMEngineOutput(
            disaggregated_params=info.as_params(),
            completion_usage=self._usage(request, prompt_tokens, 0),
            worker_trace_link=self._trace(request)))

    def _fault_error(self, kind: FaultKind, request: PreprocessedRequest) -> Item:
        return Annotated.from_error(f"{self.name}: injected fault {kind.value} on request "
                                    f"{request.request_id!r}")

    async def _send_terminal_first(self, request: PreprocessedRequest, send: SendChannel,
                                   kind: FaultKind, prompt_tokens: int) -> None:
        if kind is FaultKind.PREFILL_RESET:
            await trio.lowlevel.checkpoint()
            return  # the stream ends with no output at all
        if kind is FaultKind.PREFILL_FAIL_BEFORE_HANDOFF:
            await send.send(self._fault_error(kind, request))
            return
        if kind is FaultKind.EOS_FIRST_TOKEN:
            token = TokenStream(self.seed, request.request_id).next_id()
            output = LLMEngineOutput(token_ids=[token], text=WORDS[token],
                                     finish_reason=FinishReason.EOS,
                                     completion_usage=self._usage(request, prompt_tokens, 1))
        elif kind is FaultKind.PREFILL_ERROR_FINISH:
            output = LLMEngineOutput(
                finish_reason=FinishReason.error(
                    f"{self.name}: injected fault {kind.value} on request "
                    f"{request.request_id!r}"),
                completion_usage=self._usage(request, prompt_tokens, 0))
        else:
            output = LLMEngineOutput(finish_reason=FinishReason.CANCELLED,
                                     completion_usage=self._usage(request, prompt_tokens, 0))
        output.worker_trace_link = self._trace(request)
        await send.send(Annotated(data=output))


class MockDecodeEngine:
    """An in-process decode worker that pulls KV from a :class:`MockPrefillEngine`.

    Each request: ``started()`` at once, then the KV:

    * with ``request.bootstrap_info`` (or bootstrap ``disaggregated_params`` in
      ``request.prefill_result``): join that bootstrap room on the prefill engine at that
      address and wait up to ``bootstrap_timeout`` seconds for its KV (either side may
      come first);
    * else with ``request.prefill_result``: pull the KV its ``disaggregated_params``
      name (``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``);
    * else (no handoff): compute the prefill itself, ``latency.time_to_first_token``.

    A pull takes ``latency.kv_transfer_time(prompt tokens)`` seconds and then frees the
    prefill's blocks. KV that is gone (expired, already pulled, released, unknown) or a
    bootstrap wait that runs out ends the stream with one error item.

    Then ``max_tokens`` tokens (``request.max_tokens``, else the body's
    ``max_completion_tokens`` / ``max_tokens``, else ``default_max_tokens``), one per
    output item, ``latency.inter_token_latency`` seconds apart, with ``text`` (pseudo-words
    fixed by ``seed`` and the request id). The last item has ``finish_reason`` length (or
    eos, with probability ``eos_rate`` per token after the first) and the usage:
    ``prompt_tokens``, ``completion_tokens``, ``total_tokens``, and ``cached_tokens`` =
    the whole prompt after a pull, as a real decode worker reports it (the client's
    ``cached_tokens`` must come from the prefill). ``request.stream`` does not change
    the items.

    Cancellation: ``context.stop_generating()`` ends the stream with one ``cancelled``
    item (with the usage so far); ``context.kill()`` ends it at once; a closed receiver
    or a cancelled caller ends it silently. Whichever it is, KV the decode was sent for and
    has not yet pulled is released at once (vLLM: "if the decode worker receives the
    request and it is aborted before it runs, it tells the prefill worker to free them"),
    and a transfer in progress is abandoned and its blocks freed.

    Args:
        registry: where the prefill engines' pools are found.
        name: shown in errors and trace links.
        latency: the :class:`LatencyModel`; default ``LatencyModel()``.
        seed: fixes the tokens, with the request id.
        default_max_tokens: tokens to generate when the request sets no budget.
        eos_rate: probability, per token after the first, of ending on eos; 0 to always
            generate the whole budget.
        bootstrap_timeout: seconds to wait for the prefill's KV in a bootstrap room.
        block_size: tokens per block, for the prefix-cache hit of a request without a
            handoff.
        fault_plan: faults for requests whose body names none.
        style: reported as :attr:`handoff_style`; the engine serves both styles.

    Raises:
        ValueError: a bad setting.
    """

    def __init__(
        self,
        registry: KVRegistry,
        name: str = "decode-0",
        *,
        latency: LatencyModel | None = None,
        seed: int = 0,
        default_max_tokens: int = 16,
        eos_rate: float = 0.0,
        bootstrap_timeout: float = DEFAULT_BOOTSTRAP_TIMEOUT,
        block_size: int = DEFAULT_BLOCK_SIZE,
        fault_plan: FaultPlan | None = None,
        style: HandoffStyle = HandoffStyle.SEQUENTIAL,
    ) -> None:
        if not 0.0 <= eos_rate <= 1.0:
            raise ValueError(f"eos_rate must be in [0, 1], got {eos_rate!r}")
        if default_max_tokens < 0:
            raise ValueError(f"default_max_tokens must be >= 0, got {default_max_tokens}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        self.name = name
        self.handoff_style = style
        self.bootstrap_host: str | None = None
        self.bootstrap_port: int | None = None
        self.registry = registry
        self.latency = latency if latency is not None else LatencyModel()
        self.seed = seed
        self.default_max_tokens = default_max_tokens
        self.eos_rate = eos_rate
        self.bootstrap_timeout = _check_seconds("bootstrap_timeout", bootstrap_timeout)
        self.block_size = block_size
        self.fault_plan = fault_plan

    def __repr__(self) -> str:
        return f"<MockDecodeEngine {self.name!r}>"

    async def generate(  # noqa: ASYNC114 (started by the router)
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: SendChannel,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve the decode leg of ``request``; see the class docstring.

        Raises:
            WorkerError: before ``started()``: a malformed ``"fault"`` (status 400) or a
                ``decode_reject`` fault (its status; the KV is not released, as a real
                worker that refused the request never tells the prefill). Once started,
                failures are sent as error items and nothing is raised.
        """
        with send_channel:
            fault = _pick_fault(request, "decode", self.fault_plan, self.name)
            stopper = _Stopper(context)
            task_status.started()
            try:
                await self._run(request, send_channel, fault, stopper)
            except trio.BrokenResourceError:
                # the receiver is gone: an abort. send() only half-checkpointed.
                await trio.lowlevel.checkpoint()

    async def _run(self, request: PreprocessedRequest, send: SendChannel,
                   fault: Fault | None, stopper: _Stopper) -> None:
        kind = fault.kind if fault is not None else None
        fault_at = fault.at if fault is not None and fault.at is not None else -1
        body = request.body
        prompt_tokens = count_prompt_tokens(body)
        max_tokens = resolve_max_tokens(request.max_tokens, body, self.default_max_tokens)
        # Where the KV comes from: a room, a staged key, or nowhere (no handoff).
        resolved = _Pull.resolve(self.registry, request)
        pull = resolved if not isinstance(resolved, str) else None
        produced = 0
        cached: int | None = None
        try:
            with stopper.scope:
                await trio.lowlevel.checkpoint_if_cancelled()
                if isinstance(resolved, str):
                    await send.send(Annotated.from_error(f"{self.name}: {resolved}"))
                    return
                if kind is FaultKind.DECODE_STALL:
                    await trio.sleep_forever()  # queued: the KV waits, unpulled
                if kind is FaultKind.DECODE_FAIL_BEFORE_FIRST_TOKEN:
                    if pull is not None:
                        pull.abandon()
                    await send.send(Annotated.from_error(
                        f"{self.name}: injected fault {kind.value} on request "
                        f"{request.request_id!r}"))
                    return
                if pull is not None:
                    if pull.room is not None:  # either side may come first
                        with trio.move_on_after(self.bootstrap_timeout):
                            await pull.room.wait_staged()
                    error = pull.claim(self.bootstrap_timeout)
                    if error is not None:
                        await send.send(Annotated.from_error(f"{self.name}: {error}"))
                        return
                    if (delay := self.latency.kv_transfer_time(prompt_tokens)) > 0:
                        await trio.sleep(delay)
                    pull.complete()
                    cached = prompt_tokens  # the decode sees the whole prompt cached
                else:
                    if (delay := self.latency.time_to_first_token(prompt_tokens)) > 0:
                        await trio.sleep(delay)
                    cached = cached_prompt_tokens(self.seed, body, prompt_tokens,
                                                  self.block_size)
                    if kind is FaultKind.EOS_FIRST_TOKEN and max_tokens > 0:
                        max_tokens = 1
                # The token loop: per token one sleep if the latency is not 0, one
                # output object, one send. Nothing else.
                tokens = TokenStream(self.seed, request.request_id)
                itl = self.latency.inter_token_latency
                eos_rate = self.eos_rate
                eos_first = kind is FaultKind.EOS_FIRST_TOKEN and pull is None
                last = max_tokens - 1
                for i in range(max_tokens):
                    if i == fault_at:
                        await self._fault_at(kind, request, send)
                        return
                    if itl > 0:
                        await trio.sleep(itl)
                    token = tokens.next_id()
                    if i == last:
                        finish = FinishReason.EOS if eos_first else FinishReason.LENGTH
                    elif eos_rate and i and tokens.next_unit() < eos_rate:
                        finish = FinishReason.EOS
                    else:
                        await send.send(Annotated(data=LLMEngineOutput(
                            token_ids=[token], text=WORDS[token])))
                        produced = i + 1
                        continue
                    await send.send(Annotated(data=LLMEngineOutput(
                        token_ids=[token], text=WORDS[token], finish_reason=finish,
                        completion_usage=_usage(prompt_tokens, i + 1, cached))))
                    return
                # max_tokens == 0: nothing to generate
                await send.send(Annotated(data=LLMEngineOutput(
                    finish_reason=FinishReason.LENGTH,
                    completion_usage=_usage(prompt_tokens, 0, cached))))
                return
            if pull is not None:
                pull.abandon()
            await stopper.send_cancelled(send, _cancelled(_usage(prompt_tokens, produced, cached)))
        finally:
            if pull is not None:
                pull.abandon()

    async def _fault_at(self, kind: FaultKind | None, request: PreprocessedRequest,
                        send: SendChannel) -> None:
        if kind is FaultKind.DECODE_ERROR_AT:
            await send.send(Annotated.from_error(
                f"{self.name}: injected fault {kind.value} on request {request.request_id!r}"))
        elif kind is FaultKind.DECODE_STALL_AT:
            await trio.sleep_forever()
        else:  # DECODE_RESET_AT: the stream ends without a terminal item
            await trio.lowlevel.checkpoint()


class _Pull:
    """How one decode request gets its KV, and how it lets go of it if it never does."""

    __slots__ = ("block_ids", "entry", "key", "pool", "pulled", "room")

    def __init__(self, pool: KVBlockPool, *, key: str | None = None,
                 block_ids: list[int] | None = None, room: BootstrapRoom | None = None
                 ) -> None:
        self.pool = pool
        self.key = key
        self.block_ids = block_ids
        self.room = room
        self.entry: StagedKV | None = None
        self.pulled = False

    @classmethod
    def resolve(cls, registry: KVRegistry, request: PreprocessedRequest) -> _Pull | str | None:
        """A pull for the request's handoff; None without one; an error message if the
        handoff cannot be used."""
        info = request.bootstrap_info
        params: Any = None
        if request.prefill_result is not None:
            params = request.prefill_result.disaggregated_params
        if info is None and isinstance(params, Mapping) and all(
                k in params for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")):
            host, port, room_id = (params["bootstrap_host"], params["bootstrap_port"],
                                   params["bootstrap_room"])
            if not (isinstance(host, str) and isinstance(port, int)
                    and isinstance(room_id, int)):
                return f"malformed bootstrap params {dict(params)!r}"
            info = BootstrapInfo(host=host, port=port, room=room_id)
        try:
            if info is not None:
                pool = registry.pool_at(info.host, info.port)
                room = pool.room(info.room)
                room.enter("decode")
                return cls(pool, room=room)
            if request.prefill_result is None:
                return None
            if not isinstance(params, Mapping):
                return f"disaggregated_params must be an object, got {type(params).__name__}"
            engine_id = params.get("remote_engine_id")
            key = params.get("remote_request_id")
            block_ids = params.get("remote_block_ids")
            if not isinstance(engine_id, str) or not isinstance(key, str):
                return ("disaggregated_params need remote_engine_id and remote_request_id "
                        f"strings, got {engine_id!r} and {key!r}")
            if block_ids is not None and not (
                    isinstance(block_ids, list) and all(isinstance(b, int) for b in block_ids)):
                return f"remote_block_ids must be a list of integers, got {block_ids!r:.60}"
            return cls(registry.pool(engine_id), key=key, block_ids=block_ids)
        except KVTransferError as exc:
            return str(exc)

    def claim(self, bootstrap_timeout: float) -> str | None:
        """Claim the KV (for a room, once the wait for it is over): it is now ours to
        transfer, then :meth:`complete` or :meth:`abandon`.

        Returns:
            None once claimed, else why the KV cannot be pulled.
        """
        try:
            if self.room is not None:
                entry = self.room.entry
                if entry is None:
                    return (f"the prefill never staged KV in bootstrap room "
                            f"{self.room.room_id} within {bootstrap_timeout:g} s")
                self.pool.claim_entry(entry)
            else:
                assert self.key is not None
                entry = self.pool.claim(self.key, self.block_ids)
        except KVTransferError as exc:
            return f"cannot pull the KV: {exc}"
        self.entry = entry
        return None

    def complete(self) -> None:
        """The transfer is over: the prefill's blocks are freed, the request served."""
        assert self.entry is not None
        self.pool.complete(self.entry)
        self.pulled = True
        if self.room is not None:
            self.room.finish(pulled=True)
            self.room.leave("decode")

    def abandon(self) -> None:
        """Let go of KV not pulled: release it (counted aborted) and leave the room.
        Idempotent; nothing happens after a completed pull."""
        if self.pulled:
            return
        entry = self.entry
        if entry is not None and entry.is_held:
            self.pool.release(entry)  # a transfer in progress, abandoned
        elif entry is None and self.key is not None:
            self.pool.release_key(self.key)
        if self.room is not None:
            self.room.leave("decode")
        self.pulled = True  # nothing more to let go of
