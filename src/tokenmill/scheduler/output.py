"""What the scheduler decided for one step: the only thing the model runner reads."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.request import Request


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: tokens [start, start + num_new_tokens) of it."""

    request: Request
    start: int
    """Position of the first new token (= num_computed_tokens before this step)."""
    num_new_tokens: int
    block_table: tuple[int, ...]
    samples: bool
    """True when this chunk reaches the request's last known token: sample the next."""

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs
