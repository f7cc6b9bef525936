"""The triton backend: K/V store and paged attention as Triton kernels (CUDA; on CPU only
under TRITON_INTERPRET=1, for tests)."""

from __future__ import annotations

import torch

from tokenmill.attention import triton_kernels
from tokenmill.attention.backends import AttentionBackend, AttentionImpl, AttentionParams
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.reference import attend


class TritonBackend(AttentionBackend):
    """Two launches per layer: ``store_kv``, then ``paged_attention`` (decode or prefill).

    An all-decode batch launches without ``query_start_loc`` and needs nothing from the
    host but shapes, so a CUDA graph can capture it; padding rows have slot -1 and
    seq_len 0 (nothing stored, output 0).
    """

    name = "triton"
    supports_cuda_graphs = True

    def bind(self, params: AttentionParams) -> AttentionImpl:
        return TritonImpl(params)


class TritonImpl(AttentionImpl):
    def forward(
        self, q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        p = self.params
        triton_kernels.store_kv(kv_cache, kv, meta.slot_mapping)
        # draft-tree nodes and bidirectional media spans: the PyTorch attention has them
        if meta.extra_slots is not None or meta.bidirectional_spans is not None:
            return attend(q, kv, kv_cache, meta, p.scale, p.sliding_window, p.softcap)
        if meta.is_all_decode:
            return triton_kernels.paged_attention(
                q, kv_cache, meta.block_tables, meta.seq_lens_tensor, p.scale, p.sliding_window,
                p.softcap,
            )  # fmt: skip
        qsl = meta.query_start_loc_tensor
        if qsl is None:  # metadata built by hand, not by AttentionMetadata.build
            qsl = torch.tensor(meta.query_start_loc, dtype=torch.int64, device=q.device)
        return triton_kernels.paged_attention(
            q, kv_cache, meta.block_tables, meta.seq_lens_tensor, p.scale, p.sliding_window,
            p.softcap, query_start_loc=qsl, max_query_len=meta.max_query_len,
        )  # fmt: skip
