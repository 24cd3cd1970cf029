"""The router's ``GET /v1/models``: each model it serves, as its workers describe it.

vLLM's model object says more than OpenAI's (``root``: the weights it serves, ``parent``:
the base model of a LoRA adapter, ``max_model_len``: the context length, ``permission``),
and clients size their prompts with ``max_model_len``. The router knows none of that: it
asks its workers (``GET /v1/models``, through each engine that is a
:class:`~trio_disagg._engine.ModelLister`) and passes on what they say, never a value of
its own (docs/router.md, "The model list").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import trio

from .._engine import ModelLister
from .._pool import WorkerPool
from .._router import DisaggRouter

logger = logging.getLogger("trio_disagg.server")

#: Seconds the workers get to answer, all of them together (per pool, at once).
MODELS_TIMEOUT = 2.0
#: Seconds the workers' answer is reused before they are asked again.
MODELS_TTL = 10.0

Card = dict[str, Any]


class ModelCards:
    """The model objects of the router's ``GET /v1/models``, from its workers.

    Each served name's object is the decode worker's own for that ``id`` (else the
    prefill worker's), as the worker sent it, with ``max_model_len`` the smaller of the
    two pools' where both say (a prompt must fit the prefill's context, and a prompt and
    its answer the decode's). A name no worker lists (or a fleet of in-process engines,
    or workers that do not answer) gets OpenAI's four fields alone: ``id``, ``object``,
    ``created`` (the router's start), ``owned_by`` ``"trio-disagg"``.

    One healthy worker of each pool is asked (the next if it fails), both pools at once,
    for at most :data:`MODELS_TIMEOUT` seconds; the answers are reused for
    :data:`MODELS_TTL` seconds, and a pool that did not answer keeps its last answer.

    Args:
        router: whose pools to ask.
        models: the model names the router serves, in order.
    """

    def __init__(self, router: DisaggRouter, models: Sequence[str]) -> None:
        self.router = router
        self.models = tuple(models)
        self.created = int(time.time())
        self.timeout = MODELS_TIMEOUT
        self.ttl = MODELS_TTL
        self._listed: dict[str, list[Card]] = {}
        self._fetched_at: float | None = None
        self._lock = trio.Lock()

    async def cards(self) -> list[Card]:
        """The model object of every served name, in order."""
        listed = await self._current()
        return [self._card(model, listed) for model in self.models]

    async def card(self, model: str) -> Card:
        """The model object of ``model`` (a served name)."""
        return self._card(model, await self._current())

    async def unlisted(self) -> dict[str, list[str]]:
        """The served names a pool's workers do not list, by role (``"prefill"``,
        ``"decode"``): requests for them would be refused 404 by the workers (a ``--model``
        that is not the workers' ``--served-model-name``). Only pools that answered."""
        listed = await self._current()
        return {role: missing for role, cards in listed.items()
                if (missing := [model for model in self.models if _find(model, cards) is None])}

    async def _current(self) -> dict[str, list[Card]]:
        async with self._lock:  # one refresh at a time; the others then reuse it
            now = trio.current_time()
            if self._fetched_at is None or now - self._fetched_at >= self.ttl:
                pools = {"decode": self.router.decode, "prefill": self.router.prefill}
                async with trio.open_nursery() as nursery:
                    for role, pool in pools.items():
                        nursery.start_soon(self._refresh, role, pool)
                self._fetched_at = trio.current_time()
        return self._listed

    async def _refresh(self, role: str, pool: WorkerPool[Any]) -> None:
        healthy = pool.healthy()
        workers = [*healthy, *(worker for worker in pool.workers if worker not in healthy)]
        with trio.move_on_after(self.timeout):
            for worker in workers:
                engine = worker.engine
                if not isinstance(engine, ModelLister):
                    continue
                try:
                    self._listed[role] = await engine.list_models()
                    return
                except Exception as exc:  # the next worker, or the last answer
                    logger.debug("model list of %s failed: %r", worker.name, exc)

    def _card(self, model: str, listed: dict[str, list[Card]]) -> Card:
        found = {role: _find(model, cards) for role, cards in listed.items()}
        base = found.get("decode") or found.get("prefill")
        if base is None:
            return {"id": model, "object": "model", "created": self.created,
                    "owned_by": "trio-disagg"}
        card = dict(base)
        lengths = [length for one in found.values() if one is not None
                   and type(length := one.get("max_model_len")) is int and length > 0]
        if lengths:
            card["max_model_len"] = min(lengths)
        return card


def _find(model: str, cards: list[Card]) -> Card | None:
    for card in cards:
        if card.get("id") == model:
            return card
    return None
