"""Qwen2 / Qwen2.5: Llama's decoder with biases on q/k/v (not on o_proj)."""

from __future__ import annotations

from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Small Qwen2.5 checkpoints tie the head; large ones do not (read from the config)."""

    @classmethod
    def decoder_spec(cls, cfg: ArchConfig) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)
