"""Falcon-H1: every layer runs attention and a Mamba2 mixer side by side on the same
normed input and adds both to the residual, then a SwiGLU feed-forward.

Each layer has two caches, so the model declares 2N cache specs: entries 0..N-1 are the
attention layers' paged K/V, N..2N-1 the mixers' state slots (layer i's mixer reads
``ctx.kv_caches[N + i]``). Falcon-H1's muP multipliers are folded into the weights as
they load (q/k/v/o, the feed-forward's gate and down, the mixer's in/out projections);
only the embedding and logits multipliers stay as runtime scales.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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
from tokenmill.layers.recurrent.mamba2 import (
    GroupedGatedRMSNorm,
    Mamba2Mixer,
    Mamba2Shape,
    SiluGate,
)
from tokenmill.layers.recurrent.plan import StatePlan
from tokenmill.layers.rotary import RopeTables, RotaryEmbedding
from tokenmill.models.base import CausalLM
from tokenmill.models.config import ArchConfig
from tokenmill.models.trunk import init_trunk
from tokenmill.models.weights import load_weights


def mixer_shape(d: dict[str, Any], cfg: ArchConfig) -> Mamba2Shape:
    inner = int(d.get("mamba_d_ssm") or d.get("mamba_expand", 2) * cfg.hidden_size)
    heads = int(d.get("mamba_n_heads", 128))
    head_dim = d.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    limit = d.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Shape(
        hidden_size=cfg.hidden_size, num_heads=heads, head_dim=head_dim,
        state_size=int(d.get("mamba_d_state", 256)), n_groups=int(d.get("mamba_n_groups", 1)),
        conv_kernel=int(d.get("mamba_d_conv", 4)), conv_bias=bool(d.get("mamba_conv_bias", True)),
        bias=bool(d.get("mamba_proj_bias", False)), eps=cfg.rms_norm_eps,
        dt_limit=(float(limit[0]), float(limit[1])),
        out_bias=bool(d.get("projectors_bias", False)),
    )  # fmt: skip


def weight_scales(d: dict[str, Any], shape: Mamba2Shape) -> dict[str, float | torch.Tensor]:
    """HF name suffix -> the multiplier folded into that tensor (weights [out, in] scale by
    rows; a [out] vector multiplier applies per row)."""
    attn_in, key = float(d.get("attention_in_multiplier", 1.0)), float(d.get("key_multiplier", 1.0))
    attn_out = float(d.get("attention_out_multiplier", 1.0))
    gate, down = (float(m) for m in d.get("mlp_multipliers") or (1.0, 1.0))
    ssm_in, ssm_out = (
        float(d.get("ssm_in_multiplier", 1.0)),
        float(d.get("ssm_out_multiplier", 1.0)),
    )
    z, x, b, c, dt = (float(m) for m in d.get("ssm_multipliers") or (1.0,) * 5)
    groups = shape.n_groups * shape.state_size
    sizes = (shape.inner, shape.inner, groups, groups, shape.num_heads)  # in_proj rows: z|x|B|C|dt
    mup = torch.cat([torch.full((n,), m) for n, m in zip(sizes, (z, x, b, c, dt))])
    return {
        "self_attn.q_proj.weight": attn_in,
        "self_attn.k_proj.weight": attn_in * key,
        "self_attn.k_proj.bias": key,
        "self_attn.v_proj.weight": attn_in,
        "self_attn.o_proj.weight": attn_out,
        "self_attn.o_proj.bias": attn_out,
        "feed_forward.gate_proj.weight": gate,
        "feed_forward.gate_proj.bias": gate,
        "feed_forward.down_proj.weight": down,
        "feed_forward.down_proj.bias": down,
        "mamba.in_proj.weight": mup[:, None] * ssm_in,
        "mamba.in_proj.bias": mup,
        "mamba.out_proj.weight": ssm_out,
        "mamba.out_proj.bias": ssm_out,
    }


class FalconH1Layer(nn.Module):
    def __init__(self, cfg: ArchConfig, d: dict[str, Any], shape: Mamba2Shape, layer_idx: int,
                 rotary: RotaryEmbedding, ops: Ops, dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        hidden, eps, bias = cfg.hidden_size, cfg.rms_norm_eps, cfg.attention_bias
        spec = AttentionSpec(hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.head_dim**-0.5, qkv_bias=bias, o_bias=bias)  # fmt: skip
        self.self_attn = Attention(spec, layer_idx, rotary, dtype, ops=ops)
        if d.get("mamba_rms_norm", False):
            gate_first = not d.get("mamba_norm_before_gate", True)
            norm: nn.Module = GroupedGatedRMSNorm(
                shape.inner, shape.n_groups, eps, dtype, gate_first
            )
        else:
            norm = SiluGate()
        self.mamba = Mamba2Mixer(shape, cfg.num_layers + layer_idx, dtype, norm, ops.scan)
        self.feed_forward = GatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias,
                                     dtype, ops=ops)  # fmt: skip
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype, ops=ops)
        self.pre_ff_layernorm = RMSNorm(hidden, eps, dtype=dtype, ops=ops)

    def forward(self, rope: RopeTables, hidden: torch.Tensor, ctx: StepContext,
                plan: StatePlan) -> torch.Tensor:  # fmt: skip
        normed = self.input_layernorm(hidden)
        hidden = hidden + (self.mamba(normed, ctx, plan) + self.self_attn(rope, normed, ctx))
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden), ctx)


class FalconH1ForCausalLM(CausalLM):
    takes_quant_plan = False

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype,
                 max_positions: int | None = None, quant: Any = None,
                 ops: Ops | None = None) -> None:  # fmt: skip
        super().__init__()
        if quant is not None:
            raise UnsupportedModelError("quantized weights are not supported for Falcon-H1 yet")
        cfg = ArchConfig.from_hf({"tie_word_embeddings": False, **hf_config})
        shape = mixer_shape(hf_config, cfg)
        self.scales = weight_scales(hf_config, shape)
        self.embedding_multiplier = float(hf_config.get("embedding_multiplier", 1.0))
        self.lm_head_multiplier = float(hf_config.get("lm_head_multiplier", 1.0))
        init_trunk(self, cfg, dtype, ops, max_positions)
        self.layers = nn.ModuleList(
            FalconH1Layer(cfg, hf_config, shape, i, self.rotary, self.ops, dtype)
            for i in range(cfg.num_layers)
        )
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=self.ops)
        tied = cfg.tie_word_embeddings
        self.lm_head = None if tied else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)

    def cache_specs(self) -> list[CacheSpec]:
        """N attention entries (paged K/V), then N mixer entries (state slots)."""
        full = FullAttention(self.num_kv_heads, self.head_dim, self.dtype)
        layers: list[FalconH1Layer] = list(self.layers)  # type: ignore[arg-type]
        specs: list[CacheSpec] = [full] * self.num_layers
        return specs + [layer.mamba.state_spec for layer in layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        rope, plan = self.rotary.tables(positions), StatePlan.of(ctx)
        for layer in self.layers:
            hidden = layer(rope, hidden, ctx, plan)
        return self.final_layernorm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            logits = self.embed_tokens.logits(hidden).float()
        else:
            logits = self.lm_head(hidden).float()
        return logits * self.lm_head_multiplier if self.lm_head_multiplier != 1.0 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("lm_head.weight",) if self.lm_head is None else ()
        return load_weights(self, self._scaled(weights), skip=skip)

    def _scaled(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.removeprefix("model.")
            scale = self.scales.get(name.split(".", 2)[-1]) if name.startswith("layers.") else None
            if scale is not None and not (isinstance(scale, float) and scale == 1.0):
                tensor = tensor * (
                    scale.to(tensor.dtype) if isinstance(scale, torch.Tensor) else scale
                )
            yield name, tensor
