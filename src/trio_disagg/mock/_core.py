"""The simulator's behaviour, written once: what a mock prefill and a mock decode do, in
which order, and where each fault strikes (docs/protocols.md section 5).

It knows no channel, socket or wire format. Each face (the in-process engines of
:mod:`._engines`, the HTTP workers of :mod:`._worker` and its protocols) hands it a *sink*
that turns its steps into outputs: an :class:`~trio_disagg.LLMEngineOutput` on a memory
channel, or bytes of an HTTP answer. Time passes here (the latency model's sleeps); KV is
staged, pulled and released here, on a :class:`~._kv.KVBlockPool` or through a
:class:`KVSource`.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import attrs
import trio

from . import _pacing as pacing
from ._faults import Fault, FaultKind
from ._kv import BootstrapRoom, KVBlockPool, KVState, StagedKV
from ._latency import LatencyModel
from ._prefix import PrefixCache
from ._text import TokenStream

#: Seconds a decode spends, at most, letting go of KV it will never pull.
RELEASE_TIMEOUT = 2.0

#: The prefill faults whose first output is the final answer (S7): the finish they send.
TERMINAL_FINISH = {
    FaultKind.EOS_FIRST_TOKEN: "stop",
    FaultKind.PREFILL_ERROR_FINISH: "error",
    FaultKind.PREFILL_CANCELLED_FINISH: "abort",
}


def fault_message(worker: str, kind: FaultKind, request_id: str, note: str = "") -> str:
    """The error message of an injected fault, as every face words it."""
    tail = f" ({note})" if note else ""
    return f"{worker}: injected fault {kind.value} on request {request_id!r}{tail}"


# --- the token loop ----------------------------------------------------------------------


class TokenSink(Protocol):
    """Where the token loop's tokens go."""

    async def token(self, token: int, finish: str | None, count: int) -> None:
        """One token; ``finish`` (``"length"`` or ``"stop"``) on the last; ``count``
        tokens so far, this one included."""

    async def end(self, count: int, finish: str) -> None:
        """The loop is over after ``count`` tokens (0: no token at all)."""

    async def at_fault(self, kind: FaultKind, count: int) -> None:
        """A ``decode_*_at`` fault strikes after ``count`` tokens: send the error, or cut
        the stream (``decode_reset_at``); for ``decode_stall_at`` the loop then waits
        forever."""


@attrs.frozen(kw_only=True)
class TokenPlan:
    """What one decode generates.

    Attributes:
        seed, request_id: fix the tokens (:class:`~._text.TokenStream`).
        max_tokens: the budget, in tokens.
        itl: seconds between two tokens.
        eos_first: the last token finishes ``"stop"`` (EOS) instead of ``"length"``.
        eos_rate: probability, per token after the first, of ending on EOS.
        fault: a ``decode_*_at`` fault, or None.
        fault_at: the token count at which it strikes (-1: never).
    """

    seed: int
    request_id: str
    max_tokens: int
    itl: float = 0.0
    eos_first: bool = False
    eos_rate: float = 0.0
    fault: FaultKind | None = None
    fault_at: int = -1


async def generate_tokens(plan: TokenPlan, sink: TokenSink) -> None:
    """The token loop: per token one wait on the mock's clock if the latency is not 0, one
    :meth:`TokenSink.token`. Nothing else."""
    tokens = TokenStream(plan.seed, plan.request_id)
    itl = plan.itl
    eos_rate = plan.eos_rate
    last = plan.max_tokens - 1
    final = "stop" if plan.eos_first else "length"
    for i in range(plan.max_tokens):
        if i == plan.fault_at:
            assert plan.fault is not None
            await sink.at_fault(plan.fault, i)
            if plan.fault is FaultKind.DECODE_STALL_AT:
                await trio.sleep_forever()
            return
        if itl > 0:
            await pacing.sleep(itl)
        token = tokens.next_id()
        if i == last:
            finish = final
        elif eos_rate and i and tokens.next_unit() < eos_rate:
            finish = "stop"
        else:
            await sink.token(token, None, i + 1)
            continue
        await sink.token(token, finish, i + 1)
        await sink.end(i + 1, finish)
        return
    await sink.end(0, "length")


# --- the decode ----------------------------------------------------------------------------


