"""The project's HTTP/1.1 server: ASGI over trio sockets, parsed by httptools; it serves the
router (``trio_disagg.server``) and the mock workers (``trio_disagg.mock``).

The relay's other end (docs/performance.md): every batch of tokens a stream sends crosses
this module, so it does per message only what HTTP/1.1 needs. A response's head goes out
with its first body, and a body's last bytes with the end of the chunked stream, in one
socket write each; a request's headers and body are parsed by httptools (C) in one call
per socket read. A client that goes away is an ``http.disconnect`` at once (the app then
cancels the request's nursery, docs/semantics.md C3); the app is never cancelled by the
server except at the end of a graceful shutdown (B3).

What it serves: HTTP/1.1 and 1.0 with keep-alive, pipelined requests one at a time,
``Expect: 100-continue``, chunked and content-length request bodies. Not: TLS, HTTP/2,
upgrades (refused with a 400); put a TLS proxy in front, as is usual for a router inside a
cluster, or pass ``serve(config=...)`` to run under hypercorn instead.
"""

from __future__ import annotations

from ._connection import KEEP_ALIVE_TIMEOUT
from ._exchange import BODY_TIMEOUT, WRITE_TIMEOUT
from ._server import (
    ACCEPT_RETRY_DELAY,
    ON_DISCONNECT,
    WHOLE_SENDS,
    App,
    Server,
    descriptors_left,
    serve_http,
)

__all__ = ["ACCEPT_RETRY_DELAY", "BODY_TIMEOUT", "KEEP_ALIVE_TIMEOUT", "ON_DISCONNECT",
           "WHOLE_SENDS", "WRITE_TIMEOUT", "App", "Server", "descriptors_left", "serve_http"]
