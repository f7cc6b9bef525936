"""The contract every model family implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from tokenmill.attention import StepContext
from tokenmill.kv_cache.spec import CacheSpec, FullAttention
from tokenmill.layers.ops import Ops


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over a flattened batch of new tokens.

    Built from a Hugging Face ``config.json`` dict (``hf_config``), weights
    arrive afterwards through ``load_weights`` under Hugging Face names.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype
    """What activations and caches compute in."""
    ops: Ops
    """The kernels and attention backend its layers were built with (``layers/ops.py``)."""
    takes_quant_plan: ClassVar[bool] = True
    """False: the model builds dense layers only (a ``quant`` plan is refused), so
    ``quantization="auto"`` keeps its weights dense in the model dtype."""

    def cache_specs(self) -> list[CacheSpec]:
        """One cache spec per layer (``kv_cache/spec.py``); default: full attention."""
        spec = FullAttention(self.num_kv_heads, self.head_dim, self.dtype)
        return [spec] * self.num_layers

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> hidden states [T, hidden_size]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32, a new tensor (the
        runner's sampler edits it in place)."""

    def logits_layer(self) -> nn.Module | None:
        """The layer whose ``method.apply(layer, hidden, None)`` is ``compute_logits``
        exactly (no scaling, capping or cast after it), for a fused head and argmax
        (``sampling/greedy_head.py``); None (the default): no such layer."""
        return None

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume a stream of (HF name, tensor); return the parameter names loaded."""
