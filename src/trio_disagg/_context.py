"""Per-request cancellation state, Dynamo's ``AsyncEngineContext`` on trio primitives."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import trio

_LIVE, _STOPPED, _KILLED = 0, 1, 2


class RequestContext:
    """The live / stopped / killed state of one request (rules C1-C5 in docs/semantics.md).

    A producer (an engine leg) watches its context: ``stop_generating()`` asks it to stop
    and finish with ``cancelled`` (items already sent stay valid); ``kill()`` asks it to
    stop at once without draining. States only move forward: live -> stopped -> killed,
    and ``stop_generating()`` after ``kill()`` leaves the context killed (C3; Dynamo's
    controller downgrades here, we do not).

    Every method is synchronous and safe to call from any task of the same trio run;
    ``stopped()`` and ``killed()`` are level-triggered (C2).

    Args:
        request_id: the request's id, shared by the client context and its prefill and
            decode legs.
        metadata: read-only values carried along (trace ids, the session id, ...).
    """

    __slots__ = ("_callbacks", "_children", "_killed", "_state", "_stopped", "id", "metadata")

    def __init__(self, request_id: str, metadata: Mapping[str, Any] | None = None) -> None:
        self.id = request_id
        self.metadata: Mapping[str, Any] = MappingProxyType(dict(metadata or {}))
        self._state = _LIVE
        # Made only when somebody waits: most contexts are never awaited, and a request in
        # flight should cost as little memory as it can (docs/design.md P3).
        self._stopped: trio.Event | None = None
        self._killed: trio.Event | None = None
        self._children: list[RequestContext] = []
        self._callbacks: list[Callable[[bool], None]] = []

    def __repr__(self) -> str:
        state = "killed" if self.is_killed else "stopped" if self.is_stopped else "live"
        return f"<RequestContext {self.id!r} {state}>"

    @property
    def is_stopped(self) -> bool:
        """True once stopped *or* killed (C1)."""
        return self._state >= _STOPPED

    @property
    def is_killed(self) -> bool:
        return self._state == _KILLED

    def stop_generating(self) -> None:
        """Ask the producer to stop; children are stopped first (C3, C4)."""
        if self._state >= _STOPPED:
            return  # already stopped or killed: never downgrade a kill (C3)
        for child in self._children:
            child.stop_generating()
        self._state = _STOPPED
        if self._stopped is not None:
            self._stopped.set()
        self._notify(killed=False)

    def kill(self) -> None:
        """Ask the producer to stop at once, without draining; children first (C3, C4)."""
        if self._state == _KILLED:
            return
        for child in self._children:
            child.kill()
        self._state = _KILLED
        if self._stopped is not None:
            self._stopped.set()
        if self._killed is not None:
            self._killed.set()
        self._notify(killed=True)

    async def stopped(self) -> None:
        """Return once the context is stopped or killed; at once if it already is (C2)."""
        if self._state >= _STOPPED:
            await trio.lowlevel.checkpoint()
            return
        if self._stopped is None:
            self._stopped = trio.Event()
        await self._stopped.wait()

    async def killed(self) -> None:
        """Return once the context is killed; at once if it already is (C2)."""
        if self._state == _KILLED:
            await trio.lowlevel.checkpoint()
            return
        if self._killed is None:
            self._killed = trio.Event()
        await self._killed.wait()

    def link_child(self, child: RequestContext) -> None:
        """Propagate this context's stop and kill to ``child`` (C4).

        A child linked to an already stopped or killed context is brought to that state now.
        """
        self._children.append(child)
        if self.is_killed:
            child.kill()
        elif self.is_stopped:
            child.stop_generating()

    def detached_copy(self) -> RequestContext:
        """A new live context with this one's id and metadata, *not* linked to it.

        The prefill leg runs on such a context (C5): stopping or killing the client context
        never reaches it.
        """
        return RequestContext(self.id, self.metadata)

    def on_stop(self, callback: Callable[[bool], None]) -> None:
        """Call ``callback(killed)`` on each state change (stop, then possibly kill).

        The usual callback cancels a producer's cancel scope on kill. Callbacks run
        synchronously inside ``stop_generating()`` / ``kill()`` and must not raise. A
        callback registered on a context already stopped or killed is called at once.
        """
        self._callbacks.append(callback)
        if self.is_killed:
            callback(True)
        elif self.is_stopped:
            callback(False)

    def _notify(self, *, killed: bool) -> None:
        for callback in self._callbacks:
            callback(killed)
