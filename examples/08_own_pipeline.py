"""Tutorial 8: build your own two-leg pipeline from the core, without the router.

Run it with ``uv run python examples/08_own_pipeline.py``.

:class:`~trio_disagg.DisaggRouter` is one way to put the core together. When you need a
different one (another placement, another transport, a pipeline inside your own server),
the pieces are public and compose in a few lines. This tutorial wires one request by
hand:

- a :class:`~trio_disagg.TransferKeeper`, opened once, outside every request: the
  prefill leg (the engine *and* the reading of its stream) is started with
  ``keeper.start(...)``, so no request's cancellation is its parent (T1);
- the prefill leg runs on ``client_context.detached_copy()`` (C5), the decode leg on a
  context linked with ``client_context.link_child(...)`` (C4);
- the prefill's first output is classified with
  :func:`~trio_disagg.classify_first_output` (S1-S10) and the rest of its stream read with
  :func:`~trio_disagg.drain_prefill_outputs`, which checks every later output (T4);
- a :class:`~trio_disagg.Gatekeeper` dispatches the decode with ``gate.dispatch(...)``,
  racing the prefill (G1, G2), then ``gate.forward(...)`` moves the decode's outputs to
  the client, holding the success terminal until the prefill's outcome is known (G5).

The fake engines send their handoff first and go on "transferring" for a while, as a
bootstrap (SGLang) prefill does, so the decode runs while the prefill's fate is open.

1. A normal request: tokens flow at once; the decode's terminal waits for the prefill.
2. The client kills its context mid-transfer, then leaves: the decode leg is killed
   through its linked context, the request's nursery is cancelled, but the prefill leg,
   on its detached context in the keeper, runs to its end and succeeds (T1, C5, G9).
3. The prefill fails after the decode's last token: the held terminal becomes ONE error
   item, and the client's and decode's contexts are stopped (G5).
"""

from __future__ import annotations

import logging
import sys

import attrs
import trio

import trio_disagg as td

Item = td.Annotated[td.LLMEngineOutput]
T0 = 0.0


def now() -> str:
    return f"{(trio.current_time() - T0) * 1000:4.0f} ms"


def restart_clock() -> None:
    global T0
    T0 = trio.current_time()


async def fake_prefill(
    request: td.PreprocessedRequest,
    context: td.RequestContext,
    send: trio.MemorySendChannel[Item],
    *,
    transfer: float,
    fail: bool,
) -> None:
    """A prefill worker: the handoff at once, then ``transfer`` seconds of KV transfer,
    then its last output (an error item if ``fail``)."""
    with send:
        handoff = td.LLMEngineOutput(disaggregated_params={"kv_key": request.request_id})
        await send.send(td.Annotated.from_data(handoff))
        await trio.sleep(transfer)
        if context.is_stopped:  # never, here: nobody stops a detached context (C5)
            return
        last = (td.Annotated[td.LLMEngineOutput].from_error("prefill worker lost its KV")
                if fail else td.Annotated.from_data(td.LLMEngineOutput.length()))
        await send.send(last)


