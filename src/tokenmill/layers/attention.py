"""Self-attention over the paged KV cache: packed QKV, optional q/k norm, rotary, o_proj."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill import native
from tokenmill.attention import AttentionMetadata, ForwardContext
from tokenmill.attention.reference import attend
from tokenmill.layers.linear import Linear, PackedLinear
from tokenmill.layers.norm import RMSNorm
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


class Attention(nn.Module):
    """hidden [T, hidden] -> [T, hidden]; writes this layer's K/V into ``ctx.kv_caches[layer_idx]``.

    q, k and v stay in the packed projection output: q/k norms and rotary work in place
    there, so keys and values are stored with one copy straight from it.

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
    ) -> None:
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        qkv_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = PackedLinear(
            spec.hidden_size,
            qkv_sizes,
            spec.qkv_bias,
            dtype,
            linear_method(quant, f"{prefix}.qkv_proj", qkv_sizes, spec.hidden_size),
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
            self.q_norm = RMSNorm(spec.head_dim, spec.qk_norm_eps, offset, dtype, exact)
            self.k_norm = RMSNorm(spec.head_dim, spec.qk_norm_eps, offset, dtype, exact)
        # Quantized models are not bit-exact with HF anyway: there the float32 steps around
        # the matmuls may run as native kernels (rotary + K/V store, decode attention).
        self.native_steps = quant is not None and spec.softcap is None

    def forward(self, rope: RopeTables, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        spec, tokens = self.spec, hidden.shape[0]
        heads = spec.num_heads + spec.num_kv_heads
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 KVH) * D]
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, heads, spec.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # normalized in place
            q, k = qk.split([spec.num_heads, spec.num_kv_heads], dim=1)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        kv_cache, meta = ctx.kv_caches[self.layer_idx], ctx.attn
        if self.native_steps and native.takes(qkv, kv_cache, rope.cos):
            return self.o_proj(self._native(qkv, rope, kv_cache, meta))
        self.rotary_emb.rotate_(qk, rope)  # q and k heads in one pass, in place
        kv = qkv[:, self.q_size :].view(tokens, 2, spec.num_kv_heads, spec.head_dim)
        out = ctx.backend.forward(
            qk[:, : spec.num_heads],
            kv,
            kv_cache,
            meta,
            spec.scale,
            spec.sliding_window,
            spec.softcap,
        )  # [T, H, D]
        return self.o_proj(out.reshape(tokens, self.q_size))

    def _native(
        self, qkv: torch.Tensor, rope: RopeTables, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Rotary + K/V store in one call; decode attention in one call (prefill: PyTorch)."""
        spec, tokens = self.spec, qkv.shape[0]
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        native.rope_store_kv(qkv, h, kvh, d, rope.cos, rope.sin, kv_cache, meta.slot_mapping)
        if meta.is_all_decode:
            return native.decode_attention(
                qkv, h, kvh, d, kv_cache, meta.block_tables, meta.seq_lens_tensor,
                max(meta.seq_lens), spec.scale, spec.sliding_window,
            )  # fmt: skip
        q = qkv[:, : self.q_size].view(tokens, h, d)
        kv = qkv[:, self.q_size :].view(tokens, 2, kvh, d)
        out = attend(q, kv, kv_cache, meta, spec.scale, spec.sliding_window, spec.softcap)
        return out.reshape(tokens, self.q_size)
