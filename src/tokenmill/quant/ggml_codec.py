"""GGML tensor types we read, and their dequantization (gguf-py's numpy kernels)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from tokenmill.errors import UnsupportedModelError

# Tested one by one in tests/loader/test_gguf_quant.py against gguf-py's reference.
SUPPORTED_QUANT_TYPES: frozenset[Q] = frozenset(
    {
        Q.F32, Q.F16, Q.BF16,
        Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
        Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    }
)  # fmt: skip


def check_supported(qtype: Q, tensor_name: str) -> None:
    if qtype not in SUPPORTED_QUANT_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_QUANT_TYPES))
        raise UnsupportedModelError(
            f"tensor {tensor_name} is stored as {qtype.name}, which tokenmill can not dequantize; "
            f"supported types: {names}. Use a GGUF quantized to one of these (e.g. Q4_K_M, Q8_0)"
        )


def dequantize(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF bytes (uint8, one row of blocks per row) -> float32 tensor of ``shape``.

    ``shape`` is the torch-order shape ([out, in] for a linear weight). The result owns
    its memory: F32 data would otherwise alias the read-only memory map.
    """
    values = gguf_dequantize(raw, qtype)  # float32, [*shape[:-1], shape[-1]]
    if np.may_share_memory(values, raw):  # F32 comes back as a view of the file
        values = values.copy()
    return torch.from_numpy(values).reshape(shape)
