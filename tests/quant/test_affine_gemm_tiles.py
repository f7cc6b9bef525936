"""The few-row affine-group kernel (affine_gemm: decode and verify steps, row blocks of up
to 4 tokens with two activation terms, 8 with one), at every ISA level this CPU runs, with
both activation precisions: against a dequantized float reference (and, for one term,
the one-term scheme computed in float64), integer-exact at the extremes of codes and
activations, batch invariant bit for bit, and the same bits at every level."""

from __future__ import annotations

import pytest
import torch

from tokenmill import native

pytestmark = pytest.mark.usefixtures("native_level")  # once per ISA level

# every row-block width, whole blocks plus tails (5, 7, 9 = 4 + 4 + 1 or 8 + 1, 13, 19),
# and a verify step of k = 8 drafts (9 rows)
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 13, 19]
TERMS = [2, 1]  # int8 terms per activation: activation_precision high, low
TOLERANCE = {2: 1e-4, 1: 2e-2}  # relative error vs float32: ~15 bits, ~8 bits


def _weights(bits: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles, the float32 weights they stand for)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02
    offset = torch.randn(n, k // 32, generator=gen) * 0.02
    deq = codes.float().view(n, -1, 32) * scale.half().float()[..., None]
    deq = deq + offset.half().float()[..., None]  # the tiles hold float16 scales, offsets
    return native.pack_tiles(codes, scale, offset, bits), deq.view(n, k)


@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k", [(48, 96), (160, 1536)])
@pytest.mark.parametrize("m", ROWS)
def test_rows_match_dequantized_matmul(bits, n, k, m, terms):
    tiles, deq = _weights(bits, n, k, seed=m + bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = native.affine_gemm(x, tiles, bits, n, terms)
    ref = x @ deq.t()
    # two int8 activation terms (about 15 bits): float32-level agreement
    assert ((y - ref).norm() / ref.norm()).item() < TOLERANCE[terms]


def _one_term_reference(x: torch.Tensor, bits: int, n: int, seed: int) -> torch.Tensor:
    """The one-term scheme in float64: per group of 32, q = round(x 127 / max|x|) (nearest
    even), d = max|x| / 127; y = sum over groups of d (scale codes.q + offset sum(q))."""
    gen = torch.Generator().manual_seed(seed)  # _weights' draws, again
    m, k = x.shape
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen).double()
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02).half().double()
    offset = (torch.randn(n, k // 32, generator=gen) * 0.02).half().double()
    g = x.view(m, k // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.round(g * (127 / amax)).double()  # torch.round: half to even, as the kernel
    d = (amax / 127).double()[..., 0]  # [m, G]
    dots = torch.einsum("mgj,ngj->mng", q, codes.view(n, k // 32, 32))  # exact integers
    return (d[:, None] * (scale[None] * dots + offset[None] * q.sum(-1)[:, None])).sum(-1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 8, 9, 19])
def test_one_term_computes_its_scheme(bits, m):
    """activation_precision='low' is exactly the one-term scheme, not just close to floats."""
    n, k, seed = 48, 576, 11 * m + bits
    tiles, _ = _weights(bits, n, k, seed=seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = _one_term_reference(x, bits, n, seed)
    y = native.affine_gemm(x, tiles, bits, n, 1).double()
    assert ((y - ref).norm() / ref.norm()).item() < 1e-6


def test_one_term_is_affine_gemm_rows_one_term():
    """The decode kernel's one term and the encoder kernel's (affine_gemm_rows) are the same
    arithmetic in the same order: the same bits."""
    from tokenmill.quant.rows import gemm_rows

    tiles, _ = _weights(8, 96, 576, seed=4)
    x = torch.randn(13, 576, generator=torch.Generator().manual_seed(5))
    rows = gemm_rows(x, tiles, 96, None, terms=1)
    assert torch.equal(native.affine_gemm(x, tiles, 8, 96, 1), rows)


@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_does_not_depend_on_its_batch(bits, terms):
    """Row i of any batch equals row i computed alone, bit for bit, whatever the batch size
    and the row's place in its row block."""
    n, k = 64, 576
    tiles, _ = _weights(bits, n, k, seed=7)
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat(
        [native.affine_gemm(x[i : i + 1], tiles, bits, n, terms) for i in range(len(x))]
    )
    for m in ROWS:
        for start in (0, 3):  # the same rows at other places in their tiles
            rows = x[start : start + m].contiguous()
            got = native.affine_gemm(rows, tiles, bits, n, terms)
            assert torch.equal(got, alone[start : start + len(rows)]), (m, start)


def test_bfloat16_rows_round_the_float32_result():
    tiles, _ = _weights(4, 48, 96, seed=1)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = native.affine_gemm(x, tiles, 4, 48)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, native.affine_gemm(x.float(), tiles, 4, 48).bfloat16())


@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m, n, k", [(1, 16, 32), (3, 80, 160), (6, 48, 608), (11, 112, 224)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_odd_shapes(bits, m, n, k, dtype, terms):
    """Odd token counts and tile counts, K of 1 .. 19 groups, both activation dtypes."""
    tiles, deq = _weights(bits, n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    y = native.affine_gemm(x, tiles, bits, n, terms)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = x.float() @ deq.t()
    tol = TOLERANCE[terms] if dtype == torch.float32 else max(TOLERANCE[terms], 2**-8)
    assert ((y.float() - ref).norm() / ref.norm()).item() < tol


def _integer_case(bits: int, codes: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Tiles of scale 1, offset 0 and integer x with |x| <= 127 = max |x| in every group:
    the kernel's first activation term is x itself, its second 0 (with two), and every float
    step is exact, so y must be the integer product x codes^T (below 2^24 for K <= 256)."""
    n, k = codes.shape
    ones = torch.ones(n, k // 32)
    x = x.clone()
    x[:, ::32] = torch.where(x[:, ::32] < 0, -127.0, 127.0)  # max |x| = 127 in each group
    tiles = native.pack_tiles(codes, ones, torch.zeros_like(ones), bits)
    return tiles, x, x.double() @ codes.double().t()


@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_codes_do_not_saturate(bits, dtype, sign, terms):
    """All codes 2^bits - 1 against all activations +-127: every byte pair of a group at its
    largest (2 x 255 x 127 > 32767 for 8-bit codes, where a plain vpmaddubsw saturates)."""
    n, k, m = 32, 256, 5
    codes = torch.full((n, k), 2**bits - 1, dtype=torch.uint8)
    tiles, x, ref = _integer_case(bits, codes, torch.full((m, k), 127.0 * sign))
    y = native.affine_gemm(x.to(dtype), tiles, bits, n, terms)
    assert torch.equal(y, ref.float().to(dtype))


@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 4, 7, 9])
def test_integer_dot_products_are_exact(bits, m, terms):
    gen = torch.Generator().manual_seed(bits * 10 + m)
    n, k = 48, 256
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    x = torch.randint(-127, 128, (m, k), generator=gen).float()
    tiles, x, ref = _integer_case(bits, codes, x)
    assert torch.equal(native.affine_gemm(x, tiles, bits, n, terms), ref.float())


@pytest.mark.skipif(len(native.isas_available()) < 2, reason="one ISA level on this CPU")
@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_level_gives_the_same_bits(bits, dtype, terms):
    """The AVX2 code reproduces the AVX-512 one exactly (integer dot products, then the
    same float32 steps in the same order), so a model decodes alike on either."""
    tiles, _ = _weights(bits, 96, 1536, seed=5)
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(6)).to(dtype)
    got = {}
    for isa in native.isas_available():
        with native.use(isa):
            got[isa] = native.affine_gemm(x, tiles, bits, 96, terms)
    first, *others = got.values()
    assert all(torch.equal(first, y) for y in others), list(got)


def _amx_int8() -> bool:
    from tokenmill.native import dense16

    flags = native._cpu_flags()
    return "amx_int8" in flags and dense16.has_amx()


@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [16, 19, 32, 37, 70])
@pytest.mark.parametrize("bf16", [False, True])
def test_amx_blocks_give_the_vnni_bits(bits, m, bf16, terms):
    """Where AMX-INT8 runs, blocks of 16 tokens take their integer products from tile
    instructions (the rest from vpdpbusd): the same bits as the VNNI path alone, so a
    token's output does not depend on the block it lands in."""
    if not _amx_int8() or native.active_isa() != "avx512":
        pytest.skip("no AMX-INT8 at this level (or the OS refuses the tile state)")
    lib = native._library()
    tiles, _ = _weights(bits, 96, 576, seed=m)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(bits))
    x = x.bfloat16() if bf16 else x
    try:
        lib.affine_set_amx(0)
        vnni = native.affine_gemm(x, tiles, bits, 96, terms)
    finally:
        lib.affine_set_amx(1)
    assert torch.equal(native.affine_gemm(x, tiles, bits, 96, terms), vnni)


@pytest.mark.parametrize("bits", [4, 8])
def test_embedding_rows_are_the_dequantized_weights(bits):
    """unpack_rows (an embedding lookup; the native reader and the tensor-op fallback)
    gives the dequantized rows bit for bit, in the order asked, repeats included."""
    tiles, deq = _weights(bits, 48, 96, seed=bits)
    ids = torch.tensor([0, 47, 17, 16, 15, 5, 17])
    assert torch.equal(native.unpack_rows(tiles, ids, bits, 96), deq[ids])
    with native.use(None):
        assert torch.equal(native.unpack_rows(tiles, ids, bits, 96), deq[ids])
