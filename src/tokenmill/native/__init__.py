"""Native CPU kernels (``kernels/*.c``): built once, called through ctypes.

- ``affine_gemm``: x W^T for weights in 4/8-bit affine groups (``tokenmill.quant``);
- ``add_rms_norm``, ``rope_store_kv``, ``decode_attention``: the small per-layer steps
  of a float32 forward in one call each (``kernels/decode.c``);
- ``dense16``: x W^T for bfloat16 / float16 weights, float32 activations
  (``kernels/dense16_gemm.c``, ``dense16.py``);
- ``recurrent``: one decode step of the gated delta rule and of Mamba2's SSD, in place in
  the state pool (``kernels/recurrent.c``, ``recurrent.py``).

The C files are compiled together with the system C compiler (``cc -O3 -march=native
-fopenmp``, about two seconds) the first time they are needed and cached under
``$TOKENMILL_CACHE_DIR/kernels``, keyed by the sources, the CPU's feature flags and the ISA
level (``ISA_LEVELS``): ``avx512`` (AVX-512F/BW + VNNI) where ``/proc/cpuinfo`` has it, else
``avx2`` (AVX2 + FMA + F16C: Zen 1-3, Haswell .. Comet Lake), compiled with AVX-512 off.
``library(isa)`` builds and loads any level the CPU runs (the AVX2 code is tested on AVX-512
machines too); ``TOKENMILL_NATIVE_ISA`` picks the default one, and ``use(isa | None)`` switches
every wrapper to one level (None: off, the PyTorch path) within a block, so tests run each
level on one machine (``tests/conftest.py``: ``native_isa``, ``native_level``). The float
kernels are written once on ``kernels/simd.h`` and give the same bits at both levels. The
library links the OpenMP runtime PyTorch has already loaded, so it shares PyTorch's
threads. Without a compiler, or on a CPU below AVX2, ``available()`` is False and the
layers use PyTorch's own kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.env import TOKENMILL_NATIVE_ISA, cache_dir

logger = logging.getLogger(__name__)

_KERNELS = Path(__file__).parent / "kernels"
_SOURCES = tuple(sorted(_KERNELS.glob("*.c")))
_HEADERS = tuple(sorted(_KERNELS.glob("*.h")))
TILE, GROUP = 16, 32


@dataclass(frozen=True)
class IsaLevel:
    """An instruction set the library can be built for."""

    name: str
    flags: tuple[str, ...]
    """``/proc/cpuinfo`` flags the CPU must have to run it."""
    cflags: tuple[str, ...]
    """Compiler options selecting it (on top of -O3 -fopenmp)."""


ISA_LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("avx512", ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni"),
             ("-march=native",)),
    IsaLevel("avx2", ("avx2", "fma", "f16c"), ("-march=native", "-mno-avx512f")),
)  # fmt: skip
"""Best first. ``-mno-avx512f`` turns every AVX-512 extension off, whatever the CPU has."""
_LEVELS = {level.name: level for level in ISA_LEVELS}


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first ``field : value`` of ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.split(":", 1)[0].strip() == field:
            return line.split(":", 1)[1].strip()
    return ""


def _cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    """``GenuineIntel``, ``AuthenticAMD``, ... ("" off Linux x86)."""
    return _cpuinfo("vendor_id")


def isas_available() -> tuple[str, ...]:
    """The ISA levels this CPU runs, best first (empty off x86-64 or below AVX2)."""
    if platform.machine() != "x86_64":
        return ()
    flags = _cpu_flags()
    return tuple(lv.name for lv in ISA_LEVELS if all(f in flags for f in lv.flags))


def _check_level(isa: str, source: str) -> str:
    if isa not in _LEVELS:
        known = ", ".join(_LEVELS)
        raise ValueError(f"{source}={isa!r} is no native ISA level (one of: {known})")
    here = isas_available()
    if isa not in here:
        missing = sorted(set(_LEVELS[isa].flags) - _cpu_flags())
        runs = ", ".join(here) or "none"
        raise ValueError(
            f"{source}={isa!r} needs CPU flags {', '.join(missing)} this CPU lacks "
            f"(levels it runs: {runs})"
        )
    return isa


@functools.cache
def default_isa() -> str | None:
    """The level of the default library: ``$TOKENMILL_NATIVE_ISA``, else the best this CPU
    runs; None where it runs none. Read once (``default_isa.cache_clear()`` re-reads)."""
    wanted = TOKENMILL_NATIVE_ISA.get()
    if wanted:
        return _check_level(wanted, "TOKENMILL_NATIVE_ISA")
    here = isas_available()
    return here[0] if here else None


def _build(out: Path, level: IsaLevel) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        cmd = [compiler, "-O3", *level.cflags, "-fopenmp", "-fPIC", "-shared",
               *map(str, _SOURCES), "-o", str(target), "-lm"]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        target.replace(out)  # atomic: concurrent builders never see a partial file


def library(isa: str | None = None) -> ctypes.CDLL | None:
    """The native library built for ``isa`` (default: ``default_isa()``), compiled on first
    use; None where it can not be built here. A level this CPU can not run is a ValueError,
    never an illegal instruction."""
    if isa is None:
        isa = default_isa()  # checked when read
        return None if isa is None else _load(isa)
    return _load(_check_level(isa, "isa"))


_forced: list[str | None] = []
"""Levels ``use`` forces, innermost last; None forces the PyTorch path."""


@contextlib.contextmanager
def use(isa: str | None) -> Iterator[None]:
    """Within the block every wrapper here (and ``available()``) runs the library built for
    ``isa``; ``None`` makes ``available()`` False, so code deciding on it takes the PyTorch
    path. For tests and comparisons on one machine: what was built or decided before the
    block (a loaded model's kernel choice) stays as it was. Not thread-scoped: one process,
    one active level."""
    if isa is not None and library(isa) is None:
        raise RuntimeError(f"the native CPU kernels for {isa!r} could not be built here")
    _forced.append(isa)
    try:
        yield
    finally:
        _forced.pop()


def _need() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError(
            "the native CPU kernels are unavailable here (x86-64 with AVX2+FMA+F16C and a C "
            "compiler needed) or switched off (native.use(None))"
        )
    return lib


def active_isa() -> str | None:
    """The level the wrappers run now: the one ``use`` forces, else ``default_isa()``; None
    where they run none (forced off, no supported CPU, or the build failed)."""
    isa = _forced[-1] if _forced else default_isa()
    return isa if isa is not None and _load(isa) is not None else None


def _library() -> ctypes.CDLL | None:
    """The library every wrapper calls: the one ``use`` forces, else the default level's."""
    if _forced:
        isa = _forced[-1]
        return None if isa is None else _load(isa)
    return library()


def library_path(isa: str) -> Path:
    """Where the library of level ``isa`` is cached: keyed by the sources, the level's
    compiler options and this CPU's flags (``-march=native`` follows them)."""
    level = _LEVELS[isa]
    sources = b"".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))
    spec = " ".join([isa, *level.cflags, *sorted(_cpu_flags())]).encode()
    key = hashlib.sha256(sources + spec).hexdigest()
    return cache_dir() / "kernels" / f"tokenmill-{isa}-{key[:16]}.so"


