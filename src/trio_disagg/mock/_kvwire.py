"""The KV pull between mock HTTP workers (docs/protocols.md section 5): the bytes a
prefill worker sends for its KV blocks, the prefill side's endpoint, and where a decode
pulls them from."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote_to_bytes, urlencode

import attrs
import orjson
import trio

from .._asgi import Receive, Scope, Send, header
from ..engines import TransportError, WorkerClient
from ._asgi import run_until_disconnect, send_octets, url_host
from ._kv import KVTransferError

if TYPE_CHECKING:
    from ._worker import MockWorker

logger = logging.getLogger("trio_disagg.workers")

#: Bytes of KV per prompt token moved by a pull: a 16-token block is 256 bytes.
DEFAULT_KV_BYTES_PER_TOKEN = 16
#: Seconds a decode worker's KV pull may take before it fails.
PULL_TIMEOUT = 30.0


def kv_client() -> WorkerClient:
    """A new HTTP client for a mock worker's KV pulls and releases: the project's own
    worker client (no environment proxies), whose pool gives each request a connection of
    its own: a crowd of pulls sent at once on kept connections goes out at once. (httpx
    1.0's pool hands one idle connection to every request queued in the same pass and
    lets all but one retry, one scheduling round each: the last of N pulls waits N
    rounds.)"""
    return WorkerClient(max_connections=512, max_idle_per_worker=64, keepalive_expiry=4.0,
                        connect_timeout=PULL_TIMEOUT, pool_timeout=PULL_TIMEOUT)


def kv_block_bytes(engine_id: str, key: str, block_id: int, size: int) -> bytes:
    """The bytes of one KV block as the mock prefill worker sends them: a pattern fixed by
    the engine id, the transfer key and the block id, so the decode can check them."""
    digest = hashlib.blake2b(f"{engine_id}\x00{key}\x00{block_id}".encode(),
                             digest_size=32).digest()
    return (digest * (size // 32 + 1))[:size]


def kv_bytes(engine_id: str, key: str, block_ids: tuple[int, ...] | list[int],
             size: int) -> bytes:
    """The bytes of a whole KV transfer (every block, in order)."""
    return b"".join(kv_block_bytes(engine_id, key, block, size) for block in block_ids)


class KVSource:
    """Where a decode request gets its KV from over HTTP, and how it lets go of KV it never
    pulls: one GET that answers the KV's bytes, one POST that lets go of it. A subclass
    says where (:meth:`url`), how long the GET may take, what it is called in messages,
    and how the bytes are checked.

    Attributes:
        where: ``host:port`` of the prefill side, for messages.
    """

    host: str
    port: int

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def url(self, suffix: str = "") -> str:
        raise NotImplementedError

    #: The POST that lets go of the KV (a suffix of :meth:`url`).
    release_suffix = "/release"

    def describe(self, failure: str) -> str:
        """The message of a pull that ``failure`` (``"failed: ..."``, ``"answered N:
        ..."``)."""
        return f"KV pull from {self.where} {failure}"

    def params(self) -> dict[str, str]:
        """The GET's query parameters."""
        return {}

    def pull_timeout(self) -> float:
        """Seconds the whole GET may take (connecting, waiting, reading)."""
        return PULL_TIMEOUT

    def check(self, answer: KVAnswer, size: int) -> str | None:
        """Why the answered bytes are not the KV (``size`` bytes per block), or None."""
        raise NotImplementedError

    async def pull(self, worker: MockWorker, request_id: str) -> str | None:
        """Transfer the KV and check every byte.

        Returns:
            None once pulled, else why it failed. Cancellation closes the pull's
            connection: the prefill side then releases the KV.
        """
        url = self.url()
        if params := self.params():
            url += "?" + urlencode(params)
        problem: str | None = None
        with trio.move_on_after(self.pull_timeout()) as scope:
            try:
                answer = await _fetch(worker, "GET", url, request_id)
            except (TransportError, ValueError) as exc:  # (ValueError: no http URL)
                problem = self.describe(f"failed: {type(exc).__name__}: {exc}")
            else:
                if answer.status_code != 200:
                    problem = self.describe(f"answered {answer.status_code}: "
                                            f"{answer_message(answer.content)}")
                else:
                    problem = self.check(answer, worker.kv.block_size
                                         * worker.kv_bytes_per_token)
        if scope.cancelled_caught:
            problem = self.describe(f"failed: ReadTimeout: no KV within "
                                    f"{self.pull_timeout():g} s")
        if problem is not None:
            worker.stats.kv_pull_failures += 1
            return problem
        worker.stats.kv_pulls += 1
        return None

    async def release(self, worker: MockWorker, request_id: str) -> None:
        """Tell the prefill side to free KV this decode will never pull (bounded by the
        caller's shielded scope)."""
        worker.stats.kv_releases += 1
        try:
            await _fetch(worker, "POST", self.url(self.release_suffix), request_id)
        except (TransportError, ValueError) as exc:
            logger.warning("%s could not let go of the KV at %s: %r", worker.name,
                           self.url(), exc)


@attrs.frozen
class KVAnswer:
    """A KV pull's (or release's) whole answer: its status, headers and body."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes


async def _fetch(worker: MockWorker, method: str, url: str, request_id: str) -> KVAnswer:
    """``method url`` on the worker's KV client (:meth:`MockWorker.client`), its answer
    read whole.

    Raises:
        TransportError: the prefill side could not be reached, or broke the exchange.
        ValueError: ``url`` is no http URL.
    """
    headers = {b"x-request-id": request_id.encode("latin-1")}
    async with worker.client().stream(method, url, content=b"", headers=headers) as response:
        content = await response.aread()
        return KVAnswer(response.status_code, response.headers, content)


@attrs.frozen(kw_only=True)
class RemoteKV(KVSource):
    """KV staged under a key on a prefill worker, pulled with ``GET /kv/{key}`` and freed
    unused with ``POST /kv/{key}/release`` (vLLM's ``kv_transfer_params``, TRT-LLM's
    ``ctx_request_id``)."""

    host: str
    port: int
    key: str
    engine_id: str
    block_ids: tuple[int, ...]

    def url(self, suffix: str = "") -> str:
        return f"http://{url_host(self.host)}:{self.port}/kv/{quote(self.key, safe='')}{suffix}"

    def check(self, answer: KVAnswer, size: int) -> str | None:
        expected = kv_bytes(self.engine_id, self.key, self.block_ids, size)
        if answer.content != expected:
            return self.describe(f"was corrupt: {len(answer.content)} bytes, "
                                 f"expected {len(expected)}")
        return None


def answer_message(content: bytes) -> str:
    """The error message of a worker's error answer (its body)."""
    text = content[:200].decode("utf-8", "replace")
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError:
        return text
    if isinstance(answer, dict):
        error = answer.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(answer.get("message"), str):
            return str(answer["message"])
    return text


async def serve_kv(worker: MockWorker, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /kv/{key}`` (claim and send the KV staged under ``key``) and
    ``POST /kv/{key}/release`` (free it unused): the KV pull's prefill side."""
    raw = bytes(scope.get("raw_path") or scope["path"].encode()).partition(b"?")[0]
    rest = raw[len(b"/kv/"):]
    method = scope["method"]
    exchange = worker.exchange(send, header(scope, b"x-request-id", strip=True))
    if rest.endswith(b"/release") and method == "POST":
        key = unquote_to_bytes(rest[:-len(b"/release")]).decode("utf-8", "replace")
        released = worker.kv.release_key(key)
        await exchange.respond(200, orjson.dumps({"released": released}))
        return
    if method != "GET" or b"/" in rest:
        await exchange.error(f"Not found: {method} {scope['path']}", 404)
        return
    key = unquote_to_bytes(rest).decode("utf-8", "replace")
    try:
        entry = worker.kv.claim(key)
    except KVTransferError as exc:
        await exchange.error(str(exc), 404)
        return
    size = worker.kv.block_size * worker.kv_bytes_per_token
    done = False

    async def transfer() -> None:
        nonlocal done
        if (delay := worker.latency.kv_transfer_time(entry.num_tokens)) > 0:
            await trio.sleep(delay)
        await send_octets(exchange, kv_bytes(worker.name, entry.key, entry.block_ids, size))
        worker.kv.complete(entry)
        worker.stats.kv_transfers += 1
        done = True

    try:
        await run_until_disconnect(receive, exchange, transfer)
    finally:
        if not done:
            worker.kv.release(entry)  # the puller went away: free the blocks
