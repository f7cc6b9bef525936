"""The step side of draft trees (``scheduler/draft_tree.py``): per-node attention metadata
and the move of accepted nodes' K/V."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.scheduler import ScheduledSeq
from tokenmill.scheduler.draft_tree import depths, path


def tree_attention(
    seqs: Sequence[ScheduledSeq], positions: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, AttentionMetadata]:
    """A step with draft trees -> (rotary positions [T], its attention metadata): each tree
    sequence becomes its known tokens' chunk (the root last; usually the root alone), then
    one query row per node seeing the context up to the root plus its path's stored slots
    (``extra_slots``); other sequences keep their chunk."""
    bs = meta.block_size
    qsl, lens, owners = [0], list[int](), list[int]()
    extras: list[list[int]] = []
    rope = positions.tolist()
    for i, s in enumerate(seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if not s.draft_parents:
            qsl.append(end)
            lens.append(meta.seq_lens[i])
            owners.append(i)
            extras.append([])
            continue
        table, parents = s.block_table, s.draft_parents
        root = s.end - len(parents) - 1  # the root's stored (and rotary) position
        known = end - len(parents) - start  # the chunk's known tokens, the root last
        qsl.append(start + known)  # (more than the root after a preemption's recompute)
        lens.append(root + 1)
        owners.append(i)
        extras.append([])
        for j, d in enumerate(depths(parents)):
            stored = [root + 1 + a for a in path(parents, j)]
            extras.append([table[p // bs] * bs + p % bs for p in stored])
            rope[start + known + j] = root + d
            qsl.append(start + known + 1 + j)
            lens.append(root + 1)
            owners.append(i)
    width = max(1, *(len(e) for e in extras))
    device = positions.device
    extra = torch.tensor([[*e, *(-1,) * (width - len(e))] for e in extras], dtype=torch.int64)
    index = torch.tensor(owners, device=device)
    first = meta.first_block_if_contiguous
    tree_meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping, query_start_loc=tuple(qsl), seq_lens=tuple(lens),
        block_tables=meta.block_tables.index_select(0, index), block_size=bs,
        seq_lens_tensor=torch.tensor(lens, dtype=torch.int64, device=device),
        first_block_if_contiguous=tuple(first[i] for i in owners) if first else (),
        extra_slots=extra.to(device),
    )  # fmt: skip
    return torch.tensor(rope, dtype=positions.dtype, device=device), tree_meta


def move_kv(kv_caches: Sequence[torch.Tensor | None], src: list[int], dst: list[int]) -> None:
    """Copy the K/V at cache slots ``src`` to ``dst`` in every paged layer (all sources read
    before any destination is written)."""
    if not src:
        return
    for cache in kv_caches:
        if cache is None or cache.dim() != 5:
            continue
        two, nb, bs, kvh, d = cache.shape
        flat = cache.view(two, nb * bs, kvh, d)
        index = torch.tensor(dst, device=cache.device)
        flat.index_copy_(1, index, flat.index_select(1, torch.tensor(src, device=cache.device)))
