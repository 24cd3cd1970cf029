"""Tutorial 8: build your own two-leg pipeline from the core, without the router.

Run it with ``uv run python examples/08_own_pipeline.py``.

:class:`~trio_disagg.DisaggRouter` is one way to put the core together. When you need a
different one (another placement, another transport, a pipeline inside your own server),
the pieces are public and compose without glue of your own. This tutorial wires one
request by hand:

- a :class:`~trio_disagg.TransferKeeper`, opened once, outside every request. The whole
  prefill leg runs in it, so no request's cancellation is its parent (T1): the engine as a
  transfer leg (``keeper.spawn_leg``), and the reading of its stream with
  :func:`~trio_disagg.consume_prefill_stream` (``keeper.start``);
- :func:`~trio_disagg.consume_prefill_stream` classifies the first output (S1-S10) and,
  for a bootstrap handoff, hands the rest of the stream to the keeper as a drain named
  after the request (``name=``), which checks every later output (T4). It returns as soon
  as the handoff is known. Given the engine's leg (``leg=``), it reads the stream's end
  as the engine's end: an engine that refused, or raised after its handoff, fails the
  prefill (T3) rather than ending a stream that would read as a success;
- the prefill leg runs on ``client_context.detached_copy()`` (C5), the decode leg on a
  context linked with ``client_context.link_child(...)`` (C4);
- a :class:`~trio_disagg.Gatekeeper` takes that handoff as it is (it watches the drain):
  ``gate.dispatch(...)`` starts the decode, racing the prefill (G1, G2), then the client
  reads ``gate.outputs(...)``, a receive channel that pulls each decode output through
  the gate in the client's own task (no forwarding task), holding the success terminal
  until the prefill's outcome is known (G5). A prefill failure is logged once, by the
  keeper, under the request's name (T2). (``gate.forward(...)``, shown in tutorial 3,
  pushes the same into a channel instead.)

The fake prefill hands off a bootstrap room at once and goes on "transferring" for a
while, as an SGLang prefill does, so the decode runs while the prefill's fate is open.

1. A normal request: tokens flow at once; the decode's terminal waits for the prefill.
2. The client kills its context mid-transfer, then leaves: the decode leg is killed
   through its linked context, the request's nursery is cancelled, but the prefill leg,
   on its detached context in the keeper, runs to its end and succeeds (T1, C5, G9).
3. The prefill fails after the decode's last token: the held terminal becomes ONE error
   item, the client's and decode's contexts are stopped (G5), and the failure is logged
   once (T2).
"""

from __future__ import annotations

import itertools
import logging
import sys
from functools import partial

import attrs
import trio

import trio_disagg as td

