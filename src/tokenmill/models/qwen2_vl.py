"""Qwen2-VL and Qwen2.5-VL: the vision tower (``qwen2_vl_vision.py``) and Qwen2's decoder
with multimodal rotary positions (M-RoPE).

The language model is the shared decoder with q/k/v biases; its rotary takes positions
[3, T] (time, height, width) and rotates each slice of ``mrope_section`` frequencies by
one axis. Text-only steps pass positions [T] (all three axes equal: plain rotary). The
runner's multimodal step (``multimodal/step.py``) puts the encoder's output over the
placeholder rows through the step context and hands over the [3, T] positions.
Checkpoints: the flat hub layout (``rope_scaling: {type: mrope}``) or transformers 5's
``text_config`` / ``vision_config``; weights ``model.*`` / ``lm_head`` and ``visual.*``
(or ``model.language_model.*`` / ``model.visual.*``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.layers.rotary import RopeTables, RotaryEmbedding
from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM, DecoderModel, DecoderSpec
from tokenmill.models.qwen2_vl_vision import VisionSpec, VisionTower
from tokenmill.models.weights import load_weights
from tokenmill.multimodal.inputs import MediaItem
from tokenmill.multimodal.model import MultiModalInfo


class MRopeDecoderModel(DecoderModel):
    """The shared trunk; positions [3, T] give each frequency slice its own axis."""

    mrope_section: tuple[int, ...] = ()

    def rope_tables(self, positions: torch.Tensor) -> dict[RotaryEmbedding, RopeTables]:
        if positions.dim() == 1:
            return super().rope_tables(positions)
        rotaries: list[RotaryEmbedding] = list(self.rotaries)  # type: ignore[arg-type]
        return {r: self._mrope(r, positions) for r in rotaries}

    def _mrope(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> RopeTables:
        """positions [3, T] -> cos/sin [T, 1, D]: column j from axis ``axis[j]``."""
        axis = _column_axes(self.mrope_section, positions.device)  # [D]
        t, d = positions.shape[1], axis.shape[0]
        pick = axis.expand(1, t, d)

        def gather(cache: torch.Tensor) -> torch.Tensor:
            rows = cache.index_select(0, positions.reshape(-1)).view(3, t, d)
            return rows.gather(0, pick)[0].unsqueeze(1)

        return RopeTables(gather(rotary.cos_cache), gather(rotary.sin_cache))


def _column_axes(section: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[D] int64: which axis (0 time, 1 height, 2 width) each cos/sin column reads; the
    sections cover D / 2 frequencies, repeated for the second half (HF's layout)."""
    half = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(section)])
    return torch.cat((half, half)).to(device)


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config (flat or ``text_config``), rope in one spelling."""
    text = dict(hf.get("text_config") or hf)
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None) or [16, 24, 24]
    if rope.get("type") == "mrope" or rope.get("rope_type") in (None, "mrope"):
        rope = {
            "rope_type": "default",
            "rope_theta": rope.get("rope_theta", text.get("rope_theta", 1e6)),
        }
    text["rope_parameters"] = rope
    text.pop("rope_scaling", None)
    text["_mrope_section"] = section
    return text


class Qwen2VLForConditionalGeneration(DecoderForCausalLM):
    """Qwen2-VL: LayerNorm / QuickGELU tower, full attention per frame."""

    decoder_model_cls = MRopeDecoderModel
    vision_generation = 2

    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        max_positions: int | None = None,
        quant: Any = None,
        ops: Any = None,
    ) -> None:
        text = _text_config(hf_config)
        super().__init__(text, dtype, max_positions, quant, ops)
        assert isinstance(self.model, MRopeDecoderModel)
        self.model.mrope_section = tuple(text["_mrope_section"])
        vision = hf_config.get("vision_config") or {}
        self.visual = VisionTower(VisionSpec.from_hf(vision, self.vision_generation), dtype)
        self.multimodal = MultiModalInfo(
            image_token_id=int(hf_config.get("image_token_id", 151655)),
            video_token_id=int(hf_config.get("video_token_id", 151656)),
            merge_size=self.visual.spec.merge_size,
            tokens_per_second=float(vision.get("tokens_per_second", 2)),
            uses_mrope=True,
        )
        """What the processor and the runner's multimodal step need (``multimodal/``)."""

    @classmethod
    def decoder_spec(cls, cfg: ArchConfig) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Processed items -> their placeholder embeddings [num_tokens, hidden] each, in one
        tower call."""
        pixels = torch.cat([it.pixel_values for it in items]).to(self.visual.inv_freq.device)  # fmt: skip
        out = self.visual(pixels, [it.grid_thw for it in items]).to(self.dtype)
        return list(out.split([it.num_tokens for it in items]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Vision tensors go to the tower as they stream by, the rest to the decoder."""
        vision: set[str] = set()

        def text_only() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for prefix in ("visual.", "model.visual."):
                    if name.startswith(prefix):
                        self.visual.load_weight(name[len(prefix) :], tensor)
                        vision.add(name[len(prefix) :])
                        break
                else:
                    yield name.replace("model.language_model.", "model.", 1), tensor

        text = nn.Module()  # the decoder's parameters only (the tower checks its own)
        text.model = self.model
        if self.lm_head is not None:
            text.lm_head = self.lm_head
        skip = ("lm_head.weight",) if self.lm_head is None else ()
        loaded = load_weights(text, text_only(), skip=skip)
        if self.visual is not None:  # None: a parallel rank that never encodes
            self.visual.check_loaded(vision)
        return loaded | {f"visual.{n}" for n in vision}


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: RMSNorm / gated-SiLU tower with window attention."""

    vision_generation = 25
