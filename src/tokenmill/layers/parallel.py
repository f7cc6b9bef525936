"""Tensor-parallel forms of the built layers: same parameters, a collective in forward.

A model is built at its rank's local sizes (``distributed/shard.py``: heads, MLP width
and vocabulary divided by the ranks), then the layers whose output is partial are
*adopted* here, before any weight is loaded: their class changes, their parameters and
weight method stay, so the loader fills them as before. Column-parallel layers (q/k/v,
gate/up) need no collective: each rank computes its own heads / MLP columns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.layers.linear import Linear, VocabEmbedding

if TYPE_CHECKING:
    from tokenmill.attention import StepContext
    from tokenmill.distributed.group import RankGroup


class RowParallelLinear(Linear):
    """Input features split over ranks (o_proj, down_proj): x [T, in / size] -> the full
    y [T, out], summed over ranks. Only rank 0 holds the bias (the others' is zero)."""

    group: RankGroup

    @classmethod
    def adopt(cls, layer: Linear, group: RankGroup) -> None:
        _adopt(layer, cls, group=group)

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x, ctx))


class VocabParallelHead(Linear):
    """Output rows split over ranks (lm_head): x [N, hidden] -> logits [N, vocab], each
    rank's [N, vocab / size] gathered, the padding of the last shard cut off."""

    group: RankGroup
    vocab_size: int

    @classmethod
    def adopt(cls, layer: Linear, group: RankGroup, vocab_size: int) -> None:
        _adopt(layer, cls, group=group, vocab_size=vocab_size)

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        return self.group.all_gather_last(super().forward(x, ctx))[..., : self.vocab_size]


class VocabParallelEmbedding(VocabEmbedding):
    """Rows [start, start + local) of the table: each rank looks up the ids it holds (zeros
    for the others) and the ranks sum; tied, ``logits`` gathers like ``VocabParallelHead``."""

    group: RankGroup
    vocab_size: int
    start: int

    @classmethod
    def adopt(cls, layer: VocabEmbedding, group: RankGroup, vocab_size: int) -> None:
        start = group.rank * layer.num_embeddings
        _adopt(layer, cls, group=group, vocab_size=vocab_size, start=start)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start  # [T]
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = super().forward(local.masked_fill(outside, 0))  # [T, hidden]
        return self.group.all_reduce(hidden.masked_fill_(outside[:, None], 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(super().logits(hidden))[..., : self.vocab_size]


def _adopt(layer: nn.Module, cls: type, **attrs: object) -> None:
    """Give a built layer its parallel class (the same parameters and weight method) and
    the plain attributes its forward reads."""
    layer.__class__ = cls
    vars(layer).update(attrs)
