"""16-bit float weights (bfloat16, float16), or float32 ones, times float32 activations:
``kernels/dense16_gemm.c``.

Tiles of 16 output rows, each ``[K2 = ceil(K / 2)][16 rows][2 inputs]`` in the weight's
own dtype, zero-padded past N rows and K inputs, so any shape packs. A kernel (``KERNELS``)
is picked once per weight format by ``best_kernel`` and passed on every call. Float32
weights take the native kernel only where it beats PyTorch's BLAS (``fp32_native``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tokenmill import native
from tokenmill.env import TOKENMILL_BF16_KERNEL, TOKENMILL_FP32_GEMM

TILE = 16
KERNELS: Mapping[str, tuple[int, torch.dtype]] = {
    "bf16-avx512bf16": (0, torch.bfloat16),  # vdpbf16ps, activations as two bfloat16 terms
    "bf16-fma": (1, torch.bfloat16),  # weights widened to float32, float32 FMAs
    "fp16-fma": (2, torch.float16),  # vcvtph2ps (F16C), float32 FMAs
    "fp32-fma": (3, torch.float32),  # float32 weights, the fp16 kernel's FMAs
    "bf16-amx": (4, torch.bfloat16),  # AMX-BF16 tiles, activations as two bfloat16 terms
    "bf16-avx512bf16-1": (5, torch.bfloat16),  # vdpbf16ps, activations as one bfloat16 term
}
"""Kernel name -> (id in dense16_gemm.c, weight dtype)."""
NATIVE_CODE_BASE = 16
"""decoder_layer.c's ``Proj.bits`` for a 16-bit weight: NATIVE_CODE_BASE + kernel id."""


def has_avx512_bf16() -> bool:
    """The CPU has AVX512-BF16 and the built library was compiled with it."""
    lib = native._library()
    return lib is not None and "avx512_bf16" in native._cpu_flags() and bool(lib.dense16_has_bf16())


