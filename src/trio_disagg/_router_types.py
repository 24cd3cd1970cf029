"""The router's public data types: the deadlines of a request, a request in flight, the
router's counters (rules B2, B5, B6, B9, B10 in docs/semantics.md)."""

from __future__ import annotations

import attrs
import trio

from ._gate import GatedOutputs, Gatekeeper
from ._handoff import HandoffOwner
from ._keeper import PrefillTask
from ._prefill import Handoff, PrefillCompletion, Terminal
from ._protocols import Annotated, BootstrapInfo, LLMEngineOutput, PromptTokensDetails
from ._tracker import RequestTracker

Item = Annotated[LLMEngineOutput]

#: What :attr:`RequestStream.outputs` is: the decode stream read through the gatekeeper,
#: or a memory channel holding a request's one item when no decode leg runs.
StreamOutputs = GatedOutputs | trio.MemoryReceiveChannel[Item]

#: The routing decisions :attr:`RouterCounters.decisions` counts: with a prefill leg and
#: a KV transfer, or on one decode worker alone (conditional disaggregation).
DISAGGREGATED = "disaggregated"
DECODE_ONLY = "decode_only"


def _positive_seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"the {attribute.name} deadline must be a number of seconds, got "
                        f"{value!r}")
    if not value > 0:  # also refuses NaN
        raise ValueError(f"the {attribute.name} deadline must be > 0 seconds, got {value!r}")


@attrs.define(kw_only=True)
class Deadlines:
    """Every bounded wait of a request, in seconds (rule B2 in docs/semantics.md).

    Attributes:
        prefill: from the prefill's dispatch until the handoff, retries on other
            workers included (B9): for a sequential prefill, the end of its stream (its
            answer, which the decode needs whole, S6); for a bootstrap prefill, its
            first output, and its answer, which comes after the KV transfer, then gets
            as long again, counted from that first output. On expiry the request fails with a
            :class:`~trio_disagg.PrefillDeadlineExceeded`; an answer already on its way
            is still read, within ``min(1 s, 10% of it)``, so its staged KV is consumed
            (B1).
        handoff: handoff ready until the decode worker accepted the request.
        decode_idle: the longest gap between two decode outputs.
        terminal_hold: how long a success terminal waits for the prefill outcome.
        transfer: the whole prefill leg in the keeper, including a bootstrap drain. (A
            B1 cleanup decode is bounded by ``handoff`` + ``decode_idle``.)

    Raises:
        TypeError: a deadline that is not a number (``True`` neither).
        ValueError: a deadline that is not a positive number of seconds (``inf`` is
            allowed: no deadline).
    """

    prefill: float = attrs.field(default=60.0, validator=_positive_seconds)
    handoff: float = attrs.field(default=30.0, validator=_positive_seconds)
    decode_idle: float = attrs.field(default=60.0, validator=_positive_seconds)
    terminal_hold: float = attrs.field(default=60.0, validator=_positive_seconds)
    transfer: float = attrs.field(default=300.0, validator=_positive_seconds)


