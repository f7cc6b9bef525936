"""How a linear layer (or embedding table) stores its weight and multiplies by it.

A ``LinearMethod`` owns a layer's weight storage: it creates it, fills it row block
by row block from the checkpoint (a dense tensor or raw GGUF blocks), and computes
``x W^T``. The quantized methods use PyTorch's CPU weight-only kernels, which compute
in bfloat16 (their AVX-512 paths take bfloat16 activations and scales): inputs of
another dtype are cast in and the output cast back.

- ``dense``: ``weight [out, in]`` in the model dtype, ``F.linear``.
- ``int8``: one int8 per weight, one bfloat16 scale per output row
  (``aten._weight_int8pack_mm``); any source is re-quantized per row.
- ``int4``: 4-bit codes in groups of 32 along ``in`` with a bfloat16 scale and zero per
  group (``aten._weight_int4pack_mm_for_cpu``). GGUF Q4_0/Q4_1/Q4_K blocks load
  exactly (their scales rounded to bfloat16); other sources are rounded to nearest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.quant.gguf_blocks import GROUP, GgufBlocks, Int4Groups, int4_groups

Source = torch.Tensor | GgufBlocks
"""A block of weight rows from the checkpoint: dense [n, in], or GGUF blocks."""

_KERNEL_DTYPE = torch.bfloat16
_CHUNK_ROWS = 4096  # rows re-quantized at a time: bounds the float32 temporary


class LinearMethod(ABC):
    """Storage and matmul of one [out, in] weight. Stateless: the tensors live on the layer."""

    name: str

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


def _check_rows(layer: nn.Module, start: int, src: Source, out: int, cols: int) -> int:
    rows, src_cols = src.shape
    if src_cols != cols or start + rows > out:
        raise ModelLoadError(
            f"weight rows {start}:{start + rows} x {src_cols} do not fit {type(layer).__name__} "
            f"[{out}, {cols}]"
        )
    return rows


def _to_float(src: Source) -> torch.Tensor:
    return src.dequantize() if isinstance(src, GgufBlocks) else src.float()


def _row_chunks(src: Source):
    """(offset, float32 rows) in chunks of at most _CHUNK_ROWS rows."""
    for i in range(0, src.shape[0], _CHUNK_ROWS):
        n = min(_CHUNK_ROWS, src.shape[0] - i)
        part = src.narrow_rows(i, n) if isinstance(src, GgufBlocks) else src[i : i + n]
        yield i, _to_float(part)


class DenseMethod(LinearMethod):
    name = "dense"

    def create_weights(self, layer, out_features, in_features, dtype):
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )

    def load_rows(self, layer, start, src):
        out, cols = layer.weight.shape
        rows = _check_rows(layer, start, src, out, cols)
        dst = layer.weight.narrow(0, start, rows)
        dst.copy_(_to_float(src) if isinstance(src, GgufBlocks) else src)

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)

    def embed(self, layer, ids, dtype):
        return F.embedding(ids, layer.weight)

    def storage(self, layer):
        return [layer.weight]


class Int8Method(LinearMethod):
    """Per-output-row symmetric int8: w[n, k] = qweight[n, k] * scales[n]."""

    name = "int8"

    def create_weights(self, layer, out_features, in_features, dtype):
        layer.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        layer.register_buffer("scales", torch.empty(out_features, dtype=_KERNEL_DTYPE))

    def load_rows(self, layer, start, src):
        out, cols = layer.qweight.shape
        _check_rows(layer, start, src, out, cols)
        for i, w in _row_chunks(src):
            scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(_KERNEL_DTYPE)  # [n]
            q = torch.round(w / scale.float()[:, None]).clamp_(-128, 127)
            layer.qweight[start + i : start + i + len(w)] = q.to(torch.int8)
            layer.scales[start + i : start + i + len(w)] = scale

    def apply(self, layer, x, bias):
        if _is_kernel_input(x):  # the decode hot path: no reshapes, no casts
            y = torch._weight_int8pack_mm(x, layer.qweight, layer.scales)
        else:
            flat = x.reshape(-1, x.shape[-1]).to(_KERNEL_DTYPE).contiguous()
            y = torch._weight_int8pack_mm(flat, layer.qweight, layer.scales)
            y = y.view(*x.shape[:-1], -1).to(x.dtype)
        return y if bias is None else y + bias

    def embed(self, layer, ids, dtype):
        rows = F.embedding(ids, layer.qweight).to(dtype)
        return rows * layer.scales[ids, None].to(dtype)

    def storage(self, layer):
        return [layer.qweight, layer.scales]


class Int4Method(LinearMethod):
    """4-bit groups of 32 along ``in``: w = (code - 8) * scale + zero, in tinygemm's CPU layout.

    The packed layout puts output rows in blocks of 64 (AVX-512; 32 on AVX2), so a shard
    can be packed on its own when its row offset is a multiple of ``ROW_ALIGN``.
    """

    name = "int4"
    ROW_ALIGN = 64

    def create_weights(self, layer, out_features, in_features, dtype):
        if in_features % GROUP:
            raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {in_features}")
        layer.register_buffer(
            "qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8)
        )
        layer.register_buffer(  # [in / 32, out, (scale, zero)], the kernel's layout
            "scale_zeros",
            torch.empty(in_features // GROUP, out_features, 2, dtype=_KERNEL_DTYPE),
        )

    def load_rows(self, layer, start, src):
        out, cols = layer.qweight.shape[0], layer.qweight.shape[1] * 2
        rows = _check_rows(layer, start, src, out, cols)
        groups = int4_groups(src) if _is_int4_exact(src) else round_to_int4(_to_float(src))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.codes, 1)
        layer.qweight[start : start + rows] = packed
        layer.scale_zeros[:, start : start + rows, 0] = groups.scale.t()
        layer.scale_zeros[:, start : start + rows, 1] = groups.zero.t()

    def apply(self, layer, x, bias):
        if _is_kernel_input(x):  # the decode hot path: no reshapes, no casts
            y = torch._weight_int4pack_mm_for_cpu(x, layer.qweight, GROUP, layer.scale_zeros)
        else:
            flat = x.reshape(-1, x.shape[-1]).to(_KERNEL_DTYPE).contiguous()
            y = torch._weight_int4pack_mm_for_cpu(flat, layer.qweight, GROUP, layer.scale_zeros)
            y = y.view(*x.shape[:-1], -1).to(x.dtype)
        return y if bias is None else y + bias

    def storage(self, layer):
        return [layer.qweight, layer.scale_zeros]


def _is_kernel_input(x: torch.Tensor) -> bool:
    """A [T, in] contiguous bfloat16 tensor: what the kernels take as it is."""
    return x.dtype == _KERNEL_DTYPE and x.dim() == 2 and x.is_contiguous()


def _is_int4_exact(src: Source) -> bool:
    from tokenmill.quant.gguf_blocks import INT4_EXACT_TYPES

    return isinstance(src, GgufBlocks) and src.qtype in INT4_EXACT_TYPES


def round_to_int4(w: torch.Tensor) -> Int4Groups:
    """Asymmetric round-to-nearest of float32 [N, K] in groups of 32 (min/max per group)."""
    n, k = w.shape
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15)
    return Int4Groups(codes.to(torch.int32).view(n, k), scale, lo + 8 * scale)


METHODS: dict[str, LinearMethod] = {m.name: m for m in (DenseMethod(), Int8Method(), Int4Method())}
