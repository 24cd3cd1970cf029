"""A mock worker's API key (``mock-worker --api-key``), checked as the real workers check
theirs: a protected path without ``Authorization: Bearer <key>`` gets vLLM's and SGLang's
401 ``{"error": "Unauthorized"}``. Which paths each protects is the worker's own
(:meth:`~trio_disagg.mock.MockWorker.protects`)."""

from __future__ import annotations

import hmac

import orjson

from .._asgi import Scope, header_bytes

#: The body of vLLM's and SGLang's 401 (their authentication middleware's).
UNAUTHORIZED = orjson.dumps({"error": "Unauthorized"})


class ApiKey:
    """The key a worker was started with, compared in constant time.

    Args:
        key: the key; a request must send ``Authorization: Bearer <key>`` exactly.

    Raises:
        ValueError: an empty or blank key, or one with a CR, LF or NUL (no client could
            send it) or a non-ASCII character (the real workers would never match it).
            The message never shows the key.
    """

    __slots__ = ("_expected",)

    def __init__(self, key: str) -> None:
        if not isinstance(key, str) or not key.strip():
            raise ValueError("api_key must be a non-empty string")
        if any(char in key for char in "\r\n\0"):
            raise ValueError("api_key has a CR, LF or NUL: no client could send it")
        if not key.isascii():  # the real workers read the header as Latin-1 (Starlette)
            raise ValueError("api_key has a non-ASCII character: vLLM and SGLang would "
                             "never match it")
        self._expected = b"Bearer " + key.encode()

    def __repr__(self) -> str:
        return "<ApiKey>"  # never the key

    def admits(self, scope: Scope) -> bool:
        """Whether the request sends the key (its first ``Authorization`` header is
        ``Bearer <key>``, byte for byte)."""
        given = header_bytes(scope, b"authorization")
        return given is not None and hmac.compare_digest(given, self._expected)


def api_key_of(key: str | None, protocol: str, takes_one: bool) -> ApiKey | None:
    """``key`` as an :class:`ApiKey`, None for none.

    Raises:
        ValueError: a bad key, or a key for a protocol whose real worker takes none.
    """
    if key is None:
        return None
    if not takes_one:
        raise ValueError(f"a {protocol} worker takes no API key (trtllm-serve has no "
                         f"--api-key)")
    return ApiKey(key)
