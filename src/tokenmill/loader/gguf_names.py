"""What each GGUF architecture means in Hugging Face terms: names, config keys, transforms.

One ``GgufArch`` per llama.cpp ``general.architecture``. Adding a family is one more
entry in ``GGUF_ARCHS``. Transforms name functions in ``gguf.TRANSFORMS`` that undo
what llama.cpp's ``convert_hf_to_gguf.py`` did to a tensor, exactly as transformers'
GGUF loader (``modeling_gguf_pytorch_utils.py``) undoes them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenmill.errors import UnsupportedModelError

# GGUF tensor (without .weight/.bias) outside the blocks -> HF parameter prefix.
GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp adds that have no HF parameter (llama3 rope factors: HF computes them).
IGNORED_NAMES: frozenset[str] = frozenset({"rope_freqs"})

_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PRE_NORM_LAYER = {
    **_ATTENTION,
    **_MLP,
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_SANDWICH_NORM_LAYER = {  # Gemma2/3: norms before and after both attention and MLP
    **_ATTENTION,
    **_MLP,
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# "<arch>.<key>" metadata -> HF config key, shared by every architecture. Applied after an
# arch's own keys, so attention.key_length (the real head_dim) wins over rope.dimension_count.
COMMON_CONFIG_KEYS: Mapping[str, str] = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
}
# Full metadata key -> HF config key.
TOKEN_ID_KEYS: Mapping[str, str] = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

UNPERMUTE_Q, UNPERMUTE_K, MINUS_ONE = "unpermute_q", "unpermute_k", "minus_one"


@dataclass(frozen=True)
class GgufArch:
    architecture: str
    """HF ``architectures[0]``."""
    model_type: str
    """HF ``model_type``."""
    layer_names: Mapping[str, str]
    """GGUF leaf of ``blk.N.<leaf>.weight`` -> HF name under ``model.layers.N.``."""
    config_keys: Mapping[str, str] = field(default_factory=dict)
    """Arch-specific "<arch>.<key>" -> HF config key, on top of COMMON_CONFIG_KEYS."""
    transforms: Mapping[str, str] = field(default_factory=dict)
    """GGUF leaf (or global name) -> transform undoing llama.cpp's conversion."""


# llama.cpp's converter interleaves the rotary halves of Q and K rows for llama only.
_LLAMA_ROPE_PERMUTE = {"attn_q": UNPERMUTE_Q, "attn_k": UNPERMUTE_K}
# Gemma's RMSNorm computes x * (1 + w); llama.cpp stores 1 + w (every *norm tensor).
_GEMMA_NORM_OFFSET = {
    name: MINUS_ONE
    for name in (
        "attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm",
        "attn_q_norm", "attn_k_norm", "output_norm",
    )
}  # fmt: skip

GGUF_ARCHS: Mapping[str, GgufArch] = {
    "llama": GgufArch(
        "LlamaForCausalLM",
        "llama",
        _PRE_NORM_LAYER,
        config_keys={"rope.dimension_count": "head_dim"},
        transforms=_LLAMA_ROPE_PERMUTE,
    ),
    "qwen2": GgufArch("Qwen2ForCausalLM", "qwen2", _PRE_NORM_LAYER),
    "qwen3": GgufArch("Qwen3ForCausalLM", "qwen3", _PRE_NORM_LAYER),
    "gemma3": GgufArch(
        "Gemma3ForCausalLM",
        "gemma3_text",
        _SANDWICH_NORM_LAYER,
        config_keys={"attention.sliding_window": "sliding_window"},
        transforms=_GEMMA_NORM_OFFSET,
    ),
}

_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)")


def gguf_arch(name: str) -> GgufArch:
    if name not in GGUF_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {name!r} is not supported; supported: {', '.join(sorted(GGUF_ARCHS))}"
        )
    return GGUF_ARCHS[name]


@dataclass(frozen=True)
class MappedName:
    hf_name: str
    transform: str | None


def map_tensor_name(arch: GgufArch, gguf_name: str) -> MappedName | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if ignored."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in IGNORED_NAMES:
        return None
    block = _BLOCK.fullmatch(base)
    if block:
        leaf, hf = block[2], arch.layer_names.get(block[2])
        hf = hf and f"model.layers.{block[1]}.{hf}"
    else:
        leaf, hf = base, GLOBAL_NAMES.get(base)
    if hf is None or suffix not in ("weight", "bias"):
        raise UnsupportedModelError(
            f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart for {arch.architecture}; "
            "this file carries a variant tokenmill does not know (add it to loader/gguf_names.py)"
        )
    return MappedName(f"{hf}.{suffix}", arch.transforms.get(leaf))
