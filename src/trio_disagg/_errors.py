"""The typed errors of trio-disagg."""

from __future__ import annotations


class TrioDisaggError(Exception):
    """Base class of every error trio-disagg raises on purpose."""


class WireFormatError(TrioDisaggError, ValueError):
    """A value on the wire did not have the expected shape (bad JSON, wrong type, ...)."""


class PrefillError(TrioDisaggError):
    """The prefill leg failed, so the request cannot be decoded (rules S1-S9, T3, T4 in
    docs/semantics.md).

    The message carries the prefill worker's own error text where there is one.
    """


class NoDisaggregatedParams(PrefillError):
    """A prefill that needs a handoff returned nothing usable to hand off (S8, S9)."""


class InvalidPrefillHandoff(NoDisaggregatedParams):
    """A prefill answer failed validation as a handoff (B7): more than one choice, or a
    handoff field missing or of the wrong type. No decode request is sent for it.

    Attributes:
        field: the offending field as a path into the worker's answer, such as
            ``"choices[0].disaggregated_params.ctx_request_id"``.
    """

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class DeadlineExceeded(TrioDisaggError, TimeoutError):
    """A bounded wait ran out (rule B2 in docs/semantics.md).

    Attributes:
        what: which wait: ``"prefill"``, ``"handoff"``, ``"decode idle"``,
            ``"terminal hold"``, ...
        seconds: the deadline that was exceeded, in seconds.
    """

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(f"{what} deadline of {seconds:g} s exceeded")
        self.what = what
        self.seconds = seconds


class NoWorkerAvailable(TrioDisaggError):
    """Every worker of a pool is unhealthy or the pool is empty."""


class WorkerError(TrioDisaggError):
    """A worker refused or failed a request.

    Attributes:
        status: the HTTP-like status to show the client: the worker's own 4xx, or 502
            for a worker's 5xx or a transport failure (docs/protocols.md section 1).
        worker: the worker's name or URL, if known.
        worker_status: the status the worker itself answered, or None if it never
            answered (a transport failure) or is not an HTTP worker.
        handoff_lost: a decode worker refused because the handoff's KV could not be used
            (its transfer failed, its lease expired): the router then sends no cleanup
            decode for that KV, which would fail the same way (B1).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 502,
        worker: str | None = None,
        worker_status: int | None = None,
        handoff_lost: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.worker = worker
        self.worker_status = worker_status
        self.handoff_lost = handoff_lost



class PrefillCancelled(PrefillError):
    """The router ended the prefill on purpose: its client left inside the engine's cancel
    window (B10), or no decode will ever take its KV (B6). Nothing was stranded."""


class PrefillDeadlineExceeded(DeadlineExceeded, PrefillError):
    """The prefill leg ran past its deadline (B2); it is both a deadline and a prefill error."""


class RouterClosed(TrioDisaggError):
    """The router is shutting down and admits no new requests (rule B3 in docs/semantics.md)."""
