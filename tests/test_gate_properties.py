"""The gatekeeper under generated interleavings (rules G1-G9, B4, B5 in docs/semantics.md).

Hypothesis generates a decode stream (tokens, decode errors, success terminals, items after
a terminal, or an early end with no terminal), the times at which each item arrives, when
the decode worker accepts, when and how the prefill ends, and how fast and how buffered the
client is. Each example is one request, run under ``trio.run`` with an autojump clock:
dispatch through :meth:`Gatekeeper.dispatch`, then :meth:`Gatekeeper.forward` into a client
that reads to the end. The checks are what the client must see.
"""

from __future__ import annotations

import itertools
import math

import attrs
import pytest
import trio
import trio.testing
from hypothesis import event, given, settings
from hypothesis import strategies as st

from trio_disagg import (
    Annotated,
    FinishReason,
    GatedOutputs,
    Gatekeeper,
    LLMEngineOutput,
    PrefillError,
    RequestContext,
    TransferKeeper,
    is_decode_failure,
)

Item = Annotated[LLMEngineOutput]
PREFILL_MESSAGE = "prefill connection lost"
HALF_SECONDS = st.integers(0, 2).map(lambda n: n / 2)


def _token(n: int) -> Item:
    return Annotated.from_data(LLMEngineOutput(token_ids=[n]))


def _success(reason: FinishReason) -> Item:
    return Annotated.from_data(LLMEngineOutput(token_ids=[0], finish_reason=reason))


def _decode_failure(kind: str) -> Item:
    if kind == "envelope":
        return Annotated[LLMEngineOutput].from_error("decode failed")
    reason = FinishReason.error("decode failed") if kind == "error" else FinishReason.CANCELLED
    return Annotated.from_data(LLMEngineOutput(finish_reason=reason))


def is_terminal(item: Item) -> bool:
    """An item after which nothing may follow: an error or any finish reason."""
    return item.is_error or (item.data is not None and item.data.finish_reason is not None)


def is_success_terminal(item: Item) -> bool:
    return is_terminal(item) and not is_decode_failure(item)


decode_items = st.one_of(
    st.integers(1, 10_000).map(_token),
    st.integers(1, 10_000).map(_token),  # tokens twice as likely as each terminal kind
    st.sampled_from(
        [FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH, FinishReason.CONTENT_FILTER]
    ).map(_success),
    st.sampled_from(["envelope", "error", "cancelled"]).map(_decode_failure),
)


@attrs.frozen
class Scenario:
    items: list[Item]  # the decode stream; no terminal in it means it ended early
    gaps: list[float]  # seconds before each decode item
    dispatch_at: float  # the decode worker accepts after this many seconds
    prefill_ok: bool
    prefill_at: float  # the prefill drain ends after this many seconds
    decode_buffer: float
    client_buffer: float
    consumer_delays: list[float]  # the client's pause after each item, cycled


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    items = draw(st.lists(decode_items, max_size=7))
    return Scenario(
        items=items,
        gaps=draw(st.lists(HALF_SECONDS, min_size=len(items), max_size=len(items))),
        dispatch_at=draw(HALF_SECONDS),
        prefill_ok=draw(st.booleans()),
        prefill_at=draw(st.integers(0, 14).map(lambda n: n / 2)),
        decode_buffer=draw(st.sampled_from([0, 1, math.inf])),
        client_buffer=draw(st.sampled_from([0, 1, math.inf])),
        consumer_delays=draw(st.lists(HALF_SECONDS, min_size=1, max_size=3)),
    )


@attrs.define
class Observed:
    dispatch_error: PrefillError | None = None
    items: list[Item] = attrs.Factory(list)
    received_at: list[float] = attrs.Factory(list)
    prefill_succeeded_at_receipt: list[bool] = attrs.Factory(list)
    prefill_resolved_at: float | None = None
    prefill_failed: bool = False
    client_stopped: bool = False
    decode_stopped: bool = False
    keeper_in_flight: int = -1
    keeper_cancelled: int = -1


async def run_request(sc: Scenario, pull: bool = False) -> Observed:
    obs = Observed()
    async with TransferKeeper(drain_window=100) as keeper:

        async def prefill_drain() -> None:
            await trio.sleep(sc.prefill_at)
            obs.prefill_resolved_at = trio.current_time()
            if not sc.prefill_ok:
                raise PrefillError(PREFILL_MESSAGE)

        task = keeper.start(prefill_drain, name="r-1")
        client = RequestContext("r-1")
        decode_ctx = RequestContext("r-1")
        client.link_child(decode_ctx)
        gate = Gatekeeper(task, client)
        decode_send, decode_recv = trio.open_memory_channel[Item](sc.decode_buffer)
        client_send, client_recv = trio.open_memory_channel[Item](sc.client_buffer)

        async def decode_leg(*, task_status: trio.TaskStatus[None]) -> None:  # noqa: ASYNC114
            with decode_send:
                await trio.sleep(sc.dispatch_at)
                task_status.started()
                try:
                    for gap, item in zip(sc.gaps, sc.items, strict=True):
                        await trio.sleep(gap)
                        await decode_send.send(item)
                except trio.BrokenResourceError:
                    pass  # the gate ended the stream and closed its end

        async with trio.open_nursery() as nursery:
            try:
                await gate.dispatch(nursery, decode_leg)
            except PrefillError as exc:
                obs.dispatch_error = exc
                nursery.cancel_scope.cancel()  # a leg started in a tie is not read
            else:
                # The client reads the gate itself (pull), or what forward() pushes.
                outputs: GatedOutputs | trio.MemoryReceiveChannel[Item]
                if pull:
                    outputs = gate.outputs(decode_recv, decode_ctx)
                else:
                    nursery.start_soon(gate.forward, decode_recv, client_send, decode_ctx)
                    outputs = client_recv
                delays = itertools.cycle(sc.consumer_delays)
                with outputs:
                    async for item in outputs:
                        obs.items.append(item)
                        obs.received_at.append(trio.current_time())
                        obs.prefill_succeeded_at_receipt.append(task.succeeded)
                        await trio.sleep(next(delays))
        obs.client_stopped = client.is_stopped
        obs.decode_stopped = decode_ctx.is_stopped
        await task.wait_done()
        obs.prefill_failed = task.failed
    obs.keeper_in_flight = keeper.in_flight
    obs.keeper_cancelled = keeper.cancelled_total
    return obs


