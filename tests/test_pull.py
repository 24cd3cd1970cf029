"""A decode leg in the request's nursery hands its stream's reader the reading of its
worker: the reader reads the worker's socket in its own task (one task a token,
docs/performance.md). What a reader sees must not change: every output once, in order,
whatever cancels its reads; a stop gives one ``cancelled`` finish (C3); a reader that
leaves aborts the worker's request."""

from __future__ import annotations

import math
from typing import Any

import attrs
import httpx  # noqa: ASYNC127 (a caller's own client)
import orjson
import pytest
import trio
from e2e_support import FAST, MODEL, PROMPT, served, wait_until
from protocol_support import Item, completion, tokens
from test_vllm import vllm_cluster

from trio_disagg import DeadlineExceeded, Deadlines, FinishKind, RequestContext
from trio_disagg._pull import PullSlot
from trio_disagg.engines import VllmEngine, vllm_client
from trio_disagg.engines._chunks import ChunkParser
from trio_disagg.engines._pulled import SseSource
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


#: A short decode-idle deadline; the others long.
IDLE = Deadlines(prefill=10, handoff=10, decode_idle=0.3, terminal_hold=10, transfer=30)


async def _read_all(cluster: Any, rid: str, max_tokens: int, *, cut: float | None = None,
                    fault: str | None = None) -> tuple[list[Item], float]:
    """Route one request, read its whole stream (each receive cut after ``cut`` seconds,
    if given), and time it."""
    fields = {"fault": fault} if fault else {}
    start = trio.current_time()
    items: list[Item] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            stream = await cluster.router.stream(
                nursery, completion(rid, max_tokens=max_tokens, **fields), RequestContext(rid))
            with stream.outputs:
                while True:
                    with trio.move_on_after(math.inf if cut is None else cut):
                        try:
                            items.append(await stream.outputs.receive())
                        except trio.EndOfChannel:
                            break
    return items, trio.current_time() - start


async def test_B2_a_decode_worker_that_stalls_mid_stream_fails_at_the_decode_idle_deadline(
) -> None:
    """A decode worker that stops sending mid-stream, its reader waiting on its socket:
    the stream ends with the decode-idle error at the deadline (not later, and not at
    once), the worker's request is aborted, and nothing is left held."""
    async with vllm_cluster(deadlines=IDLE) as cluster:
        items, took = await _read_all(cluster, "stall", 8, fault="decode_stall_at:3")
        assert tokens(items) and items[-1].is_error
        assert isinstance(items[-1].exception, DeadlineExceeded)
        assert items[-1].exception.what == "decode idle"
        assert 0.3 <= took < 1.5
        await wait_until(lambda: any(rid == "stall" for rid, _ in cluster.decode.aborts))
        await cluster.settled()


async def test_B2_a_readers_own_timeouts_do_not_restart_a_pulled_waits_deadline() -> None:
    """The reader cuts each receive after 50 ms and carries on: the worker that stalled
    still fails the stream at the decode-idle deadline, counted from the first wait."""
    async with vllm_cluster(deadlines=IDLE) as cluster:
        items, took = await _read_all(cluster, "cut", 8, cut=0.05, fault="decode_stall_at:3")
        assert isinstance(items[-1].exception, DeadlineExceeded)
        assert 0.3 <= took < 1.5
        await cluster.settled()


async def test_B2_the_decode_idle_deadline_is_per_gap_not_per_stream() -> None:
    """Tokens 0.1 s apart under a 0.3 s decode-idle deadline: a stream that lasts several
    deadlines completes, each gap within it."""
    async with vllm_cluster(latency=attrs.evolve(FAST, inter_token_latency=0.1),
                            deadlines=IDLE) as cluster:
        items, took = await _read_all(cluster, "slow", 8)
        assert took > 0.6  # more than two deadlines
        assert len(tokens(items)) == 8 and finish_of(items[-1]) is FinishKind.LENGTH
        await cluster.settled()


async def test_a_read_timeout_counts_the_workers_silence_across_receives_cut_short() -> None:
    """A worker that stalls mid-stream, read by a reader whose receives its own timeout
    cuts short (shorter than the client's ``read_timeout``): the stream still ends with
    the read timeout's error once the worker was silent that long, not at the decode-idle
    deadline (60 s) nor never."""
    async with vllm_cluster(latency=PACED, client=vllm_client(read_timeout=0.2)) as cluster:
        items, _ = await _read_all(cluster, "stall", 12, cut=0.05, fault="decode_stall_at:3")
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
        items, _ = await _read_all(cluster, "bug", 50)
        assert tokens(items) and all(item.event is None for item in items[:-1])
        assert items[-1].event == "error" and "a bug in the reader" in (items[-1].error or "")
        await wait_until(lambda: any(rid == "bug" for rid, _ in cluster.decode.aborts))
        await cluster.settled()


class _OneRead:
    """A worker's answer whose whole event stream comes in one socket read."""

    def __init__(self, stream: bytes) -> None:
        self.parts = [stream]
        self.status_code = 200
        self.headers = {"content-type": "text/event-stream"}

    @property
    def at_end(self) -> bool:
        return not self.parts

    async def read(self) -> bytes:
        await trio.lowlevel.checkpoint()
        return self.parts.pop() if self.parts else b""

    async def aread(self, limit: int | None = None) -> bytes:
        return await self.read()

    async def aclose(self) -> None:
        self.parts.clear()
        await trio.lowlevel.checkpoint()


