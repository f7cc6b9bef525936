"""Tiny random-weight HF checkpoints of each decoder family, shaped to split over 2 ranks.

Each exercises one sharding rule beyond the plain split: a vocabulary that 2 ranks can
not halve into whole tiles (padding), biases on o/down (rank 0's only), fewer KV heads
than ranks (replicated), q/k norms, sliding windows, Gemma's sandwich norms and softcap.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _llama() -> transformers.PretrainedConfig:  # padded vocabulary, biases everywhere
    return transformers.LlamaConfig(
        **{**_COMMON, "vocab_size": 500}, attention_bias=True, mlp_bias=True
    )


def _llama_tied() -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True)


def _qwen2() -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False)


def _qwen3() -> transformers.PretrainedConfig:  # one KV head for two ranks
    return transformers.Qwen3Config(
        **{**_COMMON, "num_key_value_heads": 1}, head_dim=32, tie_word_embeddings=True
    )


def _mistral() -> transformers.PretrainedConfig:
    return transformers.MistralConfig(**_COMMON, sliding_window=8)


def _gemma3() -> transformers.PretrainedConfig:
    return transformers.Gemma3TextConfig(
        **_COMMON,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
    )


FAMILIES: dict[str, tuple[type, Callable[[], transformers.PretrainedConfig]]] = {
    "llama_bias_padded_vocab": (transformers.LlamaForCausalLM, _llama),
    "llama_tied": (transformers.LlamaForCausalLM, _llama_tied),
    "qwen2": (transformers.Qwen2ForCausalLM, _qwen2),
    "qwen3_one_kv_head": (transformers.Qwen3ForCausalLM, _qwen3),
    "mistral": (transformers.MistralForCausalLM, _mistral),
    "gemma3": (transformers.Gemma3ForCausalLM, _gemma3),
}


def save_family(family: str, path: Path, tokenizer, seed: int = 0) -> Path:
    """A float32 checkpoint folder with large random weights (clear greedy margins)."""
    model_cls, make_config = FAMILIES[family]
    config = make_config()
    gen = torch.Generator().manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(p + noise * 0.2 if "norm" in name else noise * 0.2)
        if isinstance(model, transformers.Gemma3ForCausalLM):
            model.get_input_embeddings().weight.div_(config.hidden_size**0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
