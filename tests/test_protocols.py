"""The wire form of the protocol types (docs/semantics.md "Vocabulary").

``to_wire`` / ``from_wire`` (and ``dumps`` / ``loads`` through orjson) must round-trip every
protocol type, read and write the ``FinishReason`` wire forms Dynamo uses, and turn bad input
into a :class:`~trio_disagg.WireFormatError` whose message says what and where.
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson
import pytest

from trio_disagg import (
    Annotated,
    BootstrapInfo,
    CompletionUsage,
    FinishKind,
    FinishReason,
    LLMEngineOutput,
    PrefillResult,
    PreprocessedRequest,
    PromptTokensDetails,
    RoutingHints,
    TraceLink,
    TrioDisaggError,
    WireFormatError,
    from_wire,
    to_wire,
)
from trio_disagg._copy import routed_copy
from trio_disagg._protocols import dumps, loads

FINISH_WIRE_FORMS: list[tuple[FinishReason, Any]] = [
    (FinishReason.EOS, "eos"),
    (FinishReason.STOP, "stop"),
    (FinishReason.LENGTH, "length"),
    (FinishReason.CANCELLED, "cancelled"),
    (FinishReason.CONTENT_FILTER, "content_filter"),
    (FinishReason.error("worker exploded"), {"error": "worker exploded"}),
]


def full_output() -> LLMEngineOutput:
    """An output with every field set to a non-default value."""
    return LLMEngineOutput(
        token_ids=[7, 8, 9],
        text="hello",
        finish_reason=FinishReason.error("kv cache full"),
        disaggregated_params={"kv_transfer_params": {"remote_block_ids": [1, 2], "x": None}},
        completion_usage=CompletionUsage(
            prompt_tokens=12,
            completion_tokens=3,
            total_tokens=15,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=8, audio_tokens=0),
        ),
        worker_trace_link=TraceLink(worker_id="prefill-0", request_id="r-1", trace_id="t-1"),
        index=1,
    )


@pytest.mark.parametrize(("reason", "wire"), FINISH_WIRE_FORMS, ids=str)
def test_wire_finish_reason_forms_round_trip(reason: FinishReason, wire: Any) -> None:
    assert to_wire(reason) == wire
    assert from_wire(wire, FinishReason) == reason


def test_wire_finish_reason_abort_is_read_as_cancelled_and_written_as_cancelled() -> None:
    reason = from_wire("abort", FinishReason)
    assert reason == FinishReason.CANCELLED
    assert reason.kind is FinishKind.CANCELLED
    assert to_wire(reason) == "cancelled"
    output = from_wire({"finish_reason": "abort"}, LLMEngineOutput)
    assert output.finish_reason == FinishReason.CANCELLED


@pytest.mark.parametrize(("reason", "wire"), FINISH_WIRE_FORMS, ids=str)
def test_wire_finish_reason_inside_an_output_uses_the_same_wire_form(
    reason: FinishReason, wire: Any
) -> None:
    output = LLMEngineOutput(token_ids=[1], finish_reason=reason)
    assert to_wire(output) == {"token_ids": [1], "finish_reason": wire}
    assert from_wire({"token_ids": [1], "finish_reason": wire}, LLMEngineOutput) == output


def test_wire_only_error_and_cancelled_are_failures() -> None:
    failures = {str(reason) for reason, _ in FINISH_WIRE_FORMS if reason.is_failure}
    assert failures == {"cancelled", "error: worker exploded"}


ROUND_TRIP_VALUES: list[tuple[Any, Any]] = [
    (PromptTokensDetails(cached_tokens=3, audio_tokens=1), PromptTokensDetails),
    (
        CompletionUsage(
            prompt_tokens=1,
            completion_tokens=2,
            total_tokens=3,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=1),
        ),
        CompletionUsage,
    ),
    (TraceLink(worker_id="w", request_id="r", trace_id="t"), TraceLink),
    (full_output(), LLMEngineOutput),
    (LLMEngineOutput(), LLMEngineOutput),
    (LLMEngineOutput.length(), LLMEngineOutput),
    (Annotated.from_data(full_output()), Annotated[LLMEngineOutput]),
    (
        Annotated(data=LLMEngineOutput(token_ids=[5]), id="r-1", event="delta", comment=["c"]),
        Annotated[LLMEngineOutput],
    ),
    (Annotated[LLMEngineOutput].from_error("decode failed"), Annotated[LLMEngineOutput]),
    (
        PrefillResult(
            disaggregated_params={"bootstrap_room": 5, "nested": [1, {"a": None}]},
            prompt_tokens_details=PromptTokensDetails(cached_tokens=4),
        ),
        PrefillResult,
    ),
    (PrefillResult(disaggregated_params=["opaque", 1]), PrefillResult),
    (BootstrapInfo(host="10.0.0.1", port=8998, room=2**63 - 1), BootstrapInfo),
    (RoutingHints(session_id="s", prefill_worker="p", decode_worker="d"), RoutingHints),
    (
        PreprocessedRequest(
            request_id="r-1",
            model="m",
            body={"messages": [{"role": "user", "content": "hi"}], "stream": True},
            max_tokens=16,
            stream=True,
            routing=RoutingHints(session_id="s"),
            prefill_result=PrefillResult(disaggregated_params={"ctx_request_id": 42}),
            bootstrap_info=BootstrapInfo(host="h", port=1, room=0),
        ),
        PreprocessedRequest,
    ),
    (PreprocessedRequest(request_id="r-2", model="m"), PreprocessedRequest),
]


@pytest.mark.parametrize(
    ("value", "cls"), ROUND_TRIP_VALUES, ids=lambda v: type(v).__name__
)
def test_wire_every_protocol_type_round_trips(value: Any, cls: Any) -> None:
    wire = to_wire(value)
    assert from_wire(wire, cls) == value
    assert loads(dumps(value), cls) == value


def test_wire_to_wire_omits_defaults() -> None:
    assert to_wire(LLMEngineOutput()) == {}
    assert to_wire(LLMEngineOutput.length()) == {"finish_reason": "length"}
    assert to_wire(PreprocessedRequest(request_id="r", model="m")) == {
        "request_id": "r",
        "model": "m",
    }


def test_wire_disaggregated_params_are_opaque_json() -> None:
    params = {"kv_transfer_params": {"do_remote_decode": False, "blocks": [[1, 2], []]}}
    wire = {"disaggregated_params": params}
    output = from_wire(wire, LLMEngineOutput)
    assert output.disaggregated_params == params
    assert to_wire(output) == wire


def test_wire_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    output = from_wire({"token_ids": [1], "logprobs": [0.5]}, LLMEngineOutput)
    assert output == LLMEngineOutput(token_ids=[1])


def test_wire_error_envelope_form() -> None:
    item = from_wire({"event": "error", "error": "boom"}, Annotated[LLMEngineOutput])
    assert item.is_error
    assert item.error_message() == "boom"
    older = from_wire({"event": "error", "comment": ["a", "b"]}, Annotated[LLMEngineOutput])
    assert older.error_message() == "a; b"
    assert Annotated[LLMEngineOutput](event="error").error_message() == "unknown error"
    assert Annotated.from_data(LLMEngineOutput()).error_message() is None


@pytest.mark.parametrize(
    ("value", "cls", "expected"),
    [
        ({"finish_reason": "bogus"}, LLMEngineOutput, "unknown finish_reason 'bogus'"),
        ({"finish_reason": "bogus"}, LLMEngineOutput, "$.finish_reason"),
        ({"finish_reason": {"error": 3}}, LLMEngineOutput, "$.finish_reason"),
        ({"finish_reason": {"error": "x", "y": 1}}, LLMEngineOutput, "$.finish_reason"),
        ({"finish_reason": 7}, LLMEngineOutput, "finish_reason must be a string"),
        ({"token_ids": "abc"}, LLMEngineOutput, "expected a list, got str 'abc' @ $.token_ids"),
        ({"token_ids": [1, "2"]}, LLMEngineOutput, "expected an integer, got str '2'"),
        ({"token_ids": [1, "2"]}, LLMEngineOutput, "$.token_ids[1]"),
        ({"token_ids": [1.0]}, LLMEngineOutput, "expected an integer, got float"),
        (orjson.loads(b'{"index": 99999999999999999999999}'), LLMEngineOutput,
         "expected an integer of at most 64 bits, got one of about 1e+23"),
        ({"index": True}, LLMEngineOutput, "expected an integer, got bool"),
        ({"text": 5}, LLMEngineOutput, "expected a string, got int 5 @ $.text"),
        ({"worker_trace_link": {}}, LLMEngineOutput, "$.worker_trace_link.worker_id"),
        ({"worker_trace_link": {}}, LLMEngineOutput, "required field missing"),
        (
            {"completion_usage": {"prompt_tokens": "12"}},
            LLMEngineOutput,
            "$.completion_usage.prompt_tokens",
        ),
        ([1, 2], LLMEngineOutput, "expected an object, got list"),
        ({"data": {"token_ids": "x"}}, Annotated[LLMEngineOutput], "$.data.token_ids"),
        ({"event": 3}, Annotated[LLMEngineOutput], "$.event"),
        ("bogus", FinishReason, "unknown finish_reason 'bogus'"),
        ({"host": "h", "port": "1", "room": 0}, BootstrapInfo, "$.port"),
        ({"model": "m"}, PreprocessedRequest, "$.request_id"),
        ({"request_id": "r", "model": "m", "max_tokens": 0}, PreprocessedRequest,
         "max_tokens must be None or an integer >= 1, got 0"),
    ],
)
def test_wire_invalid_input_raises_readable_wire_format_error(
    value: Any, cls: Any, expected: str
) -> None:
    with pytest.raises(WireFormatError) as info:
        from_wire(value, cls)
    message = str(info.value)
    assert expected in message
    assert message.startswith(f"invalid {cls.__name__}: ")
    assert info.value.__cause__ is None  # the message stands on its own


def test_wire_malformed_json_raises_wire_format_error() -> None:
    with pytest.raises(WireFormatError, match=r"^malformed JSON: "):
        loads(b'{"token_ids": [1,', LLMEngineOutput)
    with pytest.raises(WireFormatError, match=r"invalid LLMEngineOutput: .*\$\.token_ids"):
        loads(b'{"token_ids": "x"}', LLMEngineOutput)


def test_wire_format_error_is_a_value_error_and_a_trio_disagg_error() -> None:
    with pytest.raises(ValueError):
        from_wire({"token_ids": "x"}, LLMEngineOutput)
    with pytest.raises(TrioDisaggError):
        from_wire({"token_ids": "x"}, LLMEngineOutput)


@pytest.mark.parametrize("max_tokens", [0, -5, 2.0, True])
def test_a_request_with_a_budget_of_no_tokens_is_a_value_error(max_tokens: Any) -> None:
    """A library caller's ``max_tokens=0`` (or -5) used to run, and end in one token with
    finish ``length``: a success nobody asked for."""
    with pytest.raises(ValueError, match="max_tokens"):
        PreprocessedRequest(request_id="r", model="m", max_tokens=max_tokens)
    request = PreprocessedRequest(request_id="r", model="m", max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens"):
        attrs.evolve(request, max_tokens=max_tokens)
    assert PreprocessedRequest(request_id="r", model="m").max_tokens is None


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"request_id": 5}, TypeError, "request_id must be a string, got int 5"),
        ({"request_id": ""}, ValueError, "request_id must not be empty"),
        ({"model": 3}, TypeError, "model must be a string, got int 3"),
        ({"body": "x"}, TypeError, "body must be a dict, got str 'x'"),
        ({"stream": "yes"}, TypeError, "stream must be a bool, got str 'yes'"),
    ],
)
def test_a_request_with_fields_of_the_wrong_type_is_refused(
    fields: dict[str, Any], error: type[Exception], match: str
) -> None:
    """A library caller's ``request_id=5`` used to be accepted: a SEQUENTIAL mock decode
    then refused the handoff after accepting it, leaving the prefill's KV staged until its
    lease ran out; ``body="x"`` was answered as a success without a prompt."""
    good: dict[str, Any] = {"request_id": "r", "model": "m", "body": {}, "stream": False}
    with pytest.raises(error, match=match):
        PreprocessedRequest(**(good | fields))
    with pytest.raises(error, match=match):
        attrs.evolve(PreprocessedRequest(**good), **fields)
    if error is TypeError:  # over the wire it is a WireFormatError naming the field
        with pytest.raises(WireFormatError, match=next(iter(fields))):
            from_wire(good | fields, PreprocessedRequest)


def test_routed_copy_is_evolve_with_the_routers_additions() -> None:
    # The router copies requests with routed_copy() (cheaper than attrs.evolve): no field
    # may be dropped. A field added to PreprocessedRequest or RoutingHints fails here until
    # routed_copy() copies it too.
    assert [field.name for field in attrs.fields(PreprocessedRequest)] == [
        "request_id", "model", "body", "max_tokens", "stream", "routing",
        "prefill_result", "bootstrap_info"]
    assert [field.name for field in attrs.fields(RoutingHints)] == [
        "session_id", "prefill_worker", "decode_worker"]
    request = PreprocessedRequest(
        request_id="r-1", model="m", body={"prompt": "hi"}, max_tokens=3, stream=True,
        routing=RoutingHints(session_id="s", prefill_worker="p0", decode_worker="d0"),
        prefill_result=PrefillResult(disaggregated_params={"a": 1}),
        bootstrap_info=BootstrapInfo(host="h", port=1, room=2),
    )
    result = PrefillResult(disaggregated_params={"b": 2})
    info = BootstrapInfo(host="h2", port=3, room=4)
    copy = routed_copy(request, "p", "d", result, info)
    assert copy == attrs.evolve(
        request, routing=attrs.evolve(request.routing, prefill_worker="p", decode_worker="d"),
        prefill_result=result, bootstrap_info=info)
    assert copy is not request and copy.routing is not request.routing
    for field in attrs.fields(PreprocessedRequest):
        if field.name not in ("routing", "prefill_result", "bootstrap_info"):
            assert getattr(copy, field.name) is getattr(request, field.name), field.name
