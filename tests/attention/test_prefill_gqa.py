"""A prompt's causal attention over its own new keys (``reference._attend_new``) lets
PyTorch's CPU flash kernel read each kv head for its group of q heads (``enable_gqa``):
the bits of the kv heads repeated per q head, as before, without the copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.attention import reference


def _repeated(q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // kv.shape[2]
    keys = kv[:, 0].repeat_interleave(group, dim=1).transpose(0, 1)
    values = kv[:, 1].repeat_interleave(group, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], is_causal=True, scale=scale
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(
    "length, heads, kv_heads, dim",
    [(1, 9, 3, 64), (16, 9, 3, 64), (111, 9, 3, 64), (64, 8, 8, 64), (33, 12, 2, 80)],
)
def test_grouped_heads_give_the_repeated_heads_bits(length, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(length)
    q = torch.randn(length, heads, dim, generator=g)
    kv = torch.randn(length, 2, kv_heads, dim, generator=g)
    got = reference._attend_new(q, kv, dim**-0.5, None)
    assert got.shape == (length, heads, dim)
    assert torch.equal(got, _repeated(q, kv, dim**-0.5))