class KVSource(Protocol):
    """Where one decode request gets its KV from: a pool in the same process, a prefill
    worker over HTTP, a bootstrap room."""

    async def pull(self) -> str | None:
        """Transfer the KV. Returns None once pulled, else why it failed (having let go
        of the KV). Cancelled, it lets go of nothing: :meth:`release` follows."""

    async def release(self) -> None:
        """Let go of KV this decode will never pull (bounded by the caller's shielded
        scope of :data:`RELEASE_TIMEOUT` seconds)."""


class DecodeSink(TokenSink, Protocol):
    """Where a decode's answer goes."""

    async def accept(self) -> None:
        """The request is accepted (a streamed answer's headers may go out)."""

    async def fail(self, message: str, *, lost_kv: bool = False) -> None:
        """The decode fails with ``message``; ``lost_kv``: its handoff's KV could not be
        pulled (gone, or never staged), as a worker reports a lost handoff."""


async def let_go(source: KVSource) -> None:
    """Release ``source``'s KV, shielded and bounded by :data:`RELEASE_TIMEOUT`."""
    with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
        await source.release()


@attrs.define(kw_only=True)
class Decode:
    """One decode request's behaviour: the KV first (pulled from ``source``, or the
    prefill computed here), then the tokens.

    Attributes:
        worker: the worker's name, for messages.
        request_id: the request's id (fixes its tokens with ``seed``).
        seed: fixes the tokens.
        latency: the latency model.
        body: the request body (its prompt, for the prefix-cache hit).
        prompt_tokens: the prompt's length in tokens.
        max_tokens: the completion budget in tokens.
        fault: the request's decode fault (``eos_first_token`` included), or None.
        min_tokens: tokens EOS may not cut short.
        eos_with_handoff: honour ``eos_first_token`` after a handoff too.
        eos_rate: per token after the first, the probability of ending on EOS.
        release_unpulled: an aborted decode lets go of KV it never pulled.
        queue_seconds: seconds queued, accepted, before the pull (``decode_queue``).
        prefix: the worker's prefix cache, for a prefill computed here (no handoff);
            None: nothing is ever cached.
        cached: set once known: the prompt tokens found in cache (all of them after a
            pull; else the leading blocks ``prefix`` held).
    """

    worker: str
    request_id: str
    seed: int
    latency: LatencyModel
    body: Mapping[str, Any]
    prompt_tokens: int
    max_tokens: int
    fault: Fault | None = None
    min_tokens: int = 0
    eos_with_handoff: bool = False
    eos_rate: float = 0.0
    release_unpulled: bool = True
    queue_seconds: float | None = None
    prefix: PrefixCache | None = None
    cached: int | None = None

    async def run(self, source: KVSource | str | None, sink: DecodeSink) -> None:
        """Serve the decode: ``source`` is where its KV is, a message if its handoff
        cannot be used, or None (no handoff: the prefill is computed here)."""
        kind = self.fault.kind if self.fault is not None else None
        pending = source is not None and not isinstance(source, str)
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            await sink.accept()
            if isinstance(source, str):
                await sink.fail(f"{self.worker}: {source}")
                return
            if kind is FaultKind.DECODE_STALL:
                await trio.sleep_forever()  # queued: the KV waits, unpulled
            if self.queue_seconds is not None:
                await pacing.sleep(self.queue_seconds)  # queued, then the pull
            if kind is FaultKind.DECODE_FAIL_BEFORE_FIRST_TOKEN:
                if source is not None:
                    pending = False
                    await let_go(source)
                await sink.fail(fault_message(self.worker, kind, self.request_id))
                return
            if source is not None:
                error = await source.pull()
                pending = False
                if error is not None:  # (worded as the adapters read a lost handoff)
                    await sink.fail(f"KV transfer failed: {self.worker}: {error}",
                                    lost_kv=True)
                    return
                self.cached = self.prompt_tokens  # the decode sees the whole prompt cached
                eos_first = self.eos_with_handoff and kind is FaultKind.EOS_FIRST_TOKEN
            else:
                await self._compute()
                eos_first = kind is FaultKind.EOS_FIRST_TOKEN
            await generate_tokens(self._plan(eos_first), sink)
        finally:
            if pending and self.release_unpulled:  # aborted before the pull
                assert source is not None and not isinstance(source, str)
                with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
                    await source.release()

    async def _compute(self) -> None:
        """The prefill computed here: only the tokens the prefix cache misses take time."""
        prefix = self.prefix
        hashes = prefix.hashes(self.body) if prefix is not None else []
        self.cached = cached = (prefix.lookup(hashes, self.prompt_tokens)
                                if prefix is not None else 0)
        if (delay := self.latency.time_to_first_token(self.prompt_tokens - cached)) > 0:
            await pacing.sleep(delay)
        if prefix is not None:
            prefix.insert(hashes)

    def _plan(self, eos_first: bool) -> TokenPlan:
        # EOS comes first of all, or right after the min_tokens it may not cut short
        max_tokens = self.max_tokens
        eos_at = self.min_tokens + 1
        if eos_first and 0 < eos_at <= max_tokens:
            max_tokens = eos_at
        else:
            eos_first = False
        fault = self.fault
        at = fault.at if fault is not None and fault.at is not None else -1
        return TokenPlan(seed=self.seed, request_id=self.request_id, max_tokens=max_tokens,
                         itl=self.latency.inter_token_latency, eos_first=eos_first,
                         eos_rate=self.eos_rate, fault=fault.kind if fault else None,
                         fault_at=at)


