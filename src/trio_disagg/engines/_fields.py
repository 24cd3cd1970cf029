"""A worker chunk's top-level fields (B8, docs/router.md "What the router relays, and what
it owns"): which are the router's, which the worker's own plumbing, and the others, which
go to the client beside the choice they came with (a :class:`~trio_disagg.ChunkChoice`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._choices import ENVELOPE as ENVELOPE
from .._protocols import ChunkChoice

#: The disaggregation's own plumbing, whatever the protocol: vLLM's (and Dynamo's)
#: ``kv_transfer_params`` and TensorRT-LLM's ``disaggregated_params`` say where one
#: worker's KV is for the other, not anything of the client's.
PLUMBING = frozenset({"kv_transfer_params", "disaggregated_params"})


def relayed_fields(chunk: Mapping[str, Any], kept: frozenset[str]) -> dict[str, Any]:
    """The top-level fields of ``chunk`` that are not in ``kept``, in the order sent."""
    return {key: value for key, value in chunk.items() if key not in kept}


def with_fields(choice: Mapping[str, Any], fields: dict[str, Any]) -> Mapping[str, Any]:
    """``choice`` carrying ``fields`` (a :class:`~trio_disagg.ChunkChoice`), or as it is
    if there are none."""
    return ChunkChoice(choice, fields) if fields else choice
