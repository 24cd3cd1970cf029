"""What the mock HTTP workers share (docs/protocols.md section 5): the ASGI routing of a worker,
generation requests (body checks, faults, abort on close, counters), OpenAI answers and
chunks, the decode's token loop, the KV pull over loopback (both ends) and ``/metrics``.

Each protocol (:mod:`._vllm`, :mod:`._sglang`, :mod:`._trtllm`) subclasses
:class:`MockWorker` and says how one generation request is served (:meth:`MockWorker._work`).
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, ClassVar, Literal
from urllib.parse import quote, unquote_to_bytes

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client, on trio natively)
import orjson
import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from ._asgi import (
    DONE_EVENT,
    JSON_TYPE,
    Exchange,
    Receive,
    Scope,
    Send,
    read_body,
    run_until_disconnect,
)
from ._faults import Fault, FaultKind, FaultPlan, fault_for
from ._kv import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_TTL,
    KVBlockPool,
    KVCounters,
    KVTransferError,
)
from ._latency import LatencyModel
from ._text import (
    VOCAB_SIZE,
    WORDS,
    TokenStream,
    cached_prompt_tokens,
    count_prompt_tokens,
    resolve_max_tokens,
    seeded_unit,
)
from ._wire_faults import (
    REMOVED,
    AnswerFaults,
    MockFault,
    MockFaultKind,
    answer_faults,
    split_mock_faults,
)

logger = logging.getLogger("trio_disagg.workers")

Role = Literal["prefill", "decode"]
Work = Callable[[], Awaitable[None]]

#: Bytes of KV per prompt token moved by a pull: a 16-token block is 256 bytes.
DEFAULT_KV_BYTES_PER_TOKEN = 16
#: Seconds a decode worker spends, at most, telling a prefill worker to free KV.
RELEASE_TIMEOUT = 2.0
#: Seconds a decode worker's KV pull may take before it fails.
PULL_TIMEOUT = 30.0
#: The OpenAI generation endpoints every mock worker serves.
OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

OCTETS = b"application/octet-stream"
_CHUNK = 64 * 1024  # bytes per body message of a KV transfer
_BATCH = 32  # SSE chunks per write when there is no inter-token latency
REJECTS = frozenset({FaultKind.PREFILL_REJECT, FaultKind.DECODE_REJECT})


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


def url_host(host: str) -> str:
    """``host`` as it goes in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@attrs.define(kw_only=True)
class WorkerStats:
    """What one mock worker did, beyond its KV pool's counters. Counts of requests.

    Attributes:
        requests: generation requests received (``/v1/completions``,
            ``/v1/chat/completions``, SGLang's ``/generate``), valid or not.
        open: generation requests whose exchange is not over: received (even if their
            body is still being read) and not yet answered in full, failed or aborted.
            Zero once nothing is left open on the worker.
        running: generation requests being served now.
        completed: answered in full (a whole JSON answer, or a stream to ``[DONE]``).
        failed: answered with an error status or error event, or reset on purpose.
        aborted: aborted because the client closed the connection first (each also in
            :attr:`MockWorker.aborts`, with when).
        kv_transfers: KV transfers served to decode workers (``GET /kv/...`` or a
            bootstrap room), in full.
        kv_pulls: KV transfers this worker received from a prefill worker.
        kv_pull_failures: KV pulls that failed (gone, refused, corrupt, unreachable,
            timed out).
        kv_releases: releases sent to a prefill worker for KV never pulled.
        prefills_completed: prefill (context) requests whose prefill computation ran to
            its end (whatever the answer then was).
        prefills_aborted: prefill (context) requests aborted (their connection closed)
            before their prefill computation ended: compute saved (B10).
    """

    requests: int = 0
    open: int = 0
    running: int = 0
    completed: int = 0
    failed: int = 0
    aborted: int = 0
    kv_transfers: int = 0
    kv_pulls: int = 0
    kv_pull_failures: int = 0
    kv_releases: int = 0
    prefills_completed: int = 0
    prefills_aborted: int = 0


@attrs.frozen(kw_only=True)
class SeenRequest:
    """A generation request as the worker received it (for tests and demos)."""

    path: str
    request_id: str
    body: Mapping[str, Any]


