"""Tutorial 7: write your own prefill and decode engines.

Run it with ``uv run python examples/07_write_an_engine.py``.

To the router a decode worker is anything that satisfies the
:class:`~trio_disagg.DecodeEngine` protocol: a ``name`` and one ``generate`` method that
sends ``Annotated[LLMEngineOutput]`` items into a trio memory channel. A prefill worker is
a :class:`~trio_disagg.PrefillEngine`: the same, plus how it hands the KV off
(``handoff_style``, and for the bootstrap style ``bootstrap_host`` and
``bootstrap_port``). This tutorial writes a
tiny pair from the protocol's docstring alone (docs: "Write an engine"), with an
in-memory "KV cache": a dict shared by both engines. The prefill *stages* the prompt's KV
in it under a key and hands the key off; the decode *pulls* the KV by that key and
deletes it. A key left in the dict at the end would be stranded KV.

The contract, in the order the code below meets it:

- ``task_status.started()`` once the worker accepted the request (the router dispatches
  a decode with ``await nursery.start(engine.generate, ...)``);
- the prefill's first output carries the handoff in ``disaggregated_params``, with the
  prompt's usage (S4); the engine itself cuts the client's ``max_tokens`` to one token;
- the decode finds the handoff in ``request.prefill_result`` (sequential) or
  ``request.bootstrap_info`` (bootstrap);
- ``context`` is honoured (stop: one ``cancelled`` finish; kill: stop at once), a closed
  reader (``trio.BrokenResourceError``) ends the engine quietly, and a failure after
  ``started()`` is one error item, never an exception.

Then the engines go into a :class:`~trio_disagg.DisaggRouter`, which adds the rules:

1. A normal request: prefill, handoff, decode; the KV dict is empty afterwards.
2. The client leaves while its prefill computes. The prefill runs on a context of its
   own in the keeper, so it survives the client (C5, T1); the router then consumes its
   staged KV with a one-token cleanup decode (B1): the KV dict still ends empty.
3. A bootstrap-style pair whose prefill fails *after* the decode has sent its last token:
   the gatekeeper held the decode's success terminal until the prefill's outcome was
   known, and the client gets the prefill's error in its place (G5).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import trio

import trio_disagg as td

Item = td.Annotated[td.LLMEngineOutput]
PROMPT = "Engines are easy to write"
T0 = 0.0


def now() -> str:
    return f"{(trio.current_time() - T0) * 1000:4.0f} ms"


def restart_clock() -> None:
    global T0
    T0 = trio.current_time()


class KVStore:
    """The "GPU memory" both engines share: staged KV by key. ``staged`` is the dict; the
    events let a bootstrap decode wait for KV that is not staged yet, and its prefill wait
    until the KV was pulled."""

    def __init__(self) -> None:
        self.staged: dict[str, list[int]] = {}
        self._arrived: dict[str, trio.Event] = {}
        self._pulled: dict[str, trio.Event] = {}

    def _event(self, events: dict[str, trio.Event], key: str) -> trio.Event:
        return events.setdefault(key, trio.Event())

    def stage(self, key: str, blocks: list[int]) -> None:
        self.staged[key] = blocks
        self._event(self._arrived, key).set()

    async def wait_staged(self, key: str) -> None:
        await self._event(self._arrived, key).wait()

    def pull(self, key: str) -> list[int]:
        """Take the KV (a KeyError if there is none) and free it."""
        blocks = self.staged.pop(key)
        self._arrived.pop(key, None)
        self._event(self._pulled, key).set()
        return blocks

    async def wait_pulled(self, key: str) -> None:
        await self._event(self._pulled, key).wait()
        self._pulled.pop(key, None)


def stop_scope(context: td.RequestContext) -> trio.CancelScope:
    """A cancel scope that the context's stop or kill cancels (C1-C3)."""
    scope = trio.CancelScope()
    context.on_stop(lambda killed: scope.cancel())
    return scope


