"""Tutorial 1: one request is a nursery.

Run it with ``uv run python examples/01_request_nursery.py``.

Three lessons, each printed as it happens (rules C1-C5):

1. Each request runs in a nursery of its own, which holds the decode producer and the
   client writer. A client that disconnects cancels *that* nursery and nothing else: the
   other requests keep streaming.
2. A :class:`~trio_disagg.RequestContext` tells a producer (a worker) to stop.
   ``stop_generating()`` is polite: the producer ends its stream with a ``cancelled``
   finish, and what it already sent stays valid. ``kill()`` is abrupt: the producer stops
   at once and sends nothing more. States only move forward (C1-C3).
3. The decode leg's context is a linked child of the client's, so stopping the client
   stops the decode (C4). The prefill leg runs on a *detached* copy: same id and metadata,
   but stopping or killing the client's context never reaches it (C5), because its KV
   cache may still be on its way to the decode worker (see tutorial 2). (A client that
   disconnects does not stop or kill its context: the server cancels its nursery, as in
   lesson 1.)
"""

from __future__ import annotations

import trio

import trio_disagg as td

Item = td.Annotated[td.LLMEngineOutput]
WORDS = ["Nurseries", "make", "cancellation", "a", "tree", "."]


def token(index: int, text: str) -> Item:
    return td.Annotated.from_data(td.LLMEngineOutput(token_ids=[index], text=text))


def finish(reason: td.FinishReason) -> Item:
    return td.Annotated.from_data(td.LLMEngineOutput(finish_reason=reason))


async def fake_worker(
    context: td.RequestContext,
    send: trio.MemorySendChannel[Item],
    words: list[str],
    delay: float,
) -> None:
    """A stand-in for a prefill or decode worker: one word every ``delay`` s, then ``eos``.

    It honours its context the way the ``Engine`` protocol asks of a real worker.
    """
    async with send:  # closing the channel is how the consumer learns the stream ended
        with trio.CancelScope() as scope:

            def on_stop(killed: bool) -> None:
                if killed:
                    scope.cancel()  # kill(): stop at once, send nothing more

            context.on_stop(on_stop)
            for index, word in enumerate(words):
                if context.is_stopped:  # stop_generating(): end politely with `cancelled`
                    await send.send(finish(td.FinishReason.CANCELLED))
                    return
                await send.send(token(index, word))
                # Sleep for `delay`, but wake at once if the context is stopped.
                with trio.move_on_after(delay):
                    await context.stopped()
            await send.send(finish(td.FinishReason.EOS))


def describe(item: Item) -> str:
    data = item.data
    if data is not None and data.finish_reason is not None:
        return f"finish={data.finish_reason}"
    return repr(data.text if data is not None else None)


# --- 1. one request, one nursery ---------------------------------------------------------


async def client_writer(name: str, receive: trio.MemoryReceiveChannel[Item]) -> None:
    """Writes the stream to the client (here: prints it)."""
    async with receive:
        async for item in receive:
            print(f"  [{name}] -> client: {describe(item)}")


async def serve_request(name: str, disconnect_after: float | None) -> None:
    context = td.RequestContext(name)
    send, receive = trio.open_memory_channel[Item](0)
    async with trio.open_nursery() as request:  # <- this nursery *is* the request
        request.start_soon(fake_worker, context, send, WORDS, 0.02)
        request.start_soon(client_writer, name, receive)
        if disconnect_after is not None:
            await trio.sleep(disconnect_after)
            # What the server's disconnect listener does when the socket closes, and all
            # it does: it leaves the client's context alone. A *remote* worker hears of it
            # because its adapter's task is cancelled with the nursery, which closes the
            # connection to the worker: the worker takes that as an abort.
            print(f"  [{name}] client disconnected: cancel {name}'s nursery")
            request.cancel_scope.cancel()
    how = "cancelled" if request.cancel_scope.cancelled_caught else "completed"
    print(f"  [{name}] request nursery exited: {how}")


async def lesson_one_request_one_nursery() -> None:
    print("1. Two requests; bob's client disconnects after 50 ms.")
    async with trio.open_nursery() as service:  # the server's nursery, for all requests
        service.start_soon(serve_request, "alice", None)
        service.start_soon(serve_request, "bob", 0.05)
    print("   alice got every word: bob's disconnect cancelled bob's nursery only.\n")


# --- 2. stop_generating() versus kill() --------------------------------------------------


async def stop_or_kill(how: str) -> None:
    context = td.RequestContext(f"req-{how}")
    send, receive = trio.open_memory_channel[Item](0)
    received: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fake_worker, context, send, WORDS, 0.01)
        async with receive:
            async for item in receive:
                received.append(describe(item))
                if len(received) == 2:
                    if how == "stop":
                        context.stop_generating()
                    else:
                        context.kill()
    state = "killed" if context.is_killed else "stopped"
    print(f"   {how}: the consumer got {', '.join(received)}; the context is {state}")


async def lesson_stop_versus_kill() -> None:
    print("2. stop_generating() versus kill(), both after the second word.")
    await stop_or_kill("stop")
    print("         -> the stream ends with finish=cancelled; the words before it stay valid.")
    await stop_or_kill("kill")
    print("         -> the stream just ends, with no final item: nothing more is drained.")

    context = td.RequestContext("req-c3")
    context.kill()
    context.stop_generating()  # C3: must not downgrade a kill (Dynamo's controller does)
    print(f"   C1/C3: stop_generating() after kill(): is_stopped={context.is_stopped}, "
          f"is_killed={context.is_killed}")
    with trio.fail_after(1):
        await context.stopped()  # C2: level-triggered, returns at once
        await context.killed()
    print("   C2: stopped() and killed() returned at once: they are level-triggered.\n")


# --- 3. linked decode context, detached prefill context ---------------------------------


async def lesson_linked_and_detached() -> None:
    print("3. The client's context is killed while its prefill leg is still streaming.")
    client = td.RequestContext("req-42", {"session": "s-7"})
    decode = td.RequestContext(client.id, client.metadata)
    client.link_child(decode)  # C4: stopping the client stops the decode leg, child first
    prefill = client.detached_copy()  # C5: same id and metadata, *not* linked
    print(f"   prefill context: id={prefill.id!r} metadata={dict(prefill.metadata)}")

    send, receive = trio.open_memory_channel[Item](0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fake_worker, prefill, send, ["kv-block"] * 4, 0.01)
        items: list[str] = []
        async with receive:
            async for item in receive:
                items.append(describe(item))
                client.kill()  # the caller kills the client's context after one item
    print(f"   client={client!r} decode={decode!r} prefill={prefill!r}")
    print(f"   the prefill leg still sent all {len(items)} items, ending {items[-1]}: "
          "killing the client's context never reaches it (C5).")


async def main() -> None:
    await lesson_one_request_one_nursery()
    await lesson_stop_versus_kill()
    await lesson_linked_and_detached()


# tests/test_examples.py runs this file and checks that its output contains each line
# that starts with `# expect: `.
# expect: [bob] request nursery exited: cancelled
# expect: [alice] request nursery exited: completed
# expect: finish=cancelled; the context is stopped
# expect: prefill=<RequestContext 'req-42' live>

if __name__ == "__main__":
    trio.run(main)
