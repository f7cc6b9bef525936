"""The Qwen3-VL vision tower: patches [N, C*T*P*P] -> LM embeddings [N / 4, D] plus its
DeepStack features [N / 4, L, D].

Against Qwen2.5-VL's (``qwen2_vl_vision.py``, whose attention, rotary and layout it
reuses): a patch embedding with a bias; a learned square table of positions resampled to
each image's grid (bilinear, corners aligned: transformers' interpolation taps, summed in
its order) added to the patch embeddings; LayerNorm / gelu-tanh blocks with full attention
per frame (no windows); the patch merger; and one more merger (normalizing the 2 x 2 block
after the shuffle) after each block of ``deepstack_visual_indexes``, whose outputs the
decoder adds to its first layers' hidden states (``qwen3_vl.py``). HF names
(``visual.blocks.N.mlp.linear_fc1``, ``visual.deepstack_merger_list.K...``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.models.qwen2_vl_vision import (
    ACTIVATIONS,
    VisionAttention,
    VisionSpec,
    _linear,
    check_visual_loaded,
    load_visual_weight,
)
from tokenmill.multimodal.vision_layout import frame_bounds, hw_positions


def vision_spec(v: dict[str, Any]) -> VisionSpec:
    """Qwen3-VL's ``vision_config`` in the Qwen-VL tower's terms (no windows)."""
    rope = v.get("rope_parameters") or {}
    return VisionSpec(
        width=int(v.get("hidden_size", 1152)), out_dim=int(v.get("out_hidden_size", 3584)),
        depth=int(v.get("depth", 27)), num_heads=int(v.get("num_heads", 16)),
        mlp_hidden=int(v.get("intermediate_size", 4304)),
        act=str(v.get("hidden_act", "gelu_pytorch_tanh")), gated_mlp=False, rms_norm=False,
        patch_size=int(v.get("patch_size", 16)), temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        merge_size=int(v.get("spatial_merge_size", 2)), in_channels=int(v.get("in_channels", 3)),
        rope_theta=float(rope.get("rope_theta", 10000.0)), window_size=None,
        full_attention_blocks=frozenset(),
    )  # fmt: skip


def _layer_norm(dim: int, dtype: torch.dtype) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=1e-6, dtype=dtype)


class _MLP(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = ACTIVATIONS[spec.act]
        self.linear_fc1 = _linear(spec.width, spec.mlp_hidden, dtype)
        self.linear_fc2 = _linear(spec.mlp_hidden, spec.width, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = _layer_norm(spec.width, dtype)
        self.norm2 = _layer_norm(spec.width, dtype)
        self.attn = VisionAttention(spec, dtype)
        self.mlp = _MLP(spec, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: tuple[int, ...]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """Each 2 x 2 patch block -> one LM token: LayerNorm per patch (or, after the shuffle,
    over the block: DeepStack's), fc1, GELU, fc2."""

    def __init__(self, spec: VisionSpec, dtype: torch.dtype, postshuffle: bool) -> None:
        super().__init__()
        self.hidden = spec.width * spec.merge_size**2
        self.postshuffle = postshuffle
        self.norm = _layer_norm(self.hidden if postshuffle else spec.width, dtype)
        self.linear_fc1 = _linear(self.hidden, self.hidden, dtype)
        self.act = nn.GELU()
        self.linear_fc2 = _linear(self.hidden, spec.out_dim, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden)) if self.postshuffle else self.norm(x)
        return self.linear_fc2(self.act(self.linear_fc1(x.view(-1, self.hidden))))


class Qwen3VisionTower(nn.Module):
    """pixel patches [N, patch_dim] of the images in ``grid_thw`` (merge-block-major) ->
    (tokens [N / 4, out_dim], DeepStack features [N / 4, L, out_dim])."""

    inv_freq: torch.Tensor  # [head_dim / 4] float32

    def __init__(self, spec: VisionSpec, num_positions: int, deepstack: tuple[int, ...],
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        self.side = int(num_positions**0.5)
        self.deepstack = deepstack
        self.patch_embed = nn.Module()
        self.patch_embed.proj = _linear(spec.patch_dim, spec.width, dtype)  # HF's Conv3d
        self.pos_embed = nn.utils.skip_init(
            nn.Embedding, num_positions, spec.width, dtype=dtype, device=torch.get_default_device()
        )
        half = spec.head_dim // 2  # axial: h and w each rotate a quarter of the head
        exponent = torch.arange(0, half, 2, dtype=torch.int64).to(torch.float32) / half
        self.register_buffer("inv_freq", 1.0 / spec.rope_theta**exponent, persistent=False)
        self.blocks = nn.ModuleList(_Block(spec, dtype) for _ in range(spec.depth))
        self.merger = Merger(spec, dtype, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            Merger(spec, dtype, postshuffle=True) for _ in deepstack
        )

    def forward(
        self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pos = hw_positions(grid_thw, self.spec.merge_size).to(self.inv_freq.device)  # [N, 2]
        proj: nn.Linear = self.patch_embed.proj  # type: ignore[assignment]
        x = proj(pixels.to(self.dtype)) + self._learned(pos, grid_thw)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]
        freqs = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = freqs.cos(), freqs.sin()
        bounds = frame_bounds(grid_thw)
        stack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, bounds)
            if i in self.deepstack:
                stack.append(self.deepstack_merger_list[self.deepstack.index(i)](x))
        out = self.merger(x)
        return out, torch.stack(stack, dim=1) if stack else out[:, None, :0]

    def _learned(self, pos: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """[N, width]: the position table resampled bilinearly (corners aligned) to each
        patch's (row, col) of its frame's h x w grid; taps (h0 w0, h0 w1, h1 w0, h1 w1)."""
        sizes = torch.tensor([(h, w) for t, h, w in grid_thw for _ in range(t * h * w)],
                             device=pos.device)  # fmt: skip
        taps, weights = [], []
        for axis in (0, 1):
            src = pos[:, axis].float() * (self.side - 1) / (sizes[:, axis] - 1).clamp(min=1)
            floor = src.floor()
            offsets = torch.arange(2, device=pos.device)
            taps.append((floor.long()[:, None] + offsets).clamp(0, self.side - 1))
            weights.append((1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0))
        index = (taps[0][:, :, None] * self.side + taps[1][:, None, :]).reshape(-1, 4)
        weight = (weights[0][:, :, None] * weights[1][:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weight[:, :, None]).sum(1).to(self.dtype)

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        load_visual_weight(self, name, tensor)

    def check_loaded(self, filled: set[str]) -> None:
        check_visual_loaded(self, filled)
