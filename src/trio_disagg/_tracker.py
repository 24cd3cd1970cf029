"""Per-request phases and timing (rules S3, S11 in docs/semantics.md)."""

from __future__ import annotations

import enum

import trio


class Phase(enum.Enum):
    """Where a request is in its life (:attr:`RequestTracker.phase`): queued, prefill,
    decode, done. It only moves forward (S11)."""

    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class PhasePermit:
    """The request's one phase-transition permit, held by the prefill phase (S11).

    :meth:`RequestTracker.enter_prefill` hands it out; :meth:`release` it when the
    prefill drain starts (:meth:`TransferKeeper.start` does, given ``permit=``), which lets
    :meth:`RequestTracker.enter_decode` go on.

    Attributes:
        released: True once released.
    """

    __slots__ = ("_sem", "released")

    def __init__(self, sem: trio.Semaphore) -> None:
        self._sem = sem
        self.released = False

    def release(self) -> None:
        """Let the decode phase begin (S11); releasing twice is harmless."""
        if not self.released:
            self.released = True
            self._sem.release()


class RequestTracker:
    """Phase and timing of one request (S3, S11).

    Times are ``trio.current_time()`` values in seconds, so they follow a test's autojump
    clock; a tracker made outside a trio run records None. ``record_prefill_complete()``
    and ``record_decode_first_token()`` are first-call wins: only the first call records
    and returns True (S3).

    Attributes:
        phase: the :class:`Phase`.
        created_at: when the tracker was made (seconds, trio clock).
        prefill_complete_at: when the prefill's first valid output arrived (S3).
        decode_first_token_at: when the decode's first token arrived.
        finished_at: when :meth:`finish` was first called.
    """

    __slots__ = (
        "_decode_recorded",
        "_permit",
        "_prefill_recorded",
        "created_at",
        "decode_first_token_at",
        "finished_at",
        "phase",
        "prefill_complete_at",
    )

    def __init__(self) -> None:
        self.phase = Phase.QUEUED
        self.created_at: float | None = _now()
        self.prefill_complete_at: float | None = None
        self.decode_first_token_at: float | None = None
        self.finished_at: float | None = None
        # Flags, not the times: outside a trio run the times are None (S3 first call wins).
        self._prefill_recorded = False
        self._decode_recorded = False
        # Made by the prefill phase, dropped once the decode phase began (P3: a semaphore
        # and its parking lot are 336 bytes a stream in flight).
        self._permit: trio.Semaphore | None = None

    def enter_prefill(self) -> PhasePermit:
        """Enter the prefill phase and take the phase-transition permit (S11).

        Returns:
            The :class:`PhasePermit`; release it when the prefill drain starts.

        Raises:
            RuntimeError: if the permit is already held (one prefill per request).
        """
        if self._permit is None:
            self._permit = trio.Semaphore(1)
        try:
            self._permit.acquire_nowait()
        except trio.WouldBlock:
            raise RuntimeError("the phase-transition permit is already held") from None
        self.phase = Phase.PREFILL
        return PhasePermit(self._permit)

    async def enter_decode(self) -> None:
        """Flip to the decode phase once the prefill phase released its permit (S11).

        Waits until then; cancelling the wait leaves the phase as it was.
        """
        permit = self._permit
        if permit is None or permit.value:  # no prefill phase, or its permit is free
            # Nothing to wait for: a cancellation is still seen, but the task does not
            # park for a run-loop pass (P4a: one scheduler step less per request).
            await trio.lowlevel.checkpoint_if_cancelled()
            self.phase = Phase.DECODE
            self._permit = None  # free, as after taking and releasing it below
            return
        async with permit:
            self.phase = Phase.DECODE
        self._permit = None  # free again, as a new one would be

    def finish(self) -> None:
        """Mark the request done; the first call records ``finished_at``."""
        self.phase = Phase.DONE
        if self.finished_at is None:
            self.finished_at = _now()

    def record_prefill_complete(self) -> bool:
        """Record that the prefill produced its first valid output (S3).

        Returns:
            True if this call recorded it; False if an earlier call had (first call wins).
        """
        if self._prefill_recorded:
            return False
        self._prefill_recorded = True
        self.prefill_complete_at = _now()
        return True

    def record_decode_first_token(self) -> bool:
        """Record the decode worker's first token (S3).

        Returns:
            True if this call recorded it; False if an earlier call had (first call wins).
        """
        if self._decode_recorded:
            return False
        self._decode_recorded = True
        self.decode_first_token_at = _now()
        return True

    @property
    def kv_transfer_latency(self) -> float | None:
        """Seconds from prefill complete to the decode's first token, an upper bound on the
        KV transfer time; None until both are known."""
        if self.prefill_complete_at is None or self.decode_first_token_at is None:
            return None
        return max(0.0, self.decode_first_token_at - self.prefill_complete_at)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from creation to the decode's first token (TTFT); None until known."""
        if self.created_at is None or self.decode_first_token_at is None:
            return None
        return self.decode_first_token_at - self.created_at


def _now() -> float | None:
    try:
        return trio.current_time()
    except RuntimeError:  # created outside a trio run
        return None
