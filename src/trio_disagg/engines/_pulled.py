"""A worker's server-sent events read one socket read at a time, by whichever task asks:
the decode leg's own (it sends each item to its channel) or its stream's reader's (a
:class:`~trio_disagg._pull.PullSlot`, one task a token: docs/performance.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import trio

from .._protocols import Annotated, LLMEngineOutput
from ._reader import SseReader
from ._transport import TransportError

if TYPE_CHECKING:
    from .._pull import PullSlot

Item = Annotated[LLMEngineOutput]


class _Body(Protocol):
    async def read(self) -> bytes: ...


class SseSource:
    """The items of a worker's event stream, one :meth:`pull` a socket read.

    What one read brought is one item (a burst, docs/performance.md); a malformed
    event, a worker's error or a broken connection is an error item that ends the
    stream; the finish is held until the usage chunk (or ``[DONE]``, or the body's end)
    and is the last item. The same items, in the same order, whoever pulls them.

    Args:
        body: the worker's response (its :meth:`read`).
        reader: the stream's :class:`SseReader`.
        error: makes the error item naming the worker from a message.
        describe: says what a transport error was, for that message.
        slot: the reader's slot when the reader pulls (released once the last item was
            given), else None.
    """

    __slots__ = ("_body", "_describe", "_error", "_next", "_slot", "crash", "finished",
                 "reader")

    def __init__(self, body: _Body, reader: SseReader, error: Callable[[str], Item],
                 describe: Callable[[BaseException], str], slot: PullSlot | None) -> None:
        self._body = body
        self.reader = reader
        self._error = error
        self._describe = describe
        self._slot = slot
        self._next: Item | None = None  # the stream's last item, after the burst before it
        #: The last item was given.
        self.finished = False
        #: What the reading raised in the reader's task, for the leg to raise (B4).
        self.crash: Exception | None = None

    async def pull(self) -> Item | None:
        """The next item: what the next read brought, or the stream's last item.

        Returns:
            The item; None once the last was given, or when the response was closed
            under the wait (the leg took the reading back: its channel has the rest).

        Cancelled, it loses nothing (a cancelled read takes no bytes).
        """
        if self._next is not None:
            return self.pull_nowait()
        if self.finished:
            return None
        reader = self.reader
        while True:
            try:
                part = await self._body.read()
            except TransportError as exc:
                if self._withdrawn():
                    return None  # the leg closed the response (it is stopping)
                if reader.final is None:
                    return self._last(self._error(f"failed mid-stream: {self._describe(exc)}"))
                part = b""  # the answer was complete; only the usage chunk or [DONE] was lost
            except trio.ClosedResourceError:
                return None  # the leg closed the response (it is stopping)
            if not part:
                return self._last(self._end())
            try:
                problem = reader.feed(part)
            except Exception as exc:
                if self._slot is None:
                    raise  # the leg's own read: its crash (B4)
                # The reader's: the leg raises it (a decode crash, B4), its channel ends.
                self.crash = exc
                self._last(None)
                return None
            output = reader.burst.take()
            last = (self._error(problem) if problem is not None
                    else self._end() if reader.done else None)
            if output is not None:
                self._next = last
                return Annotated(data=output)
            if last is not None:
                return self._last(last)

    def pull_nowait(self) -> Item | None:
        """The stream's last item if the read that brought the burst :meth:`pull` gave
        brought it too, else None (no read)."""
        item, self._next = self._next, None
        return None if item is None else self._last(item)

    def _withdrawn(self) -> bool:
        return self._slot is not None and self._slot.source is not self

    def _end(self) -> Item:
        """The item the stream ends with once its events ended: its finish, or why
        there is none."""
        reader = self.reader
        if reader.final is None:
            how = "sent [DONE]" if reader.done else "closed the stream"
            return self._error(f"{how} without a finish_reason (the worker died mid-stream?)")
        return Annotated(data=reader.final)

    def _last(self, item: Item | None) -> Item | None:
        self.finished = True
        if self._slot is not None:
            self._slot.release()
        return item
