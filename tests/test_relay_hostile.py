"""The faithful relay (B8) against a hostile or quirky worker's chunks: fields whose kind
changes from one chunk to the next, tool calls with keys the router does not know, and
streams of many field-only chunks. A socket worker (``test_relay_adversary.Worker``)
sends the bytes; the client reads what the router relays on a real port."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import orjson
import pytest
import trio
from test_relay_adversary import MODEL, Worker, event, read_request, running
from test_relay_fidelity import MESSAGES, chunk

from trio_disagg import ChunkChoice, DisaggRouter, TransferKeeper, WorkerPool
from trio_disagg.engines import LatencyModel, VllmEngine, WorkerClient, mock_cluster
from trio_disagg.engines._chunks import ChunkParser
from trio_disagg.engines._reader import EVENT_BYTES_LIMIT, SseReader
from trio_disagg.server import create_app, serve
from trio_disagg.server._collect import ChoiceCollector
from trio_disagg.server._openai_responses import ChunkEncoder, completion_response


def delta_chunks(deltas: list[dict[str, Any]], finish: str = "stop") -> list[bytes]:
    """A chat stream of ``deltas`` (the last one with ``finish``), then ``[DONE]``."""
    last = len(deltas) - 1
    return [*(chunk(True, {"index": 0, "delta": delta,
                           "finish_reason": finish if at == last else None})
              for at, delta in enumerate(deltas)), event(b"[DONE]")]


async def test_B8_a_delta_field_that_changes_kind_is_collected_as_last_sent() -> None:
    # A delta field the router does not know that is a string in one chunk and a list
    # (or an object) in the next is no fragment any more: a client that did not stream
    # gets it as last sent, never a 500 from joining a list's items as text.
    worker = Worker()
    cases: list[tuple[list[Any], Any]] = [
        (["ab", [1, "c"]], [1, "c"]),
        (["ab", {"k": 1}], {"k": 1}),
        ([[1], "ab", "cd"], "abcd"),
        (["ab", None, "cd"], "abcd"),
    ]
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        for values, expected in cases:
            worker.pieces = delta_chunks([{"content": "x", "x_kind": value}
                                          for value in values])
            with trio.fail_after(20):
                response = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": MESSAGES})
            assert response.status_code == 200, (values, response.text)
            message = response.json()["choices"][0]["message"]
            assert message["content"] == "x" * len(values)
            assert message["x_kind"] == expected, values
            with trio.fail_after(20):
                streamed = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": MESSAGES, "stream": True})
            deltas = [orjson.loads(e.removeprefix(b"data: "))["choices"][0]["delta"]
                      for e in streamed.content.split(b"\n\n") if e.startswith(b"data: {")]
            assert [delta.get("x_kind") for delta in deltas] == values


def test_B8_fields_of_many_chunks_without_a_choice_gather_in_linear_time() -> None:
    # A worker may send chunk after chunk with no choice to relay but a field of its own
    # (before the finish: they wait for the next choice; after it: they go with the
    # finish). The fields gather in one dict, updated in place: a copy per chunk would
    # cost such a stream time quadratic in its length (seconds for a few thousand).
    count = 3000
    parser = ChunkParser()
    reader = SseReader(parser)
    waiting = [b"data: " + orjson.dumps({"choices": [], f"x_{at}": at}) + b"\n\n"
               for at in range(count)]
    assert reader.feed(waiting[0]) is None
    gathering = parser.pending
    for data in waiting[1:]:
        assert reader.feed(data) is None
        assert parser.pending is gathering  # the same dict, never a copy
    finish = {"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]}
    assert reader.feed(b"data: " + orjson.dumps(finish) + b"\n\n") is None
    assert reader.final is not None and reader.final.choices
    choice = reader.final.choices[0]
    assert type(choice) is ChunkChoice and choice.fields == {
        f"x_{at}": at for at in range(count)}
    after = choice.fields
    for at in range(count):
        late = b"data: " + orjson.dumps({"choices": [], f"y_{at}": at}) + b"\n\n"
        assert reader.feed(late) is None
        last = reader.final.choices[0]
        assert type(last) is ChunkChoice and last.fields is after  # the same, no copy
    assert len(after) == 2 * count
    assert list(after)[-1] == f"y_{count - 1}"  # in the order sent


async def test_B8_a_tool_calls_own_fields_reach_a_client_that_did_not_stream() -> None:
    # A tool call's delta may carry fields the router does not know, beside its id,
    # type and function (and in its function, beside name and arguments): a newer
    # worker's, or a provider's own. A client that did not stream gets them in its
    # answer's tool call, collected as a choice's other fields are (a list concatenated,
    # anything else as last sent), not only the four the router merges itself.
    first = {"index": 0, "id": "call_1", "type": "function", "x_origin": "parser",
             "x_spans": [1], "function": {"name": "f", "arguments": "{", "x_strict": True}}
    later = {"index": 0, "x_spans": [2], "function": {"arguments": "}"}}
    worker = Worker()
    worker.pieces = delta_chunks([{"role": "assistant", "content": None},
                                  {"tool_calls": [first]}, {"tool_calls": [later]}],
                                 "tool_calls")
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        with trio.fail_after(20):
            response = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": MESSAGES})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"] == [{
        "id": "call_1", "type": "function", "x_origin": "parser", "x_spans": [1, 2],
        "function": {"name": "f", "arguments": "{}", "x_strict": True}}]


@pytest.mark.parametrize("include_usage", [False, True])
def test_B8_a_chunk_choice_an_engine_made_never_breaks_or_rewrites_the_envelope(
    include_usage: bool
) -> None:
    # An in-process engine may make its own ChunkChoice (the type is public): one with no
    # field, or with a field named as one of the router's own (id, model, usage, ...).
    # Each streamed chunk stays one valid JSON object with the router's envelope, and a
    # collected answer keeps the router's id, model and usage.
    encoder = ChunkEncoder(chat=True, response_id="chatcmpl-r", model="m", created=1,
                           include_usage=include_usage)
    collector = ChoiceCollector(chat=True)
    choices = [ChunkChoice({"index": 0, "delta": {"content": "a"}}, {}),
               ChunkChoice({"index": 0, "delta": {"content": "b"}},
                           {"id": "w", "model": "other", "usage": 5, "x_own": 1})]
    for choice in choices:
        event = encoder.choice(choice)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        payload = event.removeprefix(b"data: ").removesuffix(b"\n\n")
        assert (payload.count(b'"id"'), payload.count(b'"usage"')) == (
            1, 1 if include_usage else 0), payload
        chunk_sent = orjson.loads(payload)
        assert (chunk_sent["id"], chunk_sent["model"]) == ("chatcmpl-r", "m")
        collector.add(choice)
    assert choices[1].fields == {"x_own": 1}
    answer = orjson.loads(completion_response(
        chat=True, response_id="chatcmpl-r", model="m", created=1, text="",
        finish_reason="stop", usage={"completion_tokens": 2}, choice=collector.choice("stop"),
        fields=collector.fields))
    assert (answer["id"], answer["model"], answer["usage"], answer["x_own"]) == (
        "chatcmpl-r", "m", {"completion_tokens": 2}, 1)
    assert answer["choices"][0]["message"]["content"] == "ab"


class Tolerant(Worker):
    """A :class:`Worker` the router may stop reading (after what it could not relay)."""

    async def handle(self, stream: trio.SocketStream) -> None:
        # the router may close the connection: its right, once it gave up
        with contextlib.suppress(trio.BrokenResourceError):
            await super().handle(stream)


async def post_chat(http: httpx.AsyncClient, *, stream: bool) -> httpx.Response:
    with trio.fail_after(20):
        return await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "stream": stream})


def worker_error(response: httpx.Response, *, stream: bool) -> dict[str, Any] | None:
    """The worker's error as the client got it: a 502's, or (once a stream started) its
    last event's; None for a stream that ended without one."""
    if stream and response.status_code == 200:  # (else a 502: nothing went out)
        events = response.content.split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        last: dict[str, Any] = orjson.loads(events[-3].removeprefix(b"data: "))
        return last.get("error")
    assert response.status_code == 502, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


