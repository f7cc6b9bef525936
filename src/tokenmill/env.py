"""Every ``TOKENMILL_*`` environment variable, typed, with its default and meaning.

This is the only module that reads ``os.environ``. Variables are read when asked
for (not at import), so tests can set them with ``monkeypatch.setenv``.
Add a variable by declaring one more ``EnvVar`` below; nothing else changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: its raw default and how to parse a raw value."""

    name: str
    default: str
    """Raw value used when the variable is unset or empty."""
    parse: Callable[[str], T]
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name) or self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"environment variable {self.name}={raw!r} is invalid: {e}") from e


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


ENV_VARS: dict[str, EnvVar] = {}


def _declare(var: EnvVar[T]) -> EnvVar[T]:
    ENV_VARS[var.name] = var
    return var


TOKENMILL_CACHE_DIR: EnvVar[Path] = _declare(
    EnvVar(
        "TOKENMILL_CACHE_DIR",
        default="~/.cache/tokenmill",
        parse=_path,
        doc="Root of tokenmill's on-disk caches (converted GGUF tokenizers live in "
        "<root>/tokenizers/<key>, prepared-model bundles in <root>/bundles/<key> unless "
        "cache_dir says otherwise). Safe to delete at any time (not while a process runs "
        "from a bundle).",
    )
)


TOKENMILL_NUM_THREADS: EnvVar[int] = _declare(
    EnvVar(
        "TOKENMILL_NUM_THREADS",
        default="0",
        parse=int,
        doc="CPU threads for the model's kernels. 0 (the default): PyTorch's own choice "
        "(OMP_NUM_THREADS when set), lowered to the CPUs this process may run on, so a "
        "container's CPU set is never oversubscribed.",
    )
)


TOKENMILL_NATIVE_ISA: EnvVar[str] = _declare(
    EnvVar(
        "TOKENMILL_NATIVE_ISA",
        default="",
        parse=lambda raw: raw.strip().lower(),
        doc="ISA level the native CPU kernels are built for: 'avx512' (AVX-512F/BW + VNNI) "
        "or 'avx2' (AVX2 + FMA + F16C). Empty (the default): the best this CPU runs. A lower "
        "level runs the AVX2 code on an AVX-512 CPU (tests, comparisons); a level the CPU "
        "lacks, or an unknown name, is an error.",
    )
)


def _one_of(*values: str) -> Callable[[str], str]:
    """A parser taking one of ``values`` (case and spaces ignored)."""

    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in values:
            raise ValueError(f"use {', '.join(values[:-1])} or {values[-1]}")
        return value

    return parse


def _flag(raw: str) -> bool:
    """A parser taking 0 or 1."""
    return _one_of("0", "1")(raw) == "1"


TOKENMILL_FP32_GEMM: EnvVar[str] = _declare(
    EnvVar(
        "TOKENMILL_FP32_GEMM",
        default="auto",
        parse=_one_of("auto", "native", "torch"),
        doc="Who multiplies float32 weights on CPU (float32 HF folders, hybrids, media "
        "towers, Whisper): 'native' (the native kernels' float32 GEMM), 'torch' (PyTorch's "
        "BLAS), or 'auto' (the default): native on an AVX-512 CPU that is not Intel's, "
        "where the BLAS PyTorch ships (MKL) runs float32 at its AVX2 rate, else torch.",
    )
)


TOKENMILL_BF16_KERNEL: EnvVar[str] = _declare(
    EnvVar(
        "TOKENMILL_BF16_KERNEL",
        default="auto",
        parse=_one_of("auto", "amx", "avx512bf16", "fma"),
        doc="Which native kernel multiplies bfloat16 weights on CPU (chosen once at load, "
        "shown in the load log): 'amx' (AMX-BF16 tiles), 'avx512bf16' (vdpbf16ps), 'fma' "
        "(weights widened to float32, float32 FMAs: every x86-64 CPU with AVX2), or 'auto' "
        "(the default): amx where the CPU has it and Linux grants the process its tile state, "
        "else fma. A kernel this CPU or library can not run is an error.",
    )
)


TOKENMILL_GREEDY_HEAD: EnvVar[bool] = _declare(
    EnvVar(
        "TOKENMILL_GREEDY_HEAD",
        default="1",
        parse=_flag,
        doc="1 (the default): on CPU, a step whose every row is plain greedy (no logprobs, "
        "penalties, bias, grammar or other processor) takes its tokens from a bfloat16 "
        "output head in one native call: logits with one bfloat16 activation term, then the "
        "exact kernel on the few tokens that could be the maximum; the same tokens as the "
        "full head, bit for bit (sampling/greedy_head.py). 0: always the full head.",
    )
)


TOKENMILL_SCAN_KERNEL: EnvVar[str] = _declare(
    EnvVar(
        "TOKENMILL_SCAN_KERNEL",
        default="auto",
        parse=_one_of("auto", "native", "triton", "torch"),
        doc="Which kernels run the recurrent layers' scans (Gated DeltaNet, Mamba2; chosen "
        "once at load, shown in the load log): 'native' (the C decode steps, CPU), 'triton' "
        "(CUDA; on CPU only under TRITON_INTERPRET=1), 'torch' (the PyTorch reference), or "
        "'auto' (the default): triton on CUDA, native on CPU where the native kernels build, "
        "else torch. A kernel that can not run here is an error.",
    )
)


def cache_dir() -> Path:
    """Root folder of tokenmill's caches (``$TOKENMILL_CACHE_DIR``, default ~/.cache/tokenmill)."""
    return TOKENMILL_CACHE_DIR.get()


TOKENMILL_HOST_MALLOC: EnvVar[bool] = _declare(
    EnvVar(
        "TOKENMILL_HOST_MALLOC",
        default="1",
        parse=_flag,
        doc="1 (the default): on Linux, tokenmill raises glibc malloc's map and trim "
        "thresholds (32 MB, 256 MB) when an engine starts, so a step's multi-megabyte "
        "tensors reuse freed heap memory instead of taking a page fault per 4 KB; up to "
        "256 MB of freed memory stays resident. 0: leave malloc as it is (your own "
        "MALLOC_* settings or a preloaded allocator).",
    )
)
