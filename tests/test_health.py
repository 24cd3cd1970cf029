"""Worker health and retries before the first byte (rule B9 in docs/semantics.md;
docs/router.md "Worker health" and "Retries").

Over HTTP: the router's real server in front of vLLM mock workers and of a scripted worker
(:func:`scripted_worker`) that answers its health probe but resets or refuses every
generation request, on 127.0.0.1 with port 0; every wait is bounded. In process: the
circuit breaker, the probes and the retry policy on the autojump clock.
"""

from __future__ import annotations

import logging
import re
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Literal

import attrs
import httpx  # noqa: ASYNC127 (httpx is the project's HTTP client)
import openai
import pytest
import trio
from e2e_support import FAST, MODEL, PROMPT, in_thread, wait_until
from prometheus_client.parser import text_string_to_metric_families

from trio_disagg import (
    Annotated,
    Deadlines,
    DecodeEngine,
    DisaggRouter,
    HandoffStyle,
    HealthMonitor,
    HealthState,
    InvalidPrefillHandoff,
    LLMEngineOutput,
    NoDisaggregatedParams,
    PrefillCancelled,
    PrefillError,
    PreprocessedRequest,
    RequestContext,
    RetryPolicy,
    RoundRobin,
    RoutingHints,
    TransferKeeper,
    WorkerError,
    WorkerPool,
)
from trio_disagg._handoff import HandoffOwner
from trio_disagg._health import retry_reason, worker_fault
from trio_disagg.engines import mock_cluster, vllm_client, vllm_engines
from trio_disagg.server import create_app, serve
from trio_disagg.workers import MockVllmWorker, create_mock_worker, serve_worker

# --- a scripted worker: healthy to its probe, failing every generation request ----------


@attrs.define(eq=False)
class Scripted:
    """What :func:`scripted_worker` does with a POST, and how many it received."""

    mode: str  # "reset", "refuse" (503), "bad" (400), "busy" (429, Retry-After: 7) or
    # "midstream" (a token, then reset)
    posts: int = 0


async def scripted_worker(
    script: Scripted, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(partial(_answer, script), listeners)


async def _answer(script: Scripted, stream: trio.SocketStream) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some()
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += await stream.receive_some()
    if head.startswith(b"GET /health "):
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n"
                              b"connection: close\r\n\r\n")
    elif head.startswith(b"POST "):
        script.posts += 1
        await _fail(script.mode, stream)
    await stream.aclose()


async def _fail(mode: str, stream: trio.SocketStream) -> None:
    if mode in ("refuse", "bad", "busy"):
        status = {"refuse": b"503 Service Unavailable", "bad": b"400 Bad Request",
                  "busy": b"429 Too Many Requests\r\nretry-after: 7"}[mode]
        error = b'{"error": {"message": "scripted refusal", "type": "x", "code": null}}'
        await stream.send_all(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json"
                              b"\r\ncontent-length: " + str(len(error)).encode()
                              + b"\r\nconnection: close\r\n\r\n" + error)
        return
    if mode == "midstream":
        chunk = (b'data: {"id": "x", "object": "text_completion", "created": 0, "model": "'
                 + MODEL.encode() + b'", "choices": [{"index": 0, "text": " first", '
                 b'"finish_reason": null}]}\n\n')
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"transfer-encoding: chunked\r\n\r\n"
                              + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
    # A reset: RST instead of FIN (SO_LINGER 0), as a worker that died does.
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def free_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --- the router over HTTP -----------------------------------------------------------------


