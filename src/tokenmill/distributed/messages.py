"""What the driver tells its workers, one object per broadcast (``RankGroup.broadcast``).

Per step: one ``Forward`` (the step's model inputs; each worker adds its own KV caches),
then one ``Logits`` per scoring call (the final hidden rows that sample, or prompt rows
for prompt logprobs), so the vocabulary-parallel head gathers logits of those rows only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.attention.context import InputEmbeds


@dataclass(frozen=True)
class Forward:
    input_ids: torch.Tensor
    """[T] int64."""
    positions: torch.Tensor
    """[T] int64."""
    attn: AttentionMetadata
    adapter_ids: torch.Tensor | None = None
    input_embeds: InputEmbeds | None = None


@dataclass(frozen=True)
class Logits:
    hidden: torch.Tensor
    """[N, hidden]: the rows to score (the same on every rank after the last all-reduce)."""


@dataclass(frozen=True)
class Stop:
    """Leave the loop and the process group."""


@dataclass(frozen=True)
class Ready:
    """A worker's startup report over its pipe: loaded (``error`` None) or why not."""

    rank: int
    error: str | None = None
