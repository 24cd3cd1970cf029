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
