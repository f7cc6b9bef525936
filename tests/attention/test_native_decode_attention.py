"""The native decode attention kernel (kernels/decode.c) against a PyTorch softmax over the
gathered keys: grouped-query heads, scattered blocks of several sizes, sliding windows,
draft-tree extra slots, head sizes on the 16-keys-at-once path (d % 16 == 0) and off it;
at each ISA level this CPU runs (``native_level``)."""

from __future__ import annotations

import pytest
import torch

from tokenmill import native

pytestmark = pytest.mark.usefixtures("native_level")  # every ISA level this CPU runs


def reference(qkv, heads, kv_heads, d, cache, tables, lens, scale, window, extra):
    """[B, heads * d] float64: each row's softmax over its visible keys, then its extras."""
    block = cache.shape[2]
    flat = cache.double().reshape(2, -1, kv_heads, d)
    out = []
    for b, n in enumerate(lens.tolist()):
        first = max(0, n - window) if window > 0 else 0
        slots = [int(tables[b, p // block]) * block + p % block for p in range(first, n)]
        if extra is not None:
            slots += [int(s) for s in extra[b] if s >= 0]
        k, v = flat[0, slots], flat[1, slots]  # [S, KVH, D]
        q = qkv[b, : heads * d].double().view(kv_heads, heads // kv_heads, d)
        w = torch.softmax(torch.einsum("gjd,sgd->gjs", q, k) * scale, dim=-1)
        out.append(torch.einsum("gjs,sgd->gjd", w, v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("head_dim", [64, 128, 80, 72, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize(("window", "extras"), [(0, False), (7, False), (0, True)])
def test_decode_attention_matches_a_softmax(
    head_dim, heads, kv_heads, block_size, window, extras
) -> None:
    gen = torch.Generator().manual_seed(head_dim * 100 + heads * 10 + block_size)
    batch, blocks, width = 5, 48, 9
    cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(blocks, generator=gen)[: batch * width].view(batch, width)
    lens = torch.tensor([1, 15, 16, 33, width * block_size - 2])  # 16-key chunks and tails
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen)
    extra = None
    if extras:  # a draft tree's node: its ancestors' slots, -1 past them
        extra = torch.full((batch, 20), -1, dtype=torch.int64)
        for b, k in enumerate([0, 1, 16, 17, 20]):
            extra[b, :k] = torch.randint(0, blocks * block_size, (k,), generator=gen)
    scale = head_dim**-0.5
    out = native.decode_attention(
        qkv, heads, kv_heads, head_dim, cache, tables.contiguous(), lens, int(lens.max()),
        scale, window, extra,
    )  # fmt: skip
    want = reference(qkv, heads, kv_heads, head_dim, cache, tables, lens, scale, window, extra)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_a_row_gives_the_same_bits_alone_and_in_a_verify_batch() -> None:
    """Speculative verification reads every row as one decode row: its output must not
    depend on the rows beside it (the greedy tokens equal the ones without drafts)."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d, block = 9, 3, 64, 16
    cache = torch.randn(2, 12, block, kv_heads, d, generator=gen)
    tables = torch.arange(12).roll(5).repeat(9, 1)
    lens = torch.arange(57, 66)  # one sequence verifying 8 drafts: a row per position
    qkv = torch.randn(9, (heads + 2 * kv_heads) * d, generator=gen)
    batch = native.decode_attention(qkv, heads, kv_heads, d, cache, tables, lens, 65, 0.125, 0)
    for r in range(9):
        alone = native.decode_attention(
            qkv[r : r + 1], heads, kv_heads, d, cache, tables[r : r + 1], lens[r : r + 1],
            int(lens[r]), 0.125, 0,
        )  # fmt: skip
        assert torch.equal(alone[0], batch[r])
