"""RMSNorm with an in-place residual add: Hugging Face's rounding, or a 4-op fast form."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import native
from tokenmill.layers.fused import fused_ops


class RMSNorm(nn.Module):
    """y = x / rms(x) * w (Llama style) or * (1 + w) (Gemma style, ``unit_offset=True``).

    ``exact=True`` in float32 rounds exactly as the Hugging Face counterparts: Llama
    casts the normalized input back to the input dtype and then multiplies by ``w``;
    Gemma multiplies by ``1 + w`` in float32 and casts the product. Otherwise (bfloat16 or
    float16 Llama norms, or ``exact=False``, which quantized models use) the same formula
    runs in 4 ops instead of 8, since per-op cost dominates a decode step.
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        unit_offset: bool = False,
        dtype: torch.dtype | None = None,
        exact: bool = True,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.exact = exact
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self._min_norm = (dim * eps) ** 0.5
        self._scaled: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim], same dtype."""
        if self._takes_fast(x):
            return self._fast(x)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def _fast(self, x: torch.Tensor) -> torch.Tensor:
        """x / max(||x||, sqrt(dim * eps)) * (w * sqrt(dim)): HF's x * rsqrt(mean(x^2) + eps)
        * w except that eps only guards tiny rows (far below bfloat16 resolution for real
        hidden states, and 0 stays 0); the norm accumulates in float32, one rounding."""
        ops = fused_ops(x)  # CUDA: one Triton kernel (None: a layout it does not take)
        out = ops.rms_norm(x, self._scaled_weight(), self._min_norm) if ops else None
        if out is not None:
            return out
        if self._native(x):
            return native.add_rms_norm(None, x, self._scaled_weight(), self._min_norm)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(self._min_norm)
        return torch.div(x, norm).mul_(self._scaled_weight())

    def _takes_fast(self, x: torch.Tensor) -> bool:
        """Not HF's exact rounding: ``exact=False``, or a Llama norm below float32."""
        return not self.exact or (x.dtype != torch.float32 and not self.unit_offset)

    def _native(self, x: torch.Tensor) -> bool:
        """Rows of float32 in one native call (quantized models: ``exact=False``)."""
        return not self.exact and x.dim() == 2 and x.is_contiguous() and native.takes(x)

    def _scaled_weight(self) -> torch.Tensor:
        """(w or 1 + w) * sqrt(dim) in float32, recomputed whenever the weight was written."""
        version = (self.weight.data_ptr(), self.weight._version)
        if self._scaled is None or self._scaled[0] != version:
            w = self.weight.float() + (1.0 if self.unit_offset else 0.0)
            self._scaled = (version, w * self.weight.shape[0] ** 0.5)
        return self._scaled[1]

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``x`` to the residual stream (in place), then normalize: (normed, residual)."""
        ops = fused_ops(residual) if self._takes_fast(residual) else None
        if ops is not None:  # CUDA: add and norm in one Triton kernel
            fused = ops.add_rms_norm(x, residual, self._scaled_weight(), self._min_norm)
            if fused is not None:
                return fused
        if self._native(residual) and x.shape == residual.shape and native.takes(x):
            normed = native.add_rms_norm(x, residual, self._scaled_weight(), self._min_norm)
            return normed, residual
        residual.add_(x)
        return self(residual), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, unit_offset={self.unit_offset}"