@functools.cache
def _load(isa: str) -> ctypes.CDLL | None:
    level = _LEVELS[isa]
    path = library_path(isa)
    try:
        if not path.exists():
            logger.info("compiling the native CPU kernels for %s (once) into %s", isa, path)
            _build(path, level)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("native CPU kernels (%s) unavailable (%s): using PyTorch's", isa, detail)
        return None
    logger.info("native CPU kernels: ISA level %s (%s)", isa, path.name)
    i64, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_bool
    lib.affine_gemm.argtypes = [ptr, flag, i64, i64, ptr, ctypes.c_int, ctypes.c_int, i64, ptr,
                                flag, ptr, ptr, ptr]  # fmt: skip
    lib.affine_gemm.restype = None
    f32 = ctypes.c_float
    lib.add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32, flag]
    lib.silu_and_mul.argtypes = [ptr, i64, i64, ptr]
    lib.affine_set_amx.argtypes = [ctypes.c_int]
    lib.rope_store_kv.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr]
    lib.decode_attention.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, i64, i64, ptr, i64,
                                     ptr, f32, i64, ptr, ptr, i64, ptr, i64]  # fmt: skip
    lib.decode_layer.argtypes = [ctypes.POINTER(LayerDesc), ctypes.POINTER(StepArgs)]
    lib.decode_layers.argtypes = [ctypes.POINTER(LayerDesc), i64, ctypes.POINTER(StepArgs)]
    lib.dense16_rows.argtypes = [ptr, ctypes.c_int, i64, ptr, i64, ptr]
    lib.argmax_rows.argtypes = [ptr, i64, i64, ptr]
    lib.affine_rows.argtypes = [ptr, ctypes.c_int, i64, ptr, i64, ptr]
    lib.dense16_gemm.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, i64, ptr]
    lib.dense16_greedy.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, i64, f32, ptr, ptr]
    lib.dense16_has_bf16.argtypes = []
    lib.dense16_has_bf16.restype = ctypes.c_int
    lib.dense16_amx_enable.argtypes = []
    lib.dense16_amx_enable.restype = ctypes.c_int
    lib.delta_rule_step.argtypes = [ptr] * 6 + [i64, ptr, ptr] + [i64] * 5 + [ptr]
    lib.ssd_step.argtypes = [ptr] * 7 + [i64, ptr, ptr] + [i64] * 5 + [ptr]
    lib.whisper_decode_layer.argtypes = [ptr, ptr]  # (WhisperLayer *, WhisperStep *)
    for fn in (
        lib.add_rms_norm,
        lib.rope_store_kv,
        lib.decode_attention,
        lib.decode_layer,
        lib.decode_layers,
        lib.dense16_gemm,
        lib.dense16_greedy,
        lib.dense16_rows,
        lib.argmax_rows,
        lib.affine_rows,
        lib.delta_rule_step,
        lib.ssd_step,
        lib.whisper_decode_layer,
    ):
        fn.restype = None
    return lib


