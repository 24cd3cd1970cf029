"""The demo's workload: scenarios, a real OpenAI client per request, and the report.

Each request is sent by the official ``openai`` client (its synchronous client, one worker
thread per concurrent request) to a router on a loopback port, so the demo measures what a
user of the router would see: real HTTP, real SSE, real disconnects.
"""

from __future__ import annotations

import enum
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs
import openai


class Outcome(enum.Enum):
    """What the client saw."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"  # the router answered 504: a deadline of rule B2 in docs/semantics.md
    ABORTED = "aborted"  # finish_reason "abort": the worker cancelled the request
    DISCONNECTED = "disconnected"  # the client went away on purpose


class Disconnect(enum.Enum):
    NONE = "none"
    PREFILL = "prefill"  # before the response headers: the prefill is running
    HANDOFF = "handoff"  # right after the headers: decode just accepted, no token read
    STREAM = "stream"  # after a few tokens


@attrs.frozen
class Scenario:
    """One kind of request in the mix and what the client must see.

    Attributes:
        name: shown in the table.
        expect: the only acceptable outcome.
        fault: the mock workers' fault string (``body["fault"]``), if any.
        prompt_words: prompt length in words (about tokens for the mock workers).
        max_tokens: completion budget in tokens.
        disconnect: when the client goes away, if it does.
        backend: which prefill pool serves it (``"sequential"`` or ``"bootstrap"``).
        chat: send a chat completion instead of a completion.
    """

    name: str
    expect: Outcome
    fault: str | None = None
    prompt_words: int = 32
    max_tokens: int = 16
    disconnect: Disconnect = Disconnect.NONE
    backend: str = "sequential"
    chat: bool = False


def default_scenarios(backend: str, *, terminal: bool) -> list[Scenario]:
    """Every scenario of the demo for one backend.

    Args:
        backend: the backend's label, prefixed to each scenario's name.
        terminal: whether the backend's prefill can answer by itself (S7): true where the
            prefill runs first (vLLM, TRT-LLM), false for the concurrent bootstrap (SGLang).
    """
    prefix = f"{backend}/"
    scenarios = [
        Scenario(prefix + "plain", Outcome.OK, backend=backend),
        Scenario(prefix + "chat", Outcome.OK, backend=backend, chat=True),
        Scenario(prefix + "long prompt", Outcome.OK, prompt_words=600, max_tokens=32,
                 backend=backend),
        Scenario(prefix + "disconnect in prefill", Outcome.DISCONNECTED, prompt_words=600,
                 disconnect=Disconnect.PREFILL, backend=backend),
        Scenario(prefix + "disconnect at handoff", Outcome.DISCONNECTED,
                 disconnect=Disconnect.HANDOFF, backend=backend),
        Scenario(prefix + "disconnect mid-stream", Outcome.DISCONNECTED, max_tokens=64,
                 disconnect=Disconnect.STREAM, backend=backend),
        Scenario(prefix + "prefill fails before handoff", Outcome.ERROR,
                 fault="prefill_fail_before_handoff", backend=backend),
        Scenario(prefix + "prefill fails after handoff", Outcome.ERROR,
                 fault="prefill_fail_after_handoff", backend=backend),
        Scenario(prefix + "prefill stalls", Outcome.TIMEOUT, fault="prefill_stall",
                 backend=backend),
        Scenario(prefix + "decode error at token 3", Outcome.ERROR,
                 fault="decode_error_at:3", backend=backend),
        Scenario(prefix + "decode fails before 1st token", Outcome.ERROR,
                 fault="decode_fail_before_first_token", backend=backend),
        Scenario(prefix + "decode stalls", Outcome.TIMEOUT, fault="decode_stall",
                 backend=backend),
    ]
    if terminal:  # S7: the prefill answers by itself; no decode (or the decode is stopped)
        scenarios += [
            Scenario(prefix + "EOS on first token", Outcome.OK, fault="eos_first_token",
                     backend=backend),
            Scenario(prefix + "prefill error finish", Outcome.ERROR,
                     fault="prefill_error_finish", backend=backend),
            Scenario(prefix + "prefill cancelled finish", Outcome.ERROR,
                     fault="prefill_cancelled_finish", backend=backend),
        ]
    return scenarios


def plan(scenarios: Sequence[Scenario], total: int, seed: int) -> list[Scenario]:
    """``total`` requests: every scenario at least once, plain requests weighted up, shuffled
    with ``seed`` so runs repeat."""
    rng = random.Random(seed)
    plain = [s for s in scenarios if s.expect is Outcome.OK and s.fault is None]
    requests = list(scenarios)
    while len(requests) < total:
        # About half the load is healthy traffic, the rest spread over the faults.
        requests.append(rng.choice(plain) if rng.random() < 0.5 else rng.choice(scenarios))
    rng.shuffle(requests)
    return requests[:max(total, len(scenarios))]


@attrs.define
class Result:
    """One request as the client saw it. Times are seconds."""

    scenario: Scenario
    outcome: Outcome
    detail: str = ""
    ttft: float | None = None
    itls: list[float] = attrs.Factory(list)
    tokens: int = 0
    elapsed: float = 0.0
    finish_reason: str | None = None


def run_request(
    client: openai.OpenAI, model: str, scenario: Scenario, index: int, seed: int
) -> Result:
    """Send one request with the official client (blocking; run in a worker thread)."""
    rng = random.Random(seed * 1_000_003 + index)
    prompt = " ".join(f"w{rng.randrange(1000)}" for _ in range(scenario.prompt_words))
    leave_after = rng.randint(1, 8)  # tokens read before a mid-stream disconnect
    start = time.perf_counter()
    result = Result(scenario, Outcome.OK)
    try:
        stream = _open_stream(client, model, scenario, prompt, f"demo-{seed}-{index}")
        with stream:
            if scenario.disconnect is Disconnect.HANDOFF:
                result.outcome = Outcome.DISCONNECTED  # gone before reading a token
            else:
                _read_stream(stream, result, start, leave_after)
        if result.outcome is Outcome.OK:
            _judge_finish(result)
    except openai.APITimeoutError:
        result.outcome = (Outcome.DISCONNECTED if scenario.disconnect is Disconnect.PREFILL
                          else Outcome.ERROR)
        result.detail = "client timeout"
    except openai.APIStatusError as exc:
        result.outcome = Outcome.TIMEOUT if exc.status_code == 504 else Outcome.ERROR
        result.detail = f"{exc.status_code}: {_message(exc)}"
    except openai.APIError as exc:  # an error event inside the stream
        result.outcome, result.detail = Outcome.ERROR, _message(exc)
    finally:
        result.elapsed = time.perf_counter() - start
    return result


def _open_stream(
    client: openai.OpenAI, model: str, scenario: Scenario, prompt: str, request_id: str
) -> Any:
    """Send ``scenario``'s request, streamed with usage, and return the client's stream
    (a chat completion's or a completion's)."""
    if scenario.disconnect is Disconnect.PREFILL:
        # Give up long before the prefill of a long prompt can finish.
        client = client.with_options(timeout=0.02)
    extra: dict[str, Any] = {"fault": scenario.fault} if scenario.fault else {}
    kwargs: dict[str, Any] = dict(
        model=model, max_tokens=scenario.max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body=extra,
        extra_headers={"X-Request-Id": request_id},
    )
    if scenario.chat:
        return client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], **kwargs)
    return client.completions.create(prompt=prompt, **kwargs)


def _read_stream(stream: Any, result: Result, start: float, leave_after: int) -> None:
    """Read ``stream`` into ``result``: tokens, TTFT and ITLs (seconds, from ``start``, a
    :func:`time.perf_counter` value) and the finish reason. A scenario that disconnects
    mid-stream stops after ``leave_after`` tokens, its outcome ``DISCONNECTED``."""
    scenario = result.scenario
    last = None
    for chunk in stream:
        now = time.perf_counter()
        if not chunk.choices:
            continue  # the usage chunk
        choice = chunk.choices[0]
        text = choice.delta.content if scenario.chat else choice.text
        if text:
            result.tokens += 1
            if result.ttft is None:
                result.ttft = now - start
            elif last is not None:
                result.itls.append(now - last)
            last = now
        if choice.finish_reason:
            result.finish_reason = choice.finish_reason
        if scenario.disconnect is Disconnect.STREAM and result.tokens >= leave_after:
            result.outcome = Outcome.DISCONNECTED
            return


def _judge_finish(result: Result) -> None:
    """The outcome of a stream read to its end: ``ABORTED`` on finish reason ``abort``,
    ``ERROR`` if it ended with no finish reason, else it stays ``OK``."""
    if result.finish_reason == "abort":
        result.outcome = Outcome.ABORTED
    elif result.finish_reason is None:
        result.outcome, result.detail = Outcome.ERROR, "stream ended without a finish"


def _message(exc: openai.APIError) -> str:
    return str(exc.message)[:80]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.1f}"


def format_table(results: Sequence[Result], wall: float) -> str:
    """One row per scenario: requests, outcomes, p50/p99 TTFT, mean ITL, tokens/s."""
    by_name: dict[str, list[Result]] = {}
    for result in results:
        by_name.setdefault(result.scenario.name, []).append(result)
    header = ("scenario", "n", "outcome (client saw)", "expect", "TTFT p50", "TTFT p99",
              "ITL p50", "tok/s")
    rows = [header]
    for name, group in sorted(by_name.items()):
        outcomes = Counter(r.outcome.value for r in group)
        ttfts = [r.ttft for r in group if r.ttft is not None]
        itls = [gap for r in group for gap in r.itls]
        tokens = sum(r.tokens for r in group)
        busy = sum(r.elapsed for r in group)
        rows.append((
            name, str(len(group)),
            " ".join(f"{k}={v}" for k, v in sorted(outcomes.items())),
            group[0].scenario.expect.value,
            _ms(percentile(ttfts, 0.5)), _ms(percentile(ttfts, 0.99)),
            _ms(percentile(itls, 0.5)),
            f"{tokens / busy:.0f}" if busy > 0 and tokens else "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    total_tokens = sum(r.tokens for r in results)
    lines.append(f"{len(results)} requests in {wall:.2f} s, {total_tokens} tokens streamed "
                 f"({total_tokens / wall:.0f} tok/s overall); times in ms")
    return "\n".join(lines)


def check_outcomes(results: Sequence[Result]) -> list[str]:
    """Each request whose outcome is not its scenario's, as a readable line."""
    broken = []
    for result in results:
        if result.outcome is not result.scenario.expect:
            broken.append(
                f"{result.scenario.name}: expected {result.scenario.expect.value}, client saw "
                f"{result.outcome.value} {result.detail}".rstrip()
            )
    return broken

