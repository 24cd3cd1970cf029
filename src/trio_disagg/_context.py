"""Per-request cancellation state, Dynamo's ``AsyncEngineContext`` on trio primitives."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from ._pull import PullSlot

logger = logging.getLogger("trio_disagg.context")

_LIVE, _STOPPED, _KILLED = 0, 1, 2
#: The metadata of every context made without any: one shared read-only mapping, not an
#: empty dict and a proxy per context (a request has three contexts; docs/design.md P3).
_NO_METADATA: Mapping[str, Any] = MappingProxyType({})


class RequestContext:
    """The live / stopped / killed state of one request (rules C1-C5 in docs/semantics.md).

    A producer (an engine leg) watches its context: ``stop_generating()`` asks it to stop
    and finish with ``cancelled`` (items already sent stay valid); ``kill()`` asks it to
    stop at once without draining. States only move forward: live -> stopped -> killed,
    and ``stop_generating()`` after ``kill()`` leaves the context killed (C3; Dynamo's
    controller downgrades here, we do not).

    Every method is synchronous and safe to call from any task of the same trio run;
    ``stopped()`` and ``killed()`` are level-triggered (C2). A context is not a cancel
    scope: stopping it cancels nothing by itself, the producer decides how to honour it
    (``on_stop`` with a cancel scope is the usual way). Cancelling the task that waits on
    a context does not change the context.

    Args:
        request_id: the request's id, shared by the client context and its prefill and
            decode legs.
        metadata: read-only values carried along (trace ids, the session id, ...); copied,
            then exposed as a read-only mapping.

    Raises:
        TypeError: ``request_id`` is not a str.

    Attributes:
        id: the request id.
        metadata: the read-only metadata.
    """

    __slots__ = ("_callbacks", "_children", "_killed", "_pull", "_state", "_stopped", "id",
                 "metadata")

    def __init__(self, request_id: str, metadata: Mapping[str, Any] | None = None) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        self.id = request_id
        self.metadata: Mapping[str, Any] = (MappingProxyType(dict(metadata)) if metadata
                                            else _NO_METADATA)
        self._state = _LIVE
        # Made only when somebody waits, links or registers: most contexts are never
        # awaited, and a request in flight should cost as little memory as it can
        # (docs/design.md P3).
        self._stopped: trio.Event | None = None
        self._killed: trio.Event | None = None
        self._children: list[RequestContext] | None = None
        self._callbacks: list[Callable[[bool], None]] | None = None
        #: Set by the router for a decode leg whose reader may read its worker (_pull.py).
        self._pull: PullSlot | None = None

    def __repr__(self) -> str:
        state = "killed" if self.is_killed else "stopped" if self.is_stopped else "live"
        return f"<RequestContext {self.id!r} {state}>"

    @property
    def is_stopped(self) -> bool:
        """True once stopped *or* killed (C1)."""
        return self._state >= _STOPPED

    @property
    def is_killed(self) -> bool:
        """True once killed (C1); a killed context is also stopped."""
        return self._state == _KILLED

    def stop_generating(self) -> None:
        """Ask the producer to stop and end its stream with one ``cancelled`` finish;
        what it already sent stays valid (C1).

        Linked children are stopped first (C4), then this context's waiters are woken and
        its ``on_stop`` callbacks called with ``killed=False``. A context already stopped
        or killed is left as it is: a stop never downgrades a kill (C3). Never raises: a
        callback that raises (it must not) is logged, and the others are still called.
        """
        if self._state >= _STOPPED:
            return  # already stopped or killed: never downgrade a kill (C3)
        for child in self._children or ():
            child.stop_generating()
        self._state = _STOPPED
        if self._stopped is not None:
            self._stopped.set()
        self._notify(killed=False)

    def kill(self) -> None:
        """Ask the producer to stop at once and send nothing more (C1).

        Linked children are killed first (C4), then waiters of both ``stopped()`` and
        ``killed()`` are woken and the ``on_stop`` callbacks called with ``killed=True``.
        Killing a killed context does nothing; killing a stopped one upgrades it (C3).
        Never raises, as :meth:`stop_generating`.
        """
        if self._state == _KILLED:
            return
        for child in self._children or ():
            child.kill()
        self._state = _KILLED
        if self._stopped is not None:
            self._stopped.set()
        if self._killed is not None:
            self._killed.set()
        self._notify(killed=True)

    async def stopped(self) -> None:
        """Return once the context is stopped or killed; at once (after a checkpoint) if it
        already is (C2). Cancelling the wait leaves the context as it is."""
        if self._state >= _STOPPED:
            await trio.lowlevel.checkpoint()
            return
        if self._stopped is None:
            self._stopped = trio.Event()
        await self._stopped.wait()

    async def killed(self) -> None:
        """Return once the context is killed; at once (after a checkpoint) if it already
        is (C2). Cancelling the wait leaves the context as it is."""
        if self._state == _KILLED:
            await trio.lowlevel.checkpoint()
            return
        if self._killed is None:
            self._killed = trio.Event()
        await self._killed.wait()

    def link_child(self, child: RequestContext) -> None:
        """Propagate this context's stop and kill to ``child`` (C4).

        The link is one way: stopping ``child`` leaves this context as it is. A child
        linked to an already stopped or killed context is brought to that state now. The
        router links a decode leg's context; never a prefill's (C5).

        Args:
            child: the context of a leg working for this request.

        Raises:
            ValueError: ``child`` is this context or one it is linked from: the link
                would make a cycle, which a stop would walk for ever.
            TypeError: ``child`` is not a :class:`RequestContext`.
        """
        if not isinstance(child, RequestContext):
            raise TypeError(f"child must be a RequestContext, got {type(child).__name__}")
        if child is self or child._reaches(self):
            raise ValueError(f"linking {child!r} under {self!r} would make a cycle")
        if self._children is None:
            self._children = []
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
        """Call ``callback(killed)`` on each state change: ``False`` on a stop, ``True``
        on a kill (a stop then a kill calls it twice) (C1, C2).

        The usual callback cancels a producer's cancel scope. Callbacks run synchronously
        inside ``stop_generating()`` / ``kill()``, in whatever task stops the context (a
        keeper's drain, for one the gatekeeper stops), and must not raise (nor await):
        one that raises there is logged to ``trio_disagg.context``, never raised into
        that task. A callback registered on a context already stopped or killed is
        called at once, with its current state (what it raises then is raised here).
        Callbacks cannot be removed; they live as long as the context.

        Args:
            callback: called with ``killed``.

        Raises:
            TypeError: ``callback`` is not callable (said now: at the stop it would only
                be logged).
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)
        if self.is_killed:
            callback(True)
        elif self.is_stopped:
            callback(False)

    def _forget_on_stop(self, callback: Callable[[bool], None]) -> None:
        """Drop a callback of :meth:`on_stop` that has no more use, so that what it holds
        (a cancel scope) is not kept for the rest of the request (docs/design.md P3).
        For the router's own short waits; a callback not registered is ignored."""
        if self._callbacks is not None and callback in self._callbacks:
            self._callbacks.remove(callback)

    def _reaches(self, other: RequestContext) -> bool:
        """Whether ``other`` is among this context's linked descendants."""
        pending = list(self._children or ())
        while pending:
            child = pending.pop()
            if child is other:
                return True
            pending.extend(child._children or ())
        return False

    def _notify(self, *, killed: bool) -> None:
        for callback in self._callbacks or ():
            try:
                callback(killed)
            except Exception:
                # The stopping task may be a keeper's, whose nursery nothing may reach (T2).
                logger.exception("on_stop callback %r of %r raised", callback, self)
