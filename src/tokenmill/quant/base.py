"""The contract of a weight format (``LinearMethod``) and the loading helpers every format
shares; the formats live in ``methods.py``, ``torch_methods.py`` and ``dense16.py``."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.quant.gguf_blocks import GgufBlocks

Source = torch.Tensor | GgufBlocks
"""A block of weight rows from the checkpoint: dense [n, in], or GGUF blocks."""

CHUNK_ROWS = 1024  # rows converted at a time: bounds the temporaries of loading


class LinearMethod(ABC):
    """Storage and matmul of one [out, in] weight. Stateless: the tensors live on the layer."""

    name: str
    activation_terms: int = 2
    """int8 terms per activation of the native affine-group kernels (``ACTIVATION_TERMS``);
    other formats ignore it."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, out_features: int, in_features: int, dtype: torch.dtype
    ) -> None:
        """Register the (uninitialized) weight storage on ``layer``."""

    @abstractmethod
    def load_rows(self, layer: nn.Module, start: int, src: Source) -> None:
        """Fill output rows ``start : start + rows(src)``."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""

    def embed(self, layer: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [T] -> weight rows [T, in] in ``dtype`` (for an embedding table)."""
        raise NotImplementedError(f"{self.name} weights can not be used as an embedding table")

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes a full pass over the weight reads."""
        return sum(t.numel() * t.element_size() for t in self.storage(layer))

    @abstractmethod
    def storage(self, layer: nn.Module) -> list[torch.Tensor]: ...

    def native_weight(self, layer: nn.Module) -> tuple[int, int] | None:
        """(weight address, ``Proj.bits`` code) when ``decoder_layer.c`` can run this
        layer's matmul, else None."""
        return None


def check_rows(layer: nn.Module, start: int, src: Source, out: int, cols: int) -> int:
    rows, src_cols = src.shape
    if src_cols != cols or start + rows > out:
        raise ModelLoadError(
            f"weight rows {start}:{start + rows} x {src_cols} do not fit {type(layer).__name__} "
            f"[{out}, {cols}]"
        )
    return rows


def to_float(src: Source) -> torch.Tensor:
    return src.dequantize() if isinstance(src, GgufBlocks) else src.float()


def row_chunks(src: Source):
    """(offset, rows) of ``src`` in chunks of at most CHUNK_ROWS rows."""
    for i in range(0, src.shape[0], CHUNK_ROWS):
        n = min(CHUNK_ROWS, src.shape[0] - i)
        yield i, src.narrow_rows(i, n) if isinstance(src, GgufBlocks) else src[i : i + n]