# -- one decoder layer per call (kernels/decoder_layer.c) --------------------------------
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class Proj(ctypes.Structure):
    """An affine-group projection: its tiles, optional float32 bias, bits, shape and int8
    activation terms (1 or 2; 16-bit tiles ignore it)."""

    _fields_ = [
        ("tiles", _ptr), ("bias", _ptr), ("bits", _i64), ("out", _i64), ("in_", _i64),
        ("terms", _i64),
    ]  # fmt: skip


class LayerDesc(ctypes.Structure):
    """What stays fixed for a layer across steps (built once per KV cache)."""

    _fields_ = [
        ("qkv", Proj), ("o", Proj), ("gate_up", Proj), ("down", Proj),
        ("input_norm", _ptr), ("post_norm", _ptr), ("eps_sum", _f32), ("scale", _f32),
        ("hidden", _i64), ("q_heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
        ("intermediate", _i64), ("window", _i64), ("activation", _i64),
        ("kv_cache", _ptr), ("cache_slots", _i64), ("block_size", _i64),
    ]  # fmt: skip


class StepArgs(ctypes.Structure):
    """What one decode step shares across its layers: buffers and attention metadata."""

    _fields_ = [
        ("tokens", _i64), ("table_width", _i64), ("max_len", _i64), ("first_layer", _i64),
        ("hidden", _ptr), ("residual", _ptr), ("cos", _ptr), ("sin", _ptr),
        ("slots", _ptr), ("block_tables", _ptr), ("seq_lens", _ptr),
        ("normed", _ptr), ("qkv", _ptr), ("attn", _ptr), ("gate_up", _ptr), ("act", _ptr),
        ("scores", _ptr), ("qx", _ptr), ("dx", _ptr), ("sx", _ptr),
        ("extra_slots", _ptr), ("max_extra", _i64),
    ]  # fmt: skip


def decode_layer(desc: ctypes.Structure, step: ctypes.Structure) -> None:
    """Run one decoder layer (see kernels/decoder_layer.c) on ``step``'s buffers in place."""
    _need().decode_layer(ctypes.byref(desc), ctypes.byref(step))


def decode_layers(descs: ctypes.Array, step: ctypes.Structure) -> None:
    """Run every layer of ``descs`` (a ``LayerDesc`` array) in order in one call."""
    _need().decode_layers(descs, len(descs), ctypes.byref(step))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] float32 contiguous (CPU) -> [R] int64, exactly ``x.argmax(dim=-1)``."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    _need().argmax_rows(x.data_ptr(), rows, vocab, out.data_ptr())
    return out


