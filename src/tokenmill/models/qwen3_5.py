"""Qwen3.5 (dense, text): a hybrid of Gated DeltaNet layers and gated full attention.

``layer_types`` says which layer is which (by default three ``linear_attention`` layers to
one ``full_attention``). Every layer is pre-norm with (1 + w) RMSNorms and a gated MLP:

- linear attention: ``layers/recurrent/gated_deltanet.GatedDeltaNet``, its conv window and
  delta state in a state slot (``RecurrentState``);
- full attention: q and a per-head output gate from one projection, q/k RMSNorm, rotary on
  the first ``partial_rotary_factor * head_dim`` dims, paged K/V, out * sigmoid(gate).

Text positions here: Qwen3.5's multimodal rope sections coincide for text, so the rotary is
the plain one. The vision checkpoints (``Qwen3_5ForConditionalGeneration``: the tower, its
``model.language_model.*`` weights, interleaved M-RoPE over positions [3, T]) are
``qwen3_5_vl.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.attention import AttentionParams, StepContext
from tokenmill.errors import UnsupportedModelError
from tokenmill.kv_cache.spec import CacheSpec, FullAttention
from tokenmill.layers.linear import Linear, PackedLinear, VocabEmbedding
from tokenmill.layers.mlp import GatedMLP
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.ops import Ops, select_ops
from tokenmill.layers.recurrent.gated_deltanet import PACKED_IN_PROJ, DeltaNetShape, GatedDeltaNet
from tokenmill.layers.recurrent.plan import StatePlan
from tokenmill.layers.rotary import RopeTables, RotaryEmbedding
from tokenmill.models.base import CausalLM
from tokenmill.models.config import ArchConfig
from tokenmill.models.weights import PACKED_MODULES, load_weights

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class HybridConfig:
    """What Qwen3.5 adds to the shared ``ArchConfig``."""

    arch: ArchConfig
    layer_types: tuple[str, ...]
    rotary_dim: int
    """Leading dims of each head that rotary rotates (partial_rotary_factor * head_dim)."""
    deltanet: DeltaNetShape

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> HybridConfig:
        arch = ArchConfig.from_hf({"head_dim": 256, "tie_word_embeddings": False, **d})
        n = arch.num_layers
        types = d.get("layer_types") or [
            FULL if (i + 1) % int(d.get("full_attention_interval", 4)) == 0 else LINEAR
            for i in range(n)
        ]
        unknown = sorted({str(t) for t in types} - {LINEAR, FULL})
        if unknown or len(types) != n:
            raise UnsupportedModelError(
                f"layer_types must be {n} entries of {LINEAR!r} or {FULL!r}; got unknown "
                f"{unknown!r} in {list(types)!r}" if unknown else
                f"layer_types has {len(types)} entries for num_hidden_layers={n}"
            )  # fmt: skip
        rope = d.get("rope_parameters") or {}
        factor = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
        shape = DeltaNetShape(
            hidden_size=arch.hidden_size,
            num_k_heads=int(d.get("linear_num_key_heads", 16)),
            num_v_heads=int(d.get("linear_num_value_heads", 32)),
            head_k_dim=int(d.get("linear_key_head_dim", 128)),
            head_v_dim=int(d.get("linear_value_head_dim", 128)),
            conv_kernel=int(d.get("linear_conv_kernel_dim", 4)),
            eps=arch.rms_norm_eps,
        )
        if shape.num_v_heads % shape.num_k_heads:
            raise UnsupportedModelError(
                f"linear_num_value_heads={shape.num_v_heads} is not a multiple of "
                f"linear_num_key_heads={shape.num_k_heads}"
            )
        return cls(arch, tuple(map(str, types)), int(arch.head_dim * factor), shape)


class GatedAttention(nn.Module):
    """hidden [T, hidden] -> [T, hidden] over the paged cache; HF q_proj (q and the gate,
    interleaved per head), k_proj, v_proj load into qkv_proj shards 0/1/2."""

    def __init__(self, cfg: HybridConfig, layer_idx: int, rotary: RotaryEmbedding, ops: Ops,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        a = cfg.arch
        self.layer_idx, self.rotary = layer_idx, rotary
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.rotary_dim = cfg.rotary_dim
        q2, kv = 2 * a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = PackedLinear(a.hidden_size, [q2, kv, kv], a.attention_bias, dtype)
        self.o_proj = Linear(a.num_heads * a.head_dim, a.hidden_size, a.attention_bias, dtype)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, True, dtype, ops=ops)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, True, dtype, ops=ops)
        params = AttentionParams(a.num_heads, a.num_kv_heads, a.head_dim, a.head_dim**-0.5)
        self.impl = ops.backend.bind(params)
        """Called through the unfused contract (q and k rotated here: partial rotary)."""

    def forward(self, rope: RopeTables, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t, h, kvh, d = hidden.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden, ctx)
        q_gate = qkv[:, : 2 * h * d].view(t, h, 2, d)
        gate = q_gate[:, :, 1].reshape(t, h * d)
        k, v = qkv[:, 2 * h * d :].view(t, 2, kvh, d).unbind(1)
        qk = torch.cat([self.q_norm(q_gate[:, :, 0]), self.k_norm(k)], dim=1)  # [T, H + KVH, D]
        rotated = qk[..., : self.rotary_dim].contiguous()
        qk[..., : self.rotary_dim] = self.rotary.rotate_(rotated, rope)
        kv = torch.stack([qk[:, h:], v], dim=1)  # [T, 2, KVH, D]
        cache = ctx.kv_caches[self.layer_idx]
        assert cache is not None, f"layer {self.layer_idx} has no paged cache"
        out = self.impl.forward(qk[:, :h], kv, cache, ctx.attn)  # [T, H, D]
        return self.o_proj(out.reshape(t, h * d) * torch.sigmoid(gate), ctx)


class HybridLayer(nn.Module):
    """Pre-norm layer around a token mixer (DeltaNet or gated attention) and the MLP:
    (hidden, residual) -> (hidden, residual), the residual summed in place."""

    def __init__(self, cfg: HybridConfig, layer_idx: int, rotary: RotaryEmbedding, ops: Ops,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        a = cfg.arch
        self.is_linear = cfg.layer_types[layer_idx] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg.deltanet, layer_idx, dtype, ops.scan)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx, rotary, ops, dtype)
        prefix = f"model.layers.{layer_idx}.mlp"
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, a.hidden_act, False, dtype,
                            None, prefix, ops)  # fmt: skip
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, True, dtype, ops=ops)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, True, dtype, ops=ops)

    def forward(self, rope: RopeTables, hidden: torch.Tensor, residual: torch.Tensor | None,
                ctx: StepContext, plan: StatePlan | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_residual(hidden, residual)
        if self.is_linear:
            assert plan is not None
            hidden = self.linear_attn(hidden, ctx, plan)
        else:
            hidden = self.self_attn(rope, hidden, ctx)
        hidden, residual = self.post_attention_layernorm.forward_residual(hidden, residual)
        return self.mlp(hidden, ctx), residual


class HybridModel(nn.Module):
    """Embedding, hybrid layers, final norm: input_ids [T] -> hidden [T, hidden]."""

    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, max_positions: int, ops: Ops) -> None:
        super().__init__()
        a = cfg.arch
        self.embed_tokens = VocabEmbedding(a.vocab_size, a.hidden_size, dtype)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, max_positions, a.rope, dtype, ops)
        self.layers = nn.ModuleList(
            HybridLayer(cfg, i, self.rotary, ops, dtype) for i in range(a.num_layers)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, True, dtype, ops=ops)
        self.has_state = LINEAR in cfg.layer_types

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]: the table rows, the step's media rows put over them."""
        hidden = self.embed_tokens(input_ids)
        if ctx.input_embeds is not None:
            hidden[ctx.input_embeds.rows] = ctx.input_embeds.values.to(hidden.dtype)
        return hidden

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        hidden = self.embed(input_ids, ctx)
        rope = self.rope_tables(positions)
        plan = StatePlan.of(ctx) if self.has_state else None  # once per step, for every layer
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, ctx, plan)
        assert residual is not None
        return self.norm.forward_residual(hidden, residual)[0]

    def rope_tables(self, positions: torch.Tensor) -> RopeTables:
        """positions [T] -> the cos/sin rows every attention layer of the step uses."""
        return self.rotary.tables(positions)


