"""A generation request at the edge: its state as the app sees it (and the disconnect
listener that cancels it), its id, its body (bounded in size), and its validation into
the router's :class:`~trio_disagg.PreprocessedRequest` (B8)."""

from __future__ import annotations

import itertools
import os
from typing import Any

import attrs
import trio

from .. import _asgi
from .._asgi import BodyTooLarge, Receive, Scope, declared_length, header, wait_disconnect
from .._http11 import ON_DISCONNECT
from .._protocols import PreprocessedRequest, RoutingHints
from ._edge import Edge, expects_continue
from ._openai_errors import ApiError, request_too_large
from ._openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    check_chat,
    check_common,
    check_completion,
    check_max_tokens,
    check_prompt_fields,
    parse_json,
    structure_body,
)
from ._responder import Responder

#: Bytes of an oversized body read (and thrown away) before answering 413, so the client
#: sees the answer rather than a connection reset.
_DRAIN_LIMIT = 8 * 1024 * 1024
MAX_REQUEST_ID = 256


@attrs.frozen
class RequestLimits:
    """What a generation request is checked against.

    Attributes:
        edge: the checks before any worker is called (prompt size, the body's ``fault``).
        models: the model names served.
        max_tokens_limit: the largest ``max_tokens`` / ``max_completion_tokens`` accepted.
        default_max_tokens: the budget, in tokens, of a request that names none.
    """

    edge: Edge
    models: frozenset[str]
    max_tokens_limit: int
    default_max_tokens: int


class RequestState:
    """One generation request, as the app's shutdown sees it.

    Attributes:
        responder: its response.
        scope: cancelled by :meth:`OpenAIApp.shutdown` (with ``shutdown`` set).
        disconnected: the client went away.
        shutdown: the server cancelled the request because it is shutting down.
        outcome: the ``requests_total`` outcome, once known.
    """

    __slots__ = ("disconnected", "outcome", "responder", "scope", "shutdown")

    def __init__(self, responder: Responder) -> None:
        self.responder = responder
        self.scope = trio.CancelScope()
        self.disconnected = False
        self.shutdown = False
        self.outcome = "disconnected"  # unless the request gets further

    def cancel_for_shutdown(self) -> None:
        self.shutdown = True
        self.scope.cancel()


class DisconnectGuard:
    """The disconnect listener as a callback, for a server that offers
    ``ON_DISCONNECT`` (the project's own): called once when the client goes away, it
    cancels the request's nursery, and only it, as :func:`watch_disconnect` does, with no
    task of its own. :meth:`cancel` (the answer is complete) disarms it, as cancelling a
    listener task's scope does."""

    __slots__ = ("armed", "request_scope", "state")

    def __init__(self, state: RequestState, request_scope: trio.CancelScope) -> None:
        self.state = state
        self.request_scope = request_scope
        self.armed = True

    def __call__(self) -> None:
        if self.armed:
            self.armed = False
            self.state.disconnected = True
            self.request_scope.cancel()

    def cancel(self) -> None:
        self.armed = False


def listen_for_disconnect(
    nursery: trio.Nursery, scope: Scope, receive: Receive, state: RequestState
) -> DisconnectGuard | trio.CancelScope:
    """Cancel ``nursery`` (the request's), and only it, when the client goes away: by a
    callback the server calls, if it offers ``ON_DISCONNECT``, else by a task that waits
    for ``http.disconnect`` (hypercorn). Returns what the responder cancels once the
    answer is complete."""
    offer = scope.get("extensions", {}).get(ON_DISCONNECT)
    if offer is not None:
        guard = DisconnectGuard(state, nursery.cancel_scope)
        offer["register"](guard)
        return guard
    listener = trio.CancelScope()
    nursery.start_soon(watch_disconnect, receive, nursery.cancel_scope, listener, state)
    return listener


