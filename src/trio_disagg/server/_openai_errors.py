"""OpenAI's errors at the edge: :class:`ApiError`, which renders as OpenAI's
``{"error": {"message", "type", "param", "code"}}``, and the table that maps the library's
typed exceptions to it (:func:`error_for_exception`)."""

from __future__ import annotations

import math
from typing import Any

import attrs
import orjson

from .._errors import (
    DeadlineExceeded,
    InvalidPrefillHandoff,
    NoWorkerAvailable,
    PrefillDeadlineExceeded,
    PrefillError,
    RouterClosed,
    WorkerError,
)


class ApiError(Exception):
    """An error to show the client as OpenAI's error object.

    Attributes:
        status: the HTTP status (4xx or 5xx).
        message: a readable explanation.
        type: OpenAI's ``error.type`` (``invalid_request_error``, ``upstream_error``, ...).
        param: the offending request field, if one is to blame.
        code: a short machine-readable code, or None.
        retry_after: whole seconds to send as ``Retry-After`` (the client may try again
            then), or None for no header; sent only with a status, never in an error
            event.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, code={self.code!r})"

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready ``{"error": {...}}`` object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_json(self) -> bytes:
        """The error object as JSON bytes."""
        return orjson.dumps(self.to_dict())

    def to_event(self) -> bytes:
        """The error as one server-sent event, ``data: {"error": ...}\\n\\n``."""
        return b"data: " + self.to_json() + b"\n\n"


#: Seconds a client the router itself refused with a 503 is told to wait (``Retry-After``):
#: admission control, shutting down, no healthy worker.
RETRY_AFTER = 1
#: The longest ``Retry-After`` the router sends, in seconds: a worker's longer one is cut
#: to it. (The openai SDK honours up to 60 s and falls back to its own backoff beyond: a
#: client must not wait an hour on one worker's word while the others may serve it.)
LONGEST_RETRY_AFTER = 60
#: The statuses that pass a worker's ``Retry-After`` on (too busy, unavailable).
RETRY_AFTER_STATUSES = frozenset({429, 503})


def retry_after_header(seconds: float) -> int:
    """``Retry-After`` seconds for a wait of ``seconds``: whole seconds rounded up, 0 to
    :data:`LONGEST_RETRY_AFTER`."""
    if not seconds > 0:  # 0, or NaN
        return 0
    return math.ceil(min(seconds, LONGEST_RETRY_AFTER))


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


#: A worker's 4xx statuses that are about the router's credentials, not about the client's
#: request (a worker started with an API key the router does not send). Passed through,
#: they would tell the client that its own key is wrong (the openai SDK raises
#: AuthenticationError and does not retry); they are a bad gateway (502) with the
#: worker's message instead (S2).
ROUTER_SIDE_STATUSES = frozenset({401, 403, 407})


def _worker_behind(exc: BaseException) -> WorkerError | None:
    """The worker's error behind ``exc``: ``exc`` itself if it is a WorkerError, else its
    ``__cause__`` if that is one; else None."""
    worker = exc if isinstance(exc, WorkerError) else exc.__cause__
    return worker if isinstance(worker, WorkerError) else None


def _worker_rejection(exc: BaseException) -> WorkerError | None:
    """The worker's 4xx behind ``exc`` (:func:`_worker_behind`); None if there is none,
    or the status is one of :data:`ROUTER_SIDE_STATUSES`."""
    worker = _worker_behind(exc)
    if (worker is not None and 400 <= worker.status < 500
            and worker.status not in ROUTER_SIDE_STATUSES):
        return worker
    return None


def _worker_unavailable(exc: BaseException) -> WorkerError | None:
    """The worker's 503 behind ``exc`` (:func:`_worker_behind`: the status the worker
    answered, or an in-process engine's own), else None."""
    worker = _worker_behind(exc)
    if worker is None:
        return None
    status = worker.worker_status if worker.worker_status is not None else worker.status
    return worker if status == 503 else None


