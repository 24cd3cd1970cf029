"""RequestContext: rules C1-C5 in docs/semantics.md."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_disagg import RequestContext


def test_C1_new_context_is_live() -> None:
    ctx = RequestContext("r-1")
    assert not ctx.is_stopped
    assert not ctx.is_killed
    assert repr(ctx) == "<RequestContext 'r-1' live>"


def test_C1_stopped_context_is_stopped_not_killed() -> None:
    ctx = RequestContext("r-1")
    ctx.stop_generating()
    assert ctx.is_stopped
    assert not ctx.is_killed
    assert repr(ctx) == "<RequestContext 'r-1' stopped>"


def test_C1_killed_context_is_also_stopped() -> None:
    ctx = RequestContext("r-1")
    ctx.kill()
    assert ctx.is_killed
    assert ctx.is_stopped
    assert repr(ctx) == "<RequestContext 'r-1' killed>"


async def test_C2_stopped_returns_at_once_when_already_stopped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ctx = RequestContext("r-1")
    ctx.stop_generating()
    before = trio.current_time()
    with trio.fail_after(1):
        await ctx.stopped()
        await ctx.stopped()  # level-triggered: again, still at once
    assert trio.current_time() == before


async def test_C2_killed_and_stopped_return_at_once_when_already_killed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ctx = RequestContext("r-1")
    ctx.kill()
    before = trio.current_time()
    with trio.fail_after(1):
        await ctx.killed()
        await ctx.stopped()
    assert trio.current_time() == before


async def test_C2_waiters_wake_on_the_transition(autojump_clock: trio.testing.MockClock) -> None:
    ctx = RequestContext("r-1")
    woke: list[str] = []

    async def wait_stopped() -> None:
        await ctx.stopped()
        woke.append("stopped")

    async def wait_killed() -> None:
        await ctx.killed()
        woke.append("killed")

    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_stopped)
            nursery.start_soon(wait_killed)
            await trio.testing.wait_all_tasks_blocked()
            assert woke == []
            ctx.stop_generating()
            await trio.testing.wait_all_tasks_blocked()
            assert woke == ["stopped"]  # a stop is not a kill
            ctx.kill()
    assert woke == ["stopped", "killed"]


async def test_C2_killed_does_not_return_on_a_mere_stop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ctx = RequestContext("r-1")
    ctx.stop_generating()
    with trio.move_on_after(5) as scope:
        await ctx.killed()
    assert scope.cancelled_caught


def test_C3_stop_after_kill_leaves_context_killed() -> None:
    ctx = RequestContext("r-1")
    seen: list[bool] = []
    ctx.on_stop(seen.append)
    ctx.kill()
    ctx.stop_generating()
    assert ctx.is_killed
    assert ctx.is_stopped
    assert seen == [True]  # no second (downgrading) notification


def test_C3_kill_after_stop_upgrades_to_killed() -> None:
    ctx = RequestContext("r-1")
    seen: list[bool] = []
    ctx.on_stop(seen.append)
    ctx.stop_generating()
    ctx.stop_generating()  # idempotent
    ctx.kill()
    ctx.kill()
    assert ctx.is_killed
    assert seen == [False, True]


def test_C3_callback_registered_late_sees_current_state() -> None:
    stopped = RequestContext("a")
    stopped.stop_generating()
    killed = RequestContext("b")
    killed.kill()
    seen: list[tuple[str, bool]] = []
    stopped.on_stop(lambda k: seen.append(("a", k)))
    killed.on_stop(lambda k: seen.append(("b", k)))
    assert seen == [("a", False), ("b", True)]


@pytest.mark.parametrize("action", ["stop_generating", "kill"])
def test_C4_link_child_propagates_children_first(action: str) -> None:
    parent = RequestContext("r-1")
    child = RequestContext("r-1")
    grandchild = RequestContext("r-1")
    parent.link_child(child)
    child.link_child(grandchild)
    order: list[str] = []
    parent.on_stop(lambda _: order.append("parent"))
    child.on_stop(lambda _: order.append("child"))
    grandchild.on_stop(lambda _: order.append("grandchild"))

    getattr(parent, action)()

    assert order == ["grandchild", "child", "parent"]
    for ctx in (parent, child, grandchild):
        assert ctx.is_stopped
        assert ctx.is_killed == (action == "kill")


def test_C4_stop_then_kill_reaches_child_as_kill() -> None:
    parent = RequestContext("r-1")
    child = RequestContext("r-1")
    parent.link_child(child)
    parent.stop_generating()
    assert child.is_stopped and not child.is_killed
    parent.kill()
    assert child.is_killed


def test_C4_child_linked_to_stopped_or_killed_parent_takes_its_state() -> None:
    stopped = RequestContext("a")
    stopped.stop_generating()
    killed = RequestContext("b")
    killed.kill()
    late_to_stopped = RequestContext("a")
    late_to_killed = RequestContext("b")
    stopped.link_child(late_to_stopped)
    killed.link_child(late_to_killed)
    assert late_to_stopped.is_stopped and not late_to_stopped.is_killed
    assert late_to_killed.is_killed


def test_C4_stopping_a_child_does_not_stop_the_parent() -> None:
    parent = RequestContext("r-1")
    child = RequestContext("r-1")
    parent.link_child(child)
    child.kill()
    assert not parent.is_stopped


def test_C5_prefill_context_shares_id_and_metadata() -> None:
    client = RequestContext("r-1", {"trace_id": "t-9", "session_id": "s"})
    prefill = client.detached_copy()
    assert prefill is not client
    assert prefill.id == "r-1"
    assert dict(prefill.metadata) == {"trace_id": "t-9", "session_id": "s"}
    assert not prefill.is_stopped


@pytest.mark.parametrize("action", ["stop_generating", "kill"])
def test_C5_stopping_or_killing_client_never_stops_prefill(action: str) -> None:
    client = RequestContext("r-1")
    decode = RequestContext("r-1")
    client.link_child(decode)
    prefill = client.detached_copy()
    getattr(client, action)()
    assert decode.is_stopped  # the linked decode leg follows the client...
    assert not prefill.is_stopped  # ...the prefill leg does not
    assert not prefill.is_killed


def test_C5_stopping_prefill_does_not_stop_client() -> None:
    client = RequestContext("r-1")
    prefill = client.detached_copy()
    prefill.kill()
    assert not client.is_stopped


def test_C5_metadata_is_read_only_and_a_copy() -> None:
    source = {"trace_id": "t"}
    ctx = RequestContext("r-1", source)
    source["trace_id"] = "changed"
    assert ctx.metadata["trace_id"] == "t"
    with pytest.raises(TypeError):
        ctx.metadata["trace_id"] = "x"  # type: ignore[index]


def test_C1_a_raising_on_stop_callback_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A callback must not raise; one that does is logged, the callbacks after it are
    still called, and the stop itself raises nothing (it may run in a keeper's task)."""
    context = RequestContext("r")
    seen: list[bool] = []
    context.on_stop(buggy_callback)
    context.on_stop(seen.append)
    context.stop_generating()
    context.kill()
    assert seen == [False, True]
    assert context.is_killed
    raised = [r for r in caplog.records if r.name == "trio_disagg.context"]
    assert len(raised) == 2 and all(r.exc_info for r in raised)


