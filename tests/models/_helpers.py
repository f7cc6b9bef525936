"""Tiny random-weight Hugging Face models of each family (our paged runner: ``paged_runner``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers
from transformers import PreTrainedModel

VOCAB = 512
_COMMON = dict(
    vocab_size=VOCAB,
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


def _llama() -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(**_COMMON, rope_theta=10000.0)


def _llama3_scaled() -> transformers.PretrainedConfig:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    }
    return transformers.LlamaConfig(**_COMMON, rope_parameters=rope, tie_word_embeddings=True)


def _qwen2() -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(**_COMMON, rope_theta=1e6, tie_word_embeddings=False)


def _qwen3() -> transformers.PretrainedConfig:
    return transformers.Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True)


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
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    )


# family name -> (HF model class, config factory)
FAMILIES: dict[str, tuple[type[PreTrainedModel], Callable[[], transformers.PretrainedConfig]]] = {
    "llama": (transformers.LlamaForCausalLM, _llama),
    "llama3_scaled_tied": (transformers.LlamaForCausalLM, _llama3_scaled),
    "qwen2": (transformers.Qwen2ForCausalLM, _qwen2),
    "qwen3": (transformers.Qwen3ForCausalLM, _qwen3),
    "mistral": (transformers.MistralForCausalLM, _mistral),
    "gemma3": (transformers.Gemma3ForCausalLM, _gemma3),
}


def build_hf(family: str, seed: int = 0, std: float = 0.2) -> PreTrainedModel:
    """A float32 HF model with large random weights, so greedy choices have clear margins.

    Norm weights are perturbed around their neutral value (1, or 0 for Gemma's
    1 + w) so that loading the wrong norm into a slot shows up. Gemma scales
    embeddings by sqrt(hidden); its table is shrunk by as much, or each token's
    own embedding dominates the tied head and greedy decoding repeats it.
    """
    model_cls, make_config = FAMILIES[family]
    config = make_config()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0.0, std)
        if isinstance(model, transformers.Gemma3ForCausalLM):
            model.get_input_embeddings().weight.div_(config.hidden_size**0.5)
    model.generation_config.eos_token_id = None
    return model


@torch.no_grad()
def hf_logits(hf_model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """HF logits of one sequence: [len(ids), vocab] float32."""
    return hf_model(torch.tensor([ids])).logits[0].float()


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()
