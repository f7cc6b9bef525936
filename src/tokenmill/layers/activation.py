"""Gated activations over a packed [gate | up] projection, looked up by HF ``hidden_act``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import UnsupportedModelError
from tokenmill.layers.ops import DEFAULT_OPS, Ops

# HF activation name -> elementwise function applied to the gate half.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedActivation(nn.Module):
    """act(gate) * up for x = [gate | up] ([..., 2 * I] -> [..., I])."""

    def __init__(self, name: str, ops: Ops | None = None) -> None:
        super().__init__()
        if name not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden activation {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
            )
        self.name = name
        self.act = _ACTIVATIONS[name]
        # One kernel for SiLU (Triton on CUDA); other activations stay PyTorch.
        self._kernel = (ops or DEFAULT_OPS).kernels.silu_and_mul if self.act is F.silu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._kernel(x) if self._kernel is not None else None
        if out is not None:
            return out
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up

    def extra_repr(self) -> str:
        return self.name