class Refusal(Exception):
    """A generation request the worker answers with an error status before serving it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class KVSource:
    """Where a decode request gets its KV from, and how it lets go of KV it never pulls.

    Attributes:
        where: ``host:port`` of the prefill side, for messages.
    """

    where: str = ""

    async def pull(self, worker: MockWorker, request_id: str) -> str | None:
        """Transfer the KV and check every byte.

        Returns:
            None once pulled, else why it failed. Cancellation closes the pull's
            connection: the prefill side then releases the KV.
        """
        raise NotImplementedError

    async def release(self, worker: MockWorker, request_id: str) -> None:
        """Tell the prefill side to free KV this decode will never pull (bounded by the
        caller's shielded scope)."""
        raise NotImplementedError


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

    @property
    def where(self) -> str:  # type: ignore[override]
        return f"{self.host}:{self.port}"

    def url(self, suffix: str = "") -> str:
        return f"http://{url_host(self.host)}:{self.port}/kv/{quote(self.key, safe='')}{suffix}"

    async def pull(self, worker: MockWorker, request_id: str) -> str | None:
        size = worker.kv.block_size * worker.kv_bytes_per_token
        try:
            response = await worker.client().get(
                self.url(), headers={b"x-request-id": request_id.encode("latin-1")},
                timeout=PULL_TIMEOUT)
        except httpx.HTTPError as exc:
            worker.stats.kv_pull_failures += 1
            return f"KV pull from {self.where} failed: {type(exc).__name__}: {exc}"
        if response.status_code != 200:
            worker.stats.kv_pull_failures += 1
            return (f"KV pull from {self.where} answered {response.status_code}: "
                    f"{answer_message(response)}")
        expected = kv_bytes(self.engine_id, self.key, self.block_ids, size)
        if response.content != expected:
            worker.stats.kv_pull_failures += 1
            return (f"KV pull from {self.where} was corrupt: {len(response.content)} bytes, "
                    f"expected {len(expected)}")
        worker.stats.kv_pulls += 1
        return None

    async def release(self, worker: MockWorker, request_id: str) -> None:
        worker.stats.kv_releases += 1
        try:
            await worker.client().post(
                self.url("/release"), headers={b"x-request-id": request_id.encode("latin-1")},
                timeout=RELEASE_TIMEOUT)
        except httpx.HTTPError as exc:
            logger.warning("%s could not release KV %r on %s: %r", worker.name, self.key,
                           self.where, exc)


def answer_message(response: httpx.Response) -> str:
    """The error message of a worker's error answer."""
    try:
        answer = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text[:200]
    if isinstance(answer, dict):
        error = answer.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(answer.get("message"), str):
            return str(answer["message"])
    return response.text[:200]


def _family(
    kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, role: str,
    value: float,
) -> Metric:
    family = kind(f"trio_disagg_mock_{name}", doc, labels=["role"])
    family.add_metric([role], value)
    return family


def kv_metric_families(kv: KVCounters, role: str) -> Iterator[Metric]:
    """A prefill worker's KV block accounting as Prometheus families
    (``trio_disagg_mock_kv_*``, docs/protocols.md section 5)."""
    yield _family(GaugeMetricFamily, "kv_held_blocks",
                  "KV blocks held for a decode (staged or in transfer).", role, kv.held_blocks)
    yield _family(GaugeMetricFamily, "kv_held_requests", "Requests holding KV blocks.", role,
                  kv.held)
    yield _family(CounterMetricFamily, "kv_staged_blocks", "KV blocks ever staged.", role,
                  kv.staged_blocks)
    yield _family(CounterMetricFamily, "kv_freed_blocks",
                  "KV blocks freed by a pull or a release.", role, kv.freed_blocks)
    yield _family(CounterMetricFamily, "kv_stranded_blocks",
                  "KV blocks whose lease or bootstrap wait expired before any decode "
                  "pulled them.", role, kv.stranded_blocks)
    yield _family(CounterMetricFamily, "kv_served_requests",
                  "Requests whose KV a decode pulled.", role, kv.served)
    yield _family(CounterMetricFamily, "kv_aborted_requests",
                  "Requests whose KV was released unused, or aborted before staging.", role,
                  kv.aborted)
    yield _family(CounterMetricFamily, "kv_expired_requests",
                  "Requests whose KV was stranded.", role, kv.expired)


class KVCollector:
    """Exposes in-process mock engines' KV counters (read at scrape time, when due leases
    expire) in a Prometheus registry: the embedded default's ``/metrics`` then shows the
    same ``trio_disagg_mock_kv_*`` families as a mock worker's.

    Args:
        read: returns the counters, e.g. ``MockCluster.counters``.
        role: the ``role`` label.
    """

    def __init__(self, read: Callable[[], KVCounters], role: str = "prefill") -> None:
        self._read = read
        self._role = role

    def collect(self) -> Iterator[Metric]:
        yield from kv_metric_families(self._read(), self._role)


class _Collector:
    """Reads the worker's counters at scrape time (the KV pool expires due leases then)."""

    def __init__(self, worker: MockWorker) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        worker = self._worker
        stats = worker.stats
        role = worker.role
        yield from kv_metric_families(worker.kv.counters(), role)
        for name, doc, value in [
            ("requests_running", "Generation requests being served.", stats.running),
            ("requests_open", "Generation requests not over yet.", stats.open),
            *worker.extra_gauges(),
        ]:
            yield _family(GaugeMetricFamily, name, doc, role, value)
        for name, doc, value in [
            ("requests", "Generation requests received.", stats.requests),
            ("requests_completed", "Generation requests answered in full.", stats.completed),
            ("requests_failed", "Generation requests answered with an error.", stats.failed),
            ("requests_aborted",
             "Generation requests aborted because their connection closed.", stats.aborted),
            ("kv_transfers", "KV transfers served to decode workers.", stats.kv_transfers),
            ("kv_pulls", "KV transfers received from prefill workers.", stats.kv_pulls),
            ("kv_pull_failures", "KV pulls that failed.", stats.kv_pull_failures),
            ("kv_releases", "Releases sent for KV never pulled.", stats.kv_releases),
            ("prefills_completed", "Prefill computations run to their end.",
             stats.prefills_completed),
            ("prefills_aborted", "Prefill requests aborted before their computation ended.",
             stats.prefills_aborted),
        ]:
            yield _family(CounterMetricFamily, name, doc, role, value)


# --- answer formats ----------------------------------------------------------------------


class AnswerFormat:
    """How one request's answer is written: server-sent chunks, or one JSON object."""

    def bind_usage(self, usage: Callable[[int], dict[str, Any]]) -> None:
        """Tell the format the usage after ``n`` tokens (for formats that put it in every
        event); called before the first :meth:`token`."""

    def start(self) -> bytes:
        """The first bytes of a stream (a chat stream's role chunk), or ``b""``."""
        return b""

    def token(self, text: str, token: int | None, finish: str | None) -> bytes:
        """One token's event (``finish`` on the last one)."""
        raise NotImplementedError

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The usage event after the finish, or ``b""``."""
        return b""

    def answer(self, *, text: str, token_ids: list[int], finish: str,
               usage: dict[str, Any], top: Mapping[str, Any] | None = None,
               choice: Mapping[str, Any] | None = None) -> bytes:
        """A whole non-streamed answer; ``top`` and ``choice`` add protocol fields."""
        raise NotImplementedError


#: A body field of the mock workers only (a test hook, like ``"fault"``): a chat's first N
#: tokens go out as ``reasoning_content`` instead of ``content``.
REASONING_HOOK = "mock_reasoning_tokens"


@attrs.frozen(kw_only=True)
class ChoiceShape:
    """What a request asks of its answer's choices beyond plain text, as the mock workers
    send it (B8: the relay must carry it as sent). Made by :func:`choice_shape`.

    Attributes:
        decode: the answer is a decode's (else a prefill's: its ``length`` finish stays,
            the handoff needs it).
        tool: a chat with ``tools`` (``tool_choice`` not ``"none"``): the name of the
            function called, the first tool's. The tokens go out as the arguments of one
            tool call, ``{"arg0": "word", ...}``, instead of content.
        call_id: that call's ``id``, ``"call_<request id>"``.
        logprobs: a chat's ``logprobs: true``, or a completion's ``logprobs: k``.
        top_logprobs: alternatives per token: a chat's ``top_logprobs``, a completion's k.
        reasoning_tokens: a chat's :data:`REASONING_HOOK`: its first N tokens go out as
            ``reasoning_content``.
        faults: the decode's answer faults (final ``finish_reason``, ``stop_reason``, no
            usage chunk).
    """

    decode: bool
    tool: str | None = None
    call_id: str = ""
    logprobs: bool = False
    top_logprobs: int = 0
    reasoning_tokens: int = 0
    faults: AnswerFaults = attrs.field(factory=AnswerFaults)

    def finish(self, finish: str) -> str:
        """The ``finish_reason`` sent for the tokens' own ``finish``."""
        if self.faults.finish is not None:
            return self.faults.finish
        if self.tool is not None and (finish == "stop" or (finish == "length" and self.decode)):
            return "tool_calls"  # the mock's call is complete (its arguments closed)
        return finish

    def stop_reason(self) -> Any:
        """The final choice's ``stop_reason``."""
        value = self.faults.stop_reason
        return None if value is REMOVED else value


