"""The many-row 8-bit kernel (affine_gemm_rows), at every ISA level this CPU runs: against a
float reference, integer-exact at the extremes, and the same bits at every level."""

from __future__ import annotations

import pytest
import torch

from tokenmill import native
from tokenmill.quant.gguf_blocks import affine_groups
from tokenmill.quant.rows import RowsInt8Linear, gemm_rows

pytestmark = pytest.mark.usefixtures("native_level")  # once per ISA level


def _dequantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles, the float weights they stand for)."""
    n, k = w.shape
    g = affine_groups(w, 8)
    scale, offset = g.scale.half().float(), g.offset.half().float()  # as the tiles hold them
    deq = g.codes.float().view(n, -1, 32) * scale[..., None] + offset[..., None]
    return native.pack_tiles(g.codes, g.scale, g.offset, 8), deq.view(n, k)


def _one_term(x: torch.Tensor) -> torch.Tensor:
    """What one int8 term per group of 32 keeps of x (the kernel's float32 steps)."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    return (torch.round(g * (127 / amax)) * (amax / 127)).view_as(x)


# M: a register block's tail (7), several 256-token chunks plus a tail (517); N: an odd
# number of 16-row tiles (48) leaves a one-tile block
@pytest.mark.parametrize("m, k, n", [(1, 64, 32), (7, 96, 48), (517, 384, 160), (33, 1536, 64)])
@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("with_bias", [True, False])
def test_rows_match_reference(m, k, n, terms, with_bias):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen)
    x[:, 5] *= 30  # an outlier channel, as encoder streams have
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen) if with_bias else None
    tiles, deq = _dequantized(w)
    y = gemm_rows(x, tiles, n, bias, terms)
    xq = _one_term(x) if terms == 1 else x
    ref = xq @ deq.t() + (0 if bias is None else bias)
    rel = ((y - ref).norm() / ref.norm()).item()
    assert rel < (2e-5 if terms == 1 else 2e-4), rel
    exact = x @ w.t() + (0 if bias is None else bias)
    assert ((y - exact).norm() / exact.norm()).item() < (0.02 if terms == 1 else 0.01)


@pytest.mark.parametrize("terms", [1, 2])
def test_bfloat16_in_and_out(terms):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 128, generator=gen).bfloat16()
    w, bias = torch.randn(80, 128, generator=gen), torch.randn(80, generator=gen)
    tiles, _ = _dequantized(w)
    y = gemm_rows(x, tiles, 80, bias, terms)
    assert y.dtype == torch.bfloat16
    # the same numbers as from float32 input, rounded once to bfloat16
    want = gemm_rows(x.float(), tiles, 80, bias, terms).bfloat16()
    assert torch.equal(y, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_added_in_the_kernel(dtype):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(300, 64, generator=gen).to(dtype)
    w, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    res = torch.randn(300, 48, generator=gen).to(dtype)
    tiles, _ = _dequantized(w)
    fused = gemm_rows(x, tiles, 48, bias, 1, residual=res)
    # float32 sums, rounded once to the output dtype
    want = (gemm_rows(x.float(), tiles, 48, bias, 1) + res.float()).to(dtype)
    assert torch.equal(fused, want)
    with pytest.raises(ValueError, match="residual"):
        gemm_rows(x, tiles, 48, bias, 1, residual=res[:10])


def test_gelu_in_the_kernel():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(70, 96, generator=gen)
    w, bias = torch.randn(64, 96, generator=gen) * 0.5, torch.randn(64, generator=gen)
    tiles, _ = _dequantized(w)
    pre = gemm_rows(x, tiles, 64, bias, 2)
    got = gemm_rows(x, tiles, 64, bias, 2, gelu=True)
    want = torch.nn.functional.gelu(pre.double())
    assert (got.double() - want).abs().max() < 2e-6 * (1 + pre.abs().max())
    neg = pre < -2  # no 1 - (1 - e) cancellation: the tiny negative outputs stay tiny
    assert neg.any() and (got[neg] - want[neg]).abs().max() < 5e-7
    res = torch.randn(70, 64, generator=gen)
    both = gemm_rows(x, tiles, 64, bias, 2, residual=res, gelu=True)
    assert torch.allclose(both, torch.nn.functional.gelu(pre + res), atol=1e-5, rtol=1e-5)


def test_two_terms_are_finer():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 256, generator=gen), torch.randn(32, 256, generator=gen)
    tiles, deq = _dequantized(w)
    ref = x @ deq.t()
    err = [(gemm_rows(x, tiles, 32, None, t) - ref).norm().item() for t in (1, 2)]
    assert err[1] < err[0] / 20


def test_linear_module_and_shape_checks():
    gen = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(64, 48)
    q = RowsInt8Linear.of(lin, terms=2)
    x = torch.randn(2, 5, 64, generator=gen)
    with torch.no_grad():
        assert torch.allclose(q(x), lin(x), atol=0.02, rtol=0)
    assert q(x).shape == (2, 5, 48)
    with pytest.raises(ValueError, match="divisible"):
        RowsInt8Linear.of(torch.nn.Linear(60, 48), terms=1)


@pytest.mark.parametrize("terms", [1, 2])
def test_a_row_does_not_depend_on_its_batch(terms):
    """Row i of a batch equals row i computed in a batch of another size, bit for bit,
    however the batch falls into chunks (610 rows: 204 + 204 + 202; 300: 152 + 148)."""
    gen = torch.Generator().manual_seed(11)
    k, n = 384, 96
    x = torch.randn(610, k, generator=gen)
    tiles, _ = _dequantized(torch.randn(n, k, generator=gen) * 0.05)
    whole = gemm_rows(x, tiles, n, None, terms)
    for start, m in ((0, 1), (0, 4), (0, 256), (200, 300), (600, 10), (0, 513)):
        part = gemm_rows(x[start : start + m].contiguous(), tiles, n, None, terms)
        assert torch.equal(part, whole[start : start + m]), (start, m)


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_integer_dot_products_are_exact(terms, dtype):
    """Scale 1, offset 0, integer x with max |x| = 127 per group: the first term is x, the
    second 0, every float step exact, so y = x codes^T + bias exactly; all-255 codes
    against all-127 rows reach the largest byte pairs (2 x 255 x 127 > 32767: no
    saturation)."""
    gen = torch.Generator().manual_seed(terms)
    m, n, k = 9, 48, 256
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    codes[:16] = 255
    x = torch.randint(-127, 128, (m, k), generator=gen).float()
    x[:, ::32] = 127.0
    x[0], x[1] = 127.0, -127.0
    ones = torch.ones(n, k // 32)
    tiles = native.pack_tiles(codes, ones, torch.zeros_like(ones), 8)
    bias = torch.arange(n, dtype=torch.float32)
    y = gemm_rows(x.to(dtype), tiles, n, bias, terms)
    want = (x.double() @ codes.double().t() + bias.double()).float().to(dtype)
    assert torch.equal(y, want)


@pytest.mark.skipif(len(native.isas_available()) < 2, reason="one ISA level on this CPU")
@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_level_gives_the_same_bits(terms, dtype):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(70, 384, generator=gen).to(dtype)
    w, bias = torch.randn(96, 384, generator=gen) * 0.05, torch.randn(96, generator=gen)
    res = torch.randn(70, 96, generator=gen).to(dtype)
    tiles, _ = _dequantized(w)
    got = {}
    for isa in native.isas_available():
        with native.use(isa):
            got[isa] = gemm_rows(x, tiles, 96, bias, terms, residual=res, gelu=True)
    first, *others = got.values()
    assert all(torch.equal(first, y) for y in others), list(got)
