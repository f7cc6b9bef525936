"""GGUF tensors kept as their raw blocks, and the 4-bit block types read as int4 groups.

A ``GgufBlocks`` is what the loader hands a quantized linear instead of a dequantized
tensor. The 4-bit block types are all ``w = scale * q + offset`` over groups of 32 with
``q`` in 0..15, so they become int4 groups *exactly* (``int4_groups``); other types are
dequantized (``dequantize``) and re-quantized by the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K

from tokenmill.loader.gguf_quant import dequantize as dequantize_raw

GROUP = 32
"""Elements per int4 group: one Q4_0/Q4_1 block, one Q4_K sub-block."""

INT4_EXACT_TYPES: frozenset[Q] = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
"""Block types whose values int4 groups of 32 hold exactly (up to bf16 scale rounding)."""

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
class Int4Groups:
    """w[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]."""

    codes: torch.Tensor
    """int32 [N, K], values 0..15."""
    scale: torch.Tensor
    """float32 [N, K / 32]."""
    zero: torch.Tensor
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
    return _nibbles_32(qs), _f16(d)[:, None], np.zeros((len(blocks), 1), np.float32)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m, qs = _split(blocks, 2, 2)  # w = d * q + m = d * (q - 8) + (m + 8 d)
    d, m = _f16(d), _f16(m)
    return _nibbles_32(qs), d[:, None], (m + 8 * d)[:, None]


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """256-element super-blocks of 8 sub-blocks: w = d * sc_j * q - dmin * m_j."""
    d, dmin, scales, qs = _split(blocks, 2, 2, 12)
    sc, mins = Q4_K.get_scale_min(np.ascontiguousarray(scales))
    scale = _f16(d)[:, None] * sc.astype(np.float32)  # [n, 8], as gguf-py rounds it
    offset = _f16(dmin)[:, None] * mins.astype(np.float32)
    # 4 chunks of 32 bytes: low nibbles are sub-block 2i, high nibbles sub-block 2i + 1.
    qs = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(len(blocks), 256)
    return codes, scale, 8 * scale - offset


_INT4_DECODERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k}


def int4_groups(t: GgufBlocks) -> Int4Groups:
    """Codes and per-group scale/zero of a Q4_0, Q4_1 or Q4_K tensor."""
    rows, cols = t.shape
    _, type_size = GGML_QUANT_SIZES[t.qtype]
    blocks = np.ascontiguousarray(t.raw).reshape(-1, type_size)
    codes, scale, zero = _INT4_DECODERS[t.qtype](blocks)
    return Int4Groups(
        codes=torch.from_numpy(codes.astype(np.int32)).reshape(rows, cols),
        scale=torch.from_numpy(np.ascontiguousarray(scale)).reshape(rows, cols // GROUP),
        zero=torch.from_numpy(np.ascontiguousarray(zero)).reshape(rows, cols // GROUP),
    )
