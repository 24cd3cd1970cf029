"""The engines of real workers: :class:`VllmEngine`, :class:`SglangEngine` and
:class:`TrtllmEngine` drive real (or mock) vLLM, SGLang and TensorRT-LLM workers over
HTTP (docs/protocols.md sections 2-4), on the skeleton they share, :class:`HttpEngine`.

The simulator's names that used to live here (``mock_cluster``, ``LatencyModel``,
``FaultKind``, ``KVCounters``, ...) now live in :mod:`trio_disagg.mock`; they are still
importable from here, as aliases resolved on first use, so this package imports nothing
from the simulator until asked.
"""

from typing import TYPE_CHECKING, Any

from .._protocols import DEFAULT_BOOTSTRAP_PORT as DEFAULT_BOOTSTRAP_PORT
from ._http import DEFAULT_LIMITS as DEFAULT_LIMITS
from ._http import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from ._http import HttpEngine as HttpEngine
from ._http import streaming_body as streaming_body
from ._http import worker_client as worker_client
from ._sglang import GENERATE_PATH as GENERATE_PATH
from ._sglang import SglangEngine as SglangEngine
from ._sglang import parse_prefill_spec as parse_prefill_spec
from ._sglang import sglang_body as sglang_body
from ._sglang import sglang_engines as sglang_engines
from ._trtllm import PROMPT_TOKEN_IDS_KEY as PROMPT_TOKEN_IDS_KEY
from ._trtllm import TrtllmEngine as TrtllmEngine
from ._trtllm import context_body as context_body
from ._trtllm import generation_body as generation_body
from ._trtllm import trtllm_engines as trtllm_engines
from ._vllm import PREFILL_KV_TRANSFER_PARAMS as PREFILL_KV_TRANSFER_PARAMS
from ._vllm import VllmEngine as VllmEngine
from ._vllm import decode_body as decode_body
from ._vllm import endpoint_for as endpoint_for
from ._vllm import prefill_body as prefill_body
from ._vllm import vllm_client as vllm_client
from ._vllm import vllm_engines as vllm_engines

#: The simulator names importable from here as aliases of :mod:`trio_disagg.mock`.
_MOCK_ALIASES = frozenset({
    "Fault",
    "FaultKind",
    "FaultPlan",
    "fault_for",
    "parse_fault",
    "parse_faults",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_BOOTSTRAP_TIMEOUT",
    "DEFAULT_KV_TTL",
    "BootstrapRoom",
    "KVBlockPool",
    "KVCounters",
    "KVRegistry",
    "KVState",
    "KVTransferError",
    "StagedKV",
    "LatencyModel",
    "INPROC_HOST",
    "MockCluster",
    "MockDecodeEngine",
    "MockPrefillEngine",
    "mock_cluster",
    "TokenStream",
    "cached_prompt_tokens",
    "count_prompt_tokens",
    "resolve_max_tokens",
})

if TYPE_CHECKING:
    from ..mock import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE
    from ..mock import DEFAULT_BOOTSTRAP_TIMEOUT as DEFAULT_BOOTSTRAP_TIMEOUT
    from ..mock import DEFAULT_KV_TTL as DEFAULT_KV_TTL
    from ..mock import INPROC_HOST as INPROC_HOST
    from ..mock import BootstrapRoom as BootstrapRoom
    from ..mock import Fault as Fault
    from ..mock import FaultKind as FaultKind
    from ..mock import FaultPlan as FaultPlan
    from ..mock import KVBlockPool as KVBlockPool
    from ..mock import KVCounters as KVCounters
    from ..mock import KVRegistry as KVRegistry
    from ..mock import KVState as KVState
    from ..mock import KVTransferError as KVTransferError
    from ..mock import LatencyModel as LatencyModel
    from ..mock import MockCluster as MockCluster
    from ..mock import MockDecodeEngine as MockDecodeEngine
    from ..mock import MockPrefillEngine as MockPrefillEngine
    from ..mock import StagedKV as StagedKV
    from ..mock import TokenStream as TokenStream
    from ..mock import cached_prompt_tokens as cached_prompt_tokens
    from ..mock import count_prompt_tokens as count_prompt_tokens
    from ..mock import fault_for as fault_for
    from ..mock import mock_cluster as mock_cluster
    from ..mock import parse_fault as parse_fault
    from ..mock import parse_faults as parse_faults
    from ..mock import resolve_max_tokens as resolve_max_tokens


def __getattr__(name: str) -> Any:
    # An alias resolved on first use, so that importing the real adapters never imports
    # the simulator.
    if name in _MOCK_ALIASES:
        from .. import mock

        return getattr(mock, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
