"""One decode step of the recurrent scans, per layer: the native C kernels vs the PyTorch
reference (gather the slots' states, the step, scatter them back), at decode shapes.

    python benchmarks/recurrent_step.py                  # batches 1, 8, 32
    python benchmarks/recurrent_step.py --batch 1 4 --iters 200

Shapes: the gated delta rule at Qwen3.5-0.8B's (16 heads, K = V = 128) and Mamba2's SSD at
Mamba2-370m's (32 heads of 64, state 128, one group); float32 states in a pool of slots
with the conv window in front of each (the layer's cache layout), malloc set up as an
engine sets it (``host_memory.keep_freed_memory``). Times are medians of ``--repeat`` runs
of ``--iters`` steps each, microseconds per step (one layer).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, table  # noqa: E402

from tokenmill.host_memory import keep_freed_memory  # noqa: E402
from tokenmill.layers.recurrent import delta_rule  # noqa: E402
from tokenmill.layers.recurrent.scan import (  # noqa: E402
    NATIVE_SCAN,
    REFERENCE_SCAN,
    ScanKernels,
)

DELTA = (16, 16, 128, 128)  # heads, q/k heads, K, V
SSD = (32, 1, 64, 128)  # heads, groups, P, N


def _pool(batch: int, heads: int, rows: int, cols: int) -> torch.Tensor:
    cache = torch.randn(batch + 1, 3 * 1024 + heads * rows * cols)  # conv window, then state
    return cache[:, 3 * 1024 :].view(batch + 1, heads, rows, cols)


def delta_args(batch: int) -> tuple[torch.Tensor, ...]:
    heads, k_heads, dk, dv = DELTA
    q = delta_rule.l2_normalize(torch.randn(batch, k_heads, dk)) * dk**-0.5
    k = delta_rule.l2_normalize(torch.randn(batch, k_heads, dk))
    v, g, beta = torch.randn(batch, heads, dv), -torch.rand(batch, heads), torch.rand(batch, heads)
    return q, k, v, g, beta, _pool(batch, heads, dk, dv), torch.arange(batch), torch.ones(batch)


def ssd_args(batch: int) -> tuple[torch.Tensor, ...]:
    heads, groups, p, n = SSD
    x, dt = torch.randn(batch, heads, p), torch.rand(batch, heads)
    a, d = -torch.rand(heads), torch.randn(heads)
    b, c = torch.randn(batch, groups, n), torch.randn(batch, groups, n)
    return x, dt, a, b, c, d, _pool(batch, heads, p, n), torch.arange(batch), torch.ones(batch)


def per_step_us(kernels: ScanKernels, kind: str, batch: int, iters: int, repeat: int) -> float:
    step = kernels.delta_step if kind == "delta" else kernels.ssd_step
    args = delta_args(batch) if kind == "delta" else ssd_args(batch)

    def run() -> None:
        for _ in range(iters):
            step(*args)

    run()  # warm up (and build the library)
    return best_of(run, repeat) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--iters", type=int, default=20, help="steps per timed run")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs (median)")
    args = ap.parse_args()
    keep_freed_memory()
    start = time.perf_counter()
    rows = [["scan", "batch", "reference us", "native us", "speed-up"]]
    for kind in ("delta", "ssd"):
        for batch in args.batch:
            ref = per_step_us(REFERENCE_SCAN, kind, batch, args.iters, args.repeat)
            ours = per_step_us(NATIVE_SCAN, kind, batch, args.iters, args.repeat)
            rows.append([kind, str(batch), f"{ref:.0f}", f"{ours:.0f}", f"{ref / ours:.1f}x"])
    print(f"one decode step, one layer: delta {DELTA} (H, Hk, K, V), ssd {SSD} (H, G, P, N), "
          f"float32, {torch.get_num_threads()} threads ({time.perf_counter() - start:.0f} s)")  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
