"""The shared start of a hybrid model's constructor: sizes, ops, embedding and rotary."""

from __future__ import annotations

import torch

from tokenmill.layers.linear import VocabEmbedding
from tokenmill.layers.ops import Ops, select_ops
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.base import CausalLM
from tokenmill.models.config import ArchConfig


def init_trunk(
    model: CausalLM,
    cfg: ArchConfig,
    dtype: torch.dtype,
    ops: Ops | None,
    max_positions: int | None,
) -> None:
    """Set ``model``'s dtype, ops (chosen here when not given), the sizes the engine reads
    (layers, KV heads, head dim, vocabulary), its token embedding and its rotary tables."""
    model.dtype, model.ops = dtype, ops or select_ops(torch.get_default_device(), dtype)
    model.num_layers, model.num_kv_heads = cfg.num_layers, cfg.num_kv_heads
    model.head_dim, model.vocab_size = cfg.head_dim, cfg.vocab_size
    model.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
    positions = max_positions or cfg.max_position_embeddings
    model.rotary = RotaryEmbedding(cfg.head_dim, positions, cfg.rope, dtype, model.ops)