async def bounded(sc: Scenario, pull: bool = False) -> Observed:
    """Run one example; a hang fails it (the autojump clock makes 1000 s instant)."""
    with trio.fail_after(1000):
        return await run_request(sc, pull)


def check(sc: Scenario, obs: Observed) -> None:
    decode = sc.items
    first_terminal = next((i for i, item in enumerate(decode) if is_terminal(item)), None)
    tokens = decode if first_terminal is None else decode[:first_terminal]

    # B5, G9: the prefill always ran to its own end in the keeper, never cancelled.
    assert obs.keeper_in_flight == 0
    assert obs.keeper_cancelled == 0
    assert obs.prefill_failed == (not sc.prefill_ok)

    if obs.dispatch_error is not None:  # G1: the prefill failed before the handoff
        assert not sc.prefill_ok
        assert PREFILL_MESSAGE in str(obs.dispatch_error)
        assert obs.client_stopped
        assert obs.items == []
        return

    items = obs.items
    ends = [i for i, item in enumerate(items) if is_terminal(item)]
    # B4, G8: exactly one terminal or error item, and it is the last; at most one if the
    # decode stream ended early without a terminal.
    if first_terminal is None:
        assert len(ends) <= 1, items
    else:
        assert len(ends) == 1, items
    if ends:
        assert ends[0] == len(items) - 1, items
    last = items[-1] if items else None
    body = items[:-1] if ends else items

    # G3, G7: tokens are forwarded in order, unchanged; all of them if the decode's own
    # terminal reached the client.
    assert len(body) <= len(tokens)
    assert all(got is sent for got, sent in zip(body, tokens, strict=False))
    from_decode = first_terminal is not None and last is decode[first_terminal]
    if from_decode:
        assert len(body) == len(tokens)

    # G5: no success terminal before the prefill succeeded.
    for item, ok, at in zip(
        items, obs.prefill_succeeded_at_receipt, obs.received_at, strict=True
    ):
        if is_success_terminal(item):
            assert ok
            assert obs.prefill_resolved_at is not None and at >= obs.prefill_resolved_at

    if sc.prefill_ok:
        # G7: after a successful prefill the stream is the decode stream, unchanged.
        expected = decode if first_terminal is None else decode[: first_terminal + 1]
        assert len(items) == len(expected), items
        assert not obs.client_stopped
    else:
        assert not any(is_success_terminal(item) for item in items)
        # G5, G6: a prefill failure always reaches the client, unless a decode error
        # ended the stream first (G4).
        decode_error_first = from_decode and last is not None and is_decode_failure(last)
        if not decode_error_first:
            assert last is not None and last.is_error, items
            assert last.error_message() == PREFILL_MESSAGE
            assert obs.client_stopped
            assert obs.decode_stopped


@pytest.mark.parametrize("pull", [False, True], ids=["forward", "outputs"])
@settings(max_examples=200, deadline=None)
@given(sc=scenarios())
def test_G1_to_G9_gatekeeper_invariants_under_generated_interleavings(
    pull: bool, sc: Scenario
) -> None:
    obs = trio.run(bounded, sc, pull, clock=trio.testing.MockClock(autojump_threshold=0))
    check(sc, obs)
    event(outcome(obs))


def outcome(obs: Observed) -> str:
    """How the example ended, for ``--hypothesis-show-statistics``."""
    if obs.dispatch_error is not None:
        return "prefill failure raised by dispatch"
    last = obs.items[-1] if obs.items else None
    if last is None or not is_terminal(last):
        return "early end, no terminal"
    if last.is_error and last.error_message() == PREFILL_MESSAGE:
        return "prefill failure replaced the stream's end"
    if is_decode_failure(last):
        return "decode failure forwarded"
    return "success terminal forwarded"


def test_G5_property_check_rejects_a_success_terminal_after_prefill_failure() -> None:
    """The checker itself can fail: a stream that let a success terminal through although
    the prefill failed is caught."""
    terminal = _success(FinishReason.EOS)
    sc = Scenario(
        items=[terminal],
        gaps=[0],
        dispatch_at=0,
        prefill_ok=False,
        prefill_at=1,
        decode_buffer=math.inf,
        client_buffer=math.inf,
        consumer_delays=[0],
    )
    bad = Observed(
        items=[terminal],
        received_at=[0.0],
        prefill_succeeded_at_receipt=[False],
        prefill_resolved_at=1.0,
        prefill_failed=True,
        keeper_in_flight=0,
        keeper_cancelled=0,
    )
    with pytest.raises(AssertionError):
        check(sc, bad)

