"""The native affine-group GEMM at few rows: time per call, t(M)/t(1) and the achieved
fraction of the int8 VNNI peak, per projection of SmolLM2-135M (random weights, the
model's shapes), for M = 1, 2, 4, 9, 16, 32 rows (a decode step, verify steps, a batch).

    python benchmarks/affine_rows.py [--threads 1] [--bits 4] [--rounds 5] [--peak]

Each call's int8 work counts two vpdpbusd byte products per multiply-add (the kernel's two
activation terms); ``--peak`` measures the limit with ``cpu_peak.py`` in the same run.
Times are medians over rounds, the row counts alternating within a round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill import native

# (name, out features N, in features K) of one SmolLM2-135M layer, and its tied LM head
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576)]  # fmt: skip
ROWS = [1, 2, 4, 9, 16, 32]
TERMS = 2  # int8 activation terms per multiply-add (affine_gemm.c)


def tiles_for(n: int, k: int, bits: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.01
    offset = -scale * 2 ** (bits - 1)
    return native.pack_tiles(codes, scale, offset, bits)


def seconds(x: torch.Tensor, tiles: torch.Tensor, bits: int, n: int, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        native.affine_gemm(x, tiles, bits, n)
    return (time.perf_counter() - start) / calls


def forward_seconds(layers: list, xs: dict, bits: int, m: int) -> float:
    """One pass over every layer's projections, weights streamed from memory (> L3)."""
    start = time.perf_counter()
    for _name, n, k, tiles in layers:
        native.affine_gemm(xs[m, k], tiles, bits, n)
    return time.perf_counter() - start


def streamed(args, peak: float | None) -> None:
    """The model's 30 layers (distinct weights, about 66 MB at 4 bits) and its head."""
    layers = [(name, n, k, tiles_for(n, k, args.bits)) for _ in range(30)
              for name, n, k in SHAPES[:-1]] + [(*SHAPES[-1], tiles_for(*SHAPES[-1][1:], args.bits))]  # fmt: skip
    macs = sum(n * k for _, n, k, _ in layers)
    xs = {(m, k): torch.randn(m, k) for m in ROWS for k in {k for _, _, k, _ in layers}}
    times: dict[int, list[float]] = {m: [] for m in ROWS}
    for r in range(args.rounds):
        for m in ROWS if r % 2 == 0 else ROWS[::-1]:
            times[m].append(forward_seconds(layers, xs, args.bits, m))
    t1 = statistics.median(times[1])
    cells = []
    for m in ROWS:
        t = statistics.median(times[m])
        frac = f" {TERMS * m * macs / t / peak:4.0%}" if peak else ""
        cells.append(f"M={m}: {t * 1e3:6.2f}ms x{t / t1:4.2f}{frac}")
    print("streamed 30 layers + head: " + " | ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--peak", action="store_true", help="measure the int8 peak too")
    ap.add_argument("--streamed-only", action="store_true", help="only the whole-model pass")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    peak = None
    if args.peak:
        from cpu_peak import peaks

        peak = peaks(threads=args.threads)["int8"]
    print(f"threads {args.threads}, {args.bits}-bit weights"
          + (f", int8 peak {peak / 1e9:.0f} GMAC/s" if peak else ""))  # fmt: skip
    streamed(args, peak)
    if args.streamed_only:
        return
    total = {m: 0.0 for m in ROWS}
    for name, n, k in SHAPES:
        tiles = tiles_for(n, k, args.bits)
        xs = {m: torch.randn(m, k) for m in ROWS}
        calls = max(3, int(2e7 / (n * k)))
        times: dict[int, list[float]] = {m: [] for m in ROWS}
        for r in range(args.rounds):
            order = ROWS if r % 2 == 0 else ROWS[::-1]
            for m in order:
                times[m].append(seconds(xs[m], tiles, args.bits, n, calls))
        cells = []
        for m in ROWS:
            t = statistics.median(times[m])
            total[m] += t
            frac = f" {TERMS * m * n * k / t / peak:4.0%}" if peak else ""
            cells.append(f"{t * 1e6:7.0f}us x{t / statistics.median(times[1]):4.2f}{frac}")
        print(f"{name:8s} " + " | ".join(f"M={m}: {c}" for m, c in zip(ROWS, cells)))
    print("layer+head total t(M)/t(1): "
          + ", ".join(f"{m}: {total[m] / total[1]:.2f}" for m in ROWS))  # fmt: skip


if __name__ == "__main__":
    main()