async def fake_decode(
    request: td.PreprocessedRequest,
    context: td.RequestContext,
    send: trio.MemorySendChannel[Item],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A decode worker: accepts, then three tokens 10 ms apart; a kill stops it at once."""
    with send:
        assert request.prefill_result is not None  # the handoff, as the prefill sent it
        task_status.started()
        with trio.CancelScope() as scope:
            context.on_stop(lambda killed: scope.cancel())
            for i in range(3):
                await trio.sleep(0.01)
                finish = td.FinishReason.EOS if i == 2 else None
                await send.send(td.Annotated.from_data(
                    td.LLMEngineOutput(token_ids=[i], text=f" t{i}", finish_reason=finish)))
        if scope.cancelled_caught:
            print(f"  {now()}  decode: {context!r}, stops at once")


@attrs.define
class Pipeline:
    """One request's legs, kept for the lessons to check."""

    client: td.RequestContext
    prefill_context: td.RequestContext
    decode_context: td.RequestContext
    prefill: td.PrefillTask[td.PrefillCompletion]
    received: list[tuple[float, Item]] = attrs.Factory(list)


async def serve(
    keeper: td.TransferKeeper,
    request: td.PreprocessedRequest,
    client: td.RequestContext,
    *,
    transfer: float,
    fail: bool = False,
    pipeline: list[Pipeline],
) -> None:
    """One request through the hand-built pipeline; the caller's cancel scope is the
    client's connection."""
    prefill_context = client.detached_copy()  # C5: same id, not linked
    decode_context = td.RequestContext(request.request_id, client.metadata)
    client.link_child(decode_context)  # C4: the client's stop or kill reaches the decode
    handed_off = trio.Event()
    handoffs: list[td.PrefillResult] = []

    async def prefill_leg() -> td.PrefillCompletion:
        """The whole prefill leg, run by the keeper: the engine and its stream (T1)."""
        send, receive = trio.open_memory_channel[Item](8)
        async with trio.open_nursery() as leg:
            leg.start_soon(lambda: fake_prefill(request, prefill_context, send,
                                                transfer=transfer, fail=fail))
            with receive:
                try:
                    first = await receive.receive()
                except trio.EndOfChannel:
                    raise td.PrefillError("Prefill returned no output") from None  # S1
                completion = td.classify_first_output(first)  # S2, S7, S8: may raise
                if isinstance(completion, td.Handoff):
                    handoffs.append(completion.result)
                    handed_off.set()  # the decode may start now
                await td.drain_prefill_outputs(receive)  # T4: a late failure raises here
        return completion

    prefill = keeper.start(prefill_leg, name=request.request_id)
    legs = Pipeline(client, prefill_context, decode_context, prefill)
    pipeline.append(legs)
    gate = td.Gatekeeper(prefill, client)
    decode_send, decode_receive = trio.open_memory_channel[Item](8)
    client_send, client_receive = trio.open_memory_channel[Item](8)

    async def start_decode(*, task_status: trio.TaskStatus[None]) -> None:
        await handed_off.wait()  # a prefill failure before this cancels it (G1)
        decoded = attrs.evolve(request, prefill_result=handoffs[0])
        await fake_decode(decoded, decode_context, decode_send, task_status=task_status)

    async with trio.open_nursery() as nursery:  # the request: decode leg, gate, writer
        await gate.dispatch(nursery, start_decode)  # G1, G2
        nursery.start_soon(gate.forward, decode_receive, client_send, decode_context)
        async with client_receive:  # the client writer
            async for item in client_receive:
                legs.received.append((trio.current_time(), item))
                state = ("failed" if prefill.failed else "succeeded" if prefill.done
                         else "pending")
                print(f"  {now()}  client <- {describe(item)}   (prefill {state})")


def describe(item: Item) -> str:
    if item.is_error:
        return f"ERROR item: {item.error_message()}"
    assert item.data is not None
    end = f", finish={item.data.finish_reason}" if item.data.finish_reason else ""
    return f"{item.data.text!r}{end}"


def make_request(request_id: str) -> td.PreprocessedRequest:
    return td.PreprocessedRequest(request_id=request_id, model="fake", stream=True,
                                  body={"model": "fake", "prompt": "own pipeline"})


async def main() -> None:
    # The keeper logs a failed prefill leg (T2) to "trio_disagg.keeper"; show it inline.
    logging.basicConfig(stream=sys.stdout, format="  [log] %(name)s: %(message)s")
    legs: list[Pipeline] = []
    async with td.TransferKeeper() as keeper:  # once, outside every request
        print("1. A normal request; the prefill's transfer ends at 40 ms (G3, G5).")
        restart_clock()
        await serve(keeper, make_request("req-1"), td.RequestContext("req-1"),
                    transfer=0.04, pipeline=legs)
        one = legs[-1]
        terminal_at, terminal = one.received[-1]
        assert terminal.data is not None and terminal.data.finish_reason is td.FinishReason.EOS
        assert one.prefill.succeeded and terminal_at - T0 >= 0.04  # held for the prefill
        print("   the tokens came at once; eos waited for the prefill's outcome.\n")

        print("2. The client kills its context at 15 ms, then disconnects (T1, C5, G9).")
        restart_clock()
        client = td.RequestContext("req-2")
        with trio.CancelScope() as connection:  # the client's connection
            async with trio.open_nursery() as server:
                server.start_soon(lambda: serve(keeper, make_request("req-2"), client,
                                                transfer=0.04, pipeline=legs))
                await trio.sleep(0.015)
                client.kill()  # the client's kill reaches the decode (C4)...
                await trio.sleep(0.005)
                connection.cancel()  # ...and its disconnect cancels the request
        two = legs[-1]
        print(f"  {now()}  request cancelled={connection.cancelled_caught}; contexts: "
              f"client {client!r}, decode {two.decode_context!r}, "
              f"prefill {two.prefill_context!r}")
        assert two.decode_context.is_killed and not two.prefill_context.is_stopped
        assert not two.prefill.done, "the prefill leg still runs, in the keeper"
        await two.prefill.wait_done()
        assert two.prefill.succeeded, "the prefill leg survived its client (T1, G9)"
        print(f"  {now()}  {two.prefill!r}: the KV transfer ran to its end\n")

        print("3. The prefill fails at 60 ms, after the decode's last token (G5).")
        restart_clock()
        await serve(keeper, make_request("req-3"), td.RequestContext("req-3"),
                    transfer=0.06, fail=True, pipeline=legs)
        three = legs[-1]
        items = [item for _, item in three.received]
        assert [item.is_error for item in items] == [False, False, True], \
            "two tokens, then ONE error item in place of the held eos"
        assert three.client.is_stopped and three.decode_context.is_stopped
        print(f"  client {three.client!r}, decode {three.decode_context!r}")
    print(f"keeper: started={keeper.started_total} failed={keeper.failed_total} "
          f"in_flight={keeper.in_flight}")


# tests/test_examples.py runs this file and checks that its output contains each line
# that starts with `# expect: `.
# expect: client <- ' t2', finish=eos   (prefill succeeded)
# expect: decode: <RequestContext 'req-2' killed>, stops at once
# expect: request cancelled=True
# expect: prefill <RequestContext 'req-2' live>
# expect: <PrefillTask 'req-2' succeeded>: the KV transfer ran to its end
# expect: client <- ERROR item: Prefill returned an error in its output stream: prefill worker
# expect: client <RequestContext 'req-3' stopped>, decode <RequestContext 'req-3' stopped>
# expect: keeper: started=3 failed=1 in_flight=0

if __name__ == "__main__":
    trio.run(main)
