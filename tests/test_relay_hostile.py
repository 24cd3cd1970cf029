"""The faithful relay (B8) against a hostile or quirky worker's chunks: fields whose kind
changes from one chunk to the next, tool calls with keys the router does not know, and
streams of many field-only chunks. A socket worker (``test_relay_adversary.Worker``)
sends the bytes; the client reads what the router relays on a real port."""

from __future__ import annotations

from typing import Any

import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import orjson
import trio
from test_relay_adversary import MODEL, Worker, event, running
from test_relay_fidelity import MESSAGES, chunk


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
