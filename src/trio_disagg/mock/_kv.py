"""KV block accounting of a mock prefill worker, and the registry linking mock workers.

A :class:`KVBlockPool` is what a prefill worker holds: KV blocks staged for a decode
worker, from the handoff until the decode pulls them, the decode's abort releases them,
or their lease (TTL) expires and they are counted as *stranded*. Expiry is lazy: it
happens against :func:`trio.current_time` whenever the pool is touched or its counters
are read, so no background task is needed. SGLang-style transfers meet in a
:class:`BootstrapRoom` of the prefill's pool instead (docs/protocols.md sections 2 and 3).

The pool only counts and signals; it never sleeps on its own. Every method is
synchronous except the room waits, and may be called from any task of one trio run.
"""

from __future__ import annotations

import enum
import math
from collections import deque

import attrs
import trio

from .._errors import TrioDisaggError

#: Tokens per KV block, as in vLLM's default.
DEFAULT_BLOCK_SIZE = 16
#: Seconds staged KV waits for its decode before it is stranded (vLLM's newer lease).
DEFAULT_KV_TTL = 30.0
#: Seconds either side of a bootstrap room waits for the other (SGLang's default).
DEFAULT_BOOTSTRAP_TIMEOUT = 300.0


class KVTransferError(TrioDisaggError):
    """Staged KV could not be pulled: unknown worker, never staged, already pulled,
    released, expired, or a bootstrap room misused."""


class KVState(enum.Enum):
    """Where a :class:`StagedKV` is in its life."""

    HELD = "held"  #: staged, waiting for its decode
    CLAIMED = "claimed"  #: a decode is transferring it (still held)
    FREED = "freed"  #: pulled, or released unused
    STRANDED = "stranded"  #: its lease or bootstrap wait expired before any decode pulled it


class StagedKV:
    """The KV blocks one prefill request staged for its decode.

    Attributes:
        key: the transfer key (vLLM's ``remote_request_id``); usually the request id.
        block_ids: the staged block ids (vLLM's ``remote_block_ids``).
        num_tokens: the prompt tokens the blocks hold.
        expires_at: the :func:`trio.current_time` at which the lease ends
            (``inf`` for KV waiting in a bootstrap room, which has its own timeout).
        state: a :class:`KVState`.
    """

    __slots__ = ("block_ids", "expires_at", "key", "num_tokens", "state")

    def __init__(self, key: str, block_ids: list[int], num_tokens: int,
                 expires_at: float) -> None:
        self.key = key
        self.block_ids = block_ids
        self.num_tokens = num_tokens
        self.expires_at = expires_at
        self.state = KVState.HELD

    def __repr__(self) -> str:
        return f"<StagedKV {self.key!r} {len(self.block_ids)} blocks {self.state.value}>"

    @property
    def num_blocks(self) -> int:
        """How many blocks are staged: ``len(block_ids)``."""
        return len(self.block_ids)

    @property
    def is_held(self) -> bool:
        """True while the blocks are staged or being transferred."""
        return self.state is KVState.HELD or self.state is KVState.CLAIMED


@attrs.frozen(slots=True, kw_only=True)
class KVCounters:
    """A snapshot of a prefill worker's KV accounting. Counts of blocks and requests.

    Always ``staged_blocks == held_blocks + freed_blocks + stranded_blocks``.

    Attributes:
        held_blocks: blocks staged now (waiting for a decode, or being transferred).
        held: requests holding those blocks.
        staged_blocks: blocks ever staged.
        freed_blocks: blocks freed, by a decode's pull or by a release.
        stranded_blocks: blocks whose lease (TTL) or bootstrap wait expired before any
            decode pulled them: the leak rule B1 closes.
        served: requests whose KV a decode pulled.
        aborted: requests aborted before a decode pulled their KV: the prefill was
            stopped, killed, cancelled or its stream closed (whether or not it had staged
            anything), a decode was aborted before it pulled (it released the KV), a
            transfer was interrupted, or the prefill failed after staging. Expiry is not
            an abort.
        expired: requests whose KV was stranded.
    """

    held_blocks: int = 0
    held: int = 0
    staged_blocks: int = 0
    freed_blocks: int = 0
    stranded_blocks: int = 0
    served: int = 0
    aborted: int = 0
    expired: int = 0

    def __add__(self, other: KVCounters) -> KVCounters:
        return KVCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                             for f in attrs.fields(KVCounters)})


