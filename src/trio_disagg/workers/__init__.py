"""Mock LLM workers over HTTP: an alias of the HTTP face of :mod:`trio_disagg.mock`, kept
so that code written against ``trio_disagg.workers`` keeps working. New code imports from
:mod:`trio_disagg.mock`. Needs the ``server`` extra."""

# ruff: noqa: E402 (the extra is checked before its packages are imported)
from .._extras import require as _require

_require("server", "trio_disagg.workers")  # a clear error naming the extra, not a bare one

from ..mock import CTX_REQUEST_ID_HOOK as CTX_REQUEST_ID_HOOK
from ..mock import DEFAULT_KV_BYTES_PER_TOKEN as DEFAULT_KV_BYTES_PER_TOKEN
from ..mock import KEEP_ALIVE_TIMEOUT as KEEP_ALIVE_TIMEOUT
from ..mock import PROTOCOLS as PROTOCOLS
from ..mock import REASONING_HOOK as REASONING_HOOK
from ..mock import KVCollector as KVCollector
from ..mock import MockSglangWorker as MockSglangWorker
from ..mock import MockTrtllmWorker as MockTrtllmWorker
from ..mock import MockVllmWorker as MockVllmWorker
from ..mock import MockWorker as MockWorker
from ..mock import Role as Role
from ..mock import SeenRequest as SeenRequest
from ..mock import WorkerStats as WorkerStats
from ..mock import create_mock_worker as create_mock_worker
from ..mock import kv_block_bytes as kv_block_bytes
from ..mock import serve_mock_worker as serve_mock_worker
from ..mock import serve_worker as serve_worker
