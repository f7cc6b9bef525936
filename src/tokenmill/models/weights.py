"""Stream HF-named tensors into a model's parameters, one tensor at a time.

Memory bound: the model's own parameters plus the one tensor in flight; every
streamed tensor is copied into place (with dtype conversion) and dropped. A
linear or embedding weight goes through its layer's ``load_weight``, which stores
it as the layer's ``LinearMethod`` says (dense, or quantized from a dense tensor or
from raw GGUF blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.layers.linear import Linear, PackedLinear, VocabEmbedding
from tokenmill.quant.gguf_blocks import GgufBlocks

# HF module name -> (our packed module name, shard index).
PACKED_MODULES: Mapping[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# Checkpoint entries that are derived buffers, not weights (old rotary caches).
IGNORED_SUFFIXES: tuple[str, ...] = (
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    skip: tuple[str, ...] = (),
    packed: Mapping[str, tuple[str, int]] = PACKED_MODULES,
) -> set[str]:
    """Copy each (HF name, tensor) into ``model``; return the parameter names filled.

    Names in ``skip`` (exact) are dropped, e.g. ``lm_head.weight`` of a tied model.
    Raises ModelLoadError on an unknown name, a shape mismatch, or parameters
    (or shards of packed ones) that the stream never filled.
    """
    params = dict(model.named_parameters())
    weighted = _weighted_modules(model)  # "<module>.weight" -> its linear / embedding
    filled: dict[str, set[int]] = {}
    with torch.no_grad():
        for hf_name, tensor in weights:
            if hf_name in skip or hf_name.endswith(IGNORED_SUFFIXES):
                continue
            name, shard = _our_name(hf_name, packed)
            if name in weighted:
                _load_layer_weight(weighted[name], hf_name, tensor, shard)
            elif name in params:
                _load_param(model, params[name], name, hf_name, tensor, shard)
            else:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in the model")
            shards = range(_num_shards(model, name)) if shard is None else (shard,)
            filled.setdefault(name, set()).update(shards)
    _check_complete(model, [*params, *weighted], filled)
    return set(filled)


def module_name(hf_name: str, packed: Mapping[str, tuple[str, int]] = PACKED_MODULES) -> str:
    """The module an HF tensor loads into: 'model.layers.0.mlp.up_proj.weight' ->
    'model.layers.0.mlp.gate_up_proj'."""
    return _our_name(hf_name, packed)[0].rsplit(".", 1)[0]


def _weighted_modules(model: nn.Module) -> dict[str, Linear | VocabEmbedding]:
    return {
        f"{name}.weight": m
        for name, m in model.named_modules()
        if isinstance(m, (Linear, VocabEmbedding))
    }


def _load_layer_weight(
    layer: Linear | VocabEmbedding, hf_name: str, src: torch.Tensor | GgufBlocks, shard: int | None
) -> None:
    rows = layer.out_sizes[shard] if shard is not None else _rows(layer)
    expected = (rows, layer.in_features if isinstance(layer, Linear) else layer.embedding_dim)
    if tuple(src.shape) != expected:
        raise ModelLoadError(
            f"{hf_name!r}: checkpoint shape {tuple(src.shape)} != model shape {expected}"
        )
    layer.load_weight(src, shard)


def _rows(layer: Linear | VocabEmbedding) -> int:
    return layer.out_features if isinstance(layer, Linear) else layer.num_embeddings


def _load_param(
    model: nn.Module,
    dst: torch.Tensor,
    name: str,
    hf_name: str,
    tensor: torch.Tensor | GgufBlocks,
    shard: int | None,
) -> None:
    if isinstance(tensor, GgufBlocks):  # a quantized tensor that is no linear weight
        tensor = tensor.dequantize()
    if shard is not None:
        dst = _packed_owner(model, name).shard(dst, shard)
    if dst.shape != tensor.shape:
        raise ModelLoadError(
            f"{hf_name!r}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dst.shape)}"
        )
    dst.copy_(tensor)


def _our_name(hf_name: str, packed: Mapping[str, tuple[str, int]]) -> tuple[str, int | None]:
    """'layers.0.self_attn.k_proj.weight' -> ('layers.0.self_attn.qkv_proj.weight', 1)."""
    parts = hf_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in packed:
            parts[i], shard = packed[part]
            return ".".join(parts), shard
    return hf_name, None


def _packed_owner(model: nn.Module, param_name: str) -> PackedLinear:
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    if not isinstance(module, PackedLinear):
        raise ModelLoadError(f"{param_name!r} is not a packed projection")
    return module


def _num_shards(model: nn.Module, param_name: str) -> int:
    owner = model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model
    return owner.num_shards if isinstance(owner, PackedLinear) else 1


def _check_complete(model: nn.Module, params: list[str], filled: dict[str, set[int]]) -> None:
    names = dict.fromkeys(params)  # a dense weight is both a parameter and a layer weight
    missing = [n for n in names if len(filled.get(n, ())) < _num_shards(model, n)]
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} weights: {', '.join(missing)}")
