"""The one object a model forward hands to every layer (no hidden globals)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.attention.backends import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata, StateMetadata


@dataclass(frozen=True)
class InputEmbeds:
    """Embeddings that replace some token rows' table lookups (multimodal input)."""

    rows: torch.Tensor
    """[N] int64 rows of the flattened batch."""
    values: torch.Tensor
    """[N, hidden] in the model dtype."""
    deepstack: torch.Tensor | None = None
    """[N, L, hidden]: features the model adds to the same rows of its hidden states after
    each of its first L layers (Qwen3-VL's DeepStack); None: nothing past the embedding."""


@dataclass(frozen=True)
class StepContext:
    """What one step tells every layer: the batch per cache group and each layer's cache.

    Attention layers read ``attn`` and their paged tensor in ``kv_caches``; layers with a
    state slot per sequence (``kv_cache/spec.py``: recurrent state, cross-attention) read
    ``state`` and their ``[num_slots, ...]`` tensor in ``kv_caches``; every other layer
    (MLPs, norms, linears, the embedding) may read the rest. Built by the runner per step.
    """

    attn: AttentionMetadata
    """The paged attention group's metadata (every attention layer shares one block table)."""
    kv_caches: Sequence[torch.Tensor | None]
    """One cache handle per layer: a paged ``[2, num_blocks, block_size, kv_heads,
    head_dim]`` tensor, a state-slot ``[num_slots, *shape]`` tensor, or None (no cache)."""
    backend: AttentionBackend | None = None
    """None: each attention layer runs the backend it was built with (chosen once at load,
    ``layers/ops.py``). Another backend here is bound once by each layer and used from then
    on (tests comparing backends on one model)."""
    state: StateMetadata | None = None
    """The state-slot group's metadata (each sequence's slot); None without such layers."""
    adapter_ids: torch.Tensor | None = None
    """[T] int64 adapter of each token (LoRA linears read it); None: no adapters."""
    input_embeds: InputEmbeds | None = None
    """Embeddings to merge over the token lookups (multimodal); None: tokens only."""


ForwardContext = StepContext
"""The former name (attention-only context); kept for callers written against it."""
