"""Encoder outputs by content hash, shared across requests, within a byte budget (LRU)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class EncoderStats:
    """Counters of the runner's multimodal step (``LLM.get_multimodal_metrics``)."""

    items: int = 0
    """Media items whose embeddings a step needed (first use per request)."""
    encoder_runs: int = 0
    """Items the encoder computed."""
    cache_hits: int = 0
    """Items served from the encoder cache."""
    encoder_seconds: float = 0.0
    evictions: int = 0


class EncoderCache:
    """hash -> embeddings [num_tokens, hidden]; least recently used out past ``budget``
    bytes. An entry larger than the budget is still returned to its caller, not kept."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def get(self, key: bytes) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: torch.Tensor, stats: EncoderStats) -> None:
        size = value.numel() * value.element_size()
        if key in self._entries or size > self.budget:
            return
        while self.used + size > self.budget:
            _, old = self._entries.popitem(last=False)
            self.used -= old.numel() * old.element_size()
            stats.evictions += 1
        self._entries[key] = value
        self.used += size

    def __len__(self) -> int:
        return len(self._entries)