@attrs.define(eq=False)
class RequestStream:
    """A request in flight: what :meth:`DisaggRouter.stream` returns.

    The caller reads ``outputs`` to its end, or closes it (``with stream.outputs:``, as
    with any trio channel): the request is in flight until then. Each item is pulled
    through the gatekeeper in the reader's own task (:class:`GatedOutputs`); the decode
    leg feeding it runs in the nursery the caller gave :meth:`DisaggRouter.stream`.
    Cancelling that nursery (the client went away) stops the decode leg, and leaving the
    ``with`` block on that cancellation ends the request, while the prefill leg
    (``prefill``) stays the keeper's: it runs on, or is cancelled inside its engine's
    cancel window, and staged KV that no decode took is consumed (B1, B10, G9). Closing
    ``outputs`` early ends the request as a client that left does, and stops its decode
    leg; the prefill leg is not affected (G9). A caller that stops reading without
    closing ``outputs`` or cancelling the nursery holds the request until its decode leg
    has put the whole stream in the channel (a short stream ends then); a longer one
    waits on its full channel, and no deadline ends that wait (a slow reader is not an
    idle decode, B2), so the nursery does not exit. The decode-idle deadline counts while
    the reader waits for an output: a decode that stalls while nobody reads is noticed at
    the next read. Bound a reader that may stall with a cancel scope of its own around
    ``with stream.outputs:`` (leaving it stops the decode leg; the HTTP server closes the
    connection of a client that reads nothing for 10 s).

    Attributes:
        outputs: the client's stream of items; the last one is a terminal, an error,
            or the channel ends (B4 is the server's job). A ``"stopped"`` request's holds
            one ``cancelled`` finish (C3), or nothing if the context was killed.
        tracker: the request's phases and timestamps (seconds, trio clock): the
            prefill's first valid output (S3), the decode's first output as the reader
            gets it through the gate (so ``time_to_first_token`` and
            ``kv_transfer_latency``), and the stream's end.
        style: which handoff style served it (``"sequential"``, ``"context_first"``,
            ``"bootstrap"``), ``"decode_only"`` (a short prompt served by its decode worker
            alone: conditional disaggregation), ``"terminal"`` (the prefill answered, S7)
            or ``"stopped"`` (the client stopped or killed its context before a decode
            took the request).
        prefill: the prefill drain, owned by the keeper (a decode-only request's has
            already succeeded, with no value).
        gate: the gatekeeper, or None when no decode leg runs (``"terminal"`` and
            ``"stopped"``).
        prefill_worker: the name of the chosen prefill worker (the routing decision);
            None for a decode-only request.
        decode_worker: the name of the chosen decode worker; None when no decode leg runs
            (``"terminal"`` and ``"stopped"``).
        bootstrap_info: the bootstrap room chosen (bootstrap style).
        handoff: the request's handoff owner (its ``state`` says what became of the KV).
    """

    outputs: StreamOutputs
    tracker: RequestTracker
    style: str
    prefill: PrefillTask[PrefillCompletion]
    gate: Gatekeeper | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    bootstrap_info: BootstrapInfo | None = None
    handoff: HandoffOwner | None = None

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's token count as the prefill worker reported it, once the prefill
        succeeded (the client's ``usage.prompt_tokens``, B8)."""
        completion = self.prefill.value
        if isinstance(completion, Handoff):
            return completion.result.prompt_tokens
        if isinstance(completion, Terminal) and completion.output.data is not None:
            usage = completion.output.data.completion_usage
            return usage.prompt_tokens if usage is not None and usage.prompt_tokens else None
        return None

    @property
    def prompt_tokens_details(self) -> PromptTokensDetails | None:
        """The prefill worker's ``prompt_tokens_details`` (its ``cached_tokens`` is the one
        to report: docs/protocols.md section 1), once the prefill succeeded."""
        completion = self.prefill.value
        if isinstance(completion, Handoff):
            return completion.result.prompt_tokens_details
        if isinstance(completion, Terminal) and completion.output.data is not None:
            usage = completion.output.data.completion_usage
            return usage.prompt_tokens_details if usage is not None else None
        return None


@attrs.define(kw_only=True)
class RouterCounters:
    """Lifetime counters for metrics (rules B5, B6, B10 in docs/semantics.md).

    Attributes:
        requests_total: requests admitted.
        staged_kv_cleanups: one-token cleanup decodes started for staged KV (B1).
        staged_kv_cleanup_failures: those that failed, one the worker accepted then ended
            with an error included (the worker's lease reclaims the KV).
        prefills_cancelled: prefills cancelled because their client left inside the
            engine's cancel window (B10).
        prefills_released: prefills ended because no decode would ever take their KV: a
            bootstrap room no decode will join (B6).
        prefills_drained: prefills whose request ended first and that the keeper ran to
            their end (C5, T1), their KV then consumed (B1) or transferred (G9); also
            one the router stopped that staged its KV all the same (its answer was on
            its way). Each prefill counts once, when its leg ended.
    """

    requests_total: int = 0
    staged_kv_cleanups: int = 0
    staged_kv_cleanup_failures: int = 0
    prefills_cancelled: int = 0
    prefills_released: int = 0
    prefills_drained: int = 0
    #: Legs tried again on another worker (B9), by ``(leg, reason)``: leg ``prefill`` or
    #: ``decode``, reason ``transport_error``, ``server_error`` or ``too_many_requests``.
    retries: dict[tuple[str, str], int] = attrs.Factory(dict)
    #: Requests by routing decision: :data:`DISAGGREGATED` or :data:`DECODE_ONLY`.
    decisions: dict[str, int] = attrs.Factory(lambda: {DISAGGREGATED: 0, DECODE_ONLY: 0})

    def count_retry(self, leg: str, reason: str) -> None:
        """Count one retry in :attr:`retries` (B9).

        Args:
            leg: ``"prefill"``, ``"decode"``, or ``"cleanup"`` (a B1 cleanup decode).
            reason: ``"transport_error"``, ``"server_error"`` or ``"too_many_requests"``
                (``retry_reason`` in the health module).
        """
        self.retries[leg, reason] = self.retries.get((leg, reason), 0) + 1