def has_amx() -> bool:
    """The CPU has AMX-BF16, the built library was compiled with it, and Linux grants this
    process the tile state (``arch_prctl``; a VM may refuse it: then no AMX, never SIGILL)."""
    lib = native._library()
    flags = native._cpu_flags()
    return (
        lib is not None
        and {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags
        and bool(lib.dense16_amx_enable())
    )


ONE_TERM_KERNEL = "bf16-avx512bf16-1"
"""bfloat16 weights with activation_precision="low": activations rounded to bfloat16."""


def best_kernel(dtype: torch.dtype, activation_terms: int = 2) -> str:
    """The kernel here for weights of ``dtype`` (bfloat16, float16 or float32).
    ``activation_terms`` 1: bfloat16 weights only, on AVX512-BF16 (``ONE_TERM_KERNEL``).

    bfloat16 (``$TOKENMILL_BF16_KERNEL``, default auto): AMX where the process may use it,
    else the float32 FMAs on widened weights, which beat ``vdpbf16ps`` where it was measured
    (two Sapphire Rapids-class Xeon cores: 42-182 vs 29-59 GMAC/s; its two-term dot products
    cost two instructions per input pair)."""
    if activation_terms == 1:
        if dtype != torch.bfloat16 or not has_avx512_bf16():
            raise ValueError(
                "activation_precision='low' on 16-bit or float32 weights needs bfloat16 "
                f"weights and a CPU with AVX512-BF16 (here: {dtype}, AVX512-BF16 "
                f"{'yes' if has_avx512_bf16() else 'no'}); use activation_precision='high'"
            )
        return ONE_TERM_KERNEL
    if dtype == torch.float32:
        return FP32_KERNEL
    if dtype == torch.float16:
        return "fp16-fma"
    choice = TOKENMILL_BF16_KERNEL.get()
    ready = {
        "amx": has_amx,
        "avx512bf16": has_avx512_bf16,
        "fma": lambda: native.active_isa() is not None,
    }
    if choice == "auto":
        return "bf16-amx" if has_amx() else "bf16-fma"
    if not ready[choice]():
        raise ValueError(
            f"TOKENMILL_BF16_KERNEL={choice} can not run here (CPU flags, the native library, "
            "or for amx the OS's tile permission); unset it to take the best kernel"
        )
    return {"amx": "bf16-amx", "avx512bf16": "bf16-avx512bf16", "fma": "bf16-fma"}[choice]


FP32_KERNEL = "fp32-fma"


def fp32_native() -> bool:
    """Whether float32 weights go through the native ``fp32-fma`` kernel here, rather than
    PyTorch's BLAS: ``$TOKENMILL_FP32_GEMM``. ``auto`` (the variable's default) is yes on an
    AVX-512 CPU that is not Intel's, where the MKL that PyTorch ships runs float32 at its
    AVX2 rate (two Zen 5 cores: ~95 GMAC/s at 1500 rows against this kernel's ~230; on
    Intel it runs AVX-512); at one to a few rows (decode) it is 2-4x MKL on two Zen 4 cores."""
    choice = TOKENMILL_FP32_GEMM.get()
    if choice == "torch":
        return False
    isa = native.active_isa()
    if choice == "native":
        if isa is None:
            raise ValueError(
                "TOKENMILL_FP32_GEMM=native needs the native CPU kernels (x86-64 with "
                "AVX2+FMA+F16C and a C compiler); unset it or use torch"
            )
        return True
    return isa == "avx512" and native.cpu_vendor() != "GenuineIntel"


def tile_shape(n: int, k: int) -> tuple[int, int, int, int]:
    return (-(-n // TILE), -(-k // 2), TILE, 2)


def empty_tiles(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Storage for an [n, k] weight; the padding (last tile's extra rows, odd k) is zero."""
    tiles = torch.empty(tile_shape(n, k), dtype=dtype)
    tiles[-1].zero_()
    if k % 2:
        tiles[:, -1, :, 1].zero_()
    return tiles


def write_rows(tiles: torch.Tensor, start: int, w: torch.Tensor) -> None:
    """Store w [rows, k] as output rows ``start : start + rows`` of ``tiles`` (cast to its dtype)."""
    rows, k = w.shape
    k2 = tiles.shape[1]
    w = w.to(tiles.dtype)
    if k % 2:
        w = torch.cat((w, w.new_zeros(rows, 1)), dim=1)
    w = w.view(rows, k2, 2)
    end, r = start + rows, start
    while r < end:  # a partial first tile, whole tiles in one copy, a partial last tile
        t, lane = divmod(r, TILE)
        if lane == 0 and end - r >= TILE:
            whole = (end - r) // TILE
            src = w[r - start : r - start + whole * TILE].view(whole, TILE, k2, 2)
            tiles[t : t + whole] = src.permute(0, 2, 1, 3)
            r += whole * TILE
        else:
            n = min(TILE - lane, end - r)
            tiles[t, :, lane : lane + n] = w[r - start : r - start + n].permute(1, 0, 2)
            r += n


_ROW_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
"""``dense16_rows``' code for each tile dtype."""


def read_rows(tiles: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Rows [len(rows), k] float32 (an embedding lookup; widening is exact): one native call
    where the kernels run (a decode step's one row: ~2 us against ~0.15 ms of indexing)."""
    if native.available() and rows.dtype == torch.int64 and rows.is_contiguous():
        out = torch.empty(len(rows), k, dtype=torch.float32)
        code = _ROW_DTYPES[tiles.dtype]
        native._need().dense16_rows(
            tiles.data_ptr(), code, k, rows.data_ptr(), len(rows), out.data_ptr()
        )
        return out
    picked = tiles[rows // TILE, :, rows % TILE]  # [R, K2, 2]
    return picked.reshape(len(rows), -1)[:, :k].float()


def gemm(x: torch.Tensor, tiles: torch.Tensor, kernel: int, n: int) -> torch.Tensor:
    """x [M, K] float32 contiguous -> y [M, n] float32."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    native._need().dense16_gemm(x.data_ptr(), m, k, tiles.data_ptr(), kernel, n, y.data_ptr())
    return y


def greedy(
    x: torch.Tensor, tiles: torch.Tensor, kernel: int, n: int, wnorm: float, approx: torch.Tensor
) -> torch.Tensor:
    """x [M, K] float32 contiguous, bfloat16 tiles of an [n, K] head, ``kernel`` its exact
    kernel (bf16-fma or bf16-avx512bf16), ``wnorm`` >= every row's norm (``max_row_norm``),
    ``approx`` >= M * n float32 scratch -> [M] int64: each row's ``gemm(...).argmax(-1)``
    bit for bit, or -1 where the row must be computed in full (``dense16_greedy``)."""
    m, k = x.shape
    assert approx.numel() >= m * n and approx.dtype == torch.float32 and approx.is_contiguous()
    ids = torch.empty(m, dtype=torch.int64)
    native._need().dense16_greedy(
        x.data_ptr(), m, k, tiles.data_ptr(), kernel, n, wnorm, approx.data_ptr(), ids.data_ptr()
    )
    return ids


def max_row_norm(tiles: torch.Tensor, n: int, chunk: int = 64) -> float:
    """An upper bound of the largest Euclidean norm of the [n, K] weight's rows in
    ``tiles``, as a float32 (``greedy``'s error bound): float32 sums of squares (a tenth of
    float64's time: 0.08 s for a 49k x 576 head here), raised by their rounding's bound."""
    top = 0.0
    for start in range(0, tiles.shape[0], chunk):
        part = tiles[start : start + chunk].float().square_().sum(dim=(1, 3))  # [t, 16]
        top = max(top, float(part.max()))
    k = 2 * tiles.shape[1]
    bound = torch.tensor((top * (1 + (k + 2) * 2.0**-23)) ** 0.5, dtype=torch.float32)
    return float(torch.nextafter(bound, torch.tensor(float("inf"))))
