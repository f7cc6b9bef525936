"""Hidden states of a packed batch -> one vector per sequence, and the per-request finish.

``Pooler`` holds what the checkpoint fixes (pooling type, sentence-transformers Dense
layers); ``finish_embedding`` / ``finish_logits`` apply what each request chooses
(dimensions, normalize, activation).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tokenmill.errors import InvalidRequestError, ModelLoadError
from tokenmill.models.bert import PackedBatch
from tokenmill.pooling.metadata import DenseLayer, PoolerConfig
from tokenmill.pooling.params import PoolingParams

DENSE_ACTIVATIONS = {
    "identity": lambda x: x,
    "tanh": torch.tanh,
    "relu": F.relu,
    "gelu": F.gelu,
    "sigmoid": torch.sigmoid,
}


def pool(hidden: torch.Tensor, batch: PackedBatch, kind: str) -> torch.Tensor:
    """hidden [T, H] -> [B, H] by CLS / MEAN / LAST / MAX over each sequence's tokens."""
    if kind == "CLS":
        return hidden.index_select(0, batch.starts)
    if kind == "LAST":
        return hidden.index_select(0, batch.starts + batch.lens - 1)
    if batch.pad_index is None:  # equal lengths: the packed tensor is [B, L, H]
        grid = hidden.view(batch.num_seqs, -1, hidden.shape[-1])
        return grid.mean(1) if kind == "MEAN" else grid.amax(1)
    if kind == "MAX":
        return torch.segment_reduce(hidden, "max", lengths=batch.lens)
    # segment_reduce sums in the input dtype: in bfloat16 a 750-token mean was off by up to
    # 1.1 (cosine 0.93 for EmbeddingGemma); float32 sums as mean() does.
    return torch.segment_reduce(hidden.float(), "mean", lengths=batch.lens).to(hidden.dtype)


class Dense(nn.Module):
    def __init__(self, spec: DenseLayer) -> None:
        super().__init__()
        self.linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        self.act = DENSE_ACTIVATIONS[spec.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class Pooler(nn.Module):
    """Pooling, then the checkpoint's Dense layers: [T, H] -> [B, D]."""

    def __init__(self, config: PoolerConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        layers = [Dense(spec) for spec in config.dense]
        for layer, spec in zip(layers, config.dense, strict=True):
            _load_dense(layer, Path(spec.folder))
        self.dense = nn.ModuleList(layers)
        self.to(dtype)

    def forward(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        x = pool(hidden, batch, self.config.pooling_type)
        for layer in self.dense:
            x = layer(x)
        return x


def _load_dense(layer: Dense, folder: Path) -> None:
    file = folder / "model.safetensors"
    if file.is_file():
        state = load_file(str(file))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"{folder} has no model.safetensors (the Dense layer's weights)")
    try:
        layer.load_state_dict(state)
    except RuntimeError as e:
        raise ModelLoadError(
            f"{folder}: the Dense weights do not match its config.json ({e})"
        ) from e


def check_dimensions(params: PoolingParams, config: PoolerConfig, size: int) -> int | None:
    """The embedding size a request gets (None: the full size); raises when not allowed."""
    dims = params.dimensions if params.dimensions is not None else config.default_dimensions
    if dims is None:
        return None
    if not config.is_matryoshka:
        raise InvalidRequestError(
            f"dimensions={dims}: this model does not support Matryoshka embeddings "
            "(its config declares no matryoshka_dimensions); leave dimensions unset, or "
            "load it with pooler_config={'dimensions': n} if you know it was trained so"
        )
    if dims > size:
        raise InvalidRequestError(f"dimensions={dims} exceeds the embedding size {size}")
    return dims


def finish_embedding(
    vec: torch.Tensor, params: PoolingParams, config: PoolerConfig
) -> torch.Tensor:
    """[D] -> what the request asked: the first ``dimensions``, then L2-normalized."""
    dims = check_dimensions(params, config, vec.shape[-1])
    if dims is not None:
        vec = vec[..., :dims]
    normalize = config.normalize if params.normalize is None else params.normalize
    return F.normalize(vec, dim=-1) if normalize else vec


def finish_logits(
    logits: torch.Tensor, params: PoolingParams, config: PoolerConfig
) -> torch.Tensor:
    """[C] logits -> probabilities (softmax; sigmoid for one label) unless activation=False."""
    use = config.activation if params.activation is None else params.activation
    if not use:
        return logits
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, -1)
