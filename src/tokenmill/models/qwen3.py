"""Qwen3 (dense): Llama's decoder plus per-head RMSNorm on q and k before rotary."""

from __future__ import annotations

from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen3ForCausalLM(DecoderForCausalLM):
    """head_dim is explicit in the config (128 by default), not hidden_size // heads."""

    @classmethod
    def decoder_spec(cls, cfg: ArchConfig) -> DecoderSpec:
        return DecoderSpec(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)
