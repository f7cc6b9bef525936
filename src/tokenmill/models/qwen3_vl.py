"""Qwen3-VL (dense): the vision tower (``qwen3_vl_vision.py``) and our Qwen3 decoder with
interleaved multimodal rotary positions and DeepStack.

Interleaved M-RoPE: frequency j rotates by the height axis when j % 3 == 1 (for the first
``mrope_section[1]`` such j), by the width axis when j % 3 == 2 (first
``mrope_section[2]``), else by time; text-only steps pass positions [T] (plain rotary).
DeepStack: the tower also gives L feature rows per image token (from intermediate
blocks); they reach the decoder through the step context (``InputEmbeds.deepstack``,
split by the runner's multimodal step) and are added to the residual stream at the
image rows after each of the first L layers. Videos are timestamped frame pairs, each
one item (``multimodal/qwen3_vl.py``). Weights:
``model.language_model.*`` / ``lm_head`` and ``model.visual.*`` (or ``visual.*``).
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.attention import StepContext
from tokenmill.layers.rotary import RopeTables, RotaryEmbedding
from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM, DecoderSpec
from tokenmill.models.qwen2_vl import MRopeDecoderModel, Qwen2VLForConditionalGeneration
from tokenmill.models.qwen2_vl import _text_config as _qwen_vl_text_config
from tokenmill.models.qwen3_vl_vision import Qwen3VisionTower, vision_spec
from tokenmill.multimodal.inputs import MediaItem
from tokenmill.multimodal.model import MultiModalInfo


class InterleavedMRopeDecoderModel(MRopeDecoderModel):
    """Qwen3-VL's trunk: interleaved M-RoPE columns, DeepStack rows after the first layers."""

    def _mrope(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> RopeTables:
        return interleaved_mrope(rotary, positions, self.mrope_section)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        embeds = ctx.input_embeds
        stack = None if embeds is None else embeds.deepstack  # [N, L, hidden]
        hidden = self.embed(input_ids, ctx)  # [T, hidden]
        rope = self.rope_tables(positions)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(rope, hidden, residual, ctx)
            if stack is not None and embeds is not None and i < stack.shape[1]:
                # the stream as HF sums it (residual + output), then + the features
                hidden = residual + hidden
                hidden[embeds.rows] += stack[:, i].to(hidden.dtype)
                residual = None
        if residual is None:
            return self.norm(hidden)
        return self.norm.forward_residual(hidden, residual)[0]


def interleaved_mrope(
    rotary: RotaryEmbedding, positions: torch.Tensor, section: tuple[int, ...]
) -> RopeTables:
    """positions [3, T] -> cos/sin [T, 1, D]: column j from axis ``axes[j]`` (Qwen3-VL's
    and Qwen3.5's rule; D is the rotated width, a partial rotary's too)."""
    axes = interleaved_axes(section, rotary.cos_cache.shape[1] // 2)
    t, d = positions.shape[1], 2 * axes.shape[0]
    pick = torch.cat((axes, axes)).to(positions.device).expand(1, t, d)

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache.index_select(0, positions.reshape(-1)).view(3, t, d)
        return rows.gather(0, pick)[0].unsqueeze(1)

    return RopeTables(gather(rotary.cos_cache), gather(rotary.sin_cache))


def interleaved_axes(section: tuple[int, ...], half: int) -> torch.Tensor:
    """[half] int64: the axis (0 time, 1 height, 2 width) frequency j rotates by."""
    j = torch.arange(half)
    axes = torch.zeros(half, dtype=torch.int64)
    for axis in (1, 2):
        axes[(j % 3 == axis) & (j < 3 * section[axis])] = axis
    return axes


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    text = _qwen_vl_text_config(hf)
    text["rope_parameters"] = {
        k: v for k, v in text["rope_parameters"].items() if k != "mrope_interleaved"
    }
    return text


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2-VL's loading and encoder interface over Qwen3-VL's tower and trunk."""

    decoder_model_cls = InterleavedMRopeDecoderModel

    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        max_positions: int | None = None,
        quant: Any = None,
        ops: Any = None,
    ) -> None:
        text = _text_config(hf_config)
        DecoderForCausalLM.__init__(self, text, dtype, max_positions, quant, ops)
        assert isinstance(self.model, InterleavedMRopeDecoderModel)
        self.model.mrope_section = tuple(text["_mrope_section"])
        v = hf_config.get("vision_config") or {}
        deepstack = tuple(int(i) for i in v.get("deepstack_visual_indexes", (8, 16, 24)))
        spec = vision_spec(v)
        self.visual = Qwen3VisionTower(  # type: ignore[assignment]
            spec, int(v.get("num_position_embeddings", 2304)), deepstack, dtype
        )
        self.multimodal = MultiModalInfo(
            image_token_id=int(hf_config.get("image_token_id", 151655)),
            video_token_id=int(hf_config.get("video_token_id", 151656)),
            merge_size=spec.merge_size,
            uses_mrope=True,
            processor="qwen3_vl",
            start_token_id=int(hf_config.get("vision_start_token_id", 151652)),
            end_token_id=int(hf_config.get("vision_end_token_id", 151653)),
            deepstack_layers=len(deepstack),
        )

    @classmethod
    def decoder_spec(cls, cfg: ArchConfig) -> DecoderSpec:
        return DecoderSpec(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Images -> [num_tokens, (1 + L) * hidden] each: the embedding, then the L
        DeepStack features of every token, in one tower call."""
        pixels = torch.cat([it.pixel_values for it in items]).to(self.visual.inv_freq.device)
        out, stack = self.visual(pixels, [it.grid_thw for it in items])
        rows = torch.cat((out[:, None], stack), dim=1).flatten(1).to(self.dtype)
        return list(rows.split([it.num_tokens for it in items]))
