"""LFM2's short convolution: y = out_proj(C * conv(B * x)), the conv window in a slot."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention import StepContext
from tokenmill.kv_cache.spec import RecurrentState
from tokenmill.layers.linear import Linear
from tokenmill.layers.recurrent.conv import CausalConv1d
from tokenmill.layers.recurrent.plan import StatePlan


class ShortConv(nn.Module):
    """hidden [T, hidden] -> [T, hidden]: in_proj gives (B, C, x); the gated input B * x
    goes through a depthwise causal conv of ``kernel`` taps (no activation), times C."""

    def __init__(self, hidden: int, kernel: int, bias: bool, layer_idx: int,
                 dtype: torch.dtype, channels: int | None = None) -> None:  # fmt: skip
        """``channels``: how many of the ``hidden`` conv channels this layer holds (all;
        a tensor-parallel rank its slice, the output projection summed over ranks)."""
        super().__init__()
        self.layer_idx = layer_idx
        c = hidden if channels is None else channels
        self.in_proj = Linear(hidden, 3 * c, bias, dtype)
        self.conv = CausalConv1d(c, kernel, bias, dtype)
        self.out_proj = Linear(c, hidden, bias, dtype)
        self.state_spec = RecurrentState(self.conv.state_shape, torch.float32)
        """The conv window [hidden, K - 1]."""

    def forward(self, hidden: torch.Tensor, ctx: StepContext, plan: StatePlan) -> torch.Tensor:
        windows = ctx.kv_caches[self.layer_idx]
        assert windows is not None, f"layer {self.layer_idx} has no state slots"
        b, c, x = self.in_proj(hidden, ctx).chunk(3, dim=-1)
        bx = b * x
        y = torch.empty_like(bx)
        if plan.num_singles:
            window = windows.index_select(0, plan.slots) * plan.keep[:, None, None]
            out, window = self.conv.forward_step(plan.gather(bx), window)
            windows.index_copy_(0, plan.slots, window.to(windows.dtype))
            plan.scatter(y, out)
        for run in plan.runs:
            rows = slice(run.start, run.end)
            window = None if run.fresh else windows[run.slot]
            if run.offsets:  # snapshots, rollback; before the slot's window (`window`) changes
                kept = self.conv.windows_at(bx[rows], window, run.offsets)
                plan.save(self.layer_idx, self.state_spec, run, (kept,))
            out, window = self.conv.forward_seq(bx[rows], window)
            windows[run.slot] = window
            y[rows] = out
        return self.out_proj(c * y, ctx)
