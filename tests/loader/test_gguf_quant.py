from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as reference_dequantize
from quant_blocks import random_raw

from tokenmill.errors import UnsupportedModelError
from tokenmill.quant.ggml_codec import SUPPORTED_QUANT_TYPES, check_supported, dequantize

ROWS, COLS = 6, 512  # 512: a multiple of both block sizes (32 and 256)
# Round-trip error bound of the quantizer, relative to the std of the data (1.0).
ROUND_TRIP_ATOL = {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 3e-2, Q.Q5_0: 0.2,
                   Q.Q5_1: 0.2, Q.Q4_0: 0.4, Q.Q4_1: 0.4}  # fmt: skip


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_QUANT_TYPES, key=lambda t: t.name), ids=str)
def test_dequantize_matches_gguf_reference(qtype):
    raw, _ = random_raw(qtype, ROWS, COLS)
    ours = dequantize(raw, qtype, (ROWS, COLS))
    expected = torch.from_numpy(reference_dequantize(raw, qtype).copy()).reshape(ROWS, COLS)
    assert ours.shape == (ROWS, COLS) and ours.dtype == torch.float32
    assert torch.isfinite(ours).all()
    assert torch.equal(ours, expected)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(ours.to(dtype), expected.to(dtype))


@pytest.mark.parametrize("qtype", sorted(ROUND_TRIP_ATOL, key=lambda t: t.name), ids=str)
def test_dequantize_recovers_quantized_values(qtype):
    raw, values = random_raw(qtype, ROWS, COLS)
    ours = dequantize(raw, qtype, (ROWS, COLS))
    torch.testing.assert_close(ours, torch.from_numpy(values), atol=ROUND_TRIP_ATOL[qtype], rtol=0)


def test_f32_result_does_not_alias_the_file_bytes():
    raw, _ = random_raw(Q.F32, 2, 32)
    raw.flags.writeable = False  # like the read-only memory map
    ours = dequantize(raw, Q.F32, (2, 32))
    assert not np.may_share_memory(ours.numpy(), raw)
    ours += 1  # writable


def test_unsupported_type_is_named():
    with pytest.raises(UnsupportedModelError, match="IQ2_XXS.*supported types: .*Q4_K"):
        check_supported(Q.IQ2_XXS, "blk.0.attn_q.weight")
