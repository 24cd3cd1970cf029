"""Engines for trio-disagg: in-process mock prefill and decode workers, and the pieces a
mock worker needs (latency model, fault injection, KV block accounting).

The shared pieces live in small modules (``_latency``, ``_faults``, ``_kv``, ``_text``)
that do not import the in-process engines, so an HTTP mock worker can reuse them.
:class:`VllmEngine`, :class:`SglangEngine` and :class:`TrtllmEngine` drive real (or mock)
vLLM, SGLang and TensorRT-LLM workers over HTTP (docs/protocols.md sections 2-4), on the
skeleton they share, :class:`HttpEngine`.
"""

import importlib as _importlib
import typing as _typing

from ._faults import Fault as Fault
from ._faults import FaultKind as FaultKind
from ._faults import FaultPlan as FaultPlan
from ._faults import fault_for as fault_for
from ._faults import parse_fault as parse_fault
from ._faults import parse_faults as parse_faults
from ._kv import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE
from ._kv import DEFAULT_BOOTSTRAP_PORT as DEFAULT_BOOTSTRAP_PORT
from ._kv import DEFAULT_BOOTSTRAP_TIMEOUT as DEFAULT_BOOTSTRAP_TIMEOUT
from ._kv import DEFAULT_KV_TTL as DEFAULT_KV_TTL
from ._kv import BootstrapRoom as BootstrapRoom
from ._kv import KVBlockPool as KVBlockPool
from ._kv import KVCounters as KVCounters
from ._kv import KVRegistry as KVRegistry
from ._kv import KVState as KVState
from ._kv import KVTransferError as KVTransferError
from ._kv import StagedKV as StagedKV
from ._latency import LatencyModel as LatencyModel
from ._mock import INPROC_HOST as INPROC_HOST
from ._mock import MockCluster as MockCluster
from ._mock import MockDecodeEngine as MockDecodeEngine
from ._mock import MockPrefillEngine as MockPrefillEngine
from ._mock import mock_cluster as mock_cluster
from ._text import TokenStream as TokenStream
from ._text import cached_prompt_tokens as cached_prompt_tokens
from ._text import count_prompt_tokens as count_prompt_tokens
from ._text import resolve_max_tokens as resolve_max_tokens

if _typing.TYPE_CHECKING:
    from ._http import Client as Client
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
    from ._wire import ConnectError as ConnectError
    from ._wire import HttpxWorkerClient as HttpxWorkerClient
    from ._wire import PoolTimeout as PoolTimeout
    from ._wire import ReadTimeout as ReadTimeout
    from ._wire import RemoteProtocolError as RemoteProtocolError
    from ._wire import TransportError as TransportError
    from ._wire import WorkerClient as WorkerClient
    from ._wire import WorkerResponse as WorkerResponse
    from ._wire import WriteTimeout as WriteTimeout

# The HTTP adapters need the 'server' extra (httptools, httpx): imported on first use, so that the
# in-process mock engines work with the core install alone.
_LAZY = {
    "Client": "_http",
    "HttpEngine": "_http",
    "streaming_body": "_http",
    "worker_client": "_http",
    "GENERATE_PATH": "_sglang",
    "SglangEngine": "_sglang",
    "parse_prefill_spec": "_sglang",
    "sglang_body": "_sglang",
    "sglang_engines": "_sglang",
    "PROMPT_TOKEN_IDS_KEY": "_trtllm",
    "TrtllmEngine": "_trtllm",
    "context_body": "_trtllm",
    "generation_body": "_trtllm",
    "trtllm_engines": "_trtllm",
    "PREFILL_KV_TRANSFER_PARAMS": "_vllm",
    "VllmEngine": "_vllm",
    "decode_body": "_vllm",
    "endpoint_for": "_vllm",
    "prefill_body": "_vllm",
    "vllm_client": "_vllm",
    "vllm_engines": "_vllm",
    "ConnectError": "_wire",
    "HttpxWorkerClient": "_wire",
    "PoolTimeout": "_wire",
    "ReadTimeout": "_wire",
    "RemoteProtocolError": "_wire",
    "TransportError": "_wire",
    "WorkerClient": "_wire",
    "WorkerResponse": "_wire",
    "WriteTimeout": "_wire",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .._extras import require

    require("server", f"trio_disagg.engines.{name}")  # a clear error naming the extra
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
