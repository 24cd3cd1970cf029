"""The exception table of the server: which HTTP status, OpenAI error type and code each
failure of the router (or an engine) reaches the client as. Row by row, then the table's
order (most specific first) and the exception-group path."""

from __future__ import annotations

import pytest

from trio_disagg import (
    DeadlineExceeded,
    InvalidPrefillHandoff,
    NoDisaggregatedParams,
    NoWorkerAvailable,
    PrefillDeadlineExceeded,
    PrefillError,
    RouterClosed,
    WorkerError,
)
from trio_disagg.engines._headers import retry_after
from trio_disagg.server import error_for_exception
from trio_disagg.server._openai_errors import ERROR_TABLE

FIELD = "choices[0].disaggregated_params.ctx_request_id"


def caused_by(error: PrefillError, cause: BaseException) -> PrefillError:
    error.__cause__ = cause
    return error


def rejected(status: int) -> WorkerError:
    return WorkerError(f"prefill-0 refused request 'r-1' ({status})", status=status,
                       worker="prefill-0")


# (exception, status, OpenAI type, code, param, message)
ROWS: list[tuple[BaseException, int, str, str, str | None, str]] = [
    (RouterClosed(), 503, "service_unavailable_error", "router_closed", None,
     "the router is shutting down"),
    (RouterClosed("closing"), 503, "service_unavailable_error", "router_closed", None,
     "closing"),
    (NoWorkerAvailable("the decode pool is empty"), 503, "service_unavailable_error",
     "no_worker_available", None, "the decode pool is empty"),
    (NoWorkerAvailable(), 503, "service_unavailable_error", "no_worker_available", None,
     "no worker available"),
    (PrefillDeadlineExceeded("prefill", 60), 504, "timeout_error",
     "prefill_deadline_exceeded", None, "prefill deadline of 60 s exceeded"),
    (PrefillDeadlineExceeded("transfer", 300), 504, "timeout_error",
     "prefill_deadline_exceeded", None, "transfer deadline of 300 s exceeded"),
    (DeadlineExceeded("handoff", 30), 504, "timeout_error", "deadline_exceeded", None,
     "handoff deadline of 30 s exceeded"),
    (DeadlineExceeded("decode idle", 2.5), 504, "timeout_error", "deadline_exceeded", None,
     "decode idle deadline of 2.5 s exceeded"),
    (InvalidPrefillHandoff("ctx_request_id is not an integer", field=FIELD), 502,
     "upstream_error", "invalid_prefill_handoff", FIELD, "ctx_request_id is not an integer"),
    # More specific than a prefill's 4xx: the prefill answered, its answer was bad.
    (caused_by(InvalidPrefillHandoff("two choices", field="choices"), rejected(400)), 502,
     "upstream_error", "invalid_prefill_handoff", "choices", "two choices"),
    (caused_by(PrefillError("prefill-0 failed"), rejected(429)), 429,
     "invalid_request_error", "prefill_rejected", None,
     "prefill-0 refused request 'r-1' (429)"),
    (caused_by(PrefillError("prefill-0 failed"), rejected(404)), 404,
     "invalid_request_error", "prefill_rejected", None,
     "prefill-0 refused request 'r-1' (404)"),
    (caused_by(PrefillError("prefill-0 failed: answered 500"), rejected(502)), 502,
     "upstream_error", "prefill_failed", None, "prefill-0 failed: answered 500"),
    (caused_by(PrefillError("prefill-0 failed"), ValueError("bad")), 502,
     "upstream_error", "prefill_failed", None, "prefill-0 failed"),
    (PrefillError("Prefill returned no output"), 502, "upstream_error", "prefill_failed",
     None, "Prefill returned no output"),
    (NoDisaggregatedParams("no usable ctx_request_id"), 502, "upstream_error",
     "prefill_failed", None, "no usable ctx_request_id"),
    (WorkerError("decode-0 refused", status=400), 400, "invalid_request_error",
     "worker_error", None, "decode-0 refused"),
    (WorkerError("decode-0 refused", status=429), 429, "invalid_request_error",
     "worker_error", None, "decode-0 refused"),
    # S2: a worker refusing the router's credentials is not the client's 401 / 403
    (WorkerError("decode-0 refused", status=401), 502, "upstream_error", "worker_error",
     None, "decode-0 refused"),
    (caused_by(PrefillError("prefill-0 failed"), rejected(403)), 502,
     "upstream_error", "prefill_failed", None, "prefill-0 failed"),
    # A worker's 503 (an HTTP worker's, or an in-process engine's own) is passed on: the
    # fleet is busy, not broken.
    (WorkerError("decode-0 failed", status=503), 503, "service_unavailable_error",
     "worker_unavailable", None, "decode-0 failed"),
    (WorkerError("decode-0 answered 503", status=502, worker_status=503), 503,
     "service_unavailable_error", "worker_unavailable", None, "decode-0 answered 503"),
    (caused_by(PrefillError("prefill-0 failed: answered 503"),
               WorkerError("answered 503", status=502, worker_status=503)), 503,
     "service_unavailable_error", "worker_unavailable", None,
     "prefill-0 failed: answered 503"),
    (WorkerError("decode-0 failed", status=500), 502, "upstream_error", "worker_error",
     None, "decode-0 failed"),
    (WorkerError("decode-0 answered 302", status=302), 502, "upstream_error",
     "worker_error", None, "decode-0 answered 302"),
    (WorkerError("connection reset"), 502, "upstream_error", "worker_error", None,
     "connection reset"),
    # A bug: nothing of it reaches the client.
    (RuntimeError("secret internals"), 500, "internal_error", "internal_error", None,
     "internal server error"),
    (KeyError("secret"), 500, "internal_error", "internal_error", None,
     "internal server error"),
]


