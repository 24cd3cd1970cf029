"""A decode leg in the request's nursery hands its stream's reader the reading of its
worker: the reader reads the worker's socket in its own task (one task a token,
docs/performance.md). What a reader sees must not change: every output once, in order,
whatever cancels its reads; a stop gives one ``cancelled`` finish (C3); a reader that
leaves aborts the worker's request."""

from __future__ import annotations

import attrs
import httpx  # noqa: ASYNC127 (a caller's own client)
import pytest
import trio
from e2e_support import FAST, wait_until
from protocol_support import completion, tokens
from test_vllm import vllm_cluster

from trio_disagg import FinishKind, RequestContext
from trio_disagg.engines import vllm_client
from trio_disagg.engines._reader import SseReader

#: 10 ms between tokens: a reader mostly waits on the worker's socket.
PACED = attrs.evolve(FAST, inter_token_latency=0.01)


def finish_of(item: object) -> FinishKind | None:
    data = getattr(item, "data", None)
    finish = data.finish_reason if data is not None else None
    return finish.kind if finish is not None else None


@pytest.mark.parametrize("client", ["worker_client", "httpx"])
async def test_G7_a_receive_cut_while_it_reads_the_worker_loses_nothing(client: str) -> None:
    """A reader whose every receive is cut short by its own timeout while it waits on
    the worker's socket still gets every token once, in order, and the finish (the
    mock's tokens follow the request id: the same id, the same tokens); also through a
    caller's own httpx client, whose reads a cancellation would end."""
    async with vllm_cluster(latency=PACED, client=None if client == "worker_client"
                            else httpx.AsyncClient()) as cluster:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                whole = await cluster.router.stream(
                    nursery, completion("same", max_tokens=12), RequestContext("same"))
                with whole.outputs:
                    expected = [item async for item in whole.outputs]
                cut = await cluster.router.stream(
                    nursery, completion("same", max_tokens=12), RequestContext("same"))
                items, cuts = [], 0
                with cut.outputs:
                    while True:
                        with trio.move_on_after(0.003) as wait:
                            try:
                                item = await cut.outputs.receive()
                            except trio.EndOfChannel:
                                break
                        if wait.cancelled_caught:
                            cuts += 1
                            continue
                        items.append(item)
        assert cuts > 5  # the reads were cut while they waited on the worker
        assert tokens(items) == tokens(expected) and len(tokens(items)) == 12
        assert finish_of(items[-1]) is finish_of(expected[-1]) is FinishKind.LENGTH
        await cluster.settled()


async def test_C3_a_stop_while_the_reader_waits_on_the_worker_ends_with_one_cancelled_finish(
) -> None:
    """The client stops its request while its reader waits on the decode worker's socket:
    the reader gets one ``cancelled`` finish, then the end; the worker's request is
    aborted (its connection closed) and nothing is left held."""
    async with vllm_cluster(latency=PACED) as cluster:
        context = RequestContext("stop")
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                stream = await cluster.router.stream(
                    nursery, completion("stop", max_tokens=200), context)
                with stream.outputs:
                    first = [await stream.outputs.receive() for _ in range(3)]
                    nursery.start_soon(_stop_when_blocked, context)
                    rest = [item async for item in stream.outputs]
        assert tokens(first) and all(finish_of(item) is None for item in first)
        assert [finish_of(item) for item in rest][-1] is FinishKind.CANCELLED
        assert sum(finish_of(item) is not None for item in rest) == 1
        assert len(tokens(first + rest)) < 200
        await wait_until(lambda: any(rid == "stop" for rid, _ in cluster.decode.aborts))
        await cluster.settled()


async def _stop_when_blocked(context: RequestContext) -> None:
    await trio.testing.wait_all_tasks_blocked()
    context.stop_generating()


async def test_B5_a_reader_that_leaves_mid_read_aborts_the_decode() -> None:
    """A reader cancelled while it waits on the worker's socket, its stream closed on the
    way out: the decode worker's request is aborted, the request ends, nothing is held."""
    async with vllm_cluster(latency=PACED) as cluster:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                stream = await cluster.router.stream(
                    nursery, completion("leave", max_tokens=200), RequestContext("leave"))
                with stream.outputs, trio.move_on_after(0.05):
                    async for _ in stream.outputs:
                        pass
        await wait_until(lambda: any(rid == "leave" for rid, _ in cluster.decode.aborts))
        await cluster.settled()


async def test_a_read_timeout_counts_the_workers_silence_across_receives_cut_short() -> None:
    """A worker that stalls mid-stream, read by a reader whose receives its own timeout
    cuts short (shorter than the client's ``read_timeout``): the stream still ends with
    the read timeout's error once the worker was silent that long, not at the decode-idle
    deadline (60 s) nor never."""
    async with vllm_cluster(latency=PACED, client=vllm_client(read_timeout=0.2)) as cluster:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                stream = await cluster.router.stream(
                    nursery, completion("stall", max_tokens=12, fault="decode_stall_at:3"),
                    RequestContext("stall"))
                items = []
                with stream.outputs:
                    while True:
                        with trio.move_on_after(0.05):
                            try:
                                items.append(await stream.outputs.receive())
                            except trio.EndOfChannel:
                                break
        assert len(tokens(items)) == 3
        assert items[-1].event == "error" and "ReadTimeout" in (items[-1].error or "")
        await cluster.settled()


async def test_B4_a_crash_reading_the_workers_stream_in_the_readers_task_is_one_error_item(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's reading of the worker's events crashes (a bug) while the stream's
    reader reads the worker in its own task: the reader gets one error item naming the
    crash, as from a decode leg that crashed after its worker accepted (G4, B4), never
    the exception out of ``receive()``; the worker's request is aborted."""
    feed = SseReader.feed
    feeds = 0

    def crashing_feed(reader: SseReader, part: bytes) -> str | None:
        nonlocal feeds
        feeds += 1
        if feeds == 3:
            raise RuntimeError("a bug in the reader")
        return feed(reader, part)

    monkeypatch.setattr(SseReader, "feed", crashing_feed)
    async with vllm_cluster(latency=PACED) as cluster:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                stream = await cluster.router.stream(
                    nursery, completion("bug", max_tokens=50), RequestContext("bug"))
                with stream.outputs:
                    items = [item async for item in stream.outputs]
        assert tokens(items) and all(item.event is None for item in items[:-1])
        assert items[-1].event == "error" and "a bug in the reader" in (items[-1].error or "")
        await wait_until(lambda: any(rid == "bug" for rid, _ in cluster.decode.aborts))
        await cluster.settled()
