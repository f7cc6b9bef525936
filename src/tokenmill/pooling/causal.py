"""A causal LM (the decoder families of ``models/``) run as a pooling model.

Embedding models of the Qwen3-Embedding kind read the hidden state of each sequence's
last token; rerankers of the Qwen3-Reranker kind read the next-token logits of two
words ("no", "yes") there: score = softmax over the two = sigmoid(yes - no). The
decoder runs unchanged over a scratch paged KV cache that one forward pass fills and
reads (causal attention within each sequence); nothing is kept between batches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.attention.context import StepContext
from tokenmill.models import resolve_model_class
from tokenmill.models.bert import PackedBatch

BLOCK_SIZE = 16


class CausalPoolingModel(nn.Module):
    """Same interface as ``models.bert.BertModel``: forward -> hidden [T, H]; classify."""

    def __init__(self, lm: Any, classifier_token_ids: tuple[int, int] | None) -> None:
        super().__init__()
        self.lm = lm
        self.hidden_size = lm.config.hidden_size
        self.max_positions = lm.config.max_position_embeddings
        self.classifier_token_ids = classifier_token_ids
        self.has_classifier = classifier_token_ids is not None
        self._caches: list[torch.Tensor] = []

    @staticmethod
    def build(
        arch: str, hf_config: dict[str, Any], weights, dtype, device, tokens
    ) -> CausalPoolingModel:
        with torch.device(device):
            lm = resolve_model_class([arch])(hf_config, dtype)
        lm.load_weights(weights)
        return CausalPoolingModel(lm.eval(), tokens)

    def forward(
        self, input_ids: torch.Tensor, batch: PackedBatch, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """-> final-norm hidden states [T, H] (segment ids are ignored)."""
        tables, next_block = [], 1  # block 0 stays unused: padding in block tables
        for n in batch.seq_lens:
            count = -(-n // BLOCK_SIZE)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        caches = self._scratch(next_block, input_ids.device)
        lens = list(batch.seq_lens)
        meta = AttentionMetadata.build(lens, lens, tables, BLOCK_SIZE, input_ids.device)
        return self.lm(input_ids, batch.positions(), StepContext(meta, caches))

    def classify(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """-> [B, 1]: logit(yes) - logit(no) at each sequence's last token."""
        assert self.classifier_token_ids is not None
        last = hidden.index_select(0, batch.starts + batch.lens - 1)
        logits = self.lm.compute_logits(last)
        no, yes = self.classifier_token_ids
        return (logits[:, yes] - logits[:, no])[:, None]

    def _scratch(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """One paged K/V tensor per layer with at least ``num_blocks`` blocks (grown, kept)."""
        if not self._caches or self._caches[0].shape[1] < num_blocks:
            lm = self.lm
            shape = (2, num_blocks, BLOCK_SIZE, lm.num_kv_heads, lm.head_dim)
            self._caches = []  # free the old ones first
            self._caches = [
                torch.empty(shape, dtype=lm.dtype, device=device) for _ in range(lm.num_layers)
            ]
        return self._caches
