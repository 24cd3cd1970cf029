"""The GPU-free worker simulator: mock prefill and decode workers (docs/protocols.md
section 5).

One behaviour, written once (the latency model, seeded token text, KV block staging, pull,
lease expiry and release, bootstrap rooms, the fault plan and its injection points, the
token loop), and two faces on it: in-process engines (:func:`mock_cluster`,
:class:`MockPrefillEngine`, :class:`MockDecodeEngine`) that implement
:class:`~trio_disagg.Engine` over memory channels, and HTTP workers
(:func:`create_mock_worker`, :func:`serve_mock_worker`, ``trio-disagg mock-worker``) that
speak vLLM's, SGLang's or TensorRT-LLM's wire protocol (docs/protocols.md sections 2-4).
"""

import typing as _typing

from .._extras import lazy_attribute as _lazy_attribute
from ._cluster import MockCluster as MockCluster
from ._cluster import mock_cluster as mock_cluster
from ._decode_engine import MockDecodeEngine as MockDecodeEngine
from ._engines import INPROC_HOST as INPROC_HOST
from ._engines import MockPrefillEngine as MockPrefillEngine
from ._faults import Fault as Fault
from ._faults import FaultKind as FaultKind
from ._faults import FaultPlan as FaultPlan
from ._faults import fault_for as fault_for
from ._faults import parse_fault as parse_fault
from ._faults import parse_faults as parse_faults
from ._kv import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE
from ._kv import DEFAULT_BOOTSTRAP_TIMEOUT as DEFAULT_BOOTSTRAP_TIMEOUT
from ._kv import DEFAULT_KV_TTL as DEFAULT_KV_TTL
from ._kv import BootstrapRoom as BootstrapRoom
from ._kv import KVBlockPool as KVBlockPool
from ._kv import KVCounters as KVCounters
from ._kv import KVState as KVState
from ._kv import KVTransferError as KVTransferError
from ._kv import StagedKV as StagedKV
from ._latency import LatencyModel as LatencyModel
from ._prefix import DEFAULT_PREFIX_CACHE_BLOCKS as DEFAULT_PREFIX_CACHE_BLOCKS
from ._prefix import PrefixCache as PrefixCache
from ._prefix import block_hashes as block_hashes
from ._registry import KVRegistry as KVRegistry
from ._text import TokenStream as TokenStream
from ._text import count_prompt_tokens as count_prompt_tokens
from ._text import resolve_max_tokens as resolve_max_tokens

if _typing.TYPE_CHECKING:
    from ._answers import REASONING_HOOK as REASONING_HOOK
    from ._kvwire import DEFAULT_KV_BYTES_PER_TOKEN as DEFAULT_KV_BYTES_PER_TOKEN
    from ._kvwire import kv_block_bytes as kv_block_bytes
    from ._metrics import KVCollector as KVCollector
    from ._options import SeenRequest as SeenRequest
    from ._options import WorkerStats as WorkerStats
    from ._serve import KEEP_ALIVE_TIMEOUT as KEEP_ALIVE_TIMEOUT
    from ._serve import PROTOCOLS as PROTOCOLS
    from ._serve import create_mock_worker as create_mock_worker
    from ._serve import serve_mock_worker as serve_mock_worker
    from ._serve import serve_worker as serve_worker
    from ._sglang import MockSglangWorker as MockSglangWorker
    from ._trtllm import CTX_REQUEST_ID_HOOK as CTX_REQUEST_ID_HOOK
    from ._trtllm import MockTrtllmWorker as MockTrtllmWorker
    from ._vllm import MockVllmWorker as MockVllmWorker
    from ._worker import MockWorker as MockWorker
    from ._worker import Role as Role

# The HTTP face needs the 'server' extra (hypercorn, httpx, prometheus-client): its names
# are imported on first use, so that the in-process engines work with the core install alone.
_HTTP_FACE = {
    "_answers": ("REASONING_HOOK",),
    "_kvwire": ("DEFAULT_KV_BYTES_PER_TOKEN", "kv_block_bytes"),
    "_metrics": ("KVCollector",),
    "_options": ("SeenRequest", "WorkerStats"),
    "_serve": ("KEEP_ALIVE_TIMEOUT", "PROTOCOLS", "create_mock_worker", "serve_mock_worker",
               "serve_worker"),
    "_sglang": ("MockSglangWorker",),
    "_trtllm": ("CTX_REQUEST_ID_HOOK", "MockTrtllmWorker"),
    "_vllm": ("MockVllmWorker",),
    "_worker": ("MockWorker", "Role"),
}
_LAZY = {name: module for module, names in _HTTP_FACE.items() for name in names}


def __getattr__(name: str) -> object:
    return _lazy_attribute(__name__, _LAZY, name, "server")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
