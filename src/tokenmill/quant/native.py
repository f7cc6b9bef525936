"""The native affine-group GEMM (``kernels/affine_gemm.c``): built once, called through ctypes.

The C file is compiled with the system C compiler (``cc -O3 -march=native -fopenmp``, about
a second) the first time it is needed and cached under ``$TOKENMILL_CACHE_DIR/kernels``,
keyed by the source and the CPU's feature flags. It links the OpenMP runtime PyTorch has
already loaded, so it shares PyTorch's threads. Without a compiler, or on a CPU without
AVX512-VNNI, ``available()`` is False and the quantized layers use PyTorch's own kernels.
"""

from __future__ import annotations

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
from pathlib import Path

import torch

from tokenmill.env import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "kernels" / "affine_gemm.c"
_REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "f16c")
TILE, GROUP = 16, 32


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _build(out: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared",
               str(_SOURCE), "-o", str(target)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        target.replace(out)  # atomic: concurrent builders never see a partial file


@functools.cache
def _library() -> ctypes.CDLL | None:
    flags = _cpu_flags()
    if platform.machine() != "x86_64" or not all(f in flags for f in _REQUIRED_FLAGS):
        logger.info("native quantized kernels need x86-64 with AVX512-VNNI: using PyTorch's")
        return None
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(sorted(flags)).encode()).hexdigest()
    path = cache_dir() / "kernels" / f"affine_gemm-{key[:16]}.so"
    try:
        if not path.exists():
            logger.info("compiling the native quantized kernels (once) into %s", path)
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("native quantized kernels unavailable (%s): using PyTorch's", detail)
        return None
    i64, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_bool
    lib.affine_gemm.argtypes = [ptr, flag, i64, i64, ptr, ctypes.c_int, i64, ptr, flag,
                                ptr, ptr, ptr]  # fmt: skip
    lib.affine_gemm.restype = None
    return lib


def available() -> bool:
    """True when the native kernel can run here (built or buildable, CPU supported)."""
    return _library() is not None


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


def affine_gemm(x: torch.Tensor, tiles: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """x [M, K] float32/bfloat16 contiguous, tiles from ``pack_tiles`` -> y [M, n] in x's dtype."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype)
    bf16 = x.dtype == torch.bfloat16
    _library().affine_gemm(x.data_ptr(), bf16, m, k, tiles.data_ptr(), bits, n, y.data_ptr(),
                           bf16, *_scratch.pointers(m, k))  # fmt: skip
    return y


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
    """Dequantized float32 [len(rows), k] of the given rows (an embedding lookup)."""
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
    so = t[:, :, steps * 64 :].contiguous().view(torch.float16).view(-1, g, 2, TILE)
    so = so[tile, :, :, lane].float()  # [R, g, 2]
    return (codes * so[..., 0:1] + so[..., 1:2]).reshape(len(rows), k)