# --- the prefill (sequential handoff) ------------------------------------------------------


class PrefillSink(Protocol):
    """Where a sequential prefill's answer goes. Each answer may set
    :attr:`Prefill.answered` where it commits."""

    def computed(self, run: Prefill) -> None:
        """The prefill computation ran to its end."""

    async def reset(self, run: Prefill) -> None:
        """``prefill_reset``: end without an answer."""

    async def fail(self, run: Prefill, message: str) -> None:
        """Fail with ``message`` (nothing staged)."""

    async def terminal(self, run: Prefill, kind: FaultKind) -> None:
        """The first output ends the request (S7): ``kind`` is in :data:`TERMINAL_FINISH`."""

    async def before_stage(self, run: Prefill) -> bool:
        """A face's own answer instead of a handoff (nothing staged); True if it
        answered."""

    def stage_key(self, run: Prefill) -> str:
        """The key to stage the KV under."""

    async def handoff(self, run: Prefill, entry: StagedKV) -> None:
        """Answer the handoff of ``entry``; with ``prefill_fail_after_handoff``, release
        it (:meth:`Prefill.release`) and fail."""


@attrs.define(kw_only=True)
class Prefill:
    """One sequential prefill request's behaviour (vLLM's and TensorRT-LLM's handoff):
    compute, stage the KV, answer the handoff; or the fault's answer instead.

    Aborted (cancelled) before its answer committed, it releases what it staged and
    counts one abort on ``pool``.

    Attributes:
        worker, request_id, seed, latency, body, prompt_tokens, fault, min_tokens: as
            for :class:`Decode`.
        pool: the worker's KV blocks.
        answered: the answer committed: an abort no longer frees the KV. Set once the
            sink's answer returns; a face whose answer commits before it is sent sets it
            first.
        lease: stage the KV with a lease (sequential style); False for KV waiting in a
            bootstrap room, which has its own timeout.
        eos_ends_prefill: ``eos_first_token`` makes the prefill's first output final;
            False where the EOS goes to the decode with the KV (SGLang).
        prefix: the worker's prefix cache (None: nothing is ever cached). The prompt is
            looked up when the run is made, its blocks held once computed.
        cached: the prompt's prefix-cache hit, in tokens: its leading whole blocks that
            ``prefix`` held when the run was made (at least one token is computed).
        computed: the prefill computation ran to its end.
        entry: the KV staged, once staged.
        aborted: the abort was counted (:meth:`abort`).
    """

    worker: str
    request_id: str
    seed: int
    latency: LatencyModel
    pool: KVBlockPool
    body: Mapping[str, Any]
    prompt_tokens: int
    fault: Fault | None = None
    min_tokens: int = 0
    lease: bool = True
    eos_ends_prefill: bool = True
    prefix: PrefixCache | None = None
    cached: int = attrs.field(default=0, init=False)
    answered: bool = False
    computed: bool = False
    entry: StagedKV | None = None
    aborted: bool = False
    _hashes: list[bytes] = attrs.field(factory=list, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.prefix is not None:
            self._hashes = self.prefix.hashes(self.body)
            self.cached = self.prefix.lookup(self._hashes, self.prompt_tokens)

    @property
    def kind(self) -> FaultKind | None:
        return self.fault.kind if self.fault is not None else None

    @property
    def token(self) -> int:
        """The first token (equal to the decode's first)."""
        return TokenStream(self.seed, self.request_id).next_id()

    async def compute(self) -> None:
        """The prefill computation: ``latency.time_to_first_token`` of the tokens the
        prefix cache missed; then the prompt's blocks are held in the cache."""
        if (delay := self.latency.time_to_first_token(self.prompt_tokens - self.cached)) > 0:
            await pacing.sleep(delay)
        self.computed = True
        if self.prefix is not None:
            self.prefix.insert(self._hashes)

    def message(self, note: str = "") -> str:
        """The injected fault's error message."""
        assert self.fault is not None
        return fault_message(self.worker, self.fault.kind, self.request_id, note)

    def release(self, entry: StagedKV) -> None:
        """The request failed after staging: the worker frees its KV."""
        self.pool.release(entry)

    def ends_on_first_token(self) -> bool:
        """``eos_first_token``, unless ``min_tokens >= 1`` holds EOS off."""
        return self.kind is FaultKind.EOS_FIRST_TOKEN and self.min_tokens == 0

    async def run(self, sink: PrefillSink) -> None:
        """Serve the prefill (see the class docstring)."""
        kind = self.kind
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            if kind is FaultKind.PREFILL_STALL:
                await trio.sleep_forever()
            await self.compute()
            sink.computed(self)
            if kind is FaultKind.PREFILL_RESET:
                await sink.reset(self)
            elif kind is FaultKind.PREFILL_FAIL_BEFORE_HANDOFF:
                await sink.fail(self, self.message())
            elif kind in TERMINAL_FINISH and (kind is not FaultKind.EOS_FIRST_TOKEN or (
                    self.eos_ends_prefill and self.ends_on_first_token())):
                await sink.terminal(self, kind)
            elif not await sink.before_stage(self):
                self.entry = self.pool.stage(sink.stage_key(self), self.prompt_tokens,
                                             lease=self.lease)
                await sink.handoff(self, self.entry)
            self.answered = True
        finally:
            self.abort()

    def abort(self) -> None:
        """Unless its answer committed, count the request aborted (once), releasing what
        it staged."""
        if not self.answered and not self.aborted:
            self.aborted = True
            abort(self.pool, self.entry)


def abort(pool: KVBlockPool, entry: StagedKV | None) -> None:
    """Count one abort on ``pool``: release ``entry`` if it still waits (a transfer in
    progress belongs to the decode), or note an abort with nothing staged."""
    if entry is None or entry.state is not KVState.HELD or not pool.release(entry):
        pool.note_aborted()


# --- the bootstrap room (SGLang's handoff) -------------------------------------------------


async def first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return as soon as one of ``waits`` returns."""
    async with trio.open_nursery() as nursery:
        async def run(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        for wait in waits:
            nursery.start_soon(run, wait)


class Handover(enum.Enum):
    """How a bootstrap prefill's KV left its room (:func:`hand_over`)."""

    PULLED = "pulled"  #: the decode joined and pulled it
    NOT_JOINED = "not joined"  #: no decode joined in time: stranded
    LEFT = "left"  #: the decode left before the transfer completed: released
    GONE = "gone"  #: the decode gave up before it joined: released


async def hand_over(pool: KVBlockPool, room: BootstrapRoom, entry: StagedKV, wait: float,
                    gone: Callable[[], bool] | None = None) -> Handover:
    """Put ``entry`` (staged with ``lease=False``) in ``room``, wait up to ``wait``
    seconds for a decode to join (or to leave: ``gone`` tells whether it gave up), then
    for the transfer to end. KV nobody pulls is released, or stranded if nobody came."""
    room.put(entry)
    with trio.move_on_after(wait):
        await first_of(room.wait_joined, room.wait_finished)
    if gone is not None and gone():
        pool.release(entry)
        return Handover.GONE
    if not room.joined:
        pool.strand(entry)
        return Handover.NOT_JOINED
    await room.wait_finished()
    if not room.pulled:
        pool.release(entry)  # normally already released by the decode's leaving
        return Handover.LEFT
    return Handover.PULLED
