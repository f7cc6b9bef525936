"""The native float32 kernel against PyTorch's BLAS on the same float32 products.

    python benchmarks/fp32_gemm.py [--reps 200]

y = x W^T for x [M, K] float32 at the rows of a decode step (1), a verify or small batch
(8, 32) and a prefill chunk (512), with the shapes of a 0.5-1B model's linears. Reports
GMAC/s of each and their ratio: ``TOKENMILL_FP32_GEMM=auto`` takes the kernel where it
wins (``native.dense16.fp32_native``). The error of both against float64 is printed too.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from tokenmill.native import dense16

SHAPES = [(1024, 3584), (1024, 1024), (3584, 1024)]  # (K, N)
ROWS = [1, 8, 32, 512]


def seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def compare(m: int, k: int, n: int, reps: int, g: torch.Generator) -> str:
    """One shape: GMAC/s of the kernel and of PyTorch, their ratio, their errors."""
    kernel, _ = dense16.KERNELS[dense16.FP32_KERNEL]
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    tiles = dense16.empty_tiles(n, k, torch.float32)
    dense16.write_rows(tiles, 0, w)
    t_native = seconds(lambda: dense16.gemm(x, tiles, kernel, n), reps)
    t_torch = seconds(lambda: torch.nn.functional.linear(x, w), reps)
    exact = x.double() @ w.double().T
    err_n = (dense16.gemm(x, tiles, kernel, n).double() - exact).abs().max().item()
    err_t = (torch.nn.functional.linear(x, w).double() - exact).abs().max().item()
    macs = m * k * n / 1e9
    return (
        f"M={m:4d} K={k:5d} N={n:5d}: native {macs / t_native:6.1f}, torch "
        f"{macs / t_torch:6.1f}, ratio {t_torch / t_native:.2f}x; "
        f"max error {err_n:.1e} / {err_t:.1e}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=200, help="calls per measurement (/20 at 512 rows)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}; GMAC/s, native / torch")
    for m in ROWS:
        reps = args.reps if m < 64 else max(args.reps // 20, 1)
        for k, n in SHAPES:
            print(compare(m, k, n, reps, g))


if __name__ == "__main__":
    main()
