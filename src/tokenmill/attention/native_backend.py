"""The native backend: the C kernels on CPU (``tokenmill.native``), float32 only.

Rotary is fused with the K/V store (one call rotates the q and k heads of the packed qkv
projection in place and stores k, v), so a layer hands it the projection unrotated
(``forward_packed``). An all-decode step attends in one native call; prefill chunks attend
with the reference's PyTorch code over the stored cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill import native
from tokenmill.attention.backends import AttentionBackend, AttentionImpl, AttentionParams
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.reference import attend, write_kv
from tokenmill.errors import InvalidRequestError

if TYPE_CHECKING:
    from tokenmill.layers.rotary import RopeTables


class NativeBackend(AttentionBackend):
    name = "native"

    def bind(self, params: AttentionParams) -> AttentionImpl:
        if params.softcap is not None:
            raise InvalidRequestError(
                "attention_backend='native' does not soft-cap attention scores: use 'reference'"
            )
        return NativeImpl(params)


class NativeImpl(AttentionImpl):
    rotates = True

    def forward(
        self, q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q and k already rotated (the unfused contract): store, then attend."""
        p = self.params
        write_kv(kv_cache, kv, meta.slot_mapping)
        return attend(q, kv, kv_cache, meta, p.scale, p.sliding_window, p.softcap)

    def forward_packed(
        self, qkv: torch.Tensor, rope: RopeTables, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Rotary + K/V store in one call; decode attention in one call (prefill: PyTorch)."""
        p, tokens = self.params, qkv.shape[0]
        h, kvh, d = p.num_heads, p.num_kv_heads, p.head_dim
        native.rope_store_kv(qkv, h, kvh, d, rope.cos, rope.sin, kv_cache, meta.slot_mapping)
        if meta.is_all_decode:
            return native.decode_attention(
                qkv, h, kvh, d, kv_cache, meta.block_tables, meta.seq_lens_tensor,
                max(meta.seq_lens), p.scale, p.sliding_window, meta.extra_slots,
            )  # fmt: skip
        q = qkv[:, : h * d].view(tokens, h, d)
        kv = qkv[:, h * d :].view(tokens, 2, kvh, d)
        return attend(q, kv, kv_cache, meta, p.scale, p.sliding_window).reshape(tokens, h * d)
