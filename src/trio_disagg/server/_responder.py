"""One HTTP response of the router's ASGI app: where it is, and sends that either complete
or break it (the responder); the shutdown ending of a cancelled request (B3, B4)."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import trio

from .._asgi import JSON_TYPE, SSE_TYPE, Message, Send
from ._openai_errors import RETRY_AFTER, ApiError
from ._openai_responses import DONE_EVENT

logger = logging.getLogger("trio_disagg.server")


#: Seconds one send of a response may wait for the connection. Sends are shielded so that
#: the responder's state is exactly what went out: a send cancelled half-way can leave
#: hypercorn and h11 disagreeing about the response, and the next message then crashes
#: the connection's task group, and with it the whole server.
SEND_WINDOW = 10.0

#: Seconds a request cancelled at shutdown (or by the server from outside) gets to write
#: its ending: a 503 error, or an error event and ``[DONE]`` (B3, B4).
ENDING_WINDOW = 1.0


class ResponseBroken(Exception):
    """A send of the response did not complete: nothing more can be sent on it."""


class Cancellable(Protocol):
    """What the responder cancels before the final bytes: a listener's cancel scope, or
    the guard of a server's disconnect callback."""

    def cancel(self) -> None: ...


class Responder:
    """One HTTP response, and where it is: not started, streaming, or finished.

    ``started`` and ``finished`` say what really went out: each is set once its send
    completed. A send that failed or ran out of time marks the response ``broken``: what
    reached the connection is then unknown, and nothing more is sent.

    Before the final bytes go out it cancels the disconnect listener, because hypercorn
    reports the end of a response to the app as an ``http.disconnect`` too.
    """

    __slots__ = ("broken", "finished", "listener", "on_complete", "request_id", "send",
                 "send_body", "send_deadline", "started", "whole_sends")

    def __init__(self, send: Send, *, whole_sends: bool = False,
                 send_body: Callable[[bytes], Awaitable[None]] | None = None) -> None:
        self.send = send
        #: The server sends each message whole or breaks the connection, bounded in time
        #: (the project's own server): no shielded scope per send is needed.
        self.whole_sends = whole_sends
        #: The server's own send of a part of a streamed body, if it has one (its
        #: ``whole_sends`` extension's ``body``): no ASGI message per part.
        self.send_body = send_body if whole_sends else None
        self.request_id: bytes | None = None
        self.started = False
        self.finished = False
        self.broken = False
        #: The disconnect listener (a scope of a listening task, or a server callback's
        #: guard): cancelled before the final bytes go out.
        self.listener: Cancellable | None = None
        #: No send may go on past this time (the shutdown ending caps it).
        self.send_deadline = math.inf
        #: Called once when the response's last bytes went out (the edge's admission
        #: slot: the request no longer counts against ``max_in_flight``).
        self.on_complete: Callable[[], object] | None = None

    @property
    def done(self) -> bool:
        """Nothing more can be sent: the response is finished, or broken."""
        return self.finished or self.broken

    def _headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", content_type)]
        if self.request_id is not None:
            headers.append((b"x-request-id", self.request_id))
        return headers

    async def _send(self, message: Message) -> None:
        """Send one message, shielded and bounded, so it either completes or breaks.

        Raises:
            ResponseBroken: the response was already broken, or this send timed out.
        """
        if self.done:
            raise ResponseBroken(f"cannot send {message['type']}: the response is over")
        if self.whole_sends and self.send_deadline == math.inf:
            try:
                await self.send(message)  # the relay's hot path: no scope per send
            except BaseException:
                self.broken = True
                raise
            return
        deadline = min(trio.current_time() + SEND_WINDOW, self.send_deadline)
        with trio.CancelScope(deadline=deadline, shield=True) as scope:
            try:
                await self.send(message)
            except BaseException:
                self.broken = True
                raise
        if scope.cancelled_caught:
            raise ResponseBroken(f"sending {message['type']} timed out")

    async def start_stream(self) -> None:
        headers = self._headers(SSE_TYPE)
        headers.append((b"cache-control", b"no-cache"))
        headers.append((b"x-accel-buffering", b"no"))
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        self.started = True

    async def body(self, data: bytes) -> None:
        send_body = self.send_body
        if send_body is not None and self.send_deadline == math.inf and not self.done:
            try:
                await send_body(data)  # the relay's hot path: one call, no message
            except BaseException:
                self.broken = True
                raise
            return
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, data: bytes) -> None:
        if self.listener is not None:
            self.listener.cancel()
        await self._send({"type": "http.response.body", "body": data, "more_body": False})
        self.finished = True
        on_complete, self.on_complete = self.on_complete, None
        if on_complete is not None:
            on_complete()

    async def respond(
        self,
        status: int,
        data: bytes,
        content_type: bytes = JSON_TYPE,
        extra: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        headers = self._headers(content_type)
        headers.extend(extra)
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        self.started = True
        await self.finish(data)

    async def error(self, error: ApiError, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """An error response (with ``Retry-After`` if the error has one), or, once
        streaming, an error event and ``[DONE]`` (B4)."""
        if self.done:
            await trio.lowlevel.checkpoint()
        elif not self.started:
            if error.retry_after is not None:
                extra = (*extra, (b"retry-after", str(error.retry_after).encode()))
            await self.respond(error.status, error.to_json(), extra=extra)
        else:
            await self.finish(error.to_event() + DONE_EVENT)


def shutdown_error() -> ApiError:
    """The error of a request the server cancelled because it is shutting down."""
    return ApiError(503, "the server is shutting down; the request was cancelled before it "
                    "completed", type="service_unavailable_error", code="server_shutting_down",
                    retry_after=RETRY_AFTER)


async def end_cancelled(responder: Responder) -> None:
    """Give a request cancelled by the server its ending (B3, B4): a 503 if nothing was
    sent yet, else an error event and ``[DONE]``; shielded, for ``ENDING_WINDOW``."""
    if responder.done:
        await trio.lowlevel.checkpoint()
        return
    responder.send_deadline = min(responder.send_deadline,
                                  trio.current_time() + ENDING_WINDOW)
    with trio.move_on_after(ENDING_WINDOW, shield=True):
        try:
            await responder.error(shutdown_error())
        except Exception as exc:
            logger.debug("could not end a cancelled request: %r", exc)
