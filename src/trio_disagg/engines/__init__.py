"""The engines of real workers: :class:`VllmEngine`, :class:`SglangEngine` and
:class:`TrtllmEngine` drive real (or mock) vLLM, SGLang and TensorRT-LLM workers over
HTTP (docs/protocols.md sections 2-4), on the skeleton they share, :class:`HttpEngine`.

The adapters need the ``server`` extra (httptools, httpx): they are imported on first use.
The simulator's names that used to live here (``mock_cluster``, ``LatencyModel``,
``FaultKind``, ``KVCounters``, ...) now live in :mod:`trio_disagg.mock`; they are still
importable from here, as aliases resolved on first use, so this package imports nothing
from the simulator until asked.
"""

import typing as _typing

from .._extras import lazy_attribute as _lazy_attribute
from .._protocols import DEFAULT_BOOTSTRAP_PORT as DEFAULT_BOOTSTRAP_PORT

if _typing.TYPE_CHECKING:
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
    from ..mock import PrefixCache as PrefixCache
    from ..mock import StagedKV as StagedKV
    from ..mock import TokenStream as TokenStream
    from ..mock import count_prompt_tokens as count_prompt_tokens
    from ..mock import fault_for as fault_for
    from ..mock import mock_cluster as mock_cluster
    from ..mock import parse_fault as parse_fault
    from ..mock import parse_faults as parse_faults
    from ..mock import resolve_max_tokens as resolve_max_tokens
    from ._headers import DefaultHeaders as DefaultHeaders
    from ._headers import bearer as bearer
    from ._http import Client as Client
    from ._http import HttpEngine as HttpEngine
    from ._httpx import HttpxWorkerClient as HttpxWorkerClient
    from ._requests import endpoint_for as endpoint_for
    from ._requests import streaming_body as streaming_body
    from ._requests import worker_client as worker_client
    from ._response import WorkerResponse as WorkerResponse
    from ._sglang import GENERATE_PATH as GENERATE_PATH
    from ._sglang import SglangEngine as SglangEngine
    from ._sglang import parse_prefill_spec as parse_prefill_spec
    from ._sglang import sglang_body as sglang_body
    from ._sglang import sglang_engines as sglang_engines
    from ._transport import ConnectError as ConnectError
    from ._transport import PoolTimeout as PoolTimeout
    from ._transport import ReadTimeout as ReadTimeout
    from ._transport import RemoteProtocolError as RemoteProtocolError
    from ._transport import TransportError as TransportError
    from ._transport import WriteTimeout as WriteTimeout
    from ._trtllm import PROMPT_TOKEN_IDS_KEY as PROMPT_TOKEN_IDS_KEY
    from ._trtllm import TrtllmEngine as TrtllmEngine
    from ._trtllm import context_body as context_body
    from ._trtllm import generation_body as generation_body
    from ._trtllm import trtllm_engines as trtllm_engines
    from ._vllm import PREFILL_KV_TRANSFER_PARAMS as PREFILL_KV_TRANSFER_PARAMS
    from ._vllm import VllmEngine as VllmEngine
    from ._vllm import decode_body as decode_body
    from ._vllm import prefill_body as prefill_body
    from ._vllm import vllm_client as vllm_client
    from ._vllm import vllm_engines as vllm_engines
    from ._wire import WorkerClient as WorkerClient

# The HTTP adapters need the 'server' extra (httptools, httpx): imported on first use, so that
# the core install alone imports this package.
_LAZY = {
    "Client": "_http",
    "HttpEngine": "_http",
    "streaming_body": "_requests",
    "worker_client": "_requests",
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
    "endpoint_for": "_requests",
    "prefill_body": "_vllm",
    "vllm_client": "_vllm",
    "vllm_engines": "_vllm",
    "ConnectError": "_transport",
    "HttpxWorkerClient": "_httpx",
    "PoolTimeout": "_transport",
    "ReadTimeout": "_transport",
    "RemoteProtocolError": "_transport",
    "TransportError": "_transport",
    "DefaultHeaders": "_headers",
    "bearer": "_headers",
    "WorkerClient": "_wire",
    "WorkerResponse": "_response",
    "WriteTimeout": "_transport",
}

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
    "PrefixCache",
    "count_prompt_tokens",
    "resolve_max_tokens",
})


def __getattr__(name: str) -> object:
    if name in _MOCK_ALIASES:
        # an alias resolved on first use: importing the adapters never imports the simulator
        from .. import mock

        value = getattr(mock, name)
        globals()[name] = value  # the next lookup does not come here
        return value
    return _lazy_attribute(__name__, _LAZY, name, "server")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})  # the aliases are documented in trio_disagg.mock