@attrs.frozen
class ErrorMapping:
    """One row of :data:`ERROR_TABLE`: how an exception type reaches the client.

    Attributes:
        exception: the exception type the row is for (its subclasses too).
        status: the HTTP status; None for the worker's own 4xx status (the exception's,
            or its ``__cause__``'s), and then the row applies only when there is one and
            the message is the worker's.
        type: OpenAI's ``error.type``.
        code: OpenAI's ``error.code``.
        param: the name of the exception's attribute that names the offending field,
            which becomes ``error.param``; None for no ``param``.
        fallback_message: the message when the exception has none.
        unavailable: the row applies only when the worker behind the exception answered
            503 (it is overloaded or starting: the client may try again later).
        retry_after: the ``Retry-After`` seconds of the router's own refusal; None for a
            worker's (its own ``Retry-After``, bounded, on a 429 or 503 passed through).
    """

    exception: type[BaseException]
    status: int | None
    type: str
    code: str
    param: str | None = None
    fallback_message: str | None = None
    unavailable: bool = False
    retry_after: int | None = None

    def error_for(self, exc: BaseException) -> ApiError | None:
        """The client's error for ``exc`` if this row applies to it, else None."""
        if not isinstance(exc, self.exception):
            return None
        if self.unavailable and _worker_unavailable(exc) is None:
            return None
        status = self.status
        message = str(exc)
        if status is None:
            worker = _worker_rejection(exc)
            if worker is None:
                return None
            status, message = worker.status, str(worker)
        param = getattr(exc, self.param, None) if self.param is not None else None
        wait = self.retry_after
        worker = _worker_behind(exc)
        if (wait is None and status in RETRY_AFTER_STATUSES and worker is not None
                and worker.retry_after is not None):
            wait = retry_after_header(worker.retry_after)
        return ApiError(status, message or self.fallback_message or type(exc).__name__,
                        type=self.type, param=param, code=self.code, retry_after=wait)


#: How each exception of the router (or an engine) reaches the client, most specific
#: first: :func:`error_for_exception` uses the first row that applies. An exception that
#: no row takes is a bug: 500 ``internal_error``.
ERROR_TABLE: tuple[ErrorMapping, ...] = (
    ErrorMapping(RouterClosed, 503, "service_unavailable_error", "router_closed",
                 fallback_message="the router is shutting down", retry_after=RETRY_AFTER),
    ErrorMapping(NoWorkerAvailable, 503, "service_unavailable_error", "no_worker_available",
                 fallback_message="no worker available", retry_after=RETRY_AFTER),
    # Before DeadlineExceeded and PrefillError: it is both (B2).
    ErrorMapping(PrefillDeadlineExceeded, 504, "timeout_error", "prefill_deadline_exceeded"),
    # The message says which wait ran out ("handoff deadline of 30 s exceeded").
    ErrorMapping(DeadlineExceeded, 504, "timeout_error", "deadline_exceeded"),
    # B7: the client learns which field of the prefill's answer was wrong.
    ErrorMapping(InvalidPrefillHandoff, 502, "upstream_error", "invalid_prefill_handoff",
                 param="field"),
    # A prefill worker's 4xx is the client's fault: passed through as sent.
    ErrorMapping(PrefillError, None, "invalid_request_error", "prefill_rejected"),
    # A worker's 503 is the fleet's state, not a bad gateway: the client may try later.
    ErrorMapping(PrefillError, 503, "service_unavailable_error", "worker_unavailable",
                 unavailable=True),
    ErrorMapping(PrefillError, 502, "upstream_error", "prefill_failed"),
    ErrorMapping(WorkerError, None, "invalid_request_error", "worker_error"),
    ErrorMapping(WorkerError, 503, "service_unavailable_error", "worker_unavailable",
                 unavailable=True),
    # A worker's 5xx or transport failure is a bad gateway, never a 500 of ours.
    ErrorMapping(WorkerError, 502, "upstream_error", "worker_error"),
)


