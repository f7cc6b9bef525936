"""How a linear layer (or embedding table) stores its weight and multiplies by it.

A ``LinearMethod`` owns a layer's weight storage: it creates it, fills it row block
by row block from the checkpoint (a dense tensor or raw GGUF blocks), and computes
``x W^T``. Formats, by ``method_for(name)``:

- ``dense``: ``weight [out, in]`` in the model dtype, ``F.linear``.
- ``int4`` / ``int8``: affine groups of 32 inputs, ``w = scale * q + offset`` with ``q``
  of 4 or 8 bits and float16 scale/offset: GGUF Q4_0/Q4_1/Q4_K (4-bit) and Q8_0 (8-bit)
  load exactly, anything else is rounded to nearest. Computed by the native kernel
  (``native/``: activations quantized per group of 32 into two int8 terms, or one with
  ``activation_precision="low"``, integer dot products; on x86-64 with AVX2+FMA+F16C and
  a C compiler, AVX512-VNNI where the CPU has it), float32 or bfloat16 in and out.
- ``bf16`` / ``fp16``: 16-bit float weights as stored in the checkpoint, float32
  activations and accumulation (``dense16.py``; native kernels only).
- Where the native kernel is unavailable, ``int4`` and ``int8`` fall back to PyTorch's
  CPU weight-only kernels (``torch_methods.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import native
from tokenmill.errors import ModelLoadError
from tokenmill.quant.base import CHUNK_ROWS as CHUNK_ROWS  # re-exported (home: base.py)
from tokenmill.quant.base import LinearMethod, check_rows, row_chunks, to_float
from tokenmill.quant.base import Source as Source
from tokenmill.quant.gguf_blocks import GROUP, GgufBlocks, affine_groups


class DenseMethod(LinearMethod):
    name = "dense"

    def create_weights(self, layer, out_features, in_features, dtype):
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )

    def load_rows(self, layer, start, src):
        out, cols = layer.weight.shape
        rows = check_rows(layer, start, src, out, cols)
        dst = layer.weight.narrow(0, start, rows)
        dst.copy_(to_float(src) if isinstance(src, GgufBlocks) else src)

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)

    def embed(self, layer, ids, dtype):
        return F.embedding(ids, layer.weight)

    def storage(self, layer):
        return [layer.weight]


class AffineGroupMethod(LinearMethod):
    """4- or 8-bit affine groups of 32 in the native kernel's tiles of 16 output rows.

    Shards must start and end on a tile (16 rows); ``QuantPlan`` checks that.
    """

    TILE = native.TILE

    def __init__(self, bits: int, terms: int = 2) -> None:
        self.bits, self.activation_terms = bits, terms
        self.name = f"int{bits}"

    def create_weights(self, layer, out_features, in_features, dtype):
        if in_features % GROUP or out_features % self.TILE:
            raise ValueError(
                f"{self.name} needs in_features divisible by {GROUP} and out_features by "
                f"{self.TILE}, got [{out_features}, {in_features}]"
            )
        tile = native.tile_bytes(self.bits, in_features)
        layer.register_buffer(
            "qtiles", torch.empty(out_features // self.TILE, tile, dtype=torch.uint8)
        )

    def load_rows(self, layer, start, src):
        out, cols = layer.qtiles.shape[0] * self.TILE, _in_features(layer)
        rows = check_rows(layer, start, src, out, cols)
        if start % self.TILE or rows % self.TILE:
            raise ModelLoadError(f"rows {start}:{start + rows} are not whole tiles of {self.TILE}")
        for i, part in row_chunks(src):
            g = affine_groups(part, self.bits)
            first = (start + i) // self.TILE
            layer.qtiles[first : first + part.shape[0] // self.TILE] = native.pack_tiles(
                g.codes, g.scale, g.offset, self.bits
            )

    def apply(self, layer, x, bias):
        n = layer.qtiles.shape[0] * self.TILE
        if x.dim() == 2 and x.is_contiguous() and x.dtype in _NATIVE_DTYPES:
            y = native.affine_gemm(x, layer.qtiles, self.bits, n, self.activation_terms)
        else:
            flat = x.reshape(-1, x.shape[-1])
            flat = flat.contiguous() if flat.dtype in _NATIVE_DTYPES else flat.float()
            y = native.affine_gemm(flat, layer.qtiles, self.bits, n, self.activation_terms)
            y = y.view(*x.shape[:-1], n).to(x.dtype)
        return y if bias is None else y + bias

    def embed(self, layer, ids, dtype):
        return native.unpack_rows(layer.qtiles, ids, self.bits, _in_features(layer)).to(dtype)

    def storage(self, layer):
        return [layer.qtiles]

    def native_weight(self, layer):
        return layer.qtiles.data_ptr(), self.bits


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _in_features(layer: nn.Module) -> int:
    return layer.in_features if hasattr(layer, "in_features") else layer.embedding_dim


_DENSE = DenseMethod()
_NATIVE = {
    (f"int{bits}", terms): AffineGroupMethod(bits, terms) for bits in (4, 8) for terms in (1, 2)
}


def method_for(name: str, activation_terms: int = 2) -> LinearMethod:
    """The implementation of a weight format here: the native kernel when it runs on this
    machine, else PyTorch's kernels for int4/int8 (bf16/fp16 need the native kernels).
    ``activation_terms``: the native int4/int8 kernels' activation precision (1 or 2 int8
    terms; ``plan.ACTIVATION_PRECISIONS``)."""
    if name == "dense":
        return _DENSE
    if name in ("bf16", "fp16", "fp32"):
        from tokenmill.quant.dense16 import dense16_method

        return dense16_method(name, activation_terms)
    if native.available():
        return _NATIVE[name, activation_terms]
    from tokenmill.quant.torch_methods import TORCH_METHODS

    return TORCH_METHODS[name]
