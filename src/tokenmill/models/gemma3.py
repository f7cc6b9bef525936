"""Gemma 3 text (Gemma3ForCausalLM).

Differences from Llama, all switches of the shared decoder:
- local (sliding-window) and global layers, each with its own rope theta
  (``ArchConfig.layer_types`` / ``sliding_rope``);
- (1 + w) RMSNorms, four per layer (input, post-attention, pre- and post-feedforward);
- q/k RMSNorm, attention scale query_pre_attn_scalar ** -0.5;
- embeddings scaled by sqrt(hidden_size) rounded to the model dtype;
- GELU (tanh) MLP (from ``hidden_activation``), optional final logit soft-capping.

``Gemma3TextModel`` is the same stack as a pooling model (EmbeddingGemma).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tokenmill.attention import StepContext
from tokenmill.layers.ops import select_ops
from tokenmill.models.bert import PackedBatch
from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM, DecoderSpec
from tokenmill.pooling.attention import PackedBackend, PackedMetadata


class Gemma3ForCausalLM(DecoderForCausalLM):
    """``attn_logit_softcapping`` is not applied: Hugging Face's Gemma3 ignores it too."""

    @classmethod
    def decoder_spec(cls, cfg: ArchConfig) -> DecoderSpec:
        scalar = (
            cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim
        )
        return DecoderSpec(
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            qk_norm=True,
            sandwich_norms=True,
            norm_unit_offset=True,
            embed_scale=True,
            attn_scale=scalar**-0.5,
            final_softcap=cfg.final_logit_softcapping,
        )


class Gemma3TextModel(nn.Module):
    """Gemma3TextModel as a pooling model (EmbeddingGemma): the decoder stack above, no LM
    head, over a packed batch with no KV cache: input_ids [T] -> final-norm hidden [T, H].

    ``use_bidirectional_attention`` (transformers' flag) lets every token see its whole
    sequence; local layers then see keys with ``|q - k| < sliding_window // 2 + 1``, the
    window transformers derives for them. Without the flag attention stays causal.
    """

    has_classifier = False
    builds_in_place = True
    """Built on its device, not on meta: the rotary tables are computed at construction."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        bidirectional = bool(hf_config.get("use_bidirectional_attention"))
        cfg = {**hf_config, "use_bidirectional_attention": False, "tie_word_embeddings": True}
        if bidirectional and cfg.get("sliding_window"):
            cfg["sliding_window"] = int(cfg["sliding_window"]) // 2 + 1
        device = torch.get_default_device()
        ops = replace(select_ops(device, dtype), backend=PackedBackend(causal=not bidirectional))
        self.decoder = Gemma3ForCausalLM(cfg, dtype, ops=ops)
        self.hidden_size = self.decoder.config.hidden_size
        self.max_positions = self.decoder.config.max_position_embeddings
        # The layers' cache handles: never read (the backend keeps no cache).
        self._no_caches = [torch.empty(0, device=device)] * self.decoder.num_layers

    def forward(
        self, input_ids: torch.Tensor, batch: PackedBatch, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        ctx = StepContext(PackedMetadata.of(batch), self._no_caches)
        return self.decoder(input_ids, batch.positions(), ctx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Gemma3TextModel names (``layers.N...``, ``norm``) or Gemma3ForCausalLM ones."""
        renamed = (
            (name if name.startswith("model.") else f"model.{name}", tensor)
            for name, tensor in weights
        )
        return self.decoder.load_weights(renamed)
