"""The OpenAI-compatible HTTP server of trio-disagg.

A plain ASGI 3 application (:func:`create_app`) served by the project's own HTTP/1.1
server on trio, or by hypercorn's trio worker given a hypercorn config (:func:`serve`).
All HTTP lives here; the router and the core know nothing of it.
"""

# ruff: noqa: E402 (the extra is checked before its packages are imported)
from .._extras import require as _require

_require("server", "trio_disagg.server")  # a clear error naming the extra, not a bare one

from .._listen import REUSE_PORT_SUPPORTED as REUSE_PORT_SUPPORTED
from ._app import OpenAIApp as OpenAIApp
from ._app import create_app as create_app
from ._metrics import OUTCOMES as OUTCOMES
from ._metrics import RouterCollector as RouterCollector
from ._metrics import ServerMetrics as ServerMetrics
from ._openai_errors import ApiError as ApiError
from ._openai_errors import error_for_exception as error_for_exception
from ._openai_requests import ChatCompletionRequest as ChatCompletionRequest
from ._openai_requests import ChatMessage as ChatMessage
from ._openai_requests import CompletionRequest as CompletionRequest
from ._openai_requests import StreamOptions as StreamOptions
from ._openai_responses import ChunkEncoder as ChunkEncoder
from ._serve import serve as serve
from ._serve import wait_for_signals as wait_for_signals
