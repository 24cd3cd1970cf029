"""B7: a prefill answer is validated as a handoff at the adapter's edge, before anything
is built from it.

Each adapter's prefill engine runs against a fake worker (an httpx mock transport): a
non-terminal answer whose handoff is invalid becomes ONE error item carrying an
:class:`~trio_disagg.InvalidPrefillHandoff` that names the offending field; the router's
classification raises that very exception, and no decode or generation request is sent.
A valid handoff goes to the decode as the worker sent it, unknown fields included, and a
terminal answer (S7) is not a handoff at all. The clock is trio's; every wait is bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import orjson
import pytest
import trio
from e2e_support import MODEL
from protocol_support import Item, completion

from trio_disagg import (
    BootstrapInfo,
    DisaggRouter,
    FinishKind,
    InvalidPrefillHandoff,
    NoDisaggregatedParams,
    RequestContext,
    Terminal,
    TransferKeeper,
    TrioDisaggError,
    WorkerError,
    WorkerPool,
    classify_first_output,
)
from trio_disagg.engines import (
    PROMPT_TOKEN_IDS_KEY,
    HttpEngine,
    SglangEngine,
    TrtllmEngine,
    VllmEngine,
)

PREFILL_URL = "http://prefill:8000"
DECODE_URL = "http://decode:8000"
MISSING = object()  # a field left out of the worker's answer

#: What a decode or generation worker answers, should the router ever send it a request.
DECODE_EVENTS = (
    b'data: {"id": "d", "object": "text_completion", "model": "m", "choices": '
    b'[{"index": 0, "text": " y", "finish_reason": "length"}]}\n\n'
    b"data: [DONE]\n\n"
)


def vllm_answer(finish: str = "length", **kv: Any) -> dict[str, Any]:
    """A vLLM prefill answer (as the mock vLLM worker sends it); ``kv`` changes its
    ``kv_transfer_params`` (``MISSING`` removes a field)."""
    params: dict[str, Any] = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 5],
        "remote_engine_id": "prefill@10.0.0.5:8000", "remote_request_id": "r-1",
        "remote_host": "10.0.0.5", "remote_port": 8000, "tp_size": 1,
    }
    params.update(kv)
    return {
        "id": "cmpl-p", "object": "text_completion", "model": MODEL,
        "choices": [{"index": 0, "text": " x", "finish_reason": finish}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "kv_transfer_params": {k: v for k, v in params.items() if v is not MISSING},
    }


def trtllm_answer(finish: str = "length", *, choices: int = 1, top: dict[str, Any] | None = None,
                  **params: Any) -> dict[str, Any]:
    """A TensorRT-LLM context answer (as the mock context server sends it), with
    ``choices`` copies of its choice; ``params`` change its ``disaggregated_params``
    (``MISSING`` removes a field), ``top`` its top-level fields."""
    handoff: dict[str, Any] = {
        "request_type": "context_only", "first_gen_tokens": [7], "ctx_request_id": 11,
        "encoded_opaque_state": "c3RhdGU=", "draft_tokens": None, "disagg_request_id": 42,
    }
    handoff.update(params)
    choice = {"index": 0, "text": " x", "finish_reason": finish,
              "disaggregated_params": {k: v for k, v in handoff.items() if v is not MISSING}}
    answer = {
        "id": "cmpl-c", "object": "text_completion", "model": MODEL,
        "choices": [dict(choice, index=i) for i in range(choices)],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "prompt_token_ids": [1, 2, 3],
    }
    answer.update(top or {})
    return answer


@attrs.define
class FakeWorkers:
    """The prefill worker answers ``answer``; every request is recorded by host."""

    answer: dict[str, Any]
    seen: dict[str, list[dict[str, Any]]] = attrs.Factory(
        lambda: {"prefill": [], "decode": []})

    async def handle(self, request: httpx.Request) -> httpx.Response:
        await trio.lowlevel.checkpoint()
        self.seen[request.url.host].append(orjson.loads(request.content))
        if request.url.host == "prefill":
            return httpx.Response(200, json=self.answer)
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=DECODE_EVENTS)


@asynccontextmanager
async def fake_client(workers: FakeWorkers) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(workers.handle)) as client:
        yield client


async def prefill_items(engine: HttpEngine, rid: str = "r") -> list[Item]:
    """Everything ``engine``'s prefill leg of a request sends."""
    send, receive = trio.open_memory_channel[Item](8)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.generate, completion(rid), RequestContext(rid), send)
            with receive:
                items = [item async for item in receive]
    return items


