"""The Qwen2-VL / Qwen2.5-VL vision tower: patches [N, C*T*P*P] -> LM embeddings [N / 4, D].

A dynamic-resolution ViT: every image (or video frame group) is a grid of t x h x w
patches with 2-D axial rotary positions; Qwen2.5-VL attends within windows of
``window_size`` pixels except in ``fullatt_block_indexes`` (full attention per frame),
Qwen2-VL attends per frame in every block. The patch merger folds each 2 x 2 block of
neighbouring patches into one language-model token. Parameter names follow HF
(``visual.blocks.N.attn.qkv...``) so loading is a copy (``load_vision_weights``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.multimodal.vision_layout import VisionLayout, vision_layout


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class VisionSpec:
    """What differs between the two generations, read once from ``vision_config``."""

    width: int
    out_dim: int
    depth: int
    num_heads: int
    mlp_hidden: int
    act: str
    gated_mlp: bool
    """Qwen2.5-VL: gate/up/down with biases; Qwen2-VL: fc1 -> act -> fc2."""
    rms_norm: bool
    """Qwen2.5-VL: RMSNorm; Qwen2-VL: LayerNorm (both eps 1e-6)."""
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    rope_theta: float
    window_size: int | None
    """Pixels per attention window side (Qwen2.5-VL); None: full attention per frame."""
    full_attention_blocks: frozenset[int]

    @classmethod
    def from_hf(cls, v: dict[str, Any], generation: int) -> VisionSpec:
        rope = v.get("rope_parameters") or {}
        common: dict[str, Any] = dict(
            depth=int(v["depth"]), num_heads=int(v["num_heads"]),
            patch_size=int(v.get("patch_size", 14)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            merge_size=int(v.get("spatial_merge_size", 2)), in_channels=int(v.get("in_channels", 3)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )  # fmt: skip
        if generation == 2:  # Qwen2-VL: embed_dim wide, hidden_size is the LM's width
            width = int(v.get("embed_dim", 1280))
            return cls(
                width=width, out_dim=int(v["hidden_size"]), mlp_hidden=width * int(v.get("mlp_ratio", 4)),
                act=str(v.get("hidden_act", "quick_gelu")), gated_mlp=False, rms_norm=False,
                window_size=None, full_attention_blocks=frozenset(), **common,
            )  # fmt: skip
        return cls(
            width=int(v["hidden_size"]), out_dim=int(v["out_hidden_size"]),
            mlp_hidden=int(v["intermediate_size"]), act=str(v.get("hidden_act", "silu")),
            gated_mlp=True, rms_norm=True, window_size=int(v.get("window_size", 112)),
            full_attention_blocks=frozenset(v.get("fullatt_block_indexes", ())), **common,
        )  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


class _RMSNorm(nn.Module):
    """HF's Qwen2RMSNorm: float32 statistics, weight times the input-dtype result."""

    def __init__(self, dim: int, dtype: torch.dtype, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _norm(spec: VisionSpec, dtype: torch.dtype) -> nn.Module:
    if spec.rms_norm:
        return _RMSNorm(spec.width, dtype)
    return nn.LayerNorm(spec.width, eps=1e-6, dtype=dtype)


def _linear(i: int, o: int, dtype: torch.dtype, bias: bool = True) -> nn.Linear:
    """Allocated, not initialized (the loader fills it)."""
    device = torch.get_default_device()
    return nn.utils.skip_init(nn.Linear, i, o, bias=bias, dtype=dtype, device=device)


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = ACTIVATIONS[spec.act]
        self.gated = spec.gated_mlp
        if self.gated:
            self.gate_proj = _linear(spec.width, spec.mlp_hidden, dtype)
            self.up_proj = _linear(spec.width, spec.mlp_hidden, dtype)
            self.down_proj = _linear(spec.mlp_hidden, spec.width, dtype)
        else:
            self.fc1 = _linear(spec.width, spec.mlp_hidden, dtype)
            self.fc2 = _linear(spec.mlp_hidden, spec.width, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated in float32 (as HF), back in x's dtype; cos/sin [N, 1, D]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: tuple[int, ...]
) -> torch.Tensor:
    """Bidirectional attention within each segment [bounds[i], bounds[i+1]) of q, k, v
    [N, H, D] -> [N, H, D]. Consecutive segments of one length are one batched SDPA call
    over a view (no gather): a 1024 x 1024 image's ~100 windows take ~20 calls."""
    out = torch.empty_like(q)
    for a, length, count in _runs(bounds):
        b = a + length * count
        # [count * L, H, D] -> [count, H, L, D], 4-D for the CPU flash kernel
        qs, ks, vs = (t[a:b].view(count, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)
        out[a:b] = o.transpose(1, 2).reshape(b - a, *q.shape[1:])
    return out


def _runs(bounds: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Segment bounds -> (start, length, count) of runs of consecutive equal-length segments."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(bounds, bounds[1:]):
        if b == a:
            continue
        if runs and runs[-1][1] == b - a and runs[-1][0] + runs[-1][1] * runs[-1][2] == a:
            start, length, count = runs[-1]
            runs[-1] = (start, length, count + 1)
        else:
            runs.append((a, b - a, 1))
    return runs


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.qkv = _linear(spec.width, 3 * spec.width, dtype)
        self.proj = _linear(spec.width, spec.width, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: tuple[int, ...]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # [N, H, D] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.proj(segment_attention(q, k, v, bounds).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = _norm(spec, dtype)
        self.norm2 = _norm(spec, dtype)
        self.attn = VisionAttention(spec, dtype)
        self.mlp = VisionMLP(spec, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: tuple[int, ...]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2 x 2 patch block [4, width] -> one LM token [out_dim] (norm, MLP with GELU)."""

    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden = spec.width * spec.merge_size**2
        self.ln_q = _norm(spec, dtype)
        self.mlp = nn.Sequential(
            _linear(self.hidden, self.hidden, dtype),
            nn.GELU(),
            _linear(self.hidden, spec.out_dim, dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class PatchEmbed(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = _linear(spec.patch_dim, spec.width, dtype, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels)


class VisionTower(nn.Module):
    """pixel patches [N, patch_dim] of the images in ``grid_thw`` -> [N / merge^2, out_dim],
    images one after another, each in the processor's (merge-block-major) patch order."""

    inv_freq: torch.Tensor  # [head_dim / 4] float32

    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        # The stride = kernel Conv3d of HF is a matmul over the flattened patch.
        self.patch_embed = PatchEmbed(spec, dtype)
        half = spec.head_dim // 2  # axial: h and w each rotate a quarter of the head
        exponent = torch.arange(0, half, 2, dtype=torch.int64).to(torch.float32) / half
        self.register_buffer("inv_freq", 1.0 / spec.rope_theta**exponent, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(spec, dtype) for _ in range(spec.depth))
        self.merger = PatchMerger(spec, dtype)

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        spec = self.spec
        lay = vision_layout(grid_thw, spec.merge_size, spec.window_size, spec.patch_size)
        x = self.patch_embed(pixels.to(self.dtype))  # [N, width]
        cos, sin = self._rope(lay)
        if lay.window_order is not None:  # permute merge-blocks into window order
            x, cos, sin = (self._by_window(t, lay.window_order) for t in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            windowed = lay.window_bounds is not None and i not in spec.full_attention_blocks
            x = block(x, cos, sin, lay.window_bounds if windowed else lay.frame_bounds)
        out = self.merger(x)  # [N / unit, out_dim]
        if lay.window_order is not None:
            out = out[torch.argsort(lay.window_order)]
        return out

    def _rope(self, lay: VisionLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, 1, head_dim]: [h freqs | w freqs] twice, float32 (as HF)."""
        pos = lay.hw_positions.to(self.inv_freq.device)  # [N, 2]
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]
        freqs = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return freqs.cos(), freqs.sin()

    def _by_window(self, t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        unit = self.spec.merge_size**2
        return t.reshape(t.shape[0] // unit, unit, *t.shape[1:])[order].reshape(t.shape)

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        load_visual_weight(self, name, tensor)

    def check_loaded(self, filled: set[str]) -> None:
        check_visual_loaded(self, filled)


def load_visual_weight(tower: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """One checkpoint tensor of a Qwen vision tower (its name under ``visual.``); the
    Conv3d patch kernel is stored flattened."""
    params = dict(tower.named_parameters())
    if name not in params:
        raise ModelLoadError(f"checkpoint tensor 'visual.{name}' has no place in the model")
    dst = params[name]
    src = tensor.reshape(dst.shape) if name == "patch_embed.proj.weight" else tensor
    if src.shape != dst.shape:
        raise ModelLoadError(
            f"'visual.{name}': checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)


def check_visual_loaded(tower: nn.Module, filled: set[str]) -> None:
    missing = sorted(dict(tower.named_parameters()).keys() - filled)
    if missing:
        raise ModelLoadError(f"checkpoint is missing vision weights: {', '.join(missing)}")
