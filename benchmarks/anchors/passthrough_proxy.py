"""The pass-through proxy anchor of P4 (docs/performance.md): what a user would write in an
afternoon instead of running the router.

FastAPI on uvicorn (uvloop, httptools), one httpx client with an unbounded pool. For each
``/v1/completions`` or ``/v1/chat/completions`` request it posts the prefill to the prefill
worker (``max_tokens: 1``, ``stream: false``, ``kv_transfer_params`` asking for a remote
decode), then posts the decode with the prefill's ``kv_transfer_params`` and relays the
decode worker's response bytes to the client unparsed. No gate, no usage correction, no
cancellation rules: the cheapest thing that works on the happy path.

Run it with ``python benchmarks/anchors/passthrough_proxy.py --port P --prefill URL
--decode URL`` (needs the ``bench`` dependency group).
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None,
                  "remote_host": None, "remote_port": None}


def create_proxy(prefill: str, decode: str) -> FastAPI:
    app = FastAPI()
    # Idle connections are let go after 4 s: the workers (as uvicorn) close theirs after
    # 5 s, and httpx's default of 5 s raced them (a POST on a connection the worker was
    # closing failed with a 500, once in a full benchmark run).
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None,
                            keepalive_expiry=4.0),
        timeout=None)

    async def relay(request: Request, path: str) -> Response:
        body: dict[str, Any] = orjson.loads(await request.body())
        prefill_body = {**body, "max_tokens": 1, "stream": False,
                        "kv_transfer_params": PREFILL_PARAMS}
        prefill_body.pop("stream_options", None)
        answer = await client.post(prefill + path, content=orjson.dumps(prefill_body),
                                   headers={"content-type": "application/json"})
        decode_body = {**body, "kv_transfer_params": answer.json().get("kv_transfer_params")}
        decode_request = client.build_request(
            "POST", decode + path, content=orjson.dumps(decode_body),
            headers={"content-type": "application/json"})
        response = await client.send(decode_request, stream=True)

        # Starlette's idiom for a streamed body (asyncio, not trio).
        async def relayed() -> AsyncIterator[bytes]:  # noqa: ASYNC900
            try:
                async for part in response.aiter_raw():
                    yield part
            finally:
                await response.aclose()

        return StreamingResponse(relayed(), status_code=response.status_code,
                                 media_type=response.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await relay(request, "/v1/chat/completions")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    args = parser.parse_args()
    uvicorn.run(create_proxy(args.prefill, args.decode), host=args.host, port=args.port,
                loop="uvloop", http="httptools", log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
