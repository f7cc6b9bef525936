"""8-bit affine-group linears for many rows at once: the int8 path of encoder models.

An encoder's forward pass multiplies thousands of tokens by each weight, so the
per-token kernel of decode (``native.affine_gemm``, two int8 terms per activation) is
not the fast shape. ``affine_gemm_rows`` (``kernels/affine_gemm.c``) keeps the same
weight tiles (``native.pack_tiles``: groups of 32 inputs, ``w = scale * q + offset``)
and register-blocks 4 tokens x 32 output rows. ``terms`` picks the activation precision:
1 = one int8 per input (scale per group of 32; half the integer work), 2 = the two-term
scheme (~15 bits) for the layers whose inputs need it. A layer may also hold
``precise_terms`` for some rows only (``precise_rows``): the tokens of sequences whose
pooled output does not average the one-term rounding away (``models/bert.py``).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch
from torch import nn

from tokenmill import native
from tokenmill.quant.gguf_blocks import GROUP, affine_groups


def _kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    lib = native._library()
    if lib is None:
        raise RuntimeError(
            "the native CPU kernels are unavailable (x86-64 with AVX2+FMA+F16C and a C "
            "compiler needed)"
        )
    return _typed(lib)


@functools.cache
def _typed(lib: ctypes.CDLL) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """``lib``'s affine_gemm_rows with its argument types (once per library: one per ISA level)."""
    fn = lib.affine_gemm_rows
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ctypes.c_bool, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int, ctypes.c_int,
                   ptr, ptr, ptr, ptr]  # fmt: skip
    fn.restype = None
    return fn


class _Scratch(threading.local):
    """Per-thread buffer for the quantized activations, grown on demand."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.int8)

    def pointers(self, m: int, k: int, terms: int) -> tuple[int, int, int]:
        """(terms M K int8, M K / 32 float scales, M K / 32 float sums) addresses."""
        groups = m * k // GROUP
        need = terms * m * k + 8 * groups + 64
        if need > self.buffer.numel():
            self.buffer = torch.empty(max(need, 2 * self.buffer.numel()), dtype=torch.int8)
        base = self.buffer.data_ptr()
        scales = (base + terms * m * k + 63) // 64 * 64
        return base, scales, scales + 4 * groups


_scratch = _Scratch()


def gemm_rows(
    x: torch.Tensor,
    tiles: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    terms: int,
    residual: torch.Tensor | None = None,
    gelu: bool = False,
) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 contiguous, 8-bit ``tiles`` of W [n, K], float32
    ``bias``, ``residual`` [M, n] in x's dtype -> x W^T + bias + residual [M, n] in x's dtype;
    ``gelu``: GELU (erf form) of that, in the same pass."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype)
    b = 0 if bias is None else bias.data_ptr()
    r = 0
    if residual is not None:
        if residual.shape != (m, n) or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} != y [{m}, {n}]")
        residual = residual.contiguous()
        r = residual.data_ptr()
    qx, dx, sx = _scratch.pointers(m, k, terms)
    bf16 = x.dtype == torch.bfloat16
    args = (x.data_ptr(), bf16, m, k, tiles.data_ptr(), n, b, r, gelu, terms, y.data_ptr())
    _kernel()(*args, qx, dx, sx)
    return y


class RowsInt8Linear(nn.Module):
    """A linear layer whose weight is stored as 8-bit affine groups (float32 or bfloat16
    activations in and out)."""

    qtiles: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        terms: int,
        precise_terms: int | None = None,
    ) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % GROUP or out_features % native.TILE:
            raise ValueError(
                f"int8 needs in_features divisible by {GROUP} and out_features by "
                f"{native.TILE}, got [{out_features}, {in_features}]"
            )
        self.in_features, self.out_features, self.terms = in_features, out_features, terms
        self.precise_terms = terms if precise_terms is None else precise_terms
        g = affine_groups(weight.float(), 8)
        self.register_buffer("qtiles", native.pack_tiles(g.codes, g.scale, g.offset, 8))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @staticmethod
    def of(linear: nn.Linear, terms: int, precise_terms: int | None = None) -> RowsInt8Linear:
        return RowsInt8Linear(linear.weight.detach(), linear.bias, terms, precise_terms)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        gelu: bool = False,
        precise_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [..., in] float32 or bfloat16 -> x W^T + bias (+ residual [..., out]) [..., out]
        in x's dtype, through GELU if ``gelu``; the rows of the flattened x listed in
        ``precise_rows`` ([R] int64) with ``precise_terms``."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        flat = x.reshape(-1, self.in_features).contiguous()
        res = None if residual is None else residual.reshape(-1, self.out_features).to(x.dtype)
        terms, some = self.terms, None
        if precise_rows is not None and self.precise_terms != terms and precise_rows.numel():
            if precise_rows.numel() == flat.shape[0]:
                terms = self.precise_terms
            else:
                some = precise_rows
        y = gemm_rows(flat, self.qtiles, self.out_features, self.bias, terms, res, gelu)
        if some is not None:  # recompute those rows (few: short sequences) more precisely
            sub_res = None if res is None else res.index_select(0, some)
            sub = flat.index_select(0, some)
            n, terms = self.out_features, self.precise_terms
            y.index_copy_(0, some, gemm_rows(sub, self.qtiles, n, self.bias, terms, sub_res, gelu))
        return y.view(*x.shape[:-1], self.out_features)

    fuses_residual = True
    """``forward(x, residual)`` adds the residual in the kernel (``models/bert.py``)."""
    fuses_gelu = True
    """``forward(x, gelu=True)`` applies the exact GELU in the kernel."""

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, terms={self.terms}, "
            f"precise_terms={self.precise_terms}"
        )
