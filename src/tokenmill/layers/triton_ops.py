"""Fused Triton kernels of the small per-layer ops: (residual add +) RMSNorm, SiLU-and-mul,
rotary in place. One launch each instead of 2-5 PyTorch kernels.

Imported only through ``layers.ops.triton_kernels`` (``import tokenmill`` never imports
triton). Every launch reads only tensors and fixed shapes (no host sync), so it can be
captured in a CUDA graph. Norm and activation compute in float32 and round once to the
output dtype; rotary rounds each product and the sum as the PyTorch path does, so it stays
bit-identical to Hugging Face.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    inner, stride_x0, stride_x1, stride_res, eps_sum,
    DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Program r: one row of DIM. x row r sits at (r // inner) * stride_x0 + (r % inner) *
    stride_x1 ([T, H, D] views of a packed qkv). With HAS_RESIDUAL: res[r] += x[r] (in res's
    dtype, stored) and res[r] is the row normalized. out[r] = v / sqrt(||v||^2 + eps_sum) * w,
    w = (w or 1 + w) * sqrt(DIM) in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < DIM
    x_row = x_ptr + (row // inner) * stride_x0 + (row % inner) * stride_x1
    v = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        v = (r + v).to(res_ptr.dtype.element_ty)  # rounded as residual.add_(x) rounds
        tl.store(res_ptr + row * stride_res + cols, v, mask=ok)
        v = v.to(tl.float32)
    norm = tl.sqrt(tl.sum(v * v, axis=0) + eps_sum)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * DIM + cols, (v / norm * w).to(out_ptr.dtype.element_ty), mask=ok)


def _norm_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps_sum: float) -> torch.Tensor | None:
    """x [..., D] (last dim contiguous; rows may be strided, e.g. q heads of a packed qkv)
    -> [..., D] new, x's dtype. weight [D] float32, already (w or 1 + w) * sqrt(D).
    None when the layout is not handled (the caller falls back to PyTorch)."""
    dim = x.shape[-1]
    if x.stride(-1) != 1 or x.dim() > 3:
        return None
    x3 = x.view(1, 1, dim) if x.dim() == 1 else x if x.dim() == 3 else x.unsqueeze(1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return out
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows,)](
        x3, x3, weight, out, x3.shape[1], x3.stride(0), x3.stride(1), 0, eps_sum,
        DIM=dim, BLOCK=block, HAS_RESIDUAL=False, num_warps=_norm_warps(block),
    )  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps_sum: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """residual [T, D] += x [T, D] in place, then (rms_norm(residual), residual); None when
    the layout is not handled (2-D, same shape, last dims contiguous)."""
    if x.dim() != 2 or x.shape != residual.shape or x.stride(1) != 1 or residual.stride(1) != 1:
        return None
    rows, dim = residual.shape
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if rows == 0:
        return out, residual
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows,)](
        x, residual, weight, out, 1, x.stride(0), 0, residual.stride(0), eps_sum,
        DIM=dim, BLOCK=block, HAS_RESIDUAL=True, num_warps=_norm_warps(block),
    )  # fmt: skip
    return out, residual


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, INTER: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, tile): out[row, tile] = silu(gate) * up, x[row] = [gate | up] (2 INTER)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=ok, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up  # exp overflow -> inf -> silu = -0, as PyTorch
    tl.store(out_ptr + row * INTER + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """x [..., 2 I] = [gate | up] -> silu(gate) * up [..., I], x's dtype; None when the
    layout is not handled (last dim not contiguous, or rows not a single stride)."""
    inter = x.shape[-1] // 2
    if x.stride(-1) != 1:
        return None
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # a view when rows are uniform
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    grid = (x2.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x2, out, x2.stride(0), INTER=inter, BLOCK=block)
    return out


@triton.jit
def _halves(row_ptr, i, ok, HALF: tl.constexpr):
    """A table row [D] -> its two halves as float32 [1, HALF_PAD] each."""
    a = tl.load(row_ptr + i, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(row_ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
    return a[None, :], b[None, :]


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr,
    heads, stride_x0, stride_x1, stride_cos, stride_sin,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program (t, head tile): x[t, h] = [x1 | x2] (D = 2 HALF) becomes
    [x1 c1 + x2 s1 | x2 c2 + x1 s2] with cos[t] = [c1 | c2], sin[t] = [s1 | s2] = [-sin | sin];
    each product and the sum rounded to x's dtype, as the PyTorch path rounds them."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)
    col_ok = i < HALF
    ok = (h[:, None] < heads) & col_ok[None, :]
    c1, c2 = _halves(cos_ptr + t * stride_cos, i, col_ok, HALF)
    s1, s2 = _halves(sin_ptr + t * stride_sin, i, col_ok, HALF)
    p = x_ptr + t * stride_x0 + h[:, None] * stride_x1 + i[None, :]
    dt = x_ptr.dtype.element_ty
    x1 = tl.load(p, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=ok, other=0.0).to(tl.float32)
    y1 = (x1 * c1).to(dt).to(tl.float32) + (x2 * s1).to(dt).to(tl.float32)
    y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(p, y1.to(dt), mask=ok)
    tl.store(p + HALF, y2.to(dt), mask=ok)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate x [T, heads, D] (any row/head strides, last dim contiguous) in place with
    cos, sin [T, 1, D] (RopeTables). Returns x, or None when the layout is not handled."""
    t, heads, d = x.shape
    if x.stride(2) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or d % 2:
        return None
    if t == 0 or heads == 0:
        return x
    half = d // 2
    block_h = min(triton.next_power_of_2(heads), 16)
    _rotary_kernel[(t, triton.cdiv(heads, block_h))](
        x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), BLOCK_H=block_h,
        enable_fp_fusion=False,  # no fma: keep the products rounded (HF bit parity)
    )  # fmt: skip
    return x