def whisper_decode_layer(layer: int, step: int) -> None:
    """One Whisper decoder layer (kernels/whisper_layer.c): the addresses of its
    ``WhisperLayer`` and the step's ``WhisperStep`` (``speech/native_step.py``)."""
    _need().whisper_decode_layer(layer, step)


def available() -> bool:
    """True when the native kernels can run here (built or buildable, CPU supported)."""
    return _library() is not None


def takes(*tensors: torch.Tensor) -> bool:
    """The per-layer float32 steps apply: kernels available, float32 CPU tensors."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and available()


class _Scratch(threading.local):
    """Per-thread buffers for the quantized activations, grown on demand and reused."""

    def __init__(self) -> None:
        self.size = 0
        self.buffer = torch.empty(0, dtype=torch.int8)

    def pointers(self, m: int, k: int) -> tuple[int, int, int]:
        """(2 M K int8 terms, M K / 32 float scales, M K / 32 float sums) addresses."""
        need = 2 * m * k + 8 * (m * k // GROUP) + 64
        if need > self.size:
            self.size = max(need, 2 * self.size)
            self.buffer = torch.empty(self.size, dtype=torch.int8)
        base = self.buffer.data_ptr()
        scales = (base + 2 * m * k + 63) // 64 * 64
        return base, scales, scales + 4 * (m * k // GROUP)


_scratch = _Scratch()


def affine_gemm(
    x: torch.Tensor, tiles: torch.Tensor, bits: int, n: int, terms: int = 2
) -> torch.Tensor:
    """x [M, K] float32/bfloat16 contiguous, tiles from ``pack_tiles`` -> y [M, n] in x's dtype.
    ``terms``: int8 terms per activation (2: ~15 bits; 1: ~8 bits, half the multiply-adds)."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype)
    bf16 = x.dtype == torch.bfloat16
    _need().affine_gemm(x.data_ptr(), bf16, m, k, tiles.data_ptr(), bits, terms, n,
                           y.data_ptr(), bf16, *_scratch.pointers(m, k))  # fmt: skip
    return y


