"""The SmolVLM / Idefics3 vision side: a SigLIP tower over square tiles and the connector.

tiles [n, 3, S, S] (with a pixel mask [n, S, S]: the global view of a non-square image is
padded) -> patches [n, (S/P)^2, width] -> pixel shuffle (each r x r block of patch
features becomes one vector) -> one linear -> [n, (S/P)^2 / r^2, LM hidden]. Patch
positions are bucketed NaViT-style from the valid patch count, padded patches are masked
as keys. Parameter names follow HF (``vision_model.encoder.layers.N...``,
``connector.modality_projection.proj``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.models.qwen2_vl_vision import ACTIVATIONS, _linear


@dataclass(frozen=True)
class SiglipSpec:
    width: int
    depth: int
    num_heads: int
    mlp_hidden: int
    act: str
    eps: float
    image_size: int
    patch_size: int
    scale_factor: int
    out_dim: int

    @classmethod
    def from_hf(cls, hf: dict[str, Any], out_dim: int) -> SiglipSpec:
        v = hf.get("vision_config") or {}
        return cls(
            width=int(v.get("hidden_size", 1152)), depth=int(v.get("num_hidden_layers", 27)),
            num_heads=int(v.get("num_attention_heads", 16)),
            mlp_hidden=int(v.get("intermediate_size", 3072)),
            act=str(v.get("hidden_act", "gelu_pytorch_tanh")), eps=float(v.get("layer_norm_eps", 1e-6)),
            image_size=int(v.get("image_size", 224)), patch_size=int(v.get("patch_size", 32)),
            scale_factor=int(hf.get("scale_factor", 2)), out_dim=out_dim,
        )  # fmt: skip

    @property
    def per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        return self.per_side**2 // self.scale_factor**2


def _norm(spec: SiglipSpec, dtype: torch.dtype) -> nn.LayerNorm:
    return nn.LayerNorm(spec.width, eps=spec.eps, dtype=dtype)


class SiglipAttention(nn.Module):
    def __init__(self, spec: SiglipSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = spec.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            _linear(spec.width, spec.width, dtype) for _ in range(4)
        )

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        n, length, width = x.shape
        q, k, v = (p(x).view(n, length, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)  # [n, H, L, D]
        return self.out_proj(out.transpose(1, 2).reshape(n, length, width))


class SiglipMLP(nn.Module):
    def __init__(self, spec: SiglipSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = ACTIVATIONS[spec.act]
        self.fc1 = _linear(spec.width, spec.mlp_hidden, dtype)
        self.fc2 = _linear(spec.mlp_hidden, spec.width, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipLayer(nn.Module):
    def __init__(self, spec: SiglipSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = _norm(spec, dtype)
        self.self_attn = SiglipAttention(spec, dtype)
        self.layer_norm2 = _norm(spec, dtype)
        self.mlp = SiglipMLP(spec, dtype)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, spec: SiglipSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        # HF's stride = kernel Conv2d as a matmul over each flattened (C, P, P) patch
        self.patch_embedding = _linear(3 * spec.patch_size**2, spec.width, dtype)
        self.position_embedding = nn.Embedding(spec.per_side**2, spec.width, dtype=dtype)

    def forward(self, tiles: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """tiles [n, 3, S, S], patch_mask [n, S/P, S/P] -> [n, (S/P)^2, width]."""
        n, c, s, _ = tiles.shape
        p, g = self.spec.patch_size, s // self.spec.patch_size
        patches = (
            tiles.reshape(n, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, c * p * p)
        )
        return self.patch_embedding(patches) + self.position_embedding(self._positions(patch_mask))

    def _positions(self, mask: torch.Tensor) -> torch.Tensor:
        """NaViT bucketing of the valid patches' fractional coordinates, as HF computes it."""
        side = self.spec.per_side
        n, gh, gw = mask.shape
        bounds = torch.arange(1 / side, 1.0, 1 / side, device=mask.device)
        step_h = 1.0 / mask[:, :, 0].sum(dim=1)
        step_w = 1.0 / mask[:, 0, :].sum(dim=1)
        fh = torch.clamp(
            torch.arange(gh, device=mask.device, dtype=torch.float32)[None] * step_h[:, None],
            max=1 - 1e-6,
        )
        fw = torch.clamp(
            torch.arange(gw, device=mask.device, dtype=torch.float32)[None] * step_w[:, None],
            max=1 - 1e-6,
        )
        bh, bw = torch.bucketize(fh, bounds, right=True), torch.bucketize(fw, bounds, right=True)
        pos = (bh[:, :, None] * side + bw[:, None, :]).reshape(n, -1)
        return torch.where(mask.reshape(n, -1), pos, torch.zeros_like(pos))


class SiglipTower(nn.Module):
    """tiles [n, 3, S, S] + pixel masks [n, S, S] -> patch features [n, (S/P)^2, width]."""

    def __init__(self, spec: SiglipSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.embeddings = _Embeddings(spec, dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipLayer(spec, dtype) for _ in range(spec.depth))
        self.post_layernorm = _norm(spec, dtype)

    def forward(self, tiles: torch.Tensor, pixel_mask: torch.Tensor) -> torch.Tensor:
        p = self.spec.patch_size
        n, s, _ = pixel_mask.shape
        patch_mask = pixel_mask.reshape(n, s // p, p, s // p, p).sum(dim=(2, 4)) > 0
        x = self.embeddings(tiles, patch_mask)
        flat = patch_mask.reshape(n, 1, 1, -1)  # keys of padded patches are masked
        key_mask = None if bool(flat.all()) else flat
        layers: list[SiglipLayer] = list(self.encoder.layers)  # type: ignore[arg-type]
        for layer in layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)


class Connector(nn.Module):
    """Pixel shuffle (r x r neighbouring patches -> one vector), then a linear to the LM."""

    def __init__(self, spec: SiglipSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.r = spec.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = _linear(
            spec.width * self.r**2, spec.out_dim, dtype, bias=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, d = x.shape
        side, r = int(seq**0.5), self.r
        # HF's pixel_shuffle, step for step: [n, h, w, d] -> [n, h/r * w/r, d * r^2]
        x = x.view(n, side, side // r, d * r).permute(0, 2, 1, 3)
        x = x.reshape(n, side // r, side // r, d * r * r).permute(0, 2, 1, 3)
        x = x.reshape(n, seq // r**2, d * r * r)
        proj: nn.Linear = self.modality_projection.proj  # type: ignore[assignment]
        return proj(x)


def load_vision_weight(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """One tensor under the module's names; the patch Conv2d kernel flattens."""
    params = dict(module.named_parameters())
    if name not in params:
        raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the vision model")
    dst = params[name]
    src = tensor.reshape(dst.shape) if name.endswith("patch_embedding.weight") else tensor
    if src.shape != dst.shape:
        raise ModelLoadError(
            f"{name!r}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)
