"""Gated feed-forward block: down(act(gate(x)) * up(x)) with gate/up packed into one matmul."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.activation import GatedActivation
from tokenmill.layers.linear import Linear, PackedLinear
from tokenmill.quant.plan import QuantPlan, linear_method


class GatedMLP(nn.Module):
    """x [T, hidden] -> [T, hidden]. HF gate_proj/up_proj load into gate_up_proj shards 0/1."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        quant: QuantPlan | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        sizes = [intermediate_size] * 2
        self.gate_up_proj = PackedLinear(
            hidden_size,
            sizes,
            bias,
            dtype,
            linear_method(quant, f"{prefix}.gate_up_proj", sizes, hidden_size),
        )
        self.act = GatedActivation(hidden_act)
        self.down_proj = Linear(
            intermediate_size,
            hidden_size,
            bias,
            dtype,
            linear_method(quant, f"{prefix}.down_proj", [hidden_size], intermediate_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, hidden]
