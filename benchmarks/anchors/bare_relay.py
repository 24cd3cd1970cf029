"""The floor of P4 (docs/performance.md): the router's own I/O stack with nothing of the
router on it.

The project's HTTP/1.1 server (``trio_disagg._http11``, private: this measures it on
purpose) and its worker client (:class:`trio_disagg.engines.WorkerClient`), relaying the
way the pass-through proxy does: the prefill posted with ``max_tokens: 1`` and
``kv_transfer_params``, then the decode response's bytes written to the client unparsed.
No request context, keeper, gate, handoff owner, engine, parsing, usage, metrics,
deadlines or cancellation rules. What the router spends beyond this is what its
semantics and its relay (B8) cost.

Run it with ``python benchmarks/anchors/bare_relay.py --port P --prefill URL --decode
URL``.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import trio

from trio_disagg._http11 import serve_http
from trio_disagg.engines import WorkerClient

Message = dict[str, Any]
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None,
                  "remote_host": None, "remote_port": None}
JSON = {b"content-type": b"application/json"}


def bare_relay(prefill: str, decode: str, client: WorkerClient) -> Callable[
        [dict[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
        Awaitable[None]]:
    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                  send: Callable[[Message], Awaitable[None]]) -> None:
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = orjson.loads(body)
        prefill_body = {**request, "max_tokens": 1, "stream": False,
                        "kv_transfer_params": PREFILL_PARAMS}
        async with client.stream("POST", prefill + scope["path"],
                                 content=orjson.dumps(prefill_body), headers=JSON) as answer:
            params = orjson.loads(await answer.aread()).get("kv_transfer_params")
        decode_body = orjson.dumps({**request, "kv_transfer_params": params})
        async with client.stream("POST", decode + scope["path"], content=decode_body,
                                 headers=JSON) as response:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(b"content-type", b"text/event-stream")]})
            while part := await response.read():
                await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def serve(port: int, prefill: str, decode: str) -> None:
    async with WorkerClient() as client:
        await serve_http(bare_relay(prefill, decode, client), host="127.0.0.1", port=port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    args = parser.parse_args()
    trio.run(serve, args.port, args.prefill, args.decode)


if __name__ == "__main__":
    main()
