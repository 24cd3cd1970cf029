"""The OpenAI-compatible ASGI application in front of a :class:`~trio_disagg.DisaggRouter`."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

import trio
from trio_util import AsyncValue

from .._asgi import Receive, Scope, Send, lifespan
from .._context import RequestContext
from .._http11 import WHOLE_SENDS
from .._protocols import (
    PreprocessedRequest,
)
from .._router import DisaggRouter, RequestStream
from ._collect import EMPTY, whole_messages
from ._edge import Edge, Refusal, discard_body, expects_continue
from ._endpoints import InfoEndpoints
from ._metrics import ServerMetrics, outcome_of
from ._openai_errors import ApiError, error_for_exception
from ._openai_responses import ChunkEncoder
from ._request import (
    RequestLimits,
    RequestState,
    bad_request_id,
    build_request,
    client_request_id,
    continuous_usage,
    listen_for_disconnect,
    read_body,
    request_id_of,
)
from ._responder import ENDING_WINDOW, SEND_WINDOW, Responder, end_cancelled
from ._writer import ContinuousSseSink, JsonSink, SseSink, write_response

logger = logging.getLogger("trio_disagg.server")



class OpenAIApp:
    """An ASGI 3 application serving the OpenAI API through a :class:`DisaggRouter`.

    Build it with :func:`create_app`; serve it with :func:`serve` (or any ASGI server
    running on trio). Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``
    (streamed and not), ``GET /v1/models``, ``GET /health`` (readiness), ``GET /livez``
    (liveness), ``GET /metrics``.

    Attributes:
        router: the router every generation request goes through.
        models: the model names served; any other is a 404 ``model_not_found``.
        metrics: this app's :class:`ServerMetrics` (its own registry).
        model_cards: the model objects of ``GET /v1/models``, from the workers.
        edge: the checks before a request's body is read (API key, content type,
            admission control) and before any worker is called (prompt size, the body's
            ``fault``); :func:`create_app` sets them up.
    """

    def __init__(
        self,
        router: DisaggRouter,
        *,
        models: Sequence[str],
        max_body_bytes: int,
        max_tokens_limit: int,
        default_max_tokens: int,
        linger: float,
        edge: Edge | None = None,
    ) -> None:
        self.router = router
        self.models = tuple(models)
        self.max_body_bytes = max_body_bytes
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = default_max_tokens
        self.linger = linger
        self.metrics = ServerMetrics(router, http_in_flight=lambda: len(self._active))
        #: What each worker's own whole chat answer carries in its ``message`` (B8).
        self._whole_messages = whole_messages(router)
        #: The checks at the edge: API key, content type, admission, prompt size, faults.
        self.edge = edge if edge is not None else Edge(
            api_key=None, protect_metrics=False, max_in_flight=None, max_keeper_tasks=None,
            max_prompt_bytes=max_body_bytes, fault_injection=False,
            keeper_in_flight=lambda: router.keeper.in_flight)
        self.metrics.registry.register(self.edge.refused)
        self._limits = RequestLimits(self.edge, frozenset(self.models), max_tokens_limit,
                                     default_max_tokens)
        self._info = info = InfoEndpoints(router, self.models, self.metrics)
        #: The model objects of ``GET /v1/models``, as the workers describe them.
        self.model_cards = info.cards
        self._active: set[RequestState] = set()
        self._cancelling = False
        self._generation = frozenset({"/v1/completions", "/v1/chat/completions"})
        # No request being handled, for the tasks in wait_idle (flipped only then).
        self._idle = AsyncValue(True)
        self._routes: dict[str, tuple[frozenset[str], Callable[..., Awaitable[None]]]] = {
            "/v1/completions": (frozenset({"POST"}), self._completions),
            "/v1/chat/completions": (frozenset({"POST"}), self._chat_completions),
            "/v1/models": (frozenset({"GET", "HEAD"}), info.list_models),
            "/health": (frozenset({"GET", "HEAD"}), info.health),
            "/livez": (frozenset({"GET", "HEAD"}), info.livez),
            "/metrics": (frozenset({"GET", "HEAD"}), info.render_metrics),
        }

    @property
    def in_flight(self) -> int:
        """Generation requests being handled, until their nursery closed (rule B5 in
        docs/semantics.md); a request's decode leg may outlive the response by up to
        ``linger`` seconds."""
        return len(self._active)

    async def wait_idle(self) -> None:
        """Return once no generation request is being handled."""
        await self._idle.wait_value(True)

    async def shutdown(self, window: float) -> int:
        """End the generation requests in flight (rule B3 in docs/semantics.md), as
        :func:`serve` does once its shutdown trigger fired and the router is closed.

        Requests get ``window`` seconds to finish. Those still running then are cancelled,
        each with a clean ending (B4): a 503 ``server_shutting_down`` error if its response
        had not started, else an error event and ``[DONE]``; each gets up to
        ``ENDING_WINDOW`` seconds to write it. Requests arriving afterwards are refused
        the same way. Returns once no request is handled (or the ending window is over).

        Returns:
            How many requests were cancelled before their response was complete (requests
            whose answer was complete and whose decode leg was winding down are not
            counted).
        """
        with trio.move_on_after(window):
            await self.wait_idle()
        self._cancelling = True
        cancelled = 0
        for state in list(self._active):
            if not state.responder.done:
                cancelled += 1
            state.cancel_for_shutdown()
        if cancelled:
            logger.warning("cancelled %d request(s) still in flight after the %g s window",
                           cancelled, window)
        with trio.move_on_after(ENDING_WINDOW + 1.0):
            await self.wait_idle()
        return cancelled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http_boundary(scope, receive, send)
        elif kind == "lifespan":
            await lifespan(receive, send)
        else:  # websocket: refused by the server when the app returns
            await trio.lowlevel.checkpoint()

    async def _http_boundary(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app's boundary: nothing one request does may escape into the server.

        An exception is logged and answered with a 500 if nothing was sent, else with an
        error event and ``[DONE]``. A request the server cancels from outside (its graceful
        timeout over, a hard stop) still gets its ending, shielded and bounded.
        """
        whole_sends = scope.get("extensions", {}).get(WHOLE_SENDS)
        responder = Responder(send, whole_sends=whole_sends is not None,
                              send_body=whole_sends.get("body") if whole_sends else None)
        handled = False
        try:
            await self._http(scope, receive, responder)
            handled = True
        except* Exception as group:  # a bug: never crash the server, never an opaque close
            handled = True
            logger.error("unexpected error serving %s %s", scope.get("method"),
                         scope.get("path"), exc_info=group)
            await self._internal_error(responder)
        finally:
            if not handled and not responder.done:  # cancelled from outside
                with trio.move_on_after(ENDING_WINDOW, shield=True):
                    await end_cancelled(responder)

    async def _http(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        edge = self.edge
        refusal = edge.authorize(scope)  # before routing: no key, nothing learnt
        if refusal is not None:
            await self._refuse(scope, receive, responder, refusal)
            return
        path = scope["path"]
        route = self._routes.get(path)
        if route is None and path.startswith("/v1/models/"):
            route = (frozenset({"GET"}), self._info.retrieve_model)
        if route is None:
            method = scope["method"]
            await responder.error(ApiError(
                404, f"Invalid URL ({method} {scope['path']})", code="unknown_url"))
            return
        methods, handler = route
        if scope["method"] not in methods:
            allow = ", ".join(sorted(methods)).encode()
            await responder.error(
                ApiError(405, f"Method {scope['method']} not allowed for {scope['path']}; "
                         f"use {allow.decode()}", code="method_not_allowed"),
                extra=[(b"allow", allow)],
            )
            return
        generation = scope["path"] in self._generation
        refusal = edge.admit(scope, generation=generation)
        if refusal is not None:
            await self._refuse(scope, receive, responder, refusal)
        elif generation:
            with edge.slot() as slot:  # no checkpoint since admit(): the count is exact
                responder.on_complete = slot.leave
                await handler(scope, receive, responder)
        else:
            await handler(scope, receive, responder)

    async def _refuse(self, scope: Scope, receive: Receive, responder: Responder,
                      refusal: Refusal) -> None:
        """Answer a request the edge refused, its body read and thrown away first; but a
        client that waits for ``100 Continue`` before it sends its body gets the answer
        at once, and no body is asked for (RFC 9110, section 10.1.1): the server then
        closes the connection, whose body was never sent."""
        self.edge.refused.labels(refusal.reason).inc()
        if not expects_continue(scope):
            await discard_body(receive, self.max_body_bytes)
        await responder.error(refusal.error, extra=refusal.headers)

    async def _internal_error(self, responder: Responder) -> None:
        """Report a bug to the client, shielded and bounded: a 500 if nothing was sent,
        else an error event and ``[DONE]``."""
        with trio.move_on_after(SEND_WINDOW, shield=True):
            try:
                await responder.error(error_for_exception(RuntimeError()))
            except Exception as exc:
                logger.debug("could not report an internal error: %r", exc)

    # --- generation -------------------------------------------------------------------

    async def _completions(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        await self._generate(scope, receive, responder, chat=False)

    async def _chat_completions(
        self, scope: Scope, receive: Receive, responder: Responder
    ) -> None:
        await self._generate(scope, receive, responder, chat=True)

    async def _generate(
        self, scope: Scope, receive: Receive, responder: Responder, *, chat: bool
    ) -> None:
        endpoint = "chat_completions" if chat else "completions"
        state = RequestState(responder)
        self._active.add(state)
        if len(self._active) == 1:
            self._idle.value = False
        try:
            with state.scope:
                if self._cancelling:  # arrived after the shutdown window
                    state.cancel_for_shutdown()
                await self._serve_generation(scope, receive, state, chat=chat)
            if state.shutdown and not responder.done and not state.disconnected:
                state.outcome = "unavailable"
                await end_cancelled(responder)
        except* Exception as group:
            logger.error("unexpected error serving %s", endpoint, exc_info=group)
            state.outcome = "internal_error"
            await self._internal_error(responder)
        finally:
            self.metrics.count_request(endpoint, state.outcome)
            self._active.discard(state)
            if not self._active:
                self._idle.value = True

    async def _serve_generation(
        self, scope: Scope, receive: Receive, state: RequestState, *, chat: bool
    ) -> None:
        """Read, validate, route and answer one generation request; record its outcome
        in ``state`` as soon as it is known."""
        responder = state.responder
        request_id, bad_id = request_id_of(scope)
        responder.request_id = request_id.encode()
        try:
            data = await read_body(scope, receive, self.max_body_bytes)
            if data is None:
                state.disconnected = True
                return
            if bad_id:
                raise bad_request_id()
            request, include_usage = build_request(
                scope, data, request_id, self._limits, chat=chat)
        except ApiError as error:
            state.outcome = outcome_of(error)
            await responder.error(error)
            return
        outcome = await self._route(scope, receive, state, request, include_usage, chat=chat)
        if outcome is None:
            outcome = "disconnected" if state.disconnected else "internal_error"
        state.outcome = outcome

    async def _route(
        self,
        scope: Scope,
        receive: Receive,
        state: RequestState,
        request: PreprocessedRequest,
        include_usage: bool,
        *,
        chat: bool,
    ) -> str | None:
        """Route one valid request and answer it, in a nursery the client's disconnect
        cancels; return its outcome, None if it is still unknown (the client went away)."""
        context = RequestContext(
            request.request_id, {"session_id": request.routing.session_id}
        )
        # Counted as routed from here on, for max_keeper_tasks: no checkpoint comes before
        # router.stream() starts the prefill drain.
        with self.edge.routing():
            return await self._route_counted(scope, receive, state, request, context,
                                             include_usage, chat=chat)

    async def _route_counted(
        self,
        scope: Scope,
        receive: Receive,
        state: RequestState,
        request: PreprocessedRequest,
        context: RequestContext,
        include_usage: bool,
        *,
        chat: bool,
    ) -> str | None:
        """:meth:`_route`, the request counted as routed."""
        responder = state.responder
        outcome: str | None = None
        try:
            async with trio.open_nursery() as nursery:
                listener = listen_for_disconnect(nursery, scope, receive, state)
                responder.listener = listener
                try:
                    stream = await self.router.stream(nursery, request, context)
                except Exception as exc:
                    refusal = error_for_exception(exc)
                    if refusal.status == 500:
                        logger.error("unexpected error routing %s", request.request_id,
                                     exc_info=exc)
                    await responder.error(refusal)
                    outcome = outcome_of(refusal)
                else:
                    outcome = await self._answer(
                        responder, request, stream, include_usage, chat=chat)
                    self._observe_phases(stream)
                state.outcome = outcome
                # The answer is complete: let the decode leg end on its own (it records
                # the worker's success), but not for longer than ``linger`` seconds.
                listener.cancel()
                nursery.cancel_scope.deadline = min(
                    nursery.cancel_scope.deadline, trio.current_time() + self.linger
                )
        except* Exception as group:
            # A task of the request crashed (an engine raising after it started, a bug).
            if not responder.done:
                crash = error_for_exception(group)
                if crash.status == 500:
                    logger.error("unexpected error in request %s", request.request_id,
                                 exc_info=group)
                else:
                    logger.warning("request %s failed: %s", request.request_id, crash.message)
                outcome = outcome_of(crash)
                await responder.error(crash)
            else:
                logger.warning("request %s: a task failed after the answer was complete",
                               request.request_id, exc_info=group)
        finally:
            responder.listener = None  # (its guard holds the request's state: a cycle)
        return outcome

    async def _answer(self, responder: Responder, request: PreprocessedRequest,
                      stream: RequestStream, include_usage: bool, *, chat: bool) -> str:
        """Write the answer of a routed request: server-sent events or one JSON body."""
        created = int(time.time())
        response_id = ("chatcmpl-" if chat else "cmpl-") + client_request_id(request)
        sink: SseSink | JsonSink
        observe_itl: Callable[[float], None] | None = None
        if request.stream:
            encoder = ChunkEncoder(chat=chat, response_id=response_id, model=request.model,
                                   created=created, include_usage=include_usage)
            if include_usage and continuous_usage(request):
                sink = ContinuousSseSink(responder, encoder, stream)
            else:
                sink = SseSink(responder, encoder, include_usage)
            observe_itl = self.metrics.itl.observe
        else:
            served_by = stream.decode_worker or stream.prefill_worker
            sink = JsonSink(responder, chat=chat, response_id=response_id,
                            model=request.model, created=created,
                            whole_message=self._whole_messages.get(served_by or "", EMPTY))
        return await write_response(stream, sink, lambda: self._first_token(stream),
                                    observe_itl)

    def _observe_phases(self, stream: RequestStream) -> None:
        tracker = stream.tracker
        metrics = self.metrics
        if tracker.prefill_complete_at is not None and tracker.created_at is not None:
            metrics.prefill_time.observe(tracker.prefill_complete_at - tracker.created_at)
        if stream.style != "terminal":
            latency = tracker.kv_transfer_latency
            if latency is not None:
                metrics.kv_transfer.observe(latency)

    def _first_token(self, stream: RequestStream) -> None:
        tracker = stream.tracker
        tracker.record_decode_first_token()
        ttft = tracker.time_to_first_token
        if ttft is not None:
            self.metrics.ttft.observe(ttft)


def create_app(
    router: DisaggRouter, *, models: Sequence[str], max_body_bytes: int = 2 * 1024 * 1024,
    max_prompt_bytes: int = 1024 * 1024, max_tokens_limit: int = 32768,
    default_max_tokens: int = 16, linger: float = 5.0, api_key: str | None = None,
    protect_metrics: bool = False, max_in_flight: int | None = None,
    max_keeper_tasks: int | None = None, fault_injection: bool = False) -> OpenAIApp:
    """Build the OpenAI-compatible ASGI app for ``router``.

    Each generation request runs in a nursery of its own, in which the router starts the
    decode leg; a disconnect listener cancels that nursery, and only it, when the client
    goes away (the prefill runs on in the router's keeper). Validation errors are 4xx
    OpenAI errors; nothing a client sends makes a 500 or stops the server.

    Before a request's body is read, the edge checks its API key (401), its content type
    (415) and, for a generation request, admission (503 with ``Retry-After``); then the
    body's size (413) and its prompt's (400 ``prompt_too_long``), all before any worker is
    called. docs/router.md ("Securing and limiting the router") has the details.

    Args:
        router: the router; its keeper must stay open while the app serves.
        models: the model names to accept (``GET /v1/models`` lists them); requests for any
            other get 404 ``model_not_found``.
        max_body_bytes: the largest request body accepted, in bytes; a larger one gets 413.
        max_prompt_bytes: the largest prompt accepted, in bytes: a chat request's
            ``messages`` or a completion's ``prompt``, measured as compact JSON. A larger
            one gets 400 ``prompt_too_long`` before any worker is called.
        max_tokens_limit: the largest ``max_tokens`` / ``max_completion_tokens`` accepted.
        default_max_tokens: the completion budget, in tokens, of a request that names none
            (16 is OpenAI's legacy completions default). The client's body is passed to the
            workers unchanged; this is ``PreprocessedRequest.max_tokens``.
        linger: seconds a finished request's decode leg may take to wind down before it
            is cancelled.
        api_key: if given, every ``/v1/*`` request must send ``Authorization: Bearer
            <api_key>``, else it gets 401 ``invalid_api_key``; compared in constant time.
        protect_metrics: with ``api_key``, ``/health``, ``/metrics`` and every other path
            but ``/livez`` (the liveness probe, always open) need the key too.
        max_in_flight: the most generation requests handled at once; past it a new one
            gets 503 ``server_overloaded`` with ``Retry-After`` at once. None: no limit.
        max_keeper_tasks: the keeper tasks in flight (prefill drains, decode legs kept for
            a KV transfer, cleanups; a request not yet routed counts as one) at which new
            requests are refused the same way; started tasks always end. None: no limit.
        fault_injection: pass a client's ``"fault"`` field on to the engines (the mock
            engines and workers read it). Off, it is removed from every body first.

    Returns:
        An :class:`OpenAIApp`.

    Raises:
        ValueError: no models, a limit that is not positive, an empty ``api_key`` (or
            one no client could send), or ``protect_metrics`` without one.
    """
    _check_arguments(models, max_body_bytes, max_tokens_limit, default_max_tokens, linger)
    keeper = router.keeper
    edge = Edge(
        api_key=api_key, protect_metrics=protect_metrics, max_in_flight=max_in_flight,
        max_keeper_tasks=max_keeper_tasks, max_prompt_bytes=max_prompt_bytes,
        fault_injection=fault_injection, keeper_in_flight=lambda: keeper.in_flight)
    return OpenAIApp(router, models=models, max_body_bytes=max_body_bytes,
                     max_tokens_limit=max_tokens_limit, default_max_tokens=default_max_tokens,
                     linger=linger, edge=edge)


def _check_arguments(models: Sequence[str], max_body_bytes: int, max_tokens_limit: int,
                     default_max_tokens: int, linger: float) -> None:
    """Raise ValueError for an argument of :func:`create_app` out of its range."""
    if not models or any(not isinstance(model, str) or not model for model in models):
        raise ValueError(f"models must be a non-empty list of names, got {models!r}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if max_tokens_limit < 1:
        raise ValueError(f"max_tokens_limit must be >= 1, got {max_tokens_limit}")
    if not 1 <= default_max_tokens <= max_tokens_limit:
        raise ValueError(
            f"default_max_tokens must be in [1, {max_tokens_limit}], got {default_max_tokens}"
        )
    if not linger >= 0 or math.isnan(linger):
        raise ValueError(f"linger must be >= 0 seconds, got {linger}")
