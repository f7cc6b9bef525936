"""Llama 2 / 3 / 3.x: the plain pre-norm decoder (llama3 rope scaling comes from the config)."""

from __future__ import annotations

from tokenmill.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Biases follow HF ``attention_bias`` / ``mlp_bias`` (both off for Meta's checkpoints)."""
