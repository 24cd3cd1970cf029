"""Classifying a prefill stream: rules S1-S10 and T4 in docs/semantics.md.

Ports every test of the 1.4.0 reference (``dynamo-llm-1.4.0-admission.rs.txt``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
import trio.testing

from trio_disagg import (
    Annotated,
    CompletionUsage,
    FinishReason,
    Handoff,
    InvalidPrefillHandoff,
    LLMEngineOutput,
    NoDisaggregatedParams,
    PrefillCompletion,
    PrefillError,
    PromptTokensDetails,
    RequestTracker,
    Terminal,
    TraceLink,
    TransferKeeper,
    WorkerError,
    check_prefill_output,
    classify_first_output,
    consume_prefill_stream,
    is_bootstrap_params,
)

Item = Annotated[LLMEngineOutput]

BOOTSTRAP = {
    "bootstrap_host": "127.0.0.1",
    "bootstrap_port": 1,
    "bootstrap_room": "test",
    "ctx_request_id": 42,
}


def out(**fields: Any) -> Item:
    return Annotated.from_data(LLMEngineOutput(**fields))


def error(message: str) -> Item:
    return Annotated[LLMEngineOutput].from_error(message)


def valid_prefill_output() -> Item:
    return out(disaggregated_params={})


def usage(cached: int | None) -> CompletionUsage:
    details = None if cached is None else PromptTokensDetails(cached_tokens=cached)
    return CompletionUsage(prompt_tokens=10, prompt_tokens_details=details)


def stream_of(*items: Item) -> trio.MemoryReceiveChannel[Item]:
    """A prefill stream that already holds ``items`` and then ends."""
    send, receive = trio.open_memory_channel[Item](len(items))
    with send:
        for item in items:
            send.send_nowait(item)
    return receive


class Guard:
    """A teardown guard that records when it is held."""

    def __init__(self) -> None:
        self.entered = 0
        self.exited = 0

    def __enter__(self) -> Guard:
        self.entered += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.exited += 1

    @property
    def held(self) -> bool:
        return self.entered == 1 and self.exited == 0

    @property
    def released(self) -> bool:
        return self.entered == 1 and self.exited == 1


async def produce(send: trio.MemorySendChannel[Item], *steps: tuple[float, Item]) -> None:
    """Send each item after its delay, then end the stream."""
    with send:
        for delay, item in steps:
            await trio.sleep(delay)
            await send.send(item)
        await trio.lowlevel.checkpoint()


def handoff_of(completion: PrefillCompletion) -> Handoff:
    assert isinstance(completion, Handoff), completion
    return completion


# --- S1, S2, S3 ------------------------------------------------------------------------


async def test_S1_stream_ending_with_no_output_is_an_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tracker = RequestTracker()
    with pytest.raises(PrefillError, match="no output") as info:
        await consume_prefill_stream(stream_of(), tracker=tracker)
    assert not isinstance(info.value, NoDisaggregatedParams)
    assert tracker.prefill_complete_at is None


async def test_S2_first_output_error_does_not_record_prefill_complete(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ports 1.4.0 ``first_output_error_does_not_record_prefill_complete``."""
    tracker = RequestTracker()
    with pytest.raises(PrefillError, match="prefill failed") as info:
        await consume_prefill_stream(stream_of(error("prefill failed")), tracker=tracker)
    assert not isinstance(info.value, NoDisaggregatedParams)
    assert tracker.record_prefill_complete()  # nothing was recorded before


async def test_S2_first_output_error_closes_the_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    send, receive = trio.open_memory_channel[Item](0)
    producer_saw_close: list[bool] = []

    async def prefill_worker() -> None:
        with send:
            await send.send(error("prefill failed"))
            try:
                await send.send(out(token_ids=[1]))
            except trio.BrokenResourceError:
                producer_saw_close.append(True)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prefill_worker)
            with pytest.raises(PrefillError, match="prefill failed"):
                await consume_prefill_stream(receive)
    assert producer_saw_close == [True]


