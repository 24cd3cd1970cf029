"""The relay's fast path on bytes (B8, docs/performance.md) against the parsed path, on
random worker streams: whatever bytes a worker sends (valid or not) and however they fall
into socket reads, the client gets what it would with every chunk parsed.

Each stream is made of chunks drawn from a vocabulary of common chunks (texts with quotes,
backslashes, control characters, multibyte characters split between chunks, bytes that
are not UTF-8, the template's own bytes) and everything else a worker may send (another
``created``, other field orders and spacing, extra fields, keys written twice, usage,
token ids, a second choice, error objects, comments, malformed chunks, CRLF and CR line
ends, data in two lines, a finish, ``[DONE]``), in segments of one shape (a run, or a
template taught by an odd chunk), cut into reads at random points. The same reads go to a
reader with the fast path and to one without (``raw_choices = False``), and each read's
output is compared: the problem reported, the text, token ids, usage, the tokens the
server counts, each choice as the client decodes the server's chunk for it (one data line
an event, strict JSON), and the non-streamed answer collected from the choices. A
failure names the seed and the reads.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from typing import Any

import orjson
import pytest

from trio_disagg import LLMEngineOutput, RawChoices
from trio_disagg.engines._chunks import ChunkParser
from trio_disagg.engines._reader import SseReader
from trio_disagg.server._collect import ChoiceCollector
from trio_disagg.server._openai_responses import ChunkEncoder, counted_tokens

#: A chunk maker: ``shape`` draws its structure (the same for each chunk of a segment),
#: ``rng`` its text.
Make = Callable[[random.Random, random.Random, bool], bytes]

#: Texts written as JSON strings (orjson escapes what it must).
TEXTS = [" w", "a", "\u00e9", "\U0001f600", "caf\u00e9 \u2603", 'say "hi"', "back\\slash",
         "\n", "\t", "\u0000", "\u007f", "\u2028", '","logprobs":null', ',"finish_reason":null}]}',
         '"},"logprobs":null', '"choices":[{"index":0,"text":"', "data: ", "data: [DONE]",
         "}]}", "\r\n", "x" * 40]

#: A text's bytes put between the quotes as they are (the JSON may be invalid).
RAW_TEXTS = [b"\xc3", b"\xa9", b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
             b"a\x01b", b"b\\q", b"tail\\", b"\\u00e9", b"\\ud800", b'x"y', b"\\\"",
             b'x","text":"y', b"\x7f", b"", b"\\n", b"\\/", b"ok"]


def envelope(chat: bool, created: int = 1000, cid: str = "cmpl-w") -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": "worker-model"}


def choice_of(chat: bool, text: Any, /, **more: Any) -> dict[str, Any]:
    if chat:
        return {"index": 0, "delta": {"content": text}, "logprobs": None,
                "finish_reason": None, **more}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": None, **more}


def dumps(chat: bool, *choices: Mapping[str, Any], created: int = 1000, **top: Any) -> bytes:
    return orjson.dumps({**envelope(chat, created), "choices": list(choices), **top})


def common(shape: random.Random, rng: random.Random, chat: bool) -> bytes:
    text = rng.choice(TEXTS) if rng.random() < 0.3 else f" t{rng.randrange(100)}"
    return dumps(chat, choice_of(chat, text))


def raw_text(shape: random.Random, rng: random.Random, chat: bool) -> bytes:
    return dumps(chat, choice_of(chat, "@@")).replace(b"@@", rng.choice(RAW_TEXTS))


def split_character(shape: random.Random, rng: random.Random, chat: bool) -> bytes:
    encoded = rng.choice(["\u00e9", "\u2603", "\U0001f600"]).encode()
    cut = rng.randrange(1, len(encoded))
    template = dumps(chat, choice_of(chat, "@@"))
    return (template.replace(b"@@", b"a" + encoded[:cut]) + b"\n\ndata: "
            + template.replace(b"@@", encoded[cut:] + b"b"))


def ticked(shape: random.Random, rng: random.Random, chat: bool) -> bytes:
    return dumps(chat, choice_of(chat, f" c{rng.randrange(9)}"),
                 created=1000 + shape.randrange(3))


def spaced(shape: random.Random, rng: random.Random, chat: bool) -> bytes:
    return common(shape, rng, chat).replace(b'"logprobs":null,', b'"logprobs": null, ')


def reordered(shape: random.Random, rng: random.Random, chat: bool) -> bytes:
    text = f" r{rng.randrange(9)}"
    if chat and shape.random() < 0.5:
        return dumps(chat, {"index": 0, "delta": {"role": None, "content": text},
                            "logprobs": None, "finish_reason": None})
    choice = choice_of(chat, text)
    return dumps(chat, {"finish_reason": None, **choice})


def extra(shape: random.Random, rng: random.Random, chat: bool) -> bytes:
    more: dict[str, Any] = shape.choice([
        {"token_ids": [5]}, {"token_ids": None}, {"stop_reason": "x"}, {"stop_reason": None},
        {"logprobs": {"content": []}}, {"index": shape.choice([1, 2])},
        # a chat choice with a text too (read first), a completion with a delta too
        {"text": "T"} if chat else {"delta": {"content": "D"}}])
    top: dict[str, Any] = shape.choice([
        {}, {"system_fingerprint": "fp"}, {"usage": None},
        {"usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}])
    return dumps(chat, choice_of(chat, f" e{rng.randrange(9)}", **more), **top)


def duplicate_keys(shape: random.Random, rng: random.Random, chat: bool) -> bytes:
    """Valid JSON (the last of two keys wins) whose first text or index is not the one
    the chunk means."""
    first, last = f" d{rng.randrange(3)}", shape.choice([" d0", " later", "\u00e9"])
    last_json = orjson.dumps(last)
    if chat:
        choice = shape.choice([
            b'{"index":0,"delta":{"content":"%s","content":%s},"finish_reason":null}',
            b'{"index":0,"delta":{"content":"%s"},"delta":{"content":%s},'
            b'"finish_reason":null}',
            b'{"index":0,"delta":{"content":"%s"},"finish_reason":null,"index":%s}',
        ])
    else:
        choice = shape.choice([
            b'{"index":0,"text":"%s","text":%s,"finish_reason":null}',
            b'{"index":0,"text":"%s","finish_reason":null,"index":%s}',
        ])
    value = b"1" if b'"index":%s' in choice else last_json
    head = dumps(chat)[:-2]  # without ']}'
    return head + choice % (first.encode(), value) + b"]}"


def odd_choices(shape: random.Random, rng: random.Random, chat: bool) -> bytes:
    return shape.choice([
        dumps(chat, choice_of(chat, "")),
        dumps(chat, choice_of(chat, None)),
        dumps(chat),
        dumps(chat, choice_of(chat, "a"), {**choice_of(chat, "b"), "index": 1}),
        dumps(chat, {"index": 0, "delta": {"role": "assistant", "content": ""}}),
        orjson.dumps({**envelope(chat), "meta": {"choices": [choice_of(chat, "x")]},
                      "choices": [choice_of(chat, "y")]}),
    ])


def overlapping(shape: random.Random, rng: random.Random, chat: bool) -> bytes:
    """The template's prefix and suffix sharing the text's quotes: shorter than both."""
    data = dumps(chat, choice_of(chat, "@@"))
    return data.replace(b'"@@"', b'"')


def error(shape: random.Random, rng: random.Random, chat: bool) -> bytes:
    return orjson.dumps(shape.choice([
        {"error": {"message": "boom"}}, {"object": "error", "message": "boom"},
        {**envelope(chat), "error": "boom", "choices": [choice_of(chat, "y")]}]))


def malformed(shape: random.Random, rng: random.Random, chat: bool) -> bytes:
    data = common(shape, rng, chat)
    return shape.choice([data[:rng.randrange(1, len(data))], b"[1]", b"5", b'"x"', b"",
                       b"nul", data + b"}", b"[DONE] "])


VOCABULARY: list[tuple[float, Make]] = [
    (40, common), (6, raw_text), (3, split_character), (4, ticked), (3, spaced),
    (3, reordered), (4, extra), (3, duplicate_keys), (3, odd_choices), (2, overlapping),
    (0.5, error), (0.5, malformed)]


def framed(rng: random.Random, data: bytes, style: float) -> bytes:
    """One event carrying ``data``, in any of the framings a worker may use (``style``
    below 0.1: every event's data in two lines, cut at its last comma)."""
    if style < 0.1:
        head, comma, tail = data.rpartition(b",")
        return b"data: " + head + comma + b"\ndata: " + tail + b"\n\n"
    kind = rng.random()
    if kind < 0.8:
        return b"data: " + data + b"\n\n"
    if kind < 0.85:
        return b"data: " + data + b"\r\n\r\n"
    if kind < 0.88:
        return b"data: " + data + b"\r\r"
    if kind < 0.93:
        return b": keep-alive\n\nid: 7\nevent: message\ndata:" + data + b"\n\n"
    head, comma, tail = data.partition(b",")
    return b"data: " + head + comma + b"\ndata: " + tail + b"\n\n"


def worker_stream(rng: random.Random, chat: bool) -> bytes:
    weights, makers = zip(*VOCABULARY, strict=True)
    events = []
    style = rng.random()
    if chat:
        events.append(framed(rng, style=style, data=dumps(chat, {"index": 0, "delta": {
            "role": "assistant", "content": ""}, "finish_reason": None})))
    for make in rng.choices(makers, weights, k=rng.randrange(1, 8)):
        # a segment of chunks of one shape (a run, or a template learned from an odd one)
        seed = rng.random()
        for _ in range(rng.choice([1, 1, 2, 3, 6, 12])):
            events.append(framed(rng, make(random.Random(seed), rng, chat), style))
    if rng.random() < 0.9:
        reason = rng.choice(["stop", "length", "abort", "tool_calls"])
        last = choice_of(chat, rng.choice(["", "end"]), finish_reason=reason)
        events.append(framed(rng, style=style, data=dumps(chat, last)))
        if rng.random() < 0.5:
            events.append(framed(rng, common(rng, rng, chat), style))
        events.append(framed(rng, style=style, data=dumps(chat, usage={
            "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12})))
    if rng.random() < 0.9:
        events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def cut(rng: random.Random, stream: bytes) -> list[bytes]:
    """``stream`` cut into socket reads at random points (or at once)."""
    if rng.random() < 0.2:
        return [stream]
    points = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1,
                                                          rng.randrange(1, 12))))
    return [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]


class ParsingReader(SseReader):
    raw_choices = False


def decoded(events: list[bytes]) -> list[Any]:
    """The server's chunks as the client decodes them (Python's json, as the ``openai``
    client: the last of two keys wins), each checked to be strict JSON too (orjson)."""
    found = []
    for event in b"".join(events).split(b"\n\n")[:-1]:
        lines = event.split(b"\n")
        # one data line an event, as a client's event parser reads it (a line end in the
        # payload would cut it: the rest is a line of another field)
        assert len(lines) == 1 and event.startswith(b"data: "), event
        payload = event.removeprefix(b"data: ")
        orjson.loads(payload)
        found.append(json.loads(payload))
    return found


def relay(reads: list[bytes], chat: bool, *, raw: bool) -> list[Any]:
    """What a client gets for ``reads``: each read's problem, output fields, counted
    tokens and the chunks the server writes for its choices; the final output; and the
    non-streamed answer collected from all choices."""
    reader = (SseReader if raw else ParsingReader)(ChunkParser())
    encoder = ChunkEncoder(chat=chat, response_id="r", model="m", created=1,
                           include_usage=True)
    collector = ChoiceCollector(chat=chat)
    seen: list[Any] = []
    for part in reads:
        problem = reader.feed(part)
        output: LLMEngineOutput | None = reader.burst.take()
        if output is not None:
            choices = output.choices or []
            tokens = len(output.token_ids)
            if choices and not output.token_ids:
                tokens += (len(choices) if type(choices) is RawChoices
                           else sum(map(counted_tokens, choices)))
            for choice in choices:
                collector.add(choice)
            seen.append((output.text, output.token_ids, output.completion_usage,
                         output.index, output.finish_reason, tokens,
                         [dict(choice) for choice in choices],
                         decoded(encoder.choices(choices)) if choices else None))
        seen.append(problem)
        if problem is not None or reader.done:
            break
    final = reader.final
    seen.append((reader.done, final, final and final.choices and [
        dict(c) for c in final.choices]))
    seen.append(collector.choice("stop"))
    return seen


def check(seed: int) -> bool:
    """Compare the fast and the parsed path on the stream of ``seed``; return whether the
    fast path read a run."""
    rng = random.Random(seed)
    chat = rng.random() < 0.5
    reads = cut(rng, worker_stream(rng, chat))
    fast, slow = relay(reads, chat, raw=True), relay(reads, chat, raw=False)
    assert fast == slow, (seed, chat, reads)
    reader, ran = SseReader(ChunkParser()), False
    for part in reads:
        problem = reader.feed(part)
        output = reader.burst.take()
        ran = ran or (output is not None and type(output.choices) is RawChoices)
        if problem is not None or reader.done:
            break
    return ran


@pytest.mark.parametrize("block", range(4))
def test_B8_any_worker_stream_reaches_the_client_as_the_parsed_path_gives_it(
    block: int
) -> None:
    runs = sum(check(seed) for seed in range(block * 300, (block + 1) * 300))
    assert runs > 50  # runs were read: the comparison means something
