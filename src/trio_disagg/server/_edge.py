"""The router's edge: what a request must pass before its body is read or any worker called.

API keys, the body's content type, admission control (generation requests in flight, and
keeper tasks in flight), the prompt-size limit, and the client's ``fault`` field. Every
refusal is an OpenAI error built in :mod:`._openai_errors`; docs/router.md ("Securing and
limiting the router") describes them all.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import orjson
import trio
from prometheus_client import Counter

from .._asgi import Receive, Scope, header_bytes
from ._openai_errors import (
    ApiError,
    invalid_api_key,
    prompt_too_long,
    server_overloaded,
    unsupported_content_encoding,
    unsupported_media_type,
)

logger = logging.getLogger("trio_disagg.server")

#: Reasons of ``trio_disagg_http_refused_total``.
REFUSALS = ("unauthorized", "unsupported_media_type", "max_in_flight", "max_keeper_tasks")

#: The body's fault-injection field: honoured by the mock engines and workers only when
#: the router was started with fault injection on.
FAULT_FIELD = "fault"


@attrs.frozen
class Refusal:
    """A request the edge refuses: the error, the extra response headers, and why
    (a ``trio_disagg_http_refused_total`` reason)."""

    error: ApiError
    reason: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


def _digest(key: bytes) -> bytes:
    # Keys are compared as digests, so that the comparison's time does not even depend on
    # the length of the key the client sent.
    return hashlib.sha256(key).digest()


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"application/json"


def _is_identity(content_encoding: bytes) -> bool:
    return all(coding.strip().lower() in (b"", b"identity")
               for coding in content_encoding.split(b","))


class Edge:
    """The checks a request passes at the edge, and the count of generation requests
    admitted.

    Args:
        api_key: the bearer key every ``/v1/*`` request must send; None for none.
        protect_metrics: with an ``api_key``, every path but ``/livez`` needs it,
            ``/health`` and ``/metrics`` too; else those stay open. ``/livez`` is always
            open: it tells nothing but that the process serves, and a liveness probe
            that got 401 would have the replica restarted forever.
        max_in_flight: the most generation requests handled at once; None for no limit.
        max_keeper_tasks: keeper tasks in flight (prefill drains, decode legs kept for a
            transfer, cleanups) at which new generation requests are refused, a request
            admitted and not yet routed counting as one; None for no limit. A task
            already started is never refused or dropped.
        max_prompt_bytes: the largest prompt accepted, in bytes (see :meth:`check_prompt`).
        fault_injection: whether a body's ``"fault"`` reaches the engines.
        keeper_in_flight: reads the keeper's tasks in flight.

    Raises:
        ValueError: an empty ``api_key`` (or one no client could send: whitespace around
            it, a CR, LF or NUL), ``protect_metrics`` without one, or a limit that
            is not positive.
    """

    def __init__(
        self,
        *,
        api_key: str | None,
        protect_metrics: bool,
        max_in_flight: int | None,
        max_keeper_tasks: int | None,
        max_prompt_bytes: int,
        fault_injection: bool,
        keeper_in_flight: Callable[[], int],
    ) -> None:
        if api_key is not None and not api_key.strip():
            raise ValueError("the API key must not be empty")
        if api_key is not None and (api_key != api_key.strip()
                                    or any(char in api_key for char in "\r\n\0")):
            raise ValueError("the API key must not begin or end with whitespace, nor hold a "
                             "CR, LF or NUL: no client could send it")
        if protect_metrics and api_key is None:
            raise ValueError("protect_metrics needs an API key")
        for name, limit in (("max_in_flight", max_in_flight),
                            ("max_keeper_tasks", max_keeper_tasks),
                            ("max_prompt_bytes", max_prompt_bytes)):
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be >= 1, got {limit}")
        self._key_digest = _digest(api_key.encode()) if api_key is not None else None
        self.protect_metrics = protect_metrics
        self.max_in_flight = max_in_flight
        self.max_keeper_tasks = max_keeper_tasks
        self.max_prompt_bytes = max_prompt_bytes
        self.fault_injection = fault_injection
        self._keeper_in_flight = keeper_in_flight
        # Counting context managers that are classes, not generators: entered on every
        # request (P4a).
        self._slot = _Count()
        self._routing = _Count()
        #: ``trio_disagg_http_refused_total{reason}`` (:data:`REFUSALS`), unregistered:
        #: the app registers it in its own registry.
        self.refused = Counter(
            "trio_disagg_http_refused", "Requests refused at the edge before their body was "
            "read, by reason.", ["reason"], registry=None,
        )
        for reason in REFUSALS:
            self.refused.labels(reason)

    @property
    def requires_key(self) -> bool:
        """Whether an API key is configured."""
        return self._key_digest is not None

    def authorize(self, scope: Scope) -> Refusal | None:
        """401 ``invalid_api_key`` for a request to a protected path without
        ``Authorization: Bearer <key>``, else None. ``/v1/*`` is protected when a key is
        configured; every other path too with ``protect_metrics``, but ``/livez``, the
        liveness probe, which carries no key."""
        expected = self._key_digest
        if expected is None:
            return None
        path = scope["path"]
        if not path.startswith("/v1/") and (not self.protect_metrics or path == "/livez"):
            return None
        header = header_bytes(scope, b"authorization")
        given: bytes | None = None
        if header is not None:
            scheme, _, credentials = header.strip().partition(b" ")
            if scheme.lower() == b"bearer" and credentials.strip():
                given = credentials.strip()
        if given is not None and hmac.compare_digest(_digest(given), expected):
            return None
        return Refusal(invalid_api_key(given is not None), "unauthorized",
                       ((b"www-authenticate", b'Bearer realm="trio-disagg"'),))

    def admit(self, scope: Scope, *, generation: bool) -> Refusal | None:
        """The refusal of a routed request before its body is read, else None.

        A POST whose ``Content-Type`` is not ``application/json`` (text/plain, a form,
        none) gets 415: a browser sends those cross-site without a preflight; so does one
        sent compressed (a ``Content-Encoding`` other than ``identity``). A generation
        request gets 503 ``server_overloaded`` with ``Retry-After`` when ``max_in_flight``
        requests are in flight, or ``max_keeper_tasks`` keeper tasks, each request
        admitted and not yet routed counting as one (the prefill drain it will start).
        An admitted
        generation request must then be run inside :meth:`slot`, with no checkpoint in
        between, so that the count is exact.
        """
        if scope["method"] == "POST":
            raw = header_bytes(scope, b"content-type")
            if not _is_json(raw):
                return Refusal(unsupported_media_type(None if raw is None else
                                                      raw.decode("latin-1")),
                               "unsupported_media_type")
            encoding = header_bytes(scope, b"content-encoding")
            if encoding is not None and not _is_identity(encoding):
                # Read as it is, a gzip body is "malformed JSON": name the real cause.
                return Refusal(unsupported_content_encoding(encoding.decode("latin-1")),
                               "unsupported_media_type")
        if not generation:
            return None
        limit = self.max_in_flight
        if limit is not None and self.in_flight >= limit:
            return Refusal(server_overloaded(
                f"the router is at its limit of {limit} requests in flight; retry later"),
                "max_in_flight")
        limit = self.max_keeper_tasks
        # A request admitted but not yet routed has no keeper task yet: counted as the
        # prefill drain it will start, or a burst that arrives at once would all be
        # admitted before the first drain started.
        if limit is not None and (self._keeper_in_flight() + self.in_flight
                                  - self.routed) >= limit:
            return Refusal(server_overloaded(
                f"the router is at its limit of {limit} KV transfers and cleanups in "
                "flight; retry later"), "max_keeper_tasks")
        return None

    @property
    def in_flight(self) -> int:
        """Generation requests admitted whose answer is not complete (:meth:`slot`)."""
        return self._slot.count

    @property
    def routed(self) -> int:
        """Of those, the ones the router is handling (:meth:`routing`); the others are
        still being read or validated, and each is about to start a prefill drain."""
        return self._routing.count

    def slot(self) -> Slot:
        """Count one admitted generation request until its answer is complete (a
        context manager: :meth:`Slot.leave` when the response's last bytes went out),
        or, for one whose answer never completes (its client left, it broke), for as
        long as it is handled. So a client that sends its next request as soon as it
        read the last answer is not refused while that request's decode leg winds down
        (``linger``)."""
        return Slot(self._slot)

    def routing(self) -> _Count:
        """Count an admitted request as handed to the router for the block (a context
        manager): enter it with no checkpoint before the router starts the request's
        prefill drain, so that the request is never counted twice, nor not at all,
        against ``max_keeper_tasks``."""
        return self._routing

    def check_prompt(self, data: bytes, body: Mapping[str, Any], *, chat: bool) -> None:
        """Refuse a prompt over ``max_prompt_bytes`` before any worker is called.

        The prompt is the ``messages`` of a chat request, the ``prompt`` of a completion,
        measured as compact JSON (orjson). A body no larger than the limit is never
        refused: its prompt cannot be larger, and is not measured.

        Args:
            data: the body as received.
            body: the body parsed.
            chat: a chat completion request.

        Raises:
            ApiError: 400 ``prompt_too_long``.
        """
        limit = self.max_prompt_bytes
        if len(data) <= limit:
            return
        param = "messages" if chat else "prompt"
        prompt = body.get(param)
        if prompt is None:
            return
        size = len(orjson.dumps(prompt))
        if size > limit:
            raise prompt_too_long(param, size, limit)

    def strip_fault(self, body: dict[str, Any]) -> None:
        """Remove a client's ``"fault"`` from ``body`` unless fault injection is on: a
        client must not make the mock engines (or mock workers) fail on purpose."""
        if not self.fault_injection and FAULT_FIELD in body:
            del body[FAULT_FIELD]
            logger.debug("ignored a request's %r field (fault injection is off)", FAULT_FIELD)


#: Seconds a refused request's body may take to arrive before the answer goes out anyway:
#: a client that refuses to send its body holds nothing for long.
DISCARD_WINDOW = 5.0


def expects_continue(scope: Scope) -> bool:
    """Whether the client sent ``Expect: 100-continue``: it sends its body only once the
    server asks for it, which a refusal never does."""
    return any(name == b"expect" and value.lower() == b"100-continue"
               for name, value in scope.get("headers", ()))


async def discard_body(receive: Receive, limit: int) -> None:
    """Read and throw away a refused request's body, up to ``limit`` bytes, so that the
    client reads the answer rather than a connection reset. Returns at the body's end, at
    a disconnect, past ``limit`` or after :data:`DISCARD_WINDOW` seconds (in the last two
    cases the server closes the connection after the answer)."""
    size = 0
    with trio.move_on_after(DISCARD_WINDOW):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if not message.get("more_body", False) or size > limit:
                return


class _Count:
    """A count of the blocks it is entered for (:meth:`Edge.routing`)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> None:
        self.count += 1

    def __exit__(self, *exc_info: object) -> None:
        self.count -= 1


class Slot:
    """One admitted generation request, counted against ``max_in_flight`` (a context
    manager, :meth:`Edge.slot`) until :meth:`leave` or the end of its block, whichever
    comes first."""

    __slots__ = ("_count",)

    def __init__(self, count: _Count) -> None:
        self._count: _Count | None = count

    def __enter__(self) -> Slot:
        if self._count is not None:
            self._count.count += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.leave()

    def leave(self) -> None:
        """No longer count the request (its answer is complete). Idempotent."""
        count, self._count = self._count, None
        if count is not None:
            count.count -= 1