def assert_refused(items: list[Item], field: str, bad: str) -> InvalidPrefillHandoff:
    """ONE error item carrying an InvalidPrefillHandoff naming ``field`` and the bad
    value; the router's classification raises that very exception."""
    (item,) = items
    assert item.is_error
    error = item.exception
    assert isinstance(error, InvalidPrefillHandoff)
    assert isinstance(error, NoDisaggregatedParams)  # S8's family: no decode for it
    assert error.field == field
    message = str(error)
    assert message == item.error_message()
    assert message.startswith(f"prefill worker {PREFILL_URL} ")
    assert f": {field} " in message and bad in message
    with pytest.raises(InvalidPrefillHandoff) as classified:
        classify_first_output(item)
    assert classified.value is error
    return error


@asynccontextmanager
async def fake_router(engines: Callable[[httpx.AsyncClient], tuple[Any, Any]],
                      workers: FakeWorkers) -> AsyncIterator[DisaggRouter]:
    async with fake_client(workers) as client, TransferKeeper(drain_window=5.0) as keeper:
        prefill, decode = engines(client)
        yield DisaggRouter(WorkerPool([prefill]), WorkerPool([decode]), keeper)


def vllm_pair(client: httpx.AsyncClient) -> tuple[VllmEngine, VllmEngine]:
    return (VllmEngine(PREFILL_URL, "prefill", client=client),
            VllmEngine(DECODE_URL, "decode", client=client))


def trtllm_pair(client: httpx.AsyncClient) -> tuple[TrtllmEngine, TrtllmEngine]:
    return (TrtllmEngine(PREFILL_URL, "prefill", client=client),
            TrtllmEngine(DECODE_URL, "decode", client=client))


async def routed_refusal(engines: Callable[[httpx.AsyncClient], tuple[Any, Any]],
                         workers: FakeWorkers) -> InvalidPrefillHandoff:
    """Route one request: the router raises the adapter's InvalidPrefillHandoff, and the
    decode (generation) worker never gets a request."""
    error: TrioDisaggError | None = None
    async with fake_router(engines, workers) as router:
        with trio.fail_after(5):
            try:
                async with trio.open_nursery() as nursery:
                    await router.stream(nursery, completion("bad"), RequestContext("bad"))
            except* TrioDisaggError as group:
                (error,) = group.exceptions  # type: ignore[assignment]
            await router.wait_idle()
    assert isinstance(error, InvalidPrefillHandoff)
    assert len(workers.seen["prefill"]) == 1
    assert workers.seen["decode"] == []  # B7: no decode request built from it
    return error


# --- vLLM: kv_transfer_params ------------------------------------------------------------


