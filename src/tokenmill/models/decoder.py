"""The one pre-norm decoder every supported family is built from, switched by flags.

Module and parameter names follow Hugging Face (``model.layers.N.self_attn...``)
except where projections are packed (``qkv_proj``, ``gate_up_proj``; see
``weights.PACKED_MODULES``), so loading is a rename plus a shard copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tokenmill.attention import StepContext
from tokenmill.kv_cache.spec import CacheSpec, FullAttention, SlidingWindow
from tokenmill.layers.attention import Attention, AttentionSpec
from tokenmill.layers.linear import Linear, VocabEmbedding
from tokenmill.layers.mlp import GatedMLP
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.ops import Ops, select_ops
from tokenmill.layers.rotary import RopeConfig, RopeTables, RotaryEmbedding
from tokenmill.models.base import CausalLM
from tokenmill.models.config import ArchConfig
from tokenmill.models.weights import load_weights
from tokenmill.quant.plan import QuantPlan, linear_method


@dataclass(frozen=True)
class DecoderSpec:
    """Per-family switches of the shared decoder (what the config.json does not say)."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """RMSNorm over head_dim on q and k before rotary (Qwen3, Gemma3)."""
    sandwich_norms: bool = False
    """Gemma: also normalize attention and MLP outputs (``SandwichDecoderLayer``)."""
    norm_unit_offset: bool = False
    """Gemma: every RMSNorm scales by (1 + w)."""
    embed_scale: bool = False
    """Gemma: embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype."""
    attn_scale: float | None = None
    """q.k multiplier; None means head_dim ** -0.5."""
    attn_softcap: float | None = None
    final_softcap: float | None = None


class DecoderLayer(nn.Module):
    """Pre-norm layer: (hidden, residual) [T, hidden] -> (hidden, residual).

    ``residual`` is None on the first layer. Each norm adds its input to the
    residual stream first (``RMSNorm.forward_residual``, in place), so the stream is
    summed exactly as HF sums it. ``rope`` holds this step's cos/sin rows per rotary.
    """

    def __init__(
        self,
        cfg: ArchConfig,
        spec: DecoderSpec,
        layer_idx: int,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        quant: QuantPlan | None = None,
        ops: Ops | None = None,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        attn_spec = AttentionSpec(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            scale=spec.attn_scale if spec.attn_scale is not None else cfg.head_dim**-0.5,
            qkv_bias=spec.qkv_bias,
            o_bias=spec.o_bias,
            qk_norm_eps=cfg.rms_norm_eps if spec.qk_norm else None,
            qk_norm_unit_offset=spec.norm_unit_offset,
            sliding_window=cfg.window_of(layer_idx),
            softcap=spec.attn_softcap,
        )
        self.self_attn = Attention(
            attn_spec, layer_idx, rotary, dtype, quant, f"{prefix}.self_attn", ops
        )
        self.mlp = GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.hidden_act,
            spec.mlp_bias,
            dtype,
            quant,
            f"{prefix}.mlp",
            ops,
        )
        self.input_layernorm = _norm(cfg, spec, dtype, quant, ops)
        self.post_attention_layernorm = _norm(cfg, spec, dtype, quant, ops)

    def forward(
        self,
        rope: Mapping[RotaryEmbedding, RopeTables],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self._attention(rope, hidden, residual, ctx)
        hidden, residual = self.post_attention_layernorm.forward_residual(hidden, residual)
        return self.mlp(hidden, ctx), residual

    def _attention(
        self,
        rope: Mapping[RotaryEmbedding, RopeTables],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input norm (joining the residual stream) and self-attention."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_residual(hidden, residual)
        return self.self_attn(rope[self.self_attn.rotary_emb], hidden, ctx), residual


class SandwichDecoderLayer(DecoderLayer):
    """Gemma: the attention and MLP outputs are normalized too before joining the residual.

    Here ``post_attention_layernorm`` normalizes the attention output and
    ``pre_feedforward_layernorm`` is the norm in front of the MLP (HF names).
    """

    def __init__(
        self,
        cfg: ArchConfig,
        spec: DecoderSpec,
        layer_idx: int,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        quant: QuantPlan | None = None,
        ops: Ops | None = None,
    ) -> None:
        super().__init__(cfg, spec, layer_idx, rotary, dtype, quant, ops)
        self.pre_feedforward_layernorm = _norm(cfg, spec, dtype, quant, ops)
        self.post_feedforward_layernorm = _norm(cfg, spec, dtype, quant, ops)

    def forward(
        self,
        rope: Mapping[RotaryEmbedding, RopeTables],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self._attention(rope, hidden, residual, ctx)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm.forward_residual(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden, ctx)), residual


def _norm(
    cfg: ArchConfig,
    spec: DecoderSpec,
    dtype: torch.dtype,
    quant: QuantPlan | None,
    ops: Ops | None = None,
) -> RMSNorm:
    """HF's exact rounding for dense models (parity); the fast form once weights are quantized."""
    offset, exact = spec.norm_unit_offset, quant is None
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset, dtype, exact, ops)