async def watch_disconnect(
    receive: Receive,
    request_scope: trio.CancelScope,
    listener: trio.CancelScope,
    state: RequestState,
) -> None:
    """Cancel the request's nursery, and only it, when the client goes away.

    Hypercorn never cancels an app by itself: a client that disconnects is only an
    ``http.disconnect`` message on ``receive``.
    """
    with listener:
        await wait_disconnect(receive)
        state.disconnected = True
        request_scope.cancel()


def request_id_of(scope: Scope) -> tuple[str, bool]:
    """The request id that goes out on every answer, errors included: the client's
    ``X-Request-Id`` if it is usable, else a fresh uuid4; and whether the client's was bad
    (over ``MAX_REQUEST_ID`` characters, not UTF-8 or not printable: a 400 once the body
    is read).

    The header is read as UTF-8, the encoding the id is sent on in (to the workers, in
    the answer's header and its ``id``), so that its bytes come back as the client sent
    them."""
    raw = _asgi.header_bytes(scope, b"x-request-id")
    request_id: str | None = None
    bad_id = False
    if raw is not None:
        try:
            request_id = raw.decode()
        except UnicodeDecodeError:
            bad_id = True
        else:
            bad_id = len(request_id) > MAX_REQUEST_ID or not request_id.isprintable()
    if request_id is None or bad_id or not request_id.strip():
        request_id = fresh_request_id()
    return request_id, bad_id


#: A 128-bit number's version and variant bits, cleared and set as a uuid4's.
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48)) & ((1 << 128) - 1)
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


def fresh_request_id() -> str:
    """A random uuid4 in its usual text form, as ``str(uuid.uuid4())`` makes it (16 bytes
    of ``os.urandom``), at half its cost: no :class:`uuid.UUID` is built on the way
    (docs/performance.md)."""
    digits = f"{int.from_bytes(os.urandom(16), 'big') & _UUID4_CLEAR | _UUID4_SET:032x}"
    return (f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-"
            f"{digits[20:]}")


def _draw_tag() -> None:
    global _TAG, _serial
    _TAG = os.urandom(4).hex()
    _serial = itertools.count(1).__next__


#: What makes this process's worker request ids its own among the router processes (and
#: routers) in front of the same workers, and a serial within it: drawn at import and
#: again in a forked child.
_TAG = ""
_serial = itertools.count(1).__next__
_draw_tag()
if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_draw_tag)


def worker_request_id(request_id: str) -> str:
    """The id the workers see for a request whose client id is ``request_id`` (rule B8,
    docs/protocols.md section 1): ``request_id``, a dot, and an id unique to this
    router request (this process's tag and a serial), so that two requests in flight
    with one ``X-Request-Id`` (a retrying client) never share an id at a worker: vLLM
    refuses a request whose id is already running, and the workers key their requests,
    aborts and transfers by it. It starts with the client's id, for the workers' logs.
    A counter, not a uuid4: a few hundred nanoseconds, several times less (per request)."""
    return f"{request_id}.{_TAG}{_serial():x}"


def client_request_id(request: PreprocessedRequest) -> str:
    """The client's id of a request the server built (:func:`worker_request_id`'s
    argument): the answer's ``id`` is made of it."""
    return request.request_id.rpartition(".")[0]


