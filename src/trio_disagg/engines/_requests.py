"""What an HTTP engine sends a worker (docs/protocols.md section 1): the endpoint, the body
made to stream, the headers, and the checks on worker URLs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from .._protocols import PreprocessedRequest
from ._wire import WorkerClient


def worker_client(**options: Any) -> WorkerClient:
    """A new :class:`~trio_disagg.engines.WorkerClient` for HTTP engines to share; the
    keywords ``options`` are its own (connection bounds in connections, timeouts in
    seconds; by default no read timeout of the client's own, since the router's deadlines
    bound every wait without a cancel scope per token; ``headers`` sent with every
    request, such as the workers' API key: ``headers={"authorization": "Bearer KEY"}``).

    Environment proxies are not consulted: worker traffic stays inside the cluster. The
    caller owns the client: ``async with`` it, or ``await client.aclose()``.

    Raises:
        ValueError: ``max_connections`` < 1 or ``max_idle_per_worker`` < 0, or a header
            that could inject another (a CR, LF or NUL).
        TypeError: a keyword :class:`~trio_disagg.engines.WorkerClient` does not take.
    """
    return WorkerClient(**options)


def endpoint_for(body: Mapping[str, Any]) -> str:
    """``/v1/chat/completions`` if the body has ``messages``, else ``/v1/completions``."""
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


#: Body fields about the prompt, never sent to a decode (B8): the prompt's log
#: probabilities (``prompt_logprobs``) and the prompt echoed back (``echo``) are the
#: prefill's to compute. A decode that received the KV never ran the prompt, so it would
#: answer them wrongly or not at all; the server refuses them (400) before routing, and
#: the decode body builders drop them as a second line of defence.
PROMPT_ONLY_FIELDS = ("prompt_logprobs", "echo")


def streaming_body(request: PreprocessedRequest, *, decode: bool = True) -> dict[str, Any]:
    """The client's body, made to stream: ``stream: true`` and
    ``stream_options.include_usage: true`` (without vLLM's ``continuous_usage_stats``: the
    router answers that option itself, from its own count, docs/protocols.md section 1);
    for a decode leg (``decode``), without :data:`PROMPT_ONLY_FIELDS`.

    No budget is invented (B8): a body without ``max_tokens`` / ``max_completion_tokens``
    goes without one, and the worker's own default applies, as it would for the client
    talking to the worker directly. (``request.max_tokens`` is the router's reckoning of
    the budget, for its own accounting only.)

    The decode legs always stream, whatever the client asked: the adapter then reads the
    answer as it comes (one output per socket read, each worker chunk kept) either way, a
    worker dying mid-answer is seen as such, and the server layer collects the outputs
    into one JSON answer for a client that did not stream.
    """
    wire = dict(request.body)
    wire["stream"] = True
    options = wire.get("stream_options")
    options = dict(options) if isinstance(options, Mapping) else {}
    options["include_usage"] = True
    # The stream's usage is the router's (B8): it answers vLLM's continuous usage itself
    # (server/_writer.py); a worker's usage in every chunk would only cost a parse each.
    options.pop("continuous_usage_stats", None)
    wire["stream_options"] = options
    if decode:
        for key in PROMPT_ONLY_FIELDS:
            wire.pop(key, None)
    return wire


def check_worker_url(url: str, protocol: str) -> str:
    """``url`` without a trailing slash.

    Raises:
        ValueError: ``url`` is not an ``http://`` or ``https://`` URL with a host, has a
            port that is not 1 to 65535, has a query or a fragment, ends in ``/v1``
            (the adapter appends the endpoint's path to it), or has a user or password
            (never sent, and the URL names the worker in logs, ``/health`` and
            ``/metrics``: the message then leaves the URL out).
    """
    if "@" in url.partition("://")[2].partition("/")[0]:
        raise ValueError(f"a {protocol} worker URL must have no user or password "
                         "(user:password@host): they are not sent, and the URL names the "
                         "worker in the logs, /health and /metrics; a worker's API key goes "
                         "with --worker-api-key")
    problem = f"a {protocol} worker URL must be http(s)://host[:port], got {url!r}"
    try:
        parsed = urlsplit(url)
        port = parsed.port  # raises on a port that is not a number, or out of range
    except ValueError as exc:
        detail = ": the port must be 1 to 65535" if "range" in str(exc) else ""
        raise ValueError(problem + detail) from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(problem)
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{problem}: the port must be 1 to 65535")
    if parsed.query or parsed.fragment or "?" in url or "#" in url:
        raise ValueError(f"{problem}: no query or fragment")
    if parsed.path.rstrip("/").endswith("/v1"):
        # An OpenAI client's base URL: every request and probe would go to /v1/v1/...
        raise ValueError(f"{problem}: the worker's root, without /v1 (the router adds "
                         f"/v1/completions, /health, ...)")
    return url.rstrip("/")


def check_unique(role: str, urls: list[str]) -> None:
    """Raises ValueError if a URL appears twice (trailing slashes ignored)."""
    stripped = [url.rstrip("/") for url in urls]
    if len(set(stripped)) != len(stripped):
        raise ValueError(f"{role} URLs must be unique, got {urls}")


def request_headers(request_id: str, *, streams: bool) -> dict[bytes, bytes]:
    """The headers of a request to a worker: ``X-Request-Id`` (the server accepts any
    printable id: its UTF-8 bytes are sent, never refused here), the JSON content type,
    and ``Accept: text/event-stream`` for a body that ``streams``."""
    headers = {b"x-request-id": request_id.encode(), b"content-type": b"application/json"}
    if streams:
        headers[b"accept"] = b"text/event-stream"
    return headers