def _events(*chunks: bytes) -> bytes:
    return b"".join(b"data: " + chunk + b"\n\n" for chunk in chunks)


_TOKENS = [b'{"id":"c","object":"text_completion","created":1,"model":"m","choices":'
           b'[{"index":0,"text":"%s","logprobs":null,"finish_reason":null}]}' % text
           for text in (b" a", b" b")]
_FINISH = (b'{"id":"c","object":"text_completion","created":1,"model":"m","choices":'
           b'[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]}')
_USAGE = (b'{"id":"c","object":"text_completion","created":1,"model":"m","choices":[],'
          b'"usage":{"prompt_tokens":3,"completion_tokens":3000,"total_tokens":5}}')


async def test_G8_a_finish_read_with_the_last_tokens_is_ready_with_them() -> None:
    """One read brings the last tokens, the finish, the usage and ``[DONE]``: the reader
    gets the tokens, and the finish at once after them without a wait or another read
    (``receive_nowait`` serves it: the server writes both in one write), then nothing."""
    slot = PullSlot()
    source = SseSource(_OneRead(_events(*_TOKENS, _FINISH, _USAGE, b"[DONE]")),
                       SseReader(ChunkParser()), _no_error, repr, slot)
    assert slot.offer(source)
    burst = await source.pull()
    assert burst is not None and burst.data is not None and burst.data.text == " a b"
    final = source.pull_nowait()
    assert final is not None and finish_of(final) is FinishKind.LENGTH
    assert final.data is not None and final.data.completion_usage is not None
    assert slot.released and source.finished
    assert source.pull_nowait() is None and await source.pull() is None


def _no_error(message: str) -> Item:
    raise AssertionError(f"no error expected, got {message!r}")


async def test_C3_a_finish_already_read_when_the_leg_stops_still_reaches_the_reader() -> None:
    """The read that brought the last tokens brought the finish too, and the leg stops
    before the reader took it: the reader gets that finish from the leg's channel, as it
    would have had the leg sent each item there, not only the stop's ``cancelled``."""
    engine = VllmEngine("http://127.0.0.1:9", role="decode", client=vllm_client())
    send, receive = trio.open_memory_channel[Item](4)
    slot = PullSlot()
    body = _OneRead(_events(*_TOKENS, _FINISH, _USAGE, b"[DONE]"))
    async with trio.open_nursery() as nursery:
        leg = trio.CancelScope()

        async def run_leg() -> None:
            with leg:
                await engine._relay_stream(body, ChunkParser(), send, slot)

        nursery.start_soon(run_leg)
        await trio.testing.wait_all_tasks_blocked()
        source = slot.source
        assert source is not None
        burst = await source.pull()
        assert burst is not None and burst.data is not None and burst.data.text == " a b"
        leg.cancel()  # the leg's stop, before the reader takes the finish
    assert finish_of(receive.receive_nowait()) is FinishKind.LENGTH


async def test_B2_an_http_client_that_stops_reading_is_not_an_idle_decode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client of the router's server that stops reading its stream for longer than the
    decode-idle deadline, while its reader (the server's writer) reads the worker: the
    worker is read no further than the sockets' buffers take, the deadline does not
    fire, and the stream ends whole once the client reads again."""
    pulls: list[tuple[float, SseSource]] = []
    pull = SseSource.pull
    pulled = [trio.Event()]  # set by the next pull

    async def counted(source: SseSource) -> Item | None:
        pulls.append((trio.current_time(), source))
        pulled[0].set()
        return await pull(source)

    monkeypatch.setattr(SseSource, "pull", counted)
    fast = attrs.evolve(FAST, inter_token_latency=0.00001)
    tokens = 3000  # past the sockets' buffers
    body = orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": tokens,
                         "stream": True, "stream_options": {"include_usage": True}})
    with trio.fail_after(10):
        # (a deadline a loaded machine's stall cannot pass for: the test waits 3 of them)
        async with served("vllm", latency=fast, deadlines=Deadlines(decode_idle=0.25)) as server:
            stream = await trio.open_tcp_stream("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
            await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                                  b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                                  % (len(body), body))
            data = bytearray(await stream.receive_some(4096))
            # The client reads nothing more: the reader reads the worker until the sockets'
            # buffers are full, then waits for the client, for 3 deadlines and more.
            while True:
                pulled[0] = trio.Event()
                with trio.move_on_after(0.75) as quiet:
                    await pulled[0].wait()
                if quiet.cancelled_caught:
                    break
            # The worker is not read to its end meanwhile, nor is the decode idle.
            assert not pulls[-1][1].finished
            while b"data: [DONE]" not in data[-64:] and (part := await stream.receive_some()):
                data += part
    events = [line for line in bytes(data).split(b"\n") if line.startswith(b"data: {")]
    assert b'"error"' not in data
    assert len(events) == tokens + 1  # every token, then the usage chunk
    assert b'"completion_tokens":%d' % tokens in events[-1]