@attrs.define(eq=False)
class Fleet:
    url: str
    router: DisaggRouter
    health: HealthMonitor
    keeper: TransferKeeper

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=20.0)

    async def get(self, path: str) -> httpx.Response:
        async with httpx.AsyncClient() as client:
            with trio.fail_after(10):
                return await client.get(self.url + path)

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``."""
        text = (await self.get("/metrics")).text
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == name
                   and labels.items() <= sample.labels.items())


@asynccontextmanager
async def fleet(prefill: Sequence[str], decode: Sequence[str], *,
                interval: float = 60.0) -> AsyncIterator[Fleet]:
    """The router, with probes of its workers every ``interval`` seconds, served over
    HTTP in front of the vLLM workers at ``prefill`` and ``decode``."""
    async with vllm_client() as client, TransferKeeper(drain_window=5.0) as keeper:
        prefill_engines, decode_engines = vllm_engines(prefill, decode, client=client)
        router = DisaggRouter(WorkerPool(prefill_engines, policy=RoundRobin()),
                              WorkerPool(decode_engines, policy=RoundRobin()), keeper,
                              retry=RetryPolicy(max_attempts=2, backoff=0.01))
        health = HealthMonitor([*router.prefill.workers, *router.decode.workers],
                               interval=interval, timeout=2.0)
        app = create_app(router, models=[MODEL])
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve, app, port=0, shutdown_trigger=stop.wait,
                                               graceful_timeout=5.0, health=health))
            yield Fleet(f"http://127.0.0.1:{port}", router, health, keeper)
            stop.set()


@asynccontextmanager
async def mock_workers(
    *roles: Literal["prefill", "decode"],
) -> AsyncIterator[list[tuple[MockVllmWorker, str]]]:
    """vLLM mock workers of ``roles``, served; each with its URL."""
    async with trio.open_nursery() as nursery:
        served = []
        for role in roles:
            worker = create_mock_worker(role, latency=FAST, kv_ttl=120.0)
            port = await nursery.start(partial(serve_worker, worker))
            served.append((worker, f"http://127.0.0.1:{port}"))
        yield served
        nursery.cancel_scope.cancel()


def complete(fleet: Fleet, **options: Any) -> Any:
    return fleet.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                             **options)


async def settled(fleet: Fleet, *workers: MockVllmWorker) -> None:
    """B5 and B1: no request in flight, no KV block held."""
    with trio.fail_after(5):
        await fleet.router.wait_idle()
        await fleet.keeper.wait_idle()
    await wait_until(lambda: not any(worker.kv.counters().held_blocks or worker.stats.running
                                     for worker in workers))


async def test_dead_prefill_worker_at_start_makes_health_503_until_it_comes_back() -> None:
    dead = free_port()
    async with mock_workers("decode") as [(decode, decode_url)]:
        dead_url = f"http://127.0.0.1:{dead}"
        async with fleet([dead_url], [decode_url], interval=0.05) as router:
            # Before any request: the first round of probes ran before the port opened.
            ready = await router.get("/health")
            assert ready.status_code == 503
            assert ready.json()["pools_without_healthy_workers"] == ["prefill"]
            assert ready.json()["workers"]["prefill"] == {dead_url: "down"}
            assert (await router.get("/livez")).status_code == 200
            with pytest.raises(openai.APIStatusError) as refused:
                await in_thread(lambda: complete(router))
            assert refused.value.status_code == 503
            assert "no prefill worker available" in refused.value.message
            assert not decode.seen
            assert await router.metric("trio_disagg_worker_ejections_total", reason="probe",
                                       worker=dead_url) == 1
            assert await router.metric("trio_disagg_worker_state", state="down",
                                       worker=dead_url) == 1

            # It comes back on the same port: the next probes re-admit it.
            prefill = create_mock_worker("prefill", latency=FAST, kv_ttl=120.0)
            async with trio.open_nursery() as nursery:
                await nursery.start(partial(serve_worker, prefill, port=dead))
                with trio.fail_after(10):
                    await router.health.wait_rounds(2)
                assert (await router.get("/health")).status_code == 200
                answer = await in_thread(lambda: complete(router))
                assert answer.choices[0].text
                await settled(router, prefill, decode)
                nursery.cancel_scope.cancel()


async def test_B9_prefill_reset_is_retried_on_another_prefill_worker() -> None:
    script = Scripted("reset")
    async with mock_workers("prefill", "decode") as [(prefill, prefill_url),
                                                       (decode, decode_url)], \
            trio.open_nursery() as nursery:
        port = await nursery.start(scripted_worker, script)
        flaky = f"http://127.0.0.1:{port}"
        async with fleet([flaky, prefill_url], [decode_url]) as router:
            assert (await router.get("/health")).status_code == 200  # it answers probes
            answer = await in_thread(lambda: complete(router))
            assert answer.choices[0].text and answer.usage is not None
            assert script.posts == 1  # tried first (round robin), then the other
            assert len(prefill.seen) == 1 and len(decode.seen) == 1
            assert await router.metric("trio_disagg_retries_total", leg="prefill",
                                       reason="transport_error") == 1
            await settled(router, prefill, decode)
        nursery.cancel_scope.cancel()


async def test_B9_decode_refusal_is_replaced_with_the_same_handoff() -> None:
    script = Scripted("refuse")
    async with mock_workers("prefill", "decode") as [(prefill, prefill_url),
                                                       (decode, decode_url)], \
            trio.open_nursery() as nursery:
        port = await nursery.start(scripted_worker, script)
        async with fleet([prefill_url], [f"http://127.0.0.1:{port}", decode_url]) as router:
            chunks = await in_thread(lambda: list(complete(router, stream=True)))
            assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
            assert script.posts == 1 and len(prefill.seen) == 1
            (seen,) = decode.seen  # one prefill, its KV pulled by the second decode worker
            assert seen.body["kv_transfer_params"]["remote_request_id"]
            assert await router.metric("trio_disagg_retries_total", leg="decode",
                                       reason="server_error") == 1
            await settled(router, prefill, decode)
        nursery.cancel_scope.cancel()


async def test_B9_no_retry_after_the_first_byte() -> None:
    script = Scripted("midstream")
    async with mock_workers("prefill", "decode") as [(_, prefill_url),
                                                       (decode, decode_url)], \
            trio.open_nursery() as nursery:
        port = await nursery.start(scripted_worker, script)
        async with fleet([prefill_url], [f"http://127.0.0.1:{port}", decode_url]) as router:
            received: list[str] = []

            def read() -> None:
                for chunk in complete(router, stream=True):
                    received.extend(choice.text for choice in chunk.choices)

            with pytest.raises(openai.APIError):
                await in_thread(read)
            assert received == [" first"]  # the first byte went out: the failure is final
            assert script.posts == 1 and not decode.seen
            assert await router.metric("trio_disagg_retries_total") == 0
        nursery.cancel_scope.cancel()


async def test_B9_a_4xx_is_never_retried() -> None:
    script = Scripted("bad")
    async with mock_workers("prefill", "decode") as [(prefill, prefill_url),
                                                       (decode, decode_url)], \
            trio.open_nursery() as nursery:
        port = await nursery.start(scripted_worker, script)
        async with fleet([f"http://127.0.0.1:{port}", prefill_url], [decode_url]) as router:
            with pytest.raises(openai.BadRequestError):
                await in_thread(lambda: complete(router))
            assert script.posts == 1 and not prefill.seen and not decode.seen
            # The worker refused a bad request: alive, not at fault.
            assert router.router.prefill.workers[0].failures_total == 0
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_B9_a_worker_too_busy_is_retried_elsewhere_and_counts_against_it(
        leg: str) -> None:
    """Once: a worker's 429 was taken for a bad request: final for the client although
    another worker was idle, and a success for the worker's breaker, so a worker behind a
    rate limiter answered (fast) every request selection gave it and was never ejected."""
    script = Scripted("busy")
    async with mock_workers("prefill", "decode") as [(prefill, prefill_url),
                                                       (decode, decode_url)], \
            trio.open_nursery() as nursery:
        busy = f"http://127.0.0.1:{await nursery.start(scripted_worker, script)}"
        pools = ([busy, prefill_url], [decode_url]) if leg == "prefill" else (
            [prefill_url], [busy, decode_url])
        async with fleet(*pools) as router:
            chunks = await in_thread(lambda: list(complete(router, stream=True)))
            assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
            assert script.posts == 1 and len(prefill.seen) == 1 and len(decode.seen) == 1
            assert await router.metric("trio_disagg_retries_total", leg=leg,
                                       reason="too_many_requests") == 1
            pool = router.router.prefill if leg == "prefill" else router.router.decode
            assert pool.workers[0].failures_total == 1
            await settled(router, prefill, decode)
        nursery.cancel_scope.cancel()


async def test_B9_a_429_with_no_other_worker_reaches_the_client_with_its_retry_after(
) -> None:
    script = Scripted("busy")
    async with mock_workers("decode") as [(decode, decode_url)], trio.open_nursery() as n:
        busy = f"http://127.0.0.1:{await n.start(scripted_worker, script)}"
        async with fleet([busy], [decode_url]) as router:
            with pytest.raises(openai.RateLimitError) as raised:
                await in_thread(lambda: complete(router))
            assert raised.value.response.headers["retry-after"] == "7"
            assert script.posts == 1 and not decode.seen
        n.cancel_scope.cancel()


# --- in process: the breaker, the probes, the policy ------------------------------------


@attrs.define
class Probed:
    """An engine with a health probe the test flips."""

    name: str
    up: bool = True
    handoff_style: HandoffStyle = HandoffStyle.SEQUENTIAL
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None

    async def check_health(self) -> None:
        await trio.sleep(0.01)
        if not self.up:
            raise WorkerError(f"{self.name} is down", worker=self.name)

    async def generate(
        self,
        request: PreprocessedRequest,
        context: RequestContext,
        send_channel: trio.MemorySendChannel[Annotated[LLMEngineOutput]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        raise AssertionError("not routed to")


async def test_probes_mark_a_worker_down_and_readmit_it(autojump_clock: trio.abc.Clock) -> None:
    engines = [Probed("a"), Probed("b", up=False)]
    pool = WorkerPool(engines)
    monitor = HealthMonitor(pool.workers, interval=1.0, timeout=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        assert [worker.state for worker in pool.workers] == [HealthState.HEALTHY,
                                                              HealthState.DOWN]
        assert pool.healthy() == [pool.workers[0]]
        engines[1].up = True
        await monitor.wait_rounds(1)
        assert pool.workers[1].state is HealthState.HEALTHY
        assert pool.workers[1].health.ejections == {"passive": 0, "probe": 1}
        assert pool.workers[1].health.last_probe_seconds == pytest.approx(0.01)
        nursery.cancel_scope.cancel()


async def test_a_probe_past_its_timeout_fails(autojump_clock: trio.abc.Clock) -> None:
    class Slow(Probed):
        async def check_health(self) -> None:
            await trio.sleep(10)

    pool = WorkerPool([Slow("slow")])
    await HealthMonitor(pool.workers, timeout=0.5).probe_all()
    assert pool.workers[0].state is HealthState.DOWN
    with pytest.raises(Exception, match="every worker failed its health probe"):
        pool.select(PreprocessedRequest(request_id="r", model=MODEL, body={}))


async def test_a_failed_probe_warning_says_why(
        autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    """The operator's one line about a worker going down names the cause: a worker URL
    that answers 404 (a wrong path) reads differently from one that does not answer."""
    class NotFound(Probed):
        async def check_health(self) -> None:
            raise WorkerError(f"prefill worker {self.name} health check answered 404",
                              worker=self.name, worker_status=404)

    class Slow(Probed):
        async def check_health(self) -> None:
            await trio.sleep(10)

    pool = WorkerPool([NotFound("http://p0:8100/prefix"), Slow("http://p1:8100")])
    with caplog.at_level(logging.WARNING, logger="trio_disagg.health"):
        await HealthMonitor(pool.workers, timeout=0.5).probe_all()
    lines = [record.getMessage() for record in caplog.records]
    assert ("worker http://p0:8100/prefix failed its health probe (prefill worker "
            "http://p0:8100/prefix health check answered 404): skipped until one succeeds"
            ) in lines, lines
    assert ("worker http://p1:8100 failed its health probe (no answer within 0.5 s): "
            "skipped until one succeeds") in lines, lines


def test_the_embedded_mock_engines_are_not_probed() -> None:
    cluster = mock_cluster(1, 1)
    workers = WorkerPool(cluster.prefill).workers + WorkerPool(cluster.decode).workers
    assert HealthMonitor(workers).workers == []


async def test_breaker_opens_half_opens_and_closes(autojump_clock: trio.abc.Clock) -> None:
    pool = WorkerPool([Probed("a"), Probed("b")], policy=RoundRobin(), failure_threshold=2,
                      cooldown=5.0)
    worker = pool.workers[0]

    def state() -> HealthState:
        return worker.state

    transport = WorkerError("reset", status=502)
    pool.record_failure(worker, transport)
    assert state() is HealthState.HEALTHY
    pool.record_failure(worker, transport)
    assert state() is HealthState.EJECTED and pool.healthy() == [pool.workers[1]]
    await trio.sleep(5.0)
    assert state() is HealthState.HALF_OPEN and worker in pool.healthy()
    request = PreprocessedRequest(request_id="r", model=MODEL)
    chosen = [pool.select(request).name for _ in range(4)]
    assert chosen.count("a") == 1  # one trial at a time
    pool.record_failure(worker, transport)  # the trial failed: open again at once
    assert state() is HealthState.EJECTED
    assert worker.health.ejections["passive"] == 2
    await trio.sleep(5.0)
    assert pool.select(request).name == "a"  # the next trial...
    await trio.sleep(5.0)  # ... never answered: another one after a cool-down
    assert sorted(pool.select(request).name for _ in range(2)) == ["a", "b"]
    pool.record_success(worker)
    assert state() is HealthState.HEALTHY
    assert {pool.select(request).name for _ in range(4)} == {"a", "b"}


def test_only_a_workers_own_faults_count() -> None:
    def caused(error: BaseException, cause: BaseException) -> BaseException:
        error.__cause__ = cause
        return error

    assert worker_fault(None) is True  # no answer in time
    assert worker_fault(caused(PrefillError("x"), WorkerError("reset", status=502))) is True
    assert worker_fault(caused(PrefillError("x"), WorkerError("bad", status=400))) is False
    assert worker_fault(InvalidPrefillHandoff("bad handoff", field="f")) is None
    assert worker_fault(NoDisaggregatedParams("no handoff")) is None
    assert worker_fault(PrefillCancelled("ended by the router")) is None


def test_B9_what_may_be_retried() -> None:
    assert retry_reason(WorkerError("reset", status=502)) == "transport_error"
    assert retry_reason(WorkerError("5xx", status=502, worker_status=503)) == "server_error"
    assert retry_reason(WorkerError("4xx", status=400, worker_status=400)) is None
    assert retry_reason(WorkerError("busy", status=429, worker_status=429)) == (
        "too_many_requests")
    assert retry_reason(WorkerError("lost", status=502, worker_status=500,
                                    handoff_lost=True)) is None
    assert retry_reason(WorkerError("an engine's own", status=503)) == "server_error"
    assert retry_reason(PrefillError("after the answer began")) is None


def test_retry_policy_backs_off_with_jitter_and_refuses_nonsense() -> None:
    policy = RetryPolicy(max_attempts=4, backoff=0.1, max_backoff=0.3)
    for attempt, full in ((2, 0.1), (3, 0.2), (4, 0.3)):
        assert all(full / 2 <= policy.delay(attempt) <= full for _ in range(50))
    for bad in ({"max_attempts": 0}, {"backoff": -1.0}, {"max_backoff": float("inf")}):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)
    with pytest.raises(ValueError, match="interval"):
        HealthMonitor([], interval=0)


# --- in process: B9 on the mock engines -------------------------------------------------


async def routed(
    keeper: TransferKeeper, prefill: int, decode: int, fault: str, *,
    style: HandoffStyle = HandoffStyle.SEQUENTIAL, retry: RetryPolicy | None = None,
) -> tuple[DisaggRouter, Exception]:
    """A router on ``prefill`` and ``decode`` mock engines, and the error its one request
    with ``fault`` raised (bare)."""
    cluster = mock_cluster(prefill, decode, style=style)
    router = DisaggRouter(WorkerPool(cluster.prefill, policy=RoundRobin()),
                          WorkerPool(cluster.decode, policy=RoundRobin()), keeper,
                          deadlines=Deadlines(prefill=5, handoff=5), retry=retry)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "fault": fault}
    request = PreprocessedRequest(request_id="r", model=MODEL, body=body, max_tokens=4)
    raised: list[Exception] = []
    try:
        async with trio.open_nursery() as nursery:
            stream = await router.stream(nursery, request, RequestContext("r"))
            async for _ in stream.outputs:
                pass
    except* (PrefillError, WorkerError) as group:
        raised.extend(group.exceptions)
    (error,) = raised
    with trio.fail_after(60):
        await router.wait_idle()
        await keeper.wait_idle()
    counters = cluster.counters()
    assert counters.held_blocks == counters.stranded_blocks == 0, counters  # B1
    return router, error


def failures(pool: WorkerPool[DecodeEngine]) -> list[int]:
    return [worker.failures_total for worker in pool.workers]


async def test_B9_attempts_are_bounded(autojump_clock: trio.abc.Clock) -> None:
    async with TransferKeeper() as keeper:
        router, error = await routed(keeper, 3, 1, "prefill_reject:503")
    assert isinstance(error, PrefillError) and isinstance(error.__cause__, WorkerError)
    assert router.counters.retries == {("prefill", "server_error"): 1}  # 2 attempts of 3
    assert failures(router.prefill)[0] == 1 and sum(failures(router.prefill)) == 2


async def test_B9_no_retry_whose_backoff_would_pass_the_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    slow = RetryPolicy(max_attempts=3, backoff=10.0, max_backoff=10.0)
    async with TransferKeeper() as keeper:
        router, _ = await routed(keeper, 2, 1, "prefill_reject:503", retry=slow)
    assert router.counters.retries == {} and failures(router.prefill) == [1, 0]


async def test_B9_a_bootstrap_prefill_is_not_retried(autojump_clock: trio.abc.Clock) -> None:
    async with TransferKeeper() as keeper:
        router, _ = await routed(keeper, 2, 1, "prefill_reject:503",
                                 style=HandoffStyle.BOOTSTRAP)
    assert router.counters.retries == {} and failures(router.prefill) == [1, 0]


async def test_B9_a_refused_decode_is_retried_and_its_kv_consumed(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with TransferKeeper() as keeper:
        router, error = await routed(keeper, 1, 2, "decode_reject:503")
    assert isinstance(error, WorkerError) and error.worker == "decode-1"  # the last one
    assert router.counters.retries == {("decode", "server_error"): 1}
    assert failures(router.decode) == [1, 1]
    assert router.counters.staged_kv_cleanups == 1  # the last refusal: B1, as without retry


@attrs.define
class DownDecode:
    """A decode engine whose worker cannot be reached for its first ``down_for`` requests
    (None: ever): each is refused before it is accepted, as an HTTP adapter refuses on a
    connection error; then it is back."""

    engine: Any
    name: str = "down"
    down_for: int | None = None
    refused: int = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, request: PreprocessedRequest, context: RequestContext,
                       send_channel: Any, *,
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.down_for is not None and self.refused >= self.down_for:
            await self.engine.generate(request, context, send_channel,
                                       task_status=task_status)
            return
        self.refused += 1
        with send_channel:
            await trio.lowlevel.checkpoint()
            raise WorkerError(f"decode worker {self.name} failed: ConnectError", status=502,
                              worker=self.name)


async def cleaned_up(decode: list[Any], cluster: Any, body: dict[str, Any],
                     refusal: str) -> DisaggRouter:
    """Route one request whose decode is refused (``refusal`` matches the client's
    error) over ``decode``, then wait until its B1 cleanup ended; B1 must hold."""
    async with TransferKeeper() as keeper:
        router = DisaggRouter(WorkerPool(cluster.prefill, policy=RoundRobin()),
                              WorkerPool(decode, policy=RoundRobin()), keeper,
                              deadlines=Deadlines(prefill=5, handoff=5))
        request = PreprocessedRequest(request_id="r", model=MODEL, body=body, max_tokens=4)
        with pytest.RaisesGroup(pytest.RaisesExc(WorkerError, match=refusal)):
            async with trio.open_nursery() as nursery:
                await router.stream(nursery, request, RequestContext("r"))
        with trio.fail_after(60):
            await router.wait_idle()
            await keeper.wait_idle()
    assert router.counters.staged_kv_cleanups == 1
    assert router.counters.staged_kv_cleanup_failures == 0
    counters = cluster.counters()
    assert counters.held_blocks == counters.stranded_blocks == 0, counters  # B1
    assert counters.served == 1  # the KV went to a cleanup decode on a live worker
    return router


async def test_B1_a_cleanup_decode_refused_by_a_dead_worker_is_retried_elsewhere(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The client's decode refuses with a 400 (final: no B9 retry), so a B1 cleanup decode
    # must consume the staged KV; round-robin sends it to the dead worker first.
    cluster = mock_cluster(1, 2)
    down = DownDecode(cluster.decode[1])
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "fault": "decode_reject:400"}
    router = await cleaned_up([cluster.decode[0], down], cluster, body, "400")
    assert down.refused == 1
    assert router.counters.retries == {("cleanup", "transport_error"): 1}


async def test_B1_a_cleanup_decode_waits_for_its_only_decode_worker_to_come_back(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The only decode worker is down (the health probe has not seen it yet): the request
    # gets its 502, and the B1 cleanup decode tries again after a backoff until the worker
    # is back, while the KV is still staged, instead of leaving the KV to the lease.
    cluster = mock_cluster(1, 1)
    down = DownDecode(cluster.decode[0], down_for=3)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    router = await cleaned_up([down], cluster, body, "ConnectError")
    assert down.refused == 3  # the request's decode, then two cleanup attempts
    assert router.counters.retries == {("cleanup", "transport_error"): 2}


async def test_B9_a_decode_4xx_is_final(autojump_clock: trio.abc.Clock) -> None:
    async with TransferKeeper() as keeper:
        router, error = await routed(keeper, 1, 2, "decode_reject:400")
    assert isinstance(error, WorkerError) and error.status == 400
    assert router.counters.retries == {} and failures(router.decode) == [0, 0]


async def test_S12_B9_a_replacement_decode_worker_is_counted_from_its_choice(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode worker chosen for a retry counts as outstanding from its choice, as the
    first one did, not only once its leg leases it: a request placed in between (the
    same scheduler batch) sees it taken."""
    counted: list[int] = []
    switch = HandoffOwner.switch_decode_worker

    def counting_switch(owner: HandoffOwner, worker: Any) -> None:
        switch(owner, worker)
        counted.append(worker.outstanding)

    monkeypatch.setattr(HandoffOwner, "switch_decode_worker", counting_switch)
    async with TransferKeeper() as keeper:
        router, _ = await routed(keeper, 1, 2, "decode_reject:503")
    assert counted == [1]
    assert [worker.outstanding for worker in router.decode.workers] == [0, 0]


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_B9_a_retry_gets_the_trial_of_a_half_open_worker(
    autojump_clock: trio.abc.Clock, leg: str
) -> None:
    """The only other worker is half-open: the retry is its trial, and the request
    succeeds. (The check before the backoff chose that worker, giving its trial away for
    a cool-down, so the retry itself found no worker and the client got the refusal.)"""
    cluster = mock_cluster(2 if leg == "prefill" else 1, 2 if leg == "decode" else 1)
    engines = cluster.prefill if leg == "prefill" else cluster.decode
    down = DownDecode(engines[0])  # refuses every request before accepting it (502)
    pool: WorkerPool[Any] = WorkerPool([down, engines[1]], failure_threshold=1, cooldown=10)
    other: WorkerPool[Any] = WorkerPool(cluster.decode if leg == "prefill"
                                        else cluster.prefill)
    prefill, decode = (pool, other) if leg == "prefill" else (other, pool)
    back = pool.workers[1]
    pool.record_failure(back, WorkerError("reset", status=502, worker=back.name))
    await trio.sleep(10)  # its cool-down: half-open, one trial to give
    assert back.health.state(trio.current_time()) is HealthState.HALF_OPEN
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    pin = {f"{leg}_worker": "down"}
    request = PreprocessedRequest(request_id="r", model=MODEL, body=body, max_tokens=4,
                                  routing=RoutingHints(**pin))
    async with TransferKeeper() as keeper:
        router = DisaggRouter(prefill, decode, keeper,
                              deadlines=Deadlines(prefill=5, handoff=5))
        async with trio.open_nursery() as nursery:
            stream = await router.stream(nursery, request, RequestContext("r"))
            items = [item async for item in stream.outputs]
        assert sum(len(item.data.token_ids) for item in items if item.data) == 4
        with trio.fail_after(60):
            await router.wait_idle()
            await keeper.wait_idle()
    assert down.refused == 1
    assert router.counters.retries == {(leg, "transport_error"): 1}
    assert back.health.state(trio.current_time()) is HealthState.HEALTHY  # its trial answered
    counters = cluster.counters()
    assert counters.held_blocks == counters.stranded_blocks == 0, counters  # B1