VLLM_CASES = [
    pytest.param({"remote_block_ids": MISSING}, "kv_transfer_params.remote_block_ids",
                 "is missing", id="remote_block_ids-missing"),
    pytest.param({"remote_port": "x"}, "kv_transfer_params.remote_port", "'x'",
                 id="remote_port-x"),
    pytest.param({"remote_port": 8000.0}, "kv_transfer_params.remote_port", "8000.0",
                 id="remote_port-float"),
    # once passed on: a decode was sent, its pull failed, and the client's 502 blamed the
    # decode worker ("KV transfer failed"), not the prefill that answered the bad port
    pytest.param({"remote_port": -1}, "kv_transfer_params.remote_port",
                 "must be a port in 1-65535, got int -1", id="remote_port-negative"),
    pytest.param({"remote_port": 65536}, "kv_transfer_params.remote_port",
                 "got int 65536", id="remote_port-too-large"),
    pytest.param({"remote_block_ids": [1, "2"]}, "kv_transfer_params.remote_block_ids[1]",
                 "'2'", id="remote_block_ids-str-item"),
    pytest.param({"do_remote_prefill": "true"}, "kv_transfer_params.do_remote_prefill",
                 "'true'", id="do_remote_prefill-str"),
    pytest.param({"remote_engine_id": None}, "kv_transfer_params.remote_engine_id", "null",
                 id="remote_engine_id-null"),
    pytest.param({"remote_host": MISSING}, "kv_transfer_params.remote_host", "is missing",
                 id="remote_host-missing"),
    pytest.param({"tp_size": True}, "kv_transfer_params.tp_size", "True", id="tp_size-bool"),
    pytest.param({"remote_request_id": 5}, "kv_transfer_params.remote_request_id", "5",
                 id="remote_request_id-int"),
    pytest.param({"remote_block_ids": []}, "kv_transfer_params.remote_block_ids",
                 "must be a non-empty list, got list []", id="remote_block_ids-empty"),
    pytest.param({"remote_block_ids": [-1]}, "kv_transfer_params.remote_block_ids[0]",
                 "must be a non-negative integer, got int -1", id="remote_block_ids-negative"),
    pytest.param({"remote_block_ids": [4, -5]}, "kv_transfer_params.remote_block_ids[1]",
                 "got int -5", id="remote_block_ids-negative-item"),
    # the wrong direction: the prefill asking to be decoded remotely (the decode worker
    # would then act as a prefill and strand the KV staged here)
    pytest.param({"do_remote_decode": True}, "kv_transfer_params.do_remote_decode",
                 "must be false, got bool True", id="do_remote_decode-true"),
    pytest.param({"do_remote_decode": None}, "kv_transfer_params.do_remote_decode",
                 "null", id="do_remote_decode-null"),
    pytest.param({"do_remote_prefill": False}, "kv_transfer_params.do_remote_prefill",
                 "must be true, got bool False", id="do_remote_prefill-false"),
    pytest.param({"do_remote_prefill": MISSING}, "kv_transfer_params.do_remote_prefill",
                 "is missing", id="do_remote_prefill-missing"),
    pytest.param({"do_remote_prefill": False, "do_remote_decode": True},
                 "kv_transfer_params.do_remote_prefill", "got bool False",
                 id="direction-reversed"),
    # one list per KV cache group (vLLM's hybrid KV cache manager): each group's ids as
    # checked as the flat list's, and one block at least in all of them
    pytest.param({"remote_block_ids": [[4, 5], [-1]]},
                 "kv_transfer_params.remote_block_ids[1][0]",
                 "must be a non-negative integer, got int -1", id="groups-negative"),
    pytest.param({"remote_block_ids": [[4], ["5"]]},
                 "kv_transfer_params.remote_block_ids[1][0]", "'5'", id="groups-str"),
    pytest.param({"remote_block_ids": [[], []]}, "kv_transfer_params.remote_block_ids",
                 "must be a list with a block, got list [[], []]", id="groups-all-empty"),
    pytest.param({"remote_block_ids": [[4], 5]}, "kv_transfer_params.remote_block_ids[0]",
                 "must be an integer, got list [4]", id="groups-mixed"),
]

