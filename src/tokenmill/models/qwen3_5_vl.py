"""Qwen3.5 vision-language checkpoints: Qwen3-VL's vision tower in front of the Qwen3.5
hybrid language model (``qwen3_5.py``), with interleaved M-RoPE.

How transformers 5.x's ``Qwen3_5ForConditionalGeneration`` differs from Qwen3-VL's:

- Tower: Qwen3-VL's (biased patch embedding, learned position table resampled bilinearly
  with corners aligned, LayerNorm / gelu-tanh blocks with full attention per frame, the
  patch merger) **without DeepStack**: no ``deepstack_visual_indexes``, no
  ``deepstack_merger_list``; an encoder row is the merger's output only.
- Language model: the hybrid (Gated DeltaNet layers and gated full attention). Only the
  full-attention layers take positions; they rotate the first ``partial_rotary_factor *
  head_dim`` dims (64 of 256), by interleaved M-RoPE (``mrope_interleaved``) over
  ``mrope_section`` (default [11, 11, 10]: the rotated width's 32 frequencies): frequency j
  reads height when j % 3 == 1, width when j % 3 == 2 (within the section), else time.
  The DeltaNet layers see the same merged embeddings and no positions.
- Positions: ``get_rope_index`` is Qwen2-VL's with every video grid split into frames of
  t = 1 (timestamped frame pairs, as Qwen3-VL's): our ``multimodal/qwen3_vl.py`` path.
- Processor: transformers maps ``qwen3_5`` to ``Qwen3VLProcessor`` (Qwen2-VL's image
  processor, Qwen3-VL's video processor); only the token ids differ (image 248056, video
  248057, vision start / end 248053 / 248054), read from config.json.

Weights: ``model.language_model.*`` and ``lm_head`` (or tied at the top level) for the
language model, ``model.visual.*`` for the tower. Under tensor / pipeline parallelism the
driver holds the whole tower (``distributed/encoder_part.py``), the other ranks drop it.
A config without ``vision_config`` builds the language model alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.layers.ops import Ops
from tokenmill.layers.rotary import RopeTables
from tokenmill.models.qwen3_5 import HybridModel, Qwen3_5ForCausalLM
from tokenmill.models.qwen3_vl import interleaved_mrope
from tokenmill.models.qwen3_vl_vision import Qwen3VisionTower, vision_spec
from tokenmill.multimodal.inputs import MediaItem
from tokenmill.multimodal.model import MultiModalInfo

VISUAL = "model.visual."


class MRopeHybridModel(HybridModel):
    """The hybrid trunk; positions [3, T] (a step with media) rotate by interleaved M-RoPE."""

    mrope_section: tuple[int, ...] = (11, 11, 10)

    def rope_tables(self, positions: torch.Tensor) -> RopeTables:
        if positions.dim() == 1:
            return super().rope_tables(positions)
        return interleaved_mrope(self.rotary, positions, self.mrope_section)


def vl_text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config``, the top-level tie flag winning (as
    transformers ties)."""
    text = dict(hf_config.get("text_config") or hf_config)
    if "tie_word_embeddings" in hf_config:
        text["tie_word_embeddings"] = hf_config["tie_word_embeddings"]
    return text


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """Qwen3.5 with images and video: the tower's rows replace the placeholder runs (the
    runner's multimodal step), M-RoPE positions reach the attention layers."""

    weight_prefix = "model.language_model."
    model_cls = MRopeHybridModel

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype,
                 max_positions: int | None = None, quant: Any = None,
                 ops: Ops | None = None) -> None:  # fmt: skip
        super().__init__(hf_config, dtype, max_positions, quant, ops)
        rope = vl_text_config(hf_config).get("rope_parameters") or {}
        assert isinstance(self.model, MRopeHybridModel)
        # any section, as transformers: frequencies past 3 * section[axis] rotate by time
        self.model.mrope_section = tuple(int(n) for n in rope.get("mrope_section", (11, 11, 10)))
        self.visual: Qwen3VisionTower | None = None
        self.multimodal: MultiModalInfo | None = None
        """None without ``vision_config``: a text-only language model."""
        v = hf_config.get("vision_config")
        if v is None:
            return
        spec = vision_spec(v)
        self.visual = Qwen3VisionTower(spec, int(v.get("num_position_embeddings", 2304)), (), dtype)
        self.multimodal = MultiModalInfo(
            image_token_id=int(hf_config.get("image_token_id", 248056)),
            video_token_id=int(hf_config.get("video_token_id", 248057)),
            merge_size=spec.merge_size,
            uses_mrope=True,
            processor="qwen3_vl",
            start_token_id=int(hf_config.get("vision_start_token_id", 248053)),
            end_token_id=int(hf_config.get("vision_end_token_id", 248054)),
        )

    @staticmethod
    def text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
        return vl_text_config(hf_config)

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Processed images / frame pairs -> [num_tokens, hidden] each, one tower call."""
        assert self.visual is not None, "a text-only rank has no tower"
        pixels = torch.cat([it.pixel_values for it in items]).to(self.visual.inv_freq.device)
        out, _ = self.visual(pixels, [it.grid_thw for it in items])
        return list(out.to(self.dtype).split([it.num_tokens for it in items]))

    def language_part(self) -> nn.Module:
        text = nn.Module()  # the language model's parameters only (the tower checks its own)
        text.model = self.model
        if self.lm_head is not None:
            text.lm_head = self.lm_head
        return text

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tower tensors go to the tower as they stream by, the rest to the language model
        (a text-only rank drops the tower's)."""
        visual, filled = self.visual, set[str]()

        def language() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.startswith(VISUAL):
                    yield name, tensor
                elif visual is not None:
                    visual.load_weight(name[len(VISUAL) :], tensor)
                    filled.add(name[len(VISUAL) :])

        loaded = super().load_weights(language())
        if visual is None:
            return loaded
        visual.check_loaded(filled)
        return loaded | {VISUAL + n for n in filled}
