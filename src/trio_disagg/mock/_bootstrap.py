"""SGLang's bootstrap port over HTTP, between mock workers (docs/protocols.md sections 3 and
5): the bootstrap triple a body carries, the prefill worker's second listener where decode
workers join its rooms and receive the KV, and the decode's way there."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import attrs
import orjson
import trio

from .._asgi import Receive, Scope, Send, header, query_param
from .._protocols import DEFAULT_BOOTSTRAP_PORT
from ._asgi import Exchange, run_until_disconnect, send_octets, url_host
from ._kv import BootstrapRoom, KVTransferError
from ._kvwire import PULL_TIMEOUT, KVAnswer, KVSource, kv_bytes

if TYPE_CHECKING:
    from ._sglang import MockSglangWorker

#: The keys the router adds to both legs' bodies (docs/protocols.md section 3).
BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
#: The largest bootstrap room, 2**63 - 1.
MAX_ROOM = (1 << 63) - 1


def bootstrap_triple(body: Mapping[str, Any]) -> tuple[str, int, int] | str | None:
    """The body's ``(bootstrap_host, bootstrap_port, bootstrap_room)``; None if it has
    none; a message if they are malformed. A null ``bootstrap_port`` means SGLang's
    default, 8998."""
    host, port, room = (body.get(key) for key in BOOTSTRAP_KEYS)
    if host is None and room is None:
        return None
    if isinstance(host, list) or isinstance(room, list):
        return "batched bootstrap rooms (lists) are not supported by this mock worker"
    if port is None:
        port = DEFAULT_BOOTSTRAP_PORT
    if not isinstance(host, str) or not host:
        return f"bootstrap_host must be a host name, got {host!r:.60}"
    if type(port) is not int or not 0 < port < 65536:
        return f"bootstrap_port must be a TCP port, got {port!r:.60}"
    if type(room) is not int or not 0 <= room <= MAX_ROOM:
        return f"bootstrap_room must be an integer in [0, 2**63 - 1], got {room!r:.60}"
    return host, port, room


@attrs.frozen(kw_only=True)
class BootstrapJoin(KVSource):
    """A decode's way to its KV: join bootstrap room ``room`` on the prefill worker's
    bootstrap port (``GET /bootstrap/{room}?timeout=T`` waits up to ``timeout`` seconds for
    the prefill's KV, then transfers it) and leave it unused (``POST
    /bootstrap/{room}/leave``)."""

    host: str
    port: int
    room: int
    timeout: float

    release_suffix = "/leave"

    def url(self, suffix: str = "") -> str:
        return f"http://{url_host(self.host.strip('[]'))}:{self.port}/bootstrap/{self.room}{suffix}"

    def describe(self, failure: str) -> str:
        if failure.startswith("failed"):
            return f"joining bootstrap room {self.room} at {self.where} {failure}"
        return f"bootstrap room {self.room} at {self.where} {failure}"

    def params(self) -> dict[str, str]:
        return {"timeout": f"{self.timeout:g}"}

    def pull_timeout(self) -> float:
        # the GET waits up to ``timeout`` for the prefill's KV, then transfers it
        return self.timeout + PULL_TIMEOUT  # (inf: no bound)

    def check(self, answer: KVAnswer, size: int) -> str | None:
        headers = answer.headers
        engine = unquote(headers.get("x-kv-engine-id", ""))
        key = unquote(headers.get("x-kv-key", ""))
        try:
            blocks = [int(b) for b in headers.get("x-kv-block-ids", "").split(",") if b]
        except ValueError:
            blocks = []
        expected = kv_bytes(engine, key, blocks, size)
        if not blocks or answer.content != expected:
            return (f"the KV of bootstrap room {self.room} from {self.where} was corrupt: "
                    f"{len(answer.content)} bytes, expected {len(expected)}")
        return None


class BootstrapPort:
    """A prefill worker's bootstrap port: ``GET /bootstrap/{room}?timeout=T`` (a decode
    joins and receives the KV), ``POST /bootstrap/{room}/leave`` (a decode that never
    joined gives up), ``GET /health``. It remembers, for a while, the rooms a decode left
    before any prefill came, so that prefill fails at once.
    """

    def __init__(self, worker: MockSglangWorker) -> None:
        self.worker = worker
        self._joins: set[int] = set()  # rooms a decode is joined to (a GET in progress)
        self._gone: dict[int, float] = {}  # rooms a decode left before any prefill came
        self._gone_order: deque[tuple[float, int]] = deque()

    async def route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        path = scope["path"]
        exchange = self.worker.exchange(send, header(scope, b"x-request-id", strip=True))
        if path == "/health" and method == "GET":
            await exchange.respond(200, b"", b"text/plain")
            return
        parts = path.split("/")
        if (len(parts) in (3, 4) and parts[1] == "bootstrap" and parts[2].isdigit()
                and int(parts[2]) <= MAX_ROOM):
            room_id = int(parts[2])
            if len(parts) == 3 and method == "GET":
                await self._join(scope, receive, exchange, room_id)
                return
            if len(parts) == 4 and parts[3] == "leave" and method == "POST":
                left = self._leave(room_id)
                await exchange.respond(200, orjson.dumps({"left": left}))
                return
        await exchange.error(f"Not found on the bootstrap port: {method} {path}", 404)

    async def _join(self, scope: Scope, receive: Receive, exchange: Exchange,
                    room_id: int) -> None:
        """A decode joins ``room_id`` and receives its KV (see the class docstring)."""
        worker = self.worker
        text = query_param(scope, "timeout")
        try:
            timeout = float(text) if text else worker.bootstrap_timeout
        except ValueError:
            timeout = math.nan
        if not timeout > 0:
            await exchange.error(f"timeout must be a number of seconds > 0, got {text!r}", 400)
            return
        room = worker.kv.room(room_id)
        try:
            room.enter("decode")
        except KVTransferError as exc:
            await exchange.error(f"{worker.name}: {exc}", 400)
            return
        self._joins.add(room_id)
        size = worker.kv.block_size * worker.kv_bytes_per_token
        pulled = False

        async def transfer() -> None:
            nonlocal pulled
            with trio.move_on_after(timeout):
                await room.wait_staged()
            entry = room.entry
            if entry is None:
                await exchange.error(f"{worker.name}: the prefill never staged KV in "
                                     f"bootstrap room {room_id} within {timeout:g} s", 504)
                return
            try:
                worker.kv.claim_entry(entry)
            except KVTransferError as exc:
                await exchange.error(f"{worker.name}: {exc}", 410)
                return
            if (delay := worker.latency.kv_transfer_time(entry.num_tokens)) > 0:
                await trio.sleep(delay)
            data = kv_bytes(worker.name, entry.key, entry.block_ids, size)
            await send_octets(exchange, data, [
                (b"x-kv-engine-id", quote(worker.name).encode()),
                (b"x-kv-key", quote(entry.key).encode()),
                (b"x-kv-block-ids", ",".join(map(str, entry.block_ids)).encode()),
            ])
            worker.kv.complete(entry)
            worker.stats.kv_transfers += 1
            room.finish(pulled=True)
            pulled = True

        try:
            await run_until_disconnect(receive, exchange, transfer)
        finally:
            self._joins.discard(room_id)
            if not pulled and room_id not in worker._prefill_rooms:
                self.mark_gone(room_id)
            room.leave("decode")  # frees KV it did not pull; wakes a waiting prefill

    def _leave(self, room_id: int) -> bool:
        """A decode that never joined (or whose join is over) gives up ``room_id``; its
        prefill, now or later, fails at once."""
        if room_id in self._joins:
            return False  # its join's connection closing lets go
        self.mark_gone(room_id)
        room: BootstrapRoom = self.worker.kv.room(room_id)
        room.leave("decode")
        return True

    def _prune_gone(self) -> None:
        now = trio.current_time()
        order = self._gone_order
        while order and order[0][0] <= now:
            expiry, room_id = order.popleft()
            if self._gone.get(room_id) == expiry:
                del self._gone[room_id]

    def mark_gone(self, room_id: int) -> None:
        self._prune_gone()
        expiry = trio.current_time() + min(self.worker.bootstrap_timeout, 3600.0)
        self._gone[room_id] = expiry
        self._gone_order.append((expiry, room_id))

    def take_gone(self, room_id: int) -> bool:
        self._prune_gone()
        return self._gone.pop(room_id, None) is not None
