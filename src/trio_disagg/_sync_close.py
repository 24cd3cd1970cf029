"""A receive channel closed synchronously, as trio's memory channels are."""

from __future__ import annotations

from types import TracebackType
from typing import Self, TypeVar

import trio

T = TypeVar("T")


class SyncCloseReceiveChannel(trio.abc.ReceiveChannel[T]):
    """A :class:`trio.abc.ReceiveChannel` whose :meth:`close` needs no wait: usable in a
    synchronous ``with`` block, and an ``async with`` block ends it with no checkpoint (a
    block left on ``Cancelled`` must not raise a second one). Subclasses define
    :meth:`close`."""

    __slots__ = ()

    def close(self) -> None:
        """Close the channel. Idempotent."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """:meth:`close`, then a checkpoint."""
        self.close()
        await trio.lowlevel.checkpoint()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
