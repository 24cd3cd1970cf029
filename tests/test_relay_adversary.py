"""The relay's fast path (B8, docs/performance.md) end to end against a worker that sends
odd but valid server-sent events: a real socket worker written here answers the vLLM
adapter's request with crafted bytes, in crafted HTTP chunks (each sent once the router
read the one before), through the router on a real port, read by the ``openai`` client
and by raw HTTP. The client sees the same with the fast path on and off.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import openai
import orjson
import pytest
import trio
import trio.testing
from engine_support import StandIn, run_to_its_end

from trio_disagg import (
    Annotated,
    BootstrapInfo,
    DisaggRouter,
    LLMEngineOutput,
    PreprocessedRequest,
    RawChoices,
    RequestContext,
    TransferKeeper,
    WorkerPool,
)
from trio_disagg.engines import (
    LatencyModel,
    SglangEngine,
    VllmEngine,
    WorkerClient,
    mock_cluster,
)
from trio_disagg.engines._burst import Burst
from trio_disagg.engines._reader import SseReader
from trio_disagg.server import create_app, serve

MODEL = "mock-model"


def event(data: bytes, end: bytes = b"\n\n") -> bytes:
    return b"data: " + data + end


def bare(chat: bool, text: str, **more: Any) -> bytes:
    """A chunk as a worker that leaves out null fields writes it (no ``finish_reason``
    until the last chunk)."""
    choice = ({"index": 0, "delta": {"content": text}, **more} if chat
              else {"index": 0, "text": text, **more})
    return orjson.dumps({"id": "w", "object": "chat.completion.chunk" if chat
                         else "text_completion", "created": 7, "model": "worker",
                         "choices": [choice]})


def odd_stream(chat: bool) -> bytes:
    """Common chunks in every framing a worker may use (CRLF, CR, comments, other fields,
    ``data:`` without a space), texts with quotes, U+2028 and an emoji, then a finish in
    the template's bytes with a chunk after it, the usage and ``[DONE]``."""
    texts = ["a", " b", "\U0001f600", 'q"uote', "\u2028", " c", "back\\slash", " d"]
    events = [event(bare(chat, text)) for text in texts]
    events[2] = event(bare(chat, texts[2]), b"\r\n\r\n")
    events[4] = b": keep-alive\n\nid: 4\nevent: message\n" + event(bare(chat, texts[4]))
    events[5] = b"data:" + bare(chat, texts[5]) + b"\r\r"
    if chat:
        events.insert(0, event(orjson.dumps({"id": "w", "object": "chat.completion.chunk",
                                             "created": 7, "model": "worker", "choices": [
                                                 {"index": 0, "delta": {"role": "assistant",
                                                                        "content": ""}}]})))
    usage = orjson.dumps({"id": "w", "choices": [], "usage": {
        "prompt_tokens": 3, "completion_tokens": len(texts) + 1, "total_tokens": 12}})
    return b"".join([*events, event(bare(chat, "end", finish_reason="stop")),
                     event(bare(chat, " late")), event(usage), event(b"[DONE]")])


async def read_request(stream: trio.SocketStream) -> bool:
    """Read one request (its head and its body); False if the connection ended."""
    data = b""
    while b"\r\n\r\n" not in data:
        if not (more := await stream.receive_some(1 << 16)):
            return False
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    found = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    length = int(found.group(1)) if found else 0
    while len(body) < length:
        body += await stream.receive_some(1 << 16)
    return True


class Worker:
    """A vLLM decode worker on a real socket that answers every request with
    :attr:`pieces`, one HTTP chunk each, each sent once every task waits (the router
    read the one before), then closes the connection."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    async def handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            if not await read_request(stream):
                return
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                  b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            for piece in self.pieces:
                await trio.testing.wait_all_tasks_blocked()
                await stream.send_all(b"%x\r\n%s\r\n" % (len(piece), piece))
            await self.end(stream)

    async def end(self, stream: trio.SocketStream) -> None:
        """After the pieces: the end of the chunked body."""
        await stream.send_all(b"0\r\n\r\n")


class Relayed(StandIn):
    """The mock decode first (it pulls the KV; its tokens are thrown away), then a vLLM
    adapter (or an SGLang one, given the bootstrap room a real SGLang prefill's request
    would have) relays the socket worker's answer."""

    def __init__(self, engine: Any, url: str, client: WorkerClient,
                 protocol: str = "vllm") -> None:
        super().__init__(engine)
        self.relay: VllmEngine | SglangEngine = (
            SglangEngine(url, "decode", client=client) if protocol == "sglang"
            else VllmEngine(url, "decode", client=client))

    async def generate(  # noqa: ASYNC128 (the wrapped engines call task_status.started())
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Annotated[LLMEngineOutput]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await run_to_its_end(self.engine, request, context)  # it pulls the KV
        if isinstance(self.relay, SglangEngine):
            request = attrs.evolve(request, bootstrap_info=BootstrapInfo(
                host="127.0.0.1", port=8998, room=1))
        await self.relay.generate(request, context, send_channel, task_status=task_status)


@asynccontextmanager
async def running(worker: Worker, protocol: str = "vllm") -> AsyncIterator[str]:
    """The router on a real port, its decode the socket worker's, read by the
    ``protocol`` adapter (``"vllm"`` or ``"sglang"``)."""
    cluster = mock_cluster(latency=LatencyModel.zero())
    async with trio.open_nursery() as nursery, WorkerClient() as client:
        listeners = await nursery.start(partial(trio.serve_tcp, worker.handle, 0,
                                                host="127.0.0.1"))
        url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        decode = Relayed(cluster.decode[0], url, client, protocol)
        async with TransferKeeper(drain_window=5.0) as keeper:
            router = DisaggRouter(WorkerPool([cluster.prefill[0]]), WorkerPool([decode]),
                                  keeper)
            app = create_app(router, models=[MODEL])
            stop = trio.Event()
            async with trio.open_nursery() as inner:
                port = await inner.start(partial(
                    serve, app, host="127.0.0.1", port=0, shutdown_trigger=stop.wait))
                yield f"http://127.0.0.1:{port}"
                stop.set()
        nursery.cancel_scope.cancel()


def cuts(stream: bytes) -> list[list[bytes]]:
    """``stream`` in one piece, a piece per byte of its first 400 then the rest, and in
    pieces of 7, 13 and 64 bytes (an event, a CR line end, a UTF-8 character split
    between two reads)."""
    return [[stream], [*(stream[at:at + 1] for at in range(400)), stream[400:]],
            *([stream[at:at + size] for at in range(0, len(stream), size)]
              for size in (7, 13, 64))]


async def both_paths(monkeypatch: pytest.MonkeyPatch,
                     ask: Callable[[], Awaitable[Any]]) -> tuple[Any, Any]:
    """What ``ask`` gets with the fast path on (which carried some chunks as their bytes),
    then off."""
    seen = []
    runs: list[int] = []
    add_run = Burst.add_run

    def counted(burst: Burst, run: RawChoices, text: str) -> None:
        runs.append(len(run))
        add_run(burst, run, text)

    monkeypatch.setattr(Burst, "add_run", counted)
    for raw in (True, False):
        monkeypatch.setattr(SseReader, "raw_choices", raw)
        with trio.fail_after(20):
            seen.append(await ask())
        assert bool(runs) is raw
        runs.clear()
    return seen[0], seen[1]


async def post_hi(http: httpx.AsyncClient, *, chat: bool) -> httpx.Response:
    """A streamed ``hi`` through the router, chat or completion; its 200 answer."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": MODEL, "stream": True}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    response = await http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_B8_odd_worker_events_reach_the_client_alike_with_and_without_the_fast_path(
    chat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = Worker()
    stream = odd_stream(chat)
    expected = "a b\U0001f600q\"uote\u2028 cback\\slash dend"
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=10.0)

        def streamed() -> tuple[list[Any], Any]:
            if chat:
                parts = list(client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                    stream_options={"include_usage": True}))
                return ([(p.choices[0].delta.content, p.choices[0].finish_reason)
                         for p in parts if p.choices], parts[-1].usage)
            completions = list(client.completions.create(
                model=MODEL, prompt="hi", stream=True, stream_options={"include_usage": True}))
            return ([(p.choices[0].text, p.choices[0].finish_reason) for p in completions
                     if p.choices], completions[-1].usage)

        async def raw_http() -> list[Any]:
            response = await post_hi(http, chat=chat)
            events = response.content.split(b"\n\n")
            assert events[-2:] == [b"data: [DONE]", b""]
            parsed = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
            return [e["choices"] for e in parsed]

        for pieces in cuts(stream):
            worker.pieces = pieces
            fast, slow = await both_paths(
                monkeypatch, lambda: trio.to_thread.run_sync(streamed))
            assert fast == slow
            texts, usage = fast
            assert "".join(text or "" for text, _ in texts) == expected
            assert [reason for _, reason in texts][-1] == "stop"
            assert usage is not None and usage.completion_tokens == 9
            fast_raw, slow_raw = await both_paths(monkeypatch, raw_http)
            assert fast_raw == slow_raw


@pytest.mark.parametrize("bad", [-5, "7", 2.5, True, None])
async def test_B8_a_usage_count_that_is_no_count_is_counted_by_the_router(bad: Any) -> None:
    # A worker's completion_tokens that is not a non-negative integer is no usage: the
    # router counts the tokens it relayed (as for a decode that sent none) rather than
    # hand the client a negative or mistyped bill; the same for the prompt and cached
    # counts, where the mock prefill's own hold.
    worker = Worker()
    usage = {"prompt_tokens": bad, "completion_tokens": bad, "total_tokens": bad,
             "prompt_tokens_details": {"cached_tokens": bad}}
    worker.pieces = [event(bare(False, "a")), event(bare(False, " b")),
                     event(bare(False, " c", finish_reason="length")),
                     event(orjson.dumps({"choices": [], "usage": usage})),
                     event(b"[DONE]")]
    async with running(worker) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=10.0)
        with trio.fail_after(20):
            answer = await trio.to_thread.run_sync(lambda: client.completions.create(
                model=MODEL, prompt="one two three", max_tokens=3))
            chunks = await trio.to_thread.run_sync(lambda: list(client.completions.create(
                model=MODEL, prompt="one two three", max_tokens=3, stream=True,
                stream_options={"include_usage": True})))
    for counted in (answer.usage, chunks[-1].usage):
        assert counted is not None
        assert (counted.prompt_tokens, counted.completion_tokens,
                counted.total_tokens) == (3, 3, 6)
        assert counted.prompt_tokens_details is not None
        assert counted.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_B8_a_field_of_a_chunk_with_no_choice_goes_on_the_next_one_on_either_path(
    chat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A chunk that carries nothing for the client but a top-level field (here between
    # common chunks the fast path passes on as their bytes) hands the field to the next
    # chunk the client gets, however the reads cut the stream: the fast path gives up its
    # template for that chunk and learns it again after.
    worker = Worker()
    texts = ["a", " b", " c", " d", " e"]
    marked = orjson.dumps({"id": "w", "object": "chat.completion.chunk" if chat
                           else "text_completion", "created": 7, "model": "worker",
                           "choices": [], "x_mark": [7]})
    stream = b"".join([*(event(bare(chat, text)) for text in texts[:3]), event(marked),
                       *(event(bare(chat, text)) for text in texts[3:]),
                       event(bare(chat, " f", finish_reason="stop")), event(b"[DONE]")])
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:

        async def raw_http() -> list[Any]:
            response = await post_hi(http, chat=chat)
            chunks = [orjson.loads(e.removeprefix(b"data: "))
                      for e in response.content.split(b"\n\n") if e.startswith(b"data: {")]
            return [{key: value for key, value in chunk.items() if key not in ("id", "created")}
                    for chunk in chunks]  # (the response's own)

        for pieces in cuts(stream):
            worker.pieces = pieces
            fast, slow = await both_paths(monkeypatch, raw_http)
            assert fast == slow
            assert [chunk.get("x_mark") for chunk in fast] == [None] * 3 + [[7]] + [None] * 2
            choices = [chunk["choices"][0] for chunk in fast]
            assert "".join(choice["delta"]["content"] if chat else choice["text"]
                           for choice in choices) == "a b c d e f"
