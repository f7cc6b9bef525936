"""The few-row affine-group kernel (affine_gemm: decode and verify steps, row blocks of up
to 4 tokens): against a dequantized float reference, and batch invariant bit for bit."""

from __future__ import annotations

import pytest
import torch

from tokenmill import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")

# every row-block width, whole blocks plus tails (5, 7, 9 = 4 + 4 + 1, 13, 19), blocks
# wider than the kernel's (8), and a verify step of k = 8 drafts (9 rows)
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 13, 19]


def _weights(bits: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles, the float32 weights they stand for)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02
    offset = torch.randn(n, k // 32, generator=gen) * 0.02
    deq = codes.float().view(n, -1, 32) * scale.half().float()[..., None]
    deq = deq + offset.half().float()[..., None]  # the tiles hold float16 scales, offsets
    return native.pack_tiles(codes, scale, offset, bits), deq.view(n, k)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k", [(48, 96), (160, 1536)])
@pytest.mark.parametrize("m", ROWS)
def test_rows_match_dequantized_matmul(bits, n, k, m):
    tiles, deq = _weights(bits, n, k, seed=m + bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = native.affine_gemm(x, tiles, bits, n)
    ref = x @ deq.t()
    # two int8 activation terms (about 15 bits): float32-level agreement
    assert ((y - ref).norm() / ref.norm()).item() < 1e-4


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_does_not_depend_on_its_batch(bits):
    """Row i of any batch equals row i computed alone, bit for bit, whatever the batch size
    and the row's place in its row block."""
    n, k = 64, 576
    tiles, _ = _weights(bits, n, k, seed=7)
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([native.affine_gemm(x[i : i + 1], tiles, bits, n) for i in range(len(x))])
    for m in ROWS:
        for start in (0, 3):  # the same rows at other places in their tiles
            rows = x[start : start + m].contiguous()
            got = native.affine_gemm(rows, tiles, bits, n)
            assert torch.equal(got, alone[start : start + len(rows)]), (m, start)


def test_bfloat16_rows_round_the_float32_result():
    tiles, _ = _weights(4, 48, 96, seed=1)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = native.affine_gemm(x, tiles, 4, 48)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, native.affine_gemm(x.float(), tiles, 4, 48).bfloat16())