def bad_request_id() -> ApiError:
    return ApiError(400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID} printable characters "
                    "in UTF-8",
                    param="X-Request-Id", code="invalid_value")


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The request body, or None if the client went away first. An oversized body is
    drained up to ``_DRAIN_LIMIT`` bytes past ``limit`` before the 413; but a client that
    waits for ``100 Continue`` (curl, for a body over 1 MiB) is not asked for a body
    declared over ``limit``: it gets the 413 at once (RFC 9110, section 10.1.1).

    Raises:
        ApiError: 413 if the body is (or is declared) over ``limit`` bytes.
    """
    declared = declared_length(scope)
    unasked = declared is not None and declared > limit and expects_continue(scope)
    try:
        return await _asgi.read_body(
            receive, limit, drain=0 if unasked else _DRAIN_LIMIT, declared=declared)
    except BodyTooLarge:
        raise request_too_large(limit) from None


def build_request(
    scope: Scope, data: bytes, request_id: str, limits: RequestLimits, *, chat: bool
) -> tuple[PreprocessedRequest, bool]:
    """Validate a generation request at the edge.

    Args:
        scope: the request's ASGI scope (its ``X-Session-Id`` header).
        data: the request body.
        request_id: from :func:`request_id_of` (the client's); the request's own id is
            :func:`worker_request_id` of it.
        limits: what the request is checked against.

    Returns:
        The router's request, and whether the client asked for a usage chunk.

    Raises:
        ApiError: 400 for malformed JSON, a prompt over ``max_prompt_bytes``
            (``prompt_too_long``), wrong types, missing fields, out-of-range values,
            ``n`` > 1, ``prompt_logprobs`` or ``echo: true`` (B8); 404 for an unknown
            model.
    """
    raw = parse_json(data)
    if not isinstance(raw, dict):
        raise ApiError(400, f"the request body must be a JSON object, "
                       f"got {type(raw).__name__}", code="invalid_type")
    limits.edge.check_prompt(data, raw, chat=chat)  # 400 before any worker is called
    limits.edge.strip_fault(raw)
    parsed, budget, budget_name = _typed(raw, limits, chat=chat)
    if budget_name is None:
        # A chat that names no budget has none (the worker's is the rest of its context,
        # and none is invented for it, B8): min_tokens is bounded by the largest budget
        # accepted, not by the default the in-process engines use.
        check_common(parsed, limits.max_tokens_limit, param="the largest budget accepted")
    else:
        check_common(parsed, budget, param=budget_name)
    check_prompt_fields(raw)  # B8: what only the prefill computed is not served
    if parsed.model not in limits.models:
        raise ApiError(404, f"The model `{parsed.model}` does not exist.",
                       param="model", code="model_not_found")
    session = header(scope, b"x-session-id") or parsed.user
    options = parsed.stream_options
    include_usage = bool(options is not None and options.include_usage)
    request = PreprocessedRequest(
        request_id=worker_request_id(request_id),
        model=parsed.model,
        body=raw,
        max_tokens=budget,
        stream=bool(parsed.stream),
        routing=RoutingHints(session_id=session),
    )
    return request, include_usage


def continuous_usage(request: PreprocessedRequest) -> bool:
    """Whether a validated request asked for vLLM's ``stream_options.continuous_usage_stats``
    (the usage so far in every chunk, B8). As vLLM, the router honours it only with
    ``include_usage`` (which the caller checks): without it no chunk carries a usage."""
    options = request.body.get("stream_options")
    return isinstance(options, dict) and options.get("continuous_usage_stats") is True


def _typed(
    raw: dict[str, Any], limits: RequestLimits, *, chat: bool
) -> tuple[CompletionRequest | ChatCompletionRequest, int, str | None]:
    """The typed request, its completion budget in tokens, and the budget's field name
    (None for a chat that names none: a completion's default of 16 is its workers' too,
    a chat's default is not)."""
    budget_name = "max_tokens"
    if chat:
        chat_request: ChatCompletionRequest = structure_body(raw, ChatCompletionRequest)
        check_chat(chat_request)
        parsed: CompletionRequest | ChatCompletionRequest = chat_request
        budget = chat_request.max_tokens
        if chat_request.max_completion_tokens is not None:
            if budget is not None:  # both given: both must be valid; the newer wins
                check_max_tokens("max_tokens", budget, limits.max_tokens_limit)
            budget_name, budget = "max_completion_tokens", chat_request.max_completion_tokens
    else:
        completion_request: CompletionRequest = structure_body(raw, CompletionRequest)
        check_completion(completion_request)
        parsed = completion_request
        budget = completion_request.max_tokens
    if budget is None:
        return parsed, limits.default_max_tokens, None if chat else budget_name
    check_max_tokens(budget_name, budget, limits.max_tokens_limit)
    return parsed, budget, budget_name
