"""Attention over a packed batch with no KV cache: the backend a decoder stack runs with
when it serves as a pooling model (EmbeddingGemma: Gemma3 with bidirectional attention).

Every sequence brings all of its tokens in one forward pass and nothing is stored, so
the layer's cache handle is ignored. ``causal=False`` lets each token see every token
of its sequence (within the sliding window: ``|q - k| < window``, transformers'
bidirectional window); ``causal=True`` is the usual ``q - window < k <= q``. The
packed ``[T]`` tokens are scattered into ``[B, L_max]`` for one masked SDPA call, as in
``models.bert.bidirectional_attention`` (no scatter when all lengths are equal).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate

import torch
import torch.nn.functional as F

from tokenmill.attention.backends import AttentionBackend, AttentionImpl, AttentionParams
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.bert import PackedBatch


@dataclass(frozen=True)
class PackedMetadata(AttentionMetadata):
    """A step of whole sequences and no cache: the attention metadata plus the packing."""

    packed: PackedBatch | None = None

    @staticmethod
    def of(batch: PackedBatch) -> PackedMetadata:
        """No slots and no block tables: nothing is written to or read from a cache."""
        lens, none = batch.lens, torch.empty(0, dtype=torch.int64, device=batch.lens.device)
        starts = (0, *accumulate(batch.seq_lens))
        return PackedMetadata(none, starts, batch.seq_lens, none, 1, lens, packed=batch)


class PackedImpl(AttentionImpl):
    def forward(self, q, kv, kv_cache, meta):
        """q [T, H, D], kv [T, 2, KVH, D] -> [T, H, D]; ``kv_cache`` is not touched."""
        assert isinstance(meta, PackedMetadata) and meta.packed is not None
        assert self.params.softcap is None, "attention softcap is not supported here"
        batch, p = meta.packed, self.params
        total, heads, dim = q.shape
        qkv = torch.cat([q, kv.flatten(1, 2)], 1)  # [T, H + 2 KVH, D]
        if batch.pad_index is None:
            b, length = batch.num_seqs, total // batch.num_seqs
            grid = qkv.view(b, length, heads + 2 * p.num_kv_heads, dim)
            key_mask = None
        else:
            assert batch.key_mask is not None
            b, length = batch.num_seqs, batch.key_mask.shape[-1]
            grid = qkv.new_zeros(b * length, *qkv.shape[1:])
            grid.index_copy_(0, batch.pad_index, qkv)
            grid = grid.view(b, length, *qkv.shape[1:])
            key_mask = batch.key_mask
        x = grid.transpose(1, 2)  # [B, heads, L, D]
        qh, k, v = x.split([heads, p.num_kv_heads, p.num_kv_heads], dim=1)
        mask = _combine(key_mask, _position_mask(length, p, q.device))
        out = F.scaled_dot_product_attention(
            qh, k, v, attn_mask=mask, scale=p.scale, enable_gqa=heads != p.num_kv_heads
        )
        out = out.transpose(1, 2).reshape(b * length, heads, dim)
        return out if batch.pad_index is None else out.index_select(0, batch.pad_index)


def _position_mask(length: int, p: AttentionParams, device: torch.device) -> torch.Tensor | None:
    """[L, L] bool, True where query row may see key column; None: every key."""
    window = (
        p.sliding_window if p.sliding_window is not None and p.sliding_window < length else None
    )
    if window is None and not p.causal:
        return None
    idx = torch.arange(length, device=device)
    dist = idx[:, None] - idx[None, :]  # query - key
    if not p.causal:
        return dist.abs() < window
    allowed = dist >= 0
    return allowed & (dist < window) if window is not None else allowed


def _combine(key_mask: torch.Tensor | None, band: torch.Tensor | None) -> torch.Tensor | None:
    if key_mask is None or band is None:
        return key_mask if band is None else band
    return key_mask & band


class PackedBackend(AttentionBackend):
    """Whole sequences, no cache; ``causal`` overrides the layers' own (causal) setting."""

    name = "packed"

    def __init__(self, causal: bool) -> None:
        self.causal = causal

    def bind(self, params: AttentionParams) -> AttentionImpl:
        return PackedImpl(replace(params, causal=self.causal))
