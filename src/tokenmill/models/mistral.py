"""Mistral: Llama's decoder; ``sliding_window`` (when set) applies to every layer."""

from __future__ import annotations

from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM, DecoderSpec


class MistralForCausalLM(DecoderForCausalLM):
    """The sliding window arrives through ``ArchConfig.layer_types`` (all "sliding_attention")."""

    @classmethod
    def decoder_spec(cls, cfg: ArchConfig) -> DecoderSpec:
        return DecoderSpec()  # no biases anywhere
