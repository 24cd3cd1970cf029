"""The mock HTTP workers' side of the ASGI plumbing: one response and its state (JSON, SSE
and octet-stream answers, errors in either error shape) and the disconnect listener that
aborts a request when its connection closes. Headers, query parameters, body reading and
the lifespan protocol are the package's shared plumbing (``trio_disagg._asgi``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import orjson
import trio

from .._asgi import JSON_TYPE, SSE_TYPE, Message, Receive, Send, wait_disconnect

DONE_EVENT = b"data: [DONE]\n\n"
OCTETS = b"application/octet-stream"
_CHUNK = 64 * 1024  # bytes per body message of an octet-stream answer


def error_json(message: str, status: int, *, type_: str | None = None,
               code: str | int | None = None, flat: bool = False) -> bytes:
    """An error body: vLLM's ``{"error": {"message", "type", "param", "code"}}``, or with
    ``flat`` the ``ErrorResponse`` of SGLang and TensorRT-LLM, ``{"object": "error",
    "message", "type", "param", "code"}``."""
    if type_ is None:
        type_ = ("NotFoundError" if status == 404 else "BadRequestError" if status < 500
                 else "InternalServerError")
    error = {"message": message, "type": type_, "param": None,
             "code": code if code is not None else status}
    if flat:
        return orjson.dumps({"object": "error", **error})
    return orjson.dumps({"error": error})


def error_event(message: str, status: int = 500, *, flat: bool = False) -> bytes:
    """An error in the middle of a stream, followed by ``[DONE]`` (see :func:`error_json`
    for ``flat``)."""
    return b"data: " + error_json(message, status, flat=flat) + b"\n\n" + DONE_EVENT


class Refusal(Exception):
    """A generation request the worker answers with an error status before serving it."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        #: The ``Retry-After`` seconds to answer with, or None for no header.
        self.retry_after = retry_after


@attrs.define(eq=False)
class Exchange:
    """One HTTP response and where it is: not started, streaming, or finished.

    Hypercorn reports the end of a response to the app as ``http.disconnect`` too, so the
    final write first cancels the disconnect listener (:attr:`listener`).

    Attributes:
        request_id: the request's ``X-Request-Id``, decoded as latin-1 so that any bytes
            round-trip; echoed on the response.
        flat: errors in the ``{"object": "error", ...}`` form (see :func:`error_json`).
        started: the response's headers went out.
        finished: the last body message went out.
        failed: the answer is an error (status or event), or was cut on purpose.
        disconnected: the client went away before the response finished.
    """

    send: Send
    request_id: str | None = None
    flat: bool = attrs.field(default=False, kw_only=True)
    started: bool = attrs.field(default=False, init=False)
    finished: bool = attrs.field(default=False, init=False)
    failed: bool = attrs.field(default=False, init=False)
    disconnected: bool = attrs.field(default=False, init=False)
    listener: trio.CancelScope | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        send = self.send

        async def send_then_yield(message: Message) -> None:
            await send(message)
            # Each write is a schedule point, whatever the server's send is (the project's
            # has none when the socket takes the bytes): at zero latency the streams of a
            # batch advance together, as an engine's decode steps make them.
            await trio.lowlevel.cancel_shielded_checkpoint()

        self.send = send_then_yield

    def _headers(self, content_type: bytes, length: int | None = None
                 ) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", content_type)]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        if self.request_id is not None:
            headers.append((b"x-request-id", self.request_id.encode("latin-1")))
        return headers

    async def start(self, status: int, content_type: bytes,
                    extra: list[tuple[bytes, bytes]] | None = None,
                    length: int | None = None) -> None:
        headers = self._headers(content_type, length)
        if extra:
            headers.extend(extra)
        self.started = True
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def start_stream(self) -> None:
        await self.start(200, SSE_TYPE, [(b"cache-control", b"no-cache")])

    async def body(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, data: bytes = b"") -> None:
        if self.listener is not None:
            self.listener.cancel()
        self.finished = True
        await self.send({"type": "http.response.body", "body": data, "more_body": False})

    async def respond(self, status: int, data: bytes, content_type: bytes = JSON_TYPE,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """A whole response; the listener is cancelled first, so it cannot be aborted."""
        if self.listener is not None:
            self.listener.cancel()
        await self.start(status, content_type, extra, length=len(data))
        await self.finish(data)

    async def error(self, message: str, status: int,
                    extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """An error response (with the ``extra`` headers), or once streaming an error event
        and ``[DONE]``."""
        if not self.started:
            await self.respond(status, error_json(message, status, flat=self.flat),
                               extra=extra)
        elif not self.finished:
            await self.finish(error_event(message, status, flat=self.flat))
        else:
            await trio.lowlevel.checkpoint()


async def run_until_disconnect(
    receive: Receive, exchange: Exchange, work: Callable[[], Awaitable[None]]
) -> None:
    """Run ``work`` and cancel it if the client disconnects first (what vLLM does: a
    request is aborted when its connection closes). The listener stops once
    ``exchange`` finishes its response. ``exchange.disconnected`` tells which it was.
    """
    async with trio.open_nursery() as nursery:
        listener = trio.CancelScope()
        exchange.listener = listener

        async def listen() -> None:
            with listener:
                await wait_disconnect(receive)
                if not exchange.finished:
                    exchange.disconnected = True
                    nursery.cancel_scope.cancel()

        nursery.start_soon(listen)
        await work()
        listener.cancel()


def url_host(host: str) -> str:
    """``host`` as it goes in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def send_octets(exchange: Exchange, data: bytes,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """A whole ``application/octet-stream`` answer, in body messages of 64 KiB."""
    await exchange.start(200, OCTETS, extra, length=len(data))
    chunks = [data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
    for chunk in chunks[:-1]:
        await exchange.body(chunk)
    await exchange.finish(chunks[-1])