#: A prefill answer's ``kv_transfer_params`` from vLLM's NixlConnector with the hybrid KV
#: cache manager (vllm-project/vllm, vllm/distributed/kv_transfer/kv_connector/v1/nixl/
#: pull_scheduler.py, ``request_finished``): ``remote_block_ids`` one list per KV cache
#: group (its ``BlockIds``, a tuple of lists), and the fields it added.
HMA_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True, "do_remote_decode": False,
    "remote_block_ids": [[4, 5, 6], [2]], "remote_engine_id": "c0a8e3f1-engine",
    "remote_request_id": "cmpl-r-0-a1b2c3d4", "remote_host": "10.0.0.5",
    "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
    "remote_num_tokens": 45, "remote_blocks_expiry_time": None, "transfer_mode": "pull",
}


@pytest.mark.parametrize(("kv", "field", "bad"), VLLM_CASES)
async def test_B7_vllm_invalid_kv_transfer_params_is_one_error_item(
        kv: dict[str, Any], field: str, bad: str) -> None:
    async with fake_client(FakeWorkers(vllm_answer(**kv))) as client:
        items = await prefill_items(VllmEngine(PREFILL_URL, "prefill", client=client))
    assert_refused(items, field, bad)


@pytest.mark.parametrize("choices", [2, 3])
async def test_B7_vllm_answer_with_more_than_one_choice_is_one_error_item(choices: int) -> None:
    """As for TensorRT-LLM: one prefill, one KV; which choice would the decode continue?"""
    answer = vllm_answer()
    answer["choices"] = [dict(answer["choices"][0], index=i) for i in range(choices)]
    async with fake_client(FakeWorkers(answer)) as client:
        items = await prefill_items(VllmEngine(PREFILL_URL, "prefill", client=client))
    error = assert_refused(items, "choices", f"must hold exactly one choice, got {choices}")
    assert str(error) == (f"prefill worker {PREFILL_URL} sent an invalid handoff: choices "
                          f"must hold exactly one choice, got {choices}")


@pytest.mark.parametrize("answer", [
    pytest.param({**vllm_answer(), "kv_transfer_params": None}, id="null"),
    pytest.param({**vllm_answer(), "kv_transfer_params": [1]}, id="list"),
    pytest.param({k: v for k, v in vllm_answer().items() if k != "kv_transfer_params"},
                 id="missing"),
])
async def test_B7_S8_vllm_non_terminal_answer_without_an_object_to_hand_off(
        answer: dict[str, Any]) -> None:
    async with fake_client(FakeWorkers(answer)) as client:
        items = await prefill_items(VllmEngine(PREFILL_URL, "prefill", client=client))
    assert_refused(items, "kv_transfer_params", "")


@pytest.mark.parametrize(("kv", "field", "bad"), [
    *VLLM_CASES[:2],
    *(case for case in VLLM_CASES if case.id in ("remote_block_ids-empty",
                                                 "do_remote_decode-true")),
])
async def test_B7_vllm_router_sends_no_decode_request_for_an_invalid_handoff(
        kv: dict[str, Any], field: str, bad: str) -> None:
    error = await routed_refusal(vllm_pair, FakeWorkers(vllm_answer(**kv)))
    assert error.field == field and bad in str(error)


async def test_B7_vllm_router_sends_no_decode_request_for_two_choices() -> None:
    answer = vllm_answer()
    answer["choices"] = [dict(answer["choices"][0], index=i) for i in range(2)]
    error = await routed_refusal(vllm_pair, FakeWorkers(answer))
    assert error.field == "choices" and "got 2" in str(error)


async def test_B7_vllm_valid_handoff_goes_to_the_decode_as_sent() -> None:
    """Unknown fields pass, and the decode gets the worker's object verbatim; a null
    ``remote_request_id`` would not pass, but leaving it (and ``tp_size`` and
    ``do_remote_decode``) out does; block 0 is a block."""
    answer = vllm_answer(remote_request_id=MISSING, tp_size=MISSING, do_remote_decode=MISSING,
                         x_future={"nested": [1, "a"]}, remote_block_ids=[0])
    workers = FakeWorkers(answer)
    async with fake_router(vllm_pair, workers) as router:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                stream = await router.stream(nursery, completion("ok"), RequestContext("ok"))
                with stream.outputs:
                    items = [item async for item in stream.outputs]
    assert not any(item.is_error for item in items)
    (decode,) = workers.seen["decode"]
    assert decode["kv_transfer_params"] == answer["kv_transfer_params"]


