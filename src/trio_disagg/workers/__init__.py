"""Mock LLM workers over HTTP, for tests, demos and benchmarks (PROTOCOLS.md section 5).

Each is a plain ASGI 3 application served by hypercorn's trio worker, speaking a real
worker's wire protocol (so far vLLM's, PROTOCOLS.md section 2) and reusing the in-process
mock engines' latency model, fault injection and KV block accounting.
"""

from ._serve import KEEP_ALIVE_TIMEOUT as KEEP_ALIVE_TIMEOUT
from ._serve import PROTOCOLS as PROTOCOLS
from ._serve import create_mock_worker as create_mock_worker
from ._serve import serve_mock_worker as serve_mock_worker
from ._serve import serve_worker as serve_worker
from ._vllm import DEFAULT_KV_BYTES_PER_TOKEN as DEFAULT_KV_BYTES_PER_TOKEN
from ._vllm import MockVllmWorker as MockVllmWorker
from ._vllm import SeenRequest as SeenRequest
from ._vllm import WorkerStats as WorkerStats
from ._vllm import kv_block_bytes as kv_block_bytes
