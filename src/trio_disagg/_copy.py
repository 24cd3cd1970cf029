"""The copies of a request the router makes as it routes it (P4a: made by the constructor,
not by :func:`attrs.evolve`)."""

from __future__ import annotations

from ._protocols import BootstrapInfo, PrefillResult, PreprocessedRequest, RoutingHints


def routed_copy(
    request: PreprocessedRequest,
    prefill_worker: str | None,
    decode_worker: str | None,
    prefill_result: PrefillResult | None,
    bootstrap_info: BootstrapInfo | None,
) -> PreprocessedRequest:
    """``request`` with the router's additions: its routing's worker names, its
    ``prefill_result`` and its ``bootstrap_info``; as ``attrs.evolve`` of the request and of
    its routing makes it, by the constructors: about a microsecond less a copy, and the
    router makes two a request (docs/performance.md, P4a). The validators run as in
    ``evolve``. Every field is copied: one added to :class:`PreprocessedRequest` or
    :class:`RoutingHints` is added here too (tests/test_protocols.py checks)."""
    routing = RoutingHints(session_id=request.routing.session_id,
                           prefill_worker=prefill_worker, decode_worker=decode_worker)
    return PreprocessedRequest(
        request_id=request.request_id, model=request.model, body=request.body,
        max_tokens=request.max_tokens, stream=request.stream, routing=routing,
        prefill_result=prefill_result, bootstrap_info=bootstrap_info,
    )
