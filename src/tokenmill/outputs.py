"""What callers get back (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log probability of one token at one position (from the raw model logits)."""

    logprob: float
    rank: int | None = None
    """1 = the most likely token at this position."""
    decoded_token: str | None = None
    bytes: bytes | None = None
    """The token's raw bytes (may be part of a multi-byte UTF-8 character)."""


PositionLogprobs = dict[int, Logprob]
"""token id -> Logprob for one position: the chosen token plus the top alternatives."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    """None while running; then "stop", "length", "cancelled" or "error"."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the output (None for EOS / length)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    """Set when the request failed inside the engine (finish_reason "error")."""
    metrics: dict[str, float] = field(default_factory=dict)
