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
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 502,
        worker: str | None = None,
        worker_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.worker = worker
        self.worker_status = worker_status

    @property
    def may_have_processed(self) -> bool:
        """Whether the worker may have acted on the request before refusing it: it
        answered a 5xx other than 503. A 4xx, a 503, or no answer at all mean it did not
        (HTTP's own rule for when a request is safe to send again)."""
        return self.worker_status is not None and self.worker_status >= 500 \
            and self.worker_status != 503


class PrefillCancelled(PrefillError):
    """The router ended the prefill on purpose: its client left inside the engine's cancel
    window (B10), or no decode will ever take its KV (B6). Nothing was stranded."""


class PrefillDeadlineExceeded(DeadlineExceeded, PrefillError):
    """The prefill leg ran past its deadline (B2); it is both a deadline and a prefill error."""


class RouterClosed(TrioDisaggError):
    """The router is shutting down and admits no new requests (rule B3 in docs/semantics.md)."""
