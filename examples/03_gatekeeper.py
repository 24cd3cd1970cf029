"""Tutorial 3: the gatekeeper holds the success terminal.

Run it with ``uv run python examples/03_gatekeeper.py``.

The decode worker may start streaming before the prefill drain has ended (the KV cache
arrives in layers; SGLang even runs both legs at once). Tokens must not wait for the
prefill, yet a request whose prefill failed must not end in a *success*. The
:class:`~trio_disagg.Gatekeeper` sits between the decode stream and the client and keeps
both promises (rules G3-G5):

1. Tokens flow at once while the prefill is still pending (G3); the success terminal is
   held until the prefill succeeds (G5).
2. A prefill that fails *after* the decode finished: the held terminal is replaced by one
   error item, and both the client's and the decode's contexts are stopped (G5).
3. A decode error passes at once, without waiting for the prefill (G4); the prefill,
   owned by the keeper, finishes on its own.

Watch the timestamps: they show what is held and for how long.
"""

from __future__ import annotations

import logging
import sys

import trio

import trio_disagg as td

Item = td.Annotated[td.LLMEngineOutput]
T0 = 0.0


def now() -> str:
    return f"{(trio.current_time() - T0) * 1000:4.0f} ms"


def token(text: str) -> Item:
    return td.Annotated.from_data(td.LLMEngineOutput(token_ids=[len(text)], text=text))


def finish(reason: td.FinishReason) -> Item:
    return td.Annotated.from_data(td.LLMEngineOutput(finish_reason=reason))


def describe(item: Item) -> str:
    if item.is_error:
        return f"ERROR item: {item.error_message()}"
    assert item.data is not None
    if item.data.finish_reason is not None:
        return f"terminal, finish={item.data.finish_reason}"
    return f"token {item.data.text!r}"


async def fake_prefill_drain(seconds: float, fail: bool) -> None:
    """The rest of a prefill stream, as the keeper drains it: done after ``seconds``."""
    await trio.sleep(seconds)
    last = finish(td.FinishReason.error("KV transfer lost a block")) if fail else finish(
        td.FinishReason.LENGTH
    )
    td.check_prefill_output(last)  # raises PrefillError on a failed output (T4)


async def fake_decode_worker(send: trio.MemorySendChannel[Item], outputs: list[Item]) -> None:
    """A decode worker: one output every 10 ms."""
    async with send:
        for item in outputs:
            await trio.sleep(0.01)
            await send.send(item)


async def run_request(
    keeper: td.TransferKeeper,
    name: str,
    *,
    prefill_seconds: float,
    prefill_fails: bool,
    decode_outputs: list[Item],
) -> None:
    client_context = td.RequestContext(name)
    decode_context = td.RequestContext(name)
    prefill = keeper.start(lambda: fake_prefill_drain(prefill_seconds, prefill_fails), name=name)
    gate = td.Gatekeeper(prefill, client_context)

    decode_send, decode_receive = trio.open_memory_channel[Item](0)
    client_send, client_receive = trio.open_memory_channel[Item](0)
    async with trio.open_nursery() as request:  # one request, one nursery (tutorial 1)
        # (The router starts the decode leg with `await gate.dispatch(...)`, which also races
        # the dispatch against a prefill failure: G1, G2. Here it is accepted at once.)
        request.start_soon(fake_decode_worker, decode_send, decode_outputs)
        request.start_soon(gate.forward, decode_receive, client_send, decode_context)
        async with client_receive:  # the client writer
            async for item in client_receive:
                state = "failed" if prefill.failed else "succeeded" if prefill.done else "pending"
                print(f"  {now()}  client <- {describe(item)}   (prefill {state})")
    print(f"  {now()}  stream ended; gate.failure={gate.failure!r}")
    print(f"           client context {client_context!r}, "
          f"decode context {decode_context!r}")
    if not prefill.done:
        await prefill.wait_done()
        print(f"  {now()}  the keeper's prefill drain ended on its own: {prefill!r}")


async def main() -> None:
    global T0
    T0 = trio.current_time()
    # The keeper logs a failed drain (T2) to "trio_disagg.keeper"; show it inline.
    logging.basicConfig(stream=sys.stdout, format="  [log] %(name)s: %(message)s")
    eos = finish(td.FinishReason.EOS)
    async with td.TransferKeeper() as keeper:
        print("1. Prefill succeeds at 100 ms; decode ends with eos at 40 ms (G3, G5).")
        await run_request(keeper, "req-1", prefill_seconds=0.1, prefill_fails=False,
                          decode_outputs=[token("Hold"), token(" the"), token(" end"), eos])
        print("   the tokens came at once; eos was held until the prefill succeeded.\n")

        T0 = trio.current_time()
        print("2. Same, but the prefill fails at 100 ms, after the decode ended (G5).")
        await run_request(keeper, "req-2", prefill_seconds=0.1, prefill_fails=True,
                          decode_outputs=[token("Hold"), token(" the"), token(" end"), eos])
        print("   the held eos was replaced by one error item: no success after a failure.\n")

        T0 = trio.current_time()
        print("3. The decode worker fails at 30 ms; the prefill succeeds at 80 ms (G4).")
        oom = finish(td.FinishReason.error("decode worker out of memory"))
        await run_request(keeper, "req-3", prefill_seconds=0.08, prefill_fails=False,
                          decode_outputs=[token("Hold"), token(" the"), oom])
        print("   the decode error went through at once: there was no success to protect.")
    print(f"keeper: started={keeper.started_total} failed={keeper.failed_total} "
          f"in_flight={keeper.in_flight}")


# tests/test_examples.py runs this file and checks that its output contains each line
# that starts with `# expect: `.
# expect: client <- terminal, finish=eos   (prefill succeeded)
# expect: client <- ERROR item: Prefill backend failed: KV transfer lost a block
# expect: client <- terminal, finish=error: decode worker out of memory   (prefill pending)
# expect: keeper: started=3 failed=1 in_flight=0

if __name__ == "__main__":
    trio.run(main)
