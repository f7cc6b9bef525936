"""Linear layers whose weights are allocated empty and filled by the weight loader.

Nothing here initializes weights: building a model costs one allocation of the
parameters and no compute. ``PackedLinear`` fuses several HF projections that
read the same input (q/k/v, gate/up) into one matmul; the loader writes each
HF tensor into its shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). weight [out, in], bias [out]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class PackedLinear(Linear):
    """Several projections of the same input stacked along the output dim.

    Output rows ``offsets[i] : offsets[i] + out_sizes[i]`` belong to shard i.
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: Sequence[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, sum(out_sizes), bias, dtype)
        self.out_sizes = tuple(out_sizes)
        self.offsets = tuple(sum(out_sizes[:i]) for i in range(len(out_sizes)))

    @property
    def num_shards(self) -> int:
        return len(self.out_sizes)

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        """View of the rows of ``param`` (this module's weight or bias) owned by shard ``index``."""
        return param.narrow(0, self.offsets[index], self.out_sizes[index])


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab, hidden]; also the output head when tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]."""
        return F.embedding(input_ids, self.weight)