@pytest.mark.parametrize("block_ids", [[[4, 5, 6], [2]], [[0]], [[], [7]]],
                         ids=["two-groups", "one-group", "an-empty-group"])
async def test_B7_vllm_block_ids_per_kv_cache_group_go_to_the_decode_as_sent(
        block_ids: list[list[int]]) -> None:
    """vLLM's NixlConnector with the hybrid KV cache manager sends ``remote_block_ids`` as
    one list per KV cache group: a handoff like any other, not an invalid one."""
    answer = {**vllm_answer(), "kv_transfer_params": {**HMA_PARAMS,
                                                       "remote_block_ids": block_ids}}
    workers = FakeWorkers(answer)
    async with fake_router(vllm_pair, workers) as router:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                stream = await router.stream(nursery, completion("hma"), RequestContext("hma"))
                with stream.outputs:
                    items = [item async for item in stream.outputs]
    assert not any(item.is_error for item in items)
    assert "".join(item.data.text or "" for item in items if item.data) == " y"
    (decode,) = workers.seen["decode"]
    assert decode["kv_transfer_params"] == answer["kv_transfer_params"]


async def test_B7_S7_vllm_terminal_answer_is_not_a_handoff() -> None:
    answer = {**vllm_answer("stop"), "kv_transfer_params": None}
    async with fake_client(FakeWorkers(answer)) as client:
        (item,) = await prefill_items(VllmEngine(PREFILL_URL, "prefill", client=client))
    completion_ = classify_first_output(item)
    assert isinstance(completion_, Terminal)


# --- TensorRT-LLM: one choice, its disaggregated_params, prompt_token_ids ----------------


CTX_ID = "choices[0].disaggregated_params.ctx_request_id"

TRTLLM_CASES = [
    pytest.param({"choices": 2}, "choices", "got 2", id="two-choices"),
    pytest.param({"ctx_request_id": ""}, CTX_ID, "''", id="ctx_request_id-empty"),
    pytest.param({"ctx_request_id": "abc"}, CTX_ID, "'abc'", id="ctx_request_id-abc"),
    pytest.param({"ctx_request_id": 1.5}, CTX_ID, "1.5", id="ctx_request_id-float"),
    pytest.param({"ctx_request_id": True}, CTX_ID, "True", id="ctx_request_id-true"),
    pytest.param({"ctx_request_id": None}, CTX_ID, "null", id="ctx_request_id-null"),
    pytest.param({"ctx_request_id": MISSING}, CTX_ID, "is missing",
                 id="ctx_request_id-missing"),
    pytest.param({"choices": 3}, "choices", "must hold exactly one choice, got 3",
                 id="three-choices"),
    pytest.param({"ctx_request_id": -3}, CTX_ID, "must be a non-negative integer, got int -3",
                 id="ctx_request_id-negative"),
    pytest.param({"request_type": 3}, "choices[0].disaggregated_params.request_type", "3",
                 id="request_type-int"),
    pytest.param({"request_type": "generation_only"},
                 "choices[0].disaggregated_params.request_type",
                 "must be 'context_only', got str 'generation_only'",
                 id="request_type-generation_only"),
    pytest.param({"request_type": None}, "choices[0].disaggregated_params.request_type",
                 "null", id="request_type-null"),
    pytest.param({"first_gen_tokens": ["a"]},
                 "choices[0].disaggregated_params.first_gen_tokens[0]", "'a'",
                 id="first_gen_tokens-str"),
    pytest.param({"first_gen_tokens": []},
                 "choices[0].disaggregated_params.first_gen_tokens",
                 "must be a non-empty list, got list []", id="first_gen_tokens-empty"),
    pytest.param({"first_gen_tokens": 7},
                 "choices[0].disaggregated_params.first_gen_tokens", "int 7",
                 id="first_gen_tokens-int"),
    pytest.param({"encoded_opaque_state": 5},
                 "choices[0].disaggregated_params.encoded_opaque_state", "5",
                 id="encoded_opaque_state-int"),
    pytest.param({"disagg_request_id": "42"},
                 "choices[0].disaggregated_params.disagg_request_id", "'42'",
                 id="disagg_request_id-str"),
    pytest.param({"top": {"prompt_token_ids": "1 2 3"}}, "prompt_token_ids", "'1 2 3'",
                 id="prompt_token_ids-str"),
    pytest.param({"top": {"prompt_token_ids": [1, 2.0]}}, "prompt_token_ids[1]", "2.0",
                 id="prompt_token_ids-float-item"),
]


