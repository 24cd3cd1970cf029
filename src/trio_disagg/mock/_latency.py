"""The latency model of the mock workers: how long prefill, transfer and decode take."""

from __future__ import annotations

import math

import attrs


def _non_negative(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):  # also refuses NaN
        raise ValueError(f"{attribute.name} must be a finite number of seconds >= 0, "
                         f"got {value!r}")


@attrs.frozen(slots=True, kw_only=True)
class LatencyModel:
    """How long a mock worker takes, in seconds.

    The defaults are in the range of a mid-sized model on one GPU; use :meth:`zero` to
    measure the router's own overhead. A delay of 0 costs nothing: the workers do not
    call :func:`trio.sleep` for it (the channel sends are their only checkpoints).

    Args:
        ttft_per_prompt_token: seconds of prefill compute per prompt token, so the time
            to first token grows linearly with the prompt.
        inter_token_latency: seconds between two decoded tokens.
        kv_transfer_per_token: seconds per prompt token to move the KV cache from the
            prefill worker to the decode worker.

    Raises:
        ValueError: a delay is negative, infinite or NaN.
    """

    ttft_per_prompt_token: float = attrs.field(default=0.0002, validator=_non_negative)
    inter_token_latency: float = attrs.field(default=0.02, validator=_non_negative)
    kv_transfer_per_token: float = attrs.field(default=0.00002, validator=_non_negative)

    @classmethod
    def zero(cls) -> LatencyModel:
        """No delay anywhere: for benchmarks of router overhead."""
        return cls(ttft_per_prompt_token=0.0, inter_token_latency=0.0,
                   kv_transfer_per_token=0.0)

    @property
    def is_zero(self) -> bool:
        """True when every delay is 0 (as :meth:`zero` makes it)."""
        return (self.ttft_per_prompt_token == 0 and self.inter_token_latency == 0
                and self.kv_transfer_per_token == 0)

    def time_to_first_token(self, prompt_tokens: int) -> float:
        """Seconds of prefill compute for a prompt of ``prompt_tokens`` tokens:
        ``ttft_per_prompt_token * prompt_tokens``."""
        return self.ttft_per_prompt_token * prompt_tokens

    def kv_transfer_time(self, prompt_tokens: int) -> float:
        """Seconds to transfer the KV cache of a prompt of ``prompt_tokens`` tokens:
        ``kv_transfer_per_token * prompt_tokens``."""
        return self.kv_transfer_per_token * prompt_tokens

