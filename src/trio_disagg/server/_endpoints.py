"""The router's endpoints besides generation: the models, readiness, liveness, metrics."""

from __future__ import annotations

import orjson

from .._asgi import Receive, Scope
from .._router import DisaggRouter
from ._metrics import ServerMetrics
from ._models import ModelCards
from ._openai_errors import ApiError
from ._responder import Responder


class InfoEndpoints:
    """``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health``, ``GET /livez`` and
    ``GET /metrics`` of one app; each handler takes the request's scope, its ``receive``
    and its :class:`Responder`."""

    __slots__ = ("cards", "metrics", "models", "router")

    def __init__(self, router: DisaggRouter, models: tuple[str, ...],
                 metrics: ServerMetrics) -> None:
        self.router = router
        self.models = models
        self.metrics = metrics
        #: The model objects, as the workers describe them.
        self.cards = ModelCards(router, models)

    async def list_models(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        """``GET /v1/models``: every served model's object (:class:`ModelCards`)."""
        data = await self.cards.cards()
        await responder.respond(200, orjson.dumps({"object": "list", "data": data}))

    async def retrieve_model(self, scope: Scope, receive: Receive,
                             responder: Responder) -> None:
        """``GET /v1/models/{model}``: the model object, or 404 ``model_not_found``."""
        model = scope["path"].removeprefix("/v1/models/")
        if model not in self.models:
            await responder.error(ApiError(
                404, f"The model {model!r} does not exist", param="model",
                code="model_not_found"))
            return
        await responder.respond(200, orjson.dumps(await self.cards.card(model)))

    async def health(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        """Readiness: 200 while the router admits requests and each pool has a worker
        selection may choose; else 503 naming the pools without one (docs/router.md
        "Worker health")."""
        router = self.router
        pools = {"prefill": router.prefill, "decode": router.decode}
        healthy = {role: len(pool.healthy()) for role, pool in pools.items()}
        unhealthy = [role for role, count in healthy.items() if count == 0]
        if router.closing:
            status, state = 503, "closing"
        elif unhealthy:
            status, state = 503, "no healthy workers"
        else:
            status, state = 200, "ok"
        workers = {role: {worker.name: worker.state.value for worker in pool.workers}
                   for role, pool in pools.items()}
        await responder.respond(status, orjson.dumps({
            "status": state,
            "in_flight": router.in_flight,
            "prefill_workers_healthy": healthy["prefill"],
            "decode_workers_healthy": healthy["decode"],
            "pools_without_healthy_workers": unhealthy,
            "workers": workers,
        }))

    async def livez(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        """Liveness: 200 while the process serves, whatever its workers' health."""
        await responder.respond(200, orjson.dumps({"status": "alive"}))

    async def render_metrics(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        data, content_type = self.metrics.render()
        await responder.respond(200, data, content_type.encode())