@pytest.mark.parametrize("where", ["top", "delta"])
async def test_B8_a_field_nested_too_deep_to_relay_is_the_workers_error(where: str) -> None:
    # JSON nested 300 deep parses (orjson reads up to 1024 levels) but cannot be written
    # again (orjson writes up to 255): the client gets a 502 naming the worker's chunk
    # (an error event once the stream started), never an internal error of the router's;
    # or, streamed, the chunk as the worker sent it, where the router relays its bytes.
    worker = Tolerant()
    if where == "top":
        odd = event(orjson.dumps({"id": "w", "object": "chat.completion.chunk",
                                  "created": 7, "model": "worker", "choices": [
                                      {"index": 0, "delta": {"content": "b"}}]})[:-1]
                    + b',"x_deep":' + b"[" * 300 + b"]" * 300 + b"}")
    else:
        odd = chunk(True, {"index": 0, "delta": {"content": "b", "x_deep": "@@"}}).replace(
            b'"@@"', b"[" * 300 + b"]" * 300)
    first = chunk(True, {"index": 0, "delta": {"content": "a"}, "finish_reason": None})
    worker.pieces = [b"".join([first, odd, *delta_chunks([{"content": "c"}])])]
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        for stream in (False, True):
            response = await post_chat(http, stream=stream)
            error = worker_error(response, stream=stream)
            if error is None:  # relayed as its bytes: as the worker sent it
                events = response.content.split(b"\n\n")
                sent = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
                assert where == "delta"
                assert b'"x_deep":' + b"[" * 300 + b"]" * 300 in events[1]
                assert "".join(e["choices"][0]["delta"]["content"] for e in sent) == "abc"
                continue
            assert (error["type"], error["code"]) == ("upstream_error", "worker_error"), error
            assert "nested" in error["message"]


