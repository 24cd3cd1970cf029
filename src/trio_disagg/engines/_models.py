"""``GET /v1/models`` of a worker: the model objects it serves, for the router's own
``GET /v1/models`` (docs/protocols.md section 1). vLLM, SGLang and TensorRT-LLM all serve
``/v1/models``; each worker's model objects are its own (vLLM adds ``root``, ``parent``,
``max_model_len`` and ``permission`` to OpenAI's ``id``, ``object``, ``created`` and
``owned_by``)."""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from .._errors import WorkerError
from ._httpx import HttpxWorkerClient
from ._transport import TransportError
from ._wire import WorkerClient

#: Bytes of a worker's model list read at most (a list of a few hundred LoRA adapters).
MODELS_BODY_LIMIT = 1024 * 1024


class ModelListing:
    """What :class:`~trio_disagg.engines.HttpEngine` adds for :meth:`list_models`."""

    #: The worker's model list endpoint.
    models_path: ClassVar[str] = "/v1/models"
    url: str
    role: str
    name: str
    _transport: WorkerClient | HttpxWorkerClient

    async def list_models(self) -> list[dict[str, Any]]:
        """The model objects the worker serves (``GET /v1/models``, its ``data``), each as
        the worker sent it; entries that are not JSON objects with a string ``id`` are
        left out. It need not bound itself: the caller cancels it (the connection is then
        closed).

        Raises:
            WorkerError: the worker could not be reached, answered anything but 2xx, or
                answered something that is not a model list (more than
                :data:`MODELS_BODY_LIMIT` bytes, malformed JSON, no ``data`` list).
        """
        where = f"{self.role} worker {self.url} {self.models_path}"
        try:
            async with self._transport.stream("GET", self.url + self.models_path,
                                              content=b"", headers={}) as response:
                status = response.status_code
                data = await response.aread(MODELS_BODY_LIMIT)
        except TransportError as exc:
            raise WorkerError(f"{where} failed: {type(exc).__name__}: {exc}", status=502,
                              worker=self.name) from exc
        if not 200 <= status < 300:
            raise WorkerError(f"{where} answered {status}", status=502, worker=self.name,
                              worker_status=status)
        if len(data) >= MODELS_BODY_LIMIT:
            raise WorkerError(f"{where} answered more than {MODELS_BODY_LIMIT} bytes",
                              status=502, worker=self.name)
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError:
            answer = None
        listed = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(listed, list):
            raise WorkerError(f"{where} answered no model list", status=502,
                              worker=self.name)
        return [card for card in listed
                if isinstance(card, dict) and isinstance(card.get("id"), str)]
