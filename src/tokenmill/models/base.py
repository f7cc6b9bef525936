"""The contract every model family implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.attention import ForwardContext


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over a flattened batch of new tokens.

    Built from a Hugging Face ``config.json`` dict (``hf_config``), weights
    arrive afterwards through ``load_weights`` under Hugging Face names.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> hidden states [T, hidden_size]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32, a new tensor (the
        runner's sampler edits it in place)."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume a stream of (HF name, tensor); return the parameter names loaded."""
