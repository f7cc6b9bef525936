"""Gemma 3 text (Gemma3ForCausalLM).

Differences from Llama, all switches of the shared decoder:
- local (sliding-window) and global layers, each with its own rope theta
  (``ArchConfig.layer_types`` / ``sliding_rope``);
- (1 + w) RMSNorms, four per layer (input, post-attention, pre- and post-feedforward);
- q/k RMSNorm, attention scale query_pre_attn_scalar ** -0.5;
- embeddings scaled by sqrt(hidden_size) rounded to the model dtype;
- GELU (tanh) MLP (from ``hidden_activation``), optional final logit soft-capping.
"""

from __future__ import annotations

from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM, DecoderSpec


class Gemma3ForCausalLM(DecoderForCausalLM):
    """``attn_logit_softcapping`` is not applied: Hugging Face's Gemma3 ignores it too."""

    @classmethod
    def decoder_spec(cls, cfg: ArchConfig) -> DecoderSpec:
        scalar = (
            cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim
        )
        return DecoderSpec(
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            qk_norm=True,
            sandwich_norms=True,
            norm_unit_offset=True,
            embed_scale=True,
            attn_scale=scalar**-0.5,
            final_softcap=cfg.final_logit_softcapping,
        )