def test_C1_request_id_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="request_id must be a str"):
        RequestContext(None)  # type: ignore[arg-type]


def test_C4_C1_a_link_or_callback_of_the_wrong_type_is_refused_at_once() -> None:
    """``link_child("x")`` raised an AttributeError, and ``on_stop(5)`` was accepted and
    only logged as a raising callback at the stop, far from the mistake. Both are a
    TypeError now, and the context is left as it was."""
    context = RequestContext("a")
    with pytest.raises(TypeError, match="child must be a RequestContext, got str"):
        context.link_child("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callback must be callable, got int"):
        context.on_stop(5)  # type: ignore[arg-type]
    context.kill()  # nothing registered or linked: nothing raised, nothing logged
    assert context.is_killed


def test_C4_a_link_that_would_make_a_cycle_is_refused() -> None:
    """A cycle of links would make the next stop recurse for ever."""
    a, b, c = RequestContext("a"), RequestContext("b"), RequestContext("c")
    a.link_child(b)
    b.link_child(c)
    for parent, child in ((a, a), (c, a), (b, a), (c, b)):
        with pytest.raises(ValueError, match="cycle"):
            parent.link_child(child)
    a.kill()
    assert b.is_killed and c.is_killed


def buggy_callback(killed: bool) -> None:
    """An ``on_stop`` callback that raises (a bug: it must not)."""
    raise ZeroDivisionError("the bug")