def test_S2_T4_an_error_item_carrying_a_prefill_error_raises_that_error() -> None:
    """An adapter that knows what failed (B7: which handoff field) sends its exception in
    the error item; classification and the later-output check raise that very object.
    An error item carrying any other exception is classified from its message as before."""
    invalid = InvalidPrefillHandoff("prefill worker w sent an invalid handoff: x", field="x")
    item = Annotated[LLMEngineOutput].from_exception(invalid)
    tracker = RequestTracker()
    with pytest.raises(InvalidPrefillHandoff) as first:
        classify_first_output(item, tracker)
    assert first.value is invalid and first.value.field == "x"
    assert tracker.prefill_complete_at is None  # S2 still holds
    with pytest.raises(InvalidPrefillHandoff) as later:
        check_prefill_output(item)
    assert later.value is invalid
    other = Annotated[LLMEngineOutput].from_exception(WorkerError("worker died", status=502))
    for check in (classify_first_output, check_prefill_output):
        with pytest.raises(PrefillError, match="worker died") as caught:
            check(other)
        assert type(caught.value) is PrefillError


async def test_S3_valid_first_output_records_prefill_complete_on_arrival(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tracker = RequestTracker()
    send, receive = trio.open_memory_channel[Item](0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce, send, (2, valid_prefill_output()), (3, out(token_ids=[1])))
        completion = await consume_prefill_stream(receive, tracker=tracker)
    assert isinstance(completion, Handoff)
    assert trio.current_time() == 5.0  # the stream was read to its end (S6)...
    assert tracker.prefill_complete_at == 2.0  # ...but complete was the first output
    assert not tracker.record_prefill_complete()  # first call wins


def test_S3_classify_records_once() -> None:
    tracker = RequestTracker()
    classify_first_output(valid_prefill_output(), tracker)
    assert not tracker.record_prefill_complete()


# --- S4 ---------------------------------------------------------------------------------


async def test_S4_prompt_tokens_details_from_first_output(
    autojump_clock: trio.testing.MockClock,
) -> None:
    completion = await consume_prefill_stream(
        stream_of(
            out(disaggregated_params={"p": 1}, completion_usage=usage(3)),
            out(completion_usage=usage(9)),
        )
    )
    assert handoff_of(completion).result.prompt_tokens_details == PromptTokensDetails(
        cached_tokens=3
    )


async def test_S4_prompt_tokens_details_from_first_later_output_that_has_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    completion = await consume_prefill_stream(
        stream_of(
            out(disaggregated_params={"p": 1}),
            out(token_ids=[1]),
            out(completion_usage=usage(None)),
            out(completion_usage=usage(5)),
            out(completion_usage=usage(9)),
        )
    )
    assert handoff_of(completion).result.prompt_tokens_details == PromptTokensDetails(
        cached_tokens=5
    )


async def test_S4_no_usage_anywhere_gives_no_details(
    autojump_clock: trio.testing.MockClock,
) -> None:
    completion = await consume_prefill_stream(
        stream_of(out(disaggregated_params={"p": 1}), out(token_ids=[1]))
    )
    assert handoff_of(completion).result.prompt_tokens_details is None


# --- S5 ---------------------------------------------------------------------------------


async def test_S5_bootstrap_drain_retains_teardown_guard_until_stream_finishes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ports 1.4.0 ``bootstrap_drain_retains_teardown_guard_until_stream_finishes``."""
    guard = Guard()
    release = trio.Event()
    send, receive = trio.open_memory_channel[Item](math.inf)
    send.send_nowait(out(disaggregated_params=BOOTSTRAP))

    async def rest_of_prefill() -> None:
        with send:
            await release.wait()
            await send.send(out())

    with trio.fail_after(10):
        async with TransferKeeper() as keeper, trio.open_nursery() as nursery:
            nursery.start_soon(rest_of_prefill)
            completion = await consume_prefill_stream(receive, keeper=keeper, guard=guard)
            handoff = handoff_of(completion)
            assert handoff.bootstrap
            assert handoff.drain is not None
            assert guard.held  # held from the moment the handoff is returned
            await trio.sleep(3)
            assert guard.held  # and for as long as the rest of the stream is pending
            assert keeper.in_flight == 1

            release.set()
            await handoff.drain.wait()
            assert guard.released
            assert keeper.in_flight == 0


async def test_S5_bootstrap_handoff_returns_before_the_stream_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    send, receive = trio.open_memory_channel[Item](0)
    with trio.fail_after(10):
        async with TransferKeeper() as keeper, trio.open_nursery() as nursery:
            nursery.start_soon(
                produce,
                send,
                (1, out(disaggregated_params=BOOTSTRAP)),
                (4, out(token_ids=[1])),
            )
            completion = await consume_prefill_stream(receive, keeper=keeper)
            assert trio.current_time() == 1.0
            drain = handoff_of(completion).drain
            assert drain is not None
            assert not drain.done
            await drain.wait()
            assert trio.current_time() == 5.0


@pytest.mark.parametrize("missing", ["bootstrap_host", "bootstrap_port", "bootstrap_room"])
async def test_S5_bootstrap_needs_all_three_keys(
    autojump_clock: trio.testing.MockClock, missing: str
) -> None:
    params = {k: v for k, v in BOOTSTRAP.items() if k != missing}
    assert not is_bootstrap_params(params)
    send, receive = trio.open_memory_channel[Item](0)
    with trio.fail_after(10):
        async with TransferKeeper() as keeper, trio.open_nursery() as nursery:
            nursery.start_soon(
                produce, send, (0, out(disaggregated_params=params)), (3, out(token_ids=[1]))
            )
            completion = await consume_prefill_stream(receive, keeper=keeper)
            assert keeper.started_total == 0  # nothing handed to the keeper
    handoff = handoff_of(completion)
    assert not handoff.bootstrap
    assert handoff.drain is None
    assert trio.current_time() == 3.0  # drained here, before returning (S6)


def test_S5_bootstrap_params_must_be_an_object() -> None:
    assert is_bootstrap_params(BOOTSTRAP)
    assert not is_bootstrap_params(list(BOOTSTRAP))
    assert not is_bootstrap_params("bootstrap_host bootstrap_port bootstrap_room")
    assert not is_bootstrap_params(None)


# --- S6 ---------------------------------------------------------------------------------


async def test_S6_later_output_error_is_propagated_after_prefill_arrival(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ports 1.4.0 ``later_output_error_is_propagated_after_prefill_arrival``."""
    tracker = RequestTracker()
    with pytest.raises(PrefillError, match="prefill stream failed"):
        await consume_prefill_stream(
            stream_of(valid_prefill_output(), error("prefill stream failed")), tracker=tracker
        )
    assert not tracker.record_prefill_complete()  # the first output was recorded


async def test_S6_non_bootstrap_stream_drained_before_returning_with_guard_held(
    autojump_clock: trio.testing.MockClock,
) -> None:
    guard = Guard()
    send, receive = trio.open_memory_channel[Item](0)
    observed: list[bool] = []

    async def rest() -> None:
        with send:
            await send.send(out(disaggregated_params={"kv_transfer_params": {"id": 1}}))
            await trio.sleep(2)
            observed.append(guard.held)
            await send.send(out(token_ids=[1]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rest)
        completion = await consume_prefill_stream(receive, guard=guard)
    assert isinstance(completion, Handoff)
    assert observed == [True]
    assert guard.released
    assert trio.current_time() == 2.0


async def test_S1_consume_prefill_stream_refuses_arguments_of_the_wrong_type() -> None:
    """A list given for the stream, or a name given for the keeper, raised an
    AttributeError from inside (``'list' object has no attribute 'close'``); now a
    TypeError naming the argument, before anything is read."""
    item = valid_prefill_output()
    with pytest.raises(TypeError, match="outputs must be a ReceiveChannel, got list"):
        await consume_prefill_stream([item])  # type: ignore[arg-type]
    wrong: dict[str, Any] = {"keeper": "x", "tracker": "x", "leg": "x"}
    for name, value in wrong.items():
        with pytest.raises(TypeError, match=f"{name} must be a .* or None, got str"):
            await consume_prefill_stream(stream_of(item), **{name: value})


@pytest.mark.parametrize(
    ("garbage", "what"),
    [("a token", "a str"), (None, "a NoneType"), ({"token_ids": [1]}, "a dict"),
     (Annotated(data={"token_ids": [1]}), "an Annotated whose data is a dict")],
    ids=["str", "None", "dict", "Annotated of a dict"])
async def test_S2_T4_an_output_that_is_not_an_engine_output_is_a_prefill_error(
    autojump_clock: trio.testing.MockClock, garbage: Any, what: str
) -> None:
    """A prefill engine that sends something else than an ``Annotated[LLMEngineOutput]``,
    first or later, fails the prefill with a :class:`PrefillError` that says what it sent
    (S2, T4): not an ``AttributeError`` (read as a crash of the drain), and the tracker
    does not record the prefill complete. Inline, and in a bootstrap drain."""
    message = f"prefill engine sent {what}, not an Annotated"
    tracker = RequestTracker()
    with pytest.raises(PrefillError, match=message) as first:
        classify_first_output(garbage, tracker)
    assert type(first.value) is PrefillError and tracker.prefill_complete_at is None
    with pytest.raises(PrefillError, match=message):
        check_prefill_output(garbage)
    with pytest.raises(PrefillError, match=message):
        await consume_prefill_stream(stream_of(garbage))
    with pytest.raises(PrefillError, match=message):
        await consume_prefill_stream(stream_of(valid_prefill_output(), garbage))
    with trio.fail_after(10):
        async with TransferKeeper() as keeper:
            completion = await consume_prefill_stream(
                stream_of(out(disaggregated_params=BOOTSTRAP), garbage), keeper=keeper)
            drain = handoff_of(completion).drain
            assert drain is not None
            with pytest.raises(PrefillError, match=message):
                await drain.wait()
            assert "crashed" not in str(drain.error)


@pytest.mark.parametrize(
    ("later", "message"),
    [
        (error("lost worker"), "error in its output stream: lost worker"),
        (out(finish_reason=FinishReason.error("oom")), "Prefill backend failed: oom"),
        (out(finish_reason=FinishReason.CANCELLED), "cancelled before completing the handoff"),
    ],
    ids=["envelope", "finish-error", "finish-cancelled"],
)
async def test_T4_later_failed_output_fails_inline_drain(
    autojump_clock: trio.testing.MockClock, later: Item, message: str
) -> None:
    with pytest.raises(PrefillError, match=message):
        await consume_prefill_stream(stream_of(valid_prefill_output(), later))


# --- T4 on the bootstrap path (1.4.0 ignored these; 1.6.2 fixed it) ----------------------


@pytest.mark.parametrize(
    ("later", "message"),
    [
        (error("lost worker"), "error in its output stream: lost worker"),
        (out(finish_reason=FinishReason.error("oom")), "Prefill backend failed: oom"),
        (out(finish_reason=FinishReason.CANCELLED), "cancelled before completing the handoff"),
    ],
    ids=["envelope", "finish-error", "finish-cancelled"],
)
async def test_T4_bootstrap_drain_fails_on_later_failed_output(
    autojump_clock: trio.testing.MockClock, later: Item, message: str
) -> None:
    with trio.fail_after(10):
        async with TransferKeeper() as keeper:
            completion = await consume_prefill_stream(
                stream_of(out(disaggregated_params=BOOTSTRAP), out(token_ids=[1]), later),
                keeper=keeper,
            )
            drain = handoff_of(completion).drain
            assert drain is not None
            with pytest.raises(PrefillError, match=message):
                await drain.wait()
            assert drain.failed
            assert keeper.failed_total == 1


@pytest.mark.parametrize(
    "item",
    [
        error("boom"),
        out(finish_reason=FinishReason.error("boom")),
        out(finish_reason=FinishReason.CANCELLED),
        Annotated[LLMEngineOutput](event="error", comment=["boom"]),
    ],
    ids=["envelope", "finish-error", "finish-cancelled", "envelope-comment"],
)
def test_T4_check_prefill_output_rejects_failures(item: Item) -> None:
    with pytest.raises(PrefillError):
        check_prefill_output(item)


@pytest.mark.parametrize(
    "item",
    [
        out(),
        out(token_ids=[1, 2]),
        out(finish_reason=FinishReason.EOS),
        out(finish_reason=FinishReason.STOP),
        out(finish_reason=FinishReason.LENGTH),
        out(finish_reason=FinishReason.CONTENT_FILTER),
        Annotated[LLMEngineOutput](),
        Annotated[LLMEngineOutput](event="delta", data=LLMEngineOutput()),
    ],
    ids=["empty", "tokens", "eos", "stop", "length", "content-filter", "no-data", "event"],
)
def test_T4_check_prefill_output_accepts_non_failures(item: Item) -> None:
    check_prefill_output(item)


async def test_T4_bootstrap_drain_success_with_finish_eos(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        completion = await consume_prefill_stream(
            stream_of(out(disaggregated_params=BOOTSTRAP), out(finish_reason=FinishReason.EOS)),
            keeper=keeper,
        )
        drain = handoff_of(completion).drain
        assert drain is not None
        await drain.wait()
        assert drain.succeeded


# --- S7 ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "finish_reason",
    [
        FinishReason.EOS,
        FinishReason.STOP,
        FinishReason.CANCELLED,
        FinishReason.error("prefill failed"),
        FinishReason.CONTENT_FILTER,
    ],
    ids=str,
)
async def test_S7_terminal_finish_reasons_without_handoff_are_returned_to_caller(
    autojump_clock: trio.testing.MockClock, finish_reason: FinishReason
) -> None:
    """Ports 1.4.0 ``terminal_finish_reasons_without_handoff_are_returned_to_caller``."""
    completion = await consume_prefill_stream(
        stream_of(out(token_ids=[2], finish_reason=finish_reason))
    )
    assert isinstance(completion, Terminal)
    assert completion.output.data is not None
    assert completion.output.data.finish_reason == finish_reason
    assert completion.output.data.token_ids == [2]


async def test_S7_terminal_output_has_disaggregated_params_removed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    first = out(
        token_ids=[2],
        text="Hi",
        finish_reason=FinishReason.STOP,
        disaggregated_params={"ctx_request_id": None},
        index=0,
    )
    completion = await consume_prefill_stream(stream_of(first))
    assert isinstance(completion, Terminal)
    answer = completion.output.data
    assert answer == LLMEngineOutput(
        token_ids=[2], text="Hi", finish_reason=FinishReason.STOP, index=0
    )
    assert first.data is not None
    assert first.data.disaggregated_params == {"ctx_request_id": None}  # input untouched


async def test_S7_length_limited_prefill_still_requires_handoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ports 1.4.0 ``length_limited_prefill_still_requires_handoff``."""
    completion = await consume_prefill_stream(
        stream_of(
            out(finish_reason=FinishReason.LENGTH, disaggregated_params={"ctx_request_id": 42})
        )
    )
    assert handoff_of(completion).result.disaggregated_params == {"ctx_request_id": 42}


async def test_S7_unfinished_prefill_still_requires_handoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ports 1.4.0 ``unfinished_prefill_still_requires_handoff``."""
    completion = await consume_prefill_stream(
        stream_of(out(finish_reason=None, disaggregated_params={"ctx_request_id": 42}))
    )
    assert handoff_of(completion).result.disaggregated_params == {"ctx_request_id": 42}


# --- S8 ---------------------------------------------------------------------------------


async def test_S8_non_terminal_first_output_without_data_is_no_disaggregated_params(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with pytest.raises(NoDisaggregatedParams, match="no data"):
        await consume_prefill_stream(stream_of(Annotated[LLMEngineOutput](id="r-1")))


@pytest.mark.parametrize("finish", [None, FinishReason.LENGTH], ids=str)
async def test_S8_non_terminal_first_output_without_params_is_no_disaggregated_params(
    autojump_clock: trio.testing.MockClock, finish: FinishReason | None
) -> None:
    with pytest.raises(NoDisaggregatedParams, match="missing disaggregated_params"):
        await consume_prefill_stream(stream_of(out(token_ids=[3], finish_reason=finish)))


# --- S9 ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "disaggregated_params",
    [{"ctx_request_id": None}, {"request_type": "context_only"}],
    ids=["null-ctx-request-id", "context-only-without-id"],
)
async def test_S9_non_terminal_prefill_without_usable_ctx_request_id_fails_before_decode(
    autojump_clock: trio.testing.MockClock, disaggregated_params: dict[str, Any]
) -> None:
    """Ports 1.4.0 ``non_terminal_prefill_without_usable_ctx_request_id_fails_before_decode``."""
    with pytest.raises(NoDisaggregatedParams, match="no usable ctx_request_id"):
        await consume_prefill_stream(
            stream_of(out(finish_reason=None, disaggregated_params=disaggregated_params))
        )


async def _refused_on_first_output(params: dict[str, Any]) -> None:
    """The refusal comes with the first output: the rest of the prefill is not awaited and
    the stream is closed, so no decode request is ever built from these params."""
    send, receive = trio.open_memory_channel[Item](0)
    producer_saw_close: list[bool] = []

    async def prefill_worker() -> None:
        with send:
            await send.send(out(token_ids=[5], disaggregated_params=params))
            await trio.sleep(100)
            try:
                await send.send(out(token_ids=[6]))
            except trio.BrokenResourceError:
                producer_saw_close.append(True)

    with trio.fail_after(200):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prefill_worker)
            with pytest.raises(NoDisaggregatedParams, match="no usable ctx_request_id"):
                await consume_prefill_stream(receive)
            assert trio.current_time() == 0.0  # refused at once, not after the stream
    assert producer_saw_close == [True]


async def test_S9_null_ctx_request_id_refused(autojump_clock: trio.testing.MockClock) -> None:
    await _refused_on_first_output({"ctx_request_id": None, "request_type": "context_only"})


async def test_S9_context_only_without_ctx_request_id_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    await _refused_on_first_output({"request_type": "context_only", "opaque_state": "abc"})


@pytest.mark.parametrize(
    "params",
    [
        {"request_type": "context_only", "ctx_request_id": 42},
        {"request_type": "context_only", "ctx_request_id": 0},
        {"request_type": "generation_only"},
        {"kv_transfer_params": {"remote_engine_id": "e"}},
        ["not", "an", "object"],
    ],
    ids=["context-only-with-id", "id-zero", "other-type", "vllm", "non-object"],
)
def test_S9_usable_handoffs_are_not_refused(params: Any) -> None:
    completion = classify_first_output(out(disaggregated_params=params))
    assert handoff_of(completion).result.disaggregated_params == params


@pytest.mark.parametrize("finish", [FinishReason.EOS, FinishReason.STOP], ids=str)
def test_S9_terminal_context_with_null_ctx_request_id_is_not_refused(
    finish: FinishReason,
) -> None:
    completion = classify_first_output(
        out(finish_reason=finish, disaggregated_params={"ctx_request_id": None})
    )
    assert isinstance(completion, Terminal)


# --- S10 --------------------------------------------------------------------------------


async def test_S10_handoff_carries_params_details_and_worker_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    link = TraceLink(worker_id="prefill-3", request_id="r-1", trace_id="t")
    params = {"kv_transfer_params": {"remote_block_ids": [4, 5], "remote_host": "h"}}
    completion = await consume_prefill_stream(
        stream_of(
            out(
                token_ids=[11],
                disaggregated_params=params,
                completion_usage=usage(7),
                worker_trace_link=link,
            )
        )
    )
    handoff = handoff_of(completion)
    assert handoff.result.disaggregated_params == params
    assert handoff.result.prompt_tokens_details == PromptTokensDetails(cached_tokens=7)
    assert handoff.worker_link == link
    assert not handoff.bootstrap
    assert handoff.drain is None


async def test_S1_S10_with_a_first_output_the_caller_already_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A caller may read the first output itself (to bound that wait by a deadline of
    its own without closing the stream) and hand it over with the rest of the stream."""
    send, receive = trio.open_memory_channel[Annotated[LLMEngineOutput]](math.inf)
    first = Annotated.from_data(LLMEngineOutput(
        finish_reason=FinishReason.LENGTH, disaggregated_params={"remote_engine_id": "p"}))
    send.send_nowait(Annotated.from_data(LLMEngineOutput(completion_usage=CompletionUsage(
        prompt_tokens=4, prompt_tokens_details=PromptTokensDetails(cached_tokens=2)))))
    send.close()
    completion = await consume_prefill_stream(receive, first=first)
    assert isinstance(completion, Handoff)
    assert completion.result.disaggregated_params == {"remote_engine_id": "p"}
    assert completion.result.prompt_tokens_details == PromptTokensDetails(cached_tokens=2)

    send, receive = trio.open_memory_channel[Annotated[LLMEngineOutput]](math.inf)
    send.close()
    with pytest.raises(PrefillError, match="no output"):  # S1 still applies
        await consume_prefill_stream(receive, first=None)



# --- the engine's leg: a stream that ends is not a success if its engine failed -------------


async def leg_engine(
    behaviour: str,
    request: object,
    send: trio.MemorySendChannel[Item],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A prefill engine as docs/howto-engine.md runs it (``keeper.spawn_leg``): it
    refuses, or sends its handoff and then raises (a bug: the contract says one error
    item), or answers properly."""
    with send:
        if behaviour == "refuses":
            raise WorkerError("prefill worker is full", status=503)
        task_status.started()
        params = BOOTSTRAP if "bootstrap" in behaviour else {"kv": 1}
        await send.send(out(disaggregated_params=params))
        await trio.sleep(1)
        if "crashes" in behaviour:
            raise ValueError("engine bug")
        await send.send(out(finish_reason=FinishReason.LENGTH))


@pytest.mark.parametrize("behaviour", ["refuses", "crashes", "bootstrap crashes"])
async def test_T3_T4_a_prefill_engine_leg_that_fails_is_a_prefill_error_not_a_stream_end(
    autojump_clock: trio.testing.MockClock, behaviour: str
) -> None:
    """Given the engine's leg, ``consume_prefill_stream`` reads the stream's end as the
    engine's end: an engine that refused (S1) or raised after its handoff (T3, T4) fails
    the prefill with its error, where the stream alone ended cleanly and a crash after
    the handoff read as a success (G5)."""
    async with TransferKeeper() as keeper:
        send, receive = trio.open_memory_channel[Item](8)
        leg = keeper.spawn_leg(leg_engine, behaviour, None, send, name="r1",
                               kind="prefill engine")
        reader = keeper.start(
            lambda: consume_prefill_stream(receive, keeper=keeper, name="r1", leg=leg),
            name="r1", kind="prefill stream")
        if behaviour == "refuses":
            with pytest.raises(PrefillError, match="prefill worker is full") as caught:
                await reader.result()
            assert isinstance(caught.value.__cause__, WorkerError)
            return
        if behaviour == "crashes":  # read to its end before the handoff returns (S6)
            with pytest.raises(PrefillError, match="crashed: ValueError: engine bug"):
                await reader.result()
            return
        completion = await reader.result()  # a bootstrap handoff returns at once (S5)
        assert isinstance(completion, Handoff) and completion.drain is not None
        with pytest.raises(PrefillError, match="crashed: ValueError: engine bug"):
            await completion.drain.result()


async def test_T4_a_prefill_engine_leg_that_ends_well_is_a_handoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with TransferKeeper() as keeper:
        send, receive = trio.open_memory_channel[Item](8)
        leg = keeper.spawn_leg(leg_engine, "bootstrap", None, send, name="r1")
        completion = await consume_prefill_stream(receive, keeper=keeper, name="r1", leg=leg)
        assert isinstance(completion, Handoff) and completion.drain is not None
        await completion.drain.result()
        assert leg.done and leg.crash is None


@pytest.mark.parametrize("params", [{"kv": "k1"}, BOOTSTRAP], ids=["sequential", "bootstrap"])
async def test_T1_S6_a_prefill_engine_leg_that_forgets_to_close_its_channel_still_ends(
    autojump_clock: trio.testing.MockClock, params: dict[str, Any]
) -> None:
    """An engine written against the docs but for the ``with send_channel:`` returns
    with its channel open. Its reader, given the leg, waited for ever for the stream's
    end (a sequential handoff never returned; a bootstrap drain held the keeper); the
    keeper closes the channels it gave the leg once the leg is over, so the stream ends
    with it and the prefill succeeds."""

    async def forgetful(send: trio.MemorySendChannel[Item], *,
                        task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        await trio.sleep(0.01)
        await send.send(out(disaggregated_params=params))  # and no close

    with trio.fail_after(60):
        async with TransferKeeper() as keeper:
            send, receive = trio.open_memory_channel[Item](8)
            leg = keeper.spawn_leg(forgetful, send, name="r1", kind="prefill engine")
            completion = await consume_prefill_stream(receive, keeper=keeper, name="r1",
                                                      leg=leg)
            assert isinstance(completion, Handoff)
            if completion.drain is not None:
                await completion.drain.result()
            await keeper.wait_idle()
            assert leg.done and leg.crash is None and keeper.failed_total == 0
