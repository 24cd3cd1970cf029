"""An SGLang prefill worker's bootstrap port: given in its spec, or asked of the worker
itself (docs/protocols.md section 3).

SGLang's server answers ``GET /server_info`` (``GET /get_server_info`` in older versions,
an alias in newer ones) with its server arguments, among them ``disaggregation_mode``
(``"prefill"``, ``"decode"`` or ``"null"``) and ``disaggregation_bootstrap_port`` (its
``--disaggregation-bootstrap-port``, 8998 by default, given whatever the mode). SGLang's
own router learns a prefill worker's bootstrap port there when it is not given; so does
:class:`~trio_disagg.engines.SglangEngine`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson

from .._errors import WorkerError
from ._http import describe
from ._httpx import HttpxWorkerClient
from ._transport import TransportError
from ._wire import WorkerClient

__all__ = ["SERVER_INFO_PATHS", "check_mode", "fetch_bootstrap_port", "parse_prefill_spec"]

logger = logging.getLogger("trio_disagg.engines")

#: Where SGLang tells its server arguments, newest first: an older SGLang answers 404 to
#: the first.
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
#: Bytes of a server information answer read at most (its internal states included).
SERVER_INFO_LIMIT = 1024 * 1024
#: What to do about a port that cannot be learned, said in every such error.
_GIVE_IT = "give it in the worker's spec, URL,BOOTSTRAP_PORT (serve --prefill URL,PORT)"


def parse_prefill_spec(spec: str) -> tuple[str, int | None]:
    """Parse a prefill worker given as ``URL``, ``URL,BOOTSTRAP_PORT`` or ``URL,none``.

    Returns:
        ``(url, bootstrap_port)``; the port is None if not given (or ``none``, as
        SGLang's router writes it): the engine then asks the worker for it
        (:meth:`~trio_disagg.engines.SglangEngine.learn_bootstrap_port`).

    Raises:
        ValueError: the port is neither ``none`` nor an integer in 1-65535, or the URL is
            empty.
    """
    url, sep, port_text = spec.partition(",")
    url = url.strip()
    if not url:
        raise ValueError(f"an SGLang prefill worker is URL or URL,BOOTSTRAP_PORT; got {spec!r}")
    port_text = port_text.strip()
    if not sep or port_text.lower() == "none":
        return url, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"the bootstrap port of {url} must be an integer in 1-65535 (or "
                         f"none: asked of the worker), got {port_text!r}")
    return url, int(port_text)


def _unknown(url: str, name: str, why: str, status: int | None = None) -> WorkerError:
    return WorkerError(f"prefill worker {url}: its bootstrap port is unknown: {why}; "
                       f"{_GIVE_IT}", status=503, worker=name, worker_status=status)


async def _get(transport: WorkerClient | HttpxWorkerClient, url: str, path: str
               ) -> tuple[int, bytes]:
    async with transport.stream("GET", url + path, content=b"", headers={}) as response:
        return response.status_code, await response.aread(SERVER_INFO_LIMIT)


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        info = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return info if isinstance(info, dict) else None


def _check_mode(info: Mapping[str, Any], url: str, name: str, path: str, role: str) -> None:
    """Raise a 503 :class:`~trio_disagg.WorkerError` if ``info`` (a server information
    answer) gives a ``disaggregation_mode`` other than ``role``."""
    mode = info.get("disaggregation_mode")
    if mode is not None and mode != role:
        other = "decode" if role == "prefill" else "prefill"
        fix = f", or list it among the {other} workers" if mode == other else ""
        raise WorkerError(
            f"{role} worker {url} is not an SGLang {role} worker: its {path} gives "
            f"disaggregation_mode {str(mode)[:20]!r} (start it with --disaggregation-mode "
            f"{role}{fix})", status=503, worker=name)


def _port_of(info: Mapping[str, Any], url: str, name: str, path: str) -> int:
    """The bootstrap port a server information answer gives.

    Raises:
        WorkerError: status 503: the worker is not a prefill worker (its
            ``disaggregation_mode``), or gives no port in 1-65535.
    """
    _check_mode(info, url, name, path, "prefill")
    port = info.get("disaggregation_bootstrap_port")
    if type(port) is not int or not 0 < port < 65536:
        raise _unknown(url, name, f"its {path} gives disaggregation_bootstrap_port "
                                  f"{orjson.dumps(port).decode()[:40]}")
    return port


async def fetch_bootstrap_port(transport: WorkerClient | HttpxWorkerClient, url: str,
                               name: str) -> int:
    """Ask the SGLang prefill worker at ``url`` for its bootstrap port: ``GET
    /server_info``, else ``GET /get_server_info`` if that one is not found. It need not
    bound itself: the caller cancels it (the connection is then closed).

    Args:
        transport: the engine's client.
        url: the worker's base URL.
        name: the worker's name, for the error.

    Returns:
        The worker's ``disaggregation_bootstrap_port``.

    Raises:
        WorkerError: status 503, naming the worker and what to do: it could not be
            reached, answered neither path with 2xx JSON, is not a prefill worker, or
            gives no valid port.
    """
    status, data, path = 404, b"", SERVER_INFO_PATHS[0]
    try:
        for path in SERVER_INFO_PATHS:
            status, data = await _get(transport, url, path)
            if status not in (404, 405):
                break
    except TransportError as exc:
        raise _unknown(url, name, f"GET {path} failed: {describe(exc)}") from exc
    if not 200 <= status < 300:
        raise _unknown(url, name, f"GET {path} answered {status}", status)
    info = _json_object(data)
    if info is None:
        raise _unknown(url, name, f"GET {path} answered no JSON object")
    port = _port_of(info, url, name, path)
    logger.info("SGLang prefill worker %s bootstraps at port %d (its %s)", url, port, path)
    return port


async def check_mode(transport: WorkerClient | HttpxWorkerClient, url: str, name: str,
                     role: str) -> bool:
    """Check that the SGLang worker at ``url`` runs in the ``role`` it was given: the
    ``disaggregation_mode`` of its ``GET /server_info`` (``/get_server_info`` if that one
    is not found). A decode worker listed as a prefill one (its bootstrap port given, so
    never asked of it), or a prefill or non-disaggregated worker listed as a decode one,
    would otherwise answer requests with nothing generated, or leave the prefill's KV in
    its room. It need not bound itself: the caller cancels it.

    Args:
        transport: the engine's client.
        url: the worker's base URL.
        name: the worker's name, for the error.
        role: ``"prefill"`` or ``"decode"``.

    Returns:
        True once the worker answered (its mode is ``role``, or it does not tell it: an
        answer that is not 2xx JSON, or has no mode, is taken on trust); False if it could
        not be reached (ask again later).

    Raises:
        WorkerError: status 503, naming the worker, its mode and what to do: its
            ``disaggregation_mode`` is not ``role``.
    """
    try:
        for path in SERVER_INFO_PATHS:
            status, data = await _get(transport, url, path)
            if status not in (404, 405):
                break
    except TransportError:
        return False
    info = _json_object(data) if 200 <= status < 300 else None
    if info is not None:
        _check_mode(info, url, name, path, role)
    return True
