"""What a mock HTTP worker is made with (:class:`WorkerOptions`) and what it records
(:class:`WorkerStats`, :class:`SeenRequest`), docs/protocols.md section 5."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

import attrs

from ..engines import Client
from ._faults import FaultPlan
from ._latency import LatencyModel


class WorkerOptions(TypedDict, total=False):
    """The settings every mock worker takes, as keywords; each defaults as in
    :class:`MockWorker`."""

    name: str | None
    model: str | None
    latency: LatencyModel | None
    seed: int
    block_size: int
    kv_ttl: float
    kv_bytes_per_token: int
    default_max_tokens: int
    fault_plan: FaultPlan | None
    fault_injection: bool
    http_client: Client | None
    max_body_bytes: int
    history: int
    prefix_cache_blocks: int
    api_key: str | None


@attrs.define(kw_only=True)
class WorkerStats:
    """What one mock worker did, beyond its KV pool's counters. Counts of requests.

    Attributes:
        requests: generation requests received (``/v1/completions``,
            ``/v1/chat/completions``, SGLang's ``/generate``), valid or not.
        open: generation requests whose exchange is not over: received (even if their
            body is still being read) and not yet answered in full, failed or aborted.
            Zero once nothing is left open on the worker.
        running: generation requests being served now.
        completed: answered in full (a whole JSON answer, or a stream to ``[DONE]``).
        failed: answered with an error status or error event, or reset on purpose.
        aborted: aborted because the client closed the connection first (each also in
            :attr:`MockWorker.aborts`, with when).
        kv_transfers: KV transfers served to decode workers (``GET /kv/...`` or a
            bootstrap room), in full.
        kv_pulls: KV transfers this worker received from a prefill worker.
        kv_pull_failures: KV pulls that failed (gone, refused, corrupt, unreachable,
            timed out).
        kv_releases: releases sent to a prefill worker for KV never pulled.
        prefills_completed: prefill (context) requests whose prefill computation ran to
            its end (whatever the answer then was).
        prefills_aborted: prefill (context) requests aborted (their connection closed)
            before their prefill computation ended: compute saved (B10).
    """

    requests: int = 0
    open: int = 0
    running: int = 0
    completed: int = 0
    failed: int = 0
    aborted: int = 0
    kv_transfers: int = 0
    kv_pulls: int = 0
    kv_pull_failures: int = 0
    kv_releases: int = 0
    prefills_completed: int = 0
    prefills_aborted: int = 0


@attrs.frozen(kw_only=True)
class SeenRequest:
    """A generation request as the worker received it (for tests and demos)."""

    path: str
    request_id: str
    body: Mapping[str, Any]