class Qwen3_5ForCausalLM(CausalLM):
    """Qwen3.5 text model; weights under HF names (``model.layers.N.linear_attn...``)."""

    takes_quant_plan = False

    weight_prefix = "model."
    """Where the language model's weights sit in the checkpoint (before ``layers.N``)."""
    model_cls: type[HybridModel] = HybridModel

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype,
                 max_positions: int | None = None, quant: Any = None,
                 ops: Ops | None = None) -> None:  # fmt: skip
        super().__init__()
        if quant is not None:
            raise UnsupportedModelError("quantized weights are not supported for Qwen3.5 yet")
        cfg = HybridConfig.from_hf(self.text_config(hf_config))
        a = cfg.arch
        self.config, self.dtype = cfg, dtype
        self.ops = ops or select_ops(torch.get_default_device(), dtype)
        self.num_layers, self.num_kv_heads, self.head_dim = a.num_layers, a.num_kv_heads, a.head_dim
        self.vocab_size = a.vocab_size
        self.model = self.model_cls(
            cfg, dtype, max_positions or a.max_position_embeddings, self.ops
        )
        self.lm_head = (
            None if a.tie_word_embeddings else Linear(a.hidden_size, a.vocab_size, False, dtype)
        )

    @staticmethod
    def text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
        return hf_config

    def cache_specs(self) -> list[CacheSpec]:
        """Paged K/V for the attention layers, a state slot for the DeltaNet layers."""
        full = FullAttention(self.num_kv_heads, self.head_dim, self.dtype)
        layers: list[HybridLayer] = list(self.model.layers)  # type: ignore[arg-type]
        return [layer.linear_attn.state_spec if layer.is_linear else full for layer in layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.model.embed_tokens.logits(hidden).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("lm_head.weight",) if self.lm_head is None else ()
        packed: Mapping[str, tuple[str, int]] = {**PACKED_MODULES, **PACKED_IN_PROJ}
        return load_weights(self.language_part(), self._renamed(weights), skip=skip, packed=packed)

    def language_part(self) -> nn.Module:
        """The modules the language model's weights fill (here: all of this one)."""
        return self

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The language model's tensors under this module's names; others are dropped
        (a vision tower, multi-token-prediction heads)."""
        for name, tensor in weights:
            if name.startswith(self.weight_prefix):
                yield "model." + name[len(self.weight_prefix) :], tensor
            elif name == "lm_head.weight":
                yield name, tensor


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next with dense MLPs (``num_experts=0``, or every layer in ``mlp_only_layers``):
    Qwen3.5's layers, except that the DeltaNet input projections are grouped per key head
    (``in_proj_qkvz``: [q | k | v | z] per group, ``in_proj_ba``: [b | a] per group); they
    are regrouped into Qwen3.5's layout as they load. Mixture-of-experts layers (every real
    Qwen3-Next checkpoint) are refused: they need the MoE blocks of a later issue."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype,
                 max_positions: int | None = None, quant: Any = None,
                 ops: Ops | None = None) -> None:  # fmt: skip
        n, experts = int(hf_config["num_hidden_layers"]), int(hf_config.get("num_experts") or 0)
        dense = set(hf_config.get("mlp_only_layers") or ())
        step = int(hf_config.get("decoder_sparse_step") or 1)
        sparse = [i for i in range(n) if experts > 0 and i not in dense and (i + 1) % step == 0]
        if sparse:
            raise UnsupportedModelError(
                f"Qwen3-Next layers {sparse} are mixture-of-experts ({experts} experts), which "
                "is not supported yet; only dense Qwen3-Next configs load"
            )
        super().__init__(hf_config, dtype, max_positions, quant, ops)

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]):
        s = self.config.deltanet
        group = s.num_v_heads // s.num_k_heads
        for name, tensor in super()._renamed(weights):
            if name.endswith("linear_attn.in_proj_qkvz.weight"):
                rows = tensor.view(s.num_k_heads, -1, tensor.shape[-1])  # per key-head group
                q, k, v, z = rows.split([s.head_k_dim, s.head_k_dim, group * s.head_v_dim,
                                         group * s.head_v_dim], dim=1)  # fmt: skip
                flat = [x.reshape(-1, tensor.shape[-1]) for x in (q, k, v, z)]
                yield name.replace("in_proj_qkvz", "in_proj_qkv"), torch.cat(flat[:3])
                yield name.replace("in_proj_qkvz", "in_proj_z"), flat[3]
            elif name.endswith("linear_attn.in_proj_ba.weight"):
                b, a = tensor.view(s.num_k_heads, 2 * group, -1).split([group, group], dim=1)
                yield name.replace("in_proj_ba", "in_proj_b"), b.reshape(s.num_v_heads, -1)
                yield name.replace("in_proj_ba", "in_proj_a"), a.reshape(s.num_v_heads, -1)
            else:
                yield name, tensor
