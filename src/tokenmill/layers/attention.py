"""Self-attention over the paged KV cache: packed QKV, optional q/k norm, rotary, o_proj."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention import ForwardContext, paged_attention
from tokenmill.layers.linear import Linear, PackedLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class AttentionSpec:
    """Shape and switches of one attention layer."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    """Multiplier of q.k (usually head_dim ** -0.5)."""
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm_eps: float | None = None
    """When set, RMSNorm over head_dim is applied to q and k before rotary (Qwen3, Gemma3)."""
    qk_norm_unit_offset: bool = False
    """Gemma-style (1 + w) q/k norms."""
    sliding_window: int | None = None
    softcap: float | None = None
    """tanh soft-capping of attention scores."""


class Attention(nn.Module):
    """hidden [T, hidden] -> [T, hidden]; writes this layer's K/V into ``ctx.kv_caches[layer_idx]``.

    HF q_proj/k_proj/v_proj load into qkv_proj shards 0/1/2.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        layer_idx: int,
        rotary: RotaryEmbedding,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = PackedLinear(
            spec.hidden_size, [self.q_size, self.kv_size, self.kv_size], spec.qkv_bias, dtype
        )
        self.o_proj = Linear(self.q_size, spec.hidden_size, spec.o_bias, dtype)
        self.rotary_emb = rotary
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm_eps is not None:
            offset = spec.qk_norm_unit_offset
            self.q_norm = RMSNorm(spec.head_dim, spec.qk_norm_eps, offset, dtype)
            self.k_norm = RMSNorm(spec.head_dim, spec.qk_norm_eps, offset, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        spec, tokens = self.spec, hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 KVH) * D]
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, spec.num_kv_heads, spec.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(tokens, spec.num_heads, spec.head_dim))
            k = self.k_norm(k.view(tokens, spec.num_kv_heads, spec.head_dim))
            q, k = self.rotary_emb(positions, q, k)
        else:  # rotate q and k heads together: one pass instead of two
            heads = spec.num_heads + spec.num_kv_heads
            qk = self.rotary_emb.rotate(positions, qkv[:, : self.q_size + self.kv_size].view(tokens, heads, spec.head_dim))
            q, k = qk.split([spec.num_heads, spec.num_kv_heads], dim=1)
        out = paged_attention(
            q,
            k,
            v,
            ctx.kv_caches[self.layer_idx],
            ctx.attn,
            spec.scale,
            spec.sliding_window,
            spec.softcap,
        )  # [T, H, D]
        return self.o_proj(out.reshape(tokens, self.q_size))