def choice_shape(body: Mapping[str, Any], *, chat: bool, decode: bool, request_id: str
                 ) -> ChoiceShape | None:
    """What ``body`` asks of its choices (:class:`ChoiceShape`); None for plain text.
    The answer faults count for a decode only.

    Raises:
        ValueError: a malformed answer fault.
    """
    faults = answer_faults(body) if decode else AnswerFaults()
    tool = None
    logprobs = False
    top = 0
    reasoning = 0
    if chat:
        tools = body.get("tools")
        if isinstance(tools, list) and tools and body.get("tool_choice") != "none":
            first = tools[0] if isinstance(tools[0], Mapping) else {}
            function = first.get("function")
            name = function.get("name") if isinstance(function, Mapping) else None
            tool = name if isinstance(name, str) else "tool"
        logprobs = body.get("logprobs") is True
        value = body.get("top_logprobs")
        top = value if type(value) is int and value > 0 else 0
        value = body.get(REASONING_HOOK)
        reasoning = value if type(value) is int and value > 0 else 0
    else:
        value = body.get("logprobs")
        if type(value) is int and value >= 0:
            logprobs, top = True, value
    if tool is None and not logprobs and not reasoning and not faults:
        return None
    return ChoiceShape(decode=decode, tool=tool, call_id=f"call_{request_id}",
                       logprobs=logprobs, top_logprobs=top, reasoning_tokens=reasoning,
                       faults=faults)


def _alternatives(token: int, text: str, logprob: float, k: int
                  ) -> list[tuple[str, float]]:
    """``k`` ``(text, logprob)`` candidates for a position, the sampled token first, then
    other words, each less likely, all distinct."""
    found = [(text, logprob)][:k]
    seen = {text}
    step = 0
    while len(found) < k:
        step += 1
        alt = WORDS[(token + 131 * step) % VOCAB_SIZE]
        if alt not in seen:
            seen.add(alt)
            found.append((alt, round(logprob - 0.5 * len(found), 4)))
    return found


