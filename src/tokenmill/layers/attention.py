"""Self-attention over the paged KV cache: packed QKV, optional q/k norm, rotary, o_proj."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention import AttentionParams, StepContext
from tokenmill.attention.backends import AttentionBackend, AttentionImpl
from tokenmill.layers.linear import Linear, PackedLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.ops import DEFAULT_OPS, Ops
from tokenmill.layers.rotary import RopeTables, RotaryEmbedding
from tokenmill.quant.plan import QuantPlan, linear_method


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
    input_size: int | None = None
    """Width of the q/k/v projections' input when it is not ``hidden_size`` (an EAGLE-3
    head attends over [embedding | feature], 2 x hidden)."""


class Attention(nn.Module):
    """hidden [T, hidden] -> [T, hidden]; writes this layer's K/V into ``ctx.kv_caches[layer_idx]``.

    q, k and v stay in the packed projection output: q/k norms and rotary work in place
    there, so keys and values are stored with one copy straight from it. The attention
    constants are bound to the backend of ``ops`` when the layer is built; a step context
    that brings another backend (a test comparing two on one model) is bound once too.

    HF q_proj/k_proj/v_proj load into qkv_proj shards 0/1/2.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        layer_idx: int,
        rotary: RotaryEmbedding,
        dtype: torch.dtype | None = None,
        quant: QuantPlan | None = None,
        prefix: str = "",
        ops: Ops | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        qkv_sizes = [self.q_size, self.kv_size, self.kv_size]
        in_size = spec.input_size or spec.hidden_size
        self.qkv_proj = PackedLinear(
            in_size,
            qkv_sizes,
            spec.qkv_bias,
            dtype,
            linear_method(quant, f"{prefix}.qkv_proj", qkv_sizes, in_size),
        )
        self.o_proj = Linear(
            self.q_size,
            spec.hidden_size,
            spec.o_bias,
            dtype,
            linear_method(quant, f"{prefix}.o_proj", [spec.hidden_size], self.q_size),
        )
        self.rotary_emb = rotary
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm_eps is not None:
            offset = spec.qk_norm_unit_offset
            exact = quant is None  # HF's rounding for dense models; fast once quantized
            self.q_norm = RMSNorm(spec.head_dim, spec.qk_norm_eps, offset, dtype, exact, ops)
            self.k_norm = RMSNorm(spec.head_dim, spec.qk_norm_eps, offset, dtype, exact, ops)
        self.params = AttentionParams(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale,
            spec.sliding_window, spec.softcap,
        )  # fmt: skip
        self._bind((ops or DEFAULT_OPS).backend)

    def _bind(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.impl: AttentionImpl = backend.bind(self.params)
        """The backend bound to this layer's constants: ``forward(q, kv, cache, meta)``, or
        ``forward_packed(qkv, rope, cache, meta)`` when it applies rotary itself."""

    def forward(self, rope: RopeTables, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        spec, tokens = self.spec, hidden.shape[0]
        heads = spec.num_heads + spec.num_kv_heads
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 KVH) * D]
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, heads, spec.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # normalized in place
            q, k = qk.split([spec.num_heads, spec.num_kv_heads], dim=1)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if ctx.backend is not None and ctx.backend is not self.backend:
            self._bind(ctx.backend)
        kv_cache, meta = ctx.kv_caches[self.layer_idx], ctx.attn
        assert kv_cache is not None, f"layer {self.layer_idx} has no paged cache"
        if self.impl.rotates:  # rotary fused with the K/V store
            return self.o_proj(self.impl.forward_packed(qkv, rope, kv_cache, meta))
        self.rotary_emb.rotate_(qk, rope)  # q and k heads in one pass, in place
        kv = qkv[:, self.q_size :].view(tokens, 2, spec.num_kv_heads, spec.head_dim)
        out = self.impl.forward(qk[:, : spec.num_heads], kv, kv_cache, meta)  # [T, H, D]
        return self.o_proj(out.reshape(tokens, self.q_size))
