"""Mock LLM workers over HTTP, for tests, demos and benchmarks (docs/protocols.md section 5).

Each is a plain ASGI 3 application served by hypercorn's trio worker, speaking a real
worker's wire protocol (vLLM's, SGLang's or TensorRT-LLM's: docs/protocols.md sections 2-4) and
reusing the in-process mock engines' latency model, fault injection and KV block
accounting. :class:`MockWorker` is what they share.
"""

# ruff: noqa: E402 (the extra is checked before its packages are imported)
from .._extras import require as _require

_require("server", "trio_disagg.workers")  # a clear error naming the extra, not a bare one

from ._common import DEFAULT_KV_BYTES_PER_TOKEN as DEFAULT_KV_BYTES_PER_TOKEN
from ._common import REASONING_HOOK as REASONING_HOOK
from ._common import KVCollector as KVCollector
from ._common import MockWorker as MockWorker
from ._common import Role as Role
from ._common import SeenRequest as SeenRequest
from ._common import WorkerStats as WorkerStats
from ._common import kv_block_bytes as kv_block_bytes
from ._serve import KEEP_ALIVE_TIMEOUT as KEEP_ALIVE_TIMEOUT
from ._serve import PROTOCOLS as PROTOCOLS
from ._serve import create_mock_worker as create_mock_worker
from ._serve import serve_mock_worker as serve_mock_worker
from ._serve import serve_worker as serve_worker
from ._sglang import MockSglangWorker as MockSglangWorker
from ._trtllm import CTX_REQUEST_ID_HOOK as CTX_REQUEST_ID_HOOK
from ._trtllm import MockTrtllmWorker as MockTrtllmWorker
from ._vllm import MockVllmWorker as MockVllmWorker