class OpenAIFormat(AnswerFormat):
    """OpenAI completion and chat completion answers and chunks.

    A plain request's chunks are written from bytes made once. A request with a
    :class:`ChoiceShape` gets the fields it asks for, as vLLM sends them: a chat with
    ``tools`` one tool call (a first delta ``{"tool_calls": [{"index": 0, "id", "type":
    "function", "function": {"name", "arguments": ""}}]}``, then per token an argument
    fragment ``{"tool_calls": [{"index": 0, "function": {"arguments"}}]}``, no
    ``content``, finish ``tool_calls``; answered whole: ``message.tool_calls``,
    ``content: null``); ``logprobs`` per token (chat ``{"content": [{"token",
    "logprob", "bytes", "top_logprobs"}]}``, completions ``{"tokens", "token_logprobs",
    "top_logprobs", "text_offset"}``, answered whole: all of them), fixed by ``seed``,
    the request id and the token's position; the first tokens as
    ``delta.reasoning_content`` (``message.reasoning_content``); and the answer faults.

    Args:
        chat: a chat completion.
        response_id: the answer's ``id``.
        model: echoed.
        with_ids: add ``token_ids`` to each choice (vLLM's ``return_token_ids``).
        top: fields added to every whole answer (vLLM's ``kv_transfer_params: null``).
        shape: what the request asks of its choices, or None for plain text.
        seed: with ``request_id``, fixes the logprobs.
        request_id: the request's id.
    """

    __slots__ = ("_args", "_at", "_called", "_chat", "_head", "_ids", "_model", "_offset",
                 "_request_id", "_response_id", "_seed", "_shape", "_top", "_usage_head")

    def __init__(self, *, chat: bool, response_id: str, model: Any, with_ids: bool,
                 top: Mapping[str, Any] | None = None, shape: ChoiceShape | None = None,
                 seed: int = 0, request_id: str = "") -> None:
        kind = b"chat.completion.chunk" if chat else b"text_completion"
        head = (b'data: {"id":' + orjson.dumps(response_id) + b',"object":"' + kind
                + b'","created":' + str(int(time.time())).encode() + b',"model":'
                + orjson.dumps(model))
        self._chat = chat
        self._head = head + b',"choices":[{"index":0,'
        self._usage_head = head + b',"choices":[],"usage":'
        self._ids = with_ids
        self._model = model
        self._response_id = response_id
        self._top = top
        self._shape = shape
        self._seed = seed
        self._request_id = request_id
        self._at = 0  # tokens sent
        self._args = 0  # tool call arguments sent
        self._offset = 0  # characters of text sent (a completion's text_offset)
        self._called = False  # the tool call's first delta sent

    def start(self) -> bytes:
        if not self._chat:
            return b""
        return (self._head + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
                b'"finish_reason":null}]}\n\n')

    def token(self, text: str, token: int | None, finish: str | None) -> bytes:
        if self._shape is not None:
            return self._shaped_token(self._shape, text, token, finish)
        if self._chat:
            body = b'"delta":{"content":' + orjson.dumps(text) + b"}"
        else:
            body = b'"text":' + orjson.dumps(text)
        if self._ids:
            body += b',"token_ids":' + (b"[]" if token is None else b"[%d]" % token)
        return (self._head + body + b',"logprobs":null,"finish_reason":'
                + orjson.dumps(finish) + b',"stop_reason":null}]}\n\n')

    def usage(self, usage: dict[str, Any]) -> bytes:
        if self._shape is not None and self._shape.faults.no_usage:
            return b""
        return self._usage_head + orjson.dumps(usage) + b"}\n\n"

    # --- shaped choices ------------------------------------------------------------------

    def _logprob(self, position: int) -> float:
        return -round(0.01 + 3.0 * seeded_unit(self._seed, "logprob", self._request_id,
                                               position), 4)

    def _chat_logprob(self, shape: ChoiceShape, position: int, text: str, token: int
                      ) -> dict[str, Any]:
        logprob = self._logprob(position)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": alt, "logprob": value, "bytes": list(alt.encode())}
                    for alt, value in _alternatives(token, text, logprob,
                                                    shape.top_logprobs)]}

    def _completion_logprobs(self, shape: ChoiceShape, start: int, offset: int,
                             tokens: list[tuple[str, int]]) -> dict[str, Any]:
        result: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                  "text_offset": []}
        for position, (text, token) in enumerate(tokens, start):
            logprob = self._logprob(position)
            result["tokens"].append(text)
            result["token_logprobs"].append(logprob)
            result["top_logprobs"].append(
                dict(_alternatives(token, text, logprob, shape.top_logprobs)))
            result["text_offset"].append(offset)
            offset += len(text)
        return result

    def _event(self, choice: dict[str, Any]) -> bytes:
        return self._head[:-len(b'{"index":0,')] + orjson.dumps(choice) + b"]}\n\n"

    def _shaped_token(self, shape: ChoiceShape, text: str, token: int | None,
                      finish: str | None) -> bytes:
        position = self._at
        if token is not None:
            self._at += 1
        final = {"finish_reason": shape.finish(finish) if finish is not None else None,
                 "stop_reason": shape.stop_reason() if finish is not None else None}
        if not self._chat:
            choice: dict[str, Any] = {"index": 0, "text": text}
            if self._ids:
                choice["token_ids"] = [] if token is None else [token]
            choice["logprobs"] = (self._completion_logprobs(
                shape, position, self._offset, [(text, token)])
                if shape.logprobs and token is not None else None)
            self._offset += len(text)
            return self._event({**choice, **final})
        # a chat: the deltas this token makes, the one carrying the token's logprobs
        deltas: list[dict[str, Any]] = []
        carrier = 0
        reasoning = token is not None and position < shape.reasoning_tokens
        if reasoning:
            deltas.append({"reasoning_content": text})
        elif shape.tool is None:
            deltas.append({"content": text})
        if shape.tool is not None and (not reasoning or finish is not None):
            if not self._called:
                self._called = True
                deltas.append({"tool_calls": [{
                    "index": 0, "id": shape.call_id, "type": "function",
                    "function": {"name": shape.tool, "arguments": ""}}]})
            fragment = ""
            if token is not None and not reasoning:
                carrier = len(deltas)
                fragment = (("{" if self._args == 0 else ", ") + f'"arg{self._args}": '
                            + orjson.dumps(text.strip()).decode())
                self._args += 1
            if finish is not None:
                fragment += "}" if self._args else "{}"
            if fragment:
                deltas.append({"tool_calls": [{"index": 0,
                                               "function": {"arguments": fragment}}]})
        parts = []
        for i, delta in enumerate(deltas):
            carries = i == carrier and token is not None
            choice = {"index": 0, "delta": delta}
            if self._ids:
                choice["token_ids"] = [token] if carries else []
            choice["logprobs"] = ({"content": [self._chat_logprob(shape, position, text,
                                                                  token)]}
                                  if carries and shape.logprobs and token is not None
                                  else None)
            if i == len(deltas) - 1:
                choice.update(final)
            else:
                choice.update(finish_reason=None, stop_reason=None)
            parts.append(self._event(choice))
        return b"".join(parts)

    def _shaped_entry(self, shape: ChoiceShape, text: str, token_ids: list[int],
                      finish: str) -> dict[str, Any]:
        """A whole answer's choice: the concatenation of what its chunks would carry."""
        tokens = [(WORDS[t], t) for t in token_ids if 0 <= t < VOCAB_SIZE]
        if "".join(word for word, _ in tokens) != text:
            tokens = []  # not this mock's tokens: no per-token fields
        entry: dict[str, Any] = {"index": 0}
        logprobs: Any = None
        if self._chat:
            cut = min(shape.reasoning_tokens, len(tokens))
            message: dict[str, Any] = {"role": "assistant"}
            rest = tokens[cut:]
            if shape.tool is not None:
                arguments = "{" + ", ".join(
                    f'"arg{j}": ' + orjson.dumps(word.strip()).decode()
                    for j, (word, _) in enumerate(rest)) + "}"
                message["content"] = None
                message["tool_calls"] = [{"id": shape.call_id, "type": "function",
                                          "function": {"name": shape.tool,
                                                       "arguments": arguments}}]
            else:
                message["content"] = "".join(word for word, _ in rest) if tokens else text
            if shape.reasoning_tokens:
                message["reasoning_content"] = "".join(word for word, _ in tokens[:cut])
            entry["message"] = message
            if shape.logprobs:
                logprobs = {"content": [self._chat_logprob(shape, i, word, t)
                                        for i, (word, t) in enumerate(tokens)]}
        else:
            entry["text"] = text
            if shape.logprobs:
                logprobs = self._completion_logprobs(shape, 0, 0, tokens)
        entry["logprobs"] = logprobs
        entry["finish_reason"] = shape.finish(finish)
        entry["stop_reason"] = shape.stop_reason()
        return entry

    def answer(self, *, text: str, token_ids: list[int], finish: str,
               usage: dict[str, Any], top: Mapping[str, Any] | None = None,
               choice: Mapping[str, Any] | None = None) -> bytes:
        entry: dict[str, Any]
        if self._shape is not None:
            entry = self._shaped_entry(self._shape, text, token_ids, finish)
        else:
            entry = {"index": 0}
            if self._chat:
                entry["message"] = {"role": "assistant", "content": text}
            else:
                entry["text"] = text
            entry["logprobs"] = None
            entry["finish_reason"] = finish
            entry["stop_reason"] = None
        if self._ids:
            entry["token_ids"] = token_ids
        if choice:
            entry.update(choice)
        answer: dict[str, Any] = {
            "id": self._response_id,
            "object": "chat.completion" if self._chat else "text_completion",
            "created": int(time.time()),
            "model": self._model,
            "choices": [entry],
            "usage": usage,
        }
        if self._top:
            answer.update(self._top)
        if top:
            answer.update(top)
        return orjson.dumps(answer)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    """An OpenAI ``usage`` object with ``prompt_tokens_details.cached_tokens``."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


# --- the worker ----------------------------------------------------------------------------


class MockWorker:
    """The base of the mock workers: an ASGI 3 application (prefill or decode).

    Endpoints: the protocol's generation endpoints (``POST /v1/completions`` and
    ``POST /v1/chat/completions`` at least), ``GET /kv/{key}`` and
    ``POST /kv/{key}/release`` (the KV pull between mock workers), ``GET /v1/models``,
    ``GET /health``, and ``GET /metrics`` (Prometheus text, a registry per worker: held,
    stranded and freed KV blocks; served, aborted and expired requests; requests
    received, running, completed, failed, aborted). Not from the real workers:
    ``GET /stats``, JSON for tests and benchmarks, ``{"stats": {...}, "aborts":
    [{"request_id", "at"}, ...]}``: :attr:`stats` and :attr:`aborts`.

    A generation request is read, checked (400 for malformed JSON or missing fields, 404
    for another model than ``model``), recorded in :attr:`seen`, given its fault (the
    body's ``"fault"``, else ``fault_plan``; ``*_reject[:STATUS]`` answers that status),
    then served by the protocol's :meth:`_work`, cancelled at once if the client closes
    the connection (abort on close, as vLLM and SGLang do).

    KV pull protocol (between mock workers): ``GET /kv/{key}`` claims the KV staged under
    ``key`` (404 if it is gone: expired, pulled, released, never staged), waits
    ``latency.kv_transfer_time(prompt tokens)`` seconds, and sends the blocks' bytes
    (:func:`kv_block_bytes`, ``block_size * kv_bytes_per_token`` bytes per block), then
    frees them (the request is *served*). If the puller disconnects first, the KV is
    released. ``POST /kv/{key}/release`` frees KV still waiting for its pull.

    Args: see the protocol subclasses.
    """

    #: The protocol's name (``"vllm"``, ``"sglang"``, ``"trtllm"``).
    protocol: ClassVar[str] = "mock"
    #: ``owned_by`` in ``/v1/models``.
    owned_by: ClassVar[str] = "mock"
    #: Errors as ``{"object": "error", ...}`` (SGLang, TRT-LLM) rather than
    #: ``{"error": {...}}`` (vLLM).
    flat_errors: ClassVar[bool] = False
    #: Whether a decode request aborted before its KV pull tells the prefill side to free
    #: the KV (vLLM, SGLang); TRT-LLM's generation server does not: the context's KV
    #: waits for its transfer timeout.
    releases_unpulled_kv: ClassVar[bool] = True

    def __init__(
        self,
        role: Role,
        *,
        name: str | None = None,
        model: str | None = None,
        latency: LatencyModel | None = None,
        seed: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_ttl: float = DEFAULT_KV_TTL,
        kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
        default_max_tokens: int = 16,
        fault_plan: FaultPlan | None = None,
        http_client: httpx.AsyncClient | None = None,
        max_body_bytes: int = 4 * 1024 * 1024,
        history: int = 256,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        if kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
        if default_max_tokens < 0:
            raise ValueError(f"default_max_tokens must be >= 0, got {default_max_tokens}")
        self.role: Role = role
        self._named = name is not None
        self.name = name if name is not None else f"{role}-worker"
        self.model = model
        self.latency = latency if latency is not None else LatencyModel()
        self.seed = seed
        #: The worker's KV blocks (a prefill worker's staged KV).
        self.kv = KVBlockPool(self.name, block_size=block_size, ttl=kv_ttl)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.default_max_tokens = default_max_tokens
        self.fault_plan = fault_plan
        self.http_client = http_client
        self.max_body_bytes = max_body_bytes
        #: What it did (see :class:`WorkerStats`).
        self.stats = WorkerStats()
        #: The most recent generation requests received, oldest first.
        self.seen: deque[SeenRequest] = deque(maxlen=history)
        #: The most recent aborts, oldest first: ``(X-Request-Id, time.monotonic())`` as
        #: each aborted request (its connection closed first) finished its cleanup. On
        #: Linux ``time.monotonic()`` is ``CLOCK_MONOTONIC``, one clock for every process
        #: of the host, so a client can compare its own stamps with these (benchmark P5).
        self.aborts: deque[tuple[str, float]] = deque(maxlen=history)
        #: Where decode workers pull this worker's KV from (set by :meth:`advertise`).
        self.host = "127.0.0.1"
        self.port = 0
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self._created = int(time.time())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.role} {self.name!r} at {self.host}:{self.port}>"

    #: The port of a second listener the worker wants (SGLang's bootstrap port), 0 for any
    #: free one, or None; :func:`~trio_disagg.workers.serve_worker` binds it.
    @property
    def extra_listen_port(self) -> int | None:
        return None

    def advertise(self, host: str, port: int, extra_port: int | None = None) -> None:
        """Set the worker's own address, put in the handoffs it answers (``extra_port``:
        the bound port of :attr:`extra_listen_port`); an unnamed worker is named
        ``"{role}@host:port"``."""
        self.host = host
        self.port = port
        if not self._named:
            self.name = f"{self.role}@{host}:{port}"
            self.kv.name = self.name

    def client(self) -> httpx.AsyncClient:
        """The HTTP client of the worker's KV pulls and releases."""
        if self.http_client is None:
            self.http_client = httpx.AsyncClient(timeout=PULL_TIMEOUT, trust_env=False)
        return self.http_client

    def extra_gauges(self) -> list[tuple[str, str, float]]:
        """More ``(name, doc, value)`` gauges for ``/metrics``."""
        return []

    def exchange(self, send: Send, request_id: str | None = None) -> Exchange:
        return Exchange(send, request_id, flat=self.flat_errors)

    # --- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await lifespan(receive, send)
            return
        if kind != "http":
            await trio.lowlevel.checkpoint()
            return
        method = scope["method"]
        path = scope["path"]
        try:
            await self._route(scope, receive, send)
        except Exception:  # a bug: log it; hypercorn closes the connection
            logger.exception("mock %s %s worker %s failed on %s %s", self.protocol, self.role,
                             self.name, method, path)
            raise

    def generation_paths(self) -> frozenset[str]:
        """The paths of generation requests."""
        return OPENAI_PATHS

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        path = scope["path"]
        if path in self.generation_paths():
            if method != "POST":
                await self.exchange(send).error(f"Method {method} not allowed", 405)
                return
            await self._generate(scope, receive, send)
        elif path.startswith("/kv/"):
            await self._kv(scope, receive, send)
        elif path == "/v1/models" and method == "GET":
            await self.exchange(send).respond(200, self._models())
        elif path == "/health" and method == "GET":
            await self.exchange(send).respond(200, b"", b"text/plain")
        elif path == "/metrics" and method == "GET":
            await self.exchange(send).respond(200, generate_latest(self.registry),
                                              CONTENT_TYPE_LATEST.encode())
        elif path == "/stats" and method == "GET":
            await self.exchange(send).respond(200, self._stats_json())
        else:
            await self.exchange(send).error(f"Not found: {method} {path}", 404)

    def _stats_json(self) -> bytes:
        return orjson.dumps({
            "stats": attrs.asdict(self.stats),
            "kv": attrs.asdict(self.kv.counters()),
            "aborts": [{"request_id": rid, "at": at} for rid, at in self.aborts],
        })

    def _note_abort(self, request_id: str) -> None:
        self.stats.aborted += 1
        self.aborts.append((request_id, time.monotonic()))

    def _models(self) -> bytes:
        model = self.model if self.model is not None else "mock-model"
        return orjson.dumps({"object": "list", "data": [{
            "id": model, "object": "model", "created": self._created,
            "owned_by": self.owned_by, "root": model, "parent": None, "max_model_len": 8192,
        }]})

    # --- generation ------------------------------------------------------------------------

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.stats.requests += 1
        self.stats.open += 1
        try:
            await self._generate_open(scope, receive, send)
        finally:
            self.stats.open -= 1

    async def _generate_open(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = self.stats
        path = scope["path"]
        request_id = header(scope, b"x-request-id") or uuid.uuid4().hex
        exchange = self.exchange(send, request_id)
        try:
            data = await read_body(receive, self.max_body_bytes)
        except ValueError as exc:
            stats.failed += 1
            await exchange.error(str(exc), 413)
            return
        if data is None:
            self._note_abort(request_id)
            return
        body, problem, status = self._parse(data, path)
        if body is None:
            stats.failed += 1
            await exchange.error(problem, status)
            return
        self.seen.append(SeenRequest(path=path, request_id=request_id, body=body))
        try:
            mock, fault_body = split_mock_faults(body, self.role)
            fault = fault_for(fault_body, self.role, request_id, self.fault_plan)
            if mock is not None and fault is not None and fault.role == mock.role:
                raise ValueError(f"at most one {mock.role} fault per request; got "
                                 f"{fault} and {mock.kind.value}")
            if fault is not None and fault.kind in REJECTS:
                raise Refusal(fault.status or 503, f"{self.name} refused request "
                              f"{request_id!r} (injected fault {fault})")
            work = self._work(exchange, body, path, fault, mock)
        except ValueError as exc:
            stats.failed += 1
            await exchange.error(str(exc), 400)
            return
        except Refusal as refusal:
            stats.failed += 1
            await exchange.error(refusal.message, refusal.status)
            return
        stats.running += 1
        try:
            await run_until_disconnect(receive, exchange, work)
        finally:
            stats.running -= 1
            if exchange.disconnected:
                self._note_abort(request_id)
            elif exchange.failed:
                stats.failed += 1
            elif exchange.finished:
                stats.completed += 1

    def _work(self, exchange: Exchange, body: dict[str, Any], path: str,
              fault: Fault | None, mock: MockFault | None = None) -> Work:
        """How to serve one generation request (run until done or the client goes away);
        ``mock``: its mock-only fault (:mod:`._faults`), for this worker's role.

        Raises:
            Refusal: answer with that status instead.
            ValueError: answer 400 with the message.
        """
        raise NotImplementedError

    def _parse(self, data: bytes, path: str) -> tuple[dict[str, Any] | None, str, int]:
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            return None, f"malformed JSON: {exc}", 400
        if not isinstance(body, dict):
            return None, "the request body must be a JSON object", 400
        problem = self._check_body(body, path)
        if problem is not None:
            return None, problem[1], problem[0]
        return body, "", 200

    def _check_body(self, body: dict[str, Any], path: str) -> tuple[int, str] | None:
        """``(status, message)`` if the body cannot be served, else None."""
        if path == "/v1/chat/completions" and not isinstance(body.get("messages"), list):
            return 400, "'messages' is required and must be a list"
        if path == "/v1/completions" and "prompt" not in body:
            return 400, "'prompt' is required"
        if self.model is not None and body.get("model") != self.model:
            return 404, f"The model `{body.get('model')}` does not exist."
        hook = body.get(REASONING_HOOK)
        if hook is not None and (type(hook) is not int or hook < 0):
            return 400, f"'{REASONING_HOOK}' must be a non-negative integer, got {hook!r:.40}"
        return None

    def _max_tokens(self, body: Mapping[str, Any]) -> int:
        """The completion budget of a body, in tokens."""
        return resolve_max_tokens(None, body, self.default_max_tokens)

    def _min_tokens(self, body: Mapping[str, Any]) -> int:
        """The tokens a body asks before EOS may end it (``min_tokens``), at least 0."""
        value = body.get("min_tokens")
        return value if type(value) is int and value > 0 else 0

    def ends_on_first_token(self, body: Mapping[str, Any], fault: Fault | None) -> bool:
        """Whether a prefill's first token ends the request on EOS (``eos_first_token``):
        not when the body asks ``min_tokens >= 1`` (EOS may not come before them)."""
        return (fault is not None and fault.kind is FaultKind.EOS_FIRST_TOKEN
                and self._min_tokens(body) == 0)

    def openai_format(self, exchange: Exchange, body: Mapping[str, Any], path: str,
                      top: Mapping[str, Any] | None = None) -> OpenAIFormat:
        chat = path == "/v1/chat/completions"
        request_id = exchange.request_id or ""
        shape = choice_shape(body, chat=chat, decode=self.role == "decode",
                             request_id=request_id)
        return OpenAIFormat(chat=chat,
                            response_id=("chatcmpl-" if chat else "cmpl-") + request_id,
                            model=body.get("model"),
                            with_ids=body.get("return_token_ids") is True, top=top,
                            shape=shape, seed=self.seed, request_id=request_id)

    async def _decode(self, exchange: Exchange, body: Mapping[str, Any], fmt: AnswerFormat,
                      fault: Fault | None, source: KVSource | str | None, *,
                      include_usage: bool, eos_with_handoff: bool = False,
                      mock: MockFault | None = None) -> None:
        """A decode request: pull the KV from ``source`` first (a string: why the handoff
        cannot be used, a decode error), or with no source compute the prefill here; then
        generate.

        A streamed answer's headers go out at once (the request was accepted). A failed
        pull is a decode error: an error event and ``[DONE]`` in a stream, a 500 answer
        otherwise. KV not pulled (aborted, failed before the first token) is released.
        ``eos_with_handoff``: honour ``eos_first_token`` after a handoff too (SGLang's
        decode receives the prefill's first token with the KV). ``eos_first_token``
        ends the tokens on EOS after ``min_tokens`` of them (the first with none), as a
        stop; past the budget it is a ``length`` finish as usual. ``mock``:
        ``decode_kv_lost`` lets go of the KV and answers 500 before any byte;
        ``decode_queue:SECONDS`` waits that long, accepted, before the pull;
        ``decode_accept_delay:SECONDS`` waits that long before accepting. A worker
        that does not :attr:`releases_unpulled_kv` leaves KV it never pulled to the
        prefill side's lease.
        """
        kind = fault.kind if fault is not None else None
        fault_at = fault.at if fault is not None and fault.at is not None else -1
        request_id = exchange.request_id or ""
        stream = body.get("stream") is True
        prompt_tokens = count_prompt_tokens(body)
        max_tokens = self._max_tokens(body)
        pending = isinstance(source, KVSource)  # KV we may still have to release
        mock_kind = mock.kind if mock is not None else None
        if mock is not None and mock_kind is MockFaultKind.DECODE_ACCEPT_DELAY:
            # not accepted yet, its handoff not looked at: aborted now, it lets go of nothing
            await trio.sleep(mock.seconds)
        try:
            if mock_kind is MockFaultKind.DECODE_KV_LOST and isinstance(source, KVSource):
                pending = False  # the failed transfer lets go of the KV: nothing to pull
                self.stats.kv_pull_failures += 1
                with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
                    await source.release(self, request_id)
                await self._fail(exchange, f"KV transfer failed: {self.name} lost the KV "
                                           f"of request {request_id!r} from {source.where} "
                                           f"(injected fault {mock_kind.value})")
                return
            if stream:
                await exchange.start_stream()  # accepted: headers now, as the workers do
            if isinstance(source, str):
                await self._fail(exchange, f"{self.name}: {source}")
                return
            if kind is FaultKind.DECODE_STALL:
                await trio.sleep_forever()  # queued: the KV waits, unpulled
            if mock is not None and mock_kind is MockFaultKind.DECODE_QUEUE:
                await trio.sleep(mock.seconds)  # queued, then the pull
            if kind is FaultKind.DECODE_FAIL_BEFORE_FIRST_TOKEN:
                if source is not None:
                    pending = False
                    with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
                        await source.release(self, request_id)
                await self._fail(exchange, f"{self.name}: injected fault {kind.value} on "
                                           f"request {request_id!r}")
                return
            eos_first = False
            if source is not None:
                error = await source.pull(self, request_id)
                pending = False
                if error is not None:
                    await self._fail(exchange, f"{self.name}: {error}")
                    return
                cached = prompt_tokens  # the decode sees the whole prompt cached
                eos_first = eos_with_handoff and kind is FaultKind.EOS_FIRST_TOKEN
            else:
                if (delay := self.latency.time_to_first_token(prompt_tokens)) > 0:
                    await trio.sleep(delay)
                cached = cached_prompt_tokens(self.seed, body, prompt_tokens,
                                              self.kv.block_size)
                eos_first = kind is FaultKind.EOS_FIRST_TOKEN
            # EOS comes first of all, or right after the min_tokens it may not cut short
            eos_at = self._min_tokens(body) + 1
            if eos_first and 0 < eos_at <= max_tokens:
                max_tokens = eos_at
            else:
                eos_first = False
            await self._tokens(exchange, fmt, stream=stream, include_usage=include_usage,
                               max_tokens=max_tokens, eos_first=eos_first, fault_kind=kind,
                               fault_at=fault_at,
                               usage=lambda n: usage_dict(prompt_tokens, n, cached))
        finally:
            if pending and self.releases_unpulled_kv:  # aborted before the pull
                assert isinstance(source, KVSource)
                with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
                    await source.release(self, request_id)

    async def _tokens(self, exchange: Exchange, fmt: AnswerFormat, *, stream: bool,
                      include_usage: bool, max_tokens: int, eos_first: bool,
                      fault_kind: FaultKind | None, fault_at: int,
                      usage: Callable[[int], dict[str, Any]]) -> None:
        """Generate ``max_tokens`` tokens, ``latency.inter_token_latency`` seconds apart,
        fixed by ``seed`` and the request id; the last one finishes ``length`` (``stop``
        with ``eos_first``: EOS, counted as a token, as the mock always has)."""
        request_id = exchange.request_id or ""
        tokens = TokenStream(self.seed, request_id)
        itl = self.latency.inter_token_latency
        texts: list[str] = []
        ids: list[int] = []
        parts: list[bytes] = []
        fmt.bind_usage(usage)
        if stream and (first := fmt.start()):
            parts.append(first)
        for i in range(max_tokens):
            if i == fault_at:
                if parts:
                    await exchange.body(b"".join(parts))
                await self._fault_at(exchange, fault_kind, request_id, stream)
                return
            if itl > 0:
                await trio.sleep(itl)
            token = tokens.next_id()
            last = i == max_tokens - 1
            finish = ("stop" if eos_first else "length") if last else None
            if stream:
                parts.append(fmt.token(WORDS[token], token, finish))
                if itl > 0 or len(parts) >= _BATCH:
                    await exchange.body(b"".join(parts))
                    parts = []
            else:
                texts.append(WORDS[token])
                ids.append(token)
        if not stream:
            await exchange.respond(200, fmt.answer(
                text="".join(texts), token_ids=ids,
                finish="stop" if eos_first and max_tokens else "length",
                usage=usage(max_tokens)))
            return
        if max_tokens == 0:
            parts.append(fmt.token("", None, "length"))
        if include_usage and (tail := fmt.usage(usage(max_tokens))):
            parts.append(tail)
        parts.append(DONE_EVENT)
        await exchange.finish(b"".join(parts))

    async def _fault_at(self, exchange: Exchange, kind: FaultKind | None, request_id: str,
                        stream: bool) -> None:
        if kind is FaultKind.DECODE_ERROR_AT:
            await self._fail(exchange, f"{self.name}: injected fault {kind.value} on request "
                                       f"{request_id!r}")
        elif kind is FaultKind.DECODE_STALL_AT:
            await trio.sleep_forever()
        else:  # DECODE_RESET_AT: the connection closes with the answer half-way
            await self._reset(exchange, stream)

    async def _reset(self, exchange: Exchange, stream: bool) -> None:
        """End the response half-way: the connection closes without a complete answer."""
        exchange.failed = True
        if not exchange.started:
            await exchange.start(200, JSON_TYPE)
        if not stream:
            await exchange.body(b'{"id":"cmpl-')
        else:
            await trio.lowlevel.checkpoint()

    async def _fail(self, exchange: Exchange, message: str) -> None:
        exchange.failed = True
        await exchange.error(message, 500)

    # --- the KV pull, prefill side -----------------------------------------------------------

    async def _kv(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = bytes(scope.get("raw_path") or scope["path"].encode()).partition(b"?")[0]
        rest = raw[len(b"/kv/"):]
        method = scope["method"]
        exchange = self.exchange(send, header(scope, b"x-request-id"))
        if rest.endswith(b"/release") and method == "POST":
            key = unquote_to_bytes(rest[:-len(b"/release")]).decode("utf-8", "replace")
            released = self.kv.release_key(key)
            await exchange.respond(200, orjson.dumps({"released": released}))
            return
        if method != "GET" or b"/" in rest:
            await exchange.error(f"Not found: {method} {scope['path']}", 404)
            return
        key = unquote_to_bytes(rest).decode("utf-8", "replace")
        try:
            entry = self.kv.claim(key)
        except KVTransferError as exc:
            await exchange.error(str(exc), 404)
            return
        size = self.kv.block_size * self.kv_bytes_per_token
        done = False

        async def transfer() -> None:
            nonlocal done
            if (delay := self.latency.kv_transfer_time(entry.num_tokens)) > 0:
                await trio.sleep(delay)
            await send_octets(exchange, kv_bytes(self.name, entry.key, entry.block_ids, size))
            self.kv.complete(entry)
            self.stats.kv_transfers += 1
            done = True

        try:
            await run_until_disconnect(receive, exchange, transfer)
        finally:
            if not done:
                self.kv.release(entry)  # the puller went away: free the blocks


async def send_octets(exchange: Exchange, data: bytes,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """A whole ``application/octet-stream`` answer, in body messages of 64 KiB."""
    await exchange.start(200, OCTETS, extra, length=len(data))
    chunks = [data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
    for chunk in chunks[:-1]:
        await exchange.body(chunk)
    await exchange.finish(chunks[-1])


def header(scope: Scope, name: bytes) -> str | None:
    """A request header, decoded as latin-1 and stripped; None if absent or empty."""
    for key, value in scope["headers"]:
        if key == name:
            text = bytes(value).decode("latin-1").strip()
            return text or None
    return None


def query_param(scope: Scope, name: str) -> str | None:
    """A query string parameter (the first), or None."""
    query = bytes(scope.get("query_string") or b"").decode("latin-1")
    for part in query.split("&"):
        key, _, value = part.partition("=")
        if key == name:
            return value
    return None


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer the ASGI lifespan protocol."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
