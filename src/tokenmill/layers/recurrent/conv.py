"""Depthwise causal convolution whose window of past inputs is part of a recurrent state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalConv1d(nn.Module):
    """y_t = b + sum_j w[:, j] * x_{t - K + 1 + j} per channel, over a sequence's inputs.

    The state is the window of the last K - 1 inputs ``[channels, K - 1]`` (zeros before
    the first token). HF's ``conv1d.weight`` [channels, 1, K] loads as is.
    """

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.channels, self.kernel = channels, kernel
        self.weight = nn.Parameter(
            torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(channels, dtype=dtype), requires_grad=False) if bias else None
        )

    @property
    def state_shape(self) -> tuple[int, int]:
        return (self.channels, self.kernel - 1)

    def forward_seq(
        self, x: torch.Tensor, window: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's new inputs x [L, C] after ``window`` [C, K - 1] (None: zeros) ->
        (y [L, C], the window after them [C, K - 1], in the window's dtype)."""
        past = (
            torch.zeros(self.state_shape, dtype=x.dtype, device=x.device)
            if window is None
            else window
        )
        full = torch.cat([past.to(x.dtype), x.T], dim=1)  # [C, K - 1 + L]
        y = F.conv1d(full[None], self.weight, self.bias, groups=self.channels)[0]  # [C, L]
        new_window = full[:, full.shape[1] - (self.kernel - 1) :]
        return y.T, new_window

    def windows_at(
        self, x: torch.Tensor, window: torch.Tensor | None, offsets: tuple[int, ...]
    ) -> torch.Tensor:
        """The windows after the first o of the new inputs x [L, C] (after ``window``, None:
        zeros), for each o of ``offsets`` -> [len(offsets), C, K - 1]."""
        past = torch.zeros(self.state_shape, dtype=x.dtype, device=x.device) if window is None \
            else window.to(x.dtype)  # fmt: skip
        full = torch.cat([past, x.T], dim=1)  # [C, K - 1 + L]: input j - (K - 1) at column j
        return torch.stack([full[:, o : o + self.kernel - 1] for o in offsets])

    def forward_step(
        self, x: torch.Tensor, window: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One new input per sequence x [B, C] after windows [B, C, K - 1] -> (y [B, C], the
        windows after it [B, C, K - 1])."""
        full = torch.cat([window.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
        y = (full * self.weight[:, 0]).sum(-1)
        if self.bias is not None:
            y = y + self.bias
        return y, full[:, :, 1:]
