"""Gated feed-forward block: down(act(gate(x)) * up(x)) with gate/up packed into one matmul."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.layers.activation import GatedActivation
from tokenmill.layers.linear import Linear, PackedLinear
from tokenmill.layers.ops import Ops
from tokenmill.quant.plan import QuantPlan, linear_method

if TYPE_CHECKING:
    from tokenmill.attention import StepContext


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
        ops: Ops | None = None,
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
        self.act = GatedActivation(hidden_act, ops)
        self.down_proj = Linear(
            intermediate_size,
            hidden_size,
            bias,
            dtype,
            linear_method(quant, f"{prefix}.down_proj", [hidden_size], intermediate_size),
        )

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, ctx)  # [T, 2I]
        return self.down_proj(self.act(gate_up), ctx)  # [T, I] -> [T, hidden]
