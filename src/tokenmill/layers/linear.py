"""Linear layers whose weights are allocated empty and filled by the weight loader.

Nothing here initializes weights: building a model costs one allocation of the
parameters and no compute. ``PackedLinear`` fuses several HF projections that
read the same input (q/k/v, gate/up) into one matmul; the loader writes each
HF tensor into its shard. How a weight is stored (dense, int8, int4) is the
layer's ``LinearMethod`` (``tokenmill.quant``); the loader calls ``load_weight``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.quant.methods import LinearMethod, Source, method_for

if TYPE_CHECKING:
    from tokenmill.attention import StepContext


class Linear(nn.Module):
    """y = x W^T (+ b). W [out, in] stored as ``method`` says (dense ``weight`` by default),
    bias [out] dense."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.method = method or method_for("dense")
        self.method.create_weights(
            self, out_features, in_features, dtype or torch.get_default_dtype()
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]. ``ctx``: the step (per-token adapters will read it)."""
        return self.method.apply(self, x, self.bias)

    def load_weight(self, src: Source, shard: int | None = None) -> None:
        """Fill the weight (or one shard's rows of it) from a checkpoint tensor."""
        self.method.load_rows(self, 0, src)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"weight={self.method.name}"
        )


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
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__(in_features, sum(out_sizes), bias, dtype, method)
        self.out_sizes = tuple(out_sizes)
        self.offsets = tuple(sum(out_sizes[:i]) for i in range(len(out_sizes)))

    @property
    def num_shards(self) -> int:
        return len(self.out_sizes)

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        """View of the rows of ``param`` (this module's bias, or dense weight) owned by shard ``index``."""
        return param.narrow(0, self.offsets[index], self.out_sizes[index])

    def load_weight(self, src: Source, shard: int | None = None) -> None:
        if shard is None:
            self.method.load_rows(self, 0, src)
            return
        if src.shape[0] != self.out_sizes[shard]:
            raise ModelLoadError(
                f"shard {shard} has {self.out_sizes[shard]} rows, the checkpoint gives {src.shape[0]}"
            )
        self.method.load_rows(self, self.offsets[shard], src)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab, hidden]; also the output head when tied (``logits``)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype | None = None,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = vocab_size
        self.embedding_dim = hidden_size
        self.dtype = dtype or torch.get_default_dtype()
        self.method = method or method_for("dense")
        self.method.create_weights(self, vocab_size, hidden_size, self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]."""
        return self.method.embed(self, input_ids, self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> [N, vocab]: the table used as a tied output head."""
        return self.method.apply(self, hidden, None)

    def load_weight(self, src: Source, shard: int | None = None) -> None:
        self.method.load_rows(self, 0, src)
