"""LFM2: short-convolution layers and grouped-query attention layers, as ``layer_types``
says ("conv" / "full_attention"); pre-norm, a SwiGLU feed-forward after each.

Attention is the shared layer (``layers/attention.py``: q/k RMSNorm, full rotary); the
conv layers keep their window in a state slot (``layers/recurrent/short_conv.py``). HF
names are mapped at load: ``self_attn.out_proj`` -> ``o_proj``, ``q_layernorm`` ->
``q_norm``, ``feed_forward.w1/w3/w2`` -> ``gate_up_proj`` shards / ``down_proj``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.attention import StepContext
from tokenmill.errors import UnsupportedModelError
from tokenmill.kv_cache.spec import CacheSpec, FullAttention
from tokenmill.layers.attention import Attention, AttentionSpec
from tokenmill.layers.linear import Linear
from tokenmill.layers.mlp import GatedMLP
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.ops import Ops
from tokenmill.layers.recurrent.plan import StatePlan
from tokenmill.layers.recurrent.short_conv import ShortConv
from tokenmill.layers.rotary import RopeTables, RotaryEmbedding
from tokenmill.models.base import CausalLM
from tokenmill.models.config import ArchConfig
from tokenmill.models.trunk import init_trunk
from tokenmill.models.weights import load_weights

CONV, FULL = "conv", "full_attention"
_RENAMES = (
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".q_layernorm.", ".q_norm."),
    (".k_layernorm.", ".k_norm."),
    (".feed_forward.w1.", ".feed_forward.gate_proj."),
    (".feed_forward.w3.", ".feed_forward.up_proj."),
    (".feed_forward.w2.", ".feed_forward.down_proj."),
)


def layer_types(d: dict[str, Any], n: int) -> tuple[str, ...]:
    types = d.get("layer_types")
    if types is None:
        full = set(d.get("full_attn_idxs") or range(n))
        types = [FULL if i in full else CONV for i in range(n)]
    unknown = sorted({str(t) for t in types} - {CONV, FULL})
    if unknown or len(types) != n:
        raise UnsupportedModelError(
            f"layer_types must be {n} entries of {CONV!r} or {FULL!r}; got {list(types)!r}"
        )
    return tuple(map(str, types))


def ffn_size(d: dict[str, Any]) -> int:
    """HF's feed-forward width: 2/3 of intermediate_size, scaled, rounded up to a multiple."""
    size = int(d["intermediate_size"])
    if d.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        if d.get("block_ffn_dim_multiplier") is not None:
            size = int(d["block_ffn_dim_multiplier"] * size)
            multiple = int(d.get("block_multiple_of", 256))
            size = multiple * ((size + multiple - 1) // multiple)
    return size


class Lfm2Layer(nn.Module):
    def __init__(self, cfg: ArchConfig, d: dict[str, Any], kind: str, layer_idx: int,
                 rotary: RotaryEmbedding, ops: Ops, dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.is_conv = kind == CONV
        if self.is_conv:
            kernel, bias = int(d.get("conv_L_cache", 3)), bool(d.get("conv_bias", False))
            channels = int(d.get("conv_channels", hidden))  # a TP rank's share (distributed/)
            self.conv = ShortConv(hidden, kernel, bias, layer_idx, dtype, channels)
        else:
            spec = AttentionSpec(hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 cfg.head_dim**-0.5, qk_norm_eps=eps)  # fmt: skip
            self.self_attn = Attention(spec, layer_idx, rotary, dtype, ops=ops)
        self.feed_forward = GatedMLP(hidden, ffn_size(d), "silu", False, dtype, ops=ops)
        self.operator_norm = RMSNorm(hidden, eps, dtype=dtype, ops=ops)
        self.ffn_norm = RMSNorm(hidden, eps, dtype=dtype, ops=ops)

    def forward(self, rope: RopeTables, hidden: torch.Tensor, ctx: StepContext,
                plan: StatePlan | None) -> torch.Tensor:  # fmt: skip
        normed = self.operator_norm(hidden)
        if self.is_conv:
            assert plan is not None
            hidden = hidden + self.conv(normed, ctx, plan)
        else:
            hidden = hidden + self.self_attn(rope, normed, ctx)
        return hidden + self.feed_forward(self.ffn_norm(hidden), ctx)


class Lfm2ForCausalLM(CausalLM):
    takes_quant_plan = False

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype,
                 max_positions: int | None = None, quant: Any = None,
                 ops: Ops | None = None) -> None:  # fmt: skip
        super().__init__()
        if quant is not None:
            raise UnsupportedModelError("quantized weights are not supported for LFM2 yet")
        d = {"rms_norm_eps": hf_config.get("norm_eps", 1e-5), **hf_config}
        cfg = ArchConfig.from_hf(d)
        self.types = layer_types(d, cfg.num_layers)
        init_trunk(self, cfg, dtype, ops, max_positions)
        self.layers = nn.ModuleList(
            Lfm2Layer(cfg, d, kind, i, self.rotary, self.ops, dtype)
            for i, kind in enumerate(self.types)
        )
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=self.ops)
        tied = cfg.tie_word_embeddings
        self.lm_head = None if tied else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)

    def cache_specs(self) -> list[CacheSpec]:
        full = FullAttention(self.num_kv_heads, self.head_dim, self.dtype)
        layers: list[Lfm2Layer] = list(self.layers)  # type: ignore[arg-type]
        return [layer.conv.state_spec if layer.is_conv else full for layer in layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions)
        plan = StatePlan.of(ctx) if CONV in self.types else None
        for layer in self.layers:
            hidden = layer(rope, hidden, ctx, plan)
        return self.embedding_norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.embed_tokens.logits(hidden).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("lm_head.weight",) if self.lm_head is None else ()
        return load_weights(self, ((_renamed(n), t) for n, t in weights), skip=skip)


def _renamed(name: str) -> str:
    name = name.removeprefix("model.")
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name
