"""The CPU's arithmetic limits, measured: multiply-adds per second of one core and of all.

    python benchmarks/cpu_peak.py [--seconds S]

Runs a loop of independent vector multiply-adds (20 accumulators, so latency never
binds) for each instruction the kernels use, and prints the rate:
  int8   vpdpbusd zmm: 64 unsigned x signed byte products per instruction (VNNI)
  int8y  vpdpbusd ymm: the same at half width (tells how many ports run VNNI)
  fp32   vfmadd231ps zmm: 16
  bf16   vdpbf16ps zmm: 32
Other benchmarks import ``peaks()`` to report achieved work as a fraction of these limits
(``benchmarks/pooling.py``). The figures are per machine and per moment: a shared or
throttled core reads lower.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#define NA 20
#define LOOP(T, INIT, OP, RED)                                                  \
    T a[NA];                                                                    \
    for (int i = 0; i < NA; i++) a[i] = INIT;                                   \
    for (long it = 0; it < iters; it++) {                                       \
        _Pragma("GCC unroll 20") for (int i = 0; i < NA; i++) a[i] = OP;        \
    }                                                                           \
    double s = 0;                                                               \
    for (int i = 0; i < NA; i++) s += RED;                                      \
    return s;

double run_int8(long iters, int seed) {
    __m512i v = _mm512_set1_epi32(seed), b = _mm512_set1_epi32(0x01010101 + seed);
    LOOP(__m512i, _mm512_set1_epi32(i), _mm512_dpbusd_epi32(a[i], v, b),
         _mm512_reduce_add_epi32(a[i]))
}
double run_int8y(long iters, int seed) {
    __m256i v = _mm256_set1_epi32(seed), b = _mm256_set1_epi32(0x01010101 + seed);
    LOOP(__m256i, _mm256_set1_epi32(i), _mm256_dpbusd_epi32(a[i], v, b),
         _mm256_extract_epi32(a[i], 0))
}
double run_fp32(long iters, int seed) {
    __m512 x = _mm512_set1_ps(0.5f * seed), y = _mm512_set1_ps(0.25f);
    LOOP(__m512, _mm512_set1_ps(0.01f * i), _mm512_fmadd_ps(a[i], x, y),
         _mm512_reduce_add_ps(a[i]))
}
double run_bf16(long iters, int seed) {
    __m512bh p = (__m512bh)_mm512_set1_epi32(0x3f803f80 + seed);
    LOOP(__m512, _mm512_set1_ps(0.01f * i), _mm512_dpbf16_ps(a[i], p, p),
         _mm512_reduce_add_ps(a[i]))
}
"""

KINDS = {"int8": 64, "int8y": 32, "fp32": 16, "bf16": 32}
"""multiply-adds per instruction"""
UNROLL = 20


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The probe compiled with ``cc -O2 -march=native``; None where that fails (no
    compiler, or a CPU without AVX512-VNNI / BF16)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    out = Path(tempfile.mkdtemp(prefix="tokenmill-peak-"))
    (out / "peak.c").write_text(SOURCE)
    cmd = [compiler, "-O2", "-march=native", "-fPIC", "-shared", str(out / "peak.c"),
           "-o", str(out / "peak.so")]  # fmt: skip
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        return None
    lib = ctypes.CDLL(str(out / "peak.so"))
    for kind in KINDS:
        fn = getattr(lib, f"run_{kind}")
        fn.argtypes, fn.restype = [ctypes.c_long, ctypes.c_int], ctypes.c_double
    return lib


def _rate(kind: str, seconds: float, threads: int) -> float:
    """Multiply-adds per second of ``threads`` threads running the ``kind`` loop at once
    (ctypes lets go of the GIL during the call)."""
    fn = getattr(_library(), f"run_{kind}")
    iters = 1_000_000
    t = time.perf_counter()
    fn(iters, 1)
    iters = max(iters, int(iters * seconds / max(time.perf_counter() - t, 1e-6)))
    workers = [threading.Thread(target=fn, args=(iters, 1)) for _ in range(threads)]
    t = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t
    return threads * iters * UNROLL * KINDS[kind] / elapsed


@functools.cache
def peaks(seconds: float = 0.3, threads: int | None = None) -> dict[str, float] | None:
    """kind -> multiply-adds/s of ``threads`` cores (default: all); best of three tries,
    each ``seconds`` long. None where the probe does not build."""
    if _library() is None:
        return None
    n = threads or os.cpu_count() or 1
    return {kind: max(_rate(kind, seconds, n) for _ in range(3)) for kind in KINDS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="length of each try")
    args = parser.parse_args()
    if _library() is None:
        raise SystemExit("the probe did not build (needs cc and AVX512-VNNI/BF16)")
    cores = os.cpu_count() or 1
    one, every = peaks(args.seconds, 1), peaks(args.seconds, cores)
    assert one is not None and every is not None
    print(f"{'kind':6} {'1 core GMAC/s':>14} {f'{cores} cores GMAC/s':>16}  vs fp32")
    for kind in KINDS:
        print(
            f"{kind:6} {one[kind] / 1e9:14.1f} {every[kind] / 1e9:16.1f}  "
            f"{one[kind] / one['fp32']:.2f}x"
        )
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