@pytest.mark.parametrize(
    ("exc", "status", "kind", "code", "param", "message"),
    ROWS,
    ids=[f"{type(row[0]).__name__}-{row[1]}-{row[3]}" for row in ROWS],
)
def test_each_exception_maps_to_its_status_type_and_code(
    exc: BaseException, status: int, kind: str, code: str, param: str | None, message: str
) -> None:
    error = error_for_exception(exc)
    assert (error.status, error.type, error.code, error.param) == (status, kind, code, param)
    assert error.message == message
    assert error.to_dict() == {
        "error": {"message": message, "type": kind, "param": param, "code": code}
    }


def test_every_row_of_the_table_can_apply() -> None:
    """Most specific first: no row is shadowed by an earlier one that takes all of its
    exceptions (a row with a status of its own applies to every instance)."""
    for later_index, later in enumerate(ERROR_TABLE):
        for earlier in ERROR_TABLE[:later_index]:
            shadowed = issubclass(later.exception, earlier.exception) and (
                earlier.status is not None and not earlier.unavailable
            )
            assert not shadowed, (earlier, later)


def test_every_row_is_exercised() -> None:
    """The rows above reach every row of the table."""
    used = set()
    for exc, *_ in ROWS:
        for index, row in enumerate(ERROR_TABLE):
            if row.error_for(exc) is not None:
                used.add(index)
                break
    assert used == set(range(len(ERROR_TABLE)))


def test_an_exception_group_maps_by_its_first_leaf() -> None:
    """A defensive path: the router raises bare exceptions."""
    group = ExceptionGroup("request", [
        ExceptionGroup("leg", [PrefillDeadlineExceeded("prefill", 5), RuntimeError("x")]),
        WorkerError("later", status=429),
    ])
    error = error_for_exception(group)
    assert (error.status, error.code) == (504, "prefill_deadline_exceeded")
    bug = error_for_exception(ExceptionGroup("request", [RuntimeError("x"), RouterClosed()]))
    assert (bug.status, bug.code) == (500, "internal_error")


def worker_refusal(status: int, wait: float | None) -> WorkerError:
    """An HTTP worker's refusal with that status and ``Retry-After`` (as the adapter
    reads it)."""
    return WorkerError(f"worker answered {status}", status=status if status < 500 else 502,
                       worker="w", worker_status=status, retry_after=wait)


@pytest.mark.parametrize(("exc", "status", "retry_after"), [
    # the router's own 503s tell the client when to try again
    (RouterClosed(), 503, 1),
    (NoWorkerAvailable(), 503, 1),
    # a worker's 429 or 503 passes its Retry-After on, in whole seconds, at most 60
    (worker_refusal(429, 7.0), 429, 7),
    (worker_refusal(429, 0.2), 429, 1),
    (worker_refusal(429, 0.0), 429, 0),
    (worker_refusal(503, 3600.0), 503, 60),
    (caused_by(PrefillError("prefill-0 refused"), worker_refusal(429, 2.5)), 429, 3),
    (caused_by(PrefillError("prefill-0 failed"), worker_refusal(503, 5.0)), 503, 5),
    # none given, none sent; and never on another status
    (worker_refusal(503, None), 503, None),
    (worker_refusal(429, None), 429, None),
    (WorkerError("busy", status=500, worker_status=500, retry_after=5.0), 502, None),
    (DeadlineExceeded("handoff", 30), 504, None),
])
def test_retry_after_of_the_routers_503s_and_of_a_workers_refusal(
    exc: BaseException, status: int, retry_after: int | None
) -> None:
    error = error_for_exception(exc)
    assert (error.status, error.retry_after) == (status, retry_after)


NOW = 1_700_000_000.0  # a wall-clock time: Tue, 14 Nov 2023 22:13:20 GMT


@pytest.mark.parametrize(("headers", "seconds"), [
    ({}, None),
    ({"retry-after": "7"}, 7.0),
    ({"retry-after": " 7 "}, 7.0),
    ({"retry-after": "1.5"}, 1.5),  # not RFC 9110's, but plain enough
    ({"retry-after": "Tue, 14 Nov 2023 22:13:50 GMT"}, 30.0),  # an HTTP date: 30 s on
    ({"retry-after": "Tue, 14 Nov 2023 22:00:00 GMT"}, 0.0),  # a date past: at once
    ({"retry-after": "9" * 400}, 86400.0),  # at most a day (the server sends at most 60)
    ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),  # OpenAI's own header wins
    ({"retry-after-ms": "soon", "retry-after": "9"}, 9.0),
    # not a wait: ignored, never a crash
    ({"retry-after": "-3"}, None),
    ({"retry-after": "1e3"}, None),
    ({"retry-after": "soon"}, None),
    ({"retry-after": ""}, None),
    ({"retry-after": "\u0663"}, None),  # a digit, but not an ASCII one
    ({"retry-after": "Tue, 99 Nov 2023 22:13:50 GMT"}, None),
    ({"retry-after": "Sun, 06 Nov 99999 08:49:37 GMT"}, None),
])
def test_a_workers_retry_after_as_the_adapter_reads_it(
    headers: dict[str, str], seconds: float | None
) -> None:
    assert retry_after(headers, NOW) == seconds
