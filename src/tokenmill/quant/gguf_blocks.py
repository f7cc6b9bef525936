"""GGUF tensors kept as their raw blocks, and the block types read as affine groups.

A ``GgufBlocks`` is what the loader hands a quantized linear instead of a dequantized
tensor. Q4_0, Q4_1 and Q4_K are all ``w = scale * q + offset`` over groups of 32 with
``q`` in 0..15, and Q8_0 is the same with ``q`` in 0..255 (its int8 shifted by 128), so
they become 4-bit / 8-bit affine groups *exactly* (``affine_groups``); other types are
dequantized (``dequantize``) and rounded to the nearest affine group values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K

from tokenmill.quant.ggml_codec import dequantize as dequantize_raw

GROUP = 32
"""Elements per int4 group: one Q4_0/Q4_1 block, one Q4_K sub-block."""

INT4_EXACT_TYPES: frozenset[Q] = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
"""Block types whose values 4-bit groups of 32 hold exactly."""
INT8_EXACT_TYPES: frozenset[Q] = frozenset({Q.Q8_0})
"""Block types whose values 8-bit groups of 32 hold exactly."""

DENSE_TYPES: frozenset[Q] = frozenset({Q.F32, Q.F16, Q.BF16})


@dataclass(frozen=True)
class GgufBlocks:
    """One GGUF tensor as stored: rows of blocks, rows already in Hugging Face order."""

    raw: np.ndarray
    """uint8 [rows, row_bytes] (may be a read-only view of the memory map)."""
    qtype: Q
    shape: tuple[int, int]
    """[out_features, in_features]."""

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], owning its memory."""
        return dequantize_raw(self.raw, self.qtype, self.shape)

    def narrow_rows(self, start: int, length: int) -> GgufBlocks:
        return GgufBlocks(self.raw[start : start + length], self.qtype, (length, self.shape[1]))


@dataclass(frozen=True)
class AffineGroups:
    """w[n, k] = codes[n, k] * scale[n, k // 32] + offset[n, k // 32]."""

    codes: torch.Tensor
    """uint8 [N, K], values below 2**bits."""
    scale: torch.Tensor
    """float32 [N, K / 32]."""
    offset: torch.Tensor
    """float32 [N, K / 32]."""


def _split(blocks: np.ndarray, *sizes: int) -> list[np.ndarray]:
    """Byte fields of each block: [n_blocks, type_size] -> one array per field."""
    return np.split(blocks, np.cumsum(sizes), axis=1)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: low nibbles are elements 0..15, high ones 16..31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=1)


def _f16(field: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(field).view(np.float16).astype(np.float32)[:, 0]


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, qs = _split(blocks, 2)  # w = d * (q - 8)
    d = _f16(d)
    return _nibbles_32(qs), d[:, None], (-8 * d)[:, None]


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m, qs = _split(blocks, 2, 2)  # w = d * q + m
    return _nibbles_32(qs), _f16(d)[:, None], _f16(m)[:, None]


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, qs = _split(blocks, 2)  # w = d * q, q int8 = d * (q + 128) - 128 d
    d = _f16(d)
    codes = (np.ascontiguousarray(qs).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d[:, None], (-128 * d)[:, None]


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """256-element super-blocks of 8 sub-blocks: w = d * sc_j * q - dmin * m_j."""
    d, dmin, scales, qs = _split(blocks, 2, 2, 12)
    sc, mins = Q4_K.get_scale_min(np.ascontiguousarray(scales))
    scale = _f16(d)[:, None] * sc.astype(np.float32)  # [n, 8], as gguf-py rounds it
    offset = _f16(dmin)[:, None] * mins.astype(np.float32)
    # 4 chunks of 32 bytes: low nibbles are sub-block 2i, high nibbles sub-block 2i + 1.
    qs = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(len(blocks), 256)
    return codes, scale, -offset


_DECODERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k, Q.Q8_0: _q8_0}


def exact_groups(t: GgufBlocks) -> AffineGroups:
    """Codes and per-group scale/offset of a Q4_0, Q4_1, Q4_K (4-bit) or Q8_0 (8-bit) tensor."""
    rows, cols = t.shape
    _, type_size = GGML_QUANT_SIZES[t.qtype]
    blocks = np.ascontiguousarray(t.raw).reshape(-1, type_size)
    codes, scale, offset = _DECODERS[t.qtype](blocks)
    return AffineGroups(
        codes=torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)).reshape(rows, cols),
        scale=torch.from_numpy(np.ascontiguousarray(scale)).reshape(rows, cols // GROUP),
        offset=torch.from_numpy(np.ascontiguousarray(offset)).reshape(rows, cols // GROUP),
    )


def round_to_groups(w: torch.Tensor, bits: int) -> AffineGroups:
    """Asymmetric round-to-nearest of float32 [N, K] in groups of 32 (min/max per group)."""
    n, k = w.shape
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=1e-12)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 2**bits - 1)
    return AffineGroups(codes.to(torch.uint8).view(n, k), scale, lo)


def affine_groups(src: torch.Tensor | GgufBlocks, bits: int) -> AffineGroups:
    """``src`` as ``bits``-bit affine groups: exact for the matching GGUF types, else rounded."""
    exact = INT4_EXACT_TYPES if bits == 4 else INT8_EXACT_TYPES
    if isinstance(src, GgufBlocks) and src.qtype in exact:
        return exact_groups(src)
    w = src.dequantize() if isinstance(src, GgufBlocks) else src.float()
    return round_to_groups(w, bits)
