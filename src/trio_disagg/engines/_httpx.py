"""The worker client's interface over a caller's own :class:`httpx.AsyncClient` (a test's
``httpx.MockTransport``, a proxy, TLS settings httpx knows): the same responses and the
same :class:`~trio_disagg.engines.TransportError`\\ s as :class:`WorkerClient`, slower on
the relay's hot path."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

import httpx  # noqa: ASYNC127 (an adapter for callers' own httpx clients)

from ._transport import ConnectError, ReadTimeout, RemoteProtocolError, read_up_to


class _HttpxResponse:
    """A :class:`WorkerResponse` face on an httpx response (:class:`HttpxWorkerClient`)."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self._parts = response.aiter_bytes()
        self.at_end = False  # True once the body was read to its end
        self.status_code = response.status_code
        self.headers: Mapping[str, str] = response.headers

    async def read(self) -> bytes:
        try:
            return await anext(self._parts)
        except StopAsyncIteration:
            self.at_end = True
            return b""
        except httpx.TimeoutException as exc:
            raise ReadTimeout(str(exc)) from exc
        except httpx.HTTPError as exc:
            raise RemoteProtocolError(f"{type(exc).__name__}: {exc}") from exc

    async def aread(self, limit: int | None = None) -> bytes:
        return await read_up_to(self.read, limit)

    async def aclose(self) -> None:
        await self._response.aclose()


class _HttpxExchange:
    def __init__(self, client: httpx.AsyncClient, method: str, url: str, content: bytes,
                 headers: Mapping[bytes, bytes]) -> None:
        self._request = client.build_request(method, url, content=content or None,
                                             headers=dict(headers))
        self._client = client
        self._response: _HttpxResponse | None = None

    async def __aenter__(self) -> _HttpxResponse:
        try:
            response = await self._client.send(self._request, stream=True)
        except httpx.ConnectError as exc:
            raise ConnectError(str(exc)) from exc
        except httpx.TimeoutException as exc:
            raise ReadTimeout(str(exc)) from exc
        except httpx.HTTPError as exc:
            raise RemoteProtocolError(f"{type(exc).__name__}: {exc}") from exc
        self._response = _HttpxResponse(response)
        return self._response

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._response is not None:
            await self._response.aclose()


class HttpxWorkerClient:
    """The worker client's interface over an :class:`httpx.AsyncClient`: for a client with
    its own transport (a test's ``httpx.MockTransport``, a proxy, TLS settings httpx
    knows). Slower than :class:`WorkerClient` on the relay's hot path; its failures are
    the same :class:`TransportError`\\ s.

    Args:
        client: the httpx client to send with; the caller owns it (this wrapper never
            closes it).
    """

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    def stream(self, method: str, url: str, *, content: bytes,
               headers: Mapping[bytes, bytes]) -> _HttpxExchange:
        if method not in ("POST", "GET"):
            raise ValueError(f"the worker client only POSTs and GETs, not {method}")
        return _HttpxExchange(self.client, method, url, content, headers)


__all__ = ["HttpxWorkerClient"]
