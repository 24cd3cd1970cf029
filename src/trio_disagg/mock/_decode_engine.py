"""The in-process mock decode engine, and how it pulls KV from an in-process prefill
engine's pool (docs/protocols.md section 5)."""

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
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
)
from . import _channel as channel
from . import _pacing as pacing
from ._core import Decode, fault_message
from ._faults import FaultKind, FaultPlan
from ._kv import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BOOTSTRAP_TIMEOUT,
    BootstrapRoom,
    KVBlockPool,
    KVTransferError,
    StagedKV,
)
from ._latency import LatencyModel
from ._prefix import DEFAULT_PREFIX_CACHE_BLOCKS, PrefixCache
from ._registry import KVRegistry
from ._text import WORDS, count_prompt_tokens, resolve_max_tokens


class MockDecodeEngine:
    """An in-process decode worker that pulls KV from a :class:`MockPrefillEngine`.

    Each request: ``started()`` at once, then the KV:

    * with ``request.bootstrap_info`` (or bootstrap ``disaggregated_params`` in
      ``request.prefill_result``): join that bootstrap room on the prefill engine at that
      address and wait up to ``bootstrap_timeout`` seconds for its KV (either side may
      come first);
    * else with ``request.prefill_result``: pull the KV its ``disaggregated_params``
      name (``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``);
    * else (no handoff): compute the prefill itself, ``latency.time_to_first_token`` of
      the prompt tokens its own prefix cache (:attr:`prefix`) missed.

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
    ``cached_tokens`` must come from the prefill); without a handoff, its own prefix-cache
    hit. ``request.stream`` does not change the items.

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
        block_size: tokens per block, for the prefix cache of requests without a
            handoff.
        fault_plan: faults for requests whose body names none.
        style: reported as :attr:`handoff_style`; the engine serves both styles.
        prefix_cache_blocks: the bound of :attr:`prefix`, in blocks (0: none).

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
        prefix_cache_blocks: int = DEFAULT_PREFIX_CACHE_BLOCKS,
    ) -> None:
        if not 0.0 <= eos_rate <= 1.0:
            raise ValueError(f"eos_rate must be in [0, 1], got {eos_rate!r}")
        if default_max_tokens < 0:
            raise ValueError(f"default_max_tokens must be >= 0, got {default_max_tokens}")
        #: The prefix cache of the prefills this engine computes itself (no handoff); it
        #: checks ``block_size`` and ``prefix_cache_blocks``.
        self.prefix = PrefixCache(block_size, prefix_cache_blocks)
        self.name = name
        self.handoff_style = style
        self.bootstrap_host: str | None = None
        self.bootstrap_port: int | None = None
        self.registry = registry
        self.latency = latency if latency is not None else LatencyModel()
        self.seed = seed
        self.default_max_tokens = default_max_tokens
        self.eos_rate = eos_rate
        self.bootstrap_timeout = channel.check_seconds("bootstrap_timeout", bootstrap_timeout)
        self.block_size = block_size
        self.fault_plan = fault_plan

    def __repr__(self) -> str:
        return f"<MockDecodeEngine {self.name!r}>"

    async def generate(self, request: PreprocessedRequest, context: RequestContext,
                       send_channel: channel.SendChannel, *,
                       task_status: channel.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the decode leg of ``request``; see the class docstring.

        Raises:
            WorkerError: before ``started()``: a malformed ``"fault"`` (status 400) or a
                ``decode_reject`` fault (its status; the KV is not released, as a real
                worker that refused the request never tells the prefill). Once started,
                failures are sent as error items and nothing is raised.
        """
        with send_channel:
            fault = channel.pick_fault(request, "decode", self.fault_plan, self.name)
            stopper = channel.Stopper(context)
            task_status.started()
            # (One coroutine, not two: its frame is held for the whole stream, P3.)
            body = request.body
            run = Decode(worker=self.name, request_id=request.request_id, seed=self.seed,
                         latency=self.latency, body=body,
                         prompt_tokens=count_prompt_tokens(body),
                         max_tokens=resolve_max_tokens(request.max_tokens, body,
                                                       self.default_max_tokens),
                         fault=fault, eos_rate=self.eos_rate, prefix=self.prefix)
            # Where the KV comes from: a room, a staged key, or nowhere (no handoff).
            source = _Pull.resolve(self.registry, request, self.latency, run.prompt_tokens,
                                   self.bootstrap_timeout)
            sink = _DecodeSink(send_channel, run)
            try:
                with stopper.scope:
                    await run.run(source, sink)
                    return
                await stopper.send_cancelled(send_channel, channel.cancelled_item(
                    channel.usage(run.prompt_tokens, sink.produced, run.cached)))
            except trio.BrokenResourceError:
                # the receiver is gone: an abort. send() only half-checkpointed.
                await trio.lowlevel.checkpoint()
            finally:
                if isinstance(source, _Pull):
                    source.abandon()


