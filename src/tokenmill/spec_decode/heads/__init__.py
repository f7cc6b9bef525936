"""Speculative heads: small networks that draft from the target's own features.

A head runs one decoder layer over (token embedding, target feature) pairs, with its own
layer of KV in the target's paged blocks (``head_proposer.py``):

- ``eagle3.Eagle3Head``: EAGLE-3, a head folder next to its target; it reads the residual
  stream in front of three target layers (``feature_layers``);
- ``mtp.MTPHead``: a multi-token-prediction layer inside the target's own checkpoint
  (``num_nextn_predict_layers``); it reads the target's final hidden states.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.attention import StepContext
from tokenmill.kv_cache.spec import FullAttention
from tokenmill.models.config import ArchConfig


class SpecHead(Protocol):
    name: str
    config: ArchConfig
    """The head's own shape (one layer)."""
    feature_layers: tuple[int, ...]
    """Target layers whose input stream the head reads, in order; (): the final hidden."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: StepContext,
        features: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` (a module)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: StepContext,
        features: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions [T], features [T, F] -> (hidden for the logits [T, H], the feature
        the next draft position takes [T, H])."""
        ...

    def draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> the greedy draft of each row as target token ids [N]."""
        ...

    def draft_topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, H] -> its k best drafts as target ids [N, k] and their logprobs."""
        ...

    def cache_spec(self) -> FullAttention:
        """The head's one attention layer of KV."""
        ...