async def test_B8_an_error_object_nested_too_deep_to_quote_is_still_the_workers_error(
) -> None:
    # vLLM sends {"error": {...}} mid-stream when a request fails; a worker whose error
    # object has no message to quote is quoted whole, but one nested deeper than orjson
    # writes cannot be: the client still gets the worker's error (a 502, or an error
    # event after what went out), not the router's own crash.
    worker = Tolerant()
    first = chunk(True, {"index": 0, "delta": {"content": "a"}, "finish_reason": None})
    error = event(b'{"error":' + b"[" * 300 + b"]" * 300 + b"}")
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        for stream in (False, True):
            worker.pieces = [b"".join([first, error, event(b"[DONE]")])]
            found = worker_error(await post_chat(http, stream=stream), stream=stream)
            assert found is not None
            assert (found["type"], found["code"]) == ("upstream_error", "worker_error"), found
            assert "reported an error" in found["message"]


async def test_B8_a_request_nested_deeper_than_the_router_writes_is_a_400() -> None:
    # The router reads a body orjson reads (1024 levels), but sends it on to a worker
    # written again (255): a client's field nested 300 deep is the client's 400 at the
    # edge, not a prefill "crashed" 502; one nested 150 deep goes on as sent.
    worker = Tolerant()
    worker.pieces = delta_chunks([{"content": "a"}])
    head = orjson.dumps({"model": MODEL, "messages": MESSAGES})[:-1]
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        for depth, status in ((300, 400), (150, 200)):
            for stream in (b"false", b"true"):
                body = (head + b',"stream":' + stream + b',"x_deep":' + b"[" * depth
                        + b"]" * depth + b"}")
                with trio.fail_after(20):
                    response = await http.post("/v1/chat/completions", content=body,
                                               headers={"content-type": "application/json"})
                assert response.status_code == status, response.text
                if status == 400:
                    error = response.json()["error"]
                    assert (error["type"], error["code"]) == (
                        "invalid_request_error", "invalid_json")
                    assert "nested" in error["message"]


@pytest.mark.parametrize("first", [False, True], ids=["at-once", "after-a-token"])
async def test_B8_a_chunk_with_a_second_choice_is_the_workers_error(first: bool) -> None:
    # The router asks each worker for one choice (n and best_of > 1 are refused): a
    # chunk with two is the worker's fault. The client gets the worker's error (a 502,
    # or an error event after what went out), never the first choice with the second
    # dropped without a word; streamed or collected, on either path.
    worker = Tolerant()
    two = chunk(True, {"index": 0, "delta": {"content": "b"}}).replace(
        b"}]", b'},{"index":1,"delta":{"content":"x"}}]', 1)
    head = [chunk(True, {"index": 0, "delta": {"content": "a"}, "finish_reason": None})
            ] if first else []
    worker.pieces = [b"".join([*head, two, *delta_chunks([{"content": "c"}])])]
    async with running(worker) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        for stream in (False, True):
            found = worker_error(await post_chat(http, stream=stream), stream=stream)
            assert found is not None
            assert (found["type"], found["code"]) == ("upstream_error", "worker_error"), found
            assert "2 choices" in found["message"]