class _DecodeSink:
    """A decode engine's outputs for one request, on its channel (the core's
    :class:`~._core.DecodeSink`): per token one output object and one send."""

    __slots__ = ("produced", "run", "send")

    def __init__(self, send: channel.SendChannel, run: Decode) -> None:
        self.send = send.send
        self.run = run
        self.produced = 0  # tokens sent

    async def accept(self) -> None:
        pass

    async def fail(self, message: str, *, lost_kv: bool = False) -> None:
        if lost_kv:  # typed, as an HTTP adapter reads a worker's lost handoff (B1)
            await self.send(Annotated.from_exception(WorkerError(
                message, worker=self.run.worker, handoff_lost=True)))
            return
        await self.send(Annotated.from_error(message))

    async def token(self, token: int, finish: str | None, count: int) -> None:
        if finish is None:
            await self.send(Annotated(data=LLMEngineOutput(token_ids=[token],
                                                           text=WORDS[token])))
            self.produced = count
            return
        run = self.run
        await self.send(Annotated(data=LLMEngineOutput(
            token_ids=[token], text=WORDS[token],
            finish_reason=FinishReason.EOS if finish == "stop" else FinishReason.LENGTH,
            completion_usage=channel.usage(run.prompt_tokens, count, run.cached))))

    async def end(self, count: int, finish: str) -> None:
        if count == 0:  # max_tokens == 0: nothing to generate
            run = self.run
            await self.send(Annotated(data=LLMEngineOutput(
                finish_reason=FinishReason.LENGTH,
                completion_usage=channel.usage(run.prompt_tokens, 0, run.cached))))

    async def at_fault(self, kind: FaultKind, count: int) -> None:
        if kind is FaultKind.DECODE_ERROR_AT:
            run = self.run
            await self.send(Annotated.from_error(fault_message(run.worker, kind,
                                                               run.request_id)))
        elif kind is FaultKind.DECODE_RESET_AT:
            await trio.lowlevel.checkpoint()  # the stream ends without a terminal item


class _Pull:
    """How one decode request gets its KV, and how it lets go of it if it never does."""

    __slots__ = ("block_ids", "delay", "entry", "key", "pool", "pulled", "room", "timeout")

    def __init__(self, pool: KVBlockPool, *, key: str | None = None,
                 block_ids: list[int] | None = None, room: BootstrapRoom | None = None,
                 delay: float = 0.0, timeout: float = 0.0) -> None:
        self.pool = pool
        self.delay = delay  # seconds the transfer takes
        self.timeout = timeout  # seconds to wait for a room's KV
        self.key = key
        self.block_ids = block_ids
        self.room = room
        self.entry: StagedKV | None = None
        self.pulled = False

    @classmethod
    def resolve(cls, registry: KVRegistry, request: PreprocessedRequest,
                latency: LatencyModel, prompt_tokens: int, timeout: float
                ) -> _Pull | str | None:
        """A pull for the request's handoff; None without one; an error message if the
        handoff cannot be used."""
        delay = latency.kv_transfer_time(prompt_tokens)
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
                return cls(pool, room=room, delay=delay, timeout=timeout)
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
            return cls(registry.pool(engine_id), key=key, block_ids=block_ids, delay=delay)
        except KVTransferError as exc:
            return str(exc)

    async def pull(self) -> str | None:
        """Wait for a room's KV (either side may come first), claim it, transfer it.

        Returns:
            None once pulled, else why not (having let go of the KV).
        """
        if self.room is not None:
            with trio.move_on_after(self.timeout):
                await self.room.wait_staged()
        error = self.claim(self.timeout)
        if error is not None:
            self.abandon()
            return error
        if self.delay > 0:
            await pacing.sleep(self.delay)
        self.complete()
        return None

    async def release(self) -> None:
        """:meth:`abandon`, as the core's :class:`~._core.KVSource` asks."""
        self.abandon()

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
