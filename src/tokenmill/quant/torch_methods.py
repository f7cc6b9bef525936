"""Fallback int8/int4 layers on PyTorch's CPU weight-only kernels (no compiler needed).

They compute in bfloat16 (their AVX-512 paths take bfloat16 activations and scales):
inputs of another dtype are cast in and the output cast back.

- ``int8``: one int8 per weight, one bfloat16 scale per output row
  (``aten._weight_int8pack_mm``); any source is re-quantized per row.
- ``int4``: 4-bit codes in groups of 32 along ``in`` with a bfloat16 scale and zero per
  group (``aten._weight_int4pack_mm_for_cpu``). GGUF Q4_0/Q4_1/Q4_K blocks load
  exactly (their scales rounded to bfloat16); other sources are rounded to nearest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.quant.base import LinearMethod, check_rows, row_chunks, to_float
from tokenmill.quant.gguf_blocks import GROUP, affine_groups

_KERNEL_DTYPE = torch.bfloat16


class Int8Method(LinearMethod):
    """Per-output-row symmetric int8: w[n, k] = qweight[n, k] * scales[n]."""

    name = "int8"

    def create_weights(self, layer, out_features, in_features, dtype):
        layer.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        layer.register_buffer("scales", torch.empty(out_features, dtype=_KERNEL_DTYPE))

    def load_rows(self, layer, start, src):
        out, cols = layer.qweight.shape
        check_rows(layer, start, src, out, cols)
        for i, part in row_chunks(src):
            w = to_float(part)
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
        rows = check_rows(layer, start, src, out, cols)
        g = affine_groups(src, 4)  # tinygemm: w = (q - 8) * scale + zero
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(g.codes.to(torch.int32), 1)
        layer.qweight[start : start + rows] = packed
        layer.scale_zeros[:, start : start + rows, 0] = g.scale.t()
        layer.scale_zeros[:, start : start + rows, 1] = (g.offset + 8 * g.scale).t()

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


TORCH_METHODS: dict[str, LinearMethod] = {"int8": Int8Method(), "int4": Int4Method()}