def error_for_exception(exc: BaseException) -> ApiError:
    """Map an exception of the router (or an engine) to the error the client sees.

    The first row of :data:`ERROR_TABLE` that applies decides:

    - :class:`~trio_disagg.RouterClosed`: 503, code ``router_closed``, with
      ``Retry-After`` (:data:`RETRY_AFTER`).
    - :class:`~trio_disagg.NoWorkerAvailable`: 503, code ``no_worker_available``, with
      ``Retry-After`` (:data:`RETRY_AFTER`).
    - :class:`~trio_disagg.PrefillDeadlineExceeded`: 504, code
      ``prefill_deadline_exceeded``.
    - any other :class:`~trio_disagg.DeadlineExceeded`: 504, code ``deadline_exceeded``;
      the message names the wait that ran out.
    - :class:`~trio_disagg.InvalidPrefillHandoff`: 502, code ``invalid_prefill_handoff``,
      ``param`` the offending field of the prefill's answer (B7).
    - :class:`~trio_disagg.PrefillError` whose ``__cause__`` is a
      :class:`~trio_disagg.WorkerError` with a 4xx status: that status and the worker's
      message, code ``prefill_rejected``.
    - a :class:`~trio_disagg.PrefillError` or :class:`~trio_disagg.WorkerError` of a
      worker that answered 503: 503 with the worker's message, code
      ``worker_unavailable``.
    - any other :class:`~trio_disagg.PrefillError`: 502 with the worker's message, code
      ``prefill_failed``.
    - :class:`~trio_disagg.WorkerError`: its status if that is a 4xx, else 502; code
      ``worker_error``.
    - A worker's 429 or 503 passed on carries the worker's ``Retry-After``
      (``WorkerError.retry_after``), rounded up to whole seconds, at most
      :data:`LONGEST_RETRY_AFTER`.
    - A worker's 401, 403 or 407 (:data:`ROUTER_SIDE_STATUSES`: the router's
      credentials) is never passed through: it is a 502 like a 5xx (S2).
    - anything else: 500, code ``internal_error`` (a bug; the caller logs it).

    Args:
        exc: the exception. An exception group is mapped by its first leaf: the router
            raises bare exceptions, so a group is a defensive path only.

    Returns:
        The :class:`ApiError` to answer with.
    """
    exc = _leaf(exc)
    for row in ERROR_TABLE:
        error = row.error_for(exc)
        if error is not None:
            return error
    return ApiError(500, "internal server error", type="internal_error", code="internal_error")


# --- the edge's own refusals: answered before any worker is called -----------------------
# (docs/router.md, "Securing and limiting the router"; the table there lists them all.)


def invalid_api_key(given: bool) -> ApiError:
    """401 ``invalid_api_key``: a ``/v1/*`` request without the right bearer key.

    Args:
        given: whether the request carried a bearer key at all (it changes the message).
    """
    message = ("Incorrect API key provided." if given else
               "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
    return ApiError(401, message, type="invalid_request_error", code="invalid_api_key")


def unsupported_media_type(content_type: str | None) -> ApiError:
    """415 ``unsupported_media_type``: a POST body that is not ``application/json``."""
    got = repr(content_type) if content_type is not None else "none"
    return ApiError(415, f"the request body must be sent as Content-Type: application/json, "
                    f"got {got}", param="Content-Type", code="unsupported_media_type")


def unsupported_content_encoding(encoding: str) -> ApiError:
    """415 ``unsupported_media_type``: a POST body sent compressed (``Content-Encoding``
    other than ``identity``), which the router does not decode."""
    return ApiError(415, f"the request body must be sent uncompressed: Content-Encoding "
                    f"{encoding!r} is not supported", param="Content-Encoding",
                    code="unsupported_media_type")


def server_overloaded(message: str) -> ApiError:
    """503 ``server_overloaded``: admission control refused the request (sent with a
    ``Retry-After`` header of :data:`RETRY_AFTER` seconds)."""
    return ApiError(503, message, type="service_unavailable_error", code="server_overloaded",
                    retry_after=RETRY_AFTER)


def prompt_too_long(param: str, size: int, limit: int) -> ApiError:
    """400 ``prompt_too_long``: the prompt (``param``) is ``size`` bytes, over ``limit``."""
    return ApiError(400, f"{param}: {size} bytes as JSON, over the limit of {limit} bytes",
                    param=param, code="prompt_too_long")


def request_too_large(limit: int) -> ApiError:
    """413 ``request_too_large``: the body is over ``limit`` bytes."""
    return ApiError(413, f"request body too large (the limit is {limit} bytes)",
                    code="request_too_large")
