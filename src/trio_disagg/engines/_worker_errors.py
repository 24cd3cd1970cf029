"""A worker's error objects and error answers, in words for the client's error message
(docs/protocols.md section 1)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

MESSAGE_LIMIT = 1000  # characters of a worker's message passed on


def excerpt(data: bytes) -> str:
    return repr(data[:200].decode("utf-8", "replace"))


def is_error_object(answer: Mapping[str, Any]) -> bool:
    """An OpenAI (``{"error": ...}``) or vLLM / SGLang / TRT-LLM (``{"object": "error"}``)
    error object."""
    return "error" in answer or answer.get("object") == "error"


def error_text(answer: Mapping[str, Any]) -> str:
    """The message of an OpenAI (``{"error": {...}}``), vLLM / SGLang / TRT-LLM
    (``{"object": "error", "message"}``) or FastAPI (``{"detail"}``) error object."""
    error = answer.get("error")
    if isinstance(error, Mapping):
        message = error.get("message")
        if isinstance(message, str) and message:
            return message[:MESSAGE_LIMIT]
    elif isinstance(error, str) and error:
        return error[:MESSAGE_LIMIT]
    for key in ("message", "detail"):
        value = answer.get(key)
        if isinstance(value, str) and value:
            return value[:MESSAGE_LIMIT]
    try:
        return orjson.dumps(answer).decode()[:MESSAGE_LIMIT]
    except orjson.JSONEncodeError:  # nested deeper than orjson writes (it reads 1024)
        return "an error object nested too deeply to quote"


def error_message(data: bytes, status: int) -> str:
    """The message of an error answer's body (JSON or text)."""
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        text = data.decode("utf-8", "replace").strip()
        return text[:MESSAGE_LIMIT] if text else f"HTTP {status}"
    if isinstance(answer, Mapping):
        return error_text(answer)
    return f"HTTP {status}"


#: How an error item's message says the worker itself reported the error (its error
#: object or event), before the worker's own message.
REPORTED_ERROR = "reported an error: "


def reports_lost_kv(message: str, *, reported: bool = False) -> bool:
    """Whether a decode worker's error message says the handoff's KV could not be used:
    the KV transfer failed (vLLM's and the mock workers' "KV transfer failed: ...").
    ``reported``: ``message`` is an error item's, :data:`REPORTED_ERROR` and the worker's."""
    if reported:
        if not message.startswith(REPORTED_ERROR):
            return False
        message = message[len(REPORTED_ERROR):]
    return message.lstrip().lower().startswith("kv transfer failed")