def _now() -> float | None:
    try:
        return trio.current_time()
    except RuntimeError:  # outside trio.run: read the counters without expiring
        return None


class KVBlockPool:
    """The KV blocks a prefill worker holds for decode workers.

    Args:
        name: the worker's name (vLLM's ``remote_engine_id``), for messages.
        block_size: tokens per block; a prompt of ``n`` tokens stages
            ``ceil(n / block_size)`` blocks.
        ttl: seconds staged KV (sequential style) waits for its decode before it is
            stranded. Expiry is lazy: checked whenever the pool is used.

    Raises:
        ValueError: ``block_size`` < 1 or ``ttl`` not > 0.
    """

    def __init__(self, name: str = "prefill", *, block_size: int = DEFAULT_BLOCK_SIZE,
                 ttl: float = DEFAULT_KV_TTL) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        self.name = name
        self._block_size = block_size
        self._ttl = ttl
        self._staged: dict[str, StagedKV] = {}  # pullable by key, sequential style
        self._leases: deque[StagedKV] = deque()  # in expiry order (the TTL is fixed)
        self._rooms: dict[int, BootstrapRoom] = {}
        self._next_block = 0
        self._seq = 0
        self._held_blocks = 0
        self._held = 0
        self._staged_blocks = 0
        self._freed_blocks = 0
        self._stranded_blocks = 0
        self._served = 0
        self._aborted = 0
        self._expired = 0

    def __repr__(self) -> str:
        return f"<KVBlockPool {self.name!r} {self._held_blocks} blocks held>"

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def ttl(self) -> float:
        """Seconds staged KV waits for its decode."""
        return self._ttl

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed for ``num_tokens`` tokens (at least 1)."""
        return max(1, -(-num_tokens // self._block_size))

    # --- staging and pulling -----------------------------------------------------------

    def stage(self, request_id: str, num_tokens: int, *, lease: bool = True) -> StagedKV:
        """Stage the KV of a prompt of ``num_tokens`` tokens for a decode.

        Args:
            request_id: the prefill request; it becomes the transfer key, made unique
                with a ``#N`` suffix if that key is already staged.
            num_tokens: prompt tokens.
            lease: True (sequential style): the KV is pullable by key and expires after
                :attr:`ttl`. False (bootstrap style): it waits in a room, which times out
                on its own (:meth:`strand`).

        Returns:
            The :class:`StagedKV`.
        """
        self.expire()
        key = request_id
        if key in self._staged:
            self._seq += 1
            key = f"{request_id}#{self._seq}"
        count = self.blocks_for(num_tokens)
        first = self._next_block
        self._next_block += count
        expires_at = math.inf
        if lease:
            now = _now()
            expires_at = (now if now is not None else 0.0) + self._ttl
        entry = StagedKV(key, list(range(first, first + count)), num_tokens, expires_at)
        if lease:
            self._staged[key] = entry
            self._leases.append(entry)
        self._held_blocks += count
        self._held += 1
        self._staged_blocks += count
        return entry

    def lookup(self, key: str) -> StagedKV | None:
        """The KV staged under ``key`` and not yet claimed, or None."""
        self.expire()
        return self._staged.get(key)

    def claim(self, key: str, block_ids: list[int] | None = None) -> StagedKV:
        """Start pulling the KV staged under ``key``: it is no longer pullable or
        expirable, but stays held until :meth:`complete` or :meth:`release`.

        Args:
            key: the transfer key (``remote_request_id``).
            block_ids: the block ids the decode was told (``remote_block_ids``); checked
                if given.

        Raises:
            KVTransferError: nothing is staged under ``key`` (expired, already pulled,
                released, or never staged), or the block ids do not match.
        """
        self.expire()
        entry = self._staged.get(key)
        if entry is None:
            raise KVTransferError(
                f"no KV staged under {key!r} on {self.name!r}: expired (lease {self._ttl:g} s), "
                f"already pulled, released, or never staged")
        if block_ids is not None and list(block_ids) != entry.block_ids:
            raise KVTransferError(
                f"KV {key!r} on {self.name!r} holds blocks {_span(entry.block_ids)}, "
                f"not {_span(block_ids)}")
        del self._staged[key]
        entry.state = KVState.CLAIMED
        return entry

    def claim_entry(self, entry: StagedKV) -> None:
        """Like :meth:`claim`, for an entry in hand (a bootstrap room's).

        Raises:
            KVTransferError: the entry is no longer held.
        """
        self.expire()
        if entry.state is not KVState.HELD:
            raise KVTransferError(f"KV {entry.key!r} on {self.name!r} is {entry.state.value}, "
                                  f"not pullable")
        self._staged.pop(entry.key, None)
        entry.state = KVState.CLAIMED

    def complete(self, entry: StagedKV) -> None:
        """A claimed transfer ended: free the blocks and count the request served."""
        if entry.state is not KVState.CLAIMED:
            raise KVTransferError(f"KV {entry.key!r} on {self.name!r} was not claimed")
        self._free(entry)
        self._served += 1

    def release(self, entry: StagedKV) -> bool:
        """Free ``entry`` unused (an abort) and count the request aborted.

        Returns:
            True if it was held; False (and nothing counted) if it was already freed or
            stranded.
        """
        if not entry.is_held:
            return False
        self._staged.pop(entry.key, None)
        self._free(entry)
        self._aborted += 1
        return True

    def release_key(self, key: str) -> bool:
        """Free the KV staged under ``key`` if it is still waiting (not claimed): what a
        decode aborted before it pulled does. Counts an abort if it freed anything.

        Returns:
            True if something was freed.
        """
        self.expire()
        entry = self._staged.get(key)
        return entry is not None and self.release(entry)

    def strand(self, entry: StagedKV) -> bool:
        """Count ``entry`` as expired (a bootstrap wait ran out) and drop it.

        Returns:
            True if it was held.
        """
        if not entry.is_held:
            return False
        self._staged.pop(entry.key, None)
        entry.state = KVState.STRANDED
        self._held_blocks -= entry.num_blocks
        self._held -= 1
        self._stranded_blocks += entry.num_blocks
        self._expired += 1
        return True

    def note_aborted(self) -> None:
        """Count a request aborted before it staged anything."""
        self._aborted += 1

    def expire(self) -> int:
        """Strand every lease past its TTL. Called by every other method.

        Returns:
            The number of requests stranded now.
        """
        leases = self._leases
        if not leases:
            return 0
        now = _now()
        if now is None:
            return 0
        count = 0
        while leases and (leases[0].expires_at <= now or leases[0].state is not KVState.HELD):
            entry = leases.popleft()
            if entry.state is KVState.HELD and self.strand(entry):
                count += 1
        return count

    def _free(self, entry: StagedKV) -> None:
        entry.state = KVState.FREED
        self._held_blocks -= entry.num_blocks
        self._held -= 1
        self._freed_blocks += entry.num_blocks

    # --- counters ----------------------------------------------------------------------

    def counters(self) -> KVCounters:
        """Expire what is due, then return a snapshot of the counters."""
        self.expire()
        return KVCounters(
            held_blocks=self._held_blocks, held=self._held,
            staged_blocks=self._staged_blocks, freed_blocks=self._freed_blocks,
            stranded_blocks=self._stranded_blocks, served=self._served,
            aborted=self._aborted, expired=self._expired)

    @property
    def held_blocks(self) -> int:
        """Blocks held now (after expiring what is due)."""
        self.expire()
        return self._held_blocks

    @property
    def stranded_blocks(self) -> int:
        """Blocks stranded so far (after expiring what is due)."""
        self.expire()
        return self._stranded_blocks

    # --- bootstrap rooms ---------------------------------------------------------------

    def room(self, room_id: int) -> BootstrapRoom:
        """The bootstrap room ``room_id``, created by whichever side comes first.

        It disappears when both sides have left; a side arriving later opens a new one.
        """
        room = self._rooms.get(room_id)
        if room is None:
            room = self._rooms[room_id] = BootstrapRoom(self, room_id)
        return room

    @property
    def open_rooms(self) -> int:
        """Bootstrap rooms with a side still in them."""
        return len(self._rooms)


def _span(block_ids: list[int]) -> str:
    if len(block_ids) > 6:
        return f"[{block_ids[0]}..{block_ids[-1]}] ({len(block_ids)})"
    return str(list(block_ids))


class BootstrapRoom:
    """Where one prefill request and its decode meet (SGLang's bootstrap room).

    Either side may come first. The prefill :meth:`enter`\\ s, stages its KV with
    :meth:`put`, waits for the decode to join and to finish the transfer; the decode
    :meth:`enter`\\ s (which joins), waits for the KV, claims and completes it on the pool,
    then :meth:`finish`\\ es. Each side :meth:`leave`\\ s when done, which releases KV left
    unused: a decode that leaves before pulling frees it at once, as vLLM's decode does
    for an aborted request. A room serves one request: a second prefill or decode is
    refused.
    """

    __slots__ = ("_finished", "_joined", "_pool", "_present", "_seen", "_staged", "entry",
                 "pulled", "room_id")

    def __init__(self, pool: KVBlockPool, room_id: int) -> None:
        self._pool = pool
        self.room_id = room_id
        self.entry: StagedKV | None = None
        self.pulled = False
        self._seen: set[str] = set()  # roles that ever entered
        self._present: set[str] = set()
        self._staged = trio.Event()
        self._joined = trio.Event()
        self._finished = trio.Event()

    def __repr__(self) -> str:
        return f"<BootstrapRoom {self.room_id} {sorted(self._present)}>"

    def enter(self, role: str) -> None:
        """Enter as ``"prefill"`` or ``"decode"`` (the decode's entry is its join).

        Raises:
            KVTransferError: that role already came to this room: rooms must not be
                reused across requests (docs/protocols.md section 3).
        """
        if role in self._seen:
            raise KVTransferError(
                f"bootstrap room {self.room_id} on {self._pool.name!r} already has a {role} "
                f"request: every request needs its own room")
        self._seen.add(role)
        self._present.add(role)
        if role == "decode":
            self._joined.set()

    def leave(self, role: str) -> None:
        """Leave; releases KV nobody will pull. The decode's leaving also finishes the
        transfer (unpulled) if it had not. The room closes when both sides left."""
        entry = self.entry
        if role == "decode":
            if not self._finished.is_set():
                self._finished.set()
            if entry is not None and entry.is_held:
                self._pool.release(entry)
        elif entry is not None and entry.state is KVState.HELD:
            self._pool.release(entry)  # a claimed entry belongs to the decode now
        self._present.discard(role)
        if not self._present and self._pool._rooms.get(self.room_id) is self:
            del self._pool._rooms[self.room_id]

    def put(self, entry: StagedKV) -> None:
        """The prefill staged ``entry`` (staged with ``lease=False``) for the decode."""
        self.entry = entry
        self._staged.set()

    def finish(self, *, pulled: bool) -> None:
        """The decode is done with the transfer."""
        self.pulled = pulled
        self._finished.set()

    @property
    def joined(self) -> bool:
        """True once a decode joined (even if it has left since)."""
        return self._joined.is_set()

    async def wait_joined(self) -> None:
        """Wait for the decode to join (bound it with :func:`trio.move_on_after`)."""
        await self._joined.wait()

    async def wait_finished(self) -> None:
        """Wait until the decode pulled the KV or left."""
        await self._finished.wait()

    async def wait_staged(self) -> StagedKV:
        """Wait for the prefill's KV (bound it with :func:`trio.move_on_after`).

        Returns:
            The staged KV; check it is still held before claiming it.
        """
        await self._staged.wait()
        assert self.entry is not None
        return self.entry
