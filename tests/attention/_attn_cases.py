"""Random paged-attention batches with scattered blocks, and the reference to compare with."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from tokenmill.attention import AttentionMetadata, AttentionParams
from tokenmill.attention.backends import REFERENCE, AttentionBackend, AttentionImpl

BLOCK_SIZE = 4


@dataclass(frozen=True)
class Case:
    q: torch.Tensor  # [T, H, D]
    kv: torch.Tensor  # [T, 2, KVH, D]
    cache: torch.Tensor  # [2, NB, BS, KVH, D], random: the cached prefixes
    meta: AttentionMetadata
    scale: float


def make_case(
    query_lens: list[int],
    seq_lens: list[int],
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    """Sequence i brings query_lens[i] new tokens after seq_lens[i] - query_lens[i] cached
    ones; its blocks are scattered, non-consecutive ids (block 0 is never used)."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = 2 * sum(used) + 2
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in used]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, device)
    tokens = sum(query_lens)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
    qkv = rand(tokens, heads + 2 * kv_heads, head_dim)  # packed, as the projection gives it
    q = qkv[:, :heads]
    kv = qkv[:, heads:].view(tokens, 2, kv_heads, head_dim)
    cache = rand(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    return Case(q, kv, cache, meta, head_dim**-0.5)


def with_padding(meta: AttentionMetadata, rows: int) -> AttentionMetadata:
    """A decode batch padded with ``rows`` dummy sequences (slot -1, seq_len 0), as a
    CUDA-graph batch of fixed size has them."""
    device = meta.slot_mapping.device
    pad = lambda t, value: torch.cat(
        [t, torch.full((rows, *t.shape[1:]), value, dtype=t.dtype, device=device)]
    )
    qsl = meta.query_start_loc
    return dataclasses.replace(
        meta,
        slot_mapping=pad(meta.slot_mapping, -1),
        query_start_loc=qsl + tuple(qsl[-1] + i + 1 for i in range(rows)),
        seq_lens=meta.seq_lens + (0,) * rows,
        block_tables=pad(meta.block_tables, 0),
        seq_lens_tensor=pad(meta.seq_lens_tensor, 0),
        first_block_if_contiguous=meta.first_block_if_contiguous + (None,) * rows,
        query_start_loc_tensor=None,
    )


def bound(backend: AttentionBackend, case: Case, window=None, softcap=None) -> AttentionImpl:
    """``backend`` bound to the case's layer constants (as an attention layer binds it)."""
    heads, kv_heads, head_dim = case.q.shape[1], case.kv.shape[2], case.q.shape[2]
    return backend.bind(AttentionParams(heads, kv_heads, head_dim, case.scale, window, softcap))


def run(backend: AttentionBackend, case: Case, window=None, softcap=None, meta=None):
    """(output [T, H, D], cache after the store) of ``backend`` on a copy of the cache."""
    cache = case.cache.clone()
    out = bound(backend, case, window, softcap).forward(case.q, case.kv, cache, meta or case.meta)
    return out, cache


def reference(case: Case, window=None, softcap=None):
    """The oracle in float32, from the same (possibly bfloat16) inputs."""
    upcast = dataclasses.replace(
        case, q=case.q.float(), kv=case.kv.float(), cache=case.cache.float()
    )
    return run(REFERENCE, upcast, window, softcap)
