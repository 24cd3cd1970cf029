"""``GET /v1/models``: each model the router serves, as its workers describe it (vLLM's
``root``, ``parent``, ``max_model_len``, ...), never a value the router made up."""

from __future__ import annotations

from typing import Any

import attrs
import httpx
import pytest
import trio
from e2e_support import MODEL, PROTOCOLS, ProtocolName, served

from trio_disagg import DisaggRouter, TransferKeeper, WorkerError, WorkerPool
from trio_disagg.engines import mock_cluster
from trio_disagg.server import create_app
from trio_disagg.server._models import ModelCards

OWNED_BY = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm"}


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_model_list_is_the_workers_own(protocol: ProtocolName) -> None:
    """Once: ``{"id", "object", "created", "owned_by": "trio-disagg"}`` whatever the
    workers said, so a client could not learn the context length vLLM reports."""
    async with served(protocol) as server:
        server.cluster.prefill.max_model_len = 4096  # a prompt must fit the prefill's
        async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as http:
            listed = (await http.get("/v1/models")).json()
            (card,) = listed["data"]
            assert (await http.get(f"/v1/models/{MODEL}")).json() == card
        assert listed["object"] == "list"
        assert card["id"] == MODEL and card["object"] == "model"
        assert card["owned_by"] == OWNED_BY[protocol]  # the decode worker's own object
        assert (card["root"], card["parent"]) == (MODEL, None)
        assert card["max_model_len"] == 4096  # the smaller of the two pools'
        assert isinstance(card["created"], int)


@attrs.define(eq=False)
class Listing:
    """An in-process engine whose worker lists ``cards`` (None: never answers; an
    exception: fails)."""

    engine: Any
    name: str
    cards: list[dict[str, Any]] | BaseException | None
    asked: int = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def list_models(self) -> list[dict[str, Any]]:
        self.asked += 1
        if self.cards is None:
            await trio.sleep_forever()
        if isinstance(self.cards, BaseException):
            raise self.cards
        return self.cards


def vllm_card(model: str, length: int | None, **more: Any) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 7, "owned_by": "vllm",
            "root": f"/models/{model}", "parent": None, "max_model_len": length,
            "permission": [{"id": "modelperm-1", "object": "model_permission"}], **more}


async def cards_of(prefill: list[Any], decode: list[Any], models: list[str]
                   ) -> tuple[list[dict[str, Any]], ModelCards]:
    async with TransferKeeper() as keeper:
        router = DisaggRouter(WorkerPool(prefill), WorkerPool(decode), keeper)
        cards = ModelCards(router, models)
        listed = await cards.cards()
    return listed, cards


def fleet(prefill: list[Any], decode: list[Any]) -> tuple[list[Any], list[Any]]:
    cluster = mock_cluster(len(prefill), len(decode))
    return ([Listing(engine, engine.name, cards) for engine, cards in
             zip(cluster.prefill, prefill, strict=True)],
            [Listing(engine, engine.name, cards) for engine, cards in
             zip(cluster.decode, decode, strict=True)])


async def test_a_card_is_the_decode_workers_with_the_smaller_context(
        autojump_clock: trio.abc.Clock) -> None:
    lora = vllm_card("sql-lora", None, parent="base")
    prefill, decode = fleet([[vllm_card("base", 4096)]], [[vllm_card("base", 8192), lora]])
    listed, _ = await cards_of(prefill, decode, ["base", "sql-lora", "alias"])
    assert listed == [
        {**vllm_card("base", 8192), "max_model_len": 4096},
        lora,  # as sent: no length anywhere, so none is made up
        {"id": "alias", "object": "model", "created": listed[2]["created"],
         "owned_by": "trio-disagg"},  # no worker lists it: OpenAI's four fields
    ]


async def test_a_worker_that_fails_or_does_not_answer_is_passed_over(
        autojump_clock: trio.abc.Clock) -> None:
    # The first decode worker fails, the second lists; no prefill worker answers (the
    # wait is bounded), so the decode's card goes out as it is.
    prefill, decode = fleet([None], [WorkerError("refused"), [vllm_card("base", 8192)]])
    start = trio.current_time()
    listed, cards = await cards_of(prefill, decode, ["base"])
    assert trio.current_time() - start == pytest.approx(cards.timeout)
    assert listed == [vllm_card("base", 8192)]
    assert [engine.asked for engine in decode] == [1, 1]


async def test_the_answers_are_reused_for_a_while_and_kept_when_workers_fall_silent(
        autojump_clock: trio.abc.Clock) -> None:
    prefill, decode = fleet([[vllm_card("base", 4096)]], [[vllm_card("base", 8192)]])
    async with TransferKeeper() as keeper:
        cards = ModelCards(DisaggRouter(WorkerPool(prefill), WorkerPool(decode), keeper),
                           ["base"])
        assert (await cards.card("base"))["max_model_len"] == 4096
        prefill[0].cards = [vllm_card("base", 2048)]
        await trio.sleep(cards.ttl / 2)
        assert (await cards.card("base"))["max_model_len"] == 4096  # reused
        await trio.sleep(cards.ttl / 2)
        assert (await cards.card("base"))["max_model_len"] == 2048  # asked again
        prefill[0].cards = None  # the prefill pool falls silent: its last answer stays
        await trio.sleep(cards.ttl)
        assert (await cards.card("base"))["max_model_len"] == 2048
    assert [prefill[0].asked, decode[0].asked] == [3, 3]


async def test_in_process_engines_get_openais_four_fields() -> None:
    cluster = mock_cluster()
    listed, cards = await cards_of(list(cluster.prefill), list(cluster.decode), ["m"])
    assert listed == [{"id": "m", "object": "model", "created": cards.created,
                       "owned_by": "trio-disagg"}]


async def test_serve_warns_of_a_model_name_the_workers_do_not_list(
        autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    """``serve --backend vllm`` without ``--model`` serves 'trio-disagg-mock', which no
    vLLM worker serves: every request would be its 404. Said once it listens."""
    from trio_disagg._cli._serve import _check_models

    prefill, decode = fleet([[vllm_card("base", 4096)]], [None])  # the decode is silent
    async with TransferKeeper() as keeper:
        app = create_app(DisaggRouter(WorkerPool(prefill), WorkerPool(decode), keeper),
                         models=["base", "trio-disagg-mock"])
        await _check_models(app)
    (record,) = caplog.records
    assert record.getMessage() == (
        "the prefill workers do not list 'trio-disagg-mock' (--model) in their /v1/models: "
        "a worker that serves only what it lists refuses requests for it; give --model the "
        "names the workers serve")
