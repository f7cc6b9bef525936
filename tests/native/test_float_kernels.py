"""The float32 kernels (kernels/decode.c, dense16_gemm.c) at every ISA level this CPU runs
against PyTorch in float64, on random shapes including odd ones; and, where the CPU runs
two levels, the same bits at each (simd.h's promise for the kernels written on vf16)."""

from __future__ import annotations

import pytest
import torch

from tokenmill import native
from tokenmill.native import dense16

DIMS = [1, 7, 16, 17, 64, 100, 576, 1001]


def rms_reference(x, residual, w, eps_sum):
    r = residual.double() + (0 if x is None else x.double())
    norm = (r.square().sum(dim=-1, keepdim=True) + eps_sum).sqrt()
    return r, r / norm * w.double()


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("rows", [1, 3, 70])
@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm(native_level, dim, rows, add) -> None:
    g = torch.Generator().manual_seed(dim * 10 + rows)
    x = torch.randn(rows, dim, generator=g) if add else None
    residual = torch.randn(rows, dim, generator=g)
    residual[0] *= 1e-4  # its sum of squares near eps_sum: eps counts as in HF's norm
    if x is not None:
        x[0] *= 1e-4
    w = torch.randn(dim, generator=g)
    want_res, want = rms_reference(x, residual, w, 1e-6)
    out = native.add_rms_norm(x, residual, w, 1e-6)
    torch.testing.assert_close(residual.double(), want_res, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


def rope_reference(qkv, heads, kv_heads, d, cos, sin):
    q = qkv.double().clone()
    rot = q[:, : (heads + kv_heads) * d].view(len(q), heads + kv_heads, d)
    half = d // 2
    turned = torch.cat((rot[..., half:], rot[..., :half]), dim=-1)  # [x2 | x1]
    rot.copy_(rot * cos.double()[:, None] + turned * sin.double()[:, None])
    return q


@pytest.mark.parametrize("d", [2, 6, 18, 64, 80])
@pytest.mark.parametrize(("heads", "kv_heads", "tokens"), [(3, 1, 1), (4, 2, 5), (2, 2, 33)])
def test_rope_store_kv(native_level, d, heads, kv_heads, tokens) -> None:
    g = torch.Generator().manual_seed(d + 100 * tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    angle = torch.randn(tokens, d // 2, generator=g)
    cos = torch.cat((angle.cos(), angle.cos()), -1)
    sin = torch.cat((-angle.sin(), angle.sin()), -1)
    cache = torch.zeros(2, 8, 8, kv_heads, d)
    slots = torch.randperm(64, generator=g)[:tokens]
    want = rope_reference(qkv, heads, kv_heads, d, cos, sin)
    native.rope_store_kv(qkv, heads, kv_heads, d, cos, sin, cache, slots)
    torch.testing.assert_close(qkv.double(), want, rtol=1e-6, atol=1e-6)
    flat = cache.view(2, 64, kv_heads * d)
    k0, v0 = heads * d, (heads + kv_heads) * d
    assert torch.equal(flat[0, slots], qkv[:, k0:v0])
    assert torch.equal(flat[1, slots], qkv[:, v0:])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not flat[:, untouched].any()


def _attention_case(d: int, heads: int, kv_heads: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    batch, blocks, block_size, width = 3, 24, 7, 6
    cache = torch.randn(2, blocks, block_size, kv_heads, d, generator=g)
    tables = torch.randperm(blocks, generator=g)[: batch * width].view(batch, width)
    lens = torch.tensor([1, 17, width * block_size - 1])
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * d, generator=g)
    return qkv, cache, tables.contiguous(), lens


@pytest.mark.parametrize("d", [8, 24, 40, 48, 96, 256])
def test_decode_attention_odd_head_sizes(native_level, d) -> None:
    """Head sizes beside the ones tests/attention covers: below one vf16, odd multiples of
    8 (the scalar path), multiples of 16 with a half value chunk at the AVX2 level."""
    heads, kv_heads = 6, 2
    qkv, cache, tables, lens = _attention_case(d, heads, kv_heads, seed=d)
    out = native.decode_attention(
        qkv, heads, kv_heads, d, cache, tables, lens, int(lens.max()), d**-0.5, None
    )
    flat = cache.double().reshape(2, -1, kv_heads, d)
    for b, n in enumerate(lens.tolist()):
        slots = [int(tables[b, p // 7]) * 7 + p % 7 for p in range(n)]
        q = qkv[b, : heads * d].double().view(kv_heads, heads // kv_heads, d)
        w = torch.softmax(torch.einsum("gjd,sgd->gjs", q, flat[0, slots]) * d**-0.5, -1)
        want = torch.einsum("gjs,sgd->gjd", w, flat[1, slots]).reshape(-1)
        torch.testing.assert_close(out[b].double(), want, rtol=1e-5, atol=1e-5)


GEMM_SHAPES = [
    (1, 1, 1),
    (1, 7, 5),
    (2, 33, 17),
    (3, 64, 48),
    (5, 301, 100),
    (7, 576, 31),
    (41, 130, 70),
]


def _fma_kernels() -> list[str]:
    return ["bf16-fma", "fp16-fma", "fp32-fma"]


TWO_TERM = ("bf16-avx512bf16", "bf16-amx")


def _skip_unless_runs(kernel: str) -> None:
    if kernel == "bf16-avx512bf16" and not dense16.has_avx512_bf16():
        pytest.skip("no AVX512-BF16 in this library")
    if kernel == "bf16-amx" and not dense16.has_amx():
        pytest.skip("no AMX-BF16 in this library, or the OS refuses the tile state")


@pytest.mark.parametrize("kernel", [*_fma_kernels(), *TWO_TERM])
@pytest.mark.parametrize(("m", "k", "n"), [*GEMM_SHAPES, (33, 1001, 45), (300, 96, 40)])
def test_dense16_gemm(native_level, kernel, m, k, n) -> None:
    """16-bit (or float32) weights of any shape (padded tiles) times float32 rows; the
    exact-product kernels to float32 rounding of a float64 sum, the two-term bfloat16 ones
    to ~2^-16. The extra shapes: AMX's second token block, a k tail of 20 inputs, and more
    tokens than one of its L2 chunks."""
    _skip_unless_runs(kernel)
    code, dtype = dense16.KERNELS[kernel]
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g)
    tiles = dense16.empty_tiles(n, k, dtype)
    dense16.write_rows(tiles, 0, w)
    y = dense16.gemm(x, tiles, code, n)
    want = x.double() @ w.double().T
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    tol = 2e-5 if kernel in TWO_TERM else 2e-6
    assert (y.double() - want).abs().max().item() <= tol * scale


@pytest.mark.parametrize("kernel", [*_fma_kernels(), *TWO_TERM])
@pytest.mark.parametrize(("k", "n"), [(576, 64), (45, 17), (1536, 48)])
def test_dense16_rows_do_not_depend_on_the_batch(native_level, kernel, k, n) -> None:
    """A token's output has the same bits alone, in a batch of 5, of 37 (AMX: two token
    blocks, then one) and of 700 (several of AMX's L2 chunks): batched results equal
    single-request ones."""
    _skip_unless_runs(kernel)
    code, dtype = dense16.KERNELS[kernel]
    g = torch.Generator().manual_seed(k * n)
    tiles = dense16.empty_tiles(n, k, dtype)
    dense16.write_rows(tiles, 0, torch.randn(n, k, generator=g))
    x = torch.randn(700, k, generator=g)
    whole = dense16.gemm(x, tiles, code, n)
    for rows in (slice(0, 1), slice(3, 8), slice(17, 54), slice(699, 700)):
        assert torch.equal(dense16.gemm(x[rows].contiguous(), tiles, code, n), whole[rows])


def _levels() -> tuple[str, ...]:
    return native.isas_available()


two_levels = pytest.mark.skipif(len(_levels()) < 2, reason="this CPU runs one ISA level")


def _at_each_level(fn):
    out = []
    for isa in _levels():
        with native.use(isa):
            out.append(fn())
    return out


@two_levels
@pytest.mark.parametrize("kernel", _fma_kernels())
@pytest.mark.parametrize(("m", "k", "n"), GEMM_SHAPES)
def test_dense16_fma_kernels_give_the_same_bits_at_each_level(kernel, m, k, n) -> None:
    code, dtype = dense16.KERNELS[kernel]
    g = torch.Generator().manual_seed(k + n)
    tiles = dense16.empty_tiles(n, k, dtype)
    dense16.write_rows(tiles, 0, torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    first, *rest = _at_each_level(lambda: dense16.gemm(x, tiles, code, n))
    assert all(torch.equal(first, r) for r in rest)


@two_levels
@pytest.mark.parametrize("d", [16, 64, 80, 128])
def test_decode_attention_gives_the_same_bits_at_each_level(d) -> None:
    qkv, cache, tables, lens = _attention_case(d, 9, 3, seed=d)
    first, *rest = _at_each_level(
        lambda: native.decode_attention(
            qkv, 9, 3, d, cache, tables, lens, int(lens.max()), d**-0.5, 64
        )
    )
    assert all(torch.equal(first, r) for r in rest)


@two_levels
@pytest.mark.parametrize("dim", DIMS)
def test_add_rms_norm_gives_the_same_bits_at_each_level(dim) -> None:
    g = torch.Generator().manual_seed(dim)
    x, residual, w = (
        torch.randn(4, dim, generator=g),
        torch.randn(4, dim, generator=g),
        torch.randn(dim, generator=g),
    )

    def run():
        r = residual.clone()
        return torch.cat((native.add_rms_norm(x, r, w, 1e-6), r))

    first, *rest = _at_each_level(run)
    assert all(torch.equal(first, r) for r in rest)


@pytest.mark.parametrize(("rows", "inter"), [(1, 7), (3, 64), (70, 1536), (5, 37)])
def test_silu_and_mul(native_level, rows, inter) -> None:
    """The decode layer's SiLU gate, also the prefill's: against PyTorch in float64, large
    and tiny gates included (no overflow in exp)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(rows * inter)
    x = torch.randn(rows, 2 * inter, generator=g) * 6
    x[0, : min(inter, 4)] = torch.tensor([0.0, 90.0, -90.0, 1e-30])[: min(inter, 4)]
    gate, up = x.double().chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(native.silu_and_mul(x).double(), want, rtol=3e-6, atol=1e-7)