@pytest.mark.parametrize(("change", "field", "bad"), TRTLLM_CASES)
async def test_B7_trtllm_invalid_context_answer_is_one_error_item(
        change: dict[str, Any], field: str, bad: str) -> None:
    async with fake_client(FakeWorkers(trtllm_answer(**change))) as client:
        items = await prefill_items(TrtllmEngine(PREFILL_URL, "prefill", client=client))
    error = assert_refused(items, field, bad)
    if field == CTX_ID:
        assert "no usable ctx_request_id" in str(error)  # S9's refusal, by B7's rule


@pytest.mark.parametrize("answer", [
    pytest.param(trtllm_answer(top={"choices": [{"index": 0, "text": " x",
                                                 "finish_reason": "length"}]}),
                 id="missing"),
    pytest.param(trtllm_answer(top={"choices": [{"index": 0, "text": " x",
                                                 "finish_reason": "not_finished",
                                                 "disaggregated_params": "11"}]}),
                 id="string"),
])
async def test_B7_S8_trtllm_non_terminal_context_without_an_object_to_hand_off(
        answer: dict[str, Any]) -> None:
    async with fake_client(FakeWorkers(answer)) as client:
        items = await prefill_items(TrtllmEngine(PREFILL_URL, "prefill", client=client))
    assert_refused(items, "choices[0].disaggregated_params", "")


@pytest.mark.parametrize(("change", "field", "bad"), [
    *TRTLLM_CASES[:5],
    *(case for case in TRTLLM_CASES if case.id in ("ctx_request_id-negative",
                                                   "request_type-generation_only",
                                                   "first_gen_tokens-empty")),
])
async def test_B7_trtllm_router_sends_no_generation_request_for_an_invalid_handoff(
        change: dict[str, Any], field: str, bad: str) -> None:
    error = await routed_refusal(trtllm_pair, FakeWorkers(trtllm_answer(**change)))
    assert error.field == field and bad in str(error)


async def test_B7_trtllm_valid_handoff_goes_to_the_generation_as_sent() -> None:
    answer = trtllm_answer(x_future={"a": 1}, draft_tokens=MISSING, first_gen_tokens=None,
                           top={"prompt_token_ids": None})
    workers = FakeWorkers(answer)
    async with fake_router(trtllm_pair, workers) as router:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                stream = await router.stream(nursery, completion("ok"), RequestContext("ok"))
                with stream.outputs:
                    items = [item async for item in stream.outputs]
    assert not any(item.is_error for item in items)
    (generation,) = workers.seen["decode"]
    sent = answer["choices"][0]["disaggregated_params"]
    assert generation["disaggregated_params"] == {**sent, "request_type": "generation_only"}
    assert PROMPT_TOKEN_IDS_KEY not in generation["disaggregated_params"]
    assert generation["prompt"] == completion("ok").body["prompt"]  # no ids: the client's