# --- the command ------------------------------------------------------------------------


async def test_serve_command_reports_dead_workers_before_any_request() -> None:
    """``trio-disagg serve`` probes its workers before it listens: with both unreachable,
    readiness is 503 naming both pools at once, liveness 200; SIGTERM still exits 0."""
    prefill, decode = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "trio_disagg._cli", "serve", "--port", "0", "--backend", "vllm",
            "--prefill", prefill, "--decode", decode, "--health-timeout", "1"]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(partial(
                trio.run_process, argv, stdout=subprocess.PIPE, check=False))
            assert process.stdout is not None
            banner = b""
            while b"\n" not in banner:
                data = await process.stdout.receive_some()
                assert data, "serve exited before its banner"
                banner += data
            port = re.search(rb"http://127\.0\.0\.1:(\d+)/v1", banner)
            assert port, banner
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{int(port[1])}") as http:
                ready = await http.get("/health")
                assert ready.status_code == 503
                assert ready.json()["pools_without_healthy_workers"] == ["prefill", "decode"]
                assert ready.json()["workers"] == {"prefill": {prefill: "down"},
                                                   "decode": {decode: "down"}}
                assert (await http.get("/livez")).status_code == 200
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0


@pytest.mark.parametrize("argv", [["--max-attempts", "0"], ["--health-interval", "0"],
                                  ["--health-timeout", "nan"]], ids=" ".join)
async def test_serve_refuses_bad_health_and_retry_flags(argv: list[str]) -> None:
    with trio.fail_after(30):
        done = await trio.run_process([sys.executable, "-m", "trio_disagg._cli", "serve", *argv],
                                      capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 2 and b"Traceback" not in done.stderr