class AuxTap(Protocol):
    """Takes the residual stream in front of each layer (``hidden + residual``; the
    embeddings in front of the first): ``spec_decode.features.FeatureTap``."""

    def capture(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None: ...


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm: input_ids [T] -> hidden [T, hidden]."""

    def __init__(
        self,
        cfg: ArchConfig,
        spec: DecoderSpec,
        dtype: torch.dtype,
        max_positions: int,
        quant: QuantPlan | None = None,
        ops: Ops | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype,
            None if quant is None else quant.embedding_method("model.embed_tokens"),
        )
        # Like HF, the scale is rounded to the model dtype (sqrt(3072) -> 55.5 in bfloat16).
        self.embed_scale = (
            float(torch.tensor(cfg.hidden_size**0.5).to(dtype)) if spec.embed_scale else None
        )
        ropes: dict[RopeConfig, RotaryEmbedding] = {}  # one cos/sin cache per distinct rope
        for i in range(cfg.num_layers):
            rope = cfg.rope_of(i)
            if rope not in ropes:
                ropes[rope] = RotaryEmbedding(cfg.head_dim, max_positions, rope, dtype, ops)
        self.rotaries = nn.ModuleList(ropes.values())
        layer_cls = SandwichDecoderLayer if spec.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(
            layer_cls(cfg, spec, i, ropes[cfg.rope_of(i)], dtype, quant, ops)
            for i in range(cfg.num_layers)
        )
        self.norm = _norm(cfg, spec, dtype, quant, ops)
        self.aux_tap: AuxTap | None = None
        """Set by a speculative head that reads the residual stream in front of some layers
        (EAGLE-3, ``spec_decode/features.py``); None: nothing is captured."""

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]: the table rows (scaled for Gemma), with the step's
        ``input_embeds`` rows put over them."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if ctx.input_embeds is not None:
            hidden[ctx.input_embeds.rows] = ctx.input_embeds.values.to(hidden.dtype)
        return hidden

    def rope_tables(self, positions: torch.Tensor) -> dict[RotaryEmbedding, RopeTables]:
        """Each rotary's cos/sin rows of the step's positions (gathered once per step)."""
        rotaries: list[RotaryEmbedding] = list(self.rotaries)  # type: ignore[arg-type]
        return {rotary: rotary.tables(positions) for rotary in rotaries}

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        hidden = self.embed(input_ids, ctx)  # [T, hidden]
        rope = self.rope_tables(positions)
        residual: torch.Tensor | None = None
        tap = self.aux_tap
        for i, layer in enumerate(self.layers):
            if tap is not None:
                tap.capture(i, hidden, residual)
            hidden, residual = layer(rope, hidden, residual, ctx)
        if residual is None:
            return self.norm(hidden)
        return self.norm.forward_residual(hidden, residual)[0]


class DecoderForCausalLM(CausalLM):
    """A CausalLM over the shared decoder; a family subclass only overrides ``decoder_spec``.

    Parameters are allocated uninitialized (on the current default device) and
    must be filled by ``load_weights``. ``max_positions`` caps the rotary cache
    (default: the config's max_position_embeddings); positions must stay below it.
    ``quant`` says how each linear stores its weight (default: dense in ``dtype``).
    """

    decoder_model_cls: type[DecoderModel] = DecoderModel
    """The trunk class (Qwen-VL's swaps in one with multimodal rotary positions)."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        max_positions: int | None = None,
        quant: QuantPlan | None = None,
        ops: Ops | None = None,
    ) -> None:
        super().__init__()
        cfg = ArchConfig.from_hf(hf_config)
        self.config = cfg
        self.dtype = dtype
        self.ops = ops or select_ops(torch.get_default_device(), dtype, quant)
        """The kernels and attention backend of every layer, chosen once here."""
        self.spec = self.decoder_spec(cfg)
        self.num_layers = cfg.num_layers
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.vocab_size = cfg.vocab_size
        self.model = self.decoder_model_cls(
            cfg, self.spec, dtype, max_positions or cfg.max_position_embeddings, quant, self.ops
        )
        self.lm_head: Linear | None = (
            None
            if cfg.tie_word_embeddings
            else Linear(
                cfg.hidden_size,
                cfg.vocab_size,
                False,
                dtype,
                linear_method(quant, "lm_head", [cfg.vocab_size], cfg.hidden_size),
            )
        )

    @classmethod
    def decoder_spec(cls, cfg: ArchConfig) -> DecoderSpec:
        """Llama-style defaults: HF ``attention_bias`` on q/k/v/o, ``mlp_bias`` on the MLP."""
        return DecoderSpec(
            qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def cache_specs(self) -> list[CacheSpec]:
        """Paged K/V for every layer; sliding-window layers (Gemma3's local ones) say so."""
        cfg, specs = self.config, list[CacheSpec]()
        for i in range(cfg.num_layers):
            window = cfg.window_of(i)
            kv = (cfg.num_kv_heads, cfg.head_dim, self.dtype)
            specs.append(SlidingWindow(*kv, window=window) if window else FullAttention(*kv))
        return specs

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (soft-capped in float32 if set)."""
        if self.lm_head is None:
            logits = self.model.embed_tokens.logits(hidden).float()
        else:
            logits = self.lm_head(hidden).float()
        cap = self.spec.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def logits_layer(self) -> nn.Module | None:
        """The head (``lm_head``, or the tied embedding table) when ``compute_logits`` is
        this class's without a soft cap: then the logits are its output as it is."""
        if self.spec.final_softcap is not None:
            return None
        if type(self).compute_logits is not DecoderForCausalLM.compute_logits:
            return None
        if self.lm_head is not None and self.lm_head.bias is not None:
            return None
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("lm_head.weight",) if self.lm_head is None else ()
        return load_weights(self, weights, skip=skip)