@pytest.mark.parametrize("finish", ["stop", "timeout"])
async def test_B7_S7_trtllm_terminal_context_is_not_a_handoff(finish: str) -> None:
    """A terminal context with a null ctx_request_id is the answer, not a handoff to
    check. (Two choices would be the worker's error, as in any whole answer: B8.)"""
    answer = trtllm_answer(finish, ctx_request_id=None)
    async with fake_client(FakeWorkers(answer)) as client:
        (item,) = await prefill_items(TrtllmEngine(PREFILL_URL, "prefill", client=client))
    terminal = classify_first_output(item)
    assert isinstance(terminal, Terminal)
    assert terminal.output.data is not None and terminal.output.data.finish_reason is not None
    assert terminal.output.data.finish_reason.kind in (FinishKind.STOP, FinishKind.ERROR)


# --- SGLang: the bootstrap triple ----------------------------------------------------------


@pytest.mark.parametrize(("info", "field", "bad"), [
    pytest.param(BootstrapInfo(host="10.0.0.5", port="8998", room=7),  # type: ignore[arg-type]
                 "bootstrap_port", "'8998'", id="port-str"),
    pytest.param(BootstrapInfo(host="10.0.0.5", port=8998, room=True),
                 "bootstrap_room", "True", id="room-bool"),
    pytest.param(BootstrapInfo(host="10.0.0.5", port=8998, room=7.0),  # type: ignore[arg-type]
                 "bootstrap_room", "7.0", id="room-float"),
    pytest.param(BootstrapInfo(host=None, port=8998, room=7),  # type: ignore[arg-type]
                 "bootstrap_host", "null", id="host-null"),
])
async def test_B7_sglang_invalid_bootstrap_triple_reaches_neither_worker(
        info: BootstrapInfo, field: str, bad: str) -> None:
    """The prefill sends no request and ONE error item; the decode leg's body refuses the
    same triple, so it sends none either."""
    workers = FakeWorkers({})
    async with fake_client(workers) as client:
        prefill = SglangEngine(PREFILL_URL, "prefill", client=client)
        decode = SglangEngine(DECODE_URL, "decode", client=client)
        request = attrs.evolve(completion("bad"), bootstrap_info=info)
        send, receive = trio.open_memory_channel[Item](8)
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                await nursery.start(prefill.generate, request, RequestContext("bad"), send)
                with receive:
                    items = [item async for item in receive]
        error = assert_refused(items, field, bad)
        assert "has an invalid handoff" in str(error)  # the router's triple, not the worker's
        send, receive = trio.open_memory_channel[Item](8)
        with receive, pytest.raises(WorkerError, match=field) as refused:
            await decode.generate(request, RequestContext("bad"), send)
        assert refused.value.status == 502
    assert workers.seen == {"prefill": [], "decode": []}


# --- B10 with B1: a stop never drops an answer already on its way ----------------------------


@pytest.mark.parametrize("protocol", ["vllm", "trtllm"])
async def test_B10_B1_a_stopped_prefill_still_reads_an_answer_on_its_way(protocol: str) -> None:
    """The router stops a prefill (its client left inside the cancel window) just as the
    worker's answer is on the wire: the adapter gives the answer a moment and reads it, so
    the router sees the handoff and its KV is consumed (B1) instead of waiting for the
    worker's lease. (Without that grace the response was closed unread.)"""
    answer = vllm_answer() if protocol == "vllm" else trtllm_answer()
    workers = FakeWorkers(answer)
    async with fake_client(workers) as client:
        engine: HttpEngine = (
            VllmEngine("http://prefill", "prefill", client=client) if protocol == "vllm"
            else TrtllmEngine("http://prefill", "prefill", client=client))
        context = RequestContext("r")
        send, receive = trio.open_memory_channel[Item](8)
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(engine.generate, completion("r"), context, send))
                context.stop_generating()  # the answer is already there to be read
                with receive:
                    items = [item async for item in receive]
    (item,) = items
    assert not item.is_error and item.data is not None
    assert item.data.disaggregated_params is not None  # the handoff, not "cancelled"
