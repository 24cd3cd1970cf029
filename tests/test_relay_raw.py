"""The relay's fast path on bytes (B8, docs/performance.md): the worker's common chunk is
neither parsed nor re-encoded, its choice's bytes go to the client as sent, and the client
sees exactly what the parsed path gives it.

The reader (engines/_reader.py ``SseReader``) is checked on scripted worker streams; the
server on a real port, a :class:`~trio_disagg.engines.VllmEngine` decode whose worker is
an in-memory transport answering a scripted stream (after the in-process mock decode
pulled the KV), and raw httpx and the ``openai`` client.
"""

from __future__ import annotations

import json
import operator
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, cast

import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import openai
import orjson
import pytest
import trio
from engine_support import StandIn, run_to_its_end

from trio_disagg import (
    Annotated,
    DisaggRouter,
    LLMEngineOutput,
    PreprocessedRequest,
    RawChoice,
    RawChoices,
    RequestContext,
    TransferKeeper,
    WorkerPool,
    to_wire,
)
from trio_disagg.engines import (
    LatencyModel,
    MockCluster,
    VllmEngine,
    _raw,
    _reader,
    mock_cluster,
)
from trio_disagg.engines._burst import Burst
from trio_disagg.engines._chunks import ChunkParser
from trio_disagg.engines._raw import RunReader, learn_template
from trio_disagg.engines._reader import SseReader
from trio_disagg.server import OpenAIApp, create_app, serve
from trio_disagg.server._openai_responses import ChunkEncoder

MODEL = "mock-model"
Choice = dict[str, Any]


def envelope(chat: bool, created: int = 1000) -> dict[str, Any]:
    return {"id": "cmpl-w", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": "worker-model"}


def text_choice(text: str, **more: Any) -> Choice:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": None,
            "stop_reason": None, **more}


def delta_choice(delta: dict[str, Any], **more: Any) -> Choice:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **more}


def event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def chunk(chat: bool, *choices: Choice, created: int = 1000, **top: Any) -> bytes:
    return event(orjson.dumps({**envelope(chat, created), "choices": list(choices), **top}))


def finish(chat: bool, reason: str = "stop") -> bytes:
    last = (delta_choice({}, finish_reason=reason) if chat
            else text_choice("", finish_reason=reason))
    return chunk(chat, last)


def usage(chat: bool, completion: int) -> bytes:
    return chunk(chat, usage={"prompt_tokens": 5, "completion_tokens": completion,
                              "total_tokens": 5 + completion})


DONE = event(b"[DONE]")

#: Texts the byte checks must not be fooled by: quotes, backslashes, unicode, and the
#: very patterns the reader looks for.
TRICKY = ["caf\u00e9 \u2603 \U0001f600", 'say "hi"', "back\\slash\\", '"finish_reason":null',
          ',"finish_reason":null}]}', '"choices":[{"index":0,', '"token_ids":[1]', "\n\t\u0000",
          "}]}", "data: [DONE]", "{index:0,text:\u00e9", "\u00a0\u2028"]


def completions_stream(texts: list[str], **more: Any) -> bytes:
    return (b"".join(chunk(False, text_choice(text, **more)) for text in texts)
            + finish(False, "length") + usage(False, len(texts)) + DONE)


def chat_stream(texts: list[str], **more: Any) -> bytes:
    role = chunk(True, delta_choice({"role": "assistant", "content": ""}))
    return (role + b"".join(chunk(True, delta_choice({"content": text}, **more))
                            for text in texts)
            + finish(True) + usage(True, len(texts)) + DONE)


def spaced(stream: bytes) -> bytes:
    """``stream`` as a worker that writes a space after a choice's separators writes it:
    the same JSON, other bytes than the router's own encoder writes."""
    return stream.replace(b',"logprobs":null,"finish_reason":null',
                          b', "logprobs": null, "finish_reason": null')


def plain(text: str) -> bool:
    """Whether ``text`` is written in JSON as it is (no escape): the fast path's text."""
    return not any(c in '"\\' or ord(c) < 0x20 for c in text)


def reads_of(stream: bytes) -> Iterator[list[bytes]]:
    """The stream in one read, an event per read, and cut in odd places."""
    yield [stream]
    yield [e + b"\n\n" for e in stream[:-2].split(b"\n\n")]
    yield [stream[i:i + 37] for i in range(0, len(stream), 37)]


class ParsingReader(SseReader):
    """The reader with the fast path off: every chunk parsed."""

    raw_choices = False


