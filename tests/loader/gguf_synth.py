"""Write small synthetic GGUF files with gguf-py's writer (imported by the loader tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from quant_blocks import random_raw

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 256, 4, 2, 512, 64
HEAD_DIM = HIDDEN // HEADS
# GGUF tensor name -> torch-order shape of one llama layer's tensors.
LAYER_SHAPES = {
    "attn_q": (HEADS * HEAD_DIM, HIDDEN),
    "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_output": (HIDDEN, HEADS * HEAD_DIM),
    "ffn_gate": (FFN, HIDDEN),
    "ffn_up": (FFN, HIDDEN),
    "ffn_down": (HIDDEN, FFN),
}
NORMS = ("attn_norm", "ffn_norm")
# Per architecture: extra F32 tensors of each layer (GGUF leaf -> shape) beyond LAYER_SHAPES.
ARCH_EXTRAS: dict[str, dict[str, tuple[int, ...]]] = {
    "llama": {leaf: (HIDDEN,) for leaf in NORMS},
    "qwen2": {
        **{leaf: (HIDDEN,) for leaf in NORMS},
        **{f"{leaf}.bias": (LAYER_SHAPES[leaf][0],) for leaf in ("attn_q", "attn_k", "attn_v")},
    },
    "qwen3": {
        **{leaf: (HIDDEN,) for leaf in NORMS},
        "attn_q_norm": (HEAD_DIM,),
        "attn_k_norm": (HEAD_DIM,),
    },
    "gemma3": {
        **{leaf: (HIDDEN,) for leaf in NORMS + ("post_attention_norm", "post_ffw_norm")},
        "attn_q_norm": (HEAD_DIM,),
        "attn_k_norm": (HEAD_DIM,),
    },
}


def synthetic_tensors(
    types: list[Q], layers: int = 2, tied: bool = False, arch: str = "llama"
) -> dict[str, tuple[np.ndarray, Q]]:
    """GGUF name -> (raw bytes, type); the layers' matrices cycle through ``types``."""
    out: dict[str, tuple[np.ndarray, Q]] = {}
    seed = 0

    def add(name: str, shape: tuple[int, ...], qtype: Q) -> None:
        nonlocal seed
        seed += 1
        raw, _ = random_raw(qtype, int(np.prod(shape[:-1])), shape[-1], seed)
        out[name] = (raw.reshape(*shape[:-1], -1), qtype)

    add("token_embd.weight", (VOCAB, HIDDEN), Q.F16)
    slot = 0
    for i in range(layers):
        for leaf, shape in LAYER_SHAPES.items():
            add(f"blk.{i}.{leaf}.weight", shape, types[slot % len(types)])
            slot += 1
        for leaf, shape in ARCH_EXTRAS[arch].items():
            name = leaf if leaf.endswith(".bias") else f"{leaf}.weight"
            add(f"blk.{i}.{name}", shape, Q.F32)
    add("output_norm.weight", (HIDDEN,), Q.F32)
    if not tied:
        add("output.weight", (VOCAB, HIDDEN), Q.Q8_0)
    return out


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q]], arch: str = "llama") -> Path:
    w = GGUFWriter(str(path), arch)
    w.add_block_count(max(int(n.split(".")[1]) for n in tensors if n.startswith("blk.")) + 1)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, (raw, qtype) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