# -- float32 per-layer steps ---------------------------------------------------------------
def add_rms_norm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps_sum: float
) -> torch.Tensor:
    """residual += x (in place, unless x is None); returns residual / sqrt(|residual|^2 +
    eps_sum) * weight per row. float32 [T, D] contiguous; weight float32 [D]."""
    out = torch.empty_like(residual)
    add = x is not None
    _need().add_rms_norm(x.data_ptr() if add else 0, residual.data_ptr(), weight.data_ptr(),
                            out.data_ptr(), residual.shape[0], residual.shape[1], eps_sum, add)  # fmt: skip
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [T, 2 I] = [gate | up] float32 contiguous -> [T, I] (the decode
    layer's own activation, so a prefill and a decode step compute it alike)."""
    rows, two_i = x.shape
    out = torch.empty(rows, two_i // 2, dtype=torch.float32)
    _need().silu_and_mul(x.data_ptr(), rows, two_i // 2, out.data_ptr())
    return out


def rope_store_kv(
    qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
    sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
) -> None:  # fmt: skip
    """Rotate the q and k heads of qkv [T, (H + 2 KVH) D] in place and store k, v at
    ``slots`` of kv_cache [2, NB, BS, KVH, D]. cos/sin [T, D] (see ``RopeTables``)."""
    slots_total = kv_cache.shape[1] * kv_cache.shape[2]
    _need().rope_store_kv(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), q_heads, kv_heads,
                             head_dim, cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(),
                             slots_total, slots.data_ptr())  # fmt: skip


def decode_attention(
    qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, kv_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, scale: float,
    window: int | None, extra_slots: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """One query per sequence (the q heads of qkv [B, ...]) -> [B, H D] float32.
    ``extra_slots`` [B, E] int64: cache slots each row sees past its context (-1: none)."""
    batch = qkv.shape[0]
    extras = 0 if extra_slots is None else extra_slots.shape[1]
    out = torch.empty(batch, q_heads * head_dim, dtype=torch.float32)
    scores = torch.empty(batch * q_heads * (max_len + extras), dtype=torch.float32)
    _, nb, bs = kv_cache.shape[:3]
    _need().decode_attention(qkv.data_ptr(), batch, qkv.stride(0), q_heads, kv_heads,
                                head_dim, kv_cache.data_ptr(), nb * bs, bs,
                                block_tables.data_ptr(), block_tables.stride(0),
                                seq_lens.data_ptr(), scale, window or 0, out.data_ptr(),
                                scores.data_ptr(), max_len,
                                None if extra_slots is None else extra_slots.data_ptr(),
                                extras)  # fmt: skip
    return out


# -- affine-group GEMM -------------------------------------------------------------------
def tile_bytes(bits: int, k: int) -> int:
    """Bytes of one tile (16 rows x k inputs): per group, the codes then 16 + 16 float16."""
    return k // GROUP * ((4 if bits == 4 else 8) * 64 + 64)


def pack_tiles(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int
) -> torch.Tensor:
    """codes uint8 [n, K] (< 2**bits), scale/offset [n, K/32] -> uint8 [n/16, tile_bytes].

    Row r of a tile is lane r of every 64-byte load (see affine_gemm.c).
    """
    n, k = codes.shape
    t, g = n // TILE, k // GROUP
    c = codes.view(t, TILE, g, GROUP)
    if bits == 4:  # k = 8 s + 4 h + j -> byte [s][r][j] = low: h=0, high: h=1
        c = c.view(t, TILE, g, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)  # [t, g, s, r, h, j]
        c = c[..., 0, :] | (c[..., 1, :] << 4)  # [t, g, 4, 16, 4]
    else:  # k = 4 s + j -> byte [s][r][j]
        c = c.view(t, TILE, g, 8, 4).permute(0, 2, 3, 1, 4)  # [t, g, 8, 16, 4]
    c = c.reshape(t, g, -1)
    so = torch.stack((scale, offset)).to(torch.float16).view(2, t, TILE, g)
    so = so.permute(1, 3, 0, 2).reshape(t, g, 2 * TILE).contiguous().view(torch.uint8)
    return torch.cat((c, so), dim=2).reshape(t, -1)


def unpack_rows(tiles: torch.Tensor, rows: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Dequantized float32 [len(rows), k] of the given rows (an embedding lookup): one
    native call where the kernels run (a decode step's row: ~5 us against ~0.15 ms of the
    tensor ops below, the same bits)."""
    if available() and rows.dtype == torch.int64 and rows.is_contiguous():
        out = torch.empty(len(rows), k, dtype=torch.float32)
        _need().affine_rows(tiles.data_ptr(), bits, k, rows.data_ptr(), len(rows), out.data_ptr())
        return out
    g = k // GROUP
    steps = 4 if bits == 4 else 8
    t = tiles.view(tiles.shape[0], g, steps * 64 + 64)
    tile, lane = rows // TILE, rows % TILE
    code_bytes = t[:, :, : steps * 64].reshape(-1, g, steps, TILE, 4)[
        tile, :, :, lane
    ]  # [R, g, s, 4]
    if bits == 4:
        codes = torch.stack((code_bytes & 0x0F, code_bytes >> 4), dim=3)  # [R, g, s, h, 4]
    else:
        codes = code_bytes
    codes = codes.reshape(len(rows), g, GROUP).float()
    so = t[tile, :, steps * 64 :].view(torch.float16).view(len(rows), g, 2, TILE)  # [R, g, 2, 16]
    so = so[torch.arange(len(rows)), :, :, lane].float()  # [R, g, 2]
    return (codes * so[..., 0:1] + so[..., 1:2]).reshape(len(rows), k)
