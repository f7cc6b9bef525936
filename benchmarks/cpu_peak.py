"""The CPU's arithmetic limits, measured: multiply-adds per second of one core and of all.

    python benchmarks/cpu_peak.py [--seconds S]

Runs a loop of independent vector multiply-adds (20 accumulators, so latency never
binds) for each instruction the kernels use, where the CPU has it, and prints the rate:
  int8z  vpdpbusd zmm: 64 unsigned x signed byte products per instruction (AVX512-VNNI)
  int8y  vpdpbusd ymm: the same at half width (tells how many ports run VNNI)
  int8a  AVX2 vpmaddubsw + vpmaddwd + vpaddd: 32 byte products per three instructions
         (bytes into int32 at every step, without VNNI)
  int8h  AVX2 vpmaddubsw + vpaddw: 32 byte products per two instructions, summed in int16
         (how the AVX2 affine_gemm runs: int16 sums over a group of 32, widened once per
         group, so this is its limit)
  fp32z  vfmadd231ps zmm: 16
  fp32y  vfmadd231ps ymm: 8 (AVX2 + FMA)
  bf16   vdpbf16ps zmm: 32 (AVX512-BF16)
``peaks()`` also gives ``int8`` and ``fp32``: the best of each family this CPU runs (the
limit of the kernels' ISA level). Other benchmarks import it to report achieved work as a
fraction of these limits (``benchmarks/pooling.py``). The figures are per machine and per
moment: a shared or throttled core reads lower.
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

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
double run_int8z(long iters, int seed) {
    __m512i v = _mm512_set1_epi32(seed), b = _mm512_set1_epi32(0x01010101 + seed);
    LOOP(__m512i, _mm512_set1_epi32(i), _mm512_dpbusd_epi32(a[i], v, b),
         _mm512_reduce_add_epi32(a[i]))
}
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
double run_int8y(long iters, int seed) {
    __m256i v = _mm256_set1_epi32(seed), b = _mm256_set1_epi32(0x01010101 + seed);
    LOOP(__m256i, _mm256_set1_epi32(i), _mm256_dpbusd_epi32(a[i], v, b),
         _mm256_extract_epi32(a[i], 0))
}
#endif
#ifdef __AVX2__
/* the accumulator's bytes are the unsigned operand, so nothing is loop-invariant */
double run_int8a(long iters, int seed) {
    __m256i b = _mm256_set1_epi32(0x01010101 + seed), ones = _mm256_set1_epi16(1);
    LOOP(__m256i, _mm256_set1_epi32(i),
         _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a[i], b), ones)),
         _mm256_extract_epi32(a[i], 0))
}
#endif
#ifdef __AVX2__
double run_int8h(long iters, int seed) {
    __m256i b = _mm256_set1_epi32(0x01010101 + seed);
    LOOP(__m256i, _mm256_set1_epi32(i), _mm256_add_epi16(a[i], _mm256_maddubs_epi16(a[i], b)),
         _mm256_extract_epi32(a[i], 0))
}
#endif
#ifdef __AVX512F__
double run_fp32z(long iters, int seed) {
    __m512 x = _mm512_set1_ps(0.5f * seed), y = _mm512_set1_ps(0.25f);
    LOOP(__m512, _mm512_set1_ps(0.01f * i), _mm512_fmadd_ps(a[i], x, y),
         _mm512_reduce_add_ps(a[i]))
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
double run_fp32y(long iters, int seed) {
    __m256 x = _mm256_set1_ps(0.5f * seed), y = _mm256_set1_ps(0.25f);
    LOOP(__m256, _mm256_set1_ps(0.01f * i), _mm256_fmadd_ps(a[i], x, y),
         _mm256_cvtss_f32(a[i]))
}
#endif
#ifdef __AVX512BF16__
double run_bf16(long iters, int seed) {
    __m512bh p = (__m512bh)_mm512_set1_epi32(0x3f803f80 + seed);
    LOOP(__m512, _mm512_set1_ps(0.01f * i), _mm512_dpbf16_ps(a[i], p, p),
         _mm512_reduce_add_ps(a[i]))
}
#endif
"""

KINDS = {"int8z": 64, "int8y": 32, "int8h": 32, "int8a": 32, "fp32z": 16, "fp32y": 8, "bf16": 32}
"""multiply-adds per loop step (one instruction; int8h: two, int8a: three)"""
BEST = {"int8": ("int8z", "int8h"), "fp32": ("fp32z", "fp32y")}
"""family -> its kinds, best first: ``peaks()[family]`` is the first this CPU runs"""
UNROLL = 20


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The probes this CPU runs, compiled with ``cc -O2 -march=native``; None where that
    fails (no compiler) or none is built (a CPU below AVX2)."""
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
    for kind in kinds(lib):
        fn = getattr(lib, f"run_{kind}")
        fn.argtypes, fn.restype = [ctypes.c_long, ctypes.c_int], ctypes.c_double
    return lib if kinds(lib) else None


def kinds(lib: ctypes.CDLL | None = None) -> tuple[str, ...]:
    """The kinds whose probe was built (the ones the compiler's -march=native has)."""
    lib = lib or _library()
    return tuple(k for k in KINDS if lib is not None and hasattr(lib, f"run_{k}"))


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
    """kind -> multiply-adds/s of ``threads`` cores (default: all), for each kind this CPU
    runs and each family of ``BEST``; best of three tries, each ``seconds`` long. None
    where the probe does not build."""
    if _library() is None:
        return None
    n = threads or os.cpu_count() or 1
    rates = {kind: max(_rate(kind, seconds, n) for _ in range(3)) for kind in kinds()}
    for family, options in BEST.items():
        best = next((k for k in options if k in rates), None)
        if best is not None:
            rates[family] = rates[best]
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="length of each try")
    args = parser.parse_args()
    if _library() is None:
        raise SystemExit("the probe did not build (needs cc and an AVX2 CPU)")
    cores = os.cpu_count() or 1
    one, every = peaks(args.seconds, 1), peaks(args.seconds, cores)
    assert one is not None and every is not None
    print(f"{'kind':6} {'1 core GMAC/s':>14} {f'{cores} cores GMAC/s':>16}  vs fp32")
    for kind in one:
        print(
            f"{kind:6} {one[kind] / 1e9:14.1f} {every[kind] / 1e9:16.1f}  "
            f"{one[kind] / one['fp32']:.2f}x"
        )
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
