"""What every speculative head module starts with: its one-layer shape, dtype, kernels,
rotary table and the spec of its one layer of KV."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.kv_cache.spec import FullAttention
from tokenmill.layers.ops import Ops, select_ops
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.config import ArchConfig


class HeadModule(nn.Module):
    def __init__(
        self, hf_config: dict[str, Any], dtype: torch.dtype, max_positions: int,
        ops: Ops | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        cfg = ArchConfig.from_hf({**hf_config, "num_hidden_layers": 1})
        self.config = cfg
        self.dtype = dtype
        self.ops = ops or select_ops(torch.get_default_device(), dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, dtype, self.ops)

    def cache_spec(self) -> FullAttention:
        cfg = self.config
        return FullAttention(cfg.num_kv_heads, cfg.head_dim, self.dtype)
