"""GGUF files: HF config from the metadata, dequantized tensors under HF names."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tokenmill.errors import ModelLoadError, TokenmillError
from tokenmill.loader.checkpoint import Checkpoint
from tokenmill.loader.gguf_file import GgufFile, GgufTensorInfo, read_gguf
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
from tokenmill.loader.hf_config import normalize_hf_config
from tokenmill.quant.ggml_codec import check_supported, dequantize
from tokenmill.quant.gguf_blocks import DENSE_TYPES, GgufBlocks

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


# Transforms that only reorder rows: they apply to raw blocks as well as to values.
_ROW_TRANSFORMS = frozenset({UNPERMUTE_Q, UNPERMUTE_K})


@dataclass(frozen=True)
class GgufWeights:
    """Dequantizes one tensor at a time (float32, transform, then cast) from the memory map."""

    file: GgufFile
    names: tuple[tuple[int, MappedName], ...]
    """(index into file.tensors, where it goes) for every tensor that maps to HF."""
    hf_config: dict[str, Any]

    def tensor_types(self) -> dict[str, GGMLQuantizationType]:
        """HF tensor name -> the GGML type it is stored in."""
        return {mapped.hf_name: self.file.tensors[i].qtype for i, mapped in self.names}

    def iter_weights(
        self, dtype: torch.dtype, keep_quantized: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | GgufBlocks]]:
        """With ``keep_quantized``, 2-D block-quantized tensors come as ``GgufBlocks`` (rows
        in HF order) for the layer to pack; everything else is dequantized to ``dtype``."""
        last_log = start = time.perf_counter()
        for done, (index, mapped) in enumerate(self.names, 1):
            info = self.file.tensors[index]
            try:
                if keep_quantized and _keeps_blocks(info.qtype, info.shape, mapped.transform):
                    tensor: torch.Tensor | GgufBlocks = self._blocks(info, mapped)
                else:
                    tensor = self._dequantized(info, mapped, dtype)
            except (RuntimeError, ValueError, IndexError, ZeroDivisionError) as e:
                if isinstance(e, TokenmillError):
                    raise
                raise ModelLoadError(
                    f"{self.file.path}: tensor {info.name} {info.shape} does not fit the "
                    f"metadata ({type(e).__name__}: {e}); the file is corrupt"
                ) from None
            yield mapped.hf_name, tensor
            self.file.release(info)  # the pages of this tensor leave our resident memory
            if time.perf_counter() - last_log > _PROGRESS_EVERY_S:
                last_log = time.perf_counter()
                logger.info(
                    "dequantized %d/%d GGUF tensors (%.0f s)",
                    done,
                    len(self.names),
                    last_log - start,
                )

    def _dequantized(
        self, info: GgufTensorInfo, mapped: MappedName, dtype: torch.dtype
    ) -> torch.Tensor:
        tensor = dequantize(self.file.raw(info), info.qtype, info.shape)
        if mapped.transform is not None:
            tensor = TRANSFORMS[mapped.transform](tensor, self.hf_config)
        return tensor.to(dtype).contiguous()

    def _blocks(self, info: GgufTensorInfo, mapped: MappedName) -> GgufBlocks:
        raw = self.file.raw(info)
        if mapped.transform is not None:  # a row permutation: apply it to the blocks
            raw = TRANSFORMS[mapped.transform](torch.from_numpy(np.array(raw)), self.hf_config)
            raw = raw.numpy()
        return GgufBlocks(raw, info.qtype, (info.shape[0], info.shape[1]))


def _keeps_blocks(
    qtype: GGMLQuantizationType, shape: tuple[int, ...], transform: str | None
) -> bool:
    return len(shape) == 2 and qtype not in DENSE_TYPES and transform in (None, *_ROW_TRANSFORMS)


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
