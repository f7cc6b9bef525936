"""RMSNorm, computed in float32 like Hugging Face, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * w (Llama style) or * (1 + w) (Gemma style, ``unit_offset=True``).

    The two styles also round differently, exactly as their Hugging Face
    counterparts: Llama casts the normalized input back to the input dtype and
    then multiplies by ``w``; Gemma multiplies by ``1 + w`` in float32 and casts
    the product.
    """

    def __init__(
        self, dim: int, eps: float, unit_offset: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim], same dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``x`` to the residual stream, then normalize: returns (normed, new residual)."""
        residual = residual + x
        return self(residual), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, unit_offset={self.unit_offset}"
