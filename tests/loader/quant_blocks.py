"""Random raw GGUF tensor bytes of every supported type (imported by the loader tests)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

# Types gguf-py can quantize: built from random floats with its reference quantizer.
QUANTIZABLE = (Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
# K-quants gguf-py only dequantizes: random bytes, with sane f16 super-block scales at
# these byte offsets of each block (else random bits make inf/NaN scales).
K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_raw(
    qtype: Q, rows: int, cols: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray | None]:
    """(raw uint8 bytes [rows, row_bytes], the float values they encode if known)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == Q.F32:
        return values.view(np.uint8), values
    if qtype == Q.F16:
        return values.astype(np.float16).view(np.uint8), values
    if qtype in QUANTIZABLE:
        return quantize(values, qtype), values
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(0.001, 0.05, len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1), None
