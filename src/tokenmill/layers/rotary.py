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


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to q [T, H, D] and k [T, KVH, D] at ``positions`` [T].

    One instance per distinct RopeConfig is shared by all layers that use it.
    Positions must be < ``max_positions``.
    """

    cos_sin_cache: torch.Tensor  # [max_positions, D] = [cos | sin], model dtype

    def __init__(
        self, head_dim: int, max_positions: int, rope: RopeConfig, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = ROPE_SCALINGS[rope.scaling](rope, head_dim)  # [D/2]
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)  # cos, sin [T, 1, D/2]

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (any mix of q and k heads) -> rotated [T, heads, D]."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return _rotate(x, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * [cos|cos] + rotate_half(x) * [sin|sin], bit-identical to HF's formula."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