async def end_stopped(send: trio.MemorySendChannel[Item], context: td.RequestContext) -> None:
    """A stopped stream ends with one ``cancelled`` finish; a killed one with nothing."""
    if not context.is_killed:
        await send.send(td.Annotated.from_data(
            td.LLMEngineOutput(finish_reason=td.FinishReason.CANCELLED)))


class TinyPrefill:
    """A prefill engine. ``SEQUENTIAL``: compute, stage the KV under ``kv-<request id>``,
    send ONE output, the handoff. ``BOOTSTRAP``: send the handoff (the room) at once,
    compute, stage the KV in the room, wait for the decode to pull it, then end with the
    last output (or, if the body asks for it, with an error item: lesson 3)."""

    # No cancel_window attribute: CancelWindow.NEVER, the router never cancels the
    # prefill because its client left; the keeper runs it to its end (B10, then B1).

    def __init__(self, kv: KVStore, name: str, style: td.HandoffStyle,
                 compute: float = 0.02) -> None:
        self.kv = kv
        self.name = name
        self.handoff_style = style
        self.compute = compute
        self.contexts: list[td.RequestContext] = []  # what lesson 2 checks
        self.finished: list[str] = []  # request ids served to the end
        # Where a bootstrap decode meets this prefill (docs/protocols.md section 3).
        bootstrap = style is td.HandoffStyle.BOOTSTRAP
        self.bootstrap_host: str | None = "127.0.0.1" if bootstrap else None
        self.bootstrap_port: int | None = 8998 if bootstrap else None

    async def generate(
        self,
        request: td.PreprocessedRequest,
        context: td.RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with send_channel:  # the stream ends when this engine returns, however it returns
            if not request.body.get("prompt"):
                # Refused before started(): the one time an engine raises WorkerError.
                raise td.WorkerError(f"{self.name}: no prompt", status=400, worker=self.name)
            self.contexts.append(context)
            task_status.started()
            # The router sends the client's body: cutting it to one token is our job.
            print(f"  {now()}  {self.name} <- {request.request_id} (the client asked for "
                  f"max_tokens={request.max_tokens}; a prefill makes 1 token)")
            tokens = len(PROMPT.split())
            usage = td.CompletionUsage(  # S4: the prefill's counts are the ones reported
                prompt_tokens=tokens, total_tokens=tokens + 1,
                prompt_tokens_details=td.PromptTokensDetails(cached_tokens=2))
            try:
                with stop_scope(context) as stopped:
                    if self.handoff_style is td.HandoffStyle.BOOTSTRAP:
                        await self._bootstrap(request, send_channel, usage)
                    else:
                        await trio.sleep(self.compute)  # "compute the prompt's KV"
                        key = f"kv-{request.request_id}"
                        self.kv.stage(key, list(range(tokens)))
                        handoff = td.LLMEngineOutput(
                            token_ids=[7], finish_reason=td.FinishReason.LENGTH,
                            disaggregated_params={"kv_key": key}, completion_usage=usage)
                        await send_channel.send(td.Annotated.from_data(handoff))
                        print(f"  {now()}  {self.name}: staged {key}, handed it off")
                    self.finished.append(request.request_id)
                if stopped.cancelled_caught:
                    await end_stopped(send_channel, context)
            except trio.BrokenResourceError:
                return  # nobody reads us any more: the router decides about the KV

    async def _bootstrap(self, request: td.PreprocessedRequest,
                         send: trio.MemorySendChannel[Item], usage: td.CompletionUsage) -> None:
        info = request.bootstrap_info
        assert info is not None  # the router picked the room (S5)
        key = f"room-{info.room}"
        # The first output is the handoff, at once: the bootstrap triple (S5).
        await send.send(td.Annotated.from_data(td.LLMEngineOutput(
            disaggregated_params=info.as_params(), completion_usage=usage)))
        await trio.sleep(self.compute)
        self.kv.stage(key, [1, 2, 3])
        await self.kv.wait_pulled(key)  # the decode joined the room and took the KV
        if request.body.get("fail_after_transfer"):
            await trio.sleep(0.04)  # ...and the decode has finished meanwhile
            print(f"  {now()}  {self.name}: fails after the transfer: one error item")
            # Started already, so no exception: ONE error item, then the end.
            await send.send(td.Annotated.from_error(f"{self.name}: lost the KV ack"))
            return
        await send.send(td.Annotated.from_data(td.LLMEngineOutput.length()))


class TinyDecode:
    """A decode engine: find the handoff, pull the KV (deleting it), stream tokens.

    A :class:`~trio_disagg.DecodeEngine` needs nothing but a ``name`` and ``generate``:
    the handoff style and the bootstrap address are a prefill engine's business."""

    def __init__(self, kv: KVStore, name: str, on_terminal: Callable[[], None]) -> None:
        self.kv = kv
        self.name = name
        self.on_terminal = on_terminal  # lesson 3 notes when the terminal was sent

    async def generate(
        self,
        request: td.PreprocessedRequest,
        context: td.RequestContext,
        send_channel: trio.MemorySendChannel[Item],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with send_channel:
            # Where the handoff is: the room for a bootstrap prefill, else the prefill's
            # disaggregated_params as it sent them.
            if request.bootstrap_info is not None:
                key = f"room-{request.bootstrap_info.room}"
            else:
                assert request.prefill_result is not None
                key = request.prefill_result.disaggregated_params["kv_key"]
                if key not in self.kv.staged:  # refused before started(): raise
                    raise td.WorkerError(f"{self.name}: no KV under {key}", status=502,
                                         worker=self.name, handoff_lost=True)
            cleanup = request.max_tokens == 1 and not request.stream
            print(f"  {now()}  {self.name} <- {request.request_id}, pull {key}"
                  + (" (max_tokens=1, stream=False: the router's B1 cleanup)" if cleanup
                     else ""))
            task_status.started()  # accepted: queued on the worker, or joined the room
            try:
                with stop_scope(context) as stopped:
                    await self.kv.wait_staged(key)  # at once unless bootstrap
                    self.kv.pull(key)  # fetched, and freed on the prefill side
                    budget = request.max_tokens or 3
                    for i in range(budget):
                        await trio.sleep(0.005)
                        last = i == budget - 1
                        output = td.LLMEngineOutput(
                            token_ids=[i], text=f" tok{i}",
                            finish_reason=td.FinishReason.LENGTH if last else None)
                        if last:
                            self.on_terminal()
                        await send_channel.send(td.Annotated.from_data(output))
                if stopped.cancelled_caught:
                    await end_stopped(send_channel, context)
            except trio.BrokenResourceError:
                return


def describe(item: Item) -> str:
    if item.is_error:
        return f"ERROR item: {item.error_message()}"
    assert item.data is not None
    end = f", finish={item.data.finish_reason}" if item.data.finish_reason else ""
    return f"{item.data.text!r}{end}"


def make_request(request_id: str, **extra: object) -> td.PreprocessedRequest:
    body: dict[str, object] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, **extra}
    return td.PreprocessedRequest(request_id=request_id, model="tiny", body=body,
                                  max_tokens=3, stream=True)


async def run(
    router: td.DisaggRouter, request: td.PreprocessedRequest
) -> list[tuple[float, Item]]:
    """One client: send the request, print and return what it receives, and when."""
    received: list[tuple[float, Item]] = []
    async with trio.open_nursery() as nursery:  # the request (tutorial 1)
        stream = await router.stream(nursery, request, td.RequestContext(request.request_id))
        async with stream.outputs:
            async for item in stream.outputs:
                received.append((trio.current_time(), item))
                print(f"  {now()}  client <- {describe(item)}")
    return received


async def main() -> None:
    # The keeper logs failed drains (T2) to "trio_disagg.keeper"; show them inline.
    logging.basicConfig(stream=sys.stdout, format="  [log] %(name)s: %(message)s")
    kv = KVStore()
    terminal_sent: list[float] = []
    decode = TinyDecode(kv, "tiny-decode", lambda: terminal_sent.append(trio.current_time()))
    prefill = TinyPrefill(kv, "tiny-prefill", td.HandoffStyle.SEQUENTIAL)
    deadlines = td.Deadlines(prefill=2, handoff=2, decode_idle=2, terminal_hold=2)
    async with td.TransferKeeper() as keeper:
        router = td.DisaggRouter(td.WorkerPool([prefill]), td.WorkerPool([decode]), keeper,
                                 deadlines=deadlines)

        print("1. A normal request: prefill, handoff, decode.")
        restart_clock()
        received = await run(router, make_request("req-1"))
        await keeper.wait_idle()
        assert [item.data.text for _, item in received if item.data] == [" tok0", " tok1", " tok2"]
        assert kv.staged == {}
        print(f"  {now()}  done: KV dict {kv.staged}\n")

        print("2. The client leaves 10 ms into its 20 ms prefill (C5, T1, B1).")
        restart_clock()
        with trio.move_on_after(0.01) as client:  # the disconnect cancels the request
            await run(router, make_request("req-2"))
        assert client.cancelled_caught
        prefill_context = prefill.contexts[-1]
        print(f"  {now()}  client gone; the prefill runs on in the keeper "
              f"(in_flight={keeper.in_flight}), on {prefill_context!r}")
        await keeper.wait_idle()
        assert "req-2" in prefill.finished, "the prefill survives its client (C5, T1)"
        assert not prefill_context.is_stopped  # never stopped by the client (C5)
        assert router.counters.staged_kv_cleanups == 1  # B1
        assert kv.staged == {}, "the cleanup decode consumed the staged KV (B1)"
        print(f"  {now()}  keeper idle: the prefill finished, cleanup decodes="
              f"{router.counters.staged_kv_cleanups}, KV dict {kv.staged}\n")

        print("3. Bootstrap style: the prefill fails after the decode's last token (G5).")
        bootstrap = TinyPrefill(kv, "tiny-sglang", td.HandoffStyle.BOOTSTRAP, compute=0.01)
        router = td.DisaggRouter(td.WorkerPool([bootstrap]), td.WorkerPool([decode]), keeper,
                                 deadlines=deadlines)
        restart_clock()
        received = await run(router, make_request("req-3", fail_after_transfer=True))
        await keeper.wait_idle()
        items = [item for _, item in received]
        assert items[-1].is_error and not any(item.is_error for item in items[:-1])
        assert not any(item.data and item.data.finish_reason for item in items), \
            "the decode's success terminal never reached the client"
        error_at = received[-1][0]
        assert error_at >= terminal_sent[-1], "held until the prefill's outcome (G5)"
        print(f"  the decode sent its terminal at {(terminal_sent[-1] - T0) * 1000:.0f} ms; "
              f"the gatekeeper held it, then sent the prefill's error instead")
        assert kv.staged == {}
        print(f"  {now()}  KV dict {kv.staged}, keeper in_flight={keeper.in_flight}")


# tests/test_examples.py runs this file and checks that its output contains each line
# that starts with `# expect: `.
# expect: tiny-prefill <- req-1 (the client asked for max_tokens=3; a prefill makes 1 token)
# expect: client <- ' tok2', finish=length
# expect: done: KV dict {}
# expect: client gone; the prefill runs on in the keeper (in_flight=1)
# expect: pull kv-req-2 (max_tokens=1, stream=False: the router's B1 cleanup)
# expect: keeper idle: the prefill finished, cleanup decodes=1, KV dict {}
# expect: client <- ERROR item: Prefill returned an error in its output stream
# expect: the gatekeeper held it, then sent the prefill's error instead
# expect: KV dict {}, keeper in_flight=0

if __name__ == "__main__":
    trio.run(main)
