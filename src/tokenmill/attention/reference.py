"""Pure-PyTorch paged attention: the reference backend on CPU and CUDA.

Semantics (matching Hugging Face): query token at absolute position p attends to
key positions k with k <= p and, for a sliding window w, k > p - w.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new keys/values. kv_cache [2, NB, BS, KVH, D]; k, v [T, KVH, D]; slots [T]."""
    kvh, d = kv_cache.shape[-2:]
    kv_cache[0].view(-1, kvh, d).index_copy_(0, slots, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, kvh, d).index_copy_(0, slots, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for the new tokens -> output [T, H, D].

    Writes the new K/V into the cache first, then reads each sequence's whole
    context back from its blocks.
    """
    write_kv(kv_cache, k, v, meta.slot_mapping)
    if meta.is_all_decode and softcap is None:
        return _decode_batched(q, kv_cache, meta, scale, sliding_window)
    out = torch.empty_like(q)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        out[start:end] = _attend_one(
            q[start:end], kv_cache, meta, i, scale, sliding_window, softcap
        )
    return out


def _gather(kv_cache: torch.Tensor, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence: two [length, KVH, D] tensors."""
    nb = (length + kv_cache.shape[2] - 1) // kv_cache.shape[2]
    blocks = table[:nb]
    kvh, d = kv_cache.shape[-2:]
    keys = kv_cache[0, blocks].reshape(-1, kvh, d)[:length]
    values = kv_cache[1, blocks].reshape(-1, kvh, d)[:length]
    return keys, values


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool [..., Q, K]: True where attention is allowed."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


def _attend_one(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    i: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    q_len, heads, _ = q.shape
    length = meta.seq_lens[i]
    keys, values = _gather(kv_cache, meta.block_tables[i], length)
    group = heads // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)  # [H, L, D]
    values = values.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)
    q_pos = torch.arange(length - q_len, length, device=q.device)
    k_pos = torch.arange(length, device=q.device)
    mask = _mask(q_pos, k_pos, window)
    qh = q.transpose(0, 1)  # [H, Q, D]
    if softcap is None:
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(qh, keys.transpose(1, 2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), values)
    return out.transpose(0, 1)


def _decode_batched(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """All sequences have one new token: one padded SDPA call for the batch.

    Grouped-query attention without copying K/V per head: the G query heads that
    share a KV head become G query rows of that head.
    """
    batch, heads, d = q.shape
    _, _, bs, kvh, _ = kv_cache.shape
    group = heads // kvh
    max_len = max(meta.seq_lens)
    nb = (max_len + bs - 1) // bs
    kv = kv_cache[:, meta.block_tables[:, :nb]]  # one gather: [2, B, nb, BS, KVH, D]
    kv = kv.view(2, batch, nb * bs, kvh, d).transpose(2, 3).to(q.dtype)  # [2, B, KVH, L, D]
    qg = q.view(batch, kvh, group, d)
    if batch == 1 and (window is None or max_len <= window):
        keys, values = kv[0, :, :, :max_len], kv[1, :, :, :max_len]  # every key visible: no mask
        out = F.scaled_dot_product_attention(qg, keys, values, scale=scale)
    else:
        mask = meta.decode_mask(window, nb * bs)
        out = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, d)
