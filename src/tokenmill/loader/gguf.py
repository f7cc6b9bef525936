"""GGUF files: HF config from the metadata, dequantized tensors under HF names."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.loader.checkpoint import Checkpoint
from tokenmill.loader.gguf_file import GgufFile, read_gguf
from tokenmill.loader.gguf_names import (
    COMMON_CONFIG_KEYS,
    MINUS_ONE,
    TOKEN_ID_KEYS,
    UNPERMUTE_K,
    UNPERMUTE_Q,
    GgufArch,
    MappedName,
    gguf_arch,
    map_tensor_name,
)
from tokenmill.loader.gguf_quant import check_supported, dequantize
from tokenmill.loader.hf_config import normalize_hf_config

logger = logging.getLogger(__name__)

_PROGRESS_EVERY_S = 5.0


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permute of Q/K rows: per head [2, d/2] -> [d/2, 2] interleave.

    w: [n_head * d, ...] (a weight [out, in] or a bias [out]).
    """
    d_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, d_half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# transform name -> f(tensor in float32, hf_config) -> tensor. Names come from gguf_names.
TRANSFORMS: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]] = {
    UNPERMUTE_Q: lambda w, c: _unpermute_rows(w, c["num_attention_heads"]),
    UNPERMUTE_K: lambda w, c: _unpermute_rows(w, c["num_key_value_heads"]),
    MINUS_ONE: lambda w, c: w - 1.0,
}


@dataclass(frozen=True)
class GgufWeights:
    """Dequantizes one tensor at a time (float32, transform, then cast) from the memory map."""

    file: GgufFile
    names: tuple[tuple[int, MappedName], ...]
    """(index into file.tensors, where it goes) for every tensor that maps to HF."""
    hf_config: dict[str, Any]

    def iter_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        last_log = start = time.perf_counter()
        for done, (index, mapped) in enumerate(self.names, 1):
            info = self.file.tensors[index]
            tensor = dequantize(self.file.raw(info), info.qtype, info.shape)
            if mapped.transform is not None:
                tensor = TRANSFORMS[mapped.transform](tensor, self.hf_config)
            yield mapped.hf_name, tensor.to(dtype).contiguous()
            if time.perf_counter() - last_log > _PROGRESS_EVERY_S:
                last_log = time.perf_counter()
                logger.info(
                    "dequantized %d/%d GGUF tensors (%.0f s)",
                    done,
                    len(self.names),
                    last_log - start,
                )


def load_gguf_checkpoint(path: Path) -> Checkpoint:
    """Read the header of ``path``, check every tensor is mappable and of a supported type."""
    file = read_gguf(path)
    arch = gguf_arch(str(file.metadata.get("general.architecture")))
    for info in file.tensors:
        check_supported(info.qtype, info.name)
    names = tuple(
        (i, mapped)
        for i, info in enumerate(file.tensors)
        if (mapped := map_tensor_name(arch, info.name)) is not None
    )
    hf_config = normalize_hf_config(gguf_hf_config(file, arch))
    return Checkpoint(
        path=str(path),
        format="gguf",
        hf_config=hf_config,
        generation_config={},
        source=GgufWeights(file, names, hf_config),
    )


def gguf_hf_config(file: GgufFile, arch: GgufArch) -> dict[str, Any]:
    """The raw HF config keys GGUF metadata holds (defaults are filled in later)."""
    meta, prefix = file.metadata, str(file.metadata["general.architecture"])
    config: dict[str, Any] = {"model_type": arch.model_type, "architectures": [arch.architecture]}
    for key, hf_key in {**arch.config_keys, **COMMON_CONFIG_KEYS}.items():
        if f"{prefix}.{key}" in meta:
            config[hf_key] = meta[f"{prefix}.{key}"]
    config.update({hf: meta[key] for key, hf in TOKEN_ID_KEYS.items() if key in meta})
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in file.tensors)
    _warn_ignored_rope_scaling(meta, prefix)
    return config


def _warn_ignored_rope_scaling(meta: dict[str, Any], prefix: str) -> None:
    kind = meta.get(f"{prefix}.rope.scaling.type", "none")
    if kind != "none":
        logger.warning(
            "GGUF rope scaling %r is ignored (as transformers does): quality may drop past "
            "the original context length",
            kind,
        )
