"""Rotary position embedding (neox / rotate-half layout, as Hugging Face applies it).

cos/sin are precomputed once for every position up to ``max_positions``, in
float32 exactly as HF computes them per step, then cast to the model dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.layers.ops import DEFAULT_OPS, Ops


@dataclass(frozen=True)
class RopeConfig:
    """Rotary parameters of one attention layer type."""

    theta: float = 10000.0
    """Base of the inverse frequencies (HF ``rope_theta``)."""
    scaling: str = "default"
    """Frequency scaling type: one of ``ROPE_SCALINGS`` (HF ``rope_type``)."""
    factor: float = 1.0
    """Context extension factor (linear, llama3)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max / low_freq_factor are divided by ``factor``."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """llama3: the pretraining context length."""


def _base_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """[dim / 2] float32, as HF: 1 / theta ** (arange(0, dim, 2) / dim)."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (rope.theta**exponent)


def _linear_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    return _base_inv_freq(rope, dim) / rope.factor


def _llama3_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    inv_freq = _base_inv_freq(rope, dim)
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


# HF rope_type -> inverse frequencies [dim / 2] float32.
ROPE_SCALINGS: dict[str, Callable[[RopeConfig, int], torch.Tensor]] = {
    "default": _base_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
}


@dataclass(frozen=True)
class RopeTables:
    """cos/sin rows of one step's positions, gathered once and shared by every layer."""

    cos: torch.Tensor
    """[T, 1, D] = [cos | cos]."""
    sin: torch.Tensor
    """[T, 1, D] = [-sin | sin]: rotate_half's sign folded in."""


class RotaryEmbedding(nn.Module):
    """Rotates q [T, H, D] and k [T, KVH, D] at the step's positions (``tables``).

    One instance per distinct RopeConfig is shared by all layers that use it; the
    model gathers its ``tables`` once per step. Positions must be < ``max_positions``.
    """

    cos_cache: torch.Tensor  # [max_positions, D] = [cos | cos], model dtype
    sin_cache: torch.Tensor  # [max_positions, D] = [-sin | sin], model dtype

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope: RopeConfig,
        dtype: torch.dtype,
        ops: Ops | None = None,
    ) -> None:
        super().__init__()
        self._kernel = (ops or DEFAULT_OPS).kernels.rotate_
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = ROPE_SCALINGS[rope.scaling](rope, head_dim)  # [D/2]
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)  # rounded as HF rounds them
        self.register_buffer("cos_cache", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_cache", torch.cat((-sin, sin), dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor) -> RopeTables:
        """positions [T] -> the cos/sin rows every layer of this step uses."""
        return RopeTables(
            self.cos_cache.index_select(0, positions).unsqueeze(1),
            self.sin_cache.index_select(0, positions).unsqueeze(1),
        )

    def rotate_(self, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """Rotate x [T, heads, D] (any mix of q and k heads, may be a view) in place.

        x * [cos|cos] + [x2|x1] * [-sin|sin]: each product and the sum rounded once, in
        x's dtype, bit-identical to HF's ``x * cos + rotate_half(x) * sin``.
        """
        kernel = self._kernel  # Triton on CUDA: one kernel, the same roundings
        if kernel is not None and kernel(x, tables.cos, tables.sin) is not None:
            return x
        t, heads, d = x.shape
        swapped = x.reshape(t, heads, 2, d // 2).flip(2).view(t, heads, d)  # a copy
        return x.mul_(tables.cos).add_(swapped.mul_(tables.sin))

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}"
