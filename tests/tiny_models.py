"""Tiny random-weight HF checkpoints for tests (importable as `tiny_models`)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_llama(path: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """A 2-layer random Llama with the SmolLM2 tokenizer; weights scaled up so that
    greedy choices are clear-cut (random init at std 0.02 gives near-ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
