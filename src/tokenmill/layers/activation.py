"""Gated activations over a packed [gate | up] projection, looked up by HF ``hidden_act``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import UnsupportedModelError
from tokenmill.layers.fused import fused_ops

# HF activation name -> elementwise function applied to the gate half.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedActivation(nn.Module):
    """act(gate) * up for x = [gate | up] ([..., 2 * I] -> [..., I])."""

    def __init__(self, name: str) -> None:
        super().__init__()
        if name not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden activation {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
            )
        self.name = name
        self.act = _ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x) if self.act is F.silu else None  # CUDA: one Triton kernel
        out = ops.silu_and_mul(x) if ops else None
        if out is not None:
            return out
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up

    def extra_repr(self) -> str:
        return self.name