Item = td.Annotated[td.LLMEngineOutput]
ROOMS = itertools.count(1)
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
    until: trio.Event,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A bootstrap prefill worker: accepts, hands off its room at once, then ``transfer``
    seconds of KV transfer (and, so that each lesson's order holds on a loaded machine,
    not before ``until`` is set), then its last output (an error item if ``fail``)."""
    with send:
        task_status.started()
        assert request.bootstrap_info is not None  # the room the pipeline chose (S5)
        handoff = td.LLMEngineOutput(disaggregated_params=request.bootstrap_info.as_params())
        await send.send(td.Annotated.from_data(handoff))
        await trio.sleep(transfer)
        await until.wait()
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
    """A decode worker: joins the room, then three tokens 10 ms apart; a kill stops it at
    once."""
    with send:
        assert request.bootstrap_info is not None  # where the KV comes from
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
    prefill: td.PrefillTask[td.Handoff] | None = None  # the drain the gate watches
    #: Set once the decode leg sent its last output.
    decoded: trio.Event = attrs.Factory(trio.Event)
    #: (when, item, the prefill's state then) for each item the client received
    received: list[tuple[float, Item, str]] = attrs.Factory(list)


async def serve(
    keeper: td.TransferKeeper,
    request: td.PreprocessedRequest,
    client: td.RequestContext,
    *,
    transfer: float,
    fail: bool = False,
    until: trio.Event | None = None,
    pipeline: list[Pipeline],
) -> None:
    """One request through the hand-built pipeline; the caller's cancel scope is the
    client's connection. The prefill ends once ``until`` is set (a failing one once the
    decode sent its last output)."""
    name = request.request_id
    room = td.BootstrapInfo(host="127.0.0.1", port=8998, room=next(ROOMS))
    request = attrs.evolve(request, bootstrap_info=room)
    legs = Pipeline(client, client.detached_copy(),  # C5: same id, not linked
                    td.RequestContext(name, client.metadata))
    client.link_child(legs.decode_context)  # C4: the client's stop or kill reaches the decode
    pipeline.append(legs)

    # The prefill leg, all of it in the keeper (T1): the engine as a transfer leg, and the
    # reading of its stream; consume_prefill_stream hands the rest of a bootstrap stream to
    # the keeper as a drain named after the request (S5, T4).
    prefill_send, prefill_receive = trio.open_memory_channel[Item](8)
    # Given the engine's leg, the stream's end is read as the engine's end: an engine that
    # refused, or raised after its handoff, fails the prefill (T3), never reads as success.
    if until is None:  # a failing prefill fails after the decode's last token (lesson 3)
        until = legs.decoded if fail else trio.Event()
        if not fail:
            until.set()  # no wait but its transfer
    leg = keeper.spawn_leg(partial(fake_prefill, transfer=transfer, fail=fail, until=until),
                           request,
                           legs.prefill_context, prefill_send, name=name, kind="prefill engine")
    reader = keeper.start(partial(td.consume_prefill_stream, prefill_receive,
                                  keeper=keeper, name=name, leg=leg),
                          name=name, kind="prefill stream")
    completion = await reader.result()  # the handoff; a failed first output raises (S2)

    gate = td.Gatekeeper(completion, client)  # watches the drain: no glue needed
    legs.prefill = completion.drain if isinstance(completion, td.Handoff) else None
    decode_send, decode_receive = trio.open_memory_channel[Item](8)

    async def start_decode(*, task_status: trio.TaskStatus[None]) -> None:
        assert isinstance(completion, td.Handoff)  # a Terminal dispatches nothing (S7)
        decoded = attrs.evolve(request, prefill_result=completion.result)
        await fake_decode(decoded, legs.decode_context, decode_send, task_status=task_status)
        legs.decoded.set()

    async with trio.open_nursery() as nursery:  # the request: the decode leg, the writer
        await gate.dispatch(nursery, start_decode)  # G1, G2
        # The client writer reads through the gate, in its own task (G3-G8).
        with gate.outputs(decode_receive, legs.decode_context) as outputs:
            async for item in outputs:
                prefill = gate.prefill
                state = ("failed" if prefill.failed else "succeeded" if prefill.done
                         else "pending")
                legs.received.append((trio.current_time(), item, state))
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


class Collect(logging.Handler):
    """Keeps the keeper's log records, to count them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def main() -> None:
    # The keeper logs a failed prefill (T2) to "trio_disagg.keeper"; show it inline.
    logging.basicConfig(stream=sys.stdout, format="  [log] %(name)s: %(message)s")
    logs = Collect()
    logging.getLogger("trio_disagg.keeper").addHandler(logs)
    legs: list[Pipeline] = []
    async with td.TransferKeeper() as keeper:  # once, outside every request
        print("1. A normal request; the prefill's transfer ends at 40 ms (G3, G5).")
        restart_clock()
        await serve(keeper, make_request("req-1"), td.RequestContext("req-1"),
                    transfer=0.04, pipeline=legs)
        one = legs[-1]
        terminal_at, terminal, state = one.received[-1]
        assert terminal.data is not None and terminal.data.finish_reason is td.FinishReason.EOS
        assert state == "succeeded", "the terminal waited for the prefill's outcome (G5)"
        assert terminal_at - T0 >= 0.04  # the transfer's end, not the decode's (30 ms)
        print("   the tokens came at once; eos waited for the prefill's outcome.\n")

        print("2. The client kills its context at 15 ms, then disconnects (T1, C5, G9).")
        restart_clock()
        client = td.RequestContext("req-2")
        transferred = trio.Event()  # the transfer outlasts the client, however slow the run
        with trio.CancelScope() as connection:  # the client's connection
            async with trio.open_nursery() as server:
                server.start_soon(lambda: serve(keeper, make_request("req-2"), client,
                                                transfer=0.04, until=transferred,
                                                pipeline=legs))
                await trio.sleep(0.015)
                client.kill()  # the client's kill reaches the decode (C4)...
                await trio.sleep(0.005)
                connection.cancel()  # ...and its disconnect cancels the request
        two = legs[-1]
        print(f"  {now()}  request cancelled={connection.cancelled_caught}; contexts: "
              f"client {client!r}, decode {two.decode_context!r}, "
              f"prefill {two.prefill_context!r}")
        assert two.decode_context.is_killed and not two.prefill_context.is_stopped
        assert two.prefill is not None and not two.prefill.done, \
            "the prefill leg still runs, in the keeper"
        transferred.set()
        await two.prefill.wait_done()
        assert two.prefill.succeeded, "the prefill leg survived its client (T1, G9)"
        print(f"  {now()}  {two.prefill!r}: the KV transfer ran to its end\n")

        print("3. The prefill fails at 60 ms, after the decode's last token (G5, T2).")
        restart_clock()
        await serve(keeper, make_request("req-3"), td.RequestContext("req-3"),
                    transfer=0.06, fail=True, pipeline=legs)
        three = legs[-1]
        items = [item for _, item, _ in three.received]
        assert [item.is_error for item in items] == [False, False, True], \
            "two tokens, then ONE error item in place of the held eos"
        assert three.client.is_stopped and three.decode_context.is_stopped
        print(f"  client {three.client!r}, decode {three.decode_context!r}")
        failures = [record for record in logs.records if "req-3" in record.getMessage()]
        assert len(failures) == 1, "the failure is logged once, under the request's name"
        print(f"  the keeper logged it {len(failures)} time, as "
              f"{failures[0].getMessage()[:30]!r}...")
    print(f"keeper: started={dict(keeper.started_by_kind)}\n"
          f"        failed={keeper.failed_total} in_flight={keeper.in_flight}")


# tests/test_examples.py runs this file and checks that its output contains each line
# that starts with `# expect: client <- ' t2', finish=eos   (prefill succeeded)
# expect: decode: <RequestContext 'req-2' killed>, stops at once
# expect: request cancelled=True
# expect: prefill <RequestContext 'req-2' live>
# expect: <PrefillTask 'req-2' succeeded>: the KV transfer ran to its end
# expect: [log] trio_disagg.keeper: prefill drain req-3 failed: Prefill returned an error
# expect: client <- ERROR item: Prefill returned an error in its output stream: prefill worker
# expect: client <RequestContext 'req-3' stopped>, decode <RequestContext 'req-3' stopped>
# expect: the keeper logged it 1 time, as 'prefill drain req-3 failed: Pr'...
# expect: keeper: started={'prefill engine': 3, 'prefill stream': 3, 'prefill drain': 3}
# expect: failed=1 in_flight=0

if __name__ == "__main__":
    trio.run(main)
