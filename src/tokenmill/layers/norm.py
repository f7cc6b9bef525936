"""RMSNorm with an in-place residual add: Hugging Face's rounding, or a 4-op fast form."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.ops import DEFAULT_OPS, Ops


class RMSNorm(nn.Module):
    """y = x / rms(x) * w (Llama style) or * (1 + w) (Gemma style, ``unit_offset=True``).

    ``exact=True`` in float32 rounds exactly as the Hugging Face counterparts: Llama
    casts the normalized input back to the input dtype and then multiplies by ``w``;
    Gemma multiplies by ``1 + w`` in float32 and casts the product. Otherwise (bfloat16 or
    float16 Llama norms, or ``exact=False``, which quantized models use) the same formula
    runs in 4 ops instead of 8, since per-op cost dominates a decode step; that fast form
    runs as one kernel when ``ops`` has one (Triton on CUDA, native on CPU).
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        unit_offset: bool = False,
        dtype: torch.dtype | None = None,
        exact: bool = True,
        ops: Ops | None = None,
    ) -> None:
        super().__init__()
        kernels = (ops or DEFAULT_OPS).kernels
        self._kernel = kernels.rms_norm
        self._add_kernel = kernels.add_rms_norm
        self.eps = eps
        self.unit_offset = unit_offset
        self.exact = exact
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.eps_sum = dim * eps
        """dim * eps: what ``_fast`` adds to a row's sum of squares (HF's eps on the mean)."""
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
        """x / sqrt(||x||^2 + dim * eps) * (w * sqrt(dim)): HF's x * rsqrt(mean(x^2) + eps)
        * w with the mean's division folded into the weight (a few roundings apart, and 0
        stays 0); the sum of squares accumulates in float32."""
        if self._kernel is not None:  # None back: a layout the kernel does not take
            out = self._kernel(x, self.scaled_weight(), self.eps_sum)
            if out is not None:
                return out
        squares = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_()
        return torch.div(x, squares.add_(self.eps_sum).sqrt_()).mul_(self.scaled_weight())

    def _takes_fast(self, x: torch.Tensor) -> bool:
        """Not HF's exact rounding: ``exact=False``, or a Llama norm below float32."""
        return not self.exact or (x.dtype != torch.float32 and not self.unit_offset)

    def scaled_weight(self) -> torch.Tensor:
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
        if self._add_kernel is not None and self._takes_fast(residual):  # add + norm, one kernel
            fused = self._add_kernel(x, residual, self.scaled_weight(), self.eps_sum)
            if fused is not None:
                return fused
        residual.add_(x)
        return self(residual), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, unit_offset={self.unit_offset}"