class Read:
    """What the reader made of a stream: the outputs, in order, and the final one."""

    def __init__(self, reads: list[bytes], *, raw: bool) -> None:
        reader = (SseReader if raw else ParsingReader)(ChunkParser())
        self.outputs: list[LLMEngineOutput] = []
        for part in reads:
            assert reader.feed(part) is None
            if (output := reader.burst.take()) is not None:
                self.outputs.append(output)
        assert reader.done and reader.final is not None
        self.final = reader.final

    @property
    def choices(self) -> list[Any]:
        return [c for output in self.outputs for c in output.choices or ()]

    @property
    def raw(self) -> list[RawChoice]:
        return [c for c in self.choices if type(c) is RawChoice]


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The bytes of every RawChoice parsed, in order."""
    parsed: list[bytes] = []
    real = RawChoice._parse

    def counted(self: RawChoice) -> dict[str, Any]:
        if self._parsed is None:
            parsed.append(self.raw)
        return real(self)

    monkeypatch.setattr(RawChoice, "_parse", counted)
    return parsed


def assert_same_as_parsed(stream: bytes, fast: Read) -> None:
    """The fast read equals the parsed one: each choice (as a mapping), each output's
    text, token ids and usage, and the final output."""
    slow = Read([stream], raw=False)
    assert not slow.raw
    assert [dict(c) for c in fast.choices] == slow.choices
    assert "".join(o.text or "" for o in fast.outputs) == "".join(
        o.text or "" for o in slow.outputs)
    assert [o.token_ids for o in fast.outputs if o.token_ids] == [
        o.token_ids for o in slow.outputs if o.token_ids]
    assert fast.final == slow.final and fast.final.choices == slow.final.choices


def raw_bytes(choices: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """The bytes of ``choices``, each a :class:`RawChoice`."""
    assert all(type(choice) is RawChoice for choice in choices), choices
    return [cast(RawChoice, choice).raw for choice in choices]


def choice_bytes(stream: bytes) -> list[bytes]:
    """Each event's ``choices[0]`` bytes, as the worker wrote them (the scripts write one
    choice per chunk)."""
    found = []
    for data in stream[:-2].split(b"\n\n"):
        start = data.find(b'"choices":[{')
        if start >= 0:
            found.append(data[start + 11:data.rindex(b"]")])
    return found


# --- the reader ------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_common_chunk_is_carried_as_its_bytes(chat: bool, parses: list[bytes]) -> None:
    texts = [f" w{i}" for i in range(6)] + TRICKY
    stream = chat_stream(texts) if chat else completions_stream(texts)
    for reads in reads_of(stream):
        fast = Read(reads, raw=True)
        # every content chunk is carried as sent, byte for byte (the first, which
        # taught the template, too), but those whose text has an escape in JSON
        content = choice_bytes(stream)[chat:chat + len(texts)]
        assert [c.raw for c in fast.raw] == [
            sent for sent, text in zip(content, texts, strict=True) if plain(text)]
        assert parses == []  # nothing read them
        assert_same_as_parsed(stream, fast)  # reading them now gives the parsed answer
        parses.clear()


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_an_outputs_text_comes_from_the_bytes_without_a_parse(
    chat: bool, parses: list[bytes]
) -> None:
    texts = ["a", "b\u00e9", 'c"', "d"]
    stream = chat_stream(texts) if chat else completions_stream(texts)
    fast = Read([stream], raw=True)
    (output,) = fast.outputs
    # 'c"' was parsed (a quote), the others were not ("a" taught the template, and is
    # carried as its bytes too)
    assert output.choices is not None
    assert [type(c) for c in output.choices] == [RawChoice, RawChoice, dict, RawChoice]
    assert output.text == "ab\u00e9c\"d"  # in order, parsed and unparsed alike
    assert parses == []  # the plain text's bytes are its value: no parse for it
    assert to_wire(output)["text"] == "ab\u00e9c\"d"


def test_logprobs_and_reasoning_ride_along_in_the_bytes() -> None:
    logprobs = {"content": [{"token": "x", "logprob": -0.25, "bytes": [120],
                             "top_logprobs": [{"token": "x", "logprob": -0.25,
                                               "bytes": [120]}]}]}
    texts = ["x", "y", "z"]
    stream = chat_stream(texts, logprobs=logprobs)
    fast = Read([stream], raw=True)
    assert len(fast.raw) == 3
    assert_same_as_parsed(stream, fast)
    both = (chunk(True, delta_choice({"content": "a", "reasoning_content": "because"}))
            * 3 + finish(True) + DONE)
    fast = Read([both], raw=True)
    assert len(fast.raw) == 3 and fast.raw[0]["delta"]["reasoning_content"] == "because"
    assert_same_as_parsed(both, fast)
    completion_lp = {"tokens": ["x"], "token_logprobs": [-0.5], "top_logprobs": [{"x": -0.5}],
                     "text_offset": [0]}
    stream = completions_stream(texts, logprobs=completion_lp)
    fast = Read([stream], raw=True)
    assert len(fast.raw) == 3
    assert_same_as_parsed(stream, fast)


def test_anything_unusual_is_parsed() -> None:
    tool = delta_choice({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                         "function": {"name": "f", "arguments": "{}"}}]})
    unusual = [
        chunk(True, tool),  # no content first
        chunk(True, delta_choice({"content": ""})),  # empty content
        chunk(False, {**text_choice("a"), "index": 2}),  # another index
        chunk(False, text_choice("a", token_ids=[5])),  # token ids are counted
        chunk(False, text_choice("a"), usage={"prompt_tokens": 1, "completion_tokens": 1,
                                              "total_tokens": 2}),
        chunk(False, text_choice("a"), system_fingerprint="fp"),  # more after choices
        # a "choices" key before the chunk's own
        event(orjson.dumps({**envelope(False), "meta": {"choices": [{"index": 0, "text": "x"}]},
                            "choices": [text_choice("a")]})),
        # the template's bytes around other fields than a text: their quotes tell
        chunk(False, {"index": 0, "text": "x", "token_ids": [5, 6], "s": "",
                      "logprobs": None, "finish_reason": None, "stop_reason": None}),
    ]
    for data in unusual:
        chat = b"chat.completion.chunk" in data
        learned = chunk(chat, delta_choice({"content": "x"}) if chat else text_choice("x"))
        stream = learned + data + learned + (finish(chat) + DONE)
        fast = Read([stream], raw=True)
        assert [c.raw for c in fast.raw] == choice_bytes(learned) * 2, data
        assert_same_as_parsed(stream, fast)


def test_sglang_chat_deltas_take_the_fast_path() -> None:
    """SGLang writes every chat delta after its role-only first chunk with ``"role":null``
    before the content (and other null fields after it): its stream's chunks are common
    chunks all the same, relayed as sent, and the client's bytes are the parsed path's
    (the first delta's role set to ``assistant`` by the encoder). They were all parsed."""
    def sglang(text: str) -> dict[str, Any]:
        return delta_choice({"role": None, "content": text, "reasoning_content": None,
                             "tool_calls": None})

    texts = ["Hel", "lo", " wor", "ld", "!"]
    stream = (chunk(True, delta_choice({"role": "assistant", "content": ""}))
              + b"".join(chunk(True, sglang(text)) for text in texts)
              + finish(True) + DONE)
    fast = Read([stream], raw=True)
    assert [c.raw for c in fast.raw] == [
        orjson.dumps(sglang(text)) for text in texts]
    assert_same_as_parsed(stream, fast)
    # a "content" key inside another field before the delta's own: parsed, not learned
    nested = delta_choice({"tool_calls": [{"content": "x"}], "content": "y"})
    stream = chunk(True, nested) * 3 + finish(True) + DONE
    fast = Read([stream], raw=True)
    assert fast.raw == []
    assert_same_as_parsed(stream, fast)


def test_usage_in_every_chunk_takes_the_parsed_path_and_null_usage_does_not() -> None:
    def every(usage: Any) -> bytes:
        return b"".join(chunk(False, text_choice(f"t{i}"), usage=usage) for i in range(4)) + (
            finish(False) + DONE)

    counts = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert Read([every(counts)], raw=True).raw == []
    assert len(Read([every(None)], raw=True).raw) == 4
    assert_same_as_parsed(every(counts), Read([every(counts)], raw=True))
    assert_same_as_parsed(every(None), Read([every(None)], raw=True))


def test_null_token_ids_in_every_chunk_take_the_fast_path() -> None:
    stream = (b"".join(chunk(False, text_choice(f"t{i}", token_ids=None)) for i in range(4))
              + finish(False) + DONE)
    fast = Read([stream], raw=True)
    assert len(fast.raw) == 4
    assert_same_as_parsed(stream, fast)


def test_a_created_that_changes_costs_one_parsed_chunk() -> None:
    stream = (b"".join(chunk(False, text_choice(f"a{i}"), created=1000) for i in range(3))
              + b"".join(chunk(False, text_choice(f"b{i}"), created=1001) for i in range(3))
              + finish(False) + DONE)
    fast = Read([stream], raw=True)
    # b0 is parsed to learn the new template, then carried as its bytes as a0 was
    assert [c["text"] for c in fast.raw] == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert_same_as_parsed(stream, fast)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_whose_every_chunk_is_another_stops_learning_templates(
    chat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With logprobs (or an id per chunk) every chunk differs from the one before outside
    its text: each taught a template that no chunk used, and a stream cost 3.5 to 5 times
    the parsed path (14 us a chunk against 4). After a few templates in a row that
    carried nothing, the stream is parsed, and the client gets the same; a template that
    carries chunks (a created that ticks over) is learned again as often as it comes."""
    learned: list[bytes] = []
    learn = learn_template

    def counted_learn(data: bytes, chunk: dict[str, Any]) -> Any:
        learned.append(data)
        return learn(data, chunk)

    monkeypatch.setattr(_reader, "learn_template", counted_learn)
    many = 200

    def logprobs(i: int) -> dict[str, Any]:
        return {"content": [{"token": f" w{i}", "logprob": -i / 100, "top_logprobs": []}]}

    reads = [chunk(chat, content(chat, f" w{i}", logprobs=logprobs(i))) for i in range(many)]
    reads.append(finish(chat) + DONE)
    fast = Read(reads, raw=True)
    assert len(learned) <= 8 and len(fast.raw) <= 8
    assert_same_as_parsed(b"".join(reads), fast)
    learned.clear()
    ticks = [b"".join(chunk(chat, content(chat, f" w{i}"), created=i // 4) for i in range(many))
             + finish(chat) + DONE]
    fast = Read(ticks, raw=True)
    assert len(learned) == many // 4 and len(fast.raw) == many
    assert_same_as_parsed(ticks[0], fast)


def test_an_error_object_is_never_carried() -> None:
    learned = chunk(False, text_choice("x"))
    for error in ({"error": {"message": "boom"}}, {"object": "error", "message": "boom"},
                  {**envelope(False), "error": "boom", "choices": [text_choice("y")]},
                  {**envelope(False), "object": "error", "message": "boom",
                   "choices": [text_choice("y")]}):
        reader = SseReader(ChunkParser())
        assert reader.feed(learned * 2) is None
        assert reader.feed(event(orjson.dumps(error))) == "reported an error: boom"
        output = reader.burst.take()
        assert output is not None and output.choices is not None
        assert raw_bytes(output.choices) == choice_bytes(learned) * 2


def test_a_malformed_text_is_never_carried() -> None:
    """A chunk is carried unparsed only if it is valid JSON: a text with a bad escape, a
    control character or bytes that are not UTF-8 is parsed, and reported."""
    learned = chunk(False, text_choice("x"))
    for text in (b"b\\q", b"a\x01b", b"\xff\xfe", b"tail\\", b"\xc3"):
        bad = learned.replace(b'"text":"x"', b'"text":"' + text + b'"')
        reader = SseReader(ChunkParser())
        problem = reader.feed(learned + bad)
        assert problem is not None and problem.startswith("sent a malformed chunk"), text
        output = reader.burst.take()
        assert output is not None and output.choices is not None
        assert raw_bytes(output.choices) == choice_bytes(learned)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_key_the_worker_writes_twice_means_its_last_value_on_the_fast_path_too(
    chat: bool
) -> None:
    """JSON keeps the last of two keys: a chunk whose first ``text`` (``content``) or
    ``index`` a second one overrides teaches no template, so the output's text is the
    one the chunk means and the client's choice has ``index`` 0, as parsed."""
    head = orjson.dumps({**envelope(chat), "choices": []})[:-2]
    texts = (b'{"index":0,"delta":{"content":"%s","content":"kept"},"finish_reason":null}'
             if chat else b'{"index":0,"text":"%s","text":"kept","finish_reason":null}')
    index = (b'{"index":0,"delta":{"content":"%s"},"finish_reason":null,"index":1}'
             if chat else b'{"index":0,"text":"%s","finish_reason":null,"index":1}')
    encoder = partial(ChunkEncoder, chat=chat, response_id="r", model=MODEL, created=1,
                      include_usage=False)
    for shape, text in ((texts, "kept" * 3), (index, "abc")):
        stream = b"".join(event(head + shape % sent + b"]}") for sent in (b"a", b"b", b"c"))
        stream += finish(chat) + DONE
        for reads in reads_of(stream):
            fast = Read(reads, raw=True)
            assert fast.raw == []
            assert "".join(o.text or "" for o in fast.outputs) == text
            assert_same_as_parsed(stream, fast)
            chunks = encoder().choices(fast.choices[1:])
            assert [orjson.loads(e[6:])["choices"][0]["index"] for e in chunks] == [0, 0]


def test_a_chat_chunk_with_a_text_too_has_the_text_the_parsed_path_reads() -> None:
    """A chunk's text is its choice's ``text`` when it has one, chat or not: a chat
    choice that has one besides its ``delta.content`` teaches no template, whose text
    would be the content."""
    stream = b"".join(chunk(True, delta_choice({"content": text}, text="T"))
                      for text in "abc") + finish(True) + DONE
    for reads in reads_of(stream):
        fast = Read(reads, raw=True)
        assert fast.raw == []
        assert "".join(o.text or "" for o in fast.outputs) == "TTT"
        assert_same_as_parsed(stream, fast)


def test_nothing_after_the_finish_is_carried() -> None:
    learned = chunk(False, text_choice("x"))
    stream = learned * 2 + finish(False) + learned + usage(False, 2) + DONE
    fast = Read([stream], raw=True)
    assert len(fast.choices) == 2 and len(fast.raw) == 2
    assert fast.final.completion_usage is not None
    assert_same_as_parsed(stream, fast)


def test_B8_nothing_after_a_finish_written_in_the_templates_bytes_is_carried() -> None:
    """A worker that leaves ``finish_reason`` out of its common chunks writes its finish
    as the template around a text with quotes (``end","finish_reason":"stop``): it is
    read on its own between two runs, and the common chunks after it in the same read
    are not relayed (they were, after the finish, with their text in the answer)."""
    def bare(text: str, **more: Any) -> bytes:
        return chunk(False, {"index": 0, "text": text, **more})

    last = bare("end", finish_reason="stop")
    stream = (bare("a") + bare("b") + last + bare("late") + bare("later") + usage(False, 3)
              + DONE)
    for reads in ([stream], [bare("a"), stream[len(bare("a")):]]):
        fast = Read(reads, raw=True)
        assert "".join(o.text or "" for o in fast.outputs) == "ab"
        assert fast.final.text == "end" and fast.final.completion_usage is not None
        assert_same_as_parsed(stream, fast)


def test_B8_a_line_without_a_field_is_not_read_as_a_chunk_on_the_fast_path() -> None:
    """A chunk whose data lines are joined inside its envelope (``{"id":"w",`` LF
    ``"choices":...``) teaches a template with a line feed in it; a later event whose
    second line has no ``data:`` field is only its first line (malformed), not that
    template's chunk: the fast path reports it as the parsed path does."""
    whole = orjson.dumps({**envelope(False), "choices": [text_choice("a")]})
    head, comma, rest = whole.partition(b",")
    taught = b"data: " + head + comma + b"\ndata: " + rest + b"\n\n"
    fieldless = b"data: " + head + comma + b"\n" + rest.replace(b'"a"', b'"b"') + b"\n\n"
    for raw in (True, False):
        reader = (SseReader if raw else ParsingReader)(ChunkParser())
        assert reader.feed(taught) is None
        output = reader.burst.take()
        assert output is not None and output.text == "a"
        problem = reader.feed(fieldless)
        assert problem is not None and problem.startswith("sent a malformed chunk"), raw
        assert reader.burst.take() is None


# --- a read of common chunks: one run ------------------------------------------------------


def content(chat: bool, text: str, **more: Any) -> Choice:
    return delta_choice({"content": text}, **more) if chat else text_choice(text, **more)


def run_reads(chat: bool, texts: list[str]) -> list[bytes]:
    """A stream in three reads: a chunk that teaches the template, the common chunks of
    ``texts``, and the finish with ``[DONE]``."""
    return [chunk(chat, content(chat, "first")),
            b"".join(chunk(chat, content(chat, text)) for text in texts),
            finish(chat) + DONE]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_read_of_common_chunks_is_one_run_of_their_bytes(
    chat: bool, parses: list[bytes]
) -> None:
    texts = [f" w{i}" for i in range(8)] + [text for text in TRICKY if plain(text)]
    reads = run_reads(chat, texts)
    fast = Read(reads, raw=True)
    run = fast.outputs[1].choices
    assert type(run) is RawChoices and len(run) == len(texts)
    assert [choice.raw for choice in run] == choice_bytes(reads[1])  # as sent
    assert fast.outputs[1].text == "".join(texts)
    assert parses == []
    assert_same_as_parsed(b"".join(reads), fast)
    # one common chunk per read is a run of one
    one = Read([reads[0], *(chunk(chat, content(chat, t)) for t in texts), reads[2]],
               raw=True)
    assert [len(o.choices or ()) for o in one.outputs[1:]] == [1] * len(texts)
    assert all(type(o.choices) is RawChoices for o in one.outputs[1:])


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_whole_stream_in_one_read_is_one_run_from_the_chunk_that_taught_it(
    chat: bool, parses: list[bytes]
) -> None:
    """The first read of a stream (the chunk that teaches the template, the common
    chunks after it) and a read that ends with the finish, its usage and ``[DONE]`` are
    runs too: nothing in them is made a choice of its own."""
    texts = [f" w{i}" for i in range(10)]
    common = b"".join(chunk(chat, content(chat, text)) for text in texts)
    for reads in ([common + finish(chat) + usage(chat, 10) + DONE],
                  [common[:len(common) // 2], common[len(common) // 2:] + finish(chat) + DONE]):
        fast = Read(reads, raw=True)
        assert all(type(output.choices) is RawChoices for output in fast.outputs)
        assert [c.raw for c in fast.raw] == choice_bytes(common)  # as sent, all of them
        assert "".join(o.text or "" for o in fast.outputs) == "".join(texts)
        assert parses == []
        assert_same_as_parsed(b"".join(reads), fast)
        parses.clear()


@pytest.mark.parametrize("raw", [True, False], ids=["fast", "parsed"])
def test_an_event_is_read_once_its_blank_line_came_whatever_came_after_it(raw: bool) -> None:
    """A read that ends a few bytes into the next event (``...\\n\\nd``) gives the event
    it completed at once, not with the next read (a CR that ends its blank line too);
    one that ends inside an event holds it."""
    learned, common = chunk(False, text_choice("x")), chunk(False, text_choice("t"))
    for cut in (1, 3, 6, 20, len(common) - 1):
        reader = (SseReader if raw else ParsingReader)(ChunkParser())
        assert reader.feed(learned) is None and reader.burst.take() is not None
        assert reader.feed(common + common[:cut]) is None
        output = reader.burst.take()
        assert output is not None and output.text == "t", cut
        assert reader.feed(common[cut:]) is None
        output = reader.burst.take()
        assert output is not None and output.text == "t", cut
    crlf = common.replace(b"\n\n", b"\r\n\r\n")
    reader = (SseReader if raw else ParsingReader)(ChunkParser())
    assert reader.feed(learned) is None and reader.burst.take() is not None
    assert reader.feed(common + crlf[:-1]) is None  # the last LF not in yet: the CR
    output = reader.burst.take()                     # ended the blank line
    assert output is not None and output.text == "tt"
    assert reader.feed(crlf[-1:]) is None
    assert reader.burst.take() is None


@pytest.mark.parametrize("raw", [True, False], ids=["fast", "parsed"])
def test_an_event_whose_blank_line_is_a_cr_at_the_end_of_a_read_is_read_at_once(
    raw: bool
) -> None:
    """A CR ends a line (server-sent events allow CR, LF and CRLF): a read that ends with
    the CR of an event's blank line completed the event, which is read at once (it
    waited for the next read: with CR line ends, every event, a token late). An LF that
    comes first in the next read is that CR's (no blank line of its own); a CR that ends
    a data line still waits, the next line may be of the same event."""
    learned = chunk(False, text_choice("x"))
    for end in (b"\r\r", b"\r\n\r"):
        reader = (SseReader if raw else ParsingReader)(ChunkParser())
        assert reader.feed(learned) is None and reader.burst.take() is not None
        for text in ("t", "u"):
            assert reader.feed(chunk(False, text_choice(text))[:-2] + end) is None
            output = reader.burst.take()
            assert output is not None and output.text == text, end
            reader.feed(b"\n" if end == b"\r\n\r" else b": ping\r")  # the CR's LF
            assert reader.burst.take() is None
    whole = orjson.dumps({**envelope(False), "choices": [text_choice("two lines")]})
    head, comma, rest = whole.partition(b",")
    reader = (SseReader if raw else ParsingReader)(ChunkParser())
    assert reader.feed(b"data: " + head + comma + b"\r") is None
    assert reader.burst.take() is None
    assert reader.feed(b"\ndata: " + rest + b"\r\n\r\n") is None
    output = reader.burst.take()
    assert output is not None and output.text == "two lines"


@pytest.mark.parametrize("raw", [True, False], ids=["fast", "parsed"])
def test_B8_a_stream_that_starts_with_a_byte_order_mark_loses_no_event(raw: bool) -> None:
    """The event-stream format strips a leading UTF-8 byte order mark: the first event
    after it is read (it was lost, with its role or first token), however the reads cut
    the mark."""
    texts = [f" w{i}" for i in range(4)]
    stream = completions_stream(texts)
    plain_read = Read([stream], raw=raw)
    marked = b"\xef\xbb\xbf" + stream
    for cut in (1, 2, 3, 4, 40, len(marked)):
        read = Read([marked[:cut], marked[cut:]] if cut < len(marked) else [marked], raw=raw)
        assert [dict(c) for c in read.choices] == [dict(c) for c in plain_read.choices], cut
        assert "".join(o.text or "" for o in read.outputs) == "".join(texts), cut
        assert read.final == plain_read.final
    # a mark anywhere else is bytes of the stream, as before: the first event's field
    # name is then not "data", and the event carries nothing
    late = Read([chunk(False, text_choice("a")), b"\xef\xbb\xbf" + stream], raw=raw)
    assert "".join(o.text or "" for o in late.outputs) == "a" + "".join(texts[1:])


def test_a_read_with_any_other_chunk_is_read_chunk_by_chunk() -> None:
    learned, common = chunk(False, text_choice("x")), chunk(False, text_choice("t"))
    others = [
        chunk(False, text_choice('q"')),  # an escape
        chunk(False, text_choice("t"), created=1001),  # another prefix
        chunk(False, text_choice("t", token_ids=[5])),  # another suffix
        chunk(False, text_choice("t"), usage={"prompt_tokens": 1, "completion_tokens": 1,
                                              "total_tokens": 2}),
        usage(False, 3),  # a chunk without choices
    ]
    for other in others:
        read = common + other + common
        fast = Read([learned, read, finish(False) + DONE], raw=True)
        assert type(fast.outputs[1].choices) is list, other
        assert_same_as_parsed(learned + read + finish(False) + DONE, fast)
    # an event without data (a comment), or a chunk with an empty text (shorter than the
    # template's), carries nothing: the run is the chunks around it
    for nothing in (b": a comment\n\n", chunk(False, text_choice(""))):
        read = common + nothing + common
        fast = Read([learned, read, finish(False) + DONE], raw=True)
        assert type(fast.outputs[1].choices) is RawChoices, nothing
        assert len(fast.outputs[1].choices) == 2
        assert_same_as_parsed(learned + read + finish(False) + DONE, fast)


def test_a_run_is_never_malformed_json() -> None:
    """Each chunk of a run must be valid JSON on its own: a character split between two
    chunks, a control character or a bad escape in one of them makes the read's chunks
    parsed one by one, and the bad one reported."""
    learned = chunk(False, text_choice("x"))

    def with_text(text: bytes) -> bytes:
        return learned.replace(b'"text":"x"', b'"text":"' + text + b'"')

    e_acute = "\u00e9".encode()
    for bad in ([with_text(b"a" + e_acute[:1]), with_text(e_acute[1:] + b"b")],
                [with_text(b"a\x01b")], [with_text(b"\xff")], [with_text(b"b\\q")]):
        reader = SseReader(ChunkParser())
        assert reader.feed(learned) is None
        reader.burst.take()
        problem = reader.feed(learned + b"".join(bad) + learned)
        assert problem is not None and problem.startswith("sent a malformed chunk"), bad
        output = reader.burst.take()  # the chunk before the bad one, and nothing after
        assert output is not None and output.choices is not None
        assert raw_bytes(output.choices) == choice_bytes(learned)


@pytest.mark.parametrize("raw", [True, False], ids=["fast", "parsed"])
def test_a_long_event_in_many_reads_costs_time_linear_in_its_bytes(
    raw: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long chunk (logprobs, a slow worker) that comes in many small reads was joined
    with all that came before it at each read and searched again for its blank line:
    time quadratic in its length (a 1 MB event in 1 kB reads, 0.45 s). Now a read
    without a line end is held until one comes; the bytes looked at are linear."""
    looked: list[int] = []
    data_of, whole = SseReader._data_of, RunReader.whole

    def counted_data_of(self: SseReader, part: bytes) -> list[bytes]:
        looked.append(len(part))
        return data_of(self, part)

    def counted_whole(self: RunReader, part: bytes) -> Any:
        looked.append(len(part))
        return whole(self, part)

    monkeypatch.setattr(SseReader, "_data_of", counted_data_of)
    monkeypatch.setattr(RunReader, "whole", counted_whole)
    reader = (SseReader if raw else ParsingReader)(ChunkParser())
    assert reader.feed(chunk(False, text_choice("x"))) is None
    reader.burst.take()
    long = chunk(False, text_choice("y" * 100_000))
    looked.clear()
    for at in range(0, len(long), 100):
        assert reader.feed(long[at:at + 100]) is None
    output = reader.burst.take()
    assert output is not None and output.text == "y" * 100_000
    assert sum(looked) <= 3 * len(long)


def test_a_read_whose_chunks_change_their_suffix_costs_time_linear_in_its_chunks(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of one envelope whose choices end in two ways, two of each in turn (a field
    that changes now and then: logprobs, a stop_reason): each pair teaches a template,
    and the read of the chunks after it looked at the prefix of every chunk left in the
    read, the suffix of only the first two, n * n / 4 slices (a read of 16,000 such
    chunks, 19 s). Now the chunks are looked at a block of 64 at a time."""
    sliced = 0
    real = operator.itemgetter

    def counting(item: Any) -> Callable[[bytes], bytes]:
        getter = real(item)

        def sliced_by(data: bytes) -> bytes:
            nonlocal sliced
            sliced += 1
            return cast(bytes, getter(data))

        return sliced_by

    monkeypatch.setattr(_raw, "itemgetter", counting)
    many = 2000
    read = b"".join(chunk(False, text_choice(f" w{i}", stop_reason=None if i // 2 % 2 else 7))
                    for i in range(many))
    fast = Read([read, finish(False) + DONE], raw=True)
    assert sliced <= 80 * many  # (two blocks of 64 a pair at most; n * n / 4 was 500 * n)
    assert len(fast.choices) == many
    assert_same_as_parsed(read + finish(False) + DONE, fast)


def test_a_read_of_common_chunks_between_empty_ones_costs_time_linear_in_its_chunks(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty text carries nothing, so the runs on both sides of it join in the burst:
    each join copied the run so far, n * n / 2 for a read of common chunks between
    empty ones (32,000 chunks: 13 us a chunk, and growing). Now a run grows in place."""
    copied = 0
    real = Burst.add_run

    def counted(burst: Burst, run: RawChoices, text: str) -> None:
        nonlocal copied
        held = burst.run
        real(burst, run, text)
        if burst.run is not None and held is not None and burst.run.texts is not held.texts:
            copied += len(burst.run.texts)

    monkeypatch.setattr(Burst, "add_run", counted)
    many = 400
    read = b"".join(chunk(False, text_choice(f" w{i}" if i % 2 else "")) for i in range(many))
    reads = [chunk(False, text_choice("x")), read, finish(False) + DONE]
    fast = Read(reads, raw=True)
    assert type(fast.outputs[1].choices) is RawChoices
    assert len(fast.outputs[1].choices) == many // 2
    assert copied <= many
    assert_same_as_parsed(b"".join(reads), fast)


@pytest.mark.parametrize("every", [1, 2, 7])
def test_a_read_of_many_chunks_with_escaped_texts_costs_time_linear_in_its_chunks(
    every: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A text with an escape (a newline, a quote) is common: each such chunk of a read
    taught the template again, and the chunks after it were read again as a run that
    failed at the next one, a read of n chunks costing n * n (0.5 ms a chunk at 4,000).
    Now each chunk is looked at a bounded number of times, and the template is learned
    once."""
    looked: list[int] = []
    learned: list[bytes] = []
    leading, texts, learn = RunReader.leading, RunReader.texts, learn_template

    def counted_leading(self: RunReader, chunks: list[bytes], *begin: int) -> int:
        looked.append(count := leading(self, chunks, *begin))
        return count

    def counted_texts(self: RunReader, chunks: list[bytes]) -> Any:
        looked.append(len(chunks))
        return texts(self, chunks)

    def counted_learn(data: bytes, chunk: dict[str, Any]) -> Any:
        learned.append(data)
        return learn(data, chunk)

    monkeypatch.setattr(RunReader, "leading", counted_leading)
    monkeypatch.setattr(RunReader, "texts", counted_texts)
    monkeypatch.setattr(_reader, "learn_template", counted_learn)
    many = 400
    read = b"".join(chunk(False, text_choice("a\nb" if i % every == 0 else f" w{i}"))
                    for i in range(many))
    reads = [chunk(False, text_choice("x")), read, finish(False) + DONE]
    fast = Read(reads, raw=True)
    assert sum(looked) <= 2 * many and len(learned) == 1
    assert len(fast.choices) == 1 + many
    assert_same_as_parsed(b"".join(reads), fast)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_chunks_with_escaped_or_empty_texts_split_a_run_and_the_rest_stays_runs(
    chat: bool, monkeypatch: pytest.MonkeyPatch, parses: list[bytes]
) -> None:
    """A model's text has newlines and quotes: a chunk whose text JSON escapes (or an
    empty one) is read on its own, and the common chunks around it still go at once;
    the client gets the same chunks, in order."""
    alone: list[int] = []
    one_by_one = SseReader._one_by_one

    def counted(self: SseReader, chunks: list[bytes], begin: int, end: int) -> Any:
        alone.append(end - begin)
        return one_by_one(self, chunks, begin, end)

    monkeypatch.setattr(SseReader, "_one_by_one", counted)
    texts = [("line\n" if i % 7 == 3 else 'say "x"' if i % 11 == 5 else "" if i == 20
              else f" w{i}") for i in range(40)]
    odd = sum(1 for text in texts if not plain(text) or not text)
    reads = [chunk(chat, content(chat, "first")),
             b"".join(chunk(chat, content(chat, text)) for text in texts),
             finish(chat) + DONE]
    fast = Read(reads, raw=True)
    assert sum(alone[1:-1]) == odd  # (the first read's and the finish's aside)
    # (an empty text carries nothing: no choice, as in the parsed path)
    assert [type(c) is RawChoice for c in fast.outputs[1].choices or ()] == [
        plain(text) for text in texts if text]
    assert parses == []
    assert_same_as_parsed(b"".join(reads), fast)


def test_raw_choices_is_a_sequence_of_raw_choices() -> None:
    head, tail = b'{"index":0,"text":"', b'","finish_reason":null}'
    run = RawChoices(head, [b"a", b"b\xc3\xa9"], tail)
    assert len(run) == 2
    assert run[0] == RawChoice(head + b"a" + tail)
    assert run[-1]["text"] == "b\u00e9"
    assert run[1:] == [RawChoice(head + b"b\xc3\xa9" + tail)]
    assert [dict(choice) for choice in run] == [
        {"index": 0, "text": "a", "finish_reason": None},
        {"index": 0, "text": "b\u00e9", "finish_reason": None}]
    assert "choices" not in to_wire(LLMEngineOutput(choices=run))  # in process only
    # equal to the list it stands for, either way round, and to a run of the same choices
    as_list = [RawChoice(head + b"a" + tail), {"index": 0, "text": "b\u00e9",
                                                "finish_reason": None}]
    assert run == as_list and as_list == run
    assert run == RawChoices(head, [b"a", b"b\xc3\xa9"], tail)
    assert run == RawChoices(b'{"index": 0, "text": "', [b"a", b"b\xc3\xa9"],
                             b'", "finish_reason": null}')  # other bytes, the same JSON
    assert run != RawChoices(head, [b"a"], tail) and run != as_list[:1]
    assert run != (1, 2) and run[::-1] == list(reversed(run))


# --- through the server ----------------------------------------------------------------------


class Reads(httpx.AsyncByteStream):
    """A response body that comes in reads of ``size`` bytes, or in the reads ``parts``."""

    def __init__(self, data: bytes, size: int, parts: list[bytes] | None = None) -> None:
        self._parts = (list(parts) if parts is not None
                       else [data[at:at + size] for at in range(0, len(data), size)])

    def __aiter__(self) -> Reads:
        return self

    async def __anext__(self) -> bytes:
        await trio.lowlevel.checkpoint()
        if not self._parts:
            raise StopAsyncIteration
        return self._parts.pop(0)


class Relayed(StandIn):
    """A decode engine: the mock decode runs first (it pulls the KV; its tokens are thrown
    away), then a vLLM adapter relays :attr:`stream` as its worker's answer, in reads of
    :attr:`read_size` bytes."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.stream = b""
        self.read_size = 1 << 20
        #: The reads of the answer, if not ``stream`` cut every ``read_size`` bytes.
        self.reads: list[bytes] | None = None

    async def _answer(self, request: httpx.Request) -> httpx.Response:
        await trio.lowlevel.checkpoint()
        return httpx.Response(200, stream=Reads(self.stream, self.read_size, self.reads),
                              headers={"content-type": "text/event-stream"})

    async def generate(  # noqa: ASYNC128 (the wrapped engines call task_status.started())
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Annotated[LLMEngineOutput]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await run_to_its_end(self.engine, request, context)  # it pulls the KV
        client = httpx.AsyncClient(transport=httpx.MockTransport(self._answer))
        async with client:
            vllm = VllmEngine("http://worker:1", "decode", client=client)
            await vllm.generate(request, context, send_channel, task_status=task_status)


@asynccontextmanager
async def running() -> AsyncIterator[tuple[str, Relayed, OpenAIApp, MockCluster]]:
    cluster = mock_cluster(latency=LatencyModel.zero())
    decode = Relayed(cluster.decode[0])
    async with TransferKeeper(drain_window=5.0) as keeper:
        router = DisaggRouter(WorkerPool([cluster.prefill[0]]), WorkerPool([decode]), keeper)
        app = create_app(router, models=[MODEL])
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(
                serve, app, host="127.0.0.1", port=0, shutdown_trigger=stop.wait))
            yield f"http://127.0.0.1:{port}", decode, app, cluster
            with trio.fail_after(5):
                await app.wait_idle()
                await router.wait_idle()
                await keeper.wait_idle()
            assert cluster.counters().held_blocks == 0
            stop.set()


def client_events(body: bytes) -> list[bytes]:
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"data: [DONE]\n\n") == 1
    return [e.removeprefix(b"data: ") for e in body[:-2].split(b"\n\n")][:-1]


async def relay_twice(path: str, body: dict[str, Any], stream: bytes, monkeypatch:
                      pytest.MonkeyPatch, read_size: int = 1 << 20,
                      reads: list[bytes] | None = None) -> list[list[bytes]]:
    """The client's events for ``stream`` (in ``reads`` if given) with the fast path on,
    then off."""
    answers = []
    async with running() as (url, decode, _, _), httpx.AsyncClient(
            base_url=url, timeout=10.0) as http:
        decode.stream, decode.read_size, decode.reads = stream, read_size, reads
        for raw in (True, False):
            monkeypatch.setattr(SseReader, "raw_choices", raw)
            response = await http.post(path, json=body)
            assert response.status_code == 200, response.text
            answers.append(client_events(response.content))
    return answers


def choices_of(events: list[bytes]) -> list[bytes]:
    """The bytes of each event's ``choices`` array, without the brackets."""
    return [e[e.index(b'"choices":[') + 11:e.rindex(b"]")] for e in events]


def normalised(events: list[bytes]) -> list[Any]:
    """The parsed events without what differs between two responses (id, created)."""
    parsed = [orjson.loads(e) for e in events]
    for e in parsed:
        e.pop("id"), e.pop("created")
    return parsed


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_B8_the_client_gets_the_same_chunks_with_and_without_the_fast_path(
    chat: bool, monkeypatch: pytest.MonkeyPatch, parses: list[bytes]
) -> None:
    texts = [f" w{i}" for i in range(8)] + TRICKY
    body: dict[str, Any] = {"model": MODEL, "stream": True,
                            "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat
                else {"prompt": "hi"})
    stream = spaced(chat_stream(texts) if chat else completions_stream(texts))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    for read_size in (1 << 20, 97):
        fast, slow = await relay_twice(path, body, stream, monkeypatch, read_size)
        assert normalised(fast) == normalised(slow)
        # each choice is the worker's bytes, in the router's envelope (the parsed path
        # writes them its own way); those with an escaped text are parsed
        sent = choice_bytes(stream)[chat + 1:chat + len(texts)]
        carried = [i for i, text in enumerate(texts[1:]) if plain(text)]
        assert len(carried) == len(texts) - 1 - 7
        fast_choices, slow_choices = choices_of(fast[1:-2]), choices_of(slow[1:-2])
        assert [fast_choices[i] for i in carried] == [sent[i] for i in carried]
        assert not {slow_choices[i] for i in carried} & set(sent)
        assert orjson.loads(fast[-1])["usage"]["completion_tokens"] == len(texts)
        # the client got them with no parse past the first chunk
        assert parses == []


async def test_B8_tool_calls_and_tokens_counted_when_the_worker_reports_no_usage(
    monkeypatch: pytest.MonkeyPatch, parses: list[bytes]
) -> None:
    tool = delta_choice({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                         "function": {"name": "f", "arguments": ""}}]})
    texts = ["a", "b", "c"]
    stream = (chunk(True, delta_choice({"role": "assistant", "content": ""}))
              + b"".join(chunk(True, delta_choice({"content": t})) for t in texts)
              + chunk(True, tool) + b"".join(chunk(True, delta_choice({"content": t}))
                                             for t in texts)
              + finish(True, "tool_calls") + DONE)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}
    fast, slow = await relay_twice("/v1/chat/completions", body, stream, monkeypatch)
    assert normalised(fast) == normalised(slow)
    assert orjson.loads(fast[-1])["usage"]["completion_tokens"] == 7
    assert parses == []


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_B8_a_run_reaches_the_client_as_sent_and_counted(
    chat: bool, monkeypatch: pytest.MonkeyPatch, parses: list[bytes]
) -> None:
    texts = [f" w{i}" for i in range(12)] + [text for text in TRICKY if plain(text)]
    reads = run_reads(chat, texts)
    body: dict[str, Any] = {"model": MODEL, "stream": True,
                            "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat
                else {"prompt": "hi"})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    fast, slow = await relay_twice(path, body, b"".join(reads), monkeypatch, reads=reads)
    assert normalised(fast) == normalised(slow)
    assert choices_of(fast[1:-2]) == choice_bytes(reads[1])  # the worker's bytes
    # the worker reported no usage: one token a chunk with content
    assert orjson.loads(fast[-1])["usage"]["completion_tokens"] == 1 + len(texts)
    assert parses == []


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_B8_a_chunk_the_worker_writes_in_two_data_lines_reaches_the_client_whole(
    chat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Server-sent events join a chunk's data lines with a line feed, here inside the
    choice: its bytes cannot go to the client as they are (the line feed would end the
    client's data line and cut the chunk), so it teaches no template and the ``openai``
    client reads every chunk, fast path or not."""
    texts = ["a", "b", "c"]
    stream = b"".join(event(orjson.dumps({**envelope(chat), "choices": [content(chat, text)]})
                            .replace(b',"logprobs"', b',\ndata: "logprobs"'))
                      for text in texts) + finish(chat) + DONE
    async with running() as (url, decode, _, _):
        decode.stream = stream
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=10.0)

        def streamed() -> list[str | None]:
            if chat:
                return [part.choices[0].delta.content for part in client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)]
            return [part.choices[0].text for part in client.completions.create(
                model=MODEL, prompt="hi", stream=True)]

        for raw in (True, False):
            monkeypatch.setattr(SseReader, "raw_choices", raw)
            got = await trio.to_thread.run_sync(streamed)
            assert "".join(text or "" for text in got) == "abc"
            assert len(got) == 4


async def test_a_client_that_does_not_stream_gets_the_same_answer(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = [f" w{i}" for i in range(5)] + TRICKY
    stream = chat_stream(texts)
    async with running() as (url, decode, _, _):
        decode.stream = stream
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=10.0)
        answers = []
        for raw in (True, False):
            monkeypatch.setattr(SseReader, "raw_choices", raw)
            answer = await trio.to_thread.run_sync(partial(
                client.chat.completions.create, model=MODEL,
                messages=[{"role": "user", "content": "hi"}]))
            answers.append(answer)
        fast, slow = answers
        assert fast.choices[0].message.content == "".join(texts)
        assert fast.choices == slow.choices and fast.usage == slow.usage


# --- the encoder ---------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_encoder_writes_raw_and_parsed_choices_alike(chat: bool) -> None:
    """Whatever mix a burst brings, a RawChoice is written as the dict it parses to would
    be (a first chat delta gets its role), in order."""
    made: list[Mapping[str, Any]] = [
        delta_choice({"content": t}) if chat else text_choice(t) for t in "abcd"]
    raw = [RawChoice(orjson.dumps(c)) for c in made]
    mixes: list[list[Mapping[str, Any]]] = [
        list(raw), [made[0], raw[1], made[2], raw[3]], [raw[0], *made[1:]]]

    def encoder() -> ChunkEncoder:
        return ChunkEncoder(chat=chat, response_id="r", model=MODEL, created=1,
                            include_usage=True)

    expected = b"".join(encoder().choices(made))
    assert expected.count(b'"role":"assistant"') == chat
    for mix in mixes:
        assert b"".join(encoder().choices(mix)) == expected
        split = encoder()
        assert b"".join(split.choices(mix[:1]) + split.choices(mix[1:])) == expected


def test_B8_a_first_chat_delta_with_a_role_of_its_own_gets_no_second_one() -> None:
    """The role a first chat delta gets is patched into its bytes; a worker's delta that
    has a ``role`` after its ``content`` got a second ``role`` key the worker never sent
    (a client that refuses duplicate keys fails; one that keeps the first reads
    ``assistant`` where the worker said null). It is written as the parsed path writes
    it: the role once, the worker's own, or ``assistant`` for its null (SGLang's "no
    change" after a role-only first chunk, which is not relayed)."""
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        assert len(keys) == len(set(keys)), keys
        return dict(pairs)

    for role in ("assistant", None, "user"):
        stream = b"".join(chunk(True, delta_choice({"content": text, "role": role}))
                          for text in ("a", "b"))
        written = []
        for raw in (True, False):
            reader = (SseReader if raw else ParsingReader)(ChunkParser())
            assert reader.feed(stream) is None
            output = reader.burst.take()
            assert output is not None and output.choices is not None
            encoder = ChunkEncoder(chat=True, response_id="r", model=MODEL, created=1,
                                   include_usage=False)
            events = b"".join(encoder.choices(output.choices))[:-2].split(b"\n\n")
            written.append([json.loads(e.removeprefix(b"data: "), object_pairs_hook=unique)
                            for e in events])
        assert written[0] == written[1]
        assert [e["choices"][0]["delta"]["role"] for e in written[0]] == [
            role or "assistant", role]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_encoder_writes_a_run_as_its_choices(chat: bool) -> None:
    """A run is written in one join, as each of its choices would be, also as a chat's
    first delta (which gets its role)."""
    head = b'{"index":0,"delta":{"content":"' if chat else b'{"index":0,"text":"'
    tail = b'"},"logprobs":null,"finish_reason":null}' if chat else b'","logprobs":null}'
    run = RawChoices(head, [b"a", b"b\xc3\xa9", b"c"], tail)

    def encoder() -> ChunkEncoder:
        return ChunkEncoder(chat=chat, response_id="r", model=MODEL, created=1,
                            include_usage=True)

    for first in (True, False):
        as_run, one_by_one = encoder(), encoder()
        if not first:
            for used in (as_run, one_by_one):
                used.choices([content(chat, "x")])
        expected = b"".join(one_by_one.choices(list(run)))
        assert b"".join(as_run.choices(run)) == expected
        assert expected.count(b'"role":"assistant"') == (chat and first)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("escaped", [False, True])
def test_a_first_read_is_one_run_after_the_chunk_that_taught_it(
    monkeypatch: pytest.MonkeyPatch, chat: bool, escaped: bool
) -> None:
    """A stream's first read (a fast decode's, hundreds of tokens) learns its template
    from its first common chunk, then reads the rest as a later read is read: one split
    and one comparison, not each chunk's ends looked at (``RunReader.leading``). A read
    whose rest is not all common chunks (an escaped text, a finish) goes the chunk by
    chunk way; both read what the parser reads, and the event the read cut in half waits
    for the next read."""
    ends_looked_at = 0
    real = RunReader.leading

    def counted(runs: RunReader, chunks: list[bytes], begin: int = 0) -> int:
        nonlocal ends_looked_at
        ends_looked_at += 1
        return real(runs, chunks, begin)

    monkeypatch.setattr(RunReader, "leading", counted)
    words = [f" w{i}" for i in range(300)]
    if escaped:
        words[150] = ' "quoted"'
    tokens = [chunk(chat, delta_choice({"content": w}) if chat else text_choice(w))
              for w in words]
    first = chunk(chat, delta_choice({"role": "assistant", "content": ""})) if chat else b""
    stream = first + b"".join(tokens) + finish(chat) + DONE
    cut = len(first) + sum(map(len, tokens[:200])) + 40  # in the middle of an event
    reader = SseReader(ChunkParser())
    assert reader.feed(stream[:cut]) is None
    burst = reader.burst.take()
    assert burst is not None and burst.text == "".join(words[:200])
    assert (ends_looked_at > 0) is escaped
    assert_same_as_parsed(stream, Read([stream[:cut], stream[cut:]], raw=True))


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("tail", ["finish", "finish usage done", "comment", "five", "cr"])
def test_a_last_read_is_one_run_then_its_finish(
    monkeypatch: pytest.MonkeyPatch, chat: bool, tail: str
) -> None:
    """A stream's last read (common chunks, then its finish, a usage chunk and
    ``[DONE]``) is read as one run, found as a later read is (no chunk's ends looked at,
    ``RunReader.leading``), and the events after it one by one; a tail that is not a few
    one-line events (a comment line, five events of another kind, CR line ends) goes the
    chunk by chunk way. Both read what the parser reads."""
    ends_looked_at = 0
    real = RunReader.leading

    def counted(runs: RunReader, chunks: list[bytes], begin: int = 0) -> int:
        nonlocal ends_looked_at
        ends_looked_at += len(chunks) - begin
        return real(runs, chunks, begin)

    monkeypatch.setattr(RunReader, "leading", counted)
    words = [f" w{i}" for i in range(120)]
    tokens = [chunk(chat, delta_choice({"content": w}) if chat else text_choice(w))
              for w in words]
    ending = {"finish": finish(chat), "finish usage done": finish(chat) + usage(chat, 120)
              + DONE, "comment": finish(chat)[:-2] + b"\n: a comment\n\n" + DONE,
              "five": b"".join([chunk(chat, delta_choice({"content": ""}) if chat
                                      else text_choice(""))] * 4) + finish(chat) + DONE,
              "cr": finish(chat).replace(b"\n", b"\r\n") + DONE}[tail]
    if tail == "finish":
        ending += DONE
    first = b"".join(tokens[:20])
    last = b"".join(tokens[20:]) + ending
    reader = SseReader(ChunkParser())
    assert reader.feed(first) is None
    reader.burst.take()
    ends_looked_at = 0
    assert reader.feed(last) is None
    burst = reader.burst.take()
    assert burst is not None and burst.text == "".join(words[20:])
    assert reader.done and reader.final is not None
    assert (ends_looked_at > 10) is (tail in ("comment", "five", "cr"))
    assert_same_as_parsed(first + last, Read([first, last], raw=True))
