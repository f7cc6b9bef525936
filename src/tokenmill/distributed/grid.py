"""Where each of an engine's ``tp * pp`` ranks sits: its pipeline stage and its rank in
that stage's tensor-parallel group.

Global rank g = slot * tp + r, r the rank inside the stage's TP group. Slot 0 is the
*last* stage, so global rank 0 (the driver: scheduler, KV bookkeeping, sampler) is the
last stage's TP rank 0; slot k >= 1 is stage k - 1. With pp = 1 this is plain tensor
parallelism (global rank = TP rank), with tp = 1 plain pipeline parallelism (ranks 1..
are stages 0..P-2).

Stage to stage, TP rank r of stage s sends its (hidden, residual) to TP rank r of stage
s + 1 (``peer``). After every layer's row-parallel all-reduce each TP rank of a stage
holds the whole pair, so each sends its own copy: tp independent point-to-point links,
no collective added, and the pipeline's send / recv code unchanged but for the peer's
rank. The alternative (TP rank 0 sends, the next stage broadcasts inside its group) moves
1/tp of the bytes between stages but puts a broadcast per micro-batch on the critical
path and gives ranks of one stage different code paths.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    tp: int
    """Ranks per stage (``tensor_parallel_size``)."""
    pp: int
    """Stages (``pipeline_parallel_size``)."""

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def stage_of(self, rank: int) -> int:
        slot = rank // self.tp
        return self.pp - 1 if slot == 0 else slot - 1

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def rank_of(self, stage: int, tp_rank: int) -> int:
        """The global rank of ``stage``'s TP rank ``tp_rank``."""
        slot = 0 if stage == self.pp - 1 else stage + 1
        return slot * self.tp + tp_rank

    def peer(self, rank: int, stage: int) -> int:
        """The rank of ``stage`` that ``rank`` exchanges activations with (its TP rank)."""
        return self.rank_of(stage, self.tp_rank_of(rank))

    def stage_ranks(self) -> list[list[int]]:
        """Each stage's global ranks, by slot (the last stage first): the TP groups."""
        return [[slot * self.tp + r for r in range(self.tp)] for slot in range(self.pp)]