def test_B8_an_event_that_never_ends_is_read_in_linear_time_and_bounded() -> None:
    # A broken worker that sends line after line and never the blank line that ends an
    # event: each read is held, not joined to all before it (that cost a few thousand
    # reads seconds of the router's one thread), and past EVENT_BYTES_LIMIT the stream
    # is the worker's error, not the router's memory.
    reader = SseReader(ChunkParser())
    assert reader.feed(chunk(False, {"index": 0, "text": "a"})) is None
    line = b"data: " + b"x" * 1017 + b"\n"  # 1 KiB
    problem = None
    reads = 0
    while problem is None:
        reads += 1
        problem = reader.feed(line * 64)
        assert reads * 64 * 1024 <= EVENT_BYTES_LIMIT + 64 * 1024
    assert reads * 64 * 1024 > EVENT_BYTES_LIMIT
    assert problem == f"sent an event of more than {EVENT_BYTES_LIMIT} bytes"
    # an event that ends in time is read whole, whatever the reads its lines came in
    # (a data line each: lines are joined by LF, whitespace between JSON's tokens)
    reader = SseReader(ChunkParser())
    lines = [b'{"choices":[{"index":0,"text":"long","finish_reason":null}]',
             *(b',"x_%d":"%s"' % (at, b"y" * 90) for at in range(50)), b"}"]
    for line in lines:
        assert reader.feed(b"data: " + line + b"\n") is None
    assert reader.feed(b"\r\n") is None  # the blank line, CRLF after LF line ends
    output = reader.burst.take()
    assert output is not None and output.text == "long"
    assert output.choices is not None
    choice = output.choices[0]
    assert type(choice) is ChunkChoice and choice.fields["x_49"] == "y" * 90


class WholeAnswer(Worker):
    """A vLLM worker on a real socket that answers every request with one whole JSON
    answer (:attr:`answer`), as a worker asked for no stream does, then closes."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__()
        self.answer = answer

    async def handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            if not await read_request(stream):
                return
            body = orjson.dumps(self.answer)
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))


def two_choice_answer() -> dict[str, Any]:
    """A whole chat answer that ends the request (S7) with two choices."""
    return {"id": "w", "object": "chat.completion", "created": 7, "model": "worker",
            "choices": [{"index": at, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": "stop"}
                        for at, text in enumerate(["first", "second"])],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}


@asynccontextmanager
async def prefill_worker(worker: Worker) -> AsyncIterator[str]:
    """The router on a real port, its prefill the socket worker's (read by the vLLM
    adapter), its decode the mock's."""
    cluster = mock_cluster(latency=LatencyModel.zero())
    async with trio.open_nursery() as nursery, WorkerClient() as client:
        listeners = await nursery.start(partial(trio.serve_tcp, worker.handle, 0,
                                                host="127.0.0.1"))
        url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        async with TransferKeeper(drain_window=5.0) as keeper:
            router = DisaggRouter(WorkerPool([VllmEngine(url, "prefill", client=client)]),
                                  WorkerPool([cluster.decode[0]]), keeper)
            async with trio.open_nursery() as inner:
                stop = trio.Event()
                port = await inner.start(partial(
                    serve, create_app(router, models=[MODEL]), host="127.0.0.1", port=0,
                    shutdown_trigger=stop.wait))
                yield f"http://127.0.0.1:{port}"
                stop.set()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_B8_S7_a_whole_answer_with_a_second_choice_is_the_workers_error(
        role: str) -> None:
    # As for a streamed chunk: a prefill that answered the request whole (S7) or a
    # decode that answered with JSON where a stream was asked for, with two choices, is
    # the worker's fault. The client gets the worker's error (a prefill's is a
    # prefill_failed), never the first choice with the second dropped without a word;
    # streamed or not.
    worker = WholeAnswer(two_choice_answer())
    serving = prefill_worker(worker) if role == "prefill" else running(worker)
    code = "prefill_failed" if role == "prefill" else "worker_error"
    async with serving as url, httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        for stream in (False, True):
            found = worker_error(await post_chat(http, stream=stream), stream=stream)
            assert found is not None
            assert (found["type"], found["code"]) == ("upstream_error", code), found
            assert "2 choices" in found["message"] and role in found["message"]
