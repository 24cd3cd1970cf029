"""The typed errors of trio-disagg. Each is raised bare by the public call that documents
it, never inside an exception group; the server maps each to an HTTP status
(docs/protocols.md)."""

from __future__ import annotations


class TrioDisaggError(Exception):
    """Base class of every error trio-disagg raises on purpose: catch it to catch them
    all (a bug raises something else)."""


class WireFormatError(TrioDisaggError, ValueError):
    """A value on the wire did not have the expected shape (bad JSON, wrong type, a
    missing field): raised by :func:`~trio_disagg.from_wire`. It is also a
    :exc:`ValueError`."""


class PrefillError(TrioDisaggError):
    """The prefill leg failed, so the request cannot be decoded (rules S1-S9, T3, T4 in
    docs/semantics.md).

    The message carries the prefill worker's own error text where there is one; a
    worker's refusal is its ``__cause__`` (a :class:`WorkerError`, whose 4xx status the
    server passes on). A prefill task that crashed or was cancelled reports "did not
    complete" (T3). The server answers 502 (code ``prefill_failed``) unless a subclass or
    the cause says otherwise.
    """


class NoDisaggregatedParams(PrefillError):
    """A prefill that needs a handoff returned nothing usable to hand off (S8, S9): no
    ``disaggregated_params`` on a non-terminal first output, or a TensorRT-LLM context
    without a usable ``ctx_request_id``. No decode is dispatched."""


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
    """A pool has no worker to offer: it is empty (a pool whose workers are all cooling
    down still chooses one, S12). The server answers 503."""


class WorkerError(TrioDisaggError):
    """A worker refused or failed a request.

    An engine raises it from ``generate`` before ``task_status.started()`` only (after
    that, a failure is one error item). The server answers with ``status``.

    Attributes:
        status: the HTTP-like status to show the client: the worker's own 4xx, or 502
            for a worker's 5xx or a transport failure (docs/protocols.md section 1).
        worker: the worker's name or URL, if known.
        worker_status: the status the worker itself answered, or None if it never
            answered (a transport failure) or is not an HTTP worker.
        handoff_lost: a decode worker refused because the handoff's KV could not be used
            (its transfer failed, its lease expired): the router then sends no cleanup
            decode for that KV, which would fail the same way (B1).
        retry_after: seconds the worker asked its client to wait before trying again
            (an HTTP worker's ``Retry-After`` on a 429 or 503), or None; the server
            passes it on to the client, bounded.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 502,
        worker: str | None = None,
        worker_status: int | None = None,
        handoff_lost: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.worker = worker
        self.worker_status = worker_status
        self.handoff_lost = handoff_lost
        self.retry_after = retry_after


class PrefillCancelled(PrefillError):
    """The router ended the prefill on purpose: its client left inside the engine's cancel
    window (B10), or no decode will ever take its KV (B6). Nothing was stranded. The
    keeper logs it at INFO, not as a failure."""


class PrefillDeadlineExceeded(DeadlineExceeded, PrefillError):
    """The prefill leg ran past its deadline (B2): ``what`` is ``"prefill"`` (the wait for
    the handoff) or ``"transfer"`` (the whole prefill leg). It is both a
    :class:`DeadlineExceeded` and a :class:`PrefillError`; the server answers 504."""


class RouterClosed(TrioDisaggError):
    """The router is shutting down and admits no new requests (rule B3 in
    docs/semantics.md); the server answers 503."""
