"""The relay's reading of a worker's server-sent events (engines/_reader.py SseReader): the
same chunks come out whatever the framing the worker uses (LF, CRLF, CR, comments, ``id:``
and ``event:`` lines, data split over lines) and however its bytes fall into socket reads,
and each read's chunks come out as one burst."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import orjson
import pytest

from trio_disagg import FinishKind
from trio_disagg.engines._chunks import ChunkParser
from trio_disagg.engines._reader import SseReader

Framing = Callable[[bytes], bytes]


def chunk(i: int, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": finish}
    return orjson.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1,
                         "model": "m", "choices": [choice]})


USAGE = orjson.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1,
                      "model": "m", "choices": [],
                      "usage": {"prompt_tokens": 3, "completion_tokens": 5,
                                "total_tokens": 8}})
PAYLOADS = [chunk(i) for i in range(4)] + [chunk(4, "length"), USAGE, b"[DONE]"]


def plain(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def crlf(data: bytes) -> bytes:
    return b"data: " + data + b"\r\n\r\n"


def cr(data: bytes) -> bytes:
    return b"data: " + data + b"\r\r"


def with_comments(data: bytes) -> bytes:
    return b": keep-alive\n\nid: 7\nevent: message\ndata: " + data + b"\n\n"


def no_space(data: bytes) -> bytes:
    return b"data:" + data + b"\n\n"


def two_lines(data: bytes) -> bytes:
    # A JSON value split over two data lines is joined with a line feed: still JSON.
    head, _, tail = data.partition(b",")
    return b"data: " + head + b",\ndata: " + tail + b"\n\n" if tail else plain(data)


def two_lines_crlf(data: bytes) -> bytes:
    return two_lines(data).replace(b"\n", b"\r\n")


def two_lines_cr(data: bytes) -> bytes:
    return two_lines(data).replace(b"\n", b"\r")


FRAMINGS: list[Framing] = [plain, crlf, cr, with_comments, no_space, two_lines,
                           two_lines_crlf, two_lines_cr]


def splits(stream: bytes) -> Iterator[list[bytes]]:
    yield [stream]
    yield [stream[i:i + 1] for i in range(len(stream))]  # a byte per read
    for cut in range(1, len(stream), 7):
        yield [stream[:cut], stream[cut:]]
    rng = random.Random(5)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(stream)), 3))
        yield [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]


def read(reads: list[bytes]) -> tuple[list[str], SseReader]:
    reader = SseReader(ChunkParser())
    texts: list[str] = []
    for part in reads:
        assert reader.feed(part) is None
        output = reader.burst.take()
        if output is not None:
            assert output.choices is not None
            assert output.text == "".join(c["text"] for c in output.choices)
            texts += [c["text"] for c in output.choices]
        if reader.done:
            break
    return texts, reader


@pytest.mark.parametrize("framing", FRAMINGS, ids=lambda f: f.__name__)
def test_the_same_chunks_whatever_the_framing_and_the_reads(framing: Framing) -> None:
    stream = b"".join(framing(payload) for payload in PAYLOADS)
    for reads in splits(stream):
        texts, reader = read(reads)
        assert texts == [" t0", " t1", " t2", " t3"], reads
        # A CR at the very end of what came ends the blank line of [DONE] (an LF after it
        # would be its own): nothing waits for the next read.
        assert reader.done
        final = reader.final
        assert final is not None and final.finish_reason is not None
        assert final.finish_reason.kind is FinishKind.LENGTH
        assert final.choices is not None and final.choices[0]["text"] == " t4"
        assert final.completion_usage is not None
        assert final.completion_usage.completion_tokens == 5


def test_one_read_is_one_burst_with_each_chunk_kept() -> None:
    reader = SseReader(ChunkParser())
    assert reader.feed(b"".join(plain(chunk(i)) for i in range(3)) + b"data: {\"id\"") is None
    output = reader.burst.take()
    assert output is not None and output.text == " t0 t1 t2"
    assert output.choices is not None and [c["text"] for c in output.choices] == [
        " t0", " t1", " t2"]
    assert reader.burst.take() is None  # taken: nothing until the next read
    assert reader.feed(b':"x","choices":[{"index":0,"text":" t3"}]}\n\n') is None
    output = reader.burst.take()
    assert output is not None and output.text == " t3"  # the event the two reads made


@pytest.mark.parametrize(("event", "problem"), [
    (b"data: {not json\n\n", "sent a malformed chunk"),
    (b"data: [1, 2]\n\n", "sent a chunk that is not an object"),
    (b'data: {"error": {"message": "boom"}}\n\n', "reported an error: boom"),
    (b'data: {"object": "error", "message": "kv gone"}\n\n', "reported an error: kv gone"),
])
def test_a_bad_event_stops_the_reading_after_the_chunks_before_it(
    event: bytes, problem: str
) -> None:
    reader = SseReader(ChunkParser())
    found = reader.feed(plain(chunk(0)) + event + plain(chunk(1)))
    assert found is not None and found.startswith(problem)
    output = reader.burst.take()  # what came before it is still relayed
    assert output is not None and output.text == " t0"
