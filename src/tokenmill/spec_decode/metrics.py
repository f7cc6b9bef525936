"""Counters of speculative decoding (vLLM's ``spec_decode_*`` metrics), one writer: the
engine thread, through ``DraftHook``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    method: str
    max_tokens: int
    num_drafts: int = 0
    """Verifications: sequence-steps that carried drafts."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """accepted_per_pos[j]: verifications whose draft j (0-based) was accepted."""
    drafted_per_pos: list[int] = field(default_factory=list)
    """drafted_per_pos[j]: verifications that carried a draft j."""

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.max_tokens
        self.drafted_per_pos = [0] * self.max_tokens

    def add(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for j in range(drafted):
            self.drafted_per_pos[j] += 1
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: the accepted drafts plus the one sampled after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """Flat ``spec_decode_*`` entries (``LLM.get_scheduling_metrics``)."""
        out: dict[str, float | int] = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
        }
        for j, (acc, dr) in enumerate(zip(self.accepted_per_pos, self.drafted_per_pos)):
            out[f"spec_decode_acceptance_rate_pos_{j}"] = acc / dr if dr else 0.0
        return out
